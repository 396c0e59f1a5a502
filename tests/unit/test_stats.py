"""The fused C++ statistics pass against the pure-torch reference, on adversarial inputs.

min, max, NaN/Inf counts and the checksum must be bit-identical between the two; mean and norm
within 1e-12 relative to the data's scale (they are summed in different orders). Every copy of
the kernel (baseline, AVX2, AVX-512) must give the same bits.
"""

from __future__ import annotations

import math
import os
import platform
import subprocess
import sys
from typing import Any, Callable

import pytest
import torch

from tracecmp.capture import stats
from tracecmp.capture.native import cstats
from tracecmp.capture.stats import (
    STAT_FIELDS,
    TensorStats,
    native_available,
    native_error,
    reference_stats,
    set_force_reference,
    tensor_stats,
    tensor_stats_row,
)

needs_native = pytest.mark.skipif(not native_available(), reason=f"C++ kernel not built: {native_error()}")

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
ALL_DTYPES = FLOATS + INTS + [torch.bool]
BLOCK = cstats.BLOCK if native_available() else 2048
REL = 1e-12


def native(t: torch.Tensor, threads: int = 1) -> tuple[Any, ...]:
    """The kernel called directly, so a test can choose the thread count."""
    return cstats.stats(t.data_ptr(), t.shape, t.stride(), stats._NATIVE_CODES[t.dtype], t.numel(), threads)


def _same_exact(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b and type(a) is type(b)


def _data_scale(t: torch.Tensor) -> float:
    """Mean |x| over the finite elements: what a mean's rounding error is relative to."""
    x = t.detach().resolve_conj().resolve_neg()
    if x.is_complex():
        x = torch.view_as_real(x)
    x = x.reshape(-1).to(torch.float64)
    x = x[torch.isfinite(x)]
    return float(x.abs().mean()) if x.numel() else 0.0


def assert_match(got: tuple[Any, ...], want: tuple[Any, ...], t: torch.Tensor) -> None:
    """Exact for min/max/counts/checksum; mean/norm within REL of the data's scale."""
    assert len(got) == len(want) == len(STAT_FIELDS)
    g, w = dict(zip(STAT_FIELDS, got)), dict(zip(STAT_FIELDS, want))
    for name in ("min", "max", "nan_count", "inf_count", "checksum"):
        assert _same_exact(g[name], w[name]), f"{name}: {g[name]!r} != {w[name]!r} ({t.dtype}, {tuple(t.shape)})"
    for name, scale in (("mean", _data_scale(t)), ("norm", abs(w["norm"]))):
        a, b = g[name], w[name]
        if math.isnan(b) or math.isinf(b):
            assert _same_exact(a, b), f"{name}: {a!r} != {b!r}"
        else:
            assert abs(a - b) <= REL * max(abs(b), scale), f"{name}: {a!r} vs {b!r} ({t.dtype}, {tuple(t.shape)})"


def check(t: torch.Tensor) -> tuple[Any, ...]:
    """tensor_stats_row, and the kernel called directly, against the reference; returns the row."""
    want = tuple(reference_stats(t))
    row = tensor_stats_row(t)
    assert type(row) is tuple
    assert_match(row, want, t)
    if t.dtype in stats._NATIVE_CODES and not t.is_neg():
        assert_match(native(t), want, t)  # even when TRACECMP_FORCE_REFERENCE=1 routes around it
    return row


# ---------------------------------------------------------------- adversarial values, per dtype


def _from_values(values: list[float], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).to(dtype)


def float_cases(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    fi = torch.finfo(dtype)
    g = torch.Generator().manual_seed(0)
    inf, nan = math.inf, math.nan
    randn = torch.randn(3 * BLOCK + 5, generator=g, dtype=torch.float64)
    cases = {
        "randn": randn.to(dtype),
        "offset": (randn + 1000).to(dtype),
        "nan_inf": _from_values([1.0, nan, -2.5, inf, -inf, 0.5, nan], dtype),
        "all_nan": torch.full((BLOCK + 3,), nan, dtype=dtype),
        "all_inf": _from_values([inf, inf, -inf], dtype),
        "only_pos_inf": _from_values([inf] * 9, dtype),
        "nan_and_inf_only": _from_values([nan, inf, nan, -inf], dtype),
        "denormals": _from_values(
            [fi.smallest_normal / 2, -fi.smallest_normal / 4, fi.smallest_normal / 1024] * 7, dtype
        ),
        "huge": _from_values([fi.max, -fi.max, fi.max, 1.0, -fi.max / 2], dtype),
        "all_equal": torch.full((2 * BLOCK + 1,), 0.75, dtype=dtype),
        "signed_zeros": _from_values([0.0, -0.0, -0.0, 0.0], dtype),
        "one": _from_values([-3.25], dtype),
        "empty": torch.empty(0, dtype=dtype),
        "scalar": torch.tensor(2.5, dtype=dtype),
        "scalar_nan": torch.tensor(nan, dtype=dtype),
    }
    # A NaN in the middle of an otherwise finite large block, and in the ragged tail.
    spiked = randn.to(dtype).clone()
    spiked[BLOCK + 17] = nan
    spiked[-2] = -inf
    cases["spiked"] = spiked
    if dtype == torch.float64:
        cases["near_1e308"] = _from_values([1e308, -1e308, 1.0, 5.0, -1e308, 1e308], dtype)
    return cases


def int_cases(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if dtype == torch.bool:
        rand = torch.randint(0, 2, (3 * BLOCK + 7,), generator=g).bool()
        return {
            "rand": rand,
            "all_true": torch.ones(BLOCK, dtype=dtype),
            "empty": rand[:0],
            "scalar": torch.tensor(True),
        }
    ii = torch.iinfo(dtype)
    rand = torch.randint(ii.min, ii.max, (3 * BLOCK + 7,), generator=g, dtype=dtype)
    return {
        "rand": rand,
        "extremes": torch.tensor([ii.min, ii.max, 0, ii.max, ii.min, 1], dtype=dtype),
        "all_equal": torch.full((BLOCK + 9,), ii.max, dtype=dtype),
        "empty": rand[:0],
        "scalar": torch.tensor(ii.min, dtype=dtype),
    }


def cases_for(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return float_cases(dtype) if dtype.is_floating_point else int_cases(dtype)


@needs_native
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_values_match_reference(dtype: torch.dtype) -> None:
    for name, t in cases_for(dtype).items():
        try:
            check(t)
        except AssertionError as exc:
            raise AssertionError(f"case {name!r}: {exc}") from exc


@needs_native
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_sizes_around_block_boundaries(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    full = (torch.randn(3 * BLOCK + 20, generator=g) * 50).to(dtype)
    # 8 and 16 are the lane counts (chunk sizes), BLOCK the summation block.
    for n in (1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 8, 3 * BLOCK + 19):
        check(full[:n])


# ---------------------------------------------------------------- layouts


def layouts(base: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views of a (64, 97) tensor that exercise every stride path."""
    cube = base.reshape(4, 16, 97)
    return {
        "contiguous": base,
        "transposed": base.t(),
        "sliced_steps": base[::3, 5::4],
        "column": base[:, 7],
        "expanded_stride0": base[3].expand(5, 97),
        "expanded_scalar": base[2, 2].expand(33, 3),
        "narrow_offset": base.narrow(0, 9, 20).narrow(1, 13, 50),
        "permuted_3d": cube.permute(2, 0, 1),
        "inner_contiguous_rows": cube[:, ::2, 1:],
        "size_one_dims": base[5:6, None, :, None],
        "flip_via_index": base[torch.arange(63, -1, -1)],
    }


@needs_native
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_strided_views_match_contiguous_copies(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    base = (torch.randn(64, 97, generator=g) * 30).to(dtype)
    if dtype.is_floating_point:
        base[10, 20] = math.nan
        base[40, 3] = -math.inf
    for name, view in layouts(base).items():
        check(view)
        # Layout never changes a bit: the kernel gathers in logical order into the same blocks.
        assert _rows_equal(native(view), native(view.contiguous())), name


def _rows_equal(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return all(_same_exact(x, y) for x, y in zip(a, b))


@needs_native
def test_storage_offset_is_respected() -> None:
    storage = torch.arange(100, dtype=torch.float32)
    view = storage[37:41]
    assert view.storage_offset() == 37
    row = tensor_stats_row(view)
    assert row[:4] == (37.0, 40.0, 38.5, math.sqrt(37.0**2 + 38**2 + 39**2 + 40**2))


# ---------------------------------------------------------------- exhaustive 16-bit conversions


@needs_native
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_every_16bit_pattern_converts_exactly(dtype: torch.dtype) -> None:
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    values = bits.view(dtype)
    as_double = values.to(torch.float64).tolist()
    for i in range(values.numel()):
        lo, hi = native(values[i : i + 1])[:2]
        v = as_double[i]
        if math.isnan(v):
            assert math.isnan(lo) and math.isnan(hi)
        else:
            assert lo == hi == v and math.copysign(1, lo) == math.copysign(1, v), (int(bits[i]), lo, v)
    check(values)


@needs_native
def test_signalling_nan_payloads_count_as_nan() -> None:
    bits = torch.tensor([0x7F800001, 0x7FC00000, -1, 0x7F800000, 0x3F800000], dtype=torch.int32)  # -1: negative NaN
    row = check(bits.view(torch.float32))
    assert row[4:6] == (3, 1)


# ---------------------------------------------------------------- threads and accuracy


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int32], ids=str)
def test_thread_split_gives_identical_results(dtype: torch.dtype) -> None:
    n = 5 * stats._PARALLEL_MIN // 2 + 12345  # an uneven number of blocks per thread
    g = torch.Generator().manual_seed(4)
    t = (torch.randn(n, generator=g, dtype=torch.float64) * 7 + 2).to(dtype)
    if dtype.is_floating_point:
        t[n // 3] = math.nan
        t[-1] = math.inf
    rows = t[: n // 7 * 7].reshape(-1, 7)
    for view in (t, rows[:, 1:6], t[: n // 2 * 2].reshape(2, -1).t()):
        one = native(view, 1)
        for threads in (2, 3, 8):
            assert _rows_equal(native(view, threads), one), threads
        assert_match(one, tuple(reference_stats(view)), view)


@needs_native
def test_20m_fp32_mean_and_norm_are_accurate() -> None:
    np = pytest.importorskip("numpy")
    g = torch.Generator().manual_seed(5)
    t = torch.randn(20_000_000, generator=g) * 0.25 + 3.0
    mean, norm = tensor_stats_row(t)[2:4]
    as_double = t.to(torch.float64).numpy()
    exact_mean = math.fsum(as_double) / t.numel()
    exact_norm = math.sqrt(math.fsum(np.square(as_double)))  # fp32 squares are exact in float64
    assert abs(mean - exact_mean) <= 1e-13 * abs(exact_mean)
    assert abs(norm - exact_norm) <= 1e-13 * exact_norm


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_large_adversarial_mean_and_norm_are_within_the_bound(dtype: torch.dtype) -> None:
    """Values over 60 binades with random signs, so that most additions round.

    The sums' error bound (csrc/README.md): every term is exact in float64, so the error is at
    most (kBlock / kLanes - 1 + log2(kLanes) + 2 * ceil(log2(blocks))) * 2**-53 * sum |x|.
    """
    np = pytest.importorskip("numpy")
    g = torch.Generator().manual_seed(8)
    n = 2**23 + 12345  # the largest size whose exact sums (math.fsum) take about a second
    scale = torch.exp2(torch.randint(-30, 31, (n,), generator=g).to(torch.float64))
    x = (torch.randn(n, generator=g, dtype=torch.float64) * scale).to(dtype)
    x[: n // 4] = x[: n // 4].abs()  # a long positive run: large partial sums, then cancellation
    mean, norm = tensor_stats_row(x)[2:4]
    as_double = x.to(torch.float64).numpy()
    lanes = 16 if dtype == torch.bfloat16 else 8
    depth = BLOCK // lanes - 1 + math.log2(lanes) + 2 * math.ceil(math.log2(math.ceil(n / BLOCK)))
    bound = depth * 2.0**-53
    abs_sum = float(np.abs(as_double).sum())
    exact_sum = math.fsum(as_double.tolist())
    exact_sumsq = math.fsum(np.square(as_double).tolist())  # squares of fp32/bf16 are exact in float64
    assert abs(mean * n - exact_sum) <= bound * abs_sum + 4 * 2.0**-53 * abs(mean * n)
    assert abs(norm**2 - exact_sumsq) <= bound * exact_sumsq + 4 * 2.0**-53 * exact_sumsq
    assert abs(mean - exact_sum / n) <= REL * abs_sum / n  # the documented tolerance, with room


_ISA_SCRIPT = """
import math, sys, torch
from tracecmp.capture.native import cstats
from tracecmp.capture.stats import tensor_stats_row
g = torch.Generator().manual_seed(7)
base = torch.randn(3 * 2048 + 77, generator=g, dtype=torch.float64) * 1e3
base[100] = math.nan
base[5000] = -math.inf
base[6100] = -0.0
rows = []
for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
              torch.int16, torch.int32, torch.int64, torch.bool):
    t = base.to(dtype)
    for view in (t, t[::3], t[: 6000].reshape(60, 100).t(), t[: 2048 * 3], t[101:4900]):
        rows.append(tensor_stats_row(view))
print(cstats.ISA)
print(repr(rows))
"""


def _run_isa(level: str | None) -> list[str]:
    """The copy of the kernel a fresh process used under TRACECMP_CSTATS_ISA=level, and its rows."""
    env = {k: v for k, v in os.environ.items() if k != "TRACECMP_CSTATS_ISA"}
    if level is not None:
        env["TRACECMP_CSTATS_ISA"] = level
    out = subprocess.run([sys.executable, "-c", _ISA_SCRIPT], env=env, capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


@needs_native
def test_every_isa_copy_gives_identical_bits() -> None:
    # TRACECMP_CSTATS_ISA caps the copy used at a level; the CPU may cap it lower.
    default_isa, default_rows = _run_isa(None)
    ran = {default_isa}
    for level in ("baseline", "avx2", "avx512"):
        isa, rows = _run_isa(level)
        ran.add(isa)
        assert rows == default_rows, f"{isa} differs from {default_isa}"
    if platform.machine() in ("x86_64", "AMD64") and "avx2" in _cpu_flags():
        assert {"baseline", "avx2"} <= ran
        if {"avx512f", "avx512vl"} <= _cpu_flags():
            assert "avx512" in ran


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def test_unknown_isa_name_leaves_the_reference() -> None:
    code = "from tracecmp.capture import stats; print(stats.native_error())"
    env = dict(os.environ, TRACECMP_CSTATS_ISA="sse9")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "TRACECMP_CSTATS_ISA" in out.stdout or not native_available()


def test_unknown_pool_name_leaves_the_reference() -> None:
    code = "from tracecmp.capture import stats; print(stats.native_error())"
    env = dict(os.environ, TRACECMP_CSTATS_POOL="fibers")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "TRACECMP_CSTATS_POOL" in out.stdout or not native_available()


# ---------------------------------------------------------------- routing and the Python entry points


@needs_native
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_complex_and_conjugate_views(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(6)
    z = torch.randn(33, 5, generator=g, dtype=dtype)
    for t in (z, z.conj(), z.t(), z[::2].conj(), z[1, 2], z[:0]):
        check(t)
    assert tensor_stats_row(z.conj()) != tensor_stats_row(z)


@needs_native
def test_negative_bit_views_use_their_values() -> None:
    z = torch.tensor([1 + 2j, 3 - 4j, -5 + 0.5j])
    imag = z.conj().imag
    assert imag.is_neg()
    row = check(imag)
    assert row[:2] == (-2.0, 4.0)
    assert row == tensor_stats_row(imag.resolve_neg())


def test_reference_handles_conjugate_and_negative_views() -> None:
    z = torch.tensor([1 + 2j, 3 - 4j])
    assert reference_stats(z.conj()).min == -2.0
    assert reference_stats(z.conj().imag).max == 4.0


def test_tensor_stats_is_the_named_row() -> None:
    t = torch.tensor([[1.0, math.nan], [math.inf, -2.0]])
    s = tensor_stats(t)
    assert isinstance(s, TensorStats)
    assert tuple(s) == tensor_stats_row(t)
    assert (s.min, s.max, s.mean, s.nan_count, s.inf_count) == (-2.0, math.inf, -0.5, 1, 1)


@pytest.mark.parametrize("dtype", [getattr(torch, "uint16", None), torch.float8_e5m2], ids=["uint16", "float8_e5m2"])
def test_dtype_outside_the_kernel_uses_the_reference(dtype: torch.dtype | None) -> None:
    if dtype is None:
        dtype = torch.int32  # torch < 2.3 has no uint16; int32 is inside the kernel and must agree too
    t = torch.tensor([1, 5, 2], dtype=torch.float32).to(dtype)
    assert tensor_stats_row(t) == tuple(reference_stats(t))


def test_force_reference_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[torch.Tensor] = []
    real = stats.reference_stats

    def spy(t: torch.Tensor) -> TensorStats:
        calls.append(t)
        return real(t)

    monkeypatch.setattr(stats, "reference_stats", spy)
    t = torch.randn(10)
    try:
        set_force_reference(True)
        forced = tensor_stats_row(t)
        assert len(calls) == 1
        set_force_reference(False)
        tensor_stats_row(t)
        assert len(calls) == (1 if native_available() else 2)
    finally:
        set_force_reference(os.environ.get("TRACECMP_FORCE_REFERENCE", "") == "1")
    assert_match(forced, tuple(real(t)), t)


def test_force_reference_env_var_at_import() -> None:
    code = "from tracecmp.capture import stats; print(stats._native_stats is None)"
    env = dict(os.environ, TRACECMP_FORCE_REFERENCE="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


def test_native_is_built_when_required() -> None:
    if os.environ.get("TRACECMP_REQUIRE_NATIVE") != "1":
        pytest.skip("TRACECMP_REQUIRE_NATIVE=1 not set")
    assert native_available(), native_error()


@needs_native
@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.stats(0, (2,), (1,), 0, 3, 1),  # numel disagrees with shape
        lambda m: m.stats(0, (2,), (1, 1), 0, 2, 1),  # strides and shape differ in length
        lambda m: m.stats(0, (2,), (1,), 99, 2, 1),  # unknown dtype code
        lambda m: m.stats(0, (2,), (1,), 0, 2, 1),  # null data pointer
        lambda m: m.stats(0, (1,) * 65, (1,) * 65, 0, 1, 1),  # too many dims
    ],
)
def test_bad_arguments_raise(call: Callable[[Any], Any]) -> None:
    with pytest.raises(ValueError):
        call(cstats)


@needs_native
def test_wrong_arity_raises_type_error() -> None:
    with pytest.raises(TypeError):
        cstats.stats(0, (), ())
