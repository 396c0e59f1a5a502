"""The record of ``torch.compile``d regions in a trace: their graphs, and which ops each call covers.

Capture (:mod:`tracecmp.capture.compiled`) writes, next to a chunk's two tables, a JSON file
``compiled-<K>.json`` listed with its size and CRC-32 in the chunk's commit record::

    {"graphs": [<CompiledGraph>, ...],   # graphs first called in this chunk, each written once
     "calls":  [<RegionCall>, ...]}       # every call of a compiled region that finished in it

A **compiled graph** is one graph Dynamo handed to the backend. Its *parts* are the graphs AOT
autograd makes of it, as it hands them to the backend: ``forward`` and ``backward`` (training),
or ``inference``. Every FX node is kept with what it computes (the aten overload and its
non-tensor arguments, recorded as ops' ``args`` are, tensors named by the nodes they come from),
the module path from its ``nn_module_stack`` (``fwd_nn_module_stack`` for backward nodes), the
user's source line, its autograd ``seq_nr`` and the eager op it was decomposed from
(``original``). Module paths come from this metadata, never from hooks: Dynamo replays a hook's
side effects instead of running it.

A **region call** says which recorded ops one run of a part covers (op ids ``first_op`` to
``last_op``), with the tensor ids of its inputs and outputs. How the region ran is its ``mode``:

* ``"boundary"``: as compiled (inductor's kernels). The call's op ``op_id`` is a node of kind
  ``op`` named ``compiled.forward`` / ``compiled.backward`` whose inputs and outputs are the
  region's; the ops recorded inside it are what the compiled code dispatched (inductor's extern
  kernels such as ``aten.mm.out``, custom ops it falls back to), listed per FX node in ``nodes``
  where they could be matched to one. Fused code (inductor's) dispatches nothing: capture runs the
  forward part's graph a second time with eager kernels on the same inputs, outside the trace, and
  keeps each computing node's statistics in ``values`` (a *shadow* run).
* ``"graph"``: the part's FX graph ran op by op with eager kernels under the capture, so every
  node is an ordinary op of the trace (``nodes`` maps each FX node to its ops). This is
  inductor's graph structure with eager kernels: its numbers are those of
  ``backend="aot_eager"``, not inductor's.

A backward call's inputs are its forward call's inputs followed by the gradients it received: a
backward part computes from the forward's inputs (through the values the forward saved) and the
incoming gradients.

>>> graph = CompiledGraph("g0", "0/0", "inductor", "model.py:12 forward", "", ("L['x']",), {})
>>> record = CompiledRecord.from_json([{"graphs": [graph.to_json()], "calls": []}])
>>> record.graphs["g0"].backend
'inductor'
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from tracecmp.errors import TraceFormatError

PARTS = ("forward", "backward", "inference")
MODES = ("boundary", "graph")
BOUNDARY_OPS = {"forward": "compiled.forward", "inference": "compiled.forward", "backward": "compiled.backward"}
GRAPH_LABEL = "inductor's graph structure with eager kernels"


@dataclass(frozen=True)
class GraphNode:
    """One FX node of a compiled graph part."""

    name: str
    op: str  # "aten.mm.default", "getitem", "placeholder", "output", or the target's qualified name
    inputs: tuple[str, ...] = ()  # nodes read, in the order of the {"tensor": i} entries of ``args``
    args: str = "{}"  # non-tensor arguments as JSON, as an op's ``args`` column; getitem: {"index": i}
    module: str = ""  # dotted path as in named_modules(), from the node's module stack
    location: str = ""  # "model.py:42", the user's line that made the node
    seq_nr: int = -1  # autograd sequence number at trace time: links backward nodes to forward ones
    original: str = ""  # the eager op the node was decomposed from, "" when unknown
    shapes: tuple[tuple[int, ...], ...] = ()  # output shapes, from the node's example value
    dtypes: tuple[str, ...] = ()
    # A forward node the partitioner copied into a backward graph, to compute its value again there
    # instead of saving it: the eager backward has no such op.
    recomputed: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "op": self.op,
            "inputs": list(self.inputs),
            "args": self.args,
            "module": self.module,
            "location": self.location,
            "seq_nr": self.seq_nr,
            "original": self.original,
            "shapes": [list(s) for s in self.shapes],
            "dtypes": list(self.dtypes),
            "recomputed": self.recomputed,
        }

    @classmethod
    def from_json(cls, raw: Any) -> GraphNode:
        _need(raw, dict, "graph node")
        return cls(
            name=_str(raw, "name"),
            op=_str(raw, "op"),
            inputs=tuple(_strs(raw.get("inputs", []), "node inputs")),
            args=_str(raw, "args", "{}"),
            module=_str(raw, "module", ""),
            location=_str(raw, "location", ""),
            seq_nr=_int(raw, "seq_nr", -1),
            original=_str(raw, "original", ""),
            shapes=tuple(tuple(_ints(s, "shape")) for s in _list(raw.get("shapes", []), "shapes")),
            dtypes=tuple(_strs(raw.get("dtypes", []), "dtypes")),
            recomputed=raw.get("recomputed") is True,
        )


@dataclass(frozen=True)
class GraphPart:
    """The forward, backward or inference graph of a compiled graph.

    Outputs of a forward or inference part: ``mutated`` (the inputs it writes, in that order:
    their new values), then the ``user_outputs`` values the region returns, then what it saves
    for the backward.
    """

    kind: str
    nodes: tuple[GraphNode, ...]
    mutated: tuple[int, ...] = ()  # positions of the inputs the part writes
    user_outputs: int = 0

    @property
    def placeholders(self) -> list[GraphNode]:
        return [n for n in self.nodes if n.op == "placeholder"]

    @property
    def output(self) -> GraphNode | None:
        return next((n for n in reversed(self.nodes) if n.op == "output"), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "nodes": [n.to_json() for n in self.nodes],
            "mutated": list(self.mutated),
            "user_outputs": self.user_outputs,
        }

    @classmethod
    def from_json(cls, raw: Any) -> GraphPart:
        _need(raw, dict, "graph part")
        kind = _str(raw, "kind")
        if kind not in PARTS:
            raise _error(f"unknown graph part {kind!r}")
        return cls(
            kind,
            tuple(GraphNode.from_json(n) for n in _list(raw.get("nodes"), "nodes")),
            tuple(_ints(raw.get("mutated", []), "mutated")),
            _int(raw, "user_outputs", 0),
        )


@dataclass(frozen=True)
class CompiledGraph:
    """One graph Dynamo compiled: where it came from and its AOT parts (see the module docstring)."""

    id: str  # unique in the rank, "g0", "g1", ...
    compile_id: str  # Dynamo's "frame/compile" id, "0/0"
    backend: str  # "inductor", "aot_eager", ...
    code: str  # "model.py:12 forward": the compiled frame
    module: str  # module path of the compiled frame's ``self`` ("" for the root or none)
    inputs: tuple[str, ...]  # Dynamo's source of each input ("L['self'].fc.weight", "L['x']")
    parts: Mapping[str, GraphPart]
    note: str = ""  # why parts are missing, when they are

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "compile_id": self.compile_id,
            "backend": self.backend,
            "code": self.code,
            "module": self.module,
            "inputs": list(self.inputs),
            "parts": {k: p.to_json() for k, p in self.parts.items()},
            "note": self.note,
        }

    @classmethod
    def from_json(cls, raw: Any) -> CompiledGraph:
        _need(raw, dict, "compiled graph")
        parts = raw.get("parts", {})
        _need(parts, dict, "graph parts")
        return cls(
            id=_str(raw, "id"),
            compile_id=_str(raw, "compile_id", ""),
            backend=_str(raw, "backend", ""),
            code=_str(raw, "code", ""),
            module=_str(raw, "module", ""),
            inputs=tuple(_strs(raw.get("inputs", []), "inputs")),
            parts={str(k): GraphPart.from_json(v) for k, v in parts.items()},
            note=_str(raw, "note", ""),
        )


@dataclass(frozen=True)
class RegionCall:
    """One run of a compiled graph part and the ops of the trace it covers."""

    graph: str
    part: str  # forward | backward | inference
    mode: str  # boundary | graph
    step: int
    op_id: int  # the boundary node (boundary mode); -1 in graph mode
    first_op: int  # first op recorded while it ran (its source nodes included)
    last_op: int  # last op recorded while it ran (the boundary node, in boundary mode)
    inputs: tuple[int, ...]  # tensor ids of the part's inputs (see the module docstring for backward)
    outputs: tuple[int, ...]  # tensor ids of the values it returned
    forward: int = -1  # backward calls: ``first_op`` of the forward call they belong to
    nodes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # FX node -> ops recorded for it
    # Boundary calls of fused code: FX node -> ((min, max, mean, norm), shape) of
    # its value, from the part run with eager kernels on the call's inputs at capture (a shadow run).
    values: Mapping[str, tuple[tuple[float, ...], tuple[int, ...]]] = field(default_factory=dict)

    def covers(self, op_id: int) -> bool:
        return self.first_op <= op_id <= self.last_op

    def to_json(self) -> dict[str, Any]:
        return {
            "graph": self.graph,
            "part": self.part,
            "mode": self.mode,
            "step": self.step,
            "op_id": self.op_id,
            "first_op": self.first_op,
            "last_op": self.last_op,
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "forward": self.forward,
            "nodes": {k: list(v) for k, v in self.nodes.items()},
            "values": {k: [[_number(x) for x in stats], list(shape)] for k, (stats, shape) in self.values.items()},
        }

    @classmethod
    def from_json(cls, raw: Any) -> RegionCall:
        _need(raw, dict, "region call")
        part, mode = _str(raw, "part"), _str(raw, "mode")
        if part not in PARTS or mode not in MODES:
            raise _error(f"region call with unknown part {part!r} or mode {mode!r}")
        nodes = raw.get("nodes", {})
        _need(nodes, dict, "region call nodes")
        return cls(
            graph=_str(raw, "graph"),
            part=part,
            mode=mode,
            step=_int(raw, "step", 0),
            op_id=_int(raw, "op_id", -1),
            first_op=_int(raw, "first_op"),
            last_op=_int(raw, "last_op"),
            inputs=tuple(_ints(raw.get("inputs", []), "inputs")),
            outputs=tuple(_ints(raw.get("outputs", []), "outputs")),
            forward=_int(raw, "forward", -1),
            nodes={str(k): tuple(_ints(v, "node ops")) for k, v in nodes.items()},
            values=_values(raw.get("values", {})),
        )


@dataclass
class CompiledRecord:
    """Everything a rank's trace says about compiled regions: graphs by id, calls in order."""

    graphs: dict[str, CompiledGraph] = field(default_factory=dict)
    calls: list[RegionCall] = field(default_factory=list)

    @classmethod
    def from_json(cls, chunks: Iterable[Any]) -> CompiledRecord:
        """Merge the per-chunk payloads (each ``{"graphs": [...], "calls": [...]}``), validating them."""
        record = cls()
        for payload in chunks:
            _need(payload, dict, "compiled record")
            for raw in _list(payload.get("graphs", []), "graphs"):
                graph = CompiledGraph.from_json(raw)
                record.graphs.setdefault(graph.id, graph)
            record.calls.extend(RegionCall.from_json(c) for c in _list(payload.get("calls", []), "calls"))
        for call in record.calls:
            if call.graph not in record.graphs:
                raise _error(f"a region call names graph {call.graph!r}, which the trace does not hold")
        return record

    def boundary_calls(self) -> dict[int, RegionCall]:
        """``{boundary node op_id: call}`` of the calls recorded in boundary mode."""
        return {c.op_id: c for c in self.calls if c.mode == "boundary" and c.op_id >= 0}

    def region_of(self) -> dict[int, RegionCall]:
        """``{op_id: call}`` for every op a call covers (its boundary node included)."""
        out: dict[int, RegionCall] = {}
        for call in self.calls:
            for op_id in range(call.first_op, call.last_op + 1):
                out.setdefault(op_id, call)
        return out

    def __bool__(self) -> bool:
        return bool(self.calls)


def _number(value: float) -> float | str:
    """A float as strict JSON holds it: non-finite ones as the strings ``float()`` reads back."""
    return value if math.isfinite(value) else str(value)


def _values(raw: Any) -> dict[str, tuple[tuple[float, ...], tuple[int, ...]]]:
    """A region call's shadow statistics: ``{node: [[min, max, mean, norm], shape]}``."""
    _need(raw, dict, "region call values")
    out = {}
    for name, entry in raw.items():
        entry = _list(entry, "node value")
        if len(entry) != 2:
            raise _error(f"node value of {name!r} is not [statistics, shape]")
        stats = _list(entry[0], "node statistics")
        if len(stats) != 4 or not all(_is_number(x) for x in stats):
            raise _error(f"node statistics of {name!r} are not four numbers")
        out[str(name)] = (tuple(float(x) for x in stats), tuple(_ints(entry[1], "node shape")))
    return out


def _is_number(value: Any) -> bool:
    if isinstance(value, str):
        return value in ("nan", "inf", "-inf")
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _error(message: str) -> TraceFormatError:
    return TraceFormatError(f"compiled-region record: {message}")


def _need(value: Any, kind: type, what: str) -> None:
    if not isinstance(value, kind):
        raise _error(f"{what} is not a JSON {'object' if kind is dict else 'array'}")


def _list(value: Any, what: str) -> list[Any]:
    _need(value, list, what)
    return value


def _str(raw: Mapping[str, Any], key: str, default: str | None = None) -> str:
    value = raw.get(key, default)
    if not isinstance(value, str):
        raise _error(f"{key!r} is missing or not a string")
    return value


def _int(raw: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise _error(f"{key!r} is missing or not an integer")
    return value


def _ints(value: Any, what: str) -> list[int]:
    items = _list(value, what)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in items):
        raise _error(f"{what} holds something other than integers")
    return items


def _strs(value: Any, what: str) -> list[str]:
    items = _list(value, what)
    if not all(isinstance(v, str) for v in items):
        raise _error(f"{what} holds something other than strings")
    return items
