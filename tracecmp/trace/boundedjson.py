"""JSON from a trace, parsed only after its size and nesting depth are known to be sane.

``json.loads`` recurses once per nesting level: 100,000 nested brackets raise ``RecursionError``
(or exhaust the C stack), and a multi-gigabyte manifest is read into memory whole. A trace is
untrusted input, so its JSON (manifests, chunk records, each op's ``args``) is measured first.
Every refusal is a :class:`ValueError`, like ``json.loads``'s own errors, so callers that already
treat unparseable text as unreadable need no new case.

>>> loads('{"a": [1, 2]}')
{'a': [1, 2]}
>>> loads("[" * 100 + "]" * 100)
Traceback (most recent call last):
ValueError: JSON nested 100 levels deep (at most 64 are read)
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

MAX_BYTES = 16 << 20  # a manifest of many thousand chunks stays far below
MAX_DEPTH = 64  # tracecmp writes at most a handful of levels
ARGS_MAX_BYTES = 1 << 20  # one op's non-tensor arguments

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # Friedl's unrolled loop: linear
_OPEN = np.zeros(256, dtype=np.int8)
_OPEN[[ord("["), ord("{")]] = 1
_OPEN[[ord("]"), ord("}")]] = -1


def nesting_depth(data: bytes) -> int:
    """The deepest bracket nesting of JSON text ``data`` (brackets inside strings do not count).

    Linear time in C (a regular expression drops the strings, numpy sums the brackets): a hostile
    file of millions of brackets costs milliseconds, not a Python loop per byte.

    >>> nesting_depth(b'{"x": [[1], "[[["]}')
    3
    """
    if b"[" not in data and b"{" not in data:
        return 0
    if b'"' in data:
        data = _STRING.sub(b'""', data)
    steps = _OPEN[np.frombuffer(data, dtype=np.uint8)]
    return int(np.cumsum(steps, dtype=np.int64).max(initial=0))


def loads(text: str | bytes, *, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads(text)`` once ``text`` is at most ``max_bytes`` long and ``max_depth`` deep.

    Raises :class:`ValueError` (``json.JSONDecodeError`` and ``UnicodeDecodeError`` are
    subclasses) for text that is too large, too deep or not JSON; never ``RecursionError``.
    """
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    if len(data) > max_bytes:
        raise ValueError(f"JSON of {len(data):,} bytes (at most {max_bytes:,} are read)")
    depth = nesting_depth(data)
    if depth > max_depth:
        raise ValueError(f"JSON nested {depth} levels deep (at most {max_depth} are read)")
    try:
        return json.loads(data)
    except RecursionError as exc:  # unreachable at MAX_DEPTH; kept so no caller ever sees one
        raise ValueError("JSON nested too deeply") from exc
