"""The HTML report: verdict, first divergence, chart, tables, counts; self-contained; without dot."""

from __future__ import annotations

import re
import shutil
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import pandas as pd
import pytest

from tests.unit.test_render import compared, diverged, needs_dot, noisy_recipe, transformer_recipe  # noqa: F401
from tracecmp.comparison import CompareResult
from tracecmp.render import write_report
from tracecmp.render.chart import error_chart
from tracecmp.render.html import module_rollup

SVG = "{http://www.w3.org/2000/svg}"


class _Page(HTMLParser):
    """What a self-containment check needs: external references, script sources, element ids."""

    def __init__(self) -> None:
        super().__init__()
        self.external: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if values.get("id"):
            self.ids.add(values["id"] or "")
        if tag in ("link", "iframe", "object", "embed") or (tag == "script" and values.get("src")):
            self.external.append(f"<{tag}>")
        for name in ("src", "href", "xlink:href", "action"):
            value = values.get(name) or ""
            if re.match(r"\s*((https?|ftp|data):|//)", value):
                self.external.append(value)


@pytest.fixture(scope="module")
def report(diverged: CompareResult, tmp_path_factory: pytest.TempPathFactory) -> str:  # noqa: F811
    path = write_report(diverged, tmp_path_factory.mktemp("report") / "out")
    assert path.name == "report.html"
    assert (path.parent / "divergence.svg").exists() or (path.parent / "divergence.dot").exists()
    return path.read_text(encoding="utf-8")


def test_report_holds_verdict_first_divergence_chart_and_tables(report: str, diverged: CompareResult) -> None:  # noqa: F811
    verdict = re.search(r'<div class="verdict (\w+)" id="verdict">(.*?)</div>', report)
    assert verdict and verdict.group(1) == "diverged"
    assert "DIVERGED" in verdict.group(
        2
    ) and "aten.gelu.default in blocks.1.mlp.act (forward, step 0)" in verdict.group(2)
    assert "<code>aten.gelu.default</code>" in report and "<code>model.py:31</code>" in report  # op and source line
    assert "train.py:5 in main\nmodel.py:31 in forward" in report  # the stack
    chart = re.search(r'<svg xmlns="http://www.w3.org/2000/svg" class="chart".*?</svg>', report, re.S)
    assert chart and "first divergence: gelu (blocks.1.mlp.act)" in chart.group(0)
    ET.fromstring(chart.group(0))  # well-formed SVG
    suspects = report[report.index('id="suspects-table"') :]
    assert re.search(r'<tr class="first">.*?<code>gelu</code>.*?blocks\.1\.mlp\.act', suspects, re.S)
    modules = report[report.index('id="modules-table"') :]
    assert modules.index("<code>blocks.1.mlp.act</code>") < modules.index("<code>blocks.2.mlp.fc1</code>")
    for name, value in diverged.counts().items():
        assert f"<b>{value}</b><span>{name}</span>" in report


def test_report_is_self_contained(report: str) -> None:
    page = _Page()
    page.feed(report)
    assert page.external == []
    assert "@import" not in report and "url(" not in report
    assert {"verdict", "first-divergence", "subgraph", "chart", "suspects", "modules"} <= page.ids


@needs_dot
def test_report_inlines_the_subgraph_svg(report: str) -> None:
    figure = report[report.index('id="subgraph"') : report.index('id="chart"')]
    assert "<svg" in figure and "<?xml" not in figure and "<!DOCTYPE" not in figure
    assert "FIRST DIVERGENCE" in figure


def test_report_without_dot_inlines_the_own_layout(
    diverged: CompareResult,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(shutil, "which", lambda *args, **kwargs: None)
    html = write_report(diverged, tmp_path).read_text(encoding="utf-8")
    figure = html[html.index('id="subgraph"') : html.index('id="chart"')]
    assert "<svg" in figure and "tracecmp's own layout" in figure and "FIRST DIVERGENCE" in figure
    assert (tmp_path / "divergence.svg").exists() and not (tmp_path / "divergence.dot").exists()


def test_agree_verdict(tmp_path: Path) -> None:
    result = compared(tmp_path / "runs", noisy_recipe)
    html = write_report(result, tmp_path / "out").read_text(encoding="utf-8")
    assert re.search(r'<div class="verdict agree" id="verdict">AGREE', html)
    assert "No first divergence. Largest difference:" in html


def test_incomplete_trace_is_could_not_compare_and_flagged(tmp_path: Path) -> None:
    result = compared(tmp_path / "runs", transformer_recipe(fault_layer=None), complete=False)
    html = write_report(result, tmp_path / "out").read_text(encoding="utf-8")
    assert re.search(r'<div class="verdict incomplete" id="verdict">INCOMPLETE', html)
    assert 'class="verdict agree"' not in html
    assert re.search(r'<div class="warn">Warning: the target trace is incomplete', html)


def test_module_rollup_puts_the_introducing_module_first(diverged: CompareResult) -> None:  # noqa: F811
    table = module_rollup(diverged.nodes)
    assert table.iloc[0]["module"] == "blocks.1.mlp.act" and table.iloc[0]["first_diverged"] == "gelu"
    by_module = table.set_index("module")
    assert by_module.loc["blocks.0.mlp.act", "diverged"] == 0
    assert by_module.loc["blocks.2.mlp.fc1", "diverged"] >= 1  # downstream modules carry the error...
    assert by_module.loc["blocks.2.mlp.fc1", "max_introduced"] < table.iloc[0]["max_introduced"]  # ...not introduce it


def test_chart_marks_root_bands_and_thins_long_runs() -> None:
    rows = []
    for i in range(20_000):
        phase = "forward" if i < 8_000 else "backward" if i < 18_000 else "optimizer"
        error = 0.0 if i % 3 == 0 else (1e5 if i == 12_346 else 1.0 + i % 7)
        status = "nan" if i == 15_000 else ("diverged" if i >= 9_000 else "noise")
        rows.append(
            dict(
                rank=0,
                op_id=i,
                step=i // 10_000,
                phase=phase,
                kind="op",
                op="aten.mul.Tensor",
                module="m",
                status=status,
                error=error,
            )
        )
    root = ET.fromstring(error_chart(pd.DataFrame(rows), root=9_000))
    circles = root.findall(f"{SVG}circle")
    assert len(circles) < 6_000  # thinned to about one point per pixel column and phase
    tips = [c.findtext(f"{SVG}title") or "" for c in circles]
    assert any("op 12346 " in t for t in tips)  # the spike survives thinning
    assert any("op 15000 " in t and "nan" in t for t in tips)  # so does the NaN
    assert any("op 9000 " in t for t in tips)  # and the root
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert {"NaN/Inf", "= 0", "step 0", "step 1", "forward", "backward", "optimizer"} <= set(texts)
    assert "first divergence: mul (m)" in texts
    assert "1e5" in texts  # the log axis reaches the largest error
