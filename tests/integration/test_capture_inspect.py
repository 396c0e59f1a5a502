"""``tracecmp inspect`` on real captures."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

import tracecmp
from tracecmp.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def test_inspect_cli_summarises_a_training_trace(capture: Callable[..., Path]) -> None:
    path = capture("mlp", steps=2)
    result = subprocess.run(
        [sys.executable, "-m", "tracecmp", "inspect", str(path)], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "complete  yes" in out
    assert "device    cpu" in out and "torch " + torch.__version__ in out
    assert "model=MLP" in out and "data=stats" in out
    assert "backward" in out and "optimizer" in out
    assert "fc1" in out and "fc3" in out
    assert "float32" in out and "int64" in out
    assert "parameter 6" in out and "input 1" in out
    assert "NaN/Inf:   0 tensor values" in out
    assert " KiB on disk" in out
    assert f"{torch.get_num_threads()} intra-op threads" in out  # what replay needs to give the run's bits


def test_inspect_reports_incomplete_runs_and_nonfinite_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(RuntimeError):
        with tracecmp.TraceCompare(tmp_path / "t"):
            x = torch.tensor([1.0, 0.0]) / 0
            x.log()
            raise RuntimeError("boom")
    assert main(["inspect", str(tmp_path / "t")]) == 0
    out = capsys.readouterr().out
    assert "complete  NO" in out
    assert "NaN/Inf:   2 tensor values" in out
    assert "from aten.div.Tensor in <top> [forward, step 0]: 1 NaN, 1 Inf" in out
