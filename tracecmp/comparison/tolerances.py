"""Per-dtype tolerances and rounding units used to judge a tensor's error.

Defaults are grounded in two published rules:

* ``torch.testing.assert_close`` (``torch/testing/_comparison.py``, ``_DTYPE_PRECISIONS``):
  rtol/atol of float16 1e-3/1e-5, bfloat16 1.6e-2/1e-5, float32 1.3e-6/1e-5, float64 1e-7/1e-7.
* the seeds' (ptdbg/msprobe) rule: an op is wrong when ``(cosine < 0.99 and max_abs_err > 0.001)
  or cosine < 0.9 or max_abs_err > 1`` (only applicable when whole tensors were saved).

The *rounding unit* of a dtype is its machine epsilon (``torch.finfo(dtype).eps``); errors are
expressed in these units so that a bf16 run and an fp32 run are judged on the same scale. When the
two runs hold a tensor in different dtypes the coarser dtype's unit is used.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Mapping

from tracecmp.errors import CompareError
from tracecmp.numerics.units import canonical_dtype, is_float_dtype

# torch.testing._comparison._DTYPE_PRECISIONS (rtol, atol).
TORCH_TESTING_TOLERANCES: dict[str, tuple[float, float]] = {
    "float16": (1e-3, 1e-5),
    "bfloat16": (1.6e-2, 1e-5),
    "float32": (1.3e-6, 1e-5),
    "float64": (1e-7, 1e-7),
    "complex32": (1e-3, 1e-5),
    "complex64": (1.3e-6, 1e-5),
    "complex128": (1e-7, 1e-7),
}


@dataclass(frozen=True)
class Tolerances:
    """How far a tensor may differ before tracecmp calls it diverged, and how roots are decided.

    ``rtol``/``atol`` are per dtype (torch.testing's defaults, overridable); they decide the
    per-tensor ``within_tol`` column of :meth:`CompareResult.to_frame`. Localization judges
    errors in rounding units: a node is a root when the error it *introduces* is more than
    ``margin`` times what its inputs carried in (after the op's expected amplification) plus
    ``local`` rounding units, and more than ``ambient`` times the typical error that the other
    nodes of the same op and dtype introduce in this comparison. Downstream of a root, where the
    inputs carry that root's error (no rounding noise, which statistics bound from below only), a
    node must exceed ``downstream`` times what its inputs carried in to be a root of its own.

    >>> Tolerances().rtol("bfloat16")
    0.016
    >>> Tolerances.parse("bf16=0.01:1e-5,margin=8").rtol("bf16")
    0.01
    """

    per_dtype: Mapping[str, tuple[float, float]] = field(default_factory=lambda: dict(TORCH_TESTING_TOLERANCES))
    margin: float = 4.0
    local: float = 4.0
    ambient: float = 8.0
    downstream: float = 32.0
    # Seeds' rule thresholds, used only when whole tensors are in both traces.
    cosine_warn: float = 0.99
    cosine_fail: float = 0.9
    max_abs_warn: float = 1e-3
    max_abs_fail: float = 1.0
    # Relative error floor for elementwise relative errors, as a fraction of the tensor's RMS:
    # below it an element counts as "near zero" and its error is judged against the floor.
    rel_floor: float = 1e-3
    # Replay (traces with whole tensors, see tracecmp.numerics.replay): an op is a root when its own
    # error against a float64 replay of its recorded inputs is more than ``replay_margin`` times
    # what a replay in its recorded dtypes makes and more than ``replay_local`` rounding units.
    replay_margin: float = 4.0
    replay_local: float = 4.0
    # A compiled region (or the ops one eager op was decomposed into) is judged as a whole: its
    # own rounding comes from replaying its graph when the target holds tensors; without them it
    # may add this many rounding units of its output's dtype (a graph's worth of them).
    region_units: float = 1000.0
    # Allow float32 matmul/conv to run at TF32 precision without calling it a divergence.
    # None: decide from the traces (see tracecmp.numerics.precision.reduced_precision_possible).
    allow_tf32: bool | None = None

    def __post_init__(self) -> None:
        for name in (
            "margin",
            "local",
            "ambient",
            "downstream",
            "rel_floor",
            "replay_margin",
            "replay_local",
            "region_units",
        ):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise CompareError(f"tolerance {name} must be a finite non-negative number, got {value!r}")
        clean = {}
        for dtype, pair in dict(self.per_dtype).items():
            try:
                rtol, atol = (float(pair[0]), float(pair[1]))
            except (TypeError, ValueError, IndexError):
                raise CompareError(f"tolerance for {dtype} must be (rtol, atol), got {pair!r}") from None
            if not (rtol >= 0 and atol >= 0 and math.isfinite(rtol) and math.isfinite(atol)):
                raise CompareError(f"tolerance for {dtype} must be finite and non-negative, got {pair!r}")
            clean[canonical_dtype(dtype)] = (rtol, atol)
        object.__setattr__(self, "per_dtype", clean)

    def rtol(self, dtype: str) -> float:
        return self.per_dtype.get(canonical_dtype(dtype), (0.0, 0.0))[0]

    def atol(self, dtype: str) -> float:
        return self.per_dtype.get(canonical_dtype(dtype), (0.0, 0.0))[1]

    def replace(self, **changes: object) -> "Tolerances":
        """A copy with some fields changed (``per_dtype`` entries are merged, not replaced)."""
        if "per_dtype" in changes:
            merged = dict(self.per_dtype)
            merged.update({canonical_dtype(k): v for k, v in dict(changes["per_dtype"]).items()})  # type: ignore[arg-type]
            changes["per_dtype"] = merged
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @classmethod
    def parse(cls, text: str, base: "Tolerances | None" = None) -> "Tolerances":
        """Read the CLI form ``"bf16=RTOL:ATOL,fp32=RTOL:ATOL,margin=M,ambient=A,local=L,downstream=D"``."""
        base = base or cls()
        per_dtype: dict[str, tuple[float, float]] = {}
        scalars: dict[str, object] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep:
                raise CompareError(f"bad tolerance {item!r}: expected NAME=VALUE")
            try:
                if key in (
                    "margin",
                    "local",
                    "ambient",
                    "downstream",
                    "rel_floor",
                    "replay_margin",
                    "replay_local",
                    "region_units",
                    "cosine_warn",
                    "cosine_fail",
                    "max_abs_warn",
                    "max_abs_fail",
                ):
                    scalars[key] = float(value)
                elif key == "allow_tf32":
                    flag = value.strip().lower()
                    scalars[key] = None if flag == "auto" else flag in ("1", "true", "yes", "on")
                elif is_float_dtype(key):
                    rtol, _, atol = value.partition(":")
                    per_dtype[key] = (float(rtol), float(atol) if atol else base.atol(key))
                else:
                    raise CompareError(f"bad tolerance {item!r}: unknown name {key!r}")
            except ValueError:
                raise CompareError(f"bad tolerance {item!r}: not a number") from None
        if per_dtype:
            scalars["per_dtype"] = per_dtype
        return base.replace(**scalars)
