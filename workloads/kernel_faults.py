"""The demo transformer's Adam step captured under an emulated faulty device kernel (one run, for
``tracecmp.check``; two, for ``compare``).

Kernel faults are emulated as a device would make them: a dispatch mode entered before
``TraceCompare`` computes the op differently while the trace records the call as issued (the op,
its arguments, its dtypes), and only while the faulty module runs. Used by
``tests/integration/test_check_models.py`` and ``benchmarks/bench_check.py``.

>>> tracecmp.check(capture(Path("runs/gelu"), "gelu-tanh")).first_error.op  # doctest: +SKIP
'aten.gelu.default'
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

import tracecmp
from tracecmp.demo import BATCH, SEQ, VOCAB, build_model

A = torch.ops.aten
_MATMULS = {A.mm.default, A.addmm.default, A.bmm.default}


def _fp16(x: Any) -> Any:
    """A float32 tensor rounded to float16 and back (float16 kernels are emulated in float32 so that
    every torch's CPU runs them: they read float16, accumulate in float32, round once)."""
    return x.to(torch.float16).to(x.dtype) if isinstance(x, torch.Tensor) and x.dtype == torch.float32 else x


def _tf32(x: Any) -> Any:
    if not (isinstance(x, torch.Tensor) and x.dtype == torch.float32):
        return x
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0x0FFF + ((bits >> 13) & 1)) & ~0x1FFF).view(torch.float32)


# name -> (ops, what the device computes instead, module where it happens)
FAULTS: dict[str, tuple[set[Any], Callable[..., Any], str]] = {
    "gelu-tanh": ({A.gelu.default}, lambda f, a, k: A.gelu.default(a[0], approximate="tanh"), "blocks.1.mlp.act"),
    "layer-norm-eps": (
        {A.native_layer_norm.default},
        lambda f, a, k: A.native_layer_norm.default(a[0], a[1], a[2], a[3], 1e-3),
        "blocks.0.ln1",
    ),
    "matmul-fp16-inputs": (_MATMULS, lambda f, a, k: f(*tree_map(_fp16, a), **k), "blocks.1.mlp.fc1"),
    "matmul-fp16": (_MATMULS, lambda f, a, k: tree_map(_fp16, f(*tree_map(_fp16, a), **k)), "blocks.1.mlp.fc1"),
    "softmax-fp16": ({A._softmax.default}, lambda f, a, k: _fp16(f(_fp16(a[0]), a[1], a[2])), "blocks.0.attn"),
    "matmul-bf16-rounding": (
        _MATMULS,
        lambda f, a, k: f(*a, **k).to(torch.bfloat16).to(torch.float32),
        "blocks.0.mlp.fc2",
    ),
    "gelu-scale-1e-3": ({A.gelu.default}, lambda f, a, k: f(*a, **k) * (1 + 1e-3), "blocks.1.mlp.act"),
    "gelu-scale-5e-2": ({A.gelu.default}, lambda f, a, k: f(*a, **k) * (1 + 5e-2), "blocks.1.mlp.act"),
    "layer-norm-noise": ({A.native_layer_norm.default}, lambda f, a, k: _noisy(f(*a, **k), 1e-3), "blocks.1.ln2"),
}


def _noisy(out: tuple[torch.Tensor, ...], size: float) -> tuple[torch.Tensor, ...]:
    """A kernel adding relative noise of ``size`` to its first output (its own generator)."""
    noise = torch.randn(out[0].shape, generator=torch.Generator().manual_seed(7))
    return (out[0] * (1 + size * noise), *out[1:])


class _Device(TorchDispatchMode):
    """Runs ``ops`` as ``impl`` while ``active`` (a fault), and float32 matmuls on TF32 inputs when ``tf32``."""

    def __init__(self, ops: set[Any], impl: Callable[..., Any] | None, tf32: bool) -> None:
        super().__init__()
        self.ops, self.impl, self.tf32, self.active = ops, impl, tf32, False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.active and func in self.ops and self.impl is not None:
            return self.impl(func, args, kwargs)
        if self.tf32 and func in _MATMULS:
            return func(*tree_map(_tf32, args), **kwargs)
        return func(*args, **kwargs)


def capture(
    path: Path,
    fault: str | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    autocast: bool = False,
    tf32: bool = False,
    data: str = "tensors",
    only: Any = None,
    self_check: str = "off",
) -> Path:
    """One Adam step of the demo transformer under capture (and under ``fault``)."""
    model = build_model().to(dtype)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ops, impl, where = FAULTS[fault] if fault else (set(), None, "")
    device = _Device(ops, impl, tf32)
    hooks = []
    if fault:
        module = model.get_submodule(where)
        hooks = [
            module.register_forward_pre_hook(lambda *_: setattr(device, "active", True)),
            module.register_forward_hook(lambda *_: setattr(device, "active", False)),
        ]
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    extra = {"self_check": self_check, **({} if only is None else {"only": only})}
    try:
        with device, tracecmp.TraceCompare(path, model=model, data=data, **extra) as tc:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits = model(tokens[:, :-1])
            F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
            opt.step()
            tc.step()
    finally:
        torch.set_float32_matmul_precision(precision)
        for hook in hooks:
            hook.remove()
    return path
