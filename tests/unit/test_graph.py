"""Dataflow graph of a trace: nodes, producer -> consumer edges through tensor ids, views, steps."""

from __future__ import annotations

import pandas as pd
import torch

import tracecmp
from tests.tracebuild import TraceBuilder
from tracecmp.graph import build_graph, edges_frame, view_bases


def _trace(tmp_path):
    b = TraceBuilder()
    x = b.source("input.0", torch.ones(2, 3))
    w = b.param("fc.weight", torch.ones(4, 3))
    wt = b.view("aten.t.default", w, (3, 4), module="fc")
    y = b.op("aten.mm.default", [x, wt], torch.full((2, 4), 3.0), module="fc", location="train.py:7")
    v = b.view("aten.view.default", y, (8,))
    v2 = b.view("aten.view.default", v, (2, 4))
    z = b.op("aten.add.Tensor", [y, v2], torch.full((2, 4), 6.0), module="")
    b.step()
    b.op("aten.relu.default", [z], torch.full((2, 4), 6.0), module="act")
    return tracecmp.load(b.write(tmp_path / "run"))


def test_nodes_carry_trace_columns_and_edges_carry_tensors(tmp_path):
    trace = _trace(tmp_path)
    g = build_graph(trace.rank(0))
    assert g.number_of_nodes() == 8
    assert g.nodes[3]["op"] == "aten.mm.default"
    assert g.nodes[3]["module"] == "fc" and g.nodes[3]["location"] == "train.py:7"
    assert g.nodes[0]["kind"] == "source" and g.nodes[0]["name"] == "input.0"
    # mm reads the input (source 0) and the transposed weight (view node 2).
    assert set(g.predecessors(3)) == {0, 2}
    edge = g.edges[0, 3]
    assert edge["tensor_id"] == 0 and edge["shape"] == (2, 3) and edge["dtype"] == "float32"
    # add reads y directly and through two views: one edge per producer, tensors listed.
    assert set(g.predecessors(6)) == {3, 5}
    assert g.nodes[7]["step"] == 1


def test_step_filter_keeps_only_that_steps_nodes(tmp_path):
    trace = _trace(tmp_path)
    g0 = build_graph(trace.rank(0), step=0)
    g1 = build_graph(trace.rank(0), step=1)
    assert set(g1.nodes) == {7}
    assert g1.number_of_edges() == 0  # its producer lives in step 0
    assert 7 not in g0 and g0.graph["step"] == 0


def test_view_chains_resolve_to_their_base():
    tensors = pd.DataFrame({"tensor_id": [0, 1, 2, 3, 4], "view_of": [-1, 0, 1, 2, -1]})
    assert view_bases(tensors) == {1: 0, 2: 0, 3: 0}


def test_edges_frame_positions_follow_argument_order(tmp_path):
    trace = _trace(tmp_path)
    edges = edges_frame(trace.rank(0).ops, trace.rank(0).tensors)
    mm = edges[edges["consumer"] == 3].sort_values("position")
    assert mm["tensor_id"].tolist() == [0, 2]
    assert mm["producer"].tolist() == [0, 2]


def test_compare_result_graph_has_comparison_attributes(tmp_path):
    trace_path = _trace(tmp_path).path
    result = tracecmp.compare(trace_path, trace_path)
    g = result.graph(rank=0, step=0)
    assert g.nodes[3]["status"] == "agrees"
    assert g.nodes[3]["bench_op_id"] == 3
    assert g.nodes[3]["error"] == 0.0


def test_values_with_their_own_statistics_are_not_resolved_to_a_base():
    # capture's alias.update: a tensor after writes through its views names the last write in
    # view_of but carries statistics of its own.
    tensors = pd.DataFrame({"tensor_id": [0, 1, 2], "view_of": [-1, 0, 1], "has_stats": [True, False, True]})
    assert view_bases(tensors) == {1: 0}
