"""Tensor identity: which recorded value each live tensor holds (capture's TensorIdTracker).

Every tensor *value* gets an id: a fresh output, a view, and each in-place write (a new version of
the same tensor). :class:`TensorIds` keeps a weak map from the tensor object to its current id, its
``_version`` and its view family, which says which value an op's input is. It is keyed by
``id(tensor)`` and checked through a weak reference: ``torch.utils.weak.WeakTensorKeyDictionary``
does the same with Python-level hashing and costs ~1.1 us per lookup here against ~0.1 us, and
every input is looked up. Autograd bumps version counters (and hands a view its base's counter)
only after the op returns, so written tensors' versions are read at the next op (:meth:`settle`).

Views share their base's version counter, so every tensor carries its *group* (view family) and
each recorded write notes the group's new version (:attr:`TensorIds.writes`): when the recorded
writes to a family account for every step its counter moved, nothing unrecorded wrote it
(:meth:`TensorIds.accounted`). What the mode records of that (an ``alias.update`` node, or a source
node) is :mod:`tracecmp.capture.mode`'s business; this module only knows ids, versions and families.

The C per-op path (``csrc/record_identity.cpp``) reads and writes the same objects by name:
:class:`TensorRef` is its ``rec_type``, and a :class:`TensorIds`' instance dict holds ``known``,
``next_id``, ``writes``, ``unsettled``, ``held`` and ``forget_cb`` (``tracecmp/_crecord.pyi``).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

_is_inference_mode_enabled = torch.is_inference_mode_enabled
WRITE_HISTORY = 16  # recorded writes remembered per view family


class TensorRef(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to a recorded tensor carrying what capture knows of it.

    One object per live tensor (not a list plus a weakref), dropped from the map by its callback
    when the tensor dies, so the map never fills with dead entries for the collector to scan.
    """

    __slots__ = ("tid", "version", "group", "key")
    tid: int  # id of the tensor's current value
    version: int | None  # its ``_version`` when recorded; None for inference tensors (no counter)
    group: int  # view family: views share their base's version counter
    key: int  # id() of the tensor, its key in the map


class TensorIds:
    """The ids of tensor values, and which one each live tensor holds now."""

    def __init__(self) -> None:
        self.known: dict[int, TensorRef] = {}  # id(tensor) -> what we know of that tensor
        self.next_id = 0  # the id the next new value gets
        self.writes: dict[int, list[list[Any]]] = {}  # group -> [[version after, tensor id]]
        # id(base) -> (group, version, base) of bases not in the trace whose views are (family)
        self.bases: dict[int, tuple[int, int | None, weakref.ref[torch.Tensor]]] = {}
        self.unsettled: list[tuple[TensorRef, list[Any]]] = []  # writes whose version is not bumped yet
        self.held: list[torch.Tensor] = []  # views written by the last op, alive until settle looks at them
        # One callable for every weak record, not one each (the C path binds its own).
        self.forget_cb: Callable[[TensorRef], Any] = self.forget

    def new_id(self) -> int:
        """A fresh value id."""
        tid = self.next_id
        self.next_id = tid + 1
        return tid

    def ref(self, t: torch.Tensor) -> TensorRef | None:
        """What is known of ``t`` (None if nothing, or only of a dead tensor whose id() ``t`` reuses)."""
        rec = self.known.get(id(t))
        return rec if rec is not None and rec() is t else None

    def current(self, t: torch.Tensor) -> int | None:
        """The id of the value ``t`` holds now, if it is known (its version has not moved since)."""
        rec = self.known.get(id(t))
        if rec is not None and rec() is t and (rec.version is None or rec.version == t._version):
            return rec.tid
        return None

    def remember(self, t: torch.Tensor, tid: int, version: int | None, group: int) -> TensorRef:
        """Note that ``t`` holds value ``tid`` at ``version``, in view family ``group``."""
        rec = TensorRef(t, self.forget_cb)
        rec.tid, rec.version, rec.group, rec.key = tid, version, group, id(t)
        self.known[rec.key] = rec
        return rec

    def forget(self, rec: TensorRef) -> None:
        """The weak records' callback: drop a dead tensor's record unless another replaced it."""
        if self.known.get(rec.key) is rec:
            del self.known[rec.key]

    def fresh(self, t: torch.Tensor) -> int:
        """A new tensor (an op's fresh output): its id, as the first value of its own family."""
        tid = self.new_id()
        version = None if _is_inference_mode_enabled() and t.is_inference() else t._version
        self.remember(t, tid, version, tid)
        return tid

    def view(self, t: torch.Tensor, base: Any) -> tuple[int, int]:
        """A view ``t`` of ``base`` (an op's output): its id, and the id of the base's value it
        views (-1 when the base is unknown: it starts a family of its own)."""
        tid = self.new_id()
        rec = self.ref(base) if isinstance(base, torch.Tensor) else None
        if rec is not None:
            # Autograd hands the view its base's version counter after the op returns.
            view_of, group, version = rec.tid, rec.group, rec.version
        else:
            view_of, group = -1, tid
            version = None if t.is_inference() else t._version
        self.remember(t, tid, version, group)
        return tid, view_of

    def wrote(self, t: torch.Tensor) -> int:
        """An op wrote ``t`` in place: the id of its new value. The version the write reaches is
        read at the next :meth:`settle`, and noted in its family's write history."""
        tid = self.new_id()
        rec = self.ref(t)
        if rec is not None:
            rec.tid = tid
        else:  # only when the written tensor was not an input (an op hiding its writes)
            rec = self.remember(t, tid, None if t.is_inference() else t._version, tid)
        if rec.version is not None:
            # Autograd bumps the version counter only after the op returns: settled at the next op.
            entry = [rec.version, tid]
            self.unsettled.append((rec, entry))
            if t._base is not None:
                self.held.append(t)  # an out= view the caller drops at once (FSDP2's): settle must see it
            group = rec.group
            history = self.writes.get(group)
            if history is None:
                self.writes[group] = [entry]
            else:
                history.append(entry)
                if len(history) > WRITE_HISTORY:
                    del history[0]
        return tid

    def settle(self, unbumped: Callable[[torch.Tensor, int], None]) -> None:
        """Read the versions of the tensors the last op wrote, once it has returned (bumped them).

        A write that did not move the counter (a custom op without an autograd kernel writing
        its ``out=`` views) is handed to ``unbumped(tensor, value id)``.
        """
        unsettled, self.unsettled = self.unsettled, []
        held, self.held = self.held, []  # noqa: F841 - kept alive until the loop has looked at them
        for rec, entry in unsettled:
            t = rec()
            if t is not None:
                version = t._version
                if version == entry[0]:
                    unbumped(t, entry[1])
                rec.version = entry[0] = version

    def accounted(self, group: int, since: int | None, version: int) -> list[int]:
        """The ids written to family ``group`` after its counter stood at ``since``, if those
        recorded writes account for every step it moved to ``version``; else []. Each write bumps
        the shared counter by one: as many recorded writes as the counter moved means nothing
        unrecorded wrote in between."""
        writes = self.writes.get(group)
        written = [w for v, w in writes if v > since] if writes and writes[-1][0] == version else []
        return written if written and len(written) == version - since else []

    def family(self, t: torch.Tensor, tid: int, version: int | None) -> tuple[int, int | None]:
        """View family of a tensor new to the trace, and the version its family had when first seen.

        A view made outside the trace joins its base's family (views share their base's version
        counter), so writes through it count for the base and its other views; a base not in the
        trace is remembered by its views, with the counter's value then, until it enters itself.
        """
        base = t._base
        if base is not None:
            rec = self.ref(base)
            if rec is not None:
                return rec.group, None
            hit = self.bases.get(id(base))
            if hit is not None and hit[2]() is base:
                return hit[0], None
            self.bases[id(base)] = (tid, version, weakref.ref(base))
            return tid, None
        hit = self.bases.get(id(t))
        if hit is not None and hit[2]() is t:
            return hit[0], hit[1]
        return tid, None

    def sweep(self) -> set[int]:
        """Forget the write history of view families nobody holds any more; returns the ids of
        the values live tensors hold."""
        recs = list(self.known.values())
        self.bases = {key: hit for key, hit in self.bases.items() if hit[2]() is not None}
        groups = {rec.group for rec in recs} | {hit[0] for hit in self.bases.values()}
        self.writes = {g: w for g, w in self.writes.items() if g in groups}
        return {rec.tid for rec in recs}
