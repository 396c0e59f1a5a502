"""What a rank's capture found when each op checked its own computation (``self_check``, see
:mod:`tracecmp.capture.selfcheck`): per op, its worst output, as both judges read it.

>>> import pandas as pd
>>> frame = pd.DataFrame({"op_id": [4, 4], "index": [0, 1], "residual": [0.2, 9.0], "limit": [4.0, 4.0],
...                       "coarse": [0.2, 9.0], "sampled": [16, 16], "how": ["rows", "rows"]})
>>> own_checks(frame, {4: "aten.mm.default"})[4].failed
True
"""

from __future__ import annotations

import math
from typing import Mapping, NamedTuple

import numpy as np
import pandas as pd

# A float32 matmul/conv allowed reduced precision is held to float32 accumulation under the
# device's rounding model only where that model reproduces the op's calls: at least this many of
# them, all but one or all but this share (the faults); an op called fewer times goes by all the
# rank's modelled calls (the rounding is the device's). Elsewhere the model may not be the
# device's, and the precision's whole allowance holds.
MODEL_CALLS = 3
MODEL_MISSES = 0.1


class OwnCheck(NamedTuple):
    """An op's self-check at capture: the output that strayed furthest beyond its allowance."""

    index: int  # that output's position among the op's tensor outputs
    residual: float  # its largest sampled |output - float64 value|, in the op's own allowance
    limit: float  # what an honest kernel stays within
    coarse: float  # under a reduced precision's whole allowance, in units of limit (see CHECKS_SCHEMA)
    sampled: int  # elements (or rows) recomputed
    how: str  # "pointwise", "rows", "batch", "full", "exact"

    @property
    def failed(self) -> bool:
        """The op did not compute what its inputs and arguments ask (NaN: not measured)."""
        return self.residual > self.limit

    @property
    def passed(self) -> bool:
        return self.residual <= self.limit

    def describe(self) -> str:
        """One line for a verdict.

        >>> OwnCheck(0, 812.0, 4.0, 812.0, 16, "rows").describe()
        'its own check at capture failed: output 0 lies 203x beyond what its dtype and precision allow (16 rows recomputed in float64)'
        """
        unit = "rows" if self.how in ("rows", "batch") else "elements"
        if not self.failed:
            return (
                f"its own check at capture passed: {self.sampled} {unit} recomputed in float64 agree within "
                "what its dtype and precision allow"
            )
        ratio = self.residual / self.limit if self.limit > 0 else math.inf
        return (
            f"its own check at capture failed: output {self.index} lies {ratio:.3g}x beyond what its dtype "
            f"and precision allow ({self.sampled} {unit} recomputed in float64)"
        )


def own_checks(checks: pd.DataFrame | None, names: Mapping[int, str]) -> dict[int, OwnCheck]:
    """Per op id, the worst of its outputs' self-checks (largest residual over limit); empty
    where the trace holds none. ``names``: op id -> op, to learn per op whether a rounding model
    reproduces the calls of a float32 matmul/conv allowed reduced precision (see ``MODEL_CALLS``)."""
    if checks is None or checks.empty:
        return {}
    checks = _models_trusted(checks, names)
    ratio = checks["residual"].to_numpy(float) / checks["limit"].to_numpy(float).clip(min=1e-300)
    order = pd.Series(ratio).fillna(-1.0).to_numpy().argsort(kind="stable")[::-1]
    worst: dict[int, OwnCheck] = {}
    columns = [checks[c].tolist() for c in ("op_id", "index", "residual", "limit", "coarse", "sampled", "how")]
    for i in order:
        op_id = int(columns[0][i])
        if op_id not in worst:
            worst[op_id] = OwnCheck(
                int(columns[1][i]),
                float(columns[2][i]),
                float(columns[3][i]),
                float(columns[4][i]),
                int(columns[5][i]),
                columns[6][i],
            )
    return worst


def _models_trusted(checks: pd.DataFrame, names: Mapping[int, str]) -> pd.DataFrame:
    """``checks`` with each modelled residual (``coarse`` differs) replaced by its coarse one where
    the rounding model does not reproduce its op's calls."""
    residual, coarse = checks["residual"].to_numpy(float), checks["coarse"].to_numpy(float)
    modelled = ~np.isclose(residual, coarse, rtol=1e-12, atol=0.0) & ~np.isnan(coarse)
    if not modelled.any():
        return checks
    op = checks["op_id"].map(names).fillna("")
    misses = pd.DataFrame({"op": op[modelled], "miss": residual[modelled] > checks["limit"].to_numpy(float)[modelled]})
    per_op = misses.groupby("op")["miss"].agg(["size", "sum"])
    fitting = per_op["sum"] <= np.maximum(1.0, MODEL_MISSES * per_op["size"])
    rank_fits = len(misses) >= MODEL_CALLS and misses["miss"].sum() <= max(1.0, MODEL_MISSES * len(misses))
    trusted = set(
        per_op.index[((per_op["size"] >= MODEL_CALLS) & fitting) | ((per_op["size"] < MODEL_CALLS) & rank_fits)]
    )
    keep = ~modelled | op.isin(trusted).to_numpy()
    out = checks.copy()
    out["residual"] = np.where(keep, residual, coarse)
    return out
