"""What the torch tracecmp runs on may lack, in one place (unbuilt extensions: tracecmp.capture.native).

torch 2.1 is the oldest tracecmp supports (CI tests it beside the newest): capture relies on
autograd sequence numbers (``torch._C._autograd._get_sequence_nr``) to give backward ops their
module, and on always-called module hooks (``register_module_forward_hook(always_call=True)``);
torch 2.0 has neither. Differences within the supported range that tracecmp handles are noted
where they are handled; this module holds the checks that more than one place needs.

>>> TORCH_VERSION >= OLDEST_TORCH
True
"""

from __future__ import annotations

import re
from typing import Any

import torch

from tracecmp.errors import TracecmpError

OLDEST_TORCH = (2, 1)


def _version(text: str) -> tuple[int, int]:
    """``"2.1.2+cu121"`` -> ``(2, 1)``."""
    match = re.match(r"(\d+)\.(\d+)", text)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


TORCH_VERSION = _version(torch.__version__)

try:
    from torch._C import _get_dispatch_mode, _TorchDispatchModeKey
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
except ImportError:  # torch < 2.2: fake and functional modes are ordinary modes on the stack
    _get_dispatch_mode = None

    class FunctionalTensor(torch.Tensor):  # type: ignore[no-redef]
        """Stands in for the Python functional tensor subclass that torch < 2.2 lacks: never made,
        so ``isinstance`` and ``issubclass`` checks against it are simply false."""

    class FunctionalTensorMode:  # type: ignore[no-redef]
        """Stands in for the functionalization mode that torch < 2.2 lacks."""

    _TRACING_KEYS: tuple[Any, ...] = ()
else:
    _TRACING_KEYS = (_TorchDispatchModeKey.FAKE, _TorchDispatchModeKey.FUNCTIONAL)
from torch._C import _get_dispatch_stack_at, _len_torch_dispatch_stack  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402


def tracing_mode_active() -> bool:
    """Whether a FakeTensorMode or FunctionalTensorMode is active (they compute no values).

    From torch 2.2 they are infra modes, asked for by key; before, they sit on the mode stack.
    The stack's length is read first: it is 0 while no mode but the caller's runs (the usual case).

    >>> tracing_mode_active()
    False
    """
    depth = _len_torch_dispatch_stack()
    if not depth:
        return False
    if _get_dispatch_mode is not None:
        return any(_get_dispatch_mode(key) is not None for key in _TRACING_KEYS)
    return any(isinstance(_get_dispatch_stack_at(i), (FakeTensorMode, FunctionalTensorMode)) for i in range(depth))


def check_torch() -> None:
    """Refuse, with the reason, a torch older than :data:`OLDEST_TORCH`."""
    if TORCH_VERSION < OLDEST_TORCH:
        raise TracecmpError(
            f"tracecmp needs torch >= {'.'.join(map(str, OLDEST_TORCH))}, this is torch {torch.__version__}: "
            "older releases lack the autograd sequence numbers and module hooks capture relies on"
        )
