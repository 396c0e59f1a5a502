"""Whole tensors saved with a trace (``data="tensors"``), read back by data key.

A chunk's ``data-<K>.safetensors`` file is read with plain file reads into memory that the
returned tensor owns: the header once per file, then exactly the bytes of each requested tensor.
Nothing is memory-mapped, so a reader holds only the tensors its caller keeps (safetensors'
own ``safe_open`` maps the whole file, and every page a tensor touched stays resident while any
tensor from that file lives). Dtypes the writer hands to the safetensors library (complex,
float8) are read through it and copied out of the mapping.

Keys are ``"<chunk>/<tensor id>"``. A tensor row names its key in ``data_key``; a capture
restricted with ``only=`` may also save, in a later chunk, the value of a tensor whose row an
earlier chunk holds (the input of a selected op, produced before it): :meth:`SavedTensors.keys`
finds those from the files' headers.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

import torch

from tracecmp.errors import TraceFormatError
from tracecmp.trace import boundedjson
from tracecmp.trace.reader import RankTrace
from tracecmp.trace.schema import MEMORY_ORDER_KEY

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_HEADER_LIMIT = 100 << 20  # safetensors' own bound on a header
_OPEN_FILES = 8  # file handles kept open at once (a walk in execution order moves through chunks)


class DataFile:
    """One chunk's safetensors file: its parsed header and an open handle."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.handle: BinaryIO = open(path, "rb")
        except OSError as exc:
            raise TraceFormatError(f"cannot open saved tensors: {exc.strerror}", path=path) from exc
        try:
            self.entries, self.start, self.size, self.orders = self._header()
        except BaseException:
            self.handle.close()
            raise

    def _header(self) -> tuple[dict[str, Any], int, int, dict[str, list[int]]]:
        raw = self.handle.read(8)
        if len(raw) != 8:
            raise TraceFormatError("not a safetensors file (shorter than its header length)", path=self.path)
        (length,) = struct.unpack("<Q", raw)
        if length > _HEADER_LIMIT:
            raise TraceFormatError(f"safetensors header of {length} bytes is implausible", path=self.path)
        try:
            header = boundedjson.loads(self.handle.read(length), max_bytes=_HEADER_LIMIT)
        except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError included
            raise TraceFormatError(f"safetensors header is not valid JSON ({exc})", path=self.path) from exc
        if not isinstance(header, dict):
            raise TraceFormatError("safetensors header is not a JSON object", path=self.path)
        orders = self._memory_orders(header.pop("__metadata__", None))
        size = self.path.stat().st_size - 8 - length
        return header, 8 + length, size, orders

    def _memory_orders(self, metadata: Any) -> dict[str, list[int]]:
        """The memory order of each tensor saved from a permuted layout (:data:`MEMORY_ORDER_KEY`)."""
        text = metadata.get(MEMORY_ORDER_KEY) if isinstance(metadata, dict) else None
        if text is None:
            return {}
        try:
            orders = boundedjson.loads(text.encode() if isinstance(text, str) else b"", max_bytes=_HEADER_LIMIT)
        except ValueError as exc:
            raise TraceFormatError(
                f"the saved tensors' memory orders are not valid JSON ({exc})", path=self.path
            ) from exc
        if not isinstance(orders, dict) or not all(
            isinstance(order, list) and sorted(order) == list(range(len(order))) and all(type(d) is int for d in order)
            for order in orders.values()
        ):
            raise TraceFormatError("the saved tensors' memory orders are not permutations", path=self.path)
        return orders

    def read(self, key: str) -> torch.Tensor:
        entry = self.entries.get(key)
        if not isinstance(entry, dict):
            raise TraceFormatError(f"cannot read tensor {key!r} (not in the file)", path=self.path)
        dtype = _DTYPES.get(str(entry.get("dtype")))
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if (
            not isinstance(shape, list)
            or not all(isinstance(n, int) and n >= 0 for n in shape)
            or not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(n, int) for n in offsets)
        ):
            raise TraceFormatError(f"tensor {key!r} has a malformed header entry", path=self.path)
        if dtype is None:
            return self._read_through_library(key)
        begin, end = offsets
        count = 1
        for n in shape:
            count *= n
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        if not 0 <= begin <= end <= self.size or end - begin != nbytes:
            raise TraceFormatError(f"tensor {key!r} lies outside its file or has the wrong size", path=self.path)
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            self.handle.seek(self.start + begin)
            if self.handle.readinto(buffer.numpy()) != nbytes:
                raise TraceFormatError(f"tensor {key!r} is truncated", path=self.path)
        return self._laid_out(key, buffer.view(dtype).reshape(shape))

    def _laid_out(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (logical order) in the memory order it was saved from, where one is recorded."""
        order = self.orders.get(key)
        if order is None:
            return tensor
        if len(order) != tensor.dim():
            raise TraceFormatError(
                f"tensor {key!r} has a memory order of {len(order)} dimensions for {tensor.dim()}", path=self.path
            )
        inverse = sorted(range(len(order)), key=order.__getitem__)
        return tensor.permute(order).contiguous().permute(inverse)

    def _read_through_library(self, key: str) -> torch.Tensor:
        from safetensors.torch import safe_open

        try:
            with safe_open(str(self.path), framework="pt") as fh:
                tensor = fh.get_tensor(key).clone()  # out of the mapping, which closes with the file
        except Exception as exc:  # noqa: BLE001 - whatever safetensors raises on bad bytes (offsets
            # past the end, an unknown dtype) is a bad trace
            detail = " ".join(str(exc).split())[:200] or type(exc).__name__
            raise TraceFormatError(f"cannot read tensor {key[:80]!r} ({detail})", path=self.path) from exc
        return self._laid_out(key, tensor)

    def close(self) -> None:
        self.handle.close()


class SavedTensors:
    """Reads a rank's saved tensors by data key; each tensor is a fresh copy in memory.

    >>> with SavedTensors(trace.rank(0)) as saved:   # doctest: +SKIP
    ...     saved.get("0/17")
    """

    def __init__(self, rank: RankTrace) -> None:
        self.rank = rank
        self.files: dict[int, DataFile] = {}  # open files, least recently used first

    def __enter__(self) -> "SavedTensors":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        for data in self.files.values():
            data.close()
        self.files.clear()

    def _file(self, chunk: int) -> DataFile:
        data = self.files.pop(chunk, None)
        if data is None:
            path = self.rank.data_files.get(chunk)
            if path is None:
                raise TraceFormatError(f"data chunk {chunk} is missing", path=self.rank.path)
            data = DataFile(Path(path))
            if len(self.files) >= _OPEN_FILES:
                self.files.pop(next(iter(self.files))).close()
        self.files[chunk] = data
        return data

    def get(self, key: str) -> torch.Tensor:
        """The tensor saved under ``key``."""
        head = key.split("/")[0] if isinstance(key, str) else ""
        if not (head.isascii() and head.isdigit()):
            raise TraceFormatError(f"malformed data key {str(key)[:80]!r}", path=self.rank.path)
        chunk = int(head)
        if chunk not in self.rank.data_files:
            raise TraceFormatError(f"data key {key[:80]!r} refers to missing data chunk {chunk}", path=self.rank.path)
        return self._file(chunk).read(key)

    def keys(self) -> dict[int, str]:
        """``{tensor id: data key}`` of every saved value: the tensor rows' keys, and the keys of
        values saved in a later chunk than their row (``only=`` captures), read from the headers."""
        table = self.rank.tensors_table.select(["tensor_id", "data_key"]).to_pydict()
        found = {t: k for t, k in zip(table["tensor_id"], table["data_key"]) if k}
        named = set(found.values())
        for chunk in sorted(self.rank.data_files):
            for key in self._file(chunk).entries:
                if key in named:
                    continue
                _, _, tail = key.partition("/")
                try:
                    tid = int(tail.removeprefix("t"))
                except ValueError:
                    continue
                found.setdefault(tid, key)
        return found
