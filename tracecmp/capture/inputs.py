"""Names of the root model's inputs: what the user passed, the same whether the model ran eagerly or
compiled.

An input is named by the ``forward`` parameter it was bound to, however it was passed
(``model(ids)`` and ``model(input_ids=ids)`` both name it ``input_ids``), then by its path inside
what was passed (``batch.input_ids``, ``pair.1``). Arguments gathered by ``*args`` are named by
their position in the call (``input.2``), those gathered by ``**kwargs`` by their keyword. A
compiled model knows its inputs only as Dynamo's sources of the compiled frame's locals
(``L['batch']['input_ids']``), which name the same parameter and path: :func:`name_of_source`
reads them so. Where ``forward``'s signature cannot be read, inputs are named ``input.<position>``
and by keyword.

>>> import torch
>>> class Net(torch.nn.Module):
...     def forward(self, x, mask=None):
...         return x
>>> x, m = torch.ones(1), torch.zeros(1)
>>> [name for name, _ in named_inputs(Net().forward, (x,), {"mask": {"m": m}})]
['x', 'mask.m']
>>> name_of_source("L['mask']['m']", Net().forward)
'mask.m'
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch

_DEPTH = 4  # how deep into lists and dicts inputs are looked for
_ROOT = re.compile(r"^L\[['\"]([^'\"]+)['\"]\]")
# One step below a local in a Dynamo source: a subscript (``['k']``, ``[0]``). Attributes are not
# followed: an eager call's inputs are looked for in lists and mappings only.
_PATH_STEP = re.compile(r"\[['\"]([^'\"]+)['\"]\]|\[(\d+)\]")


def named_inputs(
    forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every tensor a call of ``forward(*args, **kwargs)`` passed in."""
    bound = _bind(forward, args, kwargs)
    if bound is None:
        tops = [(f"input.{i}", value) for i, value in enumerate(args)] + list(kwargs.items())
    else:
        tops = []
        position = 0
        for parameter, value in bound:
            if parameter.kind == parameter.VAR_POSITIONAL:
                tops.extend((f"input.{position + i}", item) for i, item in enumerate(value))
            elif parameter.kind == parameter.VAR_KEYWORD:
                tops.extend(value.items())
            else:
                tops.append((parameter.name, value))
            position += parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD)
    return [(name, tensor) for top, value in tops for name, tensor in _leaves(str(top), value, 0)]


def name_of_source(source: str, forward: Callable[..., Any]) -> str | None:
    """The input name of a compiled frame's graph input from its Dynamo ``source``; None where it
    is not an argument of ``forward`` (a local of a resumed frame, a global, a module attribute)."""
    hit = _ROOT.match(source)
    parameters = _parameters(forward)
    if hit is None or parameters is None:
        return None
    by_name = {p.name: p for p in parameters}
    parameter = by_name.get(hit.group(1))
    if parameter is None:
        return None
    steps: list[str] = []
    position = hit.end()
    while position < len(source):
        step = _PATH_STEP.match(source, position)
        if step is None:
            return None  # an attribute or a call: not a path named_inputs follows
        steps.append(next(g for g in step.groups() if g is not None))
        position = step.end()
    if parameter.kind == parameter.VAR_POSITIONAL:
        if not steps or not steps[0].isdigit():
            return None
        named = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters)
        steps[0] = f"input.{named + int(steps[0])}"
    elif parameter.kind != parameter.VAR_KEYWORD:
        steps.insert(0, parameter.name)
    return ".".join(steps) or None


def _parameters(forward: Callable[..., Any]) -> list[inspect.Parameter] | None:
    try:
        return list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):  # a builtin or C function without a signature
        return None


def _bind(
    forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[tuple[inspect.Parameter, Any]] | None:
    try:
        signature = inspect.signature(forward)
        arguments = signature.bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):  # no signature, or a call forward would refuse
        return None
    return [(signature.parameters[name], value) for name, value in arguments.items()]


def _leaves(name: str, value: Any, depth: int) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield name, value
    elif depth < _DEPTH and isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _leaves(f"{name}.{i}", item, depth + 1)
    elif depth < _DEPTH and isinstance(value, Mapping):  # dicts, transformers' BatchEncoding
        for key, item in value.items():
            yield from _leaves(f"{name}.{key}", item, depth + 1)
