"""The walk: every node of a rank's target graph in execution order, judged against what its inputs
carried in; roots, suspects and the first divergence come out of it.

>>> verdicts, roots, skipped, drifts = localize([rank_input], Tolerances())   # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable, Iterable

from tracecmp.aten.opclass import OpClass, base_name, classify, given_nonfinite, is_readout, takes_call_args
from tracecmp.comparison.adam import ADAM_UPDATES
from tracecmp.comparison.localize.arguments import class_for_call, constant_shift
from tracecmp.comparison.localize.calibrate import (
    TypicalRatio,
    accumulation_bounds_hold,
    ambient_noise,
    at_finite_scale,
    carried_error,
    carry_factors,
    layer_site,
    made_by,
    ops_reproduced_bitwise,
    tf32_spread_of,
)
from tracecmp.comparison.localize.decide import decide_node
from tracecmp.comparison.localize.history import (
    crossed_pairs,
    drift_of,
    follows_python,
    is_exact,
    readout_status,
    scaler_skips,
)
from tracecmp.comparison.localize.predict import (
    averaged_rounding,
    contracts_nonzero,
    local_kappa,
    predicted_error,
    through_view,
    within_adam_bound,
)
from tracecmp.comparison.localize.records import PROGRESS_EVERY, JudgedNode, NodeVerdict, RankInput, metric_dict
from tracecmp.comparison.localize.regions import (
    judge_region,
    past_bench_cast,
    region_given,
    region_roots,
    region_status_of,
)
from tracecmp.comparison.tolerances import Tolerances
from tracecmp.graph.nodes import Node, TensorState
from tracecmp.numerics.fits import model_fits
from tracecmp.numerics.units import EPS, FP32_EPS, TF32_EPS, TINY
from tracecmp.trace.schema import UNREAD_SOURCE
from tracecmp.verdict.records import Divergence, Drift, SkippedStep


def localize(
    ranks: Iterable[RankInput],
    tolerances: Tolerances,
    *,
    exact: bool = False,
    progress: Callable[[int], None] | None = None,
) -> tuple[dict[tuple[int, int], NodeVerdict], list[Divergence], list[SkippedStep], list[Drift]]:
    """Verdicts for every target node (keyed by (rank, op_id)), the roots, earliest first, the
    steps a loss scaler skipped on overflows it caught (not roots: see :func:`scaler_skips`), and
    where ranks drifted apart (:class:`Drift`, with the ops left undecided after it).

    ``progress(n)`` is called as nodes are walked (n nodes since the previous call).
    """
    verdicts: dict[tuple[int, int], NodeVerdict] = {}
    roots: list[tuple[Node, Divergence]] = []
    skipped: list[SkippedStep] = []
    drifts: list[Drift] = []
    for rank_input in ranks:
        v, r, s, drift = _localize_rank(rank_input, tolerances, exact, progress)
        verdicts.update({(rank_input.rank, k): x for k, x in v.items()})
        roots.extend(r)
        skipped.extend(s)
        drifts.extend([drift] if drift is not None else [])
    roots.sort(key=lambda item: item[0])
    return verdicts, [d for _, d in roots], sorted(skipped, key=lambda k: (k.step, k.rank)), drifts


def _localize_rank(
    ri: RankInput, tol: Tolerances, exact_mode: bool, progress: Callable[[int], None] | None = None
) -> tuple[dict[int, NodeVerdict], list[tuple[Node, Divergence]], list[SkippedStep], Drift | None]:
    state: dict[int, TensorState] = {}
    verdicts: dict[int, NodeVerdict] = {}
    judged: list[JudgedNode | None] = []
    base = ri.view_base
    first_nonexact: int | None = None
    channels = ("max/min", "norm/mean", "rms")
    crossed = crossed_pairs(ri)
    producer: dict[int, tuple[tuple, int]] = {}  # tensor id (view bases) -> the node that made it, output position

    def lookup(tid: int) -> TensorState | None:
        tid = base.get(tid, tid)
        # A value produced outside the compared steps is known only as measured.
        return state.get(tid) or ri.measured.get(tid)

    # Target ops of regions where some member, on either side, was handed a NaN/Inf.
    given_regions = {o for region in ri.regions.values() if region_given(region, ri) for o in region.target_ops}
    typical = TypicalRatio()

    # ---- pass 1: measure, propagate, compute what each node introduced -------------------------
    for index, node in enumerate(ri.nodes):
        if progress is not None and index % PROGRESS_EVERY == 0 and index:
            progress(PROGRESS_EVERY)
        op_id, step, phase, kind, op, name, module, location, args, inputs, outputs, random, stack = node
        verdict = NodeVerdict(op_id)
        verdicts[op_id] = verdict
        producer.update((tid, (node, position)) for position, tid in enumerate(outputs) if tid not in base)
        if kind == "view" and all(t in base for t in outputs):
            judged.append(None)
            continue
        if op == UNREAD_SOURCE:  # only written by its first use (an out= buffer): its content means nothing
            for tid in outputs:
                state[tid] = TensorState(known=True, exact=True, uninit=True)
            judged.append(None)
            continue
        # Sources have no inputs; a view node whose output carries statistics of its own (capture's
        # alias.update: a tensor after writes through its views) assembles its inputs' values.
        cls = OpClass("factory") if kind == "source" else OpClass("copy") if kind == "view" else classify(op)
        if args and takes_call_args(op):
            cls = class_for_call(cls, op, args)
        ins_all = [(pos, lookup(t) if t not in base else through_view(lookup(t))) for pos, t in enumerate(inputs)]
        if ri.bench_only:
            ins_all = [(pos, past_bench_cast(s, ri, ri.bench_only.get((op_id, pos)))) for pos, s in ins_all]
        # Inputs whose values the op never reads (nll_loss_backward's log-probs) count for nothing.
        ins = [(pos, s) for pos, s in ins_all if s is not None and not s.uninit and cls.input_rule(pos) != "ignore"]
        unknown_input = any(s is None and cls.input_rule(pos) != "ignore" for pos, s in ins_all) or any(
            not s.known for _, s in ins
        )
        float_ins = [(pos, s) for pos, s in ins if s.is_float]
        discrete_changed = any(not s.exact for _, s in ins if not s.is_float)
        inputs_exact = not unknown_input and all(s.exact for _, s in ins)
        out_states: list[TensorState] = []
        roles: list[str] = []  # what each of out_states is among the op's outputs (normalization ops)
        positions: list[int] = []  # and its position among them
        given_in = any(s.given for _, s in ins)
        hands_nonfinite = op_id in given_regions or given_nonfinite(args)
        for position, tid in enumerate(outputs):
            if tid in base:  # an op returning a view of an input (e.g. an in-place op's alias)
                continue
            if cls.kind == "uninit":
                state[tid] = TensorState(known=True, exact=True, uninit=True)
                continue
            m = ri.measured.get(tid)
            if m is None and op_id in ri.units:
                # A compiled unit is a whole graph: what it made unmeasured is unknown, not exact.
                is_float, nonfinite, _ = ri.own.get(tid, (True, False, ""))
                state[tid] = TensorState(known=False, exact=False, nonfinite=nonfinite, is_float=is_float)
                continue
            if m is None:
                is_float, nonfinite, _ = ri.own.get(tid, (True, False, ""))
                # No partner: carry the inputs' error through (an extra copy, a fused op's piece).
                worst = max((s for _, s in float_ins), key=lambda s: s.level, default=None)
                est = TensorState(
                    known=not unknown_input and worst is not None or (not ins and not inputs),
                    exact=inputs_exact and (kind != "source" or op_id in ri.member_of),
                    nonfinite=nonfinite,
                    is_float=is_float,
                )
                if worst is not None:
                    est.e_ext, est.e_sys, est.e_rms = worst.e_ext, worst.e_sys, worst.e_rms
                    est.c_ext, est.c_sys, est.c_rms = worst.c_ext, worst.c_sys, worst.c_rms
                    est.amax, est.rms, est.numel = worst.amax, worst.rms, worst.numel
                    est.lo, est.hi, est.mean = worst.lo, worst.hi, worst.mean
                # A source inside a region is a constant of its implementation (the eager side's
                # causal-mask buffer, which the fused op has built in).
                est.known = est.known and (kind != "source" or op_id in ri.member_of)
                est.tainted = any(s.tainted for _, s in ins)
                est.nonfinite_mismatch = any(s.nonfinite_mismatch for _, s in ins)
                est.given = est.nonfinite_mismatch and (given_in or hands_nonfinite)
                state[tid] = est
                continue
            if m.nonfinite_mismatch and (given_in or hands_nonfinite):
                m.given = True
            state[tid] = m
            out_states.append(m)
            roles.append(cls.output_role(position))
            positions.append(position)
        if op_id in ri.member_of:
            # Judged with its region at the boundary, never on its own against the other side.
            judged.append(None)
            continue
        if not out_states:
            judged.append(None)
            continue
        if first_nonexact is None and not all(s.exact for s in out_states):
            first_nonexact = op_id
        outputs_exact = all(s.exact for s in out_states)
        # Sources after the first step may be parameters the optimizer already moved: their error
        # can be inherited, so only inputs and first-step sources are judged.
        source_inherited = (
            kind == "source"
            and op != "source.input"
            and first_nonexact is not None
            and (first_nonexact < op_id and step > ri.first_step)
        )
        # NaN/Inf reaching a node make its statistics say nothing about its own arithmetic.
        nonfinite_in = any(s.nonfinite_mismatch for _, s in ins)
        judgeable = (
            not unknown_input
            and not discrete_changed
            and not source_inherited
            and not nonfinite_in
            and cls.kind != "uninit"
            and kind != "view"
        )
        if cls.kind == "select" and not inputs_exact:
            judgeable = False  # comparisons, rounding, argmax: a changed input may change anything
        bench_args = ri.bench_args.get(ri.pairs.get(op_id, -1), "")
        if op_id in crossed:
            # Measured against a bench value that the bench computes differently: neither this
            # node nor what its outputs pass on can be judged.
            judgeable = False
            for m in out_states:
                m.known = m.known and m.exact
        best_e, best_x, best_f1, best_ratio = (0.0, 0.0, 0.0), (0.0, 0.0, 0.0), (1.0, 1.0, 1.0), -math.inf
        best_kappa = kappa_local = 1.0
        lam = 2.0 if cls.accumulates else 1.0
        uses_tf32 = False
        nontrivial = False
        rstd = next((m for m, role in zip(out_states, roles) if role == "rstd"), None)
        parts = []
        dtype = ri.own.get(outputs[0], (True, False, ""))[2] if outputs else ""
        # This call's site among the op's calls (see TypicalRatio); each output adds its role.
        site = (
            (op, dtype, phase, layer_site(module), tuple(made_by(producer.get(base.get(t, t))) for t in inputs))
            if judgeable
            else ()
        )
        for out, role, position in zip(out_states, roles, positions):
            if not out.is_float:
                e = (0.0 if out.exact else 1.0, 0.0, math.nan)
                x = (0.0 if inputs_exact else math.inf, 0.0, 0.0)
                f1 = (1.0, 1.0, 1.0)
            else:
                unit = out.unit
                if (
                    cls.precision_variable
                    and tol.allow_tf32
                    and 0 < unit <= FP32_EPS
                    and contracts_nonzero(cls, float_ins)
                ):
                    # TF32 rounding, not accumulation order, then sets the local error.
                    unit, lam, uses_tf32 = TF32_EPS, 0.5, True
                kappa_local = local_kappa(cls, float_ins, out, role) if cls.accumulates else 1.0
                # Reordered (or TF32-rounded) terms differ by a unit each, amplified where they cancel.
                unit *= kappa_local
                averaged = averaged_rounding(unit, out, uses_tf32)
                f1 = (max(unit, TINY), max(averaged, TINY), max(unit, TINY))
                e = (out.e_ext, out.e_sys, out.e_rms)
                x = (
                    predicted_error(cls, base_name(op), float_ins, out, role, rstd)
                    if judgeable
                    else (math.inf, math.inf, math.inf)
                )
                if judgeable and base_name(op) in ADAM_UPDATES:
                    x = within_adam_bound(x, node, position, producer, lookup, base, out)
                if judgeable and kind != "source":
                    # full(finfo(dtype).min), x + finfo(dtype).eps: each run took its own dtype's number
                    shift = constant_shift(cls, args, bench_args, out, float_ins, rstd)
                    x = (x[0] + shift[0], x[1] + shift[1], x[2] + shift[2])
                nontrivial = nontrivial or (
                    out.amax > 0 and (cls.kind != "contract" or contracts_nonzero(cls, float_ins))
                )
                if judgeable:
                    carried_error(out, x, typical.median((*site, role)))
                    if kind == "op":
                        typical.add((*site, role), e, x)
                    if cls.kind == "product":
                        carry_factors(out, x, float_ins, cls)
                if out.filled:
                    e, x = at_finite_scale(out, e, x)
            ratio = max(
                ((ec - xc) / fc if math.isfinite(xc) else ec / fc) for ec, xc, fc in zip(e, x, f1) if not math.isnan(ec)
            )
            if role and out.is_float:
                parts.append((role, e, x, f1))
            if ratio > best_ratio:
                best_ratio, best_e, best_x, best_f1, best_kappa = ratio, e, x, f1, kappa_local
        error = max((ec / fc for ec, fc in zip(best_e, best_f1) if not math.isnan(ec)), default=math.nan)
        verdict.error = float(error)
        intro = [
            max(0.0, ec - xc) / fc if not math.isnan(ec) and math.isfinite(xc) else 0.0
            for ec, xc, fc in zip(best_e, best_x, best_f1)
        ]
        verdict.introduced = float(max(intro)) if judgeable else 0.0
        judged.append(
            JudgedNode(
                index,
                op_id,
                (op, dtype),
                cls,
                judgeable,
                inputs_exact,
                outputs_exact,
                best_e,
                best_x,
                best_f1,
                lam,
                uses_tf32,
                all(s.same_dtype for s in out_states),
                nontrivial,
                best_kappa,
                tuple(parts),
            )
        )

    for op_id, region_id in ri.member_of.items():
        verdicts[op_id].region = region_id

    # ---- pass 2: regime and ambient calibration ---------------------------------------------
    # Compiled units round like whole graphs, not like single ops: they set neither regime nor calibration.
    own_rules = [j if j is None or j.op_id not in ri.units else None for j in judged]
    exact_input_nodes = [
        j for j in own_rules if j is not None and j.judgeable and j.inputs_exact and j.cls.kind != "factory"
    ]
    # Matmuls/convs allowed to run at TF32 have their own rule and do not decide the regime.
    differing = sum(1 for j in exact_input_nodes if not j.outputs_exact and not j.uses_tf32)
    bitwise = exact_mode or differing <= max(2, 0.01 * len(exact_input_nodes))
    # A matmul/conv that turned identical, non-zero inputs into identical outputs shows that this
    # target does not run them at reduced (TF32) precision.
    exact_matmul = any(j.cls.precision_variable and j.outputs_exact and j.nontrivial for j in exact_input_nodes)
    region_judged = {
        region_id: judge_region(region, ri, lookup, tol, exact_matmul)
        for region_id, region in ri.regions.items()
        if region.target_ops
    }
    ambient = ambient_noise(own_rules, ri.nodes, tol) if not exact_mode else {}
    names = {node.op_id: node.op for node in ri.nodes}
    fits = model_fits(ri.own_errors, names) if ri.reduced_precision and not exact_matmul else {}
    bounds_hold = accumulation_bounds_hold(ri) if ri.reduced_precision and not exact_matmul else False
    tf32_spread = tf32_spread_of(own_rules) if not exact_matmul else None
    bitwise_ops = ops_reproduced_bitwise(ri)

    roots: list[tuple[Node, Divergence]] = []
    # Roots their replay confirms: the op computed wrongly on its own recorded inputs, whatever
    # made those inputs (drift, what Python decided from a diverged value) and however they differ.
    replayed: set[int] = set()

    def judge(j: JudgedNode, node: Node, tainted_in: bool) -> None:
        op_id, step, phase, kind, op, name, module, location, args, inputs, outputs, random, stack = node
        verdict = verdicts[op_id]
        bench_op = ri.pairs.get(op_id)
        root_kind, reason, deciding, part, confirmed = decide_node(
            j,
            node,
            ri,
            tol,
            bitwise,
            exact_matmul,
            ambient,
            exact_mode,
            lookup,
            channels,
            fits,
            bounds_hold,
            tf32_spread,
            bitwise_ops,
            tainted_in,
        )
        verdict.metric = deciding
        if not root_kind:
            return
        verdict.metrics = metric_dict(j, part)
        own = ri.own_errors.get(op_id)
        if own is not None:
            verdict.metrics.update(own_error=own.error, honest_error=own.honest)
            if deciding == "replay":
                units = own.error / EPS.get(own.dtype, FP32_EPS)
                verdict.introduced = units if not verdict.introduced >= units else verdict.introduced
        verdict.root_kind = root_kind
        verdict.reason = reason
        if root_kind == "computation" and confirmed:
            replayed.add(op_id)
        if root_kind == "nan":
            # NaN/Inf made from finite values: no count of rounding units measures that, and it
            # outranks every root of a few units.
            verdict.introduced = math.inf
        divergence = Divergence(
            op=op,
            module=module,
            phase=phase,
            step=int(step),
            location=location,
            op_id=int(op_id),
            bench_op_id=None if bench_op is None else int(bench_op),
            rank=ri.rank,
            kind=root_kind,
            reason=reason,
            score=float(verdict.introduced if not math.isnan(verdict.introduced) else 0.0),
            metrics=verdict.metrics,
            stack=stack,
        )
        roots.append(((int(step), int(op_id), ri.rank), divergence))

    root_regions = region_roots(ri, region_judged, verdicts, tol, exact_matmul, roots)

    python_from: int | None = None  # the first op that read a root's error into Python (``.item()``) ...
    python_step = 0  # ... and its step
    # Drift: how far apart the runs' values are where they became other samples of each other (see
    # _DRIFT), per tensor computed from such values, and per step (a step whose own values drift
    # runs on parameters an earlier drifted step moved, and is chaotic from its start).
    drifted: dict[int, tuple[float, int]] = {}  # tensor -> (how far apart, the step that made it)
    own_drift = {node.op_id: drift_of(ri.measured.get(t) for t in node.outputs) for node in ri.nodes}
    step_drift: dict[int, float] = defaultdict(float)
    for node in ri.nodes:
        step_drift[int(node.step)] = max(step_drift[int(node.step)], own_drift[node.op_id])
    drift: tuple[tuple, float] | None = None  # where it began: the node, its max/min difference
    undecided: list[Divergence] = []  # roots taken back for that
    for node, j in zip(ri.nodes, judged):
        op_id, step, phase, kind, op, name, module, location, args, inputs, outputs, random, stack = node
        # Taint: error that comes from a root. Once a root put its error into a node's inputs, that
        # error is no rounding noise, and what statistics say of it is a lower bound only.
        tainted_in = any(s is not None and s.tainted for s in map(lookup, inputs))
        # A parameter or buffer in a later step was moved by an optimizer that a root's error reached.
        tainted_in = tainted_in or (kind == "source" and op != "source.input" and any(r[0][0] < step for r in roots))
        if python_from is None and tainted_in and is_readout(op):
            python_from, python_step = op_id, step
        # Drift reaches what is computed from drifted values (a bitwise equal one excepted); into a
        # later step (its parameters, moved by a drifted update) only where that step drifts again.
        drift_in = 0.0
        for t in inputs:
            far, made = drifted.get(base.get(t, t), (0.0, step))
            if far and not is_exact(lookup(t)):
                drift_in = max(drift_in, far if made >= step else min(far, step_drift[int(step)]))
        if (
            drift is not None
            and kind == "source"
            and op != "source.input"
            and step > drift[0][1]
            and not all(map(is_exact, map(lookup, outputs)))
        ):
            drift_in = max(drift_in, step_drift[int(step)])
        if j is not None:
            judge(j, node, tainted_in)
            verdict = verdicts[op_id]
            if (
                drift_in
                and verdict.root_kind == "computation"
                and op_id not in replayed
                and max((e for e in j.e if not math.isnan(e)), default=0.0) <= drift_in
            ):
                # Its inputs drifted apart: what their statistics say bounds their error from below
                # only, far below the drift itself, so a root of no more error than the drift is
                # as likely the drift's. A larger one stands out from it.
                undecided.append(roots.pop()[1])
                verdict.root_kind = ""
                assert drift is not None
                verdict.reason = (
                    f"computed from values that drifted apart from op {drift[0][0]} on; statistics cannot tell "
                    f"a fault here from that drift: {verdict.reason}"
                )
        if not (kind == "view" and all(t in base for t in outputs)):
            for t in outputs:
                s = state.get(t) if t not in base else None
                if s is not None and not s.exact and (tainted_in or verdicts[op_id].root_kind):
                    s.tainted = True
            error = 0.0 if tainted_in or verdicts[op_id].root_kind else own_drift[op_id]
            if error and drift is None:
                drift = (node, error)
            if max(error, drift_in):
                drifted.update((base.get(t, t), (max(error, drift_in), int(step))) for t in outputs)
    if python_from is not None:
        nodes_by_id = {node.op_id: node for node in ri.nodes}
        exact_in = {j.op_id for j in judged if j is not None and j.inputs_exact}
        exact_in.update(
            op
            for op, region_id in ri.member_of.items()
            if region_id in region_judged and region_judged[region_id].inputs_exact
        )

        def inherited(d: Divergence) -> bool:
            """Whether ``d`` follows Python's reading of a root; then it is diverged, no root."""
            if d.op_id in replayed or not follows_python(d, python_from, python_step, exact_in, ri.rank):
                return False
            verdict = verdicts[d.op_id]  # the reason says where from
            verdict.root_kind = ""
            verdict.reason = (
                f"follows op {python_from}, which read a diverged value into Python (.item()); "
                f"what the program decided from it may differ: {d.reason}"
            )
            for t in nodes_by_id[d.op_id][10]:  # a root taken back for the drift did not taint yet
                s = state.get(t)
                if s is not None and not s.exact:
                    s.tainted = True
            return True

        roots[:] = [(key, d) for key, d in roots if not inherited(d)]
        undecided = [d for d in undecided if not inherited(d)]
    skipped = scaler_skips(ri, roots, verdicts, lookup, python_from)

    # ---- pass 3: statuses ------------------------------------------------------------------
    undecided_set = {d.op_id for d in undecided}
    producer_status: dict[int, str] = {}
    region_status: dict[int, str] = {}
    for node in ri.nodes:
        op_id, step, phase, kind, op, name, module, location, args, inputs, outputs, random, stack = node
        verdict = verdicts[op_id]
        paired = op_id in ri.pairs or op_id in ri.units
        region_id = ri.member_of.get(op_id)
        if region_id is not None:
            # Members share their region's status; a root region taints what it makes.
            if region_id not in region_status:
                region_status[region_id] = region_status_of(
                    ri.regions[region_id], region_judged.get(region_id), region_id in root_regions, lookup
                )
            tainted = region_id in root_regions or region_status[region_id] == "diverged"
            for t in outputs:
                s = state.get(base.get(t, t))
                if s is not None and not s.exact and tainted:
                    s.tainted = True
                producer_status[base.get(t, t)] = region_status[region_id]
            verdict.status = region_status[region_id]
            continue
        if kind == "view" and all(t in base for t in outputs):
            src = base.get(outputs[0], inputs[0] if inputs else -1) if outputs else -1
            verdict.status = producer_status.get(src, "uncompared") if paired else "unpaired"
            continue
        ins = [lookup(t) for t in inputs]
        outs = [state.get(t) for t in outputs if t not in base]
        measured = [s for s in outs if s is not None and s.measured]
        if not paired:
            status = "unpaired"
        elif op_id in crossed and not all(s.exact for s in measured):
            status = "uncompared"
        elif any(s.nonfinite_mismatch and not s.given for s in measured):
            status = "nan"
        elif not outs and is_readout(op) and inputs:
            # ``.item()``: the number is its input's value, judged where that was made.
            status = readout_status(producer_status.get(base.get(inputs[0], inputs[0]), "uncompared"))
        elif not outs:
            status = "agrees" if all(s is not None and s.exact for s in ins) or not ins else "uncompared"
        elif len(measured) < len([s for s in outs if s is not None and not s.uninit]) or op_id in undecided_set:
            status = "uncompared"
        elif all(s.exact for s in measured):
            status = "agrees"
        elif verdict.root_kind or any(s.tainted for s in measured):
            status = "diverged"
        else:
            status = "noise"
        verdict.status = status
        for t in outputs:
            producer_status[base.get(t, t)] = status
    found = None
    if drift is not None:
        (op_id, step, phase, _, op, _, module, *_), error = drift
        found = Drift(
            rank=ri.rank,
            op_id=op_id,
            step=int(step),
            phase=phase,
            op=op,
            module=module,
            error=error,
            undecided=tuple(d.op_id for d in undecided),
        )
    return verdicts, roots, skipped, found
