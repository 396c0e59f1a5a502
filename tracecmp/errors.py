"""One error family for everything tracecmp refuses to do.

The CLI turns any :class:`TracecmpError` into one line on stderr and exit code 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class TracecmpError(Exception):
    """Base class of every error tracecmp raises on purpose.

    ``path`` names the file or folder the error is about, when there is one.

    >>> str(TracecmpError("no trace here", path="runs/x"))
    'runs/x: no trace here'
    """

    def __init__(self, message: str, *, path: str | Path | None = None) -> None:
        self.message = message
        self.path = None if path is None else str(path)
        super().__init__(f"{self.path}: {message}" if self.path else message)


class TraceNotFoundError(TracecmpError):
    """The path holds no trace at all (missing folder or manifest)."""


class TraceFormatError(TracecmpError):
    """The trace exists but is corrupt, truncated, foreign or of an unknown layout."""


class TraceVersionError(TraceFormatError):
    """The trace was written by a newer format version than this tracecmp reads."""


class CaptureError(TracecmpError):
    """Capture was misused (nested sessions, step() outside the context, bad options)."""


class TraceExistsError(CaptureError):
    """The folder a capture would write already holds a trace (``overwrite=True`` replaces it)."""


class CaptureWriteError(CaptureError):
    """The trace could not be written (a full disk, a folder turned read-only, a permission lost).

    Raised only by ``TraceCompare(on_error="raise")``; by default capture warns with
    :class:`CaptureWarning`, stops recording and lets the run go on.
    """


class CaptureWarning(UserWarning):
    """Capture stopped recording (the trace could not be written) while the traced run went on."""


class CompareError(TracecmpError):
    """Two traces cannot be compared (no common ranks or steps, bad tolerances)."""


class DifferentModels(CompareError):
    """The target and bench share too little to be runs of one model (parameters by name and
    shape): a comparison would name differences of the programs, not of their numbers. ``force``
    compares them anyway."""


class OverflowDetected(TracecmpError):
    """Raised by ``TraceCompare(overflow="raise")`` at the first op producing NaN/Inf from finite inputs.

    ``overflow`` is the :class:`tracecmp.aten.overflow.Overflow` record (op, module, phase, step,
    location, input and output ranges, notes); its main fields are also attributes here. ``path``
    is the trace folder, committed up to and including that op and marked incomplete.

    >>> from tracecmp.aten.overflow import Overflow
    >>> e = OverflowDetected(Overflow("aten.mm.default", "fc", "forward", 0, "t.py:3", 4, 0), path="runs/t")
    >>> e.op, e.module
    ('aten.mm.default', 'fc')
    """

    def __init__(self, overflow: Any, *, path: str | Path | None = None) -> None:
        self.overflow = overflow
        self.op: str = overflow.op
        self.module: str = overflow.module
        self.phase: str = overflow.phase
        self.step: int = overflow.step
        self.location: str = overflow.location
        self.inputs = overflow.inputs
        self.outputs = overflow.outputs
        self.notes: tuple[str, ...] = overflow.notes
        super().__init__(f"overflow: {overflow}", path=path)
