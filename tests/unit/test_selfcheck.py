"""The capture-time self-check recomputes sampled outputs in float64 and tells kernel faults from rounding."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tracecmp.capture.selfcheck import QUEUE_MAX, SEEN_BEFORE, SUMS_AT_16_BITS, Check, Recipe, SelfChecker, special_ops
from tracecmp.trace.args import scan

SPECIAL = special_ops()

aten = torch.ops.aten
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# What scaled-dot-product attention's math path calls for masked scores (torch 2.5 and later)
SAFE_SOFTMAX = getattr(getattr(aten, "_safe_softmax", None), "default", None)


def _run(
    func: Any, args: tuple, kwargs: dict | None = None, *, tamper: Callable | None = None, **opts: Any
) -> list[Check]:
    """prepare / op / finish as the recording mode does; ``tamper`` fakes a faulty kernel's output."""
    kwargs = kwargs or {}
    checker = SelfChecker(**opts)
    plan = checker.prepare(func, args, kwargs)
    assert plan is not None, func
    out = func(*args, **kwargs)
    checks = checker.finish(plan, tamper(out) if tamper else out)
    assert checks, func
    return checks


def _randn(
    gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, positive: bool = False
) -> torch.Tensor:
    t = torch.randn(*shape, generator=gen)
    return (t.abs() if positive else t).to(dtype)


def _cases(gen: torch.Generator, dtype: torch.dtype, positive: bool, k: int) -> list[tuple[str, Any, tuple, dict]]:
    """One call of each checked kind, with inputs of ``dtype`` and accumulation length ``k``."""
    r = lambda *s: _randn(gen, *s, dtype=dtype, positive=positive)
    a, b, a_t = r(24, k), r(k, 20), r(k, 24).t()  # a_t: a transposed (strided) operand
    y = torch.softmax(r(6, k).float(), 1).to(dtype)
    return [
        ("mm", aten.mm.default, (a, b), {}),
        ("mm strided", aten.mm.default, (a_t, b), {}),
        ("addmm", aten.addmm.default, (r(20), a, b), {"beta": 0.5, "alpha": 2.0}),
        ("bmm", aten.bmm.default, (r(3, 5, k), r(3, k, 4)), {}),
        ("baddbmm", aten.baddbmm.default, (r(1, 5, 1), r(3, 5, k), r(3, k, 4)), {}),
        ("mv", aten.mv.default, (a, r(k)), {}),
        ("addmv", aten.addmv.default, (r(24), a, r(k)), {}),
        ("dot", aten.dot.default, (r(k), r(k)), {}),
        ("sum rows", aten.sum.dim_IntList, (a, [1]), {}),
        ("sum strided", aten.sum.dim_IntList, (a_t, [1]), {}),
        ("sum of squares", aten.sum.dim_IntList, (a * a, [1]), {}),
        ("mean keepdim", aten.mean.dim, (r(4, k, 3), [1], True), {}),
        ("softmax", aten._softmax.default, (a, 1, False), {}),
        *([("safe_softmax", SAFE_SOFTMAX, (_masked_rows(a, 2), 1), {})] if SAFE_SOFTMAX is not None else []),
        ("log_softmax", aten._log_softmax.default, (a_t, 1, False), {}),
        ("softmax backward", aten._softmax_backward_data.default, (r(6, k), y, 1, dtype), {}),
        ("log_softmax backward", aten._log_softmax_backward_data.default, (r(6, k), y.log(), 1, dtype), {}),
        *_attention_cases(r, k),
        *(
            [("embedding backward", aten.embedding_dense_backward.default, _embedding_backward_args(gen, r, k), {})]
            if dtype == torch.float32  # 16-bit gradients are summed at their own precision: 5% may hide
            else []
        ),
        *(
            [
                ("layer_norm", aten.native_layer_norm.default, (a + 3, [k], r(k), r(k), 1e-5), {}),
                ("layer_norm backward", aten.native_layer_norm_backward.default, _layer_norm_backward_args(a, r), {}),
            ]
            if _layer_norm_runs(dtype)
            else []
        ),
        *_batch_norm_cases(r, k),
        *_nll_loss_cases(gen, r, k),
        *_max_pool_cases(dtype, positive, k),
    ]


def _masked_rows(x: torch.Tensor, every: int) -> torch.Tensor:
    """``x`` with every ``every``-th row masked whole (-inf): a padded query's attention scores."""
    x = x.clone()
    x[::every] = -math.inf
    return x


def _max_pool_cases(dtype: torch.dtype, positive: bool, k: int) -> list[tuple[str, Any, tuple, dict]]:
    """2-D max pooling of (2, 3, 5, k + 4) and its backward: ResNet's 3x3 stride 2 padding 1
    (overlapping windows), a dilated one and one of ceil_mode. From a generator of their own."""
    gen = torch.Generator().manual_seed(k)
    r = lambda *s: _randn(gen, *s, dtype=dtype, positive=positive)  # noqa: E731
    x = r(2, 3, 5, k + 4)
    cases = []
    for label, geometry in (
        ("", ([3, 3], [2, 2], [1, 1], [1, 1], False)),
        (" dilated", ([2, 2], [1, 1], [1, 1], [2, 2], False)),
        (" ceil_mode", ([2, 3], [2, 2], [0, 0], [1, 1], True)),
    ):
        try:
            out, indices = aten.max_pool2d_with_indices.default(x, *geometry)
        except RuntimeError:  # a dtype this torch's CPU pooling lacks
            return []
        cases += [
            (f"max_pool2d{label}", aten.max_pool2d_with_indices.default, (x, *geometry), {}),
            (
                f"max_pool2d backward{label}",
                aten.max_pool2d_with_indices_backward.default,
                (r(*out.shape), x, *geometry, indices),
                {},
            ),
        ]
    return cases


def _nll_loss_cases(gen: torch.Generator, r: Callable, k: int) -> list[tuple[str, Any, tuple, dict]]:
    """The loss of 6 rows of k classes, one row's target ignored, by each reduction, and its backward."""
    x = torch.log_softmax(r(6, k).float(), 1).to(r(1).dtype)
    target = torch.randint(k, (6,), generator=gen)
    target[2] = -100
    weight = r(k).abs() + 0.5
    cases = []
    for reduction, label in ((1, "mean"), (2, "sum"), (0, "none")):
        try:
            out, total = aten.nll_loss_forward.default(x, target, weight, reduction, -100)
        except RuntimeError:  # a dtype this torch's CPU loss lacks (float16 on 2.1)
            return []
        grad = r(*out.shape) if reduction == 0 else r(1).reshape(())
        cases += [
            (f"nll_loss {label}", aten.nll_loss_forward.default, (x, target, weight, reduction, -100), {}),
            (
                f"nll_loss backward {label}",
                aten.nll_loss_backward.default,
                (grad, x, target, weight, reduction, -100, total),
                {},
            ),
        ]
    return cases


def _embedding_backward_args(gen: torch.Generator, r: Callable, k: int) -> tuple:
    """``k`` tokens of a 12-row vocabulary, row 3 the padding row."""
    return (r(2, k, 6), torch.randint(0, 12, (2, k), generator=gen), 12, 3, False)


def _attention_cases(r: Callable, k: int) -> list[tuple[str, Any, tuple, dict]]:
    """Fused attention over ``k`` keys, where this torch has the CPU kernel (2.2 and later)."""
    packet = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if packet is None:
        return []
    flash = packet.default
    q, keys, values = r(2, 2, 6, 8) * 2, r(2, 2, k, 8) * 2, r(2, 2, k, 8)
    square = r(1, 2, k, 8) * 2
    return [
        ("attention", flash, (q, keys, values, 0.0, False), {}),
        ("attention causal", flash, (square, square * 0.5, r(1, 2, k, 8), 0.0, True), {}),
        ("attention masked", flash, (q, keys, values), {"attn_mask": r(6, k) * 3}),
    ]


def _layer_norm_runs(dtype: torch.dtype) -> bool:
    """Older torch has no float16 layer norm on the CPU."""
    try:
        aten.native_layer_norm.default(torch.ones(2, 3, dtype=dtype), [3], None, None, 1e-5)
    except RuntimeError:
        return False
    return True


def _layer_norm_backward_args(x: torch.Tensor, r: Callable) -> tuple:
    k = x.shape[-1]
    w, b = r(k), r(k)
    _, mean, rstd = aten.native_layer_norm.default(x + 3, [k], w, b, 1e-5)
    return (r(*x.shape), x + 3, [k], mean, rstd, w, b, [True, True, True])


def _pointwise_cases(gen: torch.Generator, dtype: torch.dtype) -> list[tuple[str, Any, tuple, dict]]:
    r = lambda *s: _randn(gen, *s, dtype=dtype)
    return [
        ("add alpha", aten.add.Tensor, (r(8, 16), r(16)), {"alpha": -0.3}),
        ("sub", aten.sub.Tensor, (r(8, 16).t(), r(16, 1)), {}),
        ("mul_ in place", aten.mul_.Tensor, (r(8, 16), 2.5), {}),
        ("div", aten.div.Tensor, (r(8, 16), r(8, 16)), {}),
        ("addcmul", aten.addcmul.default, (r(8, 16), r(8, 16), r(16)), {"value": 0.7}),
        ("lerp", aten.lerp.Scalar, (r(8, 16), r(8, 16), 0.3), {}),
        ("exp", aten.exp.default, (r(8, 16),), {}),
        ("gelu", aten.gelu.default, (r(8, 16) * 3,), {}),
        ("gelu tanh", aten.gelu.default, (r(8, 16) * 3,), {"approximate": "tanh"}),
        ("silu", aten.silu.default, (r(8, 16),), {}),
        ("tanh", aten.tanh.default, (r(8, 16),), {}),
        ("sigmoid", aten.sigmoid.default, (r(8, 16),), {}),
        ("rsqrt", aten.rsqrt.default, (r(8, 16).abs(),), {}),
        ("pow", aten.pow.Tensor_Scalar, (r(8, 16), 3), {}),
        ("where", aten.where.self, (r(8, 16) > 0, r(8, 16), r(1)), {}),
    ]


def _batch_norm_cases(r: Callable, k: int) -> list[tuple[str, Any, tuple, dict]]:
    """Batch norm over (3, 5 channels, k), in training and evaluation, and its backward."""
    x, w, b, grad = r(3, 5, k), r(5), r(5), r(3, 5, k)
    mean, var = torch.zeros(5, dtype=x.dtype), torch.ones(5, dtype=x.dtype)
    try:
        _, saved_mean, saved_invstd = aten.native_batch_norm.default(x, w, b, None, None, True, 0.1, 1e-5)
    except RuntimeError:  # a dtype this torch's CPU batch norm lacks
        return []
    return [
        ("batch_norm", aten.native_batch_norm.default, (x, w, b, mean.clone(), var.clone(), True, 0.1, 1e-5), {}),
        ("batch_norm eval", aten.native_batch_norm.default, (x, w, b, mean + 0.1, var * 2, False, 0.1, 1e-5), {}),
        (
            "batch_norm backward",
            aten.native_batch_norm_backward.default,
            (grad, x, w, None, None, saved_mean, saved_invstd, True, 1e-5, [True, True, True]),
            {},
        ),
        (
            "batch_norm backward eval",
            aten.native_batch_norm_backward.default,
            (grad, x, w, mean + 0.1, var * 2, None, None, False, 1e-5, [True, True, False]),
            {},
        ),
    ]


def _conv_cases(gen: torch.Generator, dtype: torch.dtype) -> list[tuple[str, Any, tuple, dict]]:
    r = lambda *s: _randn(gen, *s, dtype=dtype)
    transposed = (r(2, 4, 6, 6), r(4, 3, 3, 3), r(3), [2, 2], [1, 1], [1, 1], True, [1, 1], 1)
    return [
        *([("conv transposed", aten.convolution.default, transposed, {})] if dtype == torch.float32 else []),
        (
            "conv2d",
            aten.convolution.default,
            (r(2, 8, 10, 10), r(6, 8, 3, 3), r(6), [1, 1], [1, 1], [1, 1], False, [0, 0], 1),
            {},
        ),
        ("conv1d grouped", aten.convolution.default, (r(2, 8, 30), r(8, 4, 5), None, [2], [2], [1], False, [0], 2), {}),
        ("conv2d backward grouped", aten.convolution_backward.default, _conv_backward_args(r, 2), {}),
        ("conv2d backward", aten.convolution_backward.default, _conv_backward_args(r, 1), {}),
    ]


def _conv_backward_args(r: Callable, groups: int) -> tuple:
    x, w = r(2, 8, 10, 10), r(6, 8 // groups, 3, 3)
    grad = r(2, 6, 10, 10)
    return (grad, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], groups, [True, True, False])


def _all_cases(
    gen: torch.Generator, dtype: torch.dtype, k: int, positive: bool = False
) -> list[tuple[str, Any, tuple, dict]]:
    return _runnable([*_cases(gen, dtype, positive, k), *_pointwise_cases(gen, dtype), *_conv_cases(gen, dtype)])


def _runnable(cases: list[tuple[str, Any, tuple, dict]]) -> list[tuple[str, Any, tuple, dict]]:
    """The cases this torch can run on the CPU and tags as the module expects (older torch has
    no float16 addmm there, and no pointwise tag on silu)."""
    kept = []
    for case in cases:
        _, func, args, kwargs = case
        if func not in SPECIAL and torch.Tag.pointwise not in func.tags:
            continue
        try:
            func(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args], **kwargs)
        except RuntimeError:
            continue
        kept.append(case)
    return kept


def _bigger(out: Any, factor: float) -> Any:
    return tuple(t * factor if t is not None else t for t in out) if isinstance(out, tuple) else out * factor


@pytest.mark.parametrize("dtype", DTYPES)
def test_sampled_residual_agrees_with_a_full_float64_replay(dtype: torch.dtype) -> None:
    # A sample's largest residual never exceeds the full replay's; both are within the bound.
    gen = torch.Generator().manual_seed(0)
    for name, func, args, kwargs in _all_cases(gen, dtype, 33):
        full = _run(func, args, kwargs, full=True)
        sampled = _run(func, args, kwargs, sample=4, seed=3)
        for s, f in zip(sampled, full):
            # A sampled convolution recomputes elements from their taps; a full one whole batch
            # elements (input and output) or output channels (weight gradient).
            conv = name.startswith("conv") and s.how == "matmul" and f.how in ("batch", "rows")
            assert s.index == f.index and (s.how == f.how or conv), name
            assert f.sampled >= s.sampled or conv, name
            if name.startswith(("conv2d backward", "batch_norm", "max_pool2d backward")) and dtype != torch.float32:
                # A scale fitted through a sample is no largest element: a sample's fit may
                # exceed the whole's, and both stay within the bound.
                assert max(s.residual, f.residual) <= f.limit, (name, s, f)
                continue
            assert s.residual <= f.residual + 1e-12 and f.residual <= f.limit, (name, s, f)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("positive", [False, True])
def test_honest_kernels_stay_within_the_limit(dtype: torch.dtype, positive: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    for k in (1, 7, 130, 4096) if dtype == torch.float32 else (1, 64, 1024):
        for seed in range(2):
            for name, func, args, kwargs in _runnable(_cases(gen, dtype, positive, k)):
                for check in _run(func, args, kwargs, seed=seed):
                    assert 0 <= check.residual <= check.limit, (name, k, check)
    for name, func, args, kwargs in _runnable([*_pointwise_cases(gen, dtype), *_conv_cases(gen, dtype)]):
        for check in _run(func, args, kwargs, sample=64):
            assert 0 <= check.residual <= check.limit, (name, check)


@pytest.mark.parametrize("threads", [1, 3])
def test_honest_within_limit_at_any_thread_count(threads: int) -> None:
    gen, before = torch.Generator().manual_seed(2), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for dtype in DTYPES:
            big = _randn(gen, 3, 20000, dtype=dtype)
            for func, args in [
                (aten.sum.default, (big,)),
                (aten.sum.dim_IntList, (big, [1])),
                (aten.mean.default, (big.abs(),)),
            ]:
                for check in _run(func, args):
                    assert check.residual <= check.limit, (func, dtype, check)
    finally:
        torch.set_num_threads(before)


def test_copies_are_exact_and_casts_round_once() -> None:
    x = torch.randn(9, 7).t()
    assert _run(aten.clone.default, (x,))[0][1:5] == (0.0, 0.0, 16, "exact")
    (cast,) = _run(aten._to_copy.default, (x,), {"dtype": torch.bfloat16})
    assert cast.limit == 0.5 and 0 < cast.residual <= 0.5
    (copied,) = _run(aten.copy_.default, (torch.zeros(4, 5), torch.randn(5)))
    assert copied.residual == 0.0
    (embedded,) = _run(aten.embedding.default, (torch.randn(10, 8), torch.tensor([[1, 2], [3, 9]])))
    assert embedded.residual == 0.0
    (wrong,) = _run(aten.clone.default, (x,), tamper=lambda o: o + 1e-6)
    assert wrong.residual > wrong.limit


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_scaled_output_exceeds_the_limit(dtype: torch.dtype) -> None:
    factor = 1 + (1e-3 if dtype == torch.float32 else 0.05)
    gen = torch.Generator().manual_seed(4)
    for positive in (False, True):
        for k in (7, 130, 4096) if dtype == torch.float32 else (7, 512):
            for name, func, args, kwargs in _all_cases(gen, dtype, k, positive):
                check = _run(func, args, kwargs, tamper=lambda o: _bigger(o, factor))[0]
                if SUMS_AT_16_BITS and dtype != torch.float32 and check.how != "pointwise":
                    continue  # older torch's 16-bit sums earn their own precision: 5% may hide there
                assert check.residual > check.limit, (name, k, positive, check)


@pytest.mark.parametrize("rounded_to", [torch.float16, torch.bfloat16])
def test_float32_inputs_silently_rounded_exceed_the_limit(rounded_to: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    for k in (7, 130, 4096):
        for name, func, args, kwargs in _all_cases(gen, torch.float32, k):
            if name in ("where", "softmax backward", "log_softmax backward", "dot"):
                # a select; a probability row rounded still sums to about 1; one dot product of
                # 4096 random terms may by chance be too small for the signal to show
                continue
            rounded = tuple(
                a.to(rounded_to).float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args
            )
            faulty = func(*rounded, **kwargs)
            check = _run(func, args, kwargs, tamper=lambda _, faulty=faulty: faulty)[0]
            assert check.residual > check.limit, (name, k, check)


def test_relative_noise_exceeds_the_limit() -> None:
    gen = torch.Generator().manual_seed(6)
    noisy = lambda o: (
        _bigger(o, 1) if not isinstance(o, torch.Tensor) else o * (1 + 1e-3 * torch.randn(o.shape, generator=gen))
    )
    for name, func, args, kwargs in _all_cases(gen, torch.float32, 512):
        # ops of several outputs (layer norm, its backward, attention): noise in the first
        check = _run(func, args, kwargs, tamper=lambda o: (noisy(o[0]), *o[1:]) if isinstance(o, tuple) else noisy(o))
        assert check[0].residual > check[0].limit, (name, check)


def test_non_finite_outputs() -> None:
    x = torch.tensor([1.0, -1.0, 0.0, float("nan"), float("inf")])
    (honest,) = _run(aten.div.Tensor, (x, torch.zeros(5)))  # inf, -inf, nan, nan, inf: as float64
    assert honest.residual == 0.0
    # From NaN/Inf kernels may make anything (fp32 gelu(inf) is NaN): such elements are unjudged.
    (unjudged,) = _run(aten.exp.default, (x,), tamper=lambda o: torch.where(o.isnan(), o, o.nan_to_num(posinf=1.0)))
    assert unjudged.residual <= unjudged.limit
    (faulty,) = _run(aten.exp.default, (x[:3],), tamper=lambda o: torch.where(o == 1.0, math.inf, o))
    assert faulty.residual == math.inf
    (overflow,) = _run(aten.mul.Tensor, (torch.full((4,), 60000.0, dtype=torch.float16), 2.0))
    assert overflow.residual == 0.0  # inf is what rounding to float16 gives


def test_reduced_precision_declared_widens_float32_matmuls() -> None:
    gen = torch.Generator().manual_seed(7)
    a, b = _randn(gen, 16, 256), _randn(gen, 256, 16)
    tf32 = (a.to(torch.bfloat16).float() @ b.to(torch.bfloat16).float(),)  # what bf16 matrix units compute
    (strict,) = _run(aten.mm.default, (a, b), tamper=lambda _: tf32[0])
    (declared,) = _run(aten.mm.default, (a, b), tamper=lambda _: tf32[0], reduced_precision="bf16")
    assert strict.residual > strict.limit and declared.residual <= declared.limit
    with pytest.raises(ValueError):
        SelfChecker(reduced_precision="fp8")


def test_transparent_to_the_program() -> None:
    gen = torch.Generator().manual_seed(8)
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    x = _randn(gen, 32, 32).requires_grad_()
    cases = [*_all_cases(gen, torch.float32, 32), ("add_", aten.add_.Tensor, (_randn(gen, 32, 32), x.detach()), {})]
    for name, func, args, kwargs in cases:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if func._schema.arguments[0].alias_info is not None:  # in place: the op itself writes self
            tensors = tensors[1:]
        if name == "batch_norm":  # training: the op itself updates its running statistics
            tensors = tensors[:3]
        versions, values = [t._version for t in tensors], [t.clone() for t in tensors]
        checker = SelfChecker()
        plan = checker.prepare(func, args, kwargs)
        assert plan is not None, name
        checker.finish(plan, func(*args, **kwargs))
        assert [t._version for t in tensors] == versions, name
        assert all(torch.equal(t, v) for t, v in zip(tensors, values)), name
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.is_grad_enabled()
    plan = SelfChecker().prepare(aten.mul.Tensor, (x, 2.0), {})
    (check,) = SelfChecker().finish(plan, x * 2.0)
    assert isinstance(check.residual, float) and x.grad is None


def test_in_place_ops_are_checked_against_the_values_before_the_write() -> None:
    x = torch.randn(6, 6)
    checker = SelfChecker(full=True)
    plan = checker.prepare(aten.mul_.Tensor, (x, 3.0), {})
    (check,) = checker.finish(plan, x.mul_(3.0))
    assert check.residual <= 0.5 and check.sampled == 36  # one rounding of the product


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("by_frequency", [False, True])
def test_a_16_bit_embedding_gradient_is_held_to_sums_at_its_own_precision(
    dtype: torch.dtype, by_frequency: bool
) -> None:
    gen = torch.Generator().manual_seed(2)
    for tokens in (64, 4096):
        grad = torch.randn(tokens, 32, generator=gen).to(dtype)
        indices = torch.randint(0, 20, (tokens,), generator=gen)
        for check in _run(aten.embedding_dense_backward.default, (grad, indices, 20, -1, by_frequency), sample=64):
            assert 0 <= check.residual <= check.limit, (tokens, check)
        rounded = _run(
            aten.embedding_dense_backward.default, (grad, indices, 20, -1, by_frequency), tamper=lambda o: o * 1.5
        )
        assert rounded[0].residual > rounded[0].limit


@pytest.mark.parametrize("name", ["_fused_adam_", "_fused_adamw_"])
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fused_adam_step_is_checked_per_parameter_and_moment(name: str, amsgrad: bool, dtype: torch.dtype) -> None:
    """Each parameter's new value, first and second moment, from the values before the step; a
    parameter written 5% (bf16) or 1e-3 (float32) off is far outside."""
    op = getattr(aten, name, None)
    if op is None or tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 4):
        pytest.skip("no fused Adam on the CPU before torch 2.4")
    gen = torch.Generator().manual_seed(0)

    def step(tamper: float) -> list[Check]:
        params = [_randn(gen, 300, dtype=dtype), _randn(gen, 7, 5, dtype=dtype)]
        grads = [_randn(gen, *p.shape, dtype=dtype) for p in params]
        avgs = [_randn(gen, *p.shape, dtype=dtype) * 0.1 for p in params]
        squares = [_randn(gen, *p.shape, dtype=dtype, positive=True) * 0.01 for p in params]
        highest = [v * 1.5 for v in squares] if amsgrad else []
        steps = [torch.tensor(3.0), torch.tensor(3.0)]
        args = (params, grads, avgs, squares, highest, steps)
        kwargs = dict(lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8, amsgrad=amsgrad, maximize=False)
        checker = SelfChecker(sample=64)
        plan = checker.prepare(op.default, args, kwargs)
        assert plan is not None
        op.default(*args, **kwargs)
        params[0].mul_(tamper)
        return checker.finish(plan, None)

    honest = step(1.0)
    assert len(honest) == 6 and all(c.residual <= c.limit for c in honest), honest
    faulty = step(1.05 if dtype == torch.bfloat16 else 1.001)
    assert faulty[0].index == 0 and faulty[0].residual > faulty[0].limit
    assert all(c.residual <= c.limit for c in faulty[1:])


def test_fused_attention_with_dropout_or_unequal_causal_lengths_is_left_unchecked() -> None:
    packet = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if packet is None:
        pytest.skip("this torch has no CPU flash attention")
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8)
    checker = SelfChecker()
    assert checker.prepare(packet.default, (q, k, k, 0.1), {}) is None  # its dropout draws
    assert checker.prepare(packet.default, (q, k, k, 0.0, True), {}) is None  # kernels align it differently
    assert checker.prepare(packet.default, (q, k, k, 0.0, False), {}) is not None


def test_uncheckable_ops_give_no_plan() -> None:
    checker, x = SelfChecker(), torch.randn(4, 4)
    meta = torch.empty(4, 4, device="meta")
    for func, args, kwargs in [
        (aten.bernoulli.default, (x.abs().clamp(max=1),), {}),  # random
        (aten.nonzero.default, (x,), {}),  # not modelled
        (aten.add.Tensor, (torch.ones(3, dtype=torch.int64), 1), {}),  # integer
        (aten.mul.Tensor, (torch.randn(3, dtype=torch.complex64), 2), {}),  # complex
        (aten.add.Tensor, (torch.empty(0), 1.0), {}),  # empty
        (aten.add.Tensor, (meta, meta), {}),  # no data
        (aten.mm.default, (x.to_sparse(), x), {}),  # sparse
        (aten.add.out, (x, x), {"out": torch.empty(4, 4)}),  # writes out=
        (aten.remainder.Tensor, (x, x), {}),  # discontinuous in a rounded quotient
        (aten.div.Tensor_mode, (x, x), {"rounding_mode": "floor"}),
        (
            aten.convolution.default,
            (x[None, None].half(), x[None, None].half(), None, [1, 1], [0, 0], [1, 1], True, [0, 0], 1),
            {},
        ),
    ]:
        assert checker.prepare(func, args, kwargs) is None, func
    plan = checker.prepare(aten.lt.Tensor, (x, x), {})
    assert plan is not None and checker.finish(plan, x < x) == []
    assert checker.prepare(aten.lt.Tensor, (x, x), {}) is None  # learned: its output is never floating


@pytest.mark.parametrize("rounding", ["to nearest even", "toward zero"])
def test_a_declared_tf32_matmul_is_held_to_float32_under_the_rounding_that_reproduces_it(rounding: str) -> None:
    # A device feeding TF32 units: operands rounded, products summed in float32. Under its
    # rounding model the call has only float32's freedom, so a fault 100x inside TF32's whole
    # allowance still fails; against that allowance alone (coarse) it passes.
    from tracecmp.aten.rounding import REDUCED_MODELS

    rounded = dict(REDUCED_MODELS["tf32"])[rounding]
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(32, 256, generator=gen), torch.randn(256, 24, generator=gen)
    device = lambda x, y: rounded(x) @ rounded(y)  # noqa: E731
    for conv in (False, True):
        if conv:
            x, w = torch.randn(2, 4, 9, 9, generator=gen), torch.randn(6, 4, 3, 3, generator=gen)
            func, args = aten.convolution.default, (x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
            out = torch.convolution(rounded(x), rounded(w), None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
        else:
            func, args, out = aten.mm.default, (a, b), device(a, b)
        for fault, fails in ((0.0, False), (1e-5, True)):
            (check,) = _run(
                func, args, tamper=lambda o, f=fault, v=out: v * (1 + f), reduced_precision="tf32", sample=64
            )
            assert (check.residual > check.limit) == fails, (conv, fault, check)
            assert check.coarse <= check.limit, (conv, fault, check)
    # Without the declaration a TF32 call is itself a fault of float32.
    (check,) = _run(aten.mm.default, (a, b), tamper=lambda o: device(a, b))
    assert check.residual > check.limit


def test_foreach_ops_are_checked_per_tensor_of_their_lists() -> None:
    # What optimizers run on accelerators (foreach Adam): each list position is its own output,
    # in-place ones read back from the list they wrote.
    gen = torch.Generator().manual_seed(11)
    xs = [torch.rand(5, 3, generator=gen) + 0.1 for _ in range(3)]
    ys = [torch.randn(5, 3, generator=gen) for _ in range(3)]
    copies = lambda: [x.clone() for x in xs]  # noqa: E731
    cases = [
        (aten._foreach_mul_.Scalar, lambda: (copies(), 0.9), {}),
        (aten._foreach_addcmul_.Scalar, lambda: (copies(), ys, ys), {"value": 0.001}),
        (aten._foreach_addcdiv_.ScalarList, lambda: (copies(), ys, xs, [0.1, 0.2, 0.3]), {}),
        (aten._foreach_lerp_.Scalar, lambda: (copies(), ys, 0.1), {}),
        (aten._foreach_add_.List, lambda: (copies(), ys), {"alpha": -0.1}),
        (aten._foreach_sqrt.default, lambda: (xs,), {}),
    ]
    for func, make, kwargs in cases:
        for fault in (False, True):
            args = make()
            checker = SelfChecker()
            plan = checker.prepare(func, args, kwargs)
            assert plan is not None, func
            out = func(*args, **kwargs)
            if fault:  # the kernel went wrong on the second tensor only
                (out[1] if out is not None else args[0][1]).mul_(1.001)
            checks = checker.finish(plan, out)
            assert [c.index for c in checks] == [0, 1, 2], func
            assert [c.residual > c.limit for c in checks] == [False, fault, False], (func, checks)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_convolution_gradient_scaled_by_5_percent_is_found_by_its_fitted_scale(dtype: torch.dtype) -> None:
    # Summed at 16 bits with cancellation, each element's allowance covers 5%; the sample as a
    # whole fits the scale. Both gradients (input and weight) are checked, honest ones pass.
    gen = torch.Generator().manual_seed(11)
    x = _randn(gen, 4, 32, 12, 12, dtype=dtype)
    w = (torch.randn(48, 32, 3, 3, generator=gen) / math.sqrt(32 * 9)).to(dtype)
    grad = _randn(gen, 4, 48, 12, 12, dtype=dtype)
    args = (grad, x, w, [48], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, True])
    if not _runnable([("conv backward", aten.convolution_backward.default, args, {})]):
        pytest.skip(f"this torch has no {dtype} convolution backward on the CPU")
    honest = _run(aten.convolution_backward.default, args)
    assert [(c.index, c.how) for c in honest] == [(0, "matmul"), (1, "matmul")]
    assert all(c.residual <= c.limit for c in honest), honest
    for which in (0, 1):
        scaled = lambda out, which=which: tuple(t * 1.05 if i == which else t for i, t in enumerate(out))
        checks = _run(aten.convolution_backward.default, args, tamper=scaled)
        assert [c.residual > c.limit for c in checks] == [which == 0, which == 1], checks
    # Without the input gradient the weight gradient is the op's first tensor output.
    (only_weight,) = _run(aten.convolution_backward.default, (*args[:-1], [False, True, False]))
    assert only_weight.index == 0 and only_weight.how == "matmul"


def test_a_fitted_scale_below_one_unit_of_the_output_is_no_fault() -> None:
    # A kernel rounding toward zero carries a coherent bias of under one unit of its output's
    # precision: the fit sees it, and lets it pass; the same fit of a 5% scale fails.
    gen = torch.Generator().manual_seed(12)
    x = _randn(gen, 4, 16, 10, 10, dtype=torch.bfloat16)
    w = (torch.randn(24, 16, 3, 3, generator=gen) / 12).to(torch.bfloat16)
    grad = _randn(gen, 4, 24, 10, 10, dtype=torch.bfloat16)
    args = (grad, x, w, [24], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, False, False])
    eps = torch.finfo(torch.bfloat16).eps

    def scaled(factor: float) -> Callable:
        return lambda out: (torch.ops.aten.mul.Tensor(out[0].double(), factor).to(out[0].dtype), *out[1:])

    (biased,) = _run(aten.convolution_backward.default, args, tamper=scaled(1 - eps / 2), sample=64)
    assert biased.residual <= biased.limit, biased
    (faulty,) = _run(aten.convolution_backward.default, args, tamper=scaled(1.05), sample=64)
    assert faulty.residual > faulty.limit, faulty


@pytest.mark.parametrize(
    "shape, kernel, stride, padding, dilation, groups",
    [
        ((2, 6, 9), (3,), [2], [1], [1], 1),
        ((2, 4, 11, 10), (3, 2), [2, 1], [1, 0], [1, 2], 2),
        ((1, 4, 7, 6), (1, 1), [2, 2], [0, 0], [1, 1], 1),
        ((2, 2, 5, 6, 5), (3, 3, 2), [1, 2, 2], [1, 1, 0], [2, 1, 1], 1),
    ],
)
def test_sampled_convolution_elements_are_the_float64_convolutions_own(
    shape: tuple, kernel: tuple, stride: list, padding: list, dilation: list, groups: int
) -> None:
    # Each sampled element's recomputation from its taps equals the whole float64 convolution's
    # (and its gradients') element at that place, for strides, padding, dilation and groups.
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    w = torch.randn(6, shape[1] // groups, *kernel, generator=gen, dtype=torch.float64)
    bias = torch.randn(6, generator=gen, dtype=torch.float64)
    geometry = (stride, padding, dilation, False, [0] * len(kernel), groups)
    out = aten.convolution.default(x, w, bias, *geometry)
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    calls = [
        (aten.convolution.default, (x, w, bias, *geometry), (out,)),
        (
            aten.convolution_backward.default,
            (grad, x, w, [6], *geometry, [True, True, False]),
            aten.convolution_backward.default(grad, x, w, [6], *geometry, [True, True, False])[:2],
        ),
    ]
    for func, args, outputs in calls:
        plan = SelfChecker(sample=64, seed=1).prepare(func, args, {})
        assert plan is not None and len(plan.targets) == len(outputs)
        for target, whole in zip(plan.targets, outputs):
            value, scale = target.recompute()[:2]
            torch.testing.assert_close(value, target.gather(whole), rtol=1e-12, atol=1e-12)
            assert bool((scale >= value.abs() - 1e-12).all())


def _scatter_cases(gen: torch.Generator, dtype: torch.dtype) -> list[tuple[str, Any, tuple, dict]]:
    """Ops that only place values: a reshape's copy, a gradient written into zeros at an index or slice."""
    r = lambda *s: _randn(gen, *s, dtype=dtype)
    return [
        ("_unsafe_view", aten._unsafe_view.default, (r(4, 6, 5), [24, 5]), {}),
        ("select_backward", aten.select_backward.default, (r(4, 5), [4, 3, 5], 1, -1), {}),
        ("slice_backward", aten.slice_backward.default, (r(4, 3, 5), [4, 9, 5], 1, 1, 8, 3), {}),
        ("slice_backward open", aten.slice_backward.default, (r(2, 4), [6, 4], 0, -2, 2**62, 1), {}),
        # A cache's first concatenation, onto an empty tensor: the empty input moves nothing.
        ("cat onto an empty tensor", aten.cat.default, ([torch.empty(0, dtype=dtype), r(4, 2, 3)], -2), {}),
        (
            "cat of three along a middle dimension",
            aten.cat.default,
            ([r(4, 2, 3), r(4, 5, 3).mT.mT, r(4, 1, 3)], 1),
            {},
        ),
        ("tril", aten.tril.default, (r(5, 6), -1), {}),
        ("triu", aten.triu.default, (r(2, 5, 6), 1), {}),
    ]


@pytest.mark.parametrize("dtype", DTYPES)
def test_deferred_checks_of_calls_alike_equal_each_calls_own(dtype: torch.dtype) -> None:
    # Three calls alike of each case, honest and 5% faulty ones mixed: recomputed together at
    # resolve, each call's residuals are those its own immediate check finds.
    gen = torch.Generator().manual_seed(1)
    cases = [case for _ in range(3) for case in _all_cases(gen, dtype, 33) + _scatter_cases(gen, dtype)]
    immediate, deferred = SelfChecker(sample=4, seed=5), SelfChecker(sample=4, seed=5)
    expected: list[tuple[str, Check]] = []
    pending: list[Check] = []
    for i, (name, func, args, kwargs) in enumerate(cases):
        plans = immediate.prepare(func, args, kwargs), deferred.prepare(func, args, kwargs)
        assert plans[0] is not None and plans[1] is not None, name
        out = func(*args, **kwargs)
        out = _bigger(out, 1.05) if i % 2 else out
        expected += [(name, check) for check in immediate.finish(plans[0], out)]
        pending += deferred.finish(plans[1], out, defer=True)
        for a in args:  # the program writes its inputs (an optimizer its parameters) before the hand-over
            if isinstance(a, torch.Tensor) and a.is_floating_point():
                a.mul_(0.5)
    assert any(check.ticket is not None for check in pending)
    residuals, coarses = deferred.collect()
    assert len(pending) == len(expected)
    for (name, own), check in zip(expected, pending):
        late = check.ticket is not None
        residual, coarse = (residuals[check.ticket], coarses[check.ticket]) if late else (check.residual, check.coarse)
        assert (check.index, check.limit, check.sampled, check.how) == (own.index, own.limit, own.sampled, own.how)
        assert residual == pytest.approx(own.residual, rel=1e-9, abs=1e-12), name
        assert coarse == pytest.approx(own.coarse, rel=1e-9, abs=1e-12), name


@pytest.mark.parametrize("dtype", DTYPES)
def test_placed_values_are_exact_and_a_changed_one_is_found(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    for name, func, args, kwargs in _scatter_cases(gen, dtype):
        (honest,) = _run(func, args, kwargs, sample=64)
        assert honest.how == "exact" and honest.residual == 0.0 <= honest.limit, name
        (faulty,) = _run(func, args, kwargs, sample=64, tamper=lambda out: out + (out != 0) * 2.0**-6)
        assert faulty.residual > faulty.limit, name


def test_deferred_checks_beyond_the_queue_limit_are_all_collected() -> None:
    # The queue is recomputed when full, before anyone collects: every ticket still gets its values.
    checker = SelfChecker(sample=4)
    x = torch.randn(64)
    tickets = []
    for i in range(QUEUE_MAX + 10):
        plan = checker.prepare(aten.mul.Tensor, (x, 2.0), {})
        assert plan is not None
        out = x * 2.0 if i % 3 else x * 2.5  # every third call a faulty kernel
        (check,) = checker.finish(plan, out, defer=True)
        tickets.append(check.ticket)
    residuals, _ = checker.collect()
    assert tickets == list(range(QUEUE_MAX + 10)) and len(residuals) == len(tickets)
    assert [r > 1e3 for r in residuals] == [i % 3 == 0 for i in range(len(tickets))]
    plan = checker.prepare(aten.mul.Tensor, (x, 2.0), {})
    assert plan is not None and checker.finish(plan, x * 2.0, defer=True)[0].ticket == 0  # tickets start again


def test_a_float32_weight_gradient_summed_over_a_large_batch_is_checked_by_one_element() -> None:
    # 8 x 112 x 112 terms an element: the gather budget reads one sampled element, and a 5%
    # scale of the gradient lies far beyond its limit in that one alone.
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(8, 3, 112, 112, generator=gen), torch.randn(8, 3, 3, 3, generator=gen)
    grad = torch.randn(8, 8, 112, 112, generator=gen)
    args = (grad, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [False, True, False])
    (honest,) = _run(aten.convolution_backward.default, args)
    assert honest.sampled == 1 and honest.residual <= honest.limit
    (scaled,) = _run(aten.convolution_backward.default, args, tamper=lambda out: _bigger(out, 1.05))
    assert scaled.residual > 10 * scaled.limit


def _signed(checker: SelfChecker, func: Any, args: tuple, kwargs: dict) -> tuple[tuple, list[float], list]:
    """A call's signature, floats and tensors, from its memo key as the capture mode makes it."""
    tensors: list[torch.Tensor] = []
    signed = checker.signature(func, scan(args, kwargs, tensors), tensors)
    assert signed is not None, func
    return (*signed, tensors)


FLASH_CPU = getattr(getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None), "default", None)


def _hiding_mask(length: int, seed: int) -> torch.Tensor:
    """An additive attention mask: 0 where a query sees a key, -inf where about a third are hidden."""
    hidden = torch.rand(length, length, generator=torch.Generator().manual_seed(seed)) > 0.7
    return torch.zeros(length, length).masked_fill(hidden, -math.inf)


def _attention_call(gen: torch.Generator, dtype: torch.dtype) -> tuple:
    """Queries, keys and values of 2 batches, 3 heads, 7 positions, 8 wide (the query transposed in memory)."""
    q = _randn(gen, 2, 7, 3, 8, dtype=dtype).transpose(1, 2)
    return q, _randn(gen, 2, 3, 7, 8, dtype=dtype), _randn(gen, 2, 3, 7, 8, dtype=dtype)


def _nll_call(gen: torch.Generator, reduction: int, weighted: bool) -> tuple:
    """``nll_loss_forward``'s arguments: log-probabilities of 37 rows of 10 classes (transposed
    in memory), targets with a few ignored (-100), class weights or None."""
    x = torch.log_softmax(_randn(gen, 10, 37), 0).t()
    target = torch.randint(0, 10, (37,), generator=gen)
    target[::9] = -100
    return x, target, (_randn(gen, 10).abs() + 0.5) if weighted else None, reduction, -100


def _nll_backward_call(gen: torch.Generator, reduction: int) -> tuple:
    x, target, weight, _, ignore = _nll_call(gen, reduction, weighted=True)
    _, total = aten.nll_loss_forward.default(x, target, weight, reduction, ignore)
    grad = _randn(gen, 37) if reduction == 0 else _randn(gen, 1)[0]
    return grad, x, target, weight, reduction, ignore, total


def _learned(func: Any, args: tuple, kwargs: dict | None = None, **opts: Any) -> SelfChecker:
    """A checker that has seen two calls of ``func`` (checked the usual way) and made its recipe."""
    kwargs = kwargs or {}
    checker = SelfChecker(**opts)
    assert checker.prepare(func, args, kwargs) is not None
    for _ in range(2):
        checker.learn(_signed(checker, func, args, kwargs)[0], func, args, kwargs, func(*args, **kwargs))
    return checker


RECIPE_CALLS = {
    "broadcast add": (aten.add.Tensor, lambda g: (_randn(g, 8, 6), _randn(g, 6)), {"alpha": 0.5}),
    "bf16 gelu": (aten.gelu.default, lambda g: (_randn(g, 5, 7, dtype=torch.bfloat16),), {}),
    "fp16 mul by a 0-d float": (aten.mul.Tensor, lambda g: (_randn(g, 40, dtype=torch.float16), torch.tensor(3.0)), {}),
    "strided sigmoid": (aten.sigmoid.default, lambda g: (_randn(g, 9, 4).t(),), {}),
    "where on a mask": (aten.where.self, lambda g: (_randn(g, 20) > 0, _randn(g, 20), _randn(g, 1)), {}),
    "a 0-d step counter": (aten.add_.Tensor, lambda g: (torch.tensor(3.0), torch.tensor(1)), {}),
    "clone": (aten.clone.default, lambda g: (_randn(g, 6, 6).t(),), {}),
    "reshaping copy": (aten._unsafe_view.default, lambda g: (_randn(g, 4, 6), [3, 8]), {}),
    "broadcast copy_": (aten.copy_.default, lambda g: (torch.empty(5, 4), _randn(g, 4)), {}),
    "cast to bf16": (aten._to_copy.default, lambda g: (_randn(g, 30),), {"dtype": torch.bfloat16}),
    # A constant: the same value everywhere (backward's seed), exactly or rounded once
    "ones_like": (aten.ones_like.default, lambda g: (_randn(g, 3, 5),), {}),
    "a bf16 full_like": (aten.full_like.default, lambda g: (_randn(g, 40, dtype=torch.bfloat16), 0.1), {}),
    "mm": (aten.mm.default, lambda g: (_randn(g, 9, 33), _randn(g, 33, 7)), {}),
    "mm of a transposed operand": (aten.mm.default, lambda g: (_randn(g, 33, 9).t(), _randn(g, 33, 12)), {}),
    "a narrow mm": (aten.mm.default, lambda g: (_randn(g, 2, 5), _randn(g, 5, 3)), {}),
    "bmm of a transposed operand": (aten.bmm.default, lambda g: (_randn(g, 3, 9, 33), _randn(g, 3, 12, 33).mT), {}),
    "a bf16 bmm": (
        aten.bmm.default,
        lambda g: (_randn(g, 5, 7, 20, dtype=torch.bfloat16), _randn(g, 5, 20, 3, dtype=torch.bfloat16)),
        {},
    ),
    # Fused attention: a block of query rows of one batch and head, with that head's keys and
    # values (torch 2.2 on; fp16 masked: in bf16 a 5% scale may hide in the allowance of rows whose
    # terms cancel)
    **(
        {
            "attention": (FLASH_CPU, lambda g: _attention_call(g, torch.float32), {}),
            "causal attention": (FLASH_CPU, lambda g: _attention_call(g, torch.float32), {"is_causal": True}),
            "attention under a mask of -inf where it hides": (
                FLASH_CPU,
                lambda g: _attention_call(g, torch.float32),
                {"attn_mask": _hiding_mask(7, 3)},
            ),
            "fp16 attention under an additive mask, scaled": (
                FLASH_CPU,
                lambda g: _attention_call(g, torch.float16),
                {"attn_mask": torch.randn(2, 1, 7, 7, generator=torch.Generator().manual_seed(4)).half(), "scale": 0.2},
            ),
        }
        if FLASH_CPU is not None
        else {}
    ),
    # A loss from every row's input at its target (and its total weight); its backward at rows' targets
    "nll_loss, mean": (aten.nll_loss_forward.default, lambda g: _nll_call(g, 1, weighted=False), {}),
    "nll_loss with class weights and ignored rows, sum": (
        aten.nll_loss_forward.default,
        lambda g: _nll_call(g, 2, weighted=True),
        {},
    ),
    "nll_loss per row": (aten.nll_loss_forward.default, lambda g: _nll_call(g, 0, weighted=True), {}),
    "nll_loss backward, mean": (aten.nll_loss_backward.default, lambda g: _nll_backward_call(g, 1), {}),
    "nll_loss backward per row": (aten.nll_loss_backward.default, lambda g: _nll_backward_call(g, 0), {}),
    # Rows: a block of adjacent ones, read whole, the output at them or along them
    "a bias gradient's sum": (aten.sum.dim_IntList, lambda g: (_randn(g, 4, 7, 24), [0, 1]), {}),
    "mean over a middle dimension": (aten.mean.dim, lambda g: (_randn(g, 5, 9, 6).transpose(0, 2), [1], True), {}),
    "a sum of everything": (aten.sum.default, lambda g: (_randn(g, 40, 3, positive=True),), {}),
    "a bf16 sum of rows": (aten.sum.dim_IntList, lambda g: (_randn(g, 40, 3, dtype=torch.bfloat16), [0]), {}),
    "softmax": (aten._softmax.default, lambda g: (_randn(g, 20, 6, 9), 1, False), {}),
    **(
        {"safe softmax": (SAFE_SOFTMAX, lambda g: (_masked_rows(_randn(g, 20, 9), 3), -1), {})}
        if SAFE_SOFTMAX is not None
        else {}
    ),
    "log_softmax of a transposed input": (aten._log_softmax.default, lambda g: (_randn(g, 9, 20).t(), 1, False), {}),
    "softmax backward": (
        aten._softmax_backward_data.default,
        lambda g: (_randn(g, 20, 9), torch.softmax(_randn(g, 20, 9), -1), -1, torch.float32),
        {},
    ),
    # A gradient placed into zeros: the sampled positions that hold it read it, the others 0
    "select_backward": (aten.select_backward.default, lambda g: (_randn(g, 6, 5), [6, 4, 5], 1, -3), {}),
    "slice_backward of a strided gradient": (
        aten.slice_backward.default,
        lambda g: (_randn(g, 3, 6, 4).transpose(0, 2), [4, 20, 3], 1, 2, 19, 3),
        {},
    ),
    # Rows of the input, the weight and bias whole; the output along the rows (mean and 1/std: below)
    "layer_norm": (
        aten.native_layer_norm.default,
        lambda g: (_randn(g, 6, 5, 9) * 2 + 1, [9], _randn(g, 9), _randn(g, 9), 1e-5),
        {},
    ),
    "layer_norm over two dimensions, no affine": (
        aten.native_layer_norm.default,
        lambda g: (_randn(g, 6, 5, 9).to(torch.bfloat16), [5, 9], None, None, 1e-6),
        {},
    ),
    # Its input gradient from rows of the gradient and input, the saved statistics, the weight whole
    "layer_norm backward": (aten.native_layer_norm_backward.default, lambda g: _layer_norm_backward_call(g, 1), {}),
    "layer_norm backward over two dimensions, no weight": (
        aten.native_layer_norm_backward.default,
        lambda g: _layer_norm_backward_call(g, 2),
        {},
    ),
    # Convolutions: sampled elements with the terms each sums (padding reads nothing); a
    # backward's input gradient here, its weight gradient in a recipe of its own (below)
    "a strided, padded, dilated, grouped convolution": (
        aten.convolution.default,
        lambda g: (
            _randn(g, 2, 4, 9, 8),
            _randn(g, 6, 2, 3, 3),
            _randn(g, 6),
            [2, 1],
            [1, 2],
            [1, 2],
            False,
            [0, 0],
            2,
        ),
        {},
    ),
    "a bf16 1-d convolution": (
        aten.convolution.default,
        lambda g: (
            _randn(g, 3, 4, 20, dtype=torch.bfloat16),
            _randn(g, 5, 4, 3, dtype=torch.bfloat16),
            None,
            [1],
            [1],
            [1],
            False,
            [0],
            1,
        ),
        {},
    ),  # fmt: skip
    "convolution backward": (aten.convolution_backward.default, lambda g: _convolution_backward_call(g), {}),
    # Batch norms: adjacent channels whole (the output along them), per-channel tensors at them
    "batch norm in training": (aten.native_batch_norm.default, lambda g: _batch_norm_call(g, True), {}),
    "batch norm in evaluation": (aten.native_batch_norm.default, lambda g: _batch_norm_call(g, False), {}),
    "batch norm backward": (aten.native_batch_norm_backward.default, lambda g: _batch_norm_backward_call(g, True), {}),
    "batch norm backward in evaluation": (
        aten.native_batch_norm_backward.default,
        lambda g: _batch_norm_backward_call(g, False),
        {},
    ),
}


def _convolution_backward_call(gen: torch.Generator, dtype: torch.dtype = torch.float32) -> tuple:
    """A strided, padded, dilated, grouped convolution's backward: both gradients wanted."""
    x, w = _randn(gen, 2, 4, 9, 8, dtype=dtype), _randn(gen, 6, 2, 3, 3, dtype=dtype)
    geometry = ([2, 1], [1, 2], [1, 2], False, [0, 0], 2)
    grad = _randn(gen, *aten.convolution.default(x, w, None, *geometry).shape, dtype=dtype)
    return (grad, x, w, None, *geometry, [True, True, False])


def _batch_norm_call(gen: torch.Generator, training: bool) -> tuple:
    x = _randn(gen, 4, 6, 5, 7) * 2 + 1
    return (x, _randn(gen, 6), _randn(gen, 6), _randn(gen, 6), _randn(gen, 6, positive=True) + 0.5, training, 0.1, 1e-5)


def _batch_norm_backward_call(gen: torch.Generator, training: bool) -> tuple:
    """A batch norm's backward, its saved statistics from the forward; all three gradients wanted."""
    x, weight = _randn(gen, 4, 6, 5, 7) * 2 + 1, _randn(gen, 6)
    running = (_randn(gen, 6), _randn(gen, 6, positive=True) + 0.5)
    _, mean, rstd = aten.native_batch_norm.default(x, weight, None, *(t.clone() for t in running), True, 0.1, 1e-5)
    return (_randn(gen, *x.shape), x, weight, *running, mean, rstd, training, 1e-5, [True, True, True])


def _layer_norm_backward_call(gen: torch.Generator, normalized: int) -> tuple:
    """A layer norm's backward over the last ``normalized`` dimensions of (6, 5, 9), its mean and
    1/std from the forward; a weight and bias where one dimension is normalized."""
    x = _randn(gen, 6, 5, 9) * 2 + 1
    shape = list(x.shape[3 - normalized :])
    weight, bias = (_randn(gen, *shape), _randn(gen, *shape)) if normalized == 1 else (None, None)
    _, mean, rstd = aten.native_layer_norm.default(x, shape, weight, bias, 1e-5)
    return (_randn(gen, *x.shape), x, shape, mean, rstd, weight, bias, [True, weight is not None, bias is not None])


@pytest.mark.parametrize("name", RECIPE_CALLS)
def test_calls_through_a_recipe_pass_honest_and_fail_a_five_percent_scale(name: str) -> None:
    """The per-op path's gathering (its reference here) judges a call as the usual path does:
    honest calls within the limit, a 5% scaled output far outside it."""
    func, make, kwargs = RECIPE_CALLS[name]
    if SUMS_AT_16_BITS and name in (
        "a bf16 sum of rows",
        "layer_norm over two dimensions, no affine",
        "a bf16 1-d convolution",
        "a bf16 bmm",
    ):
        pytest.skip("this torch sums 16-bit rows at 16 bits: a 5% scale may hide in their allowance")
    gen = torch.Generator().manual_seed(0)
    checker = _learned(func, make(gen), kwargs)
    tickets = []
    for scale in (1.0, 1.05):
        for _ in range(3):
            args = make(gen)
            signature, floats, tensors = _signed(checker, func, args, kwargs)
            recipe = checker.recipes[signature]
            assert recipe is not None, name
            gathered = checker.gather_sampled(recipe, tensors, floats)
            assert gathered is not None
            out = func(*args, **kwargs)
            if scale != 1.0 and isinstance(out, tuple):  # the checked output: the first
                out = (out[0] * scale, *out[1:])
            elif scale != 1.0 and func in (aten.select_backward.default, aten.slice_backward.default):
                out = out * scale + 1.0  # every element moved: 1.05 * 0 would hide where nothing was placed
            elif scale != 1.0:
                out = out.mul_(scale) if out.is_floating_point() else out
                if func is aten.where.self:
                    out += 1.0  # every element moved: 1.05 * 0 would hide where the mask picked 0
            tickets.append((scale, checker.finish_sampled(recipe, *gathered, out)))
    residuals, _ = checker.collect()
    limit = checker.recipes[next(iter(checker.recipes))].limit  # type: ignore[union-attr]
    for scale, ticket in tickets:
        assert ticket is not None
        assert (residuals[ticket] <= limit) == (scale == 1.0), (name, scale, residuals[ticket], limit)


def _layer_norm_through_its_recipe(seed: int) -> tuple[SelfChecker, Recipe, tuple, tuple]:
    """A checker with a layer norm's recipe, one more call's gathered sample, and its outputs."""
    func, make, kwargs = RECIPE_CALLS["layer_norm"]
    gen = torch.Generator().manual_seed(seed)
    checker = _learned(func, make(gen), kwargs)
    args = make(gen)
    signature, floats, tensors = _signed(checker, func, args, kwargs)
    recipe = checker.recipes[signature]
    assert isinstance(recipe, Recipe) and len(recipe.extras) == 2
    gathered = checker.gather_sampled(recipe, tensors, floats)
    assert gathered is not None
    return checker, recipe, gathered, func(*args, **kwargs)


@pytest.mark.parametrize("faulty", [None, 1, 2])
def test_a_layer_norms_mean_and_rstd_are_checked_with_its_output(faulty: int | None) -> None:
    """A layer norm's recipe checks its three outputs of each call, each with a ticket of its own
    (the call's first, then one each): a 5% scaled mean or 1/std fails alone."""
    checker, recipe, gathered, outputs = _layer_norm_through_its_recipe(3)
    out = list(outputs)
    if faulty is not None:
        out[faulty] = out[faulty] * 1.05
    ticket = checker.finish_sampled(recipe, *gathered, tuple(out))
    assert ticket is not None
    residuals, _ = checker.collect()
    limits = [recipe.limit] + [extra[3] for extra in recipe.extras]
    failed = [residuals[ticket + j] > limits[j] for j in range(3)]
    assert failed == [j == faulty for j in range(3)], (residuals, limits)


@pytest.mark.parametrize(
    ("name", "outputs", "dtype"),
    [
        ("convolution backward", 2, torch.float32),
        ("convolution backward", 2, torch.bfloat16),
        # float32 only: 16-bit batch norms hold their statistics at 16 bits (a 5% scaled mean hides)
        ("batch norm in training", 3, torch.float32),
        ("batch norm backward", 3, torch.float32),
        ("nll_loss with class weights and ignored rows, sum", 2, torch.float32),
    ],
)
def test_each_output_a_call_checks_through_its_recipes_fails_alone(name: str, outputs: int, dtype: torch.dtype) -> None:
    """A convolution backward's two gradients (a recipe each: the second in ``more``), a batch
    norm's output, saved mean and 1/std, its backward's three gradients, a loss and its total
    weight (extras): each checked
    with a ticket of its own, an honest call within every limit and a 5% scaled output failing alone."""
    func, make, kwargs = RECIPE_CALLS[name]
    if dtype != torch.float32:
        make = lambda g: _convolution_backward_call(g, dtype)  # noqa: E731
    gen = torch.Generator().manual_seed(5)
    checker = _learned(func, make(gen), kwargs)
    cases = []
    for faulty in (None, *range(outputs)):
        args = make(gen)
        signature, floats, tensors = _signed(checker, func, args, kwargs)
        recipe = checker.recipes[signature]
        assert isinstance(recipe, Recipe)
        pieces = checker.gather_call(recipe, tensors, floats)
        assert pieces is not None and len(pieces) == 1 + len(recipe.more)
        out = list(func(*args, **kwargs))
        if faulty is not None:
            out[faulty] = out[faulty] * 1.05
        for piece, index, values in pieces:
            ticket = checker.finish_sampled(piece, index, values, tuple(out))
            assert ticket is not None
            limits = [piece.limit] + [extra[3] for extra in piece.extras]
            outs = [max(piece.out_index, 0)] + [extra[0] for extra in piece.extras]
            cases += [(faulty, o, ticket + j, limits[j]) for j, o in enumerate(outs)]
    assert sorted({o for _, o, _, _ in cases}) == list(range(outputs))
    residuals, _ = checker.collect()
    for faulty, output, ticket, limit in cases:
        assert (residuals[ticket] > limit) == (faulty == output), (faulty, output, residuals[ticket], limit)


def test_a_layer_norm_whose_saved_statistics_cannot_be_read_is_left_unchecked() -> None:
    """Every output a recipe reads, or none: a call whose mean is not what the recipe expects
    queues nothing."""
    checker, recipe, gathered, (out, mean, rstd) = _layer_norm_through_its_recipe(4)
    assert checker.finish_sampled(recipe, *gathered, (out, mean.double(), rstd)) is None
    assert checker.collect() == ([], [])


def test_a_recipe_is_made_only_for_calls_the_per_op_path_can_read() -> None:
    """No recipe (the usual path goes on) for lists of tensors, a non-floating output, a negated
    view, more tensors than the C path takes; a tensor the C path cannot read in a later call
    leaves that call to the usual path, nothing drawn."""
    x = torch.randn(4, 4)
    unread = [
        (aten.cat.default, ([x, x],), {}),
        (aten.gt.Tensor, (x, x), {}),
        (aten.mul.Tensor, (torch._neg_view(x), x), {}),
    ]
    for func, args, kwargs in unread:
        checker = SelfChecker()
        tensors: list[torch.Tensor] = []
        signed = checker.signature(func, scan(args, kwargs, tensors), tensors)
        if signed is None:
            continue  # not a kind with recipes at all
        signature = signed[0]
        for _ in range(2):
            checker.learn(signature, func, args, kwargs, func(*args, **kwargs))
        assert checker.recipes[signature] is None, func
    checker = _learned(aten.mul.Tensor, (x, x))
    recipe = next(iter(checker.recipes.values()))
    assert recipe is not None
    stream = checker._stream
    assert checker.gather_sampled(recipe, [torch._neg_view(x), x]) is None
    assert checker._stream == stream


def test_full_checks_take_no_recipe() -> None:
    checker = SelfChecker(full=True)
    x = torch.randn(8)
    checker.prepare(aten.exp.default, (x,), {})
    assert checker.signature(aten.exp.default, ("key",), [x]) is None


def test_recipes_of_signatures_that_do_not_recur_are_forgotten_at_collect() -> None:
    """A signature that does not recur (its integer arguments change every step) is only noted
    as seen, kept across one collect and dropped at the next; one that served calls keeps its recipe."""
    checker, x = SelfChecker(), torch.randn(64)
    func = aten.add.Scalar
    checker.prepare(func, (x, 2), {})
    recurring = checker.signature(func, ("T", 2), [x])
    assert recurring is not None
    for step in range(3):
        for other in (step + 10, 2, 2):
            signed = checker.signature(func, ("T", other), [x])
            assert signed is not None
            recipe = checker.recipes.get(signed[0])
            if not isinstance(recipe, Recipe):
                checker.learn(signed[0], func, (x, other), {}, x + other)
            else:
                gathered = checker.gather_sampled(recipe, [x])
                assert gathered is not None
                checker.finish_sampled(recipe, *gathered, x + other)
        residuals, _ = checker.collect()
        assert all(r <= 3.25 for r in residuals)
        this_step = checker.signature(func, ("T", step + 10), [x])
        assert this_step is not None
        assert checker.recipes == {recurring[0]: checker.recipes[recurring[0]], this_step[0]: SEEN_BEFORE}


def test_a_signature_called_once_between_collects_still_gets_its_recipe() -> None:
    """A step longer than flush_secs is collected at every boundary: an op called once a step is
    seen before one collect and given its recipe at its call after it."""
    checker, x = SelfChecker(), torch.randn(64)
    func = aten.mul.Scalar
    checker.prepare(func, (x, 3), {})
    signed = checker.signature(func, ("T", 3), [x])
    assert signed is not None
    checker.learn(signed[0], func, (x, 3), {}, x * 3)
    checker.collect()
    assert checker.recipes[signed[0]] == SEEN_BEFORE
    checker.learn(signed[0], func, (x, 3), {}, x * 3)
    assert isinstance(checker.recipes[signed[0]], Recipe)


def test_a_recipe_takes_each_calls_own_floats() -> None:
    """Float arguments are left out of a signature (a learning rate changes every step) and
    gathered with each call: one recipe checks every step size, and a call whose output used
    another one than it was given fails."""
    checker, p, g = SelfChecker(), torch.randn(256), torch.randn(256)
    func = aten.add_.Tensor
    checker.prepare(func, (p.clone(), g), {"alpha": -0.1})
    tickets = []
    for step, lr in enumerate((0.1, 0.2, 0.3, 0.4, 0.5)):
        signed = checker.signature(func, ("T", "T", "alpha", (float, -lr)), [p, g])
        assert signed is not None
        signature, floats = signed
        assert floats == [-lr]
        recipe = checker.recipes.get(signature)
        if not isinstance(recipe, Recipe):
            checker.learn(signature, func, (p.clone(), g), {"alpha": -lr}, p.clone().add_(g, alpha=-lr))
            continue
        gathered = checker.gather_sampled(recipe, [p, g], floats)
        assert gathered is not None
        out = p.clone().add_(g, alpha=-lr if step < 4 else -0.9 * lr)
        tickets.append((step, checker.finish_sampled(recipe, *gathered, out)))
    residuals, _ = checker.collect()
    assert [residuals[t] <= 3.25 for _, t in tickets] == [True, True, False]


def test_a_wide_float32_convolution_reads_fewer_elements_and_a_16_bit_gradient_more() -> None:
    """A float32 convolution's check reads at most CONV_TERMS of the terms its elements sum (a
    scaled kernel shows in any one element); a 16-bit gradient's, one scale fitted through its
    sample, four times the sample."""
    from tracecmp.capture.selfcheck import CONV_TERMS

    gen = torch.Generator().manual_seed(0)
    x, w = _randn(gen, 2, 512, 5, 5), _randn(gen, 8, 512, 3, 3)
    args = (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    checker = _learned(aten.convolution.default, args)
    (recipe,) = [r for r in checker.recipes.values() if isinstance(r, Recipe)]
    assert recipe.k == CONV_TERMS // (512 * 9) == 3
    func, make, kwargs = RECIPE_CALLS["convolution backward"]
    args = _convolution_backward_call(gen, torch.bfloat16)
    checker = _learned(func, args, kwargs)
    (recipe,) = [r for r in checker.recipes.values() if isinstance(r, Recipe)]
    assert [piece.k for piece in (recipe, *recipe.more)] == [4 * checker.sample] * 2


# Optimizer-like calls whose float changes every call: (op, inputs, the call's arguments from
# its inputs and float, the name of the float in them)
VARYING_FLOATS: dict[str, tuple[Any, Callable[[torch.Generator], tuple], Callable[..., tuple[tuple, dict]]]] = {
    "mul by a Scalar": (aten.mul.Scalar, lambda g: (_randn(g, 64),), lambda t, f: ((t[0], f), {})),
    "mul by a wrapped float": (aten.mul.Tensor, lambda g: (_randn(g, 64),), lambda t, f: ((t[0], f), {})),
    "divide by a bias correction": (aten.div.Tensor, lambda g: (_randn(g, 8, 8).abs(),), lambda t, f: ((t[0], f), {})),
    "addcdiv_ by a step size": (
        aten.addcdiv_.default,
        lambda g: (_randn(g, 64), _randn(g, 64), _randn(g, 64).abs() + 0.5),
        lambda t, f: ((t[0].clone(), t[1], t[2]), {"value": -f}),
    ),
    "addcmul_": (
        aten.addcmul_.default,
        lambda g: (_randn(g, 64), _randn(g, 64), _randn(g, 64)),
        lambda t, f: ((t[0].clone(), t[1], t[2]), {"value": f}),
    ),
    "add_ of alpha 1 in some calls": (
        aten.add_.Tensor,
        lambda g: (_randn(g, 64), _randn(g, 64)),
        lambda t, f: ((t[0].clone(), t[1]), {"alpha": 1.0 if f > 0.3 else -f}),
    ),
    "lerp_ by a Scalar": (
        aten.lerp_.Scalar,
        lambda g: (_randn(g, 64), _randn(g, 64)),
        lambda t, f: ((t[0].clone(), t[1], f), {}),
    ),
    "pow by a Scalar": (aten.pow.Tensor_Scalar, lambda g: (_randn(g, 64).abs(),), lambda t, f: ((t[0], 1 + f), {})),
    "clamp between floats": (aten.clamp.default, lambda g: (_randn(g, 64),), lambda t, f: ((t[0], -f, f), {})),
    "masked_fill by a float (a 0-d tensor only)": (
        aten.masked_fill.Scalar,
        lambda g: (_randn(g, 64), _randn(g, 64) > 0),
        lambda t, f: ((t[0], t[1], f), {}),
    ),
    "leaky_relu (no overload taking a tensor)": (
        aten.leaky_relu.default,
        lambda g: (_randn(g, 64),),
        lambda t, f: ((t[0], f), {}),
    ),
}


@pytest.mark.parametrize("name", VARYING_FLOATS)
def test_calls_of_many_floats_recompute_as_one_per_float(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The calls of a recipe that took other floats (an optimizer's step size) recompute in one
    pass, each float a column: every residual as the pass per float finds it, a scaled call failing."""
    import tracecmp.capture.selfcheck as selfcheck

    func, make, call = VARYING_FLOATS[name]
    g = torch.Generator().manual_seed(7)
    floats = [0.05 * (i + 1) for i in range(12)]
    faulty = 9

    def residuals() -> list[float]:
        checker, tickets = SelfChecker(), []
        tensors = make(g.manual_seed(7))
        for i, f in enumerate(floats):
            args, kwargs = call(tensors, f)
            if i == 0 and checker.prepare(func, args, kwargs) is None:
                pytest.skip(f"this torch does not check {func}")
            signature, taken, read = _signed(checker, func, args, kwargs)
            recipe = checker.recipes.get(signature)
            gathered = checker.gather_sampled(recipe, read, taken) if isinstance(recipe, Recipe) else None
            out = func(*args, **kwargs)
            if gathered is None:
                checker.learn(signature, func, *call(tensors, f), out)
                continue
            ticket = checker.finish_sampled(recipe, *gathered, out * 1.05 if i == faulty else out)
            assert ticket is not None
            tickets.append(ticket)
        found, _ = checker.collect()
        return [found[t] for t in tickets]

    by_columns = residuals()
    monkeypatch.setattr(selfcheck, "_recompute_by_columns", lambda *_: False)
    by_float = residuals()
    assert by_columns == pytest.approx(by_float, rel=1e-9, abs=1e-12)
    failed = [r > 3.25 for r in by_float]
    assert failed == [i == faulty for i in range(2, len(floats))]


def test_a_reduction_of_a_whole_tensor_past_the_gather_budget_is_checked_from_its_float64_sums() -> None:
    """A loss's mean over more elements than a recipe reads: checked the usual way from its float64
    sum and sum of magnitudes taken before the op, an honest mean passing and a 5% scale failing."""
    x = torch.randn(700, 1000, generator=torch.Generator().manual_seed(2)) + 0.1
    for func, args in ((aten.mean.default, (x,)), (aten.sum.dim_IntList, (x, [0, 1]))):
        for scale, fails in ((1.0, False), (1.05, True)):
            checker = SelfChecker()
            plan = checker.prepare(func, args, {})
            assert plan is not None
            (check,) = checker.finish(plan, func(*args) * scale)
            assert (check.residual > check.limit) == fails, (func, scale, check)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_constant_its_dtype_cannot_hold_is_allowed_one_rounding_and_an_exact_one_none(dtype: torch.dtype) -> None:
    """``full_like(x, 1/3)`` holds 1/3 rounded once to its dtype: within the limit; ``ones_like``
    holds 1 exactly: limit 0. Either changed by 2^-6 fails, on the usual path and the recipe's."""
    x = torch.randn(40).to(dtype)
    for func, args in ((aten.full_like.default, (x, 1 / 3)), (aten.ones_like.default, (x,))):
        (honest,) = _run(func, args, {}, sample=16)
        assert honest.residual <= honest.limit and (honest.limit == 0.0) == (func is aten.ones_like.default)
        (faulty,) = _run(func, args, {}, sample=16, tamper=lambda out: out + 2.0**-6)
        assert faulty.residual > faulty.limit
        checker = _learned(func, args)
        signature, floats, tensors = _signed(checker, func, args, {})
        recipe = checker.recipes[signature]
        assert isinstance(recipe, Recipe) and recipe.limit == honest.limit
