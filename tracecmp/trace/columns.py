"""Row buffers kept as columns: what capture appends to and the writer turns into Arrow tables.

One Python list per column. Ints, floats, strings, bools and None go in as they are; a list
column (``inputs``, ``outputs``, ``shape``) keeps its items flat in one list and each row's length
in another. No object is made per row: a second of buffered steps gives the garbage collector
nothing new to scan (a tuple per row filled its young generation, survived into the old one and
set off full collections, ~0.15 s each with torch loaded), and Arrow builds each column from
one list, several times faster than from row tuples.

>>> cols = Columns(pa.schema([("x", pa.int64()), ("ids", pa.list_(pa.int64()))]))
>>> cols.append((1, (2, 3))); cols.append((4, ()))
>>> cols.table().to_pydict()
{'x': [1, 4], 'ids': [[2, 3], []]}
>>> list(cols.rows(1)), len(cols)
([(4, ())], 2)
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator

import pyarrow as pa
import pyarrow.compute as pc


class Columns:
    """The rows of one table of ``schema``, as one list per column (two for a list column).

    ``parts`` holds the lists in schema order, a list column as its flat items then its lengths;
    the native per-op path (``csrc/record.cpp``) appends to them directly, in the same layout.
    """

    __slots__ = ("schema", "parts", "_layout", "_mark")

    def __init__(self, schema: pa.Schema, rows: Iterable[tuple[Any, ...]] = ()) -> None:
        self.schema = schema
        layout: list[tuple[int, bool]] = []  # per field: its first list in parts, whether a list column
        count = 0
        for field in schema:
            is_list = pa.types.is_list(field.type)
            layout.append((count, is_list))
            count += 2 if is_list else 1
        self.parts: tuple[list[Any], ...] = tuple([] for _ in range(count))
        self._layout = tuple(layout)
        # Where the last full read by rows() ended (row, list-column offsets there): a reader
        # that goes on from there, as the overflow watch does at every op, sums no lengths again.
        self._mark: tuple[int, dict[int, int]] = (0, {index: 0 for index, is_list in layout if is_list})
        for row in rows:
            self.append(row)

    def append(self, row: tuple[Any, ...]) -> None:
        """Append one row given in schema order (a list column's value as a tuple or list)."""
        parts = self.parts
        for value, (index, is_list) in zip(row, self._layout):
            if is_list:
                parts[index].extend(value)
                parts[index + 1].append(len(value))
            else:
                parts[index].append(value)

    def __len__(self) -> int:
        return len(self.parts[0])

    def rows(self, start: int = 0) -> Iterator[tuple[Any, ...]]:
        """The rows from ``start`` on, as tuples in schema order (list columns as tuples)."""
        parts, layout = self.parts, self._layout
        mark, marked = self._mark
        if mark > start:
            mark, marked = 0, {index: 0 for index in marked}
        offsets = {index: offset + sum(parts[index + 1][mark:start]) for index, offset in marked.items()}
        end = len(self)
        for i in range(start, end):
            row = []
            for index, is_list in layout:
                if is_list:
                    begin = offsets[index]
                    end = offsets[index] = begin + parts[index + 1][i]
                    row.append(tuple(parts[index][begin:end]))
                else:
                    row.append(parts[index][i])
            yield tuple(row)
        self._mark = (end, offsets)

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        return self.rows()

    def set(self, index: int, name: str, value: Any) -> None:
        """Replace the value of scalar column ``name`` in row ``index``."""
        position, is_list = self._layout[self.schema.get_field_index(name)]
        if is_list:
            raise ValueError(f"column {name!r} is a list column")
        self.parts[position][index] = value

    def table(self) -> pa.Table:
        """The rows as an Arrow table of ``schema``."""
        arrays = []
        for field, (index, is_list) in zip(self.schema, self._layout):
            if is_list:
                lengths = pa.array(self.parts[index + 1], type=pa.int32())
                offsets = pa.concat_arrays([pa.array([0], type=pa.int32()), pc.cumulative_sum(lengths)])
                values = pa.array(self.parts[index], type=field.type.value_type)
                arrays.append(pa.ListArray.from_arrays(offsets, values, type=field.type))
            else:
                arrays.append(pa.array(self.parts[index], type=field.type))
        return pa.Table.from_arrays(arrays, schema=self.schema)
