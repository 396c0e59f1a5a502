"""Check one run without a bench: every op judged against a float64 replay of its own inputs.

The package is the checking stage; its entry point is the function :func:`tracecmp.check`
(``tracecmp check TRACE`` on the command line): msprobe's API pre-check (run_ut / acc_check),
done on the trace the run already wrote.

>>> result = tracecmp.check("runs/target")       # doctest: +SKIP
>>> result.first_error                           # doctest: +SKIP
"""

from tracecmp.checking.engine import CheckError, check
from tracecmp.checking.result import CheckResult
from tracecmp.checking.standards import Standards

__all__ = ["CheckError", "CheckResult", "Standards", "check"]
