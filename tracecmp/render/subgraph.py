"""The suspicious subgraph: the first divergence with its producers and consumers, as a picture.

Selection works on the target's dataflow graph of the divergent step (``result.graph``). Views
carry no numbers of their own, so a chain of views between two ops is drawn as one edge labelled
with the view ops; the region within ``depth`` producer and consumer hops of the root is bounded
by ``max_nodes`` (nearest and worst nodes first) and whatever does not fit is summarized as
"+N more" nodes. Nodes sit in graphviz clusters by module and are coloured by status.
"""

from __future__ import annotations

import math
import shutil
import subprocess
from collections import defaultdict
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any, Iterator

import networkx as nx
import numpy as np
import pandas as pd

from tracecmp.errors import TracecmpError
from tracecmp.render.canvas import draw
from tracecmp.verdict.records import STATUSES, op_counts

FORMATS = ("svg", "png", "dot", "gv")
_SEVERITY = {status: rank for rank, status in enumerate(STATUSES)}
_FONT = "Helvetica,Arial,sans-serif"
_DTYPE_SHORT = {
    "float32": "f32",
    "float64": "f64",
    "float16": "f16",
    "bfloat16": "bf16",
    "int64": "i64",
    "int32": "i32",
    "int8": "i8",
    "uint8": "u8",
    "bool": "bool",
    "complex64": "c64",
}
# Fill, border, font colour and border style per status. Diverged nodes get their fill from the
# error scale instead (orange for the least, red for the most erroneous node in view).
STATUS_STYLE: dict[str, tuple[str, str, str, str]] = {
    "agrees": ("#a6dba0", "#1b7837", "#000000", "solid"),
    "noise": ("#e5f5e0", "#74c476", "#000000", "solid"),
    "uncompared": ("#ffffff", "#969696", "#525252", "dotted"),
    "unpaired": ("#e0e0e0", "#737373", "#252525", "dashed"),
    "diverged": ("#fdae61", "#7f2704", "#000000", "solid"),
    "nan": ("#2d004b", "#000000", "#ffffff", "solid"),
}
_ORANGE = (253, 174, 97)
_RED = (215, 48, 39)
_ROOT_COLOR = "#a50026"
_CLUSTER_FILLS = ("#f6f7f9", "#eceff3", "#e2e6eb", "#d8dde3")


def short_op(op: str) -> str:
    """The op name a person reads: namespace ``aten`` and the overload dropped.

    >>> short_op("aten.gelu.default"), short_op("aten.add.Tensor"), short_op("npu.fused_x.default")
    ('gelu', 'add', 'npu.fused_x')
    """
    parts = op.split(".")
    if len(parts) >= 3:
        parts = parts[:-1]
    if parts and parts[0] == "aten" and len(parts) > 1:
        parts = parts[1:]
    return ".".join(parts)


def format_shape(shape: Any) -> str:
    """``[2, 16, 64]`` as ``2×16×64``; a 0-d tensor as ``scalar``."""
    if shape is None or (isinstance(shape, float) and math.isnan(shape)):
        return ""
    dims = [int(d) for d in shape]
    return "×".join(map(str, dims)) if dims else "scalar"


def format_number(value: Any) -> str:
    """Compact number for labels: ``3.1e4``, ``0.25``, ``nan``."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        return str(value)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == 0:
        return "0"
    if 100 <= abs(x) < 1e4:
        return f"{x:.0f}"
    if 1e-3 <= abs(x) < 100:
        return f"{x:.3g}"
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa.removesuffix('.0')}e{int(exponent)}"


def diverged_fill(error: float, low: float, high: float) -> tuple[str, str]:
    """Fill and font colour of a diverged node: orange at ``low`` error, red at ``high`` (log scale)."""
    if not (error > 0 and low > 0 and high > low):
        t = 1.0 if high <= low else 0.0
    else:
        t = (math.log10(error) - math.log10(low)) / (math.log10(high) - math.log10(low))
        t = min(1.0, max(0.0, t))
    rgb = tuple(round(a + (b - a) * t) for a, b in zip(_ORANGE, _RED))
    return "#%02x%02x%02x" % rgb, ("#ffffff" if t > 0.55 else "#000000")


@dataclass(frozen=True)
class Focus:
    """What the picture is centred on: the first divergence, or the largest error when there is none."""

    rank: int
    step: int | None
    op_id: int | None
    title: str
    subtitle: str = ""
    tag: str = "FIRST DIVERGENCE"


@dataclass
class Selection:
    """The nodes shown, the collapsed edges between them and the "+N more" summaries."""

    focus: Focus
    shown: list[int]
    edges: list[tuple[int, int, str]]  # (producer, consumer, label)
    more: list[tuple[int, str, list[int]]] = field(default_factory=list)  # (anchor, "up"|"down", hidden ids)
    info: _NodeInfo | None = field(default=None, repr=False)  # node facts the drawing reads


class _NodeInfo:
    """Per-node facts for one rank: ``result.nodes`` first, graph attributes and the trace as fallback."""

    def __init__(self, result: Any, rank: int, graph: nx.DiGraph) -> None:
        nodes = result.nodes
        frame = nodes[nodes["rank"] == rank] if "rank" in nodes.columns else nodes
        self.rows = frame.drop_duplicates("op_id").set_index("op_id")
        self.graph = graph
        self.outputs = _first_outputs(result, rank)

    def get(self, op_id: int, column: str, default: Any = None) -> Any:
        if op_id in self.rows.index and column in self.rows.columns:
            value = self.rows.at[op_id, column]
            if not _missing(value):
                return value
        if op_id in self.graph:
            value = self.graph.nodes[op_id].get(column)
            if value is not None:
                return value
        return default

    def is_view(self, op_id: int) -> bool:
        return self.get(op_id, "kind") == "view"

    def status(self, op_id: int) -> str:
        return str(self.get(op_id, "status", "uncompared"))

    def error(self, op_id: int) -> float:
        value = self.get(op_id, "error", math.nan)
        try:
            return float(value)
        except (TypeError, ValueError):
            return math.nan

    def severity(self, op_id: int) -> tuple[int, float]:
        error = self.error(op_id)
        return _SEVERITY.get(self.status(op_id), 0), (error if not math.isnan(error) else -1.0)

    def output(self, op_id: int) -> tuple[str, str]:
        """Shape and dtype of the node's first output, from the trace, else from an out-edge."""
        if op_id in self.outputs:
            return self.outputs[op_id][:2]
        if op_id in self.graph:
            for _, _, data in self.graph.out_edges(op_id, data=True):
                return format_shape(data.get("shape")), str(data.get("dtype", ""))
        return "", ""

    def nonfinite(self, op_id: int) -> str:
        """ "3 Inf, 1 NaN" for the node's first output as recorded, "" when finite or unknown."""
        _, _, nan, inf = self.outputs.get(op_id, ("", "", 0, 0))
        return ", ".join(f"{count} {name}" for count, name in ((inf, "Inf"), (nan, "NaN")) if count)


def _missing(value: Any) -> bool:
    """None or a scalar NaN/NA; sequences (shapes, input lists) are never missing."""
    if value is None:
        return True
    if isinstance(value, (list, tuple, dict, np.ndarray)):
        return False
    try:
        return bool(pd.isna(value))
    except (TypeError, ValueError):
        return False


def _first_outputs(result: Any, rank: int) -> dict[int, tuple[str, str, int, int]]:
    """op_id -> (shape text, dtype, NaN count, Inf count) of output 0, from the target trace."""
    try:
        tensors = result.target.rank(rank).tensors
    except (AttributeError, TracecmpError):
        return {}
    first = tensors[tensors["index"] == 0]
    nan = first["nan_count"] if "nan_count" in first.columns else pd.Series(0, index=first.index)
    inf = first["inf_count"] if "inf_count" in first.columns else pd.Series(0, index=first.index)
    return {
        int(op_id): (format_shape(shape), str(dtype), int(n), int(i))
        for op_id, shape, dtype, n, i in zip(
            first["op_id"], first["shape"], first["dtype"], nan.fillna(0), inf.fillna(0)
        )
    }


def find_focus(result: Any) -> Focus:
    """The first divergence; without one, the worst compared node (or nothing at all)."""
    d = result.first_divergence
    if d is not None:
        where = f"{d.module or '<top>'} — {d.phase}, step {d.step}"
        title = f"First divergence: {short_op(d.op)} in {where}"
        if d.location:
            title += f" — {d.location}"
        return Focus(d.rank, d.step, d.op_id, title, d.reason)
    nodes = result.nodes
    agrees = bool(result.agrees)
    verdict = (
        "No divergence: the runs agree"
        if agrees
        else "Could not compare: no divergence found, but not everything was compared"
    )
    errors = pd.to_numeric(nodes["error"], errors="coerce") if "error" in nodes.columns else pd.Series(dtype=float)
    candidates = nodes[(errors > 0) & (nodes.get("kind", "op") != "view")] if len(nodes) else nodes
    if candidates.empty:
        return Focus(0, None, None, verdict, f"{len(nodes)} target nodes, none with a non-zero error")
    worst = candidates.loc[pd.to_numeric(candidates["error"]).idxmax()]
    step = int(worst["step"]) if "step" in worst and not _missing(worst["step"]) else None
    rank = int(worst["rank"]) if "rank" in worst else 0
    subtitle = (
        f"Largest difference: {short_op(str(worst['op']))} in {worst.get('module') or '<top>'}, "
        f"error {format_number(worst['error'])} rounding units ({worst.get('status', '')})"
    )
    return Focus(rank, step, int(worst["op_id"]), verdict, subtitle, tag="LARGEST ERROR")


def _through_views(graph: nx.DiGraph, info: _NodeInfo, node: int, downstream: bool) -> Iterator[int]:
    """Non-view neighbours of ``node``, looking through chains of views."""
    step = graph.successors if downstream else graph.predecessors
    stack, seen = list(step(node)), {node}
    while stack:
        other = stack.pop()
        if other in seen:
            continue
        seen.add(other)
        if info.is_view(other):
            stack.extend(step(other))
        else:
            yield other


def _in_edges(graph: nx.DiGraph, info: _NodeInfo, node: int) -> dict[int, str]:
    """Producer -> edge label for ``node``, each view chain in between named on the label."""
    labels: dict[int, str] = {}
    stack: list[tuple[int, list[str], dict[str, Any]]] = [
        (p, [], data) for p, _, data in graph.in_edges(node, data=True)
    ]
    seen = {node}
    while stack:
        producer, via, data = stack.pop()
        if producer in seen:
            continue
        seen.add(producer)
        if info.is_view(producer):
            name = short_op(str(info.get(producer, "op", "view")))
            stack.extend((p, [name, *via], data) for p in graph.predecessors(producer))
            continue
        shape = format_shape(data.get("shape"))
        labels.setdefault(producer, f"{'·'.join(via)} ▸ {shape}" if via else shape)
    return labels


def select(result: Any, depth: int = 2, max_nodes: int = 60) -> Selection:
    """Choose the nodes to draw around the focus (see the module docstring).

    >>> sel = select(result, depth=2, max_nodes=40)  # doctest: +SKIP
    >>> len(sel.shown) + len(sel.more) <= 40          # doctest: +SKIP
    True
    """
    if not isinstance(depth, int) or depth < 0:
        raise TracecmpError(f"depth must be a non-negative integer, got {depth!r}")
    if not isinstance(max_nodes, int) or max_nodes < 1:
        raise TracecmpError(f"max_nodes must be a positive integer, got {max_nodes!r}")
    focus = find_focus(result)
    if focus.op_id is None:
        return Selection(focus, [], [])
    graph = result.graph(rank=focus.rank, step=focus.step)
    if focus.op_id not in graph:
        graph = graph.copy()
        graph.add_node(focus.op_id)
    info = _NodeInfo(result, focus.rank, graph)
    root = focus.op_id
    # Breadth-first both ways; parent links let hidden nodes be summarized next to a shown one.
    distance: dict[int, int] = {root: 0}
    parent: dict[int, tuple[int, str]] = {}
    for downstream, direction in ((False, "up"), (True, "down")):
        frontier = [root]
        for level in range(1, depth + 1):
            nxt = []
            for node in frontier:
                for other in _through_views(graph, info, node, downstream):
                    if other not in distance:
                        distance[other] = level
                        parent[other] = (node, direction)
                        nxt.append(other)
            frontier = nxt
    # A root that is a region is drawn with all its ops (the picture's box around them).
    region = info.get(root, "region")
    if region is not None:
        members = (
            info.rows.index[info.rows["region"].eq(region).fillna(False).to_numpy(bool)]
            if "region" in info.rows.columns
            else []
        )
        for member in members:
            member = int(member)
            if member != root and member in graph and not info.is_view(member) and member not in distance:
                distance[member] = 1
                parent[member] = (root, "up" if member < root else "down")
    root_phase = info.get(root, "phase")

    def priority(node: int) -> tuple[Any, ...]:
        severity, error = info.severity(node)
        return (distance[node], info.get(node, "phase") != root_phase, -severity, -error, abs(node - root))

    ordered = sorted(distance, key=priority)
    for count in range(min(len(ordered), max_nodes), 0, -1):
        shown_set = set(ordered[:count])
        groups: dict[tuple[int, str], list[int]] = defaultdict(list)
        for hidden in ordered[count:]:
            anchor, direction = parent[hidden]
            while anchor not in shown_set:
                anchor, _ = parent[anchor]
            groups[(anchor, direction)].append(hidden)
        if count + len(groups) <= max_nodes:
            break
    else:  # max_nodes leaves no room for a summary next to the root: the root alone
        groups.clear()
    shown = ordered[:count]
    edges = [
        (producer, consumer, label)
        for consumer in shown
        for producer, label in sorted(_in_edges(graph, info, consumer).items())
        if producer in shown_set
    ]
    more = [(anchor, direction, hidden) for (anchor, direction), hidden in groups.items()]
    return Selection(focus, shown, edges, more, info)


def _node_label(info: _NodeInfo, node: int, tag: str | None, font: str) -> str:
    op = str(info.get(node, "op", "?"))
    kind = info.get(node, "kind", "op")
    phase = str(info.get(node, "phase", ""))
    module = str(info.get(node, "module", "") or "")
    rows: list[str] = []
    if tag:
        rows.append(f'<FONT POINT-SIZE="8" COLOR="{font}"><B>{escape(tag)}</B></FONT>')
    if kind == "source":
        name = str(info.get(node, "name", "") or op)
        rows.append(f"<B>{escape(name)}</B>")
        rows.append(f'<FONT POINT-SIZE="8">{escape(op.split(".")[-1])}</FONT>')
    else:
        head = f"<B>{escape(short_op(op))}</B>"
        if phase and phase != "forward":
            head += f' <FONT POINT-SIZE="8">[{escape(phase)}]</FONT>'
        rows.append(head)
        if module:
            rows.append(f'<FONT POINT-SIZE="8">{escape(module)}</FONT>')
    shape, dtype = info.output(node)
    if shape or dtype:
        rows.append(f'<FONT POINT-SIZE="9">{escape(shape)} {escape(_DTYPE_SHORT.get(dtype, dtype))}</FONT>')
    rows.append(f'<FONT POINT-SIZE="9">{escape(_metric_text(info, node))}</FONT>')
    return "<" + "<BR/>".join(rows) + ">"


# The deciding metric, as localization names it, in words (see tracecmp.comparison.metrics).
METRIC_WORDS = {
    "ext": "by max/min",
    "sys": "by mean/norm",
    "rms": "by rms",
    "args": "arguments differ",
    "nan_count": "NaN/Inf count",
}


def _metric_text(info: _NodeInfo, node: int) -> str:
    """The deciding number: output error in rounding units (u), what the node added, which metric decided."""
    status = info.status(node)
    if status == "unpaired":
        return "no bench counterpart"
    error = info.error(node)
    if status == "nan" and info.nonfinite(node):
        return info.nonfinite(node) + (" (first)" if info.get(node, "root_kind") == "nan" else "")
    if math.isnan(error):
        return "not compared" if status == "uncompared" else status
    if error == 0 and status == "agrees":
        return "bitwise equal"
    text = f"err {format_number(error)} u"
    introduced = info.get(node, "introduced")
    if status in ("diverged", "nan") and not _missing(introduced) and 0 < float(introduced) < error:
        text += f", +{format_number(introduced)} own"
    metric = METRIC_WORDS.get(str(info.get(node, "metric", "")))
    if metric and status in ("diverged", "nan"):
        text += f" · {metric}"
    return text


def _node_attrs(info: _NodeInfo, node: int, low: float, high: float, is_root: bool, tag: str) -> dict[str, str]:
    status = info.status(node)
    fill, border, font, style = STATUS_STYLE.get(status, STATUS_STYLE["uncompared"])
    if status == "diverged":
        fill, font = diverged_fill(info.error(node), low, high)
    styles = ["filled", "rounded"] if info.get(node, "kind") != "source" else ["filled"]
    if style != "solid":
        styles.append(style)
    attrs = {
        "label": _node_label(info, node, tag if is_root else None, font),
        "fillcolor": fill,
        "color": border,
        "fontcolor": font,
        "style": ",".join(styles),
        "shape": "box" if info.get(node, "kind") != "source" else "ellipse",
        "tooltip": f"op {node}: {info.get(node, 'op', '?')} ({status})",
    }
    if is_root:
        attrs.update(penwidth="3", color=_ROOT_COLOR, peripheries="2")
        if status == "nan":
            attrs["color"] = "#e7298a"
    return attrs


def _attr_text(attrs: dict[str, str]) -> str:
    parts = []
    for key, value in attrs.items():
        if key == "label" and value.startswith("<"):
            parts.append(f"{key}={value}")
        else:
            parts.append(f'{key}="{_dot_escape(value)}"')
    return ", ".join(parts)


def _dot_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _legend(focus: Focus) -> str:
    """Graph label: the title, the reason, and the colour key."""
    cells = [
        ("#a6dba0", "agrees", "#000000"),
        ("#e5f5e0", "noise", "#000000"),
        ("#fdae61", "diverged", "#000000"),
        ("#d73027", "more error", "#ffffff"),
        ("#2d004b", "NaN/Inf", "#ffffff"),
        ("#e0e0e0", "unpaired", "#000000"),
        ("#ffffff", "not compared", "#525252"),
    ]
    key = "".join(
        f'<TD BGCOLOR="{fill}" BORDER="1" COLOR="#999999"><FONT POINT-SIZE="9" COLOR="{font}">{text}</FONT></TD>'
        for fill, text, font in cells
    )
    rows = [f'<TR><TD ALIGN="LEFT"><B>{escape(focus.title)}</B></TD></TR>']
    if focus.subtitle:
        rows.append(f'<TR><TD ALIGN="LEFT"><FONT POINT-SIZE="10">{escape(focus.subtitle)}</FONT></TD></TR>')
    rows.append(
        '<TR><TD ALIGN="LEFT"><TABLE BORDER="0" CELLSPACING="2" CELLPADDING="3"><TR>'
        + key
        + '<TD><FONT POINT-SIZE="9">  err: output error in rounding units (u) of its dtype; '
        "own: what the op added itself; edges: tensor shapes (views folded in)</FONT></TD></TR></TABLE></TD></TR>"
    )
    return '<<TABLE BORDER="0" CELLSPACING="0" CELLPADDING="2">' + "".join(rows) + "</TABLE>>"


def _module_tree(modules: set[str]) -> dict[str, list[str]]:
    """Cluster nesting over dotted module paths: parent path -> child clusters ("" is the top).

    A path gets a cluster when it holds nodes or splits into two or more; a frame around a single
    child and nothing else would add nesting without information.
    """
    present = {m for m in modules if m}
    every = {".".join(m.split(".")[: i + 1]) for m in present for i in range(m.count(".") + 1)}
    children: dict[str, set[str]] = defaultdict(set)
    for module in every:
        if "." in module:
            children[module.rpartition(".")[0]].add(module)
    kept = {m for m in every if m in present or len(children[m]) >= 2}
    tree: dict[str, list[str]] = defaultdict(list)
    for module in sorted(kept):
        parent = module
        while "." in parent:
            parent = parent.rpartition(".")[0]
            if parent in kept:
                break
        else:
            parent = ""
        tree[parent].append(module)
    return tree


def build_dot(result: Any, depth: int = 2, max_nodes: int = 60) -> str:
    """DOT text of the suspicious subgraph (what :func:`render_subgraph` feeds to ``dot``).

    >>> text = build_dot(tracecmp.compare("runs/target", "runs/bench"))  # doctest: +SKIP
    """
    sel = select(result, depth=depth, max_nodes=max_nodes)
    lines = [
        "digraph divergence {",
        f'  graph [rankdir=TB, labelloc=t, labeljust=l, fontname="{_FONT}", fontsize=12, nodesep=0.25, '
        f"ranksep=0.35, newrank=true, label={_legend(sel.focus)}];",
        f'  node [fontname="{_FONT}", fontsize=10, margin="0.12,0.05"];',
        f'  edge [fontname="{_FONT}", fontsize=8, fontcolor="#555555", color="#666666", arrowsize=0.6];',
    ]
    if not sel.shown:
        lines.append(
            '  none [shape=box, style="rounded,filled", fillcolor="#a6dba0", color="#1b7837", '
            f'label="{_dot_escape(sel.focus.title)}"];'
        )
        lines.append("}")
        return "\n".join(lines) + "\n"
    info = sel.info
    assert info is not None  # select() sets it whenever something is shown
    root = sel.focus.op_id
    errors = [info.error(n) for n in sel.shown if info.status(n) == "diverged" and info.error(n) > 0]
    low, high = (min(errors), max(errors)) if errors else (1.0, 1.0)
    by_module: dict[str, list[str]] = defaultdict(list)
    regions = {r.region_id: r for r in getattr(result, "regions", ()) if r.rank == sel.focus.rank}
    in_region: dict[int, list[str]] = defaultdict(list)
    for node in sel.shown:
        attrs = _node_attrs(info, node, low, high, node == root, sel.focus.tag)
        region = info.get(node, "region")
        if region is not None and int(region) in regions:
            in_region[int(region)].append(f"n{node} [{_attr_text(attrs)}];")
        else:
            by_module[str(info.get(node, "module", "") or "")].append(f"n{node} [{_attr_text(attrs)}];")
    root_region = info.get(root, "region") if root is not None else None
    for region_id, statements in in_region.items():
        region = regions[region_id]
        by_module[region.module].append(_region_cluster(region, statements, region_id == root_region))
    for index, (anchor, direction, hidden) in enumerate(sel.more):
        names = sorted({short_op(str(info.get(h, "op", "?"))) for h in hidden})
        listed = ", ".join(names[:3]) + (", …" if len(names) > 3 else "")
        side = "producers" if direction == "up" else "consumers"
        label = f"+{len(hidden)} more {side}\n({listed})"
        by_module[str(info.get(anchor, "module", "") or "")].append(
            f'more{index} [shape=box, style="dashed,rounded", color="#999999", fontcolor="#555555", '
            f'fontsize=9, label="{_dot_escape(label)}"];'
        )
    root_module = str(info.get(root, "module", "") or "")
    tree = _module_tree(set(by_module))
    counter = iter(range(1_000_000))

    def emit(module: str, indent: int) -> None:
        pad = "  " * indent
        bold = module == root_module or root_module.startswith(module + ".")
        fill = _CLUSTER_FILLS[min(indent - 1, len(_CLUSTER_FILLS) - 1)]
        lines.append(f"{pad}subgraph cluster_{next(counter)} {{")
        lines.append(
            f'{pad}  label="{_dot_escape(module)}"; style="rounded,filled"; fillcolor="{fill}"; '
            f'color="{_ROOT_COLOR if module == root_module else ("#555555" if bold else "#aaaaaa")}"; '
            f"penwidth={2 if module == root_module else 1}; fontsize=10;"
            + (' fontcolor="' + _ROOT_COLOR + '";' if module == root_module else "")
        )
        for statement in by_module.get(module, []):
            lines.append(f"{pad}  " + statement.replace("\n", f"\n{pad}  "))
        for child in tree.get(module, []):
            emit(child, indent + 1)
        lines.append(f"{pad}}}")

    for statement in by_module.get("", []):
        lines.append("  " + statement.replace("\n", "\n  "))
    for module in tree.get("", []):
        emit(module, 1)
    for producer, consumer, label in sel.edges:
        bold = root in (producer, consumer)
        attrs = f'label="{_dot_escape(label)}"' + (', penwidth=1.8, color="#333333"' if bold else "")
        lines.append(f"  n{producer} -> n{consumer} [{attrs}];")
    for index, (anchor, direction, _) in enumerate(sel.more):
        pair = (f"more{index}", f"n{anchor}") if direction == "up" else (f"n{anchor}", f"more{index}")
        lines.append(f'  {pair[0]} -> {pair[1]} [style=dashed, color="#999999"];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def _region_cluster(region: Any, statements: list[str], is_root: bool) -> str:
    """A box around a region's target ops, titled with its kind, and a note naming the bench ops
    it stands against (tracecmp.verdict.records.Region)."""
    counter = next(_REGION_BOXES)
    bench = op_counts(region.bench_names, limit=6) or (
        f"views only ({op_counts(region.bench_names, views=True, limit=6)})"
        if region.bench_names
        else "nothing (target-only ops)"
    )
    title = f"region {region.region_id} · {region.kind}"
    note = (
        f'region{region.region_id}_{counter} [shape=note, style="filled", fillcolor="#ffffff", color="#999999", '
        f'fontsize=8, label="{_dot_escape("bench: " + bench)}"];'
    )
    color = _ROOT_COLOR if is_root else "#6a51a3"
    body = "\n".join(["  " + st for st in statements] + ["  " + note])
    return (
        f"subgraph cluster_region{region.region_id}_{counter} {{\n"
        f'  label="{_dot_escape(title)}"; style="dashed,rounded"; color="{color}"; penwidth=2; fontsize=10; '
        f'fontcolor="{color}";\n{body}\n}}'
    )


_REGION_BOXES = iter(range(1 << 62))


def run_dot(text: str, fmt: str) -> bytes | None:
    """Lay ``text`` out with the graphviz ``dot`` binary; None when there is no ``dot`` here."""
    binary = shutil.which("dot")
    if binary is None:
        return None
    try:
        done = subprocess.run([binary, f"-T{fmt}"], input=text.encode(), capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise TracecmpError(f"graphviz dot failed to run: {exc}") from exc
    if done.returncode != 0:
        raise TracecmpError(f"graphviz dot failed: {done.stderr.decode(errors='replace').strip()[:500]}")
    return done.stdout


def render_subgraph(result: Any, path: str | Path, depth: int = 2, max_nodes: int = 60) -> Path:
    """Draw the suspicious subgraph to ``path`` (.svg, .png or .dot by suffix); returns the file written.

    graphviz's ``dot`` lays it out where it is installed; without it tracecmp's own layered layout
    (:mod:`tracecmp.render.dot`) draws the same DOT text (PNG then needs Pillow).

    >>> result = tracecmp.compare("runs/target", "runs/bench")        # doctest: +SKIP
    >>> render_subgraph(result, "out/divergence.svg")                 # doctest: +SKIP
    PosixPath('out/divergence.svg')
    """
    path = Path(path)
    _check_format(path)
    return write_picture(build_dot(result, depth=depth, max_nodes=max_nodes), path)


def _check_format(path: Path) -> None:
    if path.suffix.lower().lstrip(".") not in FORMATS:
        raise TracecmpError(
            f"cannot render to {path.suffix or 'a file without suffix'}: use .svg, .png or .dot", path=path
        )


def write_picture(dot_text: str, path: str | Path) -> Path:
    """Write DOT text to ``path`` as the picture its suffix names (.svg, .png, or the text for .dot/.gv).

    >>> write_picture('digraph { a -> b }', "out/ab.svg")   # doctest: +SKIP
    PosixPath('out/ab.svg')
    """
    path = Path(path)
    _check_format(path)
    fmt = path.suffix.lower().lstrip(".")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if fmt in ("dot", "gv"):
            path.write_text(dot_text, encoding="utf-8")
            return path
        data = run_dot(dot_text, fmt)
        if data is None:
            data = draw(dot_text, fmt)
        path.write_bytes(data)
    except OSError as exc:
        raise TracecmpError(f"cannot write the picture: {exc.strerror}", path=path) from exc
    return path
