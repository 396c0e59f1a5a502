"""Operator arguments as a trace holds them: a call's non-tensor arguments as JSON text, and the
memory order of the tensors it saves.

Capture turns a call's non-tensor arguments into the ops table's ``args`` column: JSON with every
tensor as ``{"tensor": i}``, its position among the call's tensor inputs, memoized on the
non-tensor part of the call. Replay reads it back against the operator's schema
(:mod:`tracecmp.aten.args`). A saved tensor's layout goes beside its bytes
(:func:`memory_order`), so a replay can hand a kernel the layout the run had.

>>> class Info:  # what the encoder reads of an operator (tracecmp.aten.schema.OpInfo has it)
...     name, arg_names = "aten.add.Tensor", ("self", "other", "alpha")
>>> ArgsEncoder().encode(Info(), ("k",), (torch.ones(1), torch.ones(1)), {"alpha": 2})
'{"self":{"tensor":0},"other":{"tensor":1},"alpha":2}'
"""

from __future__ import annotations

import json
import math
from typing import Any, Protocol

import torch
from torch.utils._pytree import tree_flatten

# Arguments as JSON. Schema types are flat (Tensor, Tensor?, Tensor[], scalars, int[] ...), so a
# two-level walk finds every tensor; anything else goes through pytree. The walk also builds a
# hashable key with tensors as placeholders, so the JSON text of a call seen before (same op,
# same scalars) is a dict lookup instead of a json.dumps.

TENSOR_MARK = object()  # a tensor, in a memo key
_MEMO_LIMIT = 1 << 16


def scan(args: tuple[Any, ...], kwargs: dict[str, Any], tensors: list[torch.Tensor]) -> tuple[Any, ...]:
    """Append every tensor argument to ``tensors`` in order; return the memo key of the non-tensor part."""
    key: list[Any] = []
    append = key.append
    for value in args:
        if isinstance(value, torch.Tensor):  # the common cases, without a call
            tensors.append(value)
            append(TENSOR_MARK)
        elif type(value) is int or value is None:
            append(value)
        else:
            append(scan_value(value, tensors))
    if kwargs:
        for name, value in kwargs.items():
            append(name)
            append(scan_value(value, tensors))
    return tuple(key)


def scan_value(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return TENSOR_MARK
    kind = type(value)
    if kind is float or kind is bool:
        return (kind, value)  # 1, 1.0 and True hash alike but mean different things
    if kind is list or kind is tuple:
        return tuple([scan_value(v, tensors) for v in value])
    if kind is int or kind is str or value is None:
        return value
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return value
    leaves, spec = tree_flatten(value)
    if len(leaves) == 1 and leaves[0] is value:
        return ("<opaque>", kind)  # encoded by type name only (see _to_json)
    return (str(spec), tuple(scan_value(v, tensors) for v in leaves))


def _json_float(value: float) -> float | str:
    if math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def _to_json(value: Any, counter: list[int]) -> Any:
    if isinstance(value, torch.Tensor):
        counter[0] += 1
        return {"tensor": counter[0] - 1}
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return _json_float(value)
    if isinstance(value, (list, tuple)):
        return [_to_json(v, counter) for v in value]
    if isinstance(value, complex):
        return {"complex": [_json_float(value.real), _json_float(value.imag)]}
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
        return str(value).removeprefix("torch.")
    if isinstance(value, torch.device):
        return str(value)
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return str(value)
    leaves, _ = tree_flatten(value)
    if len(leaves) == 1 and leaves[0] is value:
        # repr() of arbitrary objects embeds addresses, which would differ between two runs.
        return f"<{type(value).__name__}>"
    return [_to_json(v, counter) for v in leaves]


class Operator(Protocol):
    """What the encoder reads of an operator (:class:`tracecmp.aten.schema.OpInfo` has it)."""

    name: str  # "aten.add.Tensor"
    arg_names: tuple[str, ...]  # its schema's argument names, in order


class ArgsEncoder:
    """Turns one call's arguments into JSON text, memoized on the non-tensor part of the call."""

    def __init__(self) -> None:
        # (op name, scan key) -> JSON text; the per-op path reads it first and calls encode on a miss.
        self.memo: dict[tuple[Any, ...], str] = {}

    def encode(self, info: Operator, key: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        memo_key = (info.name, key)
        try:
            text = self.memo.get(memo_key)
        except TypeError:  # an unhashable value (symbolic sizes): encode without the memo
            return self._dump(info, args, kwargs)
        if text is None:
            text = self._dump(info, args, kwargs)
            if len(self.memo) >= _MEMO_LIMIT:
                self.memo.clear()
            self.memo[memo_key] = text
        return text

    @staticmethod
    def _dump(info: Operator, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        counter = [0]
        names = info.arg_names
        out: dict[str, Any] = {}
        for i, value in enumerate(args):
            out[names[i] if i < len(names) else str(i)] = _to_json(value, counter)
        for name, value in kwargs.items():
            out[name] = _to_json(value, counter)
        return json.dumps(out, separators=(",", ":"), allow_nan=False)


def memory_order(tensor: torch.Tensor) -> list[int] | None:
    """The dimensions of a dense ``tensor`` from outermost to innermost in memory, where that is
    not their logical order (a weight's ``t()``, a channels-last activation); None otherwise.

    A kernel may sum in another order for a transposed operand, so a replay of the op must hand
    it the layout the run had: the bytes are saved in logical order, as any safetensors reader
    expects, and this order beside them.

    >>> memory_order(torch.zeros(2, 3).t())
    [1, 0]
    >>> memory_order(torch.zeros(2, 3)) is None
    True
    """
    if tensor.dim() < 2 or tensor.is_contiguous():
        return None
    order = sorted(range(tensor.dim()), key=lambda d: -tensor.stride(d))
    return order if tensor.permute(order).is_contiguous() else None
