"""``TraceCompare``: the public context manager that records a run into a trace folder."""
from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from typing import Any, ClassVar, Iterable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from tracecmp.capture.compiled import HiddenHooks
from tracecmp.capture.location import Locator
from tracecmp.capture.mode import CaptureMode
from tracecmp.capture.modules import ModuleScope, is_compiling
from tracecmp.capture.rng import DropoutOff, Rewrites
from tracecmp.capture.watch import OverflowWatch
from tracecmp.errors import CaptureError, OverflowDetected, TracecmpError
from tracecmp.overflow import Overflow, from_dict, overflow_at, to_dict
from tracecmp.seeding import last_seed_settings
from tracecmp.trace.reader import load_rank
from tracecmp.trace.writer import BackgroundWriter, RankWriter, write_run_manifest

DATA_MODES = ("stats", "tensors")
RNG_MODES = ("device", "host")
OVERFLOW_MODES = (None, "record", "raise")
_PROGRESS_ROWS = 100_000  # flushes at least this large say so on a terminal
# A step boundary hands the buffer over once it holds this much, whatever flush_secs says: chunks
# stay a few MB and the memory held for the writer stays bounded.
_HANDOVER_ROWS = 65_536
_HANDOVER_BYTES = 64 << 20  # saved tensors (data="tensors")


def _distributed() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _model_device(model: torch.nn.Module | None) -> str | None:
    if model is None:
        return None
    for tensor in (*model.parameters(), *model.buffers()):
        return str(tensor.device)
    return None


class TraceCompare:
    """Record every op of the enclosed code (forward, backward, optimizer) into a trace folder.

    ``steps`` selects the recorded steps (``None``: all); in the others nothing is installed,
    so they run at full speed. ``data="tensors"`` also saves every recorded value (safetensors);
    ``stack=True`` keeps each op's whole user stack. Give ``model`` to get parameter, buffer and
    input names and module paths as ``model.named_modules()`` spells them.

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
    recorded step starts from the same history in both runs. The run manifest records the
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
    progress, at the cost of writing on the training thread's time). A write error is raised as
    a :class:`~tracecmp.TracecmpError` by the next hand-over, :meth:`sync` or the exit of the
    context.

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
        path: str | os.PathLike[str],
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
    ) -> None:
        if data not in DATA_MODES:
            raise CaptureError(f"data must be one of {DATA_MODES}, not {data!r}")
        if rng not in RNG_MODES:
            raise CaptureError(f"rng must be one of {RNG_MODES}, not {rng!r}")
        if dropout is not None and (isinstance(dropout, bool) or dropout != 0.0):
            raise CaptureError(f"dropout must be None (leave dropout alone) or 0.0 (turn it off), not {dropout!r}")
        if overflow not in OVERFLOW_MODES:
            raise CaptureError(f"overflow must be one of {OVERFLOW_MODES}, not {overflow!r}")
        if model is not None and not isinstance(model, torch.nn.Module):
            raise CaptureError(f"model must be a torch.nn.Module, not {type(model).__name__}")
        selected: frozenset[int] | None = None
        if steps is not None:
            try:
                selected = frozenset(int(s) for s in steps)
            except (TypeError, ValueError) as exc:
                raise CaptureError(f"steps must be an iterable of step numbers or None ({exc})") from None
            if any(s < 0 for s in selected):
                raise CaptureError("steps must not be negative")
        if max_ops < 1 or max_bytes < 1:
            raise CaptureError("max_ops and max_bytes must be positive")
        if isinstance(flush_secs, bool) or not isinstance(flush_secs, (int, float)) or not 0 <= flush_secs < math.inf:
            raise CaptureError(f"flush_secs must be a number of seconds >= 0, not {flush_secs!r}")
        self.path = Path(path)
        self.model = model
        self.data = data
        self.stack = bool(stack)
        self.rng = rng
        self.dropout = None if dropout is None else 0.0
        self.overflow = overflow
        self._steps = selected
        self._max_ops = max_ops
        self._max_bytes = max_bytes
        self._step = 0
        self._used = False
        self._recording = False
        self.sync_steps = bool(sync)
        self.flush_secs = float(flush_secs)
        self._handed = 0.0  # time.monotonic() of the last hand-over (or of the start)
        self._writer: BackgroundWriter | None = None
        self._mode: CaptureMode | None = None
        self._scope: ModuleScope | None = None
        self._hooks: list[Any] = []
        self._dropout_off: DropoutOff | None = None  # the whole session, recorded steps or not
        self._unrecorded: Rewrites | None = None  # rng/dropout rewrites in steps that are not recorded
        self._overflowed = False  # an OverflowDetected was raised: the run did not finish as written
        self._hidden = HiddenHooks(self._hook_handles)  # out of Dynamo's sight while it compiles

    @property
    def current_step(self) -> int:
        """The step being run now (0 until the first :meth:`step`)."""
        return self._step

    def _selected(self, step: int) -> bool:
        return self._steps is None or step in self._steps

    # -- context -------------------------------------------------------------------------------
    def __enter__(self) -> TraceCompare:
        if TraceCompare._active is not None:
            raise CaptureError("TraceCompare sessions cannot be nested", path=TraceCompare._active.path)
        if self._used:
            raise CaptureError("this TraceCompare was already used; make a new one", path=self.path)
        self._used = True
        rank, world_size = _distributed()
        device = _model_device(self.model) or "cpu"
        options = {
            "data": self.data,
            "steps": None if self._steps is None else sorted(self._steps),
            "stack": self.stack,
            "model": type(self.model).__name__ if self.model is not None else None,
            "rng": self.rng,
            "dropout": self.dropout,
            "overflow": self.overflow,
        }
        run_info = {
            "world_size": world_size,
            "device": device,
            "seed": torch.initial_seed(),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "seed_all": last_seed_settings() or None,
            "determinism": _determinism_flags(),
        }
        if rank == 0:
            try:
                write_run_manifest(self.path, options=options, extra=run_info)
            except OSError as exc:
                raise CaptureError(f"cannot write the trace: {exc.strerror}", path=self.path) from exc
        self._writer = BackgroundWriter(
            RankWriter(self.path, rank=rank, world_size=world_size, device=device, info={"options": options})
        )
        locator = Locator()
        self._scope = ModuleScope(self.model, locator)
        self._mode = CaptureMode(
            self._scope,
            locator,
            save_data=self.data == "tensors",
            stack=self.stack,
            max_ops=self._max_ops,
            max_bytes=self._max_bytes,
            on_full=self._flush,
            host_rng=self.rng == "host",
            no_dropout=self.dropout is not None,
            watch=OverflowWatch() if self.overflow else None,
            on_overflow=self._raise_overflow if self.overflow == "raise" else None,
        )
        TraceCompare._active = self
        self._step = 0
        self._handed = time.monotonic()
        try:
            self._hidden.install()
            if self.dropout is not None:
                self._dropout_off = DropoutOff()
                self._dropout_off.__enter__()
            self._begin_step()
        except BaseException:
            self._leave_dropout_off()
            self._hidden.remove()
            TraceCompare._active = None
            raise
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        assert self._writer is not None
        try:
            try:
                self._stop()
                self._leave_dropout_off()
                self._flush()
            finally:
                # Waits for the writer thread; incomplete when the body raised or a chunk was lost.
                self._writer.close(complete=exc_type is None and not self._overflowed)
        except TracecmpError as err:
            if exc is None:
                raise
            exc.add_note(f"tracecmp: {err}")  # the body's own exception is the one to see
        finally:
            self._hidden.remove()
            TraceCompare._active = None
            self._mode = self._scope = None  # drop the weak records: dying tensors stop calling back

    def step(self) -> None:
        """Mark a step boundary: hand the buffered steps to the writer when due, then start the next step."""
        if TraceCompare._active is not self:
            raise CaptureError("step() called outside the TraceCompare context", path=self.path)
        if self._recording and not self._handover_due() and self._selected(self._step + 1):
            # Recording goes on: the mode stays entered and the hooks stay in place (removing and
            # registering them cost a small model's step ~0.1 ms). A hand-over always leaves the
            # mode first, since taking the buffers may run torch ops of its own.
            assert self._mode is not None and self._scope is not None
            self._step += 1
            self._scope.begin_step()
            self._mode.begin(self._step)
            return
        self._stop()
        if self._handover_due():
            self._flush()
        self._step += 1
        self._begin_step()

    def _handover_due(self) -> bool:
        mode = self._mode
        assert mode is not None
        return (
            self.sync_steps
            or time.monotonic() - self._handed >= self.flush_secs
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
        if TraceCompare._active is not self:
            raise CaptureError("sync() called outside the TraceCompare context", path=self.path)
        assert self._writer is not None
        self._flush()
        self._writer.wait()

    # -- recording on/off ----------------------------------------------------------------------
    def _hook_handles(self) -> list[Any]:
        return [*(self._scope.hook_handles if self._scope is not None else ()), *self._hooks]

    def _begin_step(self) -> None:
        if self._selected(self._step):
            self._start()
        elif self.rng == "host" or self.dropout is not None:
            # Unrecorded steps run at full speed except for what keeps the runs comparable.
            self._unrecorded = Rewrites(self.rng == "host", self.dropout is not None)
            self._unrecorded.__enter__()

    def _leave_dropout_off(self) -> None:
        if self._dropout_off is not None:
            self._dropout_off.__exit__(None, None, None)
            self._dropout_off = None

    def _start(self) -> None:
        assert self._mode is not None and self._scope is not None
        self._scope.install()
        self._hooks = [
            register_optimizer_step_pre_hook(self._optimizer_pre),
            register_optimizer_step_post_hook(self._optimizer_post),
        ]
        self._mode.begin(self._step)
        self._mode.__enter__()
        self._recording = True

    def _stop(self) -> None:
        if self._unrecorded is not None:
            self._unrecorded.__exit__(None, None, None)
            self._unrecorded = None
        if not self._recording:
            return
        assert self._mode is not None and self._scope is not None
        self._recording = False
        self._mode.__exit__(None, None, None)
        self._mode.settle()
        self._scope.remove()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _optimizer_pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if is_compiling():  # traced by Dynamo (a compiled optimizer step): no side effects to replay
            return
        assert self._mode is not None and self._scope is not None
        self._mode.in_optimizer = True
        self._scope.optimizers.add(optimizer)

    def _optimizer_post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if is_compiling():
            return
        assert self._mode is not None
        self._mode.in_optimizer = False

    def _flush(self) -> None:
        """Hand the buffered rows to the writer as one chunk (committed atomically on its thread)."""
        mode, writer = self._mode, self._writer
        assert mode is not None and writer is not None
        self._handed = time.monotonic()
        if mode.skipped != writer.writer.manifest["info"].get("capture_skipped", {}):
            # What was not recorded, or recorded without statistics, and why (capture/tensorkinds.py).
            writer.writer.update_info(capture_skipped=dict(mode.skipped))
        if not mode.rows and not mode.tensor_rows:
            return
        if len(mode.rows) >= _PROGRESS_ROWS and sys.stderr.isatty():
            print(f"tracecmp: writing {len(mode.rows):,} ops up to step {self._step} ...", file=sys.stderr, flush=True)
        rows, tensor_rows, saved = mode.take()
        manifest = writer.writer.manifest
        if self.model is None and manifest["device"] == "cpu":
            manifest["device"] = mode.accelerator() or "cpu"
        mode.chunk = writer.submit(rows, tensor_rows, saved or None) + 1
        watch = mode.watch
        found = watch is not None and watch.found is not None and "first_overflow" not in manifest["info"]
        if self.sync_steps or found:
            writer.wait()
        if found:
            assert watch is not None and watch.found is not None
            writer.writer.update_info(first_overflow=to_dict(self._overflow_record(watch.found)))

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
