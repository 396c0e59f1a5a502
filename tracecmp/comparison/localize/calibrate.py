"""Calibration on this comparison: what each op and dtype typically introduces (the ambient noise
of a bf16 or TF32 run), what a tensor passes on, and how a run computes its matmuls.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import numpy as np

from tracecmp.aten.opclass import OpClass, classify
from tracecmp.comparison.localize.records import JudgedNode, RankInput
from tracecmp.comparison.metrics import FILLS
from tracecmp.comparison.tolerances import Tolerances
from tracecmp.graph.nodes import Node, TensorState
from tracecmp.numerics.fits import FIT_MEMBERS, quantile75

_CARRY = 2.0  # a measurement is trusted to be at most this many times below the inputs' prediction


_CARRY_SYS = 4.0  # the same for norm/mean differences


M_MIN = 2.0  # with calibration: the smallest margin over the predicted error ...


M_RATIO = 3.0  # ... else this many times the typical observed/predicted ratio of the op in this run


def carried_error(out: TensorState, x: tuple[float, float, float], typical: tuple[float, float] = (0.0, 0.0)) -> None:
    """Raise the error an output passes on towards the predicted one, by at most ``_CARRY`` times.

    A channel that measured exactly nothing on a tensor that is not bitwise equal is blind there
    (saturated extremes such as softmax's 0 and 1, a mean fixed by construction): the prediction
    stands in for it. No prediction goes beyond the tensor's range, though: every element of both
    runs lies between their extremes, so no element can be off by more than that span (a weight of
    ones after Adam's first step spans 2 lr, however wrong the division by gradients near 0 that
    made its update looks).

    ``typical`` is the measured/predicted ratio (max/min, norm/mean) that the op's earlier calls
    at the same site typically showed (see :class:`TypicalRatio`). Without whole tensors a
    measurement is one sample of a random error, and a lucky one can sit hundreds of times below
    the error the bulk of the tensor carries (BERT-base in AMP bf16: a layer norm's input gradient
    off by 0.77% in RMS, by 0.005% at both its extremes). Such an output passes on at least what
    its prediction typically comes to in this run, never more than the prediction itself.
    """
    if out.exact:
        return
    if out.filled:
        # Its statistics see the fills, and of its finite elements only the largest: the prediction
        # stands for what they carry, unless the measurement shows more.
        out.c_ext, out.c_sys = max(out.e_ext, x[0]), max(out.e_sys, x[1])
        if not math.isnan(out.e_rms):
            out.c_rms = max(out.e_rms, x[2])
        return
    if out.amax > 0 and out.rms > 0 and math.isfinite(out.hi - out.lo):
        span = (out.hi - out.lo) + 2.0 * out.e_ext * out.amax
        x = (min(x[0], span / out.amax), min(x[1], span / out.rms), min(x[2], span / out.rms))
    out.c_ext = out.e_ext and max(out.e_ext, min(x[0], _CARRY * out.e_ext)) or x[0]
    out.c_sys = out.e_sys and max(out.e_sys, min(x[1], _CARRY_SYS * out.e_sys)) or x[1]
    if not math.isnan(out.e_rms):
        out.c_rms = max(out.e_rms, min(x[2], _CARRY * out.e_rms))
    else:
        # Only a finite prediction says what is typical; an unbounded one (an op credited with
        # more than CAP) leaves the measurement as it is.
        floor = [min(t, 1.0) * v if math.isfinite(v) else 0.0 for t, v in zip(typical, x)]
        out.c_ext, out.c_sys = max(out.c_ext, floor[0]), max(out.c_sys, floor[1])


def made_by(made: tuple[tuple, int] | None) -> str:
    """What made an input, for :class:`TypicalRatio`'s sites: its op, or "state" for a parameter
    or buffer (a source, or what the optimizer last wrote into it), the same in every step."""
    if made is None or made[0][3] == "source" or made[0][2] == "optimizer":
        return "state"
    return made[0][4]


class TypicalRatio:
    """Running median, per call site, of the measured/predicted error ratio of the calls so far,
    per channel (max/min, norm/mean): what an op's prediction typically comes to in this run.
    A site is one op at one place of every layer (:func:`layer_site`), in one phase, with one
    output role and inputs made by the same ops: a multiply's calls elsewhere in a model, or by
    the same module on other inputs (an RMSNorm backward's gradient times its weight, and times
    its normalized input), relate their errors to their inputs' in other ways.

    >>> typical = TypicalRatio()
    >>> for e in (0.1, 0.2, 0.3, 0.4, 0.5):
    ...     typical.add(("add", "float32"), (e, e), (1.0, 1.0))
    >>> typical.median(("add", "float32"))
    (0.3, 0.3)
    """

    MIN_CALLS = 5  # fewer calls say nothing typical

    def __init__(self) -> None:
        self._ratios: dict[Any, tuple[list[float], list[float]]] = {}
        self._medians: dict[Any, tuple[int, tuple[float, float]]] = {}  # key -> (calls when computed, medians)

    def add(self, key: Any, e: tuple[float, ...], x: tuple[float, ...]) -> None:
        lists = self._ratios.setdefault(key, ([], []))
        for channel in (0, 1):
            if x[channel] > 0 and math.isfinite(x[channel]) and not math.isnan(e[channel]):
                lists[channel].append(e[channel] / x[channel])

    def median(self, key: Any) -> tuple[float, float]:
        lists = self._ratios.get(key)
        if lists is None:
            return 0.0, 0.0
        calls = max(len(lists[0]), len(lists[1]))
        done, medians = self._medians.get(key, (0, (0.0, 0.0)))
        # Sorted again only once a site's calls grew by an eighth: O(log n) sorts for n calls.
        if calls >= self.MIN_CALLS and calls - done >= max(1, done // 8):
            ext, sys_ = (float(np.median(v)) if len(v) >= self.MIN_CALLS else 0.0 for v in lists)
            medians = ext, sys_
            self._medians[key] = (calls, medians)
        return medians


def at_finite_scale(
    out: TensorState, e: tuple[float, float, float], x: tuple[float, float, float]
) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """A filled output's measured and predicted errors relative to its largest finite element, the
    scale its op computed at, rather than to the fill (whose 3e38 would make any error vanish).

    Statistics see its finite elements at the extreme the fills leave alone: that channel is
    judged. Its mean and norm are the fills' (they say which elements are filled, see
    metrics.stat_metrics), and whole tensors' rms error is relative to them: neither channel
    judges then. With no finite extreme (a mask of zeros, both kinds of fill), nothing changes.

    >>> s = TensorState(known=True, exact=False, amax=3.4e38, lo=-3.4e38, hi=17.0, filled=True)
    >>> e, x = at_finite_scale(s, (1e-39, 0.0, math.nan), (5e-40, 1e-40, 1e-40))
    >>> round(e[0], 6), round(x[0], 6), e[1]
    (0.02, 0.01, nan)
    """
    finite = abs(out.hi) if out.lo <= -min(FILLS) else abs(out.lo)
    if not 0 < finite < min(FILLS):
        return e, x
    scale = out.amax / finite
    return (e[0] * scale, math.nan, math.nan), (x[0] * scale, x[1], x[2])


def carry_factors(
    out: TensorState, x: tuple[float, float, float], ins: list[tuple[int, TensorState]], cls: OpClass
) -> None:
    """An elementwise product of several full-size factors passes on at least the relative error
    its factors' extremes show, as relative errors of a product add (within its prediction).

    Its own extremes are one more sample of that error, at elements where the factors' extremes
    are not, and can come out far below it (Llama-8 in bf16: a gradient times the RMSNorm input,
    factors 6e-4 and 5e-4 at their extremes, the product 9e-5 at its own), which the row sum
    after it, an RMSNorm's backward, then showed 5x beyond what it carried in.
    """
    factors = [s for pos, s in ins if s.numel == out.numel and s.numel > 1 and cls.input_rule(pos) == ""]
    if out.exact or len(factors) < 2:
        return
    floor = min(x[0], min(s.c_ext for s in factors))
    out.c_ext = max(out.c_ext, floor)


def ambient_noise(
    judged: list[JudgedNode | None], nodes: list[Node], tol: Tolerances
) -> dict[Any, tuple[tuple[float, ...], ...]]:
    """Per (op, dtype) and per (class, dtype), per channel, over this comparison: the median error
    introduced (rounding units), the median ratio of output error to predicted input error, and
    how far that ratio reaches among the group's calls.

    The first absorbs fresh noise every node of a kind adds (TF32 matmuls, a bf16 softmax); the
    second corrects the propagation model where an op amplifies more than its class predicts. The
    third covers the spread of that correction where statistics cannot bound it call by call (a
    sum over a row of products, in fp32 on bf16 data): how far the ratio reaches among the
    calls whose error is beyond their rounding (where the ratio decides), at most
    ``tol.downstream``, once as ops that sum many terms spread and once as elementwise ops do
    (see :func:`tail_ratio`); each call takes the one of its kind. With more calls a clean run
    reaches further, and a fault still has to stand out from all.

    Outputs with roles (a normalization's input gradient against its weight and bias gradients)
    are grouped by role, ``(op, dtype, role)``: their errors relate to their inputs' in ways that
    spread differently, and a call's own error shows in the role it went wrong in.
    """
    by_group: dict[Any, list[tuple[tuple[float, ...], tuple[float, ...]]]] = defaultdict(list)
    for j in judged:
        if j is None or not j.judgeable or nodes[j.index][3] != "op":
            continue
        for role, es, xs, fs in j.parts or (("", j.e, j.x, j.f1),):
            intro = tuple(
                max(0.0, e - x) / f if not math.isnan(e) and math.isfinite(x) else 0.0 for e, x, f in zip(es, xs, fs)
            )
            ratio = tuple(
                e / x if not math.isnan(e) and math.isfinite(x) and x > 0 else math.nan for e, x in zip(es, xs)
            )
            # the ratio where it decides: an error beyond the node's own rounding (else 0, left out)
            beyond = tuple(r if e > tol.local * j.lam * f else 0.0 for r, e, f in zip(ratio, es, fs))
            by_group[group_key(j.group, role)].append((intro, ratio, beyond))
            by_group[group_key((j.cls.kind, j.group[1]), role)].append((intro, ratio, beyond))
    out: dict[Any, tuple[tuple[float, ...], ...]] = {}
    for key, rows in by_group.items():
        if len(rows) < 5:
            continue
        intro = np.median(np.asarray([r[0] for r in rows], dtype=np.float64), axis=0)
        ratios = np.asarray([r[1] for r in rows], dtype=np.float64)
        beyond = np.asarray([r[2] for r in rows], dtype=np.float64)
        ratio, tail, tail_elementwise = [], [], []
        for column, deciding in zip(ratios.T, beyond.T):
            seen = column[~np.isnan(column)]
            ratio.append(float(np.median(seen)) if len(seen) >= 5 else 0.0)
            tail.append(min(tol.downstream, tail_ratio(deciding[deciding > 0], accumulates=True)))
            tail_elementwise.append(min(tol.downstream, tail_ratio(deciding[deciding > 0], accumulates=False)))
        out[key] = (tuple(float(v) for v in intro), tuple(ratio), tuple(tail), tuple(tail_elementwise))
    return out


def group_key(group: tuple[str, str], role: str) -> tuple[str, ...]:
    """The calibration group of one output: ``(op or class, dtype)``, and its role where it has one."""
    return (*group, role) if role else group


_TAIL_MIN_CALLS = 8  # fewer calls say too little about a spread


_TAIL_SAFETY = 2.0


# The upper tail is fitted through these quantiles of the log ratios: high enough that a group's
# bulk (a loose bound, ratios far below 1) does not widen it, low enough that a fault or two
# among the calls do not move it.
_TAIL_QUANTILES = (0.75, 0.9)


_TAIL_Z = (0.6745, 1.2816)  # the standard normal's quantiles at those levels


def tail_ratio(ratios: np.ndarray, accumulates: bool) -> float:
    """How far the observed/predicted ratios of a group's ``n`` calls reach (0 for too few calls).

    A log-normal fitted to the whole spread (median and median deviation), extrapolated to the
    largest of ``n`` calls (its median plus sqrt(2 ln n) deviations), times ``_TAIL_SAFETY``.
    For ops that sum many terms the statistics only estimate the error, which scatters both
    ways around the estimate, and that fit is the model, though never below ``_TAIL_SAFETY``
    times the second largest ratio: where a group's calls fall into two populations (a batch
    norm's backward decided by its input gradient in most calls, by its weight and bias
    gradients in some), the fit follows the bulk and stops short of calls a fault must still
    stand out from. For elementwise ops they bound it:
    most calls sit far below the bound (ratios of 0.01 to 0.5), which widens the fit far
    beyond any call. There the reach is at most the larger of a log-normal through the upper
    quantiles and ``_TAIL_SAFETY`` times the second largest ratio: a call must stand out from
    every other call of its group but one, and from the group's upper tail.
    """
    if len(ratios) < _TAIL_MIN_CALLS:
        return 0.0
    logs = np.log10(ratios)
    reach = math.sqrt(2.0 * math.log(len(ratios)))
    center = float(np.median(logs))
    sigma = 1.4826 * float(np.median(np.abs(logs - center)))
    whole = _TAIL_SAFETY * 10.0 ** (center + reach * sigma)
    second = _TAIL_SAFETY * float(np.partition(ratios, -2)[-2])
    if accumulates:
        return max(whole, second)
    low, high = np.quantile(logs, _TAIL_QUANTILES)
    sigma = float(high - low) / (_TAIL_Z[1] - _TAIL_Z[0])
    upper = _TAIL_SAFETY * 10.0 ** (float(low) + (reach - _TAIL_Z[0]) * sigma)
    return min(whole, max(upper, second))


TF32_LAM_MIN = 0.25  # a TF32 call's threshold never drops below one TF32 unit (times its condition)


_TF32_SPREAD_MIN = 8  # calls needed to learn how far a run's TF32 matmuls stray


def tf32_spread_of(judged: list[JudgedNode | None]) -> tuple[float, ...] | None:
    """Per channel, the 90th percentile of what this rank's TF32-allowed matmul/conv calls
    introduce beyond their inputs' error, in units of their own TF32 allowance (half the ``lam``
    scale): where the device rounds to nearest it is a fraction of a unit, toward zero more."""
    rows = [j for j in judged if j is not None and j.uses_tf32 and j.judgeable]
    if len(rows) < _TF32_SPREAD_MIN:
        return None
    spread = []
    for c in range(3):
        values = sorted(
            max(0.0, e - x) / f
            for j in rows
            for e, x, f in [(j.e[c], j.x[c], j.f1[c])]
            if not math.isnan(e) and math.isfinite(x) and f > 0
        )
        spread.append(values[int(0.9 * (len(values) - 1))] if len(values) >= _TF32_SPREAD_MIN else math.nan)
    return tuple(spread)


_BITWISE_MEMBERS = 3  # calls of an op its replay must give bit for bit before any other call must too


_BITWISE_RANK = 8  # informative calls a rank needs before they speak for ops with fewer calls of their own


def ops_reproduced_bitwise(ri: RankInput) -> dict[str, tuple[int, bool]]:
    """Ops whose replay gives this rank's calls bit for bit: the device computes them as this CPU
    does, so a call that differs in one bit (a fault far below any rounding budget) is wrong.
    Op name -> (the calls that speak for it, whether they are its own). An op speaks for itself with at least three calls
    reproduced, all but one in ten; an op with fewer is covered, unless its own calls say
    otherwise, when nine in ten of the rank's informative calls (ops that round, at least eight: no
    copy, max or single IEEE operation, which every device gives bit for bit) are reproduced: then
    this is the machine the run ran on."""
    names = {node.op_id: node.op for node in ri.nodes}
    same: dict[str, int] = defaultdict(int)
    other: dict[str, int] = defaultdict(int)
    rank_same = rank_other = 0
    for op_id, own in ri.own_errors.items():
        name = names.get(op_id)
        if name is None:
            continue
        if own.bitwise:
            same[name] += 1
        else:
            other[name] += 1
        if own.informative:
            rank_same += own.bitwise
            rank_other += not own.bitwise
    rank_held = rank_same >= _BITWISE_RANK and rank_other <= 0.1 * (rank_same + rank_other)
    held = {}
    for name in set(same) | set(other):
        if other[name] > max(1, 0.1 * (same[name] + other[name])):
            continue  # its own calls say the device computes it otherwise
        if same[name] >= _BITWISE_MEMBERS:
            held[name] = (same[name], True)
        elif rank_held:
            held[name] = (rank_same, False)
    return held


def accumulation_bounds_hold(ri: RankInput) -> bool:
    """Whether this rank's reduced-precision matmul/conv calls are reproduced within their
    accumulation bounds by some rounding of their operands (most of them, at least three): then
    the device's arithmetic is known, and a call no rounding reproduces is wrong."""
    names = {node.op_id: node.op for node in ri.nodes}
    best = [
        min(own.bounds)
        for op_id, own in ri.own_errors.items()
        if own.bounds and own.dtype == "float32" and classify(names.get(op_id, "")).precision_variable
    ]
    return len(best) >= FIT_MEMBERS and quantile75(best) <= 1.0
