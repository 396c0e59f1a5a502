"""The error along the network: per-op output error against execution order, as inline SVG.

Generated in Python so the report needs no chart library: a log-scale scatter, one colour per
phase, backward stretches shaded, step boundaries drawn, the first divergence marked. Exact
agreement (error 0) sits on a band below the axis and NaN/Inf on a band above it, so neither
disappears from a log scale. Long runs are thinned to the largest error per pixel column and
phase, which keeps every spike a person would look for.
"""

from __future__ import annotations

import math
from html import escape

import pandas as pd

from tracecmp.render.subgraph import format_number, short_op

PHASE_COLORS = {"forward": "#2166ac", "backward": "#c51b7d", "optimizer": "#7f6000"}
_MARK = "#a50026"


def _decade_label(exponent: int) -> str:
    return {-2: "0.01", -1: "0.1", 0: "1", 1: "10", 2: "100", 3: "1000"}.get(exponent, f"1e{exponent}")


def _thin(points: pd.DataFrame, columns: int, keep: int | None) -> pd.DataFrame:
    """At most one point per (pixel column, phase): the one with the largest error (NaN counts as largest)."""
    if len(points) <= 2 * columns:
        return points
    bins = (points["x"] * columns // max(1, points["x"].max() + 1)).astype(int)
    severity = points["error"].fillna(math.inf)
    picked = points.assign(_bin=bins, _sev=severity).sort_values("_sev").groupby(["_bin", "phase"]).tail(1)
    if keep is not None and keep not in picked.index and keep in points.index:
        picked = pd.concat([picked, points.loc[[keep]]])
    return picked.drop(columns=["_bin", "_sev"]).sort_values("x")


def error_chart(
    nodes: pd.DataFrame, root: int | None = None, rank: int = 0, width: int = 1100, height: int = 340
) -> str:
    """SVG text of the error chart for one rank of ``result.nodes`` (ops only; views and sources skipped).

    >>> svg = error_chart(result.nodes, root=result.first_divergence.op_id)  # doctest: +SKIP
    """
    frame = nodes
    if "rank" in frame.columns:
        frame = frame[frame["rank"] == rank]
    if "kind" in frame.columns:
        frame = frame[frame["kind"] == "op"]
    frame = frame.sort_values("op_id").reset_index(drop=True)
    left, right, top, bottom = 64, 18, 34, 44
    plot_w, plot_h = width - left - right, height - top - bottom
    band = 18  # the "NaN" band above and the "= 0" band below the log axis
    pad = 8  # between a band and the first decade, so their labels never touch
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}" font-family="Helvetica,Arial,sans-serif" font-size="11" '
        f'role="img" aria-label="output error per op along execution order">'
    ]
    if frame.empty:
        out.append(f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle">no ops to chart</text></svg>')
        return "".join(out)
    errors = pd.to_numeric(frame["error"], errors="coerce")
    status = frame["status"].astype(str) if "status" in frame.columns else pd.Series("", index=frame.index)
    points = pd.DataFrame(
        {
            "x": range(len(frame)),
            "op_id": frame["op_id"].astype(int),
            "error": errors.where(status != "nan", math.nan),
            "nan": status == "nan",
            "phase": frame.get("phase", pd.Series("forward", index=frame.index)).astype(str),
            "step": frame.get("step", pd.Series(0, index=frame.index)),
            "status": status,
            "op": frame.get("op", pd.Series("", index=frame.index)).astype(str),
            "module": frame.get("module", pd.Series("", index=frame.index)).fillna("").astype(str),
        }
    )
    charted = points[points["nan"] | points["error"].notna()]
    positive = charted["error"][charted["error"] > 0]
    lo = math.floor(math.log10(positive.min())) if len(positive) else -1
    hi = math.ceil(math.log10(positive.max())) if len(positive) else 1
    if hi - lo < 2:
        lo, hi = lo - 1, hi + 1
    axis_top, axis_bottom = top + band + pad, top + plot_h - band - pad
    n = len(points)

    def x_of(x: float) -> float:
        return left + (x + 0.5) * plot_w / n

    def y_of(error: float, is_nan: bool) -> float:
        if is_nan:
            return top + band / 2
        if error <= 0:
            return top + plot_h - band / 2
        t = (math.log10(error) - lo) / (hi - lo)
        return axis_bottom - t * (axis_bottom - axis_top)

    # Phase shading: contiguous stretches of backward / optimizer ops.
    change = points["phase"].ne(points["phase"].shift())
    starts = points.index[change].tolist() + [n]
    for begin, end in zip(starts, starts[1:]):
        phase = points.at[begin, "phase"]
        if phase != "forward":
            fill = "#fbeaf3" if phase == "backward" else "#f5f0de"
            out.append(
                f'<rect x="{x_of(begin - 0.5):.1f}" y="{top}" width="{(end - begin) * plot_w / n:.1f}" '
                f'height="{plot_h}" fill="{fill}"/>'
            )
    out.append(f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#888"/>')
    for y, text in ((top + band / 2, "NaN/Inf"), (top + plot_h - band / 2, "= 0")):
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" fill="#555">{text}</text>')
    for y in (top + band, top + plot_h - band):
        out.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{y}" y2="{y}" stroke="#ccc" stroke-dasharray="2,3"/>')
    for exponent in range(lo, hi + 1):
        y = y_of(10.0**exponent, False)
        out.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{_decade_label(exponent)}</text>')
    # Step boundaries.
    step_change = points["step"].ne(points["step"].shift())
    for begin in points.index[step_change]:
        x = x_of(begin - 0.5)
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{top + plot_h}" stroke="#999"/>')
        out.append(f'<text x="{x + 4:.1f}" y="{top - 6}" fill="#555">step {points.at[begin, "step"]}</text>')
    tick = max(1, 10 ** math.floor(math.log10(max(n, 1))) // 2)
    while n / tick > 10:
        tick *= 2
    for value in range(0, n, tick):
        x = x_of(value)
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top + plot_h}" y2="{top + plot_h + 4}" stroke="#888"/>')
        out.append(f'<text x="{x:.1f}" y="{top + plot_h + 16}" text-anchor="middle">{value}</text>')
    out.append(
        f'<text x="{left + plot_w / 2}" y="{height - 6}" text-anchor="middle" fill="#333">'
        f"execution order (op index, views and sources left out)</text>"
    )
    out.append(
        f'<text transform="translate(14,{top + plot_h / 2}) rotate(-90)" text-anchor="middle" fill="#333">'
        f"output error (rounding units, log)</text>"
    )
    keep = None
    if root is not None:
        match = points.index[points["op_id"] == root]
        keep = int(match[0]) if len(match) else None
    shown = _thin(charted, plot_w, keep)
    for row in shown.itertuples():
        cx, cy = x_of(row.x), y_of(row.error, row.nan)
        color = PHASE_COLORS.get(row.phase, "#555")
        bad = row.status in ("diverged", "nan")
        radius, opacity = (2.6, 0.95) if bad else (1.7, 0.55)
        tip = f"#{row.x} op {row.op_id} {short_op(row.op)} {row.module} [{row.phase}] {row.status} err {format_number(row.error)}"
        out.append(
            f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="{radius}" fill="{color}" fill-opacity="{opacity}">'
            f"<title>{escape(tip)}</title></circle>"
        )
    if keep is not None:
        row = points.loc[keep]
        cx, cy = x_of(row["x"]), y_of(row["error"], bool(row["nan"]))
        anchor = "end" if cx > left + plot_w * 0.7 else "start"
        dx = -8 if anchor == "end" else 8
        label = f"first divergence: {short_op(row['op'])} ({row['module'] or '<top>'})"
        out.append(
            f'<line x1="{cx:.1f}" x2="{cx:.1f}" y1="{top}" y2="{top + plot_h}" stroke="{_MARK}" '
            f'stroke-width="1.2" stroke-dasharray="5,3"/>'
            f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="6" fill="none" stroke="{_MARK}" stroke-width="2"/>'
            f'<text x="{cx + dx:.1f}" y="{top + band + 14}" text-anchor="{anchor}" fill="{_MARK}" '
            f'font-weight="bold">{escape(label)}</text>'
        )
    legend_x = left + plot_w - 250
    for index, (phase, color) in enumerate(PHASE_COLORS.items()):
        x = legend_x + index * 85
        out.append(f'<circle cx="{x}" cy="{top - 10}" r="4" fill="{color}"/>')
        out.append(f'<text x="{x + 8}" y="{top - 6}">{phase}</text>')
    out.append("</svg>")
    return "".join(out)
