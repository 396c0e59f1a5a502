"""Seeded random damage to real traces: every case must be refused in one line (exit 2) or read cleanly.

Runs as a program so that a crash of a native reader (Arrow, safetensors) is seen as a crash of
one case, not of the test session; ``tests/integration/test_reader_fuzz.py`` starts it::

    python -m tests.fuzz_reader GOOD_STATS GOOD_TENSORS --cases 200 --seed 1 --work /tmp/fuzz

Each case copies one of the two good traces, applies one mutation (bit flips, truncation at every
chunk boundary, nested and oversized JSON, wrong field types, path traversal, huge sizes and row
counts, symlinks and FIFOs, table values rewritten with their checksums fixed so that Arrow and
the comparison read them), then runs ``load`` (and every saved tensor), ``inspect``, ``overflow``
and ``compare`` against the good trace through the CLI's ``main``. A case fails when one of them
raises, prints a traceback, exits with a code its command does not use, refuses without naming a
file, or runs past ``--case-seconds``. The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import shutil
import signal
import sys
import time
import zlib
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq

Mutation = Callable[[random.Random, Path], str]  # mutates the trace at Path, returns a description


class CaseTimeout(BaseException):
    """Raised by the alarm when one case runs too long (a hang)."""


def _files(trace: Path, pattern: str = "*") -> list[Path]:
    return sorted(p for p in trace.rglob(pattern) if p.is_file() and not p.is_symlink())


def _records(trace: Path) -> list[Path]:
    return sorted((trace / "rank0").glob("chunk-*.json"))


def _load_json(path: Path) -> Any:
    return json.loads(path.read_text())


def _save_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value))


def _fix_record(trace: Path, data_file: Path) -> None:
    """Make the chunk record listing ``data_file`` agree with its new bytes (size and CRC-32)."""
    data = data_file.read_bytes()
    for record_path in _records(trace):
        record = _load_json(record_path)
        for key in ("ops", "tensors", "data"):
            entry = record.get(key)
            if isinstance(entry, dict) and entry.get("file") == data_file.name:
                entry.update(bytes=len(data), crc32=zlib.crc32(data))
                _save_json(record_path, record)


# -- mutations ---------------------------------------------------------------------------------
def flip_bits(rng: random.Random, trace: Path) -> str:
    path = rng.choice(_files(trace))
    data = bytearray(path.read_bytes())
    if not data:
        return f"{path.name}: empty, left alone"
    for _ in range(rng.randint(1, 8)):
        position = rng.randrange(len(data))
        data[position] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))
    return f"bit flips in {path.relative_to(trace)}"


def flip_bits_checksummed(rng: random.Random, trace: Path) -> str:
    """Bit flips in a table or tensor file whose record is fixed: Arrow and safetensors parse them."""
    path = rng.choice(_files(trace, "*.parquet") + _files(trace, "*.safetensors"))
    data = bytearray(path.read_bytes())
    for _ in range(rng.randint(1, 16)):
        position = rng.randrange(len(data))
        data[position] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))
    _fix_record(trace, path)
    return f"bit flips with fixed CRC in {path.name}"


def truncate_file(rng: random.Random, trace: Path) -> str:
    path = rng.choice(_files(trace))
    data = path.read_bytes()
    size = rng.choice([0, 1, 7, 8, 9, len(data) // 2, max(len(data) - 1, 0), rng.randrange(len(data) + 1)])
    path.write_bytes(data[:size])
    if rng.random() < 0.5 and path.suffix in (".parquet", ".safetensors"):
        _fix_record(trace, path)
        return f"{path.name} truncated to {size} bytes, record fixed"
    return f"{path.name} truncated to {size} bytes"


def cut_at_chunk_boundary(rng: random.Random, trace: Path) -> str:
    """The state a writer killed while committing chunk K leaves: its files in part, no record after."""
    records = _records(trace)
    k = rng.randrange(len(records))
    record = _load_json(records[k])
    for later in records[k:]:
        later.unlink()
    written = [record[key]["file"] for key in ("ops", "tensors", "data") if key in record]
    keep = rng.randrange(len(written) + 1)
    for name in written[keep:]:
        (trace / "rank0" / name).unlink()
    if rng.random() < 0.5:
        (trace / "rank0" / f"{written[0]}.tmp").write_bytes(b"PAR1 half written")
    manifest = trace / "rank0" / "manifest.json"
    value = _load_json(manifest)
    value["complete"] = False
    _save_json(manifest, value)
    return f"cut in chunk {k} after {keep} of its files"


def _hostile_json(rng: random.Random) -> Any:
    if rng.random() < 0.2:
        return "DEEP"  # replaced by 100,000 nested brackets once the document is text
    return rng.choice(
        [
            None,
            True,
            -1,
            0,
            2**62,
            10**400,
            -(2**63),
            1.5,
            float("nan"),
            "x",
            "",
            "../../etc/passwd",
            [],
            [1, "a"],
            {},
            {"file": "/dev/zero"},
            "\u0663",
            [[[[[]]]]],
        ]
    )


def bad_json_field(rng: random.Random, trace: Path) -> str:
    """One field of a manifest or chunk record set to a value of the wrong type, size or sign."""
    path = rng.choice([trace / "manifest.json", trace / "rank0" / "manifest.json", *_records(trace)])
    value = _load_json(path)
    key = rng.choice(sorted(value))
    target, where = value, key
    if isinstance(value[key], dict) and value[key] and rng.random() < 0.6:
        target, where = value[key], rng.choice(sorted(value[key]))
    new = _hostile_json(rng)
    if rng.random() < 0.15:
        del target[where]
        new = "<deleted>"
    else:
        target[where] = new
    text = json.dumps(value)
    if new == "DEEP":
        text = text.replace('"DEEP"', "[" * 100_000 + "]" * 100_000)
    path.write_text(text)
    return f"{path.relative_to(trace)}: {key}.{where} = {str(new)[:40]}"


def whole_json(rng: random.Random, trace: Path) -> str:
    """A manifest or record replaced whole: nested, oversized, foreign, not JSON, not UTF-8."""
    path = rng.choice([trace / "manifest.json", trace / "rank0" / "manifest.json", *_records(trace)])
    choice = rng.randrange(7)
    if choice == 0:
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif choice == 1:
        path.write_text('{"format": "tracecmp-trace", "format_version": 1, "pad": "' + "x" * (17 << 20) + '"}')
    elif choice == 2:
        path.write_text(json.dumps([1, 2, 3]))
    elif choice == 3:
        path.write_bytes(b"\xff\xfe{\x00")
    elif choice == 4:
        path.write_text(
            '{"format": "tracecmp-trace", "format_version": 1, "a": ' + '{"a": ' * 5000 + "1" + "}" * 5000 + "}"
        )
    elif choice == 5:
        path.write_text('{"format": "tracecmp-trace", "format_version": "1"}')
    else:
        path.write_text('{"format": "tracecmp-trace", "format_version": 1e400}')
    return f"{path.relative_to(trace)} replaced ({choice})"


def traversal(rng: random.Random, trace: Path) -> str:
    record_path = rng.choice(_records(trace))
    record = _load_json(record_path)
    key = rng.choice([k for k in ("ops", "tensors", "data") if k in record])
    name = rng.choice(
        [
            "../../../../dev/zero",
            "/dev/zero",
            "/etc/passwd",
            "..",
            ".",
            "",
            "../manifest.json",
            "rank0/../../x",
            "ops\x00.parquet",
            "C:\\x",
            "a" * 5000,
            "chunk-00000.json",
        ]
    )
    record[key]["file"] = name
    _save_json(record_path, record)
    return f"{record_path.name}: {key}.file = {name[:40]!r}"


def huge_sizes(rng: random.Random, trace: Path) -> str:
    record_path = rng.choice(_records(trace))
    record = _load_json(record_path)
    choice = rng.randrange(5)
    if choice == 0:
        record["rows"][rng.choice(["ops", "tensors"])] = rng.choice([10**15, -1, 2**63])
    elif choice == 1:
        record[rng.choice([k for k in ("ops", "tensors", "data") if k in record])]["bytes"] = rng.choice([2**62, -5])
    elif choice == 2:
        record["steps"] = rng.choice([[2**40], [-1], list(range(100_000)), "0"])
    elif choice == 3 and "data" in record:
        path = trace / "rank0" / record["data"]["file"]
        data = path.read_bytes()
        path.write_bytes(rng.choice([2**62, 2**64 - 1, len(data)]).to_bytes(8, "little") + data[8:])
        _fix_record(trace, path)
        return f"{path.name}: safetensors header length rewritten"
    else:
        return _safetensors_header(rng, trace)
    _save_json(record_path, record)
    return f"{record_path.name}: huge or negative size ({choice})"


def _safetensors_header(rng: random.Random, trace: Path) -> str:
    files = _files(trace, "*.safetensors")
    if not files:
        return "no safetensors file"
    path = rng.choice(files)
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    key = rng.choice([k for k in header if k != "__metadata__"])
    choice = rng.randrange(4)
    if choice == 0:
        header[key]["data_offsets"] = [0, 2**62]
    elif choice == 1:
        header[key]["shape"] = [2**31, 2**31]
    elif choice == 2:
        header[key]["dtype"] = "Q99"
    else:
        header[key]["data_offsets"] = [len(data), len(data) + 4]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + length :])
    _fix_record(trace, path)
    return f"{path.name}: safetensors header entry {key} rewritten ({choice})"


def links(rng: random.Random, trace: Path) -> str:
    rank = trace / "rank0"
    choice = rng.randrange(6)
    target = rng.choice(_files(rank))
    target.unlink()
    if choice == 0:
        target.symlink_to("/dev/zero")
    elif choice == 1:
        target.symlink_to(target.name)  # a loop
    elif choice == 2:
        os.mkfifo(target)
    elif choice == 3:
        target.mkdir()
    elif choice == 4:
        shutil.rmtree(rank)
        rank.symlink_to("rank0")  # the rank folder a loop
        return "rank0 is a symlink loop"
    else:
        target.symlink_to("/etc/hostname")
    return f"{target.name} made a link/FIFO/folder ({choice})"


def _random_value(rng: random.Random, arrow_type: pa.DataType) -> Any:
    if pa.types.is_list(arrow_type):
        return [_random_value(rng, arrow_type.value_type) for _ in range(rng.choice([0, 1, 3, 40]))]
    if pa.types.is_string(arrow_type):
        return rng.choice(
            [
                "",
                "x",
                "aten.mm.default",
                "backward",
                "optimizer",
                "source.parameter",
                "view",
                "op",
                "float99",
                "cpu",
                "npu:7",
                "{",
                '{"a": ' * 3000 + "1" + "}" * 3000,
                "[" * 50_000,
                '{"args": [1e999]}',
                "0/999",
                "99999/1",
                "\u0663/1",
                "../x",
                "alias.update",
                "x" * 100_000,
            ]
        )
    if pa.types.is_boolean(arrow_type):
        return rng.random() < 0.5
    if pa.types.is_floating(arrow_type):
        return rng.choice([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e308, -1e308, 5e-324, None])
    bits = arrow_type.bit_width
    return rng.choice([0, 1, -1, 2, 7, 2 ** (bits - 1) - 1, -(2 ** (bits - 1)), rng.randrange(200), None])


def rewrite_table(rng: random.Random, trace: Path) -> str:
    """Values of one column rewritten, the file re-encoded and its record fixed: the reader's
    checks pass and whatever reads the values downstream (inspect, overflow, compare) meets them."""
    path = rng.choice(_files(trace, "*.parquet"))
    table = pq.read_table(path)
    name = rng.choice(table.column_names)
    column = table.column(name).to_pylist()
    count = rng.choice([1, 2, max(1, len(column) // 10), len(column)])
    for _ in range(count):
        column[rng.randrange(len(column))] = _random_value(rng, table.schema.field(name).type)
    try:
        new = pa.array(column, type=table.schema.field(name).type)
    except (pa.ArrowException, OverflowError, TypeError, ValueError):
        return f"{path.name}: {name} values not representable, left alone"
    table = table.set_column(table.schema.get_field_index(name), name, new)
    pq.write_table(table, path)
    _fix_record(trace, path)
    return f"{path.name}: {count} value(s) of {name} rewritten"


MUTATIONS: dict[str, Mutation] = {
    "flip_bits": flip_bits,
    "flip_bits_checksummed": flip_bits_checksummed,
    "truncate_file": truncate_file,
    "cut_at_chunk_boundary": cut_at_chunk_boundary,
    "bad_json_field": bad_json_field,
    "whole_json": whole_json,
    "traversal": traversal,
    "huge_sizes": huge_sizes,
    "links": links,
    "rewrite_table": rewrite_table,
    "rewrite_table_again": rewrite_table,  # the most productive mutation: drawn twice as often
}


# -- checks ------------------------------------------------------------------------------------
def _cli(argv: list[str], allowed: set[int], where: Path) -> str | None:
    """Run the CLI in-process; a description of what went wrong, or None."""
    from tracecmp.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    text = err.getvalue()
    if "Traceback" in text or code not in allowed:
        return f"{' '.join(argv[:1])}: exit {code}: {text.strip()[-600:]}"
    if code == 2:
        lines = text.strip().splitlines()
        if len(lines) != 1 or str(where) not in lines[0]:
            return f"{argv[0]}: exit 2 without one line naming a file: {text.strip()[:600]}"
    return None


def check(trace: Path, good: Path) -> list[str]:
    import tracecmp
    from tracecmp.trace.saved import SavedTensors

    problems = []
    try:
        loaded = tracecmp.load(trace)
    except tracecmp.TracecmpError as exc:
        if str(trace) not in str(exc):
            problems.append(f"load: error names no file under the trace: {exc}")
        loaded = None
    if loaded is not None:
        loaded.to_frame()
        loaded.tensors_frame()
        for rank in loaded.ranks:
            keys = [k for k in loaded.rank(rank).tensors["data_key"] if k]
            with SavedTensors(loaded.rank(rank)) as saved:
                for key in keys:
                    try:
                        saved.get(key)
                    except tracecmp.TracecmpError as exc:
                        if str(trace) not in str(exc):
                            problems.append(f"saved tensor {key}: error names no file under the trace: {exc}")
    for argv, allowed in (
        (["inspect", str(trace)], {0, 2}),
        (["overflow", str(trace)], {0, 1, 2}),
        (["compare", str(trace), str(good)], {0, 1, 2, 3}),
    ):
        if loaded is None and argv[0] == "compare":
            continue  # refused at load like inspect: nothing more to learn, and compare costs most
        problem = _cli(argv, allowed, trace)
        if problem:
            problems.append(problem)
    return problems


def run(goods: list[Path], cases: int, seed: int, work: Path, case_seconds: float) -> dict[str, Any]:
    def alarm(signum: int, frame: Any) -> None:
        raise CaseTimeout()

    signal.signal(signal.SIGALRM, alarm)
    failures, kinds = [], {}
    names = sorted(MUTATIONS)
    start = time.monotonic()
    for case in range(cases):
        rng = random.Random(f"{seed}/{case}")
        good = goods[case % len(goods)]
        name = names[rng.randrange(len(names))]
        trace = work / f"case{case}"
        shutil.copytree(good, trace, symlinks=True)
        what = MUTATIONS[name](rng, trace)
        print(f"case {case}: {name}: {what}", flush=True)  # the last line says which case crashed
        kinds[name] = kinds.get(name, 0) + 1
        signal.setitimer(signal.ITIMER_REAL, case_seconds)
        try:
            problems = check(trace, good)
        except CaseTimeout:
            problems = [f"ran past {case_seconds} s"]
        except Exception as exc:  # noqa: BLE001 - the point: anything escaping is a failure
            problems = [f"raised {type(exc).__name__}: {' '.join(str(exc).split())[:600]}"]
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        if problems:
            failures.append({"case": case, "mutation": name, "what": what, "problems": problems})
            print(f"  FAILED: {problems}", flush=True)
        else:
            shutil.rmtree(trace, ignore_errors=True)
    return {"cases": cases, "failures": failures, "kinds": kinds, "seconds": round(time.monotonic() - start, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("goods", nargs="+", type=Path, help="good traces to damage")
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--case-seconds", type=float, default=30.0)
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    summary = run(args.goods, args.cases, args.seed, args.work, args.case_seconds)
    print(json.dumps(summary))
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
