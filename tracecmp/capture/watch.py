"""``TraceCompare(overflow=...)``: spot the first op that turns finite inputs into NaN/Inf while recording.

The statistics capture computes anyway carry NaN and Inf counts, so watching costs no pass over
the data: :class:`OverflowWatch` reads the rows as the mode appends them. A tensor is non-finite
when its counts say so; a view (no statistics of its own) when its base is. The first ``op`` row
with a non-finite output and no non-finite input is the overflow, unless the op was handed a
NaN/Inf as an argument (a causal mask's ``masked_fill(mask, -inf)``): the same rule as
:func:`tracecmp.overflow.find_overflows` applies to a finished trace.
"""

from __future__ import annotations

from tracecmp.aten.opclass import given_nonfinite
from tracecmp.trace.columns import Columns
from tracecmp.trace.schema import OPS_SCHEMA, TENSORS_SCHEMA

_T_ID, _T_OP, _T_VIEW_OF, _T_HAS_STATS, _T_NAN, _T_INF = (
    TENSORS_SCHEMA.names.index(c) for c in ("tensor_id", "op_id", "view_of", "has_stats", "nan_count", "inf_count")
)
_O_ID, _O_KIND, _O_ARGS, _O_INPUTS, _O_OUTPUTS = (
    OPS_SCHEMA.names.index(c) for c in ("op_id", "kind", "args", "inputs", "outputs")
)


class OverflowWatch:
    """Finds the first overflowing op in the row buffers of a capture mode, incrementally.

    >>> watch = OverflowWatch()
    >>> tensors = [(0, 0, 0, (2,), "float16", "cpu", -1, True, 1.0, 2.0, 1.5, 2.2, 0, 0, 0, ""),
    ...            (1, 1, 0, (2,), "float16", "cpu", -1, True, 1.0, float("inf"), 0.0, 0.0, 0, 1, 0, "")]
    >>> ops = [(0, 0, "forward", "source", "source.input", "x", "", "", "{}", (), (0,), False, False, -1, ""),
    ...        (1, 0, "forward", "op", "aten.mul.Tensor", "", "", "", "{}", (0, 0), (1,), False, False, -1, "")]
    >>> watch.scan(Columns(OPS_SCHEMA, ops), Columns(TENSORS_SCHEMA, tensors))
    1
    """

    def __init__(self) -> None:
        self.found: int | None = None  # op_id of the first overflow
        self._bad: set[int] = set()  # non-finite tensor ids seen so far
        self._ops = 0  # rows of the current buffers already looked at
        self._tensors = 0

    def scan(self, rows: Columns, tensor_rows: Columns) -> int | None:
        """Look at the rows appended since the last call; the overflowing op's id when one is among them.

        Tensor rows must carry their statistics by now (accelerators: gathered). Ops and tensors
        have increasing ids, so every input of an op was flagged before the op is judged.
        """
        start_ops, start_tensors = self._ops, self._tensors
        self._ops, self._tensors = len(rows), len(tensor_rows)
        if self.found is not None:
            return None
        bad = self._bad
        suspects: set[int] = set()
        for row in tensor_rows.rows(start_tensors):
            if row[_T_HAS_STATS]:
                if row[_T_NAN] or row[_T_INF]:
                    bad.add(row[_T_ID])
                    suspects.add(row[_T_OP])
            elif bad and row[_T_VIEW_OF] in bad:
                bad.add(row[_T_ID])
        if not suspects:
            return None
        for row in rows.rows(start_ops):
            if (
                row[_O_ID] in suspects
                and row[_O_KIND] == "op"
                and not any(t in bad for t in row[_O_INPUTS])
                and any(t in bad for t in row[_O_OUTPUTS])
                and not given_nonfinite(row[_O_ARGS])
            ):
                self.found = row[_O_ID]
                self._bad = set()
                return self.found
        return None

    def restart(self, live: set[int]) -> None:
        """The mode handed its buffers over (a chunk was taken): the next rows start at 0, and only
        values still held by a live tensor (``live``) can be an input again."""
        self._ops = self._tensors = 0
        self._bad &= live
