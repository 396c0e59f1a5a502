"""``compare``: load two traces, align them, measure every paired tensor, localize the roots."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np
import pandas as pd

from tracecmp.aten.opclass import draws_random
from tracecmp.comparison.align import RegionMatch, SideGraph, align_nodes, find_regions
from tracecmp.comparison.compiled import (
    GRAPH_MODE_NOTE,
    CompiledUnits,
    Pairing,
    compiled_units,
    covered_by_units,
    judge_units,
    narrow_units_by_statistics,
    pair_units,
    same_compiled_graphs,
)
from tracecmp.comparison.localize import NodeVerdict, RankInput, localize, substitution_notes
from tracecmp.comparison.metrics import TENSOR_METRICS, add_tensor_metrics, stat_metrics
from tracecmp.comparison.result import NODE_COLUMNS, CompareResult
from tracecmp.comparison.tolerances import Tolerances
from tracecmp.errors import CompareError
from tracecmp.graph import view_bases
from tracecmp.graph.checks import own_checks
from tracecmp.graph.nodes import Node, TensorState
from tracecmp.numerics.precision import reduced_matmul_precision, reduced_precision_possible
from tracecmp.numerics.replay import OwnError, RegionReplay, replay_rank, replay_regions
from tracecmp.numerics.units import eps_of, is_float_dtype
from tracecmp.trace import boundedjson
from tracecmp.trace.reader import RankTrace, Trace
from tracecmp.trace.schema import PYTHON_SOURCE
from tracecmp.verdict.progress import Progress, shown

_STAT_COLUMNS = [
    "tensor_id",
    "op_id",
    "index",
    "shape",
    "dtype",
    "has_stats",
    "min",
    "max",
    "mean",
    "norm",
    "nan_count",
    "inf_count",
    "checksum",
    "data_key",
]
_PROGRESS_NODES = 20_000
# Regions whose computation a replay checks (casts and copies need none).
_REPLAYED_REGIONS = ("fused", "rewritten", "extra")


@dataclass(frozen=True)
class _RankRun:
    """What every rank of one comparison is prepared with."""

    tol: Tolerances
    wanted_steps: set[int] | None
    warnings: list[str]  # the comparison's warnings, appended to
    notes: list[str]  # and its notes (what statistics could not tell)
    bar: Progress
    replay: bool | None
    reduced: str | None  # the precision float32 matmul may run at, where it may run reduced


def compare_traces(
    t_trace: Trace,
    b_trace: Trace,
    *,
    tolerances: Tolerances | None = None,
    steps: Iterable[int] | None = None,
    ranks: Iterable[int] | None = None,
    exact: bool = False,
    replay: bool | None = None,
    progress: bool | None = None,
) -> CompareResult:
    """Compare loaded traces in this process, rank by rank: the core under :func:`tracecmp.compare`
    (which also compares several ranks in a process pool, :mod:`tracecmp.comparison.ranks`).

    Arguments as :func:`tracecmp.compare`'s. Several ranks come back with their roots unordered
    across ranks (:func:`tracecmp.comparison.ranks.attach_cross_rank` orders them).

    >>> result = compare_traces(tracecmp.load("runs/target"), tracecmp.load("runs/bench"))  # doctest: +SKIP
    """
    tol = tolerances if tolerances is not None else Tolerances()
    if tol.allow_tf32 is None:
        tol = tol.replace(allow_tf32=reduced_precision_possible(t_trace) or reduced_precision_possible(b_trace))
    warnings: list[str] = []
    notes: list[str] = []
    common = _common_ranks(t_trace, b_trace, ranks, warnings)
    total = sum(len(t_trace.rank(r).ops_table) for r in common)
    run = _RankRun(
        tol=tol,
        wanted_steps=None if steps is None else {int(s) for s in steps},
        warnings=warnings,
        notes=notes,
        bar=Progress("compare", shown(progress, total > _PROGRESS_NODES), total * 3),
        replay=False if exact else replay,
        reduced=reduced_matmul_precision(t_trace, b_trace) if tol.allow_tf32 else None,
    )
    rank_inputs, node_frames, tensor_frames, unpaired_frames, compared_steps = _prepare_ranks(
        t_trace, b_trace, common, run
    )
    bar = run.bar
    bar.update("localizing")
    verdicts, roots, skipped, drifts = localize(
        rank_inputs, tol, exact=exact, progress=lambda n: bar.update("localizing", n)
    )
    warnings.extend(str(drift) for drift in drifts if drift.undecided)
    bar.done = bar.total
    bar.update("done")
    bar.close()

    for ri in rank_inputs:
        covered_by_units(ri, verdicts)
    nodes = _node_table(node_frames, rank_inputs, verdicts)
    notes.extend(_self_check_notes(rank_inputs))
    notes.extend(substitution_notes(rank_inputs, verdicts))
    first = roots[0] if roots else None
    suspects = sorted(roots, key=lambda d: -d.score)
    regions = [region for ri in rank_inputs for region in ri.regions.values()]
    result = CompareResult(
        target=t_trace,
        bench=b_trace,
        first_divergence=first,
        suspects=suspects,
        nodes=nodes,
        tensors=_tensor_table(tensor_frames, nodes),
        unpaired_bench=pd.concat(unpaired_frames, ignore_index=True),
        tolerances=tol,
        warnings=warnings,
        notes=notes,
        exact=exact,
        ranks=[ri.rank for ri in rank_inputs],
        steps=sorted(compared_steps),
        regions=regions,
        skipped_steps=skipped,
        drifts=drifts,
    )
    return result


def _common_ranks(t_trace: Trace, b_trace: Trace, ranks: Iterable[int] | None, warnings: list[str]) -> list[int]:
    """The ranks both traces hold (among ``ranks`` where given), warning of the others and of an
    unfinished capture; a :class:`CompareError` where there is none."""
    wanted_ranks = set(ranks) if ranks is not None else None
    common = sorted(set(t_trace.ranks) & set(b_trace.ranks))
    if wanted_ranks is not None:
        missing = sorted(wanted_ranks - set(common))
        if missing:
            warnings.append(f"rank(s) {missing} are not in both traces")
        common = [r for r in common if r in wanted_ranks]
    for name, trace in (("target", t_trace), ("bench", b_trace)):
        only = sorted(set(trace.ranks) - set(b_trace.ranks if trace is t_trace else t_trace.ranks))
        if only and wanted_ranks is None:
            warnings.append(f"rank(s) {only} exist only in the {name} trace and were not compared")
        if not trace.complete:
            warnings.append(f"the {name} trace is incomplete (its capture did not finish): compared as far as it goes")
    if not common:
        raise CompareError(
            f"no common rank to compare (target ranks {t_trace.ranks}, bench ranks {b_trace.ranks})", path=t_trace.path
        )
    return common


def _prepare_ranks(
    t_trace: Trace, b_trace: Trace, common: list[int], run: _RankRun
) -> tuple[list[RankInput], list[pd.DataFrame], list[pd.DataFrame], list[pd.DataFrame], set[int]]:
    """Every common rank prepared (:func:`_prepare_rank`): the localizer's inputs, the node, tensor
    and unpaired bench frames, and the steps compared; a :class:`CompareError` where no step is."""
    rank_inputs: list[RankInput] = []
    node_frames, tensor_frames, unpaired_frames = [], [], []
    compared_steps: set[int] = set()
    for r in common:
        prepared = _prepare_rank(t_trace.rank(r), b_trace.rank(r), r, run, sum(len(ri.regions) for ri in rank_inputs))
        if prepared is None:
            continue
        rank_input, t_ops, tensors, unpaired = prepared
        rank_inputs.append(rank_input)
        node_frames.append(t_ops)
        tensor_frames.append(tensors)
        unpaired_frames.append(unpaired)
        compared_steps.update(int(s) for s in t_ops["step"].unique())
    if not rank_inputs:
        run.bar.close()
        raise CompareError(
            "the traces have no step in common to compare"
            + (f" among steps {sorted(run.wanted_steps)}" if run.wanted_steps else ""),
            path=t_trace.path,
        )
    return rank_inputs, node_frames, tensor_frames, unpaired_frames, compared_steps


def _node_table(
    node_frames: list[pd.DataFrame], rank_inputs: list[RankInput], verdicts: Mapping[tuple[int, int], NodeVerdict]
) -> pd.DataFrame:
    """The result's node table: the ranks' node frames with their verdicts and own errors."""
    nodes = pd.concat(node_frames, ignore_index=True)
    keys = list(zip(nodes["rank"].tolist(), nodes["op_id"].tolist()))
    for column in ("status", "error", "introduced", "metric", "root_kind", "reason"):
        nodes[column] = [getattr(verdicts[k], column) for k in keys]
    own_errors = {(ri.rank, op): own for ri in rank_inputs for op, own in ri.own_errors.items()}
    nodes["own_error"] = [own_errors[k].error if k in own_errors else math.nan for k in keys]
    nodes["honest_error"] = [own_errors[k].honest if k in own_errors else math.nan for k in keys]
    checks = {(ri.rank, op): c for ri in rank_inputs for op, c in ri.own_checks.items()}
    nodes["self_check"] = [
        checks[k].residual / checks[k].limit if k in checks and checks[k].limit > 0 else math.nan for k in keys
    ]
    return nodes[list(NODE_COLUMNS)]


def _self_check_notes(rank_inputs: list[RankInput]) -> list[str]:
    """What the target's self-checks at capture covered, per rank that has them."""
    notes = []
    for ri in rank_inputs:
        if ri.own_checks:
            failed = sum(c.failed for c in ri.own_checks.values())
            notes.append(
                f"rank {ri.rank}: {len(ri.own_checks):,} target ops checked themselves at capture "
                f"(float64 on a sample of their outputs), {failed:,} failed"
            )
    return notes


def _tensor_table(tensor_frames: list[pd.DataFrame], nodes: pd.DataFrame) -> pd.DataFrame:
    """The result's tensor table: the ranks' measured tensors with their producer's status."""
    tensors = pd.concat(tensor_frames, ignore_index=True)
    if len(tensors):
        keys = zip(nodes["rank"].tolist(), nodes["op_id"].tolist())
        status = dict(zip(keys, nodes["status"].tolist()))
        tensors.insert(len(tensors.columns), "status", [status.get(k) for k in zip(tensors["rank"], tensors["op_id"])])
    return tensors


def _units(t_rank: RankTrace, b_rank: RankTrace, steps: Iterable[int]) -> CompiledUnits:
    """The target's compiled units: regions that replace eager ops as a whole, their insides left out
    of the alignment. Against a bench that compiled the same graphs there are none: each region call
    pairs with its twin, op for op, as eager ops do."""
    if same_compiled_graphs(t_rank, b_rank):
        return CompiledUnits()
    return compiled_units(t_rank, steps)


def _prepare_rank(
    t_rank: RankTrace, b_rank: RankTrace, rank: int, run: _RankRun, first_region: int = 0
) -> tuple[RankInput, pd.DataFrame, pd.DataFrame, pd.DataFrame] | None:
    """One rank aligned and measured: the localizer's input, the node frame, the measured tensors
    and the unpaired bench ops; None where the rank has no step to compare."""
    rank_ops = _rank_ops(t_rank, b_rank, rank, run)
    if rank_ops is None:
        return None
    steps, t_ops, b_ops, t_lists, b_lists = rank_ops
    t_ten, b_ten = t_rank.tensors, b_rank.tensors
    run.bar.update(f"rank {rank}: aligning")
    units = _units(t_rank, b_rank, steps)
    pairs = align_nodes(t_ops[~t_ops["op_id"].isin(units.members)] if units else t_ops, t_ten, b_ops, b_ten)
    t_base, b_base = view_bases(t_ten), view_bases(b_ten)
    pairing = Pairing(units, t_ops, t_ten, b_ops, b_ten, b_base, b_rank.compiled) if units else None
    if pairing is not None:
        pairs.update(pairing.pair_ops(units))  # graph-mode nodes that are eager ops, by the graph's metadata
    t_graph = SideGraph.of(t_ops, t_lists[1], t_lists[2], t_ten, t_base)
    b_graph = SideGraph.of(b_ops, b_lists[1], b_lists[2], b_ten, b_base)
    if units:
        # A compiled target's fused work is in its units, judged whole (comparison/compiled/):
        # no eager regions are looked for beside them.
        match = RegionMatch(dict(pairs), [], {}, {}, {}, {})
    else:
        match = find_regions(t_graph, b_graph, pairs, rank, first_region)
    pairs = match.pairs
    run.bar.update(f"rank {rank}: measuring", len(t_ops))

    partner = _tensor_partners(t_lists, b_lists, pairs, t_base, b_base, match.partners)
    if pairing is not None:
        partner = _unit_partners(partner, pairing, units, (t_lists, b_lists), pairs, t_base)
    if units.graph_mode:
        run.warnings.append(f"rank {rank}: {GRAPH_MODE_NOTE}")
    measured_frame = _measure(t_rank, b_rank, partner, run.tol)
    run.bar.update(f"rank {rank}: measured", len(t_ops))

    own = _own_facts(t_ten)
    measured = _states(measured_frame, own)
    inf_only = _inf_only(t_ten)
    own_errors, region_replays, has_data = _replay(t_rank, b_rank, t_ops["op_id"].tolist(), match, rank, run)
    if units and pairing is not None:
        _judge_units(units, (t_rank, b_rank), pairing, measured, own_errors if has_data else None, run)

    unpaired = _unpaired_bench(b_ops, match, pairing, units, b_base, rank)
    region_ops, region_values = _region_context(match, t_graph, b_graph, t_ten, b_ten)
    rank_input = RankInput(
        rank=rank,
        nodes=_nodes(t_ops, t_lists),
        pairs=pairs,
        measured=measured,
        own=own,
        view_base=t_base,
        bench_args=dict(zip(b_ops["op_id"].tolist(), b_ops["args"].tolist())),
        first_step=min(steps),
        own_errors=own_errors,
        reduced_precision=run.reduced,
        regions={r.region_id: r for r in match.regions},
        member_of=match.member_of,
        bench_only=match.bench_only,
        region_ops=region_ops,
        region_values=region_values,
        region_replays=region_replays,
        units=units.by_judged,
        bench_inputs={op: [b_base.get(t, t) for t in ins] for op, ins in zip(b_lists[0], b_lists[1])},
        bench_producer=dict(zip(b_ten["tensor_id"].tolist(), b_ten["op_id"].tolist())),
        partner=partner,
        inf_only=inf_only,
        reentered=_reentered(t_ops, t_lists, t_ten),
        unrecorded=_unrecorded(pairs, t_lists, b_lists, t_ten, b_ten),
        own_checks=own_checks(t_rank.checks, dict(zip(t_ops["op_id"].tolist(), t_ops["op"].tolist()))),
    )
    measured_frame.insert(0, "rank", rank)
    return rank_input, _node_frame(t_ops, rank, pairs, match.member_of), measured_frame, unpaired


def _judge_units(
    units: CompiledUnits,
    ranks: tuple[RankTrace, RankTrace],
    pairing: Pairing,
    measured: Mapping[int, TensorState],
    own_errors: Mapping[int, OwnError] | None,
    run: _RankRun,
) -> None:
    """Judge a compiled target's units: by a replay where the target holds tensors (``own_errors``
    given), else by the statistics of their recorded nodes, saying what those cannot see."""
    rank = ranks[0].rank
    if own_errors is not None and run.replay is not False:
        judge_units(units, ranks[0], ranks[1], pairing, measured, own_errors, run.tol)
    else:
        unseen = narrow_units_by_statistics(units, pairing, measured, run.tol)
        if unseen:
            run.notes.append(
                f"rank {rank}: compiled regions judged by statistics: {unseen} of their graphs' nodes ran in fused "
                f"code no op records, where a fault smaller than {run.tol.region_units:g} rounding units is not "
                'told apart; capture the target with data="tensors" to replay them'
            )
    unfaithful = sorted({u.graph.id for u in units.units if u.unfaithful})
    if unfaithful:
        run.notes.append(
            f"rank {rank}: the compiled code of {', '.join(unfaithful)} computes otherwise than its graph does "
            "with eager kernels (a fused kernel keeps a precision the graph rounds away, or a kernel departs "
            "from it): judged by what it dispatched, its graph's casts not taken as written"
        )
    run.warnings.extend(f"rank {rank}: {w}" for w in units.warnings)


_IdLists = tuple[list[int], list[list[int]], list[list[int]]]


def _rank_ops(
    t_rank: RankTrace, b_rank: RankTrace, rank: int, run: _RankRun
) -> tuple[set[int], pd.DataFrame, pd.DataFrame, _IdLists, _IdLists] | None:
    """Both sides' ops on the steps to compare, in op id order, with their id lists (:func:`_id_lists`),
    warning of steps only one side holds; None where no step is left."""
    t_ops, b_ops = t_rank.ops, b_rank.ops
    t_steps, b_steps = set(t_ops["step"].unique().tolist()), set(b_ops["step"].unique().tolist())
    steps = t_steps & b_steps
    wanted_steps = run.wanted_steps
    if wanted_steps is not None:
        steps &= wanted_steps
    for name, own, other in (("target", t_steps, b_steps), ("bench", b_steps, t_steps)):
        only = sorted(own - other)
        if only and (wanted_steps is None or set(only) & wanted_steps):
            run.warnings.append(f"rank {rank}: step(s) {only} exist only in the {name} trace")
    if not steps:
        return None
    if steps != t_steps:
        t_ops = t_ops[t_ops["step"].isin(steps)]
    if steps != b_steps:
        b_ops = b_ops[b_ops["step"].isin(steps)]
    t_ops = t_ops.sort_values("op_id", kind="stable")
    b_ops = b_ops.sort_values("op_id", kind="stable")
    # Row positions in the Arrow tables, to read the id lists from Arrow's buffers (much faster).
    t_lists = _id_lists(t_rank, t_ops.index.to_numpy())
    b_lists = _id_lists(b_rank, b_ops.index.to_numpy())
    return steps, t_ops.reset_index(drop=True), b_ops.reset_index(drop=True), t_lists, b_lists


def _unit_partners(
    partner: dict[int, int],
    pairing: Pairing,
    units: CompiledUnits,
    lists: tuple[_IdLists, _IdLists],
    pairs: Mapping[int, int],
    t_base: Mapping[int, int],
) -> dict[int, int]:
    """``partner`` with the compiled units' values: those inside a unit left out, its outputs paired
    by the graph's metadata, or, where that finds nothing, through the paired ops that read them."""
    t_lists, b_lists = lists
    leaving = {t for unit in units.units for t, _ in unit.outputs}
    inside = {
        t for op_id, outs in zip(t_lists[0], t_lists[2]) if op_id in units.members and op_id not in pairs for t in outs
    } - leaving
    partner = {t: b for t, b in partner.items() if t not in inside}
    partner.update(pair_units(pairing, units))
    unpaired = {t for t in leaving if t >= 0 and t not in partner}
    if unpaired:
        partner.update(_partners_by_readers(unpaired, lists, pairs, pairing, t_base))
    return partner


def _partners_by_readers(
    wanted: set[int],
    lists: tuple[_IdLists, _IdLists],
    pairs: Mapping[int, int],
    pairing: Pairing,
    t_base: Mapping[int, int],
) -> dict[int, int]:
    """Bench partners of the target tensors ``wanted``, from what paired ops read in the same argument
    position (the tensor itself, or a view of all of it, on both sides): a region output the
    graph's metadata cannot place, such as a tied weight's gradient, summed inside the compiled
    backward where eager autograd adds the two parts outside any op the graph names. A tensor
    whose readers disagree stays unpaired."""
    (t_ids, t_inputs, _), (b_ids, b_inputs, _) = lists
    b_reads = dict(zip(b_ids, b_inputs))
    found: dict[int, set[int | None]] = defaultdict(set)
    for op_id, inputs in zip(t_ids, t_inputs):
        b_op = pairs.get(op_id)
        if b_op is None:
            continue
        bench_inputs = b_reads.get(b_op, [])
        for position, t in enumerate(inputs[: len(bench_inputs)]):
            whole = t_base.get(t, t)
            if whole in wanted and pairing.t_shape.get(t) == pairing.t_shape.get(whole):
                found[whole].add(pairing.measured_as(bench_inputs[position]))
    return {t: b.pop() for t, b in found.items() if len(b) == 1 and None not in b}


def _own_facts(t_ten: pd.DataFrame) -> dict[int, tuple[bool, bool, str]]:
    """Per target tensor: whether it is a float, whether it holds NaN or Inf, its dtype."""
    own_float = t_ten["dtype"].map(is_float_dtype).to_numpy(bool)
    own_nonfinite = t_ten["has_stats"].to_numpy(bool) & (
        (t_ten["nan_count"].to_numpy() > 0) | (t_ten["inf_count"].to_numpy() > 0)
    )
    return dict(
        zip(t_ten["tensor_id"].tolist(), zip(own_float.tolist(), own_nonfinite.tolist(), t_ten["dtype"].tolist()))
    )


def _replay(
    t_rank: RankTrace, b_rank: RankTrace, op_ids: list[int], match: RegionMatch, rank: int, run: _RankRun
) -> tuple[dict[int, OwnError], dict[int, RegionReplay], bool]:
    """The target's ops and regions replayed where asked and possible: their own errors, the
    regions' replays, and whether the target holds tensors to replay from."""
    own_errors: dict[int, OwnError] = {}
    region_replays: dict[int, RegionReplay] = {}
    has_data = bool(t_rank.tensors["data_key"].astype(bool).any())
    if run.replay and not has_data:
        run.warnings.append(
            f'rank {rank}: no replay: the target trace holds no tensors (capture it with data="tensors")'
        )
    elif (run.replay is None or run.replay) and has_data:
        run.bar.update(f"rank {rank}: replaying")
        own_errors = replay_rank(
            t_rank, op_ids, reduced=run.reduced, progress=lambda n: run.bar.update(f"rank {rank}: replaying")
        )
        region_replays = replay_regions(t_rank, b_rank, [r for r in match.regions if r.kind in _REPLAYED_REGIONS])
    return own_errors, region_replays, has_data


def _unpaired_bench(
    b_ops: pd.DataFrame,
    match: RegionMatch,
    pairing: Pairing | None,
    units: CompiledUnits,
    b_base: Mapping[int, int],
    rank: int,
) -> pd.DataFrame:
    """The bench ops nothing in the target pairs with, nor a region or compiled unit stands for."""
    paired_bench = set(match.pairs.values()) | set(match.bench_member_of)
    if pairing is not None:
        paired_bench |= pairing.covered_bench(units, b_base, paired_bench)  # the eager ops compiled regions replace
    unpaired_mask = ~b_ops["op_id"].isin(paired_bench)
    unpaired = b_ops.loc[unpaired_mask, ["op_id", "step", "phase", "kind", "op", "name", "module", "location"]].copy()
    unpaired.insert(0, "rank", rank)
    return unpaired


def _nodes(t_ops: pd.DataFrame, t_lists: _IdLists) -> list[Node]:
    """The target's ops as graph nodes."""
    return list(
        map(
            Node._make,
            zip(
                t_ops["op_id"].tolist(),
                t_ops["step"].tolist(),
                t_ops["phase"].tolist(),
                t_ops["kind"].tolist(),
                t_ops["op"].tolist(),
                t_ops["name"].tolist(),
                t_ops["module"].tolist(),
                t_ops["location"].tolist(),
                t_ops["args"].tolist(),
                t_lists[1],
                t_lists[2],
                _draws(t_ops),
                t_ops["stack"].tolist(),
            ),
        )
    )


def _node_frame(t_ops: pd.DataFrame, rank: int, pairs: Mapping[int, int], member_of: Mapping[int, int]) -> pd.DataFrame:
    """The rank's rows of the node table, before the verdicts: identity, bench partner, region."""
    frame = t_ops[["op_id", "step", "phase", "kind", "op", "name", "module", "location"]].copy()
    frame.insert(0, "rank", rank)
    frame.insert(2, "bench_op_id", pd.array([pairs.get(o) for o in frame["op_id"].tolist()], dtype="Int64"))
    frame.insert(3, "region", pd.array([member_of.get(o) for o in frame["op_id"].tolist()], dtype="Int64"))
    return frame


def _region_context(
    match: RegionMatch, t_graph: SideGraph, b_graph: SideGraph, t_ten: pd.DataFrame, b_ten: pd.DataFrame
) -> tuple[dict[tuple[str, int], tuple[str, str, str, list[int], list[int]]], dict[tuple[str, int], TensorState]]:
    """What judging the regions needs of their members: each op (kind, name, args, inputs,
    outputs) and the recorded magnitudes of every tensor they read or make, per side."""
    ops: dict[tuple[str, int], tuple[str, str, str, list[int], list[int]]] = {}
    wanted: dict[str, set[int]] = {"t": set(), "b": set()}
    for region in match.regions:
        for side, graph, members in (("t", t_graph, region.target_ops), ("b", b_graph, region.bench_ops)):
            for o in members:
                node = graph.nodes[o]
                ops[(side, o)] = (node.kind, node.op, node.args, node.inputs, node.outputs)
                wanted[side].update(node.outputs)
                wanted[side].update(node.inputs)
    values: dict[tuple[str, int], TensorState] = {}
    for side, tensors in (("t", t_ten), ("b", b_ten)):
        if not wanted[side]:
            continue
        rows = tensors[tensors["tensor_id"].isin(list(wanted[side])) & tensors["has_stats"].astype(bool)]
        for tid, shape, dtype, lo, hi, mean, norm, nan, inf in zip(
            *(
                rows[c].tolist()
                for c in ("tensor_id", "shape", "dtype", "min", "max", "mean", "norm", "nan_count", "inf_count")
            )
        ):
            numel = int(np.prod(shape)) if shape is not None else 0
            finite = max(numel - int(nan) - int(inf), 1)
            amax = (
                max(abs(v) for v in (lo, hi) if v is not None and math.isfinite(v))
                if any(v is not None and math.isfinite(v) for v in (lo, hi))
                else 0.0
            )
            values[(side, int(tid))] = TensorState(
                known=True,
                exact=True,
                amax=float(amax),
                rms=float(norm) / math.sqrt(finite) if norm is not None and math.isfinite(norm) else 0.0,
                numel=numel,
                lo=_finite(lo),
                hi=_finite(hi),
                mean=_finite(mean),
                nonfinite=bool(nan or inf),
                is_float=is_float_dtype(dtype),
                unit=eps_of(dtype),
            )
    return ops, values


def _draws(ops: pd.DataFrame) -> list[bool]:
    """Per row, whether the call drew random numbers: the schema's ``random`` flag, refined by the
    call's arguments (fused attention with ``dropout_p=0.0`` draws nothing)."""
    out = []
    for may, op, args in zip(ops["random"].tolist(), ops["op"].tolist(), ops["args"].tolist()):
        if not may:
            out.append(False)
            continue
        try:
            parsed = boundedjson.loads(args, max_bytes=boundedjson.ARGS_MAX_BYTES) if args else None
        except ValueError:
            parsed = None
        out.append(draws_random(op, parsed if isinstance(parsed, dict) else None))
    return out


def _id_lists(rank: RankTrace, rows: np.ndarray) -> tuple[list[int], list[list[int]], list[list[int]]]:
    """op ids, input ids and output ids of the table rows ``rows``, as plain Python lists."""
    table = rank.ops_table
    whole = len(rows) == table.num_rows and bool((rows == np.arange(len(rows))).all())
    columns = []
    for name in ("inputs", "outputs"):
        column = table.column(name).combine_chunks()
        offsets_np = column.offsets.to_numpy()
        offsets = (offsets_np - offsets_np[0]).tolist()
        values = column.flatten().to_numpy().tolist()
        lists = [values[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]
        columns.append(lists if whole else [lists[i] for i in rows.tolist()])
    op_ids = table.column("op_id").to_numpy()
    return (op_ids.tolist() if whole else op_ids[rows].tolist()), columns[0], columns[1]


def _tensor_partners(
    t_lists: tuple[list[int], list[list[int]], list[list[int]]],
    b_lists: tuple[list[int], list[list[int]], list[list[int]]],
    pairs: Mapping[int, int],
    t_base: Mapping[int, int],
    b_base: Mapping[int, int],
    region_outputs: Mapping[int, int],
) -> dict[int, int]:
    """``{target tensor id: bench tensor id}`` for non-view tensors.

    Outputs of paired nodes pair by position; a region's outputs take the bench tensors they stand
    for (:func:`tracecmp.comparison.align.find_regions`). Nothing inside a region is paired.
    """
    b_outputs = dict(zip(b_lists[0], b_lists[2]))
    partner: dict[int, int] = {}
    t_op_ids, _, t_outputs = t_lists
    for op_id, outs in zip(t_op_ids, t_outputs):
        b_op = pairs.get(op_id)
        if b_op is None:
            continue
        for t, b in zip(outs, b_outputs.get(b_op, [])):
            if t not in t_base and b not in b_base:
                partner[t] = b
    for t, b in region_outputs.items():
        partner.setdefault(t, b)
    return partner


def _measure(t_rank: RankTrace, b_rank: RankTrace, partner: Mapping[int, int], tol: Tolerances) -> pd.DataFrame:
    """One row per target tensor with a bench partner: identity, both sides' stats, the metrics."""
    t_ten = t_rank.tensors[_STAT_COLUMNS]
    b_ten = b_rank.tensors[_STAT_COLUMNS].drop(columns=["op_id", "index"])
    link = pd.DataFrame(
        {
            "tensor_id": np.fromiter(partner.keys(), dtype=np.int64, count=len(partner)),
            "bench_tensor_id": np.fromiter(partner.values(), dtype=np.int64, count=len(partner)),
        }
    )
    frame = link.merge(t_ten, on="tensor_id", how="inner")
    frame = frame.merge(
        b_ten.rename(columns=lambda c: c if c == "tensor_id" else c + "_b").rename(
            columns={"tensor_id": "bench_tensor_id"}
        ),
        on="bench_tensor_id",
        how="inner",
    )
    frame = frame.sort_values("tensor_id", kind="stable").reset_index(drop=True)
    metrics = stat_metrics(frame, tol)
    frame = pd.concat([frame, metrics], axis=1)
    if len(frame) and (frame["data_key"].astype(bool) & frame["data_key_b"].astype(bool)).any():
        frame = add_tensor_metrics(frame, t_rank, b_rank, tol)
    else:
        for name in TENSOR_METRICS:
            frame[name] = np.nan if name != "seed_rule_fail" else False
    b_producer = dict(zip(b_rank.tensors["tensor_id"].tolist(), b_rank.tensors["op_id"].tolist()))
    frame.insert(2, "bench_op_id", [b_producer.get(b) for b in frame["bench_tensor_id"].tolist()])
    frame = frame.rename(columns={"dtype_b": "bench_dtype", "shape_b": "bench_shape"})
    return frame


def _states(frame: pd.DataFrame, own: Mapping[int, tuple[bool, bool, str]]) -> dict[int, TensorState]:
    """TensorState of every measured target tensor."""
    states: dict[int, TensorState] = {}
    if frame.empty:
        return states
    same = (frame["dtype"] == frame["bench_dtype"]).to_numpy(bool)
    columns = [
        frame[c].tolist()
        for c in (
            "tensor_id",
            "exact",
            "e_ext",
            "e_sys",
            "e_rms",
            "amax",
            "rms",
            "numel",
            "min_b",
            "max_b",
            "mean_b",
            "nonfinite_mismatch",
            "filled",
            "unit",
            "has_stats",
            "has_stats_b",
        )
    ]
    for (
        tid,
        exact,
        e_ext,
        e_sys,
        e_rms,
        amax,
        rms,
        numel,
        lo,
        hi,
        mean,
        nfm,
        filled,
        unit,
        has_t,
        has_b,
    ), same_dtype in zip(zip(*columns), same):
        if not (has_t and has_b):
            continue
        is_float, nonfinite, _ = own.get(tid, (True, False, ""))
        states[tid] = TensorState(
            known=True,
            exact=bool(exact),
            e_ext=float(e_ext),
            e_sys=float(e_sys),
            e_rms=float(e_rms),
            amax=float(amax),
            rms=float(rms),
            numel=int(numel),
            lo=_finite(lo),
            hi=_finite(hi),
            mean=_finite(mean),
            nonfinite=bool(nonfinite),
            is_float=bool(is_float),
            measured=True,
            nonfinite_mismatch=bool(nfm),
            unit=float(unit),
            same_dtype=bool(same_dtype),
            filled=bool(filled),
        )
    return states


def _reentered(t_ops: pd.DataFrame, t_lists: _IdLists, t_ten: pd.DataFrame) -> dict[int, int]:
    """Sources that hold a value the trace already made: ``{source op id: that tensor's id}``.

    A tensor made outside the dispatcher's sight over a traced tensor's memory enters as a new
    source (torch 2.1's ``clip_grad_norm_`` groups the gradients in C++ into tensors capture never
    saw made). Its content checksum, shape and dtype equal those of the latest tensor an op made
    before it; one that is not constant (its minimum below its maximum) is taken to be that value."""
    sources = t_ops.index[(t_ops["kind"] == "source") & (t_ops["op"] == PYTHON_SOURCE)].tolist()
    if not sources:
        return {}
    source_of = {t_lists[2][i][0]: t_lists[0][i] for i in sources if len(t_lists[2][i]) == 1}
    stats = t_ten[t_ten["has_stats"].to_numpy(bool) & (t_ten["min"].to_numpy() < t_ten["max"].to_numpy())]
    mine = stats[stats["tensor_id"].isin(list(source_of))]
    if mine.empty:
        return {}
    candidates = stats[stats["checksum"].isin(mine["checksum"].tolist())].sort_values("op_id", kind="stable")
    made: dict[tuple, int] = {}
    found: dict[int, int] = {}
    for tid, shape, dtype, checksum in zip(
        candidates["tensor_id"].tolist(),
        candidates["shape"].tolist(),
        candidates["dtype"].tolist(),
        candidates["checksum"].tolist(),
    ):
        key = (tuple(shape), dtype, checksum)
        if tid in source_of:
            if key in made:
                found[source_of[tid]] = made[key]
            continue
        made[key] = tid
    return found


def _unrecorded(
    pairs: Mapping[int, int], t_lists: _IdLists, b_lists: _IdLists, t_ten: pd.DataFrame, b_ten: pd.DataFrame
) -> frozenset[int]:
    """Outputs of paired ops that neither trace holds statistics of, in the same position: what an
    op returns without values (torch 2.1's CPU flash attention returns undefined tensors for the
    CUDA kernel's sequence offsets and random seeds). Their op is judged on its other outputs."""
    t_bare = set(t_ten.loc[~t_ten["has_stats"].to_numpy(bool), "tensor_id"].tolist())
    b_bare = set(b_ten.loc[~b_ten["has_stats"].to_numpy(bool), "tensor_id"].tolist())
    if not t_bare or not b_bare:
        return frozenset()
    b_outputs = dict(zip(b_lists[0], b_lists[2]))
    found = set()
    for op_id, outs in zip(t_lists[0], t_lists[2]):
        b_op = pairs.get(op_id)
        if b_op is None or not t_bare.intersection(outs):
            continue
        found.update(t for t, b in zip(outs, b_outputs.get(b_op, [])) if t in t_bare and b in b_bare)
    return frozenset(found)


def _inf_only(t_ten: pd.DataFrame) -> dict[int, float]:
    """Target tensors holding Inf and no NaN (what overflow makes) -> the rms of their finite values."""
    rows = t_ten[
        t_ten["has_stats"].to_numpy(bool) & (t_ten["inf_count"].to_numpy() > 0) & (t_ten["nan_count"].to_numpy() == 0)
    ]
    out: dict[int, float] = {}
    for tid, shape, norm, infs in zip(
        rows["tensor_id"].tolist(), rows["shape"].tolist(), rows["norm"].tolist(), rows["inf_count"].tolist()
    ):
        finite = math.prod(shape) - infs if shape is not None else 0
        out[tid] = float(norm) / math.sqrt(finite) if finite > 0 and norm is not None and math.isfinite(norm) else 0.0
    return out


def _finite(value: float) -> float:
    return float(value) if value is not None and math.isfinite(value) else 0.0
