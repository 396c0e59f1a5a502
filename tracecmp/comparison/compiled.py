"""Compiled regions in a comparison: lined up with the eager ops they replace, judged as a whole,
and a wrong one narrowed to its FX nodes.

A target captured with ``torch.compile`` holds *units* that have no op-for-op counterpart in an
eager bench (:mod:`tracecmp.trace.compiled` says what a trace records of them):

* a **region** (``compiled="boundary"``): one ``compiled.forward`` / ``compiled.backward`` node
  for a whole compiled graph part; the ops the compiled code dispatched inside it (inductor's
  extern kernels) are not the eager ops and are left out of the alignment;
* a **decomposition** (``compiled="graph"``): the FX nodes one eager op was decomposed into
  (``var_mean``, ``rsqrt``, ... for ``native_layer_norm``), recorded as ops of their own.

Each unit's outputs are paired with the bench tensors of the eager ops they replace, from the
graph's node metadata: the producing node's module, the eager op it came from (``original``)
and its autograd ``seq_nr`` group, counted in order within the module, and its shape. A unit is
then judged as one op (:class:`Unit.decide`, called by localize): it is a root when its outputs
differ from the bench by more than ``margin`` times what its inputs carry in plus its own
rounding. Its own rounding is measured when the target holds tensors: the unit's graph runs
again from its recorded inputs in float64 (the reference) and in the recorded dtypes with eager
kernels (an honest implementation), as :mod:`tracecmp.numerics.replay` does for single ops; without
tensors it is ``region_units`` rounding units of the output's dtype (``Tolerances``).

A region that is a root is narrowed: the replay's value of every FX node is compared with the
bench's value of the eager op that node stands for (a graph that computes something else than
the eager program: a custom op, a pass that changed a node), and with what the compiled code
dispatched for that node (a wrong kernel: an extern kernel that misbehaves). The first node
that departs is named, with its module and source line. In graph mode every node is an op of the
trace and localize names it directly.

Until the alignment has fused regions of its own, :class:`Unit` is the minimal record of one here.

>>> units = compiled_units(target.rank(0), bench.rank(0))   # doctest: +SKIP
>>> units.members          # target op ids the alignment leaves out  # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping

import pandas as pd

from tracecmp.comparison.tolerances import Tolerances
from tracecmp.graph.nodes import Node
from tracecmp.numerics.units import EPS, FP32_EPS, canonical_dtype
from tracecmp.trace.compiled import GRAPH_LABEL, CompiledGraph, GraphNode, GraphPart, RegionCall
from tracecmp.trace.reader import RankTrace

GRAPH_MODE_NOTE = (
    f'the target ran its compiled regions as {GRAPH_LABEL} (compiled="graph"): its numbers inside '
    "them are eager kernels', not the compiled code's"
)
_PROPAGATION = 4.0  # how many times an input's error a region may pass on (localize's rule for unknown ops)
# Ops that rearrange or copy a value without computing: a value they make stands for the eager op
# that computed what they rearrange.
_SAME_VALUES = (
    "aten.view.",
    "aten._unsafe_view.",
    "aten.permute.",
    "aten.t.",
    "aten.transpose.",
    "aten.reshape.",
    "aten.expand.",
    "aten.squeeze.",
    "aten.unsqueeze.",
    "aten.alias.",
    "aten.clone.",
    "aten.contiguous.",
)


@dataclass
class Unit:
    """A stretch of the target that replaces eager ops as a whole (see the module docstring)."""

    kind: str  # "region" | "decomposition"
    judged: tuple[int, ...]  # target op ids judged for the unit (its boundary node; a group's exits)
    members: frozenset[int]  # target op ids it covers, left out of the alignment
    inputs: tuple[int, ...]  # target tensor ids it reads from outside
    outputs: tuple[tuple[int, str], ...]  # (target tensor id, FX node whose value it is)
    call: RegionCall
    graph: CompiledGraph
    replaces: str  # the eager ops it stands for, as a reader says it
    forward_call: RegionCall | None = None  # a backward region's forward call
    own: tuple[float, float] | None = None  # (own error, honest error) from a replay, relative
    rounding: float | None = None  # a decomposition's rounding: its ops' honest replay errors, summed
    narrowed: str = ""  # the FX node a root was narrowed to, for its reason

    def decide(
        self, node: Node, errors: tuple[float, float, float], ri: Any, tol: Tolerances, lookup: Callable[[int], Any]
    ) -> tuple[str, str, str]:
        """Root kind, reason and deciding metric of the unit (the judged op ``node``), for localize.

        ``errors`` are localize's errors of the output it looked at; the unit looks at all of them.
        """
        states = [ri.measured[t] for t in node.outputs if t in ri.measured]
        measured = [e for s in states for e in (s.e_ext, s.e_sys, s.e_rms) if not math.isnan(e)]
        if not measured:
            return "", "", "region"
        err = max(measured)  # the worst output: a region's outputs are many values, not one
        ins = [lookup(t) for t in self.inputs]
        floats = [s for s in ins if s is not None and s.is_float and not s.uninit]
        if any(s is None or not s.known for s in ins if s is None or not s.uninit):
            return "", "", "region"  # an input of unknown error: nothing to blame on the unit
        carried = max((s.level for s in floats), default=0.0) * _PROPAGATION
        dtype = self._dtype(node, ri)
        unit = EPS.get(canonical_dtype(dtype), FP32_EPS)
        floor = tol.local * unit
        what = f"{self.kind} {self.replaces}" if self.kind == "decomposition" else f"compiled region {self.graph.id}"
        if self.own is not None:
            own, honest = self.own
            if own > max(tol.replay_margin * honest, tol.replay_local * unit):
                return (
                    "computation",
                    f"its compiled code computes its graph wrongly: own error {own:.2e} against a float64 replay "
                    f"of its recorded inputs, {own / max(honest, 1e-300):.0f}x what eager kernels make ({honest:.1e})"
                    + self._narrowed(),
                    "replay",
                )
            rounding = max(own, honest)
            how = f"its own rounding, {rounding:.1e} by a replay of its graph"
        elif self.rounding is not None:
            rounding = self.rounding
            how = f"its ops' own rounding, {rounding:.1e} by replaying them"
        else:
            rounding = tol.region_units * unit
            how = f"{tol.region_units:g} rounding units allowed a {self.kind} that no replay measured"
        bound = tol.margin * (carried + rounding) + floor
        if err > bound:
            return (
                "computation",
                f"the {what} ({self.replaces}) differs from the eager ops it replaces by {err:.2e}, more than its "
                f"inputs carry in ({carried:.1e}) and {how}" + self._narrowed(),
                "region",
            )
        return "", "", "region"

    def _dtype(self, node: Node, ri: Any) -> str:
        outputs = node.outputs
        return ri.own.get(outputs[0], (True, False, "float32"))[2] if outputs else "float32"

    def _narrowed(self) -> str:
        return f"; {self.narrowed}" if self.narrowed else ""


@dataclass
class CompiledUnits:
    """The units of one target rank and what the engine needs of them."""

    units: list[Unit] = field(default_factory=list)
    members: set[int] = field(default_factory=set)  # left out of the alignment
    by_judged: dict[int, Unit] = field(default_factory=dict)  # judged op id -> unit
    # Graph mode: every node that is an eager op of its own, with its recorded op; these pair with
    # the bench by the graph's metadata, not by the alignment's sequences (a backward graph adds
    # gradients where the autograd engine does, under other modules).
    node_ops: list[tuple[int, GraphNode, RegionCall]] = field(default_factory=list)
    calls: list[tuple[RegionCall, CompiledGraph, int]] = field(default_factory=list)  # with an op of each
    graph_mode: bool = False
    warnings: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.calls)


def compiled_units(t_rank: RankTrace, steps: Iterable[int] | None = None) -> CompiledUnits:
    """The units of the target rank's compiled-region calls (in the steps given)."""
    record = t_rank.compiled
    out = CompiledUnits()
    if not record:
        return out
    wanted = None if steps is None else set(steps)
    ops = t_rank.ops
    outputs_of = dict(zip(ops["op_id"].tolist(), (list(o) for o in ops["outputs"].tolist())))
    inputs_of = dict(zip(ops["op_id"].tolist(), (list(i) for i in ops["inputs"].tolist())))
    kinds = dict(zip(ops["op_id"].tolist(), ops["kind"].tolist()))
    forwards = {c.first_op: c for c in record.calls if c.part == "forward"}
    for call in record.calls:
        if wanted is not None and call.step not in wanted:
            continue
        graph = record.graphs[call.graph]
        part = graph.parts.get(call.part)
        if call.mode == "boundary":
            if call.op_id not in outputs_of:
                continue
            entering = set(call.inputs)
            members = frozenset(
                o
                for o in range(call.first_op, call.op_id)
                if o in kinds and not (kinds[o] == "source" and set(outputs_of[o]) <= entering)
            )
            names = _output_names(part, call)
            outputs = tuple((t, n) for t, n in zip(call.outputs, names) if t >= 0 and n)
            unit = Unit(
                "region",
                (call.op_id,),
                members,
                tuple(call.inputs),
                outputs,
                call,
                graph,
                _replaces(part, names),
                forward_call=forwards.get(call.forward),
            )
            out.units.append(unit)
            out.members |= members
            out.by_judged[call.op_id] = unit
        else:
            out.graph_mode = True
            if part is None:
                continue
            grouped: set[int] = set()
            for unit in _decompositions(call, graph, part, outputs_of, inputs_of):
                out.units.append(unit)
                out.members |= unit.members
                grouped |= unit.members
                for op_id in unit.judged:
                    out.by_judged[op_id] = unit
            for n in part.nodes:
                ops_of_node = [o for o in call.nodes.get(n.name, ()) if kinds.get(o) != "source"]
                if n.op in ("placeholder", "output", "getitem") or not ops_of_node or set(ops_of_node) & grouped:
                    continue
                out.node_ops.append((ops_of_node[-1], n, call))
                out.members |= set(ops_of_node)
        anchor = (
            call.op_id if call.mode == "boundary" else min((o for ops in call.nodes.values() for o in ops), default=-1)
        )
        if anchor in outputs_of:
            out.calls.append((call, graph, anchor))
    return out


def _output_names(part: GraphPart | None, call: RegionCall) -> list[str]:
    """The FX node whose value each of the call's outputs is ("" where unknown)."""
    if part is None or part.output is None:
        return [""] * len(call.outputs)
    entries = list(part.output.inputs)
    start = len(part.mutated) if call.part != "backward" else 0
    names = entries[start : start + len(call.outputs)]
    return names + [""] * (len(call.outputs) - len(names))


def _replaces(part: GraphPart | None, names: list[str]) -> str:
    if part is None:
        return "graph unknown"
    computing = [n for n in part.nodes if n.op not in ("placeholder", "output", "getitem")]
    modules = sorted({n.module for n in computing if n.module})
    return (
        f"{len(computing)} nodes in {', '.join(modules[:3])}{' ...' if len(modules) > 3 else ''}"
        if modules
        else (f"{len(computing)} nodes")
    )


def _decompositions(
    call: RegionCall,
    graph: CompiledGraph,
    part: GraphPart,
    outputs_of: Mapping[int, list[int]],
    inputs_of: Mapping[int, list[int]],
) -> list[Unit]:
    """Graph mode: the nodes each eager op was decomposed into, as units judged at their exits."""
    index = _PartIndex(part)
    by_name = index.by_name
    groups: dict[tuple[str, str, int], list[GraphNode]] = defaultdict(list)
    for n in part.nodes:
        if n.original and n.original != n.op and n.op not in ("placeholder", "output"):
            groups[index.group(n)].append(n)
    units = []
    for (module, original, _), nodes in groups.items():
        names = {n.name for n in nodes}
        members = frozenset(o for n in nodes for o in call.nodes.get(n.name, ()))
        if not members:
            continue
        made = {t for o in members for t in outputs_of.get(o, [])}
        inputs = tuple(dict.fromkeys(t for o in sorted(members) for t in inputs_of.get(o, []) if t not in made))
        outputs: list[tuple[int, str]] = []
        judged: list[int] = []
        for n in nodes:
            if not {u.name for u in index.users[n.name]} - names:
                continue  # used only inside the group
            found = _value_of(n, call, by_name, outputs_of)
            if found is None:
                continue
            op_id, tensor = found
            outputs.append((tensor, n.name))
            if op_id not in judged:
                judged.append(op_id)
        if judged:
            units.append(
                Unit(
                    "decomposition",
                    tuple(judged),
                    members,
                    inputs,
                    tuple(outputs),
                    call,
                    graph,
                    f"{original} in {module or '<top>'}",
                )
            )
    return units


def _value_of(
    node: GraphNode, call: RegionCall, by_name: Mapping[str, GraphNode], outputs_of: Mapping[int, list[int]]
) -> tuple[int, int] | None:
    """(op id, tensor id) of the value a graph-mode node computed: its op's output, or a getitem's pick."""
    index = 0
    if node.op == "getitem":
        index = json.loads(node.args).get("index", 0)
        node = by_name.get(node.inputs[0]) if node.inputs else None
        if node is None:
            return None
    ops = call.nodes.get(node.name, ())
    for op_id in reversed(ops):
        outs = outputs_of.get(op_id, [])
        if len(outs) > index:
            return op_id, outs[index]
    return None


class _PartIndex:
    """What pairing reads of one graph part: its nodes by name, each value's users, and the
    eager op each node was made for (:meth:`group`)."""

    def __init__(self, part: GraphPart) -> None:
        self.by_name = {n.name: n for n in part.nodes}
        self.users: dict[str, list[GraphNode]] = defaultdict(list)
        for n in part.nodes:
            for i in dict.fromkeys(n.inputs):
                self.users[i].append(n)
        # A pass that rewrites nodes inside an eager op's decomposition (inductor's stable softmax:
        # ``x - amax(x)`` becomes a ``where`` carrying the replaced node's metadata) leaves its
        # nodes without a sequence number; one feeding a node of the same module and eager op
        # belongs to that op's group: an inside value, not the op's output.
        self._seq: dict[str, int] = {}
        for n in reversed(part.nodes):  # users come after the nodes they read
            seq = n.seq_nr
            if seq < 0:
                op = (n.module, n.original or n.op)
                seq = next(
                    (
                        self._seq[u.name]
                        for u in self.users[n.name]
                        if self._seq[u.name] >= 0 and (u.module, u.original or u.op) == op
                    ),
                    -1,
                )
            self._seq[n.name] = seq
        self._leaves: dict[str, bool] = {}

    def group(self, node: GraphNode) -> tuple[str, str, int]:
        """(module, eager op, autograd sequence number) of the eager op ``node`` was made for."""
        return node.module, node.original or node.op, self._seq.get(node.name, node.seq_nr)

    def leaves_group(self, node: GraphNode) -> bool:
        """Whether the node's value is used outside the nodes its eager op was decomposed into
        (only such values have an eager counterpart: a layer norm's output, not its variance plus
        eps). A getitem is the value it takes: its users count."""
        if node.name not in self._leaves:
            group = self.group(node)
            self._leaves[node.name] = any(
                self.leaves_group(u) if u.op == "getitem" else (u.op == "output" or self.group(u) != group)
                for u in self.users[node.name]
            )
        return self._leaves[node.name]

    def output_index(self, name: str, group: tuple[str, str, int]) -> int | None:
        """Which output of ``group``'s eager op the value ``name`` is, where the graph says so:
        the index of the getitem that takes it from a node computing that very op (unbind's q, k
        and v; split's parts), found up through views and the op's other nodes (a value a pass
        scaled). None when no getitem, or getitems of several outputs, lead there."""
        found: set[int] = set()
        todo, seen = [name], {name}
        while todo:
            node = self.by_name.get(todo.pop())
            if node is None:
                continue
            if node.op == "getitem":
                source = self.by_name.get(node.inputs[0]) if node.inputs else None
                if source is not None and source.op == group[1] and self.group(source) == group:
                    found.add(int(json.loads(node.args).get("index", 0)))
                    continue
            elif self.group(node) != group and not _same_values(node):
                continue
            for i in node.inputs:
                if i not in seen:
                    seen.add(i)
                    todo.append(i)
        return found.pop() if len(found) == 1 else None


# ---------------------------------------------------------------------------------------------
# Pairing with the bench


class Pairing:
    """Finds the bench tensor a unit's node value stands for (see :func:`unit_partners`)."""

    def __init__(
        self,
        units: CompiledUnits,
        t_ops: pd.DataFrame,
        t_ten: pd.DataFrame,
        b_ops: pd.DataFrame,
        b_ten: pd.DataFrame,
        b_base: Mapping[int, int],
    ) -> None:
        self.t_shape = dict(zip(t_ten["tensor_id"].tolist(), (tuple(s) for s in t_ten["shape"].tolist())))
        self.b_shape = dict(zip(b_ten["tensor_id"].tolist(), (tuple(s) for s in b_ten["shape"].tolist())))
        self.step_of = dict(zip(t_ops["op_id"].tolist(), t_ops["step"].tolist()))
        self.phase_of = dict(zip(t_ops["op_id"].tolist(), t_ops["phase"].tolist()))
        self.b_base = b_base
        self.t_outputs = dict(zip(t_ops["op_id"].tolist(), (list(o) for o in t_ops["outputs"].tolist())))
        self.b_stats = _stats(b_ten)
        self.t_stats = _stats(t_ten)
        self.b_outputs = dict(zip(b_ops["op_id"].tolist(), (list(o) for o in b_ops["outputs"].tolist())))
        self.b_op = dict(zip(b_ops["op_id"].tolist(), b_ops["op"].tolist()))
        self.b_args = dict(zip(b_ops["op_id"].tolist(), b_ops["args"].tolist()))
        self.t_args = dict(zip(t_ops["op_id"].tolist(), t_ops["args"].tolist()))
        self.b_inputs = dict(zip(b_ops["op_id"].tolist(), (list(i) for i in b_ops["inputs"].tolist())))
        self.b_sources = set(b_ops.loc[b_ops["kind"] == "source", "op_id"].tolist())
        self.b_kind = dict(zip(b_ops["op_id"].tolist(), b_ops["kind"].tolist()))
        self.b_scope = dict(
            zip(b_ops["op_id"].tolist(), zip(b_ops["step"].tolist(), b_ops["phase"].tolist(), b_ops["module"].tolist()))
        )
        self.bench = _bench_groups(b_ops)
        self.anchor = {(call.first_op, call.part): anchor for call, _, anchor in units.calls}
        self._parts = {
            (call.first_op, call.part): graph.parts[call.part]
            for call, graph, _ in units.calls
            if call.part in graph.parts
        }
        self._indexes: dict[tuple[int, str], _PartIndex] = {}
        self.ordinals = _ordinals(units, t_ops, self.step_of, self.phase_of, self.index)

    def index(self, call: RegionCall) -> _PartIndex | None:
        """The index of the graph part ``call`` ran (None when the trace has no such part)."""
        key = (call.first_op, call.part)
        if key not in self._indexes:
            part = self._parts.get(key)
            if part is None:
                return None
            self._indexes[key] = _PartIndex(part)
        return self._indexes[key]

    def bench_tensor(
        self,
        unit: Unit,
        name: str,
        shape: tuple[int, ...],
        peers: list[tuple[str, tuple[int, ...], int | None]],
        tensor: int | None = None,
    ) -> int | None:
        """The bench tensor of node ``name``'s value (of ``shape``, the target's ``tensor`` when it
        has one), a view as the eager op made it (see :meth:`measured_as`); ``peers`` are the
        (node, shape, tensor) values of the unit being paired, which decide which of an eager op's
        same-shaped outputs is whose where the graph does not say."""
        index = self.index(unit.call)
        if index is None:
            return None
        node, same = self._stands_for(unit, index, name, shape)
        if node is None or not same:
            return None
        group = index.group(node)
        if len(same) > 1:
            # Several outputs of one shape: where a getitem of the eager op itself leads to the
            # value (q, k and v of an unbind, through views and what a pass did to them), its
            # index says which.
            at = index.output_index(name, group)
            picked = self._output_at(unit.call, node, at) if at is not None else None
            if picked in same:
                return picked
        # The unit's values that stand for this group's outputs of this shape.
        fellows: dict[str, int | None] = {}
        for other, other_shape, other_tensor in [*peers, (name, shape, tensor)]:
            if other_shape != shape or other in fellows:
                continue
            candidate, _ = self._stands_for(unit, index, other, shape)
            if candidate is not None and index.group(candidate) == group:
                fellows[other] = other_tensor
        if len(same) == 1 and len(fellows) == 1:
            chosen = same[0]
        else:
            # Several outputs of one shape (a layer norm's mean and 1/std, its weight and bias
            # gradients), which a decomposition makes in any order and may keep more values of
            # (the normalized input it saves): values pair with the outputs nearest to them, both
            # ways, or not at all.
            chosen = self._nearest(tensor, same, fellows)
        return chosen

    def measured_as(self, bench: int) -> int | None:
        """The bench tensor whose statistics are ``bench``'s: itself, or the base it is a view of
        when it holds all of the base's elements (a reshape or permute of it); None for a view of
        part of its base (unbind's q: the base's statistics are those of q, k and v together)."""
        base = self.b_base.get(bench)
        if base is None:
            return bench
        return base if math.prod(self.b_shape.get(bench, (-1,))) == math.prod(self.b_shape.get(base, ())) else None

    def _stands_for(
        self, unit: Unit, index: _PartIndex, name: str, shape: tuple[int, ...]
    ) -> tuple[GraphNode | None, list[int]]:
        """The node whose eager op a value stands for (itself, or through views and getitems the
        node that computed it) and that op's bench outputs of ``shape``."""
        node = index.by_name.get(name)
        found = self._group_outputs(unit, node, shape)
        if not found:
            node = _producer(index.by_name, name)
            found = self._group_outputs(unit, node, shape)
            if not found:  # a reshape of what it computed: the same elements, as its statistics are
                size = math.prod(shape)
                found = [
                    b
                    for op in self._group(unit.call, node)
                    for b in self.b_outputs.get(op, [])
                    if math.prod(self.b_shape.get(b, (-1,))) == size
                ]
        return node, found

    def _group_outputs(self, unit: Unit, node: GraphNode | None, shape: tuple[int, ...]) -> list[int]:
        """The outputs of ``shape`` of the bench ops that ``node``'s group stands for."""
        group = self._group(unit.call, node)
        return [b for op in group for b in self.b_outputs.get(op, []) if self.b_shape.get(b) == shape]

    def _group(self, call: RegionCall, node: GraphNode | None) -> list[int]:
        """The bench ops of the eager op (and its autograd group) that ``node`` stands for."""
        if node is None or node.op in ("placeholder", "output", "getitem") or node.recomputed:
            return []
        anchor = self.anchor.get((call.first_op, call.part))
        index = self.index(call)
        module, op, seq = (
            index.group(node) if index is not None else (node.module, node.original or node.op, node.seq_nr)
        )
        key = (self.step_of.get(anchor), self.phase_of.get(anchor), module, op)
        ordinal = self.ordinals.get((call.first_op, call.part, module, op, seq))
        groups = self.bench.get(key, [])
        return groups[ordinal] if ordinal is not None and ordinal < len(groups) else []

    def _output_at(self, call: RegionCall, node: GraphNode, at: int) -> int | None:
        """Output ``at`` of the bench op, among those ``node`` stands for, that is its eager op."""
        eager = node.original or node.op
        for op in self._group(call, node):
            outputs = self.b_outputs.get(op, [])
            if self.b_op.get(op) == eager and at < len(outputs):
                return outputs[at]
        return None

    def pair_ops(self, units: CompiledUnits) -> dict[int, int]:
        """``{target op id: bench op id}`` for graph-mode nodes that are eager ops of their own: the
        op of their name in their group whose outputs have their shapes, in order."""
        pairs: dict[int, int] = {}
        used: set[int] = set()
        for op_id, node, call in units.node_ops:
            shapes = [self.t_shape.get(t) for t in self.t_outputs.get(op_id, [])]
            fits = [
                b
                for b in self._group(call, node)
                if b not in used
                and self.b_op.get(b) == node.op
                and [self.b_shape.get(t) for t in self.b_outputs.get(b, [])] == shapes
            ]
            # Of several (a backward's muls of one shape), the one called with the same arguments.
            same_args = [b for b in fits if self.b_args.get(b) == self.t_args.get(op_id)]
            chosen = (same_args or fits or [None])[0]
            if chosen is not None:
                pairs[op_id] = chosen
                used.add(chosen)
        return pairs

    def covered_bench(self, units: CompiledUnits, b_base: Mapping[int, int], paired: set[int]) -> set[int]:
        """Bench op ids the units stand for (every node of a region; a decomposition's nodes, see
        below): none of them is left unpaired by a compiled target. ``paired``: bench ops the
        alignment paired, which stay outside."""
        covered: set[int] = set()
        grouped = {
            (u.call.first_op, u.call.part, n)
            for u in units.units
            if u.kind == "decomposition"
            for n in _member_nodes(u)
        }
        region_scopes: set[tuple[Any, ...]] = set()
        for call, graph, anchor in units.calls:
            part = graph.parts.get(call.part)
            if part is None:
                continue
            for n in part.nodes:
                if call.mode == "boundary" or (call.first_op, call.part, n.name) in grouped:
                    covered.update(self._group(call, n))
                if call.mode == "boundary" and n.op not in ("placeholder", "output"):
                    region_scopes.add((self.step_of.get(anchor), self.phase_of.get(anchor), n.module))
        # A region runs its modules whole: their unpaired eager ops are its (the matmuls a fused
        # attention kernel replaced).
        covered |= {
            op
            for op, scope in self.b_scope.items()
            if scope in region_scopes and op not in paired and op not in self.b_sources
        }
        # Then the unpaired eager ops that read nothing but their values (the views a matmul makes,
        # the autograd engine's sums of the gradients a region's ops return), and the views only
        # they read (of the token ids, say).
        consumers: dict[int, set[int]] = defaultdict(set)
        for op, ins in self.b_inputs.items():
            for t in ins:
                consumers[t].add(op)
        for _ in range(8):
            made = {b_base.get(b, b) for op in covered for b in self.b_outputs.get(op, [])}
            grown = {
                op
                for op, ins in self.b_inputs.items()
                if op not in covered
                and op not in paired
                and op not in self.b_sources
                and ins
                and all(b_base.get(t, t) in made for t in ins)
            }
            grown |= {
                op
                for op, outs in self.b_outputs.items()
                if op not in covered
                and op not in paired
                and self.b_kind.get(op) == "view"
                and outs
                and all(consumers.get(t) and consumers[t] <= covered for t in outs)
            }
            if not grown:
                break
            covered |= grown
        return covered

    def _nearest(self, tensor: int | None, same: list[int], fellows: dict[str, int | None]) -> int | None:
        if tensor is None or not same or any(t is None for t in fellows.values()):
            return None
        mine = self.t_stats.get(tensor)
        best = min(same, key=lambda b: _distance(mine, self.b_stats.get(b)))
        rival = min(fellows.values(), key=lambda t: _distance(self.t_stats.get(t), self.b_stats.get(best)))  # type: ignore[arg-type]
        return best if rival == tensor and math.isfinite(_distance(mine, self.b_stats.get(best))) else None


def unit_partners(
    units: CompiledUnits,
    t_ops: pd.DataFrame,
    t_ten: pd.DataFrame,
    b_ops: pd.DataFrame,
    b_ten: pd.DataFrame,
    b_base: Mapping[int, int],
) -> dict[int, int]:
    """``{target tensor id: bench tensor id}`` for the units' outputs, from node metadata.

    The bench candidates of a node are the outputs of the bench ops named after the eager op the
    node came from, in its module, step and phase, grouped by autograd sequence number; the
    node's group is the same-numbered group counted in order (its n-th ``aten.add`` group in
    ``blocks.0``, eager ops of the target and earlier regions counted too), then the output of
    its shape.
    """
    if not units:
        return {}
    return pair_units(Pairing(units, t_ops, t_ten, b_ops, b_ten, b_base), units)


def pair_units(pairing: Pairing, units: CompiledUnits) -> dict[int, int]:
    """:func:`unit_partners` with a pairing already made."""
    partner: dict[int, int] = {}
    for unit in units.units:
        peers = [(name, pairing.t_shape.get(t, ()), t) for t, name in unit.outputs]
        for tensor, name in unit.outputs:
            shape = pairing.t_shape.get(tensor)
            if shape is None:
                continue
            found = pairing.bench_tensor(unit, name, shape, peers, tensor)
            measured = pairing.measured_as(found) if found is not None else None
            if measured is not None:
                partner[tensor] = measured
    return partner


def _member_nodes(unit: Unit) -> set[str]:
    """Names of the graph nodes whose ops a decomposition unit covers."""
    return {name for name, ops in unit.call.nodes.items() if set(ops) & unit.members}


def covered_by_units(ri: Any, verdicts: dict[tuple[int, int], Any]) -> None:
    """The ops inside a unit that no rule judged on their own take the unit's status: they were
    compared as part of it, not left unpaired."""
    seen: set[int] = set()
    for unit in ri.units.values():
        if id(unit) in seen:
            continue
        seen.add(id(unit))
        status = verdicts[(ri.rank, unit.judged[0])].status
        for member in unit.members:
            verdict = verdicts.get((ri.rank, member))
            if (
                verdict is not None
                and member not in ri.pairs
                and member not in ri.units
                and verdict.status == "unpaired"
            ):
                verdict.status = status


def _stats(tensors: pd.DataFrame) -> dict[int, tuple[float, float, float, float]]:
    """``{tensor id: (min, max, mean, norm)}`` of the tensors that carry statistics."""
    return {
        t: (lo, hi, mean, norm)
        for t, lo, hi, mean, norm, has in zip(
            tensors["tensor_id"].tolist(),
            tensors["min"].tolist(),
            tensors["max"].tolist(),
            tensors["mean"].tolist(),
            tensors["norm"].tolist(),
            tensors["has_stats"].tolist(),
        )
        if has
    }


def _distance(a: tuple[float, ...] | None, b: tuple[float, ...] | None) -> float:
    if a is None or b is None:
        return math.inf
    scale = max(max(abs(x) for x in (*a, *b)), 1e-300)
    return sum(abs(x - y) for x, y in zip(a, b)) / scale


def _producer(by_name: Mapping[str, GraphNode], name: str) -> GraphNode | None:
    """The node whose eager op made a value: through getitems and views to the computing node."""
    node = by_name.get(name)
    for _ in range(16):
        if node is None or not (node.op == "getitem" or _same_values(node)):
            return node
        if not node.inputs or node.inputs[0] not in by_name:
            return node
        node = by_name[node.inputs[0]]
    return node


def _same_values(node: GraphNode) -> bool:
    """Whether the node rearranges or copies a value as an eager op of its own (not as a step of
    another op's decomposition): its value stands for what the op it reads computed."""
    return node.op.startswith(_SAME_VALUES) and node.original in ("", node.op)


def _bench_groups(b_ops: pd.DataFrame) -> dict[tuple, list[list[int]]]:
    """``(step, phase, module, op) -> [op ids of each autograd-numbered group, in order]``."""
    groups: dict[tuple, list[list[int]]] = defaultdict(list)
    last: dict[tuple, int] = {}
    for op_id, step, phase, module, op, seq, kind in zip(
        b_ops["op_id"].tolist(),
        b_ops["step"].tolist(),
        b_ops["phase"].tolist(),
        b_ops["module"].tolist(),
        b_ops["op"].tolist(),
        b_ops["seq_nr"].tolist(),
        b_ops["kind"].tolist(),
    ):
        if kind == "source":
            continue
        key = (step, phase, module, op)
        if seq >= 0 and last.get(key) == seq and groups[key]:
            groups[key][-1].append(op_id)
        else:
            groups[key].append([op_id])
        last[key] = seq
    return groups


def _ordinals(
    units: CompiledUnits,
    t_ops: pd.DataFrame,
    step_of: Mapping[int, int],
    phase_of: Mapping[int, str],
    index_of: Callable[[RegionCall], _PartIndex | None],
) -> dict[tuple, int]:
    """Per (call, part, module, op, seq) node group: how many groups of that module and op came
    before it in its step and phase, counting the target's own eager ops and earlier calls' groups."""
    events: dict[tuple, list[tuple[int, int, tuple]]] = defaultdict(list)
    covered = units.members | set(units.by_judged)
    for op_id, step, phase, module, op, kind in zip(
        t_ops["op_id"].tolist(),
        t_ops["step"].tolist(),
        t_ops["phase"].tolist(),
        t_ops["module"].tolist(),
        t_ops["op"].tolist(),
        t_ops["kind"].tolist(),
    ):
        if kind != "source" and op_id not in covered:
            events[(step, phase, module, op)].append((op_id, 0, ()))
    for call, graph, anchor in units.calls:
        part, index = graph.parts.get(call.part), index_of(call)
        if part is None or index is None:
            continue
        step, phase = step_of.get(anchor), phase_of.get(anchor)
        seen: set[tuple] = set()
        for position, n in enumerate(part.nodes):
            if n.op in ("placeholder", "output", "getitem") or n.recomputed:
                continue
            group = index.group(n)
            if group in seen:
                continue
            seen.add(group)
            if call.mode == "graph" and not call.nodes.get(n.name):
                continue
            if call.part == "backward":
                # The autograd engine runs the eager backward by decreasing sequence number (the
                # forward ops' order, reversed); a backward graph is ordered as its partitioner
                # pleased. Both follow the forward's numbering.
                at = (call.first_op, -group[2])
            elif call.mode == "graph":
                at = (min(call.nodes[n.name]), 0)  # where its first op lies among the target's ops
            else:
                at = (call.first_op, position)  # a region's nodes all lie at the region, in graph order
            events[(step, phase, group[0], group[1])].append((*at, (call.first_op, call.part, *group)))
    ordinals: dict[tuple, int] = {}
    for items in events.values():
        for index, (_, _, key) in enumerate(sorted(items, key=lambda e: (e[0], e[1]))):
            if key:
                ordinals[key] = index
    return ordinals


# ---------------------------------------------------------------------------------------------
# Judging with a replay, and narrowing

_MISSING = object()


def judge_units(
    units: CompiledUnits,
    t_rank: RankTrace,
    b_rank: RankTrace,
    pairing: Pairing,
    measured: Mapping[int, Any],
    own_errors: Mapping[int, Any],
    tol: Tolerances,
) -> None:
    """Measure each unit's own rounding (the target holds tensors).

    A region's graph runs again from its recorded inputs: its own error against the float64
    replay, the error an eager replay in the recorded dtypes makes, and the first FX node where its
    values depart from the eager ones (:func:`_narrow`). A decomposition's rounding is the sum of
    what honest kernels make in its ops (``own_errors``: :func:`tracecmp.numerics.replay.replay_rank`).
    """
    from tracecmp.numerics.replay import Replayer

    for unit in units.units:
        if unit.kind == "decomposition":
            honest = [own_errors[o].honest for o in unit.members if o in own_errors]
            if honest and len(honest) == len([o for o in unit.members if o in own_errors or o in unit.judged]):
                unit.rounding = sum(honest)
    regions = [u for u in units.units if u.kind == "region"]
    if not regions:
        return
    # Recorded values by tensor id, views rebuilt from their base, read as replay reads them.
    with Replayer(t_rank) as t_side, Replayer(b_rank) as b_side:
        if not t_side.has_data:
            return
        t_get = t_side.value
        b_get = b_side.value if b_side.has_data else None
        for unit in regions:
            try:
                _judge_region(unit, t_get, b_get, pairing, measured, tol)
            except Exception as exc:  # noqa: BLE001 - a graph this torch cannot run again is not replayed
                unit.own = None
                units.warnings.append(
                    f"compiled region {unit.graph.id} at op {unit.judged[0]} not replayed ({type(exc).__name__}: {exc})"
                )


def _judge_region(
    unit: Unit,
    t_get: Callable[[int], Any],
    b_get: Callable[[int], Any] | None,
    pairing: Pairing,
    measured: Mapping[int, Any],
    tol: Tolerances,
) -> None:
    from tracecmp.numerics.replay.measure import Scale

    part = unit.graph.parts.get(unit.call.part)
    outside = _region_inputs(unit, part, t_get, pairing) if part is not None else None
    if part is None or outside is None:
        return
    recorded = _recorded_by_node(unit.call, t_get, pairing)
    ref, honest = run_part(part, outside, recorded, golden=True), run_part(part, outside, recorded, golden=False)
    worst: tuple[float, float] | None = None
    for tensor, name in unit.outputs:
        recorded, r, h = t_get(tensor), _tensor(ref.get(name)), _tensor(honest.get(name))
        if recorded is None or r is None or h is None or r.shape != recorded.shape or not recorded.is_floating_point():
            continue
        scale = Scale.of(r)
        pair = (scale.error(recorded), scale.error(h))
        if worst is None or _excess(pair) > _excess(worst):
            worst = pair
    unit.own = worst
    if isinstance(outside, _BackwardInputs) and unit.forward_call is not None:
        # The values the forward saved depart first, if any node of the forward does.
        forward_unit = replace(unit, call=unit.forward_call, judged=(unit.forward_call.op_id,), outputs=())
        found = _narrow(
            forward_unit,
            outside.forward_part,
            outside.forward(True),
            outside.forward(False),
            t_get,
            b_get,
            pairing,
            measured,
            tol,
        )
        if found:
            unit.narrowed = f"what its forward saved departs first: {found}"
            return
    unit.narrowed = _narrow(unit, part, ref, honest, t_get, b_get, pairing, measured, tol)


def _region_inputs(
    unit: Unit, part: GraphPart, t_get: Callable[[int], Any], pairing: Pairing
) -> Callable[[str, bool], Any] | None:
    """The recorded value of each placeholder of a region's graph part (a backward part's saved
    values come from replaying its forward the same way), or None when the call's inputs do not
    line up with the graph's."""
    call = unit.call
    placeholders = [n.name for n in part.placeholders]
    if call.part != "backward":
        if len(placeholders) != len(call.inputs):
            return None
        inputs = dict(zip(placeholders, call.inputs))
        return lambda name, golden: t_get(inputs[name]) if name in inputs else None
    forward = unit.graph.parts.get("forward")
    if forward is None:
        return None
    fw_recorded = _recorded_by_node(unit.forward_call, t_get, pairing) if unit.forward_call is not None else {}
    fw_names = [n.name for n in forward.placeholders]
    tangents = [n for n in placeholders if n.startswith("tangents")]
    grads = list(call.inputs[len(fw_names) :])
    if len(tangents) != len(grads) or len(call.inputs) < len(fw_names):
        return None
    fw_inputs = dict(zip(fw_names, call.inputs[: len(fw_names)]))
    return _BackwardInputs(forward, fw_inputs, dict(zip(tangents, grads)), fw_recorded, t_get)


class _BackwardInputs:
    """A backward part's placeholders: the gradients it received, and what its forward saved,
    computed by replaying the forward from its recorded inputs (in the same precision)."""

    def __init__(
        self,
        forward: GraphPart,
        fw_inputs: dict[str, int],
        tangents: dict[str, int],
        fw_recorded: Mapping[str, Any],
        t_get: Callable[[int], Any],
    ) -> None:
        self.forward_part, self.fw_inputs, self.tangents = forward, fw_inputs, tangents
        self.fw_recorded, self.t_get = fw_recorded, t_get
        self._values: dict[bool, dict[str, Any]] = {}

    def forward(self, golden: bool) -> dict[str, Any]:
        if golden not in self._values:
            inputs, get = self.fw_inputs, self.t_get
            self._values[golden] = run_part(
                self.forward_part, lambda n, g: get(inputs[n]) if n in inputs else None, self.fw_recorded, golden=golden
            )
        return self._values[golden]

    def __call__(self, name: str, golden: bool) -> Any:
        if name in self.tangents:
            return self.t_get(self.tangents[name])
        return self.forward(golden).get(name)


def run_part(
    part: GraphPart, outside: Callable[[str, bool], Any], recorded: Mapping[str, Any], *, golden: bool
) -> dict[str, Any]:
    """Every node of ``part`` run again: in float64 (``golden``), or in the recorded dtypes with
    eager kernels. Placeholders take ``outside(name, golden)``. A node that cannot run here (a
    custom op whose library is not loaded, a random op) takes what the compiled code recorded for
    it, when it recorded something; else it, and everything after it that needs it, is missing."""
    import torch

    from tracecmp.aten.args import decode_call
    from tracecmp.aten.schema import op_info, resolve

    env: dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in env:
            value = outside(name, golden)
            if isinstance(value, torch.Tensor):
                env[name] = value.to(torch.float64) if golden and value.is_floating_point() else value.clone()
            elif isinstance(value, (int, float)):  # a size the forward saved for a backward of dynamic shape
                env[name] = value
            else:
                env[name] = _MISSING
        return env[name]

    for n in part.nodes:
        if n.op in ("placeholder", "output"):
            continue
        inputs = [get(i) for i in n.inputs]
        if any(v is _MISSING for v in inputs):
            env[n.name] = _MISSING
            continue
        if n.op == "getitem":
            index = json.loads(n.args).get("index", 0)
            source = inputs[0] if inputs else _MISSING
            env[n.name] = source[index] if isinstance(source, (list, tuple)) and index < len(source) else _MISSING
            continue
        func = resolve(n.op)
        call = None
        if func is not None and hasattr(func, "_schema"):
            arguments = _with_sizes(json.loads(n.args), get)
            info = op_info(func)
            # A random op draws other numbers here, unless all it could draw is a dropout of 0
            # (attention kernels: random by schema, deterministic at dropout_p=0).
            if arguments is not None and (
                not info.random or (info.dropout and all(not arguments.get(name, 0.0) for (_, name), _ in info.dropout))
            ):
                call = decode_call(func, arguments, inputs, golden=golden)
        result = _MISSING
        if call is not None:
            try:
                with torch.no_grad():
                    result = func(*call[0], **call[1])
            except Exception:  # noqa: BLE001 - a node that will not run here is not replayed
                result = _MISSING
        if result is _MISSING and isinstance(recorded.get(n.name), torch.Tensor):
            value = recorded[n.name]
            result = value.to(torch.float64) if golden and value.is_floating_point() else value.clone()
        env[n.name] = result
    return env


def _with_sizes(value: Any, size_of: Callable[[str], Any]) -> Any:
    """Recorded arguments with the symbolic sizes capture named (``"<node sym_size_int>"``) set to
    the values those nodes (or the placeholders a backward reads them from) took in this replay,
    as ``size_of(name)`` gives them; None when one is unknown."""
    if isinstance(value, str) and value.startswith("<node ") and value.endswith(">"):
        size = size_of(value[6:-1])
        return size if isinstance(size, (int, float)) and not isinstance(size, bool) else None
    if isinstance(value, list):
        items = [_with_sizes(v, size_of) for v in value]
        return None if any(i is None and v is not None for i, v in zip(items, value)) else items
    if isinstance(value, dict):
        if "tensor" in value or "complex" in value:
            return value
        items = {k: _with_sizes(v, size_of) for k, v in value.items()}
        return None if any(items[k] is None and value[k] is not None for k in value) else items
    return value


def _tensor(value: Any) -> Any:
    import torch

    return value if isinstance(value, torch.Tensor) else None


def _excess(pair: tuple[float, float]) -> float:
    own, honest = pair
    return own / honest if honest > 0 else (math.inf if own > 0 else 0.0)


def _narrow(
    unit: Unit,
    part: GraphPart,
    ref: Mapping[str, Any],
    honest: Mapping[str, Any],
    t_get: Callable[[int], Any],
    b_get: Callable[[int], Any] | None,
    pairing: Pairing,
    measured: Mapping[int, Any],
    tol: Tolerances,
) -> str:
    """The first FX node (graph order) where the region departs from what it should compute.

    Two ways to depart: the graph's own float64 value of the node differs from the bench's value
    of the eager op it stands for (the graph computes something else: a custom op, a pass that
    changed a node), or what the compiled code dispatched for the node (an extern kernel) differs
    from that float64 value by more than eager kernels do (a wrong kernel).
    """
    from tracecmp.numerics.replay.measure import Scale

    carried = max((measured[t].level for t in unit.inputs if t in measured and measured[t].is_float), default=0.0)
    index = pairing.index(unit.call)
    if index is None:
        return ""
    computing = [n for n in part.nodes if n.op not in ("placeholder", "output", "getitem") and index.leaves_group(n)]
    peers = [
        (n.name, tuple(_tensor(ref.get(n.name)).shape), None) for n in computing if _tensor(ref.get(n.name)) is not None
    ]
    wrong = _wrong_kernels(part, ref, honest, _recorded_by_node(unit.call, t_get, pairing), tol)
    by_name = index.by_name
    agreeing: set[str] = set()  # nodes whose value matched the bench's
    unmatched: set[str] = set()  # computing nodes with no eager counterpart (a custom op, a fused pattern)
    for n in computing:
        r, h = _tensor(ref.get(n.name)), _tensor(honest.get(n.name))
        if r is None or h is None or not r.is_floating_point() or _is_view(n.op):
            continue
        scale = Scale.of(r)
        honest_error = scale.error(h)
        unit_eps = EPS.get(canonical_dtype(str(h.dtype).removeprefix("torch.")), FP32_EPS)
        if n.name in wrong:
            return (
                f"narrowed to {_where(n)}: what the compiled code computed for it is off by {wrong[n.name]:.1e} "
                f"from a float64 replay of the region's inputs ({honest_error:.1e} for eager kernels)"
            )
        bench = pairing.bench_tensor(unit, n.name, tuple(r.shape), peers)
        if bench is None:
            unmatched.add(n.name)
            continue
        departure = _departure(r, bench, b_get, pairing)
        if departure is None:
            continue
        bound = tol.margin * (carried * _PROPAGATION + honest_error) + tol.local * unit_eps
        if departure <= bound:
            agreeing.add(n.name)
            continue
        cause = _unmatched_cause(n, by_name, unmatched, agreeing)
        eager = n.original or n.op
        if cause is not None:
            return (
                f"narrowed to {_where(cause)}, which has no eager counterpart: the values it feeds ({n.name}) "
                f"differ from the bench's {eager} by {departure:.1e} (eager rounding {honest_error:.1e})"
            )
        return (
            f"narrowed to {_where(n)}: the graph's own value there differs from the bench's {eager} by "
            f"{departure:.1e} (eager rounding {honest_error:.1e}): the graph computes something else from here"
        )
    return ""


def _wrong_kernels(
    part: GraphPart, ref: Mapping[str, Any], honest: Mapping[str, Any], recorded: Mapping[str, Any], tol: Tolerances
) -> dict[str, float]:
    """The nodes whose value the compiled code dispatched wrong (an extern kernel off by more than
    eager kernels are from a float64 replay), with the error of what was filed under them.

    Capture files a region's dispatched ops under its nodes in dispatch order, and inductor may run
    the extern kernels of one op in another order than its graph's (the four matmuls of an
    attention's backward): a value that departs from the node it was filed under but fits another
    departing node of the same op and shape is that node's, and neither is wrong. A node is wrong
    when no departing value of its op fits it.
    """
    from tracecmp.numerics.replay.measure import Scale

    def fits(value: Any, name: str) -> bool:
        r, h = _tensor(ref.get(name)), _tensor(honest.get(name))
        if r is None or h is None or value.shape != r.shape:
            return False
        unit_eps = EPS.get(canonical_dtype(str(h.dtype).removeprefix("torch.")), FP32_EPS)
        scale = Scale.of(r)
        return scale.error(value) <= max(tol.replay_margin * scale.error(h), tol.replay_local * unit_eps)

    departing: dict[str, list[str]] = defaultdict(list)  # op -> nodes whose filed value departs
    for n in part.nodes:
        value, r = _tensor(recorded.get(n.name)), _tensor(ref.get(n.name))
        if (
            value is not None
            and r is not None
            and r.is_floating_point()
            and value.shape == r.shape
            and not fits(value, n.name)
        ):
            departing[n.op].append(n.name)
    wrong: dict[str, float] = {}
    for names in departing.values():
        for name in names:
            if not any(fits(recorded[other], name) for other in names if other != name):
                wrong[name] = Scale.of(ref[name]).error(recorded[name])
    return wrong


def _is_view(op: str) -> bool:
    """Whether ``op`` returns views of its inputs (it computes nothing to compare)."""
    from tracecmp.aten.schema import VIEW, op_info, resolve

    func = resolve(op) if op.count(".") >= 2 else None
    if func is None or not hasattr(func, "_schema"):
        return False
    returns = op_info(func).returns
    return bool(returns) and all(kind == VIEW for kind, _ in returns)


def _where(n: GraphNode) -> str:
    return f"FX node {n.name} ({n.op}, {n.module or '<top>'}{', ' + n.location if n.location else ''})"


def _unmatched_cause(
    node: GraphNode, by_name: Mapping[str, GraphNode], unmatched: set[str], agreeing: set[str]
) -> GraphNode | None:
    """The earliest node without an eager counterpart between ``node`` and the values upstream of
    it that still agreed with the bench (views and getitems are looked through)."""
    order = {name: i for i, name in enumerate(by_name)}
    found: list[str] = []
    todo, seen = list(node.inputs), set(node.inputs)
    while todo:
        name = todo.pop()
        if name in agreeing or name not in by_name:
            continue
        if name in unmatched:
            found.append(name)
        other = by_name[name]
        if other.op == "placeholder":
            continue
        for i in other.inputs:
            if i not in seen:
                seen.add(i)
                todo.append(i)
    return by_name[min(found, key=order.__getitem__)] if found else None


def _recorded_by_node(call: RegionCall, t_get: Callable[[int], Any], pairing: Pairing) -> dict[str, Any]:
    """What the compiled code dispatched for a node (boundary mode), by node name: its last op's
    first output, read from the trace."""
    out: dict[str, Any] = {}
    for name, ops in call.nodes.items():
        outputs = pairing.t_outputs.get(ops[-1]) if ops else None
        if outputs:
            out[name] = t_get(outputs[0])
    return out


def _departure(ref: Any, bench_tensor: int, b_get: Callable[[int], Any] | None, pairing: Pairing) -> float | None:
    """How far the bench's value lies from the float64 reference ``ref`` (relative): from whole
    tensors when the bench has them, else from its statistics (lower bounds, as metrics.py's)."""
    from tracecmp.numerics.replay.measure import Scale

    if b_get is not None:
        value = b_get(bench_tensor)
        if value is not None and value.shape == ref.shape:
            return Scale.of(ref).error(value)
    measured = pairing.measured_as(bench_tensor)
    stats = pairing.b_stats.get(measured) if measured is not None else None
    if stats is None:
        return None
    lo, hi, mean, norm = stats
    r = ref.detach().to("cpu")
    if not bool(r.isfinite().all()) or r.numel() == 0:
        return None
    amax = max(float(r.abs().max()), abs(lo), abs(hi), 1e-300)
    n = r.numel()
    rms = max(float(r.norm()) / math.sqrt(n), abs(norm) / math.sqrt(n), 1e-300)
    ext = max(abs(float(r.max()) - hi), abs(float(r.min()) - lo)) / amax
    sys_ = max(abs(float(r.norm()) - norm) / math.sqrt(n), abs(float(r.mean()) - mean)) / rms
    return max(ext, sys_)
