"""Small models shared by tests and benchmarks: built from a seed, no downloads, fast on one core.

>>> model = make_model("mlp"); batch = example_batch("mlp")
>>> opt = make_optimizer(model)
>>> float(train_step(model, opt, batch)) > 0
True

Every model maps ``batch[0]`` to logits (last dimension = classes) and ``train_step`` applies
cross-entropy against ``batch[1]``, so one loop trains any of them. GPT-2 is transformers'
``GPT2LMHeadModel`` with random weights (module paths as in transformers:
``transformer.h.0.mlp.c_fc``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

MODELS = ("mlp", "convnet", "transformer", "lstm", "gpt2")
CLASSES = 10
GPT2_VOCAB = 64


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act1 = nn.ReLU()
        self.fc2 = nn.Linear(32, 32)
        self.act2 = nn.GELU()
        self.fc3 = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.act2(self.fc2(self.act1(self.fc1(x)))))


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.act = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.act(self.bn1(self.conv1(x))))
        x = self.act(self.bn2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


class TransformerBlock(nn.Module):
    """Pre-norm attention + MLP block with a per-token classification head."""

    def __init__(self, dim: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=0.1, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        x = x + self.mlp(self.ln2(x))
        return self.head(x)


class LSTMClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=GPT2_VOCAB, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config)


_BUILDERS: dict[str, Any] = {
    "mlp": MLP,
    "convnet": ConvNet,
    "transformer": TransformerBlock,
    "lstm": LSTMClassifier,
    "gpt2": _gpt2,
}


def make_model(name: str, seed: int = 0) -> nn.Module:
    """A freshly initialised model ``name`` (one of :data:`MODELS`); same seed, same weights."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; choose from {MODELS}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _BUILDERS[name]()
    return model.train()


def example_batch(name: str, seed: int = 0, batch: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)`` for model ``name``, the same for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    if name == "mlp":
        return torch.randn(batch, 16, generator=gen), torch.randint(0, CLASSES, (batch,), generator=gen)
    if name == "convnet":
        return torch.randn(batch, 3, 8, 8, generator=gen), torch.randint(0, CLASSES, (batch,), generator=gen)
    if name == "transformer":
        return torch.randn(batch, 6, 32, generator=gen), torch.randint(0, CLASSES, (batch, 6), generator=gen)
    if name == "lstm":
        return torch.randn(batch, 5, 8, generator=gen), torch.randint(0, CLASSES, (batch,), generator=gen)
    if name == "gpt2":
        tokens = torch.randint(0, GPT2_VOCAB, (batch, 9), generator=gen)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    raise ValueError(f"unknown model {name!r}; choose from {MODELS}")


def make_optimizer(model: nn.Module, kind: str = "adam") -> torch.optim.Optimizer:
    """Adam (lr 1e-2; "adam-foreach": over parameter lists, as on accelerators; "adamw-fused": one
    fused kernel a step, torch 2.4+ on the CPU) or SGD with momentum (lr 0.1) over ``model``'s
    parameters."""
    if kind in ("adam", "adam-foreach"):
        return torch.optim.Adam(model.parameters(), lr=1e-2, foreach=kind == "adam-foreach")
    if kind == "adamw-fused":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    raise ValueError(f"unknown optimizer {kind!r}")


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a model output (a tensor, or transformers' ``ModelOutput``)."""
    return output if isinstance(output, torch.Tensor) else output.logits


def loss_of(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy of ``model(batch[0])`` against ``batch[1]``."""
    logits = logits_of(model(batch[0]))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[1].reshape(-1))


def train_step(model: nn.Module, opt: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Forward, backward, optimizer step, zero_grad; returns the loss (detached)."""
    loss = loss_of(model, batch)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()
