"""The first op that turned finite inputs into NaN or Inf, found offline from a trace.

NPU matrix units computing in fp16 overflow (values beyond 65504) where a GPU in fp32 does not;
the first such op, not the thousands that merely carry its NaN onward, is the one to fix.

*Given, not overflowed.* An op handed a NaN or an infinity as a non-tensor argument made what it
was asked for: the causal mask ``masked_fill(mask, -inf)`` (what
``nn.Transformer.generate_square_subsequent_mask`` makes too), ``full(size, -inf)``, ``where`` or
``clamp`` with an infinite scalar, ``index_put`` of ``-inf``. Its non-finite outputs are not an
overflow, and the search goes on past them (their consumers read a non-finite input, as always).

*Poles are reported.* An op whose finite inputs give an exact result that is infinite
(``log(0) = -inf``, ``1 / 0``, ``rsqrt(0)``) did not overflow either, but nobody handed it the
infinity: a value reached 0 that the program did not expect to (a probability that underflowed, a
variance of a constant row). It is reported like an overflow, since it is where the non-finite
values start, with a note that says the input reached 0.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from tracecmp.aten.opclass import POLES, base_name, given_nonfinite
from tracecmp.errors import TraceFormatError
from tracecmp.trace import Trace, load
from tracecmp.trace.reader import RankTrace

# Largest finite value per dtype: an input range beyond it tells why an op overflowed.
DTYPE_MAX = {
    "float16": 65504.0,
    "bfloat16": 3.3895313892515355e38,
    "float32": 3.4028234663852886e38,
    "float8_e4m3fn": 448.0,
    "float8_e5m2": 57344.0,
}


@dataclass(frozen=True)
class TensorRange:
    """Range and non-finite counts of one tensor, as recorded."""

    tensor_id: int
    dtype: str
    shape: tuple[int, ...]
    min: float
    max: float
    nan_count: int
    inf_count: int

    @property
    def finite(self) -> bool:
        return self.nan_count == 0 and self.inf_count == 0

    def __str__(self) -> str:
        shape = "x".join(map(str, self.shape)) or "scalar"
        text = f"{self.dtype}[{shape}] range [{self.min:.6g}, {self.max:.6g}]"
        if not self.finite:
            text += f", {self.nan_count} NaN, {self.inf_count} Inf"
        return text


@dataclass(frozen=True)
class Overflow:
    """An op whose inputs were all finite and whose outputs hold NaN or Inf.

    >>> Overflow(op="aten.mm.default", module="fc", phase="forward", step=0, location="t.py:3",
    ...          op_id=4, rank=0).op
    'aten.mm.default'
    """

    op: str
    module: str
    phase: str
    step: int
    location: str
    op_id: int
    rank: int
    inputs: tuple[TensorRange, ...] = ()
    outputs: tuple[TensorRange, ...] = ()
    stack: str = ""
    notes: tuple[str, ...] = field(default=())

    @property
    def reason(self) -> str:
        bad = [o for o in self.outputs if not o.finite]
        nan = sum(o.nan_count for o in bad)
        inf = sum(o.inf_count for o in bad)
        text = f"finite inputs produced {nan} NaN and {inf} Inf"
        return text + (f" ({'; '.join(self.notes)})" if self.notes else "")

    def __str__(self) -> str:
        where = f"{self.module or '<top>'} [{self.phase}, step {self.step}, rank {self.rank}]"
        return f"{self.op} in {where} at {self.location or '?'}: {self.reason}"


def overflow_notes(op: str, inputs: list[TensorRange], outputs: list[TensorRange]) -> tuple[str, ...]:
    """Plain-language hints: which inputs or outputs sit beyond or near their dtype's range."""
    notes = []
    for position, rng in enumerate(inputs):
        limit = DTYPE_MAX.get(rng.dtype)
        peak = max(abs(rng.min), abs(rng.max)) if not math.isnan(rng.min) else math.nan
        if limit and peak > limit / 4:
            notes.append(f"input {position} reaches {peak:.6g}, near {rng.dtype}'s limit {limit:.6g}")
    if base_name(op) in POLES:
        for position, rng in enumerate(inputs):
            if rng.min <= 0.0 <= rng.max:
                notes.append(
                    f"input {position} reaches 0, where {base_name(op)}'s exact result is infinite "
                    "(a pole, not beyond the dtype's range): find why it reached 0"
                )
                break
    out_dtypes = {o.dtype for o in outputs if not o.finite}
    for dtype in sorted(out_dtypes):
        limit = DTYPE_MAX.get(dtype)
        if limit and dtype == "float16":
            notes.append(f"output is float16: any result beyond {limit:.6g} becomes Inf")
    return tuple(notes)


def _float(value: float | str) -> float | str:
    """A float for JSON: non-finite values as the strings "inf", "-inf", "nan"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def to_dict(overflow: Overflow) -> dict[str, Any]:
    """``overflow`` as plain JSON-safe data (what ``TraceCompare(overflow=...)`` stores in the rank manifest).

    >>> to_dict(Overflow("aten.mm.default", "fc", "forward", 0, "t.py:3", 4, 0))["op"]
    'aten.mm.default'
    """
    data = asdict(overflow)
    for key in ("inputs", "outputs"):
        data[key] = [{k: _float(v) if k in ("min", "max") else v for k, v in r.items()} for r in data[key]]
    data["reason"] = overflow.reason
    return data


def from_dict(data: dict[str, Any]) -> Overflow:
    """The :class:`Overflow` that :func:`to_dict` wrote.

    >>> o = Overflow("aten.mm.default", "fc", "forward", 0, "t.py:3", 4, 0)
    >>> from_dict(to_dict(o)) == o
    True
    """

    def ranges(items: list[dict[str, Any]]) -> tuple[TensorRange, ...]:
        return tuple(
            TensorRange(
                int(r["tensor_id"]),
                str(r["dtype"]),
                tuple(int(s) for s in r["shape"]),
                float(r["min"]),
                float(r["max"]),
                int(r["nan_count"]),
                int(r["inf_count"]),
            )
            for r in items
        )

    return Overflow(
        op=str(data["op"]),
        module=str(data["module"]),
        phase=str(data["phase"]),
        step=int(data["step"]),
        location=str(data["location"]),
        op_id=int(data["op_id"]),
        rank=int(data["rank"]),
        inputs=ranges(data.get("inputs", [])),
        outputs=ranges(data.get("outputs", [])),
        stack=str(data.get("stack", "")),
        notes=tuple(str(n) for n in data.get("notes", [])),
    )


def _ranges(tensors: pd.DataFrame, ids: list[int]) -> list[TensorRange]:
    """Recorded ranges of ``ids``; a view (no statistics of its own) shows its base's."""
    result = []
    for tid in ids:
        if tid not in tensors.index:
            continue
        row = tensors.loc[tid]
        stats = row
        while not stats["has_stats"] and stats["view_of"] >= 0 and stats["view_of"] in tensors.index:
            stats = tensors.loc[stats["view_of"]]
        result.append(
            TensorRange(
                int(tid),
                str(row["dtype"]),
                tuple(int(s) for s in row["shape"]),
                float(stats["min"]),
                float(stats["max"]),
                int(stats["nan_count"]) if stats["has_stats"] else 0,
                int(stats["inf_count"]) if stats["has_stats"] else 0,
            )
        )
    return result


def _overflow(row: Any, rank: int, tensors: pd.DataFrame) -> Overflow:
    in_ranges = _ranges(tensors, list(row.inputs))
    out_ranges = _ranges(tensors, list(row.outputs))
    return Overflow(
        op=row.op,
        module=row.module,
        phase=row.phase,
        step=int(row.step),
        location=row.location,
        op_id=int(row.op_id),
        rank=rank,
        inputs=tuple(in_ranges),
        outputs=tuple(out_ranges),
        stack=row.stack,
        notes=overflow_notes(row.op, in_ranges, out_ranges),
    )


def find_overflows(trace: Trace | str | Path, *, limit: int | None = None) -> list[Overflow]:
    """Every op whose inputs are finite and whose outputs are not, the first of the whole job first,
    leaving out ops handed a NaN/Inf as an argument (see the module docstring).

    Views carry no statistics of their own: a view is treated as finite exactly when its base is.
    With several ranks the ops are ordered through the collectives that link the ranks
    (:mod:`tracecmp.trace.links`), and a collective that only received NaN/Inf another rank sent
    is not an overflow of its own: the first overflow of the job is where it was born.
    ``limit`` caps the overflows looked for per rank and returned.

    >>> first = find_overflows("runs/target", limit=1)  # doctest: +SKIP
    """
    from tracecmp.trace.links import Epochs, collectives, job_order

    if not isinstance(trace, Trace):
        trace = load(trace)
    flags: dict[int, dict[int, bool]] = {}
    tables: dict[int, tuple[pd.DataFrame, pd.DataFrame]] = {}
    for rank in trace.ranks:
        rank_trace = trace.rank(rank)
        tensors = rank_trace.tensors.set_index("tensor_id")
        # Non-finite flag per tensor; views take their base's flag (resolved along view chains).
        bad = pd.Series(
            (tensors["has_stats"] & ((tensors["nan_count"] > 0) | (tensors["inf_count"] > 0))).to_numpy(),
            index=tensors.index,
        )
        view_of = tensors["view_of"]
        views = view_of[view_of >= 0]
        for tid, base in views.items():  # ids increase in execution order, so bases resolve first
            bad.at[tid] = bool(bad.get(base, False))
        flags[rank] = bad.to_dict()
        tables[rank] = (rank_trace.ops, tensors)
    calls = {rank: collectives(tables[rank][0], rank) for rank in trace.ranks} if len(trace.ranks) > 1 else {}
    sent_bad = {
        (c.rank, c.key): any(flags[c.rank].get(t, False) for t in c.sent) for items in calls.values() for c in items
    }
    found: list[Overflow] = []
    for rank in trace.ranks:
        bad_array = flags[rank]
        ops, tensors = tables[rank]
        ops = ops[ops["kind"] == "op"].sort_values("op_id")
        received = {c.op_id: c for c in calls.get(rank, [])}
        count = 0
        for row in ops.itertuples(index=False):
            outputs = list(row.outputs)
            if not any(bad_array.get(t, False) for t in outputs):
                continue
            inputs = list(row.inputs)
            if any(bad_array.get(t, False) for t in inputs) or given_nonfinite(row.args):
                continue
            call = received.get(int(row.op_id))
            if call is not None and any(sent_bad.get((q, call.key)) for q in call.contributors() if q != rank):
                continue  # another rank sent the NaN/Inf this collective received
            found.append(_overflow(row, rank, tensors))
            count += 1
            if limit is not None and count >= limit:
                break
    order = job_order(calls) if calls else {}
    epochs = {rank: Epochs(calls.get(rank, []), order) for rank in trace.ranks}
    found.sort(key=lambda o: (epochs[o.rank].of(o.op_id), o.step, o.rank, o.op_id))
    return found[:limit] if limit is not None else found


def overflow_at(rank_trace: RankTrace, op_id: int) -> Overflow:
    """The :class:`Overflow` record of op ``op_id`` of one rank (the op capture's watch found).

    >>> overflow_at(tracecmp.load("runs/target").rank(0), 17).op  # doctest: +SKIP
    'aten.mm.default'
    """
    ops = rank_trace.ops
    rows = ops[ops["op_id"] == op_id]
    if rows.empty:
        raise TraceFormatError(f"the trace holds no op {op_id}", path=rank_trace.path)
    tensors = rank_trace.tensors.set_index("tensor_id")
    return _overflow(next(rows.itertuples(index=False)), rank_trace.rank, tensors)


def recorded_overflows(trace: Trace | str | Path) -> list[Overflow]:
    """The first overflow per rank as recorded during capture (``TraceCompare(overflow=...)``).

    Empty when the capture did not watch, or watched and saw none.

    >>> recorded_overflows("runs/target")  # doctest: +SKIP
    [Overflow(op='aten.mm.default', ...)]
    """
    if not isinstance(trace, Trace):
        trace = load(trace)
    found = []
    for rank in trace.ranks:
        data = trace.rank(rank).manifest.get("info", {}).get("first_overflow")
        if data:
            try:
                found.append(from_dict(data))
            except (KeyError, TypeError, ValueError) as exc:
                raise TraceFormatError(f"unreadable first_overflow record ({exc})", path=trace.rank(rank).path) from exc
    return found


def first_overflow(trace: Trace | str | Path) -> Overflow | None:
    """The first op that produced NaN/Inf from finite inputs, or None.

    >>> tracecmp.overflow.first_overflow("runs/target")  # doctest: +SKIP
    """
    found = find_overflows(trace, limit=None)
    return found[0] if found else None


__all__ = [
    "DTYPE_MAX",
    "Overflow",
    "TensorRange",
    "find_overflows",
    "first_overflow",
    "from_dict",
    "overflow_at",
    "overflow_notes",
    "recorded_overflows",
    "to_dict",
]
