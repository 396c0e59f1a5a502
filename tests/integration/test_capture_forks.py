"""A process forked while a session runs (DataLoader workers, a bare ``os.fork()``) holds nothing of
it: it records and writes nothing, never waits for the writer, and computes what it would without
tracecmp; the session's trace is the parent's alone. (``tracecmp record``'s own case, armed before
the first module call: tests/integration/test_record.py.)"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.modules import module as nn_module
from torch.optim import optimizer as optim_module
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils.data import DataLoader, Dataset

import tracecmp

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")


def _nothing_of_tracecmp() -> bool:
    """No mode, hook or session of tracecmp's in force in this process."""
    return (
        not _get_current_dispatch_mode_stack()
        and not _get_current_function_mode_stack()
        and not nn_module._global_forward_pre_hooks
        and not nn_module._global_forward_hooks
        and not optim_module._global_optimizer_pre_hooks
        and not optim_module._global_optimizer_post_hooks
        and tracecmp.TraceCompare._active is None
    )


class Augment(nn.Module):
    """A random transform, as data augmentation has: dropout=0.0 must not reach it in a worker."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(x.flip(0), 0.5, training=True)


class Data(Dataset):  # type: ignore[type-arg]
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
        self.transform = Augment()

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        return self.transform(self.x[i]), self.y[i], torch.tensor(_nothing_of_tracecmp())


def _loader() -> DataLoader:  # type: ignore[type-arg]
    # timeout: a worker that hangs fails the test instead of stalling it.
    return DataLoader(
        Data(),
        batch_size=8,
        num_workers=2,
        multiprocessing_context="fork",
        timeout=60,
        generator=torch.Generator().manual_seed(1),
    )


def test_dataloader_workers_forked_in_a_session_record_nothing_and_compute_as_without_it(tmp_path: Path) -> None:
    assert _nothing_of_tracecmp()
    untraced = [x for x, _, _ in _loader()]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    with tracecmp.TraceCompare(tmp_path / "t", model=model, dropout=0.0):
        for x, y, clean in _loader():  # the workers fork with capture's mode entered
            seen.append((x, clean))
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert len(seen) == len(untraced) == 2
    for (x, clean), plain in zip(seen, untraced):
        assert clean.all()  # no mode, hook or session in the workers
        assert x.view(torch.int32).equal(plain.view(torch.int32))  # their dropout as without tracecmp
    trace = tracecmp.load(tmp_path / "t")
    assert trace.complete and trace.rank(0).manifest["steps"] == [0, 1]
    ops = trace.to_frame()
    for step in (0, 1):
        assert set(ops[ops["step"] == step]["phase"]) == {"forward", "backward", "optimizer"}
    assert not {"aten.flip.default", "aten.native_dropout.default"} & set(ops["op"])  # the workers' ops


class Counting(TorchDispatchMode):
    """A dispatch mode of the program's own."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _wait(pid: int, seconds: float = 60.0) -> int:
    """The exit status of child ``pid``; a child still running after ``seconds`` is killed (hung)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung")


def test_a_child_forked_in_a_session_keeps_the_programs_own_mode_and_ends_it_as_a_no_op(tmp_path: Path) -> None:
    with tracecmp.TraceCompare(tmp_path / "t") as tc:
        torch.ones(2).mul(3)
        with Counting() as mine:  # entered over capture's mode
            pid = os.fork()
            if pid == 0:  # the child: never back into pytest
                status = 1
                try:
                    kept, before = _get_current_dispatch_mode_stack() == [mine], mine.ops
                    torch.ones(3).cumsum(0)
                    tc.step()
                    tc.sync()
                    tc.__exit__(None, None, None)
                    status = 0 if kept and mine.ops > before else 2
                finally:
                    os._exit(status)
            assert _wait(pid) == 0
        torch.ones(2).add(1)
    trace = tracecmp.load(tmp_path / "t")
    assert trace.complete
    assert "aten.cumsum.default" not in set(trace.to_frame()["op"])
    assert {"aten.mul.Tensor", "aten.add.Tensor"} <= set(trace.to_frame()["op"])
