"""Per-tensor metrics from statistics and from whole tensors, and the per-dtype tolerances."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from tests.tracebuild import stats_of
from tracecmp.comparison.metrics import stat_metrics, tensor_metrics
from tracecmp.comparison.tolerances import Tolerances
from tracecmp.errors import CompareError
from tracecmp.numerics.units import EPS, eps_of


def _pair(t: torch.Tensor, b: torch.Tensor) -> pd.Series:
    row = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "has_stats": True, **stats_of(t)}
    bench = {"shape": list(b.shape), "dtype": str(b.dtype).removeprefix("torch."), "has_stats": True, **stats_of(b)}
    frame = pd.DataFrame([{**row, **{k + "_b": v for k, v in bench.items()}}])
    return stat_metrics(frame, Tolerances()).iloc[0]


def test_bitwise_equal_tensors_are_exact_with_zero_error():
    x = torch.randn(100)
    m = _pair(x, x.clone())
    assert m["exact"] and m["e_ext"] == 0 and m["e_sys"] == 0 and m["within_tol"]


def test_one_ulp_difference_is_not_exact_but_within_tolerance():
    x = torch.randn(100)
    y = x.clone()
    y[3] = torch.nextafter(y[3], torch.tensor(math.inf))
    m = _pair(y, x)
    assert not m["exact"]
    assert m["within_tol"]
    assert m["e_ext"] <= EPS["float32"] and m["e_sys"] < EPS["float32"]


def test_systematic_scale_shows_in_the_norm_channel_at_full_size():
    x = torch.randn(10_000, dtype=torch.float64)
    m = _pair(x * (1 + 1e-6), x)
    assert m["e_sys"] == pytest.approx(1e-6, rel=1e-3)


def test_near_zero_tensor_gives_no_false_alarm():
    # A gradient that is tiny everywhere, off by rounding: relative to its own magnitude the
    # error is small, whatever its absolute size; elementwise max_rel_err is floored.
    b = torch.randn(1000) * 1e-12
    t = b * (1 + 1e-7 * torch.randn(1000))
    m = _pair(t, b)
    assert m["e_ext"] < 1e-5 and m["e_sys"] < 1e-5 and m["within_tol"]
    # One element of the bench exactly 0 where the target has rounding noise.
    b2 = torch.tensor([1.0, 2.0, 0.0, -1.5])
    t2 = torch.tensor([1.0, 2.0, 1e-9, -1.5])
    tm = tensor_metrics(t2, b2, Tolerances())
    assert tm["max_rel_err"] < 1e-5  # not 1e-9 / 0, not 133031 %
    assert tm["cosine"] == pytest.approx(1.0)


def test_nan_counts_are_compared():
    b = torch.randn(50)
    t = b.clone()
    t[7] = math.nan
    m = _pair(t, b)
    assert m["nonfinite_mismatch"] and not m["within_tol"]
    same = _pair(t, t.clone())
    assert not same["nonfinite_mismatch"] and same["exact"]


def test_inf_extremes_do_not_hide_the_finite_error():
    b = torch.tensor([-math.inf, -1.0, 0.5, 2.0])
    t = torch.tensor([-math.inf, -1.0, 0.5, 2.2])
    m = _pair(t, b)
    assert not m["nonfinite_mismatch"]
    assert m["e_ext"] == pytest.approx(0.2 / 2.2, rel=1e-6)
    assert math.isfinite(m["amax"])
    t2 = torch.tensor([-1.0, -1.0, 0.5, 2.0])
    assert _pair(t2, b)["nonfinite_mismatch"]


def test_empty_tensors_agree():
    e = torch.empty(0, 3)
    m = _pair(e, e.clone())
    assert m["exact"] and m["within_tol"] and m["e_ext"] == 0
    tm = tensor_metrics(e, e.clone(), Tolerances())
    assert tm["cosine"] == 1.0 and tm["max_abs_err"] == 0.0


def test_integer_tensors_compare_exactly():
    a = torch.arange(10)
    m = _pair(a, a.clone())
    assert m["exact"] and m["unit"] == 0
    b = a.clone()
    b[4] += 1
    m2 = _pair(b, a)
    assert not m2["exact"] and not m2["within_tol"] and m2["e_ext"] == 1.0


def test_dtype_difference_uses_the_coarser_rounding_unit():
    x = torch.randn(64)
    m = _pair(x.to(torch.bfloat16), x)
    assert m["unit"] == EPS["bfloat16"]
    assert not m["exact"]
    assert m["e_ext"] <= EPS["bfloat16"] / 2  # rounding moves an extreme by at most half a unit


def _padding_mask(dtype: torch.dtype, padded: slice = slice(6, 8)) -> torch.Tensor:
    """An additive mask as each run builds it: 0 where attended, its own dtype's finfo.min where padded."""
    mask = torch.zeros(2, 1, 8, 8, dtype=dtype)
    mask[1, :, :, padded] = torch.finfo(dtype).min
    return mask


def test_a_mask_filled_with_each_runs_finfo_min_compares_its_finite_elements():
    # bf16's finfo.min is 0.4% off float32's: as plain numbers that error hid every other one
    m = _pair(_padding_mask(torch.bfloat16), _padding_mask(torch.float32))
    assert m["filled"] and m["e_ext"] == 0.0 and m["e_sys"] == 0.0, m
    assert (
        tensor_metrics(_padding_mask(torch.bfloat16), _padding_mask(torch.float32), Tolerances())["max_abs_err"] == 0.0
    )
    # all fill (scalar_tensor(finfo.min)): both extremes are fills
    m = _pair(
        torch.tensor([torch.finfo(torch.bfloat16).min], dtype=torch.bfloat16),
        torch.tensor([torch.finfo(torch.float32).min]),
    )
    assert m["filled"] and m["e_ext"] == 0.0 and m["e_sys"] == 0.0, m
    # its finite elements still count, at the extreme the fills leave alone
    t, b = _padding_mask(torch.bfloat16), _padding_mask(torch.float32)
    t[0, 0, 0, 0] = 2.0
    m = _pair(t, b)
    assert m["filled"] and m["max_diff"] == 2.0 and m["min_diff"] == 0.0, m
    assert tensor_metrics(t, b, Tolerances())["max_abs_err"] == 2.0


def test_a_mask_filled_elsewhere_is_as_wrong_as_a_changed_integer():
    m = _pair(_padding_mask(torch.bfloat16, slice(5, 8)), _padding_mask(torch.float32))
    assert m["filled"] and m["e_ext"] == 1.0 and m["e_sys"] == 1.0, m
    assert (
        tensor_metrics(_padding_mask(torch.bfloat16, slice(5, 8)), _padding_mask(torch.float32), Tolerances())[
            "max_abs_err"
        ]
        > 1e38
    )
    # float16's finfo.min (65504) is a value data reaches, not a fill: compared as it is
    m = _pair(_padding_mask(torch.float16), _padding_mask(torch.float32))
    assert not m["filled"] and m["min_diff"] > 1e38


def test_tensor_metrics_match_hand_computation():
    b = torch.tensor([1.0, 2.0, 3.0, 4.0])
    t = torch.tensor([1.0, 2.0, 3.0, 4.4])
    m = tensor_metrics(t, b, Tolerances())
    assert m["max_abs_err"] == pytest.approx(0.4, rel=1e-6)
    assert m["max_rel_err"] == pytest.approx(0.1, rel=1e-6)
    assert m["rmse"] == pytest.approx(0.2, rel=1e-6)
    assert m["within_1e-3"] == 0.75 and m["within_5e-3"] == 0.75
    expected_cos = float(torch.dot(t, b) / (t.norm() * b.norm()))
    assert m["cosine"] == pytest.approx(expected_cos)
    assert not m["seed_rule_fail"]  # cosine ~0.9995 and max abs 0.4 < 1


def test_seed_rule_flags_low_cosine_with_large_error():
    b = torch.tensor([1.0, -1.0, 1.0, -1.0])
    assert tensor_metrics(-b, b, Tolerances())["seed_rule_fail"]


def test_default_tolerances_are_torch_testings():
    from torch.testing._comparison import _DTYPE_PRECISIONS

    tol = Tolerances()
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        name = str(dtype).removeprefix("torch.")
        assert (tol.rtol(name), tol.atol(name)) == _DTYPE_PRECISIONS[dtype]
        assert eps_of(name) == torch.finfo(dtype).eps


def test_tolerances_parse_and_validate():
    tol = Tolerances.parse("bf16=0.02:1e-4,margin=8,allow_tf32=0")
    assert tol.rtol("bfloat16") == 0.02 and tol.atol("bfloat16") == 1e-4
    assert tol.margin == 8 and tol.allow_tf32 is False
    assert tol.rtol("float32") == 1.3e-6  # untouched entries keep their defaults
    for bad in ("bf16", "bf16=x", "nonsense=1", "margin=-1"):
        with pytest.raises(CompareError):
            Tolerances.parse(bad)
