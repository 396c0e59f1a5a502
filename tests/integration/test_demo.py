"""`tracecmp demo` end to end: capture two runs, compare, report, and name the emulated fault."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tracecmp.cli.main import main
from tracecmp.demo import FAULTS, run_demo
from tracecmp.errors import TracecmpError
from workloads import emulated_npu

ROOT = Path(__file__).resolve().parents[2]


def test_demo_command_finds_the_fp16_overflow(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-m", "tracecmp", "demo", "-o", str(out)], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    fault = FAULTS["fp16-matmul"]
    assert fault.module == "head" and fault.op == "aten.mm.default"
    lines = done.stdout.splitlines()
    verdict = next(line for line in lines if line.startswith(("DIVERGED", "AGREE", "INCOMPLETE")))
    assert verdict.startswith("DIVERGED: first divergence at aten.mm.default in head (backward, step 0) — demo.py:")
    assert any(line.strip().startswith("reason") and "NaN/Inf" in line for line in lines)
    assert "Found it: the first divergence is in head (aten.mm.default), where the emulated fault is." in lines
    bench, target = (
        next(line for line in lines if line.strip().startswith(f"{name} ")) for name in ("bench", "target")
    )
    assert "nan" not in bench and target.rstrip().endswith("nan")  # the target's second step trains on Inf gradients
    assert any(line.startswith("Report: ") and str(out / "report.html") in line for line in lines)
    report = (out / "report.html").read_text(encoding="utf-8")
    assert "DIVERGED: first divergence at aten.mm.default in head (backward, step 0)" in report
    assert (out / "divergence.svg").exists() or (out / "divergence.dot").exists()
    assert (out / "nodes.csv").exists() and (out / "traces" / "bench" / "manifest.json").exists()


@pytest.mark.parametrize("name", ["gelu-tanh", "softmax-fp16"])
def test_other_faults_are_found(tmp_path: Path, name: str) -> None:
    outcome = run_demo(tmp_path / name, fault=name)
    d = outcome.result.first_divergence
    assert d is not None and (d.module, d.op) == (outcome.fault.module, outcome.fault.op)
    assert outcome.found and d.location.startswith("demo.py:")
    assert outcome.bench_losses != outcome.target_losses
    assert outcome.report.exists()
    if name == "gelu-tanh":
        assert d.kind == "argument" and "approximate" in d.reason


def test_cli_lists_every_fault() -> None:
    from tracecmp.cli.demo import FAULT_NAMES

    assert set(FAULT_NAMES) == set(FAULTS)


def test_demo_refuses_bad_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "-o", str(tmp_path), "--fault", "no-such-fault"]) == 2
    assert main(["demo", "-o", str(tmp_path), "--steps", "0"]) == 2
    assert "steps must be at least 1" in capsys.readouterr().err


@pytest.mark.skipif(emulated_npu.torch_can_host(), reason="this torch hosts the emulated npu (emulated_npu_cases.py)")
def test_emulated_npu_demo_says_why_this_torch_cannot_host_it(tmp_path: Path) -> None:
    with pytest.raises(TracecmpError, match="cannot host the emulated npu"):
        run_demo(tmp_path / "demo", emulated_npu=True)
