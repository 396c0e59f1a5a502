"""``tracecmp compare`` in a subprocess: exit codes 0/1/2, tables written, one-line errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from tests.tracebuild import TraceBuilder

A = torch.ops.aten
ROOT = Path(__file__).resolve().parents[2]


def _run(path: Path, factor: float = 1.0, complete: bool = True) -> Path:
    b = TraceBuilder(complete=complete)
    x = b.source("input.0", torch.linspace(-1, 1, 64).reshape(8, 8))
    w = b.param("fc.weight", torch.eye(8))
    h = b.call(A.mm.default, x, w, module="fc")
    g = b.call(A.gelu.default, h, module="act", fault=(lambda t: t * factor) if factor != 1.0 else None)
    b.call(A.sum.default, g)
    return b.write(path)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tracecmp", "compare", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    return {
        "bench": _run(root / "bench"),
        "same": _run(root / "same"),
        "bad": _run(root / "bad", 1.05),
        "partial": _run(root / "partial", complete=False),
        "root": root,
    }


def test_agreeing_runs_exit_0(runs):
    proc = cli(str(runs["same"]), str(runs["bench"]))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("AGREE")


def test_divergence_exits_1_and_writes_tables(runs, tmp_path):
    out = tmp_path / "out"
    proc = cli(str(runs["bad"]), str(runs["bench"]), "-o", str(out), "--no-report", "--xlsx")
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.startswith("DIVERGED") and "aten.gelu.default" in proc.stdout and "act" in proc.stdout
    nodes = pd.read_csv(out / "nodes.csv")
    assert {"op_id", "bench_op_id", "status", "error", "introduced", "metric"} <= set(nodes.columns)
    suspects = pd.read_csv(out / "suspects.csv")
    assert suspects["op"].tolist() == ["aten.gelu.default"]
    assert (out / "tensors.csv").exists() and (out / "unpaired_bench.csv").exists() and (out / "compare.xlsx").exists()


def test_exact_mode_and_strict(runs):
    assert cli(str(runs["same"]), str(runs["bench"]), "--exact").returncode == 0
    assert cli(str(runs["bad"]), str(runs["bench"]), "--exact").returncode == 1
    partial = cli(str(runs["partial"]), str(runs["bench"]))
    assert partial.returncode == 3 and partial.stdout.startswith("INCOMPLETE")
    assert "incomplete" in partial.stdout
    assert cli(str(runs["partial"]), str(runs["bench"]), "--allow-incomplete").returncode == 0
    assert cli(str(runs["partial"]), str(runs["bench"]), "--strict").returncode == 1


def test_bad_path_exits_2_with_one_line(runs):
    proc = cli(str(runs["root"] / "missing"), str(runs["bench"]))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "missing" in lines[0] and "no such trace folder" in lines[0]
    assert proc.stdout == ""


def test_bad_tolerance_and_usage_exit_2(runs):
    proc = cli(str(runs["same"]), str(runs["bench"]), "--tol", "bf16=oops")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert cli(str(runs["same"])).returncode == 2
