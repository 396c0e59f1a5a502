"""Compiled against compiled: two runs of one program that compiled the same graphs pair region call
with region call and op with op, so a trace compared with itself, or with a rerun, is AGREE (bitwise
with ``exact``), never a region judged against eager ops it does not replace."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tracecmp
from tracecmp._compat import TORCH_VERSION
from workloads.compile_models import TinyGPT, tiny_batch

pytestmark = pytest.mark.skipif(TORCH_VERSION < (2, 2), reason="compiled regions are recorded from torch 2.2 on")


def _run(path: Path, backend: str = "aot_eager") -> Path:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyGPT(layers=1)
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with tracecmp.TraceCompare(path, model=model) as tc:
        for step in range(2):
            idx, targets = tiny_batch(seed=step)
            compiled(idx, targets).backward()
            opt.step()
            opt.zero_grad()
            tc.step()
    return path


def test_a_compiled_trace_compared_with_itself_agrees(tmp_path: Path) -> None:
    first = _run(tmp_path / "a")
    for exact in (False, True):
        result = tracecmp.compare(first, first, exact=exact)
        assert result.status == "agree", result.summary()
    rerun = tracecmp.compare(first, _run(tmp_path / "b"), exact=True)
    assert rerun.verdict() == "AGREE: every tensor is bitwise identical", rerun.summary()
