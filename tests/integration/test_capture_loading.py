"""Batches from DataLoader workers arrive untraced: the rebuild of a worker's tensors in the training
process (``empty`` and ``set_`` onto shared memory, as many per step as happen to arrive) is not
recorded, and a batch is a source where the model first reads it, in every step alike."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tracecmp
from tracecmp.capture.loading import fetch_batches_untraced


def _train(trace: Path | None, steps: int = 3) -> list[torch.Tensor]:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 4, (64,)))
    loader = DataLoader(data, batch_size=8, num_workers=2, prefetch_factor=4)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    batches = iter(loader)
    context = tracecmp.TraceCompare(trace, model=model, steps=range(steps)) if trace else None
    if context is not None:
        context.__enter__()
    try:
        for _ in range(steps):
            x, y = next(batches)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
            if context is not None:
                context.step()
    finally:
        if context is not None:
            context.__exit__(None, None, None)
    return losses


def test_worker_batches_are_sources_not_rebuilds(tmp_path: Path) -> None:
    untraced = _train(None)
    traced = _train(tmp_path / "t")
    assert all(torch.equal(a, b) for a, b in zip(untraced, traced))  # transparency
    ops = tracecmp.load(tmp_path / "t").rank(0).ops
    assert not ops["op"].str.startswith("aten.set_").any(), ops[ops["op"].str.startswith("aten.set_")]
    assert not ops["location"].str.startswith("queues.py").any()
    inputs = ops[ops["op"] == "source.input"]
    assert sorted(set(inputs["step"])) == [0, 1, 2]  # each step's batch, as the model read it


def test_the_wrapper_is_undone() -> None:
    from torch.utils.data import dataloader

    original = dataloader._MultiProcessingDataLoaderIter.__dict__["_try_get_data"]
    undo = fetch_batches_untraced()
    assert dataloader._MultiProcessingDataLoaderIter.__dict__["_try_get_data"] is not original
    undo()
    assert dataloader._MultiProcessingDataLoaderIter.__dict__["_try_get_data"] is original
