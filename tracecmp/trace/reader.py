"""Reading a trace folder back, validating everything before anything is trusted."""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from tracecmp.errors import TraceFormatError, TraceNotFoundError, TraceVersionError
from tracecmp.trace.compiled import CompiledRecord
from tracecmp.trace.schema import (
    FORMAT_NAME,
    FORMAT_VERSION,
    OPS_SCHEMA,
    RANK_MANIFEST,
    RUN_MANIFEST,
    TENSORS_SCHEMA,
    chunk_record_name,
)


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except FileNotFoundError as exc:
        raise TraceNotFoundError("no manifest.json: not a tracecmp trace folder", path=path.parent) from exc
    except OSError as exc:
        raise TraceFormatError(f"cannot read manifest: {exc.strerror}", path=path) from exc
    try:
        manifest = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TraceFormatError(f"manifest is not valid JSON ({exc})", path=path) from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise TraceFormatError(f"not a tracecmp trace (format is not {FORMAT_NAME!r})", path=path)
    version = manifest.get("format_version")
    if not isinstance(version, int):
        raise TraceFormatError("manifest has no integer format_version", path=path)
    if version > FORMAT_VERSION:
        raise TraceVersionError(
            f"trace format version {version} is newer than this tracecmp reads ({FORMAT_VERSION}); upgrade tracecmp",
            path=path,
        )
    return manifest


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            crc = zlib.crc32(block, crc)
    return crc


def _check_file(folder: Path, entry: Any, what: str) -> Path:
    if not isinstance(entry, dict) or not isinstance(entry.get("file"), str) or "/" in entry["file"] or ".." in entry["file"]:
        raise TraceFormatError(f"a chunk record lists a malformed {what} file entry", path=folder)
    path = folder / entry["file"]
    if not path.is_file():
        raise TraceFormatError(f"{what} chunk listed in its chunk record is missing", path=path)
    size = path.stat().st_size
    if size != entry.get("bytes"):
        raise TraceFormatError(f"truncated or altered: {size} bytes, its chunk record says {entry.get('bytes')}", path=path)
    if _crc32(path) != entry.get("crc32"):
        raise TraceFormatError("corrupted: CRC-32 does not match its chunk record", path=path)
    return path


def _read_table(path: Path, schema: pa.Schema) -> pa.Table:
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise TraceFormatError(f"unreadable Parquet table ({exc})", path=path) from exc
    missing = [name for name in schema.names if name not in table.column_names]
    if missing:
        raise TraceFormatError(f"table lacks columns {missing}", path=path)
    try:
        return table.select(schema.names).cast(schema)
    except (pa.ArrowException, ValueError) as exc:
        raise TraceFormatError(f"table columns have unexpected types ({exc})", path=path) from exc


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

    @property
    def complete(self) -> bool:
        return bool(self.manifest.get("complete"))

    @property
    def device(self) -> str:
        return str(self.manifest.get("device", ""))

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

    def load_tensor(self, tensor_id: int) -> Any:
        """The saved tensor ``tensor_id`` (only with ``data="tensors"``), read through safetensors."""
        from safetensors import SafetensorError
        from safetensors.torch import safe_open

        rows = self.tensors[self.tensors["tensor_id"] == tensor_id]
        if rows.empty or not rows.iloc[0]["data_key"]:
            raise TraceFormatError(f"tensor {tensor_id} was not saved in this trace", path=self.path)
        key = rows.iloc[0]["data_key"]
        chunk = int(key.split("/")[0])
        path = self.data_files.get(chunk)
        if path is None:
            raise TraceFormatError(f"tensor {tensor_id} refers to missing data chunk {chunk}", path=self.path)
        try:
            with safe_open(str(path), framework="pt") as fh:
                return fh.get_tensor(key)
        except (SafetensorError, OSError, KeyError) as exc:
            raise TraceFormatError(f"cannot read tensor {key!r} ({exc})", path=path) from exc


def _chunk_records(folder: Path, manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """The commit records ``chunk-<K>.json`` of a rank, in order, with no gap.

    Early traces listed their chunks inside the rank manifest instead; those lists are read too,
    so such a trace never loads as an empty one.
    """
    listed = manifest.get("chunks")
    if listed is not None and not any(folder.glob("chunk-*.json")):
        if not isinstance(listed, list) or not all(isinstance(c, dict) for c in listed):
            raise TraceFormatError("rank manifest has a malformed chunk list", path=folder / RANK_MANIFEST)
        return [dict(chunk, index=index) for index, chunk in enumerate(listed)]
    records = []
    for index, path in enumerate(sorted(folder.glob("chunk-*.json"))):
        if path.name != chunk_record_name(index):
            raise TraceFormatError(f"chunk records are not numbered 0..N-1 ({chunk_record_name(index)} is missing)", path=path)
        record = _read_manifest(path)
        if record.get("index") != index:
            raise TraceFormatError(f"chunk record says index {record.get('index')!r}, expected {index}", path=path)
        rows = record.get("rows")
        if not isinstance(rows, dict) or not all(isinstance(rows.get(k), int) for k in ("ops", "tensors")):
            raise TraceFormatError("chunk record has no row counts", path=path)
        records.append(record)
    return records


def _fill_integer_nulls(table: pa.Table) -> pa.Table:
    import pyarrow.compute as pc

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
    manifest = _read_manifest(folder / RANK_MANIFEST)
    chunks = _chunk_records(folder, manifest)
    ops_parts, tensor_parts, data_files, compiled_parts = [], [], {}, []
    for index, chunk in enumerate(chunks):
        ops_table = _read_table(_check_file(folder, chunk.get("ops"), "ops"), OPS_SCHEMA)
        tensors_table = _read_table(_check_file(folder, chunk.get("tensors"), "tensors"), TENSORS_SCHEMA)
        rows = chunk.get("rows", {})
        if (ops_table.num_rows, tensors_table.num_rows) != (rows.get("ops"), rows.get("tensors")):
            raise TraceFormatError("chunk tables hold other row counts than its record", path=folder / chunk_record_name(index))
        ops_parts.append(ops_table)
        tensor_parts.append(tensors_table)
        if "data" in chunk:
            data_files[index] = _check_file(folder, chunk["data"], "data")
        if "compiled" in chunk:
            compiled_parts.append(_read_json(_check_file(folder, chunk["compiled"], "compiled")))
    ops = pa.concat_tables(ops_parts) if ops_parts else OPS_SCHEMA.empty_table()
    tensors = pa.concat_tables(tensor_parts) if tensor_parts else TENSORS_SCHEMA.empty_table()
    _check_references(folder, ops, tensors)
    try:
        compiled = CompiledRecord.from_json(compiled_parts)
    except TraceFormatError as exc:
        raise TraceFormatError(exc.message, path=folder) from None
    manifest["chunks"] = chunks
    manifest["ops"] = ops.num_rows
    manifest["tensors"] = tensors.num_rows
    manifest["steps"] = sorted({int(s) for chunk in chunks for s in chunk.get("steps", [])})
    rank = manifest.get("rank", 0)
    return RankTrace(int(rank) if isinstance(rank, int) else 0, folder, manifest, ops, tensors, data_files, compiled)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TraceFormatError(f"not valid JSON ({exc})", path=path) from exc


def _check_references(folder: Path, ops: pa.Table, tensors: pa.Table) -> None:
    """Every tensor id an op reads or writes must exist, every producer must be a recorded op."""
    import pyarrow.compute as pc

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
    if not root.exists():
        raise TraceNotFoundError("no such trace folder", path=root)
    if not root.is_dir():
        raise TraceFormatError("a trace is a folder, this is a file", path=root)
    manifest = _read_manifest(root / RUN_MANIFEST)
    ranks: dict[int, RankTrace] = {}
    for folder in sorted(root.glob("rank*")):
        if folder.is_dir() and folder.name[4:].isdigit():
            rank_trace = load_rank(folder)
            ranks[int(folder.name[4:])] = rank_trace
    if not ranks:
        raise TraceFormatError("trace holds no rank folders (rank0/ ...)", path=root)
    return Trace(root, manifest, ranks)
