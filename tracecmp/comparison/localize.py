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

import copy
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field, replace
from functools import cache, lru_cache
from typing import Any, Callable, Iterable, Mapping, NamedTuple

import numpy as np

from tracecmp.aten.opclass import (
    OpClass,
    base_name,
    classify,
    for_call,
    given_nonfinite,
    is_copy,
    is_overflow_check,
    is_readout,
    read_by,
    takes_call_args,
)
from tracecmp.comparison.adam import ADAM_UPDATES, adam_update_bound
from tracecmp.comparison.metrics import FILLS
from tracecmp.comparison.tolerances import Tolerances
from tracecmp.numerics.fits import FIT_MEMBERS, ModelFit, model_fits, quantile75
from tracecmp.numerics.replay import OwnError, RegionReplay
from tracecmp.numerics.rounding import REDUCED_MODELS
from tracecmp.numerics.units import EPS, REDUCED_EPS, TF32_EPS
from tracecmp.trace import boundedjson
from tracecmp.trace.schema import UNREAD_SOURCE
from tracecmp.verdict.records import Divergence, Drift, Region, SkippedStep

_LINEAR_UNARY = {"mul", "mul_", "div", "div_", "true_divide", "neg", "neg_"}
_PROGRESS_EVERY = 10_000
CAP = 1e6  # largest amplification any op is credited with; beyond that a node is simply not judged
_TINY = 1e-300
_FP32 = EPS["float32"]
# Non-tensor arguments that legitimately differ between a target and a bench run.
_IGNORED_ARGS = {"dtype", "device", "layout", "pin_memory", "memory_format", "non_blocking", "copy",
                 "requires_grad", "stride", "size_hint", "generator", "out_dtype", "cudnn_enabled", "benchmark",
                 "deterministic", "allow_tf32", "grad_input_mask"}
_DTYPE_WORDS = {"float16", "float32", "float64", "bfloat16", "half", "float", "double", "int64", "int32", "bool",
                "uint8", "int8", "int16", "complex64", "complex128", "cpu", "cuda", "npu", "xpu", "mps", "meta"}


@dataclass(slots=True)
class TensorState:
    """What localization knows about one target tensor's error (views resolve to their base)."""

    known: bool  # compared against a bench tensor (or estimated from known inputs)
    exact: bool  # bitwise identical to its partner
    e_ext: float = 0.0
    e_sys: float = 0.0
    e_rms: float = math.nan  # only with whole tensors
    amax: float = 0.0
    rms: float = 0.0
    numel: int = 0
    lo: float = 0.0  # bench min/max/mean, for inverse and normalization factors
    hi: float = 0.0
    mean: float = 0.0
    nonfinite: bool = False  # the target tensor itself holds NaN/Inf
    is_float: bool = True
    uninit: bool = False  # uninitialized memory: never an input's error
    measured: bool = False
    nonfinite_mismatch: bool = False
    unit: float = 0.0
    same_dtype: bool = True
    tainted: bool = False  # carries error from a root
    # Its NaN/Inf differ from the bench's only where the program handed an op a NaN/Inf (a causal
    # mask of -inf against the bench's finfo.min): given, not computed.
    given: bool = False
    # A mask each run filled with its own dtype's finfo.min or max (metrics.FILLS): its magnitudes
    # are the fill's, its errors those of its finite elements (see _at_finite_scale).
    filled: bool = False

    # Error carried on to consumers: the measurement, raised towards what the inputs predicted when a
    # measurement came out lucky (statistics are single samples of a random error), see _carry.
    c_ext: float = -1.0
    c_sys: float = -1.0
    c_rms: float = -1.0

    def __post_init__(self) -> None:
        if self.c_ext < 0:
            self.c_ext, self.c_sys, self.c_rms = self.e_ext, self.e_sys, self.e_rms

    @property
    def spread(self) -> float:
        """How far the values lie around their tensor-wide mean: sqrt(rms^2 - mean^2)."""
        return math.sqrt(max(self.rms * self.rms - self.mean * self.mean, 0.0))

    @property
    def mix_level(self) -> float:
        """Rms-relative error estimate for ops that mix many elements: the error at the extremes,
        converted half-way (geometric mean) between "proportional to magnitude" and "uniform"."""
        ext_as_rms = self.c_ext * math.sqrt(self.amax / self.rms) if self.rms > 0 else self.c_ext
        return max(ext_as_rms, self.c_sys, 0.0 if math.isnan(self.c_rms) else self.c_rms)

    @property
    def level(self) -> float:
        """Rms-relative error estimate (conservative): the largest of what the statistics show."""
        ext_as_rms = self.c_ext * self.amax / self.rms if self.rms > 0 else self.c_ext
        return max(ext_as_rms, self.c_sys, 0.0 if math.isnan(self.c_rms) else self.c_rms)


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
    nodes: list[tuple]  # (op_id, step, phase, kind, op, name, module, location, args, inputs, outputs, random, stack)
    pairs: Mapping[int, int]  # target op_id -> bench op_id
    measured: Mapping[int, TensorState]  # target tensor id -> measured state (partner found, stats on both sides)
    own: Mapping[int, tuple[bool, bool, str]]  # target tensor id -> (is_float, nonfinite, dtype) from the target alone
    view_base: Mapping[int, int]
    bench_args: Mapping[int, str]
    first_step: int = 0
    own_errors: Mapping[int, OwnError] = field(default_factory=dict)  # target op_id -> replay (numerics.replay)
    reduced_precision: str | None = None  # "tf32"/"bf16": float32 matmul/conv may run at it (numerics.replay)
    # Regions (tracecmp.comparison.align.find_regions): judged at their boundary, see _judge_region.
    regions: Mapping[int, Region] = field(default_factory=dict)  # region id -> region
    member_of: Mapping[int, int] = field(default_factory=dict)  # target op id -> region id
    bench_only: Mapping[tuple[int, int], int] = field(default_factory=dict)  # (target op, input position) -> bench-only region
    # (side "t"/"b", op id) -> (kind, op, args, inputs, outputs) of every region member
    region_ops: Mapping[tuple[str, int], tuple[str, str, str, list[int], list[int]]] = field(default_factory=dict)
    # (side, tensor id) -> the recorded magnitudes (no error) of each tensor region members read or made
    region_values: Mapping[tuple[str, int], TensorState] = field(default_factory=dict)
    region_replays: Mapping[int, RegionReplay] = field(default_factory=dict)  # region id -> its replay (numerics.replay)
    # Ops judged for a compiled unit as a whole (comparison/compiled.py): op id -> its Unit, whose
    # decide() replaces the rules below for them.
    units: Mapping[int, Any] = field(default_factory=dict)
    # For pairs whose bench partner holds another value (see _crossed_pairs):
    bench_inputs: Mapping[int, list[int]] = field(default_factory=dict)  # bench op_id -> input tensor ids (view bases)
    bench_producer: Mapping[int, int] = field(default_factory=dict)  # bench tensor id -> producer op_id
    partner: Mapping[int, int] = field(default_factory=dict)  # target tensor id -> bench tensor id
    # Target tensors holding Inf and no NaN (what overflow makes) -> the rms of their finite values
    inf_only: Mapping[int, float] = field(default_factory=dict)


def _norm_args(text: str) -> Any:
    """Parsed non-tensor arguments with device/dtype-like entries removed, for comparison."""
    if not text:
        return None
    try:
        value = boundedjson.loads(text, max_bytes=boundedjson.ARGS_MAX_BYTES)
    except (TypeError, ValueError):
        return text

    def clean(v: Any) -> Any:
        if isinstance(v, dict):
            if set(v) == {"tensor"}:
                return "<tensor>"
            return {k: clean(x) for k, x in sorted(v.items()) if k not in _IGNORED_ARGS}
        if isinstance(v, list):
            return [clean(x) for x in v]
        if isinstance(v, str):
            word = v.removeprefix("torch.").split(":")[0]
            return "<device/dtype>" if word in _DTYPE_WORDS else v
        if isinstance(v, float):
            return float(f"{v:.9g}") if math.isfinite(v) else str(v)
        return v

    return clean(value)


def _for_call(cls: OpClass, op: str, args: str) -> OpClass:
    """``cls`` with the input rules this call's recorded arguments decide (:func:`for_call`)."""
    try:
        parsed = boundedjson.loads(args, max_bytes=boundedjson.ARGS_MAX_BYTES)
    except (TypeError, ValueError):
        return cls
    return for_call(cls, op, parsed) if isinstance(parsed, dict) else cls


@lru_cache(maxsize=1024)
def _schema_defaults(op: str) -> dict[str, Any]:
    """Default values of an aten overload's non-tensor arguments, from torch's schema (empty if unknown)."""
    parts = op.split(".")
    if len(parts) != 3 or parts[0] != "aten":
        return {}
    try:
        import torch

        schema = getattr(getattr(torch.ops.aten, parts[1]), parts[2])._schema
    except (AttributeError, RuntimeError, ImportError):
        return {}
    defaults: dict[str, Any] = {}
    for arg in schema.arguments:
        if arg.has_default_value():
            value = arg.default_value
            if value is None or isinstance(value, (bool, int, float, str)):
                defaults[arg.name] = float(f"{value:.9g}") if isinstance(value, float) else value
            elif isinstance(value, (list, tuple)) and all(isinstance(v, (bool, int, float)) for v in value):
                defaults[arg.name] = list(value)
    return defaults


@lru_cache(maxsize=1)
def _dtype_constants() -> dict[float, frozenset[str]]:
    """Values that are a property of a floating dtype (``torch.finfo``: min, max, eps, tiny and the
    smallest subnormal of float16, bfloat16, float32, float64), as :func:`_norm_args` writes them,
    to the properties they are.

    A program that fills a mask with ``torch.finfo(x.dtype).min`` or guards a division with
    ``finfo(dtype).eps`` passes its own dtype's value: in a bf16 run another number than in an
    fp32 run, yet the same argument. (``resolution``, a round power of ten, and the float8 types'
    small round numbers are left out: they are also the values people write by hand.)
    """
    import torch

    table: dict[float, set[str]] = defaultdict(set)
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        info = torch.finfo(dtype)
        for name, value in (("max", info.max), ("eps", info.eps), ("tiny", info.tiny), ("subnormal", info.tiny * info.eps)):
            table[float(f"{value:.9g}")].add(name)
            table[float(f"{-value:.9g}")].add("-" + name)
    return {value: frozenset(names) for value, names in table.items()}


def _same_argument(x: Any, y: Any) -> bool:
    """Equal, or the same dtype property (``finfo(dtype).min`` and the like) of each run's own dtype."""
    if x == y:
        return True
    if isinstance(x, float) and isinstance(y, float):
        constants = _dtype_constants()
        return bool(constants.get(x, frozenset()) & constants.get(y, frozenset()))
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(_same_argument(a, b) for a, b in zip(x, y))
    if isinstance(x, dict) and isinstance(y, dict):
        return set(x) == set(y) and all(_same_argument(x[k], y[k]) for k in x)
    return False


def _dtype_constant_args(t_args: str, b_args: str) -> bool:
    """The arguments differ only by properties of each run's own dtype (see :func:`_same_argument`)."""
    if t_args == b_args or not b_args:
        return False
    a, b = _norm_args(t_args), _norm_args(b_args)
    return a != b and _same_argument(a, b)


def _constant_pairs(x: Any, y: Any) -> Iterable[tuple[float, float]]:
    """The (target, bench) pairs of unequal floats in two argument structures of one shape."""
    if isinstance(x, float) and isinstance(y, float):
        if x != y:
            yield x, y
    elif isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
        for a, b in zip(x, y):
            yield from _constant_pairs(a, b)
    elif isinstance(x, dict) and isinstance(y, dict):
        for key in x.keys() & y.keys():
            yield from _constant_pairs(x[key], y[key])


def _constant_shift(cls: OpClass, t_args: str, b_args: str, out: TensorState, ins: list[tuple[int, TensorState]],
                    rstd: TensorState | None) -> tuple[float, float, float]:
    """Error (ext, sys, rms channels) the output shows because each run took its own dtype's constant.

    ``finfo(dtype).eps`` added to a norm, ``finfo(dtype).min`` filling a mask: the same argument,
    yet other numbers (bf16's eps is 0.0078, float32's 1.2e-7), so the output may move by up to
    their difference: as an absolute shift (a sum, a clamp, a fill), a relative one (a product
    or quotient), or through a normalization's variance (its epsilon). Zero when the arguments
    are equal or differ otherwise (then the difference is an argument root).
    """
    if not b_args or t_args == b_args or not _dtype_constant_args(t_args, b_args):
        return 0.0, 0.0, 0.0
    amax_o, rms_o = max(out.amax, _TINY), max(out.rms, _TINY)
    ext = sys_ = env = 0.0
    for a, b in _constant_pairs(_norm_args(t_args), _norm_args(b_args)):
        if _is_fill(a) and _is_fill(b):
            continue  # a mask's fill: the comparison takes the two as equal (metrics.FILLS)
        shift = abs(a - b)
        if cls.kind == "normalize":
            # 1/sqrt(var + eps): relative error up to half the shift over the variance
            x = ins[0][1] if ins else None
            var = 1.0 / rstd.rms ** 2 if rstd is not None and rstd.rms > 0 else (
                x.spread ** 2 if x is not None else 0.0)
            rel = min(CAP, 0.5 * shift / max(var, _TINY))
            ext, sys_, env = ext + rel, sys_ + rel, env + rel
        elif cls.kind in ("product", "exp", "other"):
            rel = min(CAP, shift / max(min(abs(a), abs(b)), _TINY))
            ext, sys_, env = ext + rel, sys_ + rel, env + rel
        else:
            ext, sys_, env = ext + shift / amax_o, sys_ + shift / rms_o, env + shift / rms_o
    return ext, sys_, env


def _is_fill(value: float) -> bool:
    """``finfo(dtype).min`` or ``max`` of bfloat16, float32 or float64, as arguments record it."""
    return any(abs(value) == float(f"{fill:.9g}") or abs(value) == fill for fill in FILLS)


def _arg_difference(t_args: str, b_args: str, op: str = "") -> str:
    """Empty when the arguments agree, else a short description of the first difference.

    An argument passed explicitly with its default value equals one left out (``alpha=1``), and
    a property of each run's own dtype equals its counterpart (``finfo(bfloat16).min`` against
    ``finfo(float32).min``).

    >>> _arg_difference('{"value": -3.3895313892515355e+38}', '{"value": -3.4028234663852886e+38}')
    ''
    >>> _arg_difference('{"eps": 1e-05}', '{"eps": 1e-06}')
    'eps=1e-05 vs 1e-06'
    """
    if t_args == b_args:
        return ""
    a, b = _norm_args(t_args), _norm_args(b_args)
    if a == b:
        return ""
    if isinstance(a, dict) and isinstance(b, dict):
        defaults = _schema_defaults(op)
        for key, value in defaults.items():
            a.setdefault(key, value)
            b.setdefault(key, value)
        for key in set(a) & set(b):
            # A Python number passed as is on one side and wrapped in a 0-dim tensor on the other
            # (eager wraps ``0.5 * x``'s 0.5, a compiled graph keeps it): its value is compared as
            # that input's, not here.
            if {type(a[key]), type(b[key])} & {int, float} and "<tensor>" in (a[key], b[key]):
                a[key] = b[key] = "<tensor>"
        if _same_argument(a, b):
            return ""
        for key in sorted(set(a) | set(b)):
            if not _same_argument(a.get(key), b.get(key)):
                return f"{key}={a.get(key)!r} vs {b.get(key)!r}"
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        if _same_argument(a, b):
            return ""
        for index, (x, y) in enumerate(zip(a, b)):
            if not _same_argument(x, y):
                return f"argument {index}: {x!r} vs {y!r}"
    return f"{t_args} vs {b_args}"


def _inverse_factor(s: TensorState) -> float:
    """max|x| / min|x| of the bench values (CAP when they cross zero): how 1/x amplifies relative error."""
    if s.lo <= 0.0 <= s.hi:
        return CAP
    small = min(abs(s.lo), abs(s.hi))
    return min(CAP, max(1.0, max(abs(s.lo), abs(s.hi)) / max(small, _TINY)))


def _norm_condition(x: TensorState, rstd: TensorState | None) -> float:
    """How much normalizing ``x`` amplifies its relative error: rms(x) over the spread it is divided
    by. The op's own inverse-spread output gives that spread row by row (rms(x) * rms(rstd)); the
    tensor-wide mean gives it only where every row has the same mean (rms(x) / std(x))."""
    kappa = x.rms / max(x.spread, _TINY)
    if rstd is not None and rstd.measured and rstd.rms > 0:
        kappa = max(kappa, x.rms * rstd.rms)
    return min(CAP, max(1.0, kappa))


def _normalize_expected(cls: OpClass, role: str, ins: list[tuple[int, TensorState]], out: TensorState,
                        rstd: TensorState | None) -> tuple[float, float, float, float]:
    """The prediction (ext, sys, rms channels, and the sys channel's random envelope before
    averaging) for one output of a normalization op (see ``_NORM_OUTPUTS`` in opclass).

    * ``out``/``grad``: the normalized tensor (a forward op's input 0 is divided by its own spread,
      so a scale of it does not reach the norm and mean) or the input's gradient;
    * ``mean``: a mean over each row of input 0, moving with its mean and up to its largest error;
    * ``rstd``, ``running``: one over the spread of each row: relative error as the normalized
      tensor's, a scale of the input included;
    * ``reduced``: the weight's or bias's gradient, a sum over the rows of the incoming gradient
      (times the normalized input): terms that cancel amplify their relative error.
    """
    amax_o, rms_o = max(out.amax, _TINY), max(out.rms, _TINY)
    forward = cls.input_rule(0) == "normalized"  # forward ops mark input 0 as normalized
    ext = sys_ = env = env_sys = 0.0
    grad = next((s for pos, s in ins if pos == 0), None)
    x_state = next((s for pos, s in ins if pos == (0 if forward else 1)), None)
    kappa_x = _norm_condition(x_state, rstd) if x_state is not None else 1.0
    for pos, s in ins:
        mix, lvl, c_sys = s.mix_level, s.level, s.c_sys
        abs_err, env_before = lvl * s.rms, env
        if cls.input_rule(pos) == "centre" and x_state is not None:
            # The saved mean is subtracted: its absolute error moves x - mean over x's spread,
            # however large it is against the mean itself (a mean near 0).
            to_normalized = s.rms / max(x_state.spread, _TINY)
            mix, lvl, c_sys = mix * to_normalized, lvl * to_normalized, c_sys * to_normalized
        if role == "mean":
            if pos != 0:
                continue  # a row's mean depends on the input alone
            k = max(s.numel / max(out.numel, 1), 1.0)
            kappa = min(CAP, max(1.0, s.rms / (math.sqrt(k) * rms_o)))
            ext += max(kappa * mix, abs_err / amax_o)
            sys_ += max(kappa * s.c_sys, s.c_sys * s.rms / rms_o)
            env += max(kappa * mix, abs_err / rms_o)
        elif role == "reduced" and grad is not None:
            # sum over k rows of grad * normalized input: each term's relative error is the
            # gradient's plus the normalized input's (kappa_x times the input's own).
            k = max(grad.numel / max(out.numel, 1), 1.0)
            kappa = min(CAP, max(1.0, math.sqrt(k) * grad.rms / rms_o))
            own = kappa_x if pos == 1 else 1.0
            ext += kappa * own * mix
            sys_ += max(kappa * own * c_sys, own * c_sys)
            env += kappa * own * mix
        else:
            if pos == 0 or (not forward and pos == 1):
                kappa = 2.0 * (kappa_x if s is x_state else _norm_condition(s, None))
            else:
                kappa = 2.0  # weight, bias, saved statistics: relative error carries over
            ext += kappa * mix
            scale_free = forward and pos == 0 and role in ("", "out")
            sys_ += 0.0 if scale_free else kappa * c_sys
            env += kappa * mix
        if lvl > 0:  # the norm/mean channel's random envelope, from the typical error level
            env_sys += (env - env_before) * min(1.0, mix / lvl)
    return ext, sys_, env, env_sys


def _expected(cls: OpClass, name: str, ins: list[tuple[int, TensorState]], out: TensorState, role: str = "",
              rstd: TensorState | None = None) -> tuple[float, float, float]:
    """Error (ext, sys, rms channels) the output would show if the op were exact and only inputs were off.

    ``role`` is what the output is among the op's outputs (normalization ops), ``rstd`` the
    inverse spread a normalization op reported alongside (its condition, row by row).
    """
    if cls.kind == "normalize":
        ext, sys_, env, env_sys = _normalize_expected(cls, role, ins, out, rstd)
        neff = max(out.numel * (out.rms / out.amax) ** 2, 1.0) if out.amax > 0 else 1.0
        return ext, sys_ + env_sys / math.sqrt(neff), env
    amax_o, rms_o = max(out.amax, _TINY), max(out.rms, _TINY)
    neff = max(out.numel * (out.rms / out.amax) ** 2, 1.0) if out.amax > 0 else 1.0
    ext = sys_ = env = 0.0
    kind = cls.kind
    contract_pair: set[int] = set()
    kappa_contract = 1.0
    if kind == "contract":
        floats = _operands(cls, ins)
        contract_pair = {pos for pos, _ in floats}
        # Attention's three or more operands add their relative errors: no two of them are A and B.
        if len(floats) == 2 and out.numel > 0:
            (_, a), (_, b) = floats
            k = math.sqrt(max(a.numel * b.numel / out.numel, 1.0))
            kappa_contract = min(CAP, max(1.0, math.sqrt(k) * a.rms * b.rms / rms_o))
    # The output's extremes come from the same elements of its single full-size input (a unary
    # op): relative error there carries over as such, not as the tensor-wide level.
    full = [pos for pos, s in ins if s.numel == out.numel and s.numel > 1]
    unary = len(full) == 1
    # A linear map of one tensor (x * c, -x, a copy) moves its norm and mean exactly as the input's
    # moved: no fresh random realization to allow for in the norm/mean channel.
    linear = unary and (name in _LINEAR_UNARY or is_copy(name)) and all(s.numel == 1 for p, s in ins if p not in full)
    env_sys = 0.0
    for pos, s in ins:
        rule = cls.input_rule(pos)
        if rule == "ignore":
            continue
        lvl = s.level
        abs_err = lvl * s.rms
        env_before = env
        if rule == "add":
            ext += s.c_ext * s.amax / amax_o
            sys_ += s.c_sys * s.rms / rms_o
            env += abs_err / rms_o
        elif rule == "selector":
            # Only elements whose sign the error flips change: a fraction ~ the relative error
            # (Gaussian-like values: 0.8 x), each moving the norm and mean by about its own size.
            ext += 1.0 if not s.exact else 0.0
            sys_ += s.mix_level
            env += s.mix_level
        elif rule == "exp" or kind == "exp":
            lip = cls.lipschitz if kind == "exp" else 1.0
            ext += lip * abs_err
            sys_ += lip * s.c_sys * s.rms
            env += lip * abs_err
        elif kind in ("copy", "lipschitz") or (kind == "contract" and pos not in contract_pair):
            lip = cls.lipschitz
            # With several full-size inputs (a weight plus its update) the output's extremes sit
            # where another input decides them, so they carry this input's error at some element,
            # up to the tail of its error spread (Gaussian: sqrt(2 ln n) of its RMS), not its RMS.
            tail = 1.0 if unary or s.numel <= 1 else math.sqrt(2.0 * math.log(s.numel))
            ext += lip * tail * abs_err / amax_o
            sys_ += lip * s.c_sys * s.rms / rms_o
            env += lip * abs_err / rms_o
        elif kind == "product":
            kappa = _inverse_factor(s) if pos in cls.inverse_inputs else cls.lipschitz
            if name.startswith("pow") or name == "square":
                kappa *= 2.0
            ext += kappa * (s.c_ext if (unary and pos in full) or s.numel == 1 else lvl)
            sys_ += kappa * s.c_sys
            env += kappa * lvl
        elif kind == "reduce":
            # A mean moves by at most the largest input error (|d mean| <= max |d x|), a sum of K
            # terms by sqrt(K) of it for independent errors; relative to the output that is an
            # absolute-error rule, and a relative one (condition factor) for the same error spread.
            k = max(s.numel / max(out.numel, 1), 1.0)
            lip = 1.0 if cls.mean_like else math.sqrt(k)
            kappa = s.rms / (math.sqrt(k) * rms_o) if cls.mean_like else math.sqrt(k) * s.rms / rms_o
            kappa = min(CAP, max(1.0, kappa))
            mix = s.mix_level
            ext += max(kappa * mix, lip * abs_err / amax_o)
            sys_ += max(kappa * s.c_sys, lip * s.c_sys * s.rms / rms_o)
            env += max(kappa * mix, lip * abs_err / rms_o)
        else:
            if kind == "contract":
                kappa = kappa_contract
            else:  # other: unknown semantics, be generous both ways
                kappa = 4.0
            mix = max(lvl, abs_err / amax_o, abs_err / rms_o) if kind == "other" else s.mix_level
            ext += kappa * mix
            sys_ += kappa * s.c_sys
            env += kappa * mix
        # The norm/mean channel's random envelope, from the typical (not the worst) error level.
        if not (linear and pos in full) and lvl > 0:
            env_sys += (env - env_before) * min(1.0, s.mix_level / lvl)
    return ext, sys_ + env_sys / math.sqrt(neff), env


def _within_adam_bound(x: tuple[float, float, float], node: tuple, position: int,
                       producer: Mapping[int, tuple[tuple, int]], lookup: Callable[[int], TensorState | None],
                       view_base: Mapping[int, int], out: TensorState) -> tuple[float, float, float]:
    """``x`` for an output of Adam's parameter update, no larger than what Adam's arithmetic allows
    (comparison/adam.py): the parameter's own error plus twice the largest step either run can
    take, element by element. The division's rule alone predicts the whole parameter's range where
    a gradient was zero and the denominator is eps; that hid a 5% fault in GPT-2's next lookup of
    its positional table, whose untouched rows hold its extremes."""
    def step_count(tid: int) -> float | None:
        s = lookup(tid)
        return s.mean if s is not None and s.exact and s.numel == 1 and math.isfinite(s.mean) else None

    found = adam_update_bound(node, position, producer, view_base, step_count)
    if found is None:
        return x
    param, largest_step = found
    s = lookup(param) if param not in view_base else _through_view(lookup(param))
    if s is None or not s.known:
        return x
    amax_o, rms_o = max(out.amax, _TINY), max(out.rms, _TINY)
    held = _expected(OpClass("product", inputs=((0, "add"),)), "addcdiv_", [(0, s)] if s.is_float else [], out)
    apart = 2.0 * largest_step  # the two runs' steps, each within the bound, differ by at most this
    adam = (held[0] + apart / amax_o, held[1] + apart / rms_o, held[2] + apart / rms_o)
    return (min(x[0], adam[0]), min(x[1], adam[1]), min(x[2], adam[2]))


def _operands(cls: OpClass, ins: list[tuple[int, TensorState]]) -> list[tuple[int, TensorState]]:
    """The inputs a matmul/conv multiplies: by position when known (attention's query, key and
    value, and more in its backward), else the two largest."""
    if cls.operands:
        return [(pos, s) for pos, s in ins if pos in cls.operands]
    return sorted(ins, key=lambda p: p[1].numel, reverse=True)[:2]


_KAPPA_CAP = 1e12  # a sum of terms that cancel exactly has no bound; one of its units is then all it shows
_STRICT_KAPPA = 16.0  # above this condition factor a sum's bitwise change needs magnitude to count
_VIEW = 2.0  # a view shows part of its base: its largest error may sit away from the base's extremes


def _through_view(s: TensorState | None) -> TensorState | None:
    """The state an op sees through a view of ``s``: the base's, with the extreme error widened."""
    if s is None or s.exact or _VIEW == 1.0:
        return s
    seen = copy.copy(s)
    seen.c_ext = s.c_ext * _VIEW
    return seen


def _contracts_nonzero(cls: OpClass, ins: list[tuple[int, TensorState]]) -> bool:
    """Both operands of a matmul/conv are non-zero (a product with zeros is exact at any precision)."""
    operands = _operands(cls, ins)
    return len(operands) >= 2 and all(s.amax > 0 for _, s in operands)


# Tuning constants (set on the fault-injection benchmark's kept traces, see benchmarks/localization).
def _local_kappa(cls: OpClass, ins: list[tuple[int, TensorState]], out: TensorState, role: str = "") -> float:
    """How much the op's own rounding (one unit per partial sum) is amplified relative to its output:
    the condition factor of a sum or product whose terms cancel (1 when nothing cancels)."""
    rms_o = max(out.rms, _TINY)
    if cls.kind == "normalize" and role in ("mean", "reduced") and ins:
        # A row's mean, or a sum over the rows: the condition of that sum (see reduce below).
        s = ins[0][1]
        k = max(s.numel / max(out.numel, 1), 1.0)
        kappa = s.rms / (math.sqrt(k) * rms_o) if role == "mean" else math.sqrt(k) * s.rms / rms_o
        return min(_KAPPA_CAP, max(1.0, kappa))
    if cls.kind == "contract":
        operands = _operands(cls, ins)
        if len(operands) == 2 and out.numel > 0:
            (_, a), (_, b) = operands
            k = math.sqrt(max(a.numel * b.numel / out.numel, 1.0))
            return min(_KAPPA_CAP, max(1.0, math.sqrt(k) * a.rms * b.rms / rms_o))
    elif cls.kind == "reduce" and ins:
        s = max((s for _, s in ins), key=lambda s: s.numel)
        k = max(s.numel / max(out.numel, 1), 1.0)
        kappa = s.rms / (math.sqrt(k) * rms_o) if cls.mean_like else math.sqrt(k) * s.rms / rms_o
        return min(_KAPPA_CAP, max(1.0, kappa))
    elif cls.kind == "normalize" and ins:
        s = max((s for _, s in ins), key=lambda s: s.numel)
        return min(_KAPPA_CAP, max(1.0, s.rms / max(s.spread, _TINY)))
    return 1.0


# Rounding bias of an op that applies one constant to every element, in units of its dtype, is up
# to _ROUNDING_BIAS * sqrt(unit) = 2 * 2^(-p/2) for p mantissa bits (bf16 0.18, fp16 0.06): over
# the 2^p mantissas the rounding errors of x * c do not cancel (measured over random constants).
_ROUNDING_BIAS = 2.0
_ONE_MAGNITUDE = 0.9  # rms / max |x| above which a tensor's values count as one magnitude
_CARRY = 2.0  # a measurement is trusted to be at most this many times below the inputs' prediction
_CARRY_SYS = 4.0  # the same for norm/mean differences
_M_MIN = 2.0  # with calibration: the smallest margin over the predicted error ...
_M_RATIO = 3.0  # ... else this many times the typical observed/predicted ratio of the op in this run


def _carry(out: TensorState, x: tuple[float, float, float], typical: tuple[float, float] = (0.0, 0.0)) -> None:
    """Raise the error an output passes on towards the predicted one, by at most ``_CARRY`` times.

    A channel that measured exactly nothing on a tensor that is not bitwise equal is blind there
    (saturated extremes such as softmax's 0 and 1, a mean fixed by construction): the prediction
    stands in for it. No prediction goes beyond the tensor's range, though: every element of both
    runs lies between their extremes, so no element can be off by more than that span (a weight of
    ones after Adam's first step spans 2 lr, however wrong the division by gradients near 0 that
    made its update looks).

    ``typical`` is the measured/predicted ratio (max/min, norm/mean) that the op's earlier calls
    at the same site typically showed (see :class:`_TypicalRatio`). Without whole tensors a
    measurement is one sample of a random error, and a lucky one can sit hundreds of times below
    the error the bulk of the tensor carries (BERT-base in AMP bf16: a layer norm's input gradient
    off by 0.77% in RMS, by 0.005% at both its extremes). Such an output passes on at least what
    its prediction typically comes to in this run, never more than the prediction itself.
    """
    if out.exact:
        return
    if out.filled:
        # Its statistics see the fills, and of its finite elements only the largest: the prediction
        # stands for what they carry, unless the measurement shows more.
        out.c_ext, out.c_sys = max(out.e_ext, x[0]), max(out.e_sys, x[1])
        if not math.isnan(out.e_rms):
            out.c_rms = max(out.e_rms, x[2])
        return
    if out.amax > 0 and out.rms > 0 and math.isfinite(out.hi - out.lo):
        span = (out.hi - out.lo) + 2.0 * out.e_ext * out.amax
        x = (min(x[0], span / out.amax), min(x[1], span / out.rms), min(x[2], span / out.rms))
    out.c_ext = out.e_ext and max(out.e_ext, min(x[0], _CARRY * out.e_ext)) or x[0]
    out.c_sys = out.e_sys and max(out.e_sys, min(x[1], _CARRY_SYS * out.e_sys)) or x[1]
    if not math.isnan(out.e_rms):
        out.c_rms = max(out.e_rms, min(x[2], _CARRY * out.e_rms))
    else:
        # Only a finite prediction says what is typical; an unbounded one (an op credited with
        # more than CAP) leaves the measurement as it is.
        floor = [min(t, 1.0) * v if math.isfinite(v) else 0.0 for t, v in zip(typical, x)]
        out.c_ext, out.c_sys = max(out.c_ext, floor[0]), max(out.c_sys, floor[1])


@cache
def _layer_site(module: str) -> str:
    """A module path with its layer numbers taken out: where one line of a model's code runs in
    every layer.

    >>> _layer_site("bert.encoder.layer.7.output.LayerNorm")
    'bert.encoder.layer.#.output.LayerNorm'
    """
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "#", module)


def _made_by(made: tuple[tuple, int] | None) -> str:
    """What made an input, for :class:`_TypicalRatio`'s sites: its op, or "state" for a parameter
    or buffer (a source, or what the optimizer last wrote into it), the same in every step."""
    if made is None or made[0][3] == "source" or made[0][2] == "optimizer":
        return "state"
    return made[0][4]


class _TypicalRatio:
    """Running median, per call site, of the measured/predicted error ratio of the calls so far,
    per channel (max/min, norm/mean): what an op's prediction typically comes to in this run.
    A site is one op at one place of every layer (:func:`_layer_site`), in one phase, with one
    output role and inputs made by the same ops: a multiply's calls elsewhere in a model, or by
    the same module on other inputs (an RMSNorm backward's gradient times its weight, and times
    its normalized input), relate their errors to their inputs' in other ways.

    >>> typical = _TypicalRatio()
    >>> for e in (0.1, 0.2, 0.3, 0.4, 0.5):
    ...     typical.add(("add", "float32"), (e, e), (1.0, 1.0))
    >>> typical.median(("add", "float32"))
    (0.3, 0.3)
    """

    MIN_CALLS = 5  # fewer calls say nothing typical

    def __init__(self) -> None:
        self._ratios: dict[Any, tuple[list[float], list[float]]] = {}
        self._medians: dict[Any, tuple[int, tuple[float, float]]] = {}  # key -> (calls when computed, medians)

    def add(self, key: Any, e: tuple[float, ...], x: tuple[float, ...]) -> None:
        lists = self._ratios.setdefault(key, ([], []))
        for channel in (0, 1):
            if x[channel] > 0 and math.isfinite(x[channel]) and not math.isnan(e[channel]):
                lists[channel].append(e[channel] / x[channel])

    def median(self, key: Any) -> tuple[float, float]:
        lists = self._ratios.get(key)
        if lists is None:
            return 0.0, 0.0
        calls = max(len(lists[0]), len(lists[1]))
        done, medians = self._medians.get(key, (0, (0.0, 0.0)))
        # Sorted again only once a site's calls grew by an eighth: O(log n) sorts for n calls.
        if calls >= self.MIN_CALLS and calls - done >= max(1, done // 8):
            ext, sys_ = (float(np.median(v)) if len(v) >= self.MIN_CALLS else 0.0 for v in lists)
            medians = ext, sys_
            self._medians[key] = (calls, medians)
        return medians


def _at_finite_scale(out: TensorState, e: tuple[float, float, float],
                     x: tuple[float, float, float]) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """A filled output's measured and predicted errors relative to its largest finite element, the
    scale its op computed at, rather than to the fill (whose 3e38 would make any error vanish).

    Statistics see its finite elements at the extreme the fills leave alone: that channel is
    judged. Its mean and norm are the fills' (they say which elements are filled, see
    metrics.stat_metrics), and whole tensors' rms error is relative to them: neither channel
    judges then. With no finite extreme (a mask of zeros, both kinds of fill), nothing changes.

    >>> s = TensorState(known=True, exact=False, amax=3.4e38, lo=-3.4e38, hi=17.0, filled=True)
    >>> e, x = _at_finite_scale(s, (1e-39, 0.0, math.nan), (5e-40, 1e-40, 1e-40))
    >>> round(e[0], 6), round(x[0], 6), e[1]
    (0.02, 0.01, nan)
    """
    finite = abs(out.hi) if out.lo <= -min(FILLS) else abs(out.lo)
    if not 0 < finite < min(FILLS):
        return e, x
    scale = out.amax / finite
    return (e[0] * scale, math.nan, math.nan), (x[0] * scale, x[1], x[2])


def _carry_factors(out: TensorState, x: tuple[float, float, float], ins: list[tuple[int, TensorState]],
                   cls: OpClass) -> None:
    """An elementwise product of several full-size factors passes on at least the relative error
    its factors' extremes show, as relative errors of a product add (within its prediction).

    Its own extremes are one more sample of that error, at elements where the factors' extremes
    are not, and can come out far below it (Llama-8 in bf16: a gradient times the RMSNorm input,
    factors 6e-4 and 5e-4 at their extremes, the product 9e-5 at its own), which the row sum
    after it, an RMSNorm's backward, then showed 5x beyond what it carried in.
    """
    factors = [s for pos, s in ins if s.numel == out.numel and s.numel > 1 and cls.input_rule(pos) == ""]
    if out.exact or len(factors) < 2:
        return
    floor = min(x[0], min(s.c_ext for s in factors))
    out.c_ext = max(out.c_ext, floor)


@dataclass
class _Judged:
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
    parts: tuple[tuple[str, tuple[float, float, float], tuple[float, float, float], tuple[float, float, float]], ...] = ()


def localize(
    ranks: Iterable[RankInput], tolerances: Tolerances, *, exact: bool = False,
    progress: Callable[[int], None] | None = None,
) -> tuple[dict[tuple[int, int], NodeVerdict], list[Divergence], list[SkippedStep], list[Drift]]:
    """Verdicts for every target node (keyed by (rank, op_id)), the roots, earliest first, the
    steps a loss scaler skipped on overflows it caught (not roots: see :func:`_scaler_skips`), and
    where ranks drifted apart (:class:`Drift`, with the ops left undecided after it).

    ``progress(n)`` is called as nodes are walked (n nodes since the previous call).
    """
    verdicts: dict[tuple[int, int], NodeVerdict] = {}
    roots: list[tuple[tuple, Divergence]] = []
    skipped: list[SkippedStep] = []
    drifts: list[Drift] = []
    for rank_input in ranks:
        v, r, s, drift = _localize_rank(rank_input, tolerances, exact, progress)
        verdicts.update({(rank_input.rank, k): x for k, x in v.items()})
        roots.extend(r)
        skipped.extend(s)
        drifts.extend([drift] if drift is not None else [])
    roots.sort(key=lambda item: item[0])
    return verdicts, [d for _, d in roots], sorted(skipped, key=lambda k: (k.step, k.rank)), drifts


def _localize_rank(
    ri: RankInput, tol: Tolerances, exact_mode: bool, progress: Callable[[int], None] | None = None
) -> tuple[dict[int, NodeVerdict], list[tuple[tuple, Divergence]], list[SkippedStep], Drift | None]:
    state: dict[int, TensorState] = {}
    verdicts: dict[int, NodeVerdict] = {}
    judged: list[_Judged | None] = []
    base = ri.view_base
    first_nonexact: int | None = None
    channels = ("max/min", "norm/mean", "rms")
    crossed = _crossed_pairs(ri)
    producer: dict[int, tuple[tuple, int]] = {}  # tensor id (view bases) -> the node that made it, output position

    def lookup(tid: int) -> TensorState | None:
        tid = base.get(tid, tid)
        # A value produced outside the compared steps is known only as measured.
        return state.get(tid) or ri.measured.get(tid)

    # Target ops of regions where some member, on either side, was handed a NaN/Inf.
    given_regions = {o for region in ri.regions.values() if _region_given(region, ri) for o in region.target_ops}
    typical = _TypicalRatio()


    # ---- pass 1: measure, propagate, compute what each node introduced -------------------------
    for index, node in enumerate(ri.nodes):
        if progress is not None and index % _PROGRESS_EVERY == 0 and index:
            progress(_PROGRESS_EVERY)
        op_id, step, phase, kind, op, name, module, location, args, inputs, outputs, random, stack = node
        verdict = NodeVerdict(op_id)
        verdicts[op_id] = verdict
        producer.update((tid, (node, position)) for position, tid in enumerate(outputs) if tid not in base)
        if kind == "view" and all(t in base for t in outputs):
            judged.append(None)
            continue
        if op == UNREAD_SOURCE:  # only written by its first use (an out= buffer): its content means nothing
            for tid in outputs:
                state[tid] = TensorState(known=True, exact=True, uninit=True)
            judged.append(None)
            continue
        # Sources have no inputs; a view node whose output carries statistics of its own (capture's
        # alias.update: a tensor after writes through its views) assembles its inputs' values.
        cls = OpClass("factory") if kind == "source" else OpClass("copy") if kind == "view" else classify(op)
        if args and takes_call_args(op):
            cls = _for_call(cls, op, args)
        ins_all = [(pos, lookup(t) if t not in base else _through_view(lookup(t))) for pos, t in enumerate(inputs)]
        if ri.bench_only:
            ins_all = [(pos, _past_bench_cast(s, ri, ri.bench_only.get((op_id, pos)))) for pos, s in ins_all]
        # Inputs whose values the op never reads (nll_loss_backward's log-probs) count for nothing.
        ins = [(pos, s) for pos, s in ins_all if s is not None and not s.uninit and cls.input_rule(pos) != "ignore"]
        unknown_input = any(s is None and cls.input_rule(pos) != "ignore" for pos, s in ins_all) or any(not s.known for _, s in ins)
        float_ins = [(pos, s) for pos, s in ins if s.is_float]
        discrete_changed = any(not s.exact for _, s in ins if not s.is_float)
        inputs_exact = not unknown_input and all(s.exact for _, s in ins)
        out_states: list[TensorState] = []
        roles: list[str] = []  # what each of out_states is among the op's outputs (normalization ops)
        positions: list[int] = []  # and its position among them
        given_in = any(s.given for _, s in ins)
        hands_nonfinite = op_id in given_regions or given_nonfinite(args)
        for position, tid in enumerate(outputs):
            if tid in base:  # an op returning a view of an input (e.g. an in-place op's alias)
                continue
            if cls.kind == "uninit":
                state[tid] = TensorState(known=True, exact=True, uninit=True)
                continue
            m = ri.measured.get(tid)
            if m is None and op_id in ri.units:
                # A compiled unit is a whole graph: what it made unmeasured is unknown, not exact.
                is_float, nonfinite, _ = ri.own.get(tid, (True, False, ""))
                state[tid] = TensorState(known=False, exact=False, nonfinite=nonfinite, is_float=is_float)
                continue
            if m is None:
                is_float, nonfinite, _ = ri.own.get(tid, (True, False, ""))
                # No partner: carry the inputs' error through (an extra copy, a fused op's piece).
                worst = max((s for _, s in float_ins), key=lambda s: s.level, default=None)
                est = TensorState(known=not unknown_input and worst is not None or (not ins and not inputs),
                                  exact=inputs_exact and (kind != "source" or op_id in ri.member_of), nonfinite=nonfinite,
                                  is_float=is_float)
                if worst is not None:
                    est.e_ext, est.e_sys, est.e_rms = worst.e_ext, worst.e_sys, worst.e_rms
                    est.c_ext, est.c_sys, est.c_rms = worst.c_ext, worst.c_sys, worst.c_rms
                    est.amax, est.rms, est.numel = worst.amax, worst.rms, worst.numel
                    est.lo, est.hi, est.mean = worst.lo, worst.hi, worst.mean
                # A source inside a region is a constant of its implementation (the eager side's
                # causal-mask buffer, which the fused op has built in).
                est.known = est.known and (kind != "source" or op_id in ri.member_of)
                est.tainted = any(s.tainted for _, s in ins)
                est.nonfinite_mismatch = any(s.nonfinite_mismatch for _, s in ins)
                est.given = est.nonfinite_mismatch and (given_in or hands_nonfinite)
                state[tid] = est
                continue
            if m.nonfinite_mismatch and (given_in or hands_nonfinite):
                m.given = True
            state[tid] = m
            out_states.append(m)
            roles.append(cls.output_role(position))
            positions.append(position)
        if op_id in ri.member_of:
            # Judged with its region at the boundary, never on its own against the other side.
            judged.append(None)
            continue
        if not out_states:
            judged.append(None)
            continue
        if first_nonexact is None and not all(s.exact for s in out_states):
            first_nonexact = op_id
        outputs_exact = all(s.exact for s in out_states)
        # Sources after the first step may be parameters the optimizer already moved: their error
        # can be inherited, so only inputs and first-step sources are judged.
        source_inherited = kind == "source" and op != "source.input" and first_nonexact is not None and (
            first_nonexact < op_id and step > ri.first_step
        )
        # NaN/Inf reaching a node make its statistics say nothing about its own arithmetic.
        nonfinite_in = any(s.nonfinite_mismatch for _, s in ins)
        judgeable = (not unknown_input and not discrete_changed and not source_inherited and not nonfinite_in
                     and cls.kind != "uninit" and kind != "view")
        if cls.kind == "select" and not inputs_exact:
            judgeable = False  # comparisons, rounding, argmax: a changed input may change anything
        bench_args = ri.bench_args.get(ri.pairs.get(op_id, -1), "")
        if op_id in crossed:
            # Measured against a bench value that the bench computes differently: neither this
            # node nor what its outputs pass on can be judged.
            judgeable = False
            for m in out_states:
                m.known = m.known and m.exact
        best_e, best_x, best_f1, best_ratio = (0.0, 0.0, 0.0), (0.0, 0.0, 0.0), (1.0, 1.0, 1.0), -math.inf
        best_kappa = kappa_local = 1.0
        lam = 2.0 if cls.accumulates else 1.0
        uses_tf32 = False
        nontrivial = False
        rstd = next((m for m, role in zip(out_states, roles) if role == "rstd"), None)
        parts = []
        dtype = ri.own.get(outputs[0], (True, False, ""))[2] if outputs else ""
        # This call's site among the op's calls (see _TypicalRatio); each output adds its role.
        site = (op, dtype, phase, _layer_site(module),
                tuple(_made_by(producer.get(base.get(t, t))) for t in inputs)) if judgeable else ()
        for out, role, position in zip(out_states, roles, positions):
            if not out.is_float:
                e = (0.0 if out.exact else 1.0, 0.0, math.nan)
                x = (0.0 if inputs_exact else math.inf, 0.0, 0.0)
                f1 = (1.0, 1.0, 1.0)
            else:
                unit = out.unit
                if cls.precision_variable and tol.allow_tf32 and 0 < unit <= _FP32 and _contracts_nonzero(cls, float_ins):
                    # TF32 rounding, not accumulation order, then sets the local error.
                    unit, lam, uses_tf32 = TF32_EPS, 0.5, True
                kappa_local = _local_kappa(cls, float_ins, out, role) if cls.accumulates else 1.0
                # Reordered (or TF32-rounded) terms differ by a unit each, amplified where they cancel.
                unit *= kappa_local
                averaged = _averaged_rounding(unit, out, uses_tf32)
                f1 = (max(unit, _TINY), max(averaged, _TINY), max(unit, _TINY))
                e = (out.e_ext, out.e_sys, out.e_rms)
                x = _expected(cls, base_name(op), float_ins, out, role, rstd) if judgeable else (math.inf, math.inf, math.inf)
                if judgeable and base_name(op) in ADAM_UPDATES:
                    x = _within_adam_bound(x, node, position, producer, lookup, base, out)
                if judgeable and kind != "source":
                    # full(finfo(dtype).min), x + finfo(dtype).eps: each run took its own dtype's number
                    shift = _constant_shift(cls, args, bench_args, out, float_ins, rstd)
                    x = (x[0] + shift[0], x[1] + shift[1], x[2] + shift[2])
                nontrivial = nontrivial or (out.amax > 0 and (cls.kind != "contract" or _contracts_nonzero(cls, float_ins)))
                if judgeable:
                    _carry(out, x, typical.median((*site, role)))
                    if kind == "op":
                        typical.add((*site, role), e, x)
                    if cls.kind == "product":
                        _carry_factors(out, x, float_ins, cls)
                if out.filled:
                    e, x = _at_finite_scale(out, e, x)
            ratio = max(((ec - xc) / fc if math.isfinite(xc) else ec / fc) for ec, xc, fc in zip(e, x, f1) if not math.isnan(ec))
            if role and out.is_float:
                parts.append((role, e, x, f1))
            if ratio > best_ratio:
                best_ratio, best_e, best_x, best_f1, best_kappa = ratio, e, x, f1, kappa_local
        error = max((ec / fc for ec, fc in zip(best_e, best_f1) if not math.isnan(ec)), default=math.nan)
        verdict.error = float(error)
        intro = [max(0.0, ec - xc) / fc if not math.isnan(ec) and math.isfinite(xc) else 0.0
                 for ec, xc, fc in zip(best_e, best_x, best_f1)]
        verdict.introduced = float(max(intro)) if judgeable else 0.0
        judged.append(_Judged(index, op_id, (op, dtype), cls, judgeable, inputs_exact, outputs_exact, best_e, best_x,
                              best_f1, lam, uses_tf32, all(s.same_dtype for s in out_states), nontrivial, best_kappa,
                              tuple(parts)))

    for op_id, region_id in ri.member_of.items():
        verdicts[op_id].region = region_id

    # ---- pass 2: regime and ambient calibration ---------------------------------------------
    # Compiled units round like whole graphs, not like single ops: they set neither regime nor calibration.
    own_rules = [j if j is None or j.op_id not in ri.units else None for j in judged]
    exact_input_nodes = [j for j in own_rules if j is not None and j.judgeable and j.inputs_exact and j.cls.kind != "factory"]
    # Matmuls/convs allowed to run at TF32 have their own rule and do not decide the regime.
    differing = sum(1 for j in exact_input_nodes if not j.outputs_exact and not j.uses_tf32)
    bitwise = exact_mode or differing <= max(2, 0.01 * len(exact_input_nodes))
    # A matmul/conv that turned identical, non-zero inputs into identical outputs shows that this
    # target does not run them at reduced (TF32) precision.
    exact_matmul = any(j.cls.precision_variable and j.outputs_exact and j.nontrivial for j in exact_input_nodes)
    region_judged = {region_id: _judge_region(region, ri, lookup, tol, exact_matmul)
                     for region_id, region in ri.regions.items() if region.target_ops}
    ambient = _ambient(own_rules, ri.nodes, tol) if not exact_mode else {}
    names = {node[0]: node[4] for node in ri.nodes}
    fits = model_fits(ri.own_errors, names) if ri.reduced_precision and not exact_matmul else {}
    bounds_hold = _bounds_hold(ri) if ri.reduced_precision and not exact_matmul else False
    tf32_spread = _tf32_spread(own_rules) if not exact_matmul else None
    bitwise_ops = _bitwise_ops(ri)

    roots: list[tuple[tuple, Divergence]] = []
    # Roots their replay confirms: the op computed wrongly on its own recorded inputs, whatever
    # made those inputs (drift, what Python decided from a diverged value) and however they differ.
    replayed: set[int] = set()

    def judge(j: _Judged, node: tuple, tainted_in: bool) -> None:
        op_id, step, phase, kind, op, name, module, location, args, inputs, outputs, random, stack = node
        verdict = verdicts[op_id]
        bench_op = ri.pairs.get(op_id)
        root_kind, reason, deciding, part, confirmed = _decide(j, node, ri, tol, bitwise, exact_matmul, ambient, exact_mode,
                                                               lookup, channels, fits, bounds_hold, tf32_spread, bitwise_ops,
                                                               tainted_in)
        verdict.metric = deciding
        if not root_kind:
            return
        verdict.metrics = _metric_dict(j, part)
        own = ri.own_errors.get(op_id)
        if own is not None:
            verdict.metrics.update(own_error=own.error, honest_error=own.honest)
            if deciding == "replay":
                units = own.error / EPS.get(own.dtype, _FP32)
                verdict.introduced = units if not verdict.introduced >= units else verdict.introduced
        verdict.root_kind = root_kind
        verdict.reason = reason
        if root_kind == "computation" and confirmed:
            replayed.add(op_id)
        if root_kind == "nan":
            # NaN/Inf made from finite values: no count of rounding units measures that, and it
            # outranks every root of a few units.
            verdict.introduced = math.inf
        divergence = Divergence(
            op=op, module=module, phase=phase, step=int(step), location=location, op_id=int(op_id),
            bench_op_id=None if bench_op is None else int(bench_op), rank=ri.rank, kind=root_kind, reason=reason,
            score=float(verdict.introduced if not math.isnan(verdict.introduced) else 0.0), metrics=verdict.metrics,
            stack=stack,
        )
        roots.append(((int(step), int(op_id), ri.rank), divergence))
    root_regions = _region_roots(ri, region_judged, verdicts, tol, exact_matmul, roots)

    python_from: int | None = None  # the first op that read a root's error into Python (``.item()``) ...
    python_step = 0  # ... and its step
    # Drift: how far apart the runs' values are where they became other samples of each other (see
    # _DRIFT), per tensor computed from such values, and per step (a step whose own values drift
    # runs on parameters an earlier drifted step moved, and is chaotic from its start).
    drifted: dict[int, tuple[float, int]] = {}  # tensor -> (how far apart, the step that made it)
    own_drift = {node[0]: _drifted(ri.measured.get(t) for t in node[10]) for node in ri.nodes}
    step_drift: dict[int, float] = defaultdict(float)
    for node in ri.nodes:
        step_drift[int(node[1])] = max(step_drift[int(node[1])], own_drift[node[0]])
    drift: tuple[tuple, float] | None = None  # where it began: the node, its max/min difference
    undecided: list[Divergence] = []  # roots taken back for that
    for node, j in zip(ri.nodes, judged):
        op_id, step, phase, kind, op, name, module, location, args, inputs, outputs, random, stack = node
        # Taint: error that comes from a root. Once a root put its error into a node's inputs, that
        # error is no rounding noise, and what statistics say of it is a lower bound only.
        tainted_in = any(s is not None and s.tainted for s in map(lookup, inputs))
        # A parameter or buffer in a later step was moved by an optimizer that a root's error reached.
        tainted_in = tainted_in or (kind == "source" and op != "source.input" and any(r[0][0] < step for r in roots))
        if python_from is None and tainted_in and is_readout(op):
            python_from, python_step = op_id, step
        # Drift reaches what is computed from drifted values (a bitwise equal one excepted); into a
        # later step (its parameters, moved by a drifted update) only where that step drifts again.
        drift_in = 0.0
        for t in inputs:
            far, made = drifted.get(base.get(t, t), (0.0, step))
            if far and not _exact(lookup(t)):
                drift_in = max(drift_in, far if made >= step else min(far, step_drift[int(step)]))
        if drift is not None and kind == "source" and op != "source.input" and step > drift[0][1] and not all(
                map(_exact, map(lookup, outputs))):
            drift_in = max(drift_in, step_drift[int(step)])
        if j is not None:
            judge(j, node, tainted_in)
            verdict = verdicts[op_id]
            if (drift_in and verdict.root_kind == "computation" and op_id not in replayed
                    and max((e for e in j.e if not math.isnan(e)), default=0.0) <= drift_in):
                # Its inputs drifted apart: what their statistics say bounds their error from below
                # only, far below the drift itself, so a root of no more error than the drift is
                # as likely the drift's. A larger one stands out from it.
                undecided.append(roots.pop()[1])
                verdict.root_kind = ""
                assert drift is not None
                verdict.reason = (f"computed from values that drifted apart from op {drift[0][0]} on; statistics cannot tell "
                                  f"a fault here from that drift: {verdict.reason}")
        if not (kind == "view" and all(t in base for t in outputs)):
            for t in outputs:
                s = state.get(t) if t not in base else None
                if s is not None and not s.exact and (tainted_in or verdicts[op_id].root_kind):
                    s.tainted = True
            error = 0.0 if tainted_in or verdicts[op_id].root_kind else own_drift[op_id]
            if error and drift is None:
                drift = (node, error)
            if max(error, drift_in):
                drifted.update((base.get(t, t), (max(error, drift_in), int(step))) for t in outputs)
    if python_from is not None:
        nodes_by_id = {node[0]: node for node in ri.nodes}
        exact_in = {j.op_id for j in judged if j is not None and j.inputs_exact}
        exact_in.update(op for op, region_id in ri.member_of.items()
                        if region_id in region_judged and region_judged[region_id].inputs_exact)

        def inherited(d: Divergence) -> bool:
            """Whether ``d`` follows Python's reading of a root; then it is diverged, no root."""
            if d.op_id in replayed or not _follows_python(d, python_from, python_step, exact_in, ri.rank):
                return False
            verdict = verdicts[d.op_id]  # the reason says where from
            verdict.root_kind = ""
            verdict.reason = (f"follows op {python_from}, which read a diverged value into Python (.item()); "
                              f"what the program decided from it may differ: {d.reason}")
            for t in nodes_by_id[d.op_id][10]:  # a root taken back for the drift did not taint yet
                s = state.get(t)
                if s is not None and not s.exact:
                    s.tainted = True
            return True

        roots[:] = [(key, d) for key, d in roots if not inherited(d)]
        undecided = [d for d in undecided if not inherited(d)]
    skipped = _scaler_skips(ri, roots, verdicts, lookup, python_from)

    # ---- pass 3: statuses ------------------------------------------------------------------
    undecided_set = {d.op_id for d in undecided}
    producer_status: dict[int, str] = {}
    region_status: dict[int, str] = {}
    for node in ri.nodes:
        op_id, step, phase, kind, op, name, module, location, args, inputs, outputs, random, stack = node
        verdict = verdicts[op_id]
        paired = op_id in ri.pairs or op_id in ri.units
        region_id = ri.member_of.get(op_id)
        if region_id is not None:
            # Members share their region's status; a root region taints what it makes.
            if region_id not in region_status:
                region_status[region_id] = _region_status(ri.regions[region_id], region_judged.get(region_id),
                                                          region_id in root_regions, lookup)
            tainted = region_id in root_regions or region_status[region_id] == "diverged"
            for t in outputs:
                s = state.get(base.get(t, t))
                if s is not None and not s.exact and tainted:
                    s.tainted = True
                producer_status[base.get(t, t)] = region_status[region_id]
            verdict.status = region_status[region_id]
            continue
        if kind == "view" and all(t in base for t in outputs):
            src = base.get(outputs[0], inputs[0] if inputs else -1) if outputs else -1
            verdict.status = producer_status.get(src, "uncompared") if paired else "unpaired"
            continue
        ins = [lookup(t) for t in inputs]
        outs = [state.get(t) for t in outputs if t not in base]
        measured = [s for s in outs if s is not None and s.measured]
        if not paired:
            status = "unpaired"
        elif op_id in crossed and not all(s.exact for s in measured):
            status = "uncompared"
        elif any(s.nonfinite_mismatch and not s.given for s in measured):
            status = "nan"
        elif not outs and is_readout(op) and inputs:
            # ``.item()``: the number is its input's value, judged where that was made.
            status = _readout_status(producer_status.get(base.get(inputs[0], inputs[0]), "uncompared"))
        elif not outs:
            status = "agrees" if all(s is not None and s.exact for s in ins) or not ins else "uncompared"
        elif len(measured) < len([s for s in outs if s is not None and not s.uninit]) or op_id in undecided_set:
            status = "uncompared"
        elif all(s.exact for s in measured):
            status = "agrees"
        elif verdict.root_kind or any(s.tainted for s in measured):
            status = "diverged"
        else:
            status = "noise"
        verdict.status = status
        for t in outputs:
            producer_status[base.get(t, t)] = status
    found = None
    if drift is not None:
        (op_id, step, phase, _, op, _, module, *_), error = drift
        found = Drift(rank=ri.rank, op_id=op_id, step=int(step), phase=phase, op=op, module=module, error=error,
                      undecided=tuple(d.op_id for d in undecided))
    return verdicts, roots, skipped, found


# A rank's runs have drifted apart where a large tensor's extremes differ by more than this share of
# its largest value with no root behind it: its elements are then other samples of the same values
# (measured on ResNet-50 at random initialization, bf16 or AMP against fp32: relu outputs 5% off
# element by element in stage 1, 48% in stage 3, 90-131% in the backward, while norms and means
# agree to 1e-4). Text models of 100M+ parameters stay below 8% in every clean pair.
_DRIFT = 0.2
_DRIFT_MIN_NUMEL = 1 << 16  # extremes of fewer values scatter too much to say so


def _exact(s: TensorState | None) -> bool:
    return s is not None and s.exact


def _drifted(outputs: Iterable[TensorState | None]) -> float:
    """The largest measured max/min difference among an op's large float outputs beyond ``_DRIFT``, else 0."""
    errors = [s.e_ext for s in outputs if s is not None and s.measured and s.is_float and not s.nonfinite
              and s.numel >= _DRIFT_MIN_NUMEL and s.e_ext > _DRIFT]
    return max(errors, default=0.0)


# What a program's Python code decides: the arguments it passes, which ops it runs, the values it
# creates tensors from, its random draws, and the batches and parameters it feeds.
_PYTHON_KINDS = ("argument", "structure", "random", "source")


def _follows_python(d: Divergence, python_from: int, python_step: int, exact_in: set[int], rank: int) -> bool:
    """Whether root ``d`` is inherited through Python: it comes after a root's error was read into
    Python (op ``python_from``, an ``.item()`` of a tainted tensor, in step ``python_step``) and
    is of a kind Python decides, or lies in a later step (a GradScaler that found the Inf a root
    made skips the optimizer step: the next step runs on parameters the bench moved and the
    target did not, and its optimizer with other arguments on other state). NaN/Inf made from
    finite inputs stays a root, and so does a root its replay confirms (the caller's part)."""
    if d.op_id <= python_from or d.rank != rank or d.kind == "nan":
        return False
    decided = d.kind in _PYTHON_KINDS or (d.kind == "computation" and d.op_id in exact_in)
    return decided or d.step > python_step


def _scaler_skips(ri: RankInput, roots: list[tuple[tuple, Divergence]], verdicts: dict[int, NodeVerdict],
                  lookup: Callable[[int], TensorState | None], python_from: int | None) -> list[SkippedStep]:
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
    checks = [node for node in ri.nodes if is_overflow_check(node[4]) and _found_overflow(node, ri)]
    if not checks:
        return []
    nan_roots = {d.op_id for _, d in roots if d.kind == "nan" and d.phase == "backward"}
    nodes = {node[0]: node for node in ri.nodes if node[0] in nan_roots}
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
    return [SkippedStep(rank=ri.rank, step=int(c[1]), check_op_id=int(c[0]), overflows=tuple(caught[c[0]]))
            for c in checks if c[0] in caught]


def _found_overflow(node: tuple, ri: RankInput) -> bool:
    """A scaler's check whose ``found_inf`` (its last output) is set in the target and clear in the bench."""
    outputs = node[10]
    found = ri.measured.get(outputs[-1]) if outputs else None
    return found is not None and found.numel == 1 and not found.exact and found.lo == found.hi == 0.0


_OVERFLOW_NEAR = 0.5  # inherited inputs: the largest finite values expected within this factor of the dtype's largest


def _overflow(node: tuple, ri: RankInput, lookup: Callable[[int], TensorState | None], inherited: bool) -> str:
    """Why the first of the node's outputs that overflowed did ("" when none did), see :func:`_scaler_skips`."""
    inherited = inherited or any(s is not None and s.tainted for s in map(lookup, node[9]))
    for tid in node[10]:
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
            return (f"{dtype} overflow of inherited values: the target's own finite values (rms {ri.inf_only[tid]:.3g}) "
                    f"reach near {dtype}'s largest {top:.6g}")
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


def _readout_status(input_status: str) -> str:
    """A readout's status from its input's: the same where judged, never a root of its own."""
    if input_status in ("agrees", "noise", "uncompared"):
        return input_status
    return "diverged" if input_status in ("diverged", "nan") else "uncompared"


def _crossed_pairs(ri: RankInput) -> set[int]:
    """Paired target ops whose bench partner holds another value than theirs.

    Where two runs accumulate one sum in another order (autograd adds the gradients of a tensor
    used twice as its graph dictates, and a cast on one side changes the graph), alignment may
    pair a partial sum with the final one. A paired consumer then shows it: the bench op reads,
    at some argument, a tensor that is not the partner of what the target op reads there, but
    the output of a bench op paired with another target op. Both producers' outputs are measured
    against the wrong value (a bench-only op in between is another matter: see _structure_note).
    """
    b2t = {b: t for t, b in ri.pairs.items()}
    producer: dict[int, int] = {}
    crossed: set[int] = set()
    for node in ri.nodes:
        op_id, kind, inputs, outputs = node[0], node[3], node[9], node[10]
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


def _ambient(judged: list[_Judged | None], nodes: list[tuple], tol: Tolerances) -> dict[Any, tuple[tuple[float, ...], ...]]:
    """Per (op, dtype) and per (class, dtype), per channel, over this comparison: the median error
    introduced (rounding units), the median ratio of output error to predicted input error, and
    how far that ratio reaches among the group's calls.

    The first absorbs fresh noise every node of a kind adds (TF32 matmuls, a bf16 softmax); the
    second corrects the propagation model where an op amplifies more than its class predicts. The
    third covers the spread of that correction where statistics cannot bound it call by call (a
    sum over a row of products, in fp32 on bf16 data): how far the ratio reaches among the
    calls whose error is beyond their rounding (where the ratio decides), at most
    ``tol.downstream``, once as ops that sum many terms spread and once as elementwise ops do
    (see :func:`_tail_ratio`); each call takes the one of its kind. With more calls a clean run
    reaches further, and a fault still has to stand out from all.

    Outputs with roles (a normalization's input gradient against its weight and bias gradients)
    are grouped by role, ``(op, dtype, role)``: their errors relate to their inputs' in ways that
    spread differently, and a call's own error shows in the role it went wrong in.
    """
    by_group: dict[Any, list[tuple[tuple[float, ...], tuple[float, ...]]]] = defaultdict(list)
    for j in judged:
        if j is None or not j.judgeable or nodes[j.index][3] != "op":
            continue
        for role, es, xs, fs in j.parts or (("", j.e, j.x, j.f1),):
            intro = tuple(max(0.0, e - x) / f if not math.isnan(e) and math.isfinite(x) else 0.0 for e, x, f in zip(es, xs, fs))
            ratio = tuple(e / x if not math.isnan(e) and math.isfinite(x) and x > 0 else math.nan for e, x in zip(es, xs))
            # the ratio where it decides: an error beyond the node's own rounding (else 0, left out)
            beyond = tuple(r if e > tol.local * j.lam * f else 0.0 for r, e, f in zip(ratio, es, fs))
            by_group[_group_key(j.group, role)].append((intro, ratio, beyond))
            by_group[_group_key((j.cls.kind, j.group[1]), role)].append((intro, ratio, beyond))
    out: dict[Any, tuple[tuple[float, ...], ...]] = {}
    for key, rows in by_group.items():
        if len(rows) < 5:
            continue
        intro = np.median(np.asarray([r[0] for r in rows], dtype=np.float64), axis=0)
        ratios = np.asarray([r[1] for r in rows], dtype=np.float64)
        beyond = np.asarray([r[2] for r in rows], dtype=np.float64)
        ratio, tail, tail_elementwise = [], [], []
        for column, deciding in zip(ratios.T, beyond.T):
            seen = column[~np.isnan(column)]
            ratio.append(float(np.median(seen)) if len(seen) >= 5 else 0.0)
            tail.append(min(tol.downstream, _tail_ratio(deciding[deciding > 0], accumulates=True)))
            tail_elementwise.append(min(tol.downstream, _tail_ratio(deciding[deciding > 0], accumulates=False)))
        out[key] = (tuple(float(v) for v in intro), tuple(ratio), tuple(tail), tuple(tail_elementwise))
    return out


def _group_key(group: tuple[str, str], role: str) -> tuple[str, ...]:
    """The calibration group of one output: ``(op or class, dtype)``, and its role where it has one."""
    return (*group, role) if role else group


_TAIL_MIN_CALLS = 8  # fewer calls say too little about a spread
_TAIL_SAFETY = 2.0
# The upper tail is fitted through these quantiles of the log ratios: high enough that a group's
# bulk (a loose bound, ratios far below 1) does not widen it, low enough that a fault or two
# among the calls do not move it.
_TAIL_QUANTILES = (0.75, 0.9)
_TAIL_Z = (0.6745, 1.2816)  # the standard normal's quantiles at those levels


def _tail_ratio(ratios: np.ndarray, accumulates: bool) -> float:
    """How far the observed/predicted ratios of a group's ``n`` calls reach (0 for too few calls).

    A log-normal fitted to the whole spread (median and median deviation), extrapolated to the
    largest of ``n`` calls (its median plus sqrt(2 ln n) deviations), times ``_TAIL_SAFETY``.
    For ops that sum many terms the statistics only estimate the error, which scatters both
    ways around the estimate, and that fit is the model, though never below ``_TAIL_SAFETY``
    times the second largest ratio: where a group's calls fall into two populations (a batch
    norm's backward decided by its input gradient in most calls, by its weight and bias
    gradients in some), the fit follows the bulk and stops short of calls a fault must still
    stand out from. For elementwise ops they bound it:
    most calls sit far below the bound (ratios of 0.01 to 0.5), which widens the fit far
    beyond any call. There the reach is at most the larger of a log-normal through the upper
    quantiles and ``_TAIL_SAFETY`` times the second largest ratio: a call must stand out from
    every other call of its group but one, and from the group's upper tail.
    """
    if len(ratios) < _TAIL_MIN_CALLS:
        return 0.0
    logs = np.log10(ratios)
    reach = math.sqrt(2.0 * math.log(len(ratios)))
    center = float(np.median(logs))
    sigma = 1.4826 * float(np.median(np.abs(logs - center)))
    whole = _TAIL_SAFETY * 10.0 ** (center + reach * sigma)
    second = _TAIL_SAFETY * float(np.partition(ratios, -2)[-2])
    if accumulates:
        return max(whole, second)
    low, high = np.quantile(logs, _TAIL_QUANTILES)
    sigma = float(high - low) / (_TAIL_Z[1] - _TAIL_Z[0])
    upper = _TAIL_SAFETY * 10.0 ** (float(low) + (reach - _TAIL_Z[0]) * sigma)
    return min(whole, max(upper, second))


def _averaged_rounding(unit: float, out: TensorState, tf32: bool) -> float:
    """The part of an op's rounding ``unit`` (per element) that an output's norm and mean show.

    Independent rounding errors average out in norm and mean; TF32 taken by truncation (a tensor
    core fed float32 as is) shrinks every product alike, so there they do not. Nor does the final
    rounding where one constant meets every element (x / c, x * beta): rounding to p bits then has
    a bias of up to ~2 * 2^(-p/2) units of the output itself that no size averages away; where
    every element has one magnitude (a bias after Adam's first step is +-lr, and its autocast
    copy), every rounding is the same one.
    """
    if tf32:
        return unit
    neff = max(out.numel * (out.rms / out.amax) ** 2, 1.0) if out.amax > 0 else 1.0
    bias = 1.0 if out.rms >= _ONE_MAGNITUDE * out.amax else _ROUNDING_BIAS * math.sqrt(out.unit)
    return max(unit / math.sqrt(neff), out.unit * bias)


def _metric_dict(j: _Judged, part: int = -1) -> dict[str, float]:
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


class _Decision(NamedTuple):
    """What :func:`_decide` found for one node."""

    root_kind: str  # '' when not a root
    reason: str
    metric: str  # the deciding metric's name
    part: int  # the output that decided, as an index into _Judged.parts (-1: outputs without roles)
    replayed: bool = False  # a replay on the op's own recorded inputs confirms it as a root


def _decide(
    j: _Judged, node: tuple, ri: RankInput, tol: Tolerances, bitwise: bool, exact_matmul: bool,
    ambient: Mapping[Any, tuple[tuple[float, ...], ...]], exact_mode: bool, lookup: Any, channels: tuple[str, ...],
    fits: Mapping[str, ModelFit], bounds_hold: bool = False, tf32_spread: tuple[float, ...] | None = None,
    bitwise_ops: Mapping[str, tuple[int, bool]] | None = None, tainted: bool = False,
) -> _Decision:
    """Root kind ('' when not a root), the one-line reason, the deciding metric's name, the
    output that decided, as an index into ``j.parts`` (-1 where the op's outputs have no roles),
    and whether a replay of the op on its own recorded inputs confirms it as a root.

    ``tainted``: an input carries error from a root before it. Such error is no rounding noise:
    its statistics bound it from below only (its largest element may sit anywhere, its spread is
    unknown), so the node's own share must exceed ``tol.downstream`` times the prediction.
    """
    op_id, step, phase, kind, op, name, module, location, args, inputs, outputs, random, stack = node
    outs = [ri.measured.get(t) for t in outputs]
    outs = [s for s in outs if s is not None]
    # NaN/Inf from finite inputs: judged from the target's own statistics, whatever else is known.
    nonfinite_out = [s for s in outs if s.nonfinite and s.nonfinite_mismatch]
    if nonfinite_out and not given_nonfinite(args):  # an op handed -inf (a causal mask) made what it was asked for
        ins = [lookup(t) for t in inputs]
        if all(s is not None and not s.nonfinite for s in ins):
            return _Decision("nan", "NaN/Inf appear in its output although every input is finite (the bench's is not)",
                             "nan_count", -1)
    if j.outputs_exact:
        return _Decision("", "", "checksum", -1)
    unit = ri.units.get(op_id)
    if unit is not None:
        root_kind, reason, metric = unit.decide(node, j.e, ri, tol, lookup)
        return _Decision(root_kind, reason, metric, -1, root_kind == "computation" and metric == "replay")
    bench_op = ri.pairs.get(op_id)
    if bench_op is not None and kind != "source":
        diff = _arg_difference(args, ri.bench_args.get(bench_op, ""), op)
        if diff:
            return _Decision("argument", f"non-tensor arguments differ from the bench: {diff}", "args", -1)
    if any(s.nonfinite_mismatch and s.given for s in outs):
        # NaN/Inf the program handed in differ from the bench's: mean and norm say nothing then.
        return _Decision("", "", "nan_count", -1)
    deciding = channels[0] if j.e[0] >= j.e[1] or math.isnan(j.e[1]) else channels[1]
    replayed = _replayed_root(j, node, ri, tol, exact_matmul, fits.get(op), bounds_hold, bitwise_ops)
    if not j.judgeable:
        return _Decision("computation", replayed, "replay", -1, True) if replayed else _Decision("", "", deciding, -1)
    # Which channel of which output is furthest beyond what the inputs explain.
    excess = []
    tf32 = j.uses_tf32 and not exact_matmul
    for part, (role, es, xs, fs) in enumerate(j.parts) if j.parts else [(-1, ("", j.e, j.x, j.f1))]:
        amb = ambient.get(_group_key(j.group, role)) or ambient.get(_group_key((j.cls.kind, j.group[1]), role))
        for c, (e, x, f) in enumerate(zip(es, xs, fs)):
            if math.isnan(e):
                continue
            lam = j.lam
            if tf32 and tf32_spread is not None:
                # How far this run's TF32 calls typically stray beyond their inputs' error: a fault
                # a unit out is found where the device's own rounding stays well inside one.
                lam = max(_TF32_LAM_MIN, min(j.lam, tf32_spread[c])) if not math.isnan(tf32_spread[c]) else j.lam
            threshold = tol.local * lam * f
            margin = tol.margin
            if amb is not None:
                threshold = max(threshold, tol.ambient * amb[0][c] * f)
                if amb[1][c] > 0:
                    margin = max(_M_MIN, _M_RATIO * amb[1][c], amb[2 if j.cls.accumulates else 3][c])
            if tainted:
                margin = max(margin, tol.downstream)
            excess.append(((e - margin * x) / max(threshold, _TINY), c, e, x, threshold, part))
    score, channel, e, x, threshold, part = max(excess) if excess else (-math.inf, 0, 0.0, 0.0, 0.0, -1)
    # Identical inputs, identical dtypes, and identical inputs elsewhere giving identical outputs:
    # then any difference is this op's own doing, however small. A float32 matmul/conv may still
    # be running at TF32 unless the trace shows exact ones; an error too small for TF32 is not that.
    # A call TF32 rounding of its own operands can explain (from their statistics: K and sizes,
    # at most) is not held to the bitwise rule, even its op's only call; one beyond that can't be TF32.
    tf32_like = tf32 and _within_tf32(j, node, lookup, tol)
    strict = exact_mode or (bitwise and j.inputs_exact and j.same_dtype and not tf32_like)
    if strict and not exact_mode and j.kappa_local > _STRICT_KAPPA:
        # A sum whose terms cancel moves by many of its own units when merely reordered (thread
        # counts, atomics), which the rest of a deterministic run says nothing about.
        strict = any(e > f for e, f in zip(j.e, j.f1) if not math.isnan(e))
    if not (strict or score > 1.0):
        if replayed:
            return _Decision("computation", replayed, "replay", -1, True)
        return _Decision("", "", channels[channel], -1)
    if not strict and not replayed and kind == "op" and not random and _reproduced(ri.own_errors.get(op_id), j, ri, exact_matmul):
        # Its inputs already differ from the bench's, and a replay of the op on its own recorded
        # inputs finds it as exact as an honest kernel: the output's error is the inputs' error,
        # amplified more than the op's class foresaw (Adam's update of a gradient near 0). The
        # replay decides; the statistics only estimated.
        return _Decision("", "", "replay", -1)
    what = f"relative error {e:.2e} ({channels[channel]})"
    if kind == "source":
        label = op.removeprefix("source.")
        return _Decision("source", f"{label} {name!r} differs from the bench: {what}", channels[channel], part)
    if random:
        agree = " while its inputs agree" if j.inputs_exact else ""
        reason = (f"the divergence starts at a random op: it drew other numbers{agree} ({what}), so the runs' "
                  "generators differ (seed, generator state or device); seed both with tracecmp.seed_all() and "
                  'capture with TraceCompare(..., rng="host"), or dropout=0.0 to turn dropout off')
        return _Decision("random", reason, channels[channel], part)
    structure = _structure_note(op_id, inputs, ri)
    if bench_op is None:
        return _Decision("structure", f"target-only op (no bench partner) changes the values: {what}", channels[channel],
                         part)
    if structure:
        return _Decision("structure", f"{structure}; {what}", channels[channel], part)
    if j.inputs_exact:
        reason = f"output differs ({what}) while every input agrees bitwise"
    else:
        ratio = e / max(x, _TINY)
        reason = f"output error {e:.2e} ({channels[channel]}) is {ratio:.0f}x what its inputs carried in ({x:.1e})" if x > 0 else (
            f"output error {e:.2e} ({channels[channel]}) beyond rounding while its inputs agree")
    return _Decision("computation", reason, channels[channel], part, bool(replayed))


def _reproduced(own: OwnError | None, j: _Judged, ri: RankInput, exact_matmul: bool) -> bool:
    """A replay shows the op computed what its recorded inputs give: a reduced-precision
    matmul/conv within the accumulation bound of one of its replays, any other op within
    ``replay_margin`` times an honest kernel's error (the ratio rule's own test)."""
    if own is None:
        return False
    if ri.reduced_precision and own.bounds and _reduced_matmul(own, j, exact_matmul, ri.reduced_precision):
        return min(own.bounds) <= 1.0
    return not own.misrounded and (own.honest > 0 or own.error == 0)


_TF32_LAM_MIN = 0.25  # a TF32 call's threshold never drops below one TF32 unit (times its condition)
_TF32_SPREAD_MIN = 8  # calls needed to learn how far a run's TF32 matmuls stray


def _tf32_spread(judged: list[_Judged | None]) -> tuple[float, ...] | None:
    """Per channel, the 90th percentile of what this rank's TF32-allowed matmul/conv calls
    introduce beyond their inputs' error, in units of their own TF32 allowance (half the ``lam``
    scale): where the device rounds to nearest it is a fraction of a unit, toward zero more."""
    rows = [j for j in judged if j is not None and j.uses_tf32 and j.judgeable]
    if len(rows) < _TF32_SPREAD_MIN:
        return None
    spread = []
    for c in range(3):
        values = sorted(max(0.0, e - x) / f for j in rows for e, x, f in [(j.e[c], j.x[c], j.f1[c])]
                        if not math.isnan(e) and math.isfinite(x) and f > 0)
        spread.append(values[int(0.9 * (len(values) - 1))] if len(values) >= _TF32_SPREAD_MIN else math.nan)
    return tuple(spread)


def _within_tf32(j: _Judged, node: tuple, lookup: Callable[[int], TensorState | None], tol: Tolerances) -> bool:
    """Whether TF32 rounding of this matmul/conv's operands can account for its output error at
    most: each product moves by at most 2 TF32 units (2^-10 each, truncation's), so an output
    element by 2u (|A||B|)_ij <= 2u K max|a| max|b|, and the output's norm by 2u ||A|| ||B||."""
    ins = [(pos, lookup(t)) for pos, t in enumerate(node[9])]
    floats = [(pos, s) for pos, s in ins if s is not None and s.is_float and not s.uninit]
    operands = _operands(j.cls, floats)[:2]  # attention: its first product, q k^T
    outs = [s for s in (lookup(t) for t in node[10]) if s is not None and s.measured and s.is_float]
    if len(operands) != 2 or not outs:
        return True  # nothing to bound it by: as before, TF32-like
    (_, a), (_, b) = operands
    unit = 2.0 * TF32_EPS
    for out in outs:
        k = math.sqrt(max(a.numel * b.numel / max(out.numel, 1), 1.0))
        bound_ext = unit * k * a.amax * b.amax / max(out.amax, _TINY)
        bound_sys = unit * k * a.rms * b.rms / max(out.rms, _TINY)
        if out.e_ext > tol.margin * j.x[0] + bound_ext or out.e_sys > tol.margin * j.x[1] + bound_sys:
            return False
    return True


_BITWISE_MEMBERS = 3  # calls of an op its replay must give bit for bit before any other call must too
_BITWISE_RANK = 8  # informative calls a rank needs before they speak for ops with fewer calls of their own


def _bitwise_ops(ri: RankInput) -> dict[str, tuple[int, bool]]:
    """Ops whose replay gives this rank's calls bit for bit: the device computes them as this CPU
    does, so a call that differs in one bit (a fault far below any rounding budget) is wrong.
    Op name -> (the calls that speak for it, whether they are its own). An op speaks for itself with at least three calls
    reproduced, all but one in ten; an op with fewer is covered, unless its own calls say
    otherwise, when nine in ten of the rank's informative calls (ops that round, at least eight: no
    copy, max or single IEEE operation, which every device gives bit for bit) are reproduced: then
    this is the machine the run ran on."""
    names = {node[0]: node[4] for node in ri.nodes}
    same: dict[str, int] = defaultdict(int)
    other: dict[str, int] = defaultdict(int)
    rank_same = rank_other = 0
    for op_id, own in ri.own_errors.items():
        name = names.get(op_id)
        if name is None:
            continue
        if own.bitwise:
            same[name] += 1
        else:
            other[name] += 1
        if own.informative:
            rank_same += own.bitwise
            rank_other += not own.bitwise
    rank_held = rank_same >= _BITWISE_RANK and rank_other <= 0.1 * (rank_same + rank_other)
    held = {}
    for name in set(same) | set(other):
        if other[name] > max(1, 0.1 * (same[name] + other[name])):
            continue  # its own calls say the device computes it otherwise
        if same[name] >= _BITWISE_MEMBERS:
            held[name] = (same[name], True)
        elif rank_held:
            held[name] = (rank_same, False)
    return held


def _bounds_hold(ri: RankInput) -> bool:
    """Whether this rank's reduced-precision matmul/conv calls are reproduced within their
    accumulation bounds by some rounding of their operands (most of them, at least three): then
    the device's arithmetic is known, and a call no rounding reproduces is wrong."""
    names = {node[0]: node[4] for node in ri.nodes}
    best = [min(own.bounds) for op_id, own in ri.own_errors.items()
            if own.bounds and own.dtype == "float32" and classify(names.get(op_id, "")).precision_variable]
    return len(best) >= FIT_MEMBERS and quantile75(best) <= 1.0


def _replay_excess(own: OwnError, j: _Judged, tol: Tolerances, exact_matmul: bool, reduced: str | None) -> float:
    """How far an op's own error (numerics.replay) exceeds what an honest kernel makes: > 1 is a root.

    The bar is ``replay_margin`` times the honest replay's error, and at least ``replay_local``
    rounding units of the output's dtype (and one unit of the reduced precision a float32
    matmul/conv may run at). Where the honest replay is exact (no rounding happened), or the op is
    one correctly rounded IEEE operation, any other result is wrong.
    """
    floor = tol.replay_local * EPS.get(own.dtype, _FP32)
    if _reduced_matmul(own, j, exact_matmul, reduced):
        # The honest replay already multiplied inputs rounded to the reduced precision; never
        # ask for less than one of its units.
        floor = max(floor, REDUCED_EPS[reduced])
    if own.misrounded:
        return math.inf
    if math.isinf(own.honest):
        return 0.0  # an honest kernel overflows here too: the NaN/Inf rule decides
    if own.honest == 0.0:
        return math.inf if own.error > 0 else 0.0  # exact here: every correct kernel gives these bits
    return own.error / max(tol.replay_margin * own.honest, floor)


def _misfit_excess(own: OwnError, fit: ModelFit, tol: Tolerances) -> float:
    """How far a reduced-precision matmul/conv call strays from the rounding that reproduces the
    run's other calls of its op (``fit``), beyond ``replay_margin`` times their typical misfit:
    > 1 is a root, however far below the reduced precision's own error."""
    if fit.model >= len(own.fits):
        return 0.0
    return own.fits[fit.model] / (tol.replay_margin * fit.misfit)


def _reduced_matmul(own: OwnError, j: _Judged, exact_matmul: bool, reduced: str | None) -> bool:
    return bool(j.cls.precision_variable and reduced and own.dtype == "float32" and not exact_matmul)


def _replayed_root(
    j: _Judged, node: tuple, ri: RankInput, tol: Tolerances, exact_matmul: bool, fit: ModelFit | None,
    bounds_hold: bool = False, bitwise_ops: Mapping[str, tuple[int, bool]] | None = None,
) -> str:
    """The reason this op is a root by replay, or "" (not replayed, or within an honest kernel's error).

    A reduced-precision matmul/conv call that one of its replays reproduces within the
    accumulation bound is noise, even its op's only call. One that none reproduces is a root when
    the run's other such calls are reproduced (``bounds_hold``: the device's rounding is known);
    on an unknown device the ratio rule decides instead.
    """
    own = ri.own_errors.get(node[0])
    reduced = ri.reduced_precision
    if own is None or node[3] != "op":
        return ""
    reduced_call = bool(reduced and _reduced_matmul(own, j, exact_matmul, reduced))
    if reduced_call and fit is not None and _misfit_excess(own, fit, tol) > 1.0:
        how = REDUCED_MODELS[reduced][fit.model][0]
        return (f"its output lies {own.fits[fit.model]:.0f} float32 accumulation errors from a replay of its recorded "
                f"inputs rounded to {reduced} ({how}), a replay that matches this run's other {fit.members - 1} calls "
                f"of {node[4]} to within {fit.misfit:.1f} (own error {own.error:.2e}, an honest kernel's {own.honest:.1e})")
    # Bit-for-bit evidence outranks the accumulation bound, where it is the op's own: when a replay
    # gives the run's other calls of this matmul exactly, the device rounds (which operands, which
    # way, the bias added where) as that replay does, and this call should match too. The rank's
    # other ops cannot say that for a matmul with no calls of its own to show it.
    same_cpu, by_own_calls = (bitwise_ops or {}).get(node[4], (0, False))
    if same_cpu and not own.bitwise and (by_own_calls or not reduced_call):
        return _not_reproduced(own, reduced if reduced_call else None, same_cpu)
    if reduced_call and own.bounds and min(own.bounds) <= 1.0:
        return ""  # a float32 sum of its rounded operands' products gives this: noise, even as the only call
    if reduced_call and own.bounds and bounds_hold:
        return (f"its output lies {min(own.bounds):.3g}x the accumulation bound (from K, the operands' sizes and "
                f"float32's unit) away from every replay of its recorded inputs: rounded to {reduced} to nearest and "
                f"toward zero, and in float32 (own error {own.error:.2e}, an honest kernel's {own.honest:.1e})")
    if same_cpu and not own.bitwise:
        return _not_reproduced(own, reduced if reduced_call else None, same_cpu)
    if _replay_excess(own, j, tol, exact_matmul, reduced) > 1.0:
        if own.misrounded:
            return (f"its output is not the correctly rounded {own.dtype} result of its recorded inputs, which every "
                    f"IEEE 754 device gives (own error {own.error:.2e}, a replay in {own.dtype}: {own.honest:.2e})")
        if own.honest == 0:
            return f"own error {own.error:.2e} against a float64 replay of its recorded inputs, which {own.dtype} computes exactly"
        return (f"own error {own.error:.2e} against a float64 replay of its recorded inputs is "
                f"{own.error / own.honest:.0f}x what a replay in {own.dtype} makes ({own.honest:.1e})")
    return ""


def _not_reproduced(own: Any, reduced: str | None, calls: int) -> str:
    how = f"rounded to {reduced} " if reduced else ""
    return (f"its output differs from a replay in {own.dtype} on its recorded inputs {how}which gives this run's "
            f"other calls bit for bit ({calls} of them: the run computed as this CPU does; own error {own.error:.2e})")


def _structure_note(op_id: int, inputs: list[int], ri: RankInput) -> str:
    """Non-empty when the bench reads, at one of this op's inputs, what bench-only ops made of it
    (ops the target lacks, other than casts and copies)."""
    for pos in range(len(inputs)):
        region_id = ri.bench_only.get((op_id, pos))
        region = ri.regions.get(region_id) if region_id is not None else None
        if region is not None and region.kind != "pass-through":
            names = [n for n in region.bench_names if not n.startswith("source.")] or list(region.bench_names)
            return f"the bench applies {names[-1]} ({region.module or '<top>'}) to input {pos} and the target does not"
    return ""


# ---- regions -----------------------------------------------------------------------------------
#
# A region (tracecmp.comparison.align.find_regions) is judged like one op at its boundary: its
# outputs' error against the bench tensors they stand for, beside what its inputs carried in and
# what an honest implementation of the composite computation rounds. Both come from walking the
# side that spells the computation out op by op (the bench's decomposition when there is one, else
# the target's ops) with that side's recorded magnitudes: each op passes on its inputs' error the
# way its class does (the inherited error) and adds its own rounding, amplified by its condition
# (the honest budget), both carried on through the ops after it.


@dataclass
class _RegionJudged:
    """What the region's boundary shows (pass 1), for the verdict and the statuses."""

    region: Region
    judgeable: bool
    inputs_exact: bool
    outputs: list[tuple[int, TensorState]]  # (target tensor id, measured state)
    e: tuple[float, float, float] = (0.0, 0.0, 0.0)  # the worst output's measured error per channel
    x: tuple[float, float, float] = (0.0, 0.0, 0.0)  # inherited error
    r: tuple[float, float, float] = (0.0, 0.0, 0.0)  # honest rounding budget
    worst: int | None = None  # target tensor id of the worst output
    inputs_finite: bool = True
    given: bool = False  # a member was handed a NaN/Inf as an argument


def _past_bench_cast(s: TensorState | None, ri: RankInput, region_id: int | None) -> TensorState | None:
    """The error an input shows against what the bench op really reads when a bench-only cast
    (autocast's ``_to_copy``) sits between: the input's own, plus that dtype's rounding."""
    if s is None or region_id is None:
        return s
    region = ri.regions.get(region_id)
    if region is None or region.kind != "pass-through":
        return s
    unit = max((v.unit for (side, _), v in _region_made(ri, region, "b")), default=0.0)
    if unit <= 0.0:
        return s
    seen = copy.copy(s)
    seen.exact = False
    seen.c_ext, seen.c_sys = s.c_ext + unit, s.c_sys + unit
    seen.c_rms = s.c_rms + unit if not math.isnan(s.c_rms) else unit
    return seen


def _region_made(ri: RankInput, region: Region, side: str) -> list[tuple[tuple[str, int], TensorState]]:
    ops = region.bench_ops if side == "b" else region.target_ops
    out = []
    for o in ops:
        entry = ri.region_ops.get((side, o))
        if entry is None:
            continue
        for tid in entry[4]:
            value = ri.region_values.get((side, tid))
            if value is not None:
                out.append(((side, tid), value))
    return out


def _judge_region(region: Region, ri: RankInput, lookup: Callable[[int], TensorState | None], tol: Tolerances,
                  exact_matmul: bool = False) -> _RegionJudged:
    """Pass-1 numbers of a region: its outputs' error, what its inputs carried in, its honest budget."""
    base = ri.view_base
    outputs = []
    for T, _ in region.outputs:
        m = ri.measured.get(base.get(T, T))
        if m is not None:
            outputs.append((T, m))
    ins = [(T, lookup(T)) for T, _ in region.inputs if T is not None]
    unknown = any(s is None or not s.known for _, s in ins)
    known = [s for _, s in ins if s is not None and not s.uninit]
    judged = _RegionJudged(
        region, judgeable=bool(outputs) and not unknown, inputs_exact=not unknown and all(s.exact for s in known),
        outputs=outputs, inputs_finite=not any(s.nonfinite for s in known),
        given=_region_given(region, ri),
    )
    if any(s.nonfinite_mismatch for s in known) or any(not s.exact for s in known if not s.is_float):
        judged.judgeable = False  # NaN or a changed index/mask reaching it: its arithmetic is not on trial
    if not judged.judgeable:
        return judged
    predicted = _region_prediction(region, ri, lookup, tol, exact_matmul)
    best = -math.inf
    for T, m in outputs:
        if not m.is_float or (m.nonfinite_mismatch and (m.given or judged.given)):
            continue  # NaN/Inf the program handed in, which differ from the bench's: no statistic reads through them
        x, r = predicted.get(T, ((math.inf,) * 3, (math.inf,) * 3))
        e = (m.e_ext, m.e_sys, m.e_rms)
        ratio = max(((ec - tol.margin * xc) / max(tol.local * rc, _TINY) for ec, xc, rc in zip(e, x, r)
                     if not math.isnan(ec) and math.isfinite(xc)), default=-math.inf)
        if ratio > best:
            best, judged.e, judged.x, judged.r, judged.worst = ratio, e, x, r, T
    if judged.worst is None:
        judged.judgeable = False
    return judged


def _region_given(region: Region, ri: RankInput) -> bool:
    return any(given_nonfinite(ri.region_ops[(side, o)][2]) for side, ops in (("t", region.target_ops), ("b", region.bench_ops))
               for o in ops if (side, o) in ri.region_ops)


def _region_prediction(
    region: Region, ri: RankInput, lookup: Callable[[int], TensorState | None], tol: Tolerances, exact_matmul: bool = False,
) -> dict[int, tuple[tuple[float, float, float], tuple[float, float, float]]]:
    """Per target output of ``region``: (inherited error, honest rounding budget) per channel."""
    # The side that spells the computation out in more ops (the decomposition) models it best.
    computing = {side: sum(1 for o in ops if ri.region_ops.get((side, o), ("",))[0] == "op")
                 for side, ops in (("t", region.target_ops), ("b", region.bench_ops))}
    side = "b" if computing["b"] >= computing["t"] and computing["b"] else "t"
    ops = region.bench_ops if side == "b" else region.target_ops
    base = ri.view_base
    # The region's output dtypes: a fused kernel rounds at least to them, whatever the bench used.
    floor = max((ri.measured[base.get(T, T)].unit for T, _ in region.outputs if base.get(T, T) in ri.measured), default=0.0)
    inherited: dict[int, TensorState] = {}
    budget: dict[int, TensorState] = {}
    for T, B in region.inputs:
        key = B if side == "b" else T
        if key is None:
            continue
        s = lookup(T) if T is not None else None
        if s is None:
            s = ri.region_values.get((side, key)) or TensorState(known=True, exact=True)
        inherited[key] = s
        budget[key] = _with_error(s, (0.0, 0.0, 0.0))
    for o in ops:
        entry = ri.region_ops.get((side, o))
        if entry is None:
            continue
        kind, op, args, inputs, outputs = entry
        if kind != "op":
            # A view (or a source inside the region): shows its input's values, or is a constant.
            src = inherited.get(inputs[0]) if inputs else None
            for tid in outputs:
                inherited[tid] = _through_view(src) if src is not None else TensorState(known=True, exact=True)
                budget[tid] = budget.get(inputs[0], inherited[tid]) if inputs else inherited[tid]
            continue
        cls = classify(op)
        # Rounding is relative to each element: a denominator's unit is the quotient's unit, not
        # max|x| / min|x| of them (that factor is for an error spread evenly over small and large).
        budget_cls = replace(cls, inverse_inputs=())
        for index, tid in enumerate(outputs):
            out = ri.region_values.get((side, tid))
            if out is None or cls.kind == "uninit":
                continue
            read = read_by(op, args, inputs, index)
            ins_x = [(pos, inherited[t]) for pos, t in read if t in inherited and cls.input_rule(pos) != "ignore"]
            ins_r = [(pos, budget[t]) for pos, t in read if t in budget and cls.input_rule(pos) != "ignore"]
            float_x = [(pos, s) for pos, s in ins_x if s.is_float and not s.uninit]
            float_r = [(pos, s) for pos, s in ins_r if s.is_float and not s.uninit]
            if not out.is_float:
                exact = all(s.exact for _, s in ins_x)
                inherited[tid] = _with_error(out, (0.0 if exact else 1.0,) * 3, exact=exact)
                budget[tid] = _with_error(out, (0.0,) * 3)
                continue
            x = _expected(cls, base_name(op), float_x, out) if cls.kind != "factory" else (0.0, 0.0, 0.0)
            carried = _expected(budget_cls, base_name(op), float_r, out) if cls.kind != "factory" else (0.0, 0.0, 0.0)
            unit, lam, tf32 = max(out.unit, floor), (2.0 if cls.accumulates else 1.0), False
            if cls.precision_variable and tol.allow_tf32 and not exact_matmul and 0 < unit <= _FP32 and _contracts_nonzero(cls, float_x):
                unit, lam, tf32 = TF32_EPS, 0.5, True
            fresh = unit * lam * (_local_kappa(cls, float_x, out) if cls.accumulates else 1.0)
            own = (fresh, _averaged_rounding(fresh, out, tf32), fresh)
            inherited[tid] = _with_error(out, x)
            budget[tid] = _with_error(out, tuple(c + f for c, f in zip(carried, own)))
    result = {}
    for T, B in region.outputs:
        key = B if side == "b" else T
        if key in inherited and key in budget:
            x, r = inherited[key], budget[key]
            result[T] = ((x.e_ext, x.e_sys, x.e_rms if not math.isnan(x.e_rms) else x.e_ext),
                         (r.e_ext, r.e_sys, r.e_rms if not math.isnan(r.e_rms) else r.e_ext))
    return result


def _with_error(s: TensorState, e: tuple[float, ...], exact: bool | None = None) -> TensorState:
    out = copy.copy(s)
    out.e_ext, out.e_sys, out.e_rms = (float(v) for v in e)
    out.c_ext, out.c_sys, out.c_rms = out.e_ext, out.e_sys, out.e_rms
    out.exact = all(v == 0.0 for v in e) if exact is None else exact
    out.known = True
    return out


def _region_roots(
    ri: RankInput, judged: Mapping[int, _RegionJudged], verdicts: dict[int, NodeVerdict], tol: Tolerances,
    exact_matmul: bool, roots: list[tuple[tuple, Divergence]],
) -> set[int]:
    """Decide every judged region (and replay roots among target members); returns the root regions."""
    nodes = {node[0]: node for node in ri.nodes if node[0] in ri.member_of}
    root_regions: set[int] = set()
    for region_id, j in judged.items():
        region = j.region
        kind, reason, op_id, score = _decide_region(j, ri, tol)
        if not kind:
            continue
        root_regions.add(region_id)
        _add_region_root(ri, region, nodes, verdicts, roots, op_id, kind, reason, score, j)
    # A member op whose own replay is far from an honest kernel's is named itself.
    for op_id, node in nodes.items():
        own = ri.own_errors.get(op_id)
        region_id = ri.member_of[op_id]
        if own is None or node[3] != "op" or region_id in root_regions:
            continue
        cls = classify(node[4])
        probe = _Judged(0, op_id, (node[4], own.dtype), cls, False, False, False, (0.0,) * 3, (0.0,) * 3, (1.0,) * 3,
                        1.0, False, True, True, 1.0)
        reason = _replayed_root(probe, node, ri, tol, exact_matmul, None)
        if not reason:
            continue
        root_regions.add(region_id)
        score = own.error / EPS.get(own.dtype, _FP32)
        _add_region_root(ri, ri.regions[region_id], nodes, verdicts, roots, op_id, "computation", reason, score, None,
                         own=own)
    return root_regions


def _decide_region(j: _RegionJudged, ri: RankInput, tol: Tolerances) -> tuple[str, str, int | None, float]:
    """(root kind or "", reason, the target op to name, score in rounding units)."""
    region = j.region
    name = _region_name(region)
    worst_nan = [(T, s) for T, s in j.outputs if s.nonfinite and s.nonfinite_mismatch]
    if worst_nan and j.inputs_finite and not j.given:
        return ("nan", f"NaN/Inf appear in the output of {name} although every input is finite (the bench's is not)",
                _producer(ri, region, worst_nan[0][0]), math.inf)
    if not j.outputs or all(s.exact for _, s in j.outputs):
        return "", "", None, 0.0
    replay = ri.region_replays.get(region.region_id)
    if replay is not None:
        unit = EPS.get(replay.dtype, _FP32)
        if replay.sides_differ > _SIDES_DIFFER:
            return ("computation", f"{name}: the target's ops and the bench's compute different functions: on the "
                    f"target's recorded inputs their float64 replays differ by {replay.sides_differ:.2e}",
                    _producer(ri, region, replay.output), replay.sides_differ / unit)
        excess = replay.error / max(tol.replay_margin * replay.honest, tol.replay_local * unit)
        if excess > 1.0:
            against = "its own ops" if replay.reference == "target" else "the bench's ops"
            return ("computation", f"{name}: own error {replay.error:.2e} against a float64 replay of {against} on "
                    f"its recorded inputs is {replay.error / max(replay.honest, _TINY):.0f}x what an honest replay "
                    f"makes ({replay.honest:.1e})", _producer(ri, region, replay.output), replay.error / unit)
    if not j.judgeable:
        return "", "", None, 0.0
    channels = ("max/min", "norm/mean", "rms")
    excess = [((e - tol.margin * x) / max(tol.local * r, _TINY), c, e, x)
              for c, (e, x, r) in enumerate(zip(j.e, j.x, j.r)) if not math.isnan(e) and math.isfinite(x)]
    if not excess:
        return "", "", None, 0.0
    score, c, e, x = max(excess)
    if score <= 1.0:
        return "", "", None, 0.0
    what = f"relative error {e:.2e} ({channels[c]})"
    unit = max(j.r[c], _TINY)
    if not region.bench_ops and region.kind != "pass-through":
        reason = f"target-only ops ({name}) change the values: {what}"
        return "structure", reason, _producer(ri, region, j.worst), (e - x) / unit
    if j.inputs_exact:
        reason = f"{name}: output differs ({what}) while every input agrees bitwise"
    elif x > 0:
        reason = f"{name}: output error {e:.2e} ({channels[c]}) is {e / x:.0f}x what its inputs carried in ({x:.1e})"
    else:
        reason = f"{name}: output error {e:.2e} ({channels[c]}) beyond an honest implementation's rounding ({j.r[c]:.1e})"
    return "computation", reason, _producer(ri, region, j.worst), (e - x) / unit


# Two float64 replays of the same function by different ops differ by float64 rounding times the
# computation's condition (1e-13 for attention); a different eps or scale moves them by 1e-7 or more.
_SIDES_DIFFER = 1e-9


def _region_name(region: Region) -> str:
    def ops(names: tuple[str, ...]) -> str:
        computing = [n for n in names if not n.startswith("source.")]
        shown = ", ".join(dict.fromkeys(base_name(n) for n in computing[:6]))
        return shown + (", ..." if len(computing) > 6 else "")

    if not region.bench_ops:
        return ops(region.target_names)
    if not region.target_ops:
        return f"bench-only {ops(region.bench_names)}"
    return f"region {region.region_id} ({region.kind}: {ops(region.target_names)} against the bench's {ops(region.bench_names)})"


def _producer(ri: RankInput, region: Region, tid: int | None) -> int | None:
    """The target op that made ``tid`` (or the region's one computing op)."""
    computing = [o for o in region.target_ops if ri.region_ops.get(("t", o), ("",))[0] == "op"]
    if len(computing) == 1:
        return computing[0]
    wanted = {tid, ri.view_base.get(tid, tid)} if tid is not None else set()
    for o in computing:
        if wanted & set(ri.region_ops[("t", o)][4]):
            return o  # the op that computed the worst output's values, not a view of them
    return computing[-1] if computing else (region.target_ops[-1] if region.target_ops else None)


def _add_region_root(
    ri: RankInput, region: Region, nodes: Mapping[int, tuple], verdicts: dict[int, NodeVerdict],
    roots: list[tuple[tuple, Divergence]], op_id: int | None, kind: str, reason: str, score: float,
    j: _RegionJudged | None, own: OwnError | None = None,
) -> None:
    if op_id is None or op_id not in nodes:
        return
    op_id_, step, phase, node_kind, op, name, module, location, args, inputs, outputs, random, stack = nodes[op_id]
    verdict = verdicts[op_id]
    metrics: dict[str, float] = {}
    if j is not None:
        for label, e, x, r in zip(("ext", "sys", "rms"), j.e, j.x, j.r):
            if not math.isnan(e):
                metrics[f"rel_err_{label}"] = float(e)
                if math.isfinite(x):
                    metrics[f"expected_{label}"] = float(x)
                metrics[f"budget_{label}"] = float(r)
    replay = own or ri.region_replays.get(region.region_id)
    if replay is not None:
        metrics.update(own_error=replay.error, honest_error=replay.honest)
        if isinstance(replay, RegionReplay) and not math.isnan(replay.sides_differ):
            metrics["sides_differ"] = replay.sides_differ
    verdict.root_kind, verdict.reason, verdict.metrics = kind, reason, metrics
    verdict.introduced = score
    bench_op = region.bench_ops[-1] if region.bench_ops else None
    roots.append(((int(step), int(op_id), ri.rank), Divergence(
        op=op, module=module, phase=phase, step=int(step), location=location, op_id=int(op_id),
        bench_op_id=None if bench_op is None else int(bench_op), rank=ri.rank, kind=kind, reason=reason,
        score=float(score), metrics=metrics, stack=stack, region=region.region_id,
    )))


def _region_status(region: Region, j: _RegionJudged | None, root: bool, lookup: Callable[[int], TensorState | None]) -> str:
    if j is None or not j.outputs:
        return "uncompared"
    states = [s for _, s in j.outputs]
    if any(s.nonfinite_mismatch and not (s.given or j.given) for s in states):
        return "nan"
    if len(j.outputs) < len(region.outputs):
        return "uncompared"
    if all(s.exact for s in states):
        return "agrees"
    ins = [lookup(T) for T, _ in region.inputs if T is not None]
    if root or any(s is not None and s.tainted for s in ins):
        return "diverged"
    return "noise"
