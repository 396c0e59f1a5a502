"""A single fault yields a single root: the ops downstream of it inherit its error and are no
roots of their own, though what statistics say of that error is a lower bound only.

The transformer block of ``workloads/models.py`` with its MLP's first ``addmm`` (``mlp.0``) scaled by
1.001: before the downstream margin, compare also named the bias gradient of ``mlp.2`` (a sum
over tokens of an error the scale spread unevenly) or the head.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tracecmp
from workloads.localization.faults import Injector, OutputFault, Plan, Site
from workloads.localization.models import build


def _record(path: Path, plan: Plan) -> Path:
    workload = build("transformer")
    optimizer = workload.make_optimizer()
    injector = Injector(workload.model, plan)
    with injector.outer():
        with tracecmp.TraceCompare(str(path), model=workload.model) as tc:
            with injector.inner():
                workload.train_step(optimizer)
            tc.step()
    return path


@pytest.mark.parametrize("kind", ["scale", "noise"])
def test_a_scaled_mlp_matmul_is_the_only_root(tmp_path: Path, kind: str) -> None:
    torch.set_num_threads(1)
    bench = _record(tmp_path / "bench", Plan())
    mlp_in = Site("aten.addmm.default", "forward", 1)  # attn's in-projection is call 0
    target = _record(tmp_path / "target", Plan(output_fault=OutputFault(kind, mlp_in, 1e-3, seed=1)))
    result = tracecmp.compare(target, bench)
    assert [(d.op, d.module) for d in result.suspects] == [("aten.addmm.default", "mlp.0")], result.summary()
