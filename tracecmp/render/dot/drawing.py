"""The display list a layout produces (:class:`Drawing` of :class:`Group` s of :class:`Shape` s),
and labels turned into shapes; :mod:`tracecmp.render.canvas` writes it as SVG or PNG.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tracecmp.render.dot.labels import Table, TextBlock, line_height


@dataclass
class Shape:
    """One thing to draw, in points, y downwards. ``kind``: rect, ellipse, path, polygon, text."""

    kind: str
    points: list[tuple[float, float]]  # rect/ellipse: top-left and bottom-right; path: Bézier points
    fill: str | None = None
    stroke: str | None = None
    width: float = 1.0
    dash: str = ""  # "", "dashed", "dotted"
    radius: float = 0.0
    text: str = ""
    size: float = 10.0
    bold: bool = False
    anchor: str = "start"  # start | middle: x of the text
    title: str = ""  # tooltip


@dataclass
class Group:
    """The shapes of one node, edge or cluster (``kind``), named as in the DOT text: SVG groups
    them as graphviz does (``<g class="node"><title>n5</title>...``)."""

    kind: str  # graph | cluster | edge | node
    name: str
    shapes: list[Shape] = field(default_factory=list)


@dataclass
class Drawing:
    width: float
    height: float
    groups: list[Group]
    background: str = "#ffffff"

    @property
    def shapes(self) -> list[Shape]:
        return [shape for group in self.groups for shape in group.shapes]


def emit_block(block: TextBlock | Table, x: float, y: float, width: float, out: list[Shape]) -> None:
    """Shapes for a label whose box starts at (x, y) and is ``width`` wide."""
    if isinstance(block, Table):
        _emit_table(block, x, y, out)
        return
    top = y
    for line in block.lines:
        height = line_height(line)
        line_width = sum(r.width for r in line)
        left = {"left": x, "right": x + width - line_width}.get(block.align, x + (width - line_width) / 2)
        baseline = top + height * 0.5 + max((r.size for r in line), default=10.0) * 0.35
        for run in line:
            out.append(Shape("text", [(left, baseline)], fill=run.color, text=run.text, size=run.size, bold=run.bold))
            left += run.width
        top += height


def _emit_table(table: Table, x: float, y: float, out: list[Shape]) -> None:
    widths, heights = table.grid()
    top = y + table.border + table.spacing
    for row, height in zip(table.rows, heights):
        left = x + table.border + table.spacing
        cells = [table.cell_size(c) for c in row]
        if len(row) == 1:  # a lone cell takes the row's width
            cells = [(widths[0], cells[0][1])]
        for cell, (w, _) in zip(row, cells):
            if cell.bgcolor or cell.border:
                out.append(
                    Shape(
                        "rect",
                        [(left, top), (left + w, top + height)],
                        fill=cell.bgcolor,
                        stroke=cell.color if cell.border else None,
                        width=cell.border or 1.0,
                    )
                )
            inner = cell.padding + cell.border
            cw, ch = cell.content.size()
            offset = {"left": 0.0, "right": w - 2 * inner - cw}.get(cell.align, (w - 2 * inner - cw) / 2)
            emit_block(cell.content, left + inner + offset, top + (height - ch) / 2, cw, out)
            left += w + table.spacing
        top += height + table.spacing
