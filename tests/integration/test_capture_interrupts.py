"""Interrupted captures say so: Ctrl-C (KeyboardInterrupt), SIGTERM from an elastic agent, an
exception from the program, and an interrupt that lands inside an op."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import tracecmp
import tracecmp.capture.mode as mode_module
from tracecmp.capture.mode import CaptureMode
from tracecmp.cli.inspect import summarize
from workloads.models import example_batch, make_model, make_optimizer, train_step

ROOT = Path(__file__).resolve().parents[2]


def _train_until(path: Path, stop_in: int, exc: BaseException, **options: Any) -> BaseException:
    model, batch = make_model("mlp"), example_batch("mlp")
    opt = make_optimizer(model)
    with pytest.raises(type(exc)) as caught:
        with tracecmp.TraceCompare(path, model=model, flush_secs=0, **options) as tc:
            for step in range(10):
                loss = model(batch[0]).logsumexp(-1).mean()
                loss.backward()
                if step == stop_in:
                    raise exc  # after forward and backward: the step is kept in part
                opt.step()
                opt.zero_grad()
                tc.step()
    return caught.value


def test_keyboard_interrupt_is_labelled_with_the_steps_kept(tmp_path: Path) -> None:
    exc = _train_until(tmp_path / "t", 3, KeyboardInterrupt())
    trace = tracecmp.load(tmp_path / "t")
    rank = trace.rank(0)
    assert trace.complete is False
    assert rank.stopped == {
        "kind": "interrupted",
        "reason": "interrupted by the user (KeyboardInterrupt)",
        "step": 3,
        "last_step": 2,
    }
    assert rank.manifest["steps"] == [0, 1, 2, 3]
    ops = trace.to_frame()
    assert set(ops[ops["step"] == 3]["phase"]) == {"forward", "backward"}
    expected = "interrupted by the user (KeyboardInterrupt), in step 3; it keeps steps 0-2 whole, step 3 in part"
    assert f"complete  NO: {expected}" in summarize(tmp_path / "t")
    assert any(
        "keeps steps 0-2 whole, step 3 in part" in note and str(tmp_path / "t") in note for note in exc.__notes__
    )


def test_an_interrupt_in_step_0_keeps_no_whole_step_in_the_note_as_in_inspect(tmp_path: Path) -> None:
    exc = _train_until(tmp_path / "t", 0, KeyboardInterrupt())
    assert tracecmp.load(tmp_path / "t").rank(0).stopped["last_step"] is None
    kept = "it keeps no whole step, step 0 in part"
    assert f"in step 0; {kept}" in summarize(tmp_path / "t")
    assert any(kept in note for note in exc.__notes__), exc.__notes__


def test_an_exception_from_the_program_is_named(tmp_path: Path) -> None:
    _train_until(tmp_path / "t", 1, ValueError("bad batch\nshape"))
    stopped = tracecmp.load(tmp_path / "t").rank(0).stopped
    assert stopped == {
        "kind": "error",
        "reason": "the program raised ValueError: bad batch shape",
        "step": 1,
        "last_step": 0,
    }


def test_sys_exit_zero_is_a_normal_end(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        with tracecmp.TraceCompare(tmp_path / "t") as tc:
            torch.ones(2).mul(3)
            tc.step()
            sys.exit(0)
    assert tracecmp.load(tmp_path / "t").complete is True


@pytest.mark.parametrize("self_check", ["off", "sample"])
def test_an_interrupt_inside_an_op_leaves_a_readable_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, self_check: str
) -> None:
    """KeyboardInterrupt between an op's output row and its op row (the Python per-op path,
    where a signal handler can run at any line): the half-recorded op is dropped, not the rank;
    with self-checks, every check kept is of a kept op and was recomputed."""
    monkeypatch.setattr(mode_module, "USE_NATIVE", False)
    original = CaptureMode._value
    calls = {"n": 0}

    def interrupted(self: CaptureMode, *args: Any) -> None:
        original(self, *args)
        calls["n"] += 1
        if calls["n"] == 40:
            raise KeyboardInterrupt  # the tensor row is in, the op row is not

    monkeypatch.setattr(CaptureMode, "_value", interrupted)
    model, batch = make_model("mlp"), example_batch("mlp")
    opt = make_optimizer(model)
    with pytest.raises(KeyboardInterrupt):
        with tracecmp.TraceCompare(tmp_path / "t", model=model, self_check=self_check) as tc:
            for _ in range(3):
                train_step(model, opt, batch)
                tc.step()
    trace = tracecmp.load(tmp_path / "t")  # every producer and every output is in the tables
    assert trace.rank(0).stopped["kind"] == "interrupted"
    assert len(trace.to_frame()) > 30
    checks = trace.rank(0).checks
    if self_check == "sample":
        assert checks is not None and len(checks) > 5
        assert checks["op_id"].isin(trace.rank(0).ops["op_id"]).all()
        assert checks["residual"].notna().all() and (checks["residual"] <= checks["limit"]).all()


CHILD = textwrap.dedent(
    """
    import sys, time
    import torch, tracecmp
    from workloads.models import example_batch, make_model, make_optimizer, train_step

    trace, ready = sys.argv[1], sys.argv[2]
    model, batch = make_model("mlp"), example_batch("mlp")
    opt = make_optimizer(model)
    with tracecmp.TraceCompare(trace, model=model, flush_secs=0) as tc:
        for step in range(1000):
            train_step(model, opt, batch)
            tc.step()
            if step == 4:
                open(ready, "w").close()
            if step >= 4:
                time.sleep(0.05)
    print("not reached")
    """
)


def test_sigterm_is_labelled_and_the_process_still_dies_by_it(tmp_path: Path) -> None:
    trace_path, ready = tmp_path / "t", tmp_path / "ready"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(trace_path), str(ready)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == -signal.SIGTERM  # as without tracecmp: the agent sees the same status
    assert "not reached" not in out
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("tracecmp:")]
    assert "terminated by SIGTERM" in line and str(trace_path) in line
    rank = tracecmp.load(trace_path).rank(0)
    stopped = rank.stopped
    assert stopped is not None and stopped["kind"] == "terminated" and stopped["reason"] == "terminated by SIGTERM"
    assert stopped["step"] >= 5 and stopped["last_step"] == stopped["step"] - 1
    assert rank.manifest["steps"][: stopped["step"]] == list(range(stopped["step"]))


def test_a_program_handling_sigterm_itself_keeps_its_handler(tmp_path: Path) -> None:
    def handler(signum: int, frame: Any) -> None:
        pass

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        with tracecmp.TraceCompare(tmp_path / "t"):
            assert signal.getsignal(signal.SIGTERM) is handler
        assert signal.getsignal(signal.SIGTERM) is handler
    finally:
        signal.signal(signal.SIGTERM, previous)
    with tracecmp.TraceCompare(tmp_path / "u"):
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # ours, while the session runs
    assert signal.getsignal(signal.SIGTERM) is previous
