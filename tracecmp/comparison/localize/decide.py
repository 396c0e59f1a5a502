"""Deciding a node: root or not, and of which kind, from its measured error against its prediction
and calibration, its arguments, and its replay where the trace holds tensors.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from tracecmp.aten.opclass import base_name, classify, given_nonfinite, is_collective
from tracecmp.aten.rounding import REDUCED_MODELS
from tracecmp.comparison.localize.arguments import arg_difference, structure_note
from tracecmp.comparison.localize.calibrate import M_MIN, M_RATIO, TF32_LAM_MIN, group_key
from tracecmp.comparison.localize.predict import STRICT_KAPPA, within_tf32
from tracecmp.comparison.localize.records import Decision, JudgedNode, RankContext, RankInput
from tracecmp.comparison.tolerances import Tolerances
from tracecmp.graph.checks import OwnCheck
from tracecmp.graph.nodes import Node, TensorState
from tracecmp.numerics.fits import ModelFit
from tracecmp.numerics.replay import OwnError
from tracecmp.numerics.units import EPS, FP32_EPS, REDUCED_EPS, TINY
from tracecmp.trace.compiled import BOUNDARY_OPS


def decide_node(j: JudgedNode, node: Node, ctx: RankContext, tainted: bool = False) -> Decision:
    """Root kind ('' when not a root), the one-line reason, the deciding metric's name, the
    output that decided, as an index into ``j.parts`` (-1 where the op's outputs have no roles),
    and whether a replay of the op on its own recorded inputs confirms it as a root.

    ``tainted``: an input carries error from a root before it. Such error is no rounding noise:
    its statistics bound it from below only (its largest element may sit anywhere, its spread is
    unknown), so the node's own share must exceed ``tol.downstream`` times the prediction.
    """
    ri, tol, lookup, channels = ctx.ri, ctx.tol, ctx.lookup, ctx.channels
    op_id, step, phase, kind, op, name, module, location, args, inputs, outputs, random, stack = node
    outs = [ri.measured.get(t) for t in outputs]
    outs = [s for s in outs if s is not None]
    # NaN/Inf from finite inputs: judged from the target's own statistics, whatever else is known.
    nonfinite_out = [s for s in outs if s.nonfinite and s.nonfinite_mismatch]
    # A source read again after the optimizer moved it (FSDP2's shards each step) holds what the
    # optimizer wrote: not judged (walk.py), NaN included.
    inherited_source = kind == "source" and not j.judgeable
    if (
        nonfinite_out and not given_nonfinite(args) and not inherited_source
    ):  # an op handed -inf made what it was asked for
        ins = [lookup(t) for t in inputs]
        if all(s is not None and not s.nonfinite for s in ins):
            return Decision(
                "nan",
                "NaN/Inf appear in its output although every input is finite (the bench's is not)",
                "nan_count",
                -1,
            )
    if j.outputs_exact:
        return Decision("", "", "checksum", -1)
    unit = ri.units.get(op_id)
    if unit is not None:
        root_kind, reason, metric = unit.decide(node, j.e, ri, tol, lookup)
        return Decision(root_kind, reason, metric, -1, root_kind == "computation" and metric == "replay")
    bench_op = ri.pairs.get(op_id)
    if bench_op is not None and kind != "source":
        diff = arg_difference(args, ri.bench_args.get(bench_op, ""), op)
        if diff:
            return Decision("argument", f"non-tensor arguments differ from the bench: {diff}", "args", -1)
    if any(s.nonfinite_mismatch and s.given for s in outs):
        # NaN/Inf the program handed in differ from the bench's: mean and norm say nothing then.
        return Decision("", "", "nan_count", -1)
    own_check = ri.own_checks.get(op_id) if kind == "op" else None
    if own_check is not None and own_check.failed:
        # The op's output, recomputed in float64 from its own inputs at capture, is off by more
        # than its dtype allows: its own evidence, whatever its inputs carried or drifted.
        return Decision("computation", own_check.describe(), "self_check", -1, True)
    if not j.inputs_exact and moves_data(node, ctx):
        # Its outputs hold what its inputs held, so what differs came in with them. Statistics
        # could say otherwise: a slice of a DDP bucket shows the bucket's error against its own,
        # smaller, magnitude. Where its inputs agree bitwise, the bitwise rule still judges it.
        return Decision("", "", channels[0], -1)
    deciding = channels[0] if j.e[0] >= j.e[1] or math.isnan(j.e[1]) else channels[1]
    replayed = replayed_root(j, node, ri, tol, ctx.exact_matmul, ctx.fits.get(op), ctx.bounds_hold, ctx.bitwise_ops)
    if not j.judgeable:
        return Decision("computation", replayed, "replay", -1, True) if replayed else Decision("", "", deciding, -1)
    score, channel, e, x, _, part = _furthest_excess(j, ctx, tainted)
    strict = _strict(j, node, ctx)
    if not (strict or score > 1.0):
        if replayed:
            return Decision("computation", replayed, "replay", -1, True)
        return Decision("", "", channels[channel], -1)
    if (
        not strict
        and not replayed
        and kind == "op"
        and not random
        and _reproduced(ri.own_errors.get(op_id), j, ri, ctx.exact_matmul)
    ):
        # Its inputs already differ from the bench's, and a replay of the op on its own recorded
        # inputs finds it as exact as an honest kernel: the output's error is the inputs' error,
        # amplified more than the op's class foresaw (Adam's update of a gradient near 0). The
        # replay decides; the statistics only estimated.
        return Decision("", "", "replay", -1)
    if not strict and not replayed and _cleared_by_own_check(own_check, outs):
        return Decision("", "", "self_check", -1)
    return _root(j, node, ctx, (channel, e, x, part), replayed)


# Ops that only move values: FSDP2's all-gather copy-in and copy-out, its reduce-scatter's chunk_cat.
_MOVERS = frozenset({"all_gather_copy_in", "split_with_sizes_copy", "chunk_cat"})


def _moves(node: Node) -> bool:
    """Whether ``node`` is an op that may only move values: a copy, a concatenation, a view that
    carries statistics of its own, FSDP2's copies."""
    if node.kind == "view":
        return True
    # A source judged as a copy of what Python read is no move: Python made it from anything.
    return node.kind == "op" and (classify(node.op).kind == "copy" or base_name(node.op) in _MOVERS)


def collective_moves(nodes: Sequence[Node], view_base: Mapping[int, int]) -> frozenset[int]:
    """The op ids of the moving ops (see ``_moves``) that carry a collective's data: out of what a
        collective made (a DDP bucket's slice copied into its gradient, a functional all-gather's
        chunks concatenated), into what a collective reads (a gradient copied into its bucket), and
        along chains of such copies made out of place. A copy anywhere else is judged as any op is:
        a fault injected into a ``clone`` is its own root.

        >>> from tracecmp.graph.checks import OwnCheck
    from tracecmp.graph.nodes import Node, TensorState
        >>> def op(i, name, ins, outs):
        ...     return Node(i, 0, "backward", "op", name, name, "", "", "", ins, outs, False, "")
        >>> reduced = op(1, "c10d.allreduce_.default", [1], [1])
        >>> sorted(collective_moves([reduced, op(2, "aten.copy_.default", [3, 2], [3]), op(3, "aten.clone.default", [4], [5])], {2: 1}))
        [2]
    """
    base = view_base.get
    made: set[int] = set()
    movers: set[int] = set()
    for node in nodes:
        ins, outs = {base(t, t) for t in node.inputs}, {base(t, t) for t in node.outputs}
        if is_collective(node.op):
            made |= outs
        elif _moves(node) and ins & made:
            movers.add(node.op_id)
            if not _in_place(node, ins, outs):  # else it wrote the gradient, not the collective's data
                made |= outs
    read: set[int] = set()
    for node in reversed(nodes):
        ins, outs = {base(t, t) for t in node.inputs}, {base(t, t) for t in node.outputs}
        if is_collective(node.op):
            read |= ins
        elif _moves(node) and outs & read:
            movers.add(node.op_id)
            if not _in_place(node, ins, outs):
                read |= ins
    movers.update(n.op_id for n in nodes if n.kind == "op" and base_name(n.op) in _MOVERS)
    return frozenset(movers)


def _in_place(node: Node, ins: set[int], outs: set[int]) -> bool:
    return base_name(node.op).endswith("_") or bool(ins & outs)


def moves_data(node: Node, ctx: RankContext) -> bool:
    """Whether ``node`` only moves a collective's values, each in its own dtype (see
    :func:`collective_moves`; a cast rounds, so it is none)."""
    if node.op_id not in ctx.collective_moves:
        return False
    facts = [ctx.ri.own.get(t) for t in (*node.inputs, *node.outputs)]
    if any(f is None or not f[0] for f in facts):
        return False
    return len({f[2] for f in facts if f is not None}) == 1


def _cleared_by_own_check(own_check: OwnCheck | None, outs: list[TensorState]) -> bool:
    """Whether the op's own check at capture clears it of a suspicion from statistics alone, which
    only estimated what its inputs explain. NaN/Inf counts that differ from the bench's are exact
    evidence over every element, which a sample cannot outweigh."""
    return own_check is not None and own_check.passed and not any(s.nonfinite_mismatch for s in outs)


def _furthest_excess(j: JudgedNode, ctx: RankContext, tainted: bool) -> tuple[float, int, float, float, float, int]:
    """Which channel of which output is furthest beyond what the inputs explain: (score, channel,
    error, prediction, threshold, part); a score over 1 is beyond."""
    tol, ambient, tf32_spread = ctx.tol, ctx.ambient, ctx.tf32_spread
    excess = []
    tf32 = j.uses_tf32 and not ctx.exact_matmul
    for part, (role, es, xs, fs) in enumerate(j.parts) if j.parts else [(-1, ("", j.e, j.x, j.f1))]:
        amb = ambient.get(group_key(j.group, role)) or ambient.get(group_key((j.cls.kind, j.group[1]), role))
        for c, (e, x, f) in enumerate(zip(es, xs, fs)):
            if math.isnan(e):
                continue
            lam = j.lam
            if tf32 and tf32_spread is not None:
                # How far this run's TF32 calls typically stray beyond their inputs' error: a fault
                # a unit out is found where the device's own rounding stays well inside one.
                lam = max(TF32_LAM_MIN, min(j.lam, tf32_spread[c])) if not math.isnan(tf32_spread[c]) else j.lam
            threshold = tol.local * lam * f
            margin = tol.margin
            if amb is not None:
                threshold = max(threshold, tol.ambient * amb[0][c] * f)
                if amb[1][c] > 0:
                    margin = max(M_MIN, M_RATIO * amb[1][c], amb[2 if j.cls.accumulates else 3][c])
            if tainted:
                margin = max(margin, tol.downstream)
            excess.append(((e - margin * x) / max(threshold, TINY), c, e, x, threshold, part))
    return max(excess) if excess else (-math.inf, 0, 0.0, 0.0, 0.0, -1)


def _strict(j: JudgedNode, node: Node, ctx: RankContext) -> bool:
    """Whether any difference at all makes the node a root (the bitwise rule)."""
    exact_mode = ctx.exact_mode
    tf32 = j.uses_tf32 and not ctx.exact_matmul
    # Identical inputs, identical dtypes, and identical inputs elsewhere giving identical outputs:
    # then any difference is this op's own doing, however small. A float32 matmul/conv may still
    # be running at TF32 unless the trace shows exact ones; an error too small for TF32 is not that.
    # A call TF32 rounding of its own operands can explain (from their statistics: K and sizes,
    # at most) is not held to the bitwise rule, even its op's only call; one beyond that can't be TF32.
    tf32_like = tf32 and within_tf32(j, node, ctx.lookup, ctx.tol, ctx.ri.reduced_precision)
    # A compiled region's fused code may reduce in another order from one run to the next (inductor's
    # parallel reductions on the CPU): the rest of the run vouches for eager kernels, not for it.
    compiled = node.op in BOUNDARY_OPS.values()
    strict = exact_mode or (ctx.bitwise and j.inputs_exact and j.same_dtype and not tf32_like and not compiled)
    if strict and not exact_mode and j.kappa_local > STRICT_KAPPA:
        # A sum whose terms cancel moves by many of its own units when merely reordered (thread
        # counts, atomics), which the rest of a deterministic run says nothing about.
        strict = any(e > f for e, f in zip(j.e, j.f1) if not math.isnan(e))
    return strict


def random_reason(what: str, inputs_exact: bool) -> str:
    """Why a root that drew random numbers is named a random draw, and what removes it.

    >>> random_reason("relative error 1.00e-01 (norm/mean)", True)[:62]
    'the divergence starts at a random op: it drew other numbers wh'
    """
    agree = " while its inputs agree" if inputs_exact else ""
    return (
        f"the divergence starts at a random op: it drew other numbers{agree} ({what}), so the runs' "
        "generators differ (seed, generator state or device); seed both with tracecmp.seed_all() and "
        'capture with TraceCompare(..., rng="host"), or dropout=0.0 to turn dropout off'
    )


def source_label(op: str, name: str, location: str) -> str:
    """A source as a person names it: the parameter's path, the input's position, or, for a tensor
    the program made from Python data, the line that made it.

    >>> source_label("source.parameter", "h.0.attn.weight", "m.py:3"), source_label("source.tensor", "", "train.py:70")
    ("parameter 'h.0.attn.weight'", 'the tensor made at train.py:70')
    """
    label = op.removeprefix("source.")
    if name:
        return f"{label} {name!r}"
    return f"the {label} made at {location}" if location else f"a {label} without a name"


def _root(j: JudgedNode, node: Node, ctx: RankContext, found: tuple[int, float, float, int], replayed: str) -> Decision:
    """The root's kind and reason, from ``found``: the deciding channel, its error and prediction,
    and the output that decided."""
    ri, channels = ctx.ri, ctx.channels
    op_id, step, phase, kind, op, name, module, location, args, inputs, outputs, random, stack = node
    channel, e, x, part = found
    bench_op = ri.pairs.get(op_id)
    what = f"relative error {e:.2e} ({channels[channel]})"
    if kind == "source":
        return Decision(
            "source", f"{source_label(op, name, location)} differs from the bench: {what}", channels[channel], part
        )
    if random:
        return Decision("random", random_reason(what, j.inputs_exact), channels[channel], part)
    structure = structure_note(op_id, inputs, ri)
    if bench_op is None:
        return Decision(
            "structure", f"target-only op (no bench partner) changes the values: {what}", channels[channel], part
        )
    if structure:
        return Decision("structure", f"{structure}; {what}", channels[channel], part)
    if j.inputs_exact:
        reason = f"output differs ({what}) while every input agrees bitwise"
    else:
        ratio = e / max(x, TINY)
        reason = (
            f"output error {e:.2e} ({channels[channel]}) is {ratio:.0f}x what its inputs carried in ({x:.1e})"
            if x > 0
            else (f"output error {e:.2e} ({channels[channel]}) beyond rounding while its inputs agree")
        )
    return Decision("computation", reason, channels[channel], part, bool(replayed))


def _reproduced(own: OwnError | None, j: JudgedNode, ri: RankInput, exact_matmul: bool) -> bool:
    """A replay shows the op computed what its recorded inputs give: a reduced-precision
    matmul/conv within the accumulation bound of one of its replays, any other op within
    ``replay_margin`` times an honest kernel's error (the ratio rule's own test)."""
    if own is None:
        return False
    if ri.reduced_precision and own.bounds and _reduced_matmul(own, j, exact_matmul, ri.reduced_precision):
        return min(own.bounds) <= 1.0
    return not own.misrounded and (own.honest > 0 or own.error == 0)


def _replay_excess(own: OwnError, j: JudgedNode, tol: Tolerances, exact_matmul: bool, reduced: str | None) -> float:
    """How far an op's own error (numerics.replay) exceeds what an honest kernel makes: > 1 is a root.

    The bar is ``replay_margin`` times the honest replay's error, and at least ``replay_local``
    rounding units of the output's dtype (and one unit of the reduced precision a float32
    matmul/conv may run at). Where the honest replay is exact (no rounding happened), or the op is
    one correctly rounded IEEE operation, any other result is wrong.
    """
    floor = tol.replay_local * EPS.get(own.dtype, FP32_EPS)
    if _reduced_matmul(own, j, exact_matmul, reduced):
        # The honest replay already multiplied inputs rounded to the reduced precision; never
        # ask for less than one of its units.
        floor = max(floor, REDUCED_EPS[reduced])
    if own.misrounded:
        return math.inf
    if math.isinf(own.honest):
        return 0.0  # an honest kernel overflows here too: the NaN/Inf rule decides
    if own.honest == 0.0:
        return math.inf if own.error > 0 else 0.0  # exact here: every correct kernel gives these bits
    return own.error / max(tol.replay_margin * own.honest, floor)


def _misfit_excess(own: OwnError, fit: ModelFit, tol: Tolerances) -> float:
    """How far a reduced-precision matmul/conv call strays from the rounding that reproduces the
    run's other calls of its op (``fit``), beyond ``replay_margin`` times their typical misfit:
    > 1 is a root, however far below the reduced precision's own error."""
    if fit.model >= len(own.fits):
        return 0.0
    return own.fits[fit.model] / (tol.replay_margin * fit.misfit)


def _reduced_matmul(own: OwnError, j: JudgedNode, exact_matmul: bool, reduced: str | None) -> bool:
    return bool(j.cls.precision_variable and reduced and own.dtype == "float32" and not exact_matmul)


def replayed_root(
    j: JudgedNode,
    node: Node,
    ri: RankInput,
    tol: Tolerances,
    exact_matmul: bool,
    fit: ModelFit | None,
    bounds_hold: bool = False,
    bitwise_ops: Mapping[str, tuple[int, bool]] | None = None,
) -> str:
    """The reason this op is a root by replay, or "" (not replayed, or within an honest kernel's error).

    A reduced-precision matmul/conv call that one of its replays reproduces within the
    accumulation bound is noise, even its op's only call. One that none reproduces is a root when
    the run's other such calls are reproduced (``bounds_hold``: the device's rounding is known);
    on an unknown device the ratio rule decides instead.
    """
    own = ri.own_errors.get(node.op_id)
    reduced = ri.reduced_precision
    if own is None or node.kind != "op":
        return ""
    reduced_call = bool(reduced and _reduced_matmul(own, j, exact_matmul, reduced))
    if reduced_call and fit is not None and _misfit_excess(own, fit, tol) > 1.0:
        how = REDUCED_MODELS[reduced][fit.model][0]
        return (
            f"its output lies {own.fits[fit.model]:.0f} float32 accumulation errors from a replay of its recorded "
            f"inputs rounded to {reduced} ({how}), a replay that matches this run's other {fit.members - 1} calls "
            f"of {node.op} to within {fit.misfit:.1f} (own error {own.error:.2e}, an honest kernel's {own.honest:.1e})"
        )
    # Bit-for-bit evidence outranks the accumulation bound, where it is the op's own: when a replay
    # gives the run's other calls of this matmul exactly, the device rounds (which operands, which
    # way, the bias added where) as that replay does, and this call should match too. The rank's
    # other ops cannot say that for a matmul with no calls of its own to show it.
    same_cpu, by_own_calls = (bitwise_ops or {}).get(node.op, (0, False))
    if same_cpu and not own.bitwise and (by_own_calls or not reduced_call):
        return _not_reproduced(own, reduced if reduced_call else None, same_cpu)
    if reduced_call and own.bounds and min(own.bounds) <= 1.0:
        return ""  # a float32 sum of its rounded operands' products gives this: noise, even as the only call
    if reduced_call and own.bounds and bounds_hold:
        return (
            f"its output lies {min(own.bounds):.3g}x the accumulation bound (from K, the operands' sizes and "
            f"float32's unit) away from every replay of its recorded inputs: rounded to {reduced} to nearest and "
            f"toward zero, and in float32 (own error {own.error:.2e}, an honest kernel's {own.honest:.1e})"
        )
    if same_cpu and not own.bitwise:
        return _not_reproduced(own, reduced if reduced_call else None, same_cpu)
    if _replay_excess(own, j, tol, exact_matmul, reduced) > 1.0:
        if own.misrounded:
            return (
                f"its output is not the correctly rounded {own.dtype} result of its recorded inputs, which every "
                f"IEEE 754 device gives (own error {own.error:.2e}, a replay in {own.dtype}: {own.honest:.2e})"
            )
        if own.honest == 0:
            return f"own error {own.error:.2e} against a float64 replay of its recorded inputs, which {own.dtype} computes exactly"
        return (
            f"own error {own.error:.2e} against a float64 replay of its recorded inputs is "
            f"{own.error / own.honest:.0f}x what a replay in {own.dtype} makes ({own.honest:.1e})"
        )
    return ""


def _not_reproduced(own: Any, reduced: str | None, calls: int) -> str:
    how = f"rounded to {reduced} " if reduced else ""
    return (
        f"its output differs from a replay in {own.dtype} on its recorded inputs {how}which gives this run's "
        f"other calls bit for bit ({calls} of them: the run computed as this CPU does; own error {own.error:.2e})"
    )
