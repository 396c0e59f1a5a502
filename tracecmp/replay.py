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
Ops that are not replayed: random ops (they would draw other numbers), uninitialized allocations,
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
from tracecmp.aten.opclass import classify
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
            if op.kind != "op" or op.random or op.name.startswith(_UNINITIALIZED):
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
        if basic and not torch.equal(recorded, honest[position]):
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
    return OwnError(worst.op_id, worst.error, worst.honest, worst.dtype, misrounded=misrounded, fits=tuple(fits))


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
    return [[rounding(x) if i in positions else x for i, x in enumerate(inputs)] for _, rounding in REDUCED_MODELS[reduced]]


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
    "tf32": (("to nearest even", _round_tf32), ("toward zero", _truncate_tf32)),
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
