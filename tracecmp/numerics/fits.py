"""Which rounding of its inputs reproduces a run's reduced-precision matmul/conv calls.

A device computes every float32 matmul of a run the same way (TF32 inputs rounded to nearest,
toward zero, ...). Replay measures each call against each rounding model
(:attr:`~tracecmp.numerics.replay.OwnError.fits`); :func:`model_fits` picks the model once per
rank and says, per op, how closely it reproduces that op's calls. Both judges hold each call to it.

>>> from tracecmp.numerics.replay import OwnError
>>> own = {i: OwnError(i, 1e-4, 1e-4, "float32", fits=(1.5, 900.0)) for i in range(3)}
>>> model_fits(own, {0: "aten.mm.default", 1: "aten.mm.default", 2: "aten.mm.default"})
{'aten.mm.default': ModelFit(model=0, misfit=1.5, members=3)}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from tracecmp.numerics.replay.records import OwnError

FIT_MEMBERS = 3  # an op needs this many replayed calls in a rank before its calls judge each other
# A rounding model "reproduces" a run's matmuls when it leaves at most this many float32
# accumulation errors unexplained; a wrong model leaves the whole reduced-precision error
# (thousands of them for TF32), so the two are far apart.
FIT_BOUND = 64.0


@dataclass(frozen=True)
class ModelFit:
    """How a run computed the float32 matmul/conv calls of one op: the rounding model (index into
    ``REDUCED_MODELS[reduced]``) that reproduces them, and how closely (75th percentile, >= 1)."""

    model: int
    misfit: float
    members: int


def model_fits(own: Mapping[int, OwnError], names: Mapping[int, str]) -> dict[str, ModelFit]:
    """Per op name, the input rounding that reproduces a rank's reduced-precision matmul/conv
    calls, where one does: chosen once per rank (it is the device's: the model that leaves least
    unexplained over all calls), held per op (a device may pick another algorithm for
    convolutions than for matmuls)."""
    by_op: dict[str, list[tuple[float, ...]]] = {}
    for op_id, e in own.items():
        if e.fits and e.dtype == "float32" and op_id in names:
            by_op.setdefault(names[op_id], []).append(e.fits)
    pooled = [f for rows in by_op.values() for f in rows]
    if not pooled:
        return {}
    model = min(range(len(pooled[0])), key=lambda m: quantile75([f[m] for f in pooled]))
    out = {}
    for name, rows in by_op.items():
        misfit = quantile75([f[model] for f in rows])
        if len(rows) >= FIT_MEMBERS and misfit <= FIT_BOUND:
            out[name] = ModelFit(model, max(misfit, 1.0), len(rows))
    return out


def quantile75(values: list[float]) -> float:
    """The 75th percentile, lower of the two neighbours (the median for three values).

    >>> quantile75([3.0, 1.0, 2.0])
    2.0
    """
    ordered = sorted(values)
    return ordered[int(0.75 * (len(ordered) - 1))]
