"""Non-tensor arguments as evidence: a paired node whose arguments differ (GELU's approximation,
an eps), and constants whose difference is only a dtype's rounding of the same number.
"""

from __future__ import annotations

import math
from collections import defaultdict
from functools import lru_cache
from typing import Any, Iterable

from tracecmp.aten.opclass import OpClass, for_call
from tracecmp.comparison.localize.records import CAP, RankInput
from tracecmp.comparison.metrics import FILLS
from tracecmp.graph.nodes import TensorState
from tracecmp.numerics.units import TINY
from tracecmp.trace import boundedjson

# Non-tensor arguments that legitimately differ between a target and a bench run.
_IGNORED_ARGS = {
    "dtype",
    "device",
    "layout",
    "pin_memory",
    "memory_format",
    "non_blocking",
    "copy",
    "requires_grad",
    "stride",
    "size_hint",
    "generator",
    "out_dtype",
    "cudnn_enabled",
    "benchmark",
    "deterministic",
    "allow_tf32",
    "grad_input_mask",
}


_DTYPE_WORDS = {
    "float16",
    "float32",
    "float64",
    "bfloat16",
    "half",
    "float",
    "double",
    "int64",
    "int32",
    "bool",
    "uint8",
    "int8",
    "int16",
    "complex64",
    "complex128",
    "cpu",
    "cuda",
    "npu",
    "xpu",
    "mps",
    "meta",
}


def _norm_args(text: str) -> Any:
    """Parsed non-tensor arguments with device/dtype-like entries removed, for comparison."""
    if not text:
        return None
    try:
        value = boundedjson.loads(text, max_bytes=boundedjson.ARGS_MAX_BYTES)
    except (TypeError, ValueError):
        return text

    def clean(v: Any) -> Any:
        if isinstance(v, dict):
            if set(v) == {"tensor"}:
                return "<tensor>"
            return {k: clean(x) for k, x in sorted(v.items()) if k not in _IGNORED_ARGS}
        if isinstance(v, list):
            return [clean(x) for x in v]
        if isinstance(v, str):
            word = v.removeprefix("torch.").split(":")[0]
            return "<device/dtype>" if word in _DTYPE_WORDS else v
        if isinstance(v, float):
            return float(f"{v:.9g}") if math.isfinite(v) else str(v)
        return v

    return clean(value)


def class_for_call(cls: OpClass, op: str, args: str) -> OpClass:
    """``cls`` with the input rules this call's recorded arguments decide (:func:`for_call`)."""
    try:
        parsed = boundedjson.loads(args, max_bytes=boundedjson.ARGS_MAX_BYTES)
    except (TypeError, ValueError):
        return cls
    return for_call(cls, op, parsed) if isinstance(parsed, dict) else cls


@lru_cache(maxsize=1024)
def _schema_defaults(op: str) -> dict[str, Any]:
    """Default values of an aten overload's non-tensor arguments, from torch's schema (empty if unknown)."""
    parts = op.split(".")
    if len(parts) != 3 or parts[0] != "aten":
        return {}
    try:
        import torch

        schema = getattr(getattr(torch.ops.aten, parts[1]), parts[2])._schema
    except (AttributeError, RuntimeError, ImportError):
        return {}
    defaults: dict[str, Any] = {}
    for arg in schema.arguments:
        if arg.has_default_value():
            value = arg.default_value
            if value is None or isinstance(value, (bool, int, float, str)):
                defaults[arg.name] = float(f"{value:.9g}") if isinstance(value, float) else value
            elif isinstance(value, (list, tuple)) and all(isinstance(v, (bool, int, float)) for v in value):
                defaults[arg.name] = list(value)
    return defaults


@lru_cache(maxsize=1)
def _dtype_constants() -> dict[float, frozenset[str]]:
    """Values that are a property of a floating dtype (``torch.finfo``: min, max, eps, tiny and the
    smallest subnormal of float16, bfloat16, float32, float64), as :func:`_norm_args` writes them,
    to the properties they are.

    A program that fills a mask with ``torch.finfo(x.dtype).min`` or guards a division with
    ``finfo(dtype).eps`` passes its own dtype's value: in a bf16 run another number than in an
    fp32 run, yet the same argument. (``resolution``, a round power of ten, and the float8 types'
    small round numbers are left out: they are also the values people write by hand.)
    """
    import torch

    table: dict[float, set[str]] = defaultdict(set)
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        info = torch.finfo(dtype)
        for name, value in (
            ("max", info.max),
            ("eps", info.eps),
            ("tiny", info.tiny),
            ("subnormal", info.tiny * info.eps),
        ):
            table[float(f"{value:.9g}")].add(name)
            table[float(f"{-value:.9g}")].add("-" + name)
    return {value: frozenset(names) for value, names in table.items()}


def _same_argument(x: Any, y: Any) -> bool:
    """Equal, or the same dtype property (``finfo(dtype).min`` and the like) of each run's own dtype."""
    if x == y:
        return True
    if isinstance(x, float) and isinstance(y, float):
        constants = _dtype_constants()
        return bool(constants.get(x, frozenset()) & constants.get(y, frozenset()))
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(_same_argument(a, b) for a, b in zip(x, y))
    if isinstance(x, dict) and isinstance(y, dict):
        return set(x) == set(y) and all(_same_argument(x[k], y[k]) for k in x)
    return False


def _dtype_constant_args(t_args: str, b_args: str) -> bool:
    """The arguments differ only by properties of each run's own dtype (see :func:`_same_argument`)."""
    if t_args == b_args or not b_args:
        return False
    a, b = _norm_args(t_args), _norm_args(b_args)
    return a != b and _same_argument(a, b)


def _constant_pairs(x: Any, y: Any) -> Iterable[tuple[float, float]]:
    """The (target, bench) pairs of unequal floats in two argument structures of one shape."""
    if isinstance(x, float) and isinstance(y, float):
        if x != y:
            yield x, y
    elif isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
        for a, b in zip(x, y):
            yield from _constant_pairs(a, b)
    elif isinstance(x, dict) and isinstance(y, dict):
        for key in x.keys() & y.keys():
            yield from _constant_pairs(x[key], y[key])


def constant_shift(
    cls: OpClass,
    t_args: str,
    b_args: str,
    out: TensorState,
    ins: list[tuple[int, TensorState]],
    rstd: TensorState | None,
) -> tuple[float, float, float]:
    """Error (ext, sys, rms channels) the output shows because each run took its own dtype's constant.

    ``finfo(dtype).eps`` added to a norm, ``finfo(dtype).min`` filling a mask: the same argument,
    yet other numbers (bf16's eps is 0.0078, float32's 1.2e-7), so the output may move by up to
    their difference: as an absolute shift (a sum, a clamp, a fill), a relative one (a product
    or quotient), or through a normalization's variance (its epsilon). Zero when the arguments
    are equal or differ otherwise (then the difference is an argument root).
    """
    if not b_args or t_args == b_args or not _dtype_constant_args(t_args, b_args):
        return 0.0, 0.0, 0.0
    amax_o, rms_o = max(out.amax, TINY), max(out.rms, TINY)
    ext = sys_ = env = 0.0
    for a, b in _constant_pairs(_norm_args(t_args), _norm_args(b_args)):
        if _is_fill(a) and _is_fill(b):
            continue  # a mask's fill: the comparison takes the two as equal (metrics.FILLS)
        shift = abs(a - b)
        if cls.kind == "normalize":
            # 1/sqrt(var + eps): relative error up to half the shift over the variance
            x = ins[0][1] if ins else None
            var = 1.0 / rstd.rms**2 if rstd is not None and rstd.rms > 0 else (x.spread**2 if x is not None else 0.0)
            rel = min(CAP, 0.5 * shift / max(var, TINY))
            ext, sys_, env = ext + rel, sys_ + rel, env + rel
        elif cls.kind in ("product", "exp", "other"):
            rel = min(CAP, shift / max(min(abs(a), abs(b)), TINY))
            ext, sys_, env = ext + rel, sys_ + rel, env + rel
        else:
            ext, sys_, env = ext + shift / amax_o, sys_ + shift / rms_o, env + shift / rms_o
    return ext, sys_, env


def _is_fill(value: float) -> bool:
    """``finfo(dtype).min`` or ``max`` of bfloat16, float32 or float64, as arguments record it."""
    return any(abs(value) == float(f"{fill:.9g}") or abs(value) == fill for fill in FILLS)


def arg_difference(t_args: str, b_args: str, op: str = "") -> str:
    """Empty when the arguments agree, else a short description of the first difference.

    An argument passed explicitly with its default value equals one left out (``alpha=1``), and
    a property of each run's own dtype equals its counterpart (``finfo(bfloat16).min`` against
    ``finfo(float32).min``).

    >>> arg_difference('{"value": -3.3895313892515355e+38}', '{"value": -3.4028234663852886e+38}')
    ''
    >>> arg_difference('{"eps": 1e-05}', '{"eps": 1e-06}')
    'eps=1e-05 vs 1e-06'
    """
    if t_args == b_args:
        return ""
    a, b = _norm_args(t_args), _norm_args(b_args)
    if a == b:
        return ""
    if isinstance(a, dict) and isinstance(b, dict):
        defaults = _schema_defaults(op)
        for key, value in defaults.items():
            a.setdefault(key, value)
            b.setdefault(key, value)
        for key in set(a) & set(b):
            # A Python number passed as is on one side and wrapped in a 0-dim tensor on the other
            # (eager wraps ``0.5 * x``'s 0.5, a compiled graph keeps it): its value is compared as
            # that input's, not here.
            if {type(a[key]), type(b[key])} & {int, float} and "<tensor>" in (a[key], b[key]):
                a[key] = b[key] = "<tensor>"
        if _same_argument(a, b):
            return ""
        for key in sorted(set(a) | set(b)):
            if not _same_argument(a.get(key), b.get(key)):
                return f"{key}={a.get(key)!r} vs {b.get(key)!r}"
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        if _same_argument(a, b):
            return ""
        for index, (x, y) in enumerate(zip(a, b)):
            if not _same_argument(x, y):
                return f"argument {index}: {x!r} vs {y!r}"
    return f"{t_args} vs {b_args}"


def structure_note(op_id: int, inputs: list[int], ri: RankInput) -> str:
    """Non-empty when the bench reads, at one of this op's inputs, what bench-only ops made of it
    (ops the target lacks, other than casts and copies)."""
    for pos in range(len(inputs)):
        region_id = ri.bench_only.get((op_id, pos))
        region = ri.regions.get(region_id) if region_id is not None else None
        if region is not None and region.kind != "pass-through":
            names = [n for n in region.bench_names if not n.startswith("source.")] or list(region.bench_names)
            return f"the bench applies {names[-1]} ({region.module or '<top>'}) to input {pos} and the target does not"
    return ""
