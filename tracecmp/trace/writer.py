"""Crash-safe chunked writer of a trace folder (see :mod:`tracecmp.trace.schema`)."""

from __future__ import annotations

import json
import os
import queue
import threading
import time
import zlib
from pathlib import Path
from typing import Any, Mapping, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from tracecmp.errors import TracecmpError
from tracecmp.trace.args import memory_order
from tracecmp.trace.columns import Columns
from tracecmp.trace.schema import (
    CHECKS_SCHEMA,
    FORMAT_NAME,
    FORMAT_VERSION,
    MEMORY_ORDER_KEY,
    OPS_SCHEMA,
    RANK_MANIFEST,
    RUN_MANIFEST,
    TENSORS_SCHEMA,
    chunk_record_name,
)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# safetensors' names of the dtypes a chunk streams itself; a chunk holding any other dtype
# (complex, float8 ...) goes through ``safetensors.torch.save`` instead.
_SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


_SMALL_PART = 64 << 10
_JOINED_PART = 4 << 20


def _memory_orders(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """The safetensors ``__metadata__`` recording the tensors' memory orders ({} when all are plain)."""
    orders = {key: order for key, tensor in tensors.items() if (order := memory_order(tensor)) is not None}
    return {MEMORY_ORDER_KEY: json.dumps(orders, separators=(",", ":"))} if orders else {}


def _safetensors_parts(tensors: Mapping[str, torch.Tensor]) -> list[Any] | None:
    """The bytes of a safetensors file holding ``tensors``, as a header and one buffer per tensor.

    The format is an 8-byte little-endian header length, a JSON header (key -> dtype, shape, byte
    offsets; padded with spaces to 8 bytes), then the raw tensor bytes back to back. Streaming the
    tensors' own memory avoids the two whole-file copies ``safetensors.torch.save`` makes (its
    bytes, then ours); wider dtypes come first so every tensor stays aligned, as the library does.
    None when a dtype has no entry in :data:`_SAFETENSORS_DTYPES`.
    """
    metadata = _memory_orders(tensors)
    items = []
    for key, tensor in tensors.items():
        code = _SAFETENSORS_DTYPES.get(tensor.dtype)
        if code is None:
            return None
        items.append((key, tensor.detach().to("cpu").contiguous(), code))
    items.sort(key=lambda item: (-item[1].element_size(), item[0]))
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    buffers: list[Any] = []
    small: list[memoryview] = []  # small tensors go out joined, so the write loop stays short
    small_bytes = offset = 0
    for key, tensor, code in items:
        size = tensor.numel() * tensor.element_size()
        header[key] = {"dtype": code, "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
        if not size:
            continue
        view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
        if size >= _SMALL_PART:
            if small:
                buffers.append(b"".join(small))
                small, small_bytes = [], 0
            buffers.append(view)
            continue
        small.append(view)
        small_bytes += size
        if small_bytes >= _JOINED_PART:
            buffers.append(b"".join(small))
            small, small_bytes = [], 0
    if small:
        buffers.append(b"".join(small))
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return [len(text).to_bytes(8, "little") + text, *buffers]


def _atomic_write_parts(path: Path, parts: Sequence[Any], *, fsync: bool = False) -> tuple[int, int]:
    """Write the buffers ``parts`` one after another to ``path`` atomically; (bytes, CRC-32)."""
    tmp = path.with_name(path.name + ".tmp")
    size, crc = 0, 0
    try:
        with open(tmp, "wb") as fh:
            for part in parts:
                fh.write(part)
                crc = zlib.crc32(part, crc)
                size += memoryview(part).nbytes
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)  # on a full disk, the space it took is what the manifest needs to say so
        raise
    return size, crc


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def write_json_atomic(path: Path, payload: Mapping[str, Any], *, fsync: bool = False) -> None:
    """Write ``payload`` as JSON to ``path`` so that readers see the old or the new file, never half."""
    _atomic_write_parts(path, [json.dumps(payload, indent=1, default=str).encode()], fsync=fsync)


def parquet_bytes(table: pa.Table) -> pa.Buffer:
    # Encoded in memory: one write call and a CRC of bytes in hand, instead of reading the file back.
    # Dictionaries only for the text columns (op names, modules, locations repeat); on ids and
    # statistics, which rarely repeat, they cost a third of the encoding time for nothing.
    text = [f.name for f in table.schema if pa.types.is_string(f.type)]
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="snappy", use_dictionary=text, write_statistics=False)
    return sink.getvalue()


def _versions() -> dict[str, str]:
    from tracecmp import __version__

    return {"tracecmp": __version__, "torch": torch.__version__}


def write_run_manifest(root: Path, *, options: Mapping[str, Any], extra: Mapping[str, Any] | None = None) -> None:
    """Write the run-level manifest (format identity, versions, options)."""
    payload: dict[str, Any] = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "versions": _versions(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "options": dict(options),
    }
    if extra:
        payload.update(extra)
    root.mkdir(parents=True, exist_ok=True)
    write_json_atomic(root / RUN_MANIFEST, payload)


def existing_trace(root: Path, rank: int = 0) -> Path | None:
    """The file that shows ``root`` already holds a trace this rank would replace, or None.

    Rank 0 owns the run manifest, every rank its own folder: no rank looks at files another
    rank of the same run may be writing at that moment.
    """
    rank_dir = root / f"rank{rank}"
    candidates = [root / RUN_MANIFEST] if rank == 0 else []
    candidates.append(rank_dir / RANK_MANIFEST)
    for path in candidates:
        if path.exists() or path.is_symlink():
            return path
    return next(iter(sorted(rank_dir.glob("chunk-*.json"))), None) if rank_dir.is_dir() else None


def remove_extra_ranks(root: Path, world_size: int) -> None:
    """Remove the trace files of rank folders ``rank<R>``, R >= ``world_size``, that an earlier
    and larger run left in ``root`` (when a trace is overwritten; rank 0 calls it)."""
    for folder in root.glob("rank*"):
        number = folder.name[4:]
        if not (number.isascii() and number.isdigit() and int(number) >= world_size and folder.is_dir()):
            continue
        for pattern in (RANK_MANIFEST, *_TRACE_FILES):
            for stale in folder.glob(pattern):
                stale.unlink()
        try:
            folder.rmdir()
        except OSError:
            pass  # something of the user's is in it: leave the folder


_TRACE_FILES = ("chunk-*", "ops-*", "tensors-*", "data-*", "compiled-*", "checks-*", "*.tmp")


class RankWriter:
    """Appends committed chunks to ``RUN/rank<R>/`` and keeps its manifest current.

    Every file reaches its final name by an atomic rename, so a killed *process* never leaves a
    half-written chunk or manifest: the kernel's page cache outlives the process. ``fsync=True``
    also survives a machine crash or power loss, at several milliseconds per chunk, which is why
    it is off by default (a chunk can be committed every second or every step).

    >>> import tempfile, pathlib
    >>> w = RankWriter(pathlib.Path(tempfile.mkdtemp()) / "run", rank=0, device="cpu")
    >>> w.close(complete=True)
    """

    def __init__(
        self,
        root: str | Path,
        *,
        rank: int = 0,
        world_size: int = 1,
        device: str = "cpu",
        info: Mapping[str, Any] | None = None,
        fsync: bool = False,
    ) -> None:
        self.root = Path(root)
        self.fsync = fsync
        self.dir = self.root / f"rank{rank}"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TracecmpError(f"cannot create the trace folder: {exc.strerror}", path=self.dir) from exc
        for pattern in _TRACE_FILES:  # what an overwritten trace left (TraceCompare asked first)
            for stale in self.dir.glob(pattern):
                stale.unlink()
        self.manifest: dict[str, Any] = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "rank": rank,
            "world_size": world_size,
            "device": device,
            "complete": False,
            "info": dict(info or {}),
        }
        self.chunks = 0
        self.steps: set[int] = set()  # the steps committed chunks hold (in whole or in part)
        self._write_manifest()

    def _write_manifest(self) -> None:
        write_json_atomic(self.dir / RANK_MANIFEST, self.manifest, fsync=self.fsync)

    def _commit(self, name: str, parts: Sequence[Any]) -> dict[str, Any]:
        """Write the buffers ``parts`` to a temporary name and rename it to ``name``; its record entry."""
        size, crc = _atomic_write_parts(self.dir / name, parts, fsync=self.fsync)
        return {"file": name, "bytes": size, "crc32": crc}

    def write_chunk(
        self,
        ops: Mapping[str, Sequence[Any]],
        tensors: Mapping[str, Sequence[Any]],
        data: Mapping[str, torch.Tensor] | None = None,
        steps: Sequence[int] = (),
        compiled: Mapping[str, Any] | None = None,
        checks: Mapping[str, Sequence[Any]] | None = None,
    ) -> None:
        """Commit one chunk given as column lists for ops and tensors, and optionally whole tensors,
        the record of compiled regions and self-checks."""
        ops_table = pa.Table.from_pydict({k: ops[k] for k in OPS_SCHEMA.names}, schema=OPS_SCHEMA)
        tensors_table = pa.Table.from_pydict({k: tensors[k] for k in TENSORS_SCHEMA.names}, schema=TENSORS_SCHEMA)
        checks_table = (
            None
            if checks is None
            else pa.Table.from_pydict({k: checks[k] for k in CHECKS_SCHEMA.names}, schema=CHECKS_SCHEMA)
        )
        self.write_tables(ops_table, tensors_table, data, steps, compiled=compiled, checks=checks_table)

    def write_rows(
        self,
        op_rows: Columns,
        tensor_rows: Columns,
        data: Mapping[str, torch.Tensor] | None = None,
        compiled: Mapping[str, Any] | None = None,
        checks: Columns | None = None,
    ) -> None:
        """Commit one chunk given as capture's row buffers (``OPS_SCHEMA``, ``TENSORS_SCHEMA`` and
        ``CHECKS_SCHEMA``)."""
        self.write_tables(
            op_rows.table(),
            tensor_rows.table(),
            data,
            compiled=compiled,
            checks=None if checks is None else checks.table(),
        )

    def write_tables(
        self,
        ops: pa.Table,
        tensors: pa.Table,
        data: Mapping[str, torch.Tensor] | None = None,
        steps: Sequence[int] | None = None,
        compiled: Mapping[str, Any] | None = None,
        checks: pa.Table | None = None,
    ) -> None:
        """Commit one chunk: its two tables (``steps``: those its ops belong to, read from them when None).

        ``compiled`` is the chunk's record of compiled regions (:mod:`tracecmp.trace.compiled`),
        written as ``compiled-<K>.json`` when given; ``checks`` its self-checks
        (``CHECKS_SCHEMA``), written as ``checks-<K>.parquet`` when given, even empty: a chunk
        recorded with self-checks on says so.

        The chunk's record ``chunk-<K>.json`` (its files' sizes and CRC-32s, row counts, steps) is
        renamed into place last: it is the commit. Each chunk costs the same whatever came before,
        so a run of thousands of recorded steps never rewrites a growing manifest.
        """
        index = self.chunks
        if steps is None:
            steps = pc.unique(ops.column("step")).to_pylist()
        names = (
            f"ops-{index:05d}.parquet",
            f"tensors-{index:05d}.parquet",
            f"data-{index:05d}.safetensors",
            f"compiled-{index:05d}.json",
            f"checks-{index:05d}.parquet",
        )
        try:
            entry: dict[str, Any] = {
                "format": FORMAT_NAME,
                "format_version": FORMAT_VERSION,
                "index": index,
                "ops": self._commit(names[0], [parquet_bytes(ops)]),
                "tensors": self._commit(names[1], [parquet_bytes(tensors)]),
                "rows": {"ops": ops.num_rows, "tensors": tensors.num_rows},
                "steps": sorted({int(s) for s in steps}),
            }
            if data:
                parts = _safetensors_parts(data)
                if parts is None:
                    from safetensors.torch import save

                    parts = [
                        save(
                            {k: t.detach().to("cpu").contiguous() for k, t in data.items()},
                            metadata=_memory_orders(data) or None,
                        )
                    ]
                entry["data"] = self._commit(names[2], parts)
            if compiled:
                text = json.dumps(compiled, separators=(",", ":"), allow_nan=False).encode()
                entry["compiled"] = self._commit(names[3], [text])
            if checks is not None:
                entry["checks"] = self._commit(names[4], [parquet_bytes(checks)])
                entry["rows"]["checks"] = checks.num_rows
            write_json_atomic(self.dir / chunk_record_name(index), entry, fsync=self.fsync)
        except BaseException:
            for name in names:  # no record lists them: readers ignore them, a full disk wants the space
                _remove(self.dir / name)
            raise
        if self.fsync:
            _fsync_dir(self.dir)
        self.chunks = index + 1
        self.steps.update(entry["steps"])

    def update_info(self, **info: Any) -> None:
        """Merge ``info`` into the rank manifest (e.g. the first overflow found)."""
        self.manifest["info"].update(info)
        self._write_manifest()

    def close(self, *, complete: bool, stopped: Mapping[str, Any] | None = None) -> None:
        """Mark the rank finished; ``complete=False`` when the run did not end normally, and
        ``stopped`` says why (see :class:`BackgroundWriter`)."""
        self.manifest["complete"] = complete
        if stopped is not None:
            self.manifest["stopped"] = dict(stopped)
        self._write_manifest()


class BackgroundWriter:
    """Commits the chunks of a :class:`RankWriter` on a thread of its own, off the training thread.

    :meth:`submit` hands a chunk over and returns at once unless two chunks are already in
    flight (one being written, one waiting), in which case it waits for the older one: memory
    stays bounded whatever the disk's speed. A chunk is *committed* once its record is renamed
    into place; a process killed before that loses it (and every later one), never an earlier
    one. :meth:`wait` returns when every chunk handed over is committed. A chunk that cannot be
    written (a full disk, a folder turned read-only) is the thread's :attr:`error`: it is raised
    as a :class:`TracecmpError` by the next :meth:`submit` or :meth:`wait`, once, and chunks
    handed over after it are dropped (a gap would hide them from readers anyway). The thread
    starts with the first chunk. :attr:`last_step` is the last step known whole on disk.

    >>> import tempfile, pathlib
    >>> w = BackgroundWriter(RankWriter(pathlib.Path(tempfile.mkdtemp()) / "run"))
    >>> w.submit(Columns(OPS_SCHEMA), Columns(TENSORS_SCHEMA), whole_through=0)
    0
    >>> w.close(complete=True); w.writer.chunks, w.last_step
    (1, 0)
    """

    def __init__(self, writer: RankWriter) -> None:
        self.writer = writer
        self.submitted = writer.chunks  # chunks handed over so far (the next one's index)
        self.last_step: int | None = None  # the last step whose every op is committed
        self._queue: queue.Queue[tuple[Any, ...] | None] = queue.Queue(maxsize=1)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._reported = False

    @property
    def error(self) -> BaseException | None:
        """Why the last chunk could not be written (None while every chunk was)."""
        return self._error

    def submit(
        self,
        op_rows: Columns,
        tensor_rows: Columns,
        data: Mapping[str, torch.Tensor] | None = None,
        compiled: Mapping[str, Any] | None = None,
        whole_through: int | None = None,
        checks: Columns | None = None,
    ) -> int:
        """Hand over one chunk (rows the caller no longer touches); returns its index.

        ``compiled``: the chunk's record of compiled regions. ``whole_through``: the last step whose
        ops are all in this chunk or in earlier ones. ``checks``: its self-check rows.
        """
        self._raise_error()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tracecmp-writer", daemon=True)
            self._thread.start()
        self._queue.put((op_rows, tensor_rows, data, compiled, checks, whole_through))
        index = self.submitted
        self.submitted = index + 1
        return index

    def wait(self) -> None:
        """Return once every chunk handed over is committed (raising the writer's error, if any)."""
        if self._thread is not None:
            self._queue.join()
        self._raise_error()

    def close(self, *, complete: bool, stopped: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
        """Commit what is queued, stop the thread, and mark the rank finished.

        The rank is marked incomplete when a chunk could not be written. ``stopped`` says why a
        run did not end normally (``kind`` and ``reason``); the rank manifest keeps it with
        ``step`` and ``last_step`` (the last step whole on disk) filled in, and it is returned.
        A failed write is then raised (if not yet), and so is a manifest that cannot be written.
        """
        self.stop()
        record = None if stopped is None else dict(stopped)
        if self._error is not None:
            reason = f"cannot write the trace: {write_error_reason(self._error)}"
            record = {**(record or {}), "kind": "write-error", "reason": reason}
        if record is not None:
            record["last_step"] = self.last_step
        try:
            self.writer.close(complete=complete and record is None, stopped=record)
        except OSError as exc:
            if self._error is None:
                raise TracecmpError(f"cannot write the trace: {write_error_reason(exc)}", path=self.writer.dir) from exc
        self._raise_error()
        return record

    def stop(self) -> None:
        """Commit what is queued and stop the thread (a later :meth:`submit` starts a new one)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self._error is None:
                    op_rows, tensor_rows, data, compiled, checks, whole_through = item
                    self.writer.write_rows(op_rows, tensor_rows, data, compiled, checks)
                    if whole_through is not None:
                        self.last_step = whole_through
            except BaseException as exc:  # noqa: BLE001 - handed to the training thread, never lost
                self._error = exc
            finally:
                self._queue.task_done()

    def _raise_error(self) -> None:
        exc = self._error
        if exc is None or self._reported:
            return
        self._reported = True
        raise TracecmpError(f"cannot write the trace: {write_error_reason(exc)}", path=self.writer.dir) from exc


def write_error_reason(exc: BaseException) -> str:
    """A write failure in a few words: ``No space left on device``, ``MemoryError: ...``."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__
