"""The overflow record: an op whose finite inputs produced NaN or Inf, as a trace's rows describe it.

Below capture, which notes the first one it sees (``TraceCompare(overflow=...)``: the rank
manifest's ``info.first_overflow``, written by :func:`to_dict`) and raises it
(:class:`tracecmp.OverflowDetected` carries one); :mod:`tracecmp.overflow` finds them in a finished
trace. The notes say what aten knows of the op (its poles) and of the dtypes' limits.

>>> Overflow("aten.mm.default", "fc", "forward", 0, "t.py:3", 4, 0).phase
'forward'
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import pandas as pd

from tracecmp.aten.opclass import POLES, base_name
from tracecmp.errors import TraceFormatError
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


def describe(row: Any, rank: int, tensors: pd.DataFrame) -> Overflow:
    """The :class:`Overflow` record of op row ``row`` (a named tuple of the ops table) of rank
    ``rank``, its tensors' ranges read from ``tensors`` (the tensors table indexed by id)."""
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
    return describe(next(rows.itertuples(index=False)), rank_trace.rank, tensors)


__all__ = ["DTYPE_MAX", "Overflow", "TensorRange", "describe", "from_dict", "overflow_at", "overflow_notes", "to_dict"]
