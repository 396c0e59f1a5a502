"""The walk: every node of a rank's target graph in execution order, judged against what its inputs
carried in; roots, suspects and the first divergence come out of it.

>>> verdicts, roots, skipped, drifts = localize([rank_input], Tolerances())   # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from tracecmp.aten.opclass import (
    AUTOCAST_ELEMENTWISE,
    OpClass,
    base_name,
    classify,
    given_nonfinite,
    is_readout,
    takes_call_args,
)
from tracecmp.comparison.adam import ADAM_UPDATES
from tracecmp.comparison.localize.arguments import class_for_call, constant_shift
from tracecmp.comparison.localize.calibrate import (
    TypicalRatio,
    accumulation_bounds_hold,
    ambient_noise,
    at_finite_scale,
    carried_error,
    carry_factors,
    made_by,
    ops_reproduced_bitwise,
    tf32_spread_of,
)
from tracecmp.comparison.localize.decide import collective_moves, decide_node
from tracecmp.comparison.localize.history import (
    crossed_pairs,
    drift_of,
    first_skipped_update,
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
from tracecmp.comparison.localize.records import (
    PROGRESS_EVERY,
    JudgedNode,
    NodeVerdict,
    RankContext,
    RankInput,
    metric_dict,
)
from tracecmp.comparison.localize.regions import (
    judge_region,
    past_bench_cast,
    region_given,
    region_roots,
    region_status_of,
)
from tracecmp.comparison.localize.repeats import one_root_per_fault
from tracecmp.comparison.tolerances import Tolerances
from tracecmp.graph.nodes import Node, TensorState
from tracecmp.numerics.fits import model_fits
from tracecmp.numerics.units import EPS, FP32_EPS, TINY, eps_of, is_float_dtype, reduced_unit
from tracecmp.trace.schema import PYTHON_SOURCE, UNREAD_SOURCE
from tracecmp.verdict.records import Divergence, Drift, SkippedStep, layer_site


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
        v, r, s, drift = RankWalk(rank_input, tolerances, exact, progress).run()
        verdicts.update({(rank_input.rank, k): x for k, x in v.items()})
        roots.extend(r)
        skipped.extend(s)
        drifts.extend([drift] if drift is not None else [])
    roots.sort(key=lambda item: item[0])
    merged = one_root_per_fault([d for _, d in roots])
    return verdicts, merged, sorted(skipped, key=lambda k: (k.step, k.rank)), drifts


# Why a node was left uncompared or unpaired (NodeVerdict.reason), with what the user can do.
UNPAIRED = "no partner in the bench: the two runs' op sequences differ here"
CROSSED = "its bench partner computes another value (the op sequences differ around it): not comparable"
READS_UNCOMPARED = "reads into Python a value that was not compared"
WRITES_NOTHING = "makes no tensor the trace holds, from inputs that differ: nothing to compare"
REGION_UNCOMPARED = "matched as a group (a region: {kind}) whose outputs could not all be paired with the bench's"
VIEW_OF_UNCOMPARED = "a view of a tensor that was not compared"
UNDECIDED = (
    "left undecided: the runs drifted apart before it and its error is no larger than the drift "
    '(capture the target with data="tensors" to judge it by replay)'
)
UNMEASURED = (
    "an output has no statistics to compare on one side (no bench partner for it, or not recorded): "
    'capture both runs with the same options, or the target with data="tensors"'
)

# Python reads remembered for the tensors made from Python data after them (see Walk.python_reads).
PYTHON_READS_KEPT = 16


@dataclass(frozen=True)
class _Inputs:
    """What a node's inputs carried in, as pass 1 reads them."""

    cls: OpClass
    ins: list[tuple[int, TensorState]]  # (position, state) of the inputs the op reads
    float_ins: list[tuple[int, TensorState]]
    unknown_input: bool
    discrete_changed: bool
    inputs_exact: bool
    given_in: bool  # an input holds NaN/Inf the program handed in
    hands_nonfinite: bool  # the op is handed NaN/Inf (its region's members, or its arguments)


@dataclass(frozen=True)
class _Outputs:
    """A node's measured outputs, with what each is among the op's outputs (normalization ops)."""

    states: list[TensorState]
    roles: list[str]
    positions: list[int]  # each one's position among the op's outputs


@dataclass(frozen=True)
class _Judging:
    """How pass 1 judges a node's outputs."""

    judgeable: bool
    bench_args: str
    rstd: TensorState | None  # a normalization's rstd output
    dtype: str
    site: tuple  # this call's site among the op's calls (see TypicalRatio); () when not judged


@dataclass
class _Rounding:
    """What the node's float outputs, one after the other, say of its own rounding."""

    lam: float
    uses_tf32: bool = False
    kappa_local: float = 1.0
    nontrivial: bool = False


class RankWalk:
    """One rank's walk: pass 1 measures and propagates, pass 2 calibrates and judges (with drift
    and Python's readouts of diverged values), pass 3 gives every node its status."""

    channels = ("max/min", "norm/mean", "rms")
    # Found by the stages after pass 1:
    ctx: RankContext  # the regime and calibration every node is decided with
    region_judged: dict[int, Any]  # region id -> its boundary judged (regions.judge_region)
    own_drift: dict[int, float]  # op id -> how far apart its outputs drifted (history.drift_of)
    step_drift: dict[int, float]  # step -> the most any of its ops drifted
    undecided_set: set[int]  # op ids of the roots taken back for the drift
    producer_status: dict[int, str]  # tensor id (view bases) -> its producer's status
    region_status: dict[int, str]  # region id -> its members' status

    def __init__(
        self, ri: RankInput, tol: Tolerances, exact_mode: bool, progress: Callable[[int], None] | None = None
    ) -> None:
        self.ri = ri
        self.tol = tol
        self.exact_mode = exact_mode
        self.progress = progress
        self.state: dict[int, TensorState] = {}
        self.verdicts: dict[int, NodeVerdict] = {}
        self.judged: list[JudgedNode | None] = []
        self.base = ri.view_base
        self.first_nonexact: int | None = None
        self.crossed = crossed_pairs(ri)
        # tensor id (view bases) -> the node that made it, output position
        self.producer: dict[int, tuple[tuple, int]] = {}
        # Target ops of regions where some member, on either side, was handed a NaN/Inf.
        self.given_regions = {
            o for region in ri.regions.values() if region_given(region, ri) for o in region.target_ops
        }
        self.typical = TypicalRatio()
        self.roots: list[tuple[Node, Divergence]] = []
        # Roots their replay confirms: the op computed wrongly on its own recorded inputs, whatever
        # made those inputs (drift, what Python decided from a diverged value) and however they differ.
        self.replayed: set[int] = set()
        self.python_from: int | None = None  # the first op that read a root's error into Python (``.item()``)
        # The tensors whose values the program last read into Python (``.item()``, most recent last):
        # a tensor it then made from Python data may hold those values (``losses[k] = loss.item()``).
        self.python_reads: deque[int] = deque(maxlen=PYTHON_READS_KEPT)
        self.consumers: dict[int, list[Node]] | None = None  # see _consumers
        # Drift: how far apart the runs' values are where they became other samples of each other (see
        # _DRIFT), per tensor computed from such values, and per step (a step whose own values drift
        # runs on parameters an earlier drifted step moved, and is chaotic from its start).
        self.drifted: dict[int, tuple[float, int]] = {}  # tensor -> (how far apart, the step that made it)
        self.drift: tuple[tuple, float] | None = None  # where it began: the node, its max/min difference
        self.undecided: list[Divergence] = []  # roots taken back for that

    def lookup(self, tid: int) -> TensorState | None:
        """A tensor's state, through its view base."""
        tid = self.base.get(tid, tid)
        # A value produced outside the compared steps is known only as measured.
        return self.state.get(tid) or self.ri.measured.get(tid)

    def run(self) -> tuple[dict[int, NodeVerdict], list[tuple[Node, Divergence]], list[SkippedStep], Drift | None]:
        """The rank's verdicts, roots, steps a loss scaler skipped, and where its runs drifted apart."""
        ri = self.ri
        # ---- pass 1: measure, propagate, compute what each node introduced -------------------------
        for index, node in enumerate(ri.nodes):
            if self.progress is not None and index % PROGRESS_EVERY == 0 and index:
                self.progress(PROGRESS_EVERY)
            self.judged.append(self._measure(index, node))

        for op_id, region_id in ri.member_of.items():
            self.verdicts[op_id].region = region_id

        # ---- pass 2: regime and ambient calibration ---------------------------------------------
        self._calibrate()
        root_regions = region_roots(ri, self.region_judged, self.verdicts, self.tol, self.ctx.exact_matmul, self.roots)
        self._judge_all()
        if self.python_from is not None:
            self._follow_python()
        skipped = scaler_skips(ri, self.roots, self.verdicts, self.lookup, self.python_from)

        # ---- pass 3: statuses ------------------------------------------------------------------
        self._statuses(root_regions)
        return self.verdicts, self.roots, skipped, self._found_drift()

    # ---- pass 1 -------------------------------------------------------------------------------

    def _measure(self, index: int, node: Node) -> JudgedNode | None:
        """Pass 1 for one node: its outputs' states, and what it introduced where it is judged."""
        ri, base = self.ri, self.base
        op_id, step, phase, kind, op, name, module, location, args, inputs, outputs, random, stack = node
        verdict = NodeVerdict(op_id)
        self.verdicts[op_id] = verdict
        self.producer.update((tid, (node, position)) for position, tid in enumerate(outputs) if tid not in base)
        if kind == "view" and all(t in base for t in outputs):
            return None
        if op == UNREAD_SOURCE:  # only written by its first use (an out= buffer): its content means nothing
            for tid in outputs:
                self.state[tid] = TensorState(known=True, exact=True, uninit=True)
            return None
        # Sources have no inputs; a view node whose output carries statistics of its own (capture's
        # alias.update: a tensor after writes through its views) assembles its inputs' values.
        cls = OpClass("factory") if kind == "source" else OpClass("copy") if kind == "view" else classify(op)
        if args and takes_call_args(op):
            cls = class_for_call(cls, op, args)
        if is_readout(op) and inputs:
            self.python_reads.append(base.get(inputs[0], inputs[0]))
        if op_id in ri.reentered:
            # A value the trace made, entering again as a new tensor over its memory: a copy of it.
            cls = OpClass("copy")
            fin = self._inputs(node._replace(inputs=[ri.reentered[op_id]]), cls)
        elif op == PYTHON_SOURCE and self.python_reads:
            # Made from Python data after the program read values into Python: judged as a copy of
            # what it read, so it may differ by as much as they did (a loss read within noise and
            # written into a tensor is noise, not a source that differs). Beyond that it is a root.
            cls = OpClass("copy")
            fin = self._inputs(node._replace(inputs=list(self.python_reads)), cls)
        else:
            fin = self._inputs(node, cls)
        outs = self._outputs(node, fin)
        if op_id in ri.member_of:
            # Judged with its region at the boundary, never on its own against the other side.
            return None
        if not outs.states:
            return None
        if self.first_nonexact is None and not all(s.exact for s in outs.states):
            self.first_nonexact = op_id
        judging = self._judging(node, fin, outs)
        return self._introduced(index, node, fin, outs, judging, verdict)

    def _inputs(self, node: Node, cls: OpClass) -> _Inputs:
        """What the node's inputs carried in."""
        ri, base = self.ri, self.base
        op_id, inputs, args = node.op_id, node.inputs, node.args
        lookup = self.lookup
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
        given_in = any(s.given for _, s in ins)
        hands_nonfinite = op_id in self.given_regions or given_nonfinite(args)
        return _Inputs(cls, ins, float_ins, unknown_input, discrete_changed, inputs_exact, given_in, hands_nonfinite)

    def _outputs(self, node: Node, fin: _Inputs) -> _Outputs:
        """Sets the state of each of the node's outputs; returns the measured ones."""
        ri, base, cls = self.ri, self.base, fin.cls
        out_states: list[TensorState] = []
        roles: list[str] = []  # what each of out_states is among the op's outputs (normalization ops)
        positions: list[int] = []  # and its position among them
        for position, tid in enumerate(node.outputs):
            if tid in base:  # an op returning a view of an input (e.g. an in-place op's alias)
                continue
            if cls.kind == "uninit":
                self.state[tid] = TensorState(known=True, exact=True, uninit=True)
                continue
            m = ri.measured.get(tid)
            if m is None and node.op_id in ri.units:
                # A compiled unit is a whole graph: what it made unmeasured is unknown, not exact.
                is_float, nonfinite, _ = ri.own.get(tid, (True, False, ""))
                self.state[tid] = TensorState(known=False, exact=False, nonfinite=nonfinite, is_float=is_float)
                continue
            if m is None:  # its inputs' error carried through (an unrecorded output: ri.unrecorded)
                self.state[tid] = self._carried(node, tid, fin)
                continue
            if m.nonfinite_mismatch and (fin.given_in or fin.hands_nonfinite):
                m.given = True
            self.state[tid] = m
            out_states.append(m)
            roles.append(cls.output_role(position))
            positions.append(position)
        return _Outputs(out_states, roles, positions)

    def _carried(self, node: Node, tid: int, fin: _Inputs) -> TensorState:
        """The state of an output without a partner: the inputs' error carried through (an extra
        copy, a fused op's piece)."""
        ri, kind, op_id = self.ri, node.kind, node.op_id
        ins, float_ins, unknown_input = fin.ins, fin.float_ins, fin.unknown_input
        is_float, nonfinite, _ = ri.own.get(tid, (True, False, ""))
        worst = max((s for _, s in float_ins), key=lambda s: s.level, default=None)
        est = TensorState(
            known=not unknown_input and worst is not None or (not ins and not node.inputs),
            exact=fin.inputs_exact and (kind != "source" or op_id in ri.member_of),
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
        est.given = est.nonfinite_mismatch and (fin.given_in or fin.hands_nonfinite)
        return est

    def _judging(self, node: Node, fin: _Inputs, outs: _Outputs) -> _Judging:
        """Whether the node can be judged, and what judging its outputs needs."""
        ri, base, cls = self.ri, self.base, fin.cls
        op_id, step, phase, kind, op, name, module, location, args, inputs, outputs, random, stack = node
        first_nonexact = self.first_nonexact
        # Sources after the first step may be parameters the optimizer already moved: their error
        # can be inherited, so only inputs and first-step sources are judged.
        source_inherited = (
            kind == "source"
            and op != "source.input"
            and first_nonexact is not None
            and (first_nonexact < op_id and step > ri.first_step)
        )
        # NaN/Inf reaching a node make its statistics say nothing about its own arithmetic.
        nonfinite_in = any(s.nonfinite_mismatch for _, s in fin.ins)
        judgeable = (
            not fin.unknown_input
            and not fin.discrete_changed
            and not source_inherited
            and not nonfinite_in
            and cls.kind != "uninit"
            and kind != "view"
        )
        if cls.kind == "select" and not fin.inputs_exact:
            judgeable = False  # comparisons, rounding, argmax: a changed input may change anything
        bench_args = ri.bench_args.get(ri.pairs.get(op_id, -1), "")
        if op_id in self.crossed:
            # Measured against a bench value that the bench computes differently: neither this
            # node nor what its outputs pass on can be judged.
            judgeable = False
            for m in outs.states:
                m.known = m.known and m.exact
        rstd = next((m for m, role in zip(outs.states, outs.roles) if role == "rstd"), None)
        dtype = ri.own.get(outputs[0], (True, False, ""))[2] if outputs else ""
        # This call's site among the op's calls (see TypicalRatio); each output adds its role.
        site = (
            (op, dtype, phase, layer_site(module), tuple(made_by(self.producer.get(base.get(t, t))) for t in inputs))
            if judgeable
            else ()
        )
        return _Judging(judgeable, bench_args, rstd, dtype, site)

    def _introduced(
        self, index: int, node: Node, fin: _Inputs, outs: _Outputs, judging: _Judging, verdict: NodeVerdict
    ) -> JudgedNode:
        """The node's error and what it introduced beyond its inputs' (set on ``verdict``), judged."""
        cls, judgeable = fin.cls, judging.judgeable
        best_e, best_x, best_f1, best_ratio = (0.0, 0.0, 0.0), (0.0, 0.0, 0.0), (1.0, 1.0, 1.0), -math.inf
        best_kappa = 1.0
        rounding = _Rounding(lam=2.0 if cls.accumulates else 1.0)
        parts = []
        for out, role, position in zip(outs.states, outs.roles, outs.positions):
            e, x, f1 = self._output_error(node, fin, judging, out, role, position, rounding)
            ratio = max(
                ((ec - xc) / fc if math.isfinite(xc) else ec / fc) for ec, xc, fc in zip(e, x, f1) if not math.isnan(ec)
            )
            if role and out.is_float:
                parts.append((role, e, x, f1))
            if ratio > best_ratio:
                best_ratio, best_e, best_x, best_f1, best_kappa = ratio, e, x, f1, rounding.kappa_local
        error = max((ec / fc for ec, fc in zip(best_e, best_f1) if not math.isnan(ec)), default=math.nan)
        verdict.error = float(error)
        intro = [
            max(0.0, ec - xc) / fc if not math.isnan(ec) and math.isfinite(xc) else 0.0
            for ec, xc, fc in zip(best_e, best_x, best_f1)
        ]
        verdict.introduced = float(max(intro)) if judgeable else 0.0
        return JudgedNode(
            index,
            node.op_id,
            (node.op, judging.dtype),
            cls,
            judgeable,
            fin.inputs_exact,
            all(s.exact for s in outs.states),
            best_e,
            best_x,
            best_f1,
            rounding.lam,
            rounding.uses_tf32,
            all(s.same_dtype for s in outs.states),
            rounding.nontrivial,
            best_kappa,
            tuple(parts),
        )

    def _output_error(
        self,
        node: Node,
        fin: _Inputs,
        judging: _Judging,
        out: TensorState,
        role: str,
        position: int,
        rounding: _Rounding,
    ) -> tuple[tuple[float, float, float], tuple[float, float, float], tuple[float, float, float]]:
        """One output's error, its prediction from the inputs, and its own rounding unit (per channel)."""
        cls, float_ins, judgeable, op, kind = fin.cls, fin.float_ins, judging.judgeable, node.op, node.kind
        if not out.is_float:
            e = (0.0 if out.exact else 1.0, 0.0, math.nan)
            x = (0.0 if fin.inputs_exact else math.inf, 0.0, 0.0)
            return e, x, (1.0, 1.0, 1.0)
        unit = out.unit
        if (
            cls.precision_variable
            and self.tol.allow_tf32
            and 0 < unit <= FP32_EPS
            and contracts_nonzero(cls, float_ins)
        ):
            # TF32 (or declared bf16) rounding, not accumulation order, then sets the local error.
            unit, rounding.lam, rounding.uses_tf32 = reduced_unit(self.ri.reduced_precision), 0.5, True
        rounding.kappa_local = local_kappa(cls, float_ins, out, role) if cls.accumulates else 1.0
        # Reordered (or TF32-rounded) terms differ by a unit each, amplified where they cancel.
        unit *= rounding.kappa_local
        averaged = averaged_rounding(unit, out, rounding.uses_tf32)
        f1 = (max(unit, TINY), max(averaged, TINY), max(unit, TINY))
        e = (out.e_ext, out.e_sys, out.e_rms)
        x = (
            predicted_error(cls, base_name(op), float_ins, out, role, judging.rstd)
            if judgeable
            else (math.inf, math.inf, math.inf)
        )
        if judgeable and base_name(op) in ADAM_UPDATES:
            x = within_adam_bound(x, node, position, self.producer, self.lookup, self.base, out)
        if judgeable and kind != "source":
            # full(finfo(dtype).min), x + finfo(dtype).eps: each run took its own dtype's number
            shift = constant_shift(cls, node.args, judging.bench_args, out, float_ins, judging.rstd)
            x = (x[0] + shift[0], x[1] + shift[1], x[2] + shift[2])
        rounding.nontrivial = rounding.nontrivial or (
            out.amax > 0 and (cls.kind != "contract" or contracts_nonzero(cls, float_ins))
        )
        if judgeable:
            site = judging.site
            carried_error(out, x, self.typical.median((*site, role)))
            if kind == "op":
                self.typical.add((*site, role), e, x)
            if cls.kind == "product":
                carry_factors(out, x, float_ins, cls)
        if out.filled:
            e, x = at_finite_scale(out, e, x)
        return e, x, f1

    # ---- pass 2 -------------------------------------------------------------------------------

    def _calibrate(self) -> None:
        """The rank's regime (bitwise or not), its regions judged, and its ambient calibration."""
        ri, tol, exact_mode = self.ri, self.tol, self.exact_mode
        # Compiled units round like whole graphs, not like single ops: they set neither regime nor calibration.
        own_rules = [j if j is None or j.op_id not in ri.units else None for j in self.judged]
        exact_input_nodes = [
            j for j in own_rules if j is not None and j.judgeable and j.inputs_exact and j.cls.kind != "factory"
        ]
        # Matmuls/convs allowed to run at TF32 have their own rule and do not decide the regime.
        differing = sum(1 for j in exact_input_nodes if not j.outputs_exact and not j.uses_tf32)
        bitwise = exact_mode or differing <= max(2, 0.01 * len(exact_input_nodes))
        # A matmul/conv that turned identical, non-zero inputs into identical outputs shows that this
        # target does not run them at reduced (TF32) precision.
        exact_matmul = any(j.cls.precision_variable and j.outputs_exact and j.nontrivial for j in exact_input_nodes)
        self.region_judged = {
            region_id: judge_region(region, ri, self.lookup, tol, exact_matmul)
            for region_id, region in ri.regions.items()
            if region.target_ops
        }
        ambient = ambient_noise(own_rules, ri.nodes, tol) if not exact_mode else {}
        names = {node.op_id: node.op for node in ri.nodes}
        fits = model_fits(ri.own_errors, names) if ri.reduced_precision and not exact_matmul else {}
        bounds_hold = accumulation_bounds_hold(ri) if ri.reduced_precision and not exact_matmul else False
        tf32_spread = tf32_spread_of(own_rules) if not exact_matmul else None
        bitwise_ops = ops_reproduced_bitwise(ri)
        self.ctx = RankContext(
            ri,
            tol,
            bitwise,
            exact_matmul,
            ambient,
            exact_mode,
            self.lookup,
            self.channels,
            fits,
            bounds_hold,
            tf32_spread,
            bitwise_ops,
            collective_moves(ri.nodes, ri.view_base),
        )

    def _judge(self, j: JudgedNode, node: Node, tainted_in: bool) -> None:
        """Decides the node; a root goes into its verdict and ``self.roots``."""
        ri = self.ri
        op_id, step, phase, kind, op, name, module, location, args, inputs, outputs, random, stack = node
        verdict = self.verdicts[op_id]
        bench_op = ri.pairs.get(op_id)
        root_kind, reason, deciding, part, confirmed = decide_node(j, node, self.ctx, tainted_in)
        verdict.metric = deciding
        if not root_kind and not j.outputs_exact and j.cls.kind != "contract":
            narrowed = self._round_trip(node)
            if narrowed:
                root_kind, reason = "precision", narrowed
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
            self.replayed.add(op_id)
        if root_kind == "nan":
            # NaN/Inf made from finite values: no count of rounding units measures that, and it
            # outranks every root of a few units.
            verdict.introduced = math.inf
        unit = ri.units.get(op_id)
        divergence = Divergence(
            op=op,
            # A compiled region's root is where it was narrowed to: that FX node's module.
            module=unit.narrowed_module if unit is not None and unit.narrowed_module else module,
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
        self.roots.append(((int(step), int(op_id), ri.rank), divergence))

    def _judge_all(self) -> None:
        """Judges every node in order, following taint from roots and drift between the runs."""
        ri = self.ri
        self.own_drift = {node.op_id: drift_of(ri.measured.get(t) for t in node.outputs) for node in ri.nodes}
        self.step_drift = defaultdict(float)
        for node in ri.nodes:
            self.step_drift[int(node.step)] = max(self.step_drift[int(node.step)], self.own_drift[node.op_id])
        for node, j in zip(ri.nodes, self.judged):
            tainted_in = self._tainted_in(node)
            drift_in = self._drift_in(node)
            if j is not None:
                self._judge(j, node, tainted_in)
                self._take_back_for_drift(j, node, drift_in)
            if not (node.kind == "view" and all(t in self.base for t in node.outputs)):
                self._pass_on(node, tainted_in, drift_in)

    def _round_trip(self, node: Node) -> str:
        """Why the node is a precision root, or "": the target alone narrows a float value to a lower
        precision just before it and widens its result back just after, where the bench computes
        it at the value's own precision (a softmax in bfloat16 inside a float32 model). Autocast
        narrows for the ops it runs in lower precision, matmul-like ones (and PReLU), which are not
        judged so; in the backward pass their gradients make the same round trips (a bias gradient's
        sum in bfloat16 between the casts' backwards), so only forward ops are."""
        ri, base = self.ri, self.base
        if node.kind != "op" or node.phase != "forward" or node.op_id not in ri.pairs or not node.outputs:
            return ""
        if base_name(node.op) in AUTOCAST_ELEMENTWISE:
            return ""
        low = ri.own.get(node.outputs[0], (True, False, ""))[2]
        if eps_of(low) <= FP32_EPS:
            return ""
        narrowing = [
            made
            for made in (self.producer.get(base.get(t, t)) for t in node.inputs)
            if made is not None and self._target_cast(made[0], to=low)
        ]
        if not narrowing:
            return ""
        wide = ri.own.get(narrowing[0][0].inputs[0], (True, False, ""))[2]
        widening = [n for n in self._consumers().get(node.outputs[0], []) if self._target_cast(n, to=wide)]
        if not widening:
            return ""
        return (
            f"computed in {low} where the bench computes in {wide}: the target narrows its {wide} input to {low} "
            f"just before it (op {narrowing[0][0].op_id}) and widens the result back just after (op "
            f"{widening[0].op_id}), a round trip the bench does not make"
        )

    def _target_cast(self, node: Node, to: str) -> bool:
        """Whether ``node`` is a cast to dtype ``to`` of a float value of another precision, made by
        the target alone."""
        if base_name(node.op) != "_to_copy" or node.op_id in self.ri.pairs or not node.inputs or not node.outputs:
            return False
        own = self.ri.own
        source, made = own.get(node.inputs[0], (True, False, ""))[2], own.get(node.outputs[0], (True, False, ""))[2]
        return made == to and source != to and is_float_dtype(source)

    def _consumers(self) -> dict[int, list[Node]]:
        """Tensor id (view bases) -> the nodes that read it, made on first use."""
        if self.consumers is None:
            self.consumers = defaultdict(list)
            for n in self.ri.nodes:
                for t in n.inputs:
                    self.consumers[self.base.get(t, t)].append(n)
        return self.consumers

    def _tainted_in(self, node: Node) -> bool:
        """Whether error from a root reaches the node's inputs; notes the first readout of one."""
        op_id, step, kind, op, inputs = node.op_id, node.step, node.kind, node.op, node.inputs
        # Taint: error that comes from a root. Once a root put its error into a node's inputs, that
        # error is no rounding noise, and what statistics say of it is a lower bound only.
        tainted_in = any(s is not None and s.tainted for s in map(self.lookup, inputs))
        # A parameter or buffer in a later step was moved by an optimizer that a root's error reached.
        tainted_in = tainted_in or (
            kind == "source" and op != "source.input" and any(r[0][0] < step for r in self.roots)
        )
        if self.python_from is None and tainted_in and is_readout(op):
            self.python_from = op_id
        return tainted_in

    def _drift_in(self, node: Node) -> float:
        """How far apart the runs' values are that the node computes from."""
        step, kind, op, inputs, outputs = node.step, node.kind, node.op, node.inputs, node.outputs
        drift, step_drift, lookup = self.drift, self.step_drift, self.lookup
        # Drift reaches what is computed from drifted values (a bitwise equal one excepted); into a
        # later step (its parameters, moved by a drifted update) only where that step drifts again.
        drift_in = 0.0
        for t in inputs:
            far, made = self.drifted.get(self.base.get(t, t), (0.0, step))
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
        return drift_in

    def _take_back_for_drift(self, j: JudgedNode, node: Node, drift_in: float) -> None:
        """Takes back a root no larger than the drift its inputs carry."""
        op_id = node.op_id
        verdict = self.verdicts[op_id]
        if (
            drift_in
            and verdict.root_kind == "computation"
            and op_id not in self.replayed
            and max((e for e in j.e if not math.isnan(e)), default=0.0) <= drift_in
        ):
            # Its inputs drifted apart: what their statistics say bounds their error from below
            # only, far below the drift itself, so a root of no more error than the drift is
            # as likely the drift's. A larger one stands out from it.
            self.undecided.append(self.roots.pop()[1])
            verdict.root_kind = ""
            assert self.drift is not None
            verdict.reason = (
                f"computed from values that drifted apart from op {self.drift[0][0]} on; statistics cannot tell "
                f"a fault here from that drift: {verdict.reason}"
            )

    def _pass_on(self, node: Node, tainted_in: bool, drift_in: float) -> None:
        """Taints the node's diverged outputs after a root, and marks those that drift."""
        op_id, step, outputs, base = node.op_id, node.step, node.outputs, self.base
        for t in outputs:
            s = self.state.get(t) if t not in base else None
            if s is not None and not s.exact and (tainted_in or self.verdicts[op_id].root_kind):
                s.tainted = True
        error = 0.0 if tainted_in or self.verdicts[op_id].root_kind else self.own_drift[op_id]
        if error and self.drift is None:
            self.drift = (node, error)
        if max(error, drift_in):
            self.drifted.update((base.get(t, t), (max(error, drift_in), int(step))) for t in outputs)

    def _follow_python(self) -> None:
        """Takes back the roots that follow Python's reading of a diverged value."""
        ri = self.ri
        nodes_by_id = {node.op_id: node for node in ri.nodes}
        exact_in = {j.op_id for j in self.judged if j is not None and j.inputs_exact}
        exact_in.update(
            op
            for op, region_id in ri.member_of.items()
            if region_id in self.region_judged and self.region_judged[region_id].inputs_exact
        )
        skipped = first_skipped_update(ri)
        self.roots[:] = [(key, d) for key, d in self.roots if not self._inherited(d, exact_in, nodes_by_id, skipped)]
        self.undecided = [d for d in self.undecided if not self._inherited(d, exact_in, nodes_by_id, skipped)]

    def _inherited(self, d: Divergence, exact_in: set[int], nodes_by_id: dict[int, Node], skipped: int | None) -> bool:
        """Whether ``d`` follows Python's reading of a root; then it is diverged, no root."""
        python_from = self.python_from
        assert python_from is not None
        if d.op_id in self.replayed or not follows_python(d, python_from, exact_in, self.ri.rank, skipped):
            return False
        verdict = self.verdicts[d.op_id]  # the reason says where from
        verdict.root_kind = ""
        verdict.reason = (
            f"follows op {python_from}, which read a diverged value into Python (.item()); "
            f"what the program decided from it may differ: {d.reason}"
        )
        for t in nodes_by_id[d.op_id][10]:  # a root taken back for the drift did not taint yet
            s = self.state.get(t)
            if s is not None and not s.exact:
                s.tainted = True
        return True

    # ---- pass 3 -------------------------------------------------------------------------------

    def _statuses(self, root_regions: set[int]) -> None:
        """Every node's status."""
        self.undecided_set = {d.op_id for d in self.undecided}
        self.producer_status = {}
        self.region_status = {}
        for node in self.ri.nodes:
            region_id = self.ri.member_of.get(node.op_id)
            if region_id is not None:
                self._member_status(node, region_id, root_regions)
            else:
                self._status(node)

    def _member_status(self, node: Node, region_id: int, root_regions: set[int]) -> None:
        """Members share their region's status; a root region taints what it makes."""
        region_status, base = self.region_status, self.base
        if region_id not in region_status:
            region_status[region_id] = region_status_of(
                self.ri.regions[region_id], self.region_judged.get(region_id), region_id in root_regions, self.lookup
            )
        tainted = region_id in root_regions or region_status[region_id] == "diverged"
        for t in node.outputs:
            s = self.state.get(base.get(t, t))
            if s is not None and not s.exact and tainted:
                s.tainted = True
            self.producer_status[base.get(t, t)] = region_status[region_id]
        verdict = self.verdicts[node.op_id]
        verdict.status = region_status[region_id]
        if verdict.status == "uncompared" and not verdict.reason:
            verdict.reason = REGION_UNCOMPARED.format(kind=self.ri.regions[region_id].kind)

    def _status(self, node: Node) -> None:
        """The status of a node outside every region; why, where it was left uncompared."""
        verdict = self.verdicts[node.op_id]
        status, why = self._status_of(node, verdict)
        verdict.status = status
        if why and not verdict.reason:
            verdict.reason = why
        for t in node.outputs:
            self.producer_status[self.base.get(t, t)] = status

    def _status_of(self, node: Node, verdict: NodeVerdict) -> tuple[str, str]:
        """(status, why it is uncompared or unpaired, else "")."""
        ri, base, producer_status = self.ri, self.base, self.producer_status
        op_id, inputs, outputs = node.op_id, node.inputs, node.outputs
        paired = op_id in ri.pairs or op_id in ri.units
        if node.kind == "view" and all(t in base for t in outputs):
            src = base.get(outputs[0], inputs[0] if inputs else -1) if outputs else -1
            if not paired:
                return "unpaired", UNPAIRED
            status = producer_status.get(src, "uncompared")
            return status, VIEW_OF_UNCOMPARED if status == "uncompared" else ""
        ins = [self.lookup(t) for t in inputs]
        outs_all = [self.state.get(t) if t not in base else None for t in outputs]
        outs = [s for t, s in zip(outputs, outs_all) if t not in base]
        measured = [s for s in outs if s is not None and s.measured]
        if not paired:
            return "unpaired", UNPAIRED
        if op_id in self.crossed and not all(s.exact for s in measured):
            return "uncompared", CROSSED
        if any(s.nonfinite_mismatch and not s.given for s in measured):
            return "nan", ""
        if not outs and is_readout(node.op) and inputs:
            # ``.item()``: the number is its input's value, judged where that was made.
            status = readout_status(producer_status.get(base.get(inputs[0], inputs[0]), "uncompared"))
            return status, READS_UNCOMPARED if status == "uncompared" else ""
        if not outs:
            if all(s is not None and s.exact for s in ins) or not ins:
                return "agrees", ""
            return "uncompared", WRITES_NOTHING
        if op_id in self.undecided_set:
            return "uncompared", UNDECIDED
        recorded = [s for t, s in zip(outputs, outs_all) if s is not None and not s.uninit and t not in ri.unrecorded]
        unit = ri.units.get(op_id)
        if unit is not None and unit.departed and verdict.root_kind:
            return "diverged", ""  # a region root by what its own nodes showed, whatever its outputs lack
        if len(measured) < len(recorded):
            return "uncompared", UNMEASURED
        if all(s.exact for s in measured):
            return "agrees", ""
        if verdict.root_kind or any(s.tainted for s in measured):
            return "diverged", ""
        return "noise", ""

    def _found_drift(self) -> Drift | None:
        """Where the runs drifted apart, with the roots taken back for it."""
        if self.drift is None:
            return None
        (op_id, step, phase, _, op, _, module, *_), error = self.drift
        return Drift(
            rank=self.ri.rank,
            op_id=op_id,
            step=int(step),
            phase=phase,
            op=op,
            module=module,
            error=error,
            undecided=tuple(d.op_id for d in self.undecided),
        )
