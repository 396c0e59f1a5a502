"""Values capture did not see being made: a tensor made over a traced tensor's memory outside the
dispatcher (a source holding a value the trace already made) is judged as a copy of that value,
never a root of its own; outputs neither trace holds statistics of leave their op judged on the
others."""

from __future__ import annotations

from pathlib import Path

import torch

import tracecmp
from tests.tracebuild import TraceBuilder, fake_stats

A = torch.ops.aten


def _gradient_read_again(path: Path, scale: float) -> Path:
    # A gradient made by a recorded op, then read by clip_grad_norm_ through a tensor torch 2.1
    # makes in C++ (a new source with the gradient's content).
    b = TraceBuilder()
    x = torch.linspace(-1.0, 1.0, 32).reshape(4, 8)
    source = b.source("x", x)
    grad = b.call(A.mul.Tensor, source, torch.tensor(2.0 * scale), phase="backward", module="fc")
    again = b.source("", b.values[grad.tensor_id].clone(), kind="tensor")
    b.call(A.linalg_vector_norm.default, again)
    return b.write(path)


def test_a_source_holding_a_value_the_trace_made_is_that_value_not_a_root(tmp_path: Path) -> None:
    bench = _gradient_read_again(tmp_path / "bench", 1.0)
    clean = tracecmp.compare(_gradient_read_again(tmp_path / "clean", 1.0), bench)
    assert clean.status == "agree", clean.summary()
    faulty = tracecmp.compare(_gradient_read_again(tmp_path / "faulty", 1.05), bench)
    assert [d.op for d in faulty.suspects] == ["aten.mul.Tensor"], faulty.summary()  # the source inherits
    source = faulty.nodes[faulty.nodes["op"] == "source.tensor"].iloc[0]
    assert source["status"] != "agrees" and not source["root_kind"]  # it carries the mul's error


def _flash(path: Path) -> Path:
    b = TraceBuilder()
    q = b.source("q", torch.linspace(-1.0, 1.0, 16).reshape(2, 8))
    # The attention output and its log-sum-exp, then values it returns without content.
    out, lse, seed = b.op(
        "aten._scaled_dot_product_flash_attention.default",
        [q],
        shape=[(2, 8), (2,), ()],
        dtype=["float32", "float32", "int64"],
        stats=[fake_stats((2, 8)), fake_stats((2,)), None],
    )
    b.op("aten.sum.default", [out], shape=())
    return b.write(path)


def test_outputs_neither_trace_recorded_leave_their_op_judged_on_the_others(tmp_path: Path) -> None:
    result = tracecmp.compare(_flash(tmp_path / "target"), _flash(tmp_path / "bench"))
    assert result.status == "agree", result.summary()
    op = result.nodes[result.nodes["op"] == "aten._scaled_dot_product_flash_attention.default"].iloc[0]
    assert op["status"] == "agrees"
