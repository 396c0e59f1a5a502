"""The five model families the localization benchmark trains for one step each.

Each :class:`Workload` is built from a seed, so a target and a bench build hold the same weights
and inputs bit for bit. They are small (a training step in well under a second on one core) but
use the ops that matter: matmuls, conv, batch/layer norm, softmax, GELU/LeakyReLU (which carry
the non-tensor arguments the argument faults change), LSTM cell ops and a real GPT-2.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterator

import torch
import torch.nn.functional as F
from torch import nn

FAMILIES = ("mlp", "convnet", "lstm", "transformer", "gpt2")


@dataclass
class Workload:
    """A model, its inputs and one training step: forward, backward, optimizer step."""

    name: str
    model: nn.Module
    batch: tuple[torch.Tensor, ...]
    loss_fn: Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    context: Callable[[], ContextManager[None]] = contextlib.nullcontext

    def train_step(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        with self.context():
            loss = self.loss_fn(self.model, self.batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return loss.detach()


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.act1 = nn.GELU()
        self.fc2 = nn.Linear(64, 64)
        self.act2 = nn.LeakyReLU(0.01)
        self.fc3 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.act2(self.fc2(self.act1(self.fc1(x)))))


class _ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.act1 = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.act2 = nn.LeakyReLU(0.01)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.act1(self.bn1(self.conv1(x))))
        x = self.act2(self.bn2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


class _LSTMLM(nn.Module):
    def __init__(self, vocab: int = 50) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 16)
        self.lstm = nn.LSTM(16, 32, batch_first=True)
        self.head = nn.Linear(32, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(ids))
        return self.head(out)


class _Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        weights = F.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        return self.proj((weights @ v).transpose(1, 2).reshape(b, t, d))


class _Block(nn.Module):
    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = _Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


@contextlib.contextmanager
def _no_mkldnn() -> Iterator[None]:
    # Without oneDNN the CPU LSTM runs as separate cell ops (addmm, sigmoid, tanh, mul, add),
    # which is what an accelerator's unfused path and most fault sites look like.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the flags context warns about oneDNN tf32 on Intel GPUs
        with torch.backends.mkldnn.flags(enabled=False):
            yield


def build(family: str, seed: int = 1234) -> Workload:
    """A fresh workload of ``family``; equal seeds give bitwise-equal weights and inputs.

    >>> w = build("mlp"); opt = w.make_optimizer(w.model); float(w.train_step(opt)) > 0
    True
    """
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    if family == "mlp":
        model: nn.Module = _MLP()
        batch: tuple[torch.Tensor, ...] = (torch.randn(16, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen))
        return Workload(family, model, batch, lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                        lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
    if family == "convnet":
        model = _ConvNet()
        batch = (torch.randn(4, 3, 16, 16, generator=gen), torch.randint(0, 10, (4,), generator=gen))
        return Workload(family, model, batch, lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                        lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4))
    if family == "lstm":
        model = _LSTMLM()
        ids = torch.randint(0, 50, (4, 7), generator=gen)
        return Workload(family, model, (ids,),
                        lambda m, b: F.cross_entropy(m(b[0][:, :-1]).reshape(-1, 50), b[0][:, 1:].reshape(-1)),
                        lambda m: torch.optim.Adam(m.parameters(), lr=1e-3), context=_no_mkldnn)
    if family == "transformer":
        model = _Block()
        batch = (torch.randn(2, 8, 32, generator=gen), torch.randn(2, 8, 32, generator=gen))
        return Workload(family, model, batch, lambda m, b: F.mse_loss(m(b[0]), b[1]),
                        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))
    if family == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=32,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        model = GPT2LMHeadModel(config)
        ids = torch.randint(0, 128, (2, 12), generator=gen)
        return Workload(family, model, (ids,), lambda m, b: m(b[0], labels=b[0]).loss,
                        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))
    raise ValueError(f"unknown model family {family!r}; choose from {FAMILIES}")
