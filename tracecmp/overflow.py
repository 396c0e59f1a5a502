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

from pathlib import Path

import pandas as pd

from tracecmp.aten.opclass import given_nonfinite
from tracecmp.aten.overflow import (
    DTYPE_MAX,
    Overflow,
    TensorRange,
    describe,
    from_dict,
    overflow_at,
    overflow_notes,
    to_dict,
)
from tracecmp.errors import TraceFormatError
from tracecmp.trace import Trace, load


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
            found.append(describe(row, rank, tensors))
            count += 1
            if limit is not None and count >= limit:
                break
    order = job_order(calls) if calls else {}
    epochs = {rank: Epochs(calls.get(rank, []), order) for rank in trace.ranks}
    found.sort(key=lambda o: (epochs[o.rank].of(o.op_id), o.step, o.rank, o.op_id))
    return found[:limit] if limit is not None else found


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
