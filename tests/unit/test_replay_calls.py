"""Replay's verdict on single calls: TF32 matmuls an op calls once, and bits a device gives as
this CPU does (hand-recorded runs, ``tests.tracebuild``)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch

import tracecmp
from tests.tracebuild import TraceBuilder, round_tf32

A = torch.ops.aten


def _three_matmuls(
    path: Path, tf32: bool, fault: Callable[[torch.Tensor], torch.Tensor] | None = None, data: bool = True
) -> Path:
    """mm, addmm, bmm: three matmul ops called once each, TF32-rounded operands in the target;
    ``fault`` rewrites the addmm's output."""
    g = torch.Generator().manual_seed(21)
    x, w1 = torch.randn(16, 48, generator=g), torch.randn(48, 32, generator=g) / 7
    bias, w2 = torch.randn(24, generator=g), torch.randn(32, 24, generator=g) / 6
    w3 = torch.randn(4, 24, 8, generator=g) / 5
    r = round_tf32 if tf32 else (lambda t: t)
    b = TraceBuilder(data=data)
    X, W1 = b.source("input.0", x), b.param("fc1.weight", w1, module="fc1")
    BIAS, W2 = b.param("fc2.bias", bias, module="fc2"), b.param("fc2.weight", w2, module="fc2")
    W3 = b.param("mix.weight", w3, module="mix")
    h = b.call(A.mm.default, X, W1, module="fc1", fault=lambda _: A.mm.default(r(x), r(w1)))
    h = b.call(A.tanh.default, h, module="act")
    hv = b.value(h)

    def addmm(_: torch.Tensor) -> torch.Tensor:
        out = A.addmm.default(bias, r(hv), r(w2))
        return fault(out) if fault is not None else out

    h = b.call(A.addmm.default, BIAS, h, W2, module="fc2", fault=addmm)
    h = b.call(A.view.default, h, [4, 4, 24], module="mix")
    hv = b.value(h)
    h = b.call(A.bmm.default, h, W3, module="mix", fault=lambda _: A.bmm.default(r(hv), r(w3)))
    b.call(A.sum.default, b.call(A.relu.default, h, module="act2"))
    options = {"determinism": {"float32_matmul_precision": "high" if tf32 else "highest"}}
    return b.write(path, options=options)


@pytest.mark.parametrize("data", [False, True], ids=["stats", "tensors"])
def test_tf32_matmuls_called_once_are_noise(tmp_path, data):
    bench = _three_matmuls(tmp_path / "b", tf32=False, data=data)
    result = tracecmp.compare(_three_matmuls(tmp_path / "t", tf32=True, data=data), bench)
    assert result.first_divergence is None, result.suspects


def test_a_tf32_matmul_called_once_and_wrong_is_named_by_its_accumulation_bound(tmp_path):
    bench = _three_matmuls(tmp_path / "b", tf32=False)
    wrong = tracecmp.compare(_three_matmuls(tmp_path / "t", tf32=True, fault=lambda t: t.half().float()), bench)
    d = wrong.first_divergence
    assert d is not None and (d.op, d.module) == ("aten.addmm.default", "fc2"), wrong.suspects
    assert "accumulation bound" in d.reason or "bit for bit" in d.reason


def _gelus(path: Path, *, tf32: bool = True, flip: int | None = None, device_gelu: bool = False) -> Path:
    """Four gelus behind matmuls (TF32 in the target: noise far above one ulp everywhere);
    ``flip`` moves one element of that gelu's output by one ulp; ``device_gelu`` computes every
    gelu another way (float64, rounded once), as a device would."""
    g = torch.Generator().manual_seed(8)
    b = TraceBuilder(data=True)
    h = b.source("input.0", torch.randn(8, 32, generator=g))
    r = round_tf32 if tf32 else (lambda t: t)
    for i in range(4):
        wv = torch.randn(32, 32, generator=g) / 6
        w = b.param(f"fc{i}.weight", wv, module=f"fc{i}")
        hv = b.value(h)
        h = b.call(A.mm.default, h, w, module=f"fc{i}", fault=lambda _, hv=hv, wv=wv: A.mm.default(r(hv), r(wv)))
        hv = b.value(h)

        def gelu(out: torch.Tensor, i: int = i, hv: torch.Tensor = hv) -> torch.Tensor:
            out = A.gelu.default(hv.double()).float() if device_gelu else out.clone()
            if flip == i:
                out.view(-1)[3] = torch.nextafter(out.view(-1)[3], torch.tensor(1e30))
            return out

        h = b.call(A.gelu.default, h, module=f"act{i}", fault=gelu)
    b.call(A.sum.default, h)
    return b.write(path, options={"determinism": {"float32_matmul_precision": "high" if tf32 else "highest"}})


def test_one_flipped_bit_is_found_where_the_run_computes_as_this_cpu(tmp_path):
    bench = _gelus(tmp_path / "b", tf32=False)
    result = tracecmp.compare(_gelus(tmp_path / "t", flip=2), bench)
    d = result.first_divergence
    assert d is not None and (d.op, d.module) == ("aten.gelu.default", "act2") and "bit for bit" in d.reason


def test_a_device_that_computes_an_op_otherwise_is_not_held_to_this_cpus_bits(tmp_path):
    # Every gelu a few ulps off this CPU's (another implementation): one more flipped ulp is
    # noise, as is the rest.
    bench = _gelus(tmp_path / "b", tf32=False)
    result = tracecmp.compare(_gelus(tmp_path / "t", flip=2, device_gelu=True), bench)
    assert result.first_divergence is None, result.suspects
