"""The dataflow graph of one rank of a trace: nodes are recorded nodes, edges are tensors.

A node is an op, a view or a source tensor (``op_id``); an edge runs from a tensor's producer to
every node that reads it, and carries the tensor's id, shape and dtype. Views carry no statistics
of their own: :func:`view_bases` maps every view output to the non-view tensor whose values (and
therefore whose error) it shows.

>>> import tracecmp
>>> g = build_graph(tracecmp.load("runs/bench").rank(0), step=0)   # doctest: +SKIP
>>> [g.nodes[n]["op"] for n in g.predecessors(42)]                 # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import networkx as nx
import numpy as np
import pandas as pd

from tracecmp.trace.reader import RankTrace

_NODE_COLUMNS = ("step", "phase", "kind", "op", "name", "module", "location", "args", "inplace", "random", "seq_nr")


def view_bases(tensors: pd.DataFrame) -> dict[int, int]:
    """``{view tensor id: id of the non-view tensor it ultimately aliases}`` (chains followed).

    A view whose base is not in the table maps to that base id anyway (its error is unknown).
    Tensors with statistics of their own are never resolved, whatever their ``view_of``.

    >>> view_bases(pd.DataFrame({"tensor_id": [1, 2, 3], "view_of": [-1, 1, 2]}))
    {2: 1, 3: 1}
    """
    mask = tensors["view_of"].to_numpy() >= 0
    if "has_stats" in tensors.columns:
        # A value with statistics of its own (capture's ``alias.update`` of a tensor written
        # through a view) shows its own numbers, not its base's.
        mask &= ~tensors["has_stats"].to_numpy(bool)
    views = tensors.loc[mask, ["tensor_id", "view_of"]]
    parent = dict(zip(views["tensor_id"].tolist(), views["view_of"].tolist()))
    resolved: dict[int, int] = {}
    for tid in parent:
        chain = []
        node = tid
        while node in parent and node not in resolved and len(chain) <= len(parent):
            chain.append(node)
            node = parent[node]
        base = resolved.get(node, node)
        for link in chain:
            resolved[link] = base
    return resolved


def edges_frame(ops: pd.DataFrame, tensors: pd.DataFrame) -> pd.DataFrame:
    """One row per (producer, consumer, tensor): columns producer, consumer, position, tensor_id, shape, dtype.

    Inputs produced by nodes outside ``ops`` (an earlier step not loaded) keep their producer id.
    """
    reads = ops[["op_id", "inputs"]].explode("inputs").dropna(subset=["inputs"])
    if reads.empty:
        return pd.DataFrame(columns=["producer", "consumer", "position", "tensor_id", "shape", "dtype"])
    reads = reads.rename(columns={"op_id": "consumer", "inputs": "tensor_id"})
    reads["position"] = reads.groupby(level=0).cumcount()
    reads["tensor_id"] = reads["tensor_id"].astype(np.int64)
    info = tensors[["tensor_id", "op_id", "shape", "dtype"]].rename(columns={"op_id": "producer"})
    edges = reads.merge(info, on="tensor_id", how="inner")
    return edges[["producer", "consumer", "position", "tensor_id", "shape", "dtype"]].reset_index(drop=True)


def build_graph(rank_trace: RankTrace, step: int | None = None, *, rank: int | None = None) -> nx.DiGraph:
    """The dataflow ``networkx.DiGraph`` of one rank, optionally restricted to one step.

    Node attributes: the trace's node columns (op, kind, name, module, phase, step, location,
    args, ...) and ``rank``. Edge attributes: ``tensor_id``, ``shape``, ``dtype`` of the first tensor
    between the two nodes, and ``tensor_ids`` listing all of them. Edges from nodes of another step
    are left out when ``step`` is given.
    """
    ops = rank_trace.ops
    if step is not None:
        ops = ops[ops["step"] == step]
    graph = nx.DiGraph(rank=rank_trace.rank if rank is None else rank, step=step)
    rank_value = graph.graph["rank"]
    columns = [c for c in _NODE_COLUMNS if c in ops.columns]
    records = ops[["op_id", *columns]].to_dict("records")
    graph.add_nodes_from((int(r.pop("op_id")), {**r, "rank": rank_value}) for r in records)
    edges = edges_frame(ops, rank_trace.tensors)
    if step is not None:
        edges = edges[edges["producer"].isin(graph)]
    for producer, consumer, tid, shape, dtype in zip(
        edges["producer"].tolist(),
        edges["consumer"].tolist(),
        edges["tensor_id"].tolist(),
        edges["shape"].tolist(),
        edges["dtype"].tolist(),
    ):
        data: dict[str, Any] | None = graph.get_edge_data(producer, consumer)
        if data is None:
            graph.add_edge(producer, consumer, tensor_id=tid, shape=tuple(shape), dtype=dtype, tensor_ids=[tid])
        else:
            data["tensor_ids"].append(tid)
    return graph
