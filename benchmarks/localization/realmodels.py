"""Real-size models for the localization benchmark, built from configs with random weights.

Four families, each at the size people train (no download, no torchvision):

- ``gpt2-small``: transformers' ``GPT2LMHeadModel`` with ``GPT2Config()`` defaults (124M
  parameters, 12 layers, d768), batch 2 x 128 tokens, AdamW;
- ``bert-base``: ``BertForMaskedLM`` with ``BertConfig()`` defaults (110M), batch 2 x 128 tokens
  with 15% of them masked, AdamW;
- ``resnet50``: ``ResNetForImageClassification`` from a ``ResNetConfig`` of ResNet-50's
  bottleneck stages (25.6M), batch 8 x 3 x 224 x 224, SGD with momentum and weight decay;
- ``llama8``: ``LlamaForCausalLM`` of 8 layers at d1024 (RMSNorm, RoPE, SwiGLU, 16 heads,
  32000 tokens; 134M), batch 2 x 128 tokens, AdamW.

One more, on request only (``--models bert-padded``, not among the defaults):

- ``bert-padded``: ``bert-base`` with transformers' eager attention and a batch whose second
  sequence is padding after 96 of its 128 tokens, as a tokenizer pads a batch. Each run builds
  the additive mask from its own dtype's ``torch.finfo(dtype).min``, and every attention's
  scores and softmax carry it (whole-bf16 fills -3.3895e38, fp32 -3.4028e38).

Dropout is 0 everywhere (the seeds' advice while debugging). The other text models get an
attention mask of ones, as a tokenizer hands over an unpadded batch.

A *precision* says how one run computes: ``fp32`` (the bench), ``bf16`` (the whole model and its
optimizer state in bfloat16), ``amp-bf16`` (``torch.autocast`` to bfloat16, fp32 weights) and
``amp-fp16`` (autocast to float16 with a ``GradScaler``). A GradScaler is part of the training
script, so the bench of an ``amp-fp16`` run (``fp32-scaler``) runs the same script with autocast
off and the scaler on: both runs scale the loss by the same power of two.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

REAL_MODELS = ("gpt2-small", "bert-base", "resnet50", "llama8")
EXTRA_MODELS = ("bert-padded",)
PRECISIONS = ("bf16", "amp-bf16", "amp-fp16")
BENCH_OF = {"bf16": "fp32", "amp-bf16": "fp32", "amp-fp16": "fp32-scaler"}
BATCH = {
    "gpt2-small": (2, 128),
    "bert-base": (2, 128),
    "resnet50": (8, 224),
    "llama8": (2, 128),
    "bert-padded": (2, 128),
}
PADDED_FROM = 96  # bert-padded: where its second sequence's padding starts


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    warnings.simplefilter("ignore")


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _bert_padded() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForMaskedLM._from_config(config, attn_implementation="eager")


def _resnet50() -> nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(
        embedding_size=64,
        hidden_sizes=[256, 512, 1024, 2048],
        depths=[3, 4, 6, 3],
        layer_type="bottleneck",
        hidden_act="relu",
        downsample_in_first_stage=False,
        num_labels=1000,
    )
    return ResNetForImageClassification(config)


def _llama8() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


_BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "gpt2-small": _gpt2,
    "bert-base": _bert,
    "resnet50": _resnet50,
    "llama8": _llama8,
    "bert-padded": _bert_padded,
}


def _batch(family: str, model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    if family == "resnet50":
        n, size = BATCH[family]
        return {
            "pixel_values": torch.randn(n, 3, size, size, generator=gen),
            "labels": torch.randint(0, 1000, (n,), generator=gen),
        }
    n, length = BATCH[family]
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (n, length), generator=gen)
    mask = torch.ones(n, length, dtype=torch.long)
    if family in ("bert-base", "bert-padded"):
        labels = torch.full_like(ids, -100)
        masked = torch.rand(n, length, generator=gen) < 0.15
        if family == "bert-padded":
            ids[1, PADDED_FROM:] = 0  # [PAD]
            mask[1, PADDED_FROM:] = 0
            masked[1, PADDED_FROM:] = False
        labels[masked] = ids[masked]
        ids = ids.masked_fill(masked, 103)  # [MASK] of bert-base-uncased's vocabulary
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}


@dataclass
class RealWorkload:
    """A real-size model in one precision, its batch, optimizer and (for amp-fp16) loss scaler."""

    family: str
    precision: str
    model: nn.Module
    batch: dict[str, torch.Tensor]
    optimizer: torch.optim.Optimizer
    scaler: Any = None
    losses: list[float] = field(default_factory=list)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.precision == "amp-bf16":
            return torch.autocast("cpu", dtype=torch.bfloat16)
        if self.precision == "amp-fp16":
            return torch.autocast("cpu", dtype=torch.float16)
        return contextlib.nullcontext()

    def train_step(self) -> float:
        """Forward (under autocast where the precision says so), backward, optimizer step."""
        with self.autocast():
            loss = self.model(**self.batch).loss
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        value = float(loss.detach().float())
        self.losses.append(value)
        return value


def build_real(family: str, precision: str, seed: int = 1234) -> RealWorkload:
    """``family`` (one of :data:`REAL_MODELS` or :data:`EXTRA_MODELS`) with random weights from ``seed``, set up for ``precision``
    (``fp32``, ``fp32-scaler`` or one of :data:`PRECISIONS`); equal seeds give equal weights and batches.

    >>> w = build_real("resnet50", "fp32")  # doctest: +SKIP
    >>> w.train_step() > 0  # doctest: +SKIP
    True
    """
    if family not in _BUILDERS:
        raise ValueError(f"unknown model {family!r}; choose from {REAL_MODELS + EXTRA_MODELS}")
    if precision not in ("fp32", "fp32-scaler", *PRECISIONS):
        raise ValueError(f"unknown precision {precision!r}")
    _quiet_transformers()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _BUILDERS[family]().train()
    batch = _batch(family, model, seed)
    if precision == "bf16":
        model = model.to(torch.bfloat16)
        batch = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in batch.items()}
    if family == "resnet50":
        optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu") if precision in ("amp-fp16", "fp32-scaler") else None
    torch.manual_seed(seed)
    return RealWorkload(family, precision, model, batch, optimizer, scaler)
