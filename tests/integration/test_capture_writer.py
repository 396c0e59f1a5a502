"""The background chunk writer: bounded, ordered, and never silent about a failed write."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import tracecmp
from tracecmp.errors import CaptureError, CaptureWarning, CaptureWriteError
from tracecmp.trace.columns import Columns
from tracecmp.trace.schema import OPS_SCHEMA, TENSORS_SCHEMA
from tracecmp.trace.writer import BackgroundWriter, RankWriter
from workloads.models import example_batch, make_model, make_optimizer, train_step


def _fail_chunk(monkeypatch: pytest.MonkeyPatch, index: int) -> None:
    """Make the writer's chunk ``index`` fail as a full disk would."""
    original = RankWriter.write_tables

    def write_tables(self: RankWriter, *args: Any, **kwargs: Any) -> None:
        if self.chunks == index:
            raise OSError(28, "No space left on device")
        original(self, *args, **kwargs)

    monkeypatch.setattr(RankWriter, "write_tables", write_tables)


def test_steps_are_committed_in_order_and_complete(tmp_path: Path) -> None:
    model, batch = make_model("mlp"), example_batch("mlp")
    opt = make_optimizer(model)
    with tracecmp.TraceCompare(tmp_path / "t", model=model) as tc:
        for _ in range(4):
            train_step(model, opt, batch)
            tc.step()
        tc.sync()
        assert tracecmp.load(tc.path).rank(0).manifest["steps"] == [0, 1, 2, 3]
    trace = tracecmp.load(tmp_path / "t")
    assert trace.complete is True
    assert sorted(trace.to_frame()["step"].unique()) == [0, 1, 2, 3]


def test_write_error_stops_recording_and_the_run_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fail_chunk(monkeypatch, 1)
    done = []
    with pytest.warns(
        CaptureWarning, match=r"No space left on device; recording stopped in step \d+ and the run goes on"
    ):
        with tracecmp.TraceCompare(tmp_path / "t", flush_secs=0) as tc:  # a chunk per step
            for step in range(6):
                torch.ones(3).mul(2).sum()
                tc.step()
                done.append(step)
    assert done == list(range(6))
    trace = tracecmp.load(tmp_path / "t")
    assert trace.complete is False
    assert sorted(trace.to_frame()["step"].unique()) == [0]  # what was committed before the error
    stopped = trace.rank(0).manifest["stopped"]
    assert stopped["kind"] == "write-error" and "No space left on device" in stopped["reason"]
    assert stopped["last_step"] == 0


def test_on_error_raise_fails_at_the_next_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fail_chunk(monkeypatch, 1)
    with pytest.raises(CaptureWriteError, match="cannot write the trace: No space left on device"):
        with tracecmp.TraceCompare(tmp_path / "t", flush_secs=0, on_error="raise") as tc:
            for _ in range(6):
                torch.ones(3).mul(2).sum()
                tc.step()
    trace = tracecmp.load(tmp_path / "t")
    assert trace.complete is False and trace.rank(0).manifest["stopped"]["kind"] == "write-error"
    assert sorted(trace.to_frame()["step"].unique()) == [0]


def test_write_error_at_exit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fail_chunk(monkeypatch, 0)
    with pytest.warns(CaptureWarning, match="No space left"):
        with tracecmp.TraceCompare(tmp_path / "t"):
            torch.ones(3).mul(2)
    assert tracecmp.load(tmp_path / "t").complete is False
    with pytest.raises(CaptureWriteError, match="No space left"):
        with tracecmp.TraceCompare(tmp_path / "t", overwrite=True, on_error="raise"):
            torch.ones(3).mul(2)
    assert tracecmp.load(tmp_path / "t").complete is False


def test_sync_mode_raises_at_the_failing_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fail_chunk(monkeypatch, 1)
    done = []
    with pytest.raises(CaptureWriteError, match="No space left"):
        with tracecmp.TraceCompare(tmp_path / "t", sync=True, on_error="raise") as tc:
            for step in range(4):
                torch.ones(3).mul(2)
                tc.step()
                done.append(step)
    assert done == [0]  # step 1's own step() raised


def test_body_exception_wins_over_a_write_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fail_chunk(monkeypatch, 0)
    with pytest.raises(ValueError, match="user bug") as caught, pytest.warns(CaptureWarning):
        with tracecmp.TraceCompare(tmp_path / "t"):
            torch.ones(3).mul(2)
            raise ValueError("user bug")
    assert any("cannot write the trace" in note for note in caught.value.__notes__)
    assert tracecmp.load(tmp_path / "t").complete is False


def test_body_exception_keeps_finished_steps(tmp_path: Path) -> None:
    with pytest.raises(KeyError):
        with tracecmp.TraceCompare(tmp_path / "t") as tc:
            for step in range(3):
                torch.ones(3).mul(step)
                tc.step()
            raise KeyError("boom")
    trace = tracecmp.load(tmp_path / "t")
    assert trace.complete is False
    assert sorted(trace.to_frame()["step"].unique()) == [0, 1, 2]


def test_sync_outside_the_context_is_refused(tmp_path: Path) -> None:
    tc = tracecmp.TraceCompare(tmp_path / "t")
    with pytest.raises(CaptureError, match="sync"):
        tc.sync()


def empty_rows() -> tuple[Columns, Columns]:
    return Columns(OPS_SCHEMA), Columns(TENSORS_SCHEMA)


def test_at_most_two_chunks_in_flight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate, started = threading.Event(), threading.Event()
    original = RankWriter.write_rows

    def gated(self: RankWriter, *args: Any, **kwargs: Any) -> None:
        started.set()
        gate.wait(timeout=60)
        original(self, *args, **kwargs)

    monkeypatch.setattr(RankWriter, "write_rows", gated)
    writer = BackgroundWriter(RankWriter(tmp_path / "t"))
    assert writer.submit(*empty_rows()) == 0
    assert started.wait(timeout=60)  # chunk 0 is being written (held at the gate)
    assert writer.submit(*empty_rows()) == 1  # chunk 1 waits in the queue
    third = threading.Thread(target=writer.submit, args=empty_rows())
    third.start()
    third.join(timeout=0.5)
    assert third.is_alive()  # a third chunk waits for room: memory stays bounded
    gate.set()
    third.join(timeout=60)
    writer.close(complete=True)
    assert writer.writer.chunks == 3


def test_saved_tensors_of_every_dtype_read_back_bit_for_bit(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(0)
    values = {
        "f32": torch.randn(3, 4, generator=g),
        "f32_t": torch.randn(4, 3, generator=g).t(),
        "bf16": torch.randn(5, generator=g).bfloat16(),
        "f16": torch.randn(2, 3, generator=g).half(),
        "f64": torch.randn(2, generator=g).double(),
        "i64": torch.arange(7),
        "i32": torch.arange(3, dtype=torch.int32),
        "u8": torch.tensor([1, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "nan": torch.tensor([float("nan"), float("-inf")]),
    }
    with tracecmp.TraceCompare(tmp_path / "run", data="tensors", flush_secs=0) as tc:
        outs = {name: v.clone() for name, v in values.items()}  # clone: an op whose output is saved
        tc.step()
    rank = tracecmp.load(tmp_path / "run").rank(0)
    saved = rank.tensors[rank.tensors["data_key"] != ""]
    assert len(saved) >= len(values)
    (path,) = rank.data_files.values()
    files = load_file(str(path))

    def bits(t: torch.Tensor) -> torch.Tensor:  # NaN == NaN, -0.0 != 0.0
        return t.contiguous().reshape(-1).view(torch.uint8)

    for name, value in outs.items():
        matches = [
            t
            for t in files.values()
            if t.dtype == value.dtype and t.shape == value.shape and torch.equal(bits(t), bits(value))
        ]
        assert matches, name


def test_a_chunk_with_a_dtype_safetensors_names_no_other_way_still_saves(tmp_path: Path) -> None:
    writer = RankWriter(tmp_path / "run")
    data = {"0/0": torch.randn(3, dtype=torch.complex64), "0/1": torch.randn(2)}
    writer.write_chunk(
        {k: [] for k in tracecmp.trace.schema.OPS_SCHEMA.names},
        {k: [] for k in tracecmp.trace.schema.TENSORS_SCHEMA.names},
        data,
    )
    from safetensors.torch import load_file

    back = load_file(str(tmp_path / "run" / "rank0" / "data-00000.safetensors"))
    assert torch.equal(back["0/0"], data["0/0"]) and torch.equal(back["0/1"], data["0/1"])
