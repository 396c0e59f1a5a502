"""What a capture session was asked for: :class:`TraceCompare`'s keyword options as one frozen value.

:meth:`CaptureOptions.of` checks the keywords as ``TraceCompare(...)`` takes them and refuses a bad
one with :class:`~tracecmp.CaptureError`; the session reads the result (``tc.options``) and writes
:meth:`CaptureOptions.manifest` into the run and rank manifests. What each option does is
``TraceCompare``'s docstring.

>>> CaptureOptions.of(steps=[2, 1], dropout=0.0).steps
frozenset({1, 2})
>>> CaptureOptions.of(data="everything")
Traceback (most recent call last):
...
tracecmp.errors.CaptureError: data must be one of ('stats', 'tensors'), not 'everything'
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

from tracecmp.capture.select import Selection
from tracecmp.errors import CaptureError

DATA_MODES = ("stats", "tensors")
RNG_MODES = ("device", "host")
OVERFLOW_MODES = (None, "record", "raise")
COMPILED_MODES = ("boundary", "graph")
SELF_CHECK_MODES = ("off", "sample", "full")
ERROR_MODES = ("warn", "raise")


@dataclass(frozen=True)
class CaptureOptions:
    """A session's options, checked (see :class:`~tracecmp.capture.session.TraceCompare`)."""

    steps: frozenset[int] | None = None  # the recorded steps (None: all)
    data: str = "stats"
    stack: bool = False
    max_ops: int = 200_000
    max_bytes: int = 1 << 30
    rng: str = "device"
    dropout: float | None = None  # None: dropout left alone; 0.0: turned off
    overflow: str | None = None
    sync: bool = False
    flush_secs: float = 1.0
    overwrite: bool = False
    on_error: str = "warn"
    only: Selection | None = None
    compiled: str = "boundary"
    self_check: str = "off"
    self_check_sample: int = 16
    self_check_seed: int = 0

    @classmethod
    def of(
        cls,
        *,
        steps: Iterable[int] | None = None,
        data: str = "stats",
        stack: bool = False,
        max_ops: int = 200_000,
        max_bytes: int = 1 << 30,
        rng: str = "device",
        dropout: float | None = None,
        overflow: str | None = None,
        sync: bool = False,
        flush_secs: float = 1.0,
        overwrite: bool = False,
        on_error: str = "warn",
        only: Selection | Mapping[str, Any] | str | None = None,
        compiled: str = "boundary",
        self_check: str = "off",
        self_check_sample: int = 16,
        self_check_seed: int = 0,
    ) -> CaptureOptions:
        """The options ``TraceCompare(...)`` was given, checked and normalised (CaptureError if not)."""
        if data not in DATA_MODES:
            raise CaptureError(f"data must be one of {DATA_MODES}, not {data!r}")
        if rng not in RNG_MODES:
            raise CaptureError(f"rng must be one of {RNG_MODES}, not {rng!r}")
        if dropout is not None and (isinstance(dropout, bool) or dropout != 0.0):
            raise CaptureError(f"dropout must be None (leave dropout alone) or 0.0 (turn it off), not {dropout!r}")
        if overflow not in OVERFLOW_MODES:
            raise CaptureError(f"overflow must be one of {OVERFLOW_MODES}, not {overflow!r}")
        if on_error not in ERROR_MODES:
            raise CaptureError(f"on_error must be one of {ERROR_MODES}, not {on_error!r}")
        if compiled not in COMPILED_MODES:
            raise CaptureError(f"compiled must be one of {COMPILED_MODES}, not {compiled!r}")
        if self_check not in SELF_CHECK_MODES:
            raise CaptureError(f"self_check must be one of {SELF_CHECK_MODES}, not {self_check!r}")
        if isinstance(self_check_sample, bool) or not isinstance(self_check_sample, int) or self_check_sample < 1:
            raise CaptureError(f"self_check_sample must be a positive number of elements, not {self_check_sample!r}")
        if isinstance(self_check_seed, bool) or not isinstance(self_check_seed, int):
            raise CaptureError(f"self_check_seed must be an integer, not {self_check_seed!r}")
        selected: frozenset[int] | None = None
        if steps is not None:
            try:
                selected = frozenset(int(s) for s in steps)
            except (TypeError, ValueError) as exc:
                raise CaptureError(f"steps must be an iterable of step numbers or None ({exc})") from None
            if any(s < 0 for s in selected):
                raise CaptureError("steps must not be negative")
        selection = None if only is None else Selection.of(only)
        if selection is not None and data != "tensors":
            raise CaptureError('only= chooses the ops whose tensors are saved: use it with data="tensors"')
        if max_ops < 1 or max_bytes < 1:
            raise CaptureError("max_ops and max_bytes must be positive")
        if isinstance(flush_secs, bool) or not isinstance(flush_secs, (int, float)) or not 0 <= flush_secs < math.inf:
            raise CaptureError(f"flush_secs must be a number of seconds >= 0, not {flush_secs!r}")
        return cls(
            steps=selected,
            data=data,
            stack=bool(stack),
            max_ops=max_ops,
            max_bytes=max_bytes,
            rng=rng,
            dropout=None if dropout is None else 0.0,
            overflow=overflow,
            sync=bool(sync),
            flush_secs=float(flush_secs),
            overwrite=bool(overwrite),
            on_error=on_error,
            only=selection,
            compiled=compiled,
            self_check=self_check,
            self_check_sample=self_check_sample,
            self_check_seed=self_check_seed,
        )

    def manifest(self, model: torch.nn.Module | None) -> dict[str, Any]:
        """The ``options`` a session writes into the run and rank manifests (``model``: its class name)."""
        return {
            "data": self.data,
            "steps": None if self.steps is None else sorted(self.steps),
            "stack": self.stack,
            "model": type(model).__name__ if model is not None else None,
            "rng": self.rng,
            "dropout": self.dropout,
            "overflow": self.overflow,
            "only": None if self.only is None else self.only.to_dict(),
            "compiled": self.compiled,
            "self_check": self.self_check,
            "self_check_sample": self.self_check_sample,
            "self_check_seed": self.self_check_seed,
        }
