"""Bitwise determinism: two seeded runs give identical traces, and ``compare --exact`` names the one
op that is not deterministic (its output changed while its inputs were bitwise equal)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tracecmp
from workloads.models import example_batch, make_model, make_optimizer, train_step

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _restore_determinism() -> Any:
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)
    torch.backends.cudnn.deterministic = False


def _run(
    path: Path, name: str = "transformer", *, deterministic: bool = False, fault: TorchDispatchMode | None = None
) -> Path:
    model = make_model(name)
    opt = make_optimizer(model)
    batch = example_batch(name)
    tracecmp.seed_all(1234, deterministic=deterministic)
    with fault if fault is not None else contextlib.nullcontext():
        with tracecmp.TraceCompare(path, model=model) as tc:
            for _ in range(2):
                train_step(model, opt, batch)
                tc.step()
    return path


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tracecmp", *args], capture_output=True, text=True, cwd=ROOT)


def test_two_seeded_runs_give_bitwise_identical_traces(tmp_path: Path) -> None:
    # The transformer block draws attention dropout masks: identical only because of the seed.
    a = tracecmp.load(_run(tmp_path / "a", deterministic=True)).rank(0)
    b = tracecmp.load(_run(tmp_path / "b", deterministic=True)).rank(0)
    assert a.ops["op"].tolist() == b.ops["op"].tolist()
    stats_a, stats_b = a.tensors[a.tensors["has_stats"]], b.tensors[b.tensors["has_stats"]]
    assert len(stats_a) > 100 and stats_a["tensor_id"].tolist() == stats_b["tensor_id"].tolist()
    assert np.array_equal(stats_a["checksum"].to_numpy(), stats_b["checksum"].to_numpy())
    assert a.ops["random"].any()
    done = _cli("compare", str(tmp_path / "a"), str(tmp_path / "b"), "--exact")
    assert done.returncode == 0, done.stdout + done.stderr
    # What seed_all set is in the manifest, with the switches in force.
    manifest = tracecmp.load(tmp_path / "a").manifest
    assert manifest["seed_all"]["seed"] == 1234 and manifest["seed_all"]["deterministic"] is True
    assert manifest["determinism"]["torch_deterministic_algorithms"] is True
    assert manifest["determinism"]["cudnn_deterministic"] is True


class ReorderedSum(TorchDispatchMode):
    """Sums one reduction's input in reverse order (entered outside the capture): a nondeterministic kernel."""

    def __init__(self, op: Any, nth: int) -> None:
        super().__init__()
        self.op, self.nth, self.seen, self.changed = op, nth, 0, False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is self.op:
            self.seen += 1
            if self.seen == self.nth:
                x, dims = args[0], args[1]
                reordered = func(torch.flip(x, dims), *args[1:], **kwargs)
                self.changed = not torch.equal(reordered, out)
                out = reordered
        return out


def test_an_injected_nondeterministic_reduction_is_named(tmp_path: Path) -> None:
    sum_dim = torch.ops.aten.sum.dim_IntList
    _run(tmp_path / "a")
    fault = ReorderedSum(sum_dim, 1)
    _run(tmp_path / "b", fault=fault)
    assert fault.changed, "reversing the summation order changed no bit: the test would prove nothing"
    result = tracecmp.compare(tmp_path / "b", tmp_path / "a", exact=True)
    first = result.first_divergence
    assert first is not None
    assert first.op == str(sum_dim) and first.phase == "backward"
    assert "agrees bitwise" in first.reason  # its inputs were bitwise equal
    done = _cli("compare", str(tmp_path / "b"), str(tmp_path / "a"), "--exact")
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"first divergence at {sum_dim}" in done.stdout.splitlines()[0]
