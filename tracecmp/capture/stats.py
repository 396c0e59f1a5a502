"""Per-tensor statistics recorded by capture: the definition and its pure-torch reference.

Every recorded (non-view) output gets seven numbers, all computed in float64 (or exact integer)
arithmetic whatever the tensor's dtype:

``min``, ``max``
    over the non-NaN elements (infinities included); NaN when there is none.
``mean``
    sum of the finite elements divided by their count; NaN when there is none.
``norm``
    sqrt of the sum of squares of the finite elements; 0.0 when there is none.
``nan_count``, ``inf_count``
    number of NaN and of +-Inf elements (0 for integer and bool tensors).
``checksum``
    ``sum_i u_i * (2*i + 1) mod 2**64`` stored as a signed int64, where ``u_i`` is the raw bit
    pattern of element ``i`` (row-major logical order, so strides do not matter) read as an
    unsigned integer of the element's width. Any single changed bit changes it (odd weights), so
    equal checksums mean "bitwise identical" with overwhelming probability, unequal ones mean
    "not identical" for certain.

Complex tensors are summarised through ``torch.view_as_real``.

The fused C++ pass in ``csrc/`` computes the same numbers; :func:`tensor_stats` uses it when it
is built and ``TRACECMP_FORCE_REFERENCE=1`` is not set.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

STAT_FIELDS = ("min", "max", "mean", "norm", "nan_count", "inf_count", "checksum")


class TensorStats(NamedTuple):
    """The statistics of one tensor (see the module docstring for definitions)."""

    min: float
    max: float
    mean: float
    norm: float
    nan_count: int
    inf_count: int
    checksum: int


_UNSIGNED_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_WIDTH_MASK = {1: 0xFF, 2: 0xFFFF, 4: 0xFFFFFFFF}


def checksum_reference(t: torch.Tensor) -> torch.Tensor:
    """Bitwise checksum as a 0-dim int64 tensor on ``t``'s device (no host sync).

    >>> int(checksum_reference(torch.zeros(3)))
    0
    """
    flat = t.detach().contiguous().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    width = flat.element_size()
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    bits = flat.view(_UNSIGNED_VIEW[width]).to(torch.int64)
    if width in _WIDTH_MASK:
        bits = bits & _WIDTH_MASK[width]
    weights = torch.arange(flat.numel(), device=flat.device, dtype=torch.int64) * 2 + 1
    # int64 products and sums wrap modulo 2**64, which is exactly the definition.
    return (bits * weights).sum()


def stats_tensor_reference(t: torch.Tensor) -> torch.Tensor:
    """All seven statistics packed in one float64 tensor on ``t``'s device, without host sync.

    Layout: min, max, mean, norm, nan_count, inf_count, checksum (the checksum's int64 bits
    reinterpreted as float64 so that one tensor carries everything; see :func:`unpack_stats`).
    """
    x = t.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    x = x.reshape(-1)
    device = x.device
    checksum = checksum_reference(x if not t.is_complex() else t).view(torch.float64).reshape(1)
    if x.dtype.is_floating_point:
        xd = x.to(torch.float64)
        nan_mask = torch.isnan(xd)
        inf_mask = torch.isinf(xd)
        finite = ~(nan_mask | inf_mask)
        nan_count = nan_mask.sum()
        inf_count = inf_mask.sum()
        not_nan = xd[~nan_mask]
        finite_vals = torch.where(finite, xd, torch.zeros((), dtype=torch.float64, device=device))
        n_finite = finite.sum()
    else:
        xd = x.to(torch.float64)
        nan_count = torch.zeros((), dtype=torch.int64, device=device)
        inf_count = nan_count
        not_nan = xd
        finite_vals = xd
        n_finite = torch.tensor(xd.numel(), dtype=torch.int64, device=device)
    nan = torch.full((), math.nan, dtype=torch.float64, device=device)
    if not_nan.numel():
        lo, hi = torch.aminmax(not_nan)
    else:
        lo = hi = nan
    total = finite_vals.sum()
    mean = torch.where(n_finite > 0, total / n_finite.clamp(min=1), nan)
    norm = torch.sqrt((finite_vals * finite_vals).sum())
    head = torch.stack([lo, hi, mean, norm, nan_count.to(torch.float64), inf_count.to(torch.float64)])
    return torch.cat([head, checksum])


def unpack_stats(packed: torch.Tensor) -> TensorStats:
    """Turn a packed float64 stats row (CPU) into :class:`TensorStats`.

    >>> unpack_stats(stats_tensor_reference(torch.tensor([1.0, 3.0]))).mean
    2.0
    """
    values = packed.tolist()
    checksum = int(packed[6:7].view(torch.int64).item())
    return TensorStats(values[0], values[1], values[2], values[3], int(values[4]), int(values[5]), checksum)


def reference_stats(t: torch.Tensor) -> TensorStats:
    """Statistics of ``t`` by the pure-torch reference (syncs once if ``t`` is on a device).

    >>> reference_stats(torch.tensor([1.0, float("nan"), float("inf")])).inf_count
    1
    """
    return unpack_stats(stats_tensor_reference(t).cpu())
