"""Row buffers kept as columns: what capture appends to and the writer turns into Arrow tables.

A string column is a Python list. A number column (int64, int32, float64, bool) is an array of
raw values (``array.array``, or any type of its interface the maker names: capture's row buffers
take the native ``Buffer`` of :mod:`tracecmp.capture.native`), with a second array of 0/1 validity bytes when it may hold None (the statistics of a tensor that has
none). A list column (``inputs``, ``outputs``, ``shape``) keeps its items flat in one int64 array
and each row's length in an int32 array. Capture appends rows as it goes; the writer's thread
turns a second of them into Arrow once. From arrays of raw values that is one copy of their bytes;
from lists of Python numbers it was a pointer chase through objects made a second earlier and long
out of the caches, holding the GIL (87-115 ms for 300 small-model steps, more than half what
recording them cost). No object is made per row, so buffered steps give the garbage collector
nothing new to scan.

>>> cols = Columns(pa.schema([("x", pa.int64()), ("ids", pa.list_(pa.int64()))]))
>>> cols.append((1, (2, 3))); cols.append((4, ()))
>>> cols.table().to_pydict()
{'x': [1, 4], 'ids': [[2, 3], []]}
>>> list(cols.rows(1)), len(cols)
([(4, ())], 2)
"""

from __future__ import annotations

import array
import functools
from typing import Any, Callable, Iterable, Iterator, Sequence

import pyarrow as pa
import pyarrow.compute as pc

from tracecmp.trace.schema import STAT_COLUMNS

# Arrow type -> array typecode (bool as int8 0/1, Arrow packs it into bits when the table is built).
_CODES = {pa.int64(): "q", pa.int32(): "i", pa.float64(): "d", pa.bool_(): "b"}
# Number columns that may hold None.
NULLABLE = frozenset(STAT_COLUMNS)


def _field_kind(field: pa.Field) -> str:
    if pa.types.is_list(field.type):
        if field.type.value_type != pa.int64():
            raise TypeError(f"list column {field.name!r}: only lists of int64 are supported")
        return "l"
    if field.type in _CODES:
        return "N" if field.name in NULLABLE else "n"
    if pa.types.is_string(field.type):
        return "s"
    raise TypeError(f"column {field.name!r}: type {field.type} is not supported")


@functools.lru_cache(maxsize=None)
def _plan(schema: pa.Schema) -> tuple[tuple[str, str], ...]:
    """Per field of ``schema``: its kind and, for a number column, its typecode (read once per schema)."""
    return tuple((_field_kind(field), _CODES.get(field.type, "")) for field in schema)


def _bits(valid: Any, count: int) -> pa.Buffer:
    """The Arrow validity bitmap of ``count`` 0/1 bytes."""
    return pa.Array.from_buffers(pa.int8(), count, [None, pa.py_buffer(bytes(valid))]).cast(pa.bool_()).buffers()[1]


def _number_array(data: Any, valid: Any | None, arrow_type: pa.DataType, count: int) -> pa.Array:
    # bytes(): a copy, so that Arrow holds no view of an array capture may still append to.
    bitmap = None if valid is None else _bits(valid, count)
    if arrow_type == pa.bool_():
        values = _bits(data, count)
        return pa.Array.from_buffers(pa.bool_(), count, [bitmap, values])
    return pa.Array.from_buffers(arrow_type, count, [bitmap, pa.py_buffer(bytes(data))])


def _truncate(part: Any, size: int) -> None:
    if hasattr(part, "truncate"):  # Buffer
        part.truncate(min(size, len(part)))
    else:  # list, array.array
        del part[size:]


class Columns:
    """The rows of one table of ``schema``, one array or list per column (two for some).

    ``parts`` holds them in schema order and ``kinds`` says, one byte per field, what each field
    has there: ``s`` a list, ``n`` a number array, ``N`` a number array and its validity bytes,
    ``l`` an int64 array of items and an int32 array of lengths. The native per-op path
    (``csrc/record_buffer.cpp``) appends to them directly, in the same layout.

    ``number_array(typecode)`` makes each array of numbers: ``array.array`` or a type with its
    interface (``append``, ``extend``, ``len``, the buffer protocol with the typecode as format,
    deletion or ``truncate``).
    """

    __slots__ = ("schema", "parts", "kinds", "_layout", "_appenders", "_mark")

    def __init__(
        self,
        schema: pa.Schema,
        rows: Iterable[tuple[Any, ...]] = (),
        *,
        number_array: Callable[[str], Any] = array.array,
    ) -> None:
        self.schema = schema
        plan = _plan(schema)
        parts: list[Any] = []
        layout: list[tuple[int, str]] = []  # per field: its first part, its kind
        for kind, code in plan:
            layout.append((len(parts), kind))
            if kind == "s":
                parts.append([])
            elif kind == "l":
                parts += [number_array("q"), number_array("i")]
            else:
                parts.append(number_array(code))
                if kind == "N":
                    parts.append(number_array("b"))
        self.parts: tuple[Any, ...] = tuple(parts)
        self.kinds = "".join(kind for kind, _ in plan).encode()
        self._layout = tuple(layout)
        self._appenders: tuple[Callable[[Any], Any], ...] = ()  # made at the first append from Python
        # Where the last full read by rows() ended (row, list-column offsets there): a reader
        # that goes on from there, as the overflow watch does at every op, sums no lengths again.
        self._mark: tuple[int, dict[int, int]] = (0, {index: 0 for index, kind in layout if kind == "l"})
        for row in rows:
            self.append(row)

    def _appender(self, index: int, kind: str) -> Callable[[Any], Any]:
        parts = self.parts
        if kind in "sn":
            return parts[index].append
        if kind == "l":
            items, lengths = parts[index], parts[index + 1]

            def append_list(value: Any) -> None:
                items.extend(value)
                lengths.append(len(value))

            return append_list
        data, valid = parts[index], parts[index + 1]

        def append_nullable(value: Any) -> None:
            if value is None:
                data.append(0)
                valid.append(0)
            else:
                data.append(value)
                valid.append(1)

        return append_nullable

    def append(self, row: tuple[Any, ...]) -> None:
        """Append one row given in schema order (a list column's value as a tuple or list)."""
        appenders = self._appenders
        if not appenders:
            appenders = self._appenders = tuple(self._appender(index, kind) for index, kind in self._layout)
        before = len(self)
        try:
            for append, value in zip(appenders, row):
                append(value)
        except BaseException:
            self._rollback(before)  # a value that cannot be stored: the columns stay aligned
            raise

    def _rollback(self, rows: int) -> None:
        """Drop everything after the first ``rows`` rows (a partly appended row)."""
        parts = self.parts
        for index, kind in self._layout:
            if kind == "l":
                _truncate(parts[index + 1], rows)
                with memoryview(parts[index + 1]) as lengths:
                    _truncate(parts[index], sum(lengths))
            else:
                _truncate(parts[index], rows)
                if kind == "N":
                    _truncate(parts[index + 1], rows)

    def __len__(self) -> int:
        return len(self.parts[0])

    def values(self, name: str, start: int = 0) -> list[Any]:
        """Column ``name``'s values from row ``start`` on (a list column's as tuples).

        >>> cols = Columns(pa.schema([("x", pa.int64()), ("ids", pa.list_(pa.int64()))]), [(1, (2,)), (4, (5, 6))])
        >>> cols.values("ids", 1)
        [(5, 6)]
        """
        position = self.schema.get_field_index(name)
        index, kind = self._layout[position]
        offset = 0
        if kind == "l":
            with memoryview(self.parts[index + 1]) as lengths:
                offset = sum(lengths[:start])
        return self._values(index, kind, self.schema.field(name), start, len(self), offset)

    def truncate(self, rows: int) -> None:
        """Keep the first ``rows`` rows only."""
        self._rollback(rows)
        self._mark = (0, {index: 0 for index in self._mark[1]})

    def _values(self, index: int, kind: str, field: pa.Field, start: int, end: int, offset: int) -> list[Any]:
        """Column ``index``'s values of rows ``start`` to ``end`` as Python objects."""
        part = self.parts[index]
        if kind == "s":
            return part[start:end]
        if kind == "l":
            with memoryview(self.parts[index + 1]) as view:
                lengths = view[start:end].tolist()
            with memoryview(part) as view:
                items = view[offset : offset + sum(lengths)].tolist()
            values, begin = [], 0
            for length in lengths:
                values.append(tuple(items[begin : begin + length]))
                begin += length
            return values
        with memoryview(part) as view:
            values = view[start:end].tolist()
        if field.type == pa.bool_():
            values = [bool(value) for value in values]
        if kind == "N":
            with memoryview(self.parts[index + 1]) as view:
                valid = view[start:end].tolist()
            values = [value if ok else None for value, ok in zip(values, valid)]
        return values

    def rows(self, start: int = 0) -> Iterator[tuple[Any, ...]]:
        """The rows from ``start`` on, as tuples in schema order (list columns as tuples)."""
        parts, layout = self.parts, self._layout
        mark, marked = self._mark
        if mark > start:
            mark, marked = 0, {index: 0 for index in marked}
        offsets = dict(marked)
        for index in offsets:
            with memoryview(parts[index + 1]) as view:
                offsets[index] += sum(view[mark:start])
        end = len(self)
        columns = [
            self._values(index, kind, field, start, end, offsets.get(index, 0))
            for field, (index, kind) in zip(self.schema, layout)
        ]
        for index in offsets:
            with memoryview(parts[index + 1]) as view:
                offsets[index] += sum(view[start:end])
        self._mark = (max(end, start), offsets)
        return iter(list(zip(*columns)) if end > start else [])

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        return self.rows()

    def set(self, index: int, name: str, value: Any) -> None:
        """Replace the value of scalar column ``name`` in row ``index``."""
        field = self.schema.field(name)
        position, kind = self._layout[self.schema.get_field_index(name)]
        if kind == "l":
            raise ValueError(f"column {name!r} is a list column")
        if kind == "s":
            self.parts[position][index] = value
            return
        if value is None and kind != "N":
            raise ValueError(f"column {name!r} cannot hold None")
        number = 0 if value is None else float(value) if field.type == pa.float64() else int(value)
        with memoryview(self.parts[position]) as view:
            view[index] = number
        if kind == "N":
            with memoryview(self.parts[position + 1]) as view:
                view[index] = 0 if value is None else 1

    def set_many(self, name: str, rows: Sequence[int], values: Sequence[float]) -> None:
        """:meth:`set` of float column ``name`` at each of ``rows`` (a capture's deferred residuals:
        a few per op, so the column is looked up once)."""
        position, kind = self._layout[self.schema.get_field_index(name)]
        if kind == "l" or kind == "s" or self.schema.field(name).type != pa.float64():
            raise ValueError(f"column {name!r} is not a float column")
        with memoryview(self.parts[position]) as view:
            for index, value in zip(rows, values):
                view[index] = float(value)
        if kind == "N":
            with memoryview(self.parts[position + 1]) as view:
                for index in rows:
                    view[index] = 1

    def table(self) -> pa.Table:
        """The rows as an Arrow table of ``schema``.

        Raises ValueError if a column does not hold one value per row (Arrow would read past its
        end): appends are all or nothing, so that is a bug, never a trace to write.
        """
        count, arrays, parts = len(self), [], self.parts
        for field, (index, kind) in zip(self.schema, self._layout):
            part = parts[index]
            rows = len(parts[index + 1]) if kind == "l" else len(part)  # a list column: its lengths
            if rows != count or (kind == "N" and len(parts[index + 1]) != count):
                raise ValueError(f"row buffers out of step: column {field.name!r} holds {rows} rows, not {count}")
            if kind == "s":
                arrays.append(pa.array(part, type=field.type))
            elif kind == "l":
                lengths = pa.Array.from_buffers(pa.int32(), count, [None, pa.py_buffer(bytes(parts[index + 1]))])
                offsets = pa.concat_arrays([pa.array([0], type=pa.int32()), pc.cumulative_sum(lengths)])
                if offsets[-1].as_py() != len(part):
                    raise ValueError(
                        f"row buffers out of step: column {field.name!r} holds {len(part)} items, not {offsets[-1]}"
                    )
                values = pa.Array.from_buffers(pa.int64(), len(part), [None, pa.py_buffer(bytes(part))])
                arrays.append(pa.ListArray.from_arrays(offsets, values, type=field.type))
            else:
                valid = parts[index + 1] if kind == "N" else None
                arrays.append(_number_array(part, valid, field.type, count))
        return pa.Table.from_arrays(arrays, schema=self.schema)
