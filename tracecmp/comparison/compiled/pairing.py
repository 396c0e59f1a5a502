"""Pairing a compiled target's units with the bench's eager ops.

Each unit's outputs are paired with the bench tensors of the eager ops they replace, from the
graph's node metadata: the producing node's module, the eager op it came from (``original``)
and its autograd ``seq_nr`` group, counted in order within the module, and its shape.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Callable, Mapping

import pandas as pd

from tracecmp.comparison.compiled.units import (
    CompiledUnits,
    PartIndex,
    Unit,
    module_prefixes,
    output_names,
    same_values,
)
from tracecmp.trace.compiled import CompiledRecord, GraphNode, GraphPart, RegionCall

_FIRST_SHADOW = -(2**40)  # shadow values' tensor ids count down from here, far from any real id


class Pairing:
    """Finds the bench tensor a unit's node value stands for (see :func:`pair_units`)."""

    def __init__(
        self,
        units: CompiledUnits,
        t_ops: pd.DataFrame,
        t_ten: pd.DataFrame,
        b_ops: pd.DataFrame,
        b_ten: pd.DataFrame,
        b_base: Mapping[int, int],
        b_compiled: CompiledRecord | None = None,
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
        self._indexes: dict[tuple[int, str], PartIndex] = {}
        self._shadows: dict[tuple[int, str, str], int] = {}
        self._scope_last: dict[tuple[Any, ...], int] | None = None  # (step, phase, module) -> its last bench op
        steps = set(self.step_of.values())
        self._twins = _Twins(units, b_compiled, steps, self) if b_compiled else None
        self.ordinals = _ordinals(units, t_ops, self.step_of, self.phase_of, self.index)

    def twin_output(self, unit: Unit, name: str, shape: tuple[int, ...]) -> int | None:
        """Against a compiled bench: the bench region's output that holds the twin of node ``name``'s value."""
        index = self.index(unit.call)
        return self._twins.output(unit.call, index, name, shape) if self._twins is not None and index else None

    def bench_shadow_tensor(self, call: RegionCall, name: str) -> int:
        """As :meth:`shadow_tensor`, for a value of the bench's compiled code."""
        return self._shadow_id((-1 - call.first_op, call.part, name), call.values[name], self.b_stats, self.b_shape)

    def shadow_tensor(self, call: RegionCall, name: str) -> int:
        """A tensor id of the target's (negative: no op of the trace made it) for the value of node
        ``name`` that capture's shadow run measured (``call.values``), with its statistics and shape."""
        return self._shadow_id((call.first_op, call.part, name), call.values[name], self.t_stats, self.t_shape)

    def _shadow_id(
        self, key: tuple[int, str, str], value: tuple[Any, tuple[int, ...]], stats: dict, shapes: dict
    ) -> int:
        """The id of a shadow value (made once per key), entered in ``stats`` and ``shapes``."""
        tensor = self._shadows.get(key)
        if tensor is None:
            tensor = self._shadows[key] = _FIRST_SHADOW - len(self._shadows)
            stats[tensor], shapes[tensor] = value
        return tensor

    def index(self, call: RegionCall) -> PartIndex | None:
        """The index of the graph part ``call`` ran (None when the trace has no such part)."""
        key = (call.first_op, call.part)
        if key not in self._indexes:
            part = self._parts.get(key)
            if part is None:
                return None
            self._indexes[key] = PartIndex(part)
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
        if self._twins is not None:
            twin = self._twins.value(unit.call, index, name, shape)
            if twin is not None:
                return twin
        node, same = self._stands_for(unit, index, name, shape)
        if node is not None and not self._group(unit.call, node):
            return self._module_exit(unit.call, index, node, shape)
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

    def _module_exit(self, call: RegionCall, index: PartIndex, node: GraphNode, shape: tuple[int, ...]) -> int | None:
        """Where the bench ran no eager op ``node`` stands for (another implementation of the same
        module: an exact GELU for a tanh one) and ``node`` is the last its module computes: the value
        the bench's module handed on, the output of its last op there."""
        if not node.module or index.module_exit(node.module) is not node:
            return None
        anchor = self.anchor.get((call.first_op, call.part))
        scope = (self.step_of.get(anchor), self.phase_of.get(anchor), node.module)
        if self._scope_last is None:
            self._scope_last, below = {}, {}
            for op, (step, phase, module) in sorted(self.b_scope.items()):
                if op not in self.b_sources and self.b_kind.get(op) != "view":
                    self._scope_last[(step, phase, module)] = op
                    for prefix in module_prefixes(module):
                        below[(step, phase, prefix)] = op
            # A module whose submodule computes its output (attention's output projection) hands on
            # that value, not its own last op's.
            self._scope_last = {k: op for k, op in self._scope_last.items() if below.get(k) == op}
        last = self._scope_last.get(scope)
        outputs = self.b_outputs.get(last, []) if last is not None else []
        return outputs[0] if outputs and math.prod(self.b_shape.get(outputs[0], (-1,))) == math.prod(shape) else None

    def measured_as(self, bench: int) -> int | None:
        """The bench tensor whose statistics are ``bench``'s: itself, or the base it is a view of
        when it holds all of the base's elements (a reshape or permute of it); None for a view of
        part of its base (unbind's q: the base's statistics are those of q, k and v together)."""
        base = self.b_base.get(bench)
        if base is None:
            return bench
        return base if math.prod(self.b_shape.get(bench, (-1,))) == math.prod(self.b_shape.get(base, ())) else None

    def _stands_for(
        self, unit: Unit, index: PartIndex, name: str, shape: tuple[int, ...]
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

    def has_counterpart(self, call: RegionCall, node: GraphNode) -> bool:
        """Whether the bench ran an eager op ``node`` stands for (a decomposition's op has one even
        where its value pairs with none; an op the target's code added has none)."""
        return bool(self._group(call, node))

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
        if self._twins is not None:
            covered |= self._twins.covered_ops()  # what the bench's own compiled code dispatched
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
        # the autograd engine's sums of the gradients a region's ops return), and the views and
        # unnamed constants only they read (views of the token ids; a cache's ``torch.tensor([])``,
        # which the compiled code makes itself).
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
                and (self.b_kind.get(op) == "view" or self.b_op.get(op) == "source.tensor")
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


class _Twins:
    """A compiled bench's region calls, each the twin of the target's call in the same place (its
    step, part and order there), and their nodes paired with the target's by what the graphs say.

    Graphs that differ (a fault changed a constant or a node, another compile) still make the
    same eager ops in the same modules: a node pairs with the bench node of its eager op's group
    (module, eager op, counted in graph order) that leaves that group in the same place among those
    of its shape. Its value is what the bench's compiled code dispatched for it, else its shadow
    run's statistics (:mod:`tracecmp.capture.compiled`).
    """

    def __init__(self, units: CompiledUnits, record: CompiledRecord, steps: set[int], pairing: Pairing) -> None:
        self._pairing = pairing
        self._graphs = record.graphs
        bench_calls: dict[tuple[int, str], list[RegionCall]] = defaultdict(list)
        for call in record.calls:
            if call.step in steps:
                bench_calls[(call.step, call.part)].append(call)
        target_calls: dict[tuple[int, str], list[RegionCall]] = defaultdict(list)
        for call, _, _ in units.calls:
            target_calls[(call.step, call.part)].append(call)
        self._twin: dict[tuple[int, str], RegionCall] = {}
        for key, calls in target_calls.items():
            for call, twin in zip(sorted(calls, key=lambda c: c.first_op), bench_calls.get(key, [])):
                self._twin[(call.first_op, call.part)] = twin
        self._indexes: dict[tuple[int, str, str], tuple[PartIndex, dict[tuple[str, str], list[tuple]]]] = {}

    def covered_ops(self) -> set[int]:
        """Bench op ids inside the twins: the bench's regions stand where the target's do."""
        return {op for twin in self._twin.values() for op in range(twin.first_op, twin.last_op + 1)}

    def value(self, call: RegionCall, index: PartIndex, name: str, shape: tuple[int, ...]) -> int | None:
        """The bench tensor (a shadow value's id where no op recorded it) of node ``name``'s twin."""
        found = self._twin_node(call, index, name, shape) or self._twin_exit(call, index, name, shape)
        if found is None:
            return None
        twin, b_node = found
        ops = twin.nodes.get(b_node.name)
        outputs = self._pairing.b_outputs.get(ops[-1]) if ops else None
        if outputs:
            return outputs[0]
        if b_node.name in twin.values:
            return self._pairing.bench_shadow_tensor(twin, b_node.name)
        return None

    def output(self, call: RegionCall, index: PartIndex, name: str, shape: tuple[int, ...]) -> int | None:
        """The bench region's output (a tensor of its trace) that holds the value of ``name``'s twin."""
        found = self._twin_node(call, index, name, shape)
        if found is None:
            return None
        twin, b_node = found
        b_part = self._graphs[twin.graph].parts[twin.part]
        b_index = self._indexed(twin, b_part)[0]
        for position, node in enumerate(_producer(b_index.by_name, n) for n in output_names(b_part, twin)):
            if node is not None and node.name == b_node.name and twin.outputs[position] >= 0:
                tensor = twin.outputs[position]
                if math.prod(self._pairing.b_shape.get(tensor, (-1,))) == math.prod(shape):
                    return tensor
        return None

    def _twin_exit(
        self, call: RegionCall, index: PartIndex, name: str, shape: tuple[int, ...]
    ) -> tuple[RegionCall, GraphNode] | None:
        """Where no node of the twin was made for ``name``'s eager op and ``name`` is the last its
        module computes: the twin's last node in that module (another implementation of it)."""
        twin = self._twin.get((call.first_op, call.part))
        node = _producer(index.by_name, name)
        b_graph = self._graphs.get(twin.graph) if twin is not None else None
        b_part = b_graph.parts.get(twin.part) if b_graph is not None else None
        if twin is None or b_part is None or node is None or not node.module:
            return None
        if index.module_exit(node.module) is not node:
            return None
        b_exit = self._indexed(twin, b_part)[0].module_exit(node.module)
        if b_exit is None or not b_exit.shapes or math.prod(b_exit.shapes[0]) != math.prod(shape):
            return None
        return twin, b_exit

    def _twin_node(
        self, call: RegionCall, index: PartIndex, name: str, shape: tuple[int, ...]
    ) -> tuple[RegionCall, GraphNode] | None:
        """The bench's twin call of ``call`` and the node of it that node ``name`` pairs with."""
        twin = self._twin.get((call.first_op, call.part))
        node = index.by_name.get(name)
        if twin is None or node is None:
            return None
        if node.op == "getitem" or same_values(node):
            node = _producer(index.by_name, name)
        b_graph = self._graphs.get(twin.graph)
        b_part = b_graph.parts.get(twin.part) if b_graph is not None else None
        if node is None or b_part is None or node.op in ("placeholder", "output"):
            return None
        mine = self._groups(("t", call.first_op, call.part), index)
        b_index, theirs = self._indexed(twin, b_part)
        group = index.group(node)
        order = mine.get(group[:2], [])
        if group not in order:
            return None
        ordinal = order.index(group)
        b_order = theirs.get(group[:2], [])
        if ordinal >= len(b_order) or len(order) != len(b_order):
            return None
        size = math.prod(shape)
        leaving = self._leaving(index, group, size)
        b_leaving = self._leaving(b_index, b_order[ordinal], size)
        if node not in leaving or len(leaving) != len(b_leaving):
            return None
        return twin, b_leaving[leaving.index(node)]

    def _indexed(self, twin: RegionCall, part: GraphPart) -> tuple[PartIndex, dict[tuple[str, str], list[tuple]]]:
        key = ("b", twin.graph, twin.part)
        if key not in self._indexes:
            index = PartIndex(part)
            self._indexes[key] = (index, self._groups(key, index))
        return self._indexes[key]

    def _groups(self, key: tuple[Any, ...], index: PartIndex) -> dict[tuple[str, str], list[tuple]]:
        """The part's eager-op groups, per (module, eager op), in graph order."""
        cached = self._indexes.get(key)
        if cached is not None:
            return cached[1]
        order: dict[tuple[str, str], list[tuple]] = defaultdict(list)
        for n in index.by_name.values():
            if n.op in ("placeholder", "output", "getitem") or n.recomputed:
                continue
            group = index.group(n)
            if group not in order[group[:2]]:
                order[group[:2]].append(group)
        self._indexes[key] = (index, order)
        return order

    @staticmethod
    def _leaving(index: PartIndex, group: tuple, size: int) -> list[GraphNode]:
        """The group's computing nodes of ``size`` elements whose values leave it, in graph order."""
        return [
            n
            for n in index.by_name.values()
            if n.op not in ("placeholder", "output", "getitem")
            and index.group(n) == group
            and index.leaves_group(n)
            and n.shapes
            and math.prod(n.shapes[0]) == size
        ]


def pair_units(pairing: Pairing, units: CompiledUnits) -> dict[int, int]:
    """``{target tensor id: bench tensor id}`` for the units' outputs, from node metadata.

    The bench candidates of a node are the outputs of the bench ops named after the eager op the
    node came from, in its module, step and phase, grouped by autograd sequence number; the
    node's group is the same-numbered group counted in order (its n-th ``aten.add`` group in
    ``blocks.0``, eager ops of the target and earlier regions counted too), then the output of
    its shape.
    """
    partner: dict[int, int] = {}
    for unit in units.units:
        peers = [(name, pairing.t_shape.get(t, ()), t) for t, name in unit.outputs]
        for tensor, name in unit.outputs:
            shape = pairing.t_shape.get(tensor)
            if shape is None:
                continue
            found = pairing.twin_output(unit, name, shape)
            if found is None:
                found = pairing.bench_tensor(unit, name, shape, peers, tensor)
            if found is not None and found < 0:
                continue  # a shadow run's statistics: no tensor of the bench's trace to measure against
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
        if node is None or not (node.op == "getitem" or same_values(node)):
            return node
        if not node.inputs or node.inputs[0] not in by_name:
            return node
        node = by_name[node.inputs[0]]
    return node


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
    index_of: Callable[[RegionCall], PartIndex | None],
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
