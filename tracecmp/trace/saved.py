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
        from safetensors import SafetensorError
        from safetensors.torch import safe_open

        try:
            chunk = int(key.split("/")[0])
        except ValueError:
            raise TraceFormatError(f"malformed data key {key!r}", path=self.rank.path) from None
        path = self.rank.data_files.get(chunk)
        if path is None:
            raise TraceFormatError(f"data key {key!r} refers to missing data chunk {chunk}", path=self.rank.path)
        try:
            handle = self.handles.get(chunk)
            if handle is None:
                handle = safe_open(str(path), framework="pt").__enter__()
                self.handles[chunk] = handle
            return handle.get_tensor(key)
        except (SafetensorError, OSError, KeyError) as exc:
            raise TraceFormatError(f"cannot read tensor {key!r} ({exc})", path=path) from exc
