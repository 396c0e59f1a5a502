"""The five model families of the localization benchmark, taken from the shared :mod:`workloads.models`.

Two deliberate differences from the tests' use of those models, both applied to target and bench:

- the conv net's activation is ``LeakyReLU(0.01)`` instead of ReLU, so that a changed negative
  slope (a real mix-up between PyTorch's 0.01 and GAN code's 0.2) has somewhere to happen;
- the LSTM runs without oneDNN, so the CPU computes it as separate cell ops (addmm, sigmoid, tanh,
  mul, add) rather than one fused ``mkldnn_rnn_layer``: an accelerator's unfused path, and
  fault sites inside the recurrence.

Dropout stays as the models have it: target and bench start the step from the same RNG state, so
their masks are equal.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ContextManager, Iterator

import torch
from torch import nn

from workloads import models as shared

if TYPE_CHECKING:
    from workloads.localization.fused_models import FusedWorkload

FAMILIES = ("mlp", "convnet", "lstm", "transformer", "gpt2")
_OPTIMIZER = {"mlp": "sgd", "convnet": "sgd", "lstm": "adam", "transformer": "adam", "gpt2": "adam"}


@dataclass
class Workload:
    """A model, its batch and one training step: forward, backward, optimizer step."""

    name: str
    model: nn.Module
    batch: tuple[torch.Tensor, torch.Tensor]
    optimizer_kind: str
    context: Callable[[], ContextManager[None]] = contextlib.nullcontext

    def make_optimizer(self) -> torch.optim.Optimizer:
        return shared.make_optimizer(self.model, self.optimizer_kind)

    def train_step(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        with self.context():
            return shared.train_step(self.model, optimizer, self.batch)


@contextlib.contextmanager
def _no_mkldnn() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the flags context warns about oneDNN tf32 on Intel GPUs
        with torch.backends.mkldnn.flags(enabled=False):
            yield


def build(family: str, seed: int = 1234) -> Workload:
    """A fresh workload of ``family``; equal seeds give bitwise-equal weights and inputs.

    Also seeds torch's global generator, so dropout masks in the step are equal too.

    >>> w = build("mlp"); float(w.train_step(w.make_optimizer())) > 0
    True
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; choose from {FAMILIES}")
    if family == "gpt2":
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    model = shared.make_model(family, seed)
    if family == "convnet":
        model.act = nn.LeakyReLU(0.01)
    batch = shared.example_batch(family, seed)
    torch.manual_seed(seed)
    return Workload(
        family, model, batch, _OPTIMIZER[family], _no_mkldnn if family == "lstm" else contextlib.nullcontext
    )


def build_workload(family: str, seed: int = 1234) -> "Workload | FusedWorkload":
    """:func:`build` for the five families, or the fused variant's block for ``fused-<parts>``
    (see :mod:`workloads.localization.fused_models`)."""
    from workloads.localization.fused_models import build_fused, config_of

    if family.startswith("fused-"):
        return build_fused(config_of(family), seed)
    return build(family, seed)
