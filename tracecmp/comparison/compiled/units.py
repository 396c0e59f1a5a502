"""What a compiled region of the target is in a comparison: a unit that replaces eager ops as a
whole, and how it is decided as one op.

A target captured with ``torch.compile`` holds *units* that have no op-for-op counterpart in an
eager bench (:mod:`tracecmp.trace.compiled` says what a trace records of them):

* a **region** (``compiled="boundary"``): one ``compiled.forward`` / ``compiled.backward`` node
  for a whole compiled graph part; the ops the compiled code dispatched inside it (inductor's
  extern kernels) are not the eager ops and are left out of the alignment;
* a **decomposition** (``compiled="graph"``): the FX nodes one eager op was decomposed into
  (``var_mean``, ``rsqrt``, ... for ``native_layer_norm``), recorded as ops of their own.

A unit is judged as one op (:class:`Unit.decide`, called by localize): it is a root when its
outputs differ from the bench by more than ``margin`` times what its inputs carry in plus its
own rounding: measured by a replay where the target holds tensors (:mod:`.judge`), else
``region_units`` rounding units of the output's dtype (``Tolerances``).

Until the alignment has fused regions of its own, :class:`Unit` is the minimal record of one here.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from tracecmp.comparison.tolerances import Tolerances
from tracecmp.graph.nodes import Node
from tracecmp.numerics.units import EPS, FP32_EPS, canonical_dtype
from tracecmp.trace.compiled import GRAPH_LABEL, CompiledGraph, GraphNode, GraphPart, RegionCall
from tracecmp.trace.reader import RankTrace

GRAPH_MODE_NOTE = (
    f'the target ran its compiled regions as {GRAPH_LABEL} (compiled="graph"): its numbers inside '
    "them are eager kernels', not the compiled code's"
)
PROPAGATION = 4.0  # how many times an input's error a region may pass on (localize's rule for unknown ops)
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


# FX node ops that draw from inductor's own seeds, which no eager run reproduces (a graph that
# draws with eager's ops, under aot_eager, takes the bench's stream and is judged as any other).
_DRAWING = ("prims.inductor_random", "prims.inductor_randint", "prims.inductor_seeds")


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
    narrowed_module: str = ""  # and that node's module: the root's, in the verdict
    departed: bool = False  # a node inside departed from the bench by its statistics (narrow_by_statistics)
    unfaithful: bool = False  # capture's shadow run of its graph computed otherwise than its compiled code

    def decide(
        self, node: Node, errors: tuple[float, float, float], ri: Any, tol: Tolerances, lookup: Callable[[int], Any]
    ) -> tuple[str, str, str]:
        """Root kind, reason and deciding metric of the unit (the judged op ``node``), for localize.

        ``errors`` are localize's errors of the output it looked at; the unit looks at all of them.
        """
        what = f"{self.kind} {self.replaces}" if self.kind == "decomposition" else f"compiled region {self.graph.id}"
        if self.departed and not self.draws():
            # Values recorded inside the region departed from the bench's beyond what flowed in: its
            # own evidence, whether or not each of its outputs has a bench partner.
            return "computation", f"the {what} ({self.replaces}) computes something else: {self.narrowed}", "region"
        states = [ri.measured[t] for t in node.outputs if t in ri.measured]
        measured = [e for s in states for e in (s.e_ext, s.e_sys, s.e_rms) if not math.isnan(e)]
        if not measured:
            return "", "", "region"
        err = max(measured)  # the worst output: a region's outputs are many values, not one
        ins = [lookup(t) for t in self.inputs]
        floats = [s for s in ins if s is not None and s.is_float and not s.uninit]
        if any(s is None or not s.known for s in ins if s is None or not s.uninit):
            return "", "", "region"  # an input of unknown error: nothing to blame on the unit
        carried = max((s.level for s in floats), default=0.0) * PROPAGATION
        dtype = self._dtype(node, ri)
        unit = EPS.get(canonical_dtype(dtype), FP32_EPS)
        floor = tol.local * unit
        if self.draws():
            # Inductor's code draws from seeds of its own, not eager's generator: its values are
            # other samples, and nothing inside can be judged against the bench's.
            if err <= tol.margin * (carried + tol.region_units * unit) + floor:
                return "", "", "region"
            return (
                "random",
                f"the {what} ({self.replaces}) draws random numbers (dropout) from its compiled code's own "
                f"generator, not eager's: its values are other samples, {err:.2e} apart; capture both runs with "
                "dropout=0.0 to compare what it computes",
                "region",
            )
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

    def draws(self) -> bool:
        """Whether the region's graph draws from inductor's own seeds: its own part, or for a
        backward region its forward's (the masks it applies were drawn there)."""
        parts = [self.graph.parts.get(self.call.part)]
        if self.call.part == "backward":
            parts.append(self.graph.parts.get("forward"))
        return any(part is not None and any(n.op.startswith(_DRAWING) for n in part.nodes) for part in parts)

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


def same_compiled_graphs(t_rank: RankTrace, b_rank: RankTrace) -> bool:
    """Whether both ranks ran the same compiled graphs: the same graphs by id, from the same
    backend, node for node (op and arguments) in every part. Then each region call of the target
    has its twin in the bench, and their ops pair one to one as eager ops do."""
    t_record, b_record = t_rank.compiled, b_rank.compiled
    if not t_record or not b_record or len(t_record.graphs) != len(b_record.graphs):
        return False
    # Graph ids count the process's compiles ("g0", "g1", ...): twins are the same in compile order.
    for t_graph, b_graph in zip(_in_compile_order(t_record.graphs), _in_compile_order(b_record.graphs)):
        if t_graph.backend != b_graph.backend or t_graph.parts.keys() != b_graph.parts.keys():
            return False
        for name, part in t_graph.parts.items():
            if [(n.op, n.args) for n in part.nodes] != [(n.op, n.args) for n in b_graph.parts[name].nodes]:
                return False
    return True


def _in_compile_order(graphs: Mapping[str, CompiledGraph]) -> list[CompiledGraph]:
    return sorted(graphs.values(), key=lambda g: int(g.id[1:]) if g.id[1:].isdigit() else -1)


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
            names = output_names(part, call)
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


def output_names(part: GraphPart | None, call: RegionCall) -> list[str]:
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
    index = PartIndex(part)
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


class PartIndex:
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
        self._exits: dict[str, GraphNode] | None = None  # module -> the last node computing in it

    def module_exit(self, module: str) -> GraphNode | None:
        """The last node (graph order) that computes in ``module``, where no node of a submodule
        computes after it: the value the module hands on, whatever ops made it."""
        if self._exits is None:
            self._exits, last_below = {}, {}
            for n in self.by_name.values():
                if n.op not in ("placeholder", "output", "getitem") and not n.recomputed and not same_values(n):
                    self._exits[n.module] = n
                    for prefix in module_prefixes(n.module):
                        last_below[prefix] = n
            self._exits = {m: n for m, n in self._exits.items() if last_below.get(m) is n}
        return self._exits.get(module)

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
            elif self.group(node) != group and not same_values(node):
                continue
            for i in node.inputs:
                if i not in seen:
                    seen.add(i)
                    todo.append(i)
        return found.pop() if len(found) == 1 else None


def module_prefixes(module: str) -> list[str]:
    """``module`` and every module above it: "a.b.c", "a.b", "a"."""
    parts = module.split(".")
    return [".".join(parts[:k]) for k in range(len(parts), 0, -1)] if module else []


def same_values(node: GraphNode) -> bool:
    """Whether the node rearranges or copies a value as an eager op of its own (not as a step of
    another op's decomposition): its value stands for what the op it reads computed."""
    return node.op.startswith(_SAME_VALUES) and node.original in ("", node.op)
