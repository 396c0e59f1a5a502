"""Adam's parameter update, recognized in the recorded graph, and the bound its structure gives.

Localization predicts the error of ``param.addcdiv_(m, d, value=-step_size)`` from its inputs'
statistics, and a division is only as well conditioned as its smallest denominator: where a
gradient was zero (rows of an embedding table a batch did not read), ``d`` is ``eps`` and the
prediction is the whole parameter's range. Adam's arithmetic bounds the quotient element by
element, however: ``m`` and ``v`` average the same gradients (``m = lerp(m, g, 1 - b1)``,
``v = b2 v + (1 - b2) g^2``), so by Cauchy-Schwarz, after t steps from zero,

    |m| <= (1 - b1) / sqrt(1 - b2) * sqrt((1 - r^t) / (1 - r)) * sqrt(v),    r = b1^2 / b2,

and with ``d = sqrt(v) / c + eps`` (``c``: the bias correction sqrt(1 - b2^t)) every element of the
update, in either run, is at most ``step_size * c`` times that factor: ``lr`` at the first step.
Two runs' updates then differ by at most twice that, whatever the gradients were.

The ops are those of ``torch.optim.Adam``/``AdamW``: in the single-tensor and ``foreach``
implementations ``lerp_``, ``mul_``, ``addcmul_``, ``sqrt``, ``div``, ``add_``, ``addcdiv_``,
recognized from the graph; the fused kernel (``_fused_adam_``, ``_fused_adamw_``) by name, its
step number read from its ``state_steps`` tensors. AMSGrad's denominator (the largest ``v`` so
far) is no smaller, so the bound holds for it too; the unfused AMSGrad graph is not recognized.

>>> round(adam_quotient_bound(0.9, 0.999, 1), 6)  # m / sqrt(v) = g / |g| after the first step
3.162278
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

from tracecmp.aten.opclass import base_name, read_by, recorded_args, tensor_list_length

# How far rounded moments (bf16 optimizer state) may step over the exact bound.
_SLACK = 1.1

_ADDCDIV = ("addcdiv_", "addcdiv", "_foreach_addcdiv_", "_foreach_addcdiv")
_FUSED = ("_fused_adam_", "_fused_adamw_", "_fused_adam", "_fused_adamw")
ADAM_UPDATES = frozenset(_ADDCDIV + _FUSED)  # ops whose outputs may be Adam's parameter update
_ADD = ("add_", "add", "_foreach_add_", "_foreach_add")
_DIV = ("div_", "div", "_foreach_div_", "_foreach_div")
_SQRT = ("sqrt", "sqrt_", "_foreach_sqrt", "_foreach_sqrt_")
_ADDCMUL = ("addcmul_", "addcmul", "_foreach_addcmul_", "_foreach_addcmul")
_MUL = ("mul_", "mul", "_foreach_mul_", "_foreach_mul")
_LERP = ("lerp_", "lerp", "_foreach_lerp_", "_foreach_lerp")

Node = tuple  # a RankInput node: (op_id, step, phase, kind, op, name, module, location, args, inputs, outputs, ...)


def adam_quotient_bound(beta1: float, beta2: float, steps: float) -> float:
    """The largest |m| / sqrt(v) Adam's moments reach after ``steps`` updates from zero (math.inf: any number).

    >>> round(adam_quotient_bound(0.9, 0.999, math.inf), 3)
    7.27
    """
    r = beta1 * beta1 / beta2
    geometric = 1.0 / (1.0 - r) if math.isinf(steps) else (1.0 - r**steps) / (1.0 - r)
    return (1.0 - beta1) / math.sqrt(1.0 - beta2) * math.sqrt(geometric)


def adam_update_bound(
    node: Node,
    index: int,
    producer: Mapping[int, tuple[Node, int]],
    view_base: Mapping[int, int],
    value_of: Callable[[int], float | None],
) -> tuple[int, float] | None:
    """(parameter tensor id, B) when output ``index`` of ``node`` is Adam's update of a parameter,
    ``p + value * m / (sqrt(v) / c + eps)``, with B bounding ``|value * m / (sqrt(v) / c + eps)|``
    element by element in any run; None when the node is not such an update.

    ``producer`` maps each tensor id (view bases) to the node that made it and its output position;
    ``value_of`` gives a one-element tensor's value where both runs hold the same (a step count).
    """
    if base_name(node.op) in _FUSED:
        return _fused_update_bound(node, index, value_of)
    if base_name(node.op) not in _ADDCDIV:
        return None
    read, scalar = _call(node, index)
    value = scalar("value", "scalars")
    if len(read) < 3 or value is None:
        return None

    def made(tid: int, names: tuple[str, ...]) -> tuple[dict[int, int], Any] | None:
        found = producer.get(view_base.get(tid, tid))
        if found is None or base_name(found[0][4]) not in names:
            return None
        return _call(*found)

    def same(a: int, b: int) -> bool:
        return view_base.get(a, a) == view_base.get(b, b)

    denominator = made(read[2], _ADD)
    if denominator is None or denominator[1]("other", "scalar") is None or len(denominator[0]) != 1:
        return None
    eps = denominator[1]("other", "scalar") * (denominator[1]("alpha") or 1.0)
    root, correction = denominator[0][0], 1.0
    divided = made(root, _DIV)
    if divided is not None:
        correction = divided[1]("other", "scalar", "scalars") or 0.0
        root = divided[0].get(0, -1)
    rooted = made(root, _SQRT)
    if eps < 0 or not 0 < correction <= 1 or rooted is None:
        return None
    second = made(rooted[0].get(0, -1), _ADDCMUL)
    first = made(read[1], _LERP)
    if second is None or first is None or len(second[0]) < 3 or len(first[0]) < 2:
        return None
    grad = second[0][1]
    one_minus_beta2, weight = second[1]("value"), first[1]("weight")
    if one_minus_beta2 is None or weight is None or not same(grad, second[0][2]) or not same(grad, first[0][1]):
        return None
    beta1, beta2 = 1.0 - weight, 1.0 - one_minus_beta2
    decayed = made(second[0][0], _MUL)  # v's previous value times beta2
    if (
        decayed is None
        or not 0 <= beta1 < 1
        or not 0 < beta2 < 1
        or beta1 * beta1 >= beta2
        or not math.isclose(decayed[1]("other", "scalar") or 0.0, beta2, rel_tol=1e-9)
    ):
        return None
    # The step number from the bias correction c = sqrt(1 - beta2^t); none (c = 1), or one that is
    # no whole number, leaves t unknown: the bound for any t.
    steps = math.log1p(-correction * correction) / math.log(beta2) if correction < 1 else math.inf
    if not math.isinf(steps) and abs(steps - round(steps)) > 1e-3 * max(steps, 1.0):
        steps = math.inf
    bound = abs(value) * correction * adam_quotient_bound(beta1, beta2, round(steps) if math.isfinite(steps) else steps)
    return read[0], bound * _SLACK


def _fused_update_bound(node: Node, index: int, value_of: Callable[[int], float | None]) -> tuple[int, float] | None:
    """The bound for output ``index`` of a fused Adam kernel: its parameters come first, and
    parameter k took step ``state_steps[k]`` (counted up before the call) with ``lr``, ``beta1``
    and ``beta2`` as recorded."""
    parsed, n = recorded_args(node.args), tensor_list_length(node.args)
    inputs = node.inputs
    lr, beta1, beta2 = (parsed.get(name) for name in ("lr", "beta1", "beta2"))
    if index >= n or not all(isinstance(v, float) and math.isfinite(v) for v in (lr, beta1, beta2)):
        return None
    params, steps = parsed.get("self"), parsed.get("state_steps")
    if not isinstance(params, list) or not isinstance(steps, list) or len(params) != n or len(steps) != n:
        return None
    param, step = (entry.get("tensor") if isinstance(entry, dict) else None for entry in (params[index], steps[index]))
    if (
        not isinstance(param, int)
        or not isinstance(step, int)
        or not (0 <= param < len(inputs) and 0 <= step < len(inputs))
    ):
        return None
    t = value_of(inputs[step])
    if t is None or t < 1 or t != round(t) or not 0 <= beta1 < 1 or not 0 < beta2 < 1 or beta1 * beta1 >= beta2:
        return None
    correction1, correction2 = 1.0 - beta1**t, 1.0 - beta2**t
    bound = lr / correction1 * math.sqrt(correction2) * adam_quotient_bound(beta1, beta2, t)
    return inputs[param], bound * _SLACK


def _call(node: Node, index: int) -> tuple[dict[int, int], Any]:
    """The tensors output ``index`` of ``node`` reads, by argument position (a multi-tensor op's
    element ``index``), and a reader of its scalar arguments by name, the element of a list."""
    op, args, inputs = node.op, node.args, node.inputs
    read = dict(read_by(op, args, inputs, index))
    parsed = recorded_args(args)
    n = tensor_list_length(args) if base_name(op).startswith("_foreach_") else 0
    k = index % n if n else 0

    def scalar(*names: str) -> float | None:
        for name in names:
            v = parsed.get(name)
            if isinstance(v, list) and n and len(v) == n:
                v = v[k]
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                return float(v)
        return None

    return read, scalar
