"""Recorded operator arguments back: a call rebuilt from the JSON a trace holds, for replay.

Capture records a call's non-tensor arguments as JSON (:mod:`tracecmp.trace.args`: tensors become
``{"tensor": i}``, their position among the call's tensor inputs); this reads that JSON against the
operator's schema and builds the call again on given tensors.

>>> import torch
>>> recorded = {"self": {"tensor": 0}, "other": {"tensor": 1}, "alpha": 2}
>>> args, kwargs = decode_call(torch.ops.aten.add.Tensor, recorded, [torch.ones(1), torch.ones(1)])
>>> len(args), kwargs
(2, {'alpha': 2})
"""

from __future__ import annotations

import math
from typing import Any

import torch

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
