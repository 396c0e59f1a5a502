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
from torch._dynamo.backends.registry import lookup_backend

VOCAB = 64
# Faults the tests switch on without recompiling anything: read at run time by code that
# torch.compile runs as it is (an eager function between graphs, a custom op's kernel).
FAULTS = {"between": 2.0, "gelu": 1.0}


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q = q.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, d // self.heads).transpose(1, 2)
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

    ``graph_break=True`` breaks Dynamo's graph after the first block and runs ``between`` there
    on the activations, eagerly (``torch.compiler.disable``): outside any compiled region.
    ``custom_gelu=True`` computes the last block's GELU with :func:`custom_gelu`.
    """

    def __init__(self, layers: int = 2, dim: int = 32, heads: int = 4, graph_break: bool = False,
                 between: Callable[[torch.Tensor], torch.Tensor] | None = None, custom_gelu: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        if custom_gelu:  # the last block's GELU as a custom op inductor calls as it is
            self.blocks[-1].mlp.act = CustomGELU()
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)
        self.graph_break = graph_break
        self.between = torch.compiler.disable(between) if between is not None else None

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](self.emb(idx))
        if self.graph_break:  # outside any loop: Dynamo resumes after it in a second graph
            if self.between is not None:
                x = self.between(x)
            else:
                torch._dynamo.graph_break()
        for block in self.blocks[1:]:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def tiny_batch(seed: int = 0, batch: int = 2, length: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=g), torch.randint(0, VOCAB, (batch, length), generator=g)


class CountingBackend:
    """A ``torch.compile`` backend that hands every graph to ``inner`` and counts compiles and runs.

    ``runs`` counts calls of compiled code: a step that ran eagerly leaves it unchanged. It is
    named after the backend it hands graphs to (``__name__``, what torch and tracecmp read).
    """

    def __init__(self, inner: str) -> None:
        self.inner = inner
        self.__name__ = inner
        self.compiles = 0
        self.runs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.compiles += 1
        compiled = lookup_backend(self.inner)(gm, example_inputs)

        def run(*args: Any) -> Any:
            self.runs += 1
            return compiled(*args)

        return run


def between_blocks(x: torch.Tensor) -> torch.Tensor:
    """What TinyGPT runs between its graphs: ``tanh(x) * FAULTS["between"]`` (2.0 when correct)."""
    return torch.tanh(x) * FAULTS["between"]


def _gelu_kernel(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x) * FAULTS["gelu"]


def _gelu_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.save_for_backward(inputs[0])


def _gelu_backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
    (x,) = ctx.saved_tensors
    return torch.ops.aten.gelu_backward(grad, x)


if hasattr(torch.library, "custom_op"):  # torch >= 2.4; older ones compile no TinyGPT(custom_gelu=True)
    _op = torch.library.custom_op("tracecmp_tests::gelu", _gelu_kernel, mutates_args=())
    _op.register_fake(lambda x: torch.empty_like(x))
    _op.register_autograd(_gelu_backward, setup_context=_gelu_setup)


def custom_gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU as a custom op (``tracecmp_tests::gelu``): a kernel inductor calls as it is.
    ``FAULTS["gelu"]`` scales its output (1.0 when correct): a wrong kernel inside a compiled region."""
    return torch.ops.tracecmp_tests.gelu(x)


class CustomGELU(nn.Module):
    """``nn.GELU`` computed by :func:`custom_gelu`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return custom_gelu(x)
