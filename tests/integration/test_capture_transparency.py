"""Tracing never changes the traced program's results: bitwise equal with and without it."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch

import tracecmp
from workloads.models import example_batch, loss_of, make_model, make_optimizer


def _run(
    name: str, trace_to: Path | None, data: str = "stats", self_check: str = "off", optimizer: str = "adam"
) -> dict[str, Any]:
    """Two training steps from a fixed seed; every loss, gradient, parameter and optimizer state."""
    torch.manual_seed(1234)  # dropout draws from the global generator
    model, batch = make_model(name), example_batch(name)
    opt = make_optimizer(model, optimizer)
    seen: dict[str, Any] = {}
    session = (
        tracecmp.TraceCompare(trace_to, model=model, data=data, self_check=self_check)
        if trace_to
        else contextlib.nullcontext()
    )
    with session as tc:
        for step in range(2):
            loss = loss_of(model, batch)
            loss.backward()
            seen[f"loss{step}"] = loss.detach().clone()
            for pname, param in model.named_parameters():
                seen[f"grad{step}.{pname}"] = param.grad.clone()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if tc is not None:
                tc.step()
    for pname, param in model.named_parameters():
        seen[f"param.{pname}"] = param.detach().clone()
    for pname, buf in model.named_buffers():
        seen[f"buffer.{pname}"] = buf.clone()
    names = {id(p): n for n, p in model.named_parameters()}
    for param, state in opt.state.items():
        for key, value in state.items():
            seen[f"state.{names[id(param)]}.{key}"] = value.clone()
    seen["rng"] = torch.get_rng_state()
    return seen


@pytest.mark.parametrize(
    "name,data,self_check",
    [
        ("mlp", "stats", "off"),
        ("mlp", "tensors", "off"),
        ("gpt2", "stats", "off"),
        ("convnet", "stats", "off"),
        ("gpt2", "stats", "sample"),
        ("convnet", "stats", "sample"),
        ("lstm", "stats", "full"),
    ],
)
def test_results_are_bitwise_equal(tmp_path: Path, name: str, data: str, self_check: str) -> None:
    plain = _run(name, None)
    traced = _run(name, tmp_path / "t", data, self_check)
    assert plain.keys() == traced.keys()
    assert any(k.startswith("state.") for k in plain)
    different = [k for k in plain if not torch.equal(plain[k], traced[k])]
    assert different == []
    trace = tracecmp.load(tmp_path / "t")
    assert trace.complete
    checks = trace.rank(0).checks
    if self_check == "off":
        assert checks is None
    else:  # every op the checker knows was checked, and an honest run passes every check
        assert checks is not None and len(checks) > 10
        assert (checks["residual"] <= checks["limit"]).all(), checks.sort_values("residual").tail()


@pytest.mark.parametrize(
    "optimizer,op,least",
    [
        ("adam-foreach", "aten._foreach_", 50),
        # every parameter's new value, first and second moment, each of 2 steps
        ("adamw-fused", "aten._fused_adamw_", 3 * 2 * sum(1 for _ in make_model("transformer").parameters())),
    ],
)
def test_self_checks_of_list_optimizers_are_transparent_and_pass(
    tmp_path: Path, optimizer: str, op: str, least: int
) -> None:
    if optimizer == "adamw-fused" and tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 4):
        pytest.skip("fused AdamW on the CPU needs torch 2.4")
    plain = _run("transformer", None, optimizer=optimizer)
    traced = _run("transformer", tmp_path / "t", "stats", "sample", optimizer=optimizer)
    assert [k for k in plain if not torch.equal(plain[k], traced[k])] == []
    rank = tracecmp.load(tmp_path / "t").rank(0)
    checks = rank.checks.merge(rank.ops[["op_id", "op"]], on="op_id")
    checked = checks[checks["op"].str.startswith(op)]
    assert len(checked) >= least and (checked["residual"] <= checked["limit"]).all(), checked.sort_values("residual")


@pytest.mark.filterwarnings("ignore:Full backward hook")  # the first module's inputs need no gradient
def test_the_program_keeps_its_thread_count_while_ops_are_checked(tmp_path: Path) -> None:
    # A check's own ops run on one intra-op thread; the program's count is back before each of
    # its ops runs (seen from module hooks, between ops, forward and backward).
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model, batch = make_model("transformer"), example_batch("transformer")
        seen: list[int] = []
        record = lambda *_: seen.append(torch.get_num_threads())  # noqa: E731
        for module in model.modules():
            module.register_forward_hook(record)
            module.register_full_backward_hook(record)
        with tracecmp.TraceCompare(tmp_path / "t", model=model, self_check="sample"):
            loss_of(model, batch).backward()
        assert seen and set(seen) == {2}
        assert len(tracecmp.load(tmp_path / "t").rank(0).checks) > 10
    finally:
        torch.set_num_threads(threads)
