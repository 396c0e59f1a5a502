"""Reading DOT text into plain records: the subset tracecmp writes (nodes, edges, nested ``cluster``
subgraphs, attributes, HTML-like and plain labels); ports and ``strict`` are ignored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from tracecmp.errors import TracecmpError


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
            raise TracecmpError(f"DOT text: cannot read {text[pos : pos + 30]!r}")
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
            out.append(("id", Html(text[pos : end - 1])))
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

    def body(
        cluster: Cluster, own: dict[str, str], node_defaults: dict[str, str], edge_defaults: dict[str, str]
    ) -> None:
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
