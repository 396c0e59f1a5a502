"""How an op carries the error of its inputs to its outputs: one propagation class per op name.

Localization needs, for every node, the error its outputs would show if the op itself were exact
and only its inputs were off. That depends on what the op does with its inputs:

``copy``     values moved or cast (clone, _to_copy, cat, index, pad): absolute errors carry over.
``lipschitz`` pointwise or selecting ops with slope <= ~1 (add, relu, gelu, tanh, max, pooling,
             embedding): absolute errors carry over, at most ``L`` times.
``product``  multiplicative ops (mul, div, most ``*_backward`` pointwise ops): relative errors add;
             inverses (div's denominator, rsqrt, reciprocal, log) amplify by max|x| / min|x|.
``exp``      exp, softmax: the output's relative error is the input's absolute error.
``contract`` matmul, conv, attention: relative error grows by the condition-like factor
             sqrt(K) * rms(A) * rms(B) / rms(A @ B) (1 without cancellation); fused attention's
             operands (query, key, value; a backward's gradient and output too, see
             :func:`for_call`) each carry their relative error, with no such factor.
``reduce``   sums and means, losses, norms: sqrt(K) * rms(x) / rms(sum) (or its mean analogue).
``normalize`` layer/batch/group/RMS norm: divides by the spread, amplifying by rms(x) / std(x).
``select``   outputs chosen by comparing inputs (threshold_backward, sort, argmax, comparisons,
             rounding): once an input differs, any output difference is inherited.
``factory``  no data inputs (zeros, arange, rand): an output difference is the op's own.
``uninit``   uninitialized memory (empty, new_empty): never compared, never an input's error.
``other``    anything unknown (vendor fused ops): judged like ``reduce`` with a generous factor.

``contract`` ops in float32 may legitimately run at TF32/HF32 precision (``precision_variable``).

>>> classify("aten.gelu.default").kind, classify("aten.mm.default").precision_variable
('lipschitz', True)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, Mapping

from tracecmp.trace import boundedjson

KINDS = (
    "copy",
    "lipschitz",
    "product",
    "exp",
    "contract",
    "reduce",
    "normalize",
    "select",
    "factory",
    "uninit",
    "other",
)


@dataclass(frozen=True)
class OpClass:
    kind: str
    lipschitz: float = 1.0  # slope bound for copy/lipschitz/exp
    mean_like: bool = False  # reduce: averages (output ~ input) rather than sums (output ~ K * input)
    inverse_inputs: tuple[int, ...] = ()  # product: inputs that enter as 1/x (or log x)
    precision_variable: bool = False  # float32 may run at TF32/HF32 (matmul, conv)
    accumulates: bool = False  # sums many terms: implementations may differ by more than one rounding
    operands: tuple[int, ...] = ()  # contract: the argument positions multiplied together (else the two largest)
    # Per-input exceptions: (position, how) with how one of "ignore" (shape only, values unused),
    # "exp" (enters through exp: its absolute error is the output's relative error), "selector"
    # (only decides which elements pass: a changed sign flips a few elements), "add" (added to
    # the product of the others: its absolute error carries over), "normalized" (divided by its
    # own spread: a scale or shift it carried does not reach the output's norm and mean), "centre"
    # (a saved mean a normalization's backward subtracts: its absolute error counts, see for_call).
    inputs: tuple[tuple[int, str], ...] = ()
    # normalize: what each output is, by position (see _NORM_OUTPUTS); "" past the end.
    outputs: tuple[str, ...] = ()

    def input_rule(self, position: int) -> str:
        for pos, how in self.inputs:
            if pos == position:
                return how
        return ""

    def output_role(self, position: int) -> str:
        return self.outputs[position] if position < len(self.outputs) else ""


_COPY = {
    "clone",
    "contiguous",
    "_to_copy",
    "to",
    "copy",
    "copy_",
    "detach",
    "alias",
    "lift_fresh",
    "lift_fresh_copy",
    "_copy_from",
    "_copy_from_and_resize",
    "cat",
    "stack",
    "hstack",
    "vstack",
    "index",
    "index_select",
    "gather",
    "take",
    "masked_select",
    "index_put",
    "index_put_",
    "_index_put_impl_",
    "scatter",
    "scatter_",
    "slice_scatter",
    "select_scatter",
    "diagonal_scatter",
    "as_strided_scatter",
    "constant_pad_nd",
    "pad",
    "reflection_pad1d",
    "reflection_pad2d",
    "replication_pad1d",
    "replication_pad2d",
    "flip",
    "roll",
    "repeat",
    "repeat_interleave",
    "tile",
    "expand_copy",
    "permute_copy",
    "transpose_copy",
    "view_copy",
    "_unsafe_view",
    "reshape",
    "flatten",
    "unflatten",
    "squeeze_copy",
    "unsqueeze_copy",
    "slice_copy",
    "select_copy",
    "split_copy",
    "narrow_copy",
    "clone_",
    "_foreach_copy_",
    "embedding",
    "masked_scatter",
    "tril",
    "triu",
    "diag",
    "diag_embed",
    "col2im",
    "im2col",
    "pixel_shuffle",
    "pixel_unshuffle",
    "upsample_nearest1d",
    "upsample_nearest2d",
    "_unsafe_index",
    "zero_",
    "fill_",
    "fill",
    "masked_fill",
    "masked_fill_",
    "where",
    "_conj",
    "conj_physical",
    "resolve_conj",
    "resolve_neg",
    "t_copy",
    "unfold_copy",
    "unbind_copy",
    "_reshape_alias_copy",
    "set_",
    "_to_dense",
    "select_backward",
    "slice_backward",
    "index_select_backward",
    "diagonal_backward",
    "unfold_backward",
    "as_strided_backward",
    "permute_backward",
    "transpose_backward",
    "expand_backward",
    "narrow_backward",
}
_LIPSCHITZ = {
    "add",
    "add_",
    "sub",
    "sub_",
    "rsub",
    "neg",
    "abs",
    "relu",
    "relu_",
    "relu6",
    "hardtanh",
    "hardtanh_",
    "leaky_relu",
    "leaky_relu_",
    "elu",
    "elu_",
    "selu",
    "celu",
    "gelu",
    "gelu_",
    "silu",
    "silu_",
    "mish",
    "hardswish",
    "hardsigmoid",
    "softplus",
    "tanh",
    "tanh_",
    "sigmoid",
    "sigmoid_",
    "sin",
    "cos",
    "atan",
    "clamp",
    "clamp_",
    "clamp_min",
    "clamp_min_",
    "clamp_max",
    "clamp_max_",
    "clip",
    "maximum",
    "minimum",
    "fmax",
    "fmin",
    "max",
    "min",
    "amax",
    "amin",
    "max_pool1d",
    "max_pool2d",
    "max_pool3d",
    "max_pool2d_with_indices",
    "max_pool3d_with_indices",
    "adaptive_max_pool2d",
    "avg_pool1d",
    "avg_pool2d",
    "avg_pool3d",
    "adaptive_avg_pool1d",
    "adaptive_avg_pool2d",
    "_adaptive_avg_pool2d",
    "adaptive_avg_pool3d",
    "upsample_bilinear2d",
    "upsample_linear1d",
    "upsample_bicubic2d",
    "_upsample_bilinear2d_aa",
    "grid_sampler_2d",
    "lerp",
    "lerp_",
    "_foreach_add",
    "_foreach_add_",
    "_foreach_sub",
    "_foreach_sub_",
    "_foreach_neg",
    "_foreach_lerp_",
    "_foreach_clamp_min_",
    "_foreach_clamp_max_",
    "_foreach_maximum_",
    "_foreach_abs",
    "sort",
    "topk",
    "kthvalue",
    "median",
    "cummax",
    "cummin",
    "logsigmoid",
    "log_sigmoid_forward",
    "_prelu_kernel",
    "prelu",
    "native_dropout",
    "dropout",
    "feature_dropout",
    "alpha_dropout",
    "softshrink",
    "hardshrink",
    "tanhshrink",
    "erf",
    "polar",
    "angle",
    "real",
    "imag",
    "view_as_real",
    "view_as_complex",
    "complex",
    "trunc_normal_",
    "rrelu_with_noise",
}
_PRODUCT = {
    "mul",
    "mul_",
    "div",
    "div_",
    "true_divide",
    "addcmul_",
    "floor_divide",
    "square",
    "pow",
    "pow_",
    "sqrt",
    "sqrt_",
    "rsqrt",
    "rsqrt_",
    "reciprocal",
    "reciprocal_",
    "log",
    "log_",
    "log2",
    "log10",
    "log1p",
    "addcmul",
    "addcdiv",
    "addcdiv_",
    "_foreach_mul",
    "_foreach_mul_",
    "_foreach_div",
    "_foreach_div_",
    "_foreach_sqrt",
    "_foreach_sqrt_",
    "_foreach_addcmul",
    "_foreach_addcmul_",
    "_foreach_addcdiv",
    "_foreach_addcdiv_",
    "_foreach_pow",
    "_foreach_reciprocal_",
    "_foreach_rsqrt_",
    "_fused_adam_",
    "_fused_adamw_",
    "_fused_sgd_",
    "_foreach_lerp",
    "gelu_backward",
    "silu_backward",
    "tanh_backward",
    "sigmoid_backward",
    "elu_backward",
    "softplus_backward",
    "hardswish_backward",
    "hardsigmoid_backward",
    "mish_backward",
    "log_sigmoid_backward",
    "_prelu_kernel_backward",
    "native_dropout_backward",
    "masked_scale",
    "erfinv",
    "tan",
    "atan2",
    "xlogy",
    "special_xlog1py",
    "sgn_mul",
    "std_mean_backward",
    "rsub_mul",
    "cosh",
    "sinh",
    "asinh",
    "acosh",
    "atanh",
    "asin",
    "acos",
    "logit",
}
# Inputs of product ops that act as 1/x (or log x): relative error there grows by max|x| / min|x|.
_INVERSE = {
    "div": (1,),
    "div_": (1,),
    "true_divide": (1,),
    "floor_divide": (1,),
    "addcdiv": (2,),
    "addcdiv_": (2,),
    "_foreach_div": (1,),
    "_foreach_div_": (1,),
    "_foreach_addcdiv": (2,),
    "_foreach_addcdiv_": (2,),
    "rsqrt": (0,),
    "rsqrt_": (0,),
    "sqrt": (0,),
    "sqrt_": (0,),
    "reciprocal": (0,),
    "reciprocal_": (0,),
    "log": (0,),
    "log_": (0,),
    "log2": (0,),
    "log10": (0,),
    "_foreach_sqrt": (0,),
    "_foreach_sqrt_": (0,),
    "_foreach_reciprocal_": (0,),
    "_foreach_rsqrt_": (0,),
    "logit": (0,),
    "xlogy": (1,),
}
_EXP = {
    "exp",
    "exp_",
    "exp2",
    "expm1",
    "_softmax",
    "softmax",
    "_safe_softmax",
    "special_softmax",
    "logsumexp",
    "_foreach_exp",
    "_foreach_exp_",
    "cosh",
    "sinh",
}
_LOG_SOFTMAX = {"_log_softmax", "log_softmax", "special_log_softmax"}
_CONTRACT = {
    "mm",
    "bmm",
    "addmm",
    "addmm_",
    "matmul",
    "linear",
    "baddbmm",
    "addbmm",
    "addmv",
    "mv",
    "dot",
    "vdot",
    "einsum",
    "tensordot",
    "outer",
    "ger",
    "convolution",
    "_convolution",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "cudnn_convolution",
    "mkldnn_convolution",
    "_slow_conv2d_forward",
    "slow_conv3d_forward",
    "thnn_conv2d",
    "_nnpack_spatial_convolution",
    "convolution_backward",
    "_slow_conv2d_backward",
    "cudnn_convolution_backward",
    "mkldnn_convolution_backward",
    "_int_mm",
    "_scaled_mm",
    "lstm",
    "gru",
    "rnn_tanh",
    "rnn_relu",
    "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell",
    "mkldnn_rnn_layer",
    "mkldnn_rnn_layer_backward",
    "_cudnn_rnn",
    "_cudnn_rnn_backward",
    "miopen_rnn",
    "embedding_bag",
    "_embedding_bag",
    "_embedding_bag_forward_only",
    "linalg_vecdot",
    "chain_matmul",
    "multi_dot",
}
# Fused attention, forward and backward: softmax(s q k^T + mask) v and its gradients.
_ATTENTION = {
    "scaled_dot_product_attention",
    "_scaled_dot_product_attention_math",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward",
    "_efficient_attention_forward",
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention_backward",
    "_scaled_dot_product_fused_attention_overrideable_backward",
    "_flash_attention_backward",
    "_efficient_attention_backward",
}
_CONTRACT |= _ATTENTION
# The arguments whose values an attention output is a product of (the gradient of the output and
# the output itself in a backward), and the saved log-sum-exp a backward subtracts inside exp.
_ATTENTION_FACTORS = ("query", "key", "value", "grad_out", "grad_out_", "out")
# Inside exp: the saved log-sum-exp a backward subtracts, and the mask added to the scores.
_ATTENTION_EXP = ("logsumexp", "attn_mask", "attn_bias")
# Normalization ops whose outputs are statistics, not a normalized tensor.
_NORM_STATS = {"batch_norm_stats", "batch_norm_gather_stats_with_counts", "batch_norm_elemt"}
_REDUCE_SUM = {
    "sum",
    "nansum",
    "cumsum",
    "cumsum_",
    "prod",
    "cumprod",
    "trace",
    "_foreach_norm",
    "norm",
    "linalg_vector_norm",
    "linalg_norm",
    "frobenius_norm",
    "embedding_dense_backward",
    "_embedding_bag_backward",
    "_embedding_bag_dense_backward",
    "index_add",
    "index_add_",
    "scatter_add",
    "scatter_add_",
    "scatter_reduce",
    "scatter_reduce_",
    "_unsafe_index_put",
    "index_reduce",
    "bincount",
    "histc",
    "sum_to_size",
    "_foreach_sum",
    "dist",
    "cdist",
    "_cdist_forward",
    "_cdist_backward",
}
_REDUCE_MEAN = {
    "mean",
    "nanmean",
    "var",
    "std",
    "var_mean",
    "std_mean",
    "nll_loss",
    "nll_loss_forward",
    "nll_loss2d_forward",
    "nll_loss_nd",
    "cross_entropy_loss",
    "mse_loss",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "binary_cross_entropy",
    "binary_cross_entropy_with_logits",
    "kl_div",
    "soft_margin_loss",
    "multilabel_margin_loss_forward",
    "multi_margin_loss",
    "hinge_embedding_loss",
    "cosine_similarity",
    "cosine_embedding_loss",
    "margin_ranking_loss",
    "poisson_nll_loss",
    "ctc_loss",
    "_ctc_loss",
    "mse_loss_backward",
    "smooth_l1_loss_backward",
    "huber_loss_backward",
    "l1_loss_backward",
    "binary_cross_entropy_backward",
    "grid_sampler_2d_backward",
    "kl_div_backward",
}
# Backward ops whose output is the incoming gradient times a function of saved values, with the
# exceptions of the inputs that enter differently.
_GRAD_PRODUCT: dict[str, tuple[tuple[int, str], ...]] = {
    "nll_loss_backward": ((1, "ignore"),),  # d loss / d log-probs depends on the target, not the values
    "nll_loss2d_backward": ((1, "ignore"),),
    "_log_softmax_backward_data": ((1, "exp"),),  # grad - exp(out) * sum(grad)
    "_softmax_backward_data": (),
    "avg_pool2d_backward": ((1, "ignore"),),
    "avg_pool3d_backward": ((1, "ignore"),),
    "_adaptive_avg_pool2d_backward": ((1, "ignore"),),
    "adaptive_avg_pool3d_backward": ((1, "ignore"),),
    "upsample_bilinear2d_backward": (),
    "upsample_nearest2d_backward": (),
}
# Backward ops that route the gradient to where a saved input was positive / selected.
_GRAD_SELECT: dict[str, tuple[tuple[int, str], ...]] = {
    "threshold_backward": ((1, "selector"),),
    "leaky_relu_backward": ((1, "selector"),),
    "hardtanh_backward": ((1, "selector"),),
    "relu_backward": ((1, "selector"),),
    "hardshrink_backward": ((1, "selector"),),
    "softshrink_backward": ((1, "selector"),),
    "max_pool2d_with_indices_backward": ((1, "ignore"),),
    "max_pool3d_with_indices_backward": ((1, "ignore"),),
}
_NORMALIZE = {
    "native_layer_norm",
    "layer_norm",
    "native_batch_norm",
    "batch_norm",
    "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training",
    "_native_batch_norm_legit_functional",
    "cudnn_batch_norm",
    "miopen_batch_norm",
    "native_group_norm",
    "group_norm",
    "instance_norm",
    "rms_norm",
    "_fused_rms_norm",
    "native_layer_norm_backward",
    "native_batch_norm_backward",
    "native_group_norm_backward",
    "cudnn_batch_norm_backward",
    "_fused_rms_norm_backward",
    "batch_norm_backward",
    "_batch_norm_with_update",
    "_batch_norm_with_update_functional",
    "_batch_norm_no_update",
    "normalize",
    "renorm",
    "weight_norm",
    "_weight_norm_interface",
    "_weight_norm_interface_backward",
    "local_response_norm",
    "batch_norm_stats",
    "batch_norm_elemt",
    "batch_norm_gather_stats_with_counts",
    "_fused_layer_norm",
    "miopen_batch_norm_backward",
}
# What each output of a normalization op holds, by position: the normalized tensor ("out"), the
# per-row (per-channel) mean and inverse spread it used ("mean", "rstd"), updated running
# statistics ("running"), scratch space ("reserve"); for backward ops the input's gradient
# ("grad") and the weight's and bias's, sums over the rows ("reduced"). They carry error
# differently: a mean moves with its input's mean, an inverse spread with its scale.
_NORM_OUTPUTS: dict[str, tuple[str, ...]] = {
    "native_layer_norm": ("out", "mean", "rstd"),
    "native_group_norm": ("out", "mean", "rstd"),
    "native_batch_norm": ("out", "mean", "rstd"),
    "_native_batch_norm_legit": ("out", "mean", "rstd"),
    "_native_batch_norm_legit_no_training": ("out", "mean", "rstd"),
    "_native_batch_norm_legit_functional": ("out", "mean", "rstd", "running", "running"),
    "_batch_norm_with_update": ("out", "mean", "rstd", "reserve"),
    "_batch_norm_with_update_functional": ("out", "mean", "rstd", "reserve", "running", "running"),
    "_batch_norm_no_update": ("out", "mean", "rstd", "reserve"),
    "cudnn_batch_norm": ("out", "mean", "rstd", "reserve"),
    "miopen_batch_norm": ("out", "mean", "rstd"),
    "_fused_rms_norm": ("out", "rstd"),
    "native_layer_norm_backward": ("grad", "reduced", "reduced"),
    "native_group_norm_backward": ("grad", "reduced", "reduced"),
    "native_batch_norm_backward": ("grad", "reduced", "reduced"),
    "batch_norm_backward": ("grad", "reduced", "reduced"),
    "cudnn_batch_norm_backward": ("grad", "reduced", "reduced"),
    "miopen_batch_norm_backward": ("grad", "reduced", "reduced"),
    "_fused_rms_norm_backward": ("grad", "reduced"),
}
_SELECT = {
    "sign",
    "sgn",
    "round",
    "round_",
    "floor",
    "floor_",
    "ceil",
    "ceil_",
    "trunc",
    "trunc_",
    "frac",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "eq_",
    "ne_",
    "lt_",
    "le_",
    "gt_",
    "ge_",
    "isnan",
    "isinf",
    "isfinite",
    "isclose",
    "argmax",
    "argmin",
    "argsort",
    "nonzero",
    "unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "bucketize",
    "searchsorted",
    "logical_and",
    "logical_or",
    "logical_not",
    "logical_xor",
    "bitwise_and",
    "bitwise_or",
    "bitwise_not",
    "bitwise_xor",
    "all",
    "any",
    "remainder",
    "fmod",
    "clamp_backward",
    "_local_scalar_dense",
    "equal",
    "masked_fill_backward",
    "heaviside",
    "count_nonzero",
    "_assert_async",
    "is_nonzero",
    "topk_indices",
    "max_unpool2d",
    "rrelu_with_noise_backward",
    "_fused_dropout",
    "native_dropout_mask",
    "le_scalar",
    "signbit",
}
_FACTORY = {
    "zeros",
    "ones",
    "full",
    "arange",
    "linspace",
    "logspace",
    "eye",
    "scalar_tensor",
    "tensor",
    "zeros_like",
    "ones_like",
    "full_like",
    "new_zeros",
    "new_ones",
    "new_full",
    "rand",
    "randn",
    "randint",
    "rand_like",
    "randn_like",
    "randint_like",
    "randperm",
    "normal",
    "normal_",
    "uniform",
    "uniform_",
    "bernoulli",
    "bernoulli_",
    "multinomial",
    "exponential_",
    "geometric_",
    "cauchy_",
    "log_normal_",
    "random_",
    "poisson",
    "_fused_dropout_mask",
    "_philox_rand",
    "empty_permuted_fill",
    "_foreach_zero_",
}
_UNINIT = {
    "empty",
    "empty_like",
    "new_empty",
    "new_empty_strided",
    "empty_strided",
    "empty_permuted",
    "_empty_affine_quantized",
    "resize_",
    "resize_as_",
    "_resize_output_",
    "empty_quantized",
    "_empty_per_channel_affine_quantized",
}

# Argument positions a matmul/conv multiplies (a bias is added, not multiplied: a device at
# reduced precision rounds only these); ops not listed multiply every floating input.
_OPERANDS = {name: (1, 2) for name in ("addmm", "addmm_", "baddbmm", "addbmm", "addmv")}
_OPERANDS.update(
    {
        name: (0, 1)
        for name in (
            "convolution",
            "_convolution",
            "conv1d",
            "conv2d",
            "conv3d",
            "conv_transpose1d",
            "conv_transpose2d",
            "conv_transpose3d",
            "cudnn_convolution",
            "mkldnn_convolution",
            "_slow_conv2d_forward",
            "slow_conv3d_forward",
            "thnn_conv2d",
            "linear",
        )
    }
)


def base_name(op: str) -> str:
    """``"aten.add_.Tensor"`` -> ``"add_"``; ``"npu.fast_gelu.default"`` -> ``"fast_gelu"``.

    >>> base_name("aten.native_layer_norm.default"), base_name("relu")
    ('native_layer_norm', 'relu')
    """
    parts = op.split(".")
    if len(parts) >= 3:
        return parts[1]
    if len(parts) == 2:
        return parts[1] if parts[0] in ("aten", "prims", "npu", "torch_npu", "_c10d_functional", "c10d") else parts[0]
    return op


@lru_cache(maxsize=4096)
def classify(op: str) -> OpClass:
    """The propagation class of an op name (see the module docstring)."""
    name = base_name(op)
    if name in _UNINIT:
        return OpClass("uninit")
    if name in _FACTORY:
        return OpClass("factory")
    if name in _GRAD_SELECT:
        return OpClass("product", inputs=_GRAD_SELECT[name])
    if name in _GRAD_PRODUCT:
        return OpClass("product", lipschitz=2.0, inputs=_GRAD_PRODUCT[name], accumulates=True)
    if name in _SELECT:
        return OpClass("select")
    if name in _CONTRACT:
        operands = _OPERANDS.get(name, ())
        return OpClass("contract", precision_variable=True, accumulates=True, operands=operands)
    if name in _NORMALIZE:
        forward = not name.endswith(("_backward", "backward")) and name not in _NORM_STATS
        return OpClass(
            "normalize",
            accumulates=True,
            inputs=((0, "normalized"),) if forward else (),
            outputs=_NORM_OUTPUTS.get(name, ()),
        )
    if name in _REDUCE_MEAN:
        return OpClass("reduce", mean_like=True, accumulates=True)
    if name in _REDUCE_SUM:
        return OpClass("reduce", accumulates=True)
    if name in _EXP:
        return OpClass(
            "exp",
            lipschitz=2.0 if "softmax" in name or name == "logsumexp" else 1.0,
            accumulates="softmax" in name or name == "logsumexp",
        )
    if name in _LOG_SOFTMAX:
        return OpClass("lipschitz", lipschitz=2.0, accumulates=True)
    if name in _PRODUCT:
        added = ((0, "add"),) if name.startswith(("addcmul", "addcdiv", "_foreach_addcmul", "_foreach_addcdiv")) else ()
        return OpClass("product", inverse_inputs=_INVERSE.get(name, ()), inputs=added)
    if name in _LIPSCHITZ:
        return OpClass("lipschitz", lipschitz=1.13 if name.startswith(("gelu", "silu", "mish")) else 1.0)
    if name in _COPY:
        return OpClass("copy")
    if name.startswith("_foreach_"):
        return OpClass("product")
    return OpClass("other", accumulates=True)


# Where torch's collectives live: c10d's in-place ops and the functional ones (with their wait_tensor).
COLLECTIVE_NAMESPACES = ("c10d.", "_c10d_functional.", "c10d_functional.")


def is_collective(op: str) -> bool:
    """Whether ``op`` is a collective (or the wait on one's result).

    >>> is_collective("c10d.allreduce_.default"), is_collective("aten.add.Tensor")
    (True, False)
    """
    return op.startswith(COLLECTIVE_NAMESPACES)


def is_copy(op: str) -> bool:
    """Ops whose output holds the same values as their (first) input: what an extra op usually is."""
    return base_name(op) in {
        "clone",
        "contiguous",
        "_to_copy",
        "to",
        "copy",
        "detach",
        "alias",
        "lift_fresh",
        "lift_fresh_copy",
        "_copy_from",
        "copy_",
        "_unsafe_view",
        "reshape",
        "flatten",
        "view_copy",
        "expand_copy",
        "permute_copy",
        "transpose_copy",
        "t_copy",
        "resolve_conj",
        "resolve_neg",
    }


def is_readout(op: str) -> bool:
    """Ops that hand their one-element input to Python as a number (``.item()``), computing nothing.

    Capture records no value for a Python number, so such an op's output carries exactly the
    error its input was judged to carry.

    >>> is_readout("aten._local_scalar_dense.default"), is_readout("aten.sum.default")
    (True, False)
    """
    return base_name(op) == "_local_scalar_dense"


# Normalization backward ops, by argument name: the mean the forward subtracted ("centre": its
# error moves x - mean by its absolute size, over the spread) and running statistics a training
# step's backward never reads ("ignore" when ``train`` is true).
_NORM_CENTRES: dict[str, tuple[str, ...]] = {
    "native_layer_norm_backward": ("mean",),
    "native_group_norm_backward": ("mean",),
    "native_batch_norm_backward": ("save_mean",),
    "batch_norm_backward": ("save_mean",),
    "miopen_batch_norm_backward": ("save_mean",),
}
_RUNNING = ("running_mean", "running_var")


def takes_call_args(op: str) -> bool:
    """Whether :func:`for_call` refines ``op``'s class from a call's recorded arguments.

    >>> takes_call_args("aten.native_batch_norm_backward.default"), takes_call_args("aten.mm.default")
    (True, False)
    """
    name = base_name(op)
    return name in _NORM_CENTRES or name in _ATTENTION


def for_call(cls: OpClass, op: str, args: Mapping[str, Any]) -> OpClass:
    """``cls`` with the input rules one call's arguments decide (recorded arguments, tensors as
    ``{"tensor": position}``): a normalization backward's saved mean is a "centre", and a training
    batch norm's running statistics, which its backward does not read, are ignored. Fused
    attention multiplies its query, key and value (and in a backward the output's gradient and the
    output): each is an operand, whose relative error the output carries; its mask, added to the
    scores, and its backward's saved log-sum-exp enter through exp. Without that, the two largest
    inputs were the operands and the others counted as added to a gradient a thousand times
    smaller than they are.

    >>> cls = for_call(classify("aten.native_layer_norm_backward.default"), "aten.native_layer_norm_backward.default",
    ...                {"grad_out": {"tensor": 0}, "input": {"tensor": 1}, "mean": {"tensor": 2}})
    >>> cls.input_rule(2)
    'centre'
    >>> op = "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"
    >>> cls = for_call(classify(op), op, {n: {"tensor": i} for i, n in enumerate(
    ...     ("grad_out", "query", "key", "value", "out", "logsumexp"))})
    >>> cls.operands, cls.input_rule(5)
    ((0, 1, 2, 3, 4), 'exp')
    """
    name = base_name(op)
    if name in _ATTENTION:
        operands = tuple(sorted(args[key]["tensor"] for key in _ATTENTION_FACTORS if isinstance(args.get(key), dict)))
        if len(operands) < 2:
            return cls
        inside_exp = tuple((args[key]["tensor"], "exp") for key in _ATTENTION_EXP if isinstance(args.get(key), dict))
        return replace(cls, operands=operands, inputs=cls.inputs + inside_exp)
    if name not in _NORM_CENTRES:
        return cls
    rules = [(args[key]["tensor"], "centre") for key in _NORM_CENTRES[name] if isinstance(args.get(key), dict)]
    if args.get("train") is True:
        rules += [(args[key]["tensor"], "ignore") for key in _RUNNING if isinstance(args.get(key), dict)]
    if not rules:
        return cls
    return replace(cls, inputs=cls.inputs + tuple(rules))


def is_overflow_check(op: str) -> bool:
    """A loss scaler's check of the gradients for NaN/Inf (``GradScaler.unscale_``, on any device):
    it unscales them in place and sets its ``found_inf`` argument, which capture records as the
    op's last output, after the gradients it mutated.

    >>> is_overflow_check("aten._amp_foreach_non_finite_check_and_unscale_.default")
    True
    """
    return base_name(op) == "_amp_foreach_non_finite_check_and_unscale_"


# Arguments that switch an op's random draw off when they hold these values: a drop probability
# of 0 (``dropout_p``, RNN ``dropout``, a dropout op's ``p``), a keep probability of 1, or
# ``train``/``training`` false. ``_fused_dropout``'s ``p`` is its keep probability.
_NO_DRAW_ARGS = {"dropout_p": 0.0, "dropout": 0.0, "keep_prob": 1.0, "train": False, "training": False}


def draws_random(op: str, args: Mapping[str, Any] | None, may_draw: bool = True) -> bool:
    """Whether a call of ``op`` with the recorded non-tensor ``args`` drew random numbers.

    ``may_draw`` is what the schema says (the trace's ``random`` column: the op is tagged
    nondeterministic-seeded or takes a Generator). An op that draws only to drop values draws
    nothing when told to drop none: fused attention with ``dropout_p=0.0``, ``native_dropout`` with
    ``p=0`` or ``train=False``, an RNN with ``dropout=0``, ``rrelu`` outside training.

    >>> draws_random("aten._scaled_dot_product_flash_attention_for_cpu.default", {"dropout_p": 0.0})
    False
    >>> draws_random("aten.native_dropout.default", {"p": 0.1, "train": True})
    True
    >>> draws_random("aten.bernoulli_.float", {"p": 0.9})
    True
    """
    if not may_draw:
        return False
    if not args:
        return True
    name = base_name(op)
    switches = dict(_NO_DRAW_ARGS)
    if "dropout" in name:
        switches["p"] = 1.0 if name == "_fused_dropout" else 0.0
    seen = False
    for key, off in switches.items():
        value = args.get(key)
        if value is None or isinstance(value, (dict, list)):
            continue  # absent, or a tensor argument: says nothing
        if isinstance(off, bool):
            if value is off:
                return False  # train=False: the op does not drop whatever its probability
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        seen = True
        if float(value) != off:
            return True
    return not seen


_NONFINITE_TEXT = ('"inf"', '"-inf"', '"nan"')


def given_nonfinite(args: str | None) -> bool:
    """Whether a call was handed a NaN or an infinity as a non-tensor argument (recorded
    arguments as JSON, where such floats are the strings "inf", "-inf", "nan"): the NaN/Inf it
    makes then were asked for (a causal mask ``masked_fill(mask, -inf)``, ``full(size, inf)``,
    ``clamp(x, max=inf)``), not produced by overflowing arithmetic.

    >>> given_nonfinite('{"self": {"tensor": 0}, "mask": {"tensor": 1}, "value": "-inf"}')
    True
    >>> given_nonfinite('{"self": {"tensor": 0}, "value": -3.4028234663852886e+38}')
    False
    """
    if not args or not any(mark in args for mark in _NONFINITE_TEXT):
        return False
    try:
        value = boundedjson.loads(args, max_bytes=boundedjson.ARGS_MAX_BYTES)
    except ValueError:
        return False
    return _holds_nonfinite(value)


def _holds_nonfinite(value: Any) -> bool:
    if isinstance(value, str):
        return value in ("inf", "-inf", "nan")
    if isinstance(value, dict):
        return set(value) != {"tensor"} and any(_holds_nonfinite(v) for v in value.values())
    if isinstance(value, list):
        return any(_holds_nonfinite(v) for v in value)
    return False


# Ops besides matmul-like ones that autocast runs in lower precision, narrowing their inputs: PReLU,
# and the bias add of a linear or convolution that decomposes into a matmul and an add (the bias
# narrowed to the matmul's dtype, the sum widened for the next float32 op).
AUTOCAST_ELEMENTWISE = frozenset({"prelu", "_prelu_kernel", "add", "add_", "sub", "sub_"})


# Ops whose exact result is infinite where an input is 0 (a pole): log(0) = -inf, 1/0 = inf.
POLES = frozenset(
    {
        "log",
        "log_",
        "log2",
        "log2_",
        "log10",
        "log10_",
        "reciprocal",
        "reciprocal_",
        "rsqrt",
        "rsqrt_",
        "div",
        "div_",
        "true_divide",
        "xlogy",
        "_foreach_log",
        "_foreach_reciprocal_",
        "_foreach_div",
        "_foreach_div_",
        "_foreach_rsqrt_",
        "logit",
        "atanh",
        "digamma",
        "lgamma",
        "polygamma",
    }
)


def read_by(op: str, args: str, inputs: list[int], index: int) -> list[tuple[int, int]]:
    """(position, tensor id) of the inputs output ``index`` is computed from. A multi-tensor op
    (``_foreach_addcdiv_``, ``_fused_adamw_``) takes lists of n tensors and computes element k of
    each list it returns from element k of each list it reads: positions then count lists.

    >>> read_by("aten._foreach_mul.List", '{"self": [{"tensor": 0}, {"tensor": 1}], '
    ...         '"other": [{"tensor": 2}, {"tensor": 3}]}', [10, 11, 12, 13], 1)
    [(0, 11), (1, 13)]
    """
    if not base_name(op).startswith(("_foreach_", "_fused_")):
        return list(enumerate(inputs))
    n = tensor_list_length(args)
    if n < 2 or len(inputs) < n:
        return list(enumerate(inputs))
    lists, k = len(inputs) // n, index % n
    read = [(j, inputs[j * n + k]) for j in range(lists)]
    return read + [(lists + i, t) for i, t in enumerate(inputs[lists * n :])]  # single tensors after the lists


def tensor_list_length(args: str) -> int:
    """How many tensors the first tensor-list argument of a recorded call holds (0 if none)."""
    return _recorded(args)[1]


def recorded_args(args: str) -> Mapping[str, Any]:
    """A call's recorded non-tensor arguments by name ({} where they do not parse). Shared: read only."""
    return _recorded(args)[0]


@lru_cache(maxsize=64)
def _recorded(args: str) -> tuple[dict[str, Any], int]:
    # Cached: each element of a multi-tensor call reads the same arguments.
    try:
        parsed = boundedjson.loads(args, max_bytes=boundedjson.ARGS_MAX_BYTES) if args else {}
    except (TypeError, ValueError):
        parsed = {}
    parsed = parsed if isinstance(parsed, dict) else {}
    lists = (
        v
        for v in parsed.values()
        if isinstance(v, list) and v and all(isinstance(x, dict) and "tensor" in x for x in v)
    )
    return parsed, len(next(lists, ()))
