"""Per-tensor comparison metrics: from recorded statistics always, from whole tensors when saved.

Statistics give *lower bounds* of the true error, which is what makes them safe to localize with:

* ``e_ext`` = max(|max_t - max_b|, |min_t - min_b|) / amax  <= max|t - b| / amax
  (rounding is monotone, so rounding alone moves an extreme by at most one rounding unit);
* ``e_sys`` = max(|rms_t - rms_b|, |mean_t - mean_b|) / rms  <= rms(t - b) / rms
  (triangle and Cauchy-Schwarz inequalities). Random rounding moves it only by ~u/sqrt(n), a
  systematic error (a scale, a bias, a changed eps) by its full size, so it sees small systematic
  faults that drown in elementwise noise.

Magnitudes (amax, rms) are the larger of the two runs', so a tensor that is exactly zero in one run
is judged relative to the other and a near-zero tensor never yields a 133031 % error. NaN/Inf are
compared as counts; bitwise identity by checksum. Integer and bool tensors compare exactly. A
mask each run filled with its own dtype's ``finfo.min`` is *filled* (see :data:`FILLS`): its
fills compare as equal, and only its finite elements and which elements are filled count.

With whole tensors in both traces: cosine similarity, max absolute error, max relative error with
a floor of ``rel_floor * rms`` for near-zero elements, RMSE, and the share of elements within 1/1000
and 5/1000 relative error (the seeds' metrics); ``e_ext`` and ``e_rms`` then become exact.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from tracecmp.comparison.tolerances import Tolerances
from tracecmp.numerics.units import EPS, TINY, canonical_dtype
from tracecmp.trace.saved import SavedTensors

STAT_METRICS = (
    "exact",
    "numel",
    "unit",
    "nonfinite_mismatch",
    "filled",
    "amax",
    "rms",
    "e_ext",
    "e_sys",
    "max_diff",
    "min_diff",
    "mean_diff",
    "norm_rel_diff",
    "within_tol",
)
# torch.finfo(dtype).max of bfloat16, float32 and float64: what a program fills a mask with
# (``masked_fill(mask, finfo(dtype).min)``), each run its own dtype's. Elements at a fill are given,
# not computed: exp of either is 0, and their 0.4% difference is no error (see stat_metrics).
# float16's 65504 is left out: a tensor's own values reach it (a saturated cast), and a float16
# mask's finite entries can weigh as much as its fills in its mean and norm.
FILLS = (3.3895313892515355e38, 3.4028234663852886e38, 1.7976931348623157e308)
# A filled tensor's mean and norm, scaled to the bench's fill, differ by far less than this unless
# an element is filled in one run and not in the other (then by at least 1 / numel).
_FILL_PATTERN = 1e-12
TENSOR_METRICS = (
    "cosine",
    "max_abs_err",
    "max_rel_err",
    "rmse",
    "e_rms",
    "within_1e-3",
    "within_5e-3",
    "seed_rule_fail",
)


def _eps(dtypes: pd.Series) -> np.ndarray:
    """Rounding unit per row (0 for integer/bool: exact comparison), one lookup per distinct dtype."""
    table = {d: EPS.get(canonical_dtype(d), 0.0) for d in dtypes.unique()}
    return dtypes.map(table).to_numpy(np.float64)


def stat_metrics(pairs: pd.DataFrame, tolerances: Tolerances) -> pd.DataFrame:
    """Add the statistics-based metrics to ``pairs`` (target columns plain, bench columns ``*_b``).

    ``pairs`` needs: shape, dtype, min, max, mean, norm, nan_count, inf_count, checksum, has_stats,
    and the same with ``_b``. Returns a frame with :data:`STAT_METRICS` columns, same index.

    >>> row = dict(shape=[4], dtype="float32", min=-1.0, max=1.0, mean=0.0, norm=2.0, nan_count=0,
    ...            inf_count=0, checksum=1, has_stats=True)
    >>> frame = pd.DataFrame([{**row, **{k + "_b": v for k, v in row.items()}}])
    >>> bool(stat_metrics(frame, Tolerances())["exact"][0])
    True
    """
    out = pd.DataFrame(index=pairs.index)
    if pairs.empty:
        for name in STAT_METRICS:
            out[name] = pd.Series(dtype=float)
        return out
    numel, numel_b = _numel(pairs["shape"]), _numel(pairs["shape_b"])
    eps_t, eps_b = _eps(pairs["dtype"]), _eps(pairs["dtype_b"])
    unit = np.maximum(eps_t, eps_b)  # the coarser dtype's unit
    canon = {d: canonical_dtype(d) for d in pd.concat([pairs["dtype"], pairs["dtype_b"]]).unique()}
    same_dtype = (pairs["dtype"].map(canon) == pairs["dtype_b"].map(canon)).to_numpy(bool)
    has = pairs["has_stats"].to_numpy(bool) & pairs["has_stats_b"].to_numpy(bool)
    exact = has & same_dtype & (numel == numel_b) & (pairs["checksum"].to_numpy() == pairs["checksum_b"].to_numpy())

    lo_t, hi_t, mean_t, norm_t = _floats(pairs, "min", "max", "mean", "norm")
    lo_b, hi_b, mean_b, norm_b = _floats(pairs, "min_b", "max_b", "mean_b", "norm_b")
    lo_fill, hi_fill, fill_scale = _fills(has, lo_t, hi_t, lo_b, hi_b)
    filled = lo_fill | hi_fill
    mean_t, norm_t = mean_t * fill_scale, norm_t * fill_scale
    nan_t, inf_t, nan_b, inf_b = _floats(pairs, "nan_count", "inf_count", "nan_count_b", "inf_count_b")
    nonfinite_mismatch = has & ((nan_t != nan_b) | (inf_t != inf_b))
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        fin_t = np.maximum(numel - nan_t - inf_t, 1.0)
        fin_b = np.maximum(numel_b - nan_b - inf_b, 1.0)
        rms_t, rms_b = norm_t / np.sqrt(fin_t), norm_b / np.sqrt(fin_b)
        rms = np.fmax(rms_t, rms_b)
        # Infinite extremes say nothing about the finite values' error (the counts carry them):
        # an extreme is compared only where both runs' are finite, and magnitudes use finite ones.
        amax = _finite_amax(lo_t, hi_t, lo_b, hi_b, rms)
        max_diff, min_diff = _extreme_diff(hi_t, hi_b, hi_fill), _extreme_diff(lo_t, lo_b, lo_fill)
        mean_diff, norm_diff = np.abs(mean_t - mean_b), np.abs(norm_t - norm_b)
        e_ext = np.fmax(max_diff, min_diff) / np.maximum(amax, TINY)
        # Each side's rms over its own finite elements: the same as |norm_t - norm_b| / sqrt(n) for
        # two tensors of n finite elements, and zero for a tensor against its broadcast copy (a
        # region's [T, T] mask against the bench's [B, 1, T, T] one).
        e_sys = np.fmax(np.abs(rms_t - rms_b), mean_diff) / np.maximum(rms, TINY)
        norm_rel = norm_diff / np.maximum(np.fmax(norm_t, norm_b), TINY)
        both_zero = (amax == 0) & (rms == 0)
    e_ext = np.where(both_zero | exact, 0.0, np.nan_to_num(e_ext, nan=0.0))
    e_sys = np.where(both_zero | exact, 0.0, np.nan_to_num(e_sys, nan=0.0))
    # torch.testing's criterion |t - b| <= atol + rtol * |b|, applied to what statistics show.
    rtol, atol = _tolerance_bounds(pairs, canon, tolerances)
    with np.errstate(invalid="ignore"):
        within = (np.nan_to_num(np.fmax(max_diff, min_diff), nan=0.0) <= atol + rtol * np.nan_to_num(amax, nan=0.0)) & (
            np.nan_to_num(mean_diff, nan=0.0) <= atol + rtol * np.nan_to_num(rms, nan=0.0)
        )
    is_int = unit == 0
    within = np.where(is_int, exact, within) & ~nonfinite_mismatch
    # Elements filled in one run and not in the other: as wrong as a changed integer. Filled alike,
    # the rest of a filled tensor's mean and norm is the rounding of their sums, no error.
    refilled = filled & (e_sys > _FILL_PATTERN)
    changed = (is_int | refilled) & has & ~exact
    e_ext = np.where(changed, 1.0, e_ext)
    e_sys = np.where(changed, 1.0, np.where(filled, 0.0, e_sys))
    out["exact"] = exact
    out["numel"] = numel.astype(np.int64)
    out["unit"] = unit
    out["nonfinite_mismatch"] = nonfinite_mismatch
    out["filled"] = filled
    out["amax"] = np.nan_to_num(amax, nan=0.0, posinf=0.0)
    out["rms"] = np.nan_to_num(rms, nan=0.0, posinf=0.0)
    out["e_ext"] = e_ext
    out["e_sys"] = e_sys
    out["max_diff"] = max_diff
    out["min_diff"] = min_diff
    out["mean_diff"] = mean_diff
    out["norm_rel_diff"] = np.where(exact, 0.0, norm_rel)
    out["within_tol"] = within & has
    return out


def _numel(shapes: pd.Series) -> np.ndarray:
    """Element count per row (0 where the shape is unknown), as floats."""
    return np.array([math.prod(s) if s is not None else 0 for s in shapes], dtype=np.float64)


def _floats(pairs: pd.DataFrame, *names: str) -> list[np.ndarray]:
    """The columns ``names`` of ``pairs`` as float64 arrays."""
    return [pairs[name].to_numpy(np.float64) for name in names]


def _fills(
    has: np.ndarray, lo_t: np.ndarray, hi_t: np.ndarray, lo_b: np.ndarray, hi_b: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row, whether the minimum and the maximum are fills in both runs, and the scale from the
    target's fill to the bench's (1 where neither is).

    A mask each run filled with its own dtype's finfo.min (or .max): the fills are the same
    argument, so the extremes at them compare as equal, and mean and norm, which the fills
    dominate, compare with the target's fill scaled to the bench's. What is left of them says
    whether the same elements are filled; the finite elements are seen at the other extreme.
    (A tensor that is all fill, scalar_tensor(finfo.min), has one at both extremes.)
    """
    fills = np.asarray(FILLS)
    lo_fill = has & np.isin(np.abs(lo_t), fills) & np.isin(np.abs(lo_b), fills) & (np.sign(lo_t) == np.sign(lo_b))
    hi_fill = has & np.isin(np.abs(hi_t), fills) & np.isin(np.abs(hi_b), fills) & (np.sign(hi_t) == np.sign(hi_b))
    with np.errstate(invalid="ignore", divide="ignore"):
        fill_scale = np.where(
            lo_fill, lo_b / np.where(lo_fill, lo_t, 1.0), np.where(hi_fill, hi_b / np.where(hi_fill, hi_t, 1.0), 1.0)
        )
    return lo_fill, hi_fill, fill_scale


def _finite_amax(lo_t: np.ndarray, hi_t: np.ndarray, lo_b: np.ndarray, hi_b: np.ndarray, rms: np.ndarray) -> np.ndarray:
    """The largest finite extreme of either run in magnitude, at least ``rms`` (``rms`` where none is finite)."""
    lo_t, hi_t, lo_b, hi_b = (np.where(np.isfinite(v), np.abs(v), np.nan) for v in (lo_t, hi_t, lo_b, hi_b))
    amax = np.fmax(np.fmax(lo_t, hi_t), np.fmax(lo_b, hi_b))
    return np.where(np.isnan(amax), rms, np.fmax(amax, rms))


def _extreme_diff(t: np.ndarray, b: np.ndarray, fill: np.ndarray) -> np.ndarray:
    """|t - b| of one extreme where both runs' are finite (else 0 where equal, NaN where not); 0 at fills."""
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.where(np.isfinite(t) & np.isfinite(b), np.abs(t - b), np.where(t == b, 0.0, np.nan))
    return np.where(fill, 0.0, diff)


def _tolerance_bounds(
    pairs: pd.DataFrame, canon: dict[str, str], tolerances: Tolerances
) -> tuple[np.ndarray, np.ndarray]:
    """Per row rtol and atol: the larger of the target's and the bench's dtype's."""
    rtol_of = {d: tolerances.rtol(d) for d in canon}
    atol_of = {d: tolerances.atol(d) for d in canon}
    rtol = np.maximum(
        pairs["dtype"].map(rtol_of).to_numpy(np.float64), pairs["dtype_b"].map(rtol_of).to_numpy(np.float64)
    )
    atol = np.maximum(
        pairs["dtype"].map(atol_of).to_numpy(np.float64), pairs["dtype_b"].map(atol_of).to_numpy(np.float64)
    )
    return rtol, atol


def tensor_metrics(t: Any, b: Any, tolerances: Tolerances) -> dict[str, float]:
    """Elementwise metrics of two whole tensors (torch), in float64.

    >>> import torch
    >>> m = tensor_metrics(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.002]), Tolerances())
    >>> round(m["max_rel_err"], 6), m["within_1e-3"]
    (0.000999, 1.0)
    """
    import torch

    if t.shape != b.shape:
        return {}  # elementwise metrics need the same layout; statistics still compare
    if t.is_complex() or b.is_complex():
        t, b = torch.view_as_real(t.resolve_conj()), torch.view_as_real(b.resolve_conj())
    td, bd = t.detach().to(torch.float64).reshape(-1), b.detach().to(torch.float64).reshape(-1)
    if td.numel() == 0:
        return {
            "cosine": 1.0,
            "max_abs_err": 0.0,
            "max_rel_err": 0.0,
            "rmse": 0.0,
            "e_rms": 0.0,
            "within_1e-3": 1.0,
            "within_5e-3": 1.0,
            "seed_rule_fail": False,
        }
    finite = torch.isfinite(td) & torch.isfinite(bd)
    td, bd = td[finite], bd[finite]
    big = td.abs() >= min(FILLS)
    if bool(big.any()):  # elements both runs filled with their own dtype's finfo.min/max are given
        fills = td.new_tensor(FILLS)
        given = torch.isin(td.abs(), fills) & torch.isin(bd.abs(), fills) & (td.sign() == bd.sign())
        td = torch.where(given, bd, td)
    if td.numel() == 0:
        return {}
    diff = (td - bd).abs()
    rms_b = float(bd.norm()) / math.sqrt(bd.numel())
    rms = max(rms_b, float(td.norm()) / math.sqrt(td.numel()))
    floor = max(tolerances.rel_floor * rms, TINY)
    rel = diff / torch.clamp(bd.abs(), min=floor)
    nt, nb = float(td.norm()), float(bd.norm())
    if nt == 0 and nb == 0:
        cosine = 1.0
    elif nt == 0 or nb == 0:
        cosine = 0.0
    else:
        cosine = float(torch.dot(td, bd)) / (nt * nb)
    max_abs = float(diff.max())
    rmse = float(diff.square().mean().sqrt())
    # The seeds' rule (ptdbg/msprobe): wrong when (cos < 0.99 and max abs > 1e-3) or cos < 0.9 or max abs > 1.
    fail = (
        (cosine < tolerances.cosine_warn and max_abs > tolerances.max_abs_warn)
        or cosine < tolerances.cosine_fail
        or (max_abs > tolerances.max_abs_fail)
    )
    return {
        "cosine": cosine,
        "max_abs_err": max_abs,
        "max_rel_err": float(rel.max()),
        "rmse": rmse,
        "e_rms": rmse / max(rms, TINY) if rms > 0 else 0.0,
        "within_1e-3": float((rel <= 1e-3).double().mean()),
        "within_5e-3": float((rel <= 5e-3).double().mean()),
        "seed_rule_fail": bool(fail),
    }


def add_tensor_metrics(frame: pd.DataFrame, target: Any, bench: Any, tolerances: Tolerances) -> pd.DataFrame:
    """Fill :data:`TENSOR_METRICS` for rows whose tensors were saved in both traces (``data_key``/``data_key_b``).

    ``target`` and ``bench`` are the two :class:`~tracecmp.trace.reader.RankTrace`.
    """
    saved = frame["data_key"].astype(bool) & frame["data_key_b"].astype(bool)
    for name in TENSOR_METRICS:
        frame[name] = np.nan if name != "seed_rule_fail" else False
    if not saved.any():
        return frame
    rows = []
    with SavedTensors(target) as load_t, SavedTensors(bench) as load_b:
        for index, key_t, key_b in zip(
            frame.index[saved], frame.loc[saved, "data_key"], frame.loc[saved, "data_key_b"]
        ):
            metrics = tensor_metrics(load_t.get(key_t), load_b.get(key_b), tolerances)
            if metrics:
                rows.append((index, metrics))
    for index, metrics in rows:
        for name, value in metrics.items():
            frame.at[index, name] = value
    # Whole tensors give the exact max error and an rms error instead of lower bounds.
    has = frame["max_abs_err"].notna()
    with np.errstate(invalid="ignore", divide="ignore"):
        exact_ext = frame["max_abs_err"] / np.maximum(frame["amax"], TINY)
    frame.loc[has, "e_ext"] = np.where(frame.loc[has, "exact"], 0.0, np.fmax(frame.loc[has, "e_ext"], exact_ext[has]))
    return frame
