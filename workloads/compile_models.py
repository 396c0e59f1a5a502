"""A small transformer for ``torch.compile`` tests, a backend that counts what it compiles and runs,
and a graph pass that miscompiles one node on purpose.

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
import operator
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
    """Causal-free softmax attention. ``heads_layout="split"`` splits the projection into q, k, v
    and lays out each one's heads; ``"unbind"`` lays out the heads of all three at once and unbinds
    them (nanoGPT's and timm's ``view(B, T, 3, H, hd).permute(2, 0, 3, 1, 4).unbind(0)``)."""

    def __init__(self, dim: int, heads: int, heads_layout: str = "split") -> None:
        super().__init__()
        if heads_layout not in ("split", "unbind"):
            raise ValueError(f"heads_layout is 'split' or 'unbind', not {heads_layout!r}")
        self.heads = heads
        self.heads_layout = heads_layout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        if self.heads_layout == "unbind":
            q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        else:
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
    def __init__(self, dim: int, heads: int, heads_layout: str = "split") -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, heads_layout)
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
    ``heads_layout`` is how attention lays out its heads (:class:`Attention`).
    """

    def __init__(
        self,
        layers: int = 2,
        dim: int = 32,
        heads: int = 4,
        graph_break: bool = False,
        between: Callable[[torch.Tensor], torch.Tensor] | None = None,
        custom_gelu: bool = False,
        heads_layout: str = "split",
    ) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, heads_layout) for _ in range(layers))
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


try:  # torch >= 2.6 asks inductor's custom passes for this interface (a plain callable before)
    from torch._inductor.custom_graph_pass import CustomGraphPass as _GraphPass
except ImportError:  # pragma: no cover - older torch
    _GraphPass = object  # type: ignore[assignment,misc]


class ScaleNode(_GraphPass):  # type: ignore[misc,valid-type]
    """A joint-graph pass that multiplies the value of the first node ``pick`` accepts by
    ``factor``: a compiled region that computes something else than the eager program.

    Set it as ``torch._inductor.config.joint_custom_post_pass`` while a model compiles; inductor
    and tracecmp's record of the graph both run it. The product carries the scaled node's
    metadata (module, source line, eager op), as inductor's own rewrites do; ``scaled`` is its
    name in the last graph the pass rewrote.
    """

    def __init__(self, pick: Callable[[torch.fx.Node], bool], factor: float) -> None:
        self.pick = pick
        self.factor = factor
        self.scaled = ""

    def __call__(self, graph: torch.fx.Graph) -> None:
        node = next((n for n in graph.nodes if self.pick(n)), None)
        if node is None:
            return
        with graph.inserting_after(node):
            scaled = graph.call_function(torch.ops.aten.mul.Tensor, (node, self.factor))
        node.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)
        scaled.meta.update(node.meta)
        self.scaled = scaled.name

    def uuid(self) -> None:
        return None  # not cacheable: a compile with it never reuses one without it


def unbind_output(index: int) -> Callable[[torch.fx.Node], bool]:
    """Picks output ``index`` of an ``unbind`` (attention's k for 1 in ``heads_layout="unbind"``)."""

    def pick(node: torch.fx.Node) -> bool:
        source = node.args[0] if node.target is operator.getitem and node.args else None
        return (
            isinstance(source, torch.fx.Node) and source.target is torch.ops.aten.unbind.int and node.args[1] == index
        )

    return pick
