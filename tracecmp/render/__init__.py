"""Pictures and reports of a verdict: the suspicious subgraph, the HTML report, the error chart.

Compare's report is :mod:`tracecmp.render.html`, check's :mod:`tracecmp.render.check_report`.
Loading render registers how each kind of result is drawn (:mod:`tracecmp.verdict.drawing`): a
result's ``render(path)`` draws through it, and the results import no renderer.

>>> from tracecmp.render import render_subgraph, write_report
>>> write_report(tracecmp.compare("runs/target", "runs/bench"), "out")  # doctest: +SKIP
PosixPath('out/report.html')
"""

from tracecmp.render import check_report
from tracecmp.render.html import write_report
from tracecmp.render.subgraph import render_subgraph
from tracecmp.verdict.drawing import register_drawing

register_drawing("compare", render_subgraph)
register_drawing("check", check_report.render_subgraph)

__all__ = ["render_subgraph", "write_report"]
