"""Compare a target trace with a bench trace: align, measure, localize the first divergence.

>>> result = tracecmp.compare("runs/target", "runs/bench")   # doctest: +SKIP
>>> result.first_divergence                                  # doctest: +SKIP
"""
from tracecmp.compare.engine import compare
from tracecmp.compare.records import STATUSES, Divergence
from tracecmp.compare.result import CompareResult
from tracecmp.compare.tolerances import Tolerances

__all__ = ["CompareResult", "Divergence", "STATUSES", "Tolerances", "compare"]
