"""Columns: capture's row buffers give back the rows they were given, as tuples and as Arrow."""

from __future__ import annotations

import array
import math
from typing import Any, Callable

import pyarrow as pa
import pytest

from tracecmp.capture import native
from tracecmp.trace.columns import Columns
from tracecmp.trace.schema import OPS_SCHEMA, TENSORS_SCHEMA

OPS = [
    (
        0,
        0,
        "forward",
        "source",
        "source.parameter",
        "fc.weight",
        "fc",
        "train.py:3",
        "{}",
        (),
        (0,),
        False,
        False,
        -1,
        "",
    ),
    (
        1,
        0,
        "forward",
        "op",
        "aten.mm.default",
        "",
        "fc",
        "train.py:3",
        '{"self":{"tensor":0}}',
        (0, 7),
        (1,),
        False,
        False,
        12,
        "",
    ),
    (2, 0, "backward", "op", "aten.split.Tensor", "", "", "", "{}", (1,), (2, 3, 4), False, False, 12, "a\nb"),
]
TENSORS = [
    (0, 0, 0, (4, 3), "float32", "cpu", -1, True, -1.0, 2.0, 0.5, 3.0, 0, 0, 123, ""),
    (1, 1, 0, (), "bfloat16", "cpu", -1, True, float("nan"), float("inf"), 0.0, 0.0, 1, 2, -5, "0/1"),
    (2, 2, 0, (2, 0, 5), "float16", "cuda:0", 1, False, None, None, None, None, None, None, None, ""),
]


def rows_table(rows: list[tuple[object, ...]], schema: pa.Schema) -> pa.Table:
    """The reference: Arrow's own conversion of the row tuples, read as struct values."""
    structs = pa.array(rows, type=pa.struct(list(schema)))
    return pa.Table.from_batches([pa.RecordBatch.from_struct_array(structs)], schema=schema)


NATIVE_BUFFER = pytest.mark.skipif(native.Buffer is None, reason="tracecmp._crecord not built")


@pytest.fixture(params=["native", "array"])
def number_array(request: pytest.FixtureRequest) -> Callable[[str], Any]:
    """Every test runs with the C Buffer and with its fallback, array.array."""
    if request.param == "native":
        if native.Buffer is None:
            pytest.skip("tracecmp._crecord not built")
        return native.Buffer
    return array.array


@pytest.mark.parametrize(("schema", "rows"), [(OPS_SCHEMA, OPS), (TENSORS_SCHEMA, TENSORS)])
def test_rows_and_table_round_trip(
    number_array: Callable[[str], Any], schema: object, rows: list[tuple[object, ...]]
) -> None:
    cols = Columns(schema, rows, number_array=number_array)
    assert len(cols) == len(rows)
    assert repr(list(cols)) == repr(rows)  # repr: NaN compares unequal to itself
    table = cols.table()
    assert table.schema == schema
    assert repr(table.to_pylist()) == repr(rows_table(rows, schema).to_pylist())


def test_rows_from_a_start_and_after_more_appends(number_array: Callable[[str], Any]) -> None:
    cols = Columns(OPS_SCHEMA, OPS[:2], number_array=number_array)
    assert list(cols.rows(1)) == OPS[1:2]
    cols.append(OPS[2])
    assert list(cols.rows(2)) == OPS[2:]  # goes on from where the last read ended
    assert list(cols.rows(1)) == OPS[1:]  # and back to an earlier row
    assert list(cols.rows(0)) == OPS
    assert list(cols.rows(3)) == []


def test_empty_columns_make_an_empty_table(number_array: Callable[[str], Any]) -> None:
    for schema in (OPS_SCHEMA, TENSORS_SCHEMA):
        table = Columns(schema, number_array=number_array).table()
        assert table.num_rows == 0 and table.schema == schema


def test_set_replaces_one_scalar_value(number_array: Callable[[str], Any]) -> None:
    cols = Columns(TENSORS_SCHEMA, TENSORS, number_array=number_array)
    cols.set(2, "max", 4.0)
    cols.set(2, "nan_count", 3)
    cols.set(0, "min", None)
    cols.set(1, "has_stats", False)
    cols.set(1, "dtype", "float64")
    rows = list(cols)
    assert rows[2][9] == 4.0 and rows[2][12] == 3 and rows[2][8] is None
    assert rows[0][8] is None and rows[1][7] is False and rows[1][4] == "float64"
    table = cols.table().to_pylist()
    assert table[2]["max"] == 4.0 and table[0]["min"] is None and table[1]["has_stats"] is False
    with pytest.raises(ValueError, match="list column"):
        cols.set(2, "shape", (1,))
    with pytest.raises(ValueError, match="cannot hold None"):
        cols.set(2, "view_of", None)


def test_set_many_replaces_a_float_column_at_rows(number_array: Callable[[str], Any]) -> None:
    cols = Columns(TENSORS_SCHEMA, TENSORS, number_array=number_array)
    cols.set(0, "min", None)
    cols.set_many("min", [0, 2], [-1.5, 7.0])
    table = cols.table().to_pylist()
    assert [table[0]["min"], table[2]["min"]] == [-1.5, 7.0]
    assert math.isnan(table[1]["min"])  # untouched
    with pytest.raises(ValueError, match="not a float column"):
        cols.set_many("nan_count", [0], [1.0])


def test_a_value_of_the_wrong_kind_is_refused(number_array: Callable[[str], Any]) -> None:
    cols = Columns(TENSORS_SCHEMA, number_array=number_array)
    with pytest.raises(TypeError):
        cols.append((0, 0, 0, (1,), "float32", "cpu", -1, True, "x", 0.0, 0.0, 0.0, 0, 0, 0, ""))
    with pytest.raises(TypeError):
        cols.append((None, 0, 0, (1,), "float32", "cpu", -1, True, 0.0, 0.0, 0.0, 0.0, 0, 0, 0, ""))


def test_the_table_does_not_hold_the_buffers(number_array: Callable[[str], Any]) -> None:
    cols = Columns(OPS_SCHEMA, number_array=number_array)
    table = None
    for i in range(5000):  # grows every array many times while earlier tables are alive
        cols.append(OPS[i % 3])
        if i % 997 == 0:
            table = cols.table()
    assert table is not None and table.num_rows == 5 * 997 + 1
    assert len(cols.table()) == 5000


@NATIVE_BUFFER
def test_buffer_behaves_as_array() -> None:
    Buffer = native.Buffer
    cases = {"q": [5, -(2**63), 2**63 - 1, True], "i": [7, -(2**31)], "d": [1.5, 2, float("nan")], "b": [1, 0, -128]}
    for code, values in cases.items():
        buffer, reference = Buffer(code), array.array(code)
        for value in values:
            buffer.append(value)
            reference.append(value)
        buffer.extend(values)
        reference.extend(values)
        assert buffer.typecode == code and len(buffer) == len(reference)
        assert bytes(buffer) == bytes(reference)
        with memoryview(buffer) as view:
            assert view.format == code and view.itemsize == reference.itemsize
            assert repr(view.tolist()) == repr(reference.tolist())
    with pytest.raises(OverflowError):
        Buffer("i").append(2**31)
    with pytest.raises(OverflowError):
        Buffer("q").append(2**63)
    with pytest.raises(TypeError):
        Buffer("q").append(1.5)
    with pytest.raises(ValueError, match="typecode"):
        Buffer("f")
    grown = Buffer("q")
    grown.append(1)
    with memoryview(grown):
        with pytest.raises(BufferError):
            for value in range(1000):  # it may not move its storage while viewed
                grown.append(value)
    grown.append(2)


def test_a_row_that_cannot_be_stored_leaves_the_columns_as_they_were(number_array: Callable[[str], Any]) -> None:
    cols = Columns(TENSORS_SCHEMA, TENSORS[:2], number_array=number_array)
    bad = (5, 5, 0, (7, 8), "float32", "cpu", -1, True, 0.0, 1.0, 0.5, 1.0, 0, 0, "not an int", "")
    with pytest.raises(TypeError):
        cols.append(bad)  # fails at the checksum, after the shape's items and most numbers went in
    assert repr(list(cols)) == repr(TENSORS[:2])
    assert repr(cols.table().to_pylist()) == repr(rows_table(TENSORS[:2], TENSORS_SCHEMA).to_pylist())
    cols.append(TENSORS[2])
    assert repr(list(cols)) == repr(TENSORS)


def test_out_of_step_buffers_are_refused_not_written(number_array: Callable[[str], Any]) -> None:
    cols = Columns(OPS_SCHEMA, OPS, number_array=number_array)
    cols.parts[0].append(99)  # a row id with no row: a bug the table must not write
    with pytest.raises(ValueError, match="out of step"):
        cols.table()
    cols = Columns(OPS_SCHEMA, OPS, number_array=number_array)
    cols.parts[9].append(5)  # an input id with no length
    with pytest.raises(ValueError, match="out of step"):
        cols.table()
