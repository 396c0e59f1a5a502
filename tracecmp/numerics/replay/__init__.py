"""Replay: re-run each recorded op on its own recorded inputs in float64 and measure its own error.

With whole tensors in a trace (``data="tensors"``) every op's inputs are known exactly, so the op
can be run again on the CPU: in float64, as the *reference*, and in the dtypes it was recorded in,
as an *honest* implementation (the two-standard check of msprobe's run_ut pre-check; the FX
Numeric Suite's shadow mode has the same aim). How far the recorded output lies from the
reference is the op's *own* error, free of whatever its inputs inherited; how far the honest
replay lies from it is the error a correct kernel makes on these very inputs, sums that cancel
and low-precision dtypes included. A fault far smaller than the noise a device adds upstream (a
TF32 matmul before a GELU) thus still stands out at the op that made it. ``compare`` uses it next
to a bench; ``check`` judges a single run with it.

Errors are normwise: ``max(max|x - ref| / max|ref|, ||x - ref|| / ||ref||)`` over the op's worst
floating output. Positions where both hold the same NaN/Inf count as equal; a NaN/Inf on one side
only is an infinite error. With ``detail`` (what ``check`` asks for) an :class:`OwnError` also
counts those positions, and measures each element's error in units in the last place of the
recorded dtype at the reference's magnitude: the largest, and the share beyond a per-dtype bound.

A float32 matmul/conv that may have run at reduced precision (TF32, or bf16 under
``set_float32_matmul_precision("medium")``) is replayed with its inputs rounded to nearest and
toward zero, and in plain float32; ``OwnError.fits`` says how far the recorded output lies from
each rounded replay in float32 accumulation errors, so that the caller can learn which rounding
the run used from its other calls and hold each call to it.

Views carry no data of their own and are recomputed from their base by replaying the view op.
Ops that are not replayed come back as :class:`Skipped` with the reason (:func:`replay_ops`):
random ops that drew numbers (they would draw others; ``dropout_p=0.0`` draws none), uninitialized allocations, collectives (they need the
other ranks), operators this torch does not have or cannot run on the CPU (device-only custom ops;
:func:`register_reference` gives one a CPU reference), ops whose arguments the trace could not
record (opaque objects), ops whose inputs were not saved, and ops that refuse float64: the caller
treats those as "not replayed", never as "correct".

Scale. Replay streams in execution order: an op's inputs are read from the trace when it needs
them (``trace.saved`` reads exactly their bytes) and dropped again, with a small cache of recent
values (the next op usually reads what the last one wrote; it makes room for a large op), so
memory is bounded by the largest op, not by the trace. Within an op it stays near the op's own
recorded values: a ``_foreach_*`` or fused optimizer op over a model's every parameter is replayed
one list element at a time; a pointwise call over many elements (Adam's steps on a 38.6M-element
embedding) gets its float64 reference in pieces, whose elements take the kernel paths they take
in a whole call; every large output is measured piece by piece; float64 copies of inputs an op
does not return are dropped as soon as it ran. The honest replay always runs whole. After a
large op, memory the C heap keeps is handed back. :func:`replay_ops` can spread the ops over
worker processes, each opening the trace itself.

>>> own = replay_rank(tracecmp.load("runs/target").rank(0))   # doctest: +SKIP
>>> own[42].error, own[42].honest                            # doctest: +SKIP
(1.0e-06, 3.1e-08)
"""

from __future__ import annotations

from tracecmp.numerics.replay.calls import register_reference, static_skip_reason
from tracecmp.numerics.replay.records import ELEMENT_ULPS, OwnError, RecordedOp, Skipped, iter_ops
from tracecmp.numerics.replay.regions import RegionReplay, replay_regions
from tracecmp.numerics.replay.replayer import Replayer
from tracecmp.numerics.replay.workers import auto_workers, replay_ops, replay_rank, run_in_workers

__all__ = [
    "ELEMENT_ULPS",
    "OwnError",
    "RecordedOp",
    "RegionReplay",
    "Replayer",
    "Skipped",
    "auto_workers",
    "iter_ops",
    "register_reference",
    "replay_ops",
    "replay_rank",
    "replay_regions",
    "run_in_workers",
    "static_skip_reason",
]
