"""A layered drawing of a DOT graph without graphviz: what :mod:`tracecmp.render.subgraph` uses
when the ``dot`` binary is missing (no root, a cluster node).

It reads the DOT text the ``dot`` path gets (the subset tracecmp writes: nodes, edges, nested
``cluster`` subgraphs, HTML-like and plain labels) and lays it out the way ``dot`` does, in four
passes (Sugiyama): ranks by longest path, pulled together where that shortens edges; long edges
broken into chains of virtual nodes, and every edge label given a virtual node of its own on a half
rank so that labels take room instead of overlapping; the order within each rank by barycenter
sweeps that keep every cluster contiguous and sibling clusters in one order on every rank (fewest
crossings kept); x coordinates by repeated quadratic placement under separation constraints, with
each cluster a rectangle that nothing else enters. The result is a display list
(:class:`Drawing`) that :mod:`tracecmp.render.canvas` writes as SVG or PNG.

>>> svg = draw('digraph { a -> b [label="2×3"]; }', "svg")
>>> svg.startswith(b"<svg")
True
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from html.parser import HTMLParser
from typing import Iterable

from tracecmp.errors import TracecmpError

# --- the DOT subset -------------------------------------------------------------------------------


class Html(str):
    """An HTML-like label (``<...>`` in DOT), without its outer angle brackets."""


@dataclass
class Cluster:
    """A ``subgraph cluster_*``: its attributes, direct nodes and child clusters."""

    name: str
    attrs: dict[str, str]
    parent: Cluster | None = None
    nodes: list[str] = field(default_factory=list)
    children: list[Cluster] = field(default_factory=list)
    depth: int = 0


@dataclass
class DotGraph:
    """A parsed DOT digraph: attributes, nodes in order, edges, and the cluster tree under ``root``."""

    attrs: dict[str, str]
    nodes: dict[str, dict[str, str]]
    edges: list[tuple[str, str, dict[str, str]]]
    root: Cluster
    cluster_of: dict[str, Cluster]


_TOKEN = re.compile(
    r'\s+|//[^\n]*|/\*.*?\*/|^\#[^\n]*|(?P<arrow>->|--)|(?P<punct>[{}\[\]=;,:])|"(?P<quoted>(?:[^"\\]|\\.)*)"'
    r"|(?P<id>[A-Za-z_\x80-\uffff][\w\x80-\uffff]*|-?(?:\.\d+|\d+(?:\.\d*)?))|(?P<html><)",
    re.S | re.M,
)


def _tokens(text: str) -> list[str | tuple[str, str]]:
    """DOT tokens: punctuation and arrows as plain strings, values as ("id", text)."""
    out: list[str | tuple[str, str]] = []
    pos = 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            raise TracecmpError(f"DOT text: cannot read {text[pos:pos + 30]!r}")
        pos = match.end()
        if match.group("arrow") or match.group("punct"):
            out.append(match.group(0))
        elif match.group("quoted") is not None:
            out.append(("id", re.sub(r'\\(["\\])', r"\1", match.group("quoted"))))
        elif match.group("id") is not None:
            out.append(("id", match.group("id")))
        elif match.group("html"):
            depth, end = 1, pos
            while depth and end < len(text):
                depth += {"<": 1, ">": -1}.get(text[end], 0)
                end += 1
            if depth:
                raise TracecmpError("the DOT text has an unterminated HTML label")
            out.append(("id", Html(text[pos:end - 1])))
            pos = end
    return out


def parse_dot(text: str) -> DotGraph:
    """Read a DOT digraph (the subset tracecmp writes; ports and ``strict`` are ignored)."""
    tokens = _tokens(text)
    pos = 0

    def peek(offset: int = 0) -> str | tuple[str, str] | None:
        return tokens[pos + offset] if pos + offset < len(tokens) else None

    def take(expected: str | None = None) -> str | tuple[str, str]:
        nonlocal pos
        token = peek()
        if token is None or (expected is not None and token != expected):
            raise TracecmpError(f"DOT text: expected {expected or 'more'}, found {token!r}")
        pos += 1
        return token

    def value() -> str:
        token = take()
        if not isinstance(token, tuple):
            raise TracecmpError(f"DOT text: expected a name or value, found {token!r}")
        return token[1]

    def attr_list() -> dict[str, str]:
        attrs: dict[str, str] = {}
        while peek() == "[":
            take("[")
            while peek() != "]":
                key = value()
                attrs[key] = value() if peek() == "=" and take("=") else "true"
                while peek() in (",", ";"):
                    take()
            take("]")
        return attrs

    graph_attrs: dict[str, str] = {}
    nodes: dict[str, dict[str, str]] = {}
    edges: list[tuple[str, str, dict[str, str]]] = []
    root = Cluster("", graph_attrs)
    cluster_of: dict[str, Cluster] = {}

    def add_node(name: str, attrs: dict[str, str], defaults: dict[str, str], cluster: Cluster) -> None:
        if name not in nodes:
            nodes[name] = dict(defaults)
            cluster_of[name] = cluster
            cluster.nodes.append(name)
        elif cluster.depth > cluster_of[name].depth:  # named again inside a cluster: it moves there
            cluster_of[name].nodes.remove(name)
            cluster_of[name] = cluster
            cluster.nodes.append(name)
        nodes[name].update(attrs)

    def body(cluster: Cluster, own: dict[str, str], node_defaults: dict[str, str], edge_defaults: dict[str, str]) -> None:
        node_defaults, edge_defaults = dict(node_defaults), dict(edge_defaults)
        take("{")
        while peek() != "}":
            token = peek()
            if token in (";", ","):
                take()
                continue
            if token == ("id", "subgraph") or token == "{":
                if token != "{":
                    take()
                name = value() if isinstance(peek(), tuple) else ""
                if name.startswith("cluster"):
                    child = Cluster(name, {}, cluster, depth=cluster.depth + 1)
                    cluster.children.append(child)
                    body(child, child.attrs, node_defaults, edge_defaults)
                else:
                    body(cluster, {}, node_defaults, edge_defaults)
                continue
            name = value()
            if name in ("graph", "node", "edge") and peek() == "[":
                attrs = attr_list()
                {"graph": own, "node": node_defaults, "edge": edge_defaults}[name].update(attrs)
            elif peek() == "=":
                take("=")
                own[name] = value()
            else:
                chain = [name]
                while peek() == ":":  # a port: ignored
                    take(":")
                    value()
                while peek() in ("->", "--"):
                    take()
                    chain.append(value())
                attrs = attr_list()
                if len(chain) == 1:
                    add_node(name, attrs, node_defaults, cluster)
                else:
                    for member in chain:
                        add_node(member, {}, node_defaults, cluster)
                    for tail, head in zip(chain, chain[1:]):
                        edges.append((tail, head, {**edge_defaults, **attrs}))
        take("}")

    if peek() == ("id", "strict"):
        take()
    kind = value()
    if kind not in ("digraph", "graph"):
        raise TracecmpError(f"DOT text: expected a digraph, found {kind!r}")
    if isinstance(peek(), tuple):
        value()
    body(root, graph_attrs, {}, {})
    if peek() is not None:
        raise TracecmpError(f"DOT text: unexpected {peek()!r} after the graph")
    return DotGraph(graph_attrs, nodes, edges, root, cluster_of)


# --- labels ---------------------------------------------------------------------------------------

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
        return (max(widths, default=0.0), sum(_line_height(line) for line in self.lines))


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
        widths, heights = self._grid()
        return (sum(widths) + self.spacing * (len(widths) + 1) + 2 * self.border,
                sum(heights) + self.spacing * (len(heights) + 1) + 2 * self.border)

    def _cell_size(self, cell: Cell) -> tuple[float, float]:
        w, h = cell.content.size()
        pad = 2 * (cell.padding + cell.border)
        return w + pad, h + pad

    def _grid(self) -> tuple[list[float], list[float]]:
        # Every row is one cell wide in tracecmp's legends except the key row: columns stay per row.
        widths = [max((sum(self._cell_size(c)[0] for c in row) + self.spacing * (len(row) - 1)) for row in self.rows)] if self.rows else [0.0]
        heights = [max((self._cell_size(c)[1] for c in row), default=0.0) for row in self.rows]
        return widths, heights


def _line_height(line: list[Run]) -> float:
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
            self.stack.append(Table([], float(a.get("cellspacing", 2)), float(a.get("border", 1)), float(a.get("cellpadding", 2))))
        elif tag == "tr":
            row: list[Cell] = []
            table = self.stack[-1]
            if isinstance(table, Table):
                table.rows.append(row)
            self.stack.append(row)
        elif tag == "td":
            table = next(t for t in reversed(self.stack) if isinstance(t, Table))
            cell = Cell(TextBlock([[]], a.get("align", "center").lower()), a.get("bgcolor"),
                        float(a.get("border", table.border)), a.get("color", "#000000"),
                        a.get("align", "center").lower(), float(a.get("cellpadding", table.padding)))
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


# --- the display list ------------------------------------------------------------------------------


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


def _emit_block(block: TextBlock | Table, x: float, y: float, width: float, out: list[Shape]) -> None:
    """Shapes for a label whose box starts at (x, y) and is ``width`` wide."""
    if isinstance(block, Table):
        _emit_table(block, x, y, out)
        return
    top = y
    for line in block.lines:
        height = _line_height(line)
        line_width = sum(r.width for r in line)
        left = {"left": x, "right": x + width - line_width}.get(block.align, x + (width - line_width) / 2)
        baseline = top + height * 0.5 + max((r.size for r in line), default=10.0) * 0.35
        for run in line:
            out.append(Shape("text", [(left, baseline)], fill=run.color, text=run.text, size=run.size, bold=run.bold))
            left += run.width
        top += height


def _emit_table(table: Table, x: float, y: float, out: list[Shape]) -> None:
    widths, heights = table._grid()
    top = y + table.border + table.spacing
    for row, height in zip(table.rows, heights):
        left = x + table.border + table.spacing
        cells = [table._cell_size(c) for c in row]
        if len(row) == 1:  # a lone cell takes the row's width
            cells = [(widths[0], cells[0][1])]
        for cell, (w, _) in zip(row, cells):
            if cell.bgcolor or cell.border:
                out.append(Shape("rect", [(left, top), (left + w, top + height)], fill=cell.bgcolor,
                                 stroke=cell.color if cell.border else None, width=cell.border or 1.0))
            inner = cell.padding + cell.border
            cw, ch = cell.content.size()
            offset = {"left": 0.0, "right": w - 2 * inner - cw}.get(cell.align, (w - 2 * inner - cw) / 2)
            _emit_block(cell.content, left + inner + offset, top + (height - ch) / 2, cw, out)
            left += w + table.spacing
        top += height + table.spacing


# --- layout ---------------------------------------------------------------------------------------

_NODESEP = 14.0  # points between neighbours in a rank
_RANKSEP = 22.0  # points between ranks
_CLUSTER_PAD = 8.0  # points between a cluster's frame and what it holds
_ITERATIONS = 24  # ordering sweeps
_PLACEMENTS = 60  # x placement rounds


@dataclass
class _Item:
    """A node, a virtual node of a long edge, an edge label's place, or a cluster's filler."""

    key: str
    rank: int
    cluster: Cluster
    left: float  # extent left of x
    right: float  # extent right of x
    height: float
    kind: str = "node"  # node | virtual | label | filler
    x: float = 0.0
    order: float = 0.0


def _float(attrs: dict[str, str], key: str, default: float) -> float:
    try:
        return float(attrs.get(key, default))
    except ValueError:
        return default


def _styles(attrs: dict[str, str]) -> set[str]:
    return {s.strip() for s in attrs.get("style", "").split(",") if s.strip()}


class _Layout:
    def __init__(self, graph: DotGraph) -> None:
        self.g = graph
        self.font = _float(graph.attrs, "fontsize", 14.0)
        self.labels: dict[str, TextBlock | Table] = {}
        self.items: dict[str, _Item] = {}
        self.ranks: list[list[_Item]] = []
        self.chains: list[tuple[str, str, dict[str, str], list[str]]] = []  # edge -> its item chain
        # Clusters without nodes are not drawn (graphviz draws them as empty boxes somewhere).
        self.clusters = [c for c in self._walk(graph.root) if c.parent is None or self._holds_nodes(c)]

    def _holds_nodes(self, cluster: Cluster) -> bool:
        return bool(cluster.nodes) or any(self._holds_nodes(c) for c in cluster.children)

    def _walk(self, cluster: Cluster) -> Iterable[Cluster]:
        yield cluster
        for child in cluster.children:
            yield from self._walk(child)

    # ranks ---------------------------------------------------------------------------------------
    def rank(self) -> dict[str, int]:
        """Longest-path ranks on an acyclic copy, then nodes moved toward the side with more edges."""
        names = list(self.g.nodes)
        succ: dict[str, list[str]] = defaultdict(list)
        pred: dict[str, list[str]] = defaultdict(list)
        state: dict[str, int] = {}
        adjacency: dict[str, list[str]] = defaultdict(list)
        for tail, head, _ in self.g.edges:
            if tail != head:
                adjacency[tail].append(head)
        for start in names:  # iterative DFS: edges that close a cycle are turned around
            if start in state:
                continue
            stack = [(start, iter(adjacency[start]))]
            state[start] = 1
            while stack:
                node, children = stack[-1]
                child = next(children, None)
                if child is None:
                    state[node] = 2
                    stack.pop()
                elif state.get(child) == 1:
                    succ[child].append(node)
                    pred[node].append(child)
                elif child not in state:
                    succ[node].append(child)
                    pred[child].append(node)
                    state[child] = 1
                    stack.append((child, iter(adjacency[child])))
                else:
                    succ[node].append(child)
                    pred[child].append(node)
        order: list[str] = []
        indegree = {n: len(pred[n]) for n in names}
        ready = [n for n in names if indegree[n] == 0]
        while ready:
            node = ready.pop(0)
            order.append(node)
            for child in succ[node]:
                indegree[child] -= 1
                if indegree[child] == 0:
                    ready.append(child)
        rank = {n: 0 for n in names}
        for node in order:
            for child in succ[node]:
                rank[child] = max(rank[child], rank[node] + 1)
        for _ in range(4):  # balance: a node with more edges below than above moves down, and back
            moved = False
            for node in reversed(order):
                if succ[node] and len(succ[node]) >= len(pred[node]):
                    best = min(rank[c] for c in succ[node]) - 1
                    if best > rank[node]:
                        rank[node], moved = best, True
            for node in order:
                if pred[node] and len(pred[node]) > len(succ[node]):
                    best = max(rank[p] for p in pred[node]) + 1
                    if best < rank[node]:
                        rank[node], moved = best, True
            if not moved:
                break
        low = min(rank.values(), default=0)
        self._dag = [(t, h) for t in names for h in succ[t]]
        return {n: r - low for n, r in rank.items()}

    # items ---------------------------------------------------------------------------------------
    def build(self) -> None:
        rank = self.rank()
        for name, attrs in self.g.nodes.items():
            size = _float(attrs, "fontsize", 14.0)
            label = parse_label(attrs.get("label", name), size, attrs.get("fontcolor", "#000000"))
            self.labels[name] = label
            w, h = label.size()
            mx, my = 8.0, 4.0
            if "margin" in attrs:
                parts = [float(p) for p in attrs["margin"].split(",") if p.strip()]
                mx = parts[0] * 72
                my = (parts[1] if len(parts) > 1 else parts[0]) * 72
            w, h = w + 2 * mx, h + 2 * my
            if attrs.get("shape") in ("ellipse", "oval", "circle"):
                w, h = w * 1.3, h * 1.3
            w, h = max(w, 36.0), max(h, 24.0)
            if attrs.get("peripheries") == "2":
                w, h = w + 8, h + 8
            self.items[name] = _Item(name, 2 * rank[name], self.g.cluster_of[name], w / 2, w / 2, h)
        edge_font = 14.0
        for index, (tail, head, attrs) in enumerate(self.g.edges):
            if tail == head:
                continue
            reverse = rank[tail] > rank[head]
            top, bottom = (head, tail) if reverse else (tail, head)
            lca = self._lca(self.g.cluster_of[top], self.g.cluster_of[bottom])
            chain = [top]
            label = attrs.get("label", "")
            mid = (self.items[top].rank + self.items[bottom].rank) // 2
            for r in range(self.items[top].rank + 1, self.items[bottom].rank):
                key = f"\0e{index}.{r}"
                if label and r == mid:
                    block = parse_label(label, _float(attrs, "fontsize", edge_font), attrs.get("fontcolor", "#000000"))
                    self.labels[key] = block
                    w, h = block.size()
                    item = _Item(key, r, lca, 2.0, w + 6.0, h, "label")
                else:
                    item = _Item(key, r, lca, 1.0, 1.0, 0.0, "virtual")
                self.items[key] = item
                chain.append(key)
            chain.append(bottom)
            if reverse:
                chain.reverse()
            self.chains.append((tail, head, attrs, chain))
        # Fillers: a cluster is present on every rank of its span, so nothing else enters its frame.
        span: dict[int, list[int]] = {}
        for item in self.items.values():
            c: Cluster | None = item.cluster
            while c is not None:
                lo, hi = span.get(id(c), [item.rank, item.rank])
                span[id(c)] = [min(lo, item.rank), max(hi, item.rank)]
                c = c.parent
        present: set[tuple[int, int]] = set()
        for item in self.items.values():
            c = item.cluster
            while c is not None:
                present.add((id(c), item.rank))
                c = c.parent
        self.span = span
        for cluster in self.clusters[1:]:
            lo, hi = span.get(id(cluster), [0, -1])
            for r in range(lo, hi + 1):
                if (id(cluster), r) not in present:
                    key = f"\0f{cluster.name}.{r}"
                    self.items[key] = _Item(key, r, cluster, 0.5, 0.5, 0.0, "filler")
                    c2: Cluster | None = cluster
                    while c2 is not None:
                        present.add((id(c2), r))
                        c2 = c2.parent
        count = max((i.rank for i in self.items.values()), default=0) + 1
        self.ranks = [[] for _ in range(count)]
        for item in self.items.values():
            self.ranks[item.rank].append(item)
        self.up: dict[str, list[tuple[str, float]]] = defaultdict(list)
        self.down: dict[str, list[tuple[str, float]]] = defaultdict(list)
        for _, _, _, chain in self.chains:
            for a, b in zip(chain, chain[1:]):
                weight = 1.0 + 3.0 * (self.items[a].kind != "node") + 3.0 * (self.items[b].kind != "node")
                self.down[a].append((b, weight))
                self.up[b].append((a, weight))

    @staticmethod
    def _lca(a: Cluster, b: Cluster) -> Cluster:
        seen = set()
        c: Cluster | None = a
        while c is not None:
            seen.add(id(c))
            c = c.parent
        c = b
        while c is not None and id(c) not in seen:
            c = c.parent
        assert c is not None
        return c

    @staticmethod
    def _path(cluster: Cluster) -> list[Cluster]:
        path = []
        c: Cluster | None = cluster
        while c is not None:
            path.append(c)
            c = c.parent
        return path[::-1]

    # order ---------------------------------------------------------------------------------------
    def order(self) -> None:
        """Barycenter sweeps with contiguous clusters; the order with the fewest crossings wins."""
        # Initial order: depth-first from the top, so connected nodes start near each other.
        seen: dict[str, int] = {}
        counter = 0
        for item in sorted(self.items.values(), key=lambda i: i.rank):
            stack = [item.key]
            while stack:
                key = stack.pop()
                if key in seen:
                    continue
                seen[key] = counter
                counter += 1
                stack.extend(k for k, _ in reversed(self.down[key]))
        for row in self.ranks:
            for item in row:
                item.order = seen[item.key]
            self._sort_rank(row, {i.key: i.order for i in row}, {})
        best = [list(row) for row in self.ranks]
        best_crossings = self.crossings()
        for sweep in range(_ITERATIONS):
            downwards = sweep % 2 == 0
            keys = self._cluster_keys()
            indices = range(1, len(self.ranks)) if downwards else range(len(self.ranks) - 2, -1, -1)
            for r in indices:
                neighbours = self.up if downwards else self.down
                bary: dict[str, float] = {}
                for item in self.ranks[r]:
                    near = neighbours[item.key]
                    if near:
                        total = sum(w for _, w in near)
                        bary[item.key] = sum(self.items[k].order * w for k, w in near) / total
                    else:
                        bary[item.key] = item.order
                self._sort_rank(self.ranks[r], bary, keys)
            crossings = self.crossings()
            if crossings < best_crossings:
                best, best_crossings = [list(row) for row in self.ranks], crossings
        self.ranks = best
        for row in self.ranks:
            for position, item in enumerate(row):
                item.order = position

    def _cluster_keys(self) -> dict[int, float]:
        """One key per cluster, the mean order of its items over every rank: siblings then sort
        alike on every rank, which keeps their frames from overlapping."""
        sums: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for row in self.ranks:
            width = max(len(row) - 1, 1)
            for item in row:
                c: Cluster | None = item.cluster
                while c is not None:
                    entry = sums[id(c)]
                    entry[0] += item.order / width
                    entry[1] += 1
                    c = c.parent
        return {k: total / count for k, (total, count) in sums.items()}

    def _sort_rank(self, row: list[_Item], bary: dict[str, float], keys: dict[int, float]) -> None:
        width = max(len(row) - 1, 1)

        def arrange(cluster: Cluster, members: list[_Item], depth: int) -> tuple[list[_Item], float]:
            groups: dict[int, list[_Item]] = defaultdict(list)
            direct: list[tuple[float, int, list[_Item]]] = []
            child_of: dict[int, Cluster] = {}
            for item in members:
                path = self._path(item.cluster)
                if len(path) > depth + 1:
                    child = path[depth + 1]
                    groups[id(child)].append(item)
                    child_of[id(child)] = child
                else:
                    direct.append((bary[item.key] / width if keys else bary[item.key], int(item.order), [item]))
            entries = list(direct)
            for cid, group in groups.items():
                arranged, mean = arrange(child_of[cid], group, depth + 1)
                key = keys.get(cid, mean)
                entries.append((key, min(int(i.order) for i in group), arranged))
            entries.sort(key=lambda e: (e[0], e[1]))
            flat = [item for _, _, items in entries for item in items]
            mean = sum(bary[i.key] / (width if keys else 1) for i in flat) / max(len(flat), 1)
            return flat, mean

        arranged, _ = arrange(self.g.root, row, 0)
        row[:] = arranged
        for position, item in enumerate(row):
            item.order = position

    def crossings(self) -> int:
        total = 0
        for r in range(len(self.ranks) - 1):
            pairs = sorted(
                (self.items[a].order, self.items[b].order)
                for a in (i.key for i in self.ranks[r])
                for b, _ in self.down[a]
            )
            lower = [b for _, b in pairs]
            for i in range(len(lower)):
                for j in range(i + 1, len(lower)):
                    if lower[j] < lower[i] and pairs[j][0] != pairs[i][0]:
                        total += 1
        return total

    # x coordinates -------------------------------------------------------------------------------
    def place(self) -> None:
        """Quadratic placement: each round pulls every item toward its neighbours' mean, then the
        separation constraints are restored by merging blocks (Dwyer et al.'s VPSC "satisfy")."""
        clusters = self.clusters[1:]
        names: list[str] = [i.key for row in self.ranks for i in row]
        names += [f"\0L{c.name}" for c in clusters] + [f"\0R{c.name}" for c in clusters]
        index = {n: k for k, n in enumerate(names)}
        constraints: list[tuple[int, int, float]] = []  # x[b] - x[a] >= gap

        def bound(cluster: Cluster, side: str) -> int:
            return index[f"\0{side}{cluster.name}"]

        for row in self.ranks:
            for a, b in zip(row, row[1:]):
                pa, pb = self._path(a.cluster), self._path(b.cluster)
                common = 0
                while common < min(len(pa), len(pb)) and pa[common] is pb[common]:
                    common += 1
                if len(pa) > common:
                    left, left_gap = bound(pa[common], "R"), 0.0
                else:
                    left, left_gap = index[a.key], a.right
                if len(pb) > common:
                    right, right_gap = bound(pb[common], "L"), 0.0
                else:
                    right, right_gap = index[b.key], b.left
                gap = _NODESEP if a.kind == "node" and b.kind == "node" else _NODESEP / 2
                constraints.append((left, right, left_gap + right_gap + gap))
            for item in row:
                if item.cluster.parent is not None:
                    constraints.append((bound(item.cluster, "L"), index[item.key], item.left + _CLUSTER_PAD))
                    constraints.append((index[item.key], bound(item.cluster, "R"), item.right + _CLUSTER_PAD))
        for cluster in clusters:
            label = self.cluster_label(cluster)
            constraints.append((bound(cluster, "L"), bound(cluster, "R"), label.size()[0] + 2 * _CLUSTER_PAD))
            if cluster.parent is not None and cluster.parent.parent is not None:
                constraints.append((bound(cluster.parent, "L"), bound(cluster, "L"), _CLUSTER_PAD))
                constraints.append((bound(cluster, "R"), bound(cluster.parent, "R"), _CLUSTER_PAD))
        x = [0.0] * len(names)
        # Start from the tightest left-packed placement.
        outgoing: dict[int, list[tuple[int, float]]] = defaultdict(list)
        incoming: dict[int, list[tuple[int, float]]] = defaultdict(list)
        for a, b, gap in constraints:
            outgoing[a].append((b, gap))
            incoming[b].append((a, gap))
        topo = _topological(len(names), outgoing)
        for v in topo:
            for u, gap in incoming[v]:
                x[v] = max(x[v], x[u] + gap)
        weight = [0.01] * len(names)
        neighbours: list[list[tuple[int, float]]] = [[] for _ in names]
        for key, k in index.items():
            if key in self.items:
                for other, w in self.up[key] + self.down[key]:
                    neighbours[k].append((index[other], w))
                    weight[k] += w
        for _ in range(_PLACEMENTS):
            desired = list(x)
            for k, near in enumerate(neighbours):
                if near:
                    desired[k] = sum(x[o] * w for o, w in near) / sum(w for _, w in near)
            x = _satisfy(desired, weight, topo, incoming)
        extents = [x[index[i.key]] - i.left for i in self.items.values()]
        low = min(extents + [x[bound(c, "L")] for c in clusters], default=0.0)
        for key, k in index.items():
            if key in self.items:
                self.items[key].x = x[k] - low
        self.bounds = {c.name: (x[bound(c, "L")] - low, x[bound(c, "R")] - low) for c in clusters}

    def cluster_label(self, cluster: Cluster) -> TextBlock | Table:
        attrs = cluster.attrs
        return parse_label(attrs.get("label", ""), _float(attrs, "fontsize", 14.0), attrs.get("fontcolor", "#000000"))

    # y coordinates and shapes --------------------------------------------------------------------
    def render(self) -> Drawing:
        clusters = self.clusters[1:]
        label_height = {c.name: max(self.cluster_label(c).size()[1], 0.0) for c in clusters}
        # Frames that open on a rank need room above it, nested ones stacked; closing ones below.
        above = [0.0] * len(self.ranks)
        below = [0.0] * len(self.ranks)
        top_offset: dict[str, float] = {}
        bottom_offset: dict[str, float] = {}
        for cluster in sorted(clusters, key=lambda c: -c.depth):
            lo, hi = self.span[id(cluster)]
            inner = max((top_offset[c.name] for c in cluster.children if self._holds_nodes(c) and self.span[id(c)][0] == lo), default=0.0)
            top_offset[cluster.name] = inner + label_height[cluster.name] + _CLUSTER_PAD
            above[lo] = max(above[lo], top_offset[cluster.name])
            inner = max((bottom_offset[c.name] for c in cluster.children if self._holds_nodes(c) and self.span[id(c)][1] == hi), default=0.0)
            bottom_offset[cluster.name] = inner + _CLUSTER_PAD
            below[hi] = max(below[hi], bottom_offset[cluster.name])
        graph_label = parse_label(self.g.attrs["label"], self.font, self.g.attrs.get("fontcolor", "#000000")) if self.g.attrs.get("label") else None
        margin = 8.0
        gw, gh = graph_label.size() if graph_label is not None else (0.0, 0.0)
        y = margin + (gh + 8.0 if graph_label is not None else 0.0)
        centers: list[float] = []
        heights: list[float] = []
        for r, row in enumerate(self.ranks):
            height = max((i.height for i in row), default=0.0)
            if r % 2 == 1 and height == 0.0:  # a half rank without labels takes little room
                gap = _RANKSEP / 4
            else:
                gap = _RANKSEP / 2
            y += above[r] + (gap if r else 0.0)
            centers.append(y + height / 2)
            heights.append(height)
            y += height + below[r]
        groups: list[Group] = []
        width = max([i.x + i.right for i in self.items.values()] + [b for _, b in self.bounds.values()] + [gw], default=0.0)
        shift = margin
        for cluster in sorted(clusters, key=lambda c: c.depth):
            left, right = self.bounds[cluster.name]
            lo, hi = self.span[id(cluster)]
            top = centers[lo] - heights[lo] / 2 - top_offset[cluster.name]
            bottom = centers[hi] + heights[hi] / 2 + bottom_offset[cluster.name]
            attrs = cluster.attrs
            styles = _styles(attrs)
            shapes: list[Shape] = []
            groups.append(Group("cluster", cluster.name, shapes))
            shapes.append(Shape(
                "rect", [(left + shift, top), (right + shift, bottom)],
                fill=attrs.get("fillcolor") if "filled" in styles else None,
                stroke=attrs.get("color", "#000000"), width=_float(attrs, "penwidth", 1.0),
                dash="dashed" if "dashed" in styles else "dotted" if "dotted" in styles else "",
                radius=6.0 if "rounded" in styles else 0.0,
            ))
            label = self.cluster_label(cluster)
            _emit_block(label, left + shift + _CLUSTER_PAD, top + 3.0, label.size()[0], shapes)
        for tail, head, attrs, chain in self.chains:
            groups.append(Group("edge", f"{tail}->{head}", self._edge(attrs, chain, centers, shift)))
        for name, attrs in self.g.nodes.items():
            groups.append(Group("node", name, self._node(name, attrs, centers, shift)))
        if graph_label is not None:
            legend: list[Shape] = []
            _emit_block(graph_label, margin, margin, gw, legend)
            groups.insert(0, Group("graph", "legend", legend))
        return Drawing(max(width + 2 * margin, gw + 2 * margin), y + margin, groups, self.g.attrs.get("bgcolor", "#ffffff"))

    def _node(self, name: str, attrs: dict[str, str], centers: list[float], shift: float) -> list[Shape]:
        item = self.items[name]
        cx, cy = item.x + shift, centers[item.rank]
        w, h = item.left + item.right, item.height
        styles = _styles(attrs)
        fill = attrs.get("fillcolor", attrs.get("color", "#d3d3d3")) if "filled" in styles else None
        stroke = attrs.get("color", "#000000")
        dash = "dashed" if "dashed" in styles else "dotted" if "dotted" in styles else ""
        pen = _float(attrs, "penwidth", 2.0 if "bold" in styles else 1.0)
        kind = "ellipse" if attrs.get("shape") in ("ellipse", "oval", "circle") else "rect"
        radius = 6.0 if "rounded" in styles else 0.0
        title = attrs.get("tooltip", "")
        box = [(cx - w / 2, cy - h / 2), (cx + w / 2, cy + h / 2)]
        out = [Shape(kind, box, fill=fill, stroke=stroke, width=pen, dash=dash, radius=radius, title=title)]
        if attrs.get("peripheries") == "2":
            inset = [(box[0][0] + 4, box[0][1] + 4), (box[1][0] - 4, box[1][1] - 4)]
            out.append(Shape(kind, inset, stroke=stroke, width=pen, dash=dash, radius=max(radius - 3, 0.0)))
        label = self.labels[name]
        lw, lh = label.size()
        _emit_block(label, cx - lw / 2, cy - lh / 2, lw, out)
        return out

    def _edge(self, attrs: dict[str, str], chain: list[str], centers: list[float], shift: float) -> list[Shape]:
        items = [self.items[k] for k in chain]
        points = []
        for k, item in enumerate(items):
            x, y = item.x + shift, centers[item.rank]
            if item.kind == "node":  # leave and arrive toward the next point, on the bottom/top edge
                y += item.height / 2 if k == 0 else -item.height / 2
                near = items[1] if k == 0 else items[-2]
                half = (item.left + item.right) / 2 - 6.0
                x += max(-half, min(half, (near.x + shift - x) * 0.3))
            points.append((x, y))
        arrow = _float(attrs, "arrowsize", 1.0) * 7.0
        x1, y1 = points[-1]
        # Stop the line where the arrowhead starts.
        end = (x1, y1 - arrow)
        path = [points[0]]
        route = points[1:-1] + [end]
        previous = points[0]
        for point in route:
            dy = (point[1] - previous[1]) / 2
            path += [(previous[0], previous[1] + dy), (point[0], point[1] - dy), point]
            previous = point
        color = attrs.get("color", "#000000")
        styles = _styles(attrs)
        dash = "dashed" if "dashed" in styles else "dotted" if "dotted" in styles else ""
        pen = _float(attrs, "penwidth", 1.0)
        out = [Shape("path", path, stroke=color, width=pen, dash=dash)]
        half = arrow * 0.35
        out.append(Shape("polygon", [(x1, y1), (end[0] - half, end[1]), (end[0] + half, end[1])], fill=color, stroke=color, width=pen))
        for k, item in zip(chain, items):
            if item.kind == "label":
                label = self.labels[k]
                lw, lh = label.size()
                _emit_block(label, item.x + shift + 4.0, centers[item.rank] - lh / 2, lw, out)
        return out


def _topological(count: int, outgoing: dict[int, list[tuple[int, float]]]) -> list[int]:
    indegree = [0] * count
    for targets in outgoing.values():
        for b, _ in targets:
            indegree[b] += 1
    ready = [v for v in range(count) if indegree[v] == 0]
    order = []
    while ready:
        v = ready.pop()
        order.append(v)
        for b, _ in outgoing.get(v, ()):
            indegree[b] -= 1
            if indegree[b] == 0:
                ready.append(b)
    if len(order) != count:
        raise TracecmpError("the drawing's placement constraints form a cycle")
    return order


def _satisfy(desired: list[float], weight: list[float], topo: list[int], incoming: dict[int, list[tuple[int, float]]]) -> list[float]:
    """Positions as close to ``desired`` (weighted least squares) as the constraints allow, by
    merging blocks left to right (Dwyer, Marriott, Stuckey: "Fast node overlap removal", satisfy)."""
    block = list(range(len(desired)))  # variable -> its block id
    offset = [0.0] * len(desired)  # position within the block
    members: dict[int, list[int]] = {v: [v] for v in range(len(desired))}
    wsum = {v: weight[v] for v in range(len(desired))}
    wpos = {v: weight[v] * desired[v] for v in range(len(desired))}
    posn = dict(enumerate(desired))

    for v in topo:
        b = block[v]
        while True:
            worst, violation = None, 1e-9
            for u in members[b]:
                for a, gap in incoming.get(u, ()):
                    if block[a] == b:
                        continue
                    excess = posn[block[a]] + offset[a] + gap - (posn[b] + offset[u])
                    if excess > violation:
                        worst, violation = (a, u, gap), excess
            if worst is None:
                break
            a, u, gap = worst
            left = block[a]
            # Merge b into the left block: u sits exactly gap right of a.
            shift = offset[a] + gap - offset[u]
            for m in members[b]:
                offset[m] += shift
                block[m] = left
            members[left].extend(members.pop(b))
            wsum[left] += wsum.pop(b)
            del wpos[b]
            wpos[left] = sum(weight[m] * (desired[m] - offset[m]) for m in members[left])
            posn[left] = wpos[left] / wsum[left]
            del posn[b]
            b = left
    x = [posn[block[v]] + offset[v] for v in range(len(desired))]
    for v in topo:  # merged blocks can lean on constraints met earlier: push those right again
        for a, gap in incoming.get(v, ()):
            x[v] = max(x[v], x[a] + gap)
    return x


def layout(text: str) -> Drawing:
    """Lay the DOT digraph ``text`` out (top to bottom) as a :class:`Drawing`."""
    graph = parse_dot(text)
    engine = _Layout(graph)
    engine.build()
    engine.order()
    engine.place()
    return engine.render()


def draw(text: str, fmt: str) -> bytes:
    """The DOT digraph ``text`` drawn as ``fmt`` ("svg" or "png"), as ``dot -T<fmt>`` would.

    >>> draw("digraph { a -> b; }", "svg")[:4]
    b'<svg'
    """
    from tracecmp.render import canvas

    drawing = layout(text)
    if fmt == "svg":
        return canvas.to_svg(drawing).encode("utf-8")
    if fmt == "png":
        return canvas.to_png(drawing)
    raise TracecmpError(f"cannot draw {fmt!r} without graphviz: use svg or png")
