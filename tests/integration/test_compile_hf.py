"""A compiled Hugging Face model against its eager run: the inputs pair by what the user passed
(keyword arguments, a ``labels`` only the loss function reads), the tied embedding's gradient (a
sum of two parts inside the compiled backward, an eager add outside it) pairs through the
optimizer that reads it, and a cache's ``torch.tensor([])`` the compiled code makes itself is no
unpaired bench node. Nothing is left uncompared or unpaired; a fault is named at its module by
statistics alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tracecmp
from tracecmp._compat import TORCH_VERSION

pytestmark = pytest.mark.skipif(TORCH_VERSION < (2, 2), reason="compiled regions are recorded from torch 2.2 on")
transformers = pytest.importorskip("transformers")


def _run(path: Path, compiled: bool, layer_norm_epsilon: float = 1e-5) -> Path:
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=32, layer_norm_epsilon=layer_norm_epsilon
    )
    model = transformers.GPT2LMHeadModel(config).train()
    run = torch.compile(model, backend="aot_eager") if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 96, (2, 2, 12), generator=generator).unbind() for _ in range(2)]  # a data loader's
    with tracecmp.TraceCompare(path, model=model) as tc:
        for ids, labels in batches:
            run(input_ids=ids, labels=labels).loss.backward()
            opt.step()
            opt.zero_grad()
            tc.step()
    return path


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _run(tmp_path_factory.mktemp("hf") / "bench", compiled=False)


def test_a_compiled_target_pairs_every_input_and_output_with_its_eager_bench(bench: Path, tmp_path: Path) -> None:
    target = _run(tmp_path / "target", compiled=True)
    inputs = tracecmp.load(target).to_frame()
    assert "input_ids" in set(inputs.loc[inputs["op"] == "source.input", "name"])  # not "input.0"
    result = tracecmp.compare(target, bench)
    counts = result.counts()
    assert counts["unpaired target"] == counts["unpaired bench"] == 0, result.summary()
    assert counts["uncompared"] == 0, result.uncompared_groups()
    assert result.first_divergence is None, result.summary()


def test_a_fault_in_the_compiled_target_is_found(bench: Path, tmp_path: Path) -> None:
    result = tracecmp.compare(_run(tmp_path / "target", compiled=True, layer_norm_epsilon=1e-2), bench)
    assert result.verdict().startswith("DIVERGED"), result.summary()
    first = result.first_divergence
    # Statistics alone (no replay): the region is narrowed to the first FX node whose recorded value
    # departs from the bench's, the first layer norm with the wrong epsilon.
    assert (first.module, first.phase, first.step) == ("transformer.h.0.ln_1", "forward", 0), result.summary()
    assert "narrowed by statistics to FX node native_layer_norm " in first.reason
