"""Faults written into a compiled model, found with statistics alone: the region is a root by what
its recorded nodes show, named at the faulty node's module; a clean compiled target against its
eager bench reads AGREE."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import tracecmp
from tracecmp._compat import TORCH_VERSION
from workloads.compile_models import TinyGPT, tiny_batch

pytestmark = pytest.mark.skipif(TORCH_VERSION < (2, 2), reason="compiled regions are recorded from torch 2.2 on")


def _faulty(module: torch.nn.Module, change: Any) -> None:
    """Give ``module`` a forward that changes its output, as an edit of the model's code would."""
    cls = type(module)

    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        return change(cls.forward(self, x))

    module.__class__ = type(f"Faulty{cls.__name__}", (cls,), {"forward": forward})


def _run(path: Path, compiled: bool, fault: str = "", backend: str = "aot_eager") -> Path:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyGPT(layers=1)
    if fault == "bf16-act":
        _faulty(model.blocks[0].mlp.act, lambda y: y.to(torch.bfloat16).to(y.dtype))
    elif fault == "attn-scale":
        _faulty(model.blocks[0].attn, lambda y: y * 1.05)
    elif fault == "ln-eps":
        model.blocks[0].ln1.eps = 1e-2
    run = torch.compile(model, backend=backend) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = [tiny_batch(seed=step) for step in range(2)]
    with tracecmp.TraceCompare(path, model=model) as tc:
        for idx, targets in batches:
            run(idx, targets).backward()
            opt.step()
            opt.zero_grad()
            tc.step()
    return path


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _run(tmp_path_factory.mktemp("faults") / "bench", compiled=False)


def test_a_clean_compiled_target_agrees_with_its_eager_bench(bench: Path, tmp_path: Path) -> None:
    result = tracecmp.compare(_run(tmp_path / "target", compiled=True), bench)
    assert result.status == "agree", result.summary()


def test_a_round_trip_through_bfloat16_is_named_at_its_module(bench: Path, tmp_path: Path) -> None:
    result = tracecmp.compare(_run(tmp_path / "target", compiled=True, fault="bf16-act"), bench)
    first = result.first_divergence
    assert first is not None and first.module == "blocks.0.mlp.act", result.summary()
    assert "rounds its value to bfloat16 and back" in first.reason


def test_an_op_the_bench_never_ran_is_named_at_its_module(bench: Path, tmp_path: Path) -> None:
    result = tracecmp.compare(_run(tmp_path / "target", compiled=True, fault="attn-scale"), bench)
    first = result.first_divergence
    assert first is not None and (first.module, first.phase) == ("blocks.0.attn", "forward"), result.summary()


def test_a_fault_inside_inductors_fused_code_is_named_at_its_module(bench: Path, tmp_path: Path) -> None:
    # Inductor's fused kernels dispatch nothing: capture runs the forward graph again eagerly on
    # the region's inputs (a shadow run) for each node's statistics, and the layer norm whose
    # epsilon changed is named, against the eager bench and against a clean compiled bench.
    target = _run(tmp_path / "target", compiled=True, fault="ln-eps", backend="inductor")
    forward = next(c for c in tracecmp.load(target).rank(0).compiled.calls if c.part == "forward")
    assert {"add", "rsqrt"} <= set(forward.values)  # the layer norm's decomposition, measured
    assert "var_mean" not in forward.values  # its variance is no eager op's value: seen through its getitems
    for other in (bench, _run(tmp_path / "clean", compiled=True, backend="inductor")):
        first = tracecmp.compare(target, other).first_divergence
        assert first is not None and (first.module, first.op) == ("blocks.0.ln1", "compiled.forward"), other
        assert "narrowed by statistics to FX node" in first.reason


def test_a_round_trip_inductor_keeps_in_float32_is_no_root(bench: Path, tmp_path: Path) -> None:
    # Inductor computes the bf16 round trip inside its fused kernel in float32: the compiled run is
    # the clean one bit for bit. The shadow run rounds as the graph says, so it is set aside where
    # it departs from what the compiled code dispatched, and the verdict stays AGREE, with a note.
    target = _run(tmp_path / "target", compiled=True, fault="bf16-act", backend="inductor")
    result = tracecmp.compare(target, bench)
    assert result.status == "agree", result.summary()
    assert any("computes otherwise than its graph does with eager kernels" in n for n in result.notes)
