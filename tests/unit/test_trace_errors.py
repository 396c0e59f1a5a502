"""Bad traces: each is refused with a TracecmpError subclass naming the file and the problem."""
from __future__ import annotations

import json
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import tracecmp
from tracecmp.errors import TraceFormatError, TraceNotFoundError, TraceVersionError
from tracecmp.trace.schema import FORMAT_VERSION, STAT_COLUMNS
from tracecmp.trace.writer import RankWriter, write_run_manifest

ROOT = Path(__file__).resolve().parents[2]


def _ops(inputs: list[list[int]], outputs: list[list[int]]) -> dict[str, list[Any]]:
    n = len(inputs)
    return {
        "op_id": list(range(n)),
        "step": [0] * n,
        "phase": ["forward"] * n,
        "kind": ["source"] + ["op"] * (n - 1),
        "op": ["source.input"] + ["aten.relu.default"] * (n - 1),
        "name": ["input.0"] + [""] * (n - 1),
        "module": [""] * n,
        "location": ["train.py:1"] * n,
        "args": ["{}"] * n,
        "inputs": inputs,
        "outputs": outputs,
        "inplace": [False] * n,
        "random": [False] * n,
        "seq_nr": [-1] * n,
        "stack": [""] * n,
    }


def _tensors(ids: list[int], producers: list[int]) -> dict[str, list[Any]]:
    n = len(ids)
    columns: dict[str, list[Any]] = {
        "tensor_id": ids,
        "op_id": producers,
        "index": [0] * n,
        "shape": [[2]] * n,
        "dtype": ["float32"] * n,
        "device": ["cpu"] * n,
        "view_of": [-1] * n,
        "has_stats": [True] * n,
        "data_key": [""] * n,
    }
    for name in STAT_COLUMNS:
        columns[name] = [0] * n
    return columns


def _write(path: Path, ops: dict[str, list[Any]], tensors: dict[str, list[Any]]) -> Path:
    write_run_manifest(path, options={"data": "stats"})
    writer = RankWriter(path, rank=0)
    writer.write_chunk(ops, tensors, steps=[0])
    writer.close(complete=True)
    return path


@pytest.fixture
def good(tmp_path: Path) -> Path:
    """source -> relu -> relu: a valid two-op trace written by the real writer."""
    return _write(tmp_path / "good", _ops([[], [0], [1]], [[0], [1], [2]]), _tensors([0, 1, 2], [0, 1, 2]))


def _rank_manifest(trace: Path) -> tuple[Path, dict[str, Any]]:
    path = trace / "rank0" / "manifest.json"
    return path, json.loads(path.read_text())


def _expect(exc_type: type[Exception], path: Path | str, match: str, trace: Path) -> None:
    with pytest.raises(exc_type, match=match) as info:
        tracecmp.load(trace)
    assert str(path) in str(info.value)


def test_the_fixture_is_valid(good: Path) -> None:
    trace = tracecmp.load(good)
    assert trace.complete and len(trace.to_frame()) == 3


def test_missing_folder(tmp_path: Path) -> None:
    _expect(TraceNotFoundError, tmp_path / "nope", "no such trace folder", tmp_path / "nope")


def test_not_a_folder(tmp_path: Path) -> None:
    file = tmp_path / "file.txt"
    file.write_text("hello")
    _expect(TraceFormatError, file, "a trace is a folder", file)


def test_missing_manifest(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    _expect(TraceNotFoundError, tmp_path / "empty", "no manifest.json", tmp_path / "empty")


def test_manifest_not_json(good: Path) -> None:
    (good / "manifest.json").write_text("{not json")
    _expect(TraceFormatError, good / "manifest.json", "not valid JSON", good)


@pytest.mark.parametrize("payload", [{"hello": 1}, {"format": "msprobe-dump", "format_version": 1}, [1, 2]])
def test_foreign_json(good: Path, payload: Any) -> None:
    (good / "manifest.json").write_text(json.dumps(payload))
    _expect(TraceFormatError, good / "manifest.json", "not a tracecmp trace", good)


def test_newer_format_version(good: Path) -> None:
    path, manifest = _rank_manifest(good)
    manifest["format_version"] = FORMAT_VERSION + 1
    path.write_text(json.dumps(manifest))
    with pytest.raises(TraceVersionError, match="newer than this tracecmp reads") as info:
        tracecmp.load(good)
    assert str(path) in str(info.value)
    assert isinstance(info.value, TraceFormatError)  # callers catching format errors see it too


def test_chunk_file_missing(good: Path) -> None:
    chunk = good / "rank0" / "tensors-00000.parquet"
    chunk.unlink()
    _expect(TraceFormatError, chunk, "missing", good)


def test_truncated_parquet(good: Path) -> None:
    chunk = good / "rank0" / "ops-00000.parquet"
    data = chunk.read_bytes()
    chunk.write_bytes(data[: len(data) - 100])
    _expect(TraceFormatError, chunk, "truncated", good)


def test_corrupted_bytes(good: Path) -> None:
    chunk = good / "rank0" / "ops-00000.parquet"
    data = bytearray(chunk.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
    chunk.write_bytes(bytes(data))
    _expect(TraceFormatError, chunk, "CRC-32", good)


def test_table_with_wrong_columns(good: Path) -> None:
    chunk = good / "rank0" / "ops-00000.parquet"
    pq.write_table(pa.table({"op_id": [0], "what": ["else"]}), chunk)
    record_path = good / "rank0" / "chunk-00000.json"
    record = json.loads(record_path.read_text())
    data = chunk.read_bytes()
    record["ops"].update(bytes=len(data), crc32=zlib.crc32(data))
    record_path.write_text(json.dumps(record))
    _expect(TraceFormatError, chunk, "lacks columns", good)


def test_a_missing_chunk_record_is_a_gap_not_a_shorter_trace(tmp_path: Path) -> None:
    root = tmp_path / "gap"
    write_run_manifest(root, options={})
    writer = RankWriter(root)
    for _ in range(3):
        writer.write_chunk(_ops([[], [0]], [[0], [1]]), _tensors([0, 1], [0, 1]), steps=[0])
    writer.close(complete=True)
    (root / "rank0" / "chunk-00001.json").unlink()
    _expect(TraceFormatError, root / "rank0" / "chunk-00002.json", "chunk-00001.json is missing", root)


def test_chunk_record_row_counts_must_match_its_tables(good: Path) -> None:
    record_path = good / "rank0" / "chunk-00000.json"
    record = json.loads(record_path.read_text())
    record["rows"]["ops"] += 1
    record_path.write_text(json.dumps(record))
    _expect(TraceFormatError, record_path, "other row counts", good)


def test_ids_referencing_missing_tensors(tmp_path: Path) -> None:
    bad = _write(tmp_path / "bad", _ops([[], [0], [7]], [[0], [1], [2]]), _tensors([0, 1, 2], [0, 1, 2]))
    _expect(TraceFormatError, bad, "refer to tensors the trace does not hold", bad)


def test_tensors_naming_missing_producers(tmp_path: Path) -> None:
    bad = _write(tmp_path / "bad", _ops([[], [0], [1]], [[0], [1], [2]]), _tensors([0, 1, 2], [0, 1, 9]))
    _expect(TraceFormatError, bad, "producer ops the trace does not hold", bad)


def test_cli_inspect_bad_trace_exits_2_with_one_line(good: Path) -> None:
    chunk = good / "rank0" / "ops-00000.parquet"
    chunk.write_bytes(chunk.read_bytes()[:-10])
    result = subprocess.run(
        [sys.executable, "-m", "tracecmp", "inspect", str(good)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(chunk) in lines[0] and "truncated" in lines[0]


def test_checksums_keep_all_64_bits_next_to_rows_without_statistics(tmp_path: Path) -> None:
    """A nullable integer column would turn float64 in pandas and lose the checksum's low bits."""
    tensors = _tensors([0, 1], [0, 1])
    tensors["checksum"] = [None, (1 << 62) + 1]
    tensors["nan_count"] = [None, 0]
    tensors["has_stats"] = [False, True]
    trace = tracecmp.load(_write(tmp_path / "t", _ops([[], [0]], [[0], [1]]), tensors))
    frame = trace.rank(0).tensors
    assert frame["checksum"].dtype == "int64" and frame["nan_count"].dtype == "int64"
    assert frame["checksum"].tolist() == [0, (1 << 62) + 1]


def test_a_trace_listing_its_chunks_in_the_rank_manifest_still_loads(good: Path) -> None:
    """The early layout kept the chunk list in the rank manifest: it must not read as empty."""
    record_path = good / "rank0" / "chunk-00000.json"
    record = json.loads(record_path.read_text())
    record_path.unlink()
    path, manifest = _rank_manifest(good)
    manifest["chunks"] = [{k: record[k] for k in ("ops", "tensors", "rows")}]
    path.write_text(json.dumps(manifest))
    trace = tracecmp.load(good)
    assert len(trace.to_frame()) == 3 and trace.rank(0).manifest["steps"] == []
