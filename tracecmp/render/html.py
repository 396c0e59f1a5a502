"""The self-contained HTML reports: the pieces both verdicts' reports share, and compare's report.

A report is one file with inline CSS, JS and SVG that works offline. Compare's reads top to bottom
the way a person debugs: the verdict, the first divergence and its stack, the subgraph around it,
the error along the network, the ranked suspects, the modules that introduced error, and the
counts behind the verdict. Check's report (:mod:`tracecmp.render.check_report`) is built from the
same pieces.
"""

from __future__ import annotations

import math
import re
import time
from html import escape
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import pandas as pd

from tracecmp.errors import TracecmpError
from tracecmp.render.chart import error_chart
from tracecmp.render.subgraph import find_focus, format_number, render_subgraph, short_op
from tracecmp.verdict.records import Divergence, layer_site, op_counts

REPORT_NAME = "report.html"
SUBGRAPH_NAME = "divergence.svg"

_CSS = """
body{font:14px/1.45 -apple-system,"Segoe UI",Helvetica,Arial,sans-serif;color:#1f2328;margin:0;background:#fff}
main{max-width:1240px;margin:0 auto;padding:18px 28px 40px}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:28px 0 8px;border-bottom:1px solid #d0d7de;padding-bottom:4px}
.runs{color:#57606a;font-size:13px}.runs code{font-size:12px}
.verdict{margin:14px 0 6px;padding:12px 16px;border-radius:6px;font-size:16px;font-weight:600}
.verdict.diverged{background:#ffebe9;border:1px solid #ff8182;color:#82071e}
.verdict.agree{background:#dafbe1;border:1px solid #4ac26b;color:#116329}
.verdict.incomplete{background:#fff8c5;border:1px solid #d4a72c;color:#7d4e00}
.warn{margin:6px 0;padding:8px 14px;border-radius:6px;background:#fff8c5;border:1px solid #d4a72c;color:#7d4e00}
.counts{display:flex;flex-wrap:wrap;gap:8px;margin:10px 0}
.count{border:1px solid #d0d7de;border-radius:6px;padding:6px 12px;min-width:84px}
.count b{display:block;font-size:18px}.count span{color:#57606a;font-size:12px}
.count.bad b{color:#cf222e}.count.nan b{color:#6f42c1}
dl.first{display:grid;grid-template-columns:max-content 1fr;gap:3px 14px;margin:0}
dl.first dt{color:#57606a}dl.first dd{margin:0}
pre{background:#f6f8fa;border:1px solid #d0d7de;border-radius:6px;padding:10px;overflow:auto;font-size:12px;max-height:360px}
.figure{border:1px solid #d0d7de;border-radius:6px;padding:8px;overflow:auto;background:#fff}
.figure svg{max-width:100%;height:auto}
.figure.graph svg{max-width:none}
.note{color:#57606a;font-size:13px}
table{border-collapse:collapse;width:100%;font-size:13px}
th,td{border-bottom:1px solid #e5e8eb;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f6f8fa;position:sticky;top:0}
table.sortable th{cursor:pointer;user-select:none}
table.sortable th::after{content:" \\2195";color:#afb8c1}
table.sortable th[data-dir=asc]::after{content:" \\25B2";color:#1f2328}
table.sortable th[data-dir=desc]::after{content:" \\25BC";color:#1f2328}
tr.first td{background:#fff1f0;font-weight:600}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
td code,dd code{font-size:12px}
.bar{display:inline-block;height:9px;background:#e36209;border-radius:2px;vertical-align:middle;margin-right:6px}
footer{margin-top:36px;color:#8c959f;font-size:12px}
"""

# Sorting by clicking a header: numbers by data-sort, text by its content; a second click reverses.
_JS = """
document.querySelectorAll("table.sortable").forEach(function (table) {
  table.querySelectorAll("th").forEach(function (th, col) {
    th.addEventListener("click", function () {
      var asc = th.dataset.dir !== "asc";
      table.querySelectorAll("th").forEach(function (h) { delete h.dataset.dir; });
      th.dataset.dir = asc ? "asc" : "desc";
      var numeric = th.dataset.type === "num";
      var body = table.tBodies[0];
      var rows = Array.prototype.slice.call(body.rows);
      function key(row) {
        var cell = row.cells[col];
        var text = cell.dataset.sort !== undefined ? cell.dataset.sort : cell.textContent;
        if (!numeric) return text.toLowerCase();
        var value = parseFloat(text);
        return isNaN(value) ? -Infinity : value;
      }
      rows.sort(function (a, b) {
        var x = key(a), y = key(b);
        var order = x < y ? -1 : x > y ? 1 : 0;
        return asc ? order : -order;
      });
      rows.forEach(function (row) { body.appendChild(row); });
    });
  });
});
"""


def _num(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _sort_value(value: Any) -> str:
    x = _num(value)
    if math.isinf(x):
        return "1e308" if x > 0 else "-1e308"  # what the page's sort can read
    return "" if math.isnan(x) else repr(x)


def verdict(result: Any) -> tuple[str, str]:
    """(css class, line): the result's own verdict line, classed diverged / agree / incomplete."""
    line = result.verdict()
    if result.first_divergence is not None:
        return "diverged", line
    return ("agree" if result.agrees else "incomplete"), line


def module_rollup(nodes: pd.DataFrame, limit: int = 40) -> pd.DataFrame:
    """Per module: ops, diverged ops, the largest error one of its ops introduced (and which op, where),
    its largest output error, its first diverged op.

    Sorted by error introduced, so the module that created the problem comes before the ones
    that only carried it.

    >>> module_rollup(result.nodes).head()  # doctest: +SKIP
    """
    columns = ["module", "ops", "diverged", "max_introduced", "introduced_by", "max_error", "first_diverged"]
    frame = nodes[nodes["kind"] != "view"] if "kind" in nodes.columns else nodes
    if frame.empty:
        return pd.DataFrame(columns=columns)
    frame = frame.assign(
        module=frame["module"].fillna("").astype(str),
        _bad=frame["status"].isin(["diverged", "nan"]),
        _introduced=pd.to_numeric(frame.get("introduced", pd.Series(math.nan, index=frame.index)), errors="coerce"),
        _error=pd.to_numeric(frame["error"], errors="coerce"),
    )
    first_bad = frame[frame["_bad"]].sort_values("op_id").groupby("module")["op"].first().map(short_op)
    ranked = frame[frame["_introduced"] > 0].sort_values(["_introduced", "op_id"], ascending=[False, True])
    worst = ranked.groupby("module").head(1).set_index("module")
    by = {
        module: f"{short_op(str(row['op']))} · {row.get('phase', '')} · step {row.get('step', '')}"
        for module, row in worst.iterrows()
    }
    table = frame.groupby("module").agg(
        ops=("op_id", "size"),
        diverged=("_bad", "sum"),
        max_introduced=("_introduced", "max"),
        max_error=("_error", "max"),
    )
    table["introduced_by"] = [by.get(module, "") for module in table.index]
    table["first_diverged"] = first_bad.reindex(table.index).fillna("")
    table = table.reset_index().sort_values(
        ["max_introduced", "diverged", "max_error"], ascending=False, na_position="last"
    )
    return table[columns].head(limit).reset_index(drop=True)


def _first_divergence_html(result: Any) -> str:
    d = result.first_divergence
    if d is None:
        focus = find_focus(result)
        return f"<p>No first divergence. {escape(focus.subtitle)}</p>"
    metrics = ", ".join(f"{escape(k)} = {format_number(v)}" for k, v in d.metrics.items()) or "—"
    rows = [
        ("op", f"<code>{escape(d.op)}</code>"),
        ("module", f"<code>{escape(d.module or '<top>')}</code>"),
        ("where", f"{escape(d.phase)}, step {d.step}, rank {d.rank}"),
        ("source line", f"<code>{escape(d.location or '?')}</code>"),
        ("why", escape(d.reason or d.kind)),
        ("kind", escape(d.kind)),
        ("error introduced", _units(d.score)),
        ("metrics", metrics),
        (
            "node",
            f"target op {d.op_id}"
            + (f", bench op {d.bench_op_id}" if d.bench_op_id is not None else ", no bench counterpart"),
        ),
    ]
    region = next((r for r in getattr(result, "regions", ()) if r.region_id == d.region), None)
    if region is not None:
        rows[-1] = (
            "region",
            f"{escape(region.describe())}: target <code>{escape(op_counts(region.target_names, views=True))}</code>"
            f" against bench <code>{escape(op_counts(region.bench_names, views=True) or 'nothing')}</code>",
        )
    return first_html(rows, d.stack)


def _units(score: float) -> str:
    """An error in rounding units, or a dash where no count of units measures the root (an argument,
    a source, NaN)."""
    return f"{format_number(score)} rounding units" if 0 < score < float("inf") else "—"


def _compare_cells(d: Divergence) -> str:
    calls = f" (x{1 + len(d.repeats)} calls)" if d.repeats else ""
    return (
        f"<td>{escape(d.kind)}{calls}</td>"
        f'<td class="num" data-sort="{_sort_value(d.score)}">{escape(_units(d.score).replace(" rounding units", ""))}</td>'
    )


def _uncompared_html(result: Any) -> str:
    """What could not be compared, grouped (``CompareResult.uncompared_groups``); "" when nothing."""
    groups = result.uncompared_groups() if hasattr(result, "uncompared_groups") else pd.DataFrame()
    if groups.empty:
        return ""
    rows = [
        f'<tr><td class="num" data-sort="{row.count}">{row.count}</td><td>{escape(row.side)}</td>'
        f"<td><code>{escape(row.op)}</code></td><td><code>{escape(row.module or '<top>')}</code></td>"
        f"<td>{escape(row.steps)}</td><td>{escape(row.reason)}</td></tr>"
        for row in groups.itertuples()
    ]
    table = table_html(
        "uncompared-table",
        [("nodes", True), ("side", False), ("op", False), ("module", False), ("steps", False), ("why", False)],
        rows,
    )
    return (
        '<h2 id="uncompared">Not compared</h2>\n<p class="note">What the verdict could not judge, by op, module '
        "(layer numbers as #) and reason; uncompared.csv holds the same.</p>\n" + table
    )


def _regions_html(result: Any) -> str:
    frame = result.regions_frame() if hasattr(result, "regions_frame") else pd.DataFrame()
    if frame.empty:
        return '<p class="note">Every op found its counterpart one to one.</p>'
    first = result.first_divergence
    rows = []
    passing = frame[(frame["kind"] == "pass-through") & ~frame["root"].astype(bool)]
    for row in frame.drop(passing.index).itertuples():
        css = ' class="first"' if first is not None and first.region == row.region and first.rank == row.rank else ""
        rows.append(
            f'<tr{css}><td class="num" data-sort="{row.region}">{row.region}</td><td>{escape(row.kind)}</td>'
            f"<td><code>{escape(row.module or '<top>')}</code></td><td>{escape(row.phase)}</td>"
            f"<td><code>{escape(row.target_ops or '—')}</code></td><td><code>{escape(row.bench_ops or '—')}</code></td>"
            f"<td>{escape(str(row.status))}{' (root)' if row.root else ''}</td></tr>"
        )
    # Casts and copies one side makes alone are many and alike: one line per what they do.
    grouped = passing.assign(status=passing["status"].astype(str)).groupby(
        ["phase", "target_ops", "bench_ops", "status"], sort=False
    )
    for (phase, target_ops, bench_ops, status), group in grouped:
        modules = group["module"].fillna("").map(layer_site).unique()
        where = modules[0] or "<top>" if len(modules) == 1 else f"{len(modules)} modules"
        rows.append(
            f'<tr><td class="num" data-sort="{group["region"].min()}">{len(group)} regions</td><td>pass-through</td>'
            f"<td><code>{escape(where)}</code></td><td>{escape(phase)}</td>"
            f"<td><code>{escape(target_ops or '—')}</code></td><td><code>{escape(bench_ops or '—')}</code></td>"
            f"<td>{escape(status)}</td></tr>"
        )
    return table_html(
        "regions-table",
        [
            ("region", True),
            ("kind", False),
            ("module", False),
            ("phase", False),
            ("target ops", False),
            ("bench ops", False),
            ("status", False),
        ],
        rows,
    )


def _modules_html(result: Any) -> str:
    table = module_rollup(result.nodes)
    if table.empty:
        return '<p class="note">No modules.</p>'
    finite = table["max_introduced"][np.isfinite(table["max_introduced"].astype(float))]
    top = finite.max() if len(finite) else 0.0  # NaN/Inf made from finite values (infinite) get the full bar
    first = result.first_divergence
    rows = []
    for row in table.itertuples():
        introduced = _num(row.max_introduced)
        width = 0.0
        if math.isinf(introduced) and introduced > 0:
            width = 120.0
        elif top > 0 and introduced > 0:
            # Log scale over eight decades below the largest: errors span orders of magnitude.
            width = max(2.0, 120 * (1 + math.log10(introduced / top) / 8))
        css = ' class="first"' if first is not None and row.module == first.module else ""
        rows.append(
            f"<tr{css}><td><code>{escape(row.module or '<top>')}</code></td>"
            f'<td class="num" data-sort="{row.ops}">{row.ops}</td>'
            f'<td class="num" data-sort="{row.diverged}">{row.diverged}</td>'
            f'<td class="num" data-sort="{_sort_value(introduced)}"><span class="bar" style="width:{width:.0f}px"></span>'
            f"{format_number(introduced)}</td><td>{escape(row.introduced_by)}</td>"
            f'<td class="num" data-sort="{_sort_value(row.max_error)}">{format_number(row.max_error)}</td>'
            f"<td><code>{escape(row.first_diverged)}</code></td></tr>"
        )
    return table_html(
        "modules-table",
        [
            ("module", False),
            ("ops", True),
            ("diverged ops", True),
            ("max error introduced", True),
            ("by", False),
            ("max output error", True),
            ("first diverged op", False),
        ],
        rows,
    )


def _counts_with_replay(result: Any) -> dict[str, int]:
    """The result's counts, plus how many target ops were replayed on their recorded inputs."""
    counts = dict(result.counts())
    if "own_error" in result.nodes:
        replayed = int(result.nodes["own_error"].notna().sum())
        if replayed:
            counts["replayed"] = replayed
    return counts


def counts_html(counts: dict[str, int], css: dict[str, str]) -> str:
    """The row of count boxes at the top of a report; ``css`` classes a box by its name ("bad", "nan")."""
    return (
        '<div class="counts">'
        + "".join(
            f'<div class="count {css.get(name, "")}"><b>{value}</b><span>{escape(name)}</span></div>'
            for name, value in counts.items()
        )
        + "</div>"
    )


def _compare_counts_html(counts: dict[str, int]) -> str:
    css = {"diverged": "bad", "roots": "bad", "nan": "nan"}
    css.update({k: "bad" for k in ("unpaired target", "unpaired bench", "uncompared") if counts.get(k)})
    return counts_html(counts, css)


def inline_svg(svg: str) -> str:
    """dot's SVG without the XML prolog and doctype, ready to sit inside HTML."""
    return re.sub(r"^.*?(?=<svg\b)", "", svg, count=1, flags=re.S)


def _run_line(result: Any) -> str:
    parts = []
    for name in ("target", "bench"):
        trace = getattr(result, name, None)
        if trace is None:
            continue
        versions = (getattr(trace, "manifest", {}) or {}).get("versions", {})
        try:
            device = trace.rank(trace.ranks[0]).device
        except (AttributeError, IndexError, TracecmpError):
            device = ""
        detail = ", ".join(x for x in (device, f"torch {versions['torch']}" if "torch" in versions else "") if x)
        parts.append(f"{name}: <code>{escape(str(trace.path))}</code>" + (f" ({escape(detail)})" if detail else ""))
    return " · ".join(parts)


def write_report(result: Any, out_dir: str | Path, *, depth: int = 2, max_nodes: int = 60) -> Path:
    """Write ``out_dir/report.html`` (self-contained) and ``out_dir/divergence.svg``; returns the report path.

    >>> result = tracecmp.compare("runs/target", "runs/bench")   # doctest: +SKIP
    >>> write_report(result, "out")                             # doctest: +SKIP
    PosixPath('out/report.html')
    """
    out = report_folder(out_dir)
    subgraph = figure_html(render_subgraph(result, out / SUBGRAPH_NAME, depth=depth, max_nodes=max_nodes))
    css_class, sentence = verdict(result)
    focus = find_focus(result)
    chart_root = result.first_divergence.op_id if result.first_divergence is not None else None
    warnings_html = "".join(f'<div class="warn">Warning: {escape(note)}</div>' for note in result.warnings)
    warnings_html += "".join(
        f'<div class="warn">Loss scaler skipped {escape(str(skip))}. {escape(skip.overflows[0].reason if skip.overflows else "")}</div>'
        for skip in getattr(result, "skipped_steps", ())
    )
    warnings_html += "".join(
        f'<div class="warn">Drift: {escape(str(drift))}</div>'
        for drift in getattr(result, "drifts", ())
        if not drift.undecided
    )
    summary = summary_html(
        "tracecmp report",
        _run_line(result),
        css_class,
        sentence,
        warnings_html,
        _compare_counts_html(_counts_with_replay(result)),
    )
    body = f"""{summary}
<h2 id="first-divergence">First divergence</h2>
{_first_divergence_html(result)}
{result.job.html() if getattr(result, "job", None) is not None else ""}
<h2 id="subgraph">Suspicious subgraph</h2>
<p class="note">The root with its producers and consumers ({depth} hops), grouped by module; colour is the status
and, for diverged ops, the size of the error. Edges carry tensor shapes; chains of views are folded into edges.</p>
{subgraph}
<h2 id="chart">Error along the network</h2>
<p class="note">Output error of each op in rounding units of its dtype, in execution order (rank {focus.rank}).
Shaded stretches are backward and optimizer ops; hover a point for its op.</p>
<div class="figure">{error_chart(result.nodes, root=chart_root, rank=focus.rank)}</div>
<h2 id="suspects">Suspects</h2>
<p class="note">Ranked root causes (click a header to sort).</p>
{
        suspects_html(
            result.suspects or [],
            result.first_divergence,
            "No suspects.",
            [("kind", False), ("error introduced", True)],
            _compare_cells,
        )
    }
{_uncompared_html(result)}
<h2 id="regions">Regions</h2>
<p class="note">Ops that pair only as groups: a fused op against its decomposition, another decomposition of the
same values, casts or copies one side makes alone. Each is compared at its boundary, never inside; in the picture a
dashed box holds its target ops, with a note naming the bench ops it stands against.</p>
{_regions_html(result)}
<h2 id="modules">Modules</h2>
<p class="note">Per module: the largest error one of its ops introduced itself (and which op), how many of its ops
diverged; the module of the first divergence is highlighted. Click a header to sort.</p>
{_modules_html(result)}
"""
    return write_page(out / REPORT_NAME, f"tracecmp — {css_class}", body)


def report_folder(out_dir: str | Path) -> Path:
    """``out_dir`` as a Path, created if need be (a :class:`TracecmpError` where it cannot be)."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TracecmpError(f"cannot create the report folder: {exc.strerror}", path=out) from exc
    return out


def figure_html(picture: Path) -> str:
    """The picture written to ``picture`` (SVG), inlined at its natural size (scrolling when wide):
    shrunk to fit, a big graph's labels become unreadable."""
    return f'<div class="figure graph">{inline_svg(picture.read_text(encoding="utf-8"))}</div>'


def summary_html(title: str, runs: str, css: str, sentence: str, warnings: str, counts: str) -> str:
    """The head of a report: its title, the runs judged (HTML), the verdict line classed ``css``
    (diverged / agree / incomplete), the warnings (HTML) and the count boxes (HTML)."""
    return f"""<h1>{title}</h1>
<div class="runs">{runs}</div>
<div class="verdict {css}" id="verdict">{escape(sentence)}</div>
{warnings}
{counts}"""


def first_html(rows: Sequence[tuple[str, str]], stack: str) -> str:
    """The first wrong op: (name, HTML value) rows, then its recorded stack."""
    body = "".join(f"<dt>{name}</dt><dd>{value}</dd>" for name, value in rows)
    stack_html = (
        f"<pre>{escape(stack)}</pre>"
        if stack
        else '<p class="note">No stack recorded (capture with <code>TraceCompare(..., stack=True)</code> to keep it).</p>'
    )
    return f'<dl class="first">{body}</dl><h3>Stack</h3>{stack_html}'


def table_html(table_id: str, headers: Sequence[tuple[str, bool]], rows: Iterable[str]) -> str:
    """A table sortable by clicking a header; ``headers`` are (name, numeric), ``rows`` whole ``<tr>``s."""
    head = "".join(f'<th data-type="num">{name}</th>' if numeric else f"<th>{name}</th>" for name, numeric in headers)
    return (
        f'<table class="sortable" id="{table_id}"><thead><tr>{head}</tr></thead><tbody>'
        + "".join(rows)
        + "</tbody></table>"
    )


def suspects_html(
    suspects: Sequence[Divergence],
    first: Divergence | None,
    empty: str,
    columns: Sequence[tuple[str, bool]],
    cells: Callable[[Divergence], str],
) -> str:
    """The ranked suspects, the first one highlighted: where each is, the verdict's own ``columns``
    (filled by ``cells``), why and its source line; ``empty`` (a note) where there is none."""
    if not suspects:
        return f'<p class="note">{empty}</p>'
    rows = []
    for index, d in enumerate(suspects, 1):
        css = ' class="first"' if first is not None and (d.rank, d.op_id) == (first.rank, first.op_id) else ""
        rows.append(
            f'<tr{css}><td class="num" data-sort="{index}">{index}</td>'
            f'<td title="{escape(d.op)}"><code>{escape(short_op(d.op))}</code></td>'
            f"<td><code>{escape(d.module or '<top>')}</code></td><td>{escape(d.phase)}</td>"
            f'<td class="num" data-sort="{d.step}">{d.step}</td>{cells(d)}'
            f"<td>{escape(d.reason)}</td><td><code>{escape(d.location)}</code></td></tr>"
        )
    headers = [
        ("#", True),
        ("op", False),
        ("module", False),
        ("phase", False),
        ("step", True),
        *columns,
        ("why", False),
        ("source line", False),
    ]
    return table_html("suspects-table", headers, rows)


def write_page(path: Path, title: str, body: str) -> Path:
    """Write ``body`` inside the reports' page frame (inline style and sorting script, a footer with
    the version and time) to ``path``; returns it.

    >>> write_page(Path("out/page.html"), "a title", "<h1>hello</h1>")   # doctest: +SKIP
    PosixPath('out/page.html')
    """
    from tracecmp import __version__

    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{escape(title)}</title>
<style>{_CSS}</style></head>
<body><main>
{body}<footer>tracecmp {escape(__version__)} · {escape(time.strftime("%Y-%m-%d %H:%M:%S"))}</footer>
</main>
<script>{_JS}</script>
</body></html>
"""
    try:
        path.write_text(page, encoding="utf-8")
    except OSError as exc:
        raise TracecmpError(f"cannot write the report: {exc.strerror}", path=path) from exc
    return path
