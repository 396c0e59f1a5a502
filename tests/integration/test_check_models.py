"""``tracecmp.check`` on a real training step (the demo's transformer), one run, no bench.

Kernel faults are emulated as a device would make them (:mod:`workloads.kernel_faults`): a dispatch
mode entered before ``TraceCompare`` computes the op differently while the trace records the call as
issued (the op, its arguments, its dtypes), and only while the faulty module runs.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

import tracecmp
from tracecmp.demo import BATCH, SEQ, VOCAB, build_model
from tracecmp.render.check_report import write_report
from workloads.kernel_faults import FAULTS, capture

pytestmark = pytest.mark.usefixtures("one_thread")

# The clean runs every check must pass: capture() options per kind.
CLEAN_RUNS: dict[str, dict[str, Any]] = {
    "float32": {},
    "bfloat16": {"dtype": torch.bfloat16},
    "autocast-bf16": {"autocast": True},
    "tf32-declared": {"tf32": True},
}


@pytest.mark.parametrize(
    "fault,op",
    [
        ("gelu-tanh", "aten.gelu.default"),
        ("layer-norm-eps", "aten.native_layer_norm.default"),
        ("matmul-fp16-inputs", "aten.addmm.default"),
        ("softmax-fp16", "aten._softmax.default"),
    ],
)
def test_check_names_the_faulty_kernel_on_tensors(tmp_path, fault, op):
    result = tracecmp.check(capture(tmp_path / "run", fault))
    d = result.first_error
    assert d is not None and (d.op, d.module, d.phase, d.step) == (op, FAULTS[fault][2], "forward", 0), result.summary()
    assert d.location.startswith("demo.py:")
    assert len(result.suspects) == 1  # judged on its own inputs, nothing downstream is blamed
    assert result.counts()["by tensors"] >= 0.9 * result.counts()["ops"]


@pytest.mark.parametrize("kind", list(CLEAN_RUNS))
def test_clean_runs_have_no_error(tmp_path, kind):
    options = CLEAN_RUNS[kind]
    result = tracecmp.check(capture(tmp_path / "run", **options))
    assert result.first_error is None, result.summary()
    judged = result.counts()["pass"] + result.counts()["warning"]
    assert judged >= 0.9 * result.counts()["ops"]
    assert set(result.skipped()["names"]) <= {"aten._local_scalar_dense.default"}


@pytest.mark.parametrize(
    "fault,op",
    [
        ("matmul-fp16", "aten.addmm.default"),
        ("softmax-fp16", "aten._softmax.default"),
        ("gelu-tanh", "aten.gelu.default"),  # off at its output's max, which the input's max pins
    ],
)
def test_statistics_alone_find_the_faulty_kernel_and_say_the_evidence_is_weaker(tmp_path, fault, op):
    result = tracecmp.check(capture(tmp_path / "run", fault, data="stats"))
    d = result.first_error
    assert d is not None and (d.op, d.module, d.phase) == (op, FAULTS[fault][2], "forward"), result.summary()
    assert len(result.suspects) == 1
    assert result.evidence == "statistics" and "weaker evidence" in result.verdict()
    assert "statistics only" in result.summary()
    out = tmp_path / "out"
    result.write_tables(out)
    assert "weaker evidence" in write_report(result, out).read_text()
    assert set(pd.read_csv(out / "check_suspects.csv")["evidence"]) == {"statistics"}


def test_statistics_alone_find_no_error_in_a_clean_run_and_skip_what_they_cannot_judge(tmp_path):
    result = tracecmp.check(capture(tmp_path / "clean", data="stats"))
    assert result.first_error is None, result.summary()
    assert not result.agrees and "weaker evidence" in result.verdict()
    reasons = result.nodes.loc[result.nodes["status"] == "skipped"].groupby("op")["reason"].first()
    assert "indices or token ids" in reasons["aten.embedding.default"]
    assert "a mask" in reasons["aten.masked_fill.Scalar"]


@pytest.mark.parametrize(
    "fault,op",
    [
        ("gelu-tanh", "aten.gelu.default"),
        ("layer-norm-eps", "aten.native_layer_norm.default"),
        ("matmul-fp16-inputs", "aten.addmm.default"),
        ("matmul-fp16", "aten.addmm.default"),
        ("softmax-fp16", "aten._softmax.default"),
        ("matmul-bf16-rounding", "aten.addmm.default"),
        ("gelu-scale-1e-3", "aten.gelu.default"),
        ("layer-norm-noise", "aten.native_layer_norm.default"),
    ],
)
def test_statistics_with_self_checks_name_every_kernel_fault(tmp_path, fault, op):
    result = tracecmp.check(capture(tmp_path / "run", fault, data="stats", self_check="sample"))
    d = result.first_error
    assert d is not None and (d.op, d.module, d.phase) == (op, FAULTS[fault][2], "forward"), result.summary()
    assert "its own check at capture failed" in d.reason
    assert len(result.suspects) == 1, result.summary()
    counts = result.counts()
    assert counts["by self-check"] >= 0.9 * (counts["pass"] + counts["warning"] + counts["error"])


@pytest.mark.parametrize("kind", list(CLEAN_RUNS))
def test_statistics_with_self_checks_pass_clean_runs(tmp_path, kind):
    options = CLEAN_RUNS[kind]
    result = tracecmp.check(capture(tmp_path / "run", data="stats", self_check="sample", **options))
    assert result.first_error is None, result.summary()
    assert any("needs a bench run" in note for note in result.notes)


def test_a_capture_restricted_to_a_block_keeps_its_tensors_and_check_replays_them(tmp_path):
    def size(path: Path) -> int:
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())

    only = {"modules": ["blocks.1"]}
    narrow = capture(tmp_path / "narrow", "gelu-tanh", only=only)
    whole = capture(tmp_path / "whole")
    assert size(narrow) < 0.5 * size(whole)
    assert tracecmp.load(narrow).options["only"] == only
    result = tracecmp.check(narrow)
    d = result.first_error
    assert d is not None and (d.op, d.module) == ("aten.gelu.default", "blocks.1.mlp.act")
    assert "float64 replay of its recorded inputs" in d.reason  # tensors, not statistics
    nodes = result.nodes
    inside = nodes[nodes["module"].str.startswith("blocks.1.") & (nodes["status"] != "skipped")]
    assert len(inside) > 30 and (inside["evidence"] == "tensors").all()
    assert result.evidence == "mixed"
    assert str(result.selection()) == 'only={"modules": ["blocks.1.mlp.act"], "steps": [0]}'


def test_capture_under_only_is_transparent(tmp_path):
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))

    def step(context: Any) -> torch.Tensor:
        m = build_model()
        with context:
            loss = F.cross_entropy(m(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            loss.backward()
        return torch.cat([p.grad.flatten() for p in m.parameters()])

    plain = step(contextlib.nullcontext())
    traced = step(tracecmp.TraceCompare(tmp_path / "t", data="tensors", only={"modules": ["blocks.0"]}))
    assert torch.equal(plain, traced)


def test_compare_prints_the_filter_around_its_suspects(tmp_path, capsys):
    from tracecmp.cli.main import main

    target = capture(tmp_path / "target", "gelu-tanh", data="stats")
    bench = capture(tmp_path / "bench", data="stats")
    assert main(["compare", str(target), str(bench)]) == 1
    assert 'data="tensors", only={"modules": ["blocks.1.mlp.act"' in capsys.readouterr().out


def test_every_op_of_a_transformers_gpt2_step_is_judged_attention_included(tmp_path):
    from workloads import models as M

    model, batch = M.make_model("gpt2", 0), M.example_batch("gpt2", 0)
    opt = M.make_optimizer(model)
    with tracecmp.TraceCompare(tmp_path / "run", model=model, data="tensors", dropout=0.0) as tc:
        M.train_step(model, opt, batch)
        tc.step()
    result = tracecmp.check(tmp_path / "run")
    assert result.first_error is None, result.summary()
    # Attention with dropout_p=0 draws nothing and is replayed; views of strided outputs are rebuilt.
    judged = set(result.nodes.loc[result.nodes["status"] != "skipped", "op"])
    # (the CPU's fused attention is _scaled_dot_product_flash_attention_for_cpu; on torch 2.1 without "_for_cpu")
    assert any(op.startswith("aten._scaled_dot_product_flash_attention") for op in judged)
    assert set(result.skipped()["names"]) <= {"aten._local_scalar_dense.default"}
