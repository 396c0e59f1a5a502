"""Fuzzing the reader: seeded random damage to real traces (see ``tests/fuzz_reader.py``).

Every case must exit 2 with one line naming a file, or read cleanly; never a traceback, a crash
or a hang (each case has ``--case-seconds``, the whole run a timeout). CI runs a fixed seed so a
failure reproduces; a deeper search::

    TRACECMP_FUZZ_CASES=2000 TRACECMP_FUZZ_SEED=7 python3 -m pytest tests/integration/test_reader_fuzz.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import tracecmp
from workloads.models import example_batch, make_model, make_optimizer, train_step

ROOT = Path(__file__).resolve().parents[2]
CASES = int(os.environ.get("TRACECMP_FUZZ_CASES", "100"))
SEED = int(os.environ.get("TRACECMP_FUZZ_SEED", "20"))


def _good_trace(path: Path, data: str) -> Path:
    model, batch = make_model("mlp"), example_batch("mlp")
    opt = make_optimizer(model)
    with tracecmp.TraceCompare(path, model=model, data=data, flush_secs=0) as tc:  # a chunk per step
        for _ in range(3):
            train_step(model, opt, batch)
            tc.step()
    return path


def test_damaged_traces_are_refused_in_one_line_or_read_cleanly(tmp_path: Path) -> None:
    goods = [_good_trace(tmp_path / "stats", "stats"), _good_trace(tmp_path / "tensors", "tensors")]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.fuzz_reader",
            *map(str, goods),
            "--cases",
            str(CASES),
            "--seed",
            str(SEED),
            "--work",
            str(tmp_path / "work"),
            "--case-seconds",
            "60",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=900,
    )
    lines = result.stdout.strip().splitlines()
    assert result.returncode in (0, 1) and lines, (
        f"the fuzzer died (exit {result.returncode}) in: {lines[-1] if lines else '?'}\n{result.stderr[-3000:]}"
    )
    summary = json.loads(lines[-1])
    assert summary["cases"] == CASES
    assert len(summary["kinds"]) >= 10  # every kind of damage was drawn
    assert summary["failures"] == [], json.dumps(summary["failures"], indent=1)[:6000]
