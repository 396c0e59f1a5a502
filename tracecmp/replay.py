"""Replay: re-run each recorded op on its own recorded inputs in float64 and measure its own error.

With whole tensors in a trace (``data="tensors"``) every op's inputs are known exactly, so the op
can be run again on the CPU: in float64, as the *reference*, and in the dtypes it was recorded in,
as an *honest* implementation (the two-standard check of msprobe's run_ut pre-check; the FX
Numeric Suite's shadow mode has the same aim). How far the recorded output lies from the
reference is the op's *own* error, free of whatever its inputs inherited; how far the honest
replay lies from it is the error a correct kernel makes on these very inputs, sums that cancel
and low-precision dtypes included. A fault far smaller than the noise a device adds upstream (a
TF32 matmul before a GELU) thus still stands out at the op that made it.

Errors are normwise: ``max(max|x - ref| / max|ref|, ||x - ref|| / ||ref||)`` over the op's worst
floating output. Positions where both hold the same NaN/Inf count as equal; a NaN/Inf on one side
only is an infinite error.

A float32 matmul/conv that may have run at reduced precision (TF32, or bf16 under
``set_float32_matmul_precision("medium")``) is replayed with its inputs rounded to nearest and
toward zero, and in plain float32; ``OwnError.fits`` says how far the recorded output lies from
each rounded replay in float32 accumulation errors, so that localize can learn which rounding the
run used from its other calls and hold each call to it.

Views carry no data of their own and are recomputed from their base by replaying the view op.
Ops that are not replayed: random ops that drew numbers (they would draw others), uninitialized allocations,
ops whose arguments the trace could not record (opaque objects), ops without a schema, ops whose
inputs were not saved, and ops that refuse float64 (some vendor kernels): the caller treats those
as "not replayed", never as "correct".

>>> own = replay_rank(tracecmp.load("runs/target").rank(0))   # doctest: +SKIP
>>> own[42].error, own[42].honest                            # doctest: +SKIP
(1.0e-06, 3.1e-08)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch

from tracecmp.trace import boundedjson
from tracecmp.aten.args import decode_call
from tracecmp.aten.opclass import base_name, classify, draws_random
from tracecmp.aten.schema import outputs_in_order, resolve
from tracecmp.trace.saved import SavedTensors

_CACHE_BYTES = 512 << 20  # recorded values kept in memory while walking (inputs are mostly recent)
_UNINITIALIZED = ("aten.empty", "aten.new_empty", "aten.empty_like", "aten.empty_strided", "aten._empty")
_VIEW_DEPTH = 64  # views of views rebuilt from their base at most this deep (then: not replayed)
_TINY = 1e-300


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


@dataclass(slots=True)
class _Op:
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


def replay_rank(
    rank: Any, op_ids: Iterable[int] | None = None, *, reduced: str | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[int, OwnError]:
    """Own errors of the ops ``op_ids`` (default: all) of a :class:`~tracecmp.trace.reader.RankTrace`.

    ``reduced`` ("tf32" or "bf16"): the run may have computed float32 matmul/conv at that
    precision, so their honest replay multiplies inputs rounded to it (round to nearest even):
    where a product's terms cancel, the reduced precision's own error is that much larger than
    float32's. Ops that could not be replayed are absent from the result. Needs a trace with saved
    tensors; returns ``{}`` for a statistics-only trace.
    """
    if reduced not in (None, *REDUCED_MODELS):
        raise ValueError(f"reduced must be None or one of {sorted(REDUCED_MODELS)}, not {reduced!r}")
    tensors = rank.tensors_table.select(["tensor_id", "op_id", "index", "dtype", "view_of", "data_key"]).to_pydict()
    if not any(tensors["data_key"]):
        return {}
    info = {
        t: (op, idx, dtype, -1 if view is None else view, key)
        for t, op, idx, dtype, view, key in zip(
            tensors["tensor_id"], tensors["op_id"], tensors["index"], tensors["dtype"], tensors["view_of"], tensors["data_key"]
        )
    }
    table = rank.ops_table.select(["op_id", "kind", "op", "args", "inputs", "outputs", "random"]).to_pydict()
    ops = {
        o: _Op(o, k, n, a or "{}", list(i or ()), list(out or ()), bool(r))
        for o, k, n, a, i, out, r in zip(
            table["op_id"], table["kind"], table["op"], table["args"], table["inputs"], table["outputs"], table["random"]
        )
    }
    wanted = sorted(ops) if op_ids is None else sorted(o for o in set(op_ids) if o in ops)
    results: dict[int, OwnError] = {}
    with SavedTensors(rank) as saved:
        values = _Values(saved, info, ops)
        for count, op_id in enumerate(wanted, 1):
            if progress is not None and count % 1000 == 0:
                progress(1000)
            op = ops[op_id]
            if op.kind != "op" or op.draws() or op.name.startswith(_UNINITIALIZED):
                continue
            own = _replay_one(op, values, info, reduced)
            if own is not None:
                results[op_id] = own
    return results


class _Values:
    """Recorded values by tensor id: loaded from the trace, or recomputed for views."""

    def __init__(self, saved: SavedTensors, info: Mapping[int, tuple], ops: Mapping[int, _Op]) -> None:
        self.saved, self.info, self.ops = saved, info, ops
        self.cache: dict[int, torch.Tensor | None] = {}
        self.bytes = 0

    def get(self, tid: int, depth: int = 0) -> torch.Tensor | None:
        if tid in self.cache:
            return self.cache[tid]
        value = self._load(tid, depth)
        if self.bytes > _CACHE_BYTES:
            self.cache.clear()
            self.bytes = 0
        self.cache[tid] = value
        if value is not None:
            self.bytes += value.numel() * value.element_size()
        return value

    def _load(self, tid: int, depth: int) -> torch.Tensor | None:
        row = self.info.get(tid)
        if row is None:
            return None
        producer, index, _, view_of, key = row
        if key:
            return self.saved.get(key)
        if view_of < 0 or depth > _VIEW_DEPTH:
            return None
        op = self.ops.get(producer)
        if op is None:
            return None
        # A view holds no data: make it again from its base with the same view op.
        inputs = [self.get(t, depth + 1) for t in op.inputs]
        if any(v is None for v in inputs):
            return None
        out = _call(op, inputs, golden=False)
        if out is None:
            return None
        produced = _returned(op.name, out[0], out[1], out[2])
        return produced[index] if index < len(produced) else None


def _replay_one(op: _Op, values: _Values, info: Mapping[int, tuple], reduced: str | None) -> OwnError | None:
    """The own error of one op (its worst floating output), or None when it cannot be replayed."""
    checked = [(i, t) for i, t in enumerate(op.outputs) if info.get(t, (0, 0, "", -1, ""))[4] and _is_float(info[t][2])]
    if not checked:
        return None
    inputs = [values.get(t) for t in op.inputs]
    if any(v is None for v in inputs):
        return None
    models = _reduced_models(op, inputs, reduced)
    honest_inputs = models[0] if models else inputs
    golden, same = _call(op, inputs, golden=True), _call(op, honest_inputs, golden=False)
    if golden is None or same is None:
        return None
    reference, honest = _returned(op.name, *golden), _returned(op.name, *same)
    # At reduced precision: the other roundings of the inputs, and float32 itself (its
    # accumulation error is how closely a device can match any of these replays).
    alternatives = [_call(op, rounded, golden=False) for rounded in models[1:]]
    plain = _call(op, inputs, golden=False) if models else None
    if models and (plain is None or any(a is None for a in alternatives)):
        models = []
    replays = [honest] + [_returned(op.name, *a) for a in alternatives if a is not None]
    accumulated = _returned(op.name, *plain) if plain is not None else []
    basic = _correctly_rounded(op, inputs)
    misrounded = False
    bitwise = True
    worst: OwnError | None = None
    fits = [0.0] * len(models)
    for position, tid in checked:
        if any(position >= len(r) for r in (reference, *replays, *([accumulated] if models else []))):
            return None
        recorded = values.get(tid)
        if recorded is None:
            return None
        if not _comparable(recorded, honest[position], reference[position]):
            return None
        scale = _Scale.of(reference[position])
        errors = _errors_on(recorded, honest[position], scale)
        same = _same_bits(recorded, honest[position])
        bitwise = bitwise and (same or any(_same_bits(recorded, r[position]) for r in replays[1:]))
        if basic and not same:
            misrounded = True
        if models:
            unit = max(scale.error(accumulated[position]), _FP32_UNIT)
            for m, replay in enumerate(replays):
                fits[m] = max(fits[m], scale.error(recorded, center=replay[position]) / unit)
            # An honest kernel may round either way; truncation's error is biased and can be a
            # few times round-to-nearest's where terms cancel.
            errors = (errors[0], max([errors[1]] + [scale.error(replay[position]) for replay in replays[1:]]))
        if worst is None or _excess(*errors) > _excess(worst.error, worst.honest):
            worst = OwnError(op.op_id, errors[0], errors[1], info[tid][2])
    if worst is None:
        return None
    bounds = _bound_fits(op, [*models, inputs], [(p, values.get(t)) for p, t in checked]) if models else ()
    return OwnError(worst.op_id, worst.error, worst.honest, worst.dtype, misrounded=misrounded, fits=tuple(fits),
                    bounds=bounds, bitwise=bitwise, informative=not basic and worst.honest > 0)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaN where NaN is, same signed zeros)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return bool(torch.equal(a, b))
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}.get(a.element_size())
    if ints is None:
        return bool(torch.equal(a, b))
    return bool(torch.equal(a.contiguous().view(ints), b.contiguous().view(ints)))


# Ops whose every output element is a sum of products of one element of each operand (a bias
# added in): replayed on the operands' absolute values they give the sum of the terms' sizes,
# and on ones the number of terms.
_SUMS_OF_PRODUCTS = frozenset({
    "mm", "bmm", "addmm", "addmm_", "baddbmm", "addbmm", "matmul", "linear", "mv", "addmv", "dot", "vdot", "outer",
    "ger", "einsum", "tensordot", "convolution", "_convolution", "convolution_backward", "conv1d", "conv2d", "conv3d",
    "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
})


def _bound_fits(op: _Op, sets: list[list[torch.Tensor]], recorded: list[tuple[int, torch.Tensor | None]]) -> tuple[float, ...]:
    """Per input set (each rounding of the operands, then the operands as they are): the largest
    ratio, over the recorded outputs' elements, of the distance from a float64 replay on that set
    to :func:`_accumulation_bound`. () where the op is not a sum of products or a replay fails."""
    if base_name(op.name) not in _SUMS_OF_PRODUCTS or any(r is None for _, r in recorded):
        return ()
    ones = _call(op, [torch.ones_like(x) if x.is_floating_point() else x for x in sets[-1]], golden=True)
    if ones is None:
        return ()
    counts = _returned(op.name, *ones)
    fits = []
    for inputs in sets:
        exact = _call(op, inputs, golden=True)
        sizes = _call(op, [x.abs() if x.is_floating_point() else x for x in inputs], golden=True)
        if exact is None or sizes is None:
            return ()
        exact_out, size_out = _returned(op.name, *exact), _returned(op.name, *sizes)
        worst = 0.0
        for position, value in recorded:
            if max(position, 0) >= min(len(exact_out), len(size_out), len(counts)):
                return ()
            center = exact_out[position]
            if value.shape != center.shape:
                return ()
            bound = _accumulation_bound(counts[position], size_out[position], center)
            gap = (value.to(torch.float64) - center).abs()
            finite = torch.isfinite(center) & torch.isfinite(gap)
            if bool((~torch.isfinite(value) & torch.isfinite(center)).any()):
                return tuple([math.inf] * len(sets))
            if bool(finite.any()):
                ratio = gap[finite] / bound[finite].clamp_min(_TINY)
                worst = max(worst, float(ratio.max()))
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


def _reduced_models(op: _Op, inputs: list[torch.Tensor], reduced: str | None) -> list[list[torch.Tensor]]:
    """The inputs of a float32 matmul/conv rounded by each of ``REDUCED_MODELS[reduced]``, or []
    when the op does not run at reduced precision (another class, no float32 operand)."""
    if reduced is None:
        return []
    cls = classify(op.name)
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
# conforming device these give the same bits, denormal handling aside.
_BASIC_OPS = frozenset(
    [f"aten.{name}.{overload}" for name in ("add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_")
     for overload in ("Tensor", "Scalar")] + ["aten.sqrt.default", "aten.sqrt_.default"]
)


def _correctly_rounded(op: _Op, inputs: list[torch.Tensor]) -> bool:
    """Whether ``op`` is a basic IEEE operation in one float32/float64 dtype, on normal numbers."""
    if op.name not in _BASIC_OPS:
        return False
    args = op.arguments()
    if args is None or args.get("alpha", 1) != 1 or "rounding_mode" in args:
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
    amax: float
    norm: float

    @classmethod
    def of(cls, reference: torch.Tensor) -> _Scale:
        ref = reference.detach().to(torch.float64)
        finite = torch.isfinite(ref)
        amax = float(ref[finite].abs().max()) if bool(finite.any()) else 0.0
        norm = float(torch.linalg.vector_norm(ref[finite])) if amax > 0 else 0.0
        return cls(ref, finite, amax, norm)

    def error(self, value: Any, center: torch.Tensor | None = None) -> float:
        """Relative error of ``value`` against the reference, or its distance from ``center`` on
        the reference's scale; inf for a non-tensor or a shape that differs."""
        if not isinstance(value, torch.Tensor) or value.shape != self.ref.shape:
            return math.inf
        if center is None:
            return _relative(value.detach(), self.ref, self.finite, self.amax, self.norm)
        middle = center.detach().to(torch.float64)
        return _relative(value.detach(), middle, torch.isfinite(middle), self.amax, self.norm)


def _excess(error: float, honest: float) -> float:
    return error / honest if honest > 0 else (math.inf if error > 0 else 0.0)


def _is_float(dtype: str) -> bool:
    return dtype in ("float32", "float64", "float16", "bfloat16")


def _errors(recorded: torch.Tensor, honest: Any, reference: Any) -> tuple[float, float] | None:
    """(relative error of ``recorded``, relative error of ``honest``), both against ``reference``."""
    if not _comparable(recorded, honest, reference):
        return None
    return _errors_on(recorded, honest, _Scale.of(reference))


def _comparable(recorded: torch.Tensor, honest: Any, reference: Any) -> bool:
    """Whether the replay gave tensors of the recorded output's shape (and not complex ones)."""
    return (isinstance(reference, torch.Tensor) and isinstance(honest, torch.Tensor) and not reference.is_complex()
            and recorded.shape == reference.shape == honest.shape)


def _errors_on(recorded: torch.Tensor, honest: torch.Tensor, scale: _Scale) -> tuple[float, float]:
    error, honest_error = scale.error(recorded), scale.error(honest)
    if error > 0 and honest_error == 0 and recorded.is_floating_point():
        # The op is exact here (a max, a copy, a sum that needs no rounding), so any difference is
        # the op's doing, unless it is only denormals flushed to zero, as many accelerators do.
        out, ref = recorded.to(torch.float64), scale.ref
        differs = out != ref
        if bool(((out[differs] == 0) & (ref[differs].abs() < torch.finfo(recorded.dtype).tiny)).all()):
            error = 0.0
    return error, honest_error


def _relative(value: torch.Tensor, ref: torch.Tensor, finite: torch.Tensor, scale: float, norm: float) -> float:
    """``max(max|v - ref| / max|ref|, ||v - ref|| / ||ref||)`` over the reference's finite
    positions; inf when NaN/Inf sit where the reference has none (or differ from its own)."""
    out = value.to(torch.float64)
    special = ~finite
    if bool(special.any()):
        same = (out[special] == ref[special]) | (torch.isnan(out[special]) & torch.isnan(ref[special]))
        if not bool(same.all()):
            return math.inf
    out, ref = out[finite], ref[finite]
    if not bool(torch.isfinite(out).all()):
        return math.inf
    diff = (out - ref).abs()
    worst = float(diff.max()) if diff.numel() else 0.0
    if worst == 0.0:
        return 0.0
    if scale == 0.0:
        return math.inf
    return max(worst / scale, float(torch.linalg.vector_norm(diff)) / max(norm, _TINY))


def _call(op: _Op, inputs: list[torch.Tensor], *, golden: bool) -> tuple[Any, tuple, dict] | None:
    """Run ``op`` on ``inputs``; ``golden`` promotes floating values to float64.

    Returns (result, args, kwargs) so written arguments can be read back, or None.
    """
    func = resolve(op.name)
    if func is None or not hasattr(func, "_schema"):
        return None
    recorded = op.arguments()
    if recorded is None:
        return None
    call = decode_call(func, recorded, inputs, golden=golden)
    if call is None:
        return None
    args, kwargs = call
    try:
        with torch.no_grad():
            result = func(*args, **kwargs)
    except Exception:  # noqa: BLE001 - an op that will not run on the CPU or in float64 is simply not replayed
        return None
    return result, tuple(args), kwargs


def _returned(name: str, result: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The op's tensors in the order capture numbered its outputs."""
    return outputs_in_order(resolve(name), result, args, kwargs)


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


def _replay_region(t_side: "_Chain", b_side: "_Chain | _NoChain", region: Any) -> RegionReplay | None:
    outputs = [(T, B) for T, B in region.outputs]
    if not outputs or not region.target_ops:
        return None
    given = {T: t_side.values.get(T) for T, _ in region.inputs if T is not None}
    recorded = {T: t_side.values.get(T) for T, _ in outputs}
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
                value = b_side.values.get(B)  # a value only the bench reads here (a mask buffer)
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


def _same_inputs(t_side: "_Chain", b_side: "_Chain", region: Any) -> bool:
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
    """One trace's ops, re-run in order on given values (a region's side)."""

    def __init__(self, rank: Any) -> None:
        self.rank = rank
        tensors = rank.tensors_table.select(["tensor_id", "op_id", "index", "dtype", "view_of", "data_key"]).to_pydict()
        self.info = {
            t: (op, idx, dtype, -1 if view is None else view, key)
            for t, op, idx, dtype, view, key in zip(
                tensors["tensor_id"], tensors["op_id"], tensors["index"], tensors["dtype"], tensors["view_of"], tensors["data_key"]
            )
        }
        table = rank.ops_table.select(["op_id", "kind", "op", "args", "inputs", "outputs", "random"]).to_pydict()
        self.ops = {
            o: _Op(o, k, n, a or "{}", list(i or ()), list(out or ()), bool(r))
            for o, k, n, a, i, out, r in zip(
                table["op_id"], table["kind"], table["op"], table["args"], table["inputs"], table["outputs"], table["random"]
            )
        }
        self.saved = SavedTensors(rank)
        self.values = _Values(self.saved, self.info, self.ops)

    def __enter__(self) -> "_Chain":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.saved.__exit__(*exc)

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
                        value = self.values.get(t)
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
                    value = self.values.get(t)  # read from outside the region as recorded
                if value is None:
                    return None
                inputs.append(value)
            call = _call(op, inputs, golden=golden)
            if call is None:
                return None
            produced = _returned(op.name, *call)
            for t, value in zip(op.outputs, produced):
                store[t] = value
        out = {t: store[t] for t in wanted if t in store}
        return out if len(out) == len(wanted) else None


class _NoChain:
    """Stands in for the bench's side when there is no bench trace to read."""

    def __enter__(self) -> "_NoChain":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None
