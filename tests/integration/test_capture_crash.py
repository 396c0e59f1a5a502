"""A training process killed mid-step leaves every committed step readable, and the trace incomplete.

Chunks are committed by a background thread, at most two in flight; finished steps are handed to
it once ``flush_secs`` passed since the previous hand-over (every step with ``flush_secs=0``), at
``tc.sync()``, and at every step with ``sync=True``. Each case below kills the child at a point
where that contract says exactly which steps must be on disk.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import tracecmp
from tracecmp.trace.reader import Trace

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import torch
    import tracecmp
    from workloads.models import example_batch, loss_of, make_model, make_optimizer

    trace, ready, case = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    kill_at = {"sync": 2, "sync-call": 2, "every-step": 4, "interval": 6}[case]
    options = {"sync": {"sync": True}, "every-step": {"flush_secs": 0}, "interval": {"flush_secs": 0.3}}.get(case, {})
    model, batch = make_model("mlp"), example_batch("mlp")
    opt = make_optimizer(model)
    with tracecmp.TraceCompare(trace, model=model, **options) as tc:
        for step in range(kill_at + 2):
            loss = loss_of(model, batch)
            loss.backward()
            if step == kill_at:
                if case == "sync-call":
                    tc.sync()  # steps 0, 1 and step 2 so far (forward, backward) committed
                ready.write_text(f"in step {step}")  # the parent kills us now, mid-step
                time.sleep(60)
            opt.step()
            opt.zero_grad()
            if case == "interval" and step >= 3:
                time.sleep(0.35)  # steps 3, 4 and 5 each end a flush interval: three hand-overs
            tc.step()
    """
)


def _run_and_kill(tmp_path: Path, case: str) -> Trace:
    trace_path, ready = tmp_path / "trace", tmp_path / "ready"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(trace_path), str(ready), case], env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert child.poll() is None, f"child exited early with {child.returncode}"
            assert time.monotonic() < deadline, "child never reached the step it is killed in"
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
    trace = tracecmp.load(trace_path)
    assert trace.complete is False
    assert not list(trace.rank(0).path.glob("*.tmp"))  # nothing half-written is listed or left as a chunk
    return trace


def _whole_steps(trace: Trace) -> list[int]:
    """The committed steps, each checked to hold forward, backward and optimizer ops."""
    ops = trace.to_frame()
    steps = sorted(int(s) for s in ops["step"].unique())
    assert trace.rank(0).manifest["steps"] == steps
    for step in steps:
        assert set(ops[ops["step"] == step]["phase"]) == {"forward", "backward", "optimizer"}, step
    return steps


def test_sigkill_with_sync_keeps_every_finished_step(tmp_path: Path) -> None:
    # sync=True: step() returned only once its step was committed.
    assert _whole_steps(_run_and_kill(tmp_path, "sync")) == [0, 1]


def test_sigkill_after_sync_call_keeps_what_was_recorded_before_it(tmp_path: Path) -> None:
    trace = _run_and_kill(tmp_path, "sync-call")
    ops = trace.to_frame()
    assert sorted(ops["step"].unique()) == [0, 1, 2]
    assert set(ops[ops["step"] == 2]["phase"]) == {"forward", "backward"}  # killed before opt.step()
    for step in (0, 1):
        assert set(ops[ops["step"] == step]["phase"]) == {"forward", "backward", "optimizer"}


def test_sigkill_with_a_chunk_per_step_keeps_all_but_the_two_in_flight(tmp_path: Path) -> None:
    # flush_secs=0, killed in step 4: steps 2 and 3 may still be in flight, 0 and 1 are committed.
    steps = _whole_steps(_run_and_kill(tmp_path, "every-step"))
    assert steps[:2] == [0, 1] and steps == list(range(len(steps))) and len(steps) <= 4


def test_sigkill_keeps_the_steps_handed_over_before_the_two_in_flight(tmp_path: Path) -> None:
    # flush_secs=0.3: steps 0-3 are handed over at step 3's boundary at the latest, then steps 4
    # and 5 as chunks of their own, so when the kill comes in step 6 steps 0-3 are committed.
    steps = _whole_steps(_run_and_kill(tmp_path, "interval"))
    assert steps[:4] == [0, 1, 2, 3] and steps == list(range(len(steps))) and len(steps) <= 6
