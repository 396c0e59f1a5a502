"""A loss scaler's skipped step: float16 overflows a GradScaler caught are the scaler at work, not roots.

An AMP-fp16 run scales its loss by 2**16 at first, so its float16 weight gradients overflow where
an fp32 bench's reach beyond 65504. The scaler's check finds the Inf, the step's update is
skipped, the scale halved. Compare reports that as a skipped step with the ops that overflowed,
and what the next step computes from the parameters the bench moved as inherited.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import tracecmp
from tests.tracebuild import Ref, TraceBuilder

A = torch.ops.aten
_CHECK = "aten._amp_foreach_non_finite_check_and_unscale_.default"


def _scaled_steps(
    path: Path,
    low: torch.dtype,
    *,
    scale: float = 256.0,
    forward_scale: float = 1.0,
    nan_in_backward: bool = False,
    scale_forward_of_step: int | None = None,
    data: bool = False,
) -> Path:
    """Two training steps of one linear layer under a loss scaler, its matmuls in ``low`` (float16 in
    the target, float32 in the bench), its loss half the sum of squares: the weight gradient
    ``x^T x w`` scaled by ``scale`` overflows float16 at the default, by about twice; the scaler's
    check reads ``found_inf`` into Python and the update runs only when nothing overflowed.
    ``forward_scale`` makes the inputs that many times larger (overflowing the forward matmul in
    float16 at 300); ``nan_in_backward`` puts a NaN into the weight gradient; ``scale_forward_of_step``
    scales that step's forward matmul by 1.05 (a fault); ``data`` saves whole tensors."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=g) * 10.0 * forward_scale
    b = TraceBuilder(data=data)
    weight = b.param("fc.weight", torch.randn(32, 16, generator=g) * 2.0, module="fc")

    def in_low(ref: Ref, **kw: object) -> Ref:
        return ref if low == torch.float32 else b.call(A._to_copy.default, ref, dtype=low, **kw)

    def in_fp32(ref: Ref, **kw: object) -> Ref:
        return ref if low == torch.float32 else b.call(A._to_copy.default, ref, dtype=torch.float32, **kw)

    def mm(x: Ref, y: Ref, fault: Callable[[torch.Tensor], torch.Tensor] | None = None, **kw: Any) -> Ref:
        # A float16 matmul as a CPU kernel makes it, float32 sums rounded (Inf beyond 65504): torch
        # before 2.2 has no float16 matmul on the CPU.
        out = (b.value(x).float() @ b.value(y).float()).to(low)
        out = fault(out) if fault is not None else out
        ref = b.op("aten.mm.default", [x, y], out, args={"self": {"tensor": 0}, "mat2": {"tensor": 1}}, **kw)
        b.values[ref.tensor_id] = out
        return ref

    for step in range(2):
        inputs = b.source(f"input.{step}", x)
        wrong = (lambda t: t * 1.05) if step == scale_forward_of_step else None
        out = in_fp32(mm(in_low(inputs, module="fc"), in_low(weight, module="fc"), wrong, module="fc"))
        b.call(A.sum.default, b.call(A.mul.Tensor, out, out))
        grad_out = b.call(A.mul.Scalar, out, scale / 64, phase="backward")
        xt = b.call(A.t.default, in_low(inputs, module="fc", phase="backward"), module="fc", phase="backward")
        fault = (lambda t: t.index_fill(0, torch.tensor([0]), math.nan)) if nan_in_backward else None
        grad_w = in_fp32(
            mm(xt, in_low(grad_out, module="fc", phase="backward"), fault, module="fc", phase="backward"),
            module="fc",
            phase="backward",
        )
        found = b.call(A.zeros.default, [1])
        inv_scale = b.call(A.full.default, [1], 1.0 / scale)
        value = b.value(grad_w)
        overflowed = float(not torch.isfinite(value).all())
        unscaled, found_after = b.op(
            _CHECK,
            [grad_w, found, inv_scale],
            [value * (1.0 / scale), torch.tensor([overflowed])],
            args={"self": [{"tensor": 0}], "found_inf": {"tensor": 1}, "inv_scale": {"tensor": 2}},
            inplace=True,
        )
        b.call(A._local_scalar_dense.default, found_after)
        if not overflowed:
            update = b.call(A.mul.Scalar, unscaled, -3.4e-3, phase="optimizer")
            weight = b.call(A.add.Tensor, weight, update, phase="optimizer")
        b.step()
    return b.write(path)


def test_an_overflow_the_scaler_caught_is_a_skipped_step_not_a_root(tmp_path: Path) -> None:
    bench = _scaled_steps(tmp_path / "b", torch.float32)
    result = tracecmp.compare(_scaled_steps(tmp_path / "t", torch.float16), bench)
    assert result.first_divergence is None and not result.suspects, result.summary()
    assert [s.step for s in result.skipped_steps] == [0, 1], result.summary()
    first = result.skipped_steps[0].overflows
    assert [(d.op, d.phase) for d in first] == [("aten.mm.default", "backward")]
    assert "float16 overflow: the bench reaches" in first[0].reason and "65504" in first[0].reason
    # step 1 runs on the weight the bench moved and the target did not: the target's own values decide
    assert "inherited values" in result.skipped_steps[1].overflows[0].reason
    assert result.verdict().startswith("NO ROOT: the target's loss scaler skipped the update of steps 0, 1")
    assert "Loss scaler:" in result.summary()
    rows = result.nodes[result.nodes["op_id"] == first[0].op_id]
    assert rows["root_kind"].tolist() == [""] and rows["status"].tolist() == ["nan"]
    assert not result.agrees  # the runs do differ: later steps start from other parameters


def test_a_scale_the_bench_also_holds_skips_nothing(tmp_path: Path) -> None:
    # float16 holds 2**4 times the gradient: no overflow, no skipped step, noise only
    result = tracecmp.compare(
        _scaled_steps(tmp_path / "t", torch.float16, scale=16.0),
        _scaled_steps(tmp_path / "b", torch.float32, scale=16.0),
    )
    assert result.first_divergence is None and not result.skipped_steps, result.summary()


def test_a_fault_its_replay_shows_after_a_skipped_step_stays_a_root(tmp_path: Path) -> None:
    # The target skipped steps 0 and 1, and step 1's forward runs on the weight the bench moved and
    # the target did not, a difference read into Python by the scaler's check. Statistics cannot
    # see a 5% fault there; the op's replay on its own recorded inputs does, whatever Python decided.
    bench = _scaled_steps(tmp_path / "b", torch.float32, data=True)
    target = _scaled_steps(tmp_path / "t", torch.float16, data=True, scale_forward_of_step=1)
    result = tracecmp.compare(target, bench)
    assert [s.step for s in result.skipped_steps] == [0, 1], result.summary()
    d = result.first_divergence
    assert d is not None and (d.op, d.phase, d.step, d.kind) == ("aten.mm.default", "forward", 1, "computation"), (
        result.summary()
    )
    assert [s.op_id for s in result.suspects] == [d.op_id], result.summary()
    assert "replay" in d.reason
    # with statistics alone the same fault follows what Python read, as before
    stats = tracecmp.compare(_scaled_steps(tmp_path / "ts", torch.float16, scale_forward_of_step=1), bench)
    assert stats.first_divergence is None, stats.summary()


@pytest.mark.parametrize("case", ["forward overflow", "nan"])
def test_what_no_scale_explains_stays_a_root(tmp_path: Path, case: str) -> None:
    if case == "forward overflow":
        # the forward matmul overflows float16 whatever the loss scale: the scaler skips the step
        # (and every later one), but that is the precision's range, found where it happens
        target = _scaled_steps(tmp_path / "t", torch.float16, scale=16.0, forward_scale=300.0)
        bench = _scaled_steps(tmp_path / "b", torch.float32, scale=16.0, forward_scale=300.0)
        where = ("aten.mm.default", "forward", 0)
    else:
        # a NaN made in the backward at a scale float16 holds: a fault, though the scaler skips the step
        target = _scaled_steps(tmp_path / "t", torch.float16, scale=16.0, nan_in_backward=True)
        bench = _scaled_steps(tmp_path / "b", torch.float32, scale=16.0)
        where = ("aten.mm.default", "backward", 0)
    result = tracecmp.compare(target, bench)
    d = result.first_divergence
    assert d is not None and (d.op, d.phase, d.step, d.kind) == (*where, "nan"), result.summary()
    assert not result.skipped_steps
