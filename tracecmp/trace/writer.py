"""Crash-safe chunked writer of a trace folder (see :mod:`tracecmp.trace.schema`)."""
from __future__ import annotations

import json
import os
import time
import zlib
from pathlib import Path
from typing import Any, Mapping, Sequence

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from tracecmp.errors import TracecmpError
from tracecmp.trace.schema import (
    FORMAT_NAME,
    FORMAT_VERSION,
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


def _atomic_write_bytes(path: Path, data: bytes, *, fsync: bool = False) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        if fsync:
            fh.flush()
            os.fsync(fh.fileno())
    os.replace(tmp, path)


def write_json_atomic(path: Path, payload: Mapping[str, Any], *, fsync: bool = False) -> None:
    """Write ``payload`` as JSON to ``path`` so that readers see the old or the new file, never half."""
    _atomic_write_bytes(path, json.dumps(payload, indent=1, default=str).encode(), fsync=fsync)


def _crc32_file(path: Path) -> int:
    crc = 0
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            crc = zlib.crc32(block, crc)
    return crc


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


class RankWriter:
    """Appends committed chunks to ``RUN/rank<R>/`` and keeps its manifest current.

    Every file reaches its final name by an atomic rename, so a killed *process* never leaves a
    half-written chunk or manifest: the kernel's page cache outlives the process. ``fsync=True``
    also survives a machine crash or power loss, at several milliseconds per chunk, which is why
    it is off by default (a chunk is committed at every training step).

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
        for pattern in ("chunk-*", "ops-*", "tensors-*", "data-*"):
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
        self._write_manifest()

    def _write_manifest(self) -> None:
        write_json_atomic(self.dir / RANK_MANIFEST, self.manifest, fsync=self.fsync)

    def _commit_file(self, name: str, write: Any) -> dict[str, Any]:
        final = self.dir / name
        tmp = self.dir / (name + ".tmp")
        write(tmp)
        if self.fsync:
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
        os.replace(tmp, final)
        return {"file": name, "bytes": final.stat().st_size, "crc32": _crc32_file(final)}

    def write_chunk(
        self,
        ops: Mapping[str, Sequence[Any]],
        tensors: Mapping[str, Sequence[Any]],
        data: Mapping[str, torch.Tensor] | None = None,
        steps: Sequence[int] = (),
    ) -> None:
        """Commit one chunk: column lists for ops and tensors, and optionally whole tensors.

        The chunk's record ``chunk-<K>.json`` (its files' sizes and CRC-32s, row counts, steps) is
        renamed into place last: it is the commit. Each chunk costs the same whatever came before,
        so a run of thousands of recorded steps never rewrites a growing manifest.
        """
        index = self.chunks
        ops_table = pa.Table.from_pydict({k: ops[k] for k in OPS_SCHEMA.names}, schema=OPS_SCHEMA)
        tensors_table = pa.Table.from_pydict({k: tensors[k] for k in TENSORS_SCHEMA.names}, schema=TENSORS_SCHEMA)
        entry: dict[str, Any] = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "index": index,
            "ops": self._commit_file(f"ops-{index:05d}.parquet", lambda p: pq.write_table(ops_table, p, compression="zstd")),
            "tensors": self._commit_file(
                f"tensors-{index:05d}.parquet", lambda p: pq.write_table(tensors_table, p, compression="zstd")
            ),
            "rows": {"ops": ops_table.num_rows, "tensors": tensors_table.num_rows},
            "steps": sorted({int(s) for s in steps}),
        }
        if data:
            from safetensors.torch import save_file

            cpu = {key: t.detach().to("cpu").contiguous() for key, t in data.items()}
            entry["data"] = self._commit_file(f"data-{index:05d}.safetensors", lambda p: save_file(cpu, str(p)))
        write_json_atomic(self.dir / chunk_record_name(index), entry, fsync=self.fsync)
        if self.fsync:
            _fsync_dir(self.dir)
        self.chunks = index + 1

    def update_info(self, **info: Any) -> None:
        """Merge ``info`` into the rank manifest (e.g. the first overflow found)."""
        self.manifest["info"].update(info)
        self._write_manifest()

    def close(self, *, complete: bool) -> None:
        """Mark the rank finished; ``complete=False`` when the traced program raised."""
        self.manifest["complete"] = complete
        self._write_manifest()
