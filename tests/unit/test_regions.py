"""Regions: ops that pair only as groups (a fused op against its decomposition, another
decomposition, casts on one side), judged at their boundary, on hand-recorded runs."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import pytest
import torch

import tracecmp
from tests.tracebuild import Ref, TraceBuilder
from tracecmp.numerics.replay import replay_regions

A = torch.ops.aten
SCALE = 0.25  # 1 / sqrt(head dim 16)


def _qkv(b: TraceBuilder) -> tuple[Ref, Ref, Ref, Ref]:
    g = torch.Generator().manual_seed(3)
    x = b.source("input.0", torch.randn(2, 2, 8, 16, generator=g))
    w = b.param("proj.weight", torch.randn(16, 16, generator=g) / 4, module="proj")
    q = b.call(A.matmul.default, x, w, module="proj")
    k = b.call(A.mul.Tensor, q, 0.5, module="proj")
    v = b.call(A.tanh.default, q, module="proj")
    return x, q, k, v


FLASH = "aten._scaled_dot_product_flash_attention_for_cpu.default"


def _flash(
    b: TraceBuilder,
    q: Ref,
    k: Ref,
    v: Ref,
    module: str,
    fault: Callable[[torch.Tensor], torch.Tensor] | None = None,
    **kwargs: object,
) -> Ref:
    """Flash attention for the CPU, recorded as capture records it (``dropout_p=0.0``; the schema
    says random, but it draws nothing). Torch before 2.2 has no such op: its two outputs are then
    computed here, as a vendor's op would be recorded, and replay runs the bench's side instead."""
    if hasattr(torch.ops.aten, FLASH.split(".")[1]):
        return b.call(
            A._scaled_dot_product_flash_attention_for_cpu.default,
            q,
            k,
            v,
            dropout_p=0.0,
            module=module,
            random=True,
            fault=fault,
            **kwargs,
        )[0]
    qv, kv, vv = b.value(q), b.value(k), b.value(v)
    scores = qv @ kv.transpose(-2, -1) * qv.shape[-1] ** -0.5
    value = torch.softmax(scores, dim=-1) @ vv
    outputs = [fault(value) if fault else value, torch.logsumexp(scores, dim=-1)]
    return b.op(FLASH, [q, k, v], outputs, module=module, args={"dropout_p": 0.0}, random=True)[0]


def _tail(b: TraceBuilder, out: Ref) -> None:
    y = b.call(A.gelu.default, out, module="act")
    b.call(A.sum.default, y, module="")


def _fused(
    path: Path,
    *,
    fault: Callable[[torch.Tensor], torch.Tensor] | None = None,
    name: str | None = None,
    data: bool = False,
) -> Path:
    """Attention as one fused op (flash attention for the CPU, or a vendor op the CPU lacks)."""
    b = TraceBuilder(data=data)
    _, q, k, v = _qkv(b)
    if name is None:
        out = _flash(b, q, k, v, "attn", fault)
    else:
        qv, kv, vv = b.value(q), b.value(k), b.value(v)
        value = torch.softmax(qv @ kv.transpose(-2, -1) * SCALE, dim=-1) @ vv
        out = b.op(name, [q, k, v], fault(value) if fault else value, module="attn")
    _tail(b, out)
    return b.write(path)


def _eager(
    path: Path,
    *,
    fault: Callable[[torch.Tensor], torch.Tensor] | None = None,
    data: bool = False,
    bf16_softmax: bool = False,
) -> Path:
    """The same attention spelled out: q k^T, scale, softmax, @ v (``bf16_softmax``: the softmax in
    bfloat16 between two casts, ``softmax(s.to(bf16)).float()``)."""
    b = TraceBuilder(data=data)
    _, q, k, v = _qkv(b)
    kt = b.call(A.transpose.int, k, -2, -1, module="attn")
    s = b.call(A.matmul.default, q, kt, module="attn")
    s = b.call(A.mul.Tensor, s, SCALE, module="attn")
    if bf16_softmax:
        s = b.call(A._to_copy.default, s, dtype=torch.bfloat16, module="attn")
        p = b.call(A._softmax.default, s, -1, False, module="attn")
        p = b.call(A._to_copy.default, p, dtype=torch.float32, module="attn")
    else:
        p = b.call(A._softmax.default, s, -1, False, module="attn")
    out = b.call(A.matmul.default, p, v, module="attn", fault=fault)
    _tail(b, out)
    return b.write(path)


def _scale(factor: float) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t * factor


def test_fused_attention_against_eager_agrees_and_is_one_region(tmp_path):
    result = tracecmp.compare(_fused(tmp_path / "t"), _eager(tmp_path / "b"))
    assert result.first_divergence is None and not result.suspects
    assert result.agrees, result.verdict()
    (region,) = result.regions
    assert region.kind == "fused" and len(region.target_ops) == 1
    assert [n.split(".")[1] for n in region.bench_names] == ["transpose", "matmul", "mul", "_softmax", "matmul"]
    assert result.unpaired_bench.empty
    frame = result.regions_frame()
    assert frame.loc[0, "target_ops"] == "_scaled_dot_product_flash_attention_for_cpu"
    assert frame.loc[0, "bench_ops"] == "matmul x2, mul, _softmax" and frame.loc[0, "status"] in ("agrees", "noise")


@pytest.mark.parametrize("direction", ["fused-target", "fused-bench"])
def test_a_fault_inside_the_fused_part_is_named_at_its_region(tmp_path, direction):
    if direction == "fused-target":
        target, bench = _fused(tmp_path / "t", fault=_scale(1 + 1e-3)), _eager(tmp_path / "b")
        expected = FLASH
    else:
        target, bench = _eager(tmp_path / "t", fault=_scale(1 + 1e-3)), _fused(tmp_path / "b")
        expected = "aten.matmul.default"  # the op of the eager side that made the region's output
    result = tracecmp.compare(target, bench)
    d = result.first_divergence
    assert d is not None and d.op == expected and d.module == "attn" and d.kind == "computation"
    (region,) = result.regions
    assert d.region == region.region_id and d.op_id in region.target_ops and f"region {region.region_id}" in d.reason
    assert [s.op for s in result.suspects] == [expected]


@pytest.mark.parametrize("data", [False, True])
def test_a_softmax_in_bf16_inside_an_attention_matched_as_a_region_is_a_precision_root(tmp_path, data):
    """Its error is within what the region's own ops (a bfloat16 softmax among them) allow at the
    boundary; the round trip through bfloat16, which no op of the fused bench makes, is the fault."""
    target = _eager(tmp_path / "t", bf16_softmax=True, data=data)
    result = tracecmp.compare(target, _fused(tmp_path / "b", data=data))
    d = result.first_divergence
    assert d is not None and (d.op, d.module, d.kind) == ("aten._softmax.default", "attn", "precision"), (
        result.summary()
    )
    assert "round trip" in d.reason and len(result.suspects) == 1 and d.region is not None
    assert d.score > 1.0  # in float32 units, not the region's bf16 budget's


def test_a_vendor_fused_op_the_cpu_cannot_run_is_replayed_through_the_bench_ops(tmp_path):
    bench = _eager(tmp_path / "b", data=True)
    clean = tracecmp.compare(_fused(tmp_path / "t0", name="npu.fused_attention.default", data=True), bench)
    assert clean.first_divergence is None
    (region,) = clean.regions
    (replay,) = replay_regions(clean.target.rank(0), clean.bench.rank(0), clean.regions).values()
    assert replay.reference == "bench" and replay.error < 1e-6 and math.isnan(replay.sides_differ)
    faulty = tracecmp.compare(
        _fused(tmp_path / "t1", name="npu.fused_attention.default", fault=_scale(1 + 1e-5), data=True), bench
    )
    d = faulty.first_divergence
    assert d is not None and d.op == "npu.fused_attention.default" and "the bench's ops" in d.reason


def _gelu_fused(path: Path, data: bool) -> Path:
    b = TraceBuilder(data=data)
    x = b.source("input.0", torch.randn(8, 32, generator=torch.Generator().manual_seed(5)))
    y = b.call(A.gelu.default, x, approximate="tanh", module="act")
    b.call(A.sum.default, y)
    return b.write(path)


def _gelu_eager(path: Path, data: bool) -> Path:
    b = TraceBuilder(data=data)
    x = b.source("input.0", torch.randn(8, 32, generator=torch.Generator().manual_seed(5)))
    e = b.call(A.erf.default, b.call(A.mul.Tensor, x, 2**-0.5, module="act"), module="act")
    y = b.call(
        A.mul.Tensor,
        b.call(A.mul.Tensor, x, 0.5, module="act"),
        b.call(A.add.Tensor, e, 1.0, module="act"),
        module="act",
    )
    b.call(A.sum.default, y)
    return b.write(path)


@pytest.mark.parametrize("data", [False, True], ids=["stats", "tensors"])
def test_a_fused_op_computing_another_function_is_a_root(tmp_path, data):
    # The tanh approximation of GELU, fused, against the exact GELU spelled out: 1e-4 apart.
    result = tracecmp.compare(_gelu_fused(tmp_path / "t", data), _gelu_eager(tmp_path / "b", data))
    d = result.first_divergence
    assert d is not None and d.op == "aten.gelu.default" and d.region is not None
    if data:  # both sides replayed in float64 on the same inputs
        assert "compute different functions" in d.reason and d.metrics["sides_differ"] > 1e-5


def test_a_rewritten_decomposition_that_compensates_is_no_divergence(tmp_path):
    """The target scales q and k by sqrt(scale) each, the bench scales the scores once."""

    def run(path: Path, split: bool) -> Path:
        b = TraceBuilder()
        _, q, k, v = _qkv(b)
        if split:
            q = b.call(A.mul.Tensor, q, SCALE**0.5, module="attn")
            k = b.call(A.mul.Tensor, k, SCALE**0.5, module="attn")
        s = b.call(A.matmul.default, q, b.call(A.transpose.int, k, -2, -1, module="attn"), module="attn")
        if not split:
            s = b.call(A.mul.Tensor, s, SCALE, module="attn")
        p = b.call(A._softmax.default, s, -1, False, module="attn")
        _tail(b, b.call(A.matmul.default, p, v, module="attn"))
        return b.write(path)

    result = tracecmp.compare(run(tmp_path / "t", True), run(tmp_path / "b", False))
    assert result.first_divergence is None and result.agrees, result.suspects
    (region,) = result.regions
    # The pairs caught between the two changes (matmul, transpose) carry values that differ by design.
    assert region.kind == "rewritten" and "aten.matmul.default" in region.target_names
    assert "aten.matmul.default" in region.bench_names and "aten.mul.Tensor" in region.bench_names


def _mlp(path: Path, *, cast: str = "", data: bool = False) -> Path:
    """x @ w1 -> relu -> @ w2; ``cast`` "target"/"bench" makes the matmuls autocast-style: inputs
    cast to bfloat16, result cast back to float32, as torch.autocast inserts on one side only."""
    g = torch.Generator().manual_seed(7)
    b = TraceBuilder(data=data)
    x = b.source("input.0", torch.randn(16, 32, generator=g))
    w1 = b.param("fc1.weight", torch.randn(32, 64, generator=g) / 6, module="fc1")
    w2 = b.param("fc2.weight", torch.randn(64, 8, generator=g) / 8, module="fc2")

    def mm(a: Ref, w: Ref, module: str) -> Ref:
        if not cast:
            return b.call(A.mm.default, a, w, module=module)
        a16 = b.call(A._to_copy.default, a, dtype=torch.bfloat16, module=module)
        w16 = b.call(A._to_copy.default, w, dtype=torch.bfloat16, module=module)
        return b.call(
            A._to_copy.default, b.call(A.mm.default, a16, w16, module=module), dtype=torch.float32, module=module
        )

    h = b.call(A.relu.default, mm(x, w1, "fc1"), module="act")
    b.call(A.sum.default, mm(h, w2, "fc2"))
    return b.write(path)


@pytest.mark.parametrize("side", ["target", "bench"])
def test_casts_on_one_side_are_judged_as_casts_and_never_leave_the_verdict_incomplete(tmp_path, side):
    target = _mlp(tmp_path / "t", cast="target" if side == "target" else "")
    bench = _mlp(tmp_path / "b", cast="bench" if side == "bench" else "")
    result = tracecmp.compare(target, bench)
    assert result.first_divergence is None, result.suspects
    assert not result.verdict().startswith("INCOMPLETE") and result.agrees, result.verdict()
    assert {r.kind for r in result.regions} == {"pass-through"} and len(result.regions) == 6
    assert all(bool(r.target_ops) == (side == "target") for r in result.regions)
    assert result.unpaired_bench.empty and "unpaired" not in set(result.nodes["status"])


def test_a_real_change_behind_a_cast_is_still_named(tmp_path):
    def wrong(t: torch.Tensor) -> torch.Tensor:
        return t * 1.01

    g = torch.Generator().manual_seed(7)
    target = _mlp(tmp_path / "t", cast="target")
    bench = _mlp(tmp_path / "b")
    # The same, with the first relu's output scaled: found at the relu, not blamed on a cast.
    b = TraceBuilder()
    x = b.source("input.0", torch.randn(16, 32, generator=g))
    w1 = b.param("fc1.weight", torch.randn(32, 64, generator=g) / 6, module="fc1")
    w2 = b.param("fc2.weight", torch.randn(64, 8, generator=g) / 8, module="fc2")
    a16 = b.call(A._to_copy.default, x, dtype=torch.bfloat16, module="fc1")
    w16 = b.call(A._to_copy.default, w1, dtype=torch.bfloat16, module="fc1")
    h = b.call(A._to_copy.default, b.call(A.mm.default, a16, w16, module="fc1"), dtype=torch.float32, module="fc1")
    h = b.call(A.relu.default, h, module="act", fault=wrong)
    a16 = b.call(A._to_copy.default, h, dtype=torch.bfloat16, module="fc2")
    w16 = b.call(A._to_copy.default, w2, dtype=torch.bfloat16, module="fc2")
    y = b.call(A._to_copy.default, b.call(A.mm.default, a16, w16, module="fc2"), dtype=torch.float32, module="fc2")
    b.call(A.sum.default, y)
    result = tracecmp.compare(b.write(tmp_path / "t2"), bench)
    d = result.first_divergence
    assert d is not None and (d.op, d.module) == ("aten.relu.default", "act"), result.suspects
    assert target.exists()


def _saving_attention(path: Path, fused: bool, fault: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Path:
    """Attention whose sequence length equals its head size, keeping for its backward what autograd
    keeps: the fused op's output, or the eager side's softmax probabilities (same shape), each
    through a ``detach``."""
    b = TraceBuilder()
    g = torch.Generator().manual_seed(5)
    x = b.source("input.0", torch.randn(2, 2, 8, 8, generator=g))
    q = b.call(
        A.matmul.default, x, b.param("proj.weight", torch.randn(8, 8, generator=g) / 3, module="proj"), module="proj"
    )
    k, v = b.call(A.mul.Tensor, q, 0.5, module="proj"), b.call(A.tanh.default, q, module="proj")
    if fused:
        out = _flash(b, q, k, v, "attn")
        b.call(A.detach.default, out, module="attn")
    else:
        s = b.call(
            A.mul.Tensor,
            b.call(A.matmul.default, q, b.call(A.transpose.int, k, -2, -1, module="attn"), module="attn"),
            8**-0.5,
            module="attn",
        )
        p = b.call(A._softmax.default, s, -1, False, module="attn")
        b.call(A.detach.default, p, module="attn")
        out = b.call(A.matmul.default, p, v, module="attn")
    y = b.call(
        A.mm.default,
        b.call(A.view.default, out, [32, 8], module="out"),
        b.param("out.weight", torch.randn(8, 8, generator=g) / 3, module="out"),
        module="out",
    )
    b.call(A.sum.default, b.call(A.gelu.default, y, module="act", fault=fault), module="")
    return b.write(path)


def test_a_value_kept_for_backward_never_pairs_a_fused_output_with_another_tensor(tmp_path):
    # The two detaches pair by name and shape, and would say the attention output is the softmax
    # probabilities; the view read by the output projection says what it is.
    bench = _saving_attention(tmp_path / "b", fused=False)
    clean = tracecmp.compare(_saving_attention(tmp_path / "t", fused=True), bench)
    assert clean.agrees and not clean.suspects, clean.summary()
    (region,) = clean.regions
    assert "aten.detach.default" in region.target_names and "aten.detach.default" in region.bench_names
    faulty = tracecmp.compare(_saving_attention(tmp_path / "t1", fused=True, fault=_scale(1 + 1e-3)), bench)
    assert faulty.first_divergence is not None and faulty.first_divergence.op == "aten.gelu.default"
    assert [s.op for s in faulty.suspects] == ["aten.gelu.default"]


def test_a_nan_root_outranks_roots_of_a_few_rounding_units(tmp_path):
    def run(path: Path, faulty: bool) -> Path:
        b = TraceBuilder()
        x = b.source("input.0", torch.randn(64, generator=torch.Generator().manual_seed(2)))
        y = b.call(A.exp.default, x, module="a", fault=(lambda t: t * (1 + 2**-20)) if faulty else None)
        z = b.call(A.mul.Tensor, y, 3.0, module="b")

        def overflow(t: torch.Tensor) -> torch.Tensor:
            t = t.clone()
            t[0] = math.inf
            return t

        w = b.call(A.tanh.default, z, module="c")
        b.call(A.mul.Tensor, w, 2.0, module="d", fault=overflow if faulty else None)
        return b.write(path)

    result = tracecmp.compare(run(tmp_path / "t", True), run(tmp_path / "b", False))
    assert [d.op for d in result.suspects[:2]] == ["aten.mul.Tensor", "aten.exp.default"]
    nan, rounding = result.suspects[:2]
    assert nan.kind == "nan" and math.isinf(nan.score) and rounding.score < 100
    assert result.first_divergence.op == "aten.exp.default"  # the first in execution order stays first


def test_an_autocast_cast_of_a_one_magnitude_bias_is_its_own_rounding(tmp_path):
    # After Adam's first step a bias that started at zero is +-lr in every element: its cast to
    # bfloat16 rounds every element the same way, so the norm and mean move by the full rounding,
    # which no size averages away (GPT-2 small under autocast named 9 such casts as roots).
    g = torch.Generator().manual_seed(3)
    sign = torch.randint(0, 2, (768,), generator=g).float() * 2 - 1
    bias = sign * 1.0009e-3 + torch.randn(768, generator=g) * 1e-9
    inputs = torch.randn(16, 768, generator=g) / 4

    def run(path: Path, cast: bool) -> Path:
        b = TraceBuilder()
        x = b.source("input.0", inputs)
        p = b.param("fc.bias", bias, module="fc")
        if cast:
            p = b.call(A._to_copy.default, p, dtype=torch.bfloat16, module="fc")
            x = b.call(A._to_copy.default, x, dtype=torch.bfloat16, module="fc")
        y = b.call(A.add.Tensor, x, p, module="fc")
        if cast:
            y = b.call(A._to_copy.default, y, dtype=torch.float32, module="fc")
        b.call(A.sum.default, y)
        return b.write(path)

    result = tracecmp.compare(run(tmp_path / "t", True), run(tmp_path / "b", False))
    assert result.first_divergence is None, result.suspects
    assert {r.kind for r in result.regions} == {"pass-through"}


def test_a_nan_an_argument_hands_to_an_op_only_the_target_runs_is_a_root(tmp_path):
    """``index_fill(..., nan)`` the bench never runs: an argument hands the NaN in, but no bench op
    hands the same, so it is a structure root, not NaN the program gave both runs."""

    def run(path: Path, fill: bool) -> Path:
        g = torch.Generator().manual_seed(0)
        b = TraceBuilder()
        x = b.source("input.0", torch.randn(4, 8, generator=g))
        w = b.param("fc.weight", torch.randn(8, 8, generator=g), module="fc")
        h = b.call(A.mm.default, x, w, module="fc")
        if fill:
            h = b.call(A.index_fill.int_Scalar, h, 0, torch.tensor([1]), float("nan"), module="mask")
        y = b.call(A.relu.default, h, module="act")
        b.call(A.sum.default, y, module="")
        return b.write(path)

    result = tracecmp.compare(run(tmp_path / "t", True), run(tmp_path / "b", False))
    d = result.first_divergence
    assert d is not None and (d.op, d.module, d.kind) == ("aten.index_fill.int_Scalar", "mask", "structure"), (
        result.summary()
    )
    assert len(result.suspects) == 1 and result.status != "agree"
