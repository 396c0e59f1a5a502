"""The HTML report: verdict, first divergence, chart, tables, counts; self-contained; dot fallback."""
from __future__ import annotations

import re
import shutil
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import pandas as pd
import pytest

from test_render import Builder, needs_dot, transformer
from tracecmp.render import write_report
from tracecmp.render.chart import error_chart
from tracecmp.render.html import module_rollup, status_counts


class _Page(HTMLParser):
    """Collects what a self-containment check needs: external references, scripts, ids, tables."""

    def __init__(self) -> None:
        super().__init__()
        self.external: list[str] = []
        self.ids: set[str] = set()
        self.script_src: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if "id" in values:
            self.ids.add(values["id"] or "")
        if tag == "script" and values.get("src"):
            self.script_src.append(values["src"] or "")
        for name in ("src", "href", "xlink:href"):
            value = values.get(name) or ""
            if re.match(r"(https?:)?//", value):
                self.external.append(value)
        if tag == "link":
            self.external.append(values.get("href") or "<link>")


def test_report_holds_verdict_first_divergence_chart_and_tables(tmp_path: Path) -> None:
    builder, root = transformer()
    path = write_report(builder.result(root), tmp_path / "out")
    assert path == tmp_path / "out" / "report.html"
    html = path.read_text(encoding="utf-8")
    verdict = re.search(r'<div class="verdict (\w+)" id="verdict">(.*?)</div>', html)
    assert verdict and verdict.group(1) == "diverged"
    assert "gelu in blocks.1.mlp.act (forward, step 0)" in verdict.group(2)
    assert "<code>aten.gelu.default</code>" in html and f"model.py:{root}" in html
    assert "train.py:42 in main" in html  # the stack
    chart = re.search(r'<svg xmlns="http://www.w3.org/2000/svg" class="chart".*?</svg>', html, re.S)
    assert chart and "first divergence: gelu (blocks.1.mlp.act)" in chart.group(0)
    ET.fromstring(chart.group(0))  # the chart is well-formed SVG
    assert 'id="suspects-table"' in html and 'id="modules-table"' in html
    assert (tmp_path / "out" / "divergence.svg").exists() or (tmp_path / "out" / "divergence.dot").exists()


def test_report_is_self_contained(tmp_path: Path) -> None:
    builder, root = transformer()
    html = write_report(builder.result(root), tmp_path).read_text(encoding="utf-8")
    page = _Page()
    page.feed(html)
    assert page.external == [] and page.script_src == []
    assert "@import" not in html and "url(" not in html
    assert {"verdict", "first-divergence", "subgraph", "chart", "suspects", "modules"} <= page.ids


@needs_dot
def test_report_inlines_the_subgraph_svg(tmp_path: Path) -> None:
    builder, root = transformer()
    html = write_report(builder.result(root), tmp_path).read_text(encoding="utf-8")
    figure = html[html.index('id="subgraph"') : html.index('id="chart"')]
    assert "<svg" in figure and "<?xml" not in figure and "<!DOCTYPE svg" not in figure
    assert "FIRST DIVERGENCE" in figure


def test_report_without_dot_shows_the_dot_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda *args, **kwargs: None)
    builder, root = transformer()
    with pytest.warns(RuntimeWarning):
        html = write_report(builder.result(root), tmp_path).read_text(encoding="utf-8")
    figure = html[html.index('id="subgraph"') : html.index('id="chart"')]
    assert "graphviz <code>dot</code> is not installed" in figure
    assert "<pre>digraph divergence {" in figure
    assert (tmp_path / "divergence.dot").exists() and not (tmp_path / "divergence.svg").exists()


def test_agree_and_could_not_compare_verdicts(tmp_path: Path) -> None:
    builder = Builder()
    a = builder.add("aten.mm.default", "fc", status="noise", error=0.5)
    builder.add("aten.relu.default", "act", (a,), status="agrees", error=0.0)
    html = write_report(builder.result(None, agrees=True), tmp_path / "a").read_text(encoding="utf-8")
    assert 'class="verdict agree"' in html and "Agree" in html

    partial = Builder()
    b = partial.add("aten.mm.default", "fc", status="agrees", error=0.0)
    partial.add("aten.npu_fused.default", "act", (b,), status="unpaired", error=float("nan"))
    html = write_report(partial.result(None, agrees=False), tmp_path / "b").read_text(encoding="utf-8")
    assert 'class="verdict incomplete"' in html and "Could not compare" in html
    assert 'class="verdict agree"' not in html


def test_incomplete_trace_is_flagged(tmp_path: Path) -> None:
    builder, root = transformer()
    html = write_report(builder.result(root, complete=False), tmp_path).read_text(encoding="utf-8")
    assert re.search(r'<div class="warn">The target trace is incomplete', html)


def test_counts_and_module_rollup() -> None:
    builder, root = transformer()
    builder.add("aten.npu_only.default", "head", status="unpaired", error=float("nan"))
    result = builder.result(root)
    counts = status_counts(result)
    views = sum(1 for r in builder.rows if r["kind"] == "view")
    assert counts["target nodes"] == len(builder.rows) - views
    assert counts["unpaired target"] == 1 and counts["paired"] == counts["target nodes"] - 1
    assert counts["diverged"] == sum(1 for r in builder.rows if r["status"] == "diverged")
    table = module_rollup(result.nodes)
    assert table.iloc[0]["module"] == "blocks.1.mlp.act"  # the module that introduced the error comes first
    assert table.iloc[0]["first_diverged"] == "gelu"
    assert table.set_index("module").loc["blocks.2.attn", "diverged"] == 3


def test_chart_marks_root_bands_and_thins_long_runs() -> None:
    rows = []
    for i in range(20_000):
        phase = "forward" if i < 8_000 else "backward" if i < 18_000 else "optimizer"
        error = 0.0 if i % 3 == 0 else (1e5 if i == 12_346 else 1.0 + i % 7)
        status = "nan" if i == 15_000 else ("diverged" if i >= 9_000 else "noise")
        rows.append(dict(rank=0, op_id=i, step=i // 10_000, phase=phase, kind="op", op="aten.mul.Tensor",
                         module="m", status=status, error=error))
    svg = error_chart(pd.DataFrame(rows), root=9_000)
    root = ET.fromstring(svg)
    circles = root.findall("{http://www.w3.org/2000/svg}circle")
    assert len(circles) < 6_000  # thinned to about one point per pixel column and phase
    tips = [c.findtext("{http://www.w3.org/2000/svg}title") or "" for c in circles]
    assert any("op 12346 " in t for t in tips)  # the spike survives thinning
    assert any("op 15000 " in t and "nan" in t for t in tips)  # so does the NaN
    assert any("op 9000 " in t for t in tips)  # and the root
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert {"NaN/Inf", "= 0", "step 0", "step 1", "forward", "backward", "optimizer"} <= set(texts)
    assert "first divergence: mul (m)" in texts
    assert "1e5" in texts  # log axis reaches the largest error
