"""The standards ``check`` holds each op to, and the verdict they give (pass, warning, error).

Whole tensors (``data="tensors"``). Each op is replayed on its recorded inputs in float64 (the
reference) and in its recorded dtypes on this CPU (an honest kernel, :mod:`tracecmp.numerics.replay`).
With ``u`` the rounding unit (machine epsilon) of the output's dtype, ``e`` the recorded
output's normwise relative error against the reference and ``h`` the honest replay's, an op
**errs** when

1. NaN/Inf sit in its output where the reference is finite (or the reverse) and the honest
   replay has no such position: an honest kernel in these dtypes stays finite on these inputs;
2. it is one correctly rounded IEEE 754 operation (+, -, *, /, sqrt in float32/float64) and
   its bits differ from the honest replay's, which every conforming device reproduces;
3. the honest replay is exact (a copy, a max, a sum that needs no rounding) and the recorded
   output is not (flushed denormals excepted);
4. ``e > margin * h`` and ``e > floor * u``: more than ``margin`` (4) times what an honest
   kernel makes on the very same inputs, and beyond ``floor`` (4) rounding units. A float32
   matmul/conv that may run at reduced precision (TF32/HF32 where the run allows it, bf16 under
   "medium") is replayed honestly on inputs rounded to it, and its floor is at least one unit
   of that precision; where a rounding of the inputs reproduces the run's other calls of the op
   (at least three, to within 64 float32 accumulation errors), each call must match it to
   within ``margin`` times their typical misfit.

It gets a **warning** when its output overflows to NaN/Inf as the honest replay does too (the
dtype cannot hold the result: a real problem, but not the kernel's), when ``e`` exceeds
``warn_margin`` (2) times ``h`` and the floor without reaching rule 4, when a larger share of its
elements than ``max(share, margin x the honest share)`` lies more than ``ELEMENT_ULPS[dtype]``
units in the last place from the reference (1 ulp for bf16/fp16, whose honest kernels compute in
float32 and round once; 4 for float32, whose transcendental kernels differ by a few ulp across
libraries), or when an integer or boolean output (indices, masks) differs from the honest
replay (ties can legitimately break either way). Otherwise it **passes**.

Why these numbers. The honest replay measures, on the op's own inputs, the error a correct
kernel makes, so the standard scales itself with cancellation, reduction length and dtype. The
factor 4 leaves room for a device whose kernels sum in another order or accumulate differently
(their errors are of the same size but not the same bits), and is what ``compare`` uses for the
same test; the floor keeps ops whose honest error is tiny (exact-ish sums) from erring over a few
units of rounding. Together they hold whole-bf16, autocast-bf16, TF32 and clean float32 runs to
no error and find a GELU swapped for its tanh approximation (error ~1e-4 against ~1e-7), a
wrong layer-norm eps, fp16-rounded matmul inputs and an fp16 softmax by factors of hundreds or
more (tests/unit/test_check.py, tests/integration/test_check_models.py).

Statistics only: see :mod:`tracecmp.checking.statistics`; its verdicts carry
``evidence="statistics"``, weaker by construction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from tracecmp.aten.opclass import OpClass
from tracecmp.errors import TracecmpError
from tracecmp.numerics.fits import ModelFit
from tracecmp.numerics.replay import ELEMENT_ULPS, OwnError
from tracecmp.numerics.units import EPS, REDUCED_EPS

STATUSES = ("pass", "warning", "error", "skipped")


@dataclass(frozen=True)
class Standards:
    """The thresholds of ``check`` (see the module docstring for what each one means).

    >>> Standards.parse("margin=8,floor=2").margin
    8.0
    """

    margin: float = 4.0
    floor: float = 4.0
    warn_margin: float = 2.0
    share: float = 0.001  # share of elements beyond ELEMENT_ULPS that earns a warning
    element_ulps: Mapping[str, float] = field(default_factory=lambda: dict(ELEMENT_ULPS))
    # Statistics only: a pinned statistic of a mean-like kind (mean, norm) averages its elements'
    # rounding, so its floor is this many units of the output's rms instead of ``floor``.
    mean_floor: float = 1.0

    def __post_init__(self) -> None:
        for name in ("margin", "floor", "warn_margin", "share", "mean_floor"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise TracecmpError(f"standard {name} must be a finite non-negative number, got {value!r}")
        if self.warn_margin > self.margin:
            raise TracecmpError(f"warn_margin ({self.warn_margin}) must not exceed margin ({self.margin})")

    @classmethod
    def parse(cls, text: str) -> "Standards":
        """Read the CLI form ``"margin=4,floor=4,warn_margin=2,share=0.001,mean_floor=1,fp32_ulps=4"``."""
        changes: dict[str, Any] = {}
        ulps = dict(ELEMENT_ULPS)
        names = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp64": "float64"}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = item.partition("=")
            key = key.strip()
            try:
                number = float(value)
            except ValueError:
                raise TracecmpError(f"bad standard {item!r}: not a number") from None
            if not sep:
                raise TracecmpError(f"bad standard {item!r}: expected NAME=VALUE")
            if key.endswith("_ulps") and names.get(key.removesuffix("_ulps"), key.removesuffix("_ulps")) in ulps:
                ulps[names.get(key.removesuffix("_ulps"), key.removesuffix("_ulps"))] = number
            elif key in ("margin", "floor", "warn_margin", "share", "mean_floor"):
                changes[key] = number
            else:
                raise TracecmpError(f"bad standard {item!r}: unknown name {key!r}")
        return replace(cls(**changes), element_ulps=ulps)


@dataclass
class OpVerdict:
    """``check``'s finding for one op (a row of ``CheckResult.nodes``)."""

    op_id: int
    status: str  # one of STATUSES
    evidence: str = ""  # "tensors" or "statistics" ("" when skipped)
    reason: str = ""
    kind: str = ""  # "computation" or "nan" for warnings and errors
    score: float = 0.0  # how far beyond the error bar (>1 errs); ranks the suspects
    dtype: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    checks: str = ""  # what could be tested ("normwise,elements" / "max,mean,grid" ...)


def judge_replay(
    own: OwnError,
    cls: OpClass,
    standards: Standards,
    reduced: str | None,
    fit: ModelFit | None = None,
    model_name: str = "",
) -> OpVerdict:
    """The verdict of one op from its replay (rules of the module docstring)."""
    s = standards
    u = EPS.get(own.dtype, 0.0)
    reduced_matmul = bool(reduced and cls.precision_variable and own.dtype == "float32")
    floor = s.floor * u
    if reduced_matmul:
        assert reduced is not None
        floor = max(floor, REDUCED_EPS[reduced])
    metrics = _replay_metrics(own, u)
    checks = "normwise,elements,nonfinite" + (",ieee" if own.misrounded else "") + (",fit" if fit is not None else "")
    verdict = OpVerdict(own.op_id, "pass", "tensors", dtype=own.dtype, metrics=metrics, checks=checks)
    dtype = own.dtype
    certain = _certain_error(verdict, own)
    if certain is not None:
        return certain
    bar = max(s.margin * own.honest, floor)
    excess = own.error / bar if bar > 0 else (math.inf if own.error > 0 else 0.0)
    if excess > 1.0 and math.isfinite(own.error):
        ratio = f"{own.error / own.honest:.0f}x" if own.honest > 0 else "far beyond"
        return _set(
            verdict,
            "error",
            "computation",
            excess,
            f"own error {own.error:.2e} ({own.error / u:.0f} rounding units of {dtype}) against a float64 replay of "
            f"its recorded inputs is {ratio} what an honest {dtype} replay makes ({own.honest:.1e})"
            + (
                f"; {own.beyond:.1%} of its elements lie beyond {s.element_ulps.get(dtype, 4):.0f} ulp"
                if own.beyond
                else ""
            ),
        )
    if reduced_matmul and fit is not None and fit.model < len(own.fits):
        misfit = own.fits[fit.model] / (s.margin * fit.misfit)
        if misfit > 1.0:
            return _set(
                verdict,
                "error",
                "computation",
                misfit,
                f"its output lies {own.fits[fit.model]:.0f} float32 accumulation errors from a replay of its recorded "
                f"inputs rounded to {reduced} ({model_name}), a replay that matches this run's other {fit.members - 1} "
                f"calls of the op to within {fit.misfit:.1f} (own error {own.error:.2e}, an honest kernel's "
                f"{own.honest:.1e})",
            )
    return _replay_warning(verdict, own, cls, s, floor, bar)


def _replay_metrics(own: OwnError, u: float) -> dict[str, float]:
    """The metrics a replay's verdict carries (``u``: the rounding unit of its dtype)."""
    return {
        "own_error": own.error,
        "honest_error": own.honest,
        "error_units": own.error / u if u else math.nan,
        "ratio": own.error / own.honest if own.honest > 0 else (math.inf if own.error > 0 else 1.0),
        "max_ulps": own.max_ulps,
        "honest_max_ulps": own.honest_max_ulps,
        "beyond": own.beyond,
        "honest_beyond": own.honest_beyond,
        "nonfinite": float(own.nonfinite),
        "honest_nonfinite": float(own.honest_nonfinite),
    }


def _certain_error(verdict: OpVerdict, own: OwnError) -> OpVerdict | None:
    """``verdict`` made an error where no honest computation could give the output (NaN/Inf an
    honest replay lacks, a misrounded IEEE result, an error where the dtype is exact); else None."""
    dtype = own.dtype
    if own.nonfinite > own.honest_nonfinite:
        extra = own.nonfinite - own.honest_nonfinite
        return _set(
            verdict,
            "error",
            "nan",
            math.inf,
            f"{extra} NaN/Inf in its output where a float64 replay of its recorded inputs is finite and an honest "
            f"{dtype} replay is too"
            + (f" ({own.honest_nonfinite} positions overflow honestly)" if own.honest_nonfinite else ""),
        )
    if own.misrounded:
        return _set(
            verdict,
            "error",
            "computation",
            math.inf,
            f"its output is not the correctly rounded {dtype} result of its recorded inputs, which every IEEE 754 "
            f"device gives (own error {own.error:.2e}, max {own.max_ulps:.0f} ulp)",
        )
    if own.honest == 0.0 and own.error > 0 and not math.isinf(own.error):
        return _set(
            verdict,
            "error",
            "computation",
            math.inf,
            f"own error {own.error:.2e} against a float64 replay of its recorded inputs, which {dtype} computes "
            f"exactly (max {own.max_ulps:.0f} ulp)",
        )
    return None


def _replay_warning(
    verdict: OpVerdict, own: OwnError, cls: OpClass, s: Standards, floor: float, bar: float
) -> OpVerdict:
    """``verdict`` (an op within the error bar) made a warning where something about it is still
    off: honest overflow, changed integers, an error above the warning bar, too many far elements."""
    dtype = own.dtype
    if own.nonfinite and own.nonfinite <= own.honest_nonfinite:
        return _set(
            verdict,
            "warning",
            "nan",
            0.0,
            f"{own.nonfinite} NaN/Inf in its output where the float64 reference is finite: {dtype} cannot hold the "
            f"result (an honest {dtype} replay overflows there too)",
        )
    if own.integer_mismatch:
        return _set(
            verdict,
            "warning",
            "computation",
            0.0,
            f"{own.integer_mismatch} elements of an integer/boolean output differ from an honest replay "
            "(indices of ties may legitimately differ)",
        )
    warn_bar = max(s.warn_margin * own.honest, floor)
    if own.error > warn_bar and math.isfinite(own.error):
        return _set(
            verdict,
            "warning",
            "computation",
            own.error / bar if bar > 0 else 0.0,
            f"own error {own.error:.2e} is {own.error / max(own.honest, 1e-300):.1f}x an honest {dtype} replay's "
            f"({own.honest:.1e}), below the error bar of {s.margin:g}x",
        )
    share_bar = max(s.share, s.margin * own.honest_beyond)
    if cls.kind in ("copy", "lipschitz", "product", "exp", "select") and not cls.accumulates and own.beyond > share_bar:
        return _set(
            verdict,
            "warning",
            "computation",
            0.0,
            f"{own.beyond:.2%} of its elements lie more than {s.element_ulps.get(dtype, 4):.0f} ulp from a float64 "
            f"replay (an honest {dtype} replay: {own.honest_beyond:.2%}), though its normwise error "
            f"{own.error:.1e} is within the standard",
        )
    return verdict


def _set(verdict: OpVerdict, status: str, kind: str, score: float, reason: str) -> OpVerdict:
    verdict.status, verdict.kind, verdict.score, verdict.reason = status, kind, score, reason
    return verdict
