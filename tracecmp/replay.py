"""Replay: re-run each recorded op on its own recorded inputs in float64 and measure its own error.

With whole tensors in a trace (``data="tensors"``) every op's inputs are known exactly, so the op
can be run again on the CPU: in float64, as the *reference*, and in the dtypes it was recorded in,
as an *honest* implementation (the two-standard check of msprobe's run_ut pre-check; the FX
Numeric Suite's shadow mode has the same aim). How far the recorded output lies from the
reference is the op's *own* error, free of whatever its inputs inherited; how far the honest
replay lies from it is the error a correct kernel makes on these very inputs, sums that cancel
and low-precision dtypes included. A fault far smaller than the noise a device adds upstream (a
TF32 matmul before a GELU) thus still stands out at the op that made it. ``compare`` uses it next
to a bench; ``check`` judges a single run with it.

Errors are normwise: ``max(max|x - ref| / max|ref|, ||x - ref|| / ||ref||)`` over the op's worst
floating output. Positions where both hold the same NaN/Inf count as equal; a NaN/Inf on one side
only is an infinite error. With ``detail`` (what ``check`` asks for) an :class:`OwnError` also
counts those positions, and measures each element's error in units in the last place of the
recorded dtype at the reference's magnitude: the largest, and the share beyond a per-dtype bound.

A float32 matmul/conv that may have run at reduced precision (TF32, or bf16 under
``set_float32_matmul_precision("medium")``) is replayed with its inputs rounded to nearest and
toward zero, and in plain float32; ``OwnError.fits`` says how far the recorded output lies from
each rounded replay in float32 accumulation errors, so that the caller can learn which rounding
the run used from its other calls and hold each call to it.

Views carry no data of their own and are recomputed from their base by replaying the view op.
Ops that are not replayed come back as :class:`Skipped` with the reason (:func:`replay_ops`):
random ops that drew numbers (they would draw others; ``dropout_p=0.0`` draws none), uninitialized allocations, collectives (they need the
other ranks), operators this torch does not have or cannot run on the CPU (device-only custom ops;
:func:`register_reference` gives one a CPU reference), ops whose arguments the trace could not
record (opaque objects), ops whose inputs were not saved, and ops that refuse float64: the caller
treats those as "not replayed", never as "correct".

Scale. Replay streams in execution order: an op's inputs are read from the trace when it needs
them (``trace.saved`` reads exactly their bytes) and dropped again, with a small cache of recent
values (the next op usually reads what the last one wrote; it makes room for a large op), so
memory is bounded by the largest op, not by the trace. Within an op it stays near the op's own
recorded values: a ``_foreach_*`` or fused optimizer op over a model's every parameter is replayed
one list element at a time; a pointwise call over many elements (Adam's steps on a 38.6M-element
embedding) gets its float64 reference in pieces, whose elements take the kernel paths they take
in a whole call; every large output is measured piece by piece; float64 copies of inputs an op
does not return are dropped as soon as it ran. The honest replay always runs whole. After a
large op, memory the C heap keeps is handed back. :func:`replay_ops` can spread the ops over
worker processes, each opening the trace itself.

>>> own = replay_rank(tracecmp.load("runs/target").rank(0))   # doctest: +SKIP
>>> own[42].error, own[42].honest                            # doctest: +SKIP
(1.0e-06, 3.1e-08)
"""
from __future__ import annotations

import math
import os
import sys
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

from tracecmp.aten.args import decode_call, memory_order
from tracecmp.aten.opclass import base_name, classify, draws_random
from tracecmp.aten.schema import _SCRATCH_NAMES, op_info, outputs_in_order, resolve
from tracecmp.errors import TracecmpError, TraceFormatError
from tracecmp.trace import boundedjson
from tracecmp.trace.saved import SavedTensors

_CACHE_BYTES = 256 << 20  # recent recorded values kept while walking (the next op mostly reads them)
_UNINITIALIZED = ("aten.empty", "aten.new_empty", "aten.empty_like", "aten.empty_strided", "aten._empty")
_COLLECTIVES = ("c10d.", "_c10d_functional.", "c10d_functional.", "_dtensor.")
_RESHAPING_VIEWS = ("aten.view.default", "aten._unsafe_view.default", "aten._reshape_alias.default")
# Ops that return views of their input without declaring it (capture records their outputs as values).
_UNSAFE_VIEWS = frozenset({"aten.unsafe_split.Tensor", "aten.unsafe_split_with_sizes.default",
                           "aten.unsafe_chunk.default"})
_VIEW_DEPTH = 64  # views of views rebuilt from their base at most this deep (then: not replayed)
_TINY = 1e-300
_PROGRESS_EVERY = 1000
# Per-element bound of ``OwnError.beyond``: units in the last place (ulp) of the recorded dtype.
ELEMENT_ULPS: dict[str, float] = {"float64": 4.0, "float32": 4.0, "bfloat16": 1.0, "float16": 1.0}


@dataclass(frozen=True, slots=True)
class OwnError:
    """An op's own error: its recorded outputs against a float64 replay of its recorded inputs."""

    op_id: int
    error: float  # the recorded output's relative error against the float64 replay (see above)
    # The same for a replay on this CPU in the recorded dtypes: an honest kernel's error (at
    # reduced precision, the larger of rounding to nearest and toward zero).
    honest: float
    dtype: str  # dtype of the output that decided it
    # An IEEE 754 basic operation (one correctly rounded +, -, *, / per element) whose recorded
    # bits differ from the honest replay's: every conforming device gives the replay's bits.
    misrounded: bool = False
    # A float32 matmul/conv replayed at reduced precision: per way of rounding the inputs
    # (REDUCED_MODELS), how far the recorded output lies from that replay, in units of the
    # accumulation error a plain float32 replay makes (at least one float32 rounding unit); the
    # worst output decides. Near 1 where that model is what the run computed.
    fits: tuple[float, ...] = ()
    # The same per rounding model, then for float32 itself, elementwise in units of the bound on
    # what accumulating this call's products in float32 can add (see _accumulation_bound): at most
    # 1 where the recorded output is a float32 sum of those products in any order, whatever the
    # device. Only for ops whose outputs are sums of products (matmul, conv).
    bounds: tuple[float, ...] = ()
    # Every recorded output equals the replay in its recorded dtypes bit for bit (at reduced
    # precision: one of the roundings' replays): where a run's calls of an op all do, the device
    # computes that op as this CPU does (see localize).
    bitwise: bool = False
    # The honest replay rounds something (not a copy, a max, or one correctly rounded IEEE
    # operation, which every device gives bit for bit): its bits say how the device computes.
    informative: bool = False
    # With ``detail`` only (else 0), over every checked output:
    nonfinite: int = 0  # positions where the recorded output holds NaN/Inf the reference does not (or the reverse)
    honest_nonfinite: int = 0  # the same for the honest replay
    max_ulps: float = 0.0  # the largest element error, in ulp of the recorded dtype at the reference's magnitude
    honest_max_ulps: float = 0.0
    beyond: float = 0.0  # share of finite elements more than ELEMENT_ULPS[dtype] ulp from the reference
    honest_beyond: float = 0.0
    elements: int = 0  # elements measured
    integer_mismatch: int = 0  # elements of integer/bool outputs that differ from the honest replay


@dataclass(frozen=True, slots=True)
class Skipped:
    """An op that was not replayed, and why (never to be read as "correct")."""

    op_id: int
    reason: str
    data_missing: bool = False  # the trace did not save its inputs or outputs (statistics may still judge it)


@dataclass(slots=True)
class RecordedOp:
    """One node of the trace as replay sees it: ids and the recorded arguments, no tensors."""

    op_id: int
    kind: str
    name: str
    args: str
    inputs: list[int]
    outputs: list[int]
    random: bool
    parsed: Any = None  # ``args`` decoded, on first use (None: not yet; False: not a JSON object)

    def arguments(self) -> dict[str, Any] | None:
        """The recorded non-tensor arguments as a dict, or None when they are not readable."""
        if self.parsed is None:
            try:
                value = boundedjson.loads(self.args, max_bytes=boundedjson.ARGS_MAX_BYTES)
            except ValueError:
                value = None
            self.parsed = value if isinstance(value, dict) else False
        return self.parsed if self.parsed is not False else None

    def draws(self) -> bool:
        """Whether this call drew random numbers (``dropout_p=0.0`` draws none), see
        :func:`tracecmp.aten.opclass.draws_random`."""
        return self.random and draws_random(self.name, self.arguments())


@dataclass(frozen=True, slots=True)
class _Call:
    """One call to replay: an op, or one list element of a ``_foreach_*`` op."""

    op: RecordedOp
    args: dict[str, Any]  # recorded arguments, tensors as {"tensor": i} into ``inputs``
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]


# -- references for ops without a CPU kernel ---------------------------------------------------
_REFERENCES: dict[str, Callable[..., Any]] = {}


def register_reference(name: str, reference: Callable[..., Any]) -> None:
    """Give replay a CPU reference for an operator the CPU cannot run (a device-only custom op).

    ``reference`` is called like the operator (its schema's arguments, tensors on the CPU, in
    float64 for the reference replay and in the recorded dtypes for the honest one) and returns
    what the operator returns. An operator with a CPU kernel of its own (``torch.library`` with a
    "cpu" or composite implementation) needs none.

    >>> register_reference("npu.fast_gelu.default", lambda x: torch.nn.functional.gelu(x, approximate="tanh"))  # doctest: +SKIP
    """
    if not callable(reference):
        raise TypeError("reference must be callable")
    _REFERENCES[name] = reference


def _has_cpu_kernel(func: Any) -> bool:
    try:
        return bool(torch._C._dispatch_has_computed_kernel_for_dispatch_key(func.name(), "CPU"))
    except (AttributeError, RuntimeError):
        return True  # no way to ask: let the call decide


# -- the replayer ------------------------------------------------------------------------------
class Replayer:
    """Re-runs recorded ops of one rank on their recorded inputs; a context manager.

    ``reduced`` ("tf32" or "bf16"): the run may have computed float32 matmul/conv at that
    precision, so their honest replay multiplies inputs rounded to it (round to nearest even):
    where a product's terms cancel, the reduced precision's own error is that much larger than
    float32's. ``detail``: per-dtype element bounds in ulp (see :data:`ELEMENT_ULPS`) to measure
    element errors and NaN/Inf positions too (``OwnError`` fields after ``fits``).

    >>> with Replayer(tracecmp.load("runs/target").rank(0)) as replayer:   # doctest: +SKIP
    ...     replayer.replay(42)
    OwnError(op_id=42, error=1e-06, honest=3.1e-08, dtype='float32', ...)

    :meth:`run_ops` runs a set of ops together (a region: outputs of one feed the next).
    """

    def __init__(
        self, rank: Any, *, reduced: str | None = None, detail: Mapping[str, float] | None = None,
        cache_bytes: int = _CACHE_BYTES, small_on_one_thread: bool = False,
    ) -> None:
        if reduced not in (None, *REDUCED_MODELS):
            raise ValueError(f"reduced must be None or one of {sorted(REDUCED_MODELS)}, not {reduced!r}")
        self.rank = rank
        # Faster, but a reduction's bits follow the thread count: only where no judgement rests on
        # a replay giving the recorded bits (check's; not compare's, see OwnError.bitwise).
        self.small_on_one_thread = small_on_one_thread
        # The thread count the run was captured at (None for traces that do not say): a large
        # matmul or sum splits its work by threads, and its bits follow the split.
        threads = (rank.manifest.get("info") or {}).get("threads")
        self.threads = threads if isinstance(threads, int) and not isinstance(threads, bool) and threads > 0 else None
        self.reduced = reduced
        self.detail = dict(detail) if detail is not None else None
        self.saved = SavedTensors(rank)
        keys = self.saved.keys()
        tensors = rank.tensors_table.select(["tensor_id", "op_id", "index", "dtype", "view_of", "shape"]).to_pydict()
        self.sizes: dict[int, int] = {t: math.prod(shape or ()) for t, shape in zip(tensors["tensor_id"], tensors["shape"])}
        self.shapes: dict[int, tuple[int, ...]] = {t: tuple(shape or ()) for t, shape in zip(tensors["tensor_id"], tensors["shape"])}
        # tensor id -> (producer op, output index, dtype, base tensor id or -1, data key or "")
        self.info: dict[int, tuple[int, int, str, int, str]] = {
            t: (op, idx, dtype, -1 if view is None else view, keys.get(t, ""))
            for t, op, idx, dtype, view in zip(
                tensors["tensor_id"], tensors["op_id"], tensors["index"], tensors["dtype"], tensors["view_of"]
            )
        }
        self.has_data = bool(keys)
        table = rank.ops_table.select(["op_id", "kind", "op", "args", "inputs", "outputs", "random"]).to_pydict()
        self.ops: dict[int, RecordedOp] = {
            o: RecordedOp(o, k, n, a or "{}", list(i or ()), list(out or ()), bool(r))
            for o, k, n, a, i, out, r in zip(
                table["op_id"], table["kind"], table["op"], table["args"], table["inputs"], table["outputs"], table["random"]
            )
        }
        self._cache: OrderedDict[int, torch.Tensor | None] = OrderedDict()
        self._cache_bytes = 0
        self._cache_limit = int(cache_bytes)

    def __enter__(self) -> Replayer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self.saved.close()
        self._cache.clear()
        self._cache_bytes = 0

    # -- recorded values -----------------------------------------------------------------------
    def saved_value(self, tid: int) -> bool:
        """Whether the value of tensor ``tid`` can be had: saved, or a view of a saved value."""
        for _ in range(_VIEW_DEPTH + 1):
            row = self.info.get(tid)
            if row is None:
                return False
            if row[4]:
                return True
            op = self.ops.get(row[0])
            if row[3] < 0 or op is None or not op.inputs:
                return False
            tid = row[3] if row[3] in op.inputs else op.inputs[0]
        return False

    def value(self, tid: int, depth: int = 0) -> torch.Tensor | None:
        """The recorded value of tensor ``tid`` (loaded, or a view remade from its base), or None."""
        if tid in self._cache:
            self._cache.move_to_end(tid)
            return self._cache[tid]
        value = self._load(tid, depth)
        size = value.numel() * value.element_size() if value is not None else 0
        if size <= self._cache_limit // 2:
            self._cache[tid] = value
            self._cache_bytes += size
            while self._cache_bytes > self._cache_limit and self._cache:
                _, old = self._cache.popitem(last=False)
                if old is not None:
                    self._cache_bytes -= old.numel() * old.element_size()
        return value

    def _load(self, tid: int, depth: int) -> torch.Tensor | None:
        row = self.info.get(tid)
        if row is None:
            return None
        producer, index, _, view_of, key = row
        if key:
            op = self.ops.get(producer)
            if op is not None and op.name in _UNSAFE_VIEWS and depth <= _VIEW_DEPTH:
                laid_out = self._unsafe_view(op, index, tid, depth)
                if laid_out is not None:
                    return laid_out
            return self.saved.get(key)
        if view_of < 0 or depth > _VIEW_DEPTH:
            return None
        op = self.ops.get(producer)
        if op is None:
            return None
        # A view holds no data: make it again from its base with the same view op.
        inputs = [self.value(t, depth + 1) for t in op.inputs]
        if any(v is None for v in inputs):
            return None
        args = op.arguments()
        if args is None:
            return None
        out = _invoke(op.name, args, inputs, golden=False)
        if out is None and op.name in _RESHAPING_VIEWS and isinstance(args.get("size"), list) and inputs:
            # Saved values are contiguous copies: a view the run could take of a strided base
            # (a permuted attention output) may need a reshape of the copy, which holds the same values.
            try:
                return inputs[0].reshape(args["size"])
            except RuntimeError:
                return None
        if out is None:
            return None
        produced = _returned(op.name, *out)
        return produced[index] if index < len(produced) else None

    def _unsafe_view(self, op: RecordedOp, index: int, tid: int, depth: int) -> torch.Tensor | None:
        """Output ``index`` of an ``unsafe_split``-like op remade from its input: views in memory
        that capture saved as copies (the op declares no aliasing). An op on them ran over
        strided memory, and only the same layout gives its bits again (LSTM cells' gates)."""
        args = op.arguments()
        inputs = [self.value(t, depth + 1) for t in op.inputs]
        if args is None or any(v is None for v in inputs):
            return None
        out = _invoke(op.name, args, inputs, golden=False)
        produced = _returned(op.name, *out) if out is not None else []
        if index >= len(produced) or tuple(produced[index].shape) != self.shapes.get(tid):
            return None
        return produced[index]

    # -- replaying -----------------------------------------------------------------------------
    def skip_reason(self, op: RecordedOp) -> str:
        """Why ``op`` cannot be replayed whatever the trace holds ("" when it can be tried)."""
        return static_skip_reason(op)

    def replay(self, op_id: int) -> OwnError | Skipped:
        """The own error of op ``op_id`` (its worst output), or why it was not replayed."""
        op = self.ops.get(op_id)
        if op is None:
            return Skipped(op_id, "no such op in the trace")
        reason = self.skip_reason(op)
        if reason:
            return Skipped(op_id, reason)
        args = op.arguments()
        assert args is not None  # skip_reason checked it
        if not op.outputs:
            return Skipped(op_id, "it returns no tensor (a Python number): nothing recorded to compare")
        stand_ins = self._stand_ins(op)
        missing = [t for t in op.inputs if not self.saved_value(t) and t not in stand_ins]
        if missing:
            return Skipped(op_id, f"its inputs were not saved (tensor {missing[0]})", data_missing=True)
        if not any(self.info.get(t, (0, 0, "", -1, ""))[4] for t in op.outputs):
            return Skipped(op_id, "its outputs were not saved", data_missing=True)
        held = self._make_room(op)
        if held >= _TRIM_BYTES:
            _release_freed_memory()  # what earlier ops freed, before this one's peak
        # Where bits matter (compare), at the capture's thread count; where they do not (check),
        # small ops on one thread and large ones on all.
        if self.small_on_one_thread:
            threads = 1 if self._elements(op) < _PARALLEL_ELEMENTS else None
        else:
            threads = self.threads
        with _threads(threads):
            results = [self._measure(call) for call in _calls(op, args)]
        if held >= _TRIM_BYTES:
            _release_freed_memory()
        failed = next((r for r in results if isinstance(r, str)), None)
        if failed is not None:
            return Skipped(op_id, failed)
        measured = [r for r in results if isinstance(r, OwnError)]
        if not measured:
            return Skipped(op_id, "no output to compare (none saved, or none floating)")
        return _combine(op_id, measured)

    def _stand_ins(self, op: RecordedOp) -> dict[int, torch.Tensor]:
        """Zeros for the unsaved bookkeeping inputs of a fused attention backward run without
        dropout (generator seed and offset, varlen offsets: capture keeps no statistics or data of
        them, being uninitialized memory where unused, as on the CPU in torch 2.1); the kernel does
        not read them then."""
        args = op.arguments()
        if not args or args.get("dropout_p", 0.0) != 0.0 or not _SCRATCH_NAMES.intersection(args):
            return {}
        out = {}
        for name in _SCRATCH_NAMES.intersection(args):
            ref = args[name]
            if not (isinstance(ref, dict) and isinstance(ref.get("tensor"), int) and 0 <= ref["tensor"] < len(op.inputs)):
                continue
            tid = op.inputs[ref["tensor"]]
            row = self.info.get(tid)
            dtype = getattr(torch, row[2], None) if row is not None else None
            if isinstance(dtype, torch.dtype) and not self.saved_value(tid):
                out[tid] = torch.zeros(self.shapes.get(tid, ()), dtype=dtype)
        return out

    def _make_room(self, op: RecordedOp) -> int:
        """Before replaying ``op``: evict the cached values it does not read, oldest first, until
        the cache and the op's recorded values fit in the cache's limit together (the cache gets
        what the op leaves), so that the cache never adds to the peak of a large op. Returns the
        bytes of the op's recorded values."""
        need = sum(self.sizes.get(t, 0) * _ITEM_BYTES.get(self.info.get(t, (0, 0, "", -1, ""))[2], 8)
                   for t in (*op.inputs, *op.outputs))
        if self._cache_bytes + need > self._cache_limit:
            reads = set(op.inputs)
            for tid in [t for t in self._cache if t not in reads]:
                old = self._cache.pop(tid)
                if old is not None:
                    self._cache_bytes -= old.numel() * old.element_size()
                if self._cache_bytes + need <= self._cache_limit:
                    break
        return need

    def _elements(self, op: RecordedOp) -> int:
        """Elements an op reads and writes, from the recorded shapes (to pick its thread count)."""
        return sum(self.sizes.get(t, 0) for t in (*op.inputs, *op.outputs))

    def run(self, op_id: int, inputs: Sequence[torch.Tensor], *, golden: bool = False) -> list[torch.Tensor] | None:
        """Run op ``op_id`` on ``inputs`` (in its recorded input order); its outputs in capture's
        order, or None when it cannot run. ``golden`` promotes floating values to float64."""
        op = self.ops[op_id]
        args = op.arguments()
        if args is None:
            return None
        out = _invoke(op.name, args, list(inputs), golden=golden)
        return None if out is None else _returned(op.name, *out)

    def run_ops(
        self, op_ids: Iterable[int], feed: Mapping[int, torch.Tensor] | None = None, *, golden: bool = False
    ) -> dict[int, torch.Tensor]:
        """Run several ops in execution order as one region: an input comes from ``feed``, else
        from an op run earlier in the region, else from the trace. Returns every output computed
        (tensor id -> value); an op that cannot run leaves its outputs out (and so its consumers').

        >>> outs = replayer.run_ops([10, 11, 12], golden=True)   # doctest: +SKIP
        """
        values: dict[int, torch.Tensor] = dict(feed or {})
        for op_id in sorted(op_ids):
            op = self.ops[op_id]
            inputs = [values[t] if t in values else self.value(t) for t in op.inputs]
            if any(v is None for v in inputs):
                continue
            produced = self.run(op_id, inputs, golden=golden)  # type: ignore[arg-type]
            if produced is None:
                continue
            values.update({t: v for t, v in zip(op.outputs, produced)})
        return values

    def _inputs(self, call: _Call) -> list[torch.Tensor | None]:
        """A call's recorded inputs, each tensor read once where the call reads it twice (``grad * grad``)."""
        loaded: dict[int, torch.Tensor | None] = dict(self._stand_ins(call.op))
        for tid in call.inputs:
            if tid not in loaded:
                loaded[tid] = self.value(tid)
        return [loaded[tid] for tid in call.inputs]

    def _measure(self, call: _Call) -> OwnError | str | None:
        """One call's own error (worst output), None when it has no output to compare, or a reason.

        Memory stays near what the call's recorded values take: the float64 copies of the
        inputs a replay does not return are dropped as soon as it ran, a pointwise call over many
        elements gets its float64 reference piece by piece (:func:`_spans`), and each output is
        measured piece by piece. The honest replay always runs whole, as the recorded call did.
        """
        op, info = call.op, self.info
        saved = [(i, t) for i, t in enumerate(call.outputs) if info.get(t, (0, 0, "", -1, ""))[4]]
        floating = [(i, t) for i, t in saved if _is_float(info[t][2])]
        integral = [(i, t) for i, t in saved if not _is_float(info[t][2])]
        if not floating and not (self.detail is not None and integral):
            return None
        inputs = self._inputs(call)
        if any(v is None for v in inputs):
            return "an input could not be read or rebuilt from its base"
        models = _reduced_models(op.name, inputs, self.reduced)
        honest_inputs = models[0] if models else inputs
        spans = None if models else _spans(op.name, inputs, [self.shapes.get(t) for t in call.outputs])
        order = _shared_order(inputs) if spans is not None else None
        first: list[torch.Tensor] | None = None  # the reference's first piece, where it is made in pieces
        if spans is not None:
            first = _outputs(op.name, call.args, _pieces_of(inputs, spans[0], order), golden=True)
            if first is None:  # the call needs its whole shape (a memory format, say): made whole
                spans = None
        reference = _outputs(op.name, call.args, inputs, golden=True) if spans is None else None
        if spans is None and reference is None:
            return "it does not run on the CPU in float64" + _last_error()
        honest = _outputs(op.name, call.args, honest_inputs, golden=False)
        if honest is None:
            return "it does not run on the CPU in its recorded dtypes" + _last_error()
        # At reduced precision: the other roundings of the inputs, and float32 itself (its
        # accumulation error is how closely a device can match any of these replays).
        alternatives = [_outputs(op.name, call.args, rounded, golden=False) for rounded in models[1:]]
        accumulated = _outputs(op.name, call.args, inputs, golden=False) if models else None
        if models and (accumulated is None or any(a is None for a in alternatives)):
            models, accumulated = [], None
        replays = [honest] + [a for a in alternatives if a is not None]
        basic = _correctly_rounded(op.name, call.args, inputs)
        if spans is None and not models:
            inputs.clear()  # no longer needed (the cache keeps the small ones)
        misrounded = False
        bitwise = True
        worst: OwnError | None = None
        fits = [0.0] * len(models)
        detail = _Detail() if self.detail is not None else None
        made = reference if reference is not None else first
        assert made is not None
        for position, tid in floating:
            if any(position >= len(r) for r in (made, *replays, *([accumulated] if accumulated is not None else []))):
                return "its replay returned fewer outputs than were recorded"
            recorded = self.value(tid)
            if recorded is None:
                return "a recorded output could not be read"
            if not _comparable(recorded, honest[position], made[position], spans[0][1] if spans is not None else None):
                return "its replay gave outputs of another shape or kind than recorded"
            if spans is not None:
                assert first is not None
                pieces = _Reference(first[position], call=(op.name, call.args, inputs, spans, position), order=order)
            else:
                assert reference is not None
                pieces = _Reference(reference[position])
            gauge = _Gauge(recorded, [r[position] for r in replays], accumulated[position] if accumulated is not None else None,
                           pieces)
            failed = gauge.run(detail, self.detail.get(info[tid][2], 4.0) if self.detail is not None else 0.0)
            if failed:
                return failed
            error, honest_error = gauge.errors()
            same = _same_bits(recorded, honest[position])
            bitwise = bitwise and (same or any(_same_bits(recorded, r[position]) for r in replays[1:]))
            if basic and not same:
                misrounded = True
            if models:
                unit = max(gauge.accumulated_error(), _FP32_UNIT)
                for m, fit in enumerate(gauge.fits()):
                    fits[m] = max(fits[m], fit / unit)
                # An honest kernel may round either way; truncation's error is biased and can be a
                # few times round-to-nearest's where terms cancel.
                honest_error = max([honest_error] + gauge.other_errors())
            if worst is None or _excess(error, honest_error) > _excess(worst.error, worst.honest):
                worst = OwnError(op.op_id, error, honest_error, info[tid][2])
            del recorded, gauge, pieces
        for position, tid in integral if detail is not None else ():
            recorded = self.value(tid)
            if recorded is None or position >= len(honest) or not isinstance(honest[position], torch.Tensor):
                return "a recorded integer output could not be compared"
            if recorded.shape != honest[position].shape:
                return "its replay gave outputs of another shape than recorded"
            assert detail is not None
            detail.integer_mismatch += int((recorded != honest[position].to(recorded.dtype)).sum())
            if worst is None:
                worst = OwnError(op.op_id, 0.0, 0.0, info[tid][2])
        if worst is None:
            return None
        extra = detail.fields() if detail is not None else {}
        del reference, first, made, honest, replays, alternatives, accumulated  # measured: the bound makes its own replays
        bounds = _bound_fits(op.name, call.args, [*models, inputs], [(p, self.value(t)) for p, t in floating]) if models else ()
        return OwnError(worst.op_id, worst.error, worst.honest, worst.dtype, misrounded=misrounded, fits=tuple(fits),
                        bounds=bounds, bitwise=bitwise and bool(floating), informative=not basic and worst.honest > 0,
                        **extra)


_ITEM_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
               "uint8": 1, "bool": 1}
# Before and after an op whose recorded values take this much, freed memory goes back to the system (see below).
_TRIM_BYTES = 16 << 20


def _release_freed_memory() -> None:
    """Hand memory that is free inside the C heap back to the system (glibc's ``malloc_trim``).

    A large replay frees hundreds of MB of tensors of all sizes; glibc keeps the heap's freed
    pages when a live block sits above them, so the resident size of a long replay creeps up by
    what its largest ops once took (~0.5 GB on GPT-2's embedding). Elsewhere a no-op."""
    trim = _MALLOC_TRIM[0]
    if trim is None:
        trim = False
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                trim = ctypes.CDLL(None).malloc_trim
            except (OSError, AttributeError):
                trim = False
        _MALLOC_TRIM[0] = trim
    if trim:
        trim(0)


_MALLOC_TRIM: list[Any] = [None]  # glibc's malloc_trim, once looked up (False where there is none)


# Below this many elements check runs an op on one thread: its work is too small to split, and
# entering a parallel region costs more than the op (far more when the cores are busy, as OpenMP's
# threads wait for each other). Above it, torch's intra-op threads serve the one big op.
_PARALLEL_ELEMENTS = 1 << 20


@contextmanager
def _threads(count: int | None) -> Iterator[None]:
    """Run one op's replay on ``count`` intra-op threads (as they are when ``None``)."""
    saved = torch.get_num_threads()
    if count is None or count == saved:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def static_skip_reason(op: RecordedOp) -> str:
    """Why ``op`` cannot be replayed from any trace ("" when it can be tried): what it is, not
    what the trace holds (see :class:`Replayer` for missing inputs)."""
    if op.kind != "op":
        return "not a computing op (a view, a source or an alias update)"
    if op.draws():
        return "random op: a replay would draw other numbers"
    if op.name.startswith(_UNINITIALIZED):
        return "uninitialized memory (empty): nothing to check"
    if op.name.startswith(_COLLECTIVES) or "all_reduce" in op.name or "all_gather" in op.name:
        return "collective: its result needs the other ranks"
    func = resolve(op.name)
    if func is None:
        return f"this torch has no operator {op.name} (a device-only op whose library is not loaded)"
    if not hasattr(func, "_schema"):
        return "operator without a schema"
    if op.name not in _REFERENCES and not _has_cpu_kernel(func):
        return "no CPU kernel (a device-only op; tracecmp.replay.register_reference gives it one)"
    args = op.arguments()
    if args is None:
        return "its arguments were not recorded"
    opaque = _opaque(args)
    if opaque:
        return f"it takes an object the trace could only name ({opaque})"
    return ""


def _opaque(value: Any) -> str:
    if isinstance(value, str) and value.startswith("<"):
        return value
    if isinstance(value, dict):
        return next((o for o in map(_opaque, value.values()) if o), "")
    if isinstance(value, list):
        return next((o for o in map(_opaque, value) if o), "")
    return ""


class _Detail:
    """Accumulates the element-level measurements of one call's outputs (``OwnError`` detail fields).

    Written for memory: beyond the reference, one float64 copy of the output and the spacing are
    alive at a time (in-place arithmetic, no masked copies); a large output is added piece by
    piece (:class:`_Gauge`), so that these copies are a piece's, not the output's.
    """

    def __init__(self) -> None:
        self.nonfinite = self.honest_nonfinite = self.elements = self.integer_mismatch = 0
        self.max_ulps = self.honest_max_ulps = 0.0
        self.beyond = self.honest_beyond = 0  # counts

    def add(self, recorded: torch.Tensor, honest: torch.Tensor, ref: torch.Tensor, finite: torch.Tensor, bound: float) -> None:
        """Count in the elements of ``recorded`` and ``honest`` (or of one piece of them) against
        ``ref``, the float64 reference of the same elements (``finite``: where it is finite)."""
        spacing = _ulp(ref, recorded.dtype)
        for name, value in (("", recorded), ("honest_", honest)):
            out = value.detach().to(torch.float64, copy=True)
            bad = torch.isfinite(out).logical_and_(finite).logical_not_()
            if bool(bad.any()):
                same = (out == ref).logical_or_(torch.isnan(out).logical_and_(torch.isnan(ref)))
                mismatch = int(bad.logical_and(same.logical_not_()).sum())
            else:
                mismatch = 0
            ulps = out.sub_(ref).abs_().div_(spacing).masked_fill_(bad, 0.0)
            top = float(ulps.max()) if ulps.numel() else 0.0
            over = int((ulps > bound).sum())
            del out, ulps, bad
            setattr(self, name + "nonfinite", getattr(self, name + "nonfinite") + mismatch)
            setattr(self, name + "max_ulps", max(getattr(self, name + "max_ulps"), top))
            setattr(self, name + "beyond", getattr(self, name + "beyond") + over)
        self.elements += recorded.numel()

    def fields(self) -> dict[str, Any]:
        total = max(self.elements, 1)
        return {"nonfinite": self.nonfinite, "honest_nonfinite": self.honest_nonfinite, "max_ulps": self.max_ulps,
                "honest_max_ulps": self.honest_max_ulps, "beyond": self.beyond / total,
                "honest_beyond": self.honest_beyond / total, "elements": self.elements,
                "integer_mismatch": self.integer_mismatch}


def _ulp(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at each element's magnitude (its subnormal spacing near zero)."""
    finfo = torch.finfo(dtype) if dtype.is_floating_point else torch.finfo(torch.float64)
    magnitude = ref.abs().nan_to_num_(nan=finfo.tiny, posinf=finfo.tiny).clamp_(min=finfo.tiny)
    _, exponent = torch.frexp(magnitude)
    return torch.ldexp(magnitude.fill_(finfo.eps), exponent.sub_(1))


def _combine(op_id: int, parts: list[OwnError]) -> OwnError:
    """One op's own error from its calls' (the list elements of a ``_foreach_*`` op)."""
    if len(parts) == 1:
        return parts[0]
    worst = max(parts, key=lambda p: _excess(p.error, p.honest))
    width = max(len(p.fits) for p in parts)
    fits = tuple(max((p.fits[m] for p in parts if m < len(p.fits)), default=0.0) for m in range(width))
    reach = max(len(p.bounds) for p in parts)
    bounds = tuple(max((p.bounds[m] for p in parts if m < len(p.bounds)), default=0.0) for m in range(reach))
    elements = sum(p.elements for p in parts)
    share = (lambda f: sum(getattr(p, f) * p.elements for p in parts) / elements) if elements else (lambda f: 0.0)
    return OwnError(
        op_id, worst.error, worst.honest, worst.dtype, misrounded=any(p.misrounded for p in parts), fits=fits,
        bounds=bounds, bitwise=all(p.bitwise for p in parts), informative=any(p.informative for p in parts),
        nonfinite=sum(p.nonfinite for p in parts), honest_nonfinite=sum(p.honest_nonfinite for p in parts),
        max_ulps=max(p.max_ulps for p in parts), honest_max_ulps=max(p.honest_max_ulps for p in parts),
        beyond=share("beyond"), honest_beyond=share("honest_beyond"), elements=elements,
        integer_mismatch=sum(p.integer_mismatch for p in parts),
    )


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaN where NaN is, same signed zeros).

    A NaN's payload and sign are no result: one kernel's vectorized and scalar loops make
    different NaN bits from the same NaN input (a bfloat16 division by 49 on CPU does), so only
    where NaN is counts.
    """
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return bool(torch.equal(a, b))
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}.get(a.element_size())
    if ints is None:
        return bool(torch.equal(a, b))
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return False
    if bool(nan_a.any()):
        a, b = a.masked_fill(nan_a, 0.0), b.masked_fill(nan_b, 0.0)
    return bool(torch.equal(a.contiguous().view(ints), b.contiguous().view(ints)))


# Ops whose every output element is a sum of products of one element of each operand (a bias
# added in): replayed on the operands' absolute values they give the sum of the terms' sizes,
# and on ones the number of terms.
_SUMS_OF_PRODUCTS = frozenset({
    "mm", "bmm", "addmm", "addmm_", "baddbmm", "addbmm", "matmul", "linear", "mv", "addmv", "dot", "vdot", "outer",
    "ger", "einsum", "tensordot", "convolution", "_convolution", "convolution_backward", "conv1d", "conv2d", "conv3d",
    "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
})


def _bound_fits(name: str, args: dict[str, Any], sets: list[list[torch.Tensor]],
                recorded: list[tuple[int, torch.Tensor | None]]) -> tuple[float, ...]:
    """Per input set (each rounding of the operands, then the operands as they are): the largest
    ratio, over the recorded outputs' elements, of the distance from a float64 replay on that set
    to :func:`_accumulation_bound`. () where the op is not a sum of products or a replay fails.
    The ratios are taken piece by piece (``_PIECE_ELEMENTS``): a piece's temporaries, not an output's."""
    if base_name(name) not in _SUMS_OF_PRODUCTS or any(r is None for _, r in recorded):
        return ()
    ones = _invoke(name, args, [torch.ones_like(x) if x.is_floating_point() else x for x in sets[-1]], golden=True)
    if ones is None:
        return ()
    counts = _returned(name, *ones)
    fits = []
    for inputs in sets:
        exact = _invoke(name, args, inputs, golden=True)
        sizes = _invoke(name, args, [x.abs() if x.is_floating_point() else x for x in inputs], golden=True)
        if exact is None or sizes is None:
            return ()
        exact_out, size_out = _returned(name, *exact), _returned(name, *sizes)
        worst = 0.0
        for position, value in recorded:
            if max(position, 0) >= min(len(exact_out), len(size_out), len(counts)):
                return ()
            center = exact_out[position]
            if value.shape != center.shape or counts[position].shape != center.shape or size_out[position].shape != center.shape:
                return ()
            flat = [t.reshape(-1) for t in (counts[position], size_out[position], center, value)]
            for start in range(0, center.numel(), _PIECE_ELEMENTS):
                count, size, middle, got = (t[start : start + _PIECE_ELEMENTS] for t in flat)
                if bool((~torch.isfinite(got) & torch.isfinite(middle)).any()):
                    return tuple([math.inf] * len(sets))
                bound = _accumulation_bound(count, size, middle)
                gap = (got.to(torch.float64) - middle).abs()
                finite = torch.isfinite(middle) & torch.isfinite(gap)
                if bool(finite.any()):
                    ratio = gap[finite] / bound[finite].clamp_min(_TINY)
                    worst = max(worst, float(ratio.max()))
            del flat
        del exact, sizes, exact_out, size_out  # before the next set's replays
        fits.append(worst)
    return tuple(fits)


def _accumulation_bound(count: torch.Tensor, size: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """How far a float32 result may lie from the exact sum of ``count`` products whose sizes add up
    to ``size``, whatever order and blocking a device sums them in: gamma(n) * size with gamma(n)
    = n * 2u / (1 - n * 2u), u float32's unit (2u: rounding toward zero, as some accumulators do,
    errs up to a whole unit), plus rounding the result itself. (The products of TF32- or
    bf16-rounded operands are exact in float32: 11 + 11 and 8 + 8 significant bits.)"""
    n = count.to(torch.float64).abs()
    unit = 2.0 * _FP32_UNIT
    gamma = (n * unit) / (1.0 - (n * unit).clamp_max(0.5))
    return gamma * size.abs() + _FP32_UNIT * exact.abs()


def _calls(op: RecordedOp, args: dict[str, Any]) -> list[_Call]:
    """The calls that make up ``op``: itself, or one per list element of a ``_foreach_*`` or fused
    optimizer op (elementwise per element, so memory stays that of one parameter, not the model's)."""
    whole = [_Call(op, args, tuple(op.inputs), tuple(op.outputs))]
    base = op.name.split(".")[1] if op.name.count(".") >= 2 else ""
    if not base.startswith(("_foreach_", "_fused_")):
        return whole
    func = resolve(op.name)
    schema = getattr(func, "_schema", None)
    if schema is None:
        return whole
    lists = {a.name: len(args[a.name]) for a in schema.arguments
             if a.name in args and isinstance(args[a.name], list) and str(a.real_type).startswith(("List[", "Optional[List["))}
    lengths = {n for n in lists.values() if n}
    if len(lengths) != 1:
        return whole
    (count,) = lengths
    if count < 2:
        return whole
    # Output groups in capture's order: list returns, then written list arguments.
    info = op_info(func)
    groups: list[int] = []
    for ret in schema.returns:
        if not str(ret.real_type).startswith("List["):
            return whole
        groups.append(count)
    for _, name in info.extra_writes:
        groups.append(lists.get(name, -1))
    if any(g not in (0, count) for g in groups) or sum(groups) != len(op.outputs):
        return whole
    calls = []
    for i in range(count):
        used: list[int] = []

        def pick(value: Any) -> Any:
            if isinstance(value, dict) and set(value) == {"tensor"}:
                index = value["tensor"]
                if not isinstance(index, int) or not 0 <= index < len(op.inputs):
                    raise ValueError
                used.append(op.inputs[index])
                return {"tensor": len(used) - 1}
            if isinstance(value, list):
                return [pick(v) for v in value]
            return value

        try:
            sub = {name: (pick([value[i]]) if name in lists and lists[name] == count else pick(value))
                   for name, value in args.items()}
        except ValueError:
            return whole
        outputs, offset = [], 0
        for size in groups:
            if size:
                outputs.append(op.outputs[offset + i])
            offset += size
        calls.append(_Call(op, sub, tuple(used), tuple(outputs)))
    return calls


def _reduced_models(name: str, inputs: list[torch.Tensor], reduced: str | None) -> list[list[torch.Tensor]]:
    """The inputs of a float32 matmul/conv rounded by each of ``REDUCED_MODELS[reduced]``, or []
    when the op does not run at reduced precision (another class, no float32 operand)."""
    if reduced is None:
        return []
    cls = classify(name)
    if not cls.precision_variable:
        return []
    positions = [i for i, x in enumerate(inputs) if x.dtype == torch.float32 and (not cls.operands or i in cls.operands)]
    if not positions:
        return []
    return [[_laid_out_as(x, rounding(x)) if i in positions else x for i, x in enumerate(inputs)]
            for _, rounding in REDUCED_MODELS[reduced]]


def _laid_out_as(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``values`` in ``x``'s memory layout: a kernel may sum in another order for a transposed
    operand (a weight's ``t()``), and the replay must take the path the run took."""
    out = torch.empty_like(x)
    out.copy_(values.reshape(x.shape))
    return out


# One correctly rounded IEEE 754 operation per element (alpha, when given, must be 1): on every
# conforming device these give the same bits.
_BASIC_OPS = frozenset(
    [f"aten.{name}.{overload}" for name in ("add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_")
     for overload in ("Tensor", "Scalar")] + ["aten.sqrt.default", "aten.sqrt_.default"]
)


def _correctly_rounded(name: str, args: dict[str, Any], inputs: list[torch.Tensor]) -> bool:
    """Whether the call is a basic IEEE operation in one float32/float64 dtype, on normal numbers."""
    if name not in _BASIC_OPS:
        return False
    if args.get("alpha", 1) != 1 or "rounding_mode" in args:
        return False
    floats = [x for x in inputs if x.is_floating_point()]
    if not floats or any(x.dtype not in (torch.float32, torch.float64) or x.dtype != floats[0].dtype for x in floats):
        return False
    # Devices that treat denormal inputs as zero (DAZ) legitimately differ on them.
    tiny = torch.finfo(floats[0].dtype).tiny
    return not any(bool(((x != 0) & (x.abs() < tiny)).any()) for x in floats)


def _round_tf32(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to TF32's 10-bit mantissa, to nearest even, on the bit pattern (finite values only)."""
    bits = x.contiguous().view(torch.int32)
    rounded = ((bits + 0x0FFF + ((bits >> 13) & 1)) & ~0x1FFF).view(torch.float32)
    return torch.where(torch.isfinite(x), rounded, x)


def _round_tf32_away(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to TF32 to nearest with ties away from zero (``cvt.rna.tf32.f32``)."""
    bits = x.contiguous().view(torch.int32)
    rounded = ((bits + 0x1000) & ~0x1FFF).view(torch.float32)
    return torch.where(torch.isfinite(x), rounded, x)


def _truncate_tf32(x: torch.Tensor) -> torch.Tensor:
    """``x`` with the 13 mantissa bits TF32 lacks cleared (round toward zero), as some hardware feeds its units."""
    return (x.contiguous().view(torch.int32) & ~0x1FFF).view(torch.float32)


def _round_bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float32)


def _truncate_bf16(x: torch.Tensor) -> torch.Tensor:
    bits = x.contiguous().view(torch.int32)
    return torch.where(torch.isnan(x), x, (bits & ~0xFFFF).view(torch.float32))


# The ways a float32 matmul/conv may round its inputs at reduced precision, TF32 ("high") or
# bf16 ("medium"): the first is the honest replay; the others are tried only to find which one
# a run used (OwnError.fits).
REDUCED_MODELS: dict[str, tuple[tuple[str, Callable[[torch.Tensor], torch.Tensor]], ...]] = {
    "tf32": (("to nearest even", _round_tf32), ("toward zero", _truncate_tf32), ("to nearest, ties away", _round_tf32_away)),
    "bf16": (("to nearest even", _round_bf16), ("toward zero", _truncate_bf16)),
}
_FP32_UNIT = float(torch.finfo(torch.float32).eps)


@dataclass(frozen=True, slots=True)
class _Scale:
    """A reference output in float64 and the magnitudes its errors are measured on (finite positions)."""

    ref: torch.Tensor
    finite: torch.Tensor
    all_finite: bool
    amax: float
    norm: float

    @classmethod
    def of(cls, reference: torch.Tensor) -> _Scale:
        ref = reference.detach().to(torch.float64)
        finite = torch.isfinite(ref)
        all_finite = bool(finite.all())
        amax, norm = _Size().add(ref, finite, all_finite).total()
        return cls(ref, finite, all_finite, amax, norm)

    def error(self, value: Any, center: torch.Tensor | None = None) -> float:
        """Relative error of ``value`` against the reference, or its distance from ``center`` on
        the reference's scale; inf for a non-tensor or a shape that differs."""
        if not isinstance(value, torch.Tensor) or value.shape != self.ref.shape:
            return math.inf
        if center is None:
            return _relative(value.detach(), self.ref, self.finite, self.amax, self.norm, self.all_finite)
        middle = center.detach().to(torch.float64)
        finite = torch.isfinite(middle)
        return _relative(value.detach(), middle, finite, self.amax, self.norm, bool(finite.all()))


# A pointwise call over more elements than this gets its float64 reference in pieces of this many
# elements, and any output larger than this is measured in such pieces: the float64 copies and
# the measurement's temporaries are then a piece's, not the output's. A multiple of every
# vector width, so that a piece's elements take the path they take in a whole call.
_PIECE_ELEMENTS = 1 << 21
# Elementwise ops that torch does not tag pointwise.
_ELEMENTWISE = frozenset({"aten._to_copy.default", "aten.copy.default", "aten.copy_.default"})


@lru_cache(maxsize=None)
def _pointwise(name: str) -> bool:
    """Whether each output element of ``name`` depends only on the input elements at its own
    position (torch's ``pointwise`` tag; a ``_foreach_`` op's list elements, where the op it
    applies to each is pointwise)."""
    if name in _ELEMENTWISE:
        return True
    func = resolve(name)
    if func is None:
        return False
    if torch.Tag.pointwise in getattr(func, "tags", ()):
        return True
    namespace, _, rest = name.partition(".")
    packet = rest.rpartition(".")[0]
    if namespace != "aten" or not packet.startswith("_foreach_"):
        return False
    single = getattr(torch.ops.aten, packet.removeprefix("_foreach_"), None)
    overloads = single.overloads() if single is not None else []
    return any(torch.Tag.pointwise in getattr(getattr(single, o), "tags", ()) for o in overloads)


def _spans(name: str, inputs: Sequence[torch.Tensor], shapes: Sequence[Sequence[int] | None]) -> list[tuple[int, int]] | None:
    """The flat ranges to make a call's float64 reference in, one at a time (see
    ``_PIECE_ELEMENTS``), or None to make it whole: a pointwise op whose outputs all have one
    shape and more elements than a piece, and whose inputs have that shape, dense in one memory
    order (contiguous, or all transposed alike: see :func:`_shared_order`), or are scalars (no
    broadcasting, so that a piece of every input makes that piece of the output)."""
    if not shapes or any(shape is None for shape in shapes):
        return None
    shape = tuple(shapes[0])  # type: ignore[arg-type]
    count = math.prod(shape)
    if count <= _PIECE_ELEMENTS or any(tuple(other) != shape for other in shapes):  # type: ignore[arg-type]
        return None
    if not inputs or not _pointwise(name):
        return None
    if any(x.dim() and tuple(x.shape) != shape for x in inputs):
        return None
    order = _shared_order(inputs)
    if any(x.dim() and not _in_order(x, order).is_contiguous() for x in inputs):
        return None
    return [(start, min(start + _PIECE_ELEMENTS, count)) for start in range(0, count, _PIECE_ELEMENTS)]


def _shared_order(inputs: Sequence[torch.Tensor]) -> list[int] | None:
    """The memory order of a call's first non-scalar input (None: logical order). Pieces run over
    memory in that order, where every input is laid out alike (a channels-last activation and its
    gradient), so that each piece is a view and its elements take the kernel path they take whole."""
    return next((memory_order(x) for x in inputs if x.dim()), None)


def _in_order(x: torch.Tensor, order: list[int] | None) -> torch.Tensor:
    return x.permute(order) if order is not None else x


def _flat(x: torch.Tensor, order: list[int] | None) -> torch.Tensor:
    """``x``'s elements in ``order`` (a view where ``x`` is laid out so, else a copy)."""
    return _in_order(x, order).reshape(-1)


def _pieces_of(inputs: Sequence[torch.Tensor], span: tuple[int, int], order: list[int] | None = None) -> list[torch.Tensor]:
    """The elements ``span`` of each input, flattened in ``order`` (scalars whole)."""
    start, stop = span
    return [_flat(x, order)[start:stop] if x.dim() else x for x in inputs]


def _outputs(name: str, args: dict[str, Any], inputs: list[torch.Tensor], *, golden: bool) -> list[torch.Tensor] | None:
    """A call's outputs in capture's order (see :func:`_invoke`), or None when it cannot run. The
    arguments it was called with go: a float64 replay's copies of inputs it does not return with them."""
    found = _invoke(name, args, inputs, golden=golden)
    return None if found is None else _returned(name, *found)


class _Reference:
    """One output's float64 reference: whole, or made piece by piece over flat spans of a
    pointwise call (``call``: its name, arguments, recorded inputs, spans, and which output;
    ``value`` is then the first piece), its elements in memory ``order`` (None: logical)."""

    def __init__(self, value: torch.Tensor, call: tuple[str, dict[str, Any], list[torch.Tensor], list[tuple[int, int]], int] | None = None,
                 order: list[int] | None = None) -> None:
        self.value = value
        self.call = call
        self.order = order
        self.spans: list[tuple[int, int]] | None = call[3] if call is not None else None

    def split(self, tensors: Sequence[Any]) -> None:
        """Measure a whole reference in pieces where it and ``tensors`` are large and contiguous."""
        count = self.value.numel()
        if self.call is None and count > _PIECE_ELEMENTS and all(
            isinstance(t, torch.Tensor) and t.is_contiguous() for t in (self.value, *tensors)
        ):
            self.spans = [(start, min(start + _PIECE_ELEMENTS, count)) for start in range(0, count, _PIECE_ELEMENTS)]

    def piece(self, index: int) -> torch.Tensor | None:
        """Piece ``index`` (the whole reference when there are no spans), None when it cannot be made."""
        if self.spans is None:
            return self.value
        if self.call is None:
            start, stop = self.spans[index]
            return self.value.view(-1)[start:stop]
        if index == 0:
            return self.value
        name, args, inputs, spans, position = self.call
        made = _outputs(name, args, _pieces_of(inputs, spans[index], self.order), golden=True)
        if made is None or position >= len(made) or made[position].shape != (spans[index][1] - spans[index][0],):
            return None
        return made[position]


class _Gauge:
    """One recorded output measured against its float64 reference, piece by piece: the relative
    errors of the recorded output, of each replay (the honest one first) and of float32's
    accumulation, how far the recorded output lies from each replay, and the element detail.
    On a reference in one piece this is what ``_Scale.error`` and ``_Detail.add`` give."""

    def __init__(self, recorded: torch.Tensor, replays: list[Any], accumulated: Any, reference: _Reference) -> None:
        self.recorded, self.replays, self.accumulated, self.reference = recorded, replays, accumulated, reference
        self.size = _Size()
        self.own = _Distance()
        self.from_reference = [_Distance() for _ in replays]  # each replay's error
        self.from_replays = [_Distance() for _ in replays] if accumulated is not None else []  # recorded from each
        self.unit = _Distance()
        # Replays of another kind or shape than the recorded output are infinitely far.
        usable = [isinstance(r, torch.Tensor) and r.shape == recorded.shape for r in replays]
        for distance, ok in zip(self.from_reference, usable):
            distance.infinite = not ok
        for distance, ok in zip(self.from_replays, usable):
            distance.infinite = not ok
        self.unit.infinite = accumulated is not None and not (
            isinstance(accumulated, torch.Tensor) and accumulated.shape == recorded.shape)
        reference.split([recorded, *(r for r, ok in zip(replays, usable) if ok),
                         *([accumulated] if accumulated is not None and not self.unit.infinite else [])])
        self.flat: dict[int, torch.Tensor] = {}  # flattened tensors (views where contiguous), for pieces

    def _piece(self, value: Any, span: tuple[int, int] | None) -> Any:
        if span is None or not isinstance(value, torch.Tensor):
            return value
        flat = self.flat.get(id(value))
        if flat is None:
            flat = self.flat[id(value)] = _flat(value, self.reference.order)
        return flat[span[0]:span[1]]

    def _pieces(self) -> Iterator[tuple[tuple[int, int] | None, torch.Tensor | None]]:
        spans = self.reference.spans
        for index, span in enumerate(spans if spans is not None else [None]):
            ref = self.reference.piece(index)
            yield span, None if ref is None else ref.detach().to(torch.float64)

    def run(self, detail: _Detail | None, bound: float) -> str:
        """Measure every piece; a reason when a piece of the reference could not be made, else ""."""
        for span, ref in self._pieces():
            if ref is None:
                return "its float64 replay failed on part of its elements" + _last_error()
            finite = torch.isfinite(ref)
            all_finite = bool(finite.all())
            self.size.add(ref, finite, all_finite)
            recorded = self._piece(self.recorded, span).detach()
            self.own.add(recorded, ref, finite, all_finite)
            for distance, replay in zip(self.from_reference, self.replays):
                if not distance.infinite:
                    distance.add(self._piece(replay, span).detach(), ref, finite, all_finite)
            if self.accumulated is not None and not self.unit.infinite:
                self.unit.add(self._piece(self.accumulated, span).detach(), ref, finite, all_finite)
            for distance, replay in zip(self.from_replays, self.replays):
                if not distance.infinite:
                    middle = self._piece(replay, span).detach().to(torch.float64)
                    middle_finite = torch.isfinite(middle)
                    distance.add(recorded, middle, middle_finite, bool(middle_finite.all()))
            if detail is not None:
                detail.add(recorded, self._piece(self.replays[0], span), ref, finite, bound)
        return ""

    def errors(self) -> tuple[float, float]:
        """(the recorded output's relative error, the honest replay's)."""
        amax, norm = self.size.total()
        error, honest = self.own.relative(amax, norm), self.from_reference[0].relative(amax, norm)
        if error > 0 and honest == 0 and self.recorded.is_floating_point() and all(
            ref is not None and _only_flushed(self._piece(self.recorded, span), ref) for span, ref in self._pieces()
        ):
            error = 0.0
        return error, honest

    def other_errors(self) -> list[float]:
        """The relative errors of the replays after the honest one (the other roundings)."""
        amax, norm = self.size.total()
        return [d.relative(amax, norm) for d in self.from_reference[1:]]

    def accumulated_error(self) -> float:
        """The relative error of the plain float32 replay (its accumulation error)."""
        return self.unit.relative(*self.size.total())

    def fits(self) -> list[float]:
        """How far the recorded output lies from each replay, on the reference's scale."""
        amax, norm = self.size.total()
        return [d.relative(amax, norm) for d in self.from_replays]


def _excess(error: float, honest: float) -> float:
    return error / honest if honest > 0 else (math.inf if error > 0 else 0.0)


def _is_float(dtype: str) -> bool:
    return dtype in ("float32", "float64", "float16", "bfloat16")


def _errors(recorded: torch.Tensor, honest: Any, reference: Any) -> tuple[float, float] | None:
    """(relative error of ``recorded``, relative error of ``honest``), both against ``reference``."""
    if not _comparable(recorded, honest, reference):
        return None
    return _errors_on(recorded, honest, _Scale.of(reference))


def _comparable(recorded: torch.Tensor, honest: Any, reference: Any, piece: int | None = None) -> bool:
    """Whether the replay gave tensors of the recorded output's shape (and not complex ones);
    ``piece``: the reference is the first piece, of that many elements, of a flattened one."""
    if not (isinstance(reference, torch.Tensor) and isinstance(honest, torch.Tensor) and not reference.is_complex()):
        return False
    if piece is not None:
        return recorded.shape == honest.shape and reference.shape == (piece,)
    return recorded.shape == reference.shape == honest.shape


def _errors_on(recorded: torch.Tensor, honest: torch.Tensor, scale: _Scale) -> tuple[float, float]:
    error, honest_error = scale.error(recorded), scale.error(honest)
    if error > 0 and honest_error == 0 and recorded.is_floating_point() and _only_flushed(recorded, scale.ref):
        error = 0.0
    return error, honest_error


def _only_flushed(recorded: torch.Tensor, ref: torch.Tensor) -> bool:
    """Whether ``recorded`` differs from ``ref`` only where it holds zero for a denormal. Where an
    op is exact (a max, a copy, a sum that needs no rounding) any difference is the op's doing,
    unless it is only denormals flushed to zero, as many accelerators do."""
    out = recorded.to(torch.float64)
    differs = out != ref
    return bool(((out[differs] == 0) & (ref[differs].abs() < torch.finfo(recorded.dtype).tiny)).all())


def _relative(value: torch.Tensor, ref: torch.Tensor, finite: torch.Tensor, scale: float, norm: float,
              all_finite: bool | None = None) -> float:
    """``max(max|v - ref| / max|ref|, ||v - ref|| / ||ref||)`` over the reference's finite
    positions; inf when NaN/Inf sit where the reference has none (or differ from its own).
    One float64 copy of ``value`` is made and worked on in place."""
    return _Distance().add(value, ref, finite, all_finite).relative(scale, norm)


def _total_norm(norms: list[float]) -> float:
    """The norm of a vector from the norms of its pieces (one piece: its own, unchanged)."""
    if not norms:
        return 0.0
    return norms[0] if len(norms) == 1 else math.hypot(*norms)


class _Size:
    """The largest magnitude and the norm of a reference's finite elements, added piece by piece."""

    __slots__ = ("amax", "norms")

    def __init__(self) -> None:
        self.amax = 0.0
        self.norms: list[float] = []

    def add(self, ref: torch.Tensor, finite: torch.Tensor, all_finite: bool) -> _Size:
        masked = ref if all_finite else torch.where(finite, ref, 0.0)
        amax = float(torch.linalg.vector_norm(masked, ord=math.inf)) if masked.numel() else 0.0
        if amax > 0:
            self.norms.append(float(torch.linalg.vector_norm(masked)))
        self.amax = max(self.amax, amax)
        return self

    def total(self) -> tuple[float, float]:
        """(largest magnitude, norm)."""
        return self.amax, _total_norm(self.norms) if self.amax > 0 else 0.0


class _Distance:
    """How far a value lies from a center (the float64 reference, or a replay), added piece by
    piece over the center's finite positions: the largest difference and the norm of the
    differences, or infinite where NaN/Inf sit where the center has none (or other ones)."""

    __slots__ = ("worst", "norms", "infinite")

    def __init__(self) -> None:
        self.worst = 0.0
        self.norms: list[float] = []
        self.infinite = False

    def add(self, value: torch.Tensor, center: torch.Tensor, finite: torch.Tensor, all_finite: bool | None = None) -> _Distance:
        if self.infinite:
            return self
        out = value.to(torch.float64, copy=True)
        if all_finite is None:
            all_finite = bool(finite.all())
        if not all_finite:
            special = ~finite
            got, want = out[special], center[special]
            if not bool(((got == want) | (torch.isnan(got) & torch.isnan(want))).all()):
                self.infinite = True
                return self
            out = torch.where(finite, out, 0.0)  # equal there: no difference
            center = torch.where(finite, center, 0.0)
        if not bool(torch.isfinite(out).all()):
            self.infinite = True
            return self
        diff = out.sub_(center).abs_()
        worst = float(diff.max()) if diff.numel() else 0.0
        if worst > 0.0:
            self.norms.append(float(torch.linalg.vector_norm(diff)))
        self.worst = max(self.worst, worst)
        return self

    def relative(self, scale: float, norm: float) -> float:
        """The distance relative to a reference of largest magnitude ``scale`` and norm ``norm``."""
        if self.infinite:
            return math.inf
        if self.worst == 0.0:
            return 0.0
        if scale == 0.0:
            return math.inf
        return max(self.worst / scale, _total_norm(self.norms) / max(norm, _TINY))


_LAST_ERROR: list[str] = [""]  # the message of the latest call that raised (for the skip reason)


def _last_error() -> str:
    text = _LAST_ERROR[0].strip().splitlines()[0][:160] if _LAST_ERROR[0].strip() else ""
    return f" ({text})" if text else ""


def _invoke(name: str, recorded: dict[str, Any], inputs: list[torch.Tensor], *, golden: bool) -> tuple[Any, tuple, dict] | None:
    """Run op ``name`` with ``recorded`` arguments on ``inputs``; ``golden`` promotes floating
    values to float64. Returns (result, args, kwargs) so written arguments can be read back, or None."""
    func = resolve(name)
    if func is None or not hasattr(func, "_schema"):
        return None
    call = decode_call(func, recorded, inputs, golden=golden)
    if call is None:
        return None
    args, kwargs = call
    target = _REFERENCES.get(name, func)
    try:
        with torch.no_grad():
            result = target(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - an op that will not run on the CPU or in float64 is simply not replayed
        _LAST_ERROR[0] = f"{type(exc).__name__}: {exc}"
        if golden or not any(isinstance(t, torch.Tensor) and t.dtype in _HALVES for t in inputs):
            return None
        return _invoke_widened(func, target, recorded, inputs)
    return result, tuple(args), kwargs


_HALVES = (torch.float16, torch.bfloat16)


def _invoke_widened(func: Any, target: Any, recorded: dict[str, Any], inputs: list[torch.Tensor]) -> tuple[Any, tuple, dict] | None:
    """An honest float16/bfloat16 kernel where this CPU has none (torch 2.1 lacks float16 matmul
    and softmax, for one): the op computed in float32 on the recorded inputs and each output
    rounded once to the dtype the op gives (read from its meta kernel), which is what such kernels
    do (they accumulate in float32). None when the output dtypes cannot be known."""
    from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

    def meta(v: Any) -> Any:
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta") if isinstance(v, torch.Tensor) else v

    wide = [t.float() if isinstance(t, torch.Tensor) and t.dtype in _HALVES else t for t in inputs]
    low = decode_call(func, recorded, inputs, golden=False)
    call = decode_call(func, recorded, wide, golden=False)
    if low is None or call is None:
        return None
    args, kwargs = call
    try:
        with torch.no_grad():
            shapes = func(*tree_map(meta, low[0]), **tree_map(meta, low[1]))  # dtypes of the low-precision call
            result = target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - not even in float32: not replayed (the first error is the reason)
        return None
    expected, _ = tree_flatten(shapes)
    flat, spec = tree_flatten(result)
    if len(expected) != len(flat):
        return None
    rounded = [v.to(m.dtype) if isinstance(v, torch.Tensor) and isinstance(m, torch.Tensor) else v
               for v, m in zip(flat, expected)]
    # Arguments the op wrote (in-place, out=) go back to their recorded dtypes too.
    back = {id(w): t.dtype for w, t in zip(wide, inputs) if isinstance(t, torch.Tensor) and w is not t}

    def narrow(v: Any) -> Any:
        return v.to(back[id(v)]) if isinstance(v, torch.Tensor) and id(v) in back else v

    return tree_unflatten(rounded, spec), tuple(tree_map(narrow, tuple(args))), tree_map(narrow, kwargs)


def _returned(name: str, result: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The op's tensors in the order capture numbered its outputs."""
    return outputs_in_order(resolve(name), result, args, kwargs)


# -- whole ranks -------------------------------------------------------------------------------
def replay_rank(
    rank: Any, op_ids: Iterable[int] | None = None, *, reduced: str | None = None,
    progress: Callable[[int], None] | None = None, workers: int = 1,
) -> dict[int, OwnError]:
    """Own errors of the ops ``op_ids`` (default: all) of a :class:`~tracecmp.trace.reader.RankTrace`.

    ``reduced`` as for :class:`Replayer`. Ops that could not be replayed are absent from the
    result (:func:`replay_ops` says why). Needs a trace with saved tensors; returns ``{}`` for a
    statistics-only trace.
    """
    found = replay_ops(rank, op_ids, reduced=reduced, progress=progress, workers=workers)
    return {op_id: own for op_id, own in found.items() if isinstance(own, OwnError)}


def replay_ops(
    rank: Any, op_ids: Iterable[int] | None = None, *, reduced: str | None = None,
    detail: Mapping[str, float] | None = None, progress: Callable[[int], None] | None = None,
    workers: int | None = 1, cache_bytes: int = _CACHE_BYTES, small_on_one_thread: bool = False,
) -> dict[int, OwnError | Skipped]:
    """Replay the computing ops ``op_ids`` (default: all) of a rank: ``{op_id: OwnError | Skipped}``.

    ``workers``: processes to spread the ops over (each opens the trace itself and runs
    ``cores / workers`` torch threads); ``None`` picks by the trace's size (one process for small
    traces, where starting workers costs more than it saves). ``progress(n)`` is called as ops
    finish (n ops since the previous call).

    >>> found = replay_ops(tracecmp.load("runs/target").rank(0), detail=ELEMENT_ULPS)  # doctest: +SKIP
    """
    if reduced not in (None, *REDUCED_MODELS):
        raise ValueError(f"reduced must be None or one of {sorted(REDUCED_MODELS)}, not {reduced!r}")
    table = rank.ops_table.select(["op_id", "kind"]).to_pydict()
    computing = {o for o, k in zip(table["op_id"], table["kind"]) if k == "op"}
    wanted = sorted(computing) if op_ids is None else sorted(o for o in set(op_ids) if o in computing)
    if not any(rank.tensors_table.column("data_key").to_pylist()) and not rank.data_files:
        return {}
    if workers is None:
        workers = auto_workers(len(wanted))
    if workers > 1 and len(wanted) > 1 and rank.manifest.get("chunks"):
        options = {"reduced": reduced, "detail": None if detail is None else dict(detail), "cache_bytes": cache_bytes,
                   "small_on_one_thread": small_on_one_thread}
        return run_in_workers(rank, wanted, "tracecmp.replay:Replayer.replay", options, workers=workers, progress=progress)
    results: dict[int, OwnError | Skipped] = {}
    with Replayer(rank, reduced=reduced, detail=detail, cache_bytes=cache_bytes, small_on_one_thread=small_on_one_thread) as replayer:
        if not replayer.has_data:
            return {}
        done = 0
        for op_id in wanted:
            results[op_id] = replayer.replay(op_id)
            done += 1
            if progress is not None and done % _PROGRESS_EVERY == 0:
                progress(_PROGRESS_EVERY)
        if progress is not None and done % _PROGRESS_EVERY:
            progress(done % _PROGRESS_EVERY)
    return results


_WORKER_MIN_OPS = 4000  # below this many ops, starting worker processes costs more than it saves


def auto_workers(ops: int) -> int:
    """Worker processes :func:`replay_ops` uses for ``ops`` ops when asked to choose: one per
    core (at most 8) for large traces, one otherwise; ``TRACECMP_REPLAY_WORKERS`` overrides."""
    forced = os.environ.get("TRACECMP_REPLAY_WORKERS", "")
    if forced.isdigit() and int(forced) > 0:
        return int(forced)
    if ops < _WORKER_MIN_OPS:
        return 1
    return max(1, min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1, 8))


def _rank_files(rank: Any) -> dict[str, Any]:
    """What a worker needs to open the rank itself: its folder, table files and data files."""
    folder = Path(rank.path)
    chunks = rank.manifest.get("chunks") or []
    ops = [str(folder / c["ops"]["file"]) for c in chunks if isinstance(c.get("ops"), dict)]
    tensors = [str(folder / c["tensors"]["file"]) for c in chunks if isinstance(c.get("tensors"), dict)]
    return {"path": str(folder), "rank": int(rank.rank), "ops": ops, "tensors": tensors,
            "data": {int(k): str(v) for k, v in rank.data_files.items()}}


class _WorkerRank:
    """A rank opened by a worker from files its parent already validated (no second CRC pass)."""

    def __init__(self, files: Mapping[str, Any]) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        from tracecmp.trace.schema import OPS_SCHEMA, TENSORS_SCHEMA

        self.path = Path(files["path"])
        self.rank = files["rank"]
        self.manifest: dict[str, Any] = {}
        self.data_files = {int(k): Path(v) for k, v in files["data"].items()}
        ops_columns = [c for c in OPS_SCHEMA.names if c not in ("stack", "location", "name")]
        ops_schema = pa.schema([OPS_SCHEMA.field(c) for c in ops_columns])
        self.ops_table = pa.concat_tables([pq.read_table(p, columns=ops_columns).cast(ops_schema) for p in files["ops"]])
        self.tensors_table = pa.concat_tables([pq.read_table(p).select(TENSORS_SCHEMA.names).cast(TENSORS_SCHEMA)
                                               for p in files["tensors"]])


_WORKER: dict[str, Any] = {}


def _worker_init(threads: int) -> None:
    torch.set_num_threads(max(1, threads))


def _worker_run(files: Mapping[str, Any], job: str, options: Mapping[str, Any], op_ids: list[int]) -> list[Any] | str:
    """One range of ops in a worker process: ``job`` ("module:Class.method") built once per worker
    on the rank with ``options``; a ``TracecmpError``'s message instead on bad input."""
    from importlib import import_module

    try:
        key = (files["path"], job, repr(sorted(options.items())))
        if _WORKER.get("key") != key:
            old = _WORKER.pop("worker", None)
            if old is not None and hasattr(old, "close"):
                old.close()
            module, _, name = job.partition(":")
            factory, _, method = name.partition(".")
            worker = getattr(import_module(module), factory)(_WorkerRank(files), **options)
            _WORKER.update(key=key, worker=worker, method=method)
        call = getattr(_WORKER["worker"], _WORKER["method"])
        return [call(op_id) for op_id in op_ids]
    except TracecmpError as exc:
        return str(exc)


def run_in_workers(
    rank: Any, op_ids: list[int], job: str, options: Mapping[str, Any], *, workers: int,
    progress: Callable[[int], None] | None = None,
) -> dict[int, Any]:
    """``{op_id: job(op_id)}`` computed by ``workers`` processes, each opening the rank itself.

    ``job`` names a class and method, ``"module:Class.method"``, built once per worker as
    ``Class(rank, **options)`` (:class:`Replayer` and ``replay``, say). The ops go out as
    contiguous ranges (neighbours share inputs, so each worker's cache keeps working), several
    per worker to balance the load; each worker runs ``torch.get_num_threads() // workers``
    threads. Processes are spawned, not forked: forking after torch started its thread pools can hang.
    """
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    files = _rank_files(rank)
    ranges = max(workers * 8, 1)
    size = max(1, math.ceil(len(op_ids) / ranges))
    parts = [op_ids[i : i + size] for i in range(0, len(op_ids), size)]
    threads = max(1, torch.get_num_threads() // workers)
    results: dict[int, Any] = {}
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=_worker_init, initargs=(threads,)) as pool:
        pending = {pool.submit(_worker_run, files, job, dict(options), part): part for part in parts}
        try:
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    part = pending.pop(future)
                    found = future.result()
                    if isinstance(found, str):
                        raise TraceFormatError(found)
                    results.update(zip(part, found))
                    if progress is not None:
                        progress(len(part))
        except BaseException:
            for future in pending:
                future.cancel()
            raise
    return results


def iter_ops(rank: Any, op_ids: Iterable[int] | None = None) -> Iterator[RecordedOp]:
    """The recorded ops of a rank as :class:`RecordedOp` records, in execution order."""
    table = rank.ops_table.select(["op_id", "kind", "op", "args", "inputs", "outputs", "random"]).to_pydict()
    wanted = None if op_ids is None else set(op_ids)
    for o, k, n, a, i, out, r in zip(
        table["op_id"], table["kind"], table["op"], table["args"], table["inputs"], table["outputs"], table["random"]
    ):
        if wanted is None or o in wanted:
            yield RecordedOp(o, k, n, a or "{}", list(i or ()), list(out or ()), bool(r))


# ---- regions -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RegionReplay:
    """A region's own error (tracecmp.comparison.records.Region): its recorded outputs against a
    float64 replay of its computation on its recorded inputs.

    The reference is the target's own ops replayed in order where the CPU can run them all (the
    fused op itself), else the bench's ops fed the target's inputs. ``sides_differ`` is how far the
    float64 replays of the two sides lie apart on the same inputs, when both ran: beyond float64's
    rounding it means the target computes another function than the bench (a fused kernel with
    another ``eps`` or scale), NaN when not both could run.
    """

    error: float
    honest: float  # the same for the replay in the recorded dtypes: an honest implementation's error
    dtype: str  # dtype of the output that decided it
    output: int  # target tensor id of that output
    reference: str  # "target" or "bench": whose ops the float64 reference ran
    sides_differ: float = math.nan


def replay_regions(target: Any, bench: Any | None, regions: Iterable[Any]) -> dict[int, RegionReplay]:
    """Replays of ``regions`` (tracecmp.comparison.records.Region) on the target's recorded inputs,
    by region id (see :class:`RegionReplay`); regions neither side can run are absent. ``bench``
    (its rank trace) is read only for values the bench's ops read that the target has no
    counterpart of, such as a mask buffer.

    >>> replays = replay_regions(tracecmp.load("runs/target").rank(0), tracecmp.load("runs/bench").rank(0), result.regions)  # doctest: +SKIP
    >>> replays[0].error, replays[0].honest, replays[0].sides_differ                                            # doctest: +SKIP
    (3.1e-08, 2.9e-08, 1.2e-16)
    """
    found: dict[int, RegionReplay] = {}
    with _Chain(target) as t_side, (_Chain(bench) if bench is not None else _NoChain()) as b_side:
        for region in regions:
            replay = _replay_region(t_side, b_side, region)
            if replay is not None:
                found[region.region_id] = replay
    return found


def _replay_region(t_side: _Chain, b_side: _Chain | _NoChain, region: Any) -> RegionReplay | None:
    outputs = [(T, B) for T, B in region.outputs]
    if not outputs or not region.target_ops:
        return None
    given = {T: t_side.value(T) for T, _ in region.inputs if T is not None}
    recorded = {T: t_side.value(T) for T, _ in outputs}
    if any(v is None for v in recorded.values()):
        return None
    golden_t = honest_t = golden_b = honest_b = None
    if all(v is not None for v in given.values()):
        golden_t = t_side.run(region.target_ops, given, [T for T, _ in outputs], golden=True)
        honest_t = t_side.run(region.target_ops, given, [T for T, _ in outputs], golden=False) if golden_t else None
    if region.bench_ops and isinstance(b_side, _Chain):
        fed = {B: given[T] for T, B in region.inputs if T is not None and B is not None and given.get(T) is not None}
        for T, B in region.inputs:
            if B is not None and B not in fed:
                value = b_side.value(B)  # a value only the bench reads here (a mask buffer)
                if value is not None:
                    fed[B] = value
        if len(fed) == len({B for _, B in region.inputs if B is not None}):
            # The bench's own dtypes: the target's values (bf16, say) cast to what the bench read.
            fed_cast = {B: v.to(b_side.dtype(B)) if b_side.dtype(B) and v.is_floating_point() else v for B, v in fed.items()}
            golden_b = b_side.run(region.bench_ops, fed_cast, [B for _, B in outputs], golden=True)
            if golden_b is not None and golden_t is None:
                honest_b = b_side.run(region.bench_ops, fed_cast, [B for _, B in outputs], golden=False)
    if golden_t is not None and honest_t is not None:
        reference, honest, source = golden_t, honest_t, "target"
        keys = {T: T for T, _ in outputs}
    elif golden_b is not None and honest_b is not None:
        reference, honest, source = golden_b, honest_b, "bench"
        keys = {T: B for T, B in outputs}
    else:
        return None
    worst: RegionReplay | None = None
    for T, _ in outputs:
        ref, hon, rec = reference.get(keys[T]), honest.get(keys[T]), recorded[T]
        if ref is None or hon is None or not rec.is_floating_point() or rec.numel() != ref.numel():
            continue
        ref, hon = ref.reshape(rec.shape), hon.reshape(rec.shape).to(rec.dtype)
        scale = _Scale.of(ref)
        error, honest_error = _errors_on(rec, hon, scale)
        if worst is None or _excess(error, honest_error) > _excess(worst.error, worst.honest):
            worst = RegionReplay(error, honest_error, str(rec.dtype).removeprefix("torch."), T, source)
    if worst is None:
        return None
    differ = math.nan
    if golden_t is not None and golden_b is not None and _same_inputs(t_side, b_side, region):
        gaps = []
        for T, B in outputs:
            a, b = golden_t.get(T), golden_b.get(B)
            if a is not None and b is not None and a.numel() == b.numel() and a.is_floating_point():
                gaps.append(_Scale.of(a).error(b.reshape(a.shape)))
        differ = max(gaps) if gaps else math.nan
    return RegionReplay(worst.error, worst.honest, worst.dtype, worst.output, worst.reference, differ)


def _same_inputs(t_side: _Chain, b_side: _Chain, region: Any) -> bool:
    """Both sides' ops read the same floating values from outside the region. A fused attention
    backward reads the forward's output and log-sum-exp where the eager chain reads the saved
    probabilities: both are rounded intermediates, and their float64 replays differ by that
    rounding whatever the functions."""
    def read(chain: _Chain, ops: Iterable[int]) -> set[int]:
        made = {t for o in ops for t in chain.ops[o].outputs}
        return {t for o in ops for t in chain.ops[o].inputs
                if t not in made and _is_float(chain.info.get(t, (0, 0, "", -1, ""))[2])}

    partner = {T: B for T, B in region.inputs if T is not None and B is not None}
    t_read, b_read = read(t_side, region.target_ops), read(b_side, region.bench_ops)
    return all(T in partner for T in t_read) and {partner[T] for T in t_read} == b_read


class _Chain:
    """One trace's ops, re-run in order on given values (a region's side), through a :class:`Replayer`
    (its bounded cache of recorded values and its way of running an op)."""

    def __init__(self, rank: Any) -> None:
        self.replayer = Replayer(rank)
        self.ops, self.info = self.replayer.ops, self.replayer.info

    def __enter__(self) -> _Chain:
        self.replayer.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.replayer.__exit__(*exc)

    def value(self, tid: int) -> torch.Tensor | None:
        """A recorded value (None when the trace did not save it)."""
        return self.replayer.value(tid)

    def dtype(self, tid: int) -> torch.dtype | None:
        name = self.info.get(tid, (0, 0, "", -1, ""))[2]
        value = getattr(torch, name, None) if name else None
        return value if isinstance(value, torch.dtype) else None

    def run(self, op_ids: Iterable[int], given: Mapping[int, torch.Tensor], wanted: list[int], *, golden: bool) -> dict[int, torch.Tensor] | None:
        """The values of ``wanted`` after running ``op_ids`` in order on ``given`` (in float64 with
        ``golden``, else in the recorded dtypes); None when an op cannot run (it draws random
        numbers, takes an opaque argument, or the CPU has no kernel for it)."""
        store: dict[int, torch.Tensor] = dict(given)
        for op_id in sorted(op_ids):
            op = self.ops.get(op_id)
            if op is None:
                return None
            if op.kind == "source":
                for t in op.outputs:
                    if t not in store:
                        value = self.value(t)
                        if value is None:
                            return None
                        store[t] = value
                continue
            if op.draws():
                return None
            inputs = []
            for t in op.inputs:
                value = store.get(t)
                if value is None:
                    value = self.value(t)  # read from outside the region as recorded
                if value is None:
                    return None
                inputs.append(value)
            produced = self.replayer.run(op_id, inputs, golden=golden)
            if produced is None:
                return None
            store.update(zip(op.outputs, produced))
        out = {t: store[t] for t in wanted if t in store}
        return out if len(out) == len(wanted) else None


class _NoChain:
    """Stands in for the bench's side when there is no bench trace to read."""

    def __enter__(self) -> _NoChain:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None
