"""``compare`` with self-checks at capture: a bf16-autocast target against its float32 bench, where
the runs drift apart by bf16's rounding, and a 5% fault in one GELU call (emulated as a device
kernel would make it, :mod:`workloads.kernel_faults`)."""

from __future__ import annotations

import pytest

import tracecmp
from tracecmp.capture.selfcheck import SUMS_AT_16_BITS
from workloads.kernel_faults import FAULTS, capture

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    return capture(tmp_path_factory.mktemp("bench") / "run", data="stats")


@pytest.mark.skipif(
    SUMS_AT_16_BITS,
    reason="this torch's 16-bit kernels work at 16 bits: a 5% scaled bf16 GELU sits at its check's allowance",
)
def test_a_faulty_kernel_in_a_drifted_autocast_run_is_named_by_its_own_check(tmp_path, bench):
    target = capture(tmp_path / "run", "gelu-scale-5e-2", data="stats", autocast=True, self_check="sample")
    result = tracecmp.compare(target, bench)
    d = result.first_divergence
    assert d is not None and (d.op, d.module) == ("aten.gelu.default", FAULTS["gelu-scale-5e-2"][2]), result.summary()
    assert "its own check at capture failed" in d.reason
    assert [s.op for s in result.suspects] == ["aten.gelu.default"], result.summary()
    gelu = result.nodes[(result.nodes["op"] == "aten.gelu.default") & (result.nodes["module"] == d.module)]
    assert (gelu["self_check"] > 1).all()


def test_a_clean_autocast_run_with_self_checks_agrees(tmp_path, bench):
    target = capture(tmp_path / "run", data="stats", autocast=True, self_check="sample")
    result = tracecmp.compare(target, bench)
    assert not result.suspects, result.summary()
    assert result.nodes["self_check"].notna().sum() > 100
    # The summary counts the ops within rounding noise that their own check cleared.
    assert "passed their own check at capture" in result.summary()


def test_a_fault_inside_the_drift_is_found_only_by_the_ops_own_check(tmp_path, bench):
    # 1e-3 relative noise in a float32 layer norm of a bf16-autocast run: far inside what bf16's
    # drift leaves between the runs, so statistics against the bench read AGREE; the op's own
    # check at capture sees it at once.
    unchecked = tracecmp.compare(capture(tmp_path / "off", "layer-norm-noise", data="stats", autocast=True), bench)
    assert not unchecked.suspects, unchecked.summary()
    target = capture(tmp_path / "on", "layer-norm-noise", data="stats", autocast=True, self_check="sample")
    result = tracecmp.compare(target, bench)
    assert [(s.op, s.module) for s in result.suspects] == [
        ("aten.native_layer_norm.default", FAULTS["layer-norm-noise"][2])
    ], result.summary()


def test_each_check_at_capture_names_one_of_its_ops_recorded_outputs(tmp_path):
    """A check row's ``index`` is a place among the op's tensor outputs: a convolution backward
    that returns no input gradient (its input wants none) names its weight gradient 0, on the
    per-op path's recipes as on the usual path."""
    import torch

    from tracecmp.trace import reader

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, bias=False), torch.nn.BatchNorm2d(4), torch.nn.Conv2d(4, 2, 1))
    x = torch.randn(2, 3, 8, 8)
    with tracecmp.TraceCompare(tmp_path / "run", model=model, self_check="sample") as tc:
        for _ in range(4):  # a signature's first two calls teach its recipe
            model(x).sum().backward()
            tc.step()
    rank = reader.load(tmp_path / "run").rank()
    ops, checks = rank.ops, rank.checks
    outputs = dict(zip(ops["op_id"], ops["outputs"].map(len)))
    names = dict(zip(ops["op_id"], ops["op"]))
    assert (checks["index"] < checks["op_id"].map(outputs)).all()
    backward = checks[checks["op_id"].map(names) == "aten.convolution_backward.default"]
    assert len(backward) == 4 * 3 and (backward["residual"] <= backward["limit"]).all()
