"""The replayer: re-runs one rank's recorded ops on their recorded inputs, in float64 and in
their recorded dtypes, streaming inputs from the trace with a bounded cache.

>>> with Replayer(tracecmp.load("runs/target").rank(0)) as replayer:   # doctest: +SKIP
...     replayer.replay(42)
"""

from __future__ import annotations

import math
import sys
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch

from tracecmp.aten.rounding import FP32_UNIT, REDUCED_MODELS, correctly_rounded, reduced_models
from tracecmp.aten.schema import SCRATCH_NAMES
from tracecmp.numerics.replay.calls import calls_of, invoke, last_error, returned_tensors, static_skip_reason
from tracecmp.numerics.replay.measure import (
    Detail,
    Gauge,
    Reference,
    bound_fits,
    combine,
    comparable,
    excess,
    is_float,
    piece_spans,
    pieces_of,
    run_outputs,
    same_bits,
    shared_order,
)
from tracecmp.numerics.replay.records import Call, OwnError, RecordedOp, Skipped
from tracecmp.trace.saved import SavedTensors

CACHE_BYTES = 256 << 20  # recent recorded values kept while walking (the next op mostly reads them)


_RESHAPING_VIEWS = ("aten.view.default", "aten._unsafe_view.default", "aten._reshape_alias.default")


# Ops that return views of their input without declaring it (capture records their outputs as values).
_UNSAFE_VIEWS = frozenset(
    {"aten.unsafe_split.Tensor", "aten.unsafe_split_with_sizes.default", "aten.unsafe_chunk.default"}
)


_VIEW_DEPTH = 64  # views of views rebuilt from their base at most this deep (then: not replayed)


@dataclass(frozen=True)
class _Runs:
    """One call's replays (:meth:`Replayer._replays`)."""

    inputs: list[torch.Tensor]  # as recorded (emptied where nothing needs them any more)
    models: list[list[torch.Tensor]]  # the inputs rounded as a reduced-precision device may (none: full)
    spans: list[tuple[int, int]] | None  # the pieces the float64 reference is made in (None: whole)
    order: list[int] | None  # the memory order the pieces run in
    first: list[torch.Tensor] | None  # the float64 reference's first piece, where it is made in pieces
    reference: list[torch.Tensor] | None  # the float64 reference, where it is made whole
    honest: list[torch.Tensor]  # the replay in the recorded dtypes
    replays: list[list[torch.Tensor]]  # the honest replay, then those on the inputs' other roundings
    accumulated: list[torch.Tensor] | None  # float32 itself on unrounded inputs, at reduced precision
    basic: bool  # a basic IEEE operation: every IEEE 754 device gives its correctly rounded result


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
        self,
        rank: Any,
        *,
        reduced: str | None = None,
        detail: Mapping[str, float] | None = None,
        cache_bytes: int = CACHE_BYTES,
        small_on_one_thread: bool = False,
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
        self.sizes: dict[int, int] = {
            t: math.prod(shape or ()) for t, shape in zip(tensors["tensor_id"], tensors["shape"])
        }
        self.shapes: dict[int, tuple[int, ...]] = {
            t: tuple(shape or ()) for t, shape in zip(tensors["tensor_id"], tensors["shape"])
        }
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
                table["op_id"],
                table["kind"],
                table["op"],
                table["args"],
                table["inputs"],
                table["outputs"],
                table["random"],
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
        out = invoke(op.name, args, inputs, golden=False)
        if out is None and op.name in _RESHAPING_VIEWS and isinstance(args.get("size"), list) and inputs:
            # Saved values are contiguous copies: a view the run could take of a strided base
            # (a permuted attention output) may need a reshape of the copy, which holds the same values.
            try:
                return inputs[0].reshape(args["size"])
            except RuntimeError:
                return None
        if out is None:
            return None
        produced = returned_tensors(op.name, *out)
        return produced[index] if index < len(produced) else None

    def _unsafe_view(self, op: RecordedOp, index: int, tid: int, depth: int) -> torch.Tensor | None:
        """Output ``index`` of an ``unsafe_split``-like op remade from its input: views in memory
        that capture saved as copies (the op declares no aliasing). An op on them ran over
        strided memory, and only the same layout gives its bits again (LSTM cells' gates)."""
        args = op.arguments()
        inputs = [self.value(t, depth + 1) for t in op.inputs]
        if args is None or any(v is None for v in inputs):
            return None
        out = invoke(op.name, args, inputs, golden=False)
        produced = returned_tensors(op.name, *out) if out is not None else []
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
            results = [self._measure(call) for call in calls_of(op, args)]
        if held >= _TRIM_BYTES:
            _release_freed_memory()
        failed = next((r for r in results if isinstance(r, str)), None)
        if failed is not None:
            return Skipped(op_id, failed)
        measured = [r for r in results if isinstance(r, OwnError)]
        if not measured:
            return Skipped(op_id, "no output to compare (none saved, or none floating)")
        return combine(op_id, measured)

    def _stand_ins(self, op: RecordedOp) -> dict[int, torch.Tensor]:
        """Zeros for the unsaved bookkeeping inputs of a fused attention backward run without
        dropout (generator seed and offset, varlen offsets: capture keeps no statistics or data of
        them, being uninitialized memory where unused, as on the CPU in torch 2.1); the kernel does
        not read them then."""
        args = op.arguments()
        if not args or args.get("dropout_p", 0.0) != 0.0 or not SCRATCH_NAMES.intersection(args):
            return {}
        out = {}
        for name in SCRATCH_NAMES.intersection(args):
            ref = args[name]
            if not (
                isinstance(ref, dict) and isinstance(ref.get("tensor"), int) and 0 <= ref["tensor"] < len(op.inputs)
            ):
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
        need = sum(
            self.sizes.get(t, 0) * _ITEM_BYTES.get(self.info.get(t, (0, 0, "", -1, ""))[2], 8)
            for t in (*op.inputs, *op.outputs)
        )
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
        out = invoke(op.name, args, list(inputs), golden=golden)
        return None if out is None else returned_tensors(op.name, *out)

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

    def _inputs(self, call: Call) -> list[torch.Tensor | None]:
        """A call's recorded inputs, each tensor read once where the call reads it twice (``grad * grad``)."""
        loaded: dict[int, torch.Tensor | None] = dict(self._stand_ins(call.op))
        for tid in call.inputs:
            if tid not in loaded:
                loaded[tid] = self.value(tid)
        return [loaded[tid] for tid in call.inputs]

    def _measure(self, call: Call) -> OwnError | str | None:
        """One call's own error (worst output), None when it has no output to compare, or a reason.

        Memory stays near what the call's recorded values take: the float64 copies of the
        inputs a replay does not return are dropped as soon as it ran, a pointwise call over many
        elements gets its float64 reference piece by piece (:func:`piece_spans`), and each output is
        measured piece by piece. The honest replay always runs whole, as the recorded call did.
        """
        op, info = call.op, self.info
        saved = [(i, t) for i, t in enumerate(call.outputs) if info.get(t, (0, 0, "", -1, ""))[4]]
        floating = [(i, t) for i, t in saved if is_float(info[t][2])]
        integral = [(i, t) for i, t in saved if not is_float(info[t][2])]
        if not floating and not (self.detail is not None and integral):
            return None
        runs = self._replays(call)
        if isinstance(runs, str):
            return runs
        models, inputs, honest, replays, basic = runs.models, runs.inputs, runs.honest, runs.replays, runs.basic
        misrounded = False
        bitwise = True
        worst: OwnError | None = None
        fits = [0.0] * len(models)
        detail = Detail() if self.detail is not None else None
        for position, tid in floating:
            measured = self._gauge(call, runs, position, tid, detail)
            if isinstance(measured, str):
                return measured
            recorded, gauge = measured
            error, honest_error = gauge.errors()
            same = same_bits(recorded, honest[position])
            bitwise = bitwise and (same or any(same_bits(recorded, r[position]) for r in replays[1:]))
            if basic and not same:
                misrounded = True
            if models:
                unit = max(gauge.accumulated_error(), FP32_UNIT)
                for m, fit in enumerate(gauge.fits()):
                    fits[m] = max(fits[m], fit / unit)
                # An honest kernel may round either way; truncation's error is biased and can be a
                # few times round-to-nearest's where terms cancel.
                honest_error = max([honest_error] + gauge.other_errors())
            if worst is None or excess(error, honest_error) > excess(worst.error, worst.honest):
                worst = OwnError(op.op_id, error, honest_error, info[tid][2])
            del recorded, gauge, measured
        outcome = self._compare_integers(op.op_id, integral if detail is not None else [], honest, detail, worst)
        if not isinstance(outcome, OwnError):
            return outcome  # None: no output compared; else why the integer outputs could not be
        worst = outcome
        extra = detail.fields() if detail is not None else {}
        del runs, honest, replays  # measured: the bound makes its own replays
        bounds = (
            bound_fits(op.name, call.args, [*models, inputs], [(p, self.value(t)) for p, t in floating])
            if models
            else ()
        )
        return OwnError(
            worst.op_id,
            worst.error,
            worst.honest,
            worst.dtype,
            misrounded=misrounded,
            fits=tuple(fits),
            bounds=bounds,
            bitwise=bitwise and bool(floating),
            informative=not basic and worst.honest > 0,
            **extra,
        )

    def _replays(self, call: Call) -> _Runs | str:
        """The call replayed on its recorded inputs: in float64 (whole, or its first piece where it
        is made in pieces), honestly in its recorded dtypes, and on the inputs' other roundings at
        reduced precision; or why it cannot be."""
        op = call.op
        inputs = self._inputs(call)
        if any(v is None for v in inputs):
            return "an input could not be read or rebuilt from its base"
        models = reduced_models(op.name, inputs, self.reduced)
        honest_inputs = models[0] if models else inputs
        spans = None if models else piece_spans(op.name, inputs, [self.shapes.get(t) for t in call.outputs])
        order = shared_order(inputs) if spans is not None else None
        first: list[torch.Tensor] | None = None  # the reference's first piece, where it is made in pieces
        if spans is not None:
            first = run_outputs(op.name, call.args, pieces_of(inputs, spans[0], order), golden=True)
            if first is None:  # the call needs its whole shape (a memory format, say): made whole
                spans = None
        reference = run_outputs(op.name, call.args, inputs, golden=True) if spans is None else None
        if spans is None and reference is None:
            return "it does not run on the CPU in float64" + last_error()
        honest = run_outputs(op.name, call.args, honest_inputs, golden=False)
        if honest is None:
            return "it does not run on the CPU in its recorded dtypes" + last_error()
        # At reduced precision: the other roundings of the inputs, and float32 itself (its
        # accumulation error is how closely a device can match any of these replays).
        alternatives = [run_outputs(op.name, call.args, rounded, golden=False) for rounded in models[1:]]
        accumulated = run_outputs(op.name, call.args, inputs, golden=False) if models else None
        if models and (accumulated is None or any(a is None for a in alternatives)):
            models, accumulated = [], None
        replays = [honest] + [a for a in alternatives if a is not None]
        basic = correctly_rounded(op.name, call.args, inputs)
        if spans is None and not models:
            inputs.clear()  # no longer needed (the cache keeps the small ones)
        return _Runs(inputs, models, spans, order, first, reference, honest, replays, accumulated, basic)

    def _gauge(
        self, call: Call, runs: _Runs, position: int, tid: int, detail: Detail | None
    ) -> tuple[torch.Tensor, Gauge] | str:
        """The recorded output ``tid`` (at ``position``) measured against the replays; or why it cannot be."""
        made = runs.reference if runs.reference is not None else runs.first
        assert made is not None
        accumulated, spans = runs.accumulated, runs.spans
        if any(position >= len(r) for r in (made, *runs.replays, *([accumulated] if accumulated is not None else []))):
            return "its replay returned fewer outputs than were recorded"
        recorded = self.value(tid)
        if recorded is None:
            return "a recorded output could not be read"
        if not comparable(recorded, runs.honest[position], made[position], spans[0][1] if spans is not None else None):
            return "its replay gave outputs of another shape or kind than recorded"
        if spans is not None:
            assert runs.first is not None
            pieces = Reference(
                runs.first[position], call=(call.op.name, call.args, runs.inputs, spans, position), order=runs.order
            )
        else:
            assert runs.reference is not None
            pieces = Reference(runs.reference[position])
        gauge = Gauge(
            recorded,
            [r[position] for r in runs.replays],
            accumulated[position] if accumulated is not None else None,
            pieces,
        )
        failed = gauge.run(detail, self.detail.get(self.info[tid][2], 4.0) if self.detail is not None else 0.0)
        if failed:
            return failed
        return recorded, gauge

    def _compare_integers(
        self,
        op_id: int,
        integral: list[tuple[int, int]],
        honest: list[torch.Tensor],
        detail: Detail | None,
        worst: OwnError | None,
    ) -> OwnError | str | None:
        """Count the elements of the recorded integer outputs ``integral`` that differ from the
        honest replay's (into ``detail``): ``worst``, or one for them where it is None; or why
        they cannot be compared."""
        for position, tid in integral:
            recorded = self.value(tid)
            if recorded is None or position >= len(honest) or not isinstance(honest[position], torch.Tensor):
                return "a recorded integer output could not be compared"
            if recorded.shape != honest[position].shape:
                return "its replay gave outputs of another shape than recorded"
            assert detail is not None
            detail.integer_mismatch += int((recorded != honest[position].to(recorded.dtype)).sum())
            if worst is None:
                worst = OwnError(op_id, 0.0, 0.0, self.info[tid][2])
        return worst


_ITEM_BYTES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


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
