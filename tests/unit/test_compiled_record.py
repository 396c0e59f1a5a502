"""The record of compiled regions: JSON round trip, and bad records refused naming the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import tracecmp
from tests.unit.test_trace_errors import ops_columns, tensors_columns
from tracecmp.errors import TraceFormatError
from tracecmp.trace.compiled import CompiledGraph, CompiledRecord, GraphNode, GraphPart, RegionCall
from tracecmp.trace.writer import RankWriter, write_run_manifest


def _graph() -> CompiledGraph:
    nodes = (
        GraphNode("primals_1", "placeholder"),
        GraphNode(
            "relu",
            "aten.relu.default",
            ("primals_1",),
            '{"self":{"tensor":0}}',
            "fc",
            "m.py:3",
            4,
            "aten.relu.default",
            ((2,),),
            ("float32",),
        ),
        GraphNode("output", "output", ("relu",)),
    )
    backward = (
        GraphNode(
            "relu",
            "aten.relu.default",
            ("primals_1",),
            '{"self":{"tensor":0}}',
            "fc",
            "m.py:3",
            4,
            "aten.relu.default",
            ((2,),),
            ("float32",),
            recomputed=True,
        ),
        GraphNode("output", "output", ("relu",)),
    )
    return CompiledGraph(
        "g0",
        "0/0",
        "inductor",
        "m.py:1 forward",
        "",
        ("L['x']",),
        {"forward": GraphPart("forward", nodes, (), 1), "backward": GraphPart("backward", backward)},
    )


def _call(**changes: Any) -> RegionCall:
    fields: dict[str, Any] = dict(
        graph="g0",
        part="forward",
        mode="boundary",
        step=0,
        op_id=2,
        first_op=1,
        last_op=2,
        inputs=(0,),
        outputs=(2,),
        nodes={"relu": (1,)},
    )
    fields.update(changes)
    return RegionCall(**fields)


def test_round_trip() -> None:
    payload = {"graphs": [_graph().to_json()], "calls": [_call().to_json()]}
    record = CompiledRecord.from_json([json.loads(json.dumps(payload))])
    assert record.graphs["g0"] == _graph()
    assert record.calls == [_call()]
    assert record.boundary_calls() == {2: _call()}
    assert record.region_of() == {1: _call(), 2: _call()}


def test_shadow_values_round_trip_with_non_finite_statistics() -> None:
    call = _call(values={"relu": ((0.0, float("inf"), float("nan"), 2.5), (2,))})
    text = json.dumps({"graphs": [_graph().to_json()], "calls": [call.to_json()]}, allow_nan=False)
    (stats, shape) = CompiledRecord.from_json([json.loads(text)]).calls[0].values["relu"]
    assert stats[:2] == (0.0, float("inf")) and stats[2] != stats[2] and shape == (2,)


@pytest.mark.parametrize(
    "payload,match",
    [
        ({"graphs": [], "calls": [_call().to_json()]}, "names graph 'g0'"),
        (
            {"graphs": [_graph().to_json()], "calls": [{**_call().to_json(), "values": {"relu": [[1, 2], [2]]}}]},
            "are not four numbers",
        ),
        ({"graphs": [_graph().to_json()], "calls": [{**_call().to_json(), "values": []}]}, "values is not a JSON"),
        ({"graphs": [{"id": 3}], "calls": []}, "'id' is missing or not a string"),
        ({"graphs": [], "calls": [{**_call().to_json(), "mode": "fused"}]}, "unknown part"),
        ({"graphs": "g0"}, "graphs is not a JSON array"),
        ([1, 2], "compiled record is not a JSON object"),
    ],
)
def test_bad_records_are_refused(payload: Any, match: str) -> None:
    with pytest.raises(TraceFormatError, match=match):
        CompiledRecord.from_json([payload])


def _trace(tmp_path: Path, compiled: Any) -> Path:
    path = tmp_path / "t"
    write_run_manifest(path, options={"data": "stats", "compiled": "boundary"})
    writer = RankWriter(path, rank=0)
    ops = ops_columns([[], [0], [1]], [[0], [1], [2]])
    writer.write_chunk(ops, tensors_columns([0, 1, 2], [0, 1, 2]), steps=[0], compiled=compiled)
    writer.close(complete=True)
    return path


def test_a_trace_carries_its_record(tmp_path: Path) -> None:
    path = _trace(tmp_path, {"graphs": [_graph().to_json()], "calls": [_call().to_json()]})
    rank = tracecmp.load(path).rank(0)
    assert rank.compiled.calls == [_call()]
    assert not tracecmp.load(_trace(tmp_path / "plain", None)).rank(0).compiled


def test_a_corrupt_record_names_its_file(tmp_path: Path) -> None:
    path = _trace(tmp_path, {"graphs": [_graph().to_json()], "calls": [_call().to_json()]})
    record = path / "rank0" / "compiled-00000.json"
    record.write_bytes(record.read_bytes()[:-5] + b"xxxxx")
    with pytest.raises(TraceFormatError, match="CRC-32") as info:
        tracecmp.load(path)
    assert str(record) in str(info.value)


def test_a_record_naming_an_unknown_graph_names_the_rank(tmp_path: Path) -> None:
    path = _trace(tmp_path, {"graphs": [], "calls": [_call().to_json()]})
    with pytest.raises(TraceFormatError, match="names graph") as info:
        tracecmp.load(path)
    assert str(path / "rank0") in str(info.value)
