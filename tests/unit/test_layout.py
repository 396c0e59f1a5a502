"""tracecmp's own graph layout (no graphviz): the DOT subset it reads, and the geometry it draws.

The geometry is checked on the pictures tracecmp really draws (the subgraph around a divergence,
and a 60-node selection of a wide graph): nodes never overlap, every cluster frame holds exactly
its own nodes, frames nest or stay apart, edges run from their tail to their head, and labels sit
clear of nodes.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from tests.unit.test_render import compared, diverged, wide_recipe  # noqa: F401
from tracecmp.comparison import CompareResult
from tracecmp.errors import TracecmpError
from tracecmp.render.dot import Cluster, Drawing, Html, layout, parse_dot, text_width
from tracecmp.render.subgraph import build_dot

Box = tuple[float, float, float, float]


def _box(points: list[tuple[float, float]]) -> Box:
    (x0, y0), (x1, y1) = points[0], points[1]
    return x0, y0, x1, y1


def _overlap(a: Box, b: Box) -> bool:
    return a[0] < b[2] - 1e-6 and b[0] < a[2] - 1e-6 and a[1] < b[3] - 1e-6 and b[1] < a[3] - 1e-6


def _inside(inner: Box, outer: Box) -> bool:
    return (
        outer[0] <= inner[0] + 1e-6
        and outer[1] <= inner[1] + 1e-6
        and inner[2] <= outer[2] + 1e-6
        and inner[3] <= outer[3] + 1e-6
    )


def _members(cluster: Cluster) -> set[str]:
    return set(cluster.nodes).union(*(_members(c) for c in cluster.children))


def _clusters(cluster: Cluster) -> list[Cluster]:
    return [cluster] + [c for child in cluster.children for c in _clusters(child)]


def check_geometry(text: str) -> Drawing:
    graph = parse_dot(text)
    drawing = layout(text)
    nodes = {g.name: _box(g.shapes[0].points) for g in drawing.groups if g.kind == "node"}
    frames = {g.name: _box(g.shapes[0].points) for g in drawing.groups if g.kind == "cluster"}
    assert set(nodes) == set(graph.nodes)
    for (a, box_a), (b, box_b) in itertools.combinations(nodes.items(), 2):
        assert not _overlap(box_a, box_b), f"nodes {a} and {b} overlap"
    clusters = _clusters(graph.root)[1:]
    assert set(frames) == {c.name for c in clusters}
    for cluster in clusters:
        inside = _members(cluster)
        for name, box in nodes.items():
            if name in inside:
                assert _inside(box, frames[cluster.name]), f"{name} sticks out of {cluster.attrs.get('label')}"
            else:
                assert not _overlap(box, frames[cluster.name]), f"{name} enters {cluster.attrs.get('label')}"
    for a, b in itertools.combinations(clusters, 2):
        nested = _members(a) <= _members(b) or _members(b) <= _members(a)
        if not nested:
            assert not _overlap(frames[a.name], frames[b.name]), "sibling frames overlap"
    edges = [g for g in drawing.groups if g.kind == "edge"]
    assert len(edges) == len([e for e in graph.edges if e[0] != e[1]])
    for group in edges:
        tail, head = group.name.split("->")
        path = next(s for s in group.shapes if s.kind == "path")
        arrow = next(s for s in group.shapes if s.kind == "polygon")
        start, tip = path.points[0], arrow.points[0]
        t, h = nodes[tail], nodes[head]
        assert t[0] <= start[0] <= t[2] and abs(start[1] - t[3]) < 1e-6  # leaves the tail's bottom
        assert h[0] <= tip[0] <= h[2] and abs(tip[1] - h[1]) < 1e-6  # arrives on the head's top
        for label in (s for s in group.shapes if s.kind == "text"):
            ((x, y),) = label.points
            box = (x, y - label.size, x + text_width(label.text, label.size, label.bold), y)
            assert not any(_overlap(box, n) for n in nodes.values()), f"label {label.text!r} covers a node"
    for shape in drawing.shapes:
        for x, y in shape.points:
            assert -1e-6 <= x <= drawing.width + 1e-6 and -1e-6 <= y <= drawing.height + 1e-6
    return drawing


def test_the_divergence_subgraph_is_drawn_cleanly(diverged: CompareResult) -> None:  # noqa: F811
    drawing = check_geometry(build_dot(diverged))
    texts = [s.text for s in drawing.shapes if s.kind == "text"]
    assert "FIRST DIVERGENCE" in texts and "gelu" in texts and "blocks.1.mlp.act" in texts


@pytest.mark.parametrize("max_nodes", [12, 60])
def test_a_big_selection_is_drawn_cleanly(tmp_path: Path, max_nodes: int) -> None:
    result = compared(tmp_path, wide_recipe(fan=30))
    check_geometry(build_dot(result, max_nodes=max_nodes))


def test_a_planar_graph_is_drawn_without_crossings() -> None:
    # A diamond inside a cluster, a chain beside it and a long edge that skips two ranks.
    text = """digraph { a -> b; a -> c; b -> d; c -> d; a -> d;
      subgraph cluster_0 { label="m"; b; c; }
      x -> y -> z; x -> z; }"""
    drawing = check_geometry(text)
    paths = {g.name: next(s for s in g.shapes if s.kind == "path").points for g in drawing.groups if g.kind == "edge"}

    def segments(points: list[tuple[float, float]]) -> list[tuple[tuple[float, float], tuple[float, float]]]:
        ends = points[::3]
        return list(zip(ends, ends[1:]))

    def cross(p: tuple[tuple[float, float], ...], q: tuple[tuple[float, float], ...]) -> bool:
        def orient(a: tuple[float, float], b: tuple[float, float], c: tuple[float, float]) -> float:
            return (b[0] - a[0]) * (c[1] - a[1]) - (b[1] - a[1]) * (c[0] - a[0])

        return orient(*p, q[0]) * orient(*p, q[1]) < -1e-6 and orient(*q, p[0]) * orient(*q, p[1]) < -1e-6

    for (a, pa), (b, pb) in itertools.combinations(paths.items(), 2):
        assert not any(cross(s, t) for s in segments(pa) for t in segments(pb)), f"{a} crosses {b}"


def test_dot_subset_is_read() -> None:
    graph = parse_dot("""digraph g {
      graph [label=<<B>title</B>>, fontsize=12];
      node [shape=box, fontsize=10];
      "a node" [label="two\\nlines", color="#ff0000"];
      subgraph cluster_x { label="outer"; subgraph cluster_y { label="inner"; b; } c -> b [label="2×3"]; }
      "a node" -> c;  // a comment
    }""")
    assert isinstance(graph.attrs["label"], Html) and graph.attrs["fontsize"] == "12"
    assert graph.nodes["a node"] == {"shape": "box", "fontsize": "10", "label": "two\\nlines", "color": "#ff0000"}
    assert [(t, h, a.get("label")) for t, h, a in graph.edges] == [("c", "b", "2×3"), ("a node", "c", None)]
    outer = graph.root.children[0]
    assert outer.attrs["label"] == "outer" and outer.children[0].attrs["label"] == "inner"
    assert graph.cluster_of["b"] is outer.children[0] and graph.cluster_of["c"] is outer


@pytest.mark.parametrize(
    "text", ["digraph { a -> ", "digraph { a [label=<unclosed] }", "digraph { a -> b; } }{", "graph"]
)
def test_broken_dot_text_is_a_clear_error(text: str) -> None:
    with pytest.raises(TracecmpError, match="DOT"):
        layout(text)
