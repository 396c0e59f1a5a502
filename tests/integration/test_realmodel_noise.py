"""A transformers GPT-2 (small config, random weights) in bf16 and under autocast against fp32.

The end-to-end check of the noise model on a real model's graph: its attention mask from
``torch.finfo(dtype).min``, layer norms on the residual stream, AdamW over two steps (the
second step's parameters carry the first step's optimizer rounding). A clean pair gives no root;
a 5% fault at one layer norm is the only root. The real-size figures (GPT-2 small, BERT-base,
ResNet-50, Llama) are measured in ``benchmarks/localization/realsize.py``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

import tracecmp
from workloads.localization.faults import Injector, OutputFault, Plan, Site


def _record(path: Path, precision: str, plan: Plan, optimizer: str = "single") -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = GPT2Config(
            n_layer=2,
            n_embd=64,
            n_head=4,
            vocab_size=256,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        # Eager attention: its causal mask is filled with finfo(dtype).min, each run its own (and
        # every torch computes it from the same aten ops).
        config._attn_implementation = "eager"
        model = GPT2LMHeadModel(config).train()
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)  # as a tokenizer hands it over: each run builds its additive mask
    kind = {"foreach": {"foreach": True}, "fused": {"fused": True}}.get(optimizer, {"foreach": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **kind)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "amp-bf16" else contextlib.nullcontext()
    injector = Injector(model, plan)
    with injector.outer():
        with tracecmp.TraceCompare(str(path), model=model) as tc:
            for _ in range(2):
                with injector.inner():
                    with autocast:
                        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                tc.step()
    return path


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    return _record(tmp_path_factory.mktemp("gpt2") / "bench", "fp32", Plan())


@pytest.mark.parametrize("precision", ["bf16", "amp-bf16"])
def test_a_clean_reduced_precision_gpt2_is_noise(tmp_path: Path, bench: Path, precision: str) -> None:
    result = tracecmp.compare(_record(tmp_path / "target", precision, Plan()), bench)
    assert result.suspects == [], result.summary()


def test_a_layer_norm_fault_in_an_autocast_gpt2_is_the_only_root(tmp_path: Path, bench: Path) -> None:
    site = Site("aten.native_layer_norm.default", "forward", 2)  # block 1's ln_1 in step 0
    plan = Plan(output_fault=OutputFault("scale", site, 0.05, seed=1))
    result = tracecmp.compare(_record(tmp_path / "target", "amp-bf16", plan), bench)
    assert [(s.op, s.module, s.step) for s in result.suspects] == [
        ("aten.native_layer_norm.default", "transformer.h.1.ln_1", 0)
    ], result.summary()


@pytest.mark.parametrize("optimizer", ["single", "foreach", "fused"])
def test_a_fault_in_the_next_steps_positional_lookup_is_the_only_root(
    tmp_path: Path, bench: Path, optimizer: str
) -> None:
    # The batch reads 32 of the 64 positions: AdamW leaves the other rows, which hold the table's
    # extremes, where they were, and divides their zero moments by eps. What bounds the table's
    # error after the step is Adam's own arithmetic, not that division (comparison/adam.py), in
    # each of torch's implementations of it.
    if optimizer != "single":
        try:
            torch.optim.AdamW([torch.zeros(1, requires_grad=True)], **{optimizer: True})
        except RuntimeError as exc:  # an older torch's fused kernels run on CUDA only
            pytest.skip(str(exc))
        bench = _record(tmp_path / "bench", "fp32", Plan(), optimizer)
    site = Site("aten.embedding.default", "forward", 3)  # transformer.wpe in step 1
    plan = Plan(output_fault=OutputFault("scale", site, 0.05, seed=1))
    result = tracecmp.compare(_record(tmp_path / "target", "amp-bf16", plan, optimizer), bench)
    assert [(s.op, s.module, s.step) for s in result.suspects] == [("aten.embedding.default", "transformer.wpe", 1)], (
        result.summary()
    )
