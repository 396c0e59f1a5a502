"""Regions (a fused op against the bench ops it replaces, a rewrite, an extra op) judged at their
boundary like an op, and their roots.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace
from typing import Callable, Mapping

from tracecmp.aten.opclass import AUTOCAST_ELEMENTWISE, OpClass, base_name, classify, given_nonfinite, is_copy, read_by
from tracecmp.comparison.localize.decide import random_reason, replayed_root
from tracecmp.comparison.localize.predict import (
    averaged_rounding,
    contracts_nonzero,
    local_kappa,
    predicted_error,
    through_view,
)
from tracecmp.comparison.localize.records import JudgedNode, NodeVerdict, RankInput
from tracecmp.comparison.tolerances import Tolerances
from tracecmp.graph.nodes import Node, TensorState
from tracecmp.numerics.replay import OwnError, RegionReplay
from tracecmp.numerics.units import EPS, FP32_EPS, TINY, reduced_unit
from tracecmp.verdict.records import Divergence, Region

# A region member as RankInput.region_ops holds it: (kind, op, args, input ids, output ids).
_OpEntry = tuple[str, str, str, list[int], list[int]]


@dataclass
class _RegionJudged:
    """What the region's boundary shows (pass 1), for the verdict and the statuses."""

    region: Region
    judgeable: bool
    inputs_exact: bool
    outputs: list[tuple[int, TensorState]]  # (target tensor id, measured state)
    e: tuple[float, float, float] = (0.0, 0.0, 0.0)  # the worst output's measured error per channel
    x: tuple[float, float, float] = (0.0, 0.0, 0.0)  # inherited error
    r: tuple[float, float, float] = (0.0, 0.0, 0.0)  # honest rounding budget
    worst: int | None = None  # target tensor id of the worst output
    inputs_finite: bool = True
    given: bool = False  # a member was handed a NaN/Inf as an argument


def past_bench_cast(s: TensorState | None, ri: RankInput, region_id: int | None) -> TensorState | None:
    """The error an input shows against what the bench op really reads when a bench-only cast
    (autocast's ``_to_copy``) sits between: the input's own, plus that dtype's rounding."""
    if s is None or region_id is None:
        return s
    region = ri.regions.get(region_id)
    if region is None or region.kind != "pass-through":
        return s
    unit = max((v.unit for (side, _), v in _region_made(ri, region, "b")), default=0.0)
    if unit <= 0.0:
        return s
    seen = copy.copy(s)
    seen.exact = False
    seen.c_ext, seen.c_sys = s.c_ext + unit, s.c_sys + unit
    seen.c_rms = s.c_rms + unit if not math.isnan(s.c_rms) else unit
    return seen


def _region_made(ri: RankInput, region: Region, side: str) -> list[tuple[tuple[str, int], TensorState]]:
    ops = region.bench_ops if side == "b" else region.target_ops
    out = []
    for o in ops:
        entry = ri.region_ops.get((side, o))
        if entry is None:
            continue
        for tid in entry[4]:
            value = ri.region_values.get((side, tid))
            if value is not None:
                out.append(((side, tid), value))
    return out


def judge_region(
    region: Region,
    ri: RankInput,
    lookup: Callable[[int], TensorState | None],
    tol: Tolerances,
    exact_matmul: bool = False,
) -> _RegionJudged:
    """Pass-1 numbers of a region: its outputs' error, what its inputs carried in, its honest budget."""
    base = ri.view_base
    outputs = []
    for T, _ in region.outputs:
        m = ri.measured.get(base.get(T, T))
        if m is not None:
            outputs.append((T, m))
    ins = [(T, lookup(T)) for T, _ in region.inputs if T is not None]
    unknown = any(s is None or not s.known for _, s in ins)
    known = [s for _, s in ins if s is not None and not s.uninit]
    judged = _RegionJudged(
        region,
        judgeable=bool(outputs) and not unknown,
        inputs_exact=not unknown and all(s.exact for s in known),
        outputs=outputs,
        inputs_finite=not any(s.nonfinite for s in known),
        given=region_given(region, ri),
    )
    if any(s.nonfinite_mismatch for s in known) or any(not s.exact for s in known if not s.is_float):
        judged.judgeable = False  # NaN or a changed index/mask reaching it: its arithmetic is not on trial
    if not judged.judgeable:
        return judged
    predicted = _region_prediction(region, ri, lookup, tol, exact_matmul)
    best = -math.inf
    for T, m in outputs:
        if not m.is_float or (m.nonfinite_mismatch and (m.given or judged.given)):
            continue  # NaN/Inf the program handed in, which differ from the bench's: no statistic reads through them
        x, r = predicted.get(T, ((math.inf,) * 3, (math.inf,) * 3))
        e = (m.e_ext, m.e_sys, m.e_rms)
        ratio = max(
            (
                (ec - tol.margin * xc) / max(tol.local * rc, TINY)
                for ec, xc, rc in zip(e, x, r)
                if not math.isnan(ec) and math.isfinite(xc)
            ),
            default=-math.inf,
        )
        if ratio > best:
            best, judged.e, judged.x, judged.r, judged.worst = ratio, e, x, r, T
    if judged.worst is None:
        judged.judgeable = False
    return judged


def region_given(region: Region, ri: RankInput) -> bool:
    return any(
        given_nonfinite(ri.region_ops[(side, o)][2])
        for side, ops in (("t", region.target_ops), ("b", region.bench_ops))
        for o in ops
        if (side, o) in ri.region_ops
    )


def _region_prediction(
    region: Region,
    ri: RankInput,
    lookup: Callable[[int], TensorState | None],
    tol: Tolerances,
    exact_matmul: bool = False,
) -> dict[int, tuple[tuple[float, float, float], tuple[float, float, float]]]:
    """Per target output of ``region``: (inherited error, honest rounding budget) per channel."""
    side = _modelling_side(region, ri)
    ops = region.bench_ops if side == "b" else region.target_ops
    floor = _output_floor(region, ri)
    inherited, budget = _region_inputs(region, ri, lookup, side)
    for o in ops:
        entry = ri.region_ops.get((side, o))
        if entry is None:
            continue
        if entry[0] != "op":
            _through_region_view(entry, inherited, budget)
            continue
        _through_region_op(entry, ri, side, floor, tol, exact_matmul, inherited, budget)
    return _at_region_outputs(region, side, inherited, budget)


def _modelling_side(region: Region, ri: RankInput) -> str:
    """The side ("b" or "t") that models the region best: the one spelling it out in more ops (the decomposition)."""
    computing = {
        side: sum(1 for o in ops if ri.region_ops.get((side, o), ("",))[0] == "op")
        for side, ops in (("t", region.target_ops), ("b", region.bench_ops))
    }
    return "b" if computing["b"] >= computing["t"] and computing["b"] else "t"


def _output_floor(region: Region, ri: RankInput) -> float:
    """The region's output dtypes' unit: a fused kernel rounds at least to them, whatever the bench used."""
    base = ri.view_base
    return max(
        (ri.measured[base.get(T, T)].unit for T, _ in region.outputs if base.get(T, T) in ri.measured), default=0.0
    )


def _region_inputs(
    region: Region, ri: RankInput, lookup: Callable[[int], TensorState | None], side: str
) -> tuple[dict[int, TensorState], dict[int, TensorState]]:
    """(inherited, budget) seeded at the region's inputs, keyed by the modelling side's tensor ids:
    an input carries its measured error in and no rounding budget."""
    inherited: dict[int, TensorState] = {}
    budget: dict[int, TensorState] = {}
    for T, B in region.inputs:
        key = B if side == "b" else T
        if key is None:
            continue
        s = lookup(T) if T is not None else None
        if s is None:
            s = ri.region_values.get((side, key)) or TensorState(known=True, exact=True)
        inherited[key] = s
        budget[key] = _with_error(s, (0.0, 0.0, 0.0))
    return inherited, budget


def _through_region_view(entry: _OpEntry, inherited: dict[int, TensorState], budget: dict[int, TensorState]) -> None:
    """A view (or a source inside the region): shows its input's values, or is a constant."""
    _, _, _, inputs, outputs = entry
    src = inherited.get(inputs[0]) if inputs else None
    for tid in outputs:
        inherited[tid] = through_view(src) if src is not None else TensorState(known=True, exact=True)
        budget[tid] = budget.get(inputs[0], inherited[tid]) if inputs else inherited[tid]


def _through_region_op(
    entry: _OpEntry,
    ri: RankInput,
    side: str,
    floor: float,
    tol: Tolerances,
    exact_matmul: bool,
    inherited: dict[int, TensorState],
    budget: dict[int, TensorState],
) -> None:
    """An op inside the region: its outputs' inherited error and their budget (what its inputs' budget
    carries through it, plus its own honest rounding)."""
    _, op, args, inputs, outputs = entry
    cls = classify(op)
    # Rounding is relative to each element: a denominator's unit is the quotient's unit, not
    # max|x| / min|x| of them (that factor is for an error spread evenly over small and large).
    budget_cls = replace(cls, inverse_inputs=())
    for index, tid in enumerate(outputs):
        out = ri.region_values.get((side, tid))
        if out is None or cls.kind == "uninit":
            continue
        read = read_by(op, args, inputs, index)
        ins_x = [(pos, inherited[t]) for pos, t in read if t in inherited and cls.input_rule(pos) != "ignore"]
        ins_r = [(pos, budget[t]) for pos, t in read if t in budget and cls.input_rule(pos) != "ignore"]
        float_x = [(pos, s) for pos, s in ins_x if s.is_float and not s.uninit]
        float_r = [(pos, s) for pos, s in ins_r if s.is_float and not s.uninit]
        if not out.is_float:
            exact = all(s.exact for _, s in ins_x)
            inherited[tid] = _with_error(out, (0.0 if exact else 1.0,) * 3, exact=exact)
            budget[tid] = _with_error(out, (0.0,) * 3)
            continue
        x = predicted_error(cls, base_name(op), float_x, out) if cls.kind != "factory" else (0.0, 0.0, 0.0)
        carried = predicted_error(budget_cls, base_name(op), float_r, out) if cls.kind != "factory" else (0.0, 0.0, 0.0)
        own = _own_rounding(cls, float_x, out, floor, tol, exact_matmul, ri.reduced_precision)
        inherited[tid] = _with_error(out, x)
        budget[tid] = _with_error(out, tuple(c + f for c, f in zip(carried, own)))


def _own_rounding(
    cls: OpClass,
    float_x: list[tuple[int, TensorState]],
    out: TensorState,
    floor: float,
    tol: Tolerances,
    exact_matmul: bool,
    reduced: str | None,
) -> tuple[float, float, float]:
    """An honest kernel's own rounding of ``out`` per channel: its dtype's unit (at least the region's
    output floor; the reduced precision's where a float32 contraction may use it), scaled by the
    accumulation's kappa."""
    unit, lam, tf32 = max(out.unit, floor), (2.0 if cls.accumulates else 1.0), False
    if (
        cls.precision_variable
        and tol.allow_tf32
        and not exact_matmul
        and 0 < unit <= FP32_EPS
        and contracts_nonzero(cls, float_x)
    ):
        unit, lam, tf32 = reduced_unit(reduced), 0.5, True
    fresh = unit * lam * (local_kappa(cls, float_x, out) if cls.accumulates else 1.0)
    return (fresh, averaged_rounding(fresh, out, tf32), fresh)


def _at_region_outputs(
    region: Region, side: str, inherited: dict[int, TensorState], budget: dict[int, TensorState]
) -> dict[int, tuple[tuple[float, float, float], tuple[float, float, float]]]:
    """(inherited error, budget) per channel at each target output of ``region``."""
    result = {}
    for T, B in region.outputs:
        key = B if side == "b" else T
        if key in inherited and key in budget:
            x, r = inherited[key], budget[key]
            result[T] = (
                (x.e_ext, x.e_sys, x.e_rms if not math.isnan(x.e_rms) else x.e_ext),
                (r.e_ext, r.e_sys, r.e_rms if not math.isnan(r.e_rms) else r.e_ext),
            )
    return result


def _with_error(s: TensorState, e: tuple[float, ...], exact: bool | None = None) -> TensorState:
    out = copy.copy(s)
    out.e_ext, out.e_sys, out.e_rms = (float(v) for v in e)
    out.c_ext, out.c_sys, out.c_rms = out.e_ext, out.e_sys, out.e_rms
    out.exact = all(v == 0.0 for v in e) if exact is None else exact
    out.known = True
    return out


@dataclass(frozen=True)
class _RegionRoot:
    """A root found in a region: the target op named for it, its kind, reason and score (rounding
    units), and what shows it: the region's boundary, or the op's own replay."""

    op_id: int | None
    kind: str
    reason: str
    score: float
    j: _RegionJudged | None
    own: OwnError | None = None


def region_roots(
    ri: RankInput,
    judged: Mapping[int, _RegionJudged],
    verdicts: dict[int, NodeVerdict],
    tol: Tolerances,
    exact_matmul: bool,
    roots: list[tuple[Node, Divergence]],
) -> set[int]:
    """Decide every judged region (and replay roots among target members); returns the root regions."""
    nodes = {node.op_id: node for node in ri.nodes if node.op_id in ri.member_of}
    root_regions: set[int] = set()
    for region_id, j in judged.items():
        region = j.region
        kind, reason, op_id, score = _decide_region(j, ri, tol)
        if not kind:
            continue
        root_regions.add(region_id)
        _add_region_root(ri, region, nodes, verdicts, roots, _RegionRoot(op_id, kind, reason, score, j))
    # A member op whose own replay is far from an honest kernel's is named itself.
    for op_id, node in nodes.items():
        own = ri.own_errors.get(op_id)
        region_id = ri.member_of[op_id]
        if own is None or node.kind != "op" or region_id in root_regions:
            continue
        cls = classify(node.op)
        probe = JudgedNode(
            0,
            op_id,
            (node.op, own.dtype),
            cls,
            False,
            False,
            False,
            (0.0,) * 3,
            (0.0,) * 3,
            (1.0,) * 3,
            1.0,
            False,
            True,
            True,
            1.0,
        )
        reason = replayed_root(probe, node, ri, tol, exact_matmul, None)
        if not reason:
            continue
        root_regions.add(region_id)
        score = own.error / EPS.get(own.dtype, FP32_EPS)
        found = _RegionRoot(op_id, "computation", reason, score, None, own=own)
        _add_region_root(ri, ri.regions[region_id], nodes, verdicts, roots, found)
    return root_regions


def _nonfinite_root(j: _RegionJudged, ri: RankInput, name: str) -> tuple[str, str, int | None, float] | None:
    """A region that makes NaN/Inf the bench does not have from finite inputs: a NaN root, or, where
    an argument hands them in to ops only the target runs (``index_fill(nan)``), a structure root;
    an argument the bench hands in alike (a mask of -inf) is no root."""
    region = j.region
    worst_nan = [(T, s) for T, s in j.outputs if s.nonfinite and s.nonfinite_mismatch]
    if not worst_nan or not j.inputs_finite:
        return None
    if not j.given:
        kind, reason = (
            "nan",
            f"NaN/Inf appear in the output of {name} although every input is finite (the bench's is not)",
        )
    elif not region.bench_ops:
        # Handed in by an argument, but by ops the bench never runs: no bench value hands the
        # same NaN/Inf in, so nothing excuses it.
        kind = "structure"
        reason = f"target-only ops ({name}) put NaN/Inf into values the bench holds finite, handed in by an argument"
    else:
        return None
    return kind, reason, _producer(ri, region, worst_nan[0][0]), math.inf


def _decide_region(j: _RegionJudged, ri: RankInput, tol: Tolerances) -> tuple[str, str, int | None, float]:
    """(root kind or "", reason, the target op to name, score in rounding units)."""
    region = j.region
    name = _region_name(region)
    made = _nonfinite_root(j, ri, name)
    if made is not None:
        return made
    if not j.outputs or all(s.exact for _, s in j.outputs):
        return "", "", None, 0.0
    narrowed = _round_trip_inside(region, ri)
    if narrowed is not None:
        op_id, reason, wide = narrowed
        score = max((e / wide for e in j.e if not math.isnan(e)), default=0.0)  # in the bench precision's units
        return "precision", f"{name}: {reason}", op_id, score
    replay = ri.region_replays.get(region.region_id)
    if replay is not None:
        unit = EPS.get(replay.dtype, FP32_EPS)
        if replay.sides_differ > _SIDES_DIFFER:
            return (
                "computation",
                f"{name}: the target's ops and the bench's compute different functions: on the "
                f"target's recorded inputs their float64 replays differ by {replay.sides_differ:.2e}",
                _producer(ri, region, replay.output),
                replay.sides_differ / unit,
            )
        excess = replay.error / max(tol.replay_margin * replay.honest, tol.replay_local * unit)
        if excess > 1.0:
            against = "its own ops" if replay.reference == "target" else "the bench's ops"
            return (
                "computation",
                f"{name}: own error {replay.error:.2e} against a float64 replay of {against} on "
                f"its recorded inputs is {replay.error / max(replay.honest, TINY):.0f}x what an honest replay "
                f"makes ({replay.honest:.1e})",
                _producer(ri, region, replay.output),
                replay.error / unit,
            )
    if not j.judgeable:
        return "", "", None, 0.0
    channels = ("max/min", "norm/mean", "rms")
    excess = [
        ((e - tol.margin * x) / max(tol.local * r, TINY), c, e, x)
        for c, (e, x, r) in enumerate(zip(j.e, j.x, j.r))
        if not math.isnan(e) and math.isfinite(x)
    ]
    if not excess:
        return "", "", None, 0.0
    score, c, e, x = max(excess)
    if score <= 1.0:
        return "", "", None, 0.0
    what = f"relative error {e:.2e} ({channels[c]})"
    unit = max(j.r[c], TINY)
    if not region.bench_ops and region.kind != "pass-through":
        reason = f"target-only ops ({name}) change the values: {what}"
        return "structure", reason, _producer(ri, region, j.worst), (e - x) / unit
    if j.inputs_exact:
        # A fused kernel that draws (native_dropout on an accelerator against the CPU's bernoulli_
        # and mul) with every input agreeing: the draw is what differs.
        members = set(region.target_ops)
        drawn = next((node.op_id for node in ri.nodes if node.op_id in members and node.random), None)
        if drawn is not None:
            return "random", f"{name}: {random_reason(what, True)}", drawn, (e - x) / unit
        reason = f"{name}: output differs ({what}) while every input agrees bitwise"
    elif x > 0:
        reason = f"{name}: output error {e:.2e} ({channels[c]}) is {e / x:.0f}x what its inputs carried in ({x:.1e})"
    else:
        reason = (
            f"{name}: output error {e:.2e} ({channels[c]}) beyond an honest implementation's rounding ({j.r[c]:.1e})"
        )
    return "computation", reason, _producer(ri, region, j.worst), (e - x) / unit


def _round_trip_inside(region: Region, ri: RankInput) -> tuple[int, str, float] | None:
    """The target op of a forward region that the target alone computes in a lower precision, why,
    and the unit of the precision it should have had: it narrows a float value to that precision just before the op and widens the result back
    just after, inside the region, while none of the bench's ops there makes a tensor of that
    precision (a hand-written attention's softmax in bfloat16 against a float32 fused attention).
    Autocast's narrowing for matmul-like ops (and PReLU, a bias add) is no such round trip."""
    if region.phase != "forward" or not region.bench_ops:
        return None
    entries = [(o, ri.region_ops.get(("t", o))) for o in region.target_ops]
    ops = [(o, e) for o, e in entries if e is not None and e[0] == "op"]
    base: dict[int, int] = {}  # a view's tensor -> the tensor it shows
    for _, e in entries:
        if e is not None and e[0] == "view" and e[3]:
            base.update({t: base.get(e[3][0], e[3][0]) for t in e[4]})

    def unit(side: str, tid: int) -> float:
        s = ri.region_values.get((side, base.get(tid, tid) if side == "t" else tid))
        return s.unit if s is not None and s.is_float else 0.0

    casts = {e[4][0]: (o, e[3][0]) for o, e in ops if base_name(e[1]) == "_to_copy" and e[3] and e[4]}
    bench_units = {unit("b", t) for o in region.bench_ops for t in ri.region_ops.get(("b", o), ("", "", "", [], []))[4]}
    for o, (_, op, _, inputs, outputs) in ops:
        name = base_name(op)
        if not outputs or name == "_to_copy" or name in AUTOCAST_ELEMENTWISE or classify(op).kind == "contract":
            continue
        low = unit("t", outputs[0])
        if low <= FP32_EPS or low in bench_units:
            continue
        narrowing = [casts[t] for t in (base.get(t, t) for t in inputs) if t in casts]
        wide = [unit("t", src) for _, src in narrowing if 0 < unit("t", src) < low]
        if not wide:
            continue
        widening = [c for t, (c, src) in casts.items() if base.get(src, src) == outputs[0] and unit("t", t) == wide[0]]
        if widening:
            reason = (
                f"the target computes {name} at a lower precision than the bench: it narrows its input just before "
                f"it (op {narrowing[0][0]}) and widens the result back just after (op {widening[0]}), a round trip "
                "no op of the bench's makes"
            )
            return o, reason, wide[0]
    return None


# Two float64 replays of the same function by different ops differ by float64 rounding times the
# computation's condition (1e-13 for attention); a different eps or scale moves them by 1e-7 or more.
_SIDES_DIFFER = 1e-9


def _region_name(region: Region) -> str:
    def ops(names: tuple[str, ...]) -> str:
        computing = [n for n in names if not n.startswith("source.")]
        shown = ", ".join(dict.fromkeys(base_name(n) for n in computing[:6]))
        return shown + (", ..." if len(computing) > 6 else "")

    if not region.bench_ops:
        return ops(region.target_names)
    if not region.target_ops:
        return f"bench-only {ops(region.bench_names)}"
    return f"region {region.region_id} ({region.kind}: {ops(region.target_names)} against the bench's {ops(region.bench_names)})"


def _producer(ri: RankInput, region: Region, tid: int | None) -> int | None:
    """The target op that made ``tid`` (or the region's one computing op)."""
    computing = [o for o in region.target_ops if ri.region_ops.get(("t", o), ("",))[0] == "op"]
    if len(computing) == 1:
        return computing[0]
    wanted = {tid, ri.view_base.get(tid, tid)} if tid is not None else set()
    for o in computing:
        if wanted & set(ri.region_ops[("t", o)][4]):
            return o  # the op that computed the worst output's values, not a view of them
    return computing[-1] if computing else (region.target_ops[-1] if region.target_ops else None)


def _add_region_root(
    ri: RankInput,
    region: Region,
    nodes: Mapping[int, tuple],
    verdicts: dict[int, NodeVerdict],
    roots: list[tuple[Node, Divergence]],
    found: _RegionRoot,
) -> None:
    """Names the root ``found`` in its verdict and adds it to ``roots``."""
    op_id, kind, reason, score, j, own = found.op_id, found.kind, found.reason, found.score, found.j, found.own
    if op_id is None or op_id not in nodes:
        return
    op_id_, step, phase, node_kind, op, name, module, location, args, inputs, outputs, random, stack = nodes[op_id]
    verdict = verdicts[op_id]
    metrics: dict[str, float] = {}
    if j is not None and math.isfinite(score):  # NaN/Inf made: no error measure applies
        for label, e, x, r in zip(("ext", "sys", "rms"), j.e, j.x, j.r):
            if not math.isnan(e):
                metrics[f"rel_err_{label}"] = float(e)
                if math.isfinite(x):
                    metrics[f"expected_{label}"] = float(x)
                metrics[f"budget_{label}"] = float(r)
    replay = own or ri.region_replays.get(region.region_id)
    if replay is not None:
        metrics.update(own_error=replay.error, honest_error=replay.honest)
        if isinstance(replay, RegionReplay) and not math.isnan(replay.sides_differ):
            metrics["sides_differ"] = replay.sides_differ
    verdict.root_kind, verdict.reason, verdict.metrics = kind, reason, metrics
    verdict.introduced = score
    bench_op = region.bench_ops[-1] if region.bench_ops else None
    roots.append(
        (
            (int(step), int(op_id), ri.rank),
            Divergence(
                op=op,
                module=module,
                phase=phase,
                step=int(step),
                location=location,
                op_id=int(op_id),
                bench_op_id=None if bench_op is None else int(bench_op),
                rank=ri.rank,
                kind=kind,
                reason=reason,
                score=float(score),
                metrics=metrics,
                stack=stack,
                region=region.region_id,
            ),
        )
    )


def region_status_of(
    region: Region, j: _RegionJudged | None, root: bool, lookup: Callable[[int], TensorState | None]
) -> str:
    if not region.outputs and region.kind == "pass-through":
        # Casts no op reads (accelerate's convert_to_fp32 of a model output the loss never used):
        # they move their inputs' values only, so they are what their inputs are.
        ins = [lookup(T) for T, _ in region.inputs if T is not None]
        if ins and all(s is not None and s.known for s in ins):
            if all(s.exact for s in ins):
                return "agrees"
            return "diverged" if any(s.tainted or s.nonfinite_mismatch for s in ins) else "noise"
    if j is None or not j.outputs:
        return "uncompared"
    states = [s for _, s in j.outputs]
    if any(s.nonfinite_mismatch and not (s.given or j.given) for s in states):
        return "nan"
    if len(j.outputs) < len(region.outputs):
        return "uncompared"
    if all(s.exact for s in states):
        return "agrees"
    ins = [lookup(T) for T, _ in region.inputs if T is not None]
    if root or any(s is not None and s.tainted for s in ins):
        return "diverged"
    return "noise"


def substitution_notes(rank_inputs: list[RankInput], verdicts: Mapping[tuple[int, int], NodeVerdict]) -> list[str]:
    """Where the target computes with another function than the bench and no value shows it: a
    region of one computing op a side whose names differ (``hardtanh_`` for ``relu_``: a ReLU6 no
    activation reached 6 with) whose ops all agree with the bench within noise. Not a divergence,
    since no value differs; a change of the program all the same, which later steps may show.

    >>> substitution_notes([], {})
    []
    """
    found: dict[tuple[str, str, str], int] = {}
    for ri in rank_inputs:
        for region in ri.regions.values():
            statuses = {verdicts[(ri.rank, o)].status for o in region.target_ops if (ri.rank, o) in verdicts}
            if region.kind not in ("fused", "rewritten") or not statuses <= {"agrees", "noise"}:
                continue
            mine, theirs = (
                _computing(ri, side, ops) for side, ops in (("t", region.target_ops), ("b", region.bench_ops))
            )
            if len(mine) == 1 and len(theirs) == 1 and mine[0].rstrip("_") != theirs[0].rstrip("_"):
                key = (region.module or "<top>", mine[0], theirs[0])
                found[key] = found.get(key, 0) + 1
    return [
        f"{module} computes with {mine} where the bench computes with {theirs} ({calls} call{'s' * (calls > 1)}): "
        "every value agrees within noise in the compared steps, so it is no root; another function all the same, "
        "which later values may show"
        for (module, mine, theirs), calls in found.items()
    ]


def _computing(ri: RankInput, side: str, ops: tuple[int, ...]) -> list[str]:
    """The base names of a region side's ops that compute (no views, copies or casts)."""
    entries = [ri.region_ops.get((side, o)) for o in ops]
    return [base_name(e[1]) for e in entries if e is not None and e[0] == "op" and not is_copy(e[1])]
