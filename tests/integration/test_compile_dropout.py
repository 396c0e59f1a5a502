"""A compiled region that draws (dropout under inductor): its graph is recorded like any other, and
its values, drawn from inductor's own seeds, are named random draws, not a computation that went
wrong; with ``dropout=0.0`` on both runs the same pair agrees."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import tracecmp
from tracecmp._compat import TORCH_VERSION

pytestmark = pytest.mark.skipif(TORCH_VERSION < (2, 2), reason="compiled regions are recorded from torch 2.2 on")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(16, 32), nn.Dropout(0.1), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def _run(path: Path | None, backend: str | None, **options: object) -> list[torch.Tensor]:
    """Two SGD steps from a fixed seed, compiled with ``backend`` (eager where None), traced into
    ``path`` where given; the losses and the final weights."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Net()
    run = torch.compile(model, backend=backend) if backend else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    seen = []
    session = tracecmp.TraceCompare(path, model=model, **options) if path is not None else None
    if session is not None:
        session.__enter__()
    try:
        for _ in range(2):
            loss = run(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            seen.append(loss.detach().clone())
            if session is not None:
                session.step()
    finally:
        if session is not None:
            session.__exit__(None, None, None)
    return [*seen, *(p.detach().clone() for p in model.parameters())]


def test_inductor_dropout_is_recorded_whole_and_named_a_random_draw(tmp_path: Path) -> None:
    traced = _run(tmp_path / "target", "inductor")
    assert all(torch.equal(a, b) for a, b in zip(traced, _run(None, "inductor")))  # transparent
    graphs = tracecmp.load(tmp_path / "target").rank(0).compiled.graphs
    assert graphs and all(g.parts for g in graphs.values()), {g.id: g.note for g in graphs.values()}
    _run(tmp_path / "bench", None)
    result = tracecmp.compare(tmp_path / "target", tmp_path / "bench")
    d = result.first_divergence
    assert d is not None and d.kind == "random" and "dropout=0.0" in d.reason, result.summary()
    assert {s.kind for s in result.suspects} == {"random"}
    _run(tmp_path / "target0", "inductor", dropout=0.0)
    _run(tmp_path / "bench0", None, dropout=0.0)
    quiet = tracecmp.compare(tmp_path / "target0", tmp_path / "bench0")
    assert quiet.status == "agree", quiet.summary()
