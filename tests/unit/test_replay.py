"""Replay of recorded ops (tracecmp.numerics.replay) on hand-recorded traces with whole tensors."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import tracecmp
from tests.tracebuild import TraceBuilder
from tests.unit.test_localize import noise, record, scale
from tracecmp.cli.main import main as cli_main
from tracecmp.comparison import Tolerances
from tracecmp.numerics.replay import replay_rank
from tracecmp.numerics.replay.measure import errors_against

A = torch.ops.aten


def test_a_clean_cpu_trace_replays_to_its_honest_error(tmp_path):
    rank = tracecmp.load(record(tmp_path / "run", data=True)).rank(0)
    own = replay_rank(rank)
    ops = rank.ops
    computing = ops[ops["kind"] == "op"]
    assert set(own) == set(computing["op_id"])  # every op replayed, views rebuilt from their bases
    for op_id, e in own.items():
        # Recorded on this CPU in these dtypes: the honest replay gives the very same bits.
        assert e.error == e.honest, ops.loc[ops["op_id"] == op_id, "op"].item()
        assert e.dtype == "float32" and 0 <= e.error < 1e-5
    names = dict(zip(ops["op_id"], ops["op"]))
    assert any(names[o] == "aten.native_layer_norm_backward.default" for o in own)


def test_a_statistics_trace_has_nothing_to_replay(tmp_path):
    assert replay_rank(tracecmp.load(record(tmp_path / "run")).rank(0)) == {}


@pytest.mark.parametrize(
    "site,op,phase",
    [
        ("gelu", "aten.gelu.default", "forward"),
        ("ln", "aten.native_layer_norm.default", "forward"),
        ("gelu_backward", "aten.gelu_backward.default", "backward"),
        ("grad_b1", "aten.sum.dim_IntList", "backward"),
    ],
)
def test_replay_finds_a_fault_smaller_than_the_tf32_background(tmp_path, site, op, phase):
    bench = record(tmp_path / "bench", data=True)
    target = record(tmp_path / "target", data=True, tf32=True, faults={site: scale(1 + 3e-5)})
    without = tracecmp.compare(target, bench, replay=False)
    assert without.first_divergence is None or without.first_divergence.op != op  # hidden in the noise
    result = tracecmp.compare(target, bench)
    d = result.first_divergence
    assert d is not None and (d.op, d.phase, d.kind) == (op, phase, "computation")
    assert "float64 replay" in d.reason
    assert d.metrics["own_error"] > 4 * d.metrics["honest_error"]
    row = result.nodes[result.nodes["op_id"] == d.op_id].iloc[0]
    assert row["own_error"] == pytest.approx(3e-5, rel=0.3)


def test_tf32_background_alone_is_not_a_divergence_under_replay(tmp_path):
    bench = record(tmp_path / "bench", data=True)
    result = tracecmp.compare(record(tmp_path / "target", data=True, tf32=True), bench)
    assert result.first_divergence is None
    replayed = result.nodes[result.nodes["own_error"].notna()]
    assert len(replayed) > 10
    # Without the TF32 allowance the rounded matmuls are their own errors.
    strict = tracecmp.compare(
        record(tmp_path / "target2", data=True, tf32=True), bench, tolerances={"allow_tf32": False}
    )
    assert strict.first_divergence is not None and strict.first_divergence.op == "aten.addmm.default"


def test_a_whole_bf16_run_reads_as_honest_under_replay(tmp_path):
    bench = record(tmp_path / "bench", data=True)
    result = tracecmp.compare(record(tmp_path / "target", data=True, dtype=torch.bfloat16), bench)
    replay_roots = [s for s in result.suspects if "replay" in s.reason]
    assert replay_roots == []


def _relu_after_tf32(path: Path, fault: float | None) -> Path:
    """x @ w at TF32 in the target (background), then relu, whose output may get one ulp more."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(8, 16, generator=g), torch.randn(16, 8, generator=g)
    b = TraceBuilder(data=True)
    X, W = b.source("input.0", x), b.param("fc.weight", w, module="fc")
    tf32 = None
    if fault is not None:
        from tests.tracebuild import round_tf32

        tf32 = lambda _: A.mm.default(round_tf32(x), round_tf32(w))  # noqa: E731
    H = b.call(A.mm.default, X, W, module="fc", fault=tf32)

    def bump(t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        i = int(out.flatten().argmax())
        out.view(-1)[i] = torch.nextafter(out.view(-1)[i], torch.tensor(math.inf))
        return out

    b.call(A.relu.default, H, module="act", fault=bump if fault else None)
    return b.write(path)


def test_an_op_that_computes_exactly_is_wrong_by_one_ulp(tmp_path):
    result = tracecmp.compare(_relu_after_tf32(tmp_path / "t", fault=1.0), _relu_after_tf32(tmp_path / "b", None))
    d = result.first_divergence
    assert d is not None and d.op == "aten.relu.default"
    assert "exactly" in d.reason


def test_flushed_denormals_are_not_an_error():
    honest = torch.tensor([1.0, 1e-40, -2.0])  # a float32 denormal, exact: the op needed no rounding
    recorded = torch.tensor([1.0, 0.0, -2.0])  # an accelerator that flushes denormals to zero
    assert errors_against(recorded, honest, honest.double()) == (0.0, 0.0)
    bumped = torch.tensor([1.0, 1e-40, -2.0000002])
    assert errors_against(bumped, honest, honest.double())[0] > 0


def test_nan_where_the_replay_has_none_is_an_infinite_error():
    reference = torch.tensor([1.0, 2.0], dtype=torch.float64)
    error, honest = errors_against(torch.tensor([1.0, math.nan]), torch.tensor([1.0, 2.0]), reference)
    assert math.isinf(error) and honest == 0.0
    same_nan = torch.tensor([1.0, math.nan])
    assert errors_against(same_nan, same_nan, torch.tensor([1.0, math.nan], dtype=torch.float64)) == (0.0, 0.0)


def _nan_row_divided(path: Path, recorded_bits: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """A bfloat16 gradient with one NaN row divided by 49 (a mean's backward), its recorded output
    rewritten by ``recorded_bits``; returns the division's replay."""
    grad = torch.randn(8, 64).to(torch.bfloat16)
    grad[3] = math.nan
    b = TraceBuilder(data=True)
    b.call(A.div.Scalar, b.source("input.0", grad), 49, phase="backward", fault=recorded_bits)
    return replay_rank(tracecmp.load(b.write(path)).rank(0))[1]


def test_a_nans_payload_is_no_result(tmp_path):
    # One kernel's vectorized and scalar loops make different NaN bits from one NaN input; a replay
    # that gives every number bit for bit and NaN where NaN is gives the recorded output.
    def other_nan(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.int16).masked_fill(torch.isnan(t), 0x7FC0).view(torch.bfloat16)

    assert _nan_row_divided(tmp_path / "nan", other_nan).bitwise

    def one_ulp(t: torch.Tensor) -> torch.Tensor:
        bits = t.view(torch.int16).clone()
        bits[0, 0] += 1
        return bits.view(torch.bfloat16)

    assert not _nan_row_divided(tmp_path / "ulp", one_ulp).bitwise


def test_ops_that_cannot_be_replayed_are_left_out_not_called_correct(tmp_path):
    b = TraceBuilder(data=True)
    x = b.source("input.0", torch.randn(4, 4, generator=torch.Generator().manual_seed(1)))
    torch.manual_seed(0)
    dropped, _mask = b.call(A.native_dropout.default, x, 0.5, True, random=True)
    opaque = b.op("aten.mul.Tensor", [dropped], torch.ones(4, 4), args={"self": {"tensor": 0}, "other": "<Generator>"})
    b.call(A.relu.default, x)
    rank = tracecmp.load(b.write(tmp_path / "run")).rank(0)
    own = replay_rank(rank)
    names = dict(zip(rank.ops["op_id"], rank.ops["op"]))
    assert [names[o] for o in own] == ["aten.relu.default"]
    assert opaque.op_id not in own


def test_replay_switches(tmp_path):
    bench = record(tmp_path / "bench")
    stats_only = tracecmp.compare(record(tmp_path / "target"), bench, replay=True)
    assert any("no replay" in w for w in stats_only.warnings)
    assert stats_only.nodes["own_error"].isna().all()
    with_data = record(tmp_path / "target_data", data=True)
    assert tracecmp.compare(with_data, bench, exact=True).nodes["own_error"].isna().all()
    assert tracecmp.compare(with_data, bench, replay=False).nodes["own_error"].isna().all()
    replayed = tracecmp.compare(with_data, bench)
    assert replayed.nodes["own_error"].notna().any()
    assert "Replay: " in replayed.summary()


def test_replay_tolerances_parse_and_validate():
    tol = Tolerances.parse("replay_margin=8,replay_local=2")
    assert (tol.replay_margin, tol.replay_local) == (8.0, 2.0)
    with pytest.raises(tracecmp.TracecmpError):
        Tolerances(replay_margin=-1)


def test_cli_no_replay(tmp_path, capsys):
    bench = record(tmp_path / "bench", data=True)
    target = record(tmp_path / "target", data=True, tf32=True, faults={"gelu": scale(1 + 3e-5)})
    assert cli_main(["compare", str(target), str(bench)]) == 1
    assert cli_main(["compare", str(target), str(bench), "--no-replay"]) == 0
    capsys.readouterr()


def test_noise_fault_found_by_replay_has_the_largest_score(tmp_path):
    bench = record(tmp_path / "bench", data=True)
    target = record(tmp_path / "target", data=True, tf32=True, faults={"gelu_backward": noise(1e-4)})
    result = tracecmp.compare(target, bench)
    assert result.suspects and result.suspects[0].op == "aten.gelu_backward.default"


def _after_tf32(
    path: Path, op: Any, fault: Callable[[torch.Tensor], torch.Tensor] | None, tf32: bool = True, **kwargs: Any
) -> Path:
    """x @ w (at TF32 in a target: background noise), then ``op(h, h2)`` whose output ``fault`` may rewrite."""
    from tests.tracebuild import round_tf32

    g = torch.Generator().manual_seed(4)
    x, w, w2 = torch.randn(8, 16, generator=g), torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g)
    b = TraceBuilder(data=True)
    X, W, W2 = b.source("input.0", x), b.param("fc.weight", w, module="fc"), b.param("fc2.weight", w2, module="fc2")
    rounded = (lambda a, c: lambda _: A.mm.default(round_tf32(a), round_tf32(c))) if tf32 else (lambda a, c: None)
    H = b.call(A.mm.default, X, W, module="fc", fault=rounded(x, w))
    H2 = b.call(A.mm.default, X, W2, module="fc2", fault=rounded(x, w2))
    b.call(op, H, H2, module="merge", fault=fault, **kwargs)
    return b.write(path)


def _next_float_at(index: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def bump(t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        flat = out.view(-1)
        flat[index] = torch.nextafter(flat[index], torch.tensor(math.inf))
        return out

    return bump


@pytest.mark.parametrize("op", [A.add.Tensor, A.mul.Tensor, A.div.Tensor])
def test_a_basic_ieee_op_one_ulp_off_is_a_root(tmp_path, op):
    bench = _after_tf32(tmp_path / "b", op, None, tf32=False)
    result = tracecmp.compare(_after_tf32(tmp_path / "t", op, _next_float_at(5)), bench)
    d = result.first_divergence
    assert d is not None and d.op == str(op) and "correctly rounded" in d.reason
    clean = tracecmp.compare(_after_tf32(tmp_path / "t2", op, None), bench)
    assert clean.first_divergence is None


def test_a_scaled_add_is_not_held_to_one_rounding(tmp_path):
    # add with alpha != 1 is a multiply and an add: a device may fuse them (one rounding, not two).
    bench = _after_tf32(tmp_path / "b", A.add.Tensor, None, tf32=False, alpha=0.5)
    result = tracecmp.compare(_after_tf32(tmp_path / "t", A.add.Tensor, _next_float_at(5), alpha=0.5), bench)
    assert result.first_divergence is None


def test_a_matmul_output_rounded_to_bf16_stands_out_of_the_tf32_noise(tmp_path):
    def rounded(path: Path) -> Path:
        from tests.tracebuild import round_tf32

        g = torch.Generator().manual_seed(4)
        x, w = torch.randn(64, 128, generator=g), torch.randn(128, 64, generator=g)
        b = TraceBuilder(data=True)
        X, W = b.source("input.0", x), b.param("fc.weight", w, module="fc")
        b.call(
            A.mm.default,
            X,
            W,
            module="fc",
            fault=lambda _: A.mm.default(round_tf32(x), round_tf32(w)).to(torch.bfloat16).float(),
        )
        return b.write(path)

    def clean(path: Path) -> Path:
        g = torch.Generator().manual_seed(4)
        x, w = torch.randn(64, 128, generator=g), torch.randn(128, 64, generator=g)
        b = TraceBuilder(data=True)
        X, W = b.source("input.0", x), b.param("fc.weight", w, module="fc")
        b.call(A.mm.default, X, W, module="fc")
        return b.write(path)

    result = tracecmp.compare(rounded(tmp_path / "t"), clean(tmp_path / "b"))
    d = result.first_divergence
    assert d is not None and d.op == "aten.mm.default"
    # Several times what an honest TF32 kernel makes here (the larger of rounding its inputs to
    # nearest and toward zero), and beyond one TF32 unit.
    assert d.metrics["own_error"] > 3 * d.metrics["honest_error"] and d.metrics["own_error"] > 2.0**-10


def test_a_denormal_where_the_exact_result_is_zero_is_an_error():
    honest = torch.tensor([1.0, 0.0, -2.0])
    made_up = torch.tensor([1.0, 1e-45, -2.0])
    error, _ = errors_against(made_up, honest, honest.double())
    assert error > 0


def test_medium_matmul_precision_means_a_bf16_honest_model(tmp_path):
    from tracecmp.aten.rounding import REDUCED_MODELS
    from tracecmp.numerics.precision import reduced_matmul_precision

    traces = []
    for name, precision in (("a", "high"), ("b", "medium")):
        path = record(tmp_path / name)
        manifest = path / "manifest.json"
        data = json.loads(manifest.read_text())
        data["determinism"] = {"float32_matmul_precision": precision}
        manifest.write_text(json.dumps(data))
        traces.append(tracecmp.load(path))
    assert reduced_matmul_precision(traces[0]) == "tf32"
    assert reduced_matmul_precision(*traces) == "bf16"
    x = torch.tensor([1.0 + 2.0**-9])
    to_nearest = {name: models[0][1] for name, models in REDUCED_MODELS.items()}
    assert to_nearest["bf16"](x).item() == 1.0 and to_nearest["tf32"](x).item() == x.item()
    with pytest.raises(ValueError):
        replay_rank(traces[0].rank(0), reduced="fp8")


def test_a_long_chain_of_views_is_rebuilt_or_left_out_without_crashing(tmp_path):
    b = TraceBuilder(data=True)
    x = b.source("input.0", torch.randn(4, 4, generator=torch.Generator().manual_seed(2)))
    short = b.call(A.t.default, b.call(A.t.default, x))
    near = b.call(A.relu.default, short)
    v = x
    for _ in range(200):
        v = b.call(A.t.default, v)
    far = b.call(A.relu.default, v)
    own = replay_rank(tracecmp.load(b.write(tmp_path / "run")).rank(0))
    assert near.op_id in own and own[near.op_id].error == 0.0
    assert far.op_id not in own


def test_sqrt_is_held_to_one_rounding(tmp_path):
    from tests.tracebuild import round_tf32

    def run(path: Path, target: bool) -> Path:
        g = torch.Generator().manual_seed(6)
        x, w = torch.randn(8, 16, generator=g), torch.randn(16, 8, generator=g)
        b = TraceBuilder(data=True)
        X, W = b.source("input.0", x), b.param("fc.weight", w, module="fc")
        H = b.call(
            A.mm.default,
            X,
            W,
            module="fc",
            fault=(lambda _: A.mm.default(round_tf32(x), round_tf32(w))) if target else None,
        )
        M = b.call(A.abs.default, H)
        b.call(A.sqrt.default, M, module="norm", fault=_next_float_at(3) if target else None)
        return b.write(path)

    d = tracecmp.compare(run(tmp_path / "t", True), run(tmp_path / "b", False)).first_divergence
    assert d is not None and d.op == "aten.sqrt.default" and "correctly rounded" in d.reason


def test_the_report_counts_replayed_ops(tmp_path):
    from tracecmp.render import write_report

    bench = record(tmp_path / "bench", data=True)
    result = tracecmp.compare(
        record(tmp_path / "target", data=True, tf32=True, faults={"gelu": scale(1 + 3e-5)}), bench
    )
    page = Path(write_report(result, tmp_path / "out")).read_text()
    assert "<span>replayed</span>" in page and "float64 replay" in page


def _tf32_chain(
    path: Path,
    rounding: Callable[[torch.Tensor], torch.Tensor] | None,
    fault: float | None = None,
    accumulate: str = "float32",
    data: bool = True,
) -> Path:
    """Six matmuls in a chain (with tanh between), every one at reduced precision in the target:
    inputs rounded by ``rounding`` (None: plain float32, the bench). ``fault`` scales the fourth
    matmul's output; ``accumulate="float64"`` sums in another order than this CPU (a device)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(16, 48, generator=g)
    weights = [torch.randn(48, 48, generator=g) / 7 for _ in range(6)]
    b = TraceBuilder(data=data)
    h = b.source("input.0", x)
    for i, w in enumerate(weights):
        W = b.param(f"fc{i}.weight", w, module=f"fc{i}")
        hv = b.value(h)

        def device(_: torch.Tensor, hv: torch.Tensor = hv, w: torch.Tensor = w, i: int = i) -> torch.Tensor:
            a, m = (rounding(hv), rounding(w)) if rounding is not None else (hv, w)
            out = (a.double() @ m.double()).float() if accumulate == "float64" else a @ m
            return out * fault if fault is not None and i == 3 else out

        h = b.call(A.mm.default, h, W, module=f"fc{i}", fault=device)
        h = b.call(A.tanh.default, h, module=f"act{i}")
    return b.write(path)


def _truncate(x: torch.Tensor) -> torch.Tensor:
    return (x.contiguous().view(torch.int32) & ~0x1FFF).view(torch.float32)


@pytest.mark.parametrize(
    "rounding,accumulate",
    [("to nearest even", "float32"), ("toward zero", "float32"), ("to nearest even", "float64")],
    ids=["rn", "rz", "rn-other-order"],
)
def test_a_matmul_fault_far_below_tf32_noise_shows_where_the_runs_matmuls_are_reproduced(
    tmp_path, rounding, accumulate
):
    from tests.tracebuild import round_tf32

    model = round_tf32 if rounding == "to nearest even" else _truncate
    bench = _tf32_chain(tmp_path / "bench", None)
    # The background alone: six TF32 matmuls, no root, whichever rounding and accumulation order.
    clean = tracecmp.compare(_tf32_chain(tmp_path / "clean", model, accumulate=accumulate), bench)
    assert clean.first_divergence is None, clean.first_divergence
    fault = 1 + 2e-5  # TF32 leaves ~5e-4 on these outputs: 25x the fault
    target = _tf32_chain(tmp_path / "target", model, fault=fault, accumulate=accumulate)
    result = tracecmp.compare(target, bench)
    d = result.first_divergence
    assert d is not None and (d.op, d.module, d.kind) == ("aten.mm.default", "fc3", "computation"), result.suspects
    assert f"rounded to tf32 ({rounding})" in d.reason and "accumulation errors" in d.reason
    assert d.metrics["own_error"] < 4 * d.metrics["honest_error"]  # the plain ratio rule could not see it
    assert len(result.suspects) == 1


def test_matmuls_no_rounding_model_reproduces_keep_the_ratio_rule(tmp_path):
    from tests.tracebuild import round_tf32

    bench = _tf32_chain(tmp_path / "bench", None)

    def coarse(x: torch.Tensor) -> torch.Tensor:  # some other way of running at low precision
        return round_tf32(x * (1 + 1e-4))

    target = _tf32_chain(tmp_path / "target", coarse, fault=1 + 2e-5)
    rank = tracecmp.load(target).rank(0)
    fits = [own.fits for own in replay_rank(rank, reduced="tf32").values() if own.fits]
    assert len(fits) == 6 and min(min(f) for f in fits) > 64  # neither model reproduces the run
    result = tracecmp.compare(target, bench)
    assert result.first_divergence is None  # hidden in the noise, and no false alarm either


def test_a_device_that_truncates_to_tf32_reads_as_noise_in_statistics_too(tmp_path):
    # Truncation shrinks every product alike: its error does not average out in norm and mean.
    bench = _tf32_chain(tmp_path / "bench", None, data=False)
    result = tracecmp.compare(_tf32_chain(tmp_path / "target", _truncate, data=False), bench)
    assert result.first_divergence is None, result.first_divergence
    faulty = tracecmp.compare(_tf32_chain(tmp_path / "faulty", _truncate, fault=1.05, data=False), bench)
    d = faulty.first_divergence
    assert d is not None and (d.op, d.module) == ("aten.mm.default", "fc3")


def test_a_statistics_comparison_full_of_noise_points_to_tensors(tmp_path):
    result = tracecmp.compare(record(tmp_path / "target", tf32=True), record(tmp_path / "bench"))
    assert result.first_divergence is None and not result.warnings
    assert 'capture the target with data="tensors"' in result.summary()
    replayed = tracecmp.compare(record(tmp_path / "t2", tf32=True, data=True), record(tmp_path / "b2", data=True))
    assert "Replay: none" not in replayed.summary() and "re-run on their recorded inputs" in replayed.summary()


@pytest.mark.parametrize("golden", [False, True])
def test_non_finite_scalars_are_decoded_as_numbers(golden: bool) -> None:
    """A Scalar argument (schema type "number") recorded as "-inf" replays as the float: attention
    masks fill with it, and a softmax decomposition compares with it."""
    from tracecmp.aten.args import decode_call

    x = torch.tensor([1.0, 2.0])
    mask = torch.tensor([True, False])
    call = decode_call(
        torch.ops.aten.masked_fill.Scalar,
        {"self": {"tensor": 0}, "mask": {"tensor": 1}, "value": "-inf"},
        [x, mask],
        golden=golden,
    )
    assert call is not None
    assert torch.ops.aten.masked_fill.Scalar(*call[0], **call[1]).tolist() == [-math.inf, 2.0]
    call = decode_call(torch.ops.aten.ne.Scalar, {"self": {"tensor": 0}, "other": "inf"}, [x], golden=golden)
    assert call is not None and torch.ops.aten.ne.Scalar(*call[0], **call[1]).all()


def test_an_in_place_op_of_a_float64_run_replays_to_its_own_bits(tmp_path):
    """The float64 replay of a float64 run copies its inputs too: an in-place op must not write
    the recorded value that the honest replay reads next."""
    g = torch.Generator().manual_seed(0)
    b = TraceBuilder(data=True)
    x = b.source("input.0", torch.randn(64, generator=g, dtype=torch.float64))
    y = b.source("input.1", torch.randn(64, generator=g, dtype=torch.float64))
    b.call(A.add_.Tensor, b.call(A.mul.Tensor, x, y), y, alpha=0.3)
    own = replay_rank(tracecmp.load(b.write(tmp_path / "run")).rank(0))
    assert [(e.error, e.honest, e.bitwise) for e in own.values()] == [(0.0, 0.0, True)] * 2
