"""The emulated NPU's tests (``emulated_npu_cases.py``), in a fresh interpreter of their own.

torch's autograd engine sizes its per-device queues for the device types registered when it first
runs a backward: in a test process that ran one before the emulator registered ``npu`` (another
test file in the same worker), a backward on the npu fails an internal assert of the engine. A
fresh interpreter loads the emulator before any backward, as a user's program on an NPU does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def test_the_emulated_npu_cases_pass_in_a_fresh_interpreter(tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-rs",
        str(HERE / "emulated_npu_cases.py"),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [*command, "--basetemp", str(tmp_path / "cases")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    print(done.stdout[-4000:])  # the cases' own summary, skips and their reasons included
    assert done.returncode == 0, done.stdout[-12000:] + done.stderr[-4000:]
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    if " passed" not in summary:
        reasons = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED")]
        pytest.skip(reasons[0] if reasons else summary)
