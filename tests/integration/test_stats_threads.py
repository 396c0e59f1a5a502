"""A trace does not depend on how many threads recorded it.

The statistics pass splits tensors of ``PARALLEL_MIN`` elements or more over torch's intra-op
threads (``torch.get_num_threads()``). A program whose ops give the same bits at any thread count
(element-wise arithmetic, its backward, casts) is captured at 1, 2 and 4 threads, through torch's
OpenMP team and through the pass's own pool of threads: every tensor row, statistics included,
must be equal bit for bit, and equal to the pure-torch reference's rows (exact fields bit for bit,
mean and norm within rounding: the reference adds in another order).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
import textwrap
from typing import Any

import pytest
import torch

import tracecmp
from tests.conftest import ROOT
from tracecmp.capture import stats
from tracecmp.trace.schema import TENSORS_SCHEMA

pytestmark = pytest.mark.skipif(not stats.native_available(), reason=f"C++ kernel not built: {stats.native_error()}")

_FIELDS = TENSORS_SCHEMA.names
_MEAN, _NORM = _FIELDS.index("mean"), _FIELDS.index("norm")


def program() -> None:
    """Element-wise work on tensors below, at and well above the parallel size, several dtypes."""
    g = torch.Generator().manual_seed(0)
    n = stats._PARALLEL_MIN
    for size in (n // 2, n, 3 * n + 12345):
        x = (torch.randn(size, generator=g) * 3).requires_grad_()
        y = (x * 2 + 1).relu() - x
        y.backward(torch.ones_like(y))  # element-wise backward; no reduction, whose bits follow threads
        z = y.detach()
        z[size // 3] = math.nan
        z[-1] = -math.inf
        (z * 0.5).to(torch.bfloat16) + 1
        (z.to(torch.float64) - 2).abs()
        (z * 1000).to(torch.int64) // 7
    cols = torch.randn(4, n, generator=g).t() * 2  # an output with transposed strides: the strided walk
    cols + 1


def _rows(threads: int) -> list[str]:
    """The capture's tensor rows at ``threads``, as text (exact for floats, NaN equal to NaN)."""
    return [repr(row) for row in _raw_rows(threads)]


def _raw_rows(threads: int) -> list[tuple[Any, ...]]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with tracecmp.TraceCompare(tempfile.mkdtemp() + "/run", flush_secs=3600) as tc:
            program()
            mode = tc._mode
            assert mode is not None
            return list(mode.tensor_rows)
    finally:
        torch.set_num_threads(before)


def test_rows_equal_at_every_thread_count_and_match_the_reference() -> None:
    raw = _raw_rows(1)
    has_stats, shape = _FIELDS.index("has_stats"), _FIELDS.index("shape")
    parallel = [row for row in raw if row[has_stats] and math.prod(row[shape]) >= stats._PARALLEL_MIN]
    assert len(parallel) >= 20  # the rows that went over threads, when there were several
    one = [repr(row) for row in raw]
    for threads in (2, 4):
        assert _rows(threads) == one, threads
    stats.set_force_reference(True)
    try:
        reference = _raw_rows(1)
    finally:
        stats.set_force_reference(os.environ.get("TRACECMP_FORCE_REFERENCE", "") == "1")
    assert len(reference) == len(one)
    exact = [i for i in range(len(_FIELDS)) if i not in (_MEAN, _NORM)]
    for mine, ref in zip(raw, reference):
        assert repr([mine[i] for i in exact]) == repr([ref[i] for i in exact])
        for i in (_MEAN, _NORM):
            if ref[i] is None:  # a row without statistics (none taken on either path)
                assert mine[i] is None
            else:
                assert mine[i] == pytest.approx(ref[i], rel=1e-12, abs=1e-12, nan_ok=True)


_IN_POOL = textwrap.dedent(
    """
    from tracecmp.capture.native import cstats
    from tests.integration.test_stats_threads import _rows
    print(cstats.POOL)
    for threads in (1, 2, 4):
        print(_rows(threads))
    """
)


def test_own_pool_gives_the_same_rows() -> None:
    """TRACECMP_CSTATS_POOL=threads: the pass's own threads instead of torch's team, same bits."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRACECMP_CSTATS_POOL="threads")
    out = subprocess.run(
        [sys.executable, "-c", _IN_POOL], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "threads"
    assert lines[1:] == [str(_rows(1))] * 3
