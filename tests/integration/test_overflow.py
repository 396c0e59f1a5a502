"""The first op that turns finite inputs into NaN/Inf: found offline, in forward and in backward."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tracecmp
from tracecmp.overflow import find_overflows, first_overflow, recorded_overflows

ROOT = Path(__file__).resolve().parents[2]


class ThreeGelus(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = (torch.nn.Linear(8, 8) for _ in range(3))
        self.act1, self.act2, self.act3 = (torch.nn.GELU() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act1(self.fc1(x))
        x = self.act2(self.fc2(x))
        return self.act3(self.fc3(x))


class InfInto(TorchDispatchMode):
    """Writes +Inf into element 0 of the ``nth`` output of ``op`` (entered outside the capture)."""

    def __init__(self, op: Any, nth: int) -> None:
        super().__init__()
        self.op, self.nth, self.seen = op, nth, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is self.op:
            self.seen += 1
            if self.seen == self.nth:
                out = out.clone()
                out.view(-1)[0] = float("inf")
        return out


def _capture(path: Path, fault: TorchDispatchMode | None, *, half_matmul: bool = False) -> Path:
    torch.manual_seed(0)
    model = ThreeGelus()
    x = torch.randn(4, 8)
    with fault if fault is not None else contextlib.nullcontext():
        with tracecmp.TraceCompare(path, model=model) as tc:
            model(x).sum().backward()
            tc.step()
    return path


def test_inf_in_third_gelu_forward_is_the_first_overflow(tmp_path: Path) -> None:
    path = _capture(tmp_path / "t", InfInto(torch.ops.aten.gelu.default, 3))
    first = first_overflow(path)
    assert first is not None
    assert (first.op, first.module, first.phase, first.step) == ("aten.gelu.default", "act3", "forward", 0)
    assert all(r.finite for r in first.inputs) and not all(r.finite for r in first.outputs)
    assert first.location.startswith("test_overflow.py:")
    assert "Inf" in first.reason


def test_inf_in_third_gelu_backward_is_the_first_overflow(tmp_path: Path) -> None:
    # Backward runs the GELUs in reverse: the third gelu_backward belongs to act1.
    path = _capture(tmp_path / "t", InfInto(torch.ops.aten.gelu_backward.default, 3))
    found = find_overflows(path)
    assert found, "no overflow found"
    first = found[0]
    assert (first.op, first.module, first.phase) == ("aten.gelu_backward.default", "act1", "backward")
    assert all(f.op_id >= first.op_id for f in found)


def test_clean_run_has_no_overflow(tmp_path: Path) -> None:
    assert first_overflow(_capture(tmp_path / "t", None)) is None


def _cpu_half_matmul() -> bool:
    try:
        torch.ones(1, 1, dtype=torch.half) @ torch.ones(1, 1, dtype=torch.half)
    except RuntimeError:
        return False
    return True


# torch 2.1 has no float16 matmul on the CPU ("addmm_impl_cpu_" not implemented for 'Half'); the
# overflow watch itself is tested on every torch by the InfInto tests.
needs_half_matmul = pytest.mark.skipif(not _cpu_half_matmul(), reason="this torch has no float16 matmul on the CPU")


class HalfLinear(torch.nn.Module):
    """A linear layer whose matmul runs in fp16, as NPU matrix units do."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((16, 16), 30.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.half() @ self.weight.half()).float()


@needs_half_matmul
def test_fp16_matmul_with_large_activations_overflows_and_is_located(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), HalfLinear())
    with torch.no_grad():
        model[0].weight.fill_(2.0)
        model[0].bias.fill_(200.0)
    x = torch.rand(2, 16)
    with tracecmp.TraceCompare(tmp_path / "t", model=model) as tc:
        model(x).sum().backward()
        tc.step()
    first = first_overflow(tmp_path / "t")
    assert first is not None
    assert first.op == "aten.mm.default" and first.module == "2" and first.phase == "forward"
    assert any("float16" in note for note in first.notes)
    assert {r.dtype for r in first.outputs} == {"float16"}
    peak = max(max(abs(r.min), abs(r.max)) for r in first.inputs)
    assert peak * 30 * 16 > 65504  # activations times weights pass fp16's range


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tracecmp", *args], capture_output=True, text=True, cwd=ROOT)


def test_overflow_cli_exit_codes(tmp_path: Path) -> None:
    bad = _capture(tmp_path / "bad", InfInto(torch.ops.aten.gelu.default, 2))
    clean = _capture(tmp_path / "clean", None)
    found = _cli("overflow", str(bad))
    assert found.returncode == 1, found.stderr
    assert "first overflow: aten.gelu.default" in found.stdout and "act2" in found.stdout
    assert _cli("overflow", str(clean)).returncode == 0
    missing = _cli("overflow", str(tmp_path / "nowhere"))
    assert missing.returncode == 2
    assert missing.stderr.count("\n") == 1 and "nowhere" in missing.stderr


# ---- while capturing: overflow="record" notes the first overflow, overflow="raise" stops there ----


def _capture_watching(path: Path, fault: TorchDispatchMode, overflow: str) -> tracecmp.OverflowDetected | None:
    torch.manual_seed(0)
    model = ThreeGelus()
    x = torch.randn(4, 8)
    try:
        with fault:
            with tracecmp.TraceCompare(path, model=model, overflow=overflow) as tc:
                model(x).sum().backward()
                tc.step()
    except tracecmp.OverflowDetected as exc:
        return exc
    return None


@pytest.mark.parametrize(
    "op, module, phase",
    [(torch.ops.aten.gelu.default, "act3", "forward"), (torch.ops.aten.gelu_backward.default, "act1", "backward")],
)
def test_record_notes_the_first_overflow_in_the_manifest(tmp_path: Path, op: Any, module: str, phase: str) -> None:
    assert _capture_watching(tmp_path / "t", InfInto(op, 3), "record") is None
    trace = tracecmp.load(tmp_path / "t")
    assert trace.complete  # recording changes nothing in the run
    recorded = recorded_overflows(trace)
    assert len(recorded) == 1
    first = recorded[0]
    assert (first.op, first.module, first.phase, first.step) == (str(op), module, phase, 0)
    assert first == first_overflow(trace)  # the same facts the offline finder reads from the trace
    data = trace.rank(0).manifest["info"]["first_overflow"]
    assert data["outputs"][0]["max"] == "inf" and "Inf" in data["reason"]


def test_record_on_a_clean_run_notes_nothing(tmp_path: Path) -> None:
    assert _capture_watching(tmp_path / "t", contextlib.nullcontext(), "record") is None
    trace = tracecmp.load(tmp_path / "t")
    assert recorded_overflows(trace) == [] and "first_overflow" not in trace.rank(0).manifest["info"]


@pytest.mark.parametrize(
    "op, module, phase",
    [(torch.ops.aten.gelu.default, "act3", "forward"), (torch.ops.aten.gelu_backward.default, "act1", "backward")],
)
def test_raise_stops_at_the_first_overflow_after_committing_the_trace(
    tmp_path: Path, op: Any, module: str, phase: str
) -> None:
    exc = _capture_watching(tmp_path / "t", InfInto(op, 3), "raise")
    assert exc is not None, "no OverflowDetected raised"
    assert (exc.op, exc.module, exc.phase, exc.step) == (str(op), module, phase, 0)
    assert exc.location.startswith("test_overflow.py:")
    assert exc.inputs and all(r.finite for r in exc.inputs)
    assert any(not r.finite for r in exc.outputs)
    assert exc.path == str(tmp_path / "t") and str(op) in str(exc)
    # On disk: readable, incomplete, ending with the overflowing op, which the offline finder agrees on.
    trace = tracecmp.load(tmp_path / "t")
    assert not trace.complete
    ops = trace.to_frame()
    assert ops["op_id"].max() == exc.overflow.op_id and ops.iloc[-1]["op"] == str(op)
    assert first_overflow(trace) == exc.overflow == recorded_overflows(trace)[0]


def test_raise_caught_inside_the_session_leaves_the_trace_incomplete(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = ThreeGelus()
    with InfInto(torch.ops.aten.gelu.default, 2):
        with tracecmp.TraceCompare(tmp_path / "t", model=model, overflow="raise") as tc:
            with pytest.raises(tracecmp.OverflowDetected):
                model(torch.randn(4, 8))
            model(torch.randn(4, 8))  # the program went on, but not as written
            tc.step()
    assert not tracecmp.load(tmp_path / "t").complete


@needs_half_matmul
def test_raise_locates_the_fp16_matmul_that_overflows(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), HalfLinear())
    with torch.no_grad():
        model[0].weight.fill_(2.0)
        model[0].bias.fill_(200.0)
    with pytest.raises(tracecmp.OverflowDetected) as caught:
        with tracecmp.TraceCompare(tmp_path / "t", model=model, overflow="raise") as tc:
            model(torch.rand(2, 16)).sum().backward()
            tc.step()
    exc = caught.value
    assert (exc.op, exc.module, exc.phase) == ("aten.mm.default", "2", "forward")
    assert {r.dtype for r in exc.inputs} == {"float16"} and {r.dtype for r in exc.outputs} == {"float16"}
    assert any("float16" in note and "65504" in note for note in exc.notes)
    assert max(max(abs(r.min), abs(r.max)) for r in exc.inputs) * 30 * 16 > 65504
    assert first_overflow(tmp_path / "t") == exc.overflow


def test_overflow_cli_says_why_a_raised_trace_is_incomplete(tmp_path: Path) -> None:
    _capture_watching(tmp_path / "t", InfInto(torch.ops.aten.gelu.default, 2), "raise")
    found = _cli("overflow", str(tmp_path / "t"))
    assert found.returncode == 1, found.stderr
    assert 'overflow="raise"' in found.stdout and "first overflow: aten.gelu.default" in found.stdout


class CausalBlock(torch.nn.Module):
    """Causal self-attention with the standard ``masked_fill(mask, -inf)`` mask, then an MLP."""

    def __init__(self, dim: int = 8, seq: int = 6) -> None:
        super().__init__()
        self.qkv, self.fc, self.act = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim), torch.nn.GELU()
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(seq) < 0, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = (q @ k.transpose(-2, -1)).masked_fill(self.mask, float("-inf"))
        return self.act(self.fc(torch.softmax(scores, dim=-1) @ v))


def _causal(path: Path, fault: TorchDispatchMode, overflow: str | None = None) -> tracecmp.OverflowDetected | None:
    torch.manual_seed(0)
    model = CausalBlock()
    try:
        with fault:
            with tracecmp.TraceCompare(path, model=model, overflow=overflow) as tc:
                model(torch.randn(2, 6, 8)).sum().backward()
                tc.step()
    except tracecmp.OverflowDetected as exc:
        return exc
    return None


def test_a_causal_mask_of_minus_inf_is_given_and_the_real_overflow_after_it_is_named(tmp_path: Path) -> None:
    # The mask's -inf were handed to masked_fill; the gelu output that turns Inf is the overflow,
    # offline, recorded while capturing, and raised.
    _causal(tmp_path / "offline", InfInto(torch.ops.aten.gelu.default, 1))
    found = find_overflows(tmp_path / "offline")
    assert [(o.op, o.module) for o in found[:1]] == [("aten.gelu.default", "act")]
    assert all(o.op != "aten.masked_fill.Scalar" for o in found)
    assert _causal(tmp_path / "record", InfInto(torch.ops.aten.gelu.default, 1), "record") is None
    (recorded,) = recorded_overflows(tmp_path / "record")
    assert (recorded.op, recorded.module) == ("aten.gelu.default", "act")
    raised = _causal(tmp_path / "raise", InfInto(torch.ops.aten.gelu.default, 1), "raise")
    assert raised is not None and raised.op == "aten.gelu.default"
    # With no overflow, the mask alone is nothing to report.
    _causal(tmp_path / "clean", contextlib.nullcontext())
    assert first_overflow(tmp_path / "clean") is None


def test_log_of_zero_is_reported_with_a_note_that_its_input_reached_zero(tmp_path: Path) -> None:
    with tracecmp.TraceCompare(tmp_path / "t") as tc:
        p = torch.tensor([0.5, 0.25, 0.0])
        torch.log(p).sum()
        tc.step()
    first = first_overflow(tmp_path / "t")
    assert first is not None and first.op == "aten.log.default"
    assert any("reaches 0" in note and "exact result is infinite" in note for note in first.notes)
