"""tracecmp: find the first PyTorch op where a target run and a bench run stop agreeing.

>>> import tracecmp
>>> with tracecmp.TraceCompare("runs/bench", model=model) as tc:   # doctest: +SKIP
...     loss = model(x).sum(); loss.backward(); opt.step(); tc.step()
>>> tracecmp.compare("runs/target", "runs/bench").first_divergence  # doctest: +SKIP
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from tracecmp.errors import (
    CaptureError,
    CaptureWarning,
    CaptureWriteError,
    CompareError,
    DifferentModels,
    OverflowDetected,
    TracecmpError,
    TraceExistsError,
    TraceFormatError,
    TraceNotFoundError,
    TraceVersionError,
)

__version__ = "0.1.0"

# Heavy parts load on first use so that `import tracecmp` stays cheap for the CLI and for users.
_LAZY = {
    "TraceCompare": "tracecmp.capture",
    "load": "tracecmp.trace",
    "Trace": "tracecmp.trace",
    "compare": "tracecmp.facade",  # the judges with render loaded: their results can draw themselves
    "CompareResult": "tracecmp.facade",
    "check": "tracecmp.facade",
    "CheckResult": "tracecmp.facade",
    "seed_all": "tracecmp.seeding",
    "register_reference": "tracecmp.numerics.replay",
}

__all__ = [
    "CaptureError",
    "CaptureWarning",
    "CaptureWriteError",
    "CompareError",
    "DifferentModels",
    "OverflowDetected",
    "TraceFormatError",
    "TraceExistsError",
    "TraceNotFoundError",
    "TraceVersionError",
    "TracecmpError",
    "__version__",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tracecmp' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value
