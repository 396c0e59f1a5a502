"""The suspicious subgraph: selection, colours, DOT text, SVG/PNG through dot, fallback without dot."""
from __future__ import annotations

import os
import re
import shutil
import warnings
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import networkx as nx
import pandas as pd
import pytest

from tracecmp.compare.records import Divergence
from tracecmp.errors import TracecmpError
from tracecmp.render import render_subgraph
from tracecmp.render.subgraph import build_dot, diverged_fill, format_number, select, short_op

SVG = "{http://www.w3.org/2000/svg}"
needs_dot = pytest.mark.skipif(
    shutil.which("dot") is None and not os.environ.get("CI"), reason="graphviz 'dot' not installed (CI installs it)"
)


# --- a stand-in CompareResult: the agreed attributes, built by hand -----------------------------


@dataclass
class _Rank:
    tensors: pd.DataFrame
    device: str = "cpu"


@dataclass
class _Trace:
    path: str
    tensors: pd.DataFrame
    complete: bool = True
    manifest: dict = field(default_factory=lambda: {"versions": {"torch": "2.13.0"}})
    ranks: list = field(default_factory=lambda: [0])

    def rank(self, rank: int = 0) -> _Rank:
        return _Rank(self.tensors)


@dataclass
class FakeResult:
    target: _Trace
    bench: _Trace
    first_divergence: Divergence | None
    suspects: list
    agrees: bool
    nodes: pd.DataFrame
    unpaired_bench: pd.DataFrame
    _graph: nx.DiGraph

    def graph(self, rank: int = 0, step: int | None = None) -> nx.DiGraph:
        return self._graph


class Builder:
    """Appends ops to a one-rank, one-step target graph and makes a FakeResult of it."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.graph = nx.DiGraph()
        self.shapes: dict[int, list[int]] = {}

    def add(self, op: str, module: str = "", inputs: tuple[int, ...] = (), *, kind: str = "op", status: str = "agrees",
            error: float = 0.0, introduced: float = 0.0, shape: tuple[int, ...] = (2, 8), phase: str = "forward",
            name: str = "", step: int = 0) -> int:
        op_id = len(self.rows)
        self.rows.append(dict(rank=0, op_id=op_id, bench_op_id=None if status == "unpaired" else op_id, step=step,
                              phase=phase, kind=kind, op=op, module=module, location=f"model.py:{op_id}",
                              status=status, error=error if kind != "view" else float("nan"),
                              introduced=introduced, metric="", name=name))
        self.graph.add_node(op_id, op=op, kind=kind, module=module)
        self.shapes[op_id] = list(shape)
        for producer in inputs:
            self.graph.add_edge(producer, op_id, tensor_id=producer, shape=self.shapes[producer], dtype="float32")
        return op_id

    def result(self, root: int | None, *, agrees: bool = False, complete: bool = True, kind: str = "computation") -> FakeResult:
        nodes = pd.DataFrame(self.rows)
        tensors = pd.DataFrame(
            dict(tensor_id=list(self.shapes), op_id=list(self.shapes), index=0, shape=list(self.shapes.values()),
                 dtype="float32")
        )
        first = None
        if root is not None:
            row = self.rows[root]
            first = Divergence(op=row["op"], module=row["module"], phase=row["phase"], step=row["step"],
                               location=row["location"], op_id=root, bench_op_id=root, kind=kind,
                               reason="output diverges while its inputs agree", score=row["introduced"],
                               metrics={"rel_err": 3e-3}, stack="train.py:42 in main\nmodel.py:9 in forward")
        return FakeResult(_Trace("runs/target", tensors, complete), _Trace("runs/bench", tensors), first,
                          [first] if first else [], agrees, nodes, pd.DataFrame(), self.graph)


def transformer(layers: int = 3, fault_layer: int = 1) -> tuple[Builder, int]:
    """Embedding, blocks of attention + GELU MLP, head, with GELU in ``fault_layer`` as the root."""
    b = Builder()
    tokens = b.add("source.input", "", kind="source", name="input.0", shape=(2, 16))
    weight = b.add("source.parameter", "embed", kind="source", name="embed.weight", shape=(64, 32))
    h = b.add("aten.embedding.default", "embed", (weight, tokens), shape=(2, 16, 32))
    bad, root = False, -1

    def state(error: float) -> dict[str, Any]:
        return dict(status="diverged", error=error) if bad else dict(status="noise", error=0.5)

    for layer in range(layers):
        m = f"blocks.{layer}"
        ln = b.add("aten.native_layer_norm.default", f"{m}.ln1", (h,), shape=(2, 16, 32), **state(300))
        w = b.add("source.parameter", f"{m}.attn.qkv", kind="source", name=f"{m}.attn.qkv.weight", shape=(96, 32))
        wt = b.add("aten.t.default", f"{m}.attn.qkv", (w,), kind="view", shape=(32, 96))
        flat = b.add("aten.view.default", f"{m}.attn.qkv", (ln,), kind="view", shape=(32, 32))
        qkv = b.add("aten.addmm.default", f"{m}.attn.qkv", (flat, wt), shape=(32, 96), **state(500))
        scores = b.add("aten.bmm.default", f"{m}.attn", (qkv,), shape=(8, 16, 16), **state(800))
        probs = b.add("aten._softmax.default", f"{m}.attn", (scores,), shape=(8, 16, 16), **state(400))
        ctx = b.add("aten.bmm.default", f"{m}.attn", (probs, qkv), shape=(2, 16, 32), **state(600))
        h = b.add("aten.add.Tensor", m, (h, ctx), shape=(2, 16, 32), **state(700))
        ln2 = b.add("aten.native_layer_norm.default", f"{m}.ln2", (h,), shape=(2, 16, 32), **state(700))
        fc1 = b.add("aten.addmm.default", f"{m}.mlp.fc1", (ln2,), shape=(32, 128), **state(900))
        if layer == fault_layer:
            act = b.add("aten.gelu.default", f"{m}.mlp.act", (fc1,), shape=(32, 128), status="diverged",
                        error=2.5e4, introduced=2.5e4)
            root, bad = act, True
        else:
            act = b.add("aten.gelu.default", f"{m}.mlp.act", (fc1,), shape=(32, 128), **state(1e3))
        fc2 = b.add("aten.addmm.default", f"{m}.mlp.fc2", (act,), shape=(32, 32), **state(1.2e4))
        h = b.add("aten.add.Tensor", m, (h, fc2), shape=(2, 16, 32), **state(1e4))
    logits = b.add("aten.mm.default", "head", (h,), shape=(32, 64), **state(5e3))
    b.add("aten._log_softmax_backward_data.default", "", (logits,), shape=(32, 64), phase="backward", **state(3e3))
    return b, root


def svg_nodes(path: Path) -> list[ET.Element]:
    root = ET.parse(path).getroot()
    return [g for g in root.iter(f"{SVG}g") if g.get("class") == "node"]


def svg_texts(element: ET.Element) -> list[str]:
    return [t.text or "" for t in element.iter(f"{SVG}text")]


# --- tests ---------------------------------------------------------------------------------------


def test_short_names_and_numbers() -> None:
    assert short_op("aten.gelu.default") == "gelu"
    assert short_op("aten.add.Tensor") == "add"
    assert short_op("aten._softmax.default") == "_softmax"
    assert short_op("npu.fused_x.default") == "npu.fused_x"
    assert format_number(25000.0) == "2.5e4"
    assert format_number(0.25) == "0.25"
    assert format_number(float("nan")) == "nan"
    assert format_number(0) == "0"


def test_diverged_colour_goes_from_orange_to_red_with_error() -> None:
    low, _ = diverged_fill(10.0, 10.0, 1e4)
    high, font = diverged_fill(1e4, 10.0, 1e4)
    middle, _ = diverged_fill(300.0, 10.0, 1e4)
    assert low == "#fdae61" and high == "#d73027" and font == "#ffffff"
    green = [int(colour[3:5], 16) for colour in (low, middle, high)]
    assert green[0] > green[1] > green[2]  # the green channel falls: orange turns red


@needs_dot
def test_svg_is_valid_xml_with_root_label_and_its_module_cluster(tmp_path: Path) -> None:
    builder, root = transformer()
    written = render_subgraph(builder.result(root), tmp_path / "divergence.svg")
    assert written == tmp_path / "divergence.svg"
    svg = ET.parse(written).getroot()
    clusters = {" ".join(svg_texts(g)) for g in svg.iter(f"{SVG}g") if g.get("class") == "cluster"}
    assert "blocks.1.mlp.act" in clusters
    root_node = next(g for g in svg_nodes(written) if g.findtext(f"{SVG}title") == f"n{root}")
    texts = svg_texts(root_node)
    assert "FIRST DIVERGENCE" in texts and "gelu" in texts and "blocks.1.mlp.act" in texts
    assert any("32×128" in t and "f32" in t for t in texts)
    assert any("2.5e4" in t for t in texts)
    # Producers and consumers within two hops are there: fc1 and ln2 above, fc2 and the residual add below.
    shown = {g.findtext(f"{SVG}title") for g in svg_nodes(written)}
    assert {f"n{root - 1}", f"n{root - 2}", f"n{root + 1}", f"n{root + 2}"} <= shown


def test_views_are_folded_into_edge_labels() -> None:
    builder, _ = transformer()
    qkv = next(r["op_id"] for r in builder.rows if r["module"] == "blocks.1.attn.qkv" and r["kind"] == "op")
    text = build_dot(builder.result(qkv), depth=1)
    view_ids = [r["op_id"] for r in builder.rows if r["kind"] == "view"]
    assert not any(re.search(rf"\bn{v} \[", text) for v in view_ids)
    weight = qkv - 3
    assert re.search(rf'n{weight} -> n{qkv} \[label="t ▸ 32×96"', text)
    assert re.search(rf'n{qkv - 4} -> n{qkv} \[label="view ▸ 32×32"', text)  # ln1 through the flattening view


def test_dot_fallback_without_dot_binary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(shutil, "which", lambda *args, **kwargs: None)
    builder, root = transformer()
    with pytest.warns(RuntimeWarning, match="dot") as caught:
        written = render_subgraph(builder.result(root), tmp_path / "out" / "divergence.svg")
    assert len(caught) == 1
    assert written == tmp_path / "out" / "divergence.dot"
    assert not (tmp_path / "out" / "divergence.svg").exists()
    text = written.read_text(encoding="utf-8")
    assert text.startswith("digraph divergence {") and text.rstrip().endswith("}")
    assert "FIRST DIVERGENCE" in text and 'label="blocks.1.mlp.act"' in text


def test_dot_suffix_needs_no_binary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda *args, **kwargs: None)
    builder, root = transformer()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        written = render_subgraph(builder.result(root), tmp_path / "g.dot")
    assert written.read_text(encoding="utf-8").startswith("digraph")


@needs_dot
def test_png_by_suffix(tmp_path: Path) -> None:
    builder, root = transformer()
    written = render_subgraph(builder.result(root), tmp_path / "g.png")
    assert written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_suffix_is_refused(tmp_path: Path) -> None:
    builder, root = transformer()
    with pytest.raises(TracecmpError, match=r"\.pdf"):
        render_subgraph(builder.result(root), tmp_path / "g.pdf")
    with pytest.raises(TracecmpError, match="max_nodes"):
        render_subgraph(builder.result(root), tmp_path / "g.dot", max_nodes=0)


def wide_graph(fan: int = 400) -> tuple[Builder, int]:
    """A root with ``fan`` producers and ``fan`` consumers, each consumer feeding two more ops."""
    b = Builder()
    sources = [b.add("aten.randn.default", f"in.{i % 7}", status="agrees") for i in range(fan)]
    root = b.add("aten.cat.default", "mix", tuple(sources), status="diverged", error=1e3, introduced=1e3)
    for i in range(fan):
        c = b.add("aten.mul.Tensor", f"out.{i % 5}", (root,), status="diverged", error=1e3 + i)
        b.add("aten.relu.default", f"out.{i % 5}", (c,), status="diverged", error=10.0)
        b.add("aten.sum.default", f"out.{i % 5}", (c,), status="diverged", error=5.0)
    return b, root


@needs_dot
@pytest.mark.parametrize("max_nodes", [5, 30, 60])
def test_node_count_is_bounded_on_a_big_graph(tmp_path: Path, max_nodes: int) -> None:
    builder, root = wide_graph()
    written = render_subgraph(builder.result(root), tmp_path / "big.svg", max_nodes=max_nodes)
    nodes = svg_nodes(written)
    assert len(nodes) <= max_nodes
    titles = {g.findtext(f"{SVG}title") for g in nodes}
    assert f"n{root}" in titles
    hidden = sum(int(m.group(1)) for g in nodes for t in svg_texts(g) if (m := re.match(r"\+(\d+) more", t)))
    real = sum(1 for t in titles if t and t.startswith("n"))
    assert real + hidden == 400 + 1 + 400 + 800  # everything within two hops is shown or counted


def test_selection_prefers_near_and_bad_nodes() -> None:
    builder, root = wide_graph(50)
    sel = select(builder.result(root), depth=2, max_nodes=20)
    assert sel.shown[0] == root
    assert len(sel.shown) + len(sel.more) <= 20
    consumers = [n for n in sel.shown if builder.rows[n]["op"] == "aten.mul.Tensor"]
    errors = [builder.rows[n]["error"] for n in consumers]
    assert errors and min(errors) >= max(
        r["error"] for r in builder.rows if r["op"] == "aten.mul.Tensor" and r["op_id"] not in sel.shown
    )


@needs_dot
def test_agreeing_runs_show_the_largest_error_region(tmp_path: Path) -> None:
    builder, _ = transformer()
    for row in builder.rows:
        row["status"] = "noise" if row["kind"] != "view" else row["status"]
    worst = max(range(len(builder.rows)), key=lambda i: builder.rows[i]["error"] if builder.rows[i]["kind"] == "op" else -1)
    written = render_subgraph(builder.result(None, agrees=True), tmp_path / "agree.svg")
    texts = [t for g in ET.parse(written).getroot().iter(f"{SVG}text") for t in [g.text or ""]]
    assert "No divergence: the runs agree" in texts
    assert "LARGEST ERROR" in texts
    assert f"n{worst}" in {g.findtext(f"{SVG}title") for g in svg_nodes(written)}


def test_all_equal_runs_get_a_clear_no_divergence_graph() -> None:
    builder = Builder()
    a = builder.add("aten.mm.default", "fc", error=0.0)
    builder.add("aten.relu.default", "act", (a,), error=0.0)
    text = build_dot(builder.result(None, agrees=True))
    assert "No divergence: the runs agree" in text and " -> " not in text


def test_could_not_compare_is_never_drawn_as_agreement() -> None:
    builder = Builder()
    a = builder.add("aten.mm.default", "fc", status="unpaired", error=float("nan"))
    builder.add("aten.relu.default", "act", (a,), status="uncompared", error=float("nan"))
    text = build_dot(builder.result(None, agrees=False))
    assert "Could not compare" in text and "the runs agree" not in text


def test_status_styles_in_dot() -> None:
    b = Builder()
    x = b.add("aten.mm.default", "a", status="agrees", error=0.1)
    y = b.add("aten.exp.default", "a", (x,), status="nan", error=float("inf"), introduced=float("inf"))
    z = b.add("aten.npu_only.default", "a", (y,), status="unpaired", error=float("nan"))
    text = build_dot(b.result(y, kind="nan"))
    assert re.search(rf'n{x} \[.*fillcolor="#a6dba0"', text)
    assert re.search(rf'n{y} \[.*fillcolor="#2d004b".*fontcolor="#ffffff"', text)
    assert re.search(rf'n{z} \[.*style="filled,rounded,dashed"', text)
    assert "no bench counterpart" in text
