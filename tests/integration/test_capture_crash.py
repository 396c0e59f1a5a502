"""A training process killed mid-step leaves every committed step readable, and the trace incomplete.

Chunks are committed by a background thread: ``tc.sync()`` (or ``sync=True``) is what makes
"steps 0 and 1 are on disk" true at the moment of the kill, so the expected result is exact.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import tracecmp

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import torch
    import tracecmp
    from tests.models import example_batch, loss_of, make_model, make_optimizer

    trace, ready, strict = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "sync"
    model, batch = make_model("mlp"), example_batch("mlp")
    opt = make_optimizer(model)
    with tracecmp.TraceCompare(trace, model=model, sync=strict) as tc:
        for step in range(5):
            loss = loss_of(model, batch)
            loss.backward()
            if step == 2:
                if not strict:
                    tc.sync()  # steps 0 and 1 committed (sync=True: step() already waited)
                ready.write_text("in step 2")  # the parent kills us now, mid-step
                time.sleep(60)
            opt.step()
            opt.zero_grad()
            tc.step()
    """
)


@pytest.mark.parametrize("writing", ["background", "sync"])
def test_sigkill_during_third_step_keeps_steps_0_and_1(tmp_path: Path, writing: str) -> None:
    trace_path, ready = tmp_path / "trace", tmp_path / "ready"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(trace_path), str(ready), writing], env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert child.poll() is None, f"child exited early with {child.returncode}"
            assert time.monotonic() < deadline, "child never reached step 2"
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
    trace = tracecmp.load(trace_path)
    assert trace.complete is False
    rank = trace.rank(0)
    assert rank.manifest["steps"] == [0, 1]
    ops = trace.to_frame()
    assert sorted(ops["step"].unique()) == [0, 1]
    for step in (0, 1):
        assert set(ops[ops["step"] == step]["phase"]) == {"forward", "backward", "optimizer"}
    assert not list(rank.path.glob("*.tmp"))  # nothing half-written is listed or left as a chunk
