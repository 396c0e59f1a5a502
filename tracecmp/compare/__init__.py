"""Compare a target trace with a bench trace: align, measure, localize the first divergence.

>>> result = tracecmp.compare("runs/target", "runs/bench")   # doctest: +SKIP
>>> result.first_divergence                                  # doctest: +SKIP
"""
import sys
import types
from typing import Any

from tracecmp.compare.engine import compare
from tracecmp.compare.records import STATUSES, Divergence
from tracecmp.compare.result import CompareResult
from tracecmp.compare.tolerances import Tolerances

__all__ = ["CompareResult", "Divergence", "STATUSES", "Tolerances", "compare"]


class _CallableModule(types.ModuleType):
    """Importing any ``tracecmp.compare.*`` submodule binds the name ``tracecmp.compare`` to this
    package, shadowing the function of the same name; calling the package calls the function."""

    def __call__(self, *args: Any, **kwargs: Any) -> CompareResult:
        return compare(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
