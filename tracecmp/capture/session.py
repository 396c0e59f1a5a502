"""``TraceCompare``: the public context manager that records a run into a trace folder."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Mapping

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from tracecmp.aten.overflow import Overflow, from_dict, overflow_at, to_dict
from tracecmp.capture.compiled import HiddenHooks, RegionCapture
from tracecmp.capture.folders import default_root, default_trace_dir, rank_and_world
from tracecmp.capture.forks import drop_mode
from tracecmp.capture.loading import fetch_batches_untraced
from tracecmp.capture.location import Locator
from tracecmp.capture.mode import CaptureMode
from tracecmp.capture.modules import ModuleScope, is_compiling
from tracecmp.capture.native import announce_references
from tracecmp.capture.options import CaptureOptions
from tracecmp.capture.rng import DropoutOff, Rewrites
from tracecmp.capture.select import Selection
from tracecmp.capture.selfcheck import SelfChecker
from tracecmp.capture.watch import OverflowWatch
from tracecmp.errors import (
    CaptureError,
    CaptureWarning,
    CaptureWriteError,
    OverflowDetected,
    TracecmpError,
    TraceExistsError,
)
from tracecmp.seeding import last_seed_settings
from tracecmp.trace.reader import kept_steps, load_rank, step_ranges
from tracecmp.trace.writer import (
    BackgroundWriter,
    RankWriter,
    existing_trace,
    remove_extra_ranks,
    write_error_reason,
    write_run_manifest,
)

_PROGRESS_ROWS = 100_000  # flushes at least this large say so on a terminal
# A step boundary hands the buffer over once it holds this much, whatever flush_secs says: chunks
# stay a few MB and the memory held for the writer stays bounded.
_HANDOVER_ROWS = 65_536
_HANDOVER_BYTES = 64 << 20  # saved tensors (data="tensors")


def _ddp_module(model: torch.nn.Module | None) -> torch.nn.Module | None:
    """The DistributedDataParallel module in ``model`` (itself or a submodule), if any."""
    if model is None or not torch.distributed.is_available():
        return None
    from torch.nn.parallel import DistributedDataParallel

    return next((m for m in model.modules() if isinstance(m, DistributedDataParallel)), None)


def _model_device(model: torch.nn.Module | None) -> str | None:
    if model is None:
        return None
    for tensor in (*model.parameters(), *model.buffers()):
        return str(tensor.device)
    return None


def _rewrap_optimizer_steps() -> list[tuple[type, Any]]:
    """Put torch's step wrapper, which calls the optimizer step hooks, back around the step of
    every optimizer class it was taken from; returns (class, the step found) to restore on exit.

    torch 2.1's Dynamo, at its first compile in a process, unwraps every torch.optim optimizer's
    step and marks it as wrapped so that no optimizer wraps it again: after any ``torch.compile``
    no optimizer hook fires, and capture would record the optimizer's ops as forward ones and
    never end a step at ``optimizer.step()``. Later torch leaves the wrapper in place, and then
    this finds nothing to do. The wrapper changes no value: it names the step for the profiler
    and calls the hooks.
    """
    wrap = getattr(torch.optim.Optimizer, "profile_hook_step", None)
    if wrap is None:
        return []
    wrapper_code = wrap(lambda *args, **kwargs: None).__code__
    rewrapped = []
    todo, seen = [torch.optim.Optimizer], set()
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        todo.extend(cls.__subclasses__())
        step = cls.__dict__.get("step")
        if step is not None and getattr(step, "hooked", False) and getattr(step, "__code__", None) is not wrapper_code:
            cls.step = wrap(step)
            cls.step.hooked = True  # type: ignore[attr-defined]
            rewrapped.append((cls, step))
    return rewrapped


def _checker(opts: CaptureOptions) -> SelfChecker | None:
    """The self-checker a session's options ask for, None when they are off."""
    if opts.self_check == "off":
        return None
    # What the program declared float32 matmuls may run at ("high": TF32, "medium": bf16), on any
    # device: CPU backends may take it too (oneDNN), and a check must not fail what was allowed.
    declared = {"high": "tf32", "medium": "bf16"}.get(torch.get_float32_matmul_precision())
    return SelfChecker(
        sample=opts.self_check_sample,
        seed=opts.self_check_seed,
        full=opts.self_check == "full",
        reduced_precision=declared,
    )


class TraceCompare:
    """Record every op of the enclosed code (forward, backward, optimizer) into a trace folder.

    ``path=None`` writes to a new folder under ``$TRACECMP_DIR`` (default ``./tracecmp-traces``,
    see :mod:`tracecmp.capture.folders`) and prints where the trace went at exit. ``steps``
    selects the recorded steps (``None``: all); in the others nothing is installed, so they run at
    full speed, and once the last of them ends the trace is committed and marked complete.
    ``data="tensors"`` also saves every recorded value (safetensors); ``only`` (with
    ``data="tensors"``) saves tensors for the matching ops alone, e.g.
    ``only={"modules": ["transformer.h.3"], "steps": [1]}`` (see :mod:`tracecmp.capture.select`;
    ``CompareResult.selection()`` and ``CheckResult.selection()`` write one around their
    suspects), and every op still gets its statistics. ``stack=True`` keeps each op's whole user
    stack. Module paths, parameter and input names read as
    ``model.named_modules()`` spells them; without ``model``, the outermost modules that run are
    the model (give it when several models run side by side).

    Each ``optimizer.step()`` ends a step until the program calls :meth:`step` itself (see there);
    a run that never steps an optimizer (inference) is step 0 throughout.

    Options that change what the traced program computes, for debugging (off by default):

    * ``rng="host"``: random ops issued on an accelerator draw from the CPU generator and move
      their result to the device, so runs on different devices draw the same numbers (with the
      same seed, see :func:`tracecmp.seed_all`). CPU runs are unchanged. Costs a device-to-host
      copy of each random op's tensors.
    * ``dropout=0.0``: every dropout acts with ``p=0`` (see :mod:`tracecmp.capture.rng`).
    * ``overflow="record"``: the first op whose inputs are finite and whose outputs hold NaN/Inf
      is noted in the rank manifest (``info.first_overflow``; read it back with
      :func:`tracecmp.overflow.recorded_overflows`), from the statistics capture computes anyway.
      ``overflow="raise"``: the run stops there with :class:`~tracecmp.OverflowDetected`, after the
      trace so far is committed and marked incomplete. On accelerators raising at once costs one
      host synchronisation per op (statistics are otherwise gathered once per hand-over to the writer).

    ``rng`` and ``dropout`` hold for every step of the session, recorded or not, so that a
    recorded step starts from the same history in both runs.

    ``torch.compile``: tracing never switches compilation off, and a session knows every graph
    compiled while it is open as a region (:mod:`tracecmp.capture.compiled`). ``compiled``
    says how a recorded step runs one: ``"boundary"`` as compiled (one ``compiled.forward`` /
    ``compiled.backward`` node per call, plus what the compiled code dispatches inside; the
    step computes what it does untraced), or ``"graph"``, its AOT forward and backward graphs
    node by node with eager kernels, every node an op of the trace (inductor's graph structure
    with eager kernels: ``aot_eager``'s numbers). The run manifest records the
    options, what the last :func:`tracecmp.seed_all` set, and the determinism switches in force.

    Records reach the disk in chunks, written by a background thread so that the training thread
    only hands rows over. A step boundary hands the buffered steps over as one chunk once
    ``flush_secs`` seconds have passed since the previous hand-over (or the buffer is large), so
    short steps share a chunk instead of paying for one each, like TensorBoard's ``flush_secs``;
    ``flush_secs=0`` hands every step over as its own chunk. Everything is handed over at the exit
    of the context, at :meth:`sync`, before ``overflow="raise"`` raises, and when a step outgrows
    ``max_ops``/``max_bytes`` (it then spans several chunks). At most two chunks are in flight
    (handed over, not yet committed). A run killed at any point keeps every committed chunk and
    reads as incomplete; it loses the step in progress, the finished steps not yet handed over
    (those of the last ``flush_secs`` seconds, as of the latest :meth:`step`) and the at most two
    chunks in flight. :meth:`sync` hands over what was recorded so far and waits until it is
    committed; ``sync=True`` makes every :meth:`step` hand its step over and wait, so when
    :meth:`step` returns every finished step is on disk (a crash loses at most the step in
    progress, at the cost of writing on the training thread's time).

    A trace is never replaced silently: a folder that already holds one is refused with
    :class:`~tracecmp.TraceExistsError` unless ``overwrite=True``. A folder that cannot be
    written at the start raises :class:`~tracecmp.CaptureWriteError` at once. A write that
    fails later (a full disk, a folder turned read-only, a permission lost) stops the recording
    at the next step boundary with one :class:`~tracecmp.CaptureWarning` and the run goes on
    untouched, with nothing installed; the trace stays readable, marked incomplete with the
    reason and the last step whole on disk. ``on_error="raise"`` raises
    :class:`~tracecmp.CaptureWriteError` instead, at the failed hand-over. A session ended by an
    exception says so in the trace too (``RankTrace.stopped``: Ctrl-C, an error of the program,
    SIGTERM, which capture turns into an exception while the session runs unless the program
    handles SIGTERM itself, and then ends the process by, as it would have), and the exception
    carries a note naming the steps kept.

    A session records the process that opened it: a child forked while it runs (DataLoader
    workers) holds nothing of it and computes what it would without tracecmp.

    ``self_check="sample"`` checks each op's own computation as it runs: a few of its output
    elements (rows, for matmuls, convolutions and normalizations) computed again in float64 from
    its own inputs, against what its dtype and precision allow (:mod:`tracecmp.capture.selfcheck`;
    ``self_check_sample`` elements a call, drawn from a generator of tracecmp's own seeded by
    ``self_check_seed``, never the program's). ``"full"`` recomputes every element. A fault in an
    op's kernel is then seen with no bench at all, and where a bench run drifted far from the target.

    The keyword options, checked, are ``tc.options`` (:class:`~tracecmp.capture.options.CaptureOptions`).

    >>> import torch, tracecmp, tempfile
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> with tracecmp.TraceCompare(tempfile.mkdtemp() + "/run", model=model) as tc:
    ...     for _ in range(2):
    ...         model(torch.ones(3, 4)).sum().backward(); opt.step(); opt.zero_grad()
    ...         tc.step()
    >>> sorted(tracecmp.load(tc.path).to_frame()["phase"].unique())
    ['backward', 'forward', 'optimizer']
    """

    _active: ClassVar[TraceCompare | None] = None

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        model: torch.nn.Module | None = None,
        *,
        steps: Iterable[int] | None = None,
        data: str = "stats",
        stack: bool = False,
        max_ops: int = 200_000,
        max_bytes: int = 1 << 30,
        rng: str = "device",
        dropout: float | None = None,
        overflow: str | None = None,
        sync: bool = False,
        flush_secs: float = 1.0,
        overwrite: bool = False,
        on_error: str = "warn",
        only: Selection | Mapping[str, Any] | str | None = None,
        compiled: str = "boundary",
        self_check: str = "off",
        self_check_sample: int = 16,
        self_check_seed: int = 0,
    ) -> None:
        if model is not None and not isinstance(model, torch.nn.Module):
            raise CaptureError(f"model must be a torch.nn.Module, not {type(model).__name__}")
        self.options = CaptureOptions.of(
            steps=steps,
            data=data,
            stack=stack,
            max_ops=max_ops,
            max_bytes=max_bytes,
            rng=rng,
            dropout=dropout,
            overflow=overflow,
            sync=sync,
            flush_secs=flush_secs,
            overwrite=overwrite,
            on_error=on_error,
            only=only,
            compiled=compiled,
            self_check=self_check,
            self_check_sample=self_check_sample,
            self_check_seed=self_check_seed,
        )
        # None: a fresh folder under $TRACECMP_DIR (capture/folders.py), made when the session starts.
        self.path: Path | None = None if path is None else Path(path)
        self.auto_named = path is None
        self.announce = True  # say where an auto-named trace went, at exit
        self.model = model
        self._step = 0
        self._used = False
        self._recording = False
        self._batches_traced: Callable[[], None] | None = None  # undoes fetch_batches_untraced while recording
        self._handed = 0.0  # time.monotonic() of the last hand-over (or of the start)
        self._writer: BackgroundWriter | None = None
        self._mode: CaptureMode | None = None
        self._scope: ModuleScope | None = None
        self._hooks: list[Any] = []
        self._rewrapped: list[tuple[type, Any]] = []  # optimizer steps given back their hook wrapper
        self._dropout_off: DropoutOff | None = None  # the whole session, recorded steps or not
        self._unrecorded: Rewrites | None = None  # rng/dropout rewrites in steps that are not recorded
        self._overflowed = False  # an OverflowDetected was raised: the run did not finish as written
        self._failure: BaseException | None = None  # why the trace could not be written
        self._failure_raised = False  # on_error="raise" raised it already
        self._closed = False  # the writer has marked the rank finished
        self._last_finished: int | None = None  # the last recorded step ended by step()
        self._sigterm: Any = None  # the SIGTERM handler we replaced (SIG_DFL), while ours is in place
        self._stopped: dict[str, Any] | None = None  # the rank manifest's account of an abnormal end
        # Step boundaries: each optimizer.step() ends a step until the program calls step() itself.
        self._auto_steps = True
        self._auto_boundaries = 0  # steps ended by an optimizer.step()
        # The optimizer whose step() is running at the outermost level: a wrapper (ZeRO, a
        # lookahead) steps an inner optimizer inside its own step, which ends no step of its own.
        self._outer_optimizer: torch.optim.Optimizer | None = None
        self._finished = False  # the last selected step ended: the trace is closed and complete
        self._step_start: int | None = 0  # the buffered row where the current step begins (None: handed over)
        self._rank = 0
        self._hidden = HiddenHooks(self._hook_handles)  # out of Dynamo's sight while it compiles
        self._regions: RegionCapture | None = None  # torch.compile'd regions (capture/compiled.py)
        self._disowned = False  # this process is a child forked while the session ran (_disown)

    @property
    def current_step(self) -> int:
        """The step being run now (0 until the first :meth:`step`)."""
        return self._step

    @property
    def optimizer_steps(self) -> int:
        """How many steps an ``optimizer.step()`` ended (0 for an inference-only run)."""
        return self._auto_boundaries

    def _selected(self, step: int) -> bool:
        steps = self.options.steps
        return self._failure is None and (steps is None or step in steps)

    # -- context -------------------------------------------------------------------------------
    def __enter__(self) -> TraceCompare:
        if TraceCompare._active is not None:
            raise CaptureError("TraceCompare sessions cannot be nested", path=TraceCompare._active.path)
        if self._used:
            raise CaptureError("this TraceCompare was already used; make a new one", path=self.path)
        self._used = True
        announce_references()
        rank, world_size = rank_and_world()
        self._rank = rank
        if self.path is None:
            try:
                self.path = default_trace_dir(rank, world_size)
            except (OSError, RuntimeError) as exc:  # RuntimeError: the store timed out waiting for rank 0
                raise CaptureWriteError(f"cannot make a trace folder under {default_root()}: {exc}") from exc
        device = _model_device(self.model) or "cpu"
        opts = self.options
        options = opts.manifest(self.model)
        run_info = {
            "world_size": world_size,
            "device": device,
            "seed": torch.initial_seed(),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "seed_all": last_seed_settings() or None,
            "determinism": _determinism_flags(),
        }
        found = existing_trace(self.path, rank)
        if found is not None and not opts.overwrite:
            raise TraceExistsError(
                f"already holds a trace ({found.relative_to(self.path)}); pass overwrite=True (CLI: --force) "
                "to replace it, or choose another folder",
                path=self.path,
            )
        try:
            # Nothing is recorded yet: a folder that cannot be written is an error to fix now,
            # whatever on_error says about failures later in the run.
            if rank == 0:
                write_run_manifest(self.path, options=options, extra=run_info)
                if opts.overwrite:
                    remove_extra_ranks(self.path, world_size)
            # The intra-op thread count decides how CPU kernels split a large reduction, and so its
            # bits: replay runs at the same count to be held to them.
            rank_writer = RankWriter(
                self.path,
                rank=rank,
                world_size=world_size,
                device=device,
                info={"options": options, "threads": torch.get_num_threads()},
            )
        except (OSError, TracecmpError) as exc:
            cause = exc.__cause__ or exc if isinstance(exc, TracecmpError) else exc
            raise CaptureWriteError(_cannot_write(cause), path=self.path) from exc
        self._writer = BackgroundWriter(rank_writer)
        locator = Locator()
        self._scope = ModuleScope(self.model, locator)
        self._mode = CaptureMode(
            self._scope,
            locator,
            save_data=opts.data == "tensors",
            stack=opts.stack,
            max_ops=opts.max_ops,
            max_bytes=opts.max_bytes,
            on_full=self._flush,
            host_rng=opts.rng == "host",
            no_dropout=opts.dropout is not None,
            watch=OverflowWatch() if opts.overflow else None,
            on_overflow=self._raise_overflow if opts.overflow == "raise" else None,
            only=opts.only,
            rank=rank,
            ddp=_ddp_module(self.model),
            checker=_checker(opts),
        )
        self._regions = RegionCapture(self._mode, self._scope, locator, opts.compiled)
        TraceCompare._active = self
        self._step = 0
        self._handed = time.monotonic()
        try:
            self._hidden.install()
            self._regions.install()
            if opts.dropout is not None:
                self._dropout_off = DropoutOff()
                self._dropout_off.__enter__()
            self._catch_sigterm()
            self._rewrapped = _rewrap_optimizer_steps()
            self._hooks = [
                register_optimizer_step_pre_hook(self._optimizer_pre),
                register_optimizer_step_post_hook(self._optimizer_post),
            ]
            self._begin_step()
        except BaseException:
            self._remove_optimizer_hooks()
            self._leave_dropout_off()
            self._release_sigterm()
            self._hidden.remove()
            self._regions.remove()
            TraceCompare._active = None
            raise
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._disowned:
            return
        assert self._writer is not None
        try:
            self._release_sigterm()
            self._remove_optimizer_hooks()
            self._stop()
            self._leave_dropout_off()
            if not self._closed:
                if exc is not None and self._mode is not None:
                    self._mode.trim_unfinished()  # an interrupt may have cut an op short inside the mode
                if (
                    _stopped_by(exc, self._step, self._overflowed) is None
                    and self._auto_steps
                    and self._auto_boundaries
                ):
                    self._fold_trailing_ops()
                self._flush()
                self._close(_stopped_by(exc, self._step, self._overflowed))
            self._report_failure(raising=exc is None)
        except TracecmpError as err:
            if exc is None:
                raise
            exc.add_note(f"tracecmp: {err}")  # the body's own exception is the one to see
        finally:
            self._hidden.remove()
            if self._regions is not None:
                self._regions.remove()
            TraceCompare._active = None
            if self._mode is not None:
                self._mode.collectives.release_groups()
            self._mode = self._scope = self._regions = None  # drop the weak records: dying tensors stop calling back
        if self.auto_named and self.announce and self._rank == 0 and self._stopped is None:
            print(f"tracecmp: {self.summary()}", file=sys.stderr, flush=True)
        if exc is not None and self._stopped is not None and not isinstance(exc, (OverflowDetected, CaptureWriteError)):
            note = self._kept_note()
            if isinstance(exc, _Terminated):
                print(note, file=sys.stderr, flush=True)
                exc.die()  # as the signal would have, now that the trace says what happened
            exc.add_note(note)

    def _close(self, stopped: dict[str, Any] | None) -> None:
        """Let the writer commit what it holds and mark the rank finished (or why it stopped)."""
        assert self._writer is not None
        self._closed = True
        if self.model is None and self._scope is not None and self._scope.roots:
            self._writer.writer.manifest["info"]["models"] = list(self._scope.roots)
        failure = self._failure or self._writer.error
        if failure is not None:
            stopped = {"kind": "write-error", "reason": _cannot_write(failure), "step": self._step}
        try:
            self._stopped = self._writer.close(complete=stopped is None, stopped=stopped)
        except TracecmpError as err:  # not even the manifest could be written: it still says incomplete
            self._failure = self._failure or err.__cause__ or err
            self._stopped = {
                **(stopped or {}),
                "kind": "write-error",
                "reason": _cannot_write(self._failure),
                "last_step": self._writer.last_step,
            }

    def _kept_note(self) -> str:
        """One line: where the trace is, why it stopped, which steps it keeps."""
        why = (self._stopped or {}).get("reason", "stopped")
        return f"tracecmp: {self.path} is incomplete ({why}, in step {self._step}); it keeps {self.kept()}"

    @property
    def stopped(self) -> dict[str, Any] | None:
        """Why the session ended early (``kind``, ``reason``, ``step``, ``last_step``), as its trace says; None."""
        return self._stopped

    def kept(self) -> str:
        """Which steps the trace keeps, whole or in part, in words (as ``tracecmp inspect`` says it)."""
        steps = self._writer.writer.steps if self._writer is not None else ()
        return kept_steps(steps, self._stopped)

    def step(self) -> None:
        """Mark a step boundary: hand the buffered steps to the writer when due, then start the next step.

        Without calls to ``step()``, each ``optimizer.step()`` ends a step. The first call turns that
        off: from then on steps end here only, and a call right after an ``optimizer.step()`` that
        already ended the step ends no second one.
        """
        if self._disowned:
            return
        if TraceCompare._active is not self:
            raise CaptureError("step() called outside the TraceCompare context", path=self.path)
        if self._auto_steps:
            self._auto_steps = False
            if self._auto_boundaries:
                return  # the optimizer.step() before this call ended the step already
        self._boundary()

    def _boundary(self) -> None:
        """End the current step and start the next (recorded or not)."""
        assert self._writer is not None
        if self._finished:
            self._step += 1
            self._stop()
            self._begin_step()
            return
        if self._writer.error is not None or self._failure is not None:
            self._give_up()  # the trace cannot be written: stop recording (warn, or raise)
        if self._recording:
            self._last_finished = self._step
        if self._recording and not self._handover_due() and self._selected(self._step + 1):
            # Recording goes on: the mode stays entered and the hooks stay in place (removing and
            # registering them cost a small model's step ~0.1 ms). A hand-over always leaves the
            # mode first, since taking the buffers may run torch ops of its own.
            assert self._mode is not None and self._scope is not None
            self._step += 1
            self._step_start = len(self._mode.rows)
            self._scope.begin_step()
            self._mode.begin(self._step)
            return
        self._stop()
        if self._handover_due():
            self._flush()
        self._step += 1
        self._step_start = len(self._mode.rows) if self._mode is not None else None
        steps = self.options.steps
        finishing = steps is not None and self._step > max(steps, default=-1) and not self._closed
        if finishing:
            self._finish()
        self._begin_step()
        if finishing:
            self._after_last_step()

    def _finish(self) -> None:
        """The last selected step ended: commit the trace and mark it complete now, so that nothing
        the program does afterwards (a crash, a kill) can take that from it."""
        self._flush()
        self._close(None)
        self._release_sigterm()
        self._finished = True
        self._report_failure(raising=True)

    def _after_last_step(self) -> None:
        """Called once the trace is complete, before the next step begins (``tracecmp record`` ends
        its session here)."""

    def summary(self) -> str:
        """Where the trace went and what it holds, in one line (printed at exit for auto-named folders)."""
        writer = self._writer
        if writer is None:
            return f"{self.path}: nothing recorded yet"
        steps = sorted(writer.writer.steps)
        held = f"steps {step_ranges(steps)}" if steps else "no step"
        if self._auto_steps and not self._auto_boundaries and steps:
            held += " (no optimizer.step() ran, so everything is step 0, as in an inference-only run)"
        return f"trace written to {self.path}, {held}; see `tracecmp inspect {self.path}`"

    def _fold_trailing_ops(self) -> None:
        """After the last optimizer.step(), ops outside any module (``loss.item()``, a detach for
        logging) belong to that step: they would otherwise make a step of their own at the end."""
        mode, start = self._mode, self._step_start
        if mode is None or start is None or not self._step or not self._selected(self._step - 1):
            return
        rows = mode.rows
        if len(rows) <= start or any(rows.values("module", start)):
            return
        for index in range(start, len(rows)):
            rows.set(index, "step", self._step - 1)
        self._step -= 1

    def _handover_due(self) -> bool:
        mode = self._mode
        assert mode is not None
        return (
            self.options.sync
            or time.monotonic() - self._handed >= self.options.flush_secs
            or len(mode.rows) >= _HANDOVER_ROWS
            or mode.saved_bytes >= _HANDOVER_BYTES
        )

    def sync(self) -> None:
        """Hand over everything recorded so far and wait until it is committed on disk.

        Called between steps, every finished step is then on disk; called inside a step, the
        part of the step recorded so far is too (the rest follows in a later chunk).

        >>> import torch, tracecmp, tempfile
        >>> with tracecmp.TraceCompare(tempfile.mkdtemp() + "/run") as tc:
        ...     _ = torch.ones(2) * 2
        ...     tc.step(); tc.sync()
        ...     tracecmp.load(tc.path).to_frame()["step"].unique().tolist()
        [0]
        """
        if self._disowned:
            return
        if TraceCompare._active is not self:
            raise CaptureError("sync() called outside the TraceCompare context", path=self.path)
        assert self._writer is not None
        if self._closed:
            return
        self._flush()
        if self._failure is None:
            try:
                self._writer.wait()
            except TracecmpError as err:
                self._failure = err.__cause__ or err
        if self._failure is not None:
            self._give_up()

    # -- recording on/off ----------------------------------------------------------------------
    def _hook_handles(self) -> list[Any]:
        return [*(self._scope.hook_handles if self._scope is not None else ()), *self._hooks]

    def _begin_step(self) -> None:
        if self._selected(self._step):
            self._start()
        elif self.options.rng == "host" or self.options.dropout is not None:
            # Unrecorded steps run at full speed except for what keeps the runs comparable.
            self._unrecorded = Rewrites(self.options.rng == "host", self.options.dropout is not None)
            self._unrecorded.__enter__()

    def _leave_dropout_off(self) -> None:
        if self._dropout_off is not None:
            self._dropout_off.__exit__(None, None, None)
            self._dropout_off = None

    def _start(self) -> None:
        assert self._mode is not None and self._scope is not None
        self._scope.install()
        self._mode.begin(self._step)
        self._mode.__enter__()
        self._batches_traced = fetch_batches_untraced()
        self._recording = True
        if self._regions is not None:
            self._regions.recording = True

    def _stop(self) -> None:
        if self._unrecorded is not None:
            self._unrecorded.__exit__(None, None, None)
            self._unrecorded = None
        if not self._recording:
            return
        assert self._mode is not None and self._scope is not None
        self._recording = False
        if self._batches_traced is not None:
            self._batches_traced()
            self._batches_traced = None
        if self._regions is not None:
            self._regions.recording = False
        self._mode.__exit__(None, None, None)
        self._mode.settle()
        self._scope.remove()

    def _disown(self) -> None:
        """In a child forked while this session runs: leave nothing of it in force.

        The child computes what it would without tracecmp, records and writes nothing, and never
        waits for the writer, whose thread is not there; the trace is the parent's to finish.
        :meth:`step`, :meth:`sync` and the exit of the context do nothing in the child.
        """
        TraceCompare._active = None
        self._disowned = True
        for mode in (self._mode, self._unrecorded, self._dropout_off):
            if mode is not None:
                drop_mode(mode)  # entered or not, wherever it stands on the forking thread's stack
        if self._scope is not None:
            self._scope.remove()
        if self._batches_traced is not None:
            self._batches_traced()
        self._remove_optimizer_hooks()
        self._release_sigterm()
        self._hidden.remove()
        if self._regions is not None:
            self._regions.remove()
        self._recording = False
        # The buffers and the writer are the parent's: dropped, never handed over or closed here.
        self._mode = self._scope = self._regions = self._writer = None
        self._unrecorded = self._dropout_off = None

    # -- optimizer steps: the optimizer phase, and step boundaries when step() is never called --
    def _optimizer_pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if is_compiling():  # traced by Dynamo (a compiled optimizer step): no side effects to replay
            return
        if TraceCompare._active is not self:
            return
        if self._outer_optimizer is None or optimizer is self._outer_optimizer:
            self._outer_optimizer = optimizer  # (the same optimizer again: its last step raised)
        if self._recording:
            assert self._mode is not None and self._scope is not None
            self._mode.in_optimizer = True
            self._scope.optimizers.add(optimizer)

    def _optimizer_post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if is_compiling() or TraceCompare._active is not self:
            return  # traced by Dynamo, or a hook that could not be removed yet (see _remove_optimizer_hooks)
        if optimizer is not self._outer_optimizer:
            return  # an inner optimizer of a wrapper: the step ends with the outer one
        self._outer_optimizer = None
        if self._recording:
            assert self._mode is not None
            self._mode.in_optimizer = False
        if self._auto_steps:
            self._auto_boundaries += 1
            _IN_OPTIMIZER_HOOK[0] += 1
            try:
                self._boundary()
            finally:
                _IN_OPTIMIZER_HOOK[0] -= 1

    def _remove_optimizer_hooks(self) -> None:
        """Remove the optimizer hooks, or, inside one (torch is iterating over them), leave them
        inert until a later session can remove them."""
        if _IN_OPTIMIZER_HOOK[0]:
            _INERT_HOOKS.extend(self._hooks)
        else:
            for handle in (*self._hooks, *_INERT_HOOKS):
                handle.remove()
            _INERT_HOOKS.clear()
        self._hooks = []
        for cls, step in self._rewrapped:
            cls.step = step
        self._rewrapped = []

    def _flush(self) -> None:
        """Hand the buffered rows to the writer as one chunk (committed atomically on its thread)."""
        mode, writer = self._mode, self._writer
        assert mode is not None and writer is not None
        self._handed = time.monotonic()
        self._step_start = None
        if not mode.rows and not mode.tensor_rows:
            self._update_info()
            return
        if self._failure is not None:
            mode.take()  # the trace cannot take them: drop them, memory stays bounded
            if self._regions is not None:
                self._regions.take()
            return
        if len(mode.rows) >= _PROGRESS_ROWS and sys.stderr.isatty():
            print(f"tracecmp: writing {len(mode.rows):,} ops up to step {self._step} ...", file=sys.stderr, flush=True)
        rows, tensor_rows, saved, checks = mode.take()
        compiled = self._regions.take() if self._regions is not None else None
        manifest = writer.writer.manifest
        if self.model is None and manifest["device"] == "cpu":
            manifest["device"] = mode.accelerator() or "cpu"
        try:
            mode.chunk = writer.submit(rows, tensor_rows, saved or None, compiled, self._last_finished, checks) + 1
            self._update_info()
            watch = mode.watch
            found = watch is not None and watch.found is not None and "first_overflow" not in manifest["info"]
            if self.options.sync or found:
                writer.wait()
            if found:
                assert watch is not None and watch.found is not None
                writer.writer.update_info(first_overflow=to_dict(self._overflow_record(watch.found)))
        except (TracecmpError, OSError) as err:
            self._write_failed(err)

    def _write_failed(self, err: BaseException) -> None:
        """Note a failed write. Called inside an op (a full buffer) as well as between steps, so
        recording stops at the next step boundary; on_error="raise" raises at once."""
        self._failure = err.__cause__ or err if isinstance(err, TracecmpError) else err
        if self.options.on_error == "raise" and not self._failure_raised:
            self._failure_raised = True
            raise CaptureWriteError(
                f"{_cannot_write(self._failure)}; recording stopped", path=self.path
            ) from self._failure

    # -- when the trace cannot be written -------------------------------------------------------
    def _give_up(self) -> None:
        """Stop recording for good after a write failure: the run goes on with nothing installed.

        The rank manifest (if it can still be written) says why and which steps are whole on
        disk. Warns once with :class:`CaptureWarning`, or raises :class:`CaptureWriteError` with
        ``on_error="raise"``.
        """
        assert self._writer is not None
        if self._failure is None:
            self._failure = self._writer.error
        if self._closed:
            return
        self._stop()
        if self._mode is not None and (self._mode.rows or self._mode.tensor_rows):
            self._mode.take()
        self._close(None)
        self._report_failure(raising=True)
        if self._unrecorded is None and (self.options.rng == "host" or self.options.dropout is not None):
            # What keeps the runs comparable stays on for the rest of the session, as in unrecorded steps.
            self._unrecorded = Rewrites(self.options.rng == "host", self.options.dropout is not None)
            self._unrecorded.__enter__()

    def _report_failure(self, *, raising: bool) -> None:
        """Warn (or with on_error="raise" and ``raising``, raise) once about a write failure."""
        if self._failure is None or self._failure_raised:
            return
        self._failure_raised = True
        message = (
            f"{_cannot_write(self._failure)}; recording stopped in step {self._step} "
            f"and the run goes on. The trace keeps {self.kept()} and is marked incomplete"
        )
        if self.options.on_error == "raise" and raising:
            raise CaptureWriteError(message, path=self.path) from self._failure
        warnings.warn(f"tracecmp: {self.path}: {message}", CaptureWarning, stacklevel=4)

    # -- SIGTERM (an elastic agent stopping the job) ------------------------------------------
    def _catch_sigterm(self) -> None:
        """Turn SIGTERM into an exception while the session runs, so the trace can say it was
        terminated; left alone when the program handles SIGTERM itself or runs on another thread."""
        if threading.current_thread() is not threading.main_thread():
            return
        try:
            if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
                return
            _SESSION_PID[0] = os.getpid()
            signal.signal(signal.SIGTERM, _raise_terminated)
        except (ValueError, OSError):  # no signals here (an embedded interpreter)
            return
        self._sigterm = signal.SIG_DFL

    def _release_sigterm(self) -> None:
        if self._sigterm is None:
            return
        try:
            if signal.getsignal(signal.SIGTERM) is _raise_terminated:
                signal.signal(signal.SIGTERM, self._sigterm)
        except (ValueError, OSError):
            pass
        self._sigterm = None

    def _update_info(self) -> None:
        """Note in the rank manifest what capture learnt that the tables do not say, when it changed:
        what was skipped and why (capture/tensorkinds.py), the process groups collectives used,
        the parameters of each DDP bucket (capture/collectives.py), what capture could not see of
        compiled regions (capture/compiled.py)."""
        mode, writer = self._mode, self._writer
        assert mode is not None and writer is not None
        info = writer.writer.manifest["info"]
        news = {
            key: value
            for key, value in (
                ("capture_skipped", dict(mode.skipped)),
                ("process_groups", dict(mode.collectives.process_groups)),
                ("ddp_buckets", mode.collectives.ddp_buckets),
                ("compiled_notes", list(self._regions.notes) if self._regions is not None else []),
            )
            if value and info.get(key) != value
        }
        if news and self._failure is None:
            try:
                writer.writer.update_info(**news)
            except OSError as err:
                self._write_failed(err)

    def _overflow_record(self, op_id: int) -> Overflow:
        """The overflow at ``op_id``, described from the committed chunks as ``tracecmp overflow`` would."""
        assert self._writer is not None
        return overflow_at(load_rank(self._writer.writer.dir), op_id)

    def _raise_overflow(self) -> None:
        """``overflow="raise"``: commit the trace so far, note the overflow, stop the run."""
        assert self._mode is not None and self._mode.watch is not None and self._mode.watch.found is not None
        self._flush()
        self._overflowed = True
        assert self._writer is not None
        raise OverflowDetected(from_dict(self._writer.writer.manifest["info"]["first_overflow"]), path=self.path)


def _determinism_flags() -> dict[str, Any]:
    """The switches that decide whether two runs can be bitwise identical, as they are now."""
    return {
        "torch_deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        # Whether float32 matmul/conv may run at reduced precision (TF32, HF32, bf16x3): compare
        # allows that rounding only where a run could have used it.
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cuda_matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
    }


# Optimizer hooks cannot be removed while torch iterates over them (in a hook): they stay, inert
# (their session is no longer active), and go when a later session starts or ends.
_IN_OPTIMIZER_HOOK = [0]
_INERT_HOOKS: list[Any] = []


def _disown_after_fork() -> None:
    """In a child forked while a session runs: see :meth:`TraceCompare._disown`."""
    session = TraceCompare._active
    if session is not None:
        session._disown()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_disown_after_fork)


class _Terminated(BaseException):
    """SIGTERM arrived during a session: unwinds the program like KeyboardInterrupt does, then
    ends the process by the same signal once the trace says so (see :meth:`die`)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"terminated by {signal.Signals(signum).name}")

    def die(self) -> None:
        """End the process by this signal with its default action, as it would have without tracecmp."""
        signal.signal(self.signum, signal.SIG_DFL)
        signal.raise_signal(self.signum)


_SESSION_PID: list[int] = [0]  # the process whose session installed the handler


def _raise_terminated(signum: int, frame: Any) -> None:
    if os.getpid() != _SESSION_PID[0]:
        # A child forked during the session (multiprocessing) holds no session: die as it would have.
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)
        return
    raise _Terminated(signum)


def _cannot_write(exc: BaseException) -> str:
    return f"cannot write the trace: {write_error_reason(exc)}"


def _stopped_by(exc: BaseException | None, step: int, overflowed: bool) -> dict[str, Any] | None:
    """The rank manifest's account of why a session ended abnormally (None: it ended normally)."""
    if overflowed or isinstance(exc, OverflowDetected):
        return {"kind": "overflow", "reason": 'stopped at the first overflow (overflow="raise")', "step": step}
    if exc is None or (isinstance(exc, SystemExit) and exc.code in (None, 0)):
        return None
    if isinstance(exc, KeyboardInterrupt):
        kind, reason = "interrupted", "interrupted by the user (KeyboardInterrupt)"
    elif isinstance(exc, _Terminated):
        kind, reason = "terminated", str(exc)
    elif isinstance(exc, SystemExit):
        kind, reason = "exit", f"the program exited with status {exc.code!r}"
    elif isinstance(exc, CaptureWriteError):
        return None  # the writer's own account (write-error) says it better
    else:
        text = " ".join(str(exc).split())
        text = text if len(text) <= 200 else text[:197] + "..."
        kind, reason = "error", f"the program raised {type(exc).__name__}" + (f": {text}" if text else "")
    return {"kind": kind, "reason": reason, "step": step}
