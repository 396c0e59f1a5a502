"""Plain records that the compare stage hands to render, report and the CLI.

They hold ids, names and numbers, never tensors, so a result can be built by hand in tests.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# Status of one target node after localization, worst last; render colours by it.
STATUSES = ("agrees", "noise", "uncompared", "unpaired", "diverged", "nan")

# Why a node is a root cause.
KINDS = (
    "computation",  # outputs diverge while inputs agree, or the error grew far beyond the inputs'
    "argument",  # paired node with different non-tensor arguments (gelu approximate, eps)
    "source",  # a parameter, buffer or input differs
    "nan",  # NaN/Inf appear (or disagree) although inputs are finite
    "random",  # divergence starts at a random op (different generator state or device)
    "structure",  # target has an op the bench lacks (or vice versa) that changes values
)


@dataclass(frozen=True)
class Divergence:
    """One root cause: the op whose own computation went wrong, and why.

    >>> Divergence(op="aten.gelu.default", module="mlp.act", phase="forward", step=0,
    ...            location="train.py:42", op_id=17).op
    'aten.gelu.default'
    """

    op: str
    module: str
    phase: str
    step: int
    location: str
    op_id: int  # node id in the target trace
    bench_op_id: int | None = None  # paired node in the bench trace, None when unpaired
    rank: int = 0
    kind: str = "computation"
    reason: str = ""  # one line a person reads first
    score: float = 0.0  # error introduced by this node, in rounding units of its dtype; ranks suspects
    metrics: dict[str, float] = field(default_factory=dict)  # the deciding numbers (rel_err, cosine, ...)
    stack: str = ""

    def __str__(self) -> str:
        where = f"{self.module or '<top>'} [{self.phase}, step {self.step}]"
        return f"{self.op} in {where} at {self.location or '?'}: {self.reason}"
