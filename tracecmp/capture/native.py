"""Capture's native extensions, bound in one place: the only module that imports them.

``tracecmp._cstats`` is the fused statistics kernel (``csrc/cstats.cpp``), ``tracecmp._crecord``
the capture mode's per-op path and the number columns of its row buffers (``csrc/record*.cpp``).
Their C contract is declared in ``tracecmp/_cstats.pyi`` and ``tracecmp/_crecord.pyi``. Both are
optional: an install without a C++ compiler has neither, and capture then runs the pure-Python
references, :mod:`tracecmp.capture.stats` for the kernel and ``CaptureMode.__torch_dispatch__``
(:mod:`tracecmp.capture.mode`) for the per-op path, which the tests hold the C code equal to.
``TRACECMP_FORCE_REFERENCE=1`` in the environment at import runs the references on a build that
has both (:data:`FORCE_REFERENCE`).

What an install lacks is capture's own business: :func:`announce_references` says so once per
process when a session starts, and :func:`error` says why a module is not in use.

>>> isinstance(missing(), list)
True
"""

from __future__ import annotations

import array
import os
import sys
from typing import Any, Callable

# Set at import: the references serve even where the extensions are built (tests, benchmarks).
FORCE_REFERENCE = os.environ.get("TRACECMP_FORCE_REFERENCE", "") == "1"

_errors: dict[str, str] = {}  # extension name -> why it is not in use

# Imported as modules, here only: every other module reaches them through this one.
try:
    import tracecmp._cstats as cstats
except ImportError as exc:  # not built (no compiler at install time): the reference serves
    cstats = None
    _errors["_cstats"] = f"tracecmp._cstats is not importable: {exc}"

try:
    import tracecmp._crecord as _record_module
except ImportError as exc:
    _record_module = None
    _errors["_crecord"] = f"tracecmp._crecord is not available ({exc}); capture runs its Python reference"

# The array type of the row buffers' number columns (tracecmp.trace.columns.Columns): the C
# per-op path appends to a Buffer directly and calls ``append`` on anything else, so the
# standard library's array.array, with the same interface, serves it too, only slower.
Buffer: Any = _record_module.Buffer if _record_module is not None else None
NUMBER_ARRAY: Callable[[str], Any] = Buffer if Buffer is not None and not FORCE_REFERENCE else array.array


def configure_record(helpers: Callable[[], dict[str, Any]]) -> Any:
    """``tracecmp._crecord`` configured with what ``helpers()`` names (the reference's helpers and
    types, its ``configure`` keywords), or None when it is not built or cannot run with this torch
    (:func:`error` says why)."""
    if _record_module is None:
        return None
    try:
        _record_module.configure(**helpers())
    except (TypeError, AttributeError) as exc:  # a torch without one of the helpers it is given
        _errors["_crecord"] = f"tracecmp._crecord cannot run with this torch ({exc}); capture runs its Python reference"
        return None
    _errors.pop("_crecord", None)
    return _record_module


def error(name: str) -> str | None:
    """Why extension ``name`` (``"_cstats"`` or ``"_crecord"``) is not in use; None when it is.

    >>> error("_cstats") is None or "tracecmp._cstats" in error("_cstats")
    True
    """
    return _errors.get(name)


def missing() -> list[str]:
    """The extensions this install cannot use, by name."""
    return [name for name in ("_cstats", "_crecord") if name in _errors]


_announced = False


def announce_references() -> None:
    """Say once per process, in one line on stderr, that capture runs the Python references of
    native extensions that were not built (an install without a C++ compiler). Traces are the same;
    only the per-op cost differs. Silent when ``TRACECMP_FORCE_REFERENCE=1`` asks for them."""
    global _announced
    if _announced or os.environ.get("TRACECMP_FORCE_REFERENCE", "") == "1":
        return
    _announced = True
    names = missing()
    if names:
        print(
            f"tracecmp: native extension{'s' if len(names) > 1 else ''} {' and '.join(names)} not built "
            "(no C++ compiler at install?): capture runs the Python reference (same trace, slower)",
            file=sys.stderr,
        )
