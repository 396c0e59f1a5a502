"""The fused variant's model: one pre-norm transformer block whose parts run fused or eager.

Each of the four parts the seeds' migrations fuse can be switched on its own:

- ``attn``: ``F.scaled_dot_product_attention(is_causal=True)`` (one fused aten op on the CPU,
  forward and backward) or eager attention (``q @ k^T * scale``, ``masked_fill`` with ``-inf``
  above the diagonal, softmax, ``@ v``);
- ``norm``: ``F.rms_norm`` or a hand-written RMSNorm (``x * rsqrt(mean(x^2) + eps) * w``);
- ``mlp``: a fused SwiGLU as a ``torch.library`` custom op with a CPU kernel (forward and
  backward are one op each, computed in float64 inside and rounded once, as a fused device
  kernel rounds once) or its eager decomposition ``silu(a) * b``;
- ``optim``: ``AdamW(fused=True)`` or ``AdamW(foreach=True)``.

>>> w = build_fused(FusedConfig(attn="fused")); float(w.train_step(w.make_optimizer())) > 0
True
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

PARTS = ("attn", "norm", "mlp", "optim")
Mode = Literal["fused", "eager"]
VOCAB = 64
SEQ = 8
BATCH = 4


# The fused parts need torch.library.custom_op and F.rms_norm (torch >= 2.4); the eager parts
# and the other workloads run on any torch tracecmp supports.
CUSTOM_OPS = hasattr(torch.library, "custom_op")

if CUSTOM_OPS:
    # A fused SwiGLU: silu(a) * b in one kernel, and its backward in another, each rounding once.
    @torch.library.custom_op("tracecmp_bench::swiglu", mutates_args=())
    def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``silu(a) * b`` computed in float64 and rounded once to ``a``'s dtype."""
        a64, b64 = a.double(), b.double()
        return (a64 * torch.sigmoid(a64) * b64).to(a.dtype)

    @swiglu.register_fake
    def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(a)

    @torch.library.custom_op("tracecmp_bench::swiglu_backward", mutates_args=())
    def swiglu_backward(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gradients of :func:`swiglu` with respect to ``a`` and ``b``, in float64, rounded once."""
        g64, a64, b64 = grad.double(), a.double(), b.double()
        sig = torch.sigmoid(a64)
        silu = a64 * sig
        grad_a = g64 * b64 * (sig + silu * (1.0 - sig))
        return grad_a.to(a.dtype), (g64 * silu).to(b.dtype)

    @swiglu_backward.register_fake
    def _(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty_like(a), torch.empty_like(b)

    def _setup(ctx: object, inputs: tuple[torch.Tensor, torch.Tensor], output: torch.Tensor) -> None:
        ctx.save_for_backward(*inputs)  # type: ignore[attr-defined]

    def _backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = ctx.saved_tensors  # type: ignore[attr-defined]
        return swiglu_backward(grad, a, b)

    swiglu.register_autograd(_backward, setup_context=_setup)
else:

    def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"the fused SwiGLU needs torch.library.custom_op (torch >= 2.4), not {torch.__version__}")


@dataclass(frozen=True)
class FusedConfig:
    """Which parts run fused; the rest eager."""

    attn: Mode = "eager"
    norm: Mode = "eager"
    mlp: Mode = "eager"
    optim: Mode = "eager"
    dim: int = 32
    heads: int = 2

    def with_part(self, part: str, mode: Mode) -> "FusedConfig":
        return replace(self, **{part: mode})

    def label(self) -> str:
        fused = [p for p in PARTS if getattr(self, p) == "fused"]
        return "+".join(fused) if fused else "eager"

    @property
    def family(self) -> str:
        """The benchmark's model name for this configuration: ``fused-attn``, ``fused-eager``."""
        return f"fused-{self.label()}"


def config_of(family: str) -> FusedConfig:
    """The configuration a ``fused-<parts>`` model name stands for.

    >>> config_of("fused-attn+optim").attn, config_of("fused-eager").attn
    ('fused', 'eager')
    """
    label = family.removeprefix("fused-")
    parts = [] if label == "eager" else label.split("+")
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not family.startswith("fused-"):
        raise ValueError(f"unknown fused model {family!r}")
    config = FusedConfig()
    for part in parts:
        config = config.with_part(part, "fused")
    return config


class RMSNorm(nn.Module):
    def __init__(self, dim: int, mode: Mode, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.mode, self.eps = mode, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "fused":
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class AttentionCore(nn.Module):
    """softmax(q k^T / sqrt(d), causal) v: one fused op, or the eager chain."""

    def __init__(self, mode: Mode) -> None:
        super().__init__()
        self.mode = mode
        self.register_buffer("causal", torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.mode == "fused":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        t = q.shape[-2]
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        scores = scores.masked_fill(self.causal[:t, :t], float("-inf"))
        return torch.softmax(scores, dim=-1) @ v


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, mode: Mode) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.core = AttentionCore(mode)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = self.core(q, k, v).transpose(1, 2).reshape(b, t, d)
        return self.proj(y)


class SwiGLU(nn.Module):
    def __init__(self, mode: Mode) -> None:
        super().__init__()
        self.mode = mode

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return swiglu(a, b) if self.mode == "fused" else F.silu(a) * b


class MLP(nn.Module):
    def __init__(self, dim: int, mode: Mode) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, 2 * dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.act = SwiGLU(mode)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate(x), self.up(x)))


class FusedBlock(nn.Module):
    """Embedding, one pre-norm block (attention, SwiGLU MLP), a final norm and a vocabulary head."""

    def __init__(self, config: FusedConfig) -> None:
        super().__init__()
        d = config.dim
        self.embed = nn.Embedding(VOCAB, d)
        self.norm1 = RMSNorm(d, config.norm)
        self.attn = Attention(d, config.heads, config.attn)
        self.norm2 = RMSNorm(d, config.norm)
        self.mlp = MLP(d, config.mlp)
        self.norm_f = RMSNorm(d, config.norm)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = x + self.attn(self.norm1(x))
        x = x + self.mlp(self.norm2(x))
        return self.head(self.norm_f(x))


@dataclass
class FusedWorkload:
    """A model of one configuration, its batch and one training step."""

    config: FusedConfig
    model: FusedBlock
    batch: tuple[torch.Tensor, torch.Tensor]

    def make_optimizer(self) -> torch.optim.Optimizer:
        fused = self.config.optim == "fused"
        return torch.optim.AdamW(self.model.parameters(), lr=1e-2, fused=fused, foreach=None if fused else True)

    def train_step(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        tokens, targets = self.batch
        logits = self.model(tokens)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def build_fused(config: FusedConfig, seed: int = 1234) -> FusedWorkload:
    """A fresh workload; equal seeds give bitwise-equal weights and batches whatever the config."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = FusedBlock(config).train()
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    torch.manual_seed(seed)
    return FusedWorkload(config, model, (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
