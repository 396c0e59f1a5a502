"""The judges as ``tracecmp.compare`` and ``tracecmp.check`` hand them out: with render loaded.

Results are data: a result's ``render(path)`` draws through the drawing render registers when it
loads (:mod:`tracecmp.verdict.drawing`), and neither judge imports render. This module sits above
both judges and render, and the package's lazy names (``tracecmp.compare``, ``tracecmp.check``,
``tracecmp.CompareResult``, ``tracecmp.CheckResult``) come from here, so that what they return can
draw itself. The functions and classes are the judges' own.

>>> import tracecmp
>>> tracecmp.compare("runs/target", "runs/bench").render("out/divergence.svg")  # doctest: +SKIP
PosixPath('out/divergence.svg')
"""

from __future__ import annotations

import tracecmp.render  # noqa: F401  (registers the drawings of compare's and check's results)
from tracecmp.checking import CheckResult, check
from tracecmp.comparison import CompareResult, compare

__all__ = ["CheckResult", "CompareResult", "check", "compare"]
