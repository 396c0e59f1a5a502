"""Columns: capture's row buffers give back the rows they were given, as tuples and as Arrow."""
from __future__ import annotations

import pytest

from tracecmp.trace.columns import Columns
from tracecmp.trace.schema import OPS_SCHEMA, TENSORS_SCHEMA
from tracecmp.trace.writer import rows_table

OPS = [
    (0, 0, "forward", "source", "source.parameter", "fc.weight", "fc", "train.py:3", "{}", (), (0,), False, False, -1, ""),
    (1, 0, "forward", "op", "aten.mm.default", "", "fc", "train.py:3", '{"self":{"tensor":0}}', (0, 7), (1,), False, False, 12, ""),
    (2, 0, "backward", "op", "aten.split.Tensor", "", "", "", "{}", (1,), (2, 3, 4), False, False, 12, "a\nb"),
]
TENSORS = [
    (0, 0, 0, (4, 3), "float32", "cpu", -1, True, -1.0, 2.0, 0.5, 3.0, 0, 0, 123, ""),
    (1, 1, 0, (), "bfloat16", "cpu", -1, True, float("nan"), float("inf"), 0.0, 0.0, 1, 2, -5, "0/1"),
    (2, 2, 0, (2, 0, 5), "float16", "cuda:0", 1, False, None, None, None, None, None, None, None, ""),
]


@pytest.mark.parametrize(("schema", "rows"), [(OPS_SCHEMA, OPS), (TENSORS_SCHEMA, TENSORS)])
def test_rows_and_table_round_trip(schema: object, rows: list[tuple[object, ...]]) -> None:
    cols = Columns(schema, rows)
    assert len(cols) == len(rows)
    assert repr(list(cols)) == repr(rows)  # repr: NaN compares unequal to itself
    table = cols.table()
    assert table.schema == schema
    assert repr(table.to_pylist()) == repr(rows_table(rows, schema).to_pylist())


def test_rows_from_a_start_and_after_more_appends() -> None:
    cols = Columns(OPS_SCHEMA, OPS[:2])
    assert list(cols.rows(1)) == OPS[1:2]
    cols.append(OPS[2])
    assert list(cols.rows(2)) == OPS[2:]  # goes on from where the last read ended
    assert list(cols.rows(1)) == OPS[1:]  # and back to an earlier row
    assert list(cols.rows(0)) == OPS
    assert list(cols.rows(3)) == []


def test_empty_columns_make_an_empty_table() -> None:
    for schema in (OPS_SCHEMA, TENSORS_SCHEMA):
        table = Columns(schema).table()
        assert table.num_rows == 0 and table.schema == schema


def test_set_replaces_one_scalar_value() -> None:
    cols = Columns(TENSORS_SCHEMA, TENSORS)
    cols.set(2, "max", 4.0)
    assert list(cols)[2][9] == 4.0
    with pytest.raises(ValueError, match="list column"):
        cols.set(2, "shape", (1,))
