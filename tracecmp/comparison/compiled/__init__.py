"""Compiled regions in a comparison: a ``torch.compile``'d target's units (:mod:`.units`), paired
with the eager ops they replace (:mod:`.pairing`), judged as a whole (:mod:`.judge`), and a wrong
one narrowed to its FX nodes (:mod:`.narrow`).

>>> units = compiled_units(tracecmp.load("runs/target").rank(0))   # doctest: +SKIP
>>> units.members   # target op ids the alignment leaves out  # doctest: +SKIP
"""

from tracecmp.comparison.compiled.judge import judge_units, narrow_units_by_statistics
from tracecmp.comparison.compiled.narrow import run_part
from tracecmp.comparison.compiled.pairing import Pairing, covered_by_units, pair_units
from tracecmp.comparison.compiled.units import GRAPH_MODE_NOTE, CompiledUnits, compiled_units, same_compiled_graphs

__all__ = [
    "GRAPH_MODE_NOTE",
    "CompiledUnits",
    "Pairing",
    "compiled_units",
    "covered_by_units",
    "judge_units",
    "narrow_units_by_statistics",
    "pair_units",
    "run_part",
    "same_compiled_graphs",
]
