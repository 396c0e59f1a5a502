"""Narrowing inside a compiled region whose attention lays out its heads the common way (nanoGPT's,
timm's): ``qkv(x).view(B, T, 3, H, hd).permute(2, 0, 3, 1, 4).unbind(0)``, under inductor.

Inductor keeps that attention as matmuls and a softmax (the ``split`` layout of
``test_compile_regions.py`` becomes one fused attention kernel), rewrites the softmax into its
stable form, and q, k, v reach the matmuls through getitems of the unbind: every node between
the projection and the fault must pair with its own eager value for the narrowing to reach the
fault. A one-layer TinyGPT is compiled once per module; a second one, compiled with a graph pass
that miscompiles one node, has other heads so that Dynamo compiles it again rather than reuse
the first one's code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import tracecmp
from tracecmp._compat import TORCH_VERSION
from tracecmp.comparison.compiled import judge as compiled_judge
from workloads.compile_models import FAULTS, ScaleNode, TinyGPT, tiny_batch

# Compiled regions are recorded from torch 2.2 on, and the model's custom GELU needs 2.4.
pytestmark = pytest.mark.skipif(TORCH_VERSION < (2, 4), reason="custom ops inside compiled regions need torch 2.4")


class Heads:
    """A compiled one-layer TinyGPT with unbound heads, its eager bench, and traced steps of it."""

    def __init__(self, tmp: Path, heads: int, joint_pass: Any = None) -> None:
        torch.manual_seed(11)
        self.model = TinyGPT(layers=1, dim=16, heads=heads, heads_layout="unbind", custom_gelu=True)
        self.compiled = torch.compile(self.model, backend="inductor")
        self.batch = tiny_batch()
        # Compiled in a session that records nothing, with the pass where there is one: inductor's
        # compile and the session's record of the graphs both run it.
        with (
            torch._inductor.config.patch(joint_custom_post_pass=joint_pass),
            tracecmp.TraceCompare(tmp / "warm", model=self.model, steps=[]),
        ):
            self._step(self.compiled)
        self.bench = self.trace(tmp / "bench", eager=True, data="tensors")

    def _step(self, run: Any) -> None:
        run(*self.batch).backward()
        self.model.zero_grad(set_to_none=True)

    def trace(self, path: Path, *, eager: bool = False, **options: Any) -> tracecmp.Trace:
        with tracecmp.TraceCompare(path, model=self.model, **options) as tc:
            self._step(self.model if eager else self.compiled)
            tc.step()
        return tracecmp.load(path)


@pytest.fixture(scope="module")
def heads(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Heads]:
    yield Heads(tmp_path_factory.mktemp("heads"), heads=2)


# q @ k^T, the attention scores: the first matmul after the unbind.
SCORES = ScaleNode(lambda n: n.target is torch.ops.aten.bmm.default, 1.01)


@pytest.fixture(scope="module")
def scaled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Heads]:
    yield Heads(tmp_path_factory.mktemp("scaled"), heads=4, joint_pass=SCORES)


def test_a_clean_region_has_no_root_and_nothing_to_narrow(
    heads: Heads, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    narrowed: list[tuple[str, str]] = []
    narrow = compiled_judge.narrow_region

    def recording(*args: Any, **kwargs: Any) -> tuple[str, str]:
        narrowed.append(narrow(*args, **kwargs))
        return narrowed[-1]

    monkeypatch.setattr(compiled_judge, "narrow_region", recording)
    target = heads.trace(tmp_path / "b", compiled="boundary", data="tensors")
    result = tracecmp.compare(target, heads.bench)
    assert result.first_divergence is None, result.first_divergence
    regions = result.nodes[result.nodes["op"].isin(["compiled.forward", "compiled.backward"])]
    assert len(regions) == 2 and (regions["status"] != "diverged").all()
    # Every node of both regions was walked (the backward's after the sizes its forward saved),
    # and none departs from the eager value it was paired with.
    assert narrowed == [("", "")] * 3  # forward; the backward's saved forward values, then its own nodes
    assert not any("not replayed" in w for w in result.warnings)
    graph = heads.trace(tmp_path / "g", compiled="graph")
    assert tracecmp.compare(graph, heads.bench).first_divergence is None


def test_a_fault_after_the_attention_is_narrowed_past_it(heads: Heads, tmp_path: Path) -> None:
    # The custom GELU after the attention computes 0.2% too much: the narrowing walks the whole
    # attention (stable softmax included) before it.
    FAULTS["gelu"] = 1.002
    try:
        boundary = heads.trace(tmp_path / "b", compiled="boundary", data="tensors")
        graph = heads.trace(tmp_path / "g", compiled="graph")
    finally:
        FAULTS["gelu"] = 1.0
    first = tracecmp.compare(boundary, heads.bench).first_divergence
    assert first is not None and (first.op, first.module) == ("compiled.forward", "blocks.0.mlp.act")
    assert "to FX node gelu (tracecmp_tests.gelu.default, blocks.0.mlp.act" in first.reason  # replay or statistics
    first = tracecmp.compare(graph, heads.bench).first_divergence
    assert first is not None
    assert (first.op, first.module, first.phase) == ("tracecmp_tests.gelu.default", "blocks.0.mlp.act", "forward")


def test_a_pass_scaling_the_attention_scores_is_narrowed_to_its_node(scaled: Heads, tmp_path: Path) -> None:
    # The graph itself computes q @ k^T 1% too large, right after the unbind: the compiled code
    # is faithful to it, the eager program is not.
    target = scaled.trace(tmp_path / "b", compiled="boundary", data="tensors")
    first = tracecmp.compare(target, scaled.bench).first_divergence
    assert first is not None and (first.op, first.module) == ("compiled.forward", "blocks.0.attn")
    assert SCORES.scaled
    assert f"narrowed to FX node {SCORES.scaled} (aten.mul.Tensor, blocks.0.attn" in first.reason
    assert "differs from the bench's aten.bmm.default by 9.9e-03" in first.reason
    graph = scaled.trace(tmp_path / "g", compiled="graph")
    first = tracecmp.compare(graph, scaled.bench).first_divergence
    assert first is not None
    assert (first.op, first.module, first.phase) == ("aten.mul.Tensor", "blocks.0.attn", "forward")
