"""Whole tensors saved with a trace (``data="tensors"``), read back by data key."""
from __future__ import annotations

from typing import Any

from tracecmp.errors import TraceFormatError
from tracecmp.trace.reader import RankTrace


class SavedTensors:
    """Reads a rank's saved tensors by data key, opening each safetensors chunk once.

    >>> with SavedTensors(trace.rank(0)) as saved:   # doctest: +SKIP
    ...     saved.get("0/17")
    """

    def __init__(self, rank: RankTrace) -> None:
        self.rank = rank
        self.handles: dict[int, Any] = {}

    def __enter__(self) -> "SavedTensors":
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles.values():
            handle.__exit__(None, None, None)
        self.handles.clear()

    def get(self, key: str) -> Any:
        from safetensors.torch import safe_open

        head = key.split("/")[0] if isinstance(key, str) else ""
        if not (head.isascii() and head.isdigit()):
            raise TraceFormatError(f"malformed data key {str(key)[:80]!r}", path=self.rank.path)
        chunk = int(head)
        path = self.rank.data_files.get(chunk)
        if path is None:
            raise TraceFormatError(f"data key {key!r} refers to missing data chunk {chunk}", path=self.rank.path)
        try:
            handle = self.handles.get(chunk)
            if handle is None:
                handle = safe_open(str(path), framework="pt").__enter__()
                self.handles[chunk] = handle
            return handle.get_tensor(key)
        except Exception as exc:  # noqa: BLE001 - whatever safetensors raises on bad bytes (a header
            # claiming 2**62 bytes, offsets past the end, an unknown dtype) is a bad trace
            detail = " ".join(str(exc).split())[:200] or type(exc).__name__
            raise TraceFormatError(f"cannot read tensor {key[:80]!r} ({detail})", path=path) from exc
