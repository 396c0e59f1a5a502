"""Replay of regions (a fused op against the bench ops it replaces): the region's own error
on its recorded inputs, and whether the two sides compute the same function.

>>> found = replay_regions(target_rank, bench_rank, regions)   # doctest: +SKIP
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

from tracecmp.numerics.replay.measure import Scale, errors_on, excess, is_float
from tracecmp.numerics.replay.replayer import Replayer


@dataclass(frozen=True, slots=True)
class RegionReplay:
    """A region's own error (tracecmp.verdict.records.Region): its recorded outputs against a
    float64 replay of its computation on its recorded inputs.

    The reference is the target's own ops replayed in order where the CPU can run them all (the
    fused op itself), else the bench's ops fed the target's inputs. ``sides_differ`` is how far the
    float64 replays of the two sides lie apart on the same inputs, when both ran: beyond float64's
    rounding it means the target computes another function than the bench (a fused kernel with
    another ``eps`` or scale), NaN when not both could run.
    """

    error: float
    honest: float  # the same for the replay in the recorded dtypes: an honest implementation's error
    dtype: str  # dtype of the output that decided it
    output: int  # target tensor id of that output
    reference: str  # "target" or "bench": whose ops the float64 reference ran
    sides_differ: float = math.nan


def replay_regions(target: Any, bench: Any | None, regions: Iterable[Any]) -> dict[int, RegionReplay]:
    """Replays of ``regions`` (tracecmp.verdict.records.Region) on the target's recorded inputs,
    by region id (see :class:`RegionReplay`); regions neither side can run are absent. ``bench``
    (its rank trace) is read only for values the bench's ops read that the target has no
    counterpart of, such as a mask buffer.

    >>> replays = replay_regions(tracecmp.load("runs/target").rank(0), tracecmp.load("runs/bench").rank(0), result.regions)  # doctest: +SKIP
    >>> replays[0].error, replays[0].honest, replays[0].sides_differ                                            # doctest: +SKIP
    (3.1e-08, 2.9e-08, 1.2e-16)
    """
    found: dict[int, RegionReplay] = {}
    with _Chain(target) as t_side, _Chain(bench) if bench is not None else _NoChain() as b_side:
        for region in regions:
            replay = _replay_region(t_side, b_side, region)
            if replay is not None:
                found[region.region_id] = replay
    return found


def _replay_region(t_side: _Chain, b_side: _Chain | _NoChain, region: Any) -> RegionReplay | None:
    outputs = [(T, B) for T, B in region.outputs]
    if not outputs or not region.target_ops:
        return None
    given = {T: t_side.value(T) for T, _ in region.inputs if T is not None}
    recorded = {T: t_side.value(T) for T, _ in outputs}
    if any(v is None for v in recorded.values()):
        return None
    golden_t = honest_t = golden_b = honest_b = None
    if all(v is not None for v in given.values()):
        golden_t = t_side.run(region.target_ops, given, [T for T, _ in outputs], golden=True)
        honest_t = t_side.run(region.target_ops, given, [T for T, _ in outputs], golden=False) if golden_t else None
    if region.bench_ops and isinstance(b_side, _Chain):
        fed = {B: given[T] for T, B in region.inputs if T is not None and B is not None and given.get(T) is not None}
        for _, B in region.inputs:
            if B is not None and B not in fed:
                value = b_side.value(B)  # a value only the bench reads here (a mask buffer)
                if value is not None:
                    fed[B] = value
        if len(fed) == len({B for _, B in region.inputs if B is not None}):
            # The bench's own dtypes: the target's values (bf16, say) cast to what the bench read.
            fed_cast = {
                B: v.to(b_side.dtype(B)) if b_side.dtype(B) and v.is_floating_point() else v for B, v in fed.items()
            }
            golden_b = b_side.run(region.bench_ops, fed_cast, [B for _, B in outputs], golden=True)
            if golden_b is not None and golden_t is None:
                honest_b = b_side.run(region.bench_ops, fed_cast, [B for _, B in outputs], golden=False)
    if golden_t is not None and honest_t is not None:
        reference, honest, source = golden_t, honest_t, "target"
        keys = {T: T for T, _ in outputs}
    elif golden_b is not None and honest_b is not None:
        reference, honest, source = golden_b, honest_b, "bench"
        keys = {T: B for T, B in outputs}
    else:
        return None
    worst: RegionReplay | None = None
    for T, _ in outputs:
        ref, hon, rec = reference.get(keys[T]), honest.get(keys[T]), recorded[T]
        if ref is None or hon is None or not rec.is_floating_point() or rec.numel() != ref.numel():
            continue
        ref, hon = ref.reshape(rec.shape), hon.reshape(rec.shape).to(rec.dtype)
        scale = Scale.of(ref)
        error, honest_error = errors_on(rec, hon, scale)
        if worst is None or excess(error, honest_error) > excess(worst.error, worst.honest):
            worst = RegionReplay(error, honest_error, str(rec.dtype).removeprefix("torch."), T, source)
    if worst is None:
        return None
    differ = math.nan
    if golden_t is not None and golden_b is not None and _same_inputs(t_side, b_side, region):
        gaps = []
        for T, B in outputs:
            a, b = golden_t.get(T), golden_b.get(B)
            if a is not None and b is not None and a.numel() == b.numel() and a.is_floating_point():
                gaps.append(Scale.of(a).error(b.reshape(a.shape)))
        differ = max(gaps) if gaps else math.nan
    return RegionReplay(worst.error, worst.honest, worst.dtype, worst.output, worst.reference, differ)


def _same_inputs(t_side: _Chain, b_side: _Chain, region: Any) -> bool:
    """Both sides' ops read the same floating values from outside the region. A fused attention
    backward reads the forward's output and log-sum-exp where the eager chain reads the saved
    probabilities: both are rounded intermediates, and their float64 replays differ by that
    rounding whatever the functions."""

    def read(chain: _Chain, ops: Iterable[int]) -> set[int]:
        made = {t for o in ops for t in chain.ops[o].outputs}
        return {
            t
            for o in ops
            for t in chain.ops[o].inputs
            if t not in made and is_float(chain.info.get(t, (0, 0, "", -1, ""))[2])
        }

    partner = {T: B for T, B in region.inputs if T is not None and B is not None}
    t_read, b_read = read(t_side, region.target_ops), read(b_side, region.bench_ops)
    return all(T in partner for T in t_read) and {partner[T] for T in t_read} == b_read


class _Chain:
    """One trace's ops, re-run in order on given values (a region's side), through a :class:`Replayer`
    (its bounded cache of recorded values and its way of running an op)."""

    def __init__(self, rank: Any) -> None:
        self.replayer = Replayer(rank)
        self.ops, self.info = self.replayer.ops, self.replayer.info

    def __enter__(self) -> _Chain:
        self.replayer.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.replayer.__exit__(*exc)

    def value(self, tid: int) -> torch.Tensor | None:
        """A recorded value (None when the trace did not save it)."""
        return self.replayer.value(tid)

    def dtype(self, tid: int) -> torch.dtype | None:
        name = self.info.get(tid, (0, 0, "", -1, ""))[2]
        value = getattr(torch, name, None) if name else None
        return value if isinstance(value, torch.dtype) else None

    def run(
        self, op_ids: Iterable[int], given: Mapping[int, torch.Tensor], wanted: list[int], *, golden: bool
    ) -> dict[int, torch.Tensor] | None:
        """The values of ``wanted`` after running ``op_ids`` in order on ``given`` (in float64 with
        ``golden``, else in the recorded dtypes); None when an op cannot run (it draws random
        numbers, takes an opaque argument, or the CPU has no kernel for it)."""
        store: dict[int, torch.Tensor] = dict(given)
        for op_id in sorted(op_ids):
            op = self.ops.get(op_id)
            if op is None:
                return None
            if op.kind == "source":
                for t in op.outputs:
                    if t not in store:
                        value = self.value(t)
                        if value is None:
                            return None
                        store[t] = value
                continue
            if op.draws():
                return None
            inputs = []
            for t in op.inputs:
                value = store.get(t)
                if value is None:
                    value = self.value(t)  # read from outside the region as recorded
                if value is None:
                    return None
                inputs.append(value)
            produced = self.replayer.run(op_id, inputs, golden=golden)
            if produced is None:
                return None
            store.update(zip(op.outputs, produced))
        out = {t: store[t] for t in wanted if t in store}
        return out if len(out) == len(wanted) else None


class _NoChain:
    """Stands in for the bench's side when there is no bench trace to read."""

    def __enter__(self) -> _NoChain:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None
