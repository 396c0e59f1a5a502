"""Predictions: the error a node's outputs would show if the op itself were exact, from its inputs'
errors and the op's propagation class (condition factors from the bench's magnitudes).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Callable, Mapping

from tracecmp.aten.opclass import OpClass, is_copy
from tracecmp.comparison.adam import adam_update_bound
from tracecmp.comparison.localize.records import CAP, JudgedNode
from tracecmp.comparison.tolerances import Tolerances
from tracecmp.graph.nodes import Node, TensorState
from tracecmp.numerics.units import TINY, reduced_unit

_LINEAR_UNARY = {"mul", "mul_", "div", "div_", "true_divide", "neg", "neg_"}


def _inverse_factor(s: TensorState) -> float:
    """max|x| / min|x| of the bench values (CAP when they cross zero): how 1/x amplifies relative error."""
    if s.lo <= 0.0 <= s.hi:
        return CAP
    small = min(abs(s.lo), abs(s.hi))
    return min(CAP, max(1.0, max(abs(s.lo), abs(s.hi)) / max(small, TINY)))


def _norm_condition(x: TensorState, rstd: TensorState | None) -> float:
    """How much normalizing ``x`` amplifies its relative error: rms(x) over the spread it is divided
    by. The op's own inverse-spread output gives that spread row by row (rms(x) * rms(rstd)); the
    tensor-wide mean gives it only where every row has the same mean (rms(x) / std(x))."""
    kappa = x.rms / max(x.spread, TINY)
    if rstd is not None and rstd.measured and rstd.rms > 0:
        kappa = max(kappa, x.rms * rstd.rms)
    return min(CAP, max(1.0, kappa))


def _normalize_expected(
    cls: OpClass, role: str, ins: list[tuple[int, TensorState]], out: TensorState, rstd: TensorState | None
) -> tuple[float, float, float, float]:
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
    amax_o, rms_o = max(out.amax, TINY), max(out.rms, TINY)
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
            to_normalized = s.rms / max(x_state.spread, TINY)
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


@dataclass(frozen=True)
class _Shape:
    """What :func:`predicted_error` knows of the output before it weighs each input."""

    out: TensorState
    amax_o: float  # the output's largest magnitude, at least TINY
    rms_o: float  # its RMS, at least TINY
    unary: bool  # a single full-size input decides the output's extremes
    full: list[int]  # positions of the full-size inputs
    contract_pair: set[int]  # positions of a contraction's two operands
    kappa_contract: float  # a two-operand contraction's condition factor


def predicted_error(
    cls: OpClass,
    name: str,
    ins: list[tuple[int, TensorState]],
    out: TensorState,
    role: str = "",
    rstd: TensorState | None = None,
) -> tuple[float, float, float]:
    """Error (ext, sys, rms channels) the output would show if the op were exact and only inputs were off.

    ``role`` is what the output is among the op's outputs (normalization ops), ``rstd`` the
    inverse spread a normalization op reported alongside (its condition, row by row).
    """
    if cls.kind == "normalize":
        ext, sys_, env, env_sys = _normalize_expected(cls, role, ins, out, rstd)
        neff = max(out.numel * (out.rms / out.amax) ** 2, 1.0) if out.amax > 0 else 1.0
        return ext, sys_ + env_sys / math.sqrt(neff), env
    amax_o, rms_o = max(out.amax, TINY), max(out.rms, TINY)
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
    shape = _Shape(out, amax_o, rms_o, unary, full, contract_pair, kappa_contract)
    for pos, s in ins:
        rule = cls.input_rule(pos)
        if rule == "ignore":
            continue
        lvl = s.level
        env_before = env
        d_ext, d_sys, d_env = _input_share(cls, name, rule, pos, s, shape)
        ext += d_ext
        sys_ += d_sys
        env += d_env
        # The norm/mean channel's random envelope, from the typical (not the worst) error level.
        if not (linear and pos in full) and lvl > 0:
            env_sys += (env - env_before) * min(1.0, s.mix_level / lvl)
    return ext, sys_ + env_sys / math.sqrt(neff), env


def _input_share(
    cls: OpClass, name: str, rule: str, pos: int, s: TensorState, shape: _Shape
) -> tuple[float, float, float]:
    """What one input's error adds to the output's (ext, sys, env) under the op's rule for it."""
    kind, amax_o, rms_o, out = cls.kind, shape.amax_o, shape.rms_o, shape.out
    unary, full, contract_pair, kappa_contract = shape.unary, shape.full, shape.contract_pair, shape.kappa_contract
    lvl = s.level
    abs_err = lvl * s.rms
    if rule == "add":
        ext = s.c_ext * s.amax / amax_o
        sys_ = s.c_sys * s.rms / rms_o
        env = abs_err / rms_o
    elif rule == "selector":
        # Only elements whose sign the error flips change: a fraction ~ the relative error
        # (Gaussian-like values: 0.8 x), each moving the norm and mean by about its own size.
        ext = 1.0 if not s.exact else 0.0
        sys_ = s.mix_level
        env = s.mix_level
    elif rule == "exp" or kind == "exp":
        lip = cls.lipschitz if kind == "exp" else 1.0
        ext = lip * abs_err
        sys_ = lip * s.c_sys * s.rms
        env = lip * abs_err
    elif kind in ("copy", "lipschitz") or (kind == "contract" and pos not in contract_pair):
        lip = cls.lipschitz
        # With several full-size inputs (a weight plus its update) the output's extremes sit
        # where another input decides them, so they carry this input's error at some element,
        # up to the tail of its error spread (Gaussian: sqrt(2 ln n) of its RMS), not its RMS.
        tail = 1.0 if unary or s.numel <= 1 else math.sqrt(2.0 * math.log(s.numel))
        ext = lip * tail * abs_err / amax_o
        sys_ = lip * s.c_sys * s.rms / rms_o
        env = lip * abs_err / rms_o
    elif kind == "product":
        kappa = _inverse_factor(s) if pos in cls.inverse_inputs else cls.lipschitz
        if name.startswith("pow") or name == "square":
            kappa *= 2.0
        ext = kappa * (s.c_ext if (unary and pos in full) or s.numel == 1 else lvl)
        sys_ = kappa * s.c_sys
        env = kappa * lvl
    elif kind == "reduce":
        # A mean moves by at most the largest input error (|d mean| <= max |d x|), a sum of K
        # terms by sqrt(K) of it for independent errors; relative to the output that is an
        # absolute-error rule, and a relative one (condition factor) for the same error spread.
        k = max(s.numel / max(out.numel, 1), 1.0)
        lip = 1.0 if cls.mean_like else math.sqrt(k)
        kappa = s.rms / (math.sqrt(k) * rms_o) if cls.mean_like else math.sqrt(k) * s.rms / rms_o
        kappa = min(CAP, max(1.0, kappa))
        mix = s.mix_level
        ext = max(kappa * mix, lip * abs_err / amax_o)
        sys_ = max(kappa * s.c_sys, lip * s.c_sys * s.rms / rms_o)
        env = max(kappa * mix, lip * abs_err / rms_o)
    else:
        if kind == "contract":
            kappa = kappa_contract
        else:  # other: unknown semantics, be generous both ways
            kappa = 4.0
        mix = max(lvl, abs_err / amax_o, abs_err / rms_o) if kind == "other" else s.mix_level
        ext = kappa * mix
        sys_ = kappa * s.c_sys
        env = kappa * mix
    return ext, sys_, env


def within_adam_bound(
    x: tuple[float, float, float],
    node: Node,
    position: int,
    producer: Mapping[int, tuple[tuple, int]],
    lookup: Callable[[int], TensorState | None],
    view_base: Mapping[int, int],
    out: TensorState,
) -> tuple[float, float, float]:
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
    s = lookup(param) if param not in view_base else through_view(lookup(param))
    if s is None or not s.known:
        return x
    amax_o, rms_o = max(out.amax, TINY), max(out.rms, TINY)
    held = predicted_error(OpClass("product", inputs=((0, "add"),)), "addcdiv_", [(0, s)] if s.is_float else [], out)
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


STRICT_KAPPA = 16.0  # above this condition factor a sum's bitwise change needs magnitude to count


_VIEW = 2.0  # a view shows part of its base: its largest error may sit away from the base's extremes


def through_view(s: TensorState | None) -> TensorState | None:
    """The state an op sees through a view of ``s``: the base's, with the extreme error widened."""
    if s is None or s.exact or _VIEW == 1.0:
        return s
    seen = copy.copy(s)
    seen.c_ext = s.c_ext * _VIEW
    return seen


def contracts_nonzero(cls: OpClass, ins: list[tuple[int, TensorState]]) -> bool:
    """Both operands of a matmul/conv are non-zero (a product with zeros is exact at any precision)."""
    operands = _operands(cls, ins)
    return len(operands) >= 2 and all(s.amax > 0 for _, s in operands)


# Tuning constants (set on the fault-injection benchmark's kept traces, see benchmarks/localization).
def local_kappa(cls: OpClass, ins: list[tuple[int, TensorState]], out: TensorState, role: str = "") -> float:
    """How much the op's own rounding (one unit per partial sum) is amplified relative to its output:
    the condition factor of a sum or product whose terms cancel (1 when nothing cancels)."""
    rms_o = max(out.rms, TINY)
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
        return min(_KAPPA_CAP, max(1.0, s.rms / max(s.spread, TINY)))
    return 1.0


# Rounding bias of an op that applies one constant to every element, in units of its dtype, is up
# to _ROUNDING_BIAS * sqrt(unit) = 2 * 2^(-p/2) for p mantissa bits (bf16 0.18, fp16 0.06): over
# the 2^p mantissas the rounding errors of x * c do not cancel (measured over random constants).
_ROUNDING_BIAS = 2.0


_ONE_MAGNITUDE = 0.9  # rms / max |x| above which a tensor's values count as one magnitude


def averaged_rounding(unit: float, out: TensorState, tf32: bool) -> float:
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


def within_tf32(
    j: JudgedNode, node: Node, lookup: Callable[[int], TensorState | None], tol: Tolerances, reduced: str | None
) -> bool:
    """Whether TF32 rounding (or the declared ``reduced`` precision's) of this matmul/conv's operands
    can account for its output error at most: each product moves by at most 2 units (TF32's 2^-10
    each, truncation's), so an output element by 2u (|A||B|)_ij <= 2u K max|a| max|b|, and the
    output's norm by 2u ||A|| ||B||."""
    ins = [(pos, lookup(t)) for pos, t in enumerate(node.inputs)]
    floats = [(pos, s) for pos, s in ins if s is not None and s.is_float and not s.uninit]
    operands = _operands(j.cls, floats)[:2]  # attention: its first product, q k^T
    outs = [s for s in (lookup(t) for t in node.outputs) if s is not None and s.measured and s.is_float]
    if len(operands) != 2 or not outs:
        return True  # nothing to bound it by: as before, TF32-like
    (_, a), (_, b) = operands
    unit = 2.0 * reduced_unit(reduced)
    for out in outs:
        k = math.sqrt(max(a.numel * b.numel / max(out.numel, 1), 1.0))
        bound_ext = unit * k * a.amax * b.amax / max(out.amax, TINY)
        bound_sys = unit * k * a.rms * b.rms / max(out.rms, TINY)
        if out.e_ext > tol.margin * j.x[0] + bound_ext or out.e_sys > tol.margin * j.x[1] + bound_sys:
            return False
    return True
