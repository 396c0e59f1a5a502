"""Plain records that both judges (compare and check) hand to render, report and the CLI.

They hold ids, names and numbers, never tensors, so a result can be built by hand in tests.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cache
from typing import Iterable

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
    kind: str = "computation"  # also argument, structure, source, random, nan, precision
    reason: str = ""  # one line a person reads first
    score: float = 0.0  # error introduced by this node, in rounding units of its dtype; ranks suspects
    metrics: dict[str, float] = field(default_factory=dict)  # the deciding numbers (rel_err, cosine, ...)
    stack: str = ""
    region: int | None = None  # id of the region (CompareResult.regions) this root is, when it is one
    # The same fault's later calls (each micro-batch, the backward of its line): their op ids
    repeats: tuple[int, ...] = ()

    def __str__(self) -> str:
        where = f"{self.module or '<top>'} [{self.phase}, step {self.step}]"
        again = f" (and {len(self.repeats)} more calls of this line)" if self.repeats else ""
        return f"{self.op} in {where} at {self.location or '?'}: {self.reason}{again}"


@dataclass(frozen=True)
class SkippedStep:
    """A step whose optimizer update the target's loss scaler (``GradScaler``) skipped, on an overflow
    its bench did not have: the scaler at work (it lowers its scale and tries again), not a fault.

    ``overflows`` are the ops whose results left the range of the target's dtype (float16's 65504 at
    a loss scale of 2**16) with values beyond it, earliest first; ``check_op_id``
    is the scaler's check that found them. What the next steps compute from parameters the bench
    moved and the target did not is inherited from that decision.

    >>> SkippedStep(rank=0, step=0, check_op_id=90, overflows=()).step
    0
    """

    rank: int
    step: int
    check_op_id: int
    overflows: tuple[Divergence, ...]

    def __str__(self) -> str:
        first = self.overflows[0] if self.overflows else None
        where = f": first {first.op} in {first.module or '<top>'} [{first.phase}, op {first.op_id}]" if first else ""
        many = f"{len(self.overflows)} ops overflowed" if len(self.overflows) != 1 else "1 op overflowed"
        return f"step {self.step}{', rank ' + str(self.rank) if self.rank else ''}: {many}{where}"


@dataclass(frozen=True)
class Drift:
    """Where a rank's two runs drifted apart: the first op whose output's extremes differ from the
    bench's by more than a fifth of its largest value although its inputs explain it (rounding a
    network amplified until the runs hold other samples of the same values, as ResNet-50 at
    random initialization does in bf16). Beyond it, statistics see a fault only where it is larger
    than that drift; ``undecided`` are the later ops they would have named as roots but cannot tell
    from it (their status is ``uncompared``).

    >>> Drift(rank=0, op_id=794, step=0, phase="backward", op="aten.mm.default", module="fc", error=0.25,
    ...       undecided=(1947,)).undecided
    (1947,)
    """

    rank: int
    op_id: int
    step: int
    phase: str
    op: str
    module: str
    error: float  # its max/min difference, relative to its largest value
    undecided: tuple[int, ...] = ()

    def __str__(self) -> str:
        where = (
            f"rank {self.rank}: the runs drifted apart from op {self.op_id} on ({self.op} in {self.module or '<top>'}, "
            f"{self.phase}, step {self.step}: its max/min differ by {self.error:.0%} within what its inputs carried)"
        )
        if not self.undecided:
            return (
                f"{where}; beyond it statistics see a fault only where it is larger than that drift: capture the "
                'target with data="tensors" to judge every op by replay'
            )
        one = len(self.undecided) == 1
        many = (
            "1 later op that statistics would name as a root cannot be told from that drift and is"
            if one
            else (
                f"{len(self.undecided)} later ops that statistics would name as roots cannot be told from that drift and are"
            )
        )
        return (
            f"{where}; {many} left uncompared "
            f"(op {', '.join(map(str, self.undecided[:5]))}{', ...' if len(self.undecided) > 5 else ''}): "
            'capture the target with data="tensors" to judge them by replay'
        )


# What a region is (see :class:`Region`).
REGION_KINDS = (
    "fused",  # one computing op on one side against several on the other (flash attention vs matmul, softmax, matmul)
    "rewritten",  # several ops on both sides computing the same values another way
    "pass-through",  # ops on one side only that move or cast values (autocast's _to_copy, an extra clone)
    "extra",  # ops on the target side only that change values
    "missing",  # ops on the bench side only that change values
)


@dataclass(frozen=True)
class Region:
    """Target ops and bench ops that compute the same values only at their boundary.

    Alignment pairs ops one to one where it can. Where it cannot (a fused kernel on one side and
    its decomposition on the other, a different decomposition, casts that autocast inserts on one
    side), the unpaired ops and the pairs caught between them form a region, found by dataflow:
    its ``inputs`` are tensors that both sides read (paired), its ``outputs`` tensors that paired
    ops downstream read in the same argument position (or the last version of a tensor both sides
    wrote in place, such as a parameter a fused optimizer updates). A region is judged at its
    boundary like one op; nothing inside it is compared with the other side. A one-sided region
    (``bench_ops`` or ``target_ops`` empty) stands between a tensor and its consumer on one side
    only.

    Other stages that line up many ops with one (compiled graphs against eager ops) build the same
    record and hand it to localization.

    >>> r = Region(0, rank=0, step=0, phase="forward", module="attn.core", kind="fused",
    ...            target_ops=(24,), bench_ops=(31, 33, 36, 37, 44), inputs=((21, 21), (23, 23), (25, 25)),
    ...            outputs=((26, 47),))
    >>> r.describe()
    'fused: 1 target op against 5 bench ops in attn.core (forward)'
    """

    region_id: int
    rank: int
    step: int
    phase: str
    module: str  # the module the region's target ops share (their common dotted prefix)
    kind: str  # one of REGION_KINDS
    target_ops: tuple[int, ...]  # target op ids, execution order (views included)
    bench_ops: tuple[int, ...]  # bench op ids, execution order
    # (target tensor id, bench tensor id): what both sides read; None on the side that does not read it
    inputs: tuple[tuple[int | None, int | None], ...]
    outputs: tuple[tuple[int, int], ...]  # (target tensor id, bench tensor id) the region is judged on
    target_names: tuple[str, ...] = ()  # op names of target_ops (same order), for reports
    bench_names: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line: what kind of region, how many ops on each side, where."""

        def count(n: int, side: str) -> str:
            return f"{n} {side} op{'s' if n != 1 else ''}"

        where = f"{self.module or '<top>'} ({self.phase})"
        return f"{self.kind}: {count(len(self.target_ops), 'target')} against {count(len(self.bench_ops), 'bench')} in {where}"


# Ops that only re-label or alias values; left out of a region's summary unless it has nothing else.
VIEW_OPS = frozenset(
    {
        "view",
        "transpose",
        "expand",
        "permute",
        "t",
        "alias",
        "detach",
        "unsqueeze",
        "squeeze",
        "slice",
        "select",
        "split",
        "as_strided",
        "_reshape_alias",
        "unbind",
        "reshape",
        "narrow",
    }
)


def op_counts(names: Iterable[str], *, views: bool = False, limit: int | None = None) -> str:
    """``bmm x2, mul, _softmax``: a region side's op names, short, counted, in order of first
    appearance (sources and, unless ``views``, view ops left out; past ``limit`` names, "...").

    >>> op_counts(["aten.bmm.default", "aten.view.default", "aten.mul.Tensor", "aten.bmm.default"])
    'bmm x2, mul'
    """
    counts: dict[str, int] = {}
    for name in names:
        parts = str(name).split(".")
        if parts[0] == "source" or len(parts) < 2:
            continue
        short = parts[1] if parts[0] == "aten" else ".".join(parts[:-1] if len(parts) > 2 else parts)
        if short in VIEW_OPS and not views:
            continue
        counts[short] = counts.get(short, 0) + 1
    items = [f"{n} x{c}" if c > 1 else n for n, c in counts.items()]
    if limit is not None and len(items) > limit:
        items = items[:limit] + ["..."]
    return ", ".join(items)


@cache
def layer_site(module: str) -> str:
    """A module path with its layer numbers taken out: where one line of a model's code runs in
    every layer.

    >>> layer_site("bert.encoder.layer.7.output.LayerNorm")
    'bert.encoder.layer.#.output.LayerNorm'
    """
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "#", module)
