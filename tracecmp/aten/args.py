"""Operator arguments as JSON text, and back: how capture records a call and replay re-issues it.

Capture turns a call's non-tensor arguments into JSON (tensors become ``{"tensor": i}``, their
position among the call's tensor inputs), memoized on the non-tensor part of the call; replay reads
that JSON against the operator's schema and builds the call again on given tensors.

>>> import torch
>>> from tracecmp.aten.schema import op_info
>>> info = op_info(torch.ops.aten.add.Tensor)
>>> text = ArgsEncoder().encode(info, ("k",), (torch.ones(1), torch.ones(1)), {"alpha": 2})
>>> text
'{"self":{"tensor":0},"other":{"tensor":1},"alpha":2}'
>>> args, kwargs = decode_call(torch.ops.aten.add.Tensor, json.loads(text), [torch.ones(1), torch.ones(1)])
>>> len(args), kwargs
(2, {'alpha': 2})
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from tracecmp.aten.schema import OpInfo

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


class ArgsEncoder:
    """Turns one call's arguments into JSON text, memoized on the non-tensor part of the call."""

    def __init__(self) -> None:
        # (op name, scan key) -> JSON text; the per-op path reads it first and calls encode on a miss.
        self.memo: dict[tuple[Any, ...], str] = {}

    def encode(self, info: OpInfo, key: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
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
    def _dump(info: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        counter = [0]
        names = info.arg_names
        out: dict[str, Any] = {}
        for i, value in enumerate(args):
            out[names[i] if i < len(names) else str(i)] = _to_json(value, counter)
        for name, value in kwargs.items():
            out[name] = _to_json(value, counter)
        return json.dumps(out, separators=(",", ":"), allow_nan=False)


# ---------------------------------------------------------------------------------------------
# Back from JSON: the recorded arguments against the operator's schema.

NOT_DECODABLE = object()  # an argument the trace could only name, or could not hold


def decode_call(
    func: Any, recorded: dict[str, Any], inputs: list[torch.Tensor], *, golden: bool = False
) -> tuple[list[Any], dict[str, Any]] | None:
    """``func``'s arguments rebuilt from ``recorded`` (one call's JSON object) with the tensors
    ``inputs`` in their recorded order; None when an argument cannot be rebuilt.

    ``golden`` promotes floating tensors and dtype arguments to float64; devices become the CPU.
    Tensors are copied (float64 ones too) so that an in-place op cannot write the caller's copy.
    """
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    positional = True
    for argument in func._schema.arguments:
        if argument.name not in recorded:
            positional = False  # a defaulted argument: the rest go by name
            continue
        value = decode_value(recorded[argument.name], str(argument.real_type), inputs, golden)
        if value is NOT_DECODABLE:
            return None
        if positional and not argument.kwarg_only:
            args.append(value)
        else:
            positional = False
            kwargs[argument.name] = value
    return args, kwargs


_STRIDED_SPAN = 8  # a strided copy may take at most this many times the elements it holds


def copy_laid_out(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` with its strides, also where they leave gaps (a column block of a wider
    tensor, as ``split`` and ``chunk`` make): CPU kernels take another path over such memory than
    over contiguous memory (row by row, with other vector tails), with other bits in the last place.

    >>> copy_laid_out(torch.zeros(4, 64)[:, 16:32]).stride()
    (64, 1)
    """
    copy = tensor.clone()  # keeps the strides of dense memory (a transpose) as they are
    if copy.stride() == tensor.stride():
        return copy
    dims = sorted((st, n) for n, st in zip(tensor.shape, tensor.stride()) if n > 1)
    span = 1  # elements from the first to one past the last, over the dims of smaller strides
    for st, n in dims:
        if st < span:  # zero, negative, or reaching into the dims below: overlapping or not a plain layout
            return copy
        span += (n - 1) * st
    if span > _STRIDED_SPAN * tensor.numel():
        return copy
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=tensor.device).copy_(tensor)


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


def decode_value(value: Any, type_name: str, inputs: list[torch.Tensor], golden: bool) -> Any:
    """A recorded JSON argument back as a Python value (tensors from ``inputs``, by position)."""
    if isinstance(value, dict):
        if "tensor" in value:
            index = value["tensor"]
            if not isinstance(index, int) or not 0 <= index < len(inputs):
                return NOT_DECODABLE
            tensor = inputs[index]
            if golden and tensor.is_floating_point():
                return tensor.to(torch.float64, copy=True)
            return copy_laid_out(tensor)
        if "complex" in value:
            re, im = value["complex"]
            return complex(_float(re), _float(im))
        return NOT_DECODABLE
    if isinstance(value, list):
        inner = type_name.removeprefix("Optional[").removesuffix("]")
        inner = inner[inner.find("[") + 1 : -1] if inner.startswith("List[") else inner
        items = [decode_value(v, inner, inputs, golden) for v in value]
        return NOT_DECODABLE if any(v is NOT_DECODABLE for v in items) else items
    if isinstance(value, str):
        return _decode_text(value, type_name, golden)
    return value


def _decode_text(value: str, type_name: str, golden: bool) -> Any:
    if value.startswith("<"):
        return NOT_DECODABLE  # an object the trace could only name (a generator, a process group)
    if "ScalarType" in type_name:
        dtype = getattr(torch, value, None)
        if not isinstance(dtype, torch.dtype):
            return NOT_DECODABLE
        return torch.float64 if golden and dtype.is_floating_point else dtype
    if "Layout" in type_name:
        layout = getattr(torch, value, None)
        return layout if isinstance(layout, torch.layout) else NOT_DECODABLE
    if "MemoryFormat" in type_name:
        fmt = getattr(torch, value, None)
        return fmt if isinstance(fmt, torch.memory_format) else NOT_DECODABLE
    if "Device" in type_name:
        return torch.device("cpu")  # replay runs on the CPU whatever the run used
    if "float" in type_name or "Scalar" in type_name or "number" in type_name:  # a Scalar's real_type is "number"
        if value in ("nan", "inf", "-inf"):
            return float(value)
        return value if "Scalar" in type_name else NOT_DECODABLE
    return value


def _float(value: Any) -> float:
    return float(value) if isinstance(value, (int, float, str)) else math.nan
