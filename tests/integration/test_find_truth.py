"""The localization harness names the faulty call in the target trace by its outputs' checksums:
the call holding most of them, the site's own call among equals, where another call returns one
of the same outputs."""

from __future__ import annotations

from pathlib import Path

import pyarrow.compute as pc
import torch

import tracecmp
from workloads.localization.cases import Case
from workloads.localization.faults import Observation, OutputFault, Plan, Site
from workloads.localization.runner import find_truth

aten = torch.ops.aten


def _two_batch_norm_backwards(path: Path) -> None:
    """Two batch norm backward calls fed the same gradient: their bias gradients are equal."""
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(4, 3, 5, generator=gen)
    with tracecmp.TraceCompare(path):
        for _ in range(2):
            x, w = torch.randn(4, 3, 5, generator=gen), torch.randn(3, generator=gen)
            _, mean, rstd = aten.native_batch_norm(x, w, None, None, None, True, 0.1, 1e-5)
            aten.native_batch_norm_backward(grad, x, w, None, None, mean, rstd, True, 1e-5, [True, True, True])


def test_the_faulty_call_is_the_one_holding_most_of_its_outputs(tmp_path: Path) -> None:
    _two_batch_norm_backwards(tmp_path / "run")
    rank = tracecmp.load(str(tmp_path / "run")).rank(0)
    ops = rank.ops
    calls = ops[ops["op"] == "aten.native_batch_norm_backward.default"].sort_values("op_id")["op_id"].tolist()
    assert len(calls) == 2
    tensors = rank.tensors_table
    checksums = {op_id: tensors.filter(pc.equal(tensors["op_id"], op_id))["checksum"].to_pylist() for op_id in calls}
    assert checksums[calls[0]][-1] == checksums[calls[1]][-1]  # the same bias gradient
    site = Site("aten.native_batch_norm_backward.default", "forward", 1)
    case = Case(
        "case", "none", "scale", "plain", "forward", 0.05, Plan(output_fault=OutputFault("scale", site)), Plan()
    )
    obs = Observation(site_reached=True, fault_applied=True, effective=True, site_checksums=checksums[calls[1]])
    truth, notes = find_truth(case, obs, tmp_path / "run")
    assert truth.op_id == calls[1], notes
