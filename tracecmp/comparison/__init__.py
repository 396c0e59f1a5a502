"""Compare a target trace with a bench trace: align, measure, localize the first divergence.

The package is the comparison stage; its entry point is the function :func:`tracecmp.compare`.

>>> result = tracecmp.compare("runs/target", "runs/bench")   # doctest: +SKIP
>>> result.first_divergence                                  # doctest: +SKIP
"""

from tracecmp.comparison.api import compare
from tracecmp.comparison.result import CompareResult
from tracecmp.comparison.tolerances import Tolerances
from tracecmp.verdict.records import STATUSES, Divergence

__all__ = ["CompareResult", "Divergence", "STATUSES", "Tolerances", "compare"]
