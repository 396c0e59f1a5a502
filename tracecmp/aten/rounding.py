"""Rounding models: how a float32 matmul/conv may have rounded its inputs (TF32, bf16).

``REDUCED_MODELS[precision]`` lists the ways a device may round float32 operands before it
multiplies them (to nearest, toward zero); :func:`reduced_models` applies each to an op's
inputs. :func:`correctly_rounded` names the IEEE 754 basic operations whose result every
conforming device gives bit for bit.

>>> [name for name, _ in REDUCED_MODELS["tf32"]]
['to nearest even', 'toward zero', 'to nearest, ties away']
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from tracecmp.aten.opclass import classify


def reduced_models(name: str, inputs: list[torch.Tensor], reduced: str | None) -> list[list[torch.Tensor]]:
    """The inputs of a float32 matmul/conv rounded by each of ``REDUCED_MODELS[reduced]``, or []
    when the op does not run at reduced precision (another class, no float32 operand)."""
    if reduced is None:
        return []
    cls = classify(name)
    if not cls.precision_variable:
        return []
    positions = [
        i for i, x in enumerate(inputs) if x.dtype == torch.float32 and (not cls.operands or i in cls.operands)
    ]
    if not positions:
        return []
    return [
        [_laid_out_as(x, rounding(x)) if i in positions else x for i, x in enumerate(inputs)]
        for _, rounding in REDUCED_MODELS[reduced]
    ]


def _laid_out_as(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``values`` in ``x``'s memory layout: a kernel may sum in another order for a transposed
    operand (a weight's ``t()``), and the replay must take the path the run took."""
    out = torch.empty_like(x)
    out.copy_(values.reshape(x.shape))
    return out


# One correctly rounded IEEE 754 operation per element (alpha, when given, must be 1): on every
# conforming device these give the same bits.
_BASIC_OPS = frozenset(
    [
        f"aten.{name}.{overload}"
        for name in ("add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_")
        for overload in ("Tensor", "Scalar")
    ]
    + ["aten.sqrt.default", "aten.sqrt_.default"]
)


def correctly_rounded(name: str, args: dict[str, Any], inputs: list[torch.Tensor]) -> bool:
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
    "tf32": (
        ("to nearest even", _round_tf32),
        ("toward zero", _truncate_tf32),
        ("to nearest, ties away", _round_tf32_away),
    ),
    "bf16": (("to nearest even", _round_bf16), ("toward zero", _truncate_bf16)),
}


FP32_UNIT = float(torch.finfo(torch.float32).eps)
