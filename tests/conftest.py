"""Shared test set-up: the repository on sys.path, torch seeded per test, its thread count restored
and Dynamo's cache emptied per module, a captured-trace fixture."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from workloads.models import example_batch, make_model, make_optimizer, train_step  # noqa: E402


@pytest.fixture(autouse=True)
def _seed_torch() -> None:
    """Every test starts from the same random state, whatever ran before it."""
    torch.manual_seed(0)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """The test on one thread (bitwise-reproducible reductions), the count restored after it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="module")
def _restore_threads() -> Iterator[None]:
    """A module that runs on one thread (captures that must reproduce bit for bit) leaves the rest
    of the suite on torch's thread count as it found it."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="module")
def _fresh_dynamo() -> Iterator[None]:
    """Each module compiles from an empty Dynamo cache: a frame compiled by an earlier module (another
    backend, a dimension marked dynamic) would otherwise serve this module's calls of the same code."""
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
    yield


@pytest.fixture
def capture(tmp_path: Path) -> Callable[..., Path]:
    """Trace ``steps`` training steps of a model from :mod:`workloads.models`; returns the trace folder.

    >>> path = capture("mlp", steps=2)  # doctest: +SKIP
    """
    from tracecmp import TraceCompare

    def run(name: str = "mlp", *, steps: int = 2, optimizer: str = "adam", **options: object) -> Path:
        model = make_model(name)
        opt = make_optimizer(model, optimizer)
        batch = example_batch(name)
        path = tmp_path / f"{name}-trace"
        with TraceCompare(path, model=model, **options) as tc:
            for _ in range(steps):
                train_step(model, opt, batch)
                tc.step()
        return path

    return run
