"""Find the nodes whose own computation went wrong: roots, not the nodes that inherited their error.

The target graph is walked in execution order (``op_id``). Each node's outputs carry an error
against the bench (:mod:`tracecmp.comparison.metrics`: ``e_ext`` at the extremes, ``e_sys`` in norm and
mean, lower bounds both). From its inputs' errors and the op's propagation class
(:mod:`tracecmp.aten.opclass`, with condition factors computed from the bench's magnitudes) the
node gets a *prediction*: the error its outputs would show if the op itself were exact. What the
outputs show beyond the prediction is what the node *introduced*, in rounding units of the coarser
dtype (scaled by the op's condition factor for sums, by TF32's unit for float32 matmul/conv). A
node is a root when

* its inputs agree bitwise and its outputs do not, in a comparison where identical inputs otherwise
  give identical outputs (the "bitwise regime": same implementation, dtypes, determinism), or
* its error exceeds a margin times the prediction by more than ``local`` rounding units, where
  both margin and floor are calibrated on this comparison: per (op, dtype) the typical error
  introduced (fresh noise every TF32 matmul or bf16 op adds) and the typical ratio of observed
  to predicted error (where the class's model is loose for this op). A run that is bf16
  throughout therefore reads as noise, not as a thousand roots.

Statistics are single samples of a random error, so a tensor passes on to its consumers not only
what it measured but up to a few times more when its own prediction was higher, and the full
prediction where a channel is blind (softmax's extremes are exactly 0 and 1 in both runs). A view
passes on its base's error, widened: its largest error may sit away from the base's extremes.

Non-tensor argument differences, differing sources, NaN/Inf appearing from finite inputs and
diverging random ops are roots of their own kinds; a target-only op that changes values is a
structure root. Error reaching a node only through an input that is already NaN, through a changed
index or mask, or through an input whose error is unknown is never blamed on it. The first root in
execution order is the first divergence; all roots, ranked by introduced error, are the suspects.
"""

from __future__ import annotations

from tracecmp.comparison.localize.records import NodeVerdict, RankInput
from tracecmp.comparison.localize.regions import substitution_notes
from tracecmp.comparison.localize.walk import localize

__all__ = ["NodeVerdict", "RankInput", "localize", "substitution_notes"]
