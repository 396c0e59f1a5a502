"""Randomness under capture: the same random numbers on every device, and dropout turned off.

``TraceCompare(rng="host")`` draws every random op issued on an accelerator with the CPU
generator and moves the result to the device: the same seed then gives the same numbers on an
NPU, a GPU and the CPU, which their own generators never do (the manual recipe: "make random
tensors on the CPU, then move them"). Which ops: those the schema marks as random (the
``nondeterministic_seeded`` tag or a ``Generator`` argument) that the CPU can run. Fused device
kernels that draw inside (flash attention's dropout, cuDNN RNN dropout) cannot be replayed on
the CPU and keep their device draw; ``dropout=0.0`` is the way to take them out.

``TraceCompare(dropout=0.0)`` makes every dropout act with ``p=0`` while tracing, in two places:
torch's Python functions that take a drop probability (``F.dropout`` and its variants, what every
``nn.Dropout*`` module calls, ``F.scaled_dot_product_attention``, ``F.multi_head_attention_forward``,
the RNN functions) are called with it set to 0 through a torch-function mode, and dispatched ops
with a drop-probability argument (``native_dropout``, fused attention, cuDNN RNN; see
``ops._dropout_rewrites``) get it rewritten in the capture mode, with the backward's rescaling
set to 1 to match. Both options hold for the whole session: in steps that are not recorded a
light dispatch mode (:class:`Rewrites`) applies them.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from tracecmp.aten.schema import OpInfo, arg_value, op_info

_CPU = torch.device("cpu")
_NOT_ACCELERATORS = ("cpu", "meta")  # meta tensors hold no numbers to draw
# Tests set this to treat CPU tensors as if they lived on an accelerator, so that the host path
# (copy to the host, draw, copy back) runs and can be checked bitwise on a machine without one.
_FORCE_HOST_FOR_TESTS = False
_warned: set[str] = set()


def _accelerator(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device | None:
    """The accelerator a random op draws for (None: CPU, meta, or an explicit device Generator)."""
    found: torch.device | None = None
    for value in (*args, *kwargs.values()):
        items = value if isinstance(value, (list, tuple)) else (value,)
        for item in items:
            if isinstance(item, torch.Generator):
                if item.device.type != "cpu":
                    return None  # the caller chose a device generator: honour it
                continue
            device = item.device if isinstance(item, torch.Tensor) else item if isinstance(item, torch.device) else None
            if found is None and device is not None and device.type not in _NOT_ACCELERATORS:
                found = device
    if found is None and _FORCE_HOST_FOR_TESTS:
        return _CPU
    return found


def host_call(func: Any, info: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run the random op ``func`` on the CPU generator and hand back device tensors.

    Tensor arguments are copied to the host (same sizes and, when dense, same strides), device
    arguments become ``cpu``; written arguments get the host result copied back into the
    original tensor (which the op then returns, as its schema says); fresh results are moved to
    the device. On CPU tensors the op runs as is.

    >>> t = torch.empty(3)
    >>> host_call(torch.ops.aten.uniform_.default, op_info(torch.ops.aten.uniform_.default), (t,), {}) is t
    True
    """
    device = _accelerator(args, kwargs)
    if device is None:
        return func(*args, **kwargs)
    originals: dict[int, torch.Tensor] = {}

    def to_host(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            copy = value.to(_CPU, copy=True)
            originals[id(copy)] = value
            return copy
        if isinstance(value, torch.device):
            return _CPU
        if isinstance(value, (list, tuple)):
            return type(value)(to_host(v) for v in value)
        return value

    host_args = tuple(to_host(a) for a in args)
    host_kwargs = {k: to_host(v) for k, v in kwargs.items()}
    try:
        out = func(*host_args, **host_kwargs)
    except (RuntimeError, NotImplementedError) as exc:  # a dtype the CPU kernel lacks: draw on the device
        if info.name not in _warned:
            _warned.add(info.name)
            warnings.warn(
                f"tracecmp: rng='host' cannot draw {info.name} on the CPU ({exc}); drawn on {device}", stacklevel=3
            )
        return func(*args, **kwargs)
    for ref in info.writes:
        original, written = arg_value(ref, args, kwargs), arg_value(ref, host_args, host_kwargs)
        if isinstance(original, torch.Tensor):
            original.copy_(written)

    def to_device(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        original = originals.get(id(value))
        return original if original is not None else value.to(device, copy=True)

    return tree_map(to_device, out)


def rewrite(
    info: OpInfo, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], host_rng: bool, no_dropout: bool
) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    """What ``rng="host"`` (``host_rng``) and ``dropout=0.0`` (``no_dropout``) call instead of
    ``func(*args, **kwargs)``: the callable and its arguments.

    >>> op = torch.ops.aten.native_dropout.default
    >>> call, args, _ = rewrite(op_info(op), op, (torch.ones(2), 0.5, True), {}, False, True)
    >>> call is op, args[1]
    (True, 0.0)
    """
    if no_dropout and info.dropout:
        args, kwargs = without_dropout(info, args, kwargs)
    if host_rng and info.host_rng:
        return (lambda *a, **k: host_call(func, info, a, k)), args, kwargs
    return func, args, kwargs


class Rewrites(TorchDispatchMode):
    """``rng="host"`` and ``dropout=0.0`` in the steps that are not recorded, so that a recorded
    step starts from the same history on every device (the capture mode does both when recording)."""

    def __init__(self, host_rng: bool, no_dropout: bool) -> None:
        super().__init__()
        self.host_rng = host_rng
        self.no_dropout = no_dropout

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # never switch the user's torch.compile off (see CaptureMode)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        info = op_info(func)
        if info.rewritable:
            func, args, kwargs = rewrite(info, func, args, kwargs, self.host_rng, self.no_dropout)
        return func(*args, **kwargs)


def without_dropout(
    info: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args``/``kwargs`` with the op's drop probabilities set to 0 (see ``OpInfo.dropout``).

    >>> info = op_info(torch.ops.aten.native_dropout.default)
    >>> without_dropout(info, (torch.ones(2), 0.5, True), {})[0][1:]
    (0.0, True)
    """
    positional = list(args)
    kwargs = dict(kwargs)
    for (position, name), value in info.dropout:
        if 0 <= position < len(positional):
            positional[position] = value
        else:
            kwargs[name] = value  # keyword-only, or left to its default
    return tuple(positional), kwargs


def _rnn_dropout_position(args: tuple[Any, ...]) -> int:
    # torch.lstm/gru/rnn_*: (input, hx, params, has_biases, num_layers, dropout, ...) or, packed,
    # (data, batch_sizes, hx, params, has_biases, ...): dropout follows has_biases and num_layers.
    for position, value in enumerate(args):
        if isinstance(value, bool):
            return position + 2
    return -1


_F = torch.nn.functional
# torch's Python-level functions that drop values: where their probability arrives.
_FUNCTIONAL: dict[Any, tuple[int, str]] = {
    **{
        fn: (1, "p")
        for fn in (
            _F.dropout,
            _F.dropout1d,
            _F.dropout2d,
            _F.dropout3d,
            _F.alpha_dropout,
            _F.feature_alpha_dropout,
            torch.dropout,
            torch.dropout_,
            torch.alpha_dropout,
            torch.alpha_dropout_,
            torch.feature_dropout,
            torch.feature_dropout_,
            torch.feature_alpha_dropout,
            torch.feature_alpha_dropout_,
        )
    },
    _F.scaled_dot_product_attention: (4, "dropout_p"),
    _F.multi_head_attention_forward: (10, "dropout_p"),
}
_RNN = {torch.lstm, torch.gru, torch.rnn_tanh, torch.rnn_relu}


class DropoutOff(TorchFunctionMode):
    """Calls torch's dropout functions with probability 0 (what ``nn.Dropout`` with ``p=0`` does).

    >>> x = torch.ones(4)
    >>> with DropoutOff():
    ...     torch.equal(torch.nn.functional.dropout(x, 0.5, training=True), x)
    True
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        where = _FUNCTIONAL.get(func)
        if where is None and func in _RNN:
            where = (_rnn_dropout_position(args), "dropout")
        if where is not None:
            position, name = where
            if 0 <= position < len(args):
                args = (*args[:position], 0.0, *args[position + 1 :])
            elif position >= 0 or name in kwargs:
                kwargs = {**kwargs, name: 0.0}
        return func(*args, **kwargs)
