"""``tracecmp.check`` on hand-built traces: standards, statistics mode, skips, CLI, filters, regions."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import tracecmp
from tests.tracebuild import TraceBuilder, stats_of
from tests.unit.test_localize import record, scale
from tracecmp.capture.select import Selection, around
from tracecmp.checking import CheckError, Standards, check
from tracecmp.checking.statistics import StatisticsChecker, TensorSpec, draw, on_grid
from tracecmp.cli.main import main as cli_main
from tracecmp.numerics.replay import Replayer, Skipped, register_reference, replay_ops

A = torch.ops.aten


def test_a_clean_trace_passes_and_every_op_is_judged_on_tensors(tmp_path):
    result = check(record(tmp_path / "run", data=True))
    assert result.passed and result.first_error is None and result.suspects == []
    counts = result.counts()
    assert counts["pass"] == counts["ops"] == counts["by tensors"] and counts["error"] == 0
    assert result.verdict().startswith("PASS")
    assert (result.nodes["evidence"] == "tensors").all()


@pytest.mark.parametrize(
    "site,op,module,phase",
    [
        ("gelu", "aten.gelu.default", "act", "forward"),
        ("ln", "aten.native_layer_norm.default", "ln", "forward"),
        ("gelu_backward", "aten.gelu_backward.default", "act", "backward"),
        ("sgd_b1", "aten.add.Tensor", "", "optimizer"),
    ],
)
def test_an_op_wrong_by_a_few_parts_in_1e5_is_the_first_error(tmp_path, site, op, module, phase):
    result = check(record(tmp_path / "run", data=True, faults={site: scale(1 + 3e-5)}))
    d = result.first_error
    assert d is not None and (d.op, d.module, d.phase, d.step) == (op, module, phase, 0)
    assert [s.op_id for s in result.suspects] == [d.op_id]
    assert "float64 replay" in d.reason and d.score > 1
    row = result.nodes[result.nodes["op_id"] == d.op_id].iloc[0]
    assert row["status"] == "error" and row["own_error"] == pytest.approx(3e-5, rel=0.3)
    assert result.selection() == Selection(modules=(module,), steps=(0,))


def _declare(path: Path, precision: str, device: str | None = None) -> Path:
    """Write the float32 matmul precision (and device) a capture would have recorded."""
    manifest = path / "manifest.json"
    data = json.loads(manifest.read_text())
    data["determinism"] = {"float32_matmul_precision": precision}
    manifest.write_text(json.dumps(data))
    return path


def test_a_matmul_fault_below_tf32_noise_is_found_where_the_run_declares_full_float32(tmp_path):
    faulty = record(tmp_path / "run", data=True, faults={"fc2": scale(1 + 3e-5)})
    assert check(faulty).first_error is None  # TF32 possible (not recorded): hidden below its unit
    d = check(_declare(faulty, "highest")).first_error
    assert d is not None and (d.op, d.module) == ("aten.mm.default", "fc2")
    assert any("held to float32" in n for n in check(faulty).notes)


def test_matmuls_at_tf32_pass_when_declared_and_err_when_the_run_says_highest(tmp_path):
    tf32 = record(tmp_path / "run", data=True, tf32=True)
    declared = check(_declare(tf32, "high"))
    assert declared.first_error is None and any("declared" in n for n in declared.notes)
    strict = check(_declare(tf32, "highest"))
    d = strict.first_error
    assert d is not None and d.op in ("aten.addmm.default", "aten.mm.default")
    assert "rounded to tf32" in d.reason and "does not declare" in d.reason


def test_matmuls_on_bf16_inputs_pass_under_medium_and_are_named_bf16_when_the_run_says_highest(tmp_path):
    b = TraceBuilder(data=True)
    g = torch.Generator().manual_seed(3)
    x = b.source("input.0", torch.randn(32, 64, generator=g))
    for i in range(4):  # a device at "medium" multiplies float32 tensors rounded to bf16
        w = b.param(f"l{i}.weight", torch.randn(64, 64, generator=g) / 8)
        x = b.call(
            A.mm.default,
            x,
            w,
            module=f"l{i}",
            fault=lambda _, x=x, w=w: torch.mm(b.value(x).bfloat16().float(), b.value(w).bfloat16().float()),
        )
    path = b.write(tmp_path / "run")
    declared = check(_declare(path, "medium"))
    assert declared.first_error is None and declared.counts()["pass"] == 4
    assert any("'medium'" in n and "bf16" in n for n in declared.notes)
    d = check(_declare(path, "highest")).first_error
    assert d is not None and d.op == "aten.mm.default" and d.module == "l0"
    assert "rounded to bf16" in d.reason and "(bf16 inputs) which the run does not declare" in d.reason


def test_nan_that_an_honest_kernel_does_not_make_is_an_error_and_an_honest_overflow_a_warning(tmp_path):
    b = TraceBuilder(data=True)
    x = b.source("input.0", torch.tensor([1.0, 2.0, 60000.0], dtype=torch.float16))
    w = b.source("input.1", torch.tensor([1.0, 2.0, 3.0]))

    def poison(t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        out[0] = math.nan
        return out

    b.call(A.mul.Tensor, x, 2.0, module="scale")  # 120000 overflows float16 in any kernel
    b.call(A.exp.default, w, module="act", fault=poison)
    result = check(b.write(tmp_path / "run"))
    status = dict(zip(result.nodes["module"], result.nodes["status"]))
    assert status == {"scale": "warning", "act": "error"}
    assert result.first_error.kind == "nan" and "NaN/Inf" in result.first_error.reason


def test_a_basic_ieee_op_one_ulp_off_errs_but_a_transcendental_one_ulp_off_passes(tmp_path):
    def run(path: Path, op, fault: bool) -> tracecmp.CheckResult:
        b = TraceBuilder(data=True)
        x = b.source("input.0", torch.randn(64, generator=torch.Generator().manual_seed(1)).abs() + 0.5)

        def bump(t: torch.Tensor) -> torch.Tensor:
            out = t.clone()
            out[3] = torch.nextafter(out[3], torch.tensor(math.inf))
            return out

        b.call(op, x, fault=bump if fault else None)
        return check(b.write(path))

    assert run(tmp_path / "sqrt", A.sqrt.default, True).first_error is not None
    assert "correctly rounded" in run(tmp_path / "sqrt2", A.sqrt.default, True).first_error.reason
    assert run(tmp_path / "exp", A.exp.default, True).first_error is None  # 1 ulp: within any libm


def test_standards_parse_and_refuse_nonsense():
    s = Standards.parse("margin=8,floor=2,bf16_ulps=2")
    assert (s.margin, s.floor, s.element_ulps["bfloat16"]) == (8.0, 2.0, 2.0)
    for bad in ("margin=-1", "margin=x", "nonsense=1", "warn_margin=9"):
        with pytest.raises(tracecmp.TracecmpError):
            Standards.parse(bad)


def test_a_stricter_margin_or_a_looser_one_moves_the_verdict(tmp_path):
    path = record(tmp_path / "run", data=True, faults={"gelu": scale(1 + 3e-5)})
    assert check(path).first_error is not None
    assert check(path, standards="margin=1000,warn_margin=500,floor=1000").first_error is None


# -- statistics only -----------------------------------------------------------------------------
def test_statistics_find_a_monotone_op_off_at_its_extremes_and_say_the_evidence_is_weaker(tmp_path):
    result = check(record(tmp_path / "run", faults={"gelu": scale(1 + 3e-5)}))
    d = result.first_error
    assert d is not None and (d.op, d.module) == ("aten.gelu.default", "act")
    assert "whatever its input values were" in d.reason
    assert result.evidence == "statistics" and "weaker evidence" in result.verdict()
    assert any("statistics" in w for w in result.warnings)
    assert "statistics only" in result.summary()
    clean = check(record(tmp_path / "clean"))
    assert clean.first_error is None and clean.counts()["skipped"] > 0  # what statistics cannot pin is not passed


def _fp16(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to float16 and back: a float16 kernel emulated in float32 (it reads float16
    inputs, accumulates in float32 and rounds its output once), on any torch's CPU."""
    return t.half().float()


def test_statistics_find_a_softmax_computed_in_float16(tmp_path):
    def run(path: Path, fault: bool) -> tracecmp.CheckResult:
        b = TraceBuilder()
        x = b.source("input.0", torch.randn(32, 24, generator=torch.Generator().manual_seed(2)) * 3)
        fp16 = (lambda t: _fp16(A._softmax.default(_fp16(b.value(x)), -1, False))) if fault else None
        b.call(A._softmax.default, x, -1, False, module="attn", fault=fp16)
        return check(b.write(path))

    assert run(tmp_path / "clean", False).first_error is None
    d = run(tmp_path / "fp16", True).first_error
    assert d is not None and d.module == "attn" and ("mean" in d.reason or "float16 grid" in d.reason)


def test_statistics_find_an_output_on_the_float16_grid(tmp_path):
    def run(path: Path, fault: bool) -> tracecmp.CheckResult:
        g = torch.Generator().manual_seed(3)
        b = TraceBuilder()
        x, w = (
            b.source("input.0", torch.randn(16, 32, generator=g)),
            b.param("fc.weight", torch.randn(32, 8, generator=g)),
        )
        half = (lambda t: _fp16(_fp16(b.value(x)) @ _fp16(b.value(w)))) if fault else None
        b.call(A.mm.default, x, w, module="fc", fault=half)
        return check(b.write(path))

    clean = run(tmp_path / "clean", False)
    assert clean.first_error is None and clean.counts()["skipped"] == 1  # a matmul pins nothing
    d = run(tmp_path / "fp16", True).first_error
    assert d is not None and d.module == "fc" and "float16 grid" in d.reason


def test_statistics_nan_from_finite_inputs_is_put_down_to_float16_range(tmp_path):
    b = TraceBuilder()
    g = torch.Generator().manual_seed(4)
    x, w = (
        b.source("input.0", torch.randn(8, 8, generator=g) * 3e4),
        b.param("fc.weight", torch.randn(8, 8, generator=g) * 4),
    )
    half = lambda t: _fp16(_fp16(b.value(x)) @ _fp16(b.value(w)))  # noqa: E731
    b.call(A.mm.default, x, w, module="head", fault=half)
    d = check(b.write(tmp_path / "run")).first_error
    assert d is not None and d.kind == "nan" and "rounded to float16 reproduces it" in d.reason


def test_statistics_skip_ops_that_depend_on_indices_or_masks(tmp_path):
    b = TraceBuilder()
    g = torch.Generator().manual_seed(5)
    weight = b.param("embed.weight", torch.randn(10, 4, generator=g))
    ids = b.source("input.0", torch.tensor([1, 7, 3]))
    b.call(A.embedding.default, weight, ids, module="embed")
    x = b.source("input.1", torch.randn(3, 4, generator=g))
    mask = b.source("input.2", torch.tensor([[True, False, True, False]] * 3))
    b.call(A.masked_fill.Scalar, x, mask, -math.inf)
    reasons = check(b.write(tmp_path / "run")).nodes.set_index("op")["reason"]
    assert "indices" in reasons["aten.embedding.default"] and "mask" in reasons["aten.masked_fill.Scalar"]


def test_draws_match_the_statistics_and_keep_their_grid():
    g = torch.Generator().manual_seed(0)
    spec = TensorSpec((1000,), "float32", -2.0, 3.0, 0.1, 30.0, 2, 0, True)
    x = draw(spec, g)
    finite = x[torch.isfinite(x)]
    assert int(torch.isnan(x).sum()) == 2 and (float(finite.min()), float(finite.max())) == (-2.0, 3.0)
    assert float(finite.mean()) == pytest.approx(0.1, abs=0.05)
    grid = draw(TensorSpec((100,), "float32", -1.5, 2.25, 0.0, 10.0, 0, 0, True, grid="bfloat16"), g)
    assert all(on_grid(float(v), torch.bfloat16) for v in grid)
    # A view smaller than its base: its own extremes are unknown, so no draw pins them.
    loose = [draw(TensorSpec((50,), "float32", -2.0, 3.0, 0.0, 7.0, 0, 0, False), g) for _ in range(2)]
    assert float(loose[0].min()) != float(loose[1].min())


# -- what cannot be replayed ---------------------------------------------------------------------
def test_random_collective_opaque_and_device_only_ops_are_skipped_with_the_reason(tmp_path):
    lib = torch.library.Library("tcchk", "DEF")  # noqa: TOR901 - a device-only op: a schema, no CPU kernel
    lib.define("fused(Tensor x) -> Tensor")
    b = TraceBuilder(data=True)
    x = b.source("input.0", torch.randn(4, 4, generator=torch.Generator().manual_seed(6)))
    torch.manual_seed(0)
    b.call(A.native_dropout.default, x, 0.5, True, random=True)
    b.op("aten.mul.Tensor", [x], torch.ones(4, 4), args={"self": {"tensor": 0}, "other": "<Generator>"})
    b.op(
        "_c10d_functional.all_reduce.default",
        [x],
        b.value(x).clone(),
        args={"input": {"tensor": 0}, "reduce_op": "sum", "group_name": "0"},
    )
    b.op("tcchk.fused.default", [x], b.value(x) * 2, args={"x": {"tensor": 0}})
    b.op("npu.fast_gelu.default", [x], b.value(x), args={"self": {"tensor": 0}})
    result = check(b.write(tmp_path / "run"))
    reasons = dict(zip(result.nodes["op"], result.nodes["reason"]))
    assert set(result.nodes["status"]) == {"skipped"} and result.passed and not result.agrees
    assert "random" in reasons["aten.native_dropout.default"]
    assert "could only name" in reasons["aten.mul.Tensor"]
    assert "collective" in reasons["_c10d_functional.all_reduce.default"]
    assert "no CPU kernel" in reasons["tcchk.fused.default"]
    assert "no operator" in reasons["npu.fast_gelu.default"]
    assert cli_main(["check", str(tmp_path / "run"), "--strict"]) == 1


def test_a_custom_op_with_a_cpu_kernel_or_a_registered_reference_is_replayed(tmp_path):
    lib = torch.library.Library("tcchk2", "DEF")  # noqa: TOR901
    lib.define("scale2(Tensor x) -> Tensor")
    lib.impl("scale2", lambda x: x * 2, "CPU")
    lib.define("fused(Tensor x) -> Tensor")  # device-only, given a CPU reference below
    register_reference("tcchk2.fused.default", lambda x: torch.tanh(x))
    b = TraceBuilder(data=True)
    x = b.source("input.0", torch.randn(4, 4, generator=torch.Generator().manual_seed(7)))
    b.op("tcchk2.scale2.default", [x], b.value(x) * 2, args={"x": {"tensor": 0}}, module="s")
    b.op("tcchk2.fused.default", [x], torch.tanh(b.value(x)) * 1.001, args={"x": {"tensor": 0}}, module="f")
    result = check(b.write(tmp_path / "run"))
    status = dict(zip(result.nodes["module"], result.nodes["status"]))
    assert status == {"s": "pass", "f": "error"}


def test_a_float16_op_this_cpu_has_no_kernel_for_is_replayed_in_float32_and_rounded_once(tmp_path):
    # As torch 2.1's CPU lacks float16 matmul and softmax: the honest replay computes in float32 on
    # the recorded float16 inputs and rounds each output once to the dtype the op's meta kernel gives.
    lib = torch.library.Library("tcchk3", "DEF")  # noqa: TOR901
    lib.define("halfless(Tensor x) -> Tensor")

    def cpu(x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float16:
            raise RuntimeError("\"halfless\" not implemented for 'Half'")
        return torch.exp(x) / 3

    lib.impl("halfless", cpu, "CPU")
    lib.impl("halfless", lambda x: torch.empty_like(x), "Meta")
    b = TraceBuilder(data=True)
    x = b.source("input.0", torch.randn(64, generator=torch.Generator().manual_seed(9)).half())
    honest = (torch.exp(b.value(x).float()) / 3).half()
    b.op("tcchk3.halfless.default", [x], honest, args={"x": {"tensor": 0}}, module="good")
    b.op("tcchk3.halfless.default", [x], honest * 1.01, args={"x": {"tensor": 0}}, module="bad")
    result = check(b.write(tmp_path / "run"))
    assert dict(zip(result.nodes["module"], result.nodes["status"])) == {"good": "pass", "bad": "error"}


def test_foreach_ops_are_replayed_one_element_at_a_time_with_the_same_verdict(tmp_path):
    g = torch.Generator().manual_seed(8)
    params = [torch.randn(n, generator=g) for n in (3, 5, 7)]
    grads = [torch.randn(n, generator=g) for n in (3, 5, 7)]
    b = TraceBuilder(data=True)
    P = [b.param(f"p{i}", p) for i, p in enumerate(params)]
    G = [b.source(f"g{i}", x) for i, x in enumerate(grads)]
    outs = [p + 0.1 * x for p, x in zip(params, grads)]
    outs[2] = outs[2] * (1 + 1e-4)
    args = {"self": [{"tensor": i} for i in range(3)], "other": [{"tensor": 3 + i} for i in range(3)], "alpha": 0.1}
    b.op("aten._foreach_add.List", [*P, *G], outs, args=args, phase="optimizer")
    rank = tracecmp.load(b.write(tmp_path / "run")).rank(0)
    with Replayer(rank, detail={"float32": 4.0}) as replayer:
        own = replayer.replay(6)
    assert not isinstance(own, Skipped) and own.elements == 15 and own.error > 1e-5
    assert check(rank.path.parent).first_error.op == "aten._foreach_add.List"


def test_a_region_of_ops_runs_on_recorded_or_given_inputs(tmp_path):
    rank = tracecmp.load(record(tmp_path / "run", data=True)).rank(0)
    ops = rank.ops
    gelu = int(ops.loc[ops["op"] == "aten.gelu.default", "op_id"].item())
    ln = int(ops.loc[ops["op"] == "aten.native_layer_norm.default", "op_id"].item())
    with Replayer(rank) as replayer:
        out = replayer.run_ops([ln, gelu], golden=True)
        gelu_out = replayer.ops[gelu].outputs[0]
        assert out[gelu_out].dtype == torch.float64
        assert torch.allclose(out[gelu_out].float(), replayer.value(gelu_out), atol=1e-5)
        zero = {replayer.ops[ln].inputs[0]: torch.zeros(32, 128)}
        assert float(replayer.run_ops([ln, gelu], zero)[gelu_out].abs().max()) < 1.0


def test_worker_processes_give_the_verdicts_one_process_gives(tmp_path):
    rank = tracecmp.load(record(tmp_path / "run", data=True, faults={"gelu": scale(1 + 3e-5)})).rank(0)
    # As check replays (small ops on one thread: a reduction's bits follow the thread count).
    one = replay_ops(rank, detail={"float32": 4.0}, workers=1, small_on_one_thread=True)
    two = replay_ops(rank, detail={"float32": 4.0}, workers=2, small_on_one_thread=True)
    assert one == two
    stats = tracecmp.load(record(tmp_path / "stats", faults={"gelu": scale(1 + 3e-5)}))
    assert check(stats, workers=2).first_error.op == check(stats, workers=1).first_error.op == "aten.gelu.default"


# -- bad input, CLI, report ----------------------------------------------------------------------
def test_the_tensor_path_on_a_statistics_trace_names_the_option(tmp_path, capsys):
    path = record(tmp_path / "run")
    with pytest.raises(CheckError, match='data="tensors"') as info:
        check(path, data="tensors")
    assert "--data statistics" in str(info.value)
    assert cli_main(["check", str(path), "--data", "tensors"]) == 2
    assert 'TraceCompare(..., data="tensors")' in capsys.readouterr().err


def test_cli_exit_codes_report_and_tables(tmp_path, capsys):
    bad = record(tmp_path / "bad", data=True, faults={"gelu": scale(1 + 3e-5)})
    assert cli_main(["check", str(record(tmp_path / "good", data=True))]) == 0
    assert cli_main(["check", str(bad), "-o", str(tmp_path / "out")]) == 1
    text = capsys.readouterr().out
    assert "ERROR: first erring op aten.gelu.default in act" in text and 'only={"modules": ["act"]' in text
    for name in ("check_ops.csv", "check_suspects.csv", "check_skipped.csv", "check.html"):
        assert (tmp_path / "out" / name).is_file()
    page = (tmp_path / "out" / "check.html").read_text()
    assert "First erring op" in page and "aten.gelu.default" in page and "only=" in page
    corrupt = record(tmp_path / "corrupt", data=True)
    ops_file = next((corrupt / "rank0").glob("ops-*.parquet"))
    ops_file.write_bytes(ops_file.read_bytes()[:-40])
    assert cli_main(["check", str(corrupt)]) == 2
    assert "truncated" in capsys.readouterr().err
    (tmp_path / "notrace").mkdir()
    assert cli_main(["check", str(tmp_path / "notrace")]) == 2


def test_a_corrupt_data_file_is_bad_input_not_a_crash(tmp_path, capsys):
    path = record(tmp_path / "run", data=True)
    data = next((path / "rank0").glob("data-*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[8:16] = b"\xff" * 8  # the JSON header
    data.write_bytes(bytes(raw))
    for name in (path / "rank0").glob("chunk-*.json"):  # re-sign the chunk so only the header is wrong
        record_ = json.loads(name.read_text())
        import zlib

        record_["data"]["crc32"] = zlib.crc32(bytes(raw))
        name.write_text(json.dumps(record_))
    assert cli_main(["check", str(path)]) == 2
    assert "safetensors header" in capsys.readouterr().err


def test_selection_parses_matches_and_prints_ready_to_paste():
    only = Selection.of("modules=blocks.1,head;steps=0,2;phases=forward")
    assert only == Selection(modules=("blocks.1", "head"), steps=(0, 2), phases=("forward",))
    assert only.matches(2, "forward", "blocks.1.mlp", "aten.mm.default")
    assert not only.matches(1, "forward", "blocks.1.mlp", "aten.mm.default")
    assert not only.matches(0, "forward", "blocks.10", "aten.mm.default")
    assert Selection.of({"ops": ["mm"]}).matches(0, "backward", "x", "aten.mm.default")
    assert not Selection.of({"ops": ["aten.mm"]}).matches(0, "backward", "x", "aten.addmm.default")
    assert eval(str(only).removeprefix("only=")) == only.to_dict()  # noqa: S307 - the printed form is Python
    for bad in ({"modules": 3}, {"stepz": [1]}, {"phases": ["sideways"]}, {}, {"steps": [-1]}):
        with pytest.raises(tracecmp.TracecmpError):
            Selection.of(bad)

    class D:
        def __init__(self, module: str, step: int) -> None:
            self.module, self.step = module, step

    assert around([D("blocks.1.mlp.act", 0), D("blocks.1", 1), D("head", 0), D("x", 0)], top=2) == Selection(
        modules=("blocks.1",), steps=(0, 1)
    )
    assert around([]) is None


def test_only_needs_tensors():
    with pytest.raises(tracecmp.CaptureError, match='data="tensors"'):
        tracecmp.TraceCompare("/tmp/never", only={"modules": ["a"]})


def test_calls_alike_whose_statistics_pin_nothing_are_drawn_once_but_grid_evidence_still_is(tmp_path, monkeypatch):
    """Four layers' matmuls, the third computed in float16: the first call's draws show that a matmul's
    statistics pin nothing, so the second and fourth are not drawn again; the third's extremes lie on
    the float16 grid, which only draws can put down to chance, so it is drawn and found."""
    g = torch.Generator().manual_seed(3)
    b = TraceBuilder()
    x = b.source("input.0", torch.randn(16, 32, generator=g))
    for layer in range(4):
        w = b.param(f"fc{layer}.weight", torch.randn(32, 32, generator=g), module=f"fc{layer}")
        half = (lambda t, w=w: _fp16(_fp16(b.value(x)) @ _fp16(b.value(w)))) if layer == 2 else None
        b.call(A.mm.default, x, w, module=f"fc{layer}", fault=half)
    rank = tracecmp.load(b.write(tmp_path / "t")).rank(0)
    checker = StatisticsChecker(rank)
    drawn: list[int] = []
    real_draw = StatisticsChecker._draw
    monkeypatch.setattr(
        StatisticsChecker, "_draw", lambda self, op, *a, **k: drawn.append(op.op_id) or real_draw(self, op, *a, **k)
    )
    ops = rank.ops
    mms = [int(o) for o in ops.loc[ops["op"] == "aten.mm.default", "op_id"]]
    verdicts = [checker.check(o) for o in mms]
    assert [v.status for v in verdicts] == ["skipped", "skipped", "error", "skipped"]
    assert verdicts[1].reason == verdicts[0].reason and "pin none" in verdicts[0].reason
    assert "float16 grid" in verdicts[2].reason
    assert drawn == [mms[0], mms[2]]


def test_a_statistics_checker_judges_one_op(tmp_path):
    rank = tracecmp.load(record(tmp_path / "run", faults={"gelu": scale(1 + 3e-5)})).rank(0)
    ops = rank.ops
    gelu = int(ops.loc[ops["op"] == "aten.gelu.default", "op_id"].item())
    verdict = StatisticsChecker(rank).check(gelu)
    assert verdict.status == "error" and verdict.evidence == "statistics" and "max" in verdict.checks
    assert stats_of(torch.ones(2))["max"] == 1.0


def test_progress_is_shown_when_asked(tmp_path, capsys):
    check(record(tmp_path / "run", data=True), progress=True)
    err = capsys.readouterr().err  # no terminal here: whole lines
    assert "tracecmp check:" in err and "100%" in err
