"""Collectives at the dispatcher: recorded once they complete, named so ranks can be matched.

Every ``torch.distributed`` collective reaches capture's mode as an op: ``c10d.allreduce_``,
``c10d._allgather_base_``, ``c10d._reduce_scatter_base_``, ``c10d.broadcast_``, ``c10d.send``,
``c10d.recv_`` ... (DDP's bucket all-reduce and FSDP2's all-gather and reduce-scatter among them)
and the functional collectives ``_c10d_functional.all_reduce`` ... followed by ``wait_tensor``
(DTensor's redistributions). Their outputs are *not ready* when the op returns: right after the
call a c10d all-reduce's tensor still holds what this rank sent, an all-gather's output is
uninitialised memory, until the returned ``Work`` completes.

So a collective is recorded in two moves. At the call: one node whose inputs are every tensor
argument as it is then (what is *sent* is among them, with the statistics it already has) and
whose outputs are the tensors the collective fills (what is *received*), recorded without
statistics. At completion, their statistics: when a later op reads one of them (a correct
program waits before it reads), when ``wait_tensor`` returns (functional collectives, whose wait
is implicit), or at the hand-over of the chunk, where a ``Work`` that reports completion is read
and a collective still in flight stays without statistics, its reason counted. Capture never
waits on anything itself, so it cannot deadlock a program (a rank waiting on a receive its peer
posts later) nor change what overlaps.

What the node says (``args`` JSON, under ``"collective"``): ``kind`` (all_reduce, all_gather,
reduce_scatter, broadcast, reduce, all_to_all, gather, scatter, send, recv, barrier), ``group``
(the process group's name), ``ranks`` (its global ranks), ``reduce`` ("sum", "avg", "max" ...),
``root`` and ``peer`` (global ranks), ``async`` (``async_op``; functional collectives always),
``sent`` (positions in the node's inputs of what this rank contributes) and ``received``
(positions in its outputs). The node's ``name`` is its match key, the same on every rank that
takes part: ``"<group>#<n>"`` for the n-th collective on that group, ``"<group>#<src>><dst>#<n>"``
for the n-th point-to-point message from one global rank to another (torch's own per-group
sequence number does not count calls, so capture keeps its own counters).

A DDP bucket's all-reduce also names the bucket (``"bucket": k``); the rank manifest lists the
parameters of each bucket (``info.ddp_buckets``), from the reducer's ``GradBucket.parameters()``.
"""

from __future__ import annotations

import json
import os
import sys
import weakref
from dataclasses import dataclass
from functools import cache
from typing import Any, Callable

import torch

from tracecmp.aten.schema import OpInfo, arg_value
from tracecmp.capture.identity import TensorIds
from tracecmp.trace.args import scan_value

NAMESPACES = ("c10d.", "_c10d_functional.", "c10d_functional.")
IN_FLIGHT = "a collective still in flight when its step ended: no statistics of what it received"

_KINDS = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "broadcast_": "broadcast",
    "broadcast": "broadcast",
    "reduce_": "reduce",
    "alltoall_base_": "all_to_all",
    "alltoall_": "all_to_all",
    "all_to_all_single": "all_to_all",
    "gather_": "gather",
    "scatter_": "scatter",
    "send": "send",
    "recv_": "recv",
    "recv_any_source_": "recv",
    "barrier": "barrier",
    "monitored_barrier_": "barrier",
    "wait_tensor": "wait",
}
# c10d ops fill their ``tensors`` argument in place for these kinds; it is also what they send
# (all-reduce, broadcast, reduce) unless they only receive.
_TENSORS_RECEIVED = {"all_reduce", "broadcast", "reduce", "recv"}
_TENSORS_SENT = {"all_reduce", "broadcast", "reduce", "send"}
_REDUCTIONS = (
    {int(v): name.lower() for name, v in torch.distributed.ReduceOp.RedOpType.__members__.items()}
    if (torch.distributed.is_available())
    else {}
)


@dataclass(frozen=True)
class Signature:
    """What a collective operator's schema says about its arguments (read once per operator)."""

    kind: str  # see _KINDS; "" for the namespace's bookkeeping ops (they compute nothing)
    functional: bool  # _c10d_functional: results are returned, the wait is implicit
    names: tuple[str, ...]  # schema argument names, in order
    sent: frozenset[str]  # arguments whose tensors this rank contributes
    received: frozenset[str]  # arguments the collective fills (c10d)


@cache
def _signature(name: str, arg_names: tuple[str, ...]) -> Signature:
    base = name.split(".")[1] if name.count(".") >= 2 else name
    kind = _KINDS.get(base, "")
    functional = not name.startswith("c10d.")
    sent, received = set(), set()
    for arg in arg_names:
        if arg.startswith("input") or (arg == "tensors" and kind in _TENSORS_SENT):
            sent.add(arg)
        if arg.startswith("output") or arg == "out" or (arg == "tensors" and kind in _TENSORS_RECEIVED):
            received.add(arg)
    return Signature(kind, functional, arg_names, frozenset(sent), frozenset(received))


def signature(info: OpInfo) -> Signature:
    """The :class:`Signature` of a collective's :class:`~tracecmp.aten.schema.OpInfo`.

    >>> from tracecmp.aten.schema import op_info
    >>> s = signature(op_info(torch.ops.c10d._allgather_base_.default))
    >>> s.kind, sorted(s.sent), sorted(s.received)
    ('all_gather', ['input_tensor'], ['output_tensor'])
    """
    return _signature(info.name, info.arg_names)


def is_collective(name: str) -> bool:
    """Whether an op name is in a collective namespace (``c10d.``, ``_c10d_functional.``).

    >>> is_collective("c10d.allreduce_.default"), is_collective("aten.mm.default")
    (True, False)
    """
    return name.startswith(NAMESPACES)


@dataclass(frozen=True)
class Group:
    """A process group as a recorded collective names it."""

    name: str
    ranks: tuple[int, ...]  # global ranks, in group-rank order
    desc: str = ""

    def global_rank(self, group_rank: Any) -> int | None:
        if isinstance(group_rank, int) and 0 <= group_rank < len(self.ranks):
            return self.ranks[group_rank]
        return None


def _group_of(value: Any, cache: dict[Any, Group]) -> Group | None:
    """The :class:`Group` a collective's process-group argument (boxed, or a functional
    collective's group name) stands for; cached by name, and by the unboxed group's identity
    (the cache holds the group, so its id is never another's)."""
    import torch.distributed as dist

    try:
        if isinstance(value, str):
            hit = cache.get(value)
            if hit is not None:
                return hit
            from torch.distributed.distributed_c10d import _resolve_process_group

            pg = _resolve_process_group(value)
        else:
            pg = dist.ProcessGroup.unbox(value) if isinstance(value, torch.ScriptObject) else value
            hit = cache.get(id(pg))
            if hit is not None:
                return hit
        name = _group_name(pg)
        try:
            ranks = tuple(dist.get_process_group_ranks(pg))
        except (RuntimeError, ValueError, KeyError):  # a group torch's registry does not list
            ranks = tuple(range(pg.size())) if pg.size() == dist.get_world_size() else ()
        group = Group(name, ranks, str(getattr(pg, "group_desc", "") or ""))
    except (RuntimeError, AttributeError, TypeError, ValueError):
        return None
    cache[value if isinstance(value, str) else id(pg)] = group
    cache[("held", id(pg))] = pg  # type: ignore[assignment]
    return group


def _group_name(pg: Any) -> str:
    """A process group's name; torch < 2.2 keeps it only in its registry of groups."""
    name = getattr(pg, "group_name", None)
    if name is None:
        world = getattr(torch.distributed.distributed_c10d, "_world", None)
        name = getattr(world, "pg_names", {}).get(pg, "")
    return str(name)


def _reduction(value: Any) -> str | None:
    if isinstance(value, str):
        return value.lower()
    if isinstance(value, torch.ScriptObject):
        try:
            return _REDUCTIONS.get(int(value.op()), str(value.op()))
        except (RuntimeError, AttributeError, TypeError, ValueError):
            return None
    op = getattr(value, "op", value)  # a Python ReduceOp, or its RedOpType
    try:
        return _REDUCTIONS.get(int(op), None) if op is not None else None
    except (TypeError, ValueError):
        return None


# torch's own Python sources that issue collectives: the c10d API, DDP, FSDP, DTensor.
_ISSUERS = tuple(os.sep + os.path.join("torch", *parts) + os.sep for parts in (("distributed",), ("nn", "parallel")))


def _python_issuer(depth: int = 40) -> tuple[Any, Any] | None:
    """(process group, reduce op) of the nearest Python frame of torch's distributed code that
    issued the running collective, for a torch whose opaque arguments cannot be unboxed (2.1).

    The c10d API's functions hold ``group`` (None: the default group) and ``op``; DDP's hold
    ``process_group`` or ``self.process_group``. None when no such frame issued it (DDP's
    reducer calls its all-reduce from C++).
    """
    frame = sys._getframe(2)
    while frame is not None and depth > 0:
        if any(part in frame.f_code.co_filename for part in _ISSUERS):
            local = frame.f_locals
            for name in ("group", "pg", "process_group"):
                if name in local and (local[name] is None or isinstance(local[name], torch.distributed.ProcessGroup)):
                    return local[name], local.get("op")
            group = getattr(local.get("self"), "process_group", None)
            if isinstance(group, torch.distributed.ProcessGroup):
                return group, local.get("op")
        frame, depth = frame.f_back, depth - 1
    return None


def _arguments(sig: Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[str, Any]]:
    """(schema name, value) of every argument given, in the order ``scan`` walks them."""
    named = [(sig.names[i] if i < len(sig.names) else f"arg{i}", value) for i, value in enumerate(args)]
    named.extend(kwargs.items())
    return named


def describe(
    sig: Signature,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    groups: dict[Any, Group],
    rank: int,
    issuer: Any = None,
) -> dict[str, Any]:
    """What a collective call carries, as the node's ``args["collective"]`` (without its match key).

    ``sent`` lists the positions, among the call's tensor arguments, of what this rank contributes.
    ``issuer`` is the process group to take where the call's own cannot be read and no Python
    caller names it (DDP's, for its reducer's all-reduce).
    """
    group: Group | None = None
    meta: dict[str, Any] = {"kind": sig.kind}
    sent: list[int] = []
    position = 0
    for name, value in _arguments(sig, args, kwargs):
        found: list[torch.Tensor] = []
        scan_value(value, found)
        if name in sig.sent:
            sent.extend(range(position, position + len(found)))
        position += len(found)
        if name in ("process_group", "group_name"):
            group = _group_of(value, groups)
        elif name == "reduce_op":
            meta["reduce"] = _reduction(value)
        elif name in ("root_rank", "src") and sig.kind in ("broadcast", "reduce", "gather", "scatter"):
            meta["root"] = value
        elif name in ("dst", "src", "dstRank", "srcRank"):
            meta["peer"] = value
        elif name == "async_op":
            meta["async"] = bool(value)
    if sig.functional:
        meta["async"] = True  # the wait is implicit (wait_tensor)
    else:
        meta.setdefault("async", True)  # the schema's default: the Python API passes False when it waits
    if group is None and torch.distributed.is_available() and torch.distributed.is_initialized():
        # A torch that cannot unbox the group: the Python call that issued it names it.
        called = _python_issuer()
        pg, op = called if called is not None else (issuer, None)
        if pg is None:
            pg = torch.distributed.distributed_c10d._get_default_group()
        group = _group_of(pg, groups)
        if meta.get("reduce") is None and "reduce" in meta:
            meta["reduce"] = _reduction(op)
    if group is None and torch.distributed.is_available() and torch.distributed.is_initialized():
        # A group torch does not know: the whole world, as for the default group, so the ranks
        # still link (the name stays empty: "#<n>" keys).
        group = Group("", tuple(range(torch.distributed.get_world_size())))
    meta["group"] = group.name if group is not None else ""
    meta["ranks"] = list(group.ranks) if group is not None else []
    for key in ("root", "peer"):
        if key in meta:
            meta[key] = group.global_rank(meta[key]) if group is not None else None
    if sig.kind == "send":
        meta["src"], meta["dst"] = rank, meta.get("peer")
    elif sig.kind == "recv":
        meta["src"], meta["dst"] = meta.get("peer"), rank
    meta["sent"] = sent
    return meta


def match_key(meta: dict[str, Any], counters: dict[str, int]) -> str:
    """The node's name: the same on every rank taking part in this collective (counters advance).

    >>> counters = {}
    >>> match_key({"kind": "all_reduce", "group": "0"}, counters), match_key({"kind": "all_reduce", "group": "0"}, counters)
    ('0#0', '0#1')
    >>> match_key({"kind": "send", "group": "0", "src": 0, "dst": 1}, counters)
    '0#0>1#0'
    """
    group = meta.get("group", "")
    if meta.get("kind") in ("send", "recv"):
        channel = f"{group}#{meta.get('src')}>{meta.get('dst')}"
    else:
        channel = str(group)
    n = counters.get(channel, 0)
    counters[channel] = n + 1
    return f"{channel}#{n}"


def _tensors(value: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    scan_value(value, found)
    return found


def _future_of(out: Any) -> Any:
    """What tells when the c10d op that returned ``out`` completed: its ``Work``'s future, or the
    Work where it has none (gloo's all-gather into a tensor); None if it returned no Work.

    The future first: DDP waits on the future, and a gloo Work may report ``is_completed()`` only
    once someone called its ``wait()``.
    """
    value = out[-1] if isinstance(out, (tuple, list)) and out else out
    if not isinstance(value, torch.ScriptObject):
        return None
    try:
        work = torch.distributed.Work.unbox(value)
    except (RuntimeError, AttributeError):
        return None
    try:
        return work.get_future()
    except RuntimeError:
        return work


_WORK = getattr(torch.distributed, "Work", ()) if torch.distributed.is_available() else ()


def _completed(handle: Any) -> bool:
    """Whether a collective completed, without an error (then what it received is unknown).

    ``handle`` is its Work's future, or the Work where it has none.
    """
    try:
        if isinstance(handle, _WORK):
            return bool(handle.is_completed()) and bool(handle.is_success())
        if not handle.done():
            return False
        handle.value()  # does not block once done; raises the collective's error
    except RuntimeError:
        return False
    return True


class DDPBuckets:
    """Which parameters each DDP bucket holds, from the reducer (``GradBucket.parameters()``).

    DDP launches its buckets' all-reduces in bucket order, so the k-th all-reduce of a backward
    on DDP's process group, of the size of bucket k, is bucket k. The reducer is asked between
    steps only (it holds a lock while it launches an all-reduce), and again only after DDP
    rebuilt its buckets (once, after the first step): asking allocates a zero copy of each bucket.
    """

    def __init__(self, ddp: torch.nn.Module) -> None:
        self._ddp = weakref.ref(ddp)
        self.layout: list[tuple[int, list[str]]] = []  # per bucket: element count, parameter names
        self._stamp: Any = object()
        self.next = 0  # the bucket the next all-reduce of this backward should be

    def process_group(self) -> Any:
        """DDP's process group (None once the module is gone)."""
        ddp = self._ddp()
        return getattr(ddp, "process_group", None) if ddp is not None else None

    def refresh(self) -> None:
        """Read the bucket layout if DDP (re)built its buckets since the last look; a step begins."""
        self.next = 0
        ddp = self._ddp()
        if ddp is None:
            return
        stamp = getattr(ddp, "_has_rebuilt_buckets", None)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        from torch.utils._python_dispatch import _disable_current_modes

        try:
            with _disable_current_modes():  # its allocations are not the program's ops
                buckets = ddp.reducer._get_zeros_like_grad_buckets()  # type: ignore[union-attr,operator]
            names = {id(p): n for n, p in ddp.named_parameters()}
            self.layout = [(int(b.buffer().numel()), [names.get(id(p), "") for p in b.parameters()]) for b in buckets]
        except (AttributeError, RuntimeError):
            self.layout = []

    def bucket(self, numel: int) -> int | None:
        """The bucket an all-reduce of ``numel`` elements in backward is, if it is DDP's next one."""
        layout = self.layout
        if not layout:
            return None
        k = self.next if self.next < len(layout) and layout[self.next][0] == numel else None
        if k is None and layout[0][0] == numel:  # a second backward before the step ended
            k = 0
        if k is not None:
            self.next = (k + 1) % len(layout)
        return k


class CollectiveRecorder:
    """What capture keeps to record collectives, held by the capture mode (``mode.collectives``).

    The mode records a collective's node like any op's; this names it (its ``args["collective"]``
    and match key), and keeps what it received waiting for the collective to complete: the
    tensors' rows in the mode's buffers, filled in by ``fill(row, tensor, id)`` once it has, or
    counted by ``skip(IN_FLIGHT)`` when the step ends first. Which value a tensor holds it reads
    from the mode's :class:`~tracecmp.capture.identity.TensorIds`.
    """

    def __init__(
        self,
        ids: TensorIds,
        fill: Callable[[int, torch.Tensor, int], None],
        skip: Callable[[str], None],
        rank: int,
        ddp: torch.nn.Module | None,
    ) -> None:
        self._ids = ids
        self._fill = fill
        self._skip = skip
        # Outputs whose statistics wait for their collective: tid -> (tensor row, tensor, its Work's
        # future or None, view family). Held until then (at most to the end of the step): the
        # program may keep only views of them (FSDP2's reduce-scatter output).
        self.awaiting: dict[int, tuple[int, torch.Tensor, Any, int]] = {}
        # View family -> awaited c10d outputs in it: an op that reads any member may complete them.
        self.awaited_groups: dict[int, list[int]] = {}
        self._groups: dict[Any, Group] = {}  # also holds the process groups it names (see release_groups)
        self._counters: dict[str, int] = {}
        self._rank = rank
        self._ddp = DDPBuckets(ddp) if ddp is not None else None
        self.ddp_buckets: list[list[str]] | None = None  # bucket -> parameter names, for the manifest
        self.process_groups: dict[str, dict[str, Any]] = {}

    def release_groups(self) -> None:
        """Let go of the program's process groups when the session ends: held past it, a group the
        program destroys would live on until the interpreter's exit, and gloo's threads torn down
        that late abort the process ("terminate called without an active exception")."""
        self._groups.clear()

    def describe(
        self, sig: Signature, args: tuple[Any, ...], kwargs: dict[str, Any], phase: str, tensors: list[torch.Tensor]
    ) -> dict[str, Any]:
        """What a collective call carries (:func:`describe`), its group noted for the manifest and,
        for an all-reduce in backward, the DDP bucket it carries."""
        meta = describe(sig, args, kwargs, self._groups, self._rank, self._ddp.process_group() if self._ddp else None)
        if meta["group"] and meta["group"] not in self.process_groups:
            self.process_groups[meta["group"]] = {"ranks": meta["ranks"]}
        if sig.kind == "all_reduce" and phase == "backward" and self._ddp is not None:
            bucket = self._ddp_bucket(tensors)
            if bucket is not None:
                meta["bucket"] = bucket
                if meta.get("reduce") is None:  # unreadable on torch 2.1: the reducer's built-in sum
                    meta["reduce"] = "sum"
        return meta

    @staticmethod
    def received(sig: Signature, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> list[torch.Tensor]:
        """The tensors a collective call fills (what it receives), each once, in order."""
        if sig.functional:
            received = [t for t in _tensors(out if not isinstance(out, torch.ScriptObject) else ())]
        else:
            received = [
                t for name, value in _arguments(sig, args, kwargs) if name in sig.received for t in _tensors(value)
            ]
        seen: set[int] = set()
        unique = []
        for t in received:
            if id(t) not in seen:
                seen.add(id(t))
                unique.append(t)
        return unique

    @staticmethod
    def future(sig: Signature, out: Any) -> Any:
        """What tells when the call that returned ``out`` completed (:func:`_future_of`); None for a
        functional collective, which completes at its ``wait_tensor``."""
        return None if sig.functional else _future_of(out)

    def await_output(self, tid: int, row: int, t: torch.Tensor, future: Any, functional: bool) -> None:
        """Value ``tid`` of ``t`` (tensor row ``row``, recorded without statistics) waits for its
        collective, whose completion ``future`` tells, to complete."""
        group = self._ids.known[id(t)].group
        self.awaiting[tid] = (row, t, future, group)
        if not functional:  # functional collectives complete at wait_tensor only
            self.awaited_groups.setdefault(group, []).append(tid)

    def name(self, meta: dict[str, Any]) -> str:
        """The node's match key (:func:`match_key`), counted on this recorder's channels."""
        return match_key(meta, self._counters)

    @staticmethod
    def node_args(text: str, meta: dict[str, Any]) -> str:
        """The node's ``args`` JSON: the call's arguments as encoded (``text``) with its process group
        and reduction as named, and ``meta`` under ``"collective"``."""
        try:
            encoded = json.loads(text)
        except ValueError:
            encoded = {}
        if not isinstance(encoded, dict):
            encoded = {"args": encoded}
        for arg in ("process_group", "group_name"):
            if arg in encoded:
                encoded[arg] = meta["group"]
        if "reduce_op" in encoded and meta.get("reduce"):
            encoded["reduce_op"] = meta["reduce"]
        encoded["collective"] = meta
        return json.dumps(encoded, separators=(",", ":"))

    def _ddp_bucket(self, tensors: list[torch.Tensor]) -> int | None:
        """Which DDP bucket an all-reduce in backward carries (None: not one of DDP's)."""
        assert self._ddp is not None
        if len(tensors) != 1:
            return None
        k = self._ddp.bucket(tensors[0].numel())
        if k is not None:
            self.ddp_buckets = [names for _, names in self._ddp.layout]
        return k

    def begin(self) -> None:
        """A recorded step begins (outside any backward): the last step's collectives are settled,
        and DDP may have rebuilt its buckets."""
        if self.awaiting:
            self.settle()
        if self._ddp is not None:
            self._ddp.refresh()

    def alias(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``_wrap_tensor_autograd`` and the like move no data: unrecorded, but an awaited output
        they wrap stays awaited as the wrapper (the tensor its wait_tensor will be called on)."""
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and self.awaiting:
            for t in _tensors((args, kwargs)):
                rec = self._ids.known.get(id(t))
                if rec is not None and rec() is t and rec.tid in self.awaiting and out is not t:
                    self._ids.remember(out, rec.tid, rec.version, self.awaiting[rec.tid][3])
                    break
        return out

    def wait(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``wait_tensor``: the completion point of a functional collective, not a node of its own."""
        out = func(*args, **kwargs)
        if self.awaiting:
            for t in _tensors((args, kwargs)):
                rec = self._ids.known.get(id(t))
                if rec is None or rec() is not t:
                    continue
                # The tensor waited on may be a view of what the collective returned (DTensor's).
                for tid in [tid for tid, hit in self.awaiting.items() if hit[3] == rec.group]:
                    self._complete(tid)
        return out

    def complete_inputs(
        self, info: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any], tensors: list[torch.Tensor]
    ) -> None:
        """An op reads a tensor of an awaited c10d output's view family: the output completed.

        A correct program waits before it reads what a collective received (DDP waits on the
        future, FSDP2 on the Work, a plain call returns once done), so the first read is when
        its statistics are taken. Views read nothing, and neither does an op that only writes
        the output: gloo's reduce-scatter copies the reduced shard into it while its Work
        completes, and its Work never reports completion to anyone but its waiter.
        """
        if info.kind == "view":
            return
        groups = self.awaited_groups
        known = self._ids.known
        written = [t for ref in info.writes for t in _tensors(arg_value(ref, args, kwargs))] if info.writes else ()
        for t in tensors:
            rec = known.get(id(t))
            if rec is None or rec() is not t or rec.group not in groups or any(t is w for w in written):
                continue
            for tid in list(groups.get(rec.group, ())):
                self._complete(tid)

    def _complete(self, tid: int) -> None:
        """Fill in the statistics of a collective's output, now that it completed."""
        row, t, _, group = self.awaiting.pop(tid)
        members = self.awaited_groups.get(group)
        if members is not None and tid in members:
            members.remove(tid)
            if not members:
                del self.awaited_groups[group]
        self._fill(row, t, tid)

    def settle(self) -> None:
        """At the end of a step and before a hand-over: read what completed; what is still in
        flight keeps no statistics (capture never waits)."""
        for tid in list(self.awaiting):
            future = self.awaiting[tid][2]
            if future is not None and _completed(future):
                self._complete(tid)
            else:
                del self.awaiting[tid]
                self._skip(IN_FLIGHT)
        self.awaited_groups.clear()
