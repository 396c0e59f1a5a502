"""The records replay passes around: ops as recorded (ids and arguments, no tensors), calls,
and what a replay found (:class:`OwnError`, :class:`Skipped`).

>>> Skipped(7, "random op: a replay would draw other numbers").data_missing
False
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from tracecmp.aten.opclass import draws_random
from tracecmp.trace import boundedjson

# Per-element bound of ``OwnError.beyond``: units in the last place (ulp) of the recorded dtype.
ELEMENT_ULPS: dict[str, float] = {"float64": 4.0, "float32": 4.0, "bfloat16": 1.0, "float16": 1.0}


@dataclass(frozen=True, slots=True)
class OwnError:
    """An op's own error: its recorded outputs against a float64 replay of its recorded inputs."""

    op_id: int
    error: float  # the recorded output's relative error against the float64 replay (see above)
    # The same for a replay on this CPU in the recorded dtypes: an honest kernel's error (at
    # reduced precision, the larger of rounding to nearest and toward zero).
    honest: float
    dtype: str  # dtype of the output that decided it
    # An IEEE 754 basic operation (one correctly rounded +, -, *, / per element) whose recorded
    # bits differ from the honest replay's: every conforming device gives the replay's bits.
    misrounded: bool = False
    # A float32 matmul/conv replayed at reduced precision: per way of rounding the inputs
    # (REDUCED_MODELS), how far the recorded output lies from that replay, in units of the
    # accumulation error a plain float32 replay makes (at least one float32 rounding unit); the
    # worst output decides. Near 1 where that model is what the run computed.
    fits: tuple[float, ...] = ()
    # The same per rounding model, then for float32 itself, elementwise in units of the bound on
    # what accumulating this call's products in float32 can add (see _accumulation_bound): at most
    # 1 where the recorded output is a float32 sum of those products in any order, whatever the
    # device. Only for ops whose outputs are sums of products (matmul, conv).
    bounds: tuple[float, ...] = ()
    # Every recorded output equals the replay in its recorded dtypes bit for bit (at reduced
    # precision: one of the roundings' replays): where a run's calls of an op all do, the device
    # computes that op as this CPU does (see localize).
    bitwise: bool = False
    # The honest replay rounds something (not a copy, a max, or one correctly rounded IEEE
    # operation, which every device gives bit for bit): its bits say how the device computes.
    informative: bool = False
    # With ``detail`` only (else 0), over every checked output:
    nonfinite: int = 0  # positions where the recorded output holds NaN/Inf the reference does not (or the reverse)
    honest_nonfinite: int = 0  # the same for the honest replay
    max_ulps: float = 0.0  # the largest element error, in ulp of the recorded dtype at the reference's magnitude
    honest_max_ulps: float = 0.0
    beyond: float = 0.0  # share of finite elements more than ELEMENT_ULPS[dtype] ulp from the reference
    honest_beyond: float = 0.0
    elements: int = 0  # elements measured
    integer_mismatch: int = 0  # elements of integer/bool outputs that differ from the honest replay


@dataclass(frozen=True, slots=True)
class Skipped:
    """An op that was not replayed, and why (never to be read as "correct")."""

    op_id: int
    reason: str
    data_missing: bool = False  # the trace did not save its inputs or outputs (statistics may still judge it)


@dataclass(slots=True)
class RecordedOp:
    """One node of the trace as replay sees it: ids and the recorded arguments, no tensors."""

    op_id: int
    kind: str
    name: str
    args: str
    inputs: list[int]
    outputs: list[int]
    random: bool
    parsed: Any = None  # ``args`` decoded, on first use (None: not yet; False: not a JSON object)

    def arguments(self) -> dict[str, Any] | None:
        """The recorded non-tensor arguments as a dict, or None when they are not readable."""
        if self.parsed is None:
            try:
                value = boundedjson.loads(self.args, max_bytes=boundedjson.ARGS_MAX_BYTES)
            except ValueError:
                value = None
            self.parsed = value if isinstance(value, dict) else False
        return self.parsed if self.parsed is not False else None

    def draws(self) -> bool:
        """Whether this call drew random numbers (``dropout_p=0.0`` draws none), see
        :func:`tracecmp.aten.opclass.draws_random`."""
        return self.random and draws_random(self.name, self.arguments())


@dataclass(frozen=True, slots=True)
class Call:
    """One call to replay: an op, or one list element of a ``_foreach_*`` op."""

    op: RecordedOp
    args: dict[str, Any]  # recorded arguments, tensors as {"tensor": i} into ``inputs``
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]


def iter_ops(rank: Any, op_ids: Iterable[int] | None = None) -> Iterator[RecordedOp]:
    """The recorded ops of a rank as :class:`RecordedOp` records, in execution order."""
    table = rank.ops_table.select(["op_id", "kind", "op", "args", "inputs", "outputs", "random"]).to_pydict()
    wanted = None if op_ids is None else set(op_ids)
    for o, k, n, a, i, out, r in zip(
        table["op_id"], table["kind"], table["op"], table["args"], table["inputs"], table["outputs"], table["random"]
    ):
        if wanted is None or o in wanted:
            yield RecordedOp(o, k, n, a or "{}", list(i or ()), list(out or ()), bool(r))
