"""``with TraceCompare():`` as it reads: a default folder, steps from optimizer.step(), the model
found as it runs."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tracecmp
from tracecmp.capture.folders import make_fresh


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _setup(optimizer: Any = None) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = Net()
    opt = optimizer(model) if optimizer else torch.optim.SGD(model.parameters(), lr=0.1)
    return model, opt, torch.randn(4, 8)


def _loop(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, steps: int, tc: Any = None) -> nn.Module:
    for _ in range(steps):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if tc is not None:
            tc.step()
    return model


def _train(steps: int, tc: Any = None, optimizer: Any = None) -> nn.Module:
    return _loop(*_setup(optimizer), steps, tc)


def test_no_arguments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TRACECMP_DIR", str(tmp_path / "traces"))
    model, opt, x = _setup()
    with tracecmp.TraceCompare() as tc:  # no folder, no model, no tc.step()
        _loop(model, opt, x, 3)
    assert tc.path is not None and tc.path.parent == tmp_path / "traces"
    assert re.fullmatch(r"[\w.-]+-\d{8}-\d{6}(-\d+)?", tc.path.name), tc.path.name
    err = capsys.readouterr().err
    assert f"tracecmp: trace written to {tc.path}, steps 0-2" in err

    trace = tracecmp.load(tc.path)
    assert trace.complete
    ops = trace.to_frame()
    assert sorted(ops["step"].unique()) == [0, 1, 2]  # each optimizer.step() ended a step
    for step in range(3):
        assert set(ops[ops["step"] == step]["phase"]) == {"forward", "backward", "optimizer"}
    assert {"body.0", "body.1", "head"} <= set(ops["module"])  # as Net().named_modules() spells them
    sources = set(ops[ops["kind"] == "source"]["name"])
    assert {"body.0.weight", "head.bias", "x"} <= sources
    assert trace.rank(0).manifest["info"]["models"] == ["Net"]


def test_auto_named_folders_never_collide(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACECMP_DIR", str(tmp_path / "traces"))
    first, second = make_fresh(tmp_path, "train-20250101-120000"), make_fresh(tmp_path, "train-20250101-120000")
    assert first != second and second.name == "train-20250101-120000-2"
    paths = []
    for _ in range(3):  # three sessions within a second or two
        with tracecmp.TraceCompare() as tc:
            torch.ones(2).mul(2)
        paths.append(tc.path)
    assert len(set(paths)) == 3 and all(tracecmp.load(p).complete for p in paths)


def test_explicit_steps_keep_their_numbering(tmp_path: Path) -> None:
    """tc.step() right after opt.step() ends no second step; from then on steps end at tc.step() only."""
    with tracecmp.TraceCompare(tmp_path / "t") as tc:
        _train(3, tc)
    assert sorted(tracecmp.load(tmp_path / "t").to_frame()["step"].unique()) == [0, 1, 2]


def test_an_inference_only_run_is_one_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRACECMP_DIR", str(tmp_path))
    model = Net()
    with torch.no_grad(), tracecmp.TraceCompare() as tc:
        for _ in range(3):
            model(torch.randn(2, 8))
    assert tc.optimizer_steps == 0
    assert tracecmp.load(tc.path).to_frame()["step"].unique().tolist() == [0]
    assert "no optimizer.step() ran, so everything is step 0" in capsys.readouterr().err


def test_a_wrapping_optimizer_ends_one_step_not_two(tmp_path: Path) -> None:
    class Wrapper(torch.optim.Optimizer):
        def __init__(self, inner: torch.optim.Optimizer) -> None:
            self.inner = inner
            super().__init__(inner.param_groups, {})

        def step(self, closure: Any = None) -> None:  # type: ignore[override]
            self.inner.step()

    with tracecmp.TraceCompare(tmp_path / "t") as tc:
        _train(2, optimizer=lambda m: Wrapper(torch.optim.SGD(m.parameters(), lr=0.1)))
    assert tc.optimizer_steps == 2
    assert sorted(tracecmp.load(tmp_path / "t").to_frame()["step"].unique()) == [0, 1]


def test_the_trace_is_complete_once_the_last_selected_step_ended(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError):
        with tracecmp.TraceCompare(tmp_path / "t", steps=[0, 1]):
            _train(4)
            raise RuntimeError("after the recorded steps")
    trace = tracecmp.load(tmp_path / "t")
    assert trace.complete and trace.rank(0).manifest["steps"] == [0, 1]


def test_results_are_bitwise_those_of_a_run_without_tracecmp(tmp_path: Path) -> None:
    plain = _train(3)
    model, opt, x = _setup()
    with tracecmp.TraceCompare(tmp_path / "t", data="tensors"):
        traced = _loop(model, opt, x, 3)
    for a, b in zip(plain.parameters(), traced.parameters()):
        assert torch.equal(a.view(-1).view(torch.int32), b.view(-1).view(torch.int32))
