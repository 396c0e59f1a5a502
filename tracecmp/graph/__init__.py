"""A rank's dataflow graph: typed nodes and tensor states (:mod:`tracecmp.graph.nodes`) and the
networkx graph built from a trace (:mod:`tracecmp.graph.build`)."""

from __future__ import annotations

from tracecmp.graph.build import build_graph, edges_frame, view_bases
from tracecmp.graph.nodes import Node, TensorState

__all__ = ["Node", "TensorState", "build_graph", "edges_frame", "view_bases"]
