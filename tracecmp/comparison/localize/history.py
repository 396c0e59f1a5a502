"""What happened in the run around a node: drift between the runs, values Python read (readouts
that decide arguments and control flow), overflow, and steps a loss scaler skipped.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import replace
from functools import lru_cache
from typing import Callable, Iterable

from tracecmp.aten.opclass import is_overflow_check
from tracecmp.comparison.localize.records import NodeVerdict, RankInput
from tracecmp.graph.nodes import Node, TensorState
from tracecmp.verdict.records import Divergence, SkippedStep

# A rank's runs have drifted apart where a large tensor's extremes differ by more than this share of
# its largest value with no root behind it: its elements are then other samples of the same values
# (measured on ResNet-50 at random initialization, bf16 or AMP against fp32: relu outputs 5% off
# element by element in stage 1, 48% in stage 3, 90-131% in the backward, while norms and means
# agree to 1e-4). Text models of 100M+ parameters stay below 8% in every clean pair.
_DRIFT = 0.2


_DRIFT_MIN_NUMEL = 1 << 16  # extremes of fewer values scatter too much to say so


def is_exact(s: TensorState | None) -> bool:
    return s is not None and s.exact


def drift_of(outputs: Iterable[TensorState | None]) -> float:
    """The largest measured max/min difference among an op's large float outputs beyond ``_DRIFT``, else 0."""
    errors = [
        s.e_ext
        for s in outputs
        if s is not None
        and s.measured
        and s.is_float
        and not s.nonfinite
        and s.numel >= _DRIFT_MIN_NUMEL
        and s.e_ext > _DRIFT
    ]
    return max(errors, default=0.0)


# What a program's Python code decides: the arguments it passes, which ops it runs, the values it
# creates tensors from, its random draws, and the batches and parameters it feeds.
_PYTHON_KINDS = ("argument", "structure", "random", "source")


def _skipping_checks(ri: RankInput) -> list[Node]:
    """The loss scaler's checks that found NaN/Inf in the target and none in the bench's run: its
    update of that step was skipped in the target alone."""
    return [node for node in ri.nodes if is_overflow_check(node.op) and _found_overflow(node, ri)]


def first_skipped_update(ri: RankInput) -> int | None:
    """The first step whose optimizer update the target's loss scaler alone skipped, or None."""
    return min((int(node.step) for node in _skipping_checks(ri)), default=None)


def follows_python(
    d: Divergence, python_from: int, exact_in: set[int], rank: int, skipped_update: int | None = None
) -> bool:
    """Whether root ``d`` is inherited through Python: it comes after a root's error was read into
    Python (op ``python_from``, an ``.item()`` of a tainted tensor) and
    is of a kind Python decides: in that step, or in a later one (a GradScaler that found the Inf
    a root made skips the optimizer step: the next step runs on parameters the bench moved and the
    target did not, and its optimizer with other arguments on other state). Python decides
    arguments and control flow, never an op's own arithmetic: a computation whose output is off by
    more than its inputs explain stays a root, unless its inputs agree bitwise (then what differs
    is what Python passed it). After a step whose update the target's scaler skipped
    (``skipped_update``), the next steps compute on parameters the bench moved and the target did
    not: every value there is another sample, and statistics bound no op's own error, so a
    computation root there is inherited too. NaN/Inf made from finite inputs stays a root, and so
    does a root its replay or self-check confirms (the caller's part)."""
    if d.op_id <= python_from or d.rank != rank or d.kind == "nan":
        return False
    if d.kind == "computation" and skipped_update is not None and d.step > skipped_update:
        return True
    return d.kind in _PYTHON_KINDS or (d.kind == "computation" and d.op_id in exact_in)


def scaler_skips(
    ri: RankInput,
    roots: list[tuple[Node, Divergence]],
    verdicts: dict[int, NodeVerdict],
    lookup: Callable[[int], TensorState | None],
    python_from: int | None,
) -> list[SkippedStep]:
    """Take out of ``roots`` the overflows a loss scaler caught, as the steps it skipped.

    A backward NaN/Inf root is caught when a later check of its step (:func:`is_overflow_check`)
    found NaN/Inf where the bench's found none, and the root is an overflow: its output holds Inf
    and no NaN (a fault, 0/0 or inf - inf makes NaN) of values beyond the largest finite value of
    the target's dtype (float16 gradients at a loss scale of 2**16). The bench's values show that
    where the root's inputs agree with the bench's within noise; where they carry a divergence from
    before, or follow a diverged value read into Python (``python_from``: a step the scaler skipped
    runs the next on parameters the bench moved), the target's own finite values must reach near
    that largest value. Loss scaling multiplies backward values only: an overflow in the forward
    pass is beyond any scale and stays a root.
    """
    checks = _skipping_checks(ri)
    if not checks:
        return []
    nan_roots = {d.op_id for _, d in roots if d.kind == "nan" and d.phase == "backward"}
    nodes = {node.op_id: node for node in ri.nodes if node.op_id in nan_roots}
    caught: dict[int, list[Divergence]] = defaultdict(list)
    kept = []
    for key, d in roots:
        check = next((c for c in checks if c[1] == d.step and c[0] > d.op_id), None) if d.op_id in nodes else None
        inherited = python_from is not None and d.op_id > python_from
        overflow = _overflow(nodes[d.op_id], ri, lookup, inherited) if check is not None else ""
        if check is None or not overflow:
            kept.append((key, d))
            continue
        reason = f"{overflow}; the loss scaler's check (op {check[0]}) caught it and skipped step {d.step}'s update"
        verdicts[d.op_id].root_kind = ""
        verdicts[d.op_id].reason = reason
        caught[check[0]].append(replace(d, reason=reason))
    roots[:] = kept
    return [
        SkippedStep(rank=ri.rank, step=int(c[1]), check_op_id=int(c[0]), overflows=tuple(caught[c[0]]))
        for c in checks
        if c[0] in caught
    ]


def _found_overflow(node: Node, ri: RankInput) -> bool:
    """A scaler's check whose ``found_inf`` (its last output) is set in the target and clear in the bench."""
    outputs = node.outputs
    found = ri.measured.get(outputs[-1]) if outputs else None
    return found is not None and found.numel == 1 and not found.exact and found.lo == found.hi == 0.0


_OVERFLOW_NEAR = 0.5  # inherited inputs: the largest finite values expected within this factor of the dtype's largest


def _overflow(node: Node, ri: RankInput, lookup: Callable[[int], TensorState | None], inherited: bool) -> str:
    """Why the first of the node's outputs that overflowed did ("" when none did), see :func:`scaler_skips`."""
    inherited = inherited or any(s is not None and s.tainted for s in map(lookup, node.inputs))
    for tid in node.outputs:
        s = ri.measured.get(tid)
        if s is None or not (s.nonfinite and s.nonfinite_mismatch) or tid not in ri.inf_only:
            continue
        dtype = ri.own.get(tid, (True, False, ""))[2]
        top, unit = _float_range(dtype)
        if not top:
            continue
        if not inherited:
            reach = max(abs(s.lo), abs(s.hi))
            if reach * (1.0 + unit) >= top:
                return f"{dtype} overflow: the bench reaches {reach:.3g}, beyond {dtype}'s largest {top:.6g}"
            continue
        # the largest of n values of this rms, if they were normal: their tail is where the Inf are
        reach = ri.inf_only[tid] * math.sqrt(2.0 * math.log(max(s.numel, 2)))
        if reach >= _OVERFLOW_NEAR * top:
            return (
                f"{dtype} overflow of inherited values: the target's own finite values (rms {ri.inf_only[tid]:.3g}) "
                f"reach near {dtype}'s largest {top:.6g}"
            )
    return ""


@lru_cache(maxsize=None)
def _float_range(dtype: str) -> tuple[float, float]:
    """(largest finite value, eps) of a floating dtype by name; (0, 0) for anything else."""
    import torch

    kind = getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(kind, torch.dtype) or not kind.is_floating_point:
        return 0.0, 0.0
    info = torch.finfo(kind)
    return float(info.max), float(info.eps)


def readout_status(input_status: str) -> str:
    """A readout's status from its input's: the same where judged, never a root of its own."""
    if input_status in ("agrees", "noise", "uncompared"):
        return input_status
    return "diverged" if input_status in ("diverged", "nan") else "uncompared"


def crossed_pairs(ri: RankInput) -> set[int]:
    """Paired target ops whose bench partner holds another value than theirs.

    Where two runs accumulate one sum in another order (autograd adds the gradients of a tensor
    used twice as its graph dictates, and a cast on one side changes the graph), alignment may
    pair a partial sum with the final one. A paired consumer then shows it: the bench op reads,
    at some argument, a tensor that is not the partner of what the target op reads there, but
    the output of a bench op paired with another target op. Both producers' outputs are measured
    against the wrong value (a bench-only op in between is another matter: see structure_note).
    """
    b2t = {b: t for t, b in ri.pairs.items()}
    producer: dict[int, int] = {}
    crossed: set[int] = set()
    for node in ri.nodes:
        op_id, kind, inputs, outputs = node.op_id, node.kind, node.inputs, node.outputs
        b_op = ri.pairs.get(op_id)
        if b_op is not None and kind == "op":
            b_inputs = ri.bench_inputs.get(b_op, [])
            for tid, b_tid in zip(inputs, b_inputs):
                tb = ri.view_base.get(tid, tid)
                partner = ri.partner.get(tb)
                if partner is None or partner == b_tid:
                    continue
                other = b2t.get(ri.bench_producer.get(b_tid, -1))
                mine = producer.get(tb)
                if other is not None and mine is not None and other != mine:
                    crossed.update((mine, other))
        for t in outputs:
            producer.setdefault(ri.view_base.get(t, t), op_id)
    return crossed
