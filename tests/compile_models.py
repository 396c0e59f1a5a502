"""A small transformer for ``torch.compile`` tests, and a backend that counts what it compiles and runs.

>>> model = TinyGPT(); batch = tiny_batch()
>>> float(model(*batch)) > 0
True
>>> backend = CountingBackend("aot_eager")
>>> compiled = torch.compile(TinyGPT(), backend=backend)
>>> _ = compiled(*batch); (backend.compiles, backend.runs)
(1, 1)
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 64


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(x).split(d, dim=-1))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        y = (att.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.fc(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Embedding, ``layers`` pre-norm blocks, final norm, head, cross-entropy loss.

    ``graph_break=True`` breaks Dynamo's graph after the first block and runs ``between`` (eager,
    outside any compiled region) on the activations there.
    """

    def __init__(self, layers: int = 2, dim: int = 32, heads: int = 4, graph_break: bool = False,
                 between: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)
        self.graph_break = graph_break
        self.between = between

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](self.emb(idx))
        if self.graph_break:  # outside any loop: Dynamo resumes after it in a second graph
            torch._dynamo.graph_break()
            x = self.between(x) if self.between is not None else x
        for block in self.blocks[1:]:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def tiny_batch(seed: int = 0, batch: int = 2, length: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=g), torch.randint(0, VOCAB, (batch, length), generator=g)


class CountingBackend:
    """A ``torch.compile`` backend that hands every graph to ``inner`` and counts compiles and runs.

    ``runs`` counts calls of compiled code: a step that ran eagerly leaves it unchanged.
    """

    def __init__(self, inner: str) -> None:
        self.inner = inner
        self.compiles = 0
        self.runs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.compiles += 1
        compiled = torch._dynamo.lookup_backend(self.inner)(gm, example_inputs)

        def run(*args: Any) -> Any:
            self.runs += 1
            return compiled(*args)

        return run
