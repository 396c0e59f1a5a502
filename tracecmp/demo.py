"""The built-in demo: the whole job on a small transformer, with no downloads.

A bench run trains :class:`TinyTransformer` in fp32 on the CPU; a target run trains the same
seeded model under an emulated fault (an NPU whose matrix units compute in fp16, GELU swapped
for its tanh approximation in one layer, a softmax kernel working in fp16). Both are captured,
compared, and the report is written.

Dispatch-level faults are a ``TorchDispatchMode`` entered *before* :class:`tracecmp.TraceCompare`:
the most recently entered mode sees each call first, so capture sees the call, hands it to the
fault mode, and records the faulty outputs, as it would on the real device.

>>> from tracecmp.demo import run_demo
>>> outcome = run_demo("tracecmp-demo", fault="gelu-tanh")      # doctest: +SKIP
>>> outcome.result.first_divergence.module
'blocks.1.mlp.act'
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

VOCAB = 96
DIM = 48
HEADS = 4
LAYERS = 3
SEQ = 16
BATCH = 4
# A static loss scale, GradScaler's initial 2**16 as fp16 training starts with, on a token-summed loss.
LOSS_SCALE = 2.0**16


class Attention(nn.Module):
    """Causal multi-head self-attention written out in plain ops (no fused kernel hides the matmuls)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).split(dim, dim=-1)
        q, k, v = (t.reshape(batch, seq, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(dim // self.heads)
        mask = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        weights = F.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        return self.proj((weights @ v).transpose(1, 2).reshape(batch, seq, dim))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


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


class TinyTransformer(nn.Module):
    """A GPT-shaped language model small enough to capture in a second on a CPU."""

    def __init__(
        self, vocab: int = VOCAB, dim: int = DIM, heads: int = HEADS, layers: int = LAYERS, seq: int = SEQ
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class _RoundInputs(TorchDispatchMode):
    """Runs the chosen ops on floating inputs rounded to ``dtype`` (and, optionally, outputs too).

    Emulates a device whose units for these ops read ``dtype``: the op's result differs from fp32
    while every tensor feeding it is still the same, which is exactly what localization looks for.
    """

    def __init__(self, ops: set[Any], dtype: torch.dtype, round_outputs: bool = False) -> None:
        super().__init__()
        self.ops = ops
        self.dtype = dtype
        self.round_outputs = round_outputs

    def _round(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != self.dtype:
            return value.to(self.dtype).to(value.dtype)
        return value

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.overloadpacket not in self.ops:
            return func(*args, **kwargs)
        out = func(*tree_map(self._round, args), **tree_map(self._round, kwargs))
        return tree_map(self._round, out) if self.round_outputs else out


_MATRIX_OPS = {
    torch.ops.aten.mm,
    torch.ops.aten.addmm,
    torch.ops.aten.bmm,
    torch.ops.aten.baddbmm,
    torch.ops.aten.convolution,
}


def _fp16_matrix_units(model: nn.Module) -> ContextManager[Any]:
    # Rounding alone reads as uniform low-precision noise (like TF32); fp16's range is what breaks:
    # the loss-scaled gradient of the head's weight exceeds 65504 and becomes Inf.
    return _RoundInputs(_MATRIX_OPS, torch.float16, round_outputs=True)


def _gelu_tanh(model: nn.Module) -> ContextManager[Any]:
    model.blocks[1].mlp.act = nn.GELU(approximate="tanh")  # type: ignore[index, union-attr]
    return contextlib.nullcontext()


def _fp16_softmax(model: nn.Module) -> ContextManager[Any]:
    return _RoundInputs({torch.ops.aten._softmax}, torch.float16, round_outputs=True)


@dataclass(frozen=True)
class Fault:
    """An emulated target-side fault: what it is, where it should be found, how to apply it."""

    name: str
    description: str
    module: str  # where a correct localization points
    op: str  # the op it should name
    apply: Callable[[nn.Module], ContextManager[Any]]  # may change the model; returns a context to run under


FAULTS: dict[str, Fault] = {
    fault.name: fault
    for fault in (
        Fault(
            "fp16-matmul",
            "an NPU whose matrix units (mm/addmm/bmm/conv) compute in fp16, where the loss-scaled "
            "gradient overflows 65504",
            "head",
            "aten.mm.default",
            _fp16_matrix_units,
        ),
        Fault(
            "gelu-tanh",
            "GELU replaced by its tanh approximation in the second block",
            "blocks.1.mlp.act",
            "aten.gelu.default",
            _gelu_tanh,
        ),
        Fault(
            "softmax-fp16",
            "a softmax kernel that computes in fp16",
            "blocks.0.attn",
            "aten._softmax.default",
            _fp16_softmax,
        ),
    )
}


def build_model(seed: int = 1234) -> nn.Module:
    """The demo model with weights that depend on ``seed`` only (drawn on the CPU)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyTransformer()


def train(model: nn.Module, steps: int, seed: int = 1234, on_step: Callable[[], None] | None = None) -> list[float]:
    """A few AdamW steps of next-token prediction on seeded random tokens; returns the mean losses.

    The loss is summed over tokens and scaled by :data:`LOSS_SCALE` for backward, then the
    gradients are unscaled, as fp16 training does to keep small gradients from underflowing.
    """
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    device = next(model.parameters()).device
    if device.type != "cpu":
        tokens = tokens.to(device)  # drawn on the CPU, then moved: the same tokens on every device
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    losses = []
    for _ in range(steps):
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="sum")
        (loss * LOSS_SCALE).backward()
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.grad.div_(LOSS_SCALE)  # type: ignore[union-attr]
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item() / targets.numel())
        if on_step is not None:
            on_step()
    return losses


def capture_run(path: Path, fault: Fault | None, steps: int, seed: int, device: str = "cpu") -> list[float]:
    """Train one run on ``device`` under capture (and under ``fault`` when given); returns its losses."""
    import tracecmp

    model = build_model(seed).to(device)
    context = fault.apply(model) if fault is not None else contextlib.nullcontext()
    # The emulated NPU says what a real one's trace says: its float32 matrix units may run at
    # reduced precision, so compare treats TF32/HF32-sized rounding there as noise.
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if fault is not None else "highest")
    try:
        # The fault context is entered first so that capture, entered last, sees every call first.
        # As in `tracecmp record`, nothing is said about the training: the model is found as it
        # runs and every optimizer.step() ends a step.
        with context, tracecmp.TraceCompare(path, stack=True, overwrite=True):
            return train(model, steps, seed)
    finally:
        torch.set_float32_matmul_precision(precision)


@dataclass
class DemoOutcome:
    """What a demo run produced: the comparison, the report, and whether it found the fault."""

    fault: Fault
    result: Any  # tracecmp.CompareResult
    report: Path
    bench_losses: list[float]
    target_losses: list[float]

    @property
    def found(self) -> bool:
        d = self.result.first_divergence
        return d is not None and d.module == self.fault.module


def load_emulated_npu() -> Any:
    """The emulated NPU of tracecmp's source checkout (``workloads/emulated_npu``), built and loaded.

    It is a test device, not part of the installed package: it is loaded from beside this package's
    folder, so only a checkout (or an editable install) has it. :class:`TracecmpError` says why it
    cannot be used (no checkout, no compiler, a torch that cannot host it).
    """
    from tracecmp.errors import TracecmpError

    init = Path(__file__).resolve().parents[1] / "workloads" / "emulated_npu" / "__init__.py"
    if not init.exists():
        raise TracecmpError(
            f"--emulated-npu needs tracecmp's source checkout: the emulated npu lives in its "
            f"workloads/emulated_npu, which is not beside this installation ({init.parents[2]})"
        )
    spec = importlib.util.spec_from_file_location("tracecmp_emulated_npu", init)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        module.load()
    except (module.EmulatorUnavailable, RuntimeError, OSError) as exc:
        raise TracecmpError(f"the emulated npu cannot be used here: {exc}") from exc
    return module


def run_demo(
    out_dir: str | Path = "tracecmp-demo",
    fault: str = "fp16-matmul",
    steps: int = 2,
    seed: int = 1234,
    emulated_npu: bool = False,
) -> DemoOutcome:
    """Capture a bench and a faulty target run, compare them, write the report to ``out_dir``.

    ``emulated_npu`` runs the target on the emulated NPU (:func:`load_emulated_npu`) instead of
    the CPU: capture then takes the accelerator path (statistics deferred on the device).

    >>> run_demo("tracecmp-demo").found   # doctest: +SKIP
    True
    """
    from tracecmp.comparison import compare
    from tracecmp.errors import TracecmpError
    from tracecmp.render import write_report

    if fault not in FAULTS:
        raise TracecmpError(f"unknown fault {fault!r}; choose one of {', '.join(FAULTS)}")
    if steps < 1:
        raise TracecmpError(f"steps must be at least 1, got {steps}")
    chosen = FAULTS[fault]
    out = Path(out_dir)
    bench_path, target_path = out / "traces" / "bench", out / "traces" / "target"
    if emulated_npu:
        load_emulated_npu()
    bench_losses = capture_run(bench_path, None, steps, seed)
    target_losses = capture_run(target_path, chosen, steps, seed, "npu" if emulated_npu else "cpu")
    result = compare(target_path, bench_path)
    result.write_tables(out)
    report = write_report(result, out)
    return DemoOutcome(chosen, result, report, bench_losses, target_losses)
