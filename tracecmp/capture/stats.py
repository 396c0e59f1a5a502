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

The fused C++ pass in ``csrc/`` (module ``tracecmp._cstats``, bound in :mod:`tracecmp.capture.native`)
computes the same numbers on CPU tensors: min, max, counts and checksum exactly, mean and norm to
within rounding (its sums are pairwise in float64 and independent of layout, thread count and CPU). Tensors of
``_cstats.PARALLEL_MIN`` elements or more are split over torch's intra-op threads
(``torch.get_num_threads()``, on torch's own OpenMP team where there is one; csrc/README.md,
"Threads"). :func:`tensor_stats` and :func:`tensor_stats_row` use it when it is built and
``TRACECMP_FORCE_REFERENCE=1`` is not set.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import torch

from tracecmp.capture import native
from tracecmp.capture.tensorkinds import kernel_readable

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
    # Conjugate/negative views must be materialised: their raw bits are not their values.
    flat = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
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
    x = t.detach().resolve_conj().resolve_neg()
    if x.is_complex():
        x = torch.view_as_real(x)
    x = x.reshape(-1)
    device = x.device
    checksum = checksum_reference(x).view(torch.float64).reshape(1)
    # Every step below is a fixed-shape kernel: no boolean-mask indexing (its size needs the host)
    # and no Python branch on a value, so on an accelerator nothing waits for the device.
    xd = x.to(torch.float64)
    nan = torch.full((), math.nan, dtype=torch.float64, device=device)
    numel = xd.numel()
    if x.dtype.is_floating_point:
        nan_mask = torch.isnan(xd)
        inf_mask = torch.isinf(xd)
        finite = ~(nan_mask | inf_mask)
        nan_count = nan_mask.sum()
        inf_count = inf_mask.sum()
        finite_vals = torch.where(finite, xd, torch.zeros((), dtype=torch.float64, device=device))
        n_finite = finite.sum()
        if numel:
            lo = torch.where(nan_mask, math.inf, xd).amin()
            hi = torch.where(nan_mask, -math.inf, xd).amax()
            all_nan = nan_count == numel
            lo, hi = torch.where(all_nan, nan, lo), torch.where(all_nan, nan, hi)
        else:
            lo = hi = nan
    else:
        nan_count = torch.zeros((), dtype=torch.int64, device=device)
        inf_count = nan_count
        finite_vals = xd
        n_finite = torch.full((), numel, dtype=torch.int64, device=device)
        lo, hi = torch.aminmax(xd) if numel else (nan, nan)
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


# Codes shared with csrc/stats_kernel.hpp (enum DType).
_NATIVE_CODES: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.float64: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.uint8: 4,
    torch.int8: 5,
    torch.int16: 6,
    torch.int32: 7,
    torch.int64: 8,
    torch.bool: 9,
}
_NativeFn = Callable[[int, Any, Any, int, int, int], tuple]
_native_stats: _NativeFn | None = None  # None: use the reference
# Below this many elements the kernel ignores the thread count, so the lookup (~40 ns) is skipped.
_PARALLEL_MIN: int = native.cstats.PARALLEL_MIN if native.cstats is not None else 0


def native_available() -> bool:
    """Whether the fused C++ kernel was built and imports.

    >>> isinstance(native_available(), bool)
    True
    """
    return native.cstats is not None


def native_error() -> str | None:
    """Why the C++ kernel is unavailable (None when it is available).

    >>> native_error() is None or "tracecmp._cstats" in native_error()
    True
    """
    return native.error("_cstats")


def set_force_reference(flag: bool) -> None:
    """Make :func:`tensor_stats`/:func:`tensor_stats_row` use the pure-torch reference (or not).

    The initial value is ``TRACECMP_FORCE_REFERENCE=1`` in the environment at import.

    >>> set_force_reference(True); tensor_stats(torch.ones(2)).mean
    1.0
    >>> set_force_reference(False)
    """
    global _native_stats
    _native_stats = None if flag or native.cstats is None else native.cstats.stats


set_force_reference(native.FORCE_REFERENCE)


def tensor_stats_row(t: torch.Tensor) -> tuple[Any, ...]:
    """The seven statistics of ``t`` as a plain tuple, as cheaply as possible.

    Order: min, max, mean, norm, nan_count, inf_count, checksum. CPU tensors of the kernel's
    dtypes go straight to the fused C++ pass (no copy, any strides); everything else (devices,
    complex, conjugate/negative views, other dtypes) takes the reference, which may raise for
    dtypes it does not cover.

    >>> tensor_stats_row(torch.tensor([[1.0, float("inf")], [3.0, -1.0]]))[:6]
    (-1.0, inf, 1.0, 3.3166247903554, 0, 1)
    """
    kernel = _native_stats
    code = _NATIVE_CODES.get(t.dtype)
    # The kernel reads memory: only plain dense strided tensors with storage (tensorkinds.py).
    if kernel is not None and code is not None and t.is_cpu and not t.is_neg() and kernel_readable(t):
        n = t.numel()
        try:
            return kernel(
                t.data_ptr(), t.shape, t.stride(), code, n, torch.get_num_threads() if n >= _PARALLEL_MIN else 1
            )
        except (RuntimeError, ValueError):
            pass
    return _row_slow(t, kernel)


def _row_slow(t: torch.Tensor, kernel: _NativeFn | None) -> tuple[Any, ...]:
    if kernel is not None and t.is_cpu and kernel_readable(t):
        if t.is_complex():
            # view_as_real keeps the element order (re, im per element), as the definition says.
            return tensor_stats_row(torch.view_as_real(t.resolve_conj().resolve_neg()))
        if t.is_neg():
            return tensor_stats_row(t.resolve_neg())
    return tuple(reference_stats(t))


def tensor_stats(t: torch.Tensor) -> TensorStats:
    """Statistics of ``t``: the fused C++ pass for CPU tensors when available, else the reference.

    >>> tensor_stats(torch.tensor([1.0, float("nan"), 3.0]))  # doctest: +ELLIPSIS
    TensorStats(min=1.0, max=3.0, mean=2.0, norm=3.1622776601683795, nan_count=1, inf_count=0, checksum=...)
    """
    return TensorStats(*tensor_stats_row(t))
