"""A compiled region against the eager ops it replaces, on hand-built traces (no model is run).

The bench runs ``relu(x * w)`` eagerly (``aten.mul`` in ``fc``, ``aten.relu`` in ``act``), then a
sum. The target recorded the first two as one compiled region (``compiled.forward``) whose graph
says which eager ops its nodes came from; the sum runs eagerly after it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

import tracecmp
from tests.tracebuild import TraceBuilder
from tracecmp.trace.compiled import CompiledGraph, GraphNode, GraphPart, RegionCall

X = torch.tensor([[1.5, -2.0, 0.25, 3.0], [-0.5, 1.0, -1.25, 2.5]])
W = torch.tensor([[0.5, 1.5, -2.0, 1.0], [2.0, -0.75, 0.5, -1.5]])


def _bench(path: Path) -> Path:
    b = TraceBuilder()
    x, w = b.source("input.0", X), b.param("fc.weight", W)
    y = b.call(torch.ops.aten.mul.Tensor, x, w, module="fc")
    r = b.call(torch.ops.aten.relu.default, y, module="act")
    b.call(torch.ops.aten.sum.default, r)
    return b.write(path)


def _graph(relu_op: str = "aten.relu.default", relu_args: str = '{"self":{"tensor":0}}') -> CompiledGraph:
    nodes = (
        GraphNode("primals_1", "placeholder"),
        GraphNode("primals_2", "placeholder"),
        GraphNode("mul", "aten.mul.Tensor", ("primals_1", "primals_2"), '{"self":{"tensor":0},"other":{"tensor":1}}',
                  "fc", "model.py:3", 1, "aten.mul.Tensor", ((2, 4),), ("float32",)),
        GraphNode("relu", relu_op, ("mul",), relu_args, "act", "model.py:4", 2, "aten.relu.default", ((2, 4),),
                  ("float32",)),
        GraphNode("output", "output", ("relu",)),
    )
    return CompiledGraph("g0", "0/0", "inductor", "model.py:2 forward", "", ("L['x']", "L['self'].fc.weight"),
                         {"forward": GraphPart("forward", nodes, (), 1)})


def _target(path: Path, region: Callable[[torch.Tensor], torch.Tensor], graph: CompiledGraph, data: bool) -> Path:
    b = TraceBuilder(data=data)
    x, w = b.source("input.0", X), b.param("fc.weight", W)
    out = region(X * W)
    y = b.op("compiled.forward", [x, w], out, module="")
    b.ops[-1]["name"] = graph.id
    b.call(torch.ops.aten.sum.default, y)
    call = RegionCall(graph=graph.id, part="forward", mode="boundary", step=0, op_id=y.op_id, first_op=y.op_id,
                      last_op=y.op_id, inputs=(x.tensor_id, w.tensor_id), outputs=(y.tensor_id,))
    b.compiled = {"graphs": [graph.to_json()], "calls": [call.to_json()]}
    return b.write(path)


def test_a_clean_region_pairs_with_the_op_it_replaces_and_agrees(tmp_path: Path) -> None:
    bench = _bench(tmp_path / "bench")
    target = _target(tmp_path / "target", torch.relu, _graph(), data=False)
    result = tracecmp.compare(target, bench)
    assert result.first_divergence is None
    region = result.nodes[result.nodes["op"] == "compiled.forward"].iloc[0]
    measured = result.tensors[result.tensors["op_id"] == region["op_id"]]
    relu_out = tracecmp.load(bench).rank(0).ops.query("op == 'aten.relu.default'")["outputs"].iloc[0][0]
    assert measured["bench_tensor_id"].tolist() == [relu_out]
    assert region["status"] == "agrees"
    assert any("without a replay" in w for w in result.warnings)


def test_a_region_computing_wrong_is_a_root(tmp_path: Path) -> None:
    bench = _bench(tmp_path / "bench")
    target = _target(tmp_path / "target", lambda y: torch.relu(y) * 1.01, _graph(), data=True)
    first = tracecmp.compare(target, bench).first_divergence
    assert first is not None and first.op == "compiled.forward"
    assert "computes its graph wrongly" in first.reason  # its own error against the replay of its graph


def test_a_graph_departing_from_the_eager_ops_is_narrowed_to_its_node(tmp_path: Path) -> None:
    # A pass swapped relu for a leaky relu: the region computes its graph faithfully, but the graph
    # is not the eager program. The replay finds the node where it departs.
    bench = _bench(tmp_path / "bench")
    graph = _graph("aten.leaky_relu.default", '{"self":{"tensor":0},"negative_slope":0.5}')
    target = _target(tmp_path / "target", lambda y: torch.nn.functional.leaky_relu(y, 0.5), graph, data=True)
    first = tracecmp.compare(target, bench).first_divergence
    assert first is not None and first.op == "compiled.forward"
    assert "narrowed to FX node relu (aten.leaky_relu.default, act, model.py:4)" in first.reason


def test_a_region_without_tensors_is_allowed_a_graph_of_rounding(tmp_path: Path) -> None:
    bench = _bench(tmp_path / "bench")
    # A few float32 units apart (reordered arithmetic): noise. Far more: a root.
    close = _target(tmp_path / "close", lambda y: torch.relu(y) * (1 + 2e-7), _graph(), data=False)
    assert tracecmp.compare(close, bench).first_divergence is None
    far = _target(tmp_path / "far", lambda y: torch.relu(y) * 1.01, _graph(), data=False)
    first = tracecmp.compare(far, bench).first_divergence
    assert first is not None and first.op == "compiled.forward" and "no replay measured" in first.reason
