"""How the ranks of a trace link: its collective nodes, matched across ranks, and the order they impose.

Capture records each collective as a node whose ``name`` is a match key, the same on every rank
taking part (``"<group>#<n>"``, or ``"<group>#<src>><dst>#<n>"`` for point-to-point), and whose
``args`` JSON says under ``"collective"`` what it was (see ``tracecmp/capture/collectives.py``).
Ops on different ranks have no common clock, but a collective is a point every participant
passes together: :func:`job_order` numbers the matched collectives in an order consistent with
every rank's own order, and :class:`Epochs` places any op of a rank after the last collective it
had passed. Two ops are ordered across ranks only when a collective lies between them; ops of
the same epoch on different ranks are concurrent.

>>> calls = {0: [Collective(0, 5, "0#0", "all_reduce", (0, 1))], 1: [Collective(1, 7, "0#0", "all_reduce", (0, 1))]}
>>> job_order(calls)
{'0#0': 0}
>>> Epochs(calls[1], job_order(calls)).of(9)
0
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import pandas as pd

# Which ranks' sent data reaches what a rank receives, by kind.
_FROM_ALL = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"}


@dataclass(frozen=True)
class Collective:
    """One rank's collective node, as the trace records it."""

    rank: int
    op_id: int
    key: str  # the match key (the node's name)
    kind: str  # all_reduce, all_gather, reduce_scatter, broadcast, reduce, send, recv ...
    ranks: tuple[int, ...] = ()  # the group's global ranks
    group: str = ""
    reduce: str | None = None
    root: int | None = None  # broadcast / reduce / gather / scatter: global rank
    src: int | None = None  # point-to-point: sender and receiver (global ranks)
    dst: int | None = None
    sent: tuple[int, ...] = ()  # tensor ids this rank contributed
    received: tuple[int, ...] = ()  # tensor ids it filled on this rank
    op: str = ""
    step: int = 0
    phase: str = ""
    module: str = ""
    location: str = ""
    bucket: int | None = None  # DDP's bucket index, for an all-reduce of DDP's

    def contributors(self) -> tuple[int, ...]:
        """Global ranks whose sent data reaches what this rank received (itself included)."""
        if self.kind in _FROM_ALL:
            return self.ranks
        if self.kind in ("broadcast", "scatter"):
            return (self.root,) if self.root is not None else ()
        if self.kind in ("reduce", "gather"):
            return self.ranks if self.root == self.rank else ()
        if self.kind == "recv":
            return (self.src,) if self.src is not None else ()
        return ()


def collectives(ops: pd.DataFrame, rank: int) -> list[Collective]:
    """The collective nodes among a rank's ops (``RankTrace.ops``), in execution order.

    Traces written before collectives were recorded this way (or ops without the metadata) give
    none: nothing links their ranks.
    """
    mask = ops["op"].str.startswith(("c10d.", "_c10d_functional.", "c10d_functional.")) & (ops["kind"] == "op")
    found: list[Collective] = []
    for row in ops[mask].sort_values("op_id").itertuples(index=False):
        try:
            meta = json.loads(row.args).get("collective")
        except (TypeError, ValueError, AttributeError):
            meta = None
        if not isinstance(meta, dict) or not row.name:
            continue
        inputs, outputs = [int(t) for t in row.inputs], [int(t) for t in row.outputs]
        sent = tuple(inputs[i] for i in meta.get("sent", []) if isinstance(i, int) and 0 <= i < len(inputs))
        received = tuple(outputs[i] for i in meta.get("received", []) if isinstance(i, int) and 0 <= i < len(outputs))
        found.append(
            Collective(
                rank=rank,
                op_id=int(row.op_id),
                key=str(row.name),
                kind=str(meta.get("kind", "")),
                ranks=tuple(int(r) for r in meta.get("ranks", []) if isinstance(r, int)),
                group=str(meta.get("group", "")),
                reduce=meta.get("reduce"),
                root=_int(meta.get("root")),
                src=_int(meta.get("src")),
                dst=_int(meta.get("dst")),
                sent=sent,
                received=received,
                op=str(row.op),
                step=int(row.step),
                phase=str(row.phase),
                module=str(row.module),
                location=str(row.location),
                bucket=_int(meta.get("bucket")),
            )
        )
    return found


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def job_order(calls: Mapping[int, list[Collective]]) -> dict[str, int]:
    """A number for every matched collective, consistent with each rank's own order.

    Collectives are taken in turn as soon as every rank that has one is at it; where none is
    (a rank died, or the keys do not line up), the one next on the lowest rank goes first.
    """
    queues = {rank: [c.key for c in items] for rank, items in calls.items()}
    position = {rank: 0 for rank in queues}
    holders: dict[str, list[int]] = {}
    for rank, keys in queues.items():
        for key in dict.fromkeys(keys):
            holders.setdefault(key, []).append(rank)
    order: dict[str, int] = {}
    total = len(holders)
    while len(order) < total:
        heads = {rank: queues[rank][position[rank]] for rank in queues if position[rank] < len(queues[rank])}
        ready = [
            key
            for key in dict.fromkeys(heads.values())
            if all(heads.get(r) == key for r in holders[key] if position[r] < len(queues[r]))
        ]
        key = min(ready, key=lambda k: min(r for r in holders[k])) if ready else heads[min(heads)]
        order[key] = len(order)
        for rank in queues:
            while position[rank] < len(queues[rank]) and queues[rank][position[rank]] in order:
                position[rank] += 1
    return order


@dataclass
class Epochs:
    """Where a rank's ops fall among the job's collectives: after how many of them (-1: before any)."""

    calls: list[Collective]
    order: Mapping[str, int]
    _ops: list[int] = field(init=False)
    _numbers: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self._ops = [c.op_id for c in self.calls]
        running, numbers = -1, []
        for c in self.calls:
            running = max(running, self.order.get(c.key, running))
            numbers.append(running)
        self._numbers = numbers

    def of(self, op_id: int) -> int:
        """The number of the last collective at or before ``op_id`` on this rank (-1 if none)."""
        index = bisect.bisect_right(self._ops, op_id) - 1
        return self._numbers[index] if index >= 0 else -1


def by_key(calls: Iterable[Collective]) -> dict[str, dict[int, Collective]]:
    """``{key: {rank: collective}}``."""
    table: dict[str, dict[int, Collective]] = {}
    for c in calls:
        table.setdefault(c.key, {})[c.rank] = c
    return table
