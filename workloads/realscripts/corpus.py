"""The real-script corpus (issue #34): the three training scripts beside this file, the small sizes
every run of them gets, and their variants (a target's options, its bench's options, and what issue
#34 asks tracecmp to say of the pair).

The scripts know nothing of tracecmp and run as users run them (``python nanogpt_train.py ...``);
:mod:`workloads.realscripts.runner` records them with ``tracecmp record`` and judges each pair.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path

SCRIPT_DIR = Path(__file__).resolve().parent  # where the training scripts live


@dataclass(frozen=True)
class Script:
    name: str
    file: str
    args: tuple[str, ...]  # the small size every run of the script gets
    tiny: tuple[str, ...] = ()  # smaller still (the CI test); appended after args

    @property
    def path(self) -> Path:
        return SCRIPT_DIR / self.file


@dataclass(frozen=True)
class Expect:
    """What issue #34 asks of a variant. ``module`` is None for a clean pair (AGREE, exit 0);
    otherwise the first root's module, one of ``ops`` as a substring of its op, and ``single`` when
    it must be the only root (the bug sits in one module)."""

    module: str | None = None
    ops: tuple[str, ...] = ()
    single: bool = True
    note: str = ""
    also: tuple[str, ...] = ()  # other modules that are as right an answer
    # The bug changes no value in the recorded steps: AGREE, exit 0, and a note naming the module and
    # the op the target computes with instead (a root needs a value that differs).
    equal_values: bool = False

    def modules(self) -> tuple[str, ...]:
        return () if self.module is None else (self.module, *self.also)

    def describe(self) -> str:
        if self.module is None:
            return "AGREE, exit 0"
        where = f"{'|'.join(self.ops) or '?'} in {' or '.join(m or '<top>' for m in self.modules())}"
        if self.equal_values:
            return f"AGREE, exit 0, a note: {where} computes with another op"
        return where + (", only root" if self.single else "")


@dataclass(frozen=True)
class Variant:
    script: str
    name: str
    target: tuple[str, ...]  # the target's options
    bench: tuple[str, ...]  # the bench's options (float32, no bug)
    expect: Expect
    description: str = ""


SCRIPTS = {
    "nanogpt": Script(
        "nanogpt",
        "nanogpt_train.py",
        ("--max-iters", "2", "--eval-iters", "2", "--n-layer", "2", "--n-embd", "32", "--block-size", "32"),
        tiny=("--max-iters", "1", "--eval-iters", "1", "--n-embd", "16", "--block-size", "16", "--batch-size", "2"),
    ),
    "hf_trainer": Script(
        "hf_trainer",
        "hf_trainer.py",
        ("--max-steps", "3", "--n-layer", "2", "--n-embd", "32", "--seq-len", "32"),
        tiny=("--max-steps", "2", "--n-embd", "16", "--seq-len", "16", "--batch-size", "2", "--num-samples", "16"),
    ),
    "vision": Script(
        "vision",
        "vision_train.py",
        ("--max-steps", "3", "--image-size", "16", "--batch-size", "8"),
        tiny=("--max-steps", "2", "--image-size", "8", "--batch-size", "4", "--num-samples", "16"),
    ),
}

_NANO_NOFLASH = ("--no-flash",)
_HF_EAGER = ("--attn-implementation", "eager")

VARIANTS = [
    # nanoGPT: eval loop of loss.item() before step 0, 2 micro-batches, clipping, cosine LR, checkpoint
    Variant("nanogpt", "clean-bf16", ("--dtype", "bfloat16"), (), Expect(), "bf16 autocast, flash attention (SDPA)"),
    Variant(
        "nanogpt",
        "clean-bf16-noflash",
        ("--dtype", "bfloat16", *_NANO_NOFLASH),
        _NANO_NOFLASH,
        Expect(),
        "bf16 autocast, hand-written attention",
    ),
    Variant(
        "nanogpt",
        "clean-noflash-vs-flash",
        _NANO_NOFLASH,
        (),
        Expect(),
        "float32 hand-written attention against the float32 SDPA bench (same math, other ops)",
    ),
    Variant(
        "nanogpt",
        "bug-ln-eps",
        ("--bug", "ln-eps"),
        (),
        Expect("transformer.h.1.ln_2", ("layer_norm",)),
        "block 1's ln_2 eps 1e-6 instead of 1e-5",
    ),
    Variant(
        "nanogpt",
        "bug-gelu-tanh",
        ("--bug", "gelu-tanh"),
        (),
        Expect("transformer.h.1.mlp.gelu", ("gelu",)),
        "block 1's GELU with the tanh approximation",
    ),
    Variant(
        "nanogpt",
        "bug-attn-scale",
        ("--bug", "attn-scale"),
        (),
        Expect("transformer.h.1.attn", ("scaled_dot_product", "attention")),
        "block 1's SDPA with scale 1/d instead of 1/sqrt(d)",
    ),
    Variant(
        "nanogpt",
        "bug-attn-scale-noflash",
        ("--bug", "attn-scale", *_NANO_NOFLASH),
        _NANO_NOFLASH,
        Expect("transformer.h.1.attn", ("mul",)),
        "block 1's hand-written attention scaled by 1/d instead of 1/sqrt(d)",
    ),
    Variant(
        "nanogpt",
        "bug-softmax-bf16",
        ("--bug", "softmax-bf16", *_NANO_NOFLASH),
        _NANO_NOFLASH,
        Expect("transformer.h.1.attn", ("softmax", "_to_copy")),
        "block 1's softmax in bfloat16, against the hand-written-attention bench",
    ),
    Variant(
        "nanogpt",
        "bug-softmax-bf16-vs-flash",
        ("--bug", "softmax-bf16"),
        (),
        Expect("transformer.h.1.attn", ("softmax", "_to_copy", "attention")),
        "block 1 hand-written with a bfloat16 softmax, against the SDPA bench",
    ),
    # transformers.Trainer: GPT-2 from a config, grad accumulation 2, bf16 through TrainingArguments
    Variant("hf_trainer", "clean-bf16", ("--bf16",), (), Expect(), "bf16 (accelerate's autocast), SDPA attention"),
    Variant(
        "hf_trainer",
        "clean-bf16-eager",
        ("--bf16", *_HF_EAGER),
        _HF_EAGER,
        Expect(),
        "bf16 (accelerate's autocast), eager attention",
    ),
    Variant(
        "hf_trainer",
        "bug-ln-eps",
        ("--bug", "ln-eps"),
        (),
        Expect("transformer.h.0.ln_1", ("layer_norm",), single=False, note="config-wide: every LayerNorm"),
        "config layer_norm_epsilon=1e-6 (every LayerNorm)",
    ),
    Variant(
        "hf_trainer",
        "bug-gelu",
        ("--bug", "gelu"),
        (),
        Expect("transformer.h.0.mlp.act", ("gelu", "tanh", "pow", "mul"), single=False, note="config-wide"),
        'config activation_function="gelu" instead of "gelu_new" (every MLP)',
    ),
    Variant(
        "hf_trainer",
        "bug-attn-scale",
        ("--bug", "attn-scale"),
        (),
        Expect("transformer.h.0.attn", ("scaled_dot_product", "attention"), single=False, note="config-wide"),
        "config scale_attn_weights=False (every block)",
    ),
    Variant(
        "hf_trainer",
        "bug-layer-scale",
        ("--bug", "layer-scale"),
        (),
        Expect("transformer.h.1.attn", ("scaled_dot_product", "attention")),
        "config scale_attn_by_inverse_layer_idx=True (block 1's scores halved; block 0 unchanged)",
    ),
    Variant(
        "hf_trainer",
        "bug-softmax-bf16",
        ("--bug", "softmax-bf16"),
        _HF_EAGER,
        Expect("transformer.h.0.attn", ("softmax", "_to_copy"), single=False, note="every block"),
        "a custom attention function with a bfloat16 softmax, against the eager-attention bench",
    ),
    # vision: ResNet-ish CNN, nn.Module transforms in 2 DataLoader workers, SGD momentum
    Variant("vision", "clean-fp32-rerun", (), (), Expect(), "the bench's own command again (workers, determinism)"),
    Variant("vision", "clean-bf16", ("--dtype", "bfloat16"), (), Expect(), "bf16 autocast"),
    Variant("vision", "bug-bn-eps", ("--bug", "bn-eps"), (), Expect("bn1", ("batch_norm",)), "stem BatchNorm eps 1e-3"),
    Variant(
        "vision",
        "bug-pool-swap",
        ("--bug", "pool-swap"),
        (),
        Expect("maxpool", ("avg_pool2d", "max_pool2d")),
        "stem max-pool replaced by an average pool",
    ),
    Variant(
        "vision",
        "bug-relu6",
        ("--bug", "relu6"),
        (),
        Expect("layer1.0.relu", ("hardtanh", "clamp"), equal_values=True),
        "layer1.0 uses ReLU6 (no activation exceeds 6 at this size: an op change with equal values)",
    ),
    Variant(
        "vision",
        "bug-norm-bf16",
        ("--bug", "norm-bf16"),
        (),
        Expect("", ("source",), also=("conv1",), note="the input batch (made in the workers) or its first reader"),
        "Normalize transform computed in bfloat16 in the DataLoader workers: the model's input differs",
    ),
]


def select(scripts: list[str] | None = None, patterns: list[str] | None = None) -> list[Variant]:
    """The variants of ``scripts`` (all when None) whose name matches one of ``patterns`` (fnmatch)."""
    chosen = []
    for v in VARIANTS:
        if scripts and v.script not in scripts:
            continue
        if patterns and not any(fnmatch.fnmatchcase(v.name, p) for p in patterns):
            continue
        chosen.append(v)
    return chosen


def variant(script: str, name: str) -> Variant:
    """The variant ``name`` of ``script`` (KeyError when there is none)."""
    for v in VARIANTS:
        if v.script == script and v.name == name:
            return v
    raise KeyError(f"no variant {name!r} of {script!r}")
