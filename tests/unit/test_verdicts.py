"""What a verdict says on the scripts people run, on hand-built traces: values Python read and wrote
back, a fault repeated in every micro-batch, what could not be compared (exit 3), and two runs that
are different models (exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tracecmp
from tests.tracebuild import TraceBuilder
from tracecmp.cli.main import main
from tracecmp.errors import DifferentModels

A = torch.ops.aten


def _eval_then_step(path: Path, dtype: torch.dtype, *, written: float = 1.0, fault_after: bool = False) -> Path:
    """nanoGPT's ``estimate_loss`` before step 0 (a loss computed in ``dtype``, read with
    ``.item()`` and written into ``losses[k]``, then averaged), then a training forward in fp32.
    ``written`` scales the number written back; ``fault_after`` scales the training forward's
    tanh by 1.05 (a computation fault after the readout)."""
    g = torch.Generator().manual_seed(0)
    b = TraceBuilder()
    x = b.source("input.0", torch.randn(64, 32, generator=g))
    w = b.param("head.weight", torch.randn(32, 32, generator=g) / 6)
    low = b.call(A.mm.default, b.call(A._to_copy.default, x, dtype=dtype), b.call(A._to_copy.default, w, dtype=dtype))
    loss = b.call(A.mean.default, b.call(A._to_copy.default, low, dtype=torch.float32), module="", location="t.py:9")
    b.call(A._local_scalar_dense.default, loss, location="t.py:10")
    number = float(b.value(loss)) * written
    made = b.source("", torch.tensor(number), kind="tensor", location="t.py:10")
    losses = b.source("", torch.zeros(2), kind="tensor", location="t.py:7")
    b.call(A.copy_.default, b.call(A.select.int, losses, 0, 0, location="t.py:10"), made, location="t.py:10")
    h = b.call(A.mm.default, x, w, module="head", location="t.py:20")
    b.call(A.tanh.default, h, module="act", location="t.py:21", fault=(lambda t: t * 1.05) if fault_after else None)
    return b.write(path)


def test_a_loss_read_into_python_and_written_back_is_noise(tmp_path: Path) -> None:
    bench = _eval_then_step(tmp_path / "b", torch.float32)
    result = tracecmp.compare(_eval_then_step(tmp_path / "t", torch.bfloat16), bench)
    assert result.status == "agree", result.summary()


def test_a_tensor_made_from_python_beyond_what_python_read_is_a_source_root(tmp_path: Path) -> None:
    bench = _eval_then_step(tmp_path / "b", torch.float32)
    result = tracecmp.compare(_eval_then_step(tmp_path / "t", torch.bfloat16, written=1.1), bench)
    d = result.first_divergence
    assert d is not None and (d.op, d.kind) == ("source.tensor", "source"), result.summary()


def test_a_computation_fault_after_a_diverged_readout_stays_a_root(tmp_path: Path) -> None:
    # The readout reads a loss that differs (a bf16 loss against a 2x-off bench value would be
    # a root; here the eval loss is off by its written-back number), then the training forward's
    # own arithmetic goes wrong: Python decided nothing of that.
    bench = _eval_then_step(tmp_path / "b", torch.float32)
    result = tracecmp.compare(_eval_then_step(tmp_path / "t", torch.float32, written=1.1, fault_after=True), bench)
    ops = [(s.op, s.kind) for s in sorted(result.suspects, key=lambda s: s.op_id)]
    assert ops == [("source.tensor", "source"), ("aten.tanh.default", "computation")], result.summary()


def _micro_batches(path: Path, *, fault: bool) -> Path:
    """Two micro-batches through one faulty line (``fault``: its GELU's approximation changed)."""
    g = torch.Generator().manual_seed(0)
    b = TraceBuilder()
    w = b.param("fc.weight", torch.randn(16, 16, generator=g) / 4, module="fc")
    for micro in range(2):
        x = b.source(f"input.{micro}", torch.randn(8, 16, generator=g))
        h = b.call(A.mm.default, x, w, module="fc", location="model.py:30")
        approximate = "tanh" if fault else "none"
        b.call(A.gelu.default, h, approximate=approximate, module="mlp.act", location="model.py:31")
    return b.write(path)


def test_one_fault_in_every_micro_batch_is_one_root_with_its_repeats(tmp_path: Path) -> None:
    result = tracecmp.compare(_micro_batches(tmp_path / "t", fault=True), _micro_batches(tmp_path / "b", fault=False))
    assert len(result.suspects) == 1, result.summary()
    root = result.suspects[0]
    assert (root.op, root.module, root.kind) == ("aten.gelu.default", "mlp.act", "argument")
    assert root.op_id == result.first_divergence.op_id and len(root.repeats) == 1
    gelus = result.nodes[result.nodes["op"] == "aten.gelu.default"]
    assert root.repeats == (int(gelus["op_id"].max()),)


def _with_extra_op(path: Path, *, extra: bool) -> Path:
    g = torch.Generator().manual_seed(0)
    b = TraceBuilder()
    x = b.source("input.0", torch.randn(8, 16, generator=g))
    w = b.param("fc.weight", torch.randn(16, 16, generator=g), module="fc")
    h = b.call(A.mm.default, x, w, module="fc")
    if extra:  # a value the bench never makes (another run's logging, say): nothing to compare it with
        b.call(A.sum.default, h, module="fc")
    b.call(A.relu.default, h, module="act")
    return b.write(path)


def test_incomplete_lists_what_was_not_compared_and_exits_3(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    target, bench = _with_extra_op(tmp_path / "t", extra=True), _with_extra_op(tmp_path / "b", extra=False)
    result = tracecmp.compare(target, bench)
    assert result.status == "incomplete", result.summary()
    groups = result.uncompared_groups()
    extra = groups[groups["op"] == "aten.sum.default"]
    assert list(extra[["side", "status", "module", "count"]].itertuples(index=False, name=None)) == [
        ("target", "uncompared", "fc", 1)
    ]
    assert "(a region: extra) whose outputs could not all be paired" in extra["reason"].iloc[0]
    assert "Not compared:" in result.summary() and "aten.sum.default in fc" in result.summary()
    capsys.readouterr()
    assert main(["compare", str(target), str(bench), "-o", str(tmp_path / "out")]) == 3
    assert (tmp_path / "out" / "uncompared.csv").read_text().count("aten.sum.default") == 1
    assert main(["compare", str(target), str(bench), "--allow-incomplete"]) == 0
    assert main(["compare", str(target), str(bench), "--strict"]) == 1
    assert main(["compare", str(bench), str(bench)]) == 0


def test_an_interrupted_trace_is_incomplete(tmp_path: Path) -> None:
    bench = _with_extra_op(tmp_path / "b", extra=False)
    g = torch.Generator().manual_seed(0)
    b = TraceBuilder(complete=False)  # the same run, killed after its matmul
    x = b.source("input.0", torch.randn(8, 16, generator=g))
    b.call(A.mm.default, x, b.param("fc.weight", torch.randn(16, 16, generator=g), module="fc"), module="fc")
    target = b.write(tmp_path / "t")
    result = tracecmp.compare(target, bench)
    assert result.first_divergence is None and result.status == "incomplete", result.summary()
    assert main(["compare", str(target), str(bench)]) == 3


def _model(path: Path, names: list[str], shapes: list[tuple[int, int]]) -> Path:
    g = torch.Generator().manual_seed(0)
    b = TraceBuilder()
    h = b.source("input.0", torch.randn(4, 8, generator=g))
    for name, shape in zip(names, shapes):
        w = b.param(name, torch.randn(*shape, generator=g), module=name.rsplit(".", 1)[0])
        h = b.call(A.mm.default, h, w if shape[0] == h.shape[-1] else b.call(A.t.default, w))
    return b.write(path)


def test_two_different_models_are_refused_unless_forced(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    mine = _model(tmp_path / "b", [f"h.{i}.fc.weight" for i in range(6)], [(8, 8)] * 6)
    wrapped = _model(tmp_path / "w", [f"module.h.{i}.fc.weight" for i in range(6)], [(8, 8)] * 6)
    other = _model(
        tmp_path / "t",
        [f"layers.{i}.linear.weight" for i in range(3)] + [f"h.{i}.fc.weight" for i in range(3)],
        [(8, 8)] * 6,
    )
    tracecmp.compare(wrapped, mine)  # DDP's prefix is no other model: compared, not refused
    with pytest.raises(DifferentModels, match=r"different models: 67% of parameters unmatched"):
        tracecmp.compare(other, mine)
    capsys.readouterr()
    assert main(["compare", str(other), str(mine)]) == 2
    err = capsys.readouterr().err
    assert "different models" in err and "only the target has layers.0.linear.weight" in err
    forced = tracecmp.compare(other, mine, force=True)
    assert forced.status != "agree" and "different models" in forced.warnings[0]


def test_the_suggested_filter_works_as_printed_for_record() -> None:
    from tracecmp.capture.select import Selection
    from tracecmp.cli.main import build_parser
    from tracecmp.cli.record import capture_options, options_argv

    root = Selection.of({"modules": ["", "h.1"], "steps": [0]})  # a root at the top level, one in h.1
    args = build_parser().parse_args(["record", "--data", "tensors", "--only", root.command_line(), "--", "x.py"])
    assert Selection.of(capture_options(args)["only"]) == root
    assert options_argv(args)[-2:] == ["--only", "modules=,h.1;steps=0"]
    assert root.matches(0, "forward", "", "source.tensor") and not root.matches(0, "forward", "h.0", "aten.mm")


def _attention_probs(path: Path, *, bf16_softmax: bool, autocast_matmul: bool = False) -> Path:
    """Scores, softmax, then a matmul with values, in float32; ``bf16_softmax`` computes the softmax
    in bfloat16 between two casts (``softmax(att.to(bf16)).float()``); ``autocast_matmul`` narrows
    the matmul's operands as autocast does (a round trip around a matmul: no fault)."""
    g = torch.Generator().manual_seed(0)
    b = TraceBuilder()
    att = b.source("input.0", torch.randn(16, 32, generator=g) * 3)
    v = b.param("v.weight", torch.randn(32, 8, generator=g), module="attn")
    if bf16_softmax:
        low = b.call(A._to_copy.default, att, dtype=torch.bfloat16, module="attn", location="m.py:5")
        probs = b.call(A._softmax.default, low, -1, False, module="attn", location="m.py:5")
        probs = b.call(A._to_copy.default, probs, dtype=torch.float32, module="attn", location="m.py:5")
    else:
        probs = b.call(A._softmax.default, att, -1, False, module="attn", location="m.py:5")
    if autocast_matmul:
        low_p = b.call(A._to_copy.default, probs, dtype=torch.bfloat16, module="attn", location="m.py:6")
        low_v = b.call(A._to_copy.default, v, dtype=torch.bfloat16, module="attn", location="m.py:6")
        out = b.call(A.mm.default, low_p, low_v, module="attn", location="m.py:6")
        b.call(A._to_copy.default, out, dtype=torch.float32, module="attn", location="m.py:7")
    else:
        b.call(A.mm.default, probs, v, module="attn", location="m.py:6")
    return b.write(path)


def test_an_op_computed_in_bf16_between_two_casts_of_a_float32_model_is_a_precision_root(tmp_path: Path) -> None:
    bench = _attention_probs(tmp_path / "b", bf16_softmax=False)
    result = tracecmp.compare(_attention_probs(tmp_path / "t", bf16_softmax=True), bench)
    d = result.first_divergence
    assert d is not None and (d.op, d.module, d.kind) == ("aten._softmax.default", "attn", "precision"), (
        result.summary()
    )
    assert "round trip" in d.reason and len(result.suspects) == 1
    # autocast's own round trip around a matmul is how autocast runs it, not a fault
    result = tracecmp.compare(_attention_probs(tmp_path / "a", bf16_softmax=False, autocast_matmul=True), bench)
    assert result.first_divergence is None, result.summary()
