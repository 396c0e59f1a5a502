"""Replay on real models: a whole run in bfloat16 against float32 is honest rounding, op by op."""

from __future__ import annotations

import pytest
import torch

import tracecmp
from workloads import models as M


def _capture(path, name: str, dtype: torch.dtype) -> str:
    model = M.make_model(name, 0).to(dtype)
    x, y = M.example_batch(name, 0)
    if x.is_floating_point():
        x = x.to(dtype)
    opt = M.make_optimizer(model)
    with tracecmp.TraceCompare(path, model=model, data="tensors", dropout=0.0) as tc:
        M.train_step(model, opt, (x, y))
        tc.step()
    return str(path)


def _skip_unless_torch_runs(name: str, dtype: torch.dtype) -> None:
    """Skip where this torch cannot run the model in ``dtype`` on this CPU at all, untraced
    (torch 2.1's oneDNN has no bfloat16 LSTM on CPUs without native bfloat16 instructions)."""
    model = M.make_model(name, 0).to(dtype)
    x, y = M.example_batch(name, 0)
    try:
        M.train_step(model, M.make_optimizer(model), (x.to(dtype) if x.is_floating_point() else x, y))
    except RuntimeError as exc:
        pytest.skip(f"torch {torch.__version__} cannot run the {name} model in {dtype} on this CPU: {exc}")


@pytest.mark.parametrize("name", M.MODELS)
def test_a_bf16_run_has_no_root_under_replay(tmp_path, name):
    torch.set_num_threads(1)
    _skip_unless_torch_runs(name, torch.bfloat16)
    target = _capture(tmp_path / "bf16", name, torch.bfloat16)
    bench = _capture(tmp_path / "fp32", name, torch.float32)
    result = tracecmp.compare(target, bench)
    assert result.first_divergence is None, result.summary()
    replayed = result.nodes[result.nodes["own_error"].notna()]
    computing = result.nodes[result.nodes["kind"] == "op"]
    assert len(replayed) >= 0.8 * len(computing)
    # bf16 ops carry bf16-sized own errors, and the honest replay on this CPU carries the same.
    assert (replayed["own_error"] <= 4 * replayed["honest_error"] + 1e-30).all()
