"""The HTML report and the picture of a ``check``: the reports' shared pieces, in check's words.

The page reads top to bottom: the verdict (and whether the evidence is statistics only), the
first erring op with its source line and stack, the graph around it, the own error of every op
along the run, the ranked suspects, the modules, the ops that could not be judged and why, and
the capture filter for a re-run with tensors around the suspects.
"""

from __future__ import annotations

import math
from html import escape
from pathlib import Path
from typing import Any

import pandas as pd

from tracecmp.render.chart import error_chart
from tracecmp.render.html import (
    counts_html,
    figure_html,
    first_html,
    module_rollup,
    report_folder,
    summary_html,
    suspects_html,
    table_html,
    write_page,
)
from tracecmp.render.subgraph import build_dot, format_number, write_picture
from tracecmp.verdict.records import Divergence

REPORT_NAME = "check.html"
PICTURE_NAME = "check.svg"
# compare's legend and labels, as check says them.
_WORDS = (
    (">agrees<", ">pass<"),
    (">noise<", ">warning<"),
    (">diverged<", ">error<"),
    (">unpaired<", ">—<"),
    ("FIRST DIVERGENCE", "FIRST ERROR"),
    ("LARGEST ERROR", "LARGEST OWN ERROR"),
    (
        "err: output error in rounding units (u) of its dtype; own: what the op added itself",
        "err: own error against a float64 replay of its inputs, in rounding units (u) of its dtype",
    ),
    ("First divergence:", "First erring op:"),
    ("No divergence: the runs agree", "No op errs"),
    ("Could not compare: no divergence found, but not everything was compared", "No op errs among those judged"),
)


class _View:
    """A :class:`~tracecmp.checking.result.CheckResult` as compare's picture code reads a result."""

    def __init__(self, result: Any) -> None:
        self.result = result
        self.nodes = result.render_nodes()
        self.first_divergence = result.first_error
        self.suspects = result.suspects
        self.agrees = result.passed
        self.target = result.trace

    def graph(self, rank: int = 0, step: int | None = None) -> Any:
        return self.result.graph(rank=rank, step=step)


def _words(text: str) -> str:
    for old, new in _WORDS:
        text = text.replace(old, new)
    return text


def render_subgraph(result: Any, path: str | Path, depth: int = 2, max_nodes: int = 60) -> Path:
    """Draw the first erring op (or the worst op) with its producers and consumers; .svg/.png/.dot by suffix.

    >>> render_subgraph(tracecmp.check("runs/target"), "out/check.svg")   # doctest: +SKIP
    PosixPath('out/check.svg')
    """
    return write_picture(_words(build_dot(_View(result), depth=depth, max_nodes=max_nodes)), path)


def _first_html(result: Any) -> str:
    d = result.first_error
    if d is None:
        return '<p class="note">No op errs.</p>'
    metrics = ", ".join(f"{escape(k)} = {format_number(v)}" for k, v in d.metrics.items() if not _nan(v)) or "—"
    evidence = result._evidence_of(d)
    rows = [
        ("op", f"<code>{escape(d.op)}</code>"),
        ("module", f"<code>{escape(d.module or '<top>')}</code>"),
        ("where", f"{escape(d.phase)}, step {d.step}, rank {d.rank}"),
        ("source line", f"<code>{escape(d.location or '?')}</code>"),
        ("why", escape(d.reason)),
        ("evidence", escape(evidence)),
        ("beyond the standard", f"{format_number(d.score)}x"),
        ("metrics", metrics),
        ("node", f"op {d.op_id}"),
    ]
    return first_html(rows, d.stack)


def _check_cells(d: Divergence) -> str:
    score = d.score if math.isfinite(d.score) else 1e308
    return f'<td class="num" data-sort="{score!r}">{format_number(d.score)}x</td>'


def _modules_html(result: Any) -> str:
    nodes = result.render_nodes()
    erring = pd.to_numeric(result.nodes["score"], errors="coerce").where(result.nodes["status"] == "error")
    nodes = nodes.assign(introduced=erring)
    table = module_rollup(nodes)
    if table.empty:
        return '<p class="note">No modules.</p>'
    rows = []
    for row in table.itertuples():
        worst = "" if _nan(row.max_introduced) else format_number(row.max_introduced)
        rows.append(
            f'<tr><td><code>{escape(row.module or "<top>")}</code></td><td class="num">{row.ops}</td>'
            f'<td class="num">{row.diverged}</td><td class="num">{worst}</td>'
            f"<td>{escape(row.introduced_by)}</td><td><code>{escape(row.first_diverged)}</code></td></tr>"
        )
    return table_html(
        "modules-table",
        [
            ("module", False),
            ("ops", True),
            ("erring ops", True),
            ("worst (x the standard)", True),
            ("by", False),
            ("first erring op", False),
        ],
        rows,
    )


def _skipped_html(result: Any) -> str:
    table = result.skipped()
    if table.empty:
        return '<p class="note">Every op was judged.</p>'
    rows = (
        f'<tr><td class="num">{row.ops}</td><td>{escape(row.reason)}</td><td><code>{escape(row.names)}</code></td></tr>'
        for row in table.itertuples()
    )
    return table_html("skipped-table", [("ops", True), ("why skipped", False), ("ops such as", False)], rows)


def _nan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)


def write_report(result: Any, out_dir: str | Path, *, depth: int = 2, max_nodes: int = 60) -> Path:
    """Write ``out_dir/check.html`` (self-contained) and ``out_dir/check.svg``; returns the report's path.

    >>> write_report(tracecmp.check("runs/target"), "out")   # doctest: +SKIP
    PosixPath('out/check.html')
    """
    out = report_folder(out_dir)
    graph = figure_html(render_subgraph(result, out / PICTURE_NAME, depth=depth, max_nodes=max_nodes))
    sentence = result.verdict()
    counts = result.counts()
    css = "diverged" if result.first_error is not None else ("agree" if counts["pass"] else "incomplete")
    warnings = "".join(f'<div class="warn">Warning: {escape(w)}</div>' for w in result.warnings)
    notes = "".join(f"<li>{escape(n)}</li>" for n in result.notes)
    selection = result.selection()
    rerun = (
        f'<h2 id="rerun">Re-run with tensors around the suspects</h2><p class="note">Statistics for every op, whole '
        f"tensors only where it matters; then check again.</p><pre>{escape(selection.code(str(result.trace.path)))}</pre>"
        if selection is not None
        else ""
    )
    render_nodes = result.render_nodes()
    focus_rank = result.first_error.rank if result.first_error is not None else (result.ranks[0] if result.ranks else 0)
    chart = _words(
        error_chart(render_nodes, root=result.first_error.op_id if result.first_error else None, rank=focus_rank)
    )
    chart = chart.replace("first divergence:", "first error:")
    chart = chart.replace("output error (rounding units, log)", "own error (rounding units, log)")
    summary = summary_html(
        "tracecmp check",
        f"trace: <code>{escape(str(result.trace.path))}</code> · evidence: {escape(result.evidence)}",
        css,
        sentence,
        warnings,
        counts_html(counts, {"error": "bad", "skipped": "bad" if counts.get("skipped") else ""}),
    )
    body = f"""{summary}
<h2 id="first-error">First erring op</h2>
{_first_html(result)}
<h2 id="graph">Around it</h2>
<p class="note">The op with its producers and consumers ({depth} hops), grouped by module; colour is the verdict.</p>
{graph}
<h2 id="chart">Own error along the run</h2>
<p class="note">Each op's own error against a float64 replay of its inputs, in rounding units of its dtype, in
execution order (rank {focus_rank}); statistics-judged ops show their pinned statistics' deviation.</p>
<div class="figure">{chart}</div>
<h2 id="suspects">Erring ops</h2>
<p class="note">Ranked by how far beyond the standard (click a header to sort).</p>
{suspects_html(result.suspects, result.first_error, "No erring op.", [("beyond the standard", True)], _check_cells)}
<h2 id="modules">Modules</h2>
{_modules_html(result)}
<h2 id="skipped">Not judged</h2>
<p class="note">Ops that could not be replayed, never counted as passing.</p>
{_skipped_html(result)}
{rerun}
<h2 id="notes">Notes</h2><ul>{notes}</ul>
"""
    return write_page(out / REPORT_NAME, f"tracecmp check — {css}", body)
