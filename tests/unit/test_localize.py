"""Localization on hand-recorded runs: roots, not the nodes that inherit their error.

Each run is a small training step (linear, layer norm, gelu, linear, loss; its backward by hand;
an SGD update) recorded op by op with real aten calls through ``tests.tracebuild``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

import tracecmp
from tests.tracebuild import TraceBuilder, round_tf32
from tracecmp.errors import CompareError
from tracecmp.verdict.records import STATUSES

A = torch.ops.aten


def record(
    path: Path,
    *,
    dtype: torch.dtype = torch.float32,
    faults: dict[str, Callable[[torch.Tensor], torch.Tensor]] | None = None,
    gelu: str = "none",
    eps: float = 1e-5,
    weight_delta: float = 0.0,
    extra_clone: bool = False,
    extra_scale: float | None = None,
    tf32: bool = False,
    dropout_seed: int | None = None,
    complete: bool = True,
    data: bool = False,
) -> Path:
    """Record one training step of a 2-layer MLP with layer norm; ``faults`` maps a site to an output rewrite."""
    faults = faults or {}
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, generator=g)
    w1 = torch.randn(128, 64, generator=g) / 8
    b1 = torch.randn(128, generator=g) / 10
    lw, lb = 1 + torch.randn(128, generator=g) / 10, torch.randn(128, generator=g) / 10
    w2 = torch.randn(16, 128, generator=g) / 11
    if weight_delta:
        w2 = w2 + weight_delta * torch.randn(16, 128, generator=torch.Generator().manual_seed(9)) * w2.abs().mean()
    b = TraceBuilder(complete=complete, data=data)

    def mm_in(t: torch.Tensor) -> torch.Tensor:
        return round_tf32(t) if tf32 else t

    def call(site: str, op: Any, *args: Any, **kw: Any) -> Any:
        return b.call(op, *args, fault=faults.get(site), **kw)

    X = b.source("input.0", x.to(dtype), module="")
    W1 = b.param("fc1.weight", w1.to(dtype), module="fc1")
    B1 = b.param("fc1.bias", b1.to(dtype), module="fc1")
    W1t = b.call(A.t.default, W1, module="fc1")
    # A device running matmuls at TF32 rounds their inputs.
    tf32_fc1 = (lambda _: A.addmm.default(b.value(B1), mm_in(b.value(X)), mm_in(b.value(W1t)))) if tf32 else None
    H = b.call(A.addmm.default, B1, X, W1t, module="fc1", fault=faults.get("fc1", tf32_fc1))
    LW, LB = b.param("ln.weight", lw.to(dtype), module="ln"), b.param("ln.bias", lb.to(dtype), module="ln")
    N, mean, rstd = call("ln", A.native_layer_norm.default, H, [128], LW, LB, eps, module="ln")
    if extra_clone:
        N = b.call(A.clone.default, N, module="ln")
    if extra_scale is not None:
        N = b.call(A.mul.Tensor, N, extra_scale, module="ln")
    G = call("gelu", A.gelu.default, N, approximate=gelu, module="act")
    if dropout_seed is not None:
        torch.manual_seed(dropout_seed)
        G, mask = b.call(A.native_dropout.default, G, 0.1, True, module="drop", random=True)
    W2 = b.param("fc2.weight", w2.to(dtype), module="fc2")
    W2t = b.call(A.t.default, W2, module="fc2")
    tf32_fc2 = (lambda _: A.mm.default(mm_in(b.value(G)), mm_in(b.value(W2t)))) if tf32 else None
    OUT = b.call(A.mm.default, G, W2t, module="fc2", fault=faults.get("fc2", tf32_fc2))
    SQ = call("square", A.mul.Tensor, OUT, OUT)
    call("loss", A.mean.default, SQ)
    # backward, by hand
    GO = call("grad_out", A.mul.Tensor, OUT, 2.0 / (32 * 16), phase="backward", module="")
    GW2 = call(
        "grad_w2",
        A.mm.default,
        b.call(A.t.default, GO, phase="backward", module="fc2"),
        G,
        phase="backward",
        module="fc2",
    )
    GG = call("grad_g", A.mm.default, GO, W2, phase="backward", module="fc2")
    GN = call("gelu_backward", A.gelu_backward.default, GG, N, approximate=gelu, phase="backward", module="act")
    GH, GLW, GLB = call(
        "ln_backward",
        A.native_layer_norm_backward.default,
        GN,
        H,
        [128],
        mean,
        rstd,
        LW,
        LB,
        [True, True, True],
        phase="backward",
        module="ln",
    )
    GW1 = call(
        "grad_w1",
        A.mm.default,
        b.call(A.t.default, GH, phase="backward", module="fc1"),
        X,
        phase="backward",
        module="fc1",
    )
    GB1 = call("grad_b1", A.sum.dim_IntList, GH, [0], phase="backward", module="fc1")
    # optimizer: SGD
    for param, grad, site in ((W1, GW1, "sgd_w1"), (B1, GB1, "sgd_b1"), (W2, GW2, "sgd_w2")):
        call(site, A.add.Tensor, param, grad, alpha=-0.1, phase="optimizer", module="")
    return b.write(path)


def pair(tmp_path: Path, **target: Any) -> tracecmp.CompareResult:
    bench = record(tmp_path / "bench", data=target.get("data", False))
    return tracecmp.compare(record(tmp_path / "target", **target), bench)


def scale(factor: float) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t * factor


def noise(rel: float, seed: int = 5) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t * (1 + rel * torch.randn(t.shape, generator=torch.Generator().manual_seed(seed)))


def test_identical_runs_agree(tmp_path):
    result = pair(tmp_path)
    assert result.first_divergence is None and result.suspects == []
    assert result.agrees
    assert set(result.nodes["status"]) == {"agrees"}
    assert result.verdict().startswith("AGREE")


@pytest.mark.parametrize(
    "site,op,phase",
    [
        ("gelu", "aten.gelu.default", "forward"),
        ("ln", "aten.native_layer_norm.default", "forward"),
        ("fc2", "aten.mm.default", "forward"),
        ("gelu_backward", "aten.gelu_backward.default", "backward"),
        ("grad_w1", "aten.mm.default", "backward"),
        ("sgd_b1", "aten.add.Tensor", "optimizer"),
    ],
)
@pytest.mark.parametrize(
    "fault", [scale(1 + 1e-6), noise(1e-3), scale(1.1)], ids=["scale1e-6", "noise1e-3", "scale0.1"]
)
def test_a_faulty_op_is_the_first_divergence(tmp_path, site, op, phase, fault):
    result = pair(tmp_path, faults={site: fault})
    d = result.first_divergence
    assert d is not None and (d.op, d.phase, d.kind) == (op, phase, "computation")
    assert d.bench_op_id == d.op_id
    assert "agrees bitwise" in d.reason


def test_error_inherited_downstream_is_not_blamed(tmp_path):
    result = pair(tmp_path, faults={"ln": scale(1.01)})
    assert [s.op for s in result.suspects] == ["aten.native_layer_norm.default"]
    nodes = result.nodes.set_index("op_id")
    root = result.first_divergence.op_id
    downstream = nodes[(nodes.index > root) & (nodes["kind"] == "op")]
    assert (downstream["status"].isin(["diverged", "agrees"])).all()
    assert (downstream["root_kind"] == "").all()
    assert (downstream.loc[downstream["status"] == "diverged", "introduced"] < downstream["error"].max()).all()


def test_argument_difference_is_a_root_of_its_own_kind(tmp_path):
    result = pair(tmp_path, gelu="tanh")
    d = result.first_divergence
    assert (d.op, d.kind) == ("aten.gelu.default", "argument")
    assert "approximate" in d.reason and "tanh" in d.reason


def test_layer_norm_eps_difference(tmp_path):
    result = pair(tmp_path, eps=1e-3)
    d = result.first_divergence
    assert (d.op, d.kind) == ("aten.native_layer_norm.default", "argument")
    assert "eps" in d.reason


def test_weight_difference_is_a_source_root(tmp_path):
    result = pair(tmp_path, weight_delta=1e-3)
    d = result.first_divergence
    assert (d.op, d.kind) == ("source.parameter", "source")
    assert "fc2.weight" in d.reason
    assert d.module == "fc2"


def test_nan_appearing_from_finite_inputs(tmp_path):
    def put_nan(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t[3, 5] = math.nan
        return t

    result = pair(tmp_path, faults={"gelu": put_nan})
    d = result.first_divergence
    assert (d.op, d.kind) == ("aten.gelu.default", "nan")
    assert [s.kind for s in result.suspects] == ["nan"]  # NaN flowing on is inherited
    assert "nan" in set(result.nodes["status"])


@pytest.mark.parametrize("data", [False, True], ids=["stats", "tensors"])
def test_uniform_bf16_noise_is_noise_not_roots(tmp_path, data):
    result = pair(tmp_path, dtype=torch.bfloat16, data=data)
    assert result.first_divergence is None, result.summary()
    counts = result.counts()
    assert counts["noise"] > counts["agrees"] and counts["diverged"] == 0
    assert result.agrees  # everything paired and compared; noise is not divergence
    if data:
        assert result.to_frame()["cosine"].notna().all()


def test_a_real_fault_still_shows_under_bf16_noise(tmp_path):
    result = pair(tmp_path, dtype=torch.bfloat16, faults={"gelu": scale(1.1)})
    d = result.first_divergence
    assert d is not None and d.op == "aten.gelu.default"
    assert len(result.suspects) <= 3


def test_tf32_matmuls_read_as_noise(tmp_path):
    result = pair(tmp_path, tf32=True)
    assert result.first_divergence is None, result.summary()


def test_random_op_divergence_says_so(tmp_path):
    bench = record(tmp_path / "bench", dropout_seed=1)
    result = tracecmp.compare(record(tmp_path / "target", dropout_seed=2), bench)
    d = result.first_divergence
    assert (d.op, d.kind) == ("aten.native_dropout.default", "random")
    assert "random" in d.reason


def test_extra_exact_op_is_a_pass_through_not_a_divergence(tmp_path):
    result = pair(tmp_path, extra_clone=True)
    assert result.first_divergence is None
    clone = result.nodes[result.nodes["op"] == "aten.clone.default"].iloc[0]
    # A copy on one side only is judged as one: its output against the bench value it stands for.
    (region,) = result.regions
    assert (region.kind, region.target_ops, region.bench_ops) == ("pass-through", (int(clone["op_id"]),), ())
    assert clone["status"] == "agrees" and clone["region"] == region.region_id
    assert result.agrees and result.verdict().startswith("AGREE")
    assert set(result.nodes["status"]) == {"agrees"}


def test_extra_value_changing_op_is_a_structure_root(tmp_path):
    result = pair(tmp_path, extra_scale=2.0)
    d = result.first_divergence
    assert (d.op, d.kind) == ("aten.mul.Tensor", "structure")
    assert d.bench_op_id is None


def test_op_missing_from_the_target_is_named(tmp_path):
    bench = record(tmp_path / "bench", extra_scale=2.0)
    result = tracecmp.compare(record(tmp_path / "target"), bench)
    d = result.first_divergence
    assert d.kind == "structure" and d.op == "aten.gelu.default"
    assert "aten.mul.Tensor" in d.reason
    (region,) = result.regions  # the bench-only op, accounted for as a region with no target side
    assert region.kind == "missing" and region.target_ops == () and len(region.bench_ops) == 1
    assert result.unpaired_bench.empty


def test_exact_mode_names_the_first_bitwise_change(tmp_path):
    def one_ulp(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t.view(-1)[0] = torch.nextafter(t.view(-1)[0], torch.tensor(math.inf))
        return t

    bench = record(tmp_path / "bench")
    target = record(tmp_path / "target", faults={"gelu_backward": one_ulp})
    result = tracecmp.compare(target, bench, exact=True)
    d = result.first_divergence
    assert (d.op, d.phase) == ("aten.gelu_backward.default", "backward")
    assert result.verdict().startswith("DIVERGED: bitwise")
    assert "noise" not in set(result.nodes["status"])


def test_first_divergence_is_earliest_in_execution_order(tmp_path):
    result = pair(tmp_path, faults={"grad_w1": scale(2.0), "gelu": scale(1.01)})
    assert result.first_divergence.op == "aten.gelu.default"
    assert {s.op for s in result.suspects} >= {"aten.gelu.default"}
    assert result.suspects == sorted(result.suspects, key=lambda s: -s.score)


def test_incomplete_trace_is_flagged_never_agreement(tmp_path):
    bench = record(tmp_path / "bench")
    result = tracecmp.compare(record(tmp_path / "target", complete=False), bench)
    assert result.first_divergence is None
    assert not result.agrees
    assert any("incomplete" in w for w in result.warnings)
    assert "incomplete" in result.summary()


def test_no_common_step_raises(tmp_path):
    b1 = TraceBuilder()
    b1.source("input.0", torch.ones(2))
    b2 = TraceBuilder()
    b2.step()
    b2.source("input.0", torch.ones(2))
    with pytest.raises(CompareError, match="no step in common"):
        tracecmp.compare(b1.write(tmp_path / "a"), b2.write(tmp_path / "b"))
    with pytest.raises(CompareError, match="no common rank"):
        tracecmp.compare(tmp_path / "a", tmp_path / "a", ranks=[3])


def test_result_tables_and_statuses(tmp_path):
    result = pair(tmp_path, faults={"gelu": scale(1.01)})
    assert set(result.nodes["status"]) <= set(STATUSES)
    frame = result.to_frame()
    assert {"tensor_id", "bench_tensor_id", "e_ext", "e_sys", "exact", "status", "cosine"} <= set(frame.columns)
    assert len(frame) == len(frame["tensor_id"].unique())
    paths = result.write_tables(tmp_path / "out", xlsx=True)
    assert {p.name for p in paths} == {
        "nodes.csv",
        "tensors.csv",
        "suspects.csv",
        "unpaired_bench.csv",
        "regions.csv",
        "uncompared.csv",
        "compare.xlsx",
    }
    text = result.summary()
    assert text.splitlines()[0].startswith("DIVERGED") and "aten.gelu.default" in text


def test_whole_tensors_give_elementwise_metrics(tmp_path):
    def run(path: Path, factor: float) -> Path:
        b = TraceBuilder(data=True)
        x = b.source("input.0", torch.linspace(-2, 2, 50))
        y = b.call(A.gelu.default, x, fault=lambda t: t * factor)
        b.call(A.sum.default, y)
        return b.write(path)

    result = tracecmp.compare(run(tmp_path / "t", 1.01), run(tmp_path / "b", 1.0))
    row = result.to_frame().set_index("op_id").loc[1]
    assert row["max_rel_err"] == pytest.approx(0.01, rel=1e-3)
    assert 0.999 < row["cosine"] <= 1.0
    assert result.first_divergence.op == "aten.gelu.default"


def test_explicit_default_arguments_are_not_a_difference(tmp_path):
    def run(path: Path, explicit: bool) -> Path:
        b = TraceBuilder()
        x = b.source("input.0", torch.ones(3))
        y = b.source("input.1", torch.ones(3))
        if explicit:
            z = b.call(A.add.Tensor, x, y, alpha=1)
        else:
            z = b.call(A.add.Tensor, x, y)
        b.call(A.gelu.default, z, approximate="none" if explicit else "none")
        return b.write(path)

    result = tracecmp.compare(run(tmp_path / "t", True), run(tmp_path / "b", False))
    assert result.agrees and result.first_divergence is None


def test_compare_a_later_step_alone(tmp_path):
    def run(path: Path, factor: float) -> Path:
        b = TraceBuilder()
        x = b.source("input.0", torch.linspace(-1, 1, 64))
        w = b.param("w", torch.full((64,), 0.5))
        for step in range(2):
            y = b.call(A.mul.Tensor, x, w, module="m")
            g = b.call(A.gelu.default, y, module="act", fault=(lambda t: t * factor) if step == 1 else None)
            w = b.call(A.add.Tensor, w, g, alpha=-0.1, phase="optimizer")  # the next step reads this value
            b.step()
        return b.write(path)

    result = tracecmp.compare(run(tmp_path / "t", 1.01), run(tmp_path / "b", 1.0), steps=[1])
    assert result.steps == [1]
    d = result.first_divergence
    assert (d.op, d.step) == ("aten.gelu.default", 1)
    mul = result.nodes[result.nodes["op"] == "aten.mul.Tensor"].iloc[0]
    assert mul["status"] == "agrees"  # its weight comes from step 0, measured through its consumer


def test_ranks_are_compared_separately_and_missing_ranks_warned(tmp_path):
    def run(path: Path, ranks: int, bad_rank: int | None) -> Path:
        for rank in range(ranks):
            b = TraceBuilder(rank=rank, world_size=ranks)
            x = b.source("input.0", torch.linspace(-1, 1, 32) + rank)
            b.call(A.gelu.default, x, module="act", fault=(lambda t: t * 1.01) if rank == bad_rank else None)
            b.write(path)
        return path

    result = tracecmp.compare(run(tmp_path / "t", 3, bad_rank=1), run(tmp_path / "b", 2, bad_rank=None))
    d = result.first_divergence
    assert (d.rank, d.op) == (1, "aten.gelu.default")
    assert result.ranks == [0, 1]
    assert any("only in the target" in w for w in result.warnings)
    assert set(result.nodes.loc[result.nodes["rank"] == 0, "status"]) == {"agrees"}


def test_a_reordered_sum_whose_terms_cancel_is_noise_not_a_root(tmp_path):
    x = torch.randn(4096, generator=torch.Generator().manual_seed(3))
    x = x - x.mean()  # terms that cancel: the sum is rounding noise, whatever the order

    def run(path: Path, reverse: bool) -> Path:
        b = TraceBuilder()
        X = b.source("input.0", x)
        b.call(A.sum.default, X, fault=(lambda t: x.flip(0).cumsum(0)[-1].reshape(())) if reverse else None)
        b.call(A.relu.default, X)  # deterministic ops that agree: the bitwise regime
        return b.write(path)

    result = tracecmp.compare(run(tmp_path / "t", True), run(tmp_path / "b", False))
    row = result.nodes[result.nodes["op"] == "aten.sum.default"].iloc[0]
    assert row["status"] == "noise"
    assert result.first_divergence is None


def test_a_sums_reach_covers_its_upper_population() -> None:
    # A ResNet-50 AMP run's batch-norm backward calls: most are decided by the input gradient,
    # a loose bound (ratios ~0.1); a few by the weight and bias gradients, whose estimate the
    # statistics scatter around (ratios 1.3-3.5). Fitted to the whole spread, the reach was 0.5
    # and the clean call at 2.3x was named a root; a call must stand out from all but one.
    from tracecmp.comparison.localize.calibrate import tail_ratio

    bulk = [0.05, 0.08, 0.1, 0.12, 0.15] * 10
    upper = [1.35, 1.44, 1.71, 1.96, 2.15, 2.29, 3.47]
    ratios = np.asarray(bulk + upper)
    assert tail_ratio(ratios, accumulates=True) >= 2.0 * 2.29
    # one population: the log-normal through the whole spread still decides
    single = np.asarray([0.5, 0.7, 0.9, 1.0, 1.1, 1.3, 1.5, 1.8] * 4)
    assert tail_ratio(single, accumulates=True) > 2.0 * 1.8
    assert tail_ratio(single, accumulates=True) == pytest.approx(
        2.0
        * 10
        ** (
            np.median(np.log10(single))
            + math.sqrt(2 * math.log(len(single)))
            * 1.4826
            * np.median(np.abs(np.log10(single) - np.median(np.log10(single))))
        )
    )


def test_a_copy_of_a_slice_of_a_diverged_bucket_is_data_movement_not_a_root(tmp_path: Path) -> None:
    # A DDP bucket comes back from its all-reduce with one parameter's small gradients 10% off;
    # the bucket's statistics, ruled by the large ones, hardly move. Copying that slice out into
    # the gradient moves what it holds: the all-reduce stays the only root.
    from tests.tracebuild import twin

    def recipe(b: TraceBuilder, is_target: bool) -> None:
        gen = torch.Generator().manual_seed(0)
        grads = torch.cat([100 * torch.randn(4000, generator=gen), 0.01 * torch.randn(96, generator=gen)])
        sent = b.source("input.0", grads)
        reduced = torch.cat([grads[:4000], grads[4000:] * (1.1 if is_target else 1.0)])
        bucket = b.op("c10d.allreduce_.default", [sent], reduced, module="fc", phase="backward")
        grad = b.param("fc.weight.grad", torch.zeros(96))
        b.call(A.copy_.default, grad, b.call(A.slice.Tensor, bucket, 0, 4000, 4096))

    twin(recipe, tmp_path / "t", tmp_path / "b")
    result = tracecmp.compare(tmp_path / "t", tmp_path / "b")
    assert [d.op for d in result.suspects] == ["c10d.allreduce_.default"], result.summary()
    copy = result.nodes[result.nodes["op"] == "aten.copy_.default"].iloc[0]
    assert copy["status"] == "diverged" and not copy["root_kind"]


def test_a_copy_that_changes_what_it_copies_is_a_root_away_from_collectives(tmp_path: Path) -> None:
    # Only a collective's copies are judged as data movement: a clone in the optimizer that scales
    # what it copies is a root, even where its input already carries error from a root before it.
    from tests.tracebuild import twin

    def recipe(b: TraceBuilder, is_target: bool) -> None:
        gen = torch.Generator().manual_seed(0)
        value = torch.randn(256, generator=gen)
        w = b.param("fc.weight", value * (1 + 1e-6) if is_target else value)
        b.op("aten.clone.default", [w], b.value(w) * (1.01 if is_target else 1.0), module="fc", phase="optimizer")

    twin(recipe, tmp_path / "t", tmp_path / "b")
    result = tracecmp.compare(tmp_path / "t", tmp_path / "b")
    assert "aten.clone.default" in [d.op for d in result.suspects], result.summary()
