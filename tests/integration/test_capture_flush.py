"""When finished steps are handed to the writer: ``flush_secs``, size thresholds, ``sync``, selection.

Short steps share a chunk; what is recorded (ops, ids, statistics, saved tensors) does not depend
on how it was cut into chunks.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pandas as pd
import pytest
import torch

import tracecmp
from tracecmp.capture import session
from tracecmp.errors import CaptureError
from workloads.models import example_batch, make_model, make_optimizer, train_step


def _train(path: Path, steps: int = 4, **options: Any) -> tracecmp.TraceCompare:
    model, batch = make_model("mlp"), example_batch("mlp")
    opt = make_optimizer(model)
    with tracecmp.TraceCompare(path, model=model, **options) as tc:
        for _ in range(steps):
            train_step(model, opt, batch)
            tc.step()
    return tc


def _chunk_steps(path: Path) -> list[list[int]]:
    return [chunk["steps"] for chunk in tracecmp.load(path).rank(0).manifest["chunks"]]


def _seq_from_zero(ops: pd.DataFrame) -> pd.DataFrame:
    """Autograd sequence numbers come from a process-wide counter: count them from the run's first."""
    seq = ops["seq_nr"]
    return ops.assign(seq_nr=seq.where(seq < 0, seq - seq[seq >= 0].min()))


def test_short_steps_share_a_chunk_and_read_as_one_chunk_per_step_would(tmp_path: Path) -> None:
    _train(tmp_path / "shared", flush_secs=3600, data="tensors")
    _train(tmp_path / "apart", flush_secs=0, data="tensors")
    assert _chunk_steps(tmp_path / "shared") == [[0, 1, 2, 3]]
    assert _chunk_steps(tmp_path / "apart") == [[0], [1], [2], [3]]
    shared, apart = tracecmp.load(tmp_path / "shared").rank(0), tracecmp.load(tmp_path / "apart").rank(0)
    pd.testing.assert_frame_equal(_seq_from_zero(shared.ops), _seq_from_zero(apart.ops))
    columns = [c for c in shared.tensors.columns if c != "data_key"]  # names the chunk's data file
    pd.testing.assert_frame_equal(shared.tensors[columns], apart.tensors[columns])
    last = int(shared.tensors[shared.tensors["data_key"] != ""]["tensor_id"].iloc[-1])
    assert torch.equal(shared.load_tensor(last), apart.load_tensor(last))


def test_a_step_boundary_hands_over_once_flush_secs_passed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    monkeypatch.setattr(session, "time", SimpleNamespace(monotonic=lambda: now[0]))
    model, batch = make_model("mlp"), example_batch("mlp")
    opt = make_optimizer(model)
    with tracecmp.TraceCompare(tmp_path / "t", model=model, flush_secs=1.0) as tc:
        for _ in range(7):
            train_step(model, opt, batch)
            now[0] += 0.4  # each step takes 0.4 s: every third boundary is 1.2 s after a hand-over
            tc.step()
    assert _chunk_steps(tmp_path / "t") == [[0, 1, 2], [3, 4, 5], [6]]


def test_a_large_buffer_is_handed_over_at_the_next_boundary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(session, "_HANDOVER_ROWS", 1)
    _train(tmp_path / "t", flush_secs=3600)
    assert _chunk_steps(tmp_path / "t") == [[0], [1], [2], [3]]


def test_saved_bytes_hand_over_at_the_next_boundary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(session, "_HANDOVER_BYTES", 1)
    _train(tmp_path / "t", steps=2, flush_secs=3600, data="tensors")
    assert _chunk_steps(tmp_path / "t") == [[0], [1]]


def test_sync_mode_commits_each_step(tmp_path: Path) -> None:
    _train(tmp_path / "t", flush_secs=3600, sync=True)
    assert _chunk_steps(tmp_path / "t") == [[0], [1], [2], [3]]


def test_sync_hands_over_what_was_buffered(tmp_path: Path) -> None:
    model, batch = make_model("mlp"), example_batch("mlp")
    opt = make_optimizer(model)
    with tracecmp.TraceCompare(tmp_path / "t", model=model, flush_secs=3600) as tc:
        for _ in range(2):
            train_step(model, opt, batch)
            tc.step()
        tc.sync()
        assert _chunk_steps(tmp_path / "t") == [[0, 1]]
        tc.sync()  # nothing new: no empty chunk
        train_step(model, opt, batch)
        tc.step()
    assert _chunk_steps(tmp_path / "t") == [[0, 1], [2]]
    assert tracecmp.load(tmp_path / "t").complete


def test_selected_steps_share_a_chunk(tmp_path: Path) -> None:
    model, batch = make_model("mlp"), example_batch("mlp")
    opt = make_optimizer(model)
    with tracecmp.TraceCompare(tmp_path / "t", model=model, steps=[1, 4], flush_secs=3600) as tc:
        for _ in range(6):
            train_step(model, opt, batch)
            tc.step()
    assert _chunk_steps(tmp_path / "t") == [[1, 4]]
    assert sorted(tracecmp.load(tmp_path / "t").to_frame()["step"].unique()) == [1, 4]


def test_a_step_larger_than_max_ops_spans_chunks_and_the_rest_is_shared(tmp_path: Path) -> None:
    model, batch = make_model("mlp"), example_batch("mlp")
    opt = make_optimizer(model)
    with tracecmp.TraceCompare(tmp_path / "t", model=model, flush_secs=3600, max_ops=400) as tc:
        for _ in range(4):
            train_step(model, opt, batch)
            tc.step()
    chunks = tracecmp.load(tmp_path / "t").rank(0).manifest["chunks"]
    assert len(chunks) >= 2 and all(c["rows"]["ops"] <= 400 for c in chunks)
    assert any(len(c["steps"]) > 1 for c in chunks)  # several steps in one chunk
    ops = tracecmp.load(tmp_path / "t").to_frame()
    assert list(ops["op_id"]) == list(range(len(ops))) and sorted(ops["step"].unique()) == [0, 1, 2, 3]


@pytest.mark.parametrize("value", [-1, float("nan"), float("inf"), True, "1"])
def test_flush_secs_must_be_a_number_of_seconds(tmp_path: Path, value: Any) -> None:
    with pytest.raises(CaptureError, match="flush_secs"):
        tracecmp.TraceCompare(tmp_path / "t", flush_secs=value)
