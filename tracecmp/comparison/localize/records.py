"""What localize reads and writes: a rank's nodes and tensor states in (:class:`RankInput`), a
verdict per node out (:class:`NodeVerdict`), and the judged form of a node between the stages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple

from tracecmp.aten.opclass import OpClass
from tracecmp.comparison.tolerances import Tolerances
from tracecmp.graph.checks import OwnCheck
from tracecmp.graph.nodes import Node, TensorState
from tracecmp.numerics.fits import ModelFit
from tracecmp.numerics.replay import OwnError, RegionReplay
from tracecmp.verdict.records import Region

PROGRESS_EVERY = 10_000


CAP = 1e6  # largest amplification any op is credited with; beyond that a node is simply not judged


@dataclass
class NodeVerdict:
    """Localization's findings for one target node (a row of ``CompareResult.nodes``)."""

    op_id: int
    status: str = "uncompared"
    error: float = math.nan  # output error in rounding units
    introduced: float = math.nan  # error beyond what the inputs explain, rounding units
    metric: str = ""
    root_kind: str = ""
    reason: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    region: int | None = None  # the region (RankInput.regions) the node belongs to


@dataclass
class RankInput:
    """Everything localization needs about one rank, already aligned and measured."""

    rank: int
    nodes: list[Node]  # the target's nodes in execution order
    pairs: Mapping[int, int]  # target op_id -> bench op_id
    measured: Mapping[int, TensorState]  # target tensor id -> measured state (partner found, stats on both sides)
    own: Mapping[int, tuple[bool, bool, str]]  # target tensor id -> (is_float, nonfinite, dtype) from the target alone
    view_base: Mapping[int, int]
    bench_args: Mapping[int, str]
    first_step: int = 0
    own_errors: Mapping[int, OwnError] = field(default_factory=dict)  # target op_id -> replay (numerics.replay)
    reduced_precision: str | None = None  # "tf32"/"bf16": float32 matmul/conv may run at it (numerics.replay)
    # Regions (tracecmp.comparison.align.find_regions): judged at their boundary, see judge_region.
    regions: Mapping[int, Region] = field(default_factory=dict)  # region id -> region
    member_of: Mapping[int, int] = field(default_factory=dict)  # target op id -> region id
    bench_only: Mapping[tuple[int, int], int] = field(
        default_factory=dict
    )  # (target op, input position) -> bench-only region
    # (side "t"/"b", op id) -> (kind, op, args, inputs, outputs) of every region member
    region_ops: Mapping[tuple[str, int], tuple[str, str, str, list[int], list[int]]] = field(default_factory=dict)
    # (side, tensor id) -> the recorded magnitudes (no error) of each tensor region members read or made
    region_values: Mapping[tuple[str, int], TensorState] = field(default_factory=dict)
    region_replays: Mapping[int, RegionReplay] = field(
        default_factory=dict
    )  # region id -> its replay (numerics.replay)
    # Ops judged for a compiled unit as a whole (comparison/compiled/): op id -> its Unit, whose
    # decide() replaces the rules below for them.
    units: Mapping[int, Any] = field(default_factory=dict)
    # For pairs whose bench partner holds another value (see crossed_pairs):
    bench_inputs: Mapping[int, list[int]] = field(default_factory=dict)  # bench op_id -> input tensor ids (view bases)
    bench_producer: Mapping[int, int] = field(default_factory=dict)  # bench tensor id -> producer op_id
    partner: Mapping[int, int] = field(default_factory=dict)  # target tensor id -> bench tensor id
    # Target tensors holding Inf and no NaN (what overflow makes) -> the rms of their finite values
    inf_only: Mapping[int, float] = field(default_factory=dict)
    # Sources holding a value the trace already made (a tensor made outside the dispatcher over a
    # traced tensor's memory): source op id -> that tensor's id, judged as a copy of it
    reentered: Mapping[int, int] = field(default_factory=dict)
    # Outputs of paired ops that neither trace holds statistics of: unknown, but no reason to call
    # their op uncompared when its other outputs are measured
    unrecorded: frozenset[int] = frozenset()
    # The target's self-checks at capture (graph.checks): op id -> its worst output's check
    own_checks: Mapping[int, OwnCheck] = field(default_factory=dict)


@dataclass
class JudgedNode:
    """Pass-1 numbers for one node, kept for the ambient calibration and the verdict."""

    index: int
    op_id: int
    group: tuple[str, str]
    cls: OpClass
    judgeable: bool
    inputs_exact: bool
    outputs_exact: bool
    e: tuple[float, float, float]
    x: tuple[float, float, float]
    f1: tuple[float, float, float]
    lam: float
    uses_tf32: bool
    same_dtype: bool
    nontrivial: bool  # some float output is not all zeros
    kappa_local: float  # condition factor of the op's own rounding (sums whose terms cancel)
    # Outputs with a role of their own (a normalization's input gradient, its weight and bias
    # gradients ...): (role, e, x, f1) each, judged against the same output of the op's other calls.
    parts: tuple[
        tuple[str, tuple[float, float, float], tuple[float, float, float], tuple[float, float, float]], ...
    ] = ()


@dataclass(frozen=True)
class RankContext:
    """What deciding any of a rank's nodes needs besides the node: its regime and calibration,
    found once per rank after pass 1."""

    ri: RankInput
    tol: Tolerances
    bitwise: bool  # the rank reproduces ops bitwise where their inputs agree
    exact_matmul: bool  # a matmul/conv gave identical outputs: the target does not run them at TF32
    ambient: Mapping[Any, tuple[tuple[float, ...], ...]]  # group key -> ambient noise (calibrate.ambient_noise)
    exact_mode: bool
    lookup: Callable[[int], TensorState | None]  # tensor id -> its state, through its view base
    channels: tuple[str, ...]
    fits: Mapping[str, ModelFit]  # op -> the reduced-precision rounding that reproduces its calls
    bounds_hold: bool = False  # the rank's reduced-precision calls lie within the accumulation bound
    tf32_spread: tuple[float, ...] | None = None  # per channel, how far its TF32 calls stray (calibrate)
    # op -> (the calls that speak for its replay giving it bit for bit, whether they are its own)
    bitwise_ops: Mapping[str, tuple[int, bool]] | None = None
    # Copies that carry a collective's data (decide.collective_moves): judged as data movement
    collective_moves: frozenset[int] = frozenset()


def metric_dict(j: JudgedNode, part: int = -1) -> dict[str, float]:
    """The root's errors and their predictions per channel: those of ``j.parts[part]``, the output
    that decided, where the op's outputs have roles (a layer norm backward's input gradient, not
    the weight gradient that strays furthest on its own)."""
    names = ("ext", "sys", "rms")
    out: dict[str, float] = {}
    _, es, xs, _ = j.parts[part] if part >= 0 else ("", j.e, j.x, j.f1)
    for name, e, x in zip(names, es, xs):
        if math.isnan(e):
            continue
        out[f"rel_err_{name}"] = float(e)
        if math.isfinite(x):
            out[f"expected_{name}"] = float(x)
    return out


class Decision(NamedTuple):
    """What :func:`decide_node` found for one node."""

    root_kind: str  # '' when not a root
    reason: str
    metric: str  # the deciding metric's name
    part: int  # the output that decided, as an index into JudgedNode.parts (-1: outputs without roles)
    replayed: bool = False  # a replay on the op's own recorded inputs confirms it as a root
