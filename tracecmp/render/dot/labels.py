"""Labels: their text and styles (plain DOT text or HTML-like tables), and their sizes in points."""

from __future__ import annotations

import re
from dataclasses import dataclass
from html.parser import HTMLParser

from tracecmp.render.dot.parse import Html

# Helvetica's advance widths (Adobe AFM, 1/1000 em) for ASCII 32..126, regular and bold. Browsers
# draw the SVG in Helvetica or Arial, which share these metrics.
_REGULAR = (
    "278 278 355 556 556 889 667 191 333 333 389 584 278 333 278 278 556 556 556 556 556 556 556 556 556 556 "
    "278 278 584 584 584 556 1015 667 667 722 722 667 611 778 722 278 500 667 556 833 722 778 667 778 722 667 "
    "611 722 667 944 667 667 611 278 278 278 469 556 333 556 556 500 556 556 278 556 556 222 222 500 222 833 "
    "556 556 556 556 333 500 278 556 500 722 500 500 500 334 260 334 584"
)
_BOLD = (
    "278 333 474 556 556 889 722 238 333 333 389 584 278 333 278 278 556 556 556 556 556 556 556 556 556 556 "
    "333 333 584 584 584 611 975 722 722 722 722 667 611 778 722 278 556 722 611 833 722 778 667 778 722 667 "
    "611 722 667 944 667 667 611 333 278 333 584 556 333 556 611 556 611 556 333 611 611 278 278 556 278 889 "
    "611 611 611 611 389 556 333 611 556 778 556 556 500 389 280 389 584"
)
_WIDTHS = {False: [int(w) for w in _REGULAR.split()], True: [int(w) for w in _BOLD.split()]}
_OTHER_WIDTHS = {"×": 584, "·": 278, "—": 1000, "–": 556, "…": 1000, "▸": 600, "\u00a0": 278}


def text_width(text: str, size: float, bold: bool = False) -> float:
    """The width of ``text`` in points at ``size`` points (Helvetica metrics; 1 em for wide scripts)."""
    table = _WIDTHS[bold]
    total = 0
    for char in text:
        code = ord(char)
        if 32 <= code <= 126:
            total += table[code - 32]
        else:
            total += _OTHER_WIDTHS.get(char, 1000 if code >= 0x2E80 else 600)
    return total * size / 1000.0


@dataclass(frozen=True)
class Run:
    """A piece of a text line in one style."""

    text: str
    size: float
    bold: bool
    color: str

    @property
    def width(self) -> float:
        return text_width(self.text, self.size, self.bold)


@dataclass
class TextBlock:
    """Lines of runs, each line aligned within the block."""

    lines: list[list[Run]]
    align: str = "center"  # center | left | right

    def size(self) -> tuple[float, float]:
        widths = [sum(r.width for r in line) for line in self.lines]
        return (max(widths, default=0.0), sum(line_height(line) for line in self.lines))


@dataclass
class Cell:
    content: TextBlock | Table
    bgcolor: str | None = None
    border: float = 0.0
    color: str = "#000000"
    align: str = "center"
    padding: float = 2.0


@dataclass
class Table:
    rows: list[list[Cell]]
    spacing: float = 2.0
    border: float = 1.0
    padding: float = 2.0

    def size(self) -> tuple[float, float]:
        widths, heights = self.grid()
        return (
            sum(widths) + self.spacing * (len(widths) + 1) + 2 * self.border,
            sum(heights) + self.spacing * (len(heights) + 1) + 2 * self.border,
        )

    def cell_size(self, cell: Cell) -> tuple[float, float]:
        w, h = cell.content.size()
        pad = 2 * (cell.padding + cell.border)
        return w + pad, h + pad

    def grid(self) -> tuple[list[float], list[float]]:
        # Every row is one cell wide in tracecmp's legends except the key row: columns stay per row.
        widths = (
            [max((sum(self.cell_size(c)[0] for c in row) + self.spacing * (len(row) - 1)) for row in self.rows)]
            if self.rows
            else [0.0]
        )
        heights = [max((self.cell_size(c)[1] for c in row), default=0.0) for row in self.rows]
        return widths, heights


def line_height(line: list[Run]) -> float:
    return max((r.size for r in line), default=10.0) * 1.2


class _LabelParser(HTMLParser):
    """HTML-like label -> TextBlock or Table (tags: TABLE TR TD FONT B I U BR)."""

    def __init__(self, size: float, color: str) -> None:
        super().__init__(convert_charrefs=True)
        self.styles: list[tuple[float, bool, str]] = [(size, False, color)]
        self.stack: list[Table | list[Cell] | Cell] = []  # open tables, rows and cells
        self.blocks: list[TextBlock] = [TextBlock([[]])]  # the text being collected, innermost last
        self.result: TextBlock | Table | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k.lower(): (v or "") for k, v in attrs}
        size, bold, color = self.styles[-1]
        if tag == "font":
            self.styles.append((float(a.get("point-size", size)), bold, a.get("color", color)))
        elif tag == "b":
            self.styles.append((size, True, color))
        elif tag in ("i", "u", "s", "sub", "sup", "o"):
            self.styles.append((size, bold, color))
        elif tag == "br":
            self.blocks[-1].lines.append([])
            if a.get("align"):
                self.blocks[-1].align = a["align"].lower()
        elif tag == "table":
            self.stack.append(
                Table([], float(a.get("cellspacing", 2)), float(a.get("border", 1)), float(a.get("cellpadding", 2)))
            )
        elif tag == "tr":
            row: list[Cell] = []
            table = self.stack[-1]
            if isinstance(table, Table):
                table.rows.append(row)
            self.stack.append(row)
        elif tag == "td":
            table = next(t for t in reversed(self.stack) if isinstance(t, Table))
            cell = Cell(
                TextBlock([[]], a.get("align", "center").lower()),
                a.get("bgcolor"),
                float(a.get("border", table.border)),
                a.get("color", "#000000"),
                a.get("align", "center").lower(),
                float(a.get("cellpadding", table.padding)),
            )
            row = self.stack[-1]
            if isinstance(row, list):
                row.append(cell)
            self.stack.append(cell)
            assert isinstance(cell.content, TextBlock)
            self.blocks.append(cell.content)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.handle_starttag(tag, attrs)

    def handle_endtag(self, tag: str) -> None:
        if tag in ("font", "b", "i", "u", "s", "sub", "sup", "o") and len(self.styles) > 1:
            self.styles.pop()
        elif tag == "td":
            self.stack.pop()
            self.blocks.pop()
        elif tag == "tr":
            self.stack.pop()
        elif tag == "table":
            table = self.stack.pop()
            assert isinstance(table, Table)
            parent = self.stack[-1] if self.stack else None
            if isinstance(parent, Cell):
                parent.content = table
            else:
                self.result = table

    def handle_data(self, data: str) -> None:
        text = re.sub(r"\s+", " ", data)
        if not text.strip() and not self.blocks[-1].lines[-1]:
            return
        if self.stack and not isinstance(self.stack[-1], Cell):
            return  # whitespace between table tags
        size, bold, color = self.styles[-1]
        self.blocks[-1].lines[-1].append(Run(text, size, bold, color))


def parse_label(label: str, size: float, color: str) -> TextBlock | Table:
    """A node, edge, cluster or graph label: HTML-like (:class:`Html`) or DOT text with ``\\n``."""
    if isinstance(label, Html):
        parser = _LabelParser(size, color)
        parser.feed(label)
        parser.close()
        if parser.result is not None:
            return parser.result
        block = parser.blocks[0]
        block.lines = [_trim(line) for line in block.lines]
        return block
    align = "center"
    lines = []
    for part in re.split(r"(\\[nlr])", label):
        if part in ("\\n", "\\l", "\\r"):
            align = {"\\n": "center", "\\l": "left", "\\r": "right"}[part]
            continue
        lines.append([Run(part, size, False, color)] if part else [])
    if label.endswith(("\\n", "\\l", "\\r")):
        lines = lines or [[]]
    return TextBlock([line for line in lines] or [[]], align)


def _trim(line: list[Run]) -> list[Run]:
    if line and not line[0].text.strip():
        line = line[1:]
    return line
