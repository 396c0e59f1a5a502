"""Which tensors capture may read, and what it does with the others.

The fused statistics kernel (``tracecmp._cstats``) reads memory at ``t.data_ptr()`` with the
tensor's shape and strides. That is right only for a *plain dense strided tensor with storage of
its own*. Every other tensor a user meets either has no memory behind ``data_ptr()`` (a wrapper
subclass such as DTensor, FSDP2's sharded parameters, FakeTensor, a functional tensor: their
``data_ptr()`` is 0) or lays its values out otherwise (sparse, nested, mkldnn, quantized), and
handing it to the kernel reads address 0 or garbage. So capture decides per tensor:

* plain dense strided tensors (``torch.Tensor``, ``nn.Parameter``) with storage: the kernel;
* tensors whose values torch can still read (complex, negative views, other dtypes, non-wrapper
  subclasses made with ``as_subclass``): the pure-torch reference;
* everything else: no statistics, and :func:`unreadable` says why (the reasons are counted in the
  rank manifest, ``info.capture_skipped``), so "could not compare" is never taken for "agrees".

Whole ops are handled before that (``CaptureMode.__torch_dispatch__``): an op on a wrapper subclass
(DTensor, AsyncCollectiveTensor, a jagged NestedTensor ...) returns ``NotImplemented``, as torch's
DebugMode does, so the subclass unwraps itself and the ops on its real tensors (a DTensor's local
shard, a redistribution's collectives) are what the trace holds; ops on FakeTensors, or under an
active FakeTensorMode or FunctionalTensorMode (DTensor's sharding propagation, tracing), compute no
values and pass through unrecorded.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

from tracecmp._compat import FunctionalTensor, tracing_mode_active

PLAIN_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})  # exact types the kernel may read
STRIDED = torch.strided
_PYTHON_KEY = torch._C.DispatchKey.Python

# Reasons, as counted in the rank manifest.
TRACED_OP = "an op on fake or functional tensors (sharding propagation, tracing): it computes no values"


def kernel_readable(t: torch.Tensor) -> bool:
    """Whether the statistics kernel may read ``t``'s memory: a plain dense strided tensor with storage.

    >>> kernel_readable(torch.ones(2)), kernel_readable(torch.ones(2).to_sparse())
    (True, False)
    """
    if type(t) not in PLAIN_TYPES or t.layout is not STRIDED or t.is_nested or t.is_quantized:
        return False
    try:
        return t.data_ptr() != 0 or t.numel() == 0
    except RuntimeError:  # no storage at all
        return False


def unreadable(t: torch.Tensor) -> str | None:
    """Why no statistics can be taken of ``t`` (None: the kernel or the reference can).

    >>> unreadable(torch.ones(2)) is None
    True
    >>> unreadable(torch.ones(2, 2).to_sparse())
    'sparse_coo layout: no dense values to read'
    """
    kind = type(t).__name__
    if isinstance(t, FakeTensor):
        return "FakeTensor: no values"
    if isinstance(t, FunctionalTensor) or torch._is_functional_tensor(t):
        return "functional tensor: its values live behind the functionalization layer"
    if torch._C._dispatch_keys(t).has(_PYTHON_KEY):
        return f"{kind}: a tensor subclass without storage of its own"
    if t.is_nested:
        return "nested tensor: no single shape"
    if t.layout is not STRIDED:
        return f"{str(t.layout).removeprefix('torch.')} layout: no dense values to read"
    if t.is_quantized:
        return "quantized tensor: the statistics do not cover it"
    if t.device.type == "meta":
        return "meta tensor: no values"
    try:
        if t.data_ptr() == 0 and t.numel() > 0:
            return f"{kind}: no storage behind its data pointer"
    except RuntimeError:
        return f"{kind}: no storage"
    return None


def traced_op(types: tuple[type, ...] | list[type]) -> bool:
    """Whether an op computes no values: fake or functional tensor arguments, or a tracing mode active.

    ``types`` is what ``__torch_dispatch__`` receives. The mode stack is asked only when another
    mode is on it (``_len_torch_dispatch_stack`` is 0 while capture's own mode runs alone).

    >>> traced_op(())
    False
    """
    for cls in types:
        if issubclass(cls, (FakeTensor, FunctionalTensor)):
            return True
    return tracing_active()


def tracing_active() -> bool:
    """Whether a FakeTensorMode or FunctionalTensorMode is active below capture's mode."""
    return tracing_mode_active()


def dims(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s shape as a tuple of ints; ``()`` when it has none (a nested tensor).

    >>> dims(torch.ones(2, 3))
    (2, 3)
    """
    try:
        return tuple(t.shape)
    except RuntimeError:
        return ()
