"""tracecmp's own layout of a DOT graph, for machines without graphviz's ``dot``: what
:mod:`tracecmp.render.subgraph` draws with (through :func:`tracecmp.render.canvas.draw`) when the
binary is missing.

DOT text is read into records (:mod:`.parse`), its labels measured (:mod:`.labels`), the graph laid
out in layers (:mod:`.sugiyama`) into a display list (:mod:`.drawing`) that
:mod:`tracecmp.render.canvas` writes as SVG or PNG.

>>> drawing = layout('digraph { a -> b [label="2×3"]; }')
>>> [group.kind for group in drawing.groups]
['edge', 'node', 'node']
"""

from tracecmp.render.dot.drawing import Drawing
from tracecmp.render.dot.labels import text_width
from tracecmp.render.dot.parse import Cluster, Html, parse_dot
from tracecmp.render.dot.sugiyama import layout

__all__ = ["Cluster", "Drawing", "Html", "layout", "parse_dot", "text_width"]
