"""Rounding units of dtypes: the scale every error is measured on, by both judges.

The *rounding unit* of a dtype is its machine epsilon (``torch.finfo(dtype).eps``), hard-coded so
that judging statistics does not import torch; errors are expressed in these units so that a bf16
run and an fp32 run are judged on the same scale.

>>> eps_of("bf16"), REDUCED_EPS["tf32"]
(0.0078125, 0.0009765625)
"""

from __future__ import annotations

EPS: dict[str, float] = {
    "float64": 2.220446049250313e-16,
    "float32": 1.1920928955078125e-07,
    "float16": 0.0009765625,
    "bfloat16": 0.0078125,
    "float8_e4m3fn": 0.125,
    "float8_e4m3fnuz": 0.125,
    "float8_e5m2": 0.25,
    "float8_e5m2fnuz": 0.25,
    "complex128": 2.220446049250313e-16,
    "complex64": 1.1920928955078125e-07,
    "complex32": 0.0009765625,
}
FP32_EPS = EPS["float32"]
# A magnitude below every dtype's smallest subnormal: guards a division without moving any ratio.
TINY = 1e-300
# TF32 (and Ascend HF32) keep 10 mantissa bits: the precision a "float32" matmul/conv may really run at.
TF32_EPS = 2.0**-10

# The unit of each reduced precision a float32 matmul/conv may run at (TF32; bf16 under
# ``set_float32_matmul_precision("medium")``), keyed as ``REDUCED_MODELS``.
REDUCED_EPS = {"tf32": TF32_EPS, "bf16": EPS["bfloat16"]}


def reduced_unit(reduced: str | None) -> float:
    """The unit a float32 matmul/conv allowed reduced precision rounds its operands to: bf16's where
    the run declared it (``"medium"``), else TF32's (TF32 on GPUs, HF32 on NPUs).

    >>> reduced_unit("bf16") == EPS["bfloat16"], reduced_unit(None) == TF32_EPS
    (True, True)
    """
    return REDUCED_EPS.get(reduced or "tf32", TF32_EPS)


_ALIASES = {
    "fp64": "float64",
    "double": "float64",
    "f64": "float64",
    "fp32": "float32",
    "float": "float32",
    "f32": "float32",
    "fp16": "float16",
    "half": "float16",
    "f16": "float16",
    "bf16": "bfloat16",
}


def canonical_dtype(name: str) -> str:
    """``"torch.bfloat16"``, ``"bf16"`` -> ``"bfloat16"``.

    >>> canonical_dtype("torch.float32"), canonical_dtype("bf16")
    ('float32', 'bfloat16')
    """
    name = str(name).strip().removeprefix("torch.")
    return _ALIASES.get(name, name)


def is_float_dtype(name: str) -> bool:
    return canonical_dtype(name) in EPS


def eps_of(name: str) -> float:
    """Rounding unit of a dtype; 0.0 for integer and bool dtypes (they compare exactly)."""
    return EPS.get(canonical_dtype(name), 0.0)
