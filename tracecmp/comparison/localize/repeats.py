"""One fault, one root: the roots a fault makes each time its line runs, taken together.

A fault in a model's code runs in every micro-batch of a step (gradient accumulation), in its
backward as well as its forward, and again in the next step. Each call may be judged a root of its
own; the person reading the verdict has one line of code to fix. Roots of one rank at the same
source line and module are one root (a line that casts and computes wrongly is one fault): the
earliest, with the others' op ids as its ``repeats``.

>>> from tracecmp.verdict.records import Divergence
>>> first = Divergence("aten.gelu.default", "h.1", "forward", 0, "train.py:40", op_id=85, kind="argument")
>>> again = Divergence("aten.gelu.default", "h.1", "forward", 0, "train.py:40", op_id=176, kind="argument")
>>> [d.repeats for d in one_root_per_fault([first, again])]
[(176,)]
"""

from __future__ import annotations

from dataclasses import replace

from tracecmp.verdict.records import Divergence


def _fault_key(d: Divergence) -> tuple[int, str, str] | None:
    """What makes two roots one fault: the rank, the module and the source line. Without a source
    line nothing says two calls run the same code."""
    if not d.location:
        return None
    return (d.rank, d.module, d.location)


def one_root_per_fault(roots: list[Divergence]) -> list[Divergence]:
    """``roots`` (earliest first) with each fault's later calls folded into its first, which keeps
    its place, takes the largest score among them and lists the others as ``repeats``."""
    merged: dict[tuple[int, str, str], int] = {}  # fault -> index in out
    out: list[Divergence] = []
    for d in roots:
        key = _fault_key(d)
        at = merged.get(key) if key is not None else None
        if at is None:
            if key is not None:
                merged[key] = len(out)
            out.append(d)
            continue
        first = out[at]
        out[at] = replace(first, repeats=(*first.repeats, d.op_id), score=max(first.score, d.score))
    return out
