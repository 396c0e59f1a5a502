"""TF32-sized rounding of float32 matmuls is noise only where a run could have used it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tracecmp
from tests.tracebuild import TraceBuilder
from tracecmp.numerics.precision import reduced_precision_possible


def _trace(path: Path, *, device: str = "cpu", precision: str | None = "highest") -> tracecmp.Trace:
    builder = TraceBuilder(device=device)
    builder.source("input.0", torch.ones(2, 2))
    builder.write(path)
    if precision is not None:
        manifest_path = path / "manifest.json"
        manifest = json.loads(manifest_path.read_text())
        manifest["determinism"] = {"float32_matmul_precision": precision}
        manifest_path.write_text(json.dumps(manifest))
    return tracecmp.load(path)


@pytest.mark.parametrize(
    ("device", "precision", "possible"),
    [
        ("cpu", "highest", False),  # CPU float32 matmuls differ only by summation order
        ("cpu", "high", True),  # the run asked for reduced-precision matmuls
        ("cuda:0", "highest", True),  # cuDNN allows TF32 convolutions by default
        ("npu:0", "highest", True),  # Ascend matrix units use HF32
        ("cpu", None, True),  # a trace that does not say: assume it could
    ],
)
def test_reduced_precision_follows_device_and_recorded_switches(
    tmp_path: Path, device: str, precision: str | None, possible: bool
) -> None:
    assert reduced_precision_possible(_trace(tmp_path / "t", device=device, precision=precision)) is possible


def test_capture_records_the_matmul_precision_switches(tmp_path: Path) -> None:
    with tracecmp.TraceCompare(tmp_path / "t"):
        torch.ones(2, 2) @ torch.ones(2, 2)
    flags = tracecmp.load(tmp_path / "t").manifest["determinism"]
    assert flags["float32_matmul_precision"] == torch.get_float32_matmul_precision()
    assert {"cuda_matmul_allow_tf32", "cudnn_allow_tf32"} <= set(flags)


def _first_matmul_rounded(path: Path, rounded: bool, by: float = 4e-4, precision: str = "highest") -> None:
    """input @ weight, then relu: the target's matmul output carries rounding of relative size
    ``by`` (4e-4: about TF32's, 2**-11), under the declared matmul ``precision``."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 16, generator=gen), torch.randn(16, 16, generator=gen)
    out = x @ w
    if rounded:
        out = out * (1 + by)
    builder = TraceBuilder()
    xs, ws = builder.source("input.0", x), builder.param("fc.weight", w)
    y = builder.op("aten.mm.default", [xs, ws], out, module="fc")
    builder.op("aten.relu.default", [y], out.relu(), module="act")
    builder.write(path)
    manifest_path = path / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["determinism"] = {"float32_matmul_precision": precision}
    manifest_path.write_text(json.dumps(manifest))


def test_a_cpu_run_at_full_precision_gets_no_tf32_allowance(tmp_path: Path) -> None:
    _first_matmul_rounded(tmp_path / "target", rounded=True)
    _first_matmul_rounded(tmp_path / "bench", rounded=False)
    found = tracecmp.compare(tmp_path / "target", tmp_path / "bench").first_divergence
    assert found is not None and (found.op, found.module) == ("aten.mm.default", "fc")
    allowed = tracecmp.compare(tmp_path / "target", tmp_path / "bench", tolerances={"allow_tf32": True})
    assert allowed.first_divergence is None


@pytest.mark.parametrize(
    ("by", "declared", "noise"), [(3e-3, "high", False), (3e-3, "medium", True), (5e-2, "medium", False)]
)
def test_a_declared_bf16_matmul_is_allowed_bf16_rounding_and_no_more(
    tmp_path: Path, by: float, declared: str, noise: bool
) -> None:
    """``set_float32_matmul_precision("medium")`` lets float32 matmuls round their operands to bf16
    (2**-8 each): that much is noise there, and a TF32 run's allowance stays TF32's."""
    _first_matmul_rounded(tmp_path / "target", rounded=True, by=by, precision=declared)
    _first_matmul_rounded(tmp_path / "bench", rounded=False, precision=declared)
    found = tracecmp.compare(tmp_path / "target", tmp_path / "bench").first_divergence
    if noise:
        assert found is None
    else:
        assert found is not None and (found.op, found.module) == ("aten.mm.default", "fc")
