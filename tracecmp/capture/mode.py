"""The private TorchDispatchMode that records every dispatched op (behind :class:`TraceCompare`).

Per op it appends one row (``OPS_SCHEMA`` column order) and one row per produced tensor value
(``TENSORS_SCHEMA`` order) to :class:`~tracecmp.trace.columns.Columns` buffers, an array of raw
numbers or a list of strings per column, which the writer's thread turns into Arrow tables. Rows hold ids, strings and numbers,
never tensors, and make no Python object of their own (see ``columns.py``: objects per row
would feed the garbage collector's full collections).

Tensor identity (which value an input is: ids, versions, view families) is its own object,
:class:`~tracecmp.capture.identity.TensorIds` (``mode.ids``); collectives are recorded with the
help of a :class:`~tracecmp.capture.collectives.CollectiveRecorder` (``mode.collectives``).

The per-op path below is the reference; ``csrc/record*.cpp`` (``tracecmp._crecord``, bound in
:mod:`tracecmp.capture.native`) does the same steps in C on the same objects and is bound to each
mode unless ``TRACECMP_FORCE_REFERENCE=1`` (see csrc/README.md). Its rows are equal to the
reference's (``tests/integration/test_native_capture.py``).

An input whose ``_version`` moved since it was recorded was written by something the trace did
not see, *unless* the write went through another alias: views share their base's version
counter, so every tensor carries its *group* (view family) and each recorded write notes the
group's new version. When the recorded writes to an input's group account for every step its
counter moved since capture last saw it (``TensorIds.accounted``), capture emits an
``alias.update`` node (kind ``view``) whose inputs are the tensor's previous value and the values
written since, and whose output is its new value, with statistics. Otherwise the input becomes a
*source* node named after what it is (parameter, buffer, root-model input, gradient, optimizer
state, or unnamed ``source.tensor``).

Only plain dense strided tensors with storage reach the statistics kernel; ops on tensor
subclasses (DTensor, FakeTensor ...) are unwrapped or passed through (``tensorkinds.py``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import types
from typing import Any, Callable, Iterable

import torch
from torch._C import _current_autograd_node
from torch._C._autograd import _get_sequence_nr
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from tracecmp.aten.schema import BUFFER, FRESH, ONE_FRESH, SCRATCH, VIEW, WRITE, OpInfo, arg_value, op_info
from tracecmp.aten.schema import OP_INFOS as _OP_INFOS
from tracecmp.capture import native
from tracecmp.capture import stats as _stats
from tracecmp.capture.collectives import CollectiveRecorder, signature
from tracecmp.capture.identity import TensorIds, TensorRef
from tracecmp.capture.location import Locator
from tracecmp.capture.modules import ModuleScope
from tracecmp.capture.rng import rewrite
from tracecmp.capture.select import Selection
from tracecmp.capture.selfcheck import RECIPE_KINDS, SEEN_BEFORE, SEEN_ONCE, Check, Plan, Recipe, SelfChecker
from tracecmp.capture.stats import stats_tensor_reference, tensor_stats_row, unpack_stats
from tracecmp.capture.tensorkinds import PLAIN_TYPES, STRIDED, TRACED_OP, dims, traced_op, unreadable
from tracecmp.capture.watch import OverflowWatch
from tracecmp.trace.args import TENSOR_MARK, ArgsEncoder, scan, scan_value
from tracecmp.trace.columns import Columns
from tracecmp.trace.schema import (
    ALIAS_UPDATE_OP,
    CHECKS_SCHEMA,
    OPS_SCHEMA,
    STAT_COLUMNS,
    TENSORS_SCHEMA,
    UNREAD_SOURCE,
)

_NO_STATS = (None,) * 7
# -1 outside a backward; torch without it never tells backward's final callbacks apart.
_current_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)
_NOT_AN_OP = (False, False, -1)  # inplace, random, seq_nr of source and alias.update nodes
_SEQ_NONE = 1 << 63  # engine nodes such as AccumulateGrad carry UINT64_MAX, not a sequence number
_is_grad_enabled = torch.is_grad_enabled
_is_inference_mode_enabled = torch.is_inference_mode_enabled
_get_num_threads = torch.get_num_threads
_Tensor = torch.Tensor
# The C++ kernel called as tensor_stats_row would, minus the attribute reads _value already made.
_NATIVE_CODES = _stats._NATIVE_CODES
_PARALLEL_MIN = _stats._PARALLEL_MIN
_CPU_DEVICE = ("cpu", 0)
_dispatch_stack_len = torch._C._len_torch_dispatch_stack
_NOTHING = contextlib.nullcontext()  # in place of _disable_current_modes() where no mode is below
_RECORD = object()  # _not_plain's answer for an op to record as usual

# Device kinds: statistics now (CPU), statistics gathered at flush (accelerators), none (meta).
_CPU, _DEFERRED, _NONE = 0, 1, 2


def _write_only(info: OpInfo, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors an op only writes (its ``out=`` arguments)."""
    found: list[torch.Tensor] = []
    for name in info.write_only:
        value = kwargs.get(name)
        if isinstance(value, _Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, _Tensor))
    return found


def _among(t: torch.Tensor, tensors: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> bool:
    for other in tensors:
        if other is t:
            return True
    return False


# A signature's recipe before its calls taught it (CaptureMode._sample_before).
_UNLEARNED = object()


def _place(out: Any, index: int) -> int:
    """Where output ``index`` of an op's returned ``out`` lies among its tensors (a check row's
    index: None outputs are not recorded); 0 for an op that returns one tensor (index -1)."""
    return sum(o is not None for o in out[:index]) if index > 0 else 0


class CaptureMode(TorchDispatchMode):
    """Records ops into row buffers; :meth:`take` hands them over as columns for one chunk."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # A mode that says False makes Dynamo skip every frame while it is active, and a module
        # first called then stays uncompiled after the mode exits: the traced program would not
        # be the user's. With True, compilation is untouched and the mode sees what compiled
        # code dispatches at run time (capture/compiled.py records the regions themselves).
        return True

    def __init__(
        self,
        scope: ModuleScope,
        locator: Locator,
        *,
        save_data: bool,
        stack: bool,
        max_ops: int,
        max_bytes: int,
        on_full: Callable[[], None],
        host_rng: bool = False,
        no_dropout: bool = False,
        watch: OverflowWatch | None = None,
        on_overflow: Callable[[], None] | None = None,
        only: Selection | None = None,
        rank: int = 0,
        ddp: torch.nn.Module | None = None,
        checker: SelfChecker | None = None,
    ) -> None:
        super().__init__()
        self.ids = TensorIds()
        self.collectives = CollectiveRecorder(self.ids, self._fill, self._skip, rank, ddp)
        self.scope = scope
        self.step = 0
        self.chunk = 0  # index of the chunk being filled (names saved tensors "<chunk>/<id>")
        self.in_optimizer = False
        self.rows = Columns(OPS_SCHEMA, number_array=native.NUMBER_ARRAY)
        self.tensor_rows = Columns(TENSORS_SCHEMA, number_array=native.NUMBER_ARRAY)
        # Self-checks (capture/selfcheck.py): rows of the ops checked, None when they are off.
        self._checker = checker
        self.check_rows = Columns(CHECKS_SCHEMA) if checker is not None else None
        self._pending_checks: list[tuple[int, str, torch.Tensor]] = []  # (check row, column, value on the device)
        # Deferred checks (recomputed with their calls alike at take): check rows, in ticket order
        self._deferred_rows: list[int] = []
        self.saved: dict[str, torch.Tensor] = {}
        self.saved_bytes = 0
        self.devices: dict[torch.device, tuple[str, int]] = {}
        self._locator = locator
        self._save_data = save_data
        # only= (capture/select.py): tensors are saved for the selected ops alone, their inputs
        # included (saved when the op runs if nothing saved them before: ``_saved_ids``).
        self._only = only if save_data else None
        self._saving = save_data
        self._saved_ids: set[int] = set()
        self._stack = stack
        self._max_ops = max_ops
        self._max_bytes = max_bytes
        self._on_full = on_full
        # The per-op path pays for the options below only when they are on: one test of a flag
        # before the call, and the end-of-op check it already makes (a limit of 0 rows sends
        # every op to _after_op when overflow="raise" must look at each one).
        self._plain = not (host_rng or no_dropout)
        self._host_rng = host_rng
        self._no_dropout = no_dropout
        self.watch = watch
        self._on_overflow = on_overflow
        self._row_limit = 0 if on_overflow is not None else max_ops
        self._on_limit = self._after_op if on_overflow is not None else on_full
        self._next_op = 0
        self._pending: list[tuple[int, torch.Tensor]] = []  # (tensor row, packed stats on the device)
        self._dtypes: dict[torch.dtype, str] = {}
        self._args = ArgsEncoder()
        self._args_memo = self._args.memo
        # What was not recorded, or recorded without statistics, and why: reason -> count.
        self.skipped: dict[str, int] = {}
        # The checker's kinds (op -> its check, None: unchecked): the C path leaves an op not yet
        # classified to the reference below, and checks a checked one around the call.
        self._check_kinds = checker.kinds if checker is not None else None
        if _crecord is not None and USE_NATIVE and self._only is None:  # the C path knows no only=: Python's call
            # The C copy of __torch_dispatch__ (csrc/record_dispatch.cpp), bound to this mode:
            # torch looks the method up on the instance, so it shadows the reference below, which
            # it calls for the ops it does not handle itself.
            self.__torch_dispatch__ = types.MethodType(_crecord.dispatch, self)  # type: ignore[method-assign]
            self.ids.forget_cb = functools.partial(_crecord.forget, self.ids.known)

    # -- the per-op path -----------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if kwargs is None:
            kwargs = {}
        if types or _dispatch_stack_len():
            # A tensor subclass, or another mode below this one (tensorkinds.py says what is done).
            handled = self._not_plain(func, types, args, kwargs)
            if handled is not _RECORD:
                return handled
        ids = self.ids
        if ids.unsettled:
            self.settle()
        info = _OP_INFOS.get(id(func)) or op_info(func)
        if not info.record:
            return func(*args, **kwargs)
        if info.collective:
            return self._collective(func, info, args, kwargs)
        call = func
        if not self._plain and info.rewritable:
            # The rewritten arguments are what the trace records (a ``p`` of 0.0, say), so a
            # comparison with a run that kept its dropout names the difference.
            call, args, kwargs = rewrite(info, func, args, kwargs, self._host_rng, self._no_dropout)
        tensors: list[torch.Tensor] = []
        key = scan(args, kwargs, tensors)
        scope = self.scope
        node = _current_autograd_node()
        if node is None:
            phase, module = self._unnoded_context(tensors)
            location = self._locator.location(1)
            seq = -1
        else:
            phase = "backward"
            module, location, seq = self._backward_context(node)
        forward = node is None or scope.depth  # on the thread whose sequence numbers we follow
        if forward and tensors and _is_grad_enabled():
            newest = _get_sequence_nr() - 1
            if newest >= scope.claim_floor:
                for t in tensors:
                    if t.requires_grad:
                        # A node was made since the previous op returned: this op's (modules.py).
                        scope.seq_info[newest] = (module, location)
                        scope.claims += 1
                        if node is None:
                            seq = newest
                        break
        stack = self._locator.stack(1) if self._stack else ""
        known = ids.known
        inputs: list[int] = []
        only = self._only
        if only is not None:
            self._saving = only.matches(self.step, phase, module, info.name)
        unread = _write_only(info, kwargs) if info.write_only else ()
        for t in tensors:
            rec = known.get(id(t))
            if rec is not None and rec() is t and (rec.version is None or rec.version == t._version):
                inputs.append(rec.tid)
                if only is not None and self._saving and rec.tid not in self._saved_ids and unreadable(t) is None:
                    self._save(t, rec.tid)  # made outside the selection: a replay of this op needs it
            else:
                inputs.append(self._enter(t, rec, phase, module, location, stack, unread=_among(t, unread)))
        if self.collectives.awaited_groups:  # reads a collective's output: it completed (collectives.py)
            self.collectives.complete_inputs(info, args, kwargs, tensors)
        # Before the call: an in-place op overwrites the inputs its check recomputes from.
        plan = sampled = recipe = signature = None
        if self._checker is not None and call is func:
            signature, recipe, sampled = self._sample_before(func, key, tensors)
            if sampled is None:
                plan = self._check_before(func, args, kwargs)
        out = call(*args, **kwargs)
        if forward:
            scope.claim_floor = _get_sequence_nr()
        op_id = self._next_op
        self._next_op = op_id + 1
        fresh = info.returns is ONE_FRESH and isinstance(out, _Tensor)
        if fresh:
            for t in tensors:
                if t is out:  # returned an input its schema calls new (see _outputs)
                    fresh = False
                    break
        if fresh:  # most ops: one new tensor, recorded here without the general walk's calls
            tid = ids.fresh(out)
            if info.uninitialized:
                self._bare(out, tid, op_id, 0, -1)
            else:
                self._value(out, tid, op_id, 0, -1)
            outputs: tuple[int, ...] | list[int] = (tid,)
            inplace = info.inplace
        else:
            outputs, inplace = self._outputs(info, op_id, args, kwargs, out, tensors)
        try:
            text = self._args_memo[(info.name, key)]
        except (KeyError, TypeError):  # a call not seen before, or symbolic sizes (unhashable)
            text = self._args.encode(info, key, args, kwargs)
        self.rows.append(
            (
                op_id,
                self.step,
                phase,
                info.kind,
                info.name,
                "",
                module,
                location,
                text,
                tuple(inputs),
                tuple(outputs),
                inplace,
                info.random,
                seq,
                stack,
            )
        )
        if sampled is not None:
            self._sample_after(sampled, op_id, out)
        elif plan is not None:
            self._check_after(plan, op_id, out)
        if signature is not None and recipe is _UNLEARNED:
            self._learn(signature, func, args, kwargs, out)
        if len(self.rows) >= self._row_limit or self.saved_bytes >= self._max_bytes:
            self._on_limit()
        return out

    def _sample_before(self, func: Any, key: Any, tensors: list[torch.Tensor]) -> tuple[Any, Any, Any]:
        """A call with a recipe (capture/selfcheck.py, "sampled checks gathered on the per-op path"): its
        signature, recipe and inputs gathered now; ``_UNLEARNED`` as the recipe of a signature
        without one yet (the checker learns it after the call), and no gathering (the call is checked the usual way) where there is no
        recipe or a tensor is not one the per-op path reads. csrc/record_check.cpp does the same."""
        checker = self._checker
        assert checker is not None
        signed = checker.signature(func, key, tensors)
        if signed is None:
            return None, None, None
        signature, floats = signed
        try:
            recipe = checker.recipes.get(signature, _UNLEARNED)
        except TypeError:  # symbolic sizes: unhashable
            return None, None, None
        if recipe is SEEN_ONCE or recipe is SEEN_BEFORE:
            recipe = _UNLEARNED
        if recipe is None or recipe is _UNLEARNED:
            return signature, recipe, None
        with _disable_current_modes() if _dispatch_stack_len() else _NOTHING:
            return signature, recipe, checker.gather_call(recipe, tensors, floats)

    def _sample_after(self, pieces: list[tuple[Recipe, torch.Tensor, list[float]]], op_id: int, out: Any) -> None:
        """Queue a sampled call's values with its recipes' and record its check rows (filled in at take)."""
        checker = self._checker
        assert checker is not None and self.check_rows is not None
        for recipe, index, values in pieces:
            with _disable_current_modes() if _dispatch_stack_len() else _NOTHING:
                ticket = checker.finish_sampled(recipe, index, values, out)
            if ticket is None:
                continue
            deferred = self._deferred_rows
            deferred.extend([-1] * (ticket - len(deferred)))
            deferred.append(len(self.check_rows))
            row = (op_id, _place(out, recipe.out_index), math.nan, recipe.limit, math.nan, recipe.sampled, recipe.how)
            self.check_rows.append(row)
            for extra, _, _, limit, sampled in recipe.extras:  # more outputs: the next tickets
                deferred.append(len(self.check_rows))
                self.check_rows.append((op_id, _place(out, extra), math.nan, limit, math.nan, sampled, recipe.how))
        if checker._queued >= checker._queue_max:
            self._resolve_checks()

    def _resolve_checks(self) -> None:
        """Recompute the checker's queued calls now (its queue is full)."""
        assert self._checker is not None
        with _disable_current_modes() if _dispatch_stack_len() else _NOTHING:
            self._checker._resolve()

    def _learn(
        self, signature: tuple[Any, ...], func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
    ) -> None:
        """The recipe of a signature after its first call (None: its calls are checked the usual way)."""
        assert self._checker is not None
        with _disable_current_modes() if _dispatch_stack_len() else _NOTHING:
            self._checker.learn(signature, func, args, kwargs, out)

    def _check_before(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Plan | None:
        """What the self-check of this call needs, gathered before it runs (None: unchecked).
        The check's own ops skip the modes below this one (they may change what an op computes)."""
        assert self._checker is not None
        with _disable_current_modes() if _dispatch_stack_len() else _NOTHING:
            return self._checker.prepare(func, args, kwargs)

    def _check_after(self, plan: Plan, op_id: int, out: Any) -> None:
        """Gather the checked op's outputs and record its checks (deferred ones filled in at take)."""
        assert self._checker is not None
        with _disable_current_modes() if _dispatch_stack_len() else _NOTHING:
            self._record_checks(op_id, self._checker.finish(plan, out, defer=True))

    def _not_plain(self, func: Any, types: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """An op on tensor subclasses or under another mode: its result, or ``_RECORD`` to record it.

        Fake and functional tensors compute nothing: the op runs unrecorded. Other subclasses
        (DTensor, AsyncCollectiveTensor, jagged NestedTensor ...) get ``NotImplemented``, so they
        unwrap themselves and their ops on real tensors come back here to be recorded.
        """
        subclasses = [cls for cls in types if cls not in PLAIN_TYPES]  # torch may pass Tensor itself
        if traced_op(subclasses):
            self.skipped[TRACED_OP] = self.skipped.get(TRACED_OP, 0) + 1
            return func(*args, **kwargs)
        if subclasses:
            return NotImplemented
        return _RECORD

    def _collective(self, func: Any, info: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Record a collective call (capture/collectives.py says how); bookkeeping ops run unrecorded."""
        sig = signature(info)
        recorder = self.collectives
        if sig.kind == "wait":
            return recorder.wait(func, args, kwargs)
        if not sig.kind:
            return recorder.alias(func, args, kwargs)
        if self.ids.unsettled:
            self.settle()
        tensors: list[torch.Tensor] = []
        key = scan(args, kwargs, tensors)
        node = _current_autograd_node()
        if node is None:
            phase, module = self._unnoded_context(tensors)
            location, seq = self._locator.location(2), -1
        else:
            phase = "backward"
            module, location, seq = self._backward_context(node)
        stack = self._locator.stack(2) if self._stack else ""
        inputs = self._input_ids(tensors, phase, module, location, stack)
        if recorder.awaited_groups:
            recorder.complete_inputs(info, args, kwargs, tensors)
        meta = recorder.describe(sig, args, kwargs, phase, tensors)
        out = func(*args, **kwargs)
        op_id = self._next_op
        self._next_op = op_id + 1
        future = recorder.future(sig, out)
        outputs: list[int] = []
        inplace = False
        for t in recorder.received(sig, args, kwargs, out):
            if any(t is x for x in tensors):
                self._written(t, op_id, outputs, stats=False)
                inplace = True
            else:
                self._fresh(t, op_id, outputs, False)
            recorder.await_output(outputs[-1], len(self.tensor_rows) - 1, t, future, sig.functional)
        meta["received"] = list(range(len(outputs)))
        name = recorder.name(meta)
        text = recorder.node_args(self._args.encode(info, key, args, kwargs), meta)
        self.rows.append(
            (
                op_id,
                self.step,
                phase,
                info.kind,
                info.name,
                name,
                module,
                location,
                text,
                tuple(inputs),
                tuple(outputs),
                inplace,
                False,
                seq,
                stack,
            )
        )
        if len(self.rows) >= self._row_limit or self.saved_bytes >= self._max_bytes:
            self._on_limit()
        return out

    def _record_checks(self, op_id: int, checks: list[Check]) -> None:
        """Append an op's self-check rows; a residual still on its device is read at ``take``."""
        rows = self.check_rows
        assert rows is not None
        for check in checks:
            residual, coarse = check.residual, check.coarse
            if check.ticket is not None:  # recomputed with its calls alike at take
                deferred = self._deferred_rows
                deferred.extend([-1] * (check.ticket - len(deferred)))  # a ticket no row holds: none
                deferred.append(len(rows))
            elif isinstance(residual, torch.Tensor):
                self._pending_checks.append((len(rows), "residual", residual))
                residual = float("nan")
            if isinstance(coarse, torch.Tensor):
                self._pending_checks.append((len(rows), "coarse", coarse))
                coarse = float("nan")
            rows.append((op_id, check.index, residual, check.limit, coarse, check.sampled, check.how))

    def _skip(self, reason: str) -> None:
        """Count a value recorded without statistics (or not recorded), by why."""
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    # -- nodes the dispatcher does not see: compiled regions (capture/compiled.py) -------------
    def tensor_ids(self, tensors: list[torch.Tensor], phase: str, module: str, location: str) -> list[int]:
        """Ids of ``tensors`` as inputs of a node recorded now; unknown ones enter as source nodes.

        Called from outside ``__torch_dispatch__`` (the mode may be active): the statistics and
        copies it makes run with the dispatch modes out of the way, as they do inside it.
        """
        if self.ids.unsettled:
            self.settle()
        stack = self._locator.stack(1) if self._stack else ""
        with _disable_current_modes():
            return self._input_ids(tensors, phase, module, location, stack)

    def _input_ids(
        self, tensors: Iterable[torch.Tensor], phase: str, module: str, location: str, stack: str
    ) -> list[int]:
        """The ids of the values ``tensors`` hold now; a tensor capture does not know (or knows an
        older value of) enters as a source node. ``__torch_dispatch__`` inlines this loop (its hot path)."""
        known = self.ids.known
        found: list[int] = []
        for t in tensors:
            rec = known.get(id(t))
            if rec is not None and rec() is t and (rec.version is None or rec.version == t._version):
                found.append(rec.tid)
            else:
                found.append(self._enter(t, rec, phase, module, location, stack))
        return found

    def append_node(
        self,
        op: str,
        name: str,
        phase: str,
        module: str,
        location: str,
        inputs: list[int],
        fresh: list[torch.Tensor],
        written: list[torch.Tensor] = (),  # type: ignore[assignment]
    ) -> tuple[int, list[int]]:
        """Record a node with inputs ``inputs`` (ids), new values ``fresh`` and inputs it
        ``written``; returns its op id and output ids (written first, then fresh)."""
        if self.ids.unsettled:
            self.settle()
        op_id = self._next_op
        self._next_op = op_id + 1
        outputs: list[int] = []
        with _disable_current_modes():  # as in tensor_ids
            for t in written:
                self._written(t, op_id, outputs)
            for t in fresh:
                self._fresh(t, op_id, outputs)
        stack = self._locator.stack(1) if self._stack else ""
        self.rows.append(
            (
                op_id,
                self.step,
                phase,
                "op",
                op,
                name,
                module,
                location,
                "{}",
                tuple(inputs),
                tuple(outputs),
                bool(written),
                False,
                -1,
                stack,
            )
        )
        if len(self.rows) >= self._row_limit or self.saved_bytes >= self._max_bytes:
            self._on_limit()
        return op_id, outputs

    def _after_op(self) -> None:
        """End of every op under ``overflow="raise"``: judge it now, then the usual limits."""
        assert self.watch is not None and self._on_overflow is not None
        if self._pending:
            self._gather_deferred_stats()  # accelerators: one host sync per op, the price of raising at once
        if self.watch.scan(self.rows, self.tensor_rows) is not None:
            self._on_overflow()
        if len(self.rows) >= self._max_ops or self.saved_bytes >= self._max_bytes:
            self._on_full()

    def _unnoded_context(self, tensors: list[torch.Tensor]) -> tuple[str, str]:
        """(phase, module) of an op no autograd node runs: the optimizer's, forward's, or that of
        backward's final callbacks (DDP's bucket copy-out, FSDP2's post-backward reduce-scatter),
        which belongs to the module whose parameter's gradient it moves."""
        if self.in_optimizer:
            return "optimizer", self.scope.current
        if _current_graph_task_id() != -1:
            return "backward", self.scope.grad_module(tensors)
        return "forward", self.scope.current

    def _backward_context(self, node: Any) -> tuple[str, str, int]:
        """(module, location, seq_nr) of an op run by the autograd engine for ``node``."""
        scope = self.scope
        seq = node._sequence_nr()
        if seq >= _SEQ_NONE:
            # Gradient accumulation into a parameter: it belongs to the parameter's module.
            variable = getattr(node, "variable", None)
            module = scope.owner(variable) if variable is not None else ""
            return module, self._locator.location(2), -1
        if scope.depth:  # a forward recomputed inside backward (activation checkpointing)
            return scope.current, self._locator.location(2), seq
        hit = scope.seq_info.get(seq)
        if hit is None:
            return "", self._locator.location(2), seq
        return hit[0], hit[1] or self._locator.location(2), seq

    def _enter(
        self,
        t: torch.Tensor,
        rec: TensorRef | None,
        phase: str,
        module: str,
        location: str,
        stack: str,
        unread: bool = False,
    ) -> int:
        """Id of an input the map does not vouch for: a refreshed alias or a new source node
        (``unread``: one the op only writes, recorded without statistics)."""
        if rec is not None and rec() is not t:
            rec = None  # a dead tensor's entry whose id() was reused before its callback ran
        op_id = self._next_op
        self._next_op = op_id + 1
        ids = self.ids
        tid = ids.new_id()
        if rec is not None and unread:
            version, group = t._version, rec.group  # what the op overwrites needs no value
        elif rec is not None:
            version = t._version
            written = ids.accounted(rec.group, rec.version, version)
            if written:  # nothing unrecorded wrote it since: its value is what the recorded writes made
                inputs = (rec.tid, *written)
                self.rows.append(
                    (op_id, self.step, phase, "view", ALIAS_UPDATE_OP, "", module, location, "{}", inputs, (tid,))
                    + _NOT_AN_OP
                    + (stack,)
                )
                self._value(t, tid, op_id, 0, written[-1])
                rec.tid, rec.version = tid, version
                return tid
            group = rec.group  # written behind our back: a source, still in its view family
        else:
            version = None if t.is_inference() else t._version
            group, since = ids.family(t, tid, version)
            if since is not None and version is not None and not unread:
                # Views of it made outside the trace were written (a DDP bucket, through its
                # per-parameter views): its value is what they wrote, if they account for every write.
                written = ids.accounted(group, since, version)
                if written:
                    self.rows.append(
                        (
                            op_id,
                            self.step,
                            phase,
                            "view",
                            ALIAS_UPDATE_OP,
                            "",
                            module,
                            location,
                            "{}",
                            tuple(written),
                            (tid,),
                        )
                        + _NOT_AN_OP
                        + (stack,)
                    )
                    self._value(t, tid, op_id, 0, written[-1])
                    ids.remember(t, tid, version, group)
                    return tid
        source, name = self.scope.source(t, (self.step, phase))
        if unread:
            source = UNREAD_SOURCE
        self.rows.append(
            (op_id, self.step, phase, "source", source, name, module, location, "{}", (), (tid,))
            + _NOT_AN_OP
            + (stack,)
        )
        if unread:
            self._bare(t, tid, op_id, 0, -1)
        else:
            self._value(t, tid, op_id, 0, -1)
        ids.remember(t, tid, version, group)
        return tid

    def _outputs(
        self,
        info: OpInfo,
        op_id: int,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: Any,
        inputs: list[torch.Tensor],
    ) -> tuple[list[int], bool]:
        """Record the op's outputs; returns their ids and whether the op wrote an input.

        The per-op path records an op with one new tensor itself; this handles everything else.
        """
        outputs: list[int] = []
        returns = info.returns
        if len(returns) == 1 and not info.extra_writes and isinstance(out, _Tensor):
            kind, ref = returns[0]
            if kind == VIEW:  # views are most of a transformer's ops: no walk, no statistics
                position, name = ref
                self._view(out, args[position] if 0 <= position < len(args) else kwargs.get(name), op_id, outputs)
                return outputs, info.inplace
            if kind == WRITE:  # in-place ops (the optimizer's)
                self._written(out, op_id, outputs)
                return outputs, info.inplace
        if info.schema:
            values = (out,) if len(returns) == 1 else (out if returns else ())
        else:
            values = tree_flatten(out)[0]
            returns = ((FRESH, None),) * len(values)
        inplace = info.inplace
        for (kind, ref), value in zip(returns, values):
            items = [value] if isinstance(value, _Tensor) else (value if isinstance(value, (list, tuple)) else ())
            for i, item in enumerate(items):
                if not isinstance(item, _Tensor):
                    continue
                if kind == FRESH and _among(item, inputs):
                    # Returned its own input without saying so in its schema (c10d collectives,
                    # some vendor kernels): an in-place write.
                    self._written(item, op_id, outputs)
                    inplace = True
                else:
                    self._output(info, kind, ref, item, i if item is not value else None, args, kwargs, op_id, outputs)
        for ref in info.extra_writes:
            value = arg_value(ref, args, kwargs)
            if isinstance(value, _Tensor):
                self._written(value, op_id, outputs)
            elif isinstance(value, (list, tuple)):
                for item in value:
                    if isinstance(item, _Tensor):
                        self._written(item, op_id, outputs)
        return outputs, inplace

    def _output(
        self,
        info: OpInfo,
        kind: int,
        ref: Any,
        t: torch.Tensor,
        item: int | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        op_id: int,
        outputs: list[int],
    ) -> None:
        if kind == BUFFER:
            return  # an argument handed back, partly written: it keeps its value (aten/schema.py)
        if kind == FRESH:
            self._fresh(t, op_id, outputs, not info.uninitialized)
        elif kind == SCRATCH:
            self._fresh(t, op_id, outputs, False)
        elif kind == WRITE:
            self._written(t, op_id, outputs)
        else:
            base = arg_value(ref, args, kwargs)
            if isinstance(base, (list, tuple)):
                base = base[item] if item is not None and item < len(base) else None
            self._view(t, base, op_id, outputs)

    def _fresh(self, t: torch.Tensor, op_id: int, outputs: list[int], stats: bool = True) -> None:
        tid = self.ids.fresh(t)
        if stats:
            self._value(t, tid, op_id, len(outputs), -1)
        else:
            self._bare(t, tid, op_id, len(outputs), -1)
        outputs.append(tid)

    def _written(self, t: torch.Tensor, op_id: int, outputs: list[int], stats: bool = True) -> None:
        tid = self.ids.wrote(t)
        if stats:
            self._value(t, tid, op_id, len(outputs), -1)
        else:
            self._bare(t, tid, op_id, len(outputs), -1)
        outputs.append(tid)

    def settle(self) -> None:
        """Read the versions of the tensors the last op wrote, once it has returned (bumped them)."""
        self.ids.settle(self._unbumped)

    def _unbumped(self, t: torch.Tensor, tid: int) -> None:
        """The last op wrote ``t`` (value ``tid``) without moving its version counter.

        Custom ops registered without an autograd kernel (FSDP2's ``fsdp.chunk_cat`` ...) write
        their ``out=`` views so; the view's base would then look unchanged to the next op that
        reads it. Its new value is recorded at once, as an alias update of the write.
        """
        base = t._base
        rec = self.ids.ref(base) if base is not None else None
        if rec is None or rec.tid == tid or tid in self.collectives.awaiting:
            return
        if self.rows:
            row = next(self.rows.rows(len(self.rows) - 1))  # the writing op's context
            phase, module, location, stack = row[2], row[6], row[7], row[14]
        else:  # the writing op went out with the last hand-over
            phase, module, location, stack = "optimizer" if self.in_optimizer else "forward", self.scope.current, "", ""
        op_id = self._next_op
        self._next_op = op_id + 1
        new = self.ids.new_id()
        self.rows.append(
            (op_id, self.step, phase, "view", ALIAS_UPDATE_OP, "", module, location, "{}", (rec.tid, tid), (new,))
            + _NOT_AN_OP
            + (stack,)
        )
        self._value(base, new, op_id, 0, tid)
        rec.tid = new

    def _view(self, t: torch.Tensor, base: Any, op_id: int, outputs: list[int]) -> None:
        tid, view_of = self.ids.view(t, base)
        self._bare(t, tid, op_id, len(outputs), view_of)
        outputs.append(tid)

    def _bare(self, t: torch.Tensor, tid: int, op_id: int, index: int, view_of: int) -> None:
        """Append the tensor row of a value without statistics (a view, uninitialized memory)."""
        device = "cpu" if t.is_cpu else self._device(t.device)[0]
        dtype = t.dtype
        self.tensor_rows.append(
            (tid, op_id, index, dims(t), self._dtypes.get(dtype) or self._dtype(dtype), device, view_of, False)
            + _NO_STATS
            + ("",)
        )

    def _value(self, t: torch.Tensor, tid: int, op_id: int, index: int, view_of: int) -> None:
        """Append the tensor row of a value that carries statistics (and its data, if saved)."""
        if t.is_cpu:
            device, kind = _CPU_DEVICE
        else:
            device, kind = self.devices.get(t.device) or self._device(t.device)
        dtype = t.dtype
        stats = self._stats_of(t, kind)
        has_stats = stats is not None
        key = self._save(t, tid) if self._saving and has_stats else ""
        self.tensor_rows.append(
            (tid, op_id, index, dims(t), self._dtypes.get(dtype) or self._dtype(dtype), device, view_of, has_stats)
            + (stats or _NO_STATS)
            + (key,)
        )

    def _stats_of(self, t: torch.Tensor, kind: int) -> tuple[Any, ...] | None:
        """The statistics of ``t`` (placeholders when deferred to the hand-over), None if it has none."""
        if kind == _NONE:
            return None
        native = _stats._native_stats
        code = _NATIVE_CODES.get(t.dtype)
        if (
            kind == _CPU
            and native is not None
            and code is not None
            and type(t) in PLAIN_TYPES
            and t.layout is STRIDED
            and not t.is_neg()
        ):
            # Only a plain dense strided tensor reaches the kernel, and only with storage behind
            # its pointer: a functional tensor's is 0, a sparse one's raises (tensorkinds.py).
            n = t.numel()
            try:
                ptr = t.data_ptr()
                if not ptr and n:
                    raise ValueError("no storage behind the data pointer")
                return native(ptr, t.shape, t.stride(), code, n, _get_num_threads() if n >= _PARALLEL_MIN else 1)
            except (RuntimeError, ValueError):  # nested tensors have no strides: the reference decides
                pass
        return self._reference_stats(t, kind)

    def _fill(self, row: int, t: torch.Tensor, tid: int) -> None:
        """Give tensor row ``row`` (recorded bare) the statistics ``t`` holds now: a completed collective's output."""
        kind = _CPU if t.is_cpu else (self.devices.get(t.device) or self._device(t.device))[1]
        stats = self._reference_stats(t, kind, row) if kind == _DEFERRED else self._stats_of(t, kind)
        if stats is None:
            return
        rows = self.tensor_rows
        if kind == _CPU:  # accelerators: filled in at the hand-over with the other deferred statistics
            for name, value in zip(STAT_COLUMNS, stats):
                rows.set(row, name, value)
        rows.set(row, "has_stats", True)
        if self._save_data:
            rows.set(row, "data_key", self._save(t, tid))

    def _reference_stats(self, t: torch.Tensor, kind: int, row: int | None = None) -> tuple[Any, ...] | None:
        """Statistics by the torch reference (deferred on accelerators to tensor row ``row``, by
        default the next one), or None, the reason counted."""
        reason = unreadable(t)
        if reason is None:
            try:
                if kind == _CPU:
                    return tensor_stats_row(t)
                self._pending.append((len(self.tensor_rows) if row is None else row, stats_tensor_reference(t)))
                return _NO_STATS
            except (RuntimeError, TypeError, ValueError, KeyError, NotImplementedError) as exc:
                reason = f"{str(t.dtype).removeprefix('torch.')}: the statistics do not cover it ({type(exc).__name__})"
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        return None

    def _save(self, t: torch.Tensor, tid: int) -> str:
        # Copied now: a later in-place op would change the value under us. A dense copy keeps the
        # strides (the writer records the memory order), so a replay hands kernels the run's layout.
        copy = t.detach().to("cpu", copy=True).resolve_conj().resolve_neg()
        key = f"{self.chunk}/{tid}"
        self.saved[key] = copy
        self.saved_bytes += copy.numel() * copy.element_size()
        if self._only is not None:
            self._saved_ids.add(tid)
        return key

    def _dtype(self, dtype: torch.dtype) -> str:
        name = self._dtypes.get(dtype)
        if name is None:
            name = self._dtypes[dtype] = str(dtype).removeprefix("torch.")
        return name

    def _device(self, device: torch.device) -> tuple[str, int]:
        hit = self.devices.get(device)
        if hit is None:
            kind = _CPU if device.type == "cpu" else (_NONE if device.type == "meta" else _DEFERRED)
            hit = self.devices[device] = (str(device), kind)
        return hit

    def accelerator(self) -> str | None:
        """The first accelerator device a recorded tensor lived on, if any."""
        return next((name for name, kind in self.devices.values() if kind == _DEFERRED), None)

    # -- step boundaries -----------------------------------------------------------------------
    def begin(self, step: int) -> None:
        """Called before the mode is entered for a recorded step."""
        self.step = step
        self.in_optimizer = False
        self.collectives.begin()
        for t in self.scope.unversioned():
            # Read again as a source at its next use: its counter cannot say whether it changed.
            rec = self.ids.ref(t)
            if rec is not None:
                del self.ids.known[rec.key]

    def take(self) -> tuple[Columns, Columns, dict[str, torch.Tensor], Columns | None]:
        """Hand over the buffered op rows, tensor rows, saved tensors and self-check rows (None
        when self-checks are off), and start empty buffers."""
        self.collectives.settle()
        self._gather_deferred_stats()
        self._gather_deferred_checks()
        if self.watch is not None:
            self.watch.scan(self.rows, self.tensor_rows)
        taken = self.rows, self.tensor_rows, self.saved, self.check_rows
        self.rows = Columns(OPS_SCHEMA, number_array=native.NUMBER_ARRAY)
        self.tensor_rows = Columns(TENSORS_SCHEMA, number_array=native.NUMBER_ARRAY)
        self.check_rows = Columns(CHECKS_SCHEMA) if self._checker is not None else None
        self.saved, self.saved_bytes = {}, 0
        self._sweep()
        return taken

    def trim_unfinished(self) -> None:
        """Drop the rows of an op that an exception cut short inside the mode.

        An interrupt (KeyboardInterrupt, a SIGTERM turned into an exception) can land between an
        op's tensor rows and its op row. Ops and tensors get ids in execution order, so only the
        tail can be unfinished: tensor rows of an op with no op row, or an op row whose outputs
        have no tensor rows yet. Without this a reader would refuse the whole rank.
        """
        ops, tensors = self.rows, self.tensor_rows
        last = ops.values("op_id", len(ops) - 1)[0] if len(ops) else -1
        producers = tensors.values("op_id")
        keep = len(producers)
        while keep and producers[keep - 1] > last:
            keep -= 1
        if len(ops):
            outputs = set(ops.values("outputs", len(ops) - 1)[0])
            first = keep
            while first and producers[first - 1] == last:
                first -= 1
            if not outputs <= set(tensors.values("tensor_id", first)[: keep - first]):
                ops.truncate(len(ops) - 1)
                keep = first
        if keep < len(producers):
            tensors.truncate(keep)
            self._pending = [(index, packed) for index, packed in self._pending if index < keep]
        checks = self.check_rows
        if checks is not None and len(checks):
            last = ops.values("op_id", len(ops) - 1)[0] if len(ops) else -1
            checked = checks.values("op_id")
            kept = len(checked)
            while kept and checked[kept - 1] > last:
                kept -= 1
            checks.truncate(kept)
            self._pending_checks = [pending for pending in self._pending_checks if pending[0] < kept]
            self._deferred_rows = [row if row < kept else -1 for row in self._deferred_rows]

    def _gather_deferred_stats(self) -> None:
        """Bring the statistics computed on accelerators to the host: one transfer per device."""
        if not self._pending:
            return
        by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
        for index, packed in self._pending:
            by_device.setdefault(packed.device, []).append((index, packed))
        self._pending = []
        for items in by_device.values():
            host = torch.stack([packed for _, packed in items]).cpu()
            for (index, _), packed in zip(items, host):
                for name, value in zip(STAT_COLUMNS, unpack_stats(packed)):
                    self.tensor_rows.set(index, name, value)

    def _gather_deferred_checks(self) -> None:
        """Bring the self-check residuals computed on accelerators to the host: one transfer per device."""
        if self.check_rows is None:
            return
        assert self._checker is not None
        with _disable_current_modes():
            residuals, coarse = self._checker.collect()
        pending = self._pending_checks
        on_host: dict[str, tuple[list[int], list[float]]] = {"residual": ([], []), "coarse": ([], [])}
        for row, residual, rough in zip(self._deferred_rows, residuals, coarse):
            if row < 0:  # its op was cut short (trim_unfinished)
                continue
            for column, value in (("residual", residual), ("coarse", rough)):
                if isinstance(value, torch.Tensor):
                    pending.append((row, column, value))
                else:
                    on_host[column][0].append(row)
                    on_host[column][1].append(value)
        for column, (rows, values) in on_host.items():
            self.check_rows.set_many(column, rows, values)
        self._deferred_rows = []
        if not pending:
            return
        by_device: dict[torch.device, list[tuple[int, str, torch.Tensor]]] = {}
        for index, column, value in pending:
            by_device.setdefault(value.device, []).append((index, column, value))
        self._pending_checks = []
        for items in by_device.values():
            host = torch.stack([value.reshape(()).to(torch.float64) for _, _, value in items]).cpu().tolist()
            for (index, column, _), value in zip(items, host):
                self.check_rows.set(index, column, value)

    def _sweep(self) -> None:
        """Forget the write history of view families nobody holds any more."""
        live = self.ids.sweep()
        if self.watch is not None:
            self.watch.restart(live)


def _load_native() -> Any:
    """``tracecmp._crecord`` configured with this module's helpers, or None (``native.error("_crecord")`` says why)."""
    return native.configure_record(_native_helpers)


def _native_helpers() -> dict[str, Any]:
    """What ``tracecmp._crecord.configure`` takes: the reference's helpers and types (see ``_crecord.pyi``)."""
    return dict(
        slow=CaptureMode.__torch_dispatch__,
        tensor_type=torch.Tensor,
        op_overload=torch._ops.OpOverload,
        op_infos=_OP_INFOS,
        one_fresh=ONE_FRESH,
        marker=TENSOR_MARK,
        scan_value=scan_value,
        plain_types=(torch.dtype, torch.device, torch.layout, torch.memory_format),
        rec_type=TensorRef,
        current_node=_current_autograd_node,
        sequence_nr=_get_sequence_nr,
        grad_enabled=_is_grad_enabled,
        inference_enabled=_is_inference_mode_enabled,
        num_threads=_get_num_threads,
        stats_module=_stats,
        native_codes=_NATIVE_CODES,
        parallel_min=_PARALLEL_MIN,
        view_kind=VIEW,
        write_kind=WRITE,
        fresh_kind=FRESH,
        parameter_type=torch.nn.Parameter,
        strided=torch.strided,
        stack_len=_dispatch_stack_len,
        graph_task=_current_graph_task_id,
        recipe_kinds=RECIPE_KINDS,
    )


_crecord = _load_native()
# Modes made while this is true run the C per-op path; TRACECMP_FORCE_REFERENCE=1 (read at
# import) forces the Python reference, as it does for the statistics kernel.
USE_NATIVE = not native.FORCE_REFERENCE
