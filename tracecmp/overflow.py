"""The first op that turned finite inputs into NaN or Inf, found offline from a trace.

NPU matrix units computing in fp16 overflow (values beyond 65504) where a GPU in fp32 does not;
the first such op, not the thousands that merely carry its NaN onward, is the one to fix.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from tracecmp.trace import Trace, load

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
    out_dtypes = {o.dtype for o in outputs if not o.finite}
    for dtype in sorted(out_dtypes):
        limit = DTYPE_MAX.get(dtype)
        if limit and dtype == "float16":
            notes.append(f"output is float16: any result beyond {limit:.6g} becomes Inf")
    return tuple(notes)


def _ranges(tensor_rows: pd.DataFrame, ids: list[int]) -> list[TensorRange]:
    result = []
    for tid in ids:
        if tid not in tensor_rows.index:
            continue
        row = tensor_rows.loc[tid]
        result.append(
            TensorRange(
                int(tid),
                str(row["dtype"]),
                tuple(int(s) for s in row["shape"]),
                float(row["min"]),
                float(row["max"]),
                int(row["nan_count"]),
                int(row["inf_count"]),
            )
        )
    return result


def find_overflows(trace: Trace | str | Path, *, limit: int | None = None) -> list[Overflow]:
    """Every op, in execution order per rank, whose inputs are finite and whose outputs are not.

    Views carry no statistics of their own: a view is treated as finite exactly when its base is.

    >>> first = find_overflows("runs/target", limit=1)  # doctest: +SKIP
    """
    if not isinstance(trace, Trace):
        trace = load(trace)
    found: list[Overflow] = []
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
        ops = rank_trace.ops
        ops = ops[ops["kind"] == "op"].sort_values("op_id")
        bad_array = bad.to_dict()
        for row in ops.itertuples(index=False):
            outputs = list(row.outputs)
            if not any(bad_array.get(t, False) for t in outputs):
                continue
            inputs = list(row.inputs)
            if any(bad_array.get(t, False) for t in inputs):
                continue
            in_ranges = _ranges(tensors, inputs)
            out_ranges = _ranges(tensors, outputs)
            found.append(
                Overflow(
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
            )
            if limit is not None and len(found) >= limit:
                return found
    found.sort(key=lambda o: (o.step, o.op_id))
    return found


def first_overflow(trace: Trace | str | Path) -> Overflow | None:
    """The first op that produced NaN/Inf from finite inputs, or None.

    >>> tracecmp.overflow.first_overflow("runs/target")  # doctest: +SKIP
    """
    found = find_overflows(trace, limit=None)
    return found[0] if found else None


__all__ = ["DTYPE_MAX", "Overflow", "TensorRange", "find_overflows", "first_overflow", "overflow_notes"]
