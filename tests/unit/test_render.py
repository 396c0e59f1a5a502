"""The suspicious subgraph: selection, colours, DOT text, SVG/PNG through dot and, without dot,
through tracecmp's own layout (:mod:`tracecmp.render.dot`).

Results are real comparisons of hand-made traces (:mod:`tests.tracebuild`).
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.tracebuild import TraceBuilder, fake_stats, twin
from tracecmp.comparison import CompareResult, compare
from tracecmp.errors import TracecmpError
from tracecmp.render import render_subgraph
from tracecmp.render.subgraph import build_dot, diverged_fill, format_number, select, short_op

SVG = "{http://www.w3.org/2000/svg}"
needs_dot = pytest.mark.skipif(
    shutil.which("dot") is None and os.environ.get("CI", "").lower() in ("", "0", "false"),
    reason="graphviz 'dot' not installed (CI installs it)",
)
DIM, TOKENS = 16, 8


@pytest.fixture(params=[pytest.param("dot", marks=needs_dot), "own layout"])
def engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Who draws: graphviz's dot, or tracecmp's own layout with dot hidden."""
    if request.param == "own layout":
        monkeypatch.setattr(shutil, "which", lambda *args, **kwargs: None)
    return request.param


def transformer_recipe(
    layers: int = 3, fault_layer: int | None = 1, *, nan_layer: int | None = None, extra_op: bool = False
) -> Any:
    """Blocks of LayerNorm + GELU MLP with residuals, a loss and a backward op, from real tensors.

    In the target, block ``fault_layer``'s GELU is computed with the tanh approximation (same
    recorded arguments: a computation fault), block ``nan_layer``'s fc2 output holds an Inf, and
    ``extra_op`` adds an op the bench lacks.
    """

    def recipe(b: TraceBuilder, is_target: bool) -> None:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(TOKENS, DIM, generator=g)
        h, ref = x, b.source("input.0", x)
        for layer in range(layers):
            m = f"blocks.{layer}"
            w1 = torch.randn(4 * DIM, DIM, generator=g) / DIM**0.5
            w2 = torch.randn(DIM, 4 * DIM, generator=g) / (4 * DIM) ** 0.5
            ln = F.layer_norm(h, (DIM,))
            r_ln = b.op(
                "aten.native_layer_norm.default", [ref], ln, module=f"{m}.ln", location=f"model.py:{10 + layer}"
            )
            r_w1t = b.view("aten.t.default", b.param(f"{m}.mlp.fc1.weight", w1), (DIM, 4 * DIM), module=f"{m}.mlp.fc1")
            a = ln @ w1.t()
            r_a = b.op("aten.mm.default", [r_ln, r_w1t], a, module=f"{m}.mlp.fc1", location="model.py:30")
            tanh = is_target and layer == fault_layer
            act = F.gelu(a, approximate="tanh") if tanh else F.gelu(a)
            r_act = b.op(
                "aten.gelu.default",
                [r_a],
                act,
                module=f"{m}.mlp.act",
                location="model.py:31",
                stack="train.py:5 in main\nmodel.py:31 in forward",
            )
            r_w2t = b.view("aten.t.default", b.param(f"{m}.mlp.fc2.weight", w2), (4 * DIM, DIM), module=f"{m}.mlp.fc2")
            o = act @ w2.t()
            if is_target and layer == nan_layer:
                o = o.clone()
                o[0, 0] = float("inf")
            r_o = b.op("aten.mm.default", [r_act, r_w2t], o, module=f"{m}.mlp.fc2", location="model.py:32")
            if extra_op and is_target and layer == 0:
                o = o.contiguous()
                r_o = b.op("aten.clone.default", [r_o], o, module=f"{m}.mlp.fc2", location="model.py:32")
            h = h + o
            ref = b.op("aten.add.Tensor", [ref, r_o], h, module=m, location="model.py:40")
        loss = h.square().mean()
        r_loss = b.op("aten.mean.default", [ref], loss, location="train.py:4")
        b.op("aten.mul.Tensor", [r_loss, ref], 2 * h / h.numel(), phase="backward", location="train.py:5")

    return recipe


def compared(tmp_path: Path, recipe: Any, **kw: Any) -> CompareResult:
    twin(recipe, tmp_path / "target", tmp_path / "bench", **kw)
    return compare(tmp_path / "target", tmp_path / "bench")


def diverged_result(tmp_path: Path, **kw: Any) -> CompareResult:
    """The tanh-GELU fault in blocks.1: the root is that GELU."""
    result = compared(tmp_path, transformer_recipe(**kw))
    assert result.first_divergence is not None and result.first_divergence.module == "blocks.1.mlp.act"
    return result


@pytest.fixture(scope="module")
def diverged(tmp_path_factory: pytest.TempPathFactory) -> CompareResult:
    """One comparison shared by the tests that only read it."""
    return diverged_result(tmp_path_factory.mktemp("diverged"))


def wide_recipe(fan: int = 400) -> Any:
    """A root with ``fan`` producers and ``fan`` consumers, each consumer feeding two more ops."""

    def recipe(b: TraceBuilder, is_target: bool) -> None:
        shape = (4, 4)
        inputs = [b.op("aten.randn.default", [], shape=shape, module=f"in.{i % 7}") for i in range(fan)]
        bad = dict(stats=fake_stats(shape, mean=0.5)) if is_target else {}
        root = b.op("aten.stack.default", inputs, shape=shape, module="mix", **bad)
        for i in range(fan):
            c = b.op("aten.mul.Tensor", [root], shape=shape, module=f"out.{i % 5}", **bad)
            b.op("aten.relu.default", [c], shape=shape, module=f"out.{i % 5}", **bad)
            b.op("aten.sum.default", [c], shape=shape, module=f"out.{i % 5}", **bad)

    return recipe


def svg_nodes(path: Path) -> list[ET.Element]:
    assert path.suffix == ".svg", f"got {path.name}: is graphviz 'dot' installed?"
    return [g for g in ET.parse(path).getroot().iter(f"{SVG}g") if g.get("class") == "node"]


def svg_texts(element: ET.Element) -> list[str]:
    return [t.text or "" for t in element.iter(f"{SVG}text")]


def node_id(result: CompareResult, op: str, module: str) -> int:
    rows = result.nodes[(result.nodes["op"] == op) & (result.nodes["module"] == module)]
    return int(rows["op_id"].iloc[0])


# --- tests ---------------------------------------------------------------------------------------


def test_short_names_and_numbers() -> None:
    assert short_op("aten.gelu.default") == "gelu"
    assert short_op("aten.add.Tensor") == "add"
    assert short_op("aten._softmax.default") == "_softmax"
    assert short_op("npu.fused_x.default") == "npu.fused_x"
    assert [format_number(x) for x in (25000.0, 1400, 0.25, float("nan"), 0, 1e-5)] == [
        "2.5e4",
        "1400",
        "0.25",
        "nan",
        "0",
        "1e-5",
    ]


def test_diverged_colour_goes_from_orange_to_red_with_error() -> None:
    low, _ = diverged_fill(10.0, 10.0, 1e4)
    middle, _ = diverged_fill(300.0, 10.0, 1e4)
    high, font = diverged_fill(1e4, 10.0, 1e4)
    assert low == "#fdae61" and high == "#d73027" and font == "#ffffff"
    green = [int(colour[3:5], 16) for colour in (low, middle, high)]
    assert green[0] > green[1] > green[2]  # the green channel falls: orange turns red


def test_svg_is_valid_xml_with_root_label_and_its_module_cluster(
    diverged: CompareResult, tmp_path: Path, engine: str
) -> None:
    result = diverged
    written = render_subgraph(result, tmp_path / "divergence.svg")
    assert written == tmp_path / "divergence.svg"
    svg = ET.parse(written).getroot()
    clusters = {" ".join(svg_texts(g)) for g in svg.iter(f"{SVG}g") if g.get("class") == "cluster"}
    assert "blocks.1.mlp.act" in clusters
    root = result.first_divergence.op_id
    root_node = next(g for g in svg_nodes(written) if g.findtext(f"{SVG}title") == f"n{root}")
    texts = svg_texts(root_node)
    assert {"FIRST DIVERGENCE", "gelu", "blocks.1.mlp.act"} <= set(texts)
    assert f"{TOKENS}×{4 * DIM} f32" in texts
    assert any(t.startswith("err ") and t.endswith(" u") or " u · " in t for t in texts)
    # Two hops each way: fc1 and ln above, fc2 and the residual add below.
    shown = {g.findtext(f"{SVG}title") for g in svg_nodes(written)}
    near = [
        node_id(result, "aten.mm.default", "blocks.1.mlp.fc1"),
        node_id(result, "aten.native_layer_norm.default", "blocks.1.ln"),
        node_id(result, "aten.mm.default", "blocks.1.mlp.fc2"),
        node_id(result, "aten.add.Tensor", "blocks.1"),
    ]
    assert {f"n{n}" for n in near} <= shown


def test_views_are_folded_into_edge_labels(diverged: CompareResult) -> None:
    result = diverged
    fc1 = node_id(result, "aten.mm.default", "blocks.1.mlp.fc1")
    text = build_dot(result, depth=2)
    views = result.nodes.loc[result.nodes["kind"] == "view", "op_id"]
    assert len(views) and not any(re.search(rf"\bn{v} \[", text) for v in views)
    weight = int(result.nodes.loc[result.nodes["name"] == "blocks.1.mlp.fc1.weight", "op_id"].iloc[0])
    assert re.search(rf'n{weight} -> n{fc1} \[label="t ▸ {DIM}×{4 * DIM}"', text)


def test_without_dot_binary_the_own_layout_draws_the_picture(
    diverged: CompareResult, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        written = render_subgraph(diverged, tmp_path / "out" / "divergence.svg")
    assert written == tmp_path / "out" / "divergence.svg"
    assert "tracecmp's own layout" in written.read_text(encoding="utf-8")
    shown = {g.findtext(f"{SVG}title") for g in svg_nodes(written)}
    assert shown == {f"n{n}" for n in select(diverged).shown}


def test_dot_suffix_needs_no_binary(diverged: CompareResult, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    result = diverged
    monkeypatch.setattr(shutil, "which", lambda *args, **kwargs: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        written = result.render(tmp_path / "g.dot")
    assert written.read_text(encoding="utf-8").startswith("digraph")


def test_png_by_suffix(diverged: CompareResult, tmp_path: Path, engine: str) -> None:
    written = diverged.render(tmp_path / "g.png")
    data = written.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > 400 and height > 400 and len(data) > 20_000  # a drawing, not an empty canvas


def test_bad_requests_are_refused(diverged: CompareResult, tmp_path: Path) -> None:
    result = diverged
    with pytest.raises(TracecmpError, match=r"\.pdf"):
        render_subgraph(result, tmp_path / "g.pdf")
    with pytest.raises(TracecmpError, match="max_nodes"):
        render_subgraph(result, tmp_path / "g.dot", max_nodes=0)
    with pytest.raises(TracecmpError, match="depth"):
        render_subgraph(result, tmp_path / "g.dot", depth=-1)


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> CompareResult:
    result = compared(tmp_path_factory.mktemp("wide"), wide_recipe())
    assert result.first_divergence is not None and result.first_divergence.op == "aten.stack.default"
    return result


@pytest.mark.parametrize("max_nodes", [5, 30, 60])
def test_node_count_is_bounded_on_a_big_graph(wide: CompareResult, tmp_path: Path, max_nodes: int, engine: str) -> None:
    written = render_subgraph(wide, tmp_path / "big.svg", max_nodes=max_nodes)
    nodes = svg_nodes(written)
    assert len(nodes) <= max_nodes
    titles = {g.findtext(f"{SVG}title") for g in nodes}
    assert f"n{wide.first_divergence.op_id}" in titles
    hidden = sum(int(m.group(1)) for g in nodes for t in svg_texts(g) if (m := re.match(r"\+(\d+) more", t)))
    real = sum(1 for t in titles if t and t.startswith("n"))
    assert real + hidden == 400 + 1 + 400 + 800  # everything within two hops is shown or counted


def test_selection_prefers_near_nodes(wide: CompareResult) -> None:
    sel = select(wide, depth=2, max_nodes=20)
    assert sel.shown[0] == wide.first_divergence.op_id
    assert len(sel.shown) + len(sel.more) <= 20
    assert (len(select(wide, max_nodes=1).shown), select(wide, max_nodes=1).more) == (1, [])
    ops = wide.nodes.set_index("op_id")["op"]
    # Direct producers and consumers come before anything two hops away.
    distances = [
        0 if n == sel.shown[0] else 2 if ops[n] in ("aten.relu.default", "aten.sum.default") else 1 for n in sel.shown
    ]
    assert distances == sorted(distances)


def test_identical_runs_get_a_clear_no_divergence_graph(tmp_path: Path) -> None:
    result = compared(tmp_path, transformer_recipe(fault_layer=None))
    assert result.agrees
    text = build_dot(result)
    assert "No divergence: the runs agree" in text and " -> " not in text


def noisy_recipe(b: TraceBuilder, is_target: bool) -> None:
    """Every op's output a rounding unit or so off, as another device or kernel order gives."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(TOKENS, DIM, generator=g)
    ref = b.source("input.0", x)
    for i in range(40):
        y = torch.tanh(x * (1 + i / 40))
        if is_target:
            y = y * (1 + 2**-23 * torch.randn(y.shape, generator=g))
        r_y = b.op("aten.tanh.default", [ref], y, module=f"layers.{i // 10}")
        b.op("aten.mul.Tensor", [r_y], y * 2, module=f"layers.{i // 10}")


def test_agreeing_runs_show_the_largest_difference(tmp_path: Path, engine: str) -> None:
    result = compared(tmp_path, noisy_recipe)
    assert result.first_divergence is None and result.agrees
    written = render_subgraph(result, tmp_path / "agree.svg")
    texts = [t.text or "" for t in ET.parse(written).getroot().iter(f"{SVG}text")]
    assert "No divergence: the runs agree" in texts and "LARGEST ERROR" in texts
    errors = result.nodes.set_index("op_id")["error"].astype(float)
    assert f"n{errors.idxmax()}" in {g.findtext(f"{SVG}title") for g in svg_nodes(written)}


def test_could_not_compare_is_never_drawn_as_agreement(tmp_path: Path) -> None:
    result = compared(tmp_path, transformer_recipe(fault_layer=None), complete=False)
    assert not result.agrees and result.first_divergence is None
    text = build_dot(result)
    assert "Could not compare" in text and "the runs agree" not in text


def test_nan_root_and_region_box(tmp_path: Path) -> None:
    result = compared(tmp_path, transformer_recipe(fault_layer=None, nan_layer=1, extra_op=True))
    d = result.first_divergence
    assert d is not None and d.kind == "nan" and d.module == "blocks.1.mlp.fc2"
    text = build_dot(result, depth=3)
    assert re.search(rf'n{d.op_id} \[label=<.*1 Inf \(first\).*fillcolor="#2d004b".*fontcolor="#ffffff"', text)
    # The extra op the bench lacks is a one-sided region: drawn in a box that says so.
    (region,) = result.regions
    (clone,) = region.target_ops
    text = build_dot(result, depth=60, max_nodes=200)
    box = re.search(rf"subgraph cluster_region{region.region_id}_\d+ {{(.*?)\n\s*}}", text, re.S)
    assert box is not None and f"n{clone} [" in box.group(1)
    assert "pass-through" in box.group(1) and "bench: nothing (target-only ops)" in box.group(1)
