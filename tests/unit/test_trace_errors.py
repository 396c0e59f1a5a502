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


def ops_columns(inputs: list[list[int]], outputs: list[list[int]]) -> dict[str, list[Any]]:
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


def tensors_columns(ids: list[int], producers: list[int]) -> dict[str, list[Any]]:
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
    return _write(
        tmp_path / "good", ops_columns([[], [0], [1]], [[0], [1], [2]]), tensors_columns([0, 1, 2], [0, 1, 2])
    )


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
        writer.write_chunk(ops_columns([[], [0]], [[0], [1]]), tensors_columns([0, 1], [0, 1]), steps=[0])
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
    bad = _write(tmp_path / "bad", ops_columns([[], [0], [7]], [[0], [1], [2]]), tensors_columns([0, 1, 2], [0, 1, 2]))
    _expect(TraceFormatError, bad, "refer to tensors the trace does not hold", bad)


def test_tensors_naming_missing_producers(tmp_path: Path) -> None:
    bad = _write(tmp_path / "bad", ops_columns([[], [0], [1]], [[0], [1], [2]]), tensors_columns([0, 1, 2], [0, 1, 9]))
    _expect(TraceFormatError, bad, "producer ops the trace does not hold", bad)


def test_cli_inspect_bad_trace_exits_2_with_one_line(good: Path) -> None:
    chunk = good / "rank0" / "ops-00000.parquet"
    chunk.write_bytes(chunk.read_bytes()[:-10])
    result = subprocess.run(
        [sys.executable, "-m", "tracecmp", "inspect", str(good)], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(chunk) in lines[0] and "truncated" in lines[0]


def test_checksums_keep_all_64_bits_next_to_rows_without_statistics(tmp_path: Path) -> None:
    """A nullable integer column would turn float64 in pandas and lose the checksum's low bits."""
    tensors = tensors_columns([0, 1], [0, 1])
    tensors["checksum"] = [None, (1 << 62) + 1]
    tensors["nan_count"] = [None, 0]
    tensors["has_stats"] = [False, True]
    trace = tracecmp.load(_write(tmp_path / "t", ops_columns([[], [0]], [[0], [1]]), tensors))
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


# -- hostile input: bounded before it is parsed, refused in one line ----------------------------
def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    from tracecmp.cli.main import main

    code = main(argv)
    return code, capsys.readouterr().err


def test_deeply_nested_manifest_is_refused_before_parsing(good: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = good / "rank0" / "manifest.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    _expect(TraceFormatError, path, "nested 100000 levels deep", good)
    for argv in (["inspect", str(good)], ["overflow", str(good)], ["compare", str(good), str(good)]):
        code, err = _cli(argv, capsys)
        assert code == 2, argv  # for compare, 1 would read "divergence found" to a CI gate
        assert len(err.strip().splitlines()) == 1 and str(path) in err and "Traceback" not in err


def test_compare_of_a_hostile_trace_exits_2_in_a_real_process(good: Path) -> None:
    (good / "manifest.json").write_text(
        '{"format": "tracecmp-trace", "format_version": 1, "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    )
    result = subprocess.run(
        [sys.executable, "-m", "tracecmp", "compare", str(good), str(good)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "manifest.json" in result.stderr


def test_oversized_manifest_is_refused_unread(good: Path) -> None:
    path = good / "manifest.json"
    path.write_text('{"format": "tracecmp-trace", "format_version": 1, "pad": "' + "x" * (17 << 20) + '"}')
    _expect(TraceFormatError, path, r"at most 16,777,216 are read", good)


@pytest.mark.parametrize(
    ("field", "value"),
    [("complete", "yes"), ("rank", -1), ("info", []), ("world_size", True), ("device", 3), ("stopped", "x")],
)
def test_rank_manifest_fields_of_the_wrong_type(good: Path, field: str, value: Any) -> None:
    path, manifest = _rank_manifest(good)
    manifest[field] = value
    path.write_text(json.dumps(manifest))
    _expect(TraceFormatError, path, f"field '{field}'", good)


@pytest.mark.parametrize("field", ["options", "versions", "determinism"])
def test_run_manifest_fields_of_the_wrong_type(good: Path, field: str) -> None:
    path = good / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest[field] = "not a mapping"
    path.write_text(json.dumps(manifest))
    _expect(TraceFormatError, path, f"field '{field}'", good)


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        (("rows", "ops"), 10**15, "other row counts"),
        (("rows", "ops"), -1, "no row counts"),
        (("steps",), [2**40], "steps are not a list of step numbers"),
        (("ops", "bytes"), 2**62, "truncated or altered"),
        (("ops", "file"), "../../../../dev/zero", "outside its folder"),
        (("ops", "file"), "/dev/zero", "outside its folder"),
        (("ops", "crc32"), "0", "malformed ops file entry"),
    ],
)
def test_chunk_record_values_out_of_bounds(good: Path, key: tuple[str, ...], value: Any, match: str) -> None:
    path = good / "rank0" / "chunk-00000.json"
    record = json.loads(path.read_text())
    target = record
    for part in key[:-1]:
        target = target[part]
    target[key[-1]] = value
    path.write_text(json.dumps(record))
    with pytest.raises(TraceFormatError, match=match):
        tracecmp.load(good)


@pytest.mark.parametrize("kind", ["dev-zero", "loop", "fifo"])
def test_chunk_files_that_are_not_regular_files(good: Path, kind: str) -> None:
    import os

    chunk = good / "rank0" / "ops-00000.parquet"
    chunk.unlink()
    if kind == "dev-zero":
        chunk.symlink_to("/dev/zero")
    elif kind == "loop":
        chunk.symlink_to(chunk.name)
    else:
        os.mkfifo(chunk)  # reading it would wait for a writer forever
    _expect(TraceFormatError, chunk, "not a regular file", good)


def test_a_manifest_that_is_a_fifo_does_not_hang(good: Path) -> None:
    import os

    path = good / "rank0" / "manifest.json"
    path.unlink()
    os.mkfifo(path)
    _expect(TraceFormatError, path, "not a regular file", good)


def test_nulls_where_the_schema_has_none(tmp_path: Path) -> None:
    ops = ops_columns([[], [0], [1]], [[0], [1], [2]])
    ops["phase"][1] = None
    bad = _write(tmp_path / "bad", ops, tensors_columns([0, 1, 2], [0, 1, 2]))
    _expect(TraceFormatError, bad / "rank0" / "ops-00000.parquet", "column 'phase' holds nulls", bad)


def test_a_rank_folder_whose_manifest_names_another_rank(good: Path) -> None:
    path, manifest = _rank_manifest(good)
    path.write_text(json.dumps({**manifest, "rank": 3}))
    _expect(TraceFormatError, good / "rank0", "says rank 3", good)


def test_an_internal_error_exits_2_with_its_traceback(
    good: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug must never exit 1, which compare reserves for "divergence found"."""
    import tracecmp.cli.inspect as inspect_module

    def broken(path: Any) -> str:
        raise AttributeError("a bug")

    monkeypatch.setattr(inspect_module, "summarize", broken)
    code, err = _cli(["inspect", str(good)], capsys)
    assert code == 2 and "Traceback" in err and "internal error" in err.splitlines()[-1]


@pytest.mark.parametrize(
    "text", ["[" * 100_000 + "]" * 100_000, '{"approximate": "' + "x" * (2 << 20) + '"}'], ids=["deep", "large"]
)
def test_hostile_op_arguments_are_unreadable_not_a_crash(tmp_path: Path, text: str) -> None:
    """An op's ``args`` JSON is read by compare (argument differences) and by replay: bounded too."""
    import torch

    from tests.tracebuild import TraceBuilder

    for name in ("target", "bench"):
        builder = TraceBuilder(data=True)
        x = builder.source("input.0", torch.linspace(-2, 2, 8))
        builder.call(torch.ops.aten.gelu.default, builder.call(torch.ops.aten.mul.Tensor, x, x))
        if name == "target":
            for row in builder.ops[1:]:
                row["args"] = text
        builder.write(tmp_path / name)
    result = tracecmp.compare(tmp_path / "target", tmp_path / "bench")
    assert result.first_divergence is None or result.first_divergence.op.startswith("aten.")
