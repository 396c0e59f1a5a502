"""Hand-checked dataflow (in-place ops, views, aliases), odd outputs, saved tensors and misuse."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch

import tracecmp
from tracecmp.errors import CaptureError
from workloads.models import example_batch, make_model, make_optimizer, train_step


def _trace(path: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    rank = tracecmp.load(path).rank(0)
    return rank.ops, rank.tensors.set_index("tensor_id")


def _row(ops: pd.DataFrame, op: str, nth: int = 0) -> Any:
    return ops[ops["op"] == op].iloc[nth]


def test_inplace_and_view_edges(tmp_path: Path) -> None:
    """x -> relu_ -> view -> add_ -> sum over x: every id checked by hand."""
    x = torch.tensor([-1.0, 2.0, -3.0, 4.0])
    with tracecmp.TraceCompare(tmp_path / "t"):
        x.relu_()
        v = x.view(2, 2)
        v.add_(1)
        x.sum()
    ops, tensors = _trace(tmp_path / "t")
    assert list(ops["op"]) == [
        "source.tensor",  # x enters: tensor 0
        "aten.relu_.default",  # reads 0, writes x: tensor 1
        "aten.view.default",  # view of 1: tensor 2
        "aten.add_.Tensor",  # reads 2, writes the view: tensor 3
        "alias.update",  # x changed through its view: new value 4 from (1, 3)
        "aten.sum.default",  # reads 4: tensor 5
    ]
    io = [(list(i), list(o)) for i, o in zip(ops["inputs"], ops["outputs"])]
    assert io == [([], [0]), ([0], [1]), ([1], [2]), ([2], [3]), ([1, 3], [4]), ([4], [5])]
    assert list(ops["inplace"]) == [False, True, False, True, False, False]
    assert list(ops["kind"]) == ["source", "op", "view", "op", "view", "op"]
    assert tensors.loc[2, "view_of"] == 1 and not tensors.loc[2, "has_stats"]
    assert tensors.loc[4, "view_of"] == 3
    assert tensors.loc[0, "min"] == -3.0 and tensors.loc[1, "min"] == 0.0
    assert tensors.loc[3, "max"] == 5.0 and tensors.loc[4, "max"] == 5.0  # x = [1, 3, 1, 5]
    assert tensors.loc[5, "mean"] == 10.0
    assert list(tensors["op_id"]) == [0, 1, 2, 3, 4, 5]


def test_out_variants_foreach_and_multi_outputs(tmp_path: Path) -> None:
    with tracecmp.TraceCompare(tmp_path / "t"):
        a = torch.arange(6.0)
        first, second = torch.split(a, 3)  # a list of views
        out = torch.empty(3)
        torch.add(first, second, out=out)  # writes `out`
        rows = list(torch.ones(2, 3).unbind(0))
        torch._foreach_mul_(rows, 2.0)  # writes both rows, returns nothing
        values, indices = torch.ones(3, 2).max(dim=0)  # two fresh outputs, one of them int64
        out.sum()
    ops, tensors = _trace(tmp_path / "t")
    split = _row(ops, "aten.split.Tensor")
    assert split["kind"] == "view" and len(split["outputs"]) == 2
    assert set(tensors.loc[list(split["outputs"]), "view_of"]) == {split["inputs"][0]}
    add = _row(ops, "aten.add.out")
    assert add["inplace"] and list(add["inputs"][:2]) == list(split["outputs"])
    assert list(_row(ops, "aten.sum.default")["inputs"]) == list(add["outputs"])
    foreach = _row(ops, "aten._foreach_mul_.Scalar")
    unbind = _row(ops, "aten.unbind.int")
    assert list(foreach["inputs"]) == list(unbind["outputs"]) and len(foreach["outputs"]) == 2
    assert json.loads(foreach["args"]) == {"self": [{"tensor": 0}, {"tensor": 1}], "scalar": 2.0}
    maxed = _row(ops, "aten.max.dim")
    assert list(tensors.loc[list(maxed["outputs"]), "dtype"]) == ["float32", "int64"]
    empty = _row(ops, "aten.empty.memory_format")
    assert not tensors.loc[empty["outputs"][0], "has_stats"]  # uninitialized memory has no statistics


def test_odd_tensors_get_rows(tmp_path: Path) -> None:
    with tracecmp.TraceCompare(tmp_path / "t"):
        torch.ones(3, dtype=torch.complex64) * 2j
        torch.zeros(0, 4) + 1
        torch.tensor(3.0) * 2  # 0-dim
        torch.arange(12.0).reshape(3, 4).t() * 1  # non-contiguous input
        _ = torch.ones(3) > 0
        torch.arange(5) * 2
        torch.ones(2, dtype=torch.bfloat16) / 3
        torch.tensor([1.0, float("nan"), float("inf")]) + 0
    ops, tensors = _trace(tmp_path / "t")
    stats = tensors[tensors["has_stats"]]
    by_dtype = dict(zip(stats["dtype"], stats.index))
    assert {"complex64", "bool", "bfloat16", "float32", "int64"} <= set(stats["dtype"])
    assert tensors.loc[by_dtype["complex64"], "max"] == 2.0
    assert tensors.loc[by_dtype["int64"], "max"] == 8.0
    last = stats.iloc[-1]
    assert (last["nan_count"], last["inf_count"], last["min"], last["max"]) == (1, 1, 1.0, float("inf"))
    shapes = [list(s) for s in tensors["shape"]]
    assert [0, 4] in shapes and [] in shapes and [4, 3] in shapes
    args = json.loads(_row(ops, "aten.mul.Tensor")["args"])
    assert args["other"] == {"complex": [0.0, 2.0]}


def test_arguments_are_exact_json(tmp_path: Path) -> None:
    with tracecmp.TraceCompare(tmp_path / "t"):
        x = torch.ones(4, dtype=torch.float64)
        torch.nn.functional.gelu(x, approximate="tanh")
        torch.clamp(x, min=float("-inf"), max=0.1)
        torch.nn.functional.layer_norm(x, (4,), eps=1e-12)
        x.to(torch.float16)
    ops, _ = _trace(tmp_path / "t")
    assert json.loads(_row(ops, "aten.gelu.default")["args"]) == {"self": {"tensor": 0}, "approximate": "tanh"}
    clamp = json.loads(_row(ops, "aten.clamp.default")["args"])
    assert clamp["min"] == "-inf" and clamp["max"] == 0.1
    assert json.loads(_row(ops, "aten.native_layer_norm.default")["args"])["eps"] == 1e-12
    assert json.loads(_row(ops, "aten._to_copy.default")["args"])["dtype"] == "float16"
    ones = json.loads(_row(ops, "aten.ones.default")["args"])
    assert ones["size"] == [4] and ones["dtype"] == "float64"


def test_saved_tensors_are_copies_at_record_time(tmp_path: Path) -> None:
    model, batch = make_model("mlp"), example_batch("mlp")
    opt = make_optimizer(model)
    with tracecmp.TraceCompare(tmp_path / "t", model=model, data="tensors", flush_secs=0) as tc:
        for _ in range(2):
            train_step(model, opt, batch)
            tc.step()
    trace = tracecmp.load(tmp_path / "t")
    rank = trace.rank(0)
    ops, tensors = rank.ops, rank.tensors
    saved = tensors[tensors["data_key"] != ""]
    assert (saved["has_stats"]).all() and len(saved) == tensors["has_stats"].sum()
    weight = ops[(ops["op"] == "source.parameter") & (ops["name"] == "fc1.weight")].iloc[0]
    w0 = rank.load_tensor(int(weight["outputs"][0]))
    assert torch.equal(w0, make_model("mlp").fc1.weight.detach())  # the value before any update
    assert not torch.equal(w0, model.fc1.weight.detach())
    # Statistics and saved data describe the same value.
    for row in saved.sample(20, random_state=0).itertuples():
        value = rank.load_tensor(row.tensor_id)
        assert list(value.shape) == list(row.shape)
        if value.is_floating_point() and value.numel():
            assert value.double().max().item() == row.max
    assert {key.split("/")[0] for key in saved["data_key"]} == {"0", "1"}  # one data file per chunk (a step each)


def test_stack_option_and_locations(tmp_path: Path) -> None:
    def inner(x: torch.Tensor) -> torch.Tensor:
        return x * 3  # the recorded line

    with tracecmp.TraceCompare(tmp_path / "t", stack=True):
        inner(torch.ones(2))
    ops, _ = _trace(tmp_path / "t")
    mul = _row(ops, "aten.mul.Tensor")
    line = inner.__code__.co_firstlineno + 1
    assert mul["location"] == f"test_capture_edges.py:{line}"
    assert mul["stack"].splitlines()[-1].endswith(f"test_capture_edges.py:{line} in inner")
    assert "test_stack_option_and_locations" in mul["stack"]


def test_large_steps_are_split_into_bounded_chunks(tmp_path: Path) -> None:
    with tracecmp.TraceCompare(tmp_path / "t", max_ops=7):
        x = torch.zeros(3)
        for _ in range(10):
            x = x + 1
    trace = tracecmp.load(tmp_path / "t")
    chunks = trace.rank(0).manifest["chunks"]
    assert len(chunks) >= 2 and all(c["rows"]["ops"] <= 7 for c in chunks)
    ops = trace.to_frame()
    assert list(ops["op_id"]) == list(range(len(ops)))
    adds = ops[ops["op"] == "aten.add.Tensor"]
    # The chain crosses chunk boundaries without losing a link.
    assert all(
        list(b) == list(a) for a, b in zip(adds["outputs"].iloc[:-1], adds["inputs"].iloc[1:].map(lambda i: i[:1]))
    )


def test_unselected_steps_install_nothing(tmp_path: Path) -> None:
    from torch.nn.modules import module as module_mod
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    hooks = len(module_mod._global_forward_hooks)
    with tracecmp.TraceCompare(tmp_path / "t", steps=[1]) as tc:
        assert _get_current_dispatch_mode_stack() == [] and len(module_mod._global_forward_hooks) == hooks
        tc.step()
        assert len(_get_current_dispatch_mode_stack()) == 1
        assert len(module_mod._global_forward_hooks) == hooks + 1
        tc.step()
        assert _get_current_dispatch_mode_stack() == []
    assert len(module_mod._global_forward_hooks) == hooks


def test_misuse_raises_capture_error(tmp_path: Path) -> None:
    with pytest.raises(CaptureError, match="data must be one of"):
        tracecmp.TraceCompare(tmp_path / "t", data="everything")
    with pytest.raises(CaptureError, match="steps must be"):
        tracecmp.TraceCompare(tmp_path / "t", steps=["a"])
    with pytest.raises(CaptureError, match="model must be a torch.nn.Module"):
        tracecmp.TraceCompare(tmp_path / "t", model="gpt2")  # type: ignore[arg-type]
    tc = tracecmp.TraceCompare(tmp_path / "t")
    with pytest.raises(CaptureError, match="outside the TraceCompare context"):
        tc.step()
    with tc:
        with pytest.raises(CaptureError, match="cannot be nested"):
            with tracecmp.TraceCompare(tmp_path / "u"):
                pass
    with pytest.raises(CaptureError, match="outside the TraceCompare context"):
        tc.step()
    with pytest.raises(CaptureError, match="already used"):
        with tc:
            pass
    assert tracecmp.load(tmp_path / "t").complete


def test_body_exception_marks_incomplete_and_reraises(tmp_path: Path) -> None:
    with pytest.raises(ZeroDivisionError):
        with tracecmp.TraceCompare(tmp_path / "t") as tc:
            torch.ones(2) * 2
            tc.step()
            torch.ones(2) + 1
            raise ZeroDivisionError
    trace = tracecmp.load(tmp_path / "t")
    assert not trace.complete
    assert sorted(trace.to_frame()["step"].unique()) == [0, 1]  # the failing step's ops are kept
    # Nothing is left installed: a new session works and records normally.
    with tracecmp.TraceCompare(tmp_path / "u"):
        torch.ones(1) + 1
    assert tracecmp.load(tmp_path / "u").complete


def test_accelerator_statistics_are_gathered_at_flush(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a device, statistics stay there (no sync per op) until the chunk is written: same numbers."""
    from tracecmp.capture import mode

    def run(path: Path) -> pd.DataFrame:
        with tracecmp.TraceCompare(path) as tc:
            x = torch.tensor([1.0, float("nan"), -2.0, float("inf")])
            (x * 2).sum()
            tc.step()
            torch.arange(5) + 1
            torch.ones(2, 2, dtype=torch.float16).t() * 3
        return tracecmp.load(path).rank(0).tensors

    on_cpu = run(tmp_path / "cpu")
    real = mode.CaptureMode._device

    def as_accelerator(self: mode.CaptureMode, device: torch.device) -> tuple[str, int]:
        name, kind = real(self, device)
        return name, mode._DEFERRED if kind == mode._CPU else kind

    monkeypatch.setattr(mode.CaptureMode, "_device", as_accelerator)
    deferred = run(tmp_path / "deferred")
    assert deferred["has_stats"].sum() == 7
    pd.testing.assert_frame_equal(on_cpu, deferred)


def test_write_through_alias_after_an_unrecorded_write_is_a_source(tmp_path: Path) -> None:
    """The recorded write through a view does not explain a write the trace never saw."""
    x = torch.zeros(4)
    with tracecmp.TraceCompare(tmp_path / "t", steps=[0, 2]) as tc:
        view = x[:2]
        x.sum()
        tc.step()
        x.add_(1)  # step 1 is not recorded
        tc.step()
        view.mul_(2)  # recorded, but x also changed behind our back
        x.sum()
    ops, tensors = _trace(tmp_path / "t")
    step2 = ops[ops["step"] == 2]
    assert list(step2["op"]) == ["source.tensor", "aten.mul_.Tensor", "source.tensor", "aten.sum.default"]
    assert tensors.loc[step2.iloc[2]["outputs"][0], "max"] == 2.0  # x = [2, 2, 1, 1]


def test_chunk_boundary_inside_an_inplace_op_keeps_versions(tmp_path: Path) -> None:
    """A chunk committed right after an in-place op (before autograd bumps the version) loses nothing."""
    with tracecmp.TraceCompare(tmp_path / "t", max_ops=2):
        x = torch.zeros(3)  # op 0
        x.add_(1)  # op 1: the buffer is full right after it
        x.mul_(2)
        x.sum()
    ops, _ = _trace(tmp_path / "t")
    assert list(ops["op"]) == ["aten.zeros.default", "aten.add_.Tensor", "aten.mul_.Tensor", "aten.sum.default"]
    assert [list(i) for i in ops["inputs"]] == [[], [0], [1], [2]]


def test_op_returning_its_input_without_alias_annotation_is_a_write(tmp_path: Path) -> None:
    """c10d collectives and some vendor kernels write a tensor and return it, schema unannotated."""
    lib = torch.library.Library("tracecmp_edge", "FRAGMENT")
    lib.define("sneaky_double(Tensor x) -> Tensor")

    def sneaky_double(x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return x

    lib.impl("sneaky_double", sneaky_double, "CPU")
    with tracecmp.TraceCompare(tmp_path / "t"):
        x = torch.ones(3)
        y = torch.ops.tracecmp_edge.sneaky_double(x)
        y.sum()
    ops, tensors = _trace(tmp_path / "t")
    sneaky = _row(ops, "tracecmp_edge.sneaky_double.default")
    assert sneaky["inplace"] and sneaky["outputs"][0] != sneaky["inputs"][0]
    assert list(_row(ops, "aten.sum.default")["inputs"]) == list(sneaky["outputs"])
    assert tensors.loc[sneaky["outputs"][0], "max"] == 2.0


def test_a_model_changed_between_recorded_steps_is_named_again(tmp_path: Path) -> None:
    """Steps roll over without re-walking the model; a change is named at the first lookup that misses."""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)
            self.extra: torch.nn.Module | None = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.fc(x)
            return self.extra(y) if self.extra is not None else y

    model, x = Net(), torch.randn(2, 4)
    with tracecmp.TraceCompare(tmp_path / "t", model=model, flush_secs=3600) as tc:
        model(x).sum().backward()
        tc.step()
        model.extra = torch.nn.Linear(4, 2)  # a new submodule
        model.fc.weight = torch.nn.Parameter(torch.randn(4, 4))  # a new parameter object
        tc.step()
        model(x).sum().backward()
        tc.step()
    ops, _ = _trace(tmp_path / "t")
    step2 = ops[ops["step"] == 2]
    assert "fc.weight" in set(step2[step2["op"] == "source.parameter"]["name"])
    assert set(step2[step2["op"] == "aten.addmm.default"]["module"]) == {"fc", "extra"}
    assert set(step2[step2["phase"] == "backward"]["module"]) >= {"fc", "extra"}
    assert sorted(ops["step"].unique()) == [0, 1, 2]


def test_a_session_recording_no_step_lets_the_program_run(tmp_path: Path) -> None:
    """``steps=[]`` (a session open only so that capture knows what compiles in it): each
    optimizer.step() ends a step, none is recorded, and the trace is complete and empty."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracecmp.TraceCompare(tmp_path / "t", model=model, steps=[]):
        for _ in range(2):
            model(torch.ones(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    trace = tracecmp.load(tmp_path / "t")
    assert trace.complete and len(trace.rank(0).ops) == 0


_AFTER_A_COMPILE = r"""
import sys, torch
import tracecmp
from workloads.models import example_batch, make_model, make_optimizer, train_step

torch.compile(lambda x: x.sin() + 1, backend="eager")(torch.randn(4))  # any compile, before the optimizer exists
model, batch = make_model("mlp"), example_batch("mlp")
optimizer = make_optimizer(model, "adam")
step = type(optimizer).step
with tracecmp.TraceCompare(sys.argv[1], model=model):  # no tc.step(): each optimizer.step() ends a step
    for _ in range(2):
        train_step(model, optimizer, batch)
assert type(optimizer).step is step, "capture left the optimizer's step as it found it"
"""


def test_a_compile_before_capture_leaves_the_optimizer_phase_and_steps(tmp_path: Path) -> None:
    # torch 2.1's Dynamo unwraps every optimizer's step from the wrapper that calls optimizer
    # hooks at its first compile: the optimizer's ops were recorded as forward ones, in one step.
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, "-c", _AFTER_A_COMPILE, str(tmp_path / "t")],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    ops, _ = _trace(tmp_path / "t")
    phases = ops.groupby("step")["phase"].agg(set).to_dict()
    assert phases == {0: {"forward", "backward", "optimizer"}, 1: {"forward", "backward", "optimizer"}}, phases
