"""Reading a trace folder back, validating everything before anything is trusted."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Mapping

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tracecmp.errors import TraceFormatError, TraceNotFoundError, TraceVersionError
from tracecmp.trace import boundedjson
from tracecmp.trace.compiled import CompiledRecord
from tracecmp.trace.schema import (
    CHECKS_SCHEMA,
    FORMAT_NAME,
    FORMAT_VERSION,
    OPS_SCHEMA,
    RANK_MANIFEST,
    RUN_MANIFEST,
    STAT_COLUMNS,
    TENSORS_SCHEMA,
    chunk_record_name,
)


def _read_json(path: Path, what: str) -> Any:
    """The JSON document at ``path``, read only if its size and nesting are sane (boundedjson)."""
    try:
        if not path.is_file():  # opening a FIFO would wait forever, a device would never end
            if path.exists() or path.is_symlink():
                raise TraceFormatError(f"{what} is not a regular file", path=path)
            raise FileNotFoundError(path)
        with open(path, "rb") as fh:
            raw = fh.read(boundedjson.MAX_BYTES + 1)
    except (FileNotFoundError, TraceFormatError):
        raise
    except OSError as exc:
        raise TraceFormatError(f"cannot read {what}: {exc.strerror or exc}", path=path) from exc
    try:
        return boundedjson.loads(raw)
    except ValueError as exc:
        raise TraceFormatError(f"{what} is not valid JSON ({_one_line(exc)})", path=path) from exc


def read_manifest(path: Path, what: str = "manifest") -> dict[str, Any]:
    """A manifest (run, rank or chunk record) read and checked: a tracecmp trace's format, in a
    version this tracecmp reads; :class:`~tracecmp.errors.TracecmpError` subclasses otherwise."""
    try:
        manifest = _read_json(path, what)
    except FileNotFoundError as exc:
        raise TraceNotFoundError("no manifest.json: not a tracecmp trace folder", path=path.parent) from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise TraceFormatError(f"not a tracecmp trace (format is not {FORMAT_NAME!r})", path=path)
    version = manifest.get("format_version")
    if not _is_int(version):
        raise TraceFormatError(f"{what} has no integer format_version", path=path)
    if version > FORMAT_VERSION:
        raise TraceVersionError(
            f"trace format version {version} is newer than this tracecmp reads ({FORMAT_VERSION}); upgrade tracecmp",
            path=path,
        )
    return manifest


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# What the fields every reader of a manifest uses must hold (absent is always allowed).
_RUN_FIELDS: dict[str, tuple[type, ...]] = {
    "options": (dict,),
    "versions": (dict,),
    "world_size": (int,),
    "device": (str,),
    "created": (str,),
    "seed_all": (dict, type(None)),
    "determinism": (dict, type(None)),
}
_RANK_FIELDS: dict[str, tuple[type, ...]] = {
    "rank": (int,),
    "world_size": (int,),
    "device": (str,),
    "complete": (bool,),
    "info": (dict,),
    "stopped": (dict, type(None)),
}


def _check_fields(manifest: dict[str, Any], fields: dict[str, tuple[type, ...]], path: Path) -> None:
    for name, types in fields.items():
        if name not in manifest:
            continue
        value = manifest[name]
        if not isinstance(value, types) or (int in types and isinstance(value, bool) and bool not in types):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise TraceFormatError(f"manifest field {name!r} is not {names}", path=path)
        if name in ("rank", "world_size") and value < 0:
            raise TraceFormatError(f"manifest field {name!r} is negative", path=path)


def step_ranges(numbers: list[int]) -> str:
    """Sorted step numbers as ranges.

    >>> step_ranges([0, 1, 2, 5])
    '0-2, 5'
    """
    parts, start = [], None
    for i, n in enumerate(numbers):
        if start is None:
            start = n
        if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
            parts.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ", ".join(parts)


def kept_steps(steps: Iterable[int], stopped: Mapping[str, Any] | None) -> str:
    """Which ``steps`` an unfinished rank keeps, in words, given its ``stopped`` account: whole up
    to the account's ``last_step`` (none without one: the first step did not finish), the rest in
    part. Without an account (the process was killed) nothing says which steps finished.

    Capture's notes and warnings and ``tracecmp inspect`` say it in these words.

    >>> kept_steps([0, 1, 2, 3], {"last_step": 2})
    'steps 0-2 whole, step 3 in part'
    >>> kept_steps([0], {"last_step": None})
    'no whole step, step 0 in part'
    >>> kept_steps([0, 1], None)
    'steps 0-1'
    """
    numbers = sorted(steps)
    if not stopped:
        return f"steps {step_ranges(numbers)}" if numbers else "no step"
    last = stopped.get("last_step")
    whole = [s for s in numbers if _is_int(last) and s <= last]
    partial = numbers[len(whole) :]
    kept = f"{_steps_word(whole)} {step_ranges(whole)} whole" if whole else "no whole step"
    return kept + (f", {_steps_word(partial)} {step_ranges(partial)} in part" if partial else "")


def _steps_word(numbers: list[int]) -> str:
    return "step" if len(numbers) == 1 else "steps"


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            crc = zlib.crc32(block, crc)
    return crc


def _check_file(folder: Path, entry: Any, what: str) -> Path:
    if (
        not isinstance(entry, dict)
        or not isinstance(entry.get("file"), str)
        or not _is_int(entry.get("bytes"))
        or not _is_int(entry.get("crc32"))
    ):
        raise TraceFormatError(f"a chunk record lists a malformed {what} file entry", path=folder)
    name = entry["file"]
    if not name or "/" in name or "\\" in name or "\0" in name or name in (".", ".."):
        raise TraceFormatError(f"a chunk record names a {what} file outside its folder: {name[:80]!r}", path=folder)
    path = folder / name
    try:
        regular = path.is_file()  # follows a symlink; a loop, a device or a FIFO is not a file
        size = path.stat().st_size if regular else -1
        if regular and size == entry["bytes"]:
            crc = _crc32(path)
    except OSError as exc:
        raise TraceFormatError(f"cannot read {what} chunk: {exc.strerror or exc}", path=path) from exc
    if not regular:
        raise TraceFormatError(f"{what} chunk listed in its chunk record is missing (or not a regular file)", path=path)
    if size != entry["bytes"]:
        raise TraceFormatError(f"truncated or altered: {size} bytes, its chunk record says {entry['bytes']}", path=path)
    if crc != entry["crc32"]:
        raise TraceFormatError("corrupted: CRC-32 does not match its chunk record", path=path)
    return path


def _read_table(path: Path, schema: pa.Schema) -> pa.Table:
    # Bytes that pass the CRC were written as they are, by tracecmp or by hand: Arrow may still
    # refuse them in any way it likes (ArrowInvalid, OSError, MemoryError for a claimed size ...).
    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 - whatever Arrow raises on bad bytes is a bad trace
        raise TraceFormatError(f"unreadable Parquet table ({_one_line(exc)})", path=path) from exc
    missing = [name for name in schema.names if name not in table.column_names]
    if missing:
        raise TraceFormatError(f"table lacks columns {missing}", path=path)
    try:
        table = table.select(schema.names).cast(schema)
    except Exception as exc:  # noqa: BLE001 - see above
        raise TraceFormatError(f"table columns have unexpected types ({_one_line(exc)})", path=path) from exc
    for name in schema.names:
        if name in STAT_COLUMNS:
            continue  # null where a tensor has no statistics
        column = table.column(name)
        if column.null_count or (pa.types.is_list(column.type) and pc.list_flatten(column).null_count):
            raise TraceFormatError(f"column {name!r} holds nulls", path=path)
    return table


@dataclass
class RankTrace:
    """One rank of a recorded run: its manifest and its two tables (Arrow, concatenated chunks)."""

    rank: int
    path: Path
    manifest: dict[str, Any]
    ops_table: pa.Table
    tensors_table: pa.Table
    data_files: dict[int, Path] = field(default_factory=dict)
    compiled: CompiledRecord = field(default_factory=CompiledRecord)  # torch.compile'd regions, if any
    # Self-checks at capture (CHECKS_SCHEMA), None where the run was recorded without them
    checks_table: pa.Table | None = None

    @property
    def complete(self) -> bool:
        return bool(self.manifest.get("complete"))

    @property
    def device(self) -> str:
        return str(self.manifest.get("device", ""))

    @property
    def stopped(self) -> dict[str, Any] | None:
        """Why capture ended early, as recorded: ``kind`` ("interrupted", "terminated", "error",
        "exit", "overflow", "write-error"), ``reason``, ``step`` (in progress) and ``last_step``
        (the last step whole on disk). None for a complete rank, and for one whose process was
        killed before it could say (SIGKILL, a machine crash)."""
        stopped = self.manifest.get("stopped")
        return stopped if isinstance(stopped, dict) and not self.complete else None

    def ending(self) -> str:
        """How the capture of this rank ended, in one phrase.

        >>> trace.rank(0).ending()  # doctest: +SKIP
        'interrupted by the user (KeyboardInterrupt) in step 5; it keeps steps 0-4 whole, step 5 in part'
        """
        if self.complete:
            return "complete"
        steps = self.manifest.get("steps", [])
        stopped = self.stopped or {}
        reason = str(stopped.get("reason") or "did not finish and left no account (killed, or the machine stopped)")
        step = stopped.get("step")
        if _is_int(step):
            reason += f", in step {step}"
        return f"{reason}; it keeps {kept_steps(steps, stopped)}"

    @cached_property
    def ops(self) -> pd.DataFrame:
        """One row per node (op, view or source), in execution order."""
        return self.ops_table.to_pandas()

    @cached_property
    def tensors(self) -> pd.DataFrame:
        """One row per tensor value, indexed by nothing (``tensor_id`` is a column).

        Rows without statistics (``has_stats`` false: views, uninitialised memory) read NaN in the
        float statistics and 0 in ``nan_count``, ``inf_count`` and ``checksum``: an integer column
        with nulls would become float64 in pandas and keep only 53 of the checksum's 64 bits.
        """
        return _fill_integer_nulls(self.tensors_table).to_pandas()

    @cached_property
    def checks(self) -> pd.DataFrame | None:
        """One row per op output the capture checked against its own inputs (``residual`` over
        ``limit`` is a failed check); None where the run was recorded without self-checks."""
        return None if self.checks_table is None else self.checks_table.to_pandas()

    def load_tensor(self, tensor_id: int) -> Any:
        """The saved tensor ``tensor_id`` (only with ``data="tensors"``), read through safetensors."""
        from tracecmp.trace.saved import SavedTensors

        rows = self.tensors[self.tensors["tensor_id"] == tensor_id]
        if rows.empty or not rows.iloc[0]["data_key"]:
            raise TraceFormatError(f"tensor {tensor_id} was not saved in this trace", path=self.path)
        with SavedTensors(self) as saved:
            return saved.get(rows.iloc[0]["data_key"])


def _chunk_records(folder: Path, manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """The commit records ``chunk-<K>.json`` of a rank, in order, with no gap, each checked.

    Early traces listed their chunks inside the rank manifest instead; those lists are read too,
    so such a trace never loads as an empty one.
    """
    try:
        names = [path.name for path in folder.glob("chunk-*.json")]
    except OSError as exc:
        raise TraceFormatError(f"cannot list the rank folder: {exc.strerror or exc}", path=folder) from exc
    listed = manifest.get("chunks")
    if listed is not None and not names:
        if not isinstance(listed, list) or not all(isinstance(c, dict) for c in listed):
            raise TraceFormatError("rank manifest has a malformed chunk list", path=folder / RANK_MANIFEST)
        records = [dict(chunk, index=index) for index, chunk in enumerate(listed)]
        for record in records:
            _check_record(record, folder / RANK_MANIFEST)
        return records
    numbered: dict[int, str] = {}
    for name in names:
        number = name[len("chunk-") : -len(".json")]
        if not number.isdigit() or name != chunk_record_name(int(number)):
            raise TraceFormatError("a file is named like a chunk record but is not one", path=folder / name)
        numbered[int(number)] = name
    records = []
    for index in range(len(numbered)):  # ordered by number: chunk-100000 comes after chunk-99999
        if index not in numbered:
            path = folder / numbered[min(k for k in numbered if k > index)]
            raise TraceFormatError(
                f"chunk records are not numbered 0..N-1 ({chunk_record_name(index)} is missing)", path=path
            )
        path = folder / numbered[index]
        record = read_manifest(path, "chunk record")
        if record.get("index") != index:
            raise TraceFormatError(
                f"chunk record says index {str(record.get('index'))[:40]!r}, expected {index}", path=path
            )
        _check_record(record, path)
        records.append(record)
    return records


def _check_record(record: dict[str, Any], path: Path) -> None:
    """A chunk record's row counts and step list are what readers will trust them to be."""
    rows = record.get("rows")
    if not isinstance(rows, dict) or not all(_is_int(rows.get(k)) and rows[k] >= 0 for k in ("ops", "tensors")):
        raise TraceFormatError("chunk record has no row counts", path=path)
    steps = record.get("steps", [])
    if not isinstance(steps, list) or not all(_is_int(s) and 0 <= s < 1 << 31 for s in steps):
        raise TraceFormatError("chunk record's steps are not a list of step numbers", path=path)


def _fill_integer_nulls(table: pa.Table) -> pa.Table:
    for name in ("nan_count", "inf_count", "checksum"):
        column = table.column(name)
        if column.null_count:
            table = table.set_column(table.schema.get_field_index(name), name, pc.fill_null(column, 0))
    return table


def load_rank(folder: Path) -> RankTrace:
    """Read and validate ``RUN/rank<R>``.

    The returned manifest also lists what the chunk records say: ``chunks``, ``ops``, ``tensors``
    (row counts) and ``steps`` (the recorded step numbers).
    """
    manifest = read_manifest(folder / RANK_MANIFEST, "rank manifest")
    _check_fields(manifest, _RANK_FIELDS, folder / RANK_MANIFEST)
    chunks = _chunk_records(folder, manifest)
    ops_parts, tensor_parts, data_files, compiled_parts, check_parts = [], [], {}, [], []
    for index, chunk in enumerate(chunks):
        ops_table = _read_table(_check_file(folder, chunk.get("ops"), "ops"), OPS_SCHEMA)
        tensors_table = _read_table(_check_file(folder, chunk.get("tensors"), "tensors"), TENSORS_SCHEMA)
        rows = chunk["rows"]
        if (ops_table.num_rows, tensors_table.num_rows) != (rows.get("ops"), rows.get("tensors")):
            raise TraceFormatError(
                "chunk tables hold other row counts than its record", path=folder / chunk_record_name(index)
            )
        ops_parts.append(ops_table)
        tensor_parts.append(tensors_table)
        if "data" in chunk:
            data_files[index] = _check_file(folder, chunk["data"], "data")
        if "checks" in chunk:
            checks_table = _read_table(_check_file(folder, chunk["checks"], "checks"), CHECKS_SCHEMA)
            if checks_table.num_rows != rows.get("checks"):
                raise TraceFormatError(
                    "chunk's self-checks hold another row count than its record", path=folder / chunk_record_name(index)
                )
            check_parts.append(checks_table)
        if "compiled" in chunk:
            compiled_parts.append(
                _read_json(_check_file(folder, chunk["compiled"], "compiled"), "compiled-regions record")
            )
    ops = pa.concat_tables(ops_parts) if ops_parts else OPS_SCHEMA.empty_table()
    tensors = pa.concat_tables(tensor_parts) if tensor_parts else TENSORS_SCHEMA.empty_table()
    _check_references(folder, ops, tensors)
    checks = None
    if check_parts:
        if len(check_parts) != len(chunks):
            raise TraceFormatError("only some chunks hold self-checks", path=folder)
        checks = pa.concat_tables(check_parts)
        if len(checks) and not pc.all(pc.is_in(checks.column("op_id"), value_set=ops.column("op_id"))).as_py():
            raise TraceFormatError("self-checks name ops the trace does not hold", path=folder)
    try:
        compiled = CompiledRecord.from_json(compiled_parts)
    except TraceFormatError as exc:
        raise TraceFormatError(exc.message, path=folder) from None
    manifest["chunks"] = chunks
    manifest["ops"] = ops.num_rows
    manifest["tensors"] = tensors.num_rows
    manifest["steps"] = sorted({s for chunk in chunks for s in chunk.get("steps", [])})
    return RankTrace(manifest.get("rank", 0), folder, manifest, ops, tensors, data_files, compiled, checks)


def _check_references(folder: Path, ops: pa.Table, tensors: pa.Table) -> None:
    """Every tensor id an op reads or writes must exist, every producer must be a recorded op."""
    tensor_ids = tensors.column("tensor_id")
    if pc.count_distinct(tensor_ids).as_py() != len(tensor_ids):
        raise TraceFormatError("duplicate tensor ids", path=folder)
    if pc.count_distinct(ops.column("op_id")).as_py() != ops.num_rows:
        raise TraceFormatError("duplicate op ids", path=folder)
    for column in ("inputs", "outputs"):
        used = pc.list_flatten(ops.column(column))
        unknown = pc.sum(pc.invert(pc.is_in(used, value_set=tensor_ids))).as_py() if len(used) else 0
        if unknown:
            raise TraceFormatError(f"{unknown} op {column} refer to tensors the trace does not hold", path=folder)
    producers = tensors.column("op_id")
    if len(producers) and not pc.all(pc.is_in(producers, value_set=ops.column("op_id"))).as_py():
        raise TraceFormatError("tensors name producer ops the trace does not hold", path=folder)


class Trace:
    """A recorded run: the run manifest and one :class:`RankTrace` per rank.

    >>> trace = load("runs/bench")          # doctest: +SKIP
    >>> trace.to_frame().groupby("phase").size()  # doctest: +SKIP
    """

    def __init__(self, path: Path, manifest: dict[str, Any], ranks: dict[int, RankTrace]) -> None:
        self.path = path
        self.manifest = manifest
        self._ranks = ranks

    @property
    def ranks(self) -> list[int]:
        return sorted(self._ranks)

    def rank(self, rank: int = 0) -> RankTrace:
        try:
            return self._ranks[rank]
        except KeyError:
            raise TraceFormatError(f"trace has no rank {rank} (ranks: {self.ranks})", path=self.path) from None

    @property
    def complete(self) -> bool:
        """True when every rank finished its capture normally."""
        return all(r.complete for r in self._ranks.values())

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.manifest.get("options", {}))

    def to_frame(self, rank: int | None = None) -> pd.DataFrame:
        """One row per recorded node (ops, views and source tensors), with a ``rank`` column."""
        chosen = self.ranks if rank is None else [rank]
        frames = [self.rank(r).ops.assign(rank=r) for r in chosen]
        return pd.concat(frames, ignore_index=True) if frames else OPS_SCHEMA.empty_table().to_pandas()

    def tensors_frame(self, rank: int | None = None) -> pd.DataFrame:
        """One row per tensor value, with a ``rank`` column."""
        chosen = self.ranks if rank is None else [rank]
        frames = [self.rank(r).tensors.assign(rank=r) for r in chosen]
        return pd.concat(frames, ignore_index=True) if frames else TENSORS_SCHEMA.empty_table().to_pandas()

    def __repr__(self) -> str:
        return f"Trace({str(self.path)!r}, ranks={self.ranks}, complete={self.complete})"


def load(path: str | Path) -> Trace:
    """Open a recorded trace folder, validating manifests, chunk checksums and references.

    Raises a :class:`~tracecmp.errors.TracecmpError` subclass naming the file for anything
    missing, truncated, corrupt, foreign or too new.

    >>> trace = tracecmp.load("runs/bench")  # doctest: +SKIP
    """
    root = Path(path)
    try:
        if not root.exists():
            raise TraceNotFoundError("no such trace folder", path=root)
        if not root.is_dir():
            raise TraceFormatError("a trace is a folder, this is a file", path=root)
        folders = sorted(root.glob("rank*"))
    except OSError as exc:
        raise TraceFormatError(f"cannot read the trace folder: {exc.strerror or exc}", path=root) from exc
    manifest = read_manifest(root / RUN_MANIFEST)
    _check_fields(manifest, _RUN_FIELDS, root / RUN_MANIFEST)
    ranks: dict[int, RankTrace] = {}
    for folder in folders:
        number = folder.name[4:]
        if number.isascii() and number.isdigit() and folder.is_dir():
            rank_trace = load_rank(folder)
            if rank_trace.rank != int(number):
                raise TraceFormatError(
                    f"rank manifest says rank {rank_trace.rank}, its folder rank {number}", path=folder
                )
            ranks[int(number)] = rank_trace
    if not ranks:
        raise TraceFormatError("trace holds no rank folders (rank0/ ...)", path=root)
    return Trace(root, manifest, ranks)
