"""Tracing a compiled model whose inputs Dynamo treats apart: views, dynamic sizes, recompiles.

A view (``idx[:, :-1]``) is made fake with its base and its strides; a dimension marked dynamic,
or one that changed since the last compile, is a symbol of Dynamo's ShapeEnv with guards on it.
Capture traces each region again with AOT autograd in that ShapeEnv: it must neither crash
Dynamo's guards nor add one (a recompile an untraced run would not make). Each run trains a
compiled TinyGPT on sliced batches, all steps but the last in a session, and must match a run
never traced bitwise: losses, gradients, parameters, what compiled and how often compiled code ran.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any

import pytest
import torch

import tracecmp
from tests.integration.test_compile_transparency import needs_inductor
from tracecmp._compat import TORCH_VERSION
from workloads.compile_models import CountingBackend, TinyGPT, tiny_batch

pytestmark = pytest.mark.skipif(TORCH_VERSION < (2, 2), reason="compiled regions are recorded from torch 2.2 on")

# (batch, length) of each step's batch before slicing. "view": one static compile. "dynamic": the
# batch dimension marked dynamic (2, then 3 without a recompile), then a new length: a recompile
# inside the session, which makes that dimension dynamic too, and a step after the session.
SCHEDULES = {"view": ((2, 9), (2, 9)), "dynamic": ((2, 9), (3, 9), (4, 7), (2, 9))}


def _run(schedule: str, inner: str, trace: Path | None = None, how: str = "boundary") -> dict[str, Any]:
    """The schedule's training steps from a fixed seed, on views of each batch; all but the last
    step traced when ``trace`` is given."""
    torch._dynamo.reset()
    backend = CountingBackend(inner)
    torch.manual_seed(5)
    model = TinyGPT(layers=1)
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    steps = SCHEDULES[schedule]
    seen: dict[str, Any] = {"compiles": [], "runs": []}

    def step(index: int) -> None:
        idx, targets = tiny_batch(seed=index, batch=steps[index][0], length=steps[index][1])
        inputs, labels = idx[:, :-1], targets[:, 1:]  # views: strides of the whole batch
        if schedule == "dynamic":
            torch._dynamo.mark_dynamic(inputs, 0)
            torch._dynamo.mark_dynamic(labels, 0)
        before = backend.compiles, backend.runs
        loss = compiled(inputs, labels)
        loss.backward()
        seen[f"loss{index}"] = loss.detach().clone()
        seen.update({f"grad{index}.{n}": p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
        seen["compiles"].append(backend.compiles - before[0])
        seen["runs"].append(backend.runs - before[1])

    if trace is None:
        for i in range(len(steps)):
            step(i)
    else:
        with tracecmp.TraceCompare(trace, model=model, compiled=how) as tc:
            for i in range(len(steps) - 1):
                step(i)
                tc.step()
        step(len(steps) - 1)
    seen.update({f"param.{n}": p.detach().clone() for n, p in model.named_parameters()})
    return seen


@functools.lru_cache(maxsize=None)
def _plain(schedule: str, inner: str) -> dict[str, Any]:
    return _run(schedule, inner)


@pytest.mark.parametrize(
    ("schedule", "inner", "how"),
    [
        ("view", "aot_eager", "boundary"),
        ("view", "inductor", "boundary"),
        ("dynamic", "eager", "boundary"),  # a backend without AOT autograd: capture's trace adds no guard
        ("dynamic", "aot_eager", "graph"),  # the region's graphs run at sizes other than the traced ones
    ],
)
def test_traced_view_and_dynamic_inputs_match_an_untraced_run(
    tmp_path: Path, schedule: str, inner: str, how: str
) -> None:
    needs_inductor(inner)
    plain = _plain(schedule, inner)
    traced = _run(schedule, inner, tmp_path / "t", how)
    assert traced["compiles"] == plain["compiles"]
    if how == "boundary":  # graph mode runs the region's graphs in place of the compiled code
        assert traced["runs"] == plain["runs"]
    assert traced.keys() == plain.keys()
    assert [k for k in plain if k not in ("compiles", "runs") and not torch.equal(plain[k], traced[k])] == []
    record = tracecmp.load(tmp_path / "t").rank(0).compiled
    assert len(record.graphs) == sum(plain["compiles"][:-1])
    assert sum(c.part == "forward" for c in record.calls) == len(SCHEDULES[schedule]) - 1


def test_a_region_trace_adds_no_guard(tmp_path: Path) -> None:
    """Capture's AOT trace of a region shares Dynamo's ShapeEnv: the guards Dynamo installs are
    those of an untraced compile (``eager`` traces nothing itself; AOT autograd would guard a
    view's dynamic stride against its width)."""

    def guards(trace: Path | None) -> list[str]:
        torch._dynamo.reset()
        envs: list[Any] = []

        def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            envs.append(torch._guards.TracingContext.get().fake_mode.shape_env)
            return gm.forward

        torch.manual_seed(5)
        model = TinyGPT(layers=1)
        compiled = torch.compile(model, backend=backend)
        idx, targets = tiny_batch(length=9)
        inputs, labels = idx[:, :-1], targets[:, 1:]
        for tensor in (inputs, labels):
            torch._dynamo.mark_dynamic(tensor, 0)
            torch._dynamo.mark_dynamic(tensor, 1)
        with tracecmp.TraceCompare(trace, model=model) if trace else contextlib.nullcontext():
            compiled(inputs, labels).backward()
        assert len(envs) == 1
        return sorted(str(g.expr) for g in envs[0].guards)

    assert guards(tmp_path / "t") == guards(None)
