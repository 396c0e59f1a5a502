"""The noise model at the sizes where reduced precision first fooled it.

Each test is the smallest hand-built trace (``tests.tracebuild``) that still showed a false root
of a clean bf16 or mixed-precision run against fp32, and checks that a real fault at the same
place is still found.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import tracecmp
from tests.tracebuild import TraceBuilder

A = torch.ops.aten


def _noise_then_one_root(tmp_path: Path, build: Callable[..., Path], fault: dict[str, Any], **where: Any) -> None:
    """``build``'s bf16 run against its fp32 run is noise; with ``fault`` its one root has the
    Divergence fields ``where``."""
    bench = build(tmp_path / "b", torch.float32)
    result = tracecmp.compare(build(tmp_path / "t", torch.bfloat16), bench)
    assert result.first_divergence is None, result.summary()
    result = tracecmp.compare(build(tmp_path / "f", torch.bfloat16, **fault), bench)
    d = result.first_divergence
    assert d is not None and all(getattr(d, k) == v for k, v in where.items()), result.summary()
    assert len(result.suspects) == 1, result.summary()


def _masked_scores(path: Path, dtype: torch.dtype, fill: float | None = None) -> Path:
    """An additive attention mask filled with ``torch.finfo(dtype).min`` (``fill`` instead, when given)."""
    g = torch.Generator().manual_seed(0)
    b = TraceBuilder()
    scores = b.source("input.0", torch.randn(2, 4, 8, generator=g).to(dtype))
    keep = b.source("input.1", torch.rand(2, 1, 8, generator=g) > 0.3)
    value = torch.finfo(dtype).min if fill is None else fill
    masked_value = b.call(A.scalar_tensor.default, value, dtype=dtype, module="attn")
    masked = b.call(A.where.self, keep, scores, masked_value, module="attn")
    b.call(A.exp.default, masked, module="attn")  # 0 where masked, in any dtype
    return b.write(path)


def test_finfo_min_of_each_runs_dtype_is_the_same_argument(tmp_path: Path) -> None:
    result = tracecmp.compare(
        _masked_scores(tmp_path / "t", torch.bfloat16), _masked_scores(tmp_path / "b", torch.float32)
    )
    assert result.first_divergence is None, result.summary()
    # fp16's own minimum against fp32's is the same argument too
    result = tracecmp.compare(
        _masked_scores(tmp_path / "t16", torch.float16), _masked_scores(tmp_path / "b", torch.float32)
    )
    assert result.first_divergence is None, result.summary()


def test_a_changed_constant_is_still_an_argument_root(tmp_path: Path) -> None:
    # -1e4 (a hand-written "large negative") where the bench takes its dtype's minimum
    result = tracecmp.compare(
        _masked_scores(tmp_path / "t", torch.float32, fill=-1e4), _masked_scores(tmp_path / "b", torch.float32)
    )
    d = result.first_divergence
    assert d is not None and (d.op, d.kind) == ("aten.scalar_tensor.default", "argument")
    # another property of the same dtype is another argument: max is not min
    result = tracecmp.compare(
        _masked_scores(tmp_path / "t2", torch.bfloat16, fill=torch.finfo(torch.bfloat16).max),
        _masked_scores(tmp_path / "b", torch.float32),
    )
    d = result.first_divergence
    assert d is not None and d.kind == "argument" and "3.38953139e+38" in d.reason


def _residual_layer_norm(path: Path, low: torch.dtype, *, fault: str = "", rows: int = 32, features: int = 256) -> Path:
    """A mixed-precision residual block's first half: an fp32 residual stream with a few outlier
    features, plus a matmul computed in ``low`` (bf16 in the target, fp32 in the bench), then a
    layer norm in fp32, as autocast runs it. ``fault`` scales the output of "mm" or "ln" by 1.05."""
    g = torch.Generator().manual_seed(0)
    resid = torch.randn(rows, features, generator=g)
    resid[:, :3] *= 10.0  # outlier features, as GPT-style residual streams carry them
    a = torch.randn(rows, features, generator=g)
    w = torch.randn(features, features, generator=g) / features**0.5
    scale = {name: (lambda t: t * 1.05) for name in (fault,) if name}
    b = TraceBuilder()
    x = b.source("input.0", resid)
    h_in = b.source("input.1", a)
    weight = b.param("fc.weight", w, module="fc")
    h_low = b.call(A._to_copy.default, h_in, dtype=low, module="fc")
    w_low = b.call(A._to_copy.default, weight, dtype=low, module="fc")
    h = b.call(A.mm.default, h_low, b.call(A.t.default, w_low, module="fc"), module="fc", fault=scale.get("mm"))
    r = b.call(A.add.Tensor, x, h, module="block")
    ln_w = b.param("ln.weight", torch.ones(features), module="ln")
    ln_b = b.param("ln.bias", torch.zeros(features), module="ln")
    b.call(A.native_layer_norm.default, r, [features], ln_w, ln_b, 1e-5, module="ln", fault=scale.get("ln"))
    b.call(A.relu.default, x)  # an op whose inputs agree bitwise, and its output too
    return b.write(path)


def test_layer_norm_over_outlier_features_is_noise(tmp_path: Path) -> None:
    # The row means a layer norm returns are small against rows with outlier features: their
    # relative error is the input's mean error times rms(x) / rms(mean), not a root.
    bench = _residual_layer_norm(tmp_path / "b", torch.float32)
    result = tracecmp.compare(_residual_layer_norm(tmp_path / "t", torch.bfloat16), bench)
    assert result.first_divergence is None, result.summary()


def test_layer_norm_faults_are_found_over_outlier_features(tmp_path: Path) -> None:
    bench = _residual_layer_norm(tmp_path / "b", torch.float32)
    for site, op in (("mm", "aten.mm.default"), ("ln", "aten.native_layer_norm.default")):
        result = tracecmp.compare(_residual_layer_norm(tmp_path / site, torch.bfloat16, fault=site), bench)
        d = result.first_divergence
        assert d is not None and d.op == op, result.summary()
        # the layer norm after a faulty matmul inherits its error and is no root of its own
        assert [s.op for s in result.suspects] == [op], result.summary()


def _adam_denominator(path: Path, dtype: torch.dtype, *, fault: float = 1.0, size: int = 256) -> Path:
    """Adam's denominator in ``dtype``: sqrt(v) / sqrt(1 - beta2) + eps, then the update.

    sqrt(v) holds the same (bf16) numbers in both runs, so all the division's error is its own
    rounding: in bf16 by one constant, whose rounding errors do not average out."""
    g = torch.Generator().manual_seed(0)
    root_v = (torch.randn(size, size, generator=g).abs() * 1e-3).to(torch.bfloat16).to(dtype)
    b = TraceBuilder()
    param = b.param("fc.weight", (torch.randn(size, size, generator=g) * 0.02).to(dtype), module="fc")
    exp_avg = b.source("input.0", (torch.randn(size, size, generator=g) * 1e-4).to(torch.bfloat16).to(dtype))
    denom = b.source("input.1", root_v)
    denom = b.call(
        A.div.Tensor,
        denom,
        (1 - 0.999) ** 0.5,
        phase="optimizer",
        fault=(lambda t: t * fault) if fault != 1.0 else None,
    )
    denom = b.call(A.add_.Tensor, denom, 1e-8, phase="optimizer")
    b.call(A.addcdiv_.default, param, exp_avg, denom, value=-1e-3 / 0.1, phase="optimizer")
    return b.write(path)


def test_optimizer_division_in_bf16_is_noise(tmp_path: Path) -> None:
    _noise_then_one_root(tmp_path, _adam_denominator, {"fault": 1.05}, op="aten.div.Tensor", phase="optimizer")


def _eps_guarded_normalize(
    path: Path, dtype: torch.dtype, *, fault: str = "", eps: float | None = None, scale: float = 0.025
) -> Path:
    """x / (||x|| + finfo(dtype).eps) over rows of norm ~ 4 * ``scale``, in ``dtype`` (``eps``
    instead, when given). bfloat16's eps (0.0078) moves norms of 0.1 by 8%: far beyond rounding,
    yet the program's own choice, made alike in both runs. ``fault`` scales the output of "add" by 1.05."""
    g = torch.Generator().manual_seed(0)
    b = TraceBuilder()
    x = b.source("input.0", (torch.randn(64, 16, generator=g) * scale).to(dtype))
    norm = b.call(A.linalg_vector_norm.default, x, 2, [-1], True, module="norm")
    value = torch.finfo(dtype).eps if eps is None else eps
    denom = b.call(A.add.Tensor, norm, value, module="norm", fault=(lambda t: t * 1.05) if fault == "add" else None)
    b.call(A.div.Tensor, x, denom, module="norm")
    return b.write(path)


def test_finfo_eps_of_each_runs_dtype_moves_the_output_as_noise(tmp_path: Path) -> None:
    bench = _eps_guarded_normalize(tmp_path / "b", torch.float32)
    result = tracecmp.compare(_eps_guarded_normalize(tmp_path / "t", torch.bfloat16), bench)
    assert result.first_divergence is None, result.summary()
    # A 5% fault at the very op that adds the constant is still its root, and the only one, where
    # the constant's own effect is smaller than the fault (norms near 1: the epsilon moves them by
    # 1%). Statistics cannot tell a fault from the constant's effect where that is larger.
    bench = _eps_guarded_normalize(tmp_path / "b1", torch.float32, scale=0.2)
    result = tracecmp.compare(_eps_guarded_normalize(tmp_path / "f", torch.bfloat16, fault="add", scale=0.2), bench)
    assert [(s.op, s.kind) for s in result.suspects] == [("aten.add.Tensor", "computation")], result.summary()
    # a hand-written epsilon is an argument like any other
    result = tracecmp.compare(_eps_guarded_normalize(tmp_path / "e", torch.bfloat16, eps=1e-2, scale=0.2), bench)
    d = result.first_divergence
    assert d is not None and (d.op, d.kind) == ("aten.add.Tensor", "argument"), result.summary()


def _layer_norm_eps(path: Path, dtype: torch.dtype, *, eps: float | None = None) -> Path:
    """A layer norm whose epsilon is ``finfo(dtype).eps`` (``eps`` instead, when given), over rows
    of spread 0.1: bfloat16's eps (0.0078) is most of their variance."""
    g = torch.Generator().manual_seed(0)
    b = TraceBuilder()
    x = b.source("input.0", (torch.randn(32, 64, generator=g) * 0.1).to(dtype))
    w = b.param("ln.weight", torch.ones(64, dtype=dtype), module="ln")
    bias = b.param("ln.bias", torch.zeros(64, dtype=dtype), module="ln")
    value = torch.finfo(dtype).eps if eps is None else eps
    out, _, _ = b.call(A.native_layer_norm.default, x, [64], w, bias, value, module="ln")
    b.call(A.relu.default, out, module="act")
    return b.write(path)


def test_finfo_eps_as_a_layer_norms_epsilon_is_the_same_argument(tmp_path: Path) -> None:
    bench = _layer_norm_eps(tmp_path / "b", torch.float32)
    result = tracecmp.compare(_layer_norm_eps(tmp_path / "t", torch.bfloat16), bench)
    assert result.first_divergence is None, result.summary()
    result = tracecmp.compare(_layer_norm_eps(tmp_path / "e", torch.bfloat16, eps=1e-5), bench)
    d = result.first_divergence
    assert d is not None and (d.op, d.kind) == ("aten.native_layer_norm.default", "argument"), result.summary()


def _logged_loss(path: Path, dtype: torch.dtype, *, fault: bool = False) -> Path:
    """A loss computed in ``dtype`` and read out with ``.item()`` (``_local_scalar_dense``), as a
    training loop logs it; ``fault`` scales the loss by 1.05."""
    g = torch.Generator().manual_seed(0)
    b = TraceBuilder()
    x = b.source("input.0", torch.randn(64, 32, generator=g).to(dtype))
    h = b.call(A.tanh.default, x, module="head")
    loss = b.call(A.mean.default, h, module="loss", fault=(lambda t: t * 1.05) if fault else None)
    if dtype != torch.float32:
        # ``loss.float()`` for logging, where only the low-precision run needs a cast; one of
        # the two casts is never read (the loop kept the other)
        b.call(A._to_copy.default, loss, dtype=torch.float32)
        loss = b.call(A._to_copy.default, loss, dtype=torch.float32)
    b.call(A._local_scalar_dense.default, loss)
    return b.write(path)


def test_a_logged_loss_is_judged_as_the_loss_it_reads(tmp_path: Path) -> None:
    # Capture records no value for ``.item()``'s Python number; the number is the loss itself,
    # so a bf16 run's logged loss is noise where its loss is, and the verdict is complete.
    bench = _logged_loss(tmp_path / "b", torch.float32)
    result = tracecmp.compare(_logged_loss(tmp_path / "t", torch.bfloat16), bench)
    assert result.agrees, result.summary()
    assert set(result.nodes["status"]) <= {"agrees", "noise"}
    # a wrong loss is still the root, and what reads it inherits its divergence without a root of its own
    result = tracecmp.compare(_logged_loss(tmp_path / "f", torch.float32, fault=True), bench)
    d = result.first_divergence
    assert d is not None and d.op == "aten.mean.default"
    assert [s.op for s in result.suspects] == ["aten.mean.default"]
    readout = result.nodes[result.nodes["op"] == "aten._local_scalar_dense.default"]
    assert list(readout["status"]) == ["diverged"]


def _residual_chain(path: Path, low: torch.dtype, *, fault_at: int = -1, fault: float = 1e-3) -> Path:
    """A matmul computed in ``low`` (its rounding is the run's background noise) feeds a residual
    stream of elementwise ops, ``r = r + act(gain * r)``, ``act`` a sigmoid that mostly saturates
    or (every sixth block) a tanh. Saturation and the add of two full-size tensors make the class
    bound loose, so most calls sit far below it. ``fault_at`` scales that tanh's output by
    ``1 + fault``: a few times the error its input carries."""
    g = torch.Generator().manual_seed(0)
    b = TraceBuilder()
    x = b.source("input.0", torch.randn(64, 64, generator=g))
    w = b.param("fc.weight", torch.randn(64, 64, generator=g) / 8.0, module="fc")
    h = b.call(
        A.mm.default,
        b.call(A._to_copy.default, x, dtype=low, module="fc"),
        b.call(A._to_copy.default, w, dtype=low, module="fc"),
        module="fc",
    )
    r = b.call(A._to_copy.default, h, dtype=torch.float32, module="fc")
    for i, gain in enumerate((0.5, 4.0, 0.7, 6.0, 1.0, 8.0, 0.6, 5.0, 0.8, 3.0, 0.9, 7.0) * 2):
        tanh = i % 6 == 2  # too few tanh calls to judge each other
        t = b.call(
            A.tanh.default if tanh else A.sigmoid.default,
            b.call(A.mul.Scalar, r, 0.5 if tanh else gain, module=f"block{i}"),
            module=f"block{i}",
            fault=(lambda v: v * (1 + fault)) if i == fault_at else None,
        )
        r = b.call(A.add.Tensor, r, t, module=f"block{i}")
    return b.write(path)


def test_a_fault_stands_out_from_elementwise_ops_whose_bound_is_loose(tmp_path: Path) -> None:
    # Most calls of the class sit far below its bound, which says nothing about how far above it
    # a clean call goes (fitted to the whole spread, with the fault among the calls, the reach was
    # 15x): the fault at 3.5x its input's error is found, the clean chain is noise.
    _noise_then_one_root(tmp_path, _residual_chain, {"fault_at": 8}, op="aten.tanh.default", module="block8")


def _adam_then_layer_norm(path: Path, low: torch.dtype, *, fault: float = 1.0, size: int = 256) -> Path:
    """Adam's first update of a layer norm's weight (ones), then that layer norm in the next step.

    The gradient is rounded to ``low`` and a few of its elements are near 0, so the division by
    the denominator predicts an error far larger than the weight; Adam's first step moves every
    element by about +-lr whatever the gradient's size, and the target moves two elements the
    other way round (each takes the other's value). ``fault`` scales the next step's layer norm."""
    g = torch.Generator().manual_seed(0)
    grad_values = torch.randn(size, generator=g)
    grad_values[:8] *= 1e-9  # gradients near 0: denominators near eps
    rows = torch.randn(16, size, generator=g)
    # which two elements trade places: one the update raised, one it lowered
    up, down = int(torch.nonzero(grad_values[8:] < 0)[0]) + 8, int(torch.nonzero(grad_values[8:] > 0)[0]) + 8
    swap = (lambda t: t.index_copy(0, torch.tensor([up, down]), t[[down, up]])) if low != torch.float32 else None
    b = TraceBuilder()
    weight = b.param("ln.weight", torch.ones(size), module="ln")
    bias = b.param("ln.bias", torch.zeros(size), module="ln")
    grad = b.call(A._to_copy.default, b.source("input.0", grad_values), dtype=low, phase="backward")
    grad = b.call(A._to_copy.default, grad, dtype=torch.float32, phase="backward")
    exp_avg = b.call(A.mul.Scalar, grad, 0.1, phase="optimizer")
    exp_avg_sq = b.call(A.mul.Scalar, b.call(A.mul.Tensor, grad, grad, phase="optimizer"), 0.001, phase="optimizer")
    denom = b.call(
        A.add.Scalar,
        b.call(A.div.Scalar, b.call(A.sqrt.default, exp_avg_sq, phase="optimizer"), 0.001**0.5, phase="optimizer"),
        1e-8,
        phase="optimizer",
    )
    weight = b.call(A.addcdiv_.default, weight, exp_avg, denom, value=-1e-3 / 0.1, phase="optimizer", fault=swap)
    b.step()
    b.call(
        A.native_layer_norm.default,
        b.source("input.1", rows),
        [size],
        weight,
        bias,
        1e-5,
        module="ln",
        fault=(lambda t: t * fault) if fault != 1.0 else None,
    )
    return b.write(path)


def test_a_fault_after_adams_first_step_is_found(tmp_path: Path) -> None:
    # The weight's range (2 lr) bounds its error, not the division's prediction: the next step's
    # layer norm reads a weight off by +-lr here and there, and a 5% fault in it is a root.
    _noise_then_one_root(tmp_path, _adam_then_layer_norm, {"fault": 1.05}, op="aten.native_layer_norm.default", step=1)


def _adam_then_lookup(path: Path, low: torch.dtype, *, fault: float = 1.0, foreach: bool = False) -> Path:
    """AdamW's first step on a lookup table, with the ops torch.optim runs (single-tensor or
    ``foreach``), then a lookup of the rows the batch read, in the next step.

    Only the first 16 of 64 rows have gradients (some near 0, where eps decides the quotient);
    the rest hold the table's extremes and are divided by eps. The target's gradient is rounded
    to ``low``, and two elements take each other's update (+-lr the other way round), as a sign
    flipped by rounding does. ``fault`` scales the lookup."""
    g = torch.Generator().manual_seed(0)
    table_values = torch.randn(64, 16, generator=g) * 0.02
    table_values[32:] *= 4.0  # the extremes lie in rows the batch does not read
    grad_values = torch.zeros(64, 16)
    grad_values[:16] = torch.randn(16, 16, generator=g) * 1e-2
    grad_values[:2] *= 1e-7  # gradients near 0: eps decides the quotient there
    lr, beta1, beta2, eps = 1e-3, 0.9, 0.999, 1e-8
    positive = torch.nonzero(grad_values[4] > 0)[0, 0].item()
    negative = torch.nonzero(grad_values[4] < 0)[0, 0].item()

    def swap(t: torch.Tensor) -> torch.Tensor:  # two elements of row 4 trade their updates
        t = t.clone()
        t[4, positive], t[4, negative] = t[4, negative].item(), t[4, positive].item()
        return t

    b = TraceBuilder()
    table = b.param("wpe.weight", table_values, module="wpe")
    other = b.param("fc.weight", torch.randn(16, 16, generator=g) * 0.02, module="fc")
    grad = b.call(A._to_copy.default, b.source("input.0", grad_values), dtype=low, phase="backward")
    grad = b.call(A._to_copy.default, grad, dtype=torch.float32, phase="backward")
    other_grad = b.source("input.1", torch.randn(16, 16, generator=g) * 1e-2)
    opt = {"phase": "optimizer"}
    if foreach:
        params, grads = [table, other], [grad, other_grad]
        exp_avgs = [b.call(A.zeros_like.default, p, **opt) for p in params]
        exp_avg_sqs = [b.call(A.zeros_like.default, p, **opt) for p in params]
        params = b.call(A._foreach_mul.Scalar, params, 1 - lr * 1e-2, **opt)
        exp_avgs = b.call(A._foreach_lerp.Scalar, exp_avgs, grads, 1 - beta1, **opt)
        exp_avg_sqs = b.call(A._foreach_mul.Scalar, exp_avg_sqs, beta2, **opt)
        exp_avg_sqs = b.call(A._foreach_addcmul.Scalar, exp_avg_sqs, grads, grads, 1 - beta2, **opt)
        roots = b.call(A._foreach_sqrt.default, exp_avg_sqs, **opt)
        roots = b.call(A._foreach_div.ScalarList, roots, [(1 - beta2) ** 0.5] * 2, **opt)
        denoms = b.call(A._foreach_add.Scalar, roots, eps, **opt)
        table, _ = b.call(
            A._foreach_addcdiv.ScalarList,
            params,
            exp_avgs,
            denoms,
            [-lr / (1 - beta1)] * 2,
            **opt,
            fault=[swap if low != torch.float32 else None, None],
        )
    else:
        exp_avg = b.call(A.zeros_like.default, table, **opt)
        exp_avg_sq = b.call(A.zeros_like.default, table, **opt)
        table = b.call(A.mul_.Tensor, table, 1 - lr * 1e-2, **opt)
        exp_avg = b.call(A.lerp_.Scalar, exp_avg, grad, 1 - beta1, **opt)
        exp_avg_sq = b.call(A.mul_.Tensor, exp_avg_sq, beta2, **opt)
        exp_avg_sq = b.call(A.addcmul_.default, exp_avg_sq, grad, grad, value=1 - beta2, **opt)
        denom = b.call(A.div.Tensor, b.call(A.sqrt.default, exp_avg_sq, **opt), (1 - beta2) ** 0.5, **opt)
        denom = b.call(A.add_.Tensor, denom, eps, **opt)
        table = b.call(
            A.addcdiv_.default,
            table,
            exp_avg,
            denom,
            value=-lr / (1 - beta1),
            **opt,
            fault=swap if low != torch.float32 else None,
        )
    b.step()
    rows = b.source("input.2", torch.arange(16).repeat(4))
    b.call(A.embedding.default, table, rows, module="wpe", fault=(lambda t: t * fault) if fault != 1.0 else None)
    return b.write(path)


@pytest.mark.parametrize("foreach", [False, True])
def test_a_fault_in_a_lookup_after_adams_step_is_found(tmp_path: Path, foreach: bool) -> None:
    # Rows without gradients are divided by eps; the division's rule then predicts an error as
    # large as the table's range, which hid a 5% fault in GPT-2 small's positional lookup under
    # AMP. Adam's own arithmetic bounds the step at lr, wherever the moments are 0.
    _noise_then_one_root(
        tmp_path,
        functools.partial(_adam_then_lookup, foreach=foreach),
        {"fault": 1.05},
        op="aten.embedding.default",
        step=1,
    )


def _row_sum_of_a_product(path: Path, low: torch.dtype, *, fault: str = "") -> Path:
    """An RMSNorm backward's row sum of the incoming gradient times the normalized input, both
    rounded to ``low`` in the target, as Llama-8 in bf16 runs it.

    The product's largest element is one both factors hold exactly in bf16, while each factor's
    own largest element is rounded: the product's extremes then show far less error than its
    elements carry (Llama-8: 9e-5 against its factors' 6e-4 and 5e-4). The target's sum is off by
    1%, as sums over a bf16 chain's gradients are (0.1-2.6% in Llama-8's 34 calls). ``fault``
    scales "mul" or "sum" by 1.05."""
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(64, 512, generator=g) * 1e-3
    x = torch.randn(64, 512, generator=g)
    grad[0, 0], x[0, 0] = 2.0**-7, 3.5 * (1 + 2.0**-14)  # the product's largest, held exactly
    grad[1, 1], x[2, 2] = 0.0121, 5.31  # each factor's largest, rounded
    low_run = low != torch.float32
    scale = {name: (lambda t: t * 1.05) for name in (fault,) if name}
    b = TraceBuilder()
    g_low = b.call(A._to_copy.default, b.source("input.0", grad.to(low)), dtype=torch.float32, phase="backward")
    x_low = b.call(A._to_copy.default, b.source("input.1", x.to(low)), dtype=torch.float32, phase="backward")
    product = b.call(A.mul.Tensor, g_low, x_low, phase="backward", module="norm", fault=scale.get("mul"))
    stray = (lambda t: t * 1.01) if low_run else None
    fault_sum = scale.get("sum")
    b.call(
        A.sum.dim_IntList,
        product,
        [1],
        True,
        phase="backward",
        module="norm",
        fault=(lambda t: fault_sum(stray(t))) if fault_sum and stray else stray,
    )
    return b.write(path)


@pytest.mark.parametrize("site", ["mul", "sum"])
def test_a_row_sum_after_a_product_with_lucky_extremes_is_noise(tmp_path: Path, site: str) -> None:
    # The sum's prediction carries what the product passed on; its own extremes, a single lucky
    # sample, said 20x less than its factors' did, and the sum's 1% read as 5x its inputs' error.
    _noise_then_one_root(
        tmp_path,
        _row_sum_of_a_product,
        {"fault": site},
        op={"mul": "aten.mul.Tensor", "sum": "aten.sum.dim_IntList"}[site],
    )


def _layer_norm_backwards(
    path: Path, low: torch.dtype, *, fault_at: int = -1, fault: float = 1.05, stray: float = 0.04, calls: int = 12
) -> Path:
    """Layer norms and their backwards, each grad_output from a matmul in ``low``. A layer norm
    backward's outputs play different roles: its input gradient carries its inputs' errors
    closely, while its weight and bias gradients (sums over the rows) stray from their
    prediction call by call, as they do in BERT-base in bf16 (observed/predicted ratios up to
    1.5, against 0.14 for the input gradients). Here the target's weight and bias gradients are
    moved by up to ``stray`` (default 4%). ``fault_at`` scales that call's input gradient by ``fault``."""
    g = torch.Generator().manual_seed(0)
    b = TraceBuilder()
    n = 64
    for i in range(calls):
        ln = f"ln{i}"
        x = b.source(f"input.{i}", (torch.randn(32, n, generator=g) * (1 + i % 3) + 0.5 * (i % 4)).to(low))
        weight = b.param(f"{ln}.weight", (1 + 0.1 * torch.randn(n, generator=g)).to(low), module=ln)
        bias = b.param(f"{ln}.bias", (0.1 * torch.randn(n, generator=g)).to(low), module=ln)
        _, mean, rstd = b.call(A.native_layer_norm.default, x, [n], weight, bias, 1e-5, module=ln)
        head = b.param(f"head{i}.weight", (torch.randn(48, n, generator=g) / 7).to(low), module=f"head{i}")
        grad = b.call(
            A.mm.default,
            b.source(f"input.g{i}", torch.randn(32, 48, generator=g).to(low)),
            head,
            module=f"head{i}",
            phase="backward",
        )
        off = stray * (i % 6) / 5 if low != torch.float32 else 0.0
        b.call(
            A.native_layer_norm_backward.default,
            grad,
            x,
            [n],
            mean,
            rstd,
            weight,
            bias,
            [True, True, True],
            module=ln,
            phase="backward",
            fault=[
                (lambda t: t * fault) if i == fault_at else None,  # the input gradient
                lambda t, off=off: t * (1 + off),
                lambda t, off=off: t * (1 - off),
            ],
        )  # weight, bias
    return b.write(path)


def test_a_normalizations_input_gradient_is_judged_against_its_own_calls(tmp_path: Path) -> None:
    # Calibrated against every output of the op's calls, the weight and bias gradients' spread
    # hid a 5% fault in an input gradient (3x its prediction in BERT-base); each output is judged
    # against the same output of the other calls.
    _noise_then_one_root(
        tmp_path, _layer_norm_backwards, {"fault_at": 7}, op="aten.native_layer_norm_backward.default", module="ln7"
    )


def test_a_roots_metrics_are_those_of_the_output_that_decided(tmp_path: Path) -> None:
    # The bias gradients stray by up to 20% in every call, as noise of their own role; the root is
    # the input gradient's 5%, and its metrics must say so, not show the bias gradient's 20%.
    bench = _layer_norm_backwards(tmp_path / "b", torch.float32, stray=0.2)
    result = tracecmp.compare(_layer_norm_backwards(tmp_path / "f", torch.bfloat16, fault_at=5, stray=0.2), bench)
    (root,) = result.suspects
    assert root.module == "ln5" and "(norm/mean)" in root.reason, result.summary()
    assert 0.045 < root.metrics["rel_err_sys"] < 0.055 and f"{root.metrics['rel_err_sys']:.2e}" in root.reason


def _skipped_step(path: Path, *, skip: bool, overflow: bool = False, read: bool = True) -> Path:
    """A GradScaler's step in miniature: the check for Inf in a matmul's output is read into
    Python (``.item()``, unless ``read`` is false); ``skip`` skips the optimizer's update, and the
    next step's update runs with another bias correction (an argument) while the next matmul
    reads a weight that did not move. ``overflow``: the matmul makes Inf from finite inputs."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 16, generator=g)
    w0 = torch.randn(16, 16, generator=g)
    b = TraceBuilder()
    weight = b.param("fc.weight", w0.clone(), module="fc")  # the update writes into it
    h = b.call(
        A.mm.default,
        b.source("input.0", x),
        weight,
        module="fc",
        fault=(lambda t: t.index_fill(0, torch.tensor([0]), math.inf)) if overflow else None,
    )
    found = b.call(A.any.default, b.call(A.isinf.default, h))
    if read:
        b.call(A._local_scalar_dense.default, found)
    if not skip:
        update = b.call(A.mul.Scalar, weight, -1e-2, phase="optimizer")
        weight = b.call(A.add_.Tensor, weight, update, phase="optimizer")
    b.step()
    b.call(A.mm.default, b.source("input.1", x), weight, module="fc")
    b.call(A.div.Tensor, b.source("input.2", w0), 0.1 if skip else 0.19, phase="optimizer")
    return b.write(path)


def test_what_python_decided_from_a_root_is_inherited(tmp_path: Path) -> None:
    # The Inf reaches Python through .item(), the program skips its update: the next step's changed
    # argument and the matmul on the weight that did not move follow from the root, not roots.
    bench = _skipped_step(tmp_path / "b", skip=False)
    result = tracecmp.compare(_skipped_step(tmp_path / "t", skip=True, overflow=True), bench)
    assert [(s.op, s.kind, s.step) for s in result.suspects] == [("aten.mm.default", "nan", 0)], result.summary()
    inherited = result.nodes[result.nodes["reason"].str.startswith("follows op")]
    assert set(inherited["op"]) == {"aten.mm.default", "aten.div.Tensor"} and set(inherited["status"]) == {"diverged"}
    # With no root before it, a skipped update is the program's own doing: still named.
    result = tracecmp.compare(_skipped_step(tmp_path / "s", skip=True), bench)
    assert {(s.op, s.kind) for s in result.suspects} == {
        ("aten.mm.default", "structure"),
        ("aten.div.Tensor", "argument"),
    }
    # Nor does an Inf that never reaches Python speak for what the program did later.
    result = tracecmp.compare(_skipped_step(tmp_path / "u", skip=True, overflow=True, read=False), bench)
    assert any(s.op == "aten.div.Tensor" for s in result.suspects), result.summary()


def _centred_layer_norm_backward(
    path: Path, dtype: torch.dtype, *, fault: float = 1.0, rows: int = 64, features: int = 256
) -> Path:
    """A layer norm's forward and backward in ``dtype`` over rows centred on 0: the row means it
    saves are rounding noise, off by 100% of themselves between bf16 and fp32, yet a few units of
    x's spread. ``fault`` scales the input gradient the backward returns."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, features, generator=g)
    x = x - x.mean(dim=1, keepdim=True)
    b = TraceBuilder()
    inputs = b.source("input.0", x.to(dtype))
    weight = b.param("ln.weight", torch.ones(features, dtype=dtype), module="ln")
    bias = b.param("ln.bias", torch.zeros(features, dtype=dtype), module="ln")
    _, mean, rstd = b.call(A.native_layer_norm.default, inputs, [features], weight, bias, 1e-5, module="ln")
    grad = b.source("input.1", torch.randn(rows, features, generator=g).to(dtype))
    b.call(
        A.native_layer_norm_backward.default,
        grad,
        inputs,
        [features],
        mean,
        rstd,
        weight,
        bias,
        [True, True, True],
        module="ln",
        phase="backward",
        fault=(lambda t: t * fault) if fault != 1.0 else None,
    )
    return b.write(path)


def test_a_saved_mean_counts_by_its_error_against_the_spread(tmp_path: Path) -> None:
    # The backward subtracts the saved mean from x: its error moves x - mean by its absolute size
    # over x's spread, not by its size against a mean near 0. Taken relative, it predicted an error
    # in the backward that hid a 5% fault.
    _noise_then_one_root(
        tmp_path,
        _centred_layer_norm_backward,
        {"fault": 1.05},
        op="aten.native_layer_norm_backward.default",
        phase="backward",
    )


def _drift_then_fault(path: Path, low: torch.dtype, *, again: bool = True, fault: float = 1.0) -> Path:
    """Step 0 takes ``1 + x`` (x ~ 1e-3) to ``low`` and back and subtracts 1: rounding at 1.0 is as
    large as x, so ``low``'s result is another sample of x (its extremes 30-100% off) while its
    inputs explain it; that update moves a weight by 1e-3 of it. Step 1's matmul with the weight is
    scaled by ``fault``; ``again``: step 1 drifts the same way (after the matmul), as a chaotic
    network does on the parameters a drifted step moved."""
    g = torch.Generator().manual_seed(0)
    n = 256
    near_one = 1.0 + 1e-3 * torch.randn(n * n, generator=g)
    b = TraceBuilder()

    def drifting(name: str) -> Any:
        rounded = b.call(
            A._to_copy.default, b.call(A._to_copy.default, b.source(name, near_one), dtype=low), dtype=torch.float32
        )
        return b.call(A.add.Scalar, rounded, -1.0)

    weight = b.param("fc.weight", torch.randn(n, n, generator=g), module="fc")
    update = b.call(A.mul.Scalar, b.call(A.view.default, drifting("input.0"), [n, n]), 1e-3, phase="optimizer")
    weight = b.call(A.add_.Tensor, weight, update, phase="optimizer")
    b.step()
    x = b.source("input.1", torch.randn(64, n, generator=g))
    b.call(A.mm.default, x, weight, module="fc", fault=(lambda t: t * fault) if fault != 1.0 else None)
    if again:
        drifting("input.2")
    return b.write(path)


def test_roots_after_the_runs_drift_apart_are_left_undecided(tmp_path: Path) -> None:
    # ResNet-50 at random initialization, bf16 against fp32: the runs become other samples of the
    # same values, which statistics show only at their extremes; a later op whose inputs' extremes
    # happen to agree then looks like a root. A fault no larger than the drift cannot be told from it.
    bench = _drift_then_fault(tmp_path / "b", torch.float32)
    result = tracecmp.compare(_drift_then_fault(tmp_path / "t", torch.bfloat16), bench)
    # the clean pair agrees, and says from where statistics see only faults larger than the drift
    assert result.agrees and [d.undecided for d in result.drifts] == [()], result.summary()
    assert result.drifts[0].op == "aten.add.Scalar" and "Drift:" in result.summary()
    assert result.verdict().startswith(
        f"AGREE: no op diverges beyond rounding noise; from op {result.drifts[0].op_id} "
        "(aten.add.Scalar, step 0) the runs drifted apart by"
    ), result.verdict()
    from tracecmp.render.html import write_report

    assert "Drift: rank 0: the runs drifted apart" in write_report(result, tmp_path / "report").read_text()
    result = tracecmp.compare(_drift_then_fault(tmp_path / "t1", torch.bfloat16, fault=1.05), bench)
    assert result.first_divergence is None and not result.agrees, result.summary()
    assert result.verdict().startswith("INCOMPLETE") and "drifted apart from op" in " ".join(result.warnings)
    node = result.nodes.loc[result.nodes["op"] == "aten.mm.default"].iloc[0]
    assert result.drifts[0].undecided == (int(node["op_id"]),)
    assert node["status"] == "uncompared" and "drifted apart" in node["reason"], node
    # a fault beyond the drift stands out from it
    result = tracecmp.compare(_drift_then_fault(tmp_path / "t3", torch.bfloat16, fault=3.0), bench)
    assert result.first_divergence is not None and result.first_divergence.op == "aten.mm.default", result.summary()
    # a step that does not drift again reads its parameters' small error as it is: the fault is found
    bench = _drift_then_fault(tmp_path / "b2", torch.float32, again=False)
    result = tracecmp.compare(_drift_then_fault(tmp_path / "t2", torch.bfloat16, again=False, fault=1.05), bench)
    assert result.first_divergence is not None and result.first_divergence.op == "aten.mm.default", result.summary()
    assert not result.warnings, result.warnings


def _attention_backwards(path: Path, low: torch.dtype, *, fault_at: int = -1, calls: int = 6) -> Path:
    """Fused attention and its backward, query, key, value and the output's gradient rounded to
    ``low`` in the target, as GPT-2 small runs them in bf16: the gradients it makes are a
    thousand times smaller than the query, key and value they multiply. ``fault_at`` scales that
    call's query gradient by 1.05."""
    g = torch.Generator().manual_seed(0)
    b = TraceBuilder()
    for i in range(calls):
        attn = f"h{i}.attn"
        q, k, v = (b.source(f"input.{name}{i}", torch.randn(2, 4, 32, 16, generator=g).to(low)) for name in "qkv")
        out, lse = b.call(A._scaled_dot_product_flash_attention_for_cpu.default, q, k, v, module=attn)
        grad = b.source(f"input.g{i}", (torch.randn(2, 4, 32, 16, generator=g) * 1e-4).to(low))
        b.call(
            A._scaled_dot_product_flash_attention_for_cpu_backward.default,
            grad,
            q,
            k,
            v,
            out,
            lse,
            0.0,
            False,
            module=attn,
            phase="backward",
            fault=[(lambda t: t * 1.05) if i == fault_at else None, None, None],
        )
    return b.write(path)


@pytest.mark.skipif(
    not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"),
    reason="torch before 2.2 has no fused attention kernel on the CPU",
)
def test_a_fault_in_an_attention_backward_is_found(tmp_path: Path) -> None:
    # Its two largest inputs were taken as the operands and the others as added to its output, a
    # thousand times smaller than they are: a 5% fault in GPT-2 small's query gradient read as noise.
    _noise_then_one_root(
        tmp_path,
        _attention_backwards,
        {"fault_at": 3},
        op="aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
        module="h3.attn",
    )


def _padded_attention(path: Path, low: torch.dtype, *, fused: bool, fault: str = "", calls: int = 6) -> Path:
    """Attention over a padded batch: each run fills its additive mask with its own dtype's
    finfo.min (bf16's is 0.4% off float32's). Fused, the mask goes into the attention call; eager
    (as transformers' eager attention), it is added to the scores before the softmax. ``fault``
    names the op ("attention", "add", "_softmax") whose call 3 is off by 5% in its finite elements."""
    g = torch.Generator().manual_seed(0)
    b = TraceBuilder()

    def off(op: str, i: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return (lambda t: torch.where(t.abs() < 1e30, t * 1.05, t)) if (op, i) == (fault, 3) else None

    for i in range(calls):
        attn = f"h{i}.attn"
        q, k, v = (b.source(f"input.{name}{i}", (torch.randn(2, 4, 32, 16, generator=g) * 2).to(low)) for name in "qkv")
        keep = b.source(f"input.keep{i}", torch.rand(2, 1, 1, 32, generator=g) > 0.2)
        zeros = b.call(A.zeros.default, [2, 1, 1, 32], dtype=low, module=attn)
        padded = b.call(A.logical_not.default, keep, module=attn)
        mask = b.call(A.masked_fill.Scalar, zeros, padded, torch.finfo(low).min, module=attn)
        if fused:
            b.call(
                A._scaled_dot_product_flash_attention_for_cpu.default,
                q,
                k,
                v,
                attn_mask=mask,
                module=attn,
                fault=[off("attention", i), None],
            )
            continue
        kt = b.call(A.reshape.default, b.call(A.transpose.int, k, -1, -2, module=attn), [8, 16, 32], module=attn)
        scores = b.call(A.bmm.default, b.call(A.reshape.default, q, [8, 32, 16], module=attn), kt, module=attn)
        scores = b.call(A.mul.Tensor, b.call(A.view.default, scores, [2, 4, 32, 32], module=attn), 0.25, module=attn)
        scores = b.call(A.add.Tensor, scores, mask, module=attn, fault=off("add", i))
        weights = b.call(A._softmax.default, scores, -1, False, module=attn, fault=off("_softmax", i))
        b.call(
            A.bmm.default,
            b.call(A.reshape.default, weights, [8, 32, 32], module=attn),
            b.call(A.reshape.default, v, [8, 32, 16], module=attn),
            module=attn,
        )
    return b.write(path)


@pytest.mark.skipif(
    not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"),
    reason="torch before 2.2 has no fused attention kernel on the CPU",
)
def test_a_padding_mask_leaves_a_fault_in_fused_attention_visible(tmp_path: Path) -> None:
    # The mask's 0.4% at its fills, 1e36 in absolute terms, counted as added to the output: the
    # prediction covered any error, and a 5% fault in the attention read as noise.
    _noise_then_one_root(
        tmp_path,
        functools.partial(_padded_attention, fused=True),
        {"fault": "attention"},
        op="aten._scaled_dot_product_flash_attention_for_cpu.default",
        module="h3.attn",
    )


@pytest.mark.parametrize("op", ["add", "_softmax"])
def test_a_padding_mask_leaves_a_fault_in_eager_attention_visible(tmp_path: Path, op: str) -> None:
    # The softmax's input carries the fills: through exp its 1e36 covered any error. The masked
    # scores' own error hid at the fill's scale, 1e-38 of it.
    _noise_then_one_root(
        tmp_path,
        functools.partial(_padded_attention, fused=False),
        {"fault": op},
        op=f"aten.{op}.{'Tensor' if op == 'add' else 'default'}",
        module="h3.attn",
    )


def _spread_error(t: torch.Tensor, seed: int, spare_extremes: bool, at: tuple[int, int]) -> torch.Tensor:
    """``t`` with 0.5% error in every element (1% at ``at``), none at its extremes if ``spare_extremes``."""
    noise = 0.005 * torch.randn(t.shape, generator=torch.Generator().manual_seed(seed))
    if spare_extremes:
        noise.view(-1)[t.argmax()] = noise.view(-1)[t.argmin()] = 0.0
    noise[at] = 0.01
    return t * (1 + noise)


def _lucky_layer_norm_gradient(
    path: Path, low: torch.dtype, *, fault: str = "", calls: int = 8, lucky: int = 6, features: int = 256
) -> Path:
    """Layer norms in float32 over inputs rounded to ``low``, their backwards, and the residual
    branch's gradient added to each input gradient, as BERT-base runs them in AMP bf16.

    The input gradients carry 0.5% error in every element, which the layer norm's prediction
    covers, as the forward's rounding makes them in BERT-base (0.77% in RMS). In call ``lucky`` that
    error spares the gradient's two extremes, as it did there (0.005%): its statistics show next
    to nothing, while the sum's largest element, where neither input has its own, shows the rest.
    ``fault`` ("norm" or "add") scales that call's input gradient or sum by 1.05."""
    g = torch.Generator().manual_seed(0)
    b = TraceBuilder()
    at = (20, 30)
    for i in range(calls):
        ln, mlp = f"layers.{i}.ln", f"layers.{i}.mlp"
        x = b.source(f"input.x{i}", (torch.randn(64, features, generator=g) * (1 + i % 3)).to(low))
        x = b.call(A._to_copy.default, x, dtype=torch.float32, module=ln)
        weight = b.param(f"{ln}.weight", 1 + 0.1 * torch.randn(features, generator=g), module=ln)
        bias = b.param(f"{ln}.bias", 0.1 * torch.randn(features, generator=g), module=ln)
        _, mean, rstd = b.call(A.native_layer_norm.default, x, [features], weight, bias, 1e-5, module=ln)
        grad = torch.randn(64, features, generator=g) * 1e-3
        branch = torch.randn(64, features, generator=g) * 1e-3
        grad[at], branch[at] = 3e-3, 6e-3
        # The gradient's extremes, held exactly in bf16 in the lucky call only; none in the branch's.
        grad[3, 5], grad[9, 7] = 2.0**-7 * (1 + (i != lucky) * 0.7 * 2.0**-7), -(2.0**-7)
        branch[3, 5] = branch[9, 7] = 0.0
        grad = b.call(
            A._to_copy.default, b.source(f"input.g{i}", grad.to(low)), dtype=torch.float32, module=mlp, phase="backward"
        )
        spread = (
            None if low == torch.float32 else functools.partial(_spread_error, seed=i, spare_extremes=i == lucky, at=at)
        )
        if fault == "norm" and i == lucky:
            spread = (lambda t, f=spread: f(t) * 1.05) if spread else (lambda t: t * 1.05)
        grad_in = b.call(
            A.native_layer_norm_backward.default,
            grad,
            x,
            [features],
            mean,
            rstd,
            weight,
            bias,
            [True, True, True],
            module=ln,
            phase="backward",
            fault=[spread, None, None],
        )[0]
        b.call(
            A.add.Tensor,
            grad_in,
            b.source(f"input.b{i}", branch),
            module=mlp,
            phase="backward",
            fault=(lambda t: t * 1.05) if (fault, i) == ("add", lucky) else None,
        )
    return b.write(path)


@pytest.mark.parametrize("site", ["norm", "add"])
def test_an_input_gradient_with_lucky_extremes_passes_on_what_its_calls_typically_carry(
    tmp_path: Path, site: str
) -> None:
    # The layer norm's input gradient passed on twice its extremes' 0.01%, not the 0.5% its
    # elements carried; the sum after it read as 8x its inputs' error. Its other calls show what
    # their prediction typically comes to, and it passes on that much of its own.
    op, module = {
        "norm": ("aten.native_layer_norm_backward.default", "layers.6.ln"),
        "add": ("aten.add.Tensor", "layers.6.mlp"),
    }[site]
    _noise_then_one_root(tmp_path, _lucky_layer_norm_gradient, {"fault": site}, op=op, module=module)
