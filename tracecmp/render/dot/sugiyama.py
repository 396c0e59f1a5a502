"""The layered layout (Sugiyama), the way ``dot`` does it, in four passes: ranks by longest path,
pulled together where that shortens edges; long edges broken into chains of virtual nodes, and
every edge label given a virtual node of its own on a half rank so that labels take room instead of
overlapping; the order within each rank by barycenter sweeps that keep every cluster contiguous and
sibling clusters in one order on every rank (fewest crossings kept); x coordinates by repeated
quadratic placement under separation constraints, with each cluster a rectangle that nothing else
enters. Then y coordinates, and the :class:`~tracecmp.render.dot.drawing.Drawing`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable

from tracecmp.errors import TracecmpError
from tracecmp.render.dot.drawing import Drawing, Group, Shape, emit_block
from tracecmp.render.dot.labels import Table, TextBlock, parse_label
from tracecmp.render.dot.parse import Cluster, DotGraph, parse_dot

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
            inner = max(
                (top_offset[c.name] for c in cluster.children if self._holds_nodes(c) and self.span[id(c)][0] == lo),
                default=0.0,
            )
            top_offset[cluster.name] = inner + label_height[cluster.name] + _CLUSTER_PAD
            above[lo] = max(above[lo], top_offset[cluster.name])
            inner = max(
                (bottom_offset[c.name] for c in cluster.children if self._holds_nodes(c) and self.span[id(c)][1] == hi),
                default=0.0,
            )
            bottom_offset[cluster.name] = inner + _CLUSTER_PAD
            below[hi] = max(below[hi], bottom_offset[cluster.name])
        graph_label = (
            parse_label(self.g.attrs["label"], self.font, self.g.attrs.get("fontcolor", "#000000"))
            if self.g.attrs.get("label")
            else None
        )
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
        width = max(
            [i.x + i.right for i in self.items.values()] + [b for _, b in self.bounds.values()] + [gw], default=0.0
        )
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
            shapes.append(
                Shape(
                    "rect",
                    [(left + shift, top), (right + shift, bottom)],
                    fill=attrs.get("fillcolor") if "filled" in styles else None,
                    stroke=attrs.get("color", "#000000"),
                    width=_float(attrs, "penwidth", 1.0),
                    dash="dashed" if "dashed" in styles else "dotted" if "dotted" in styles else "",
                    radius=6.0 if "rounded" in styles else 0.0,
                )
            )
            label = self.cluster_label(cluster)
            emit_block(label, left + shift + _CLUSTER_PAD, top + 3.0, label.size()[0], shapes)
        for tail, head, attrs, chain in self.chains:
            groups.append(Group("edge", f"{tail}->{head}", self._edge(attrs, chain, centers, shift)))
        for name, attrs in self.g.nodes.items():
            groups.append(Group("node", name, self._node(name, attrs, centers, shift)))
        if graph_label is not None:
            legend: list[Shape] = []
            emit_block(graph_label, margin, margin, gw, legend)
            groups.insert(0, Group("graph", "legend", legend))
        return Drawing(
            max(width + 2 * margin, gw + 2 * margin), y + margin, groups, self.g.attrs.get("bgcolor", "#ffffff")
        )

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
        emit_block(label, cx - lw / 2, cy - lh / 2, lw, out)
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
        out.append(
            Shape(
                "polygon",
                [(x1, y1), (end[0] - half, end[1]), (end[0] + half, end[1])],
                fill=color,
                stroke=color,
                width=pen,
            )
        )
        for k, item in zip(chain, items):
            if item.kind == "label":
                label = self.labels[k]
                lw, lh = label.size()
                emit_block(label, item.x + shift + 4.0, centers[item.rank] - lh / 2, lw, out)
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


def _satisfy(
    desired: list[float], weight: list[float], topo: list[int], incoming: dict[int, list[tuple[int, float]]]
) -> list[float]:
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
