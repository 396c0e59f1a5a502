"""Smoke test of the localization benchmark: its injectors on plain torch, then a few real cases.

The full benchmark is ``python -m benchmarks.localization`` (minutes); this runs a handful of
cases end to end in seconds and asserts that tracecmp names the injected op.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from workloads.localization.cases import category, choose_sites, plan_model, profile
from workloads.localization.faults import (
    ArgFault,
    Injector,
    Insertion,
    OutputFault,
    Plan,
    Site,
    bitwise_equal,
    corrupt_,
    in_layout_of,
    round_tf32,
)
from workloads.localization.models import build
from workloads.localization.runner import bench_key, run_case


def _tf32_reference(v: float) -> float:
    u = struct.unpack("<I", struct.pack("<f", v))[0]
    if u & 0x7F800000 == 0x7F800000:
        return v
    u = (u + 0x0FFF + ((u >> 13) & 1)) & 0xFFFFE000
    return struct.unpack("<f", struct.pack("<I", u & 0xFFFFFFFF))[0]


def test_round_tf32_matches_bit_reference_including_ties_and_specials() -> None:
    torch.manual_seed(0)
    x = torch.cat(
        [
            torch.randn(2000) * torch.logspace(-30, 30, 2000),
            torch.tensor(
                [0.0, -0.0, float("inf"), -float("inf"), 3.4028235e38, 1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-11)]
            ),
        ]
    )
    y = round_tf32(x)
    assert y.tolist() == [_tf32_reference(v) for v in x.tolist()]
    assert torch.isnan(round_tf32(torch.tensor([float("nan")]))).all()
    # float32's largest value rounds up past tf32's; ties go to even (1 + 2^-11 is halfway
    # between 1 and 1 + 2^-10, 1 + 3 * 2^-11 between 1 + 2^-10 and 1 + 2^-9)
    assert y[-4:].tolist() == [float("inf"), 1.0, 1.001953125, -1.0]


def test_the_tf32_background_hands_the_kernel_the_operands_layout() -> None:
    # A tensor core rounds inside the kernel: a transposed weight stays transposed.
    weight = torch.randn(10, 32)
    rounded = in_layout_of(weight.t(), round_tf32(weight.t()))
    assert rounded.stride() == weight.t().stride() and torch.equal(rounded, round_tf32(weight.t()))


@pytest.mark.parametrize(
    "kind,magnitude", [("scale", 1e-6), ("noise", 1e-4), ("bf16", 0), ("fp16", 0), ("nan", 0), ("inf", 0), ("ulp", 0)]
)
def test_every_output_fault_changes_bits_and_is_reproducible(kind: str, magnitude: float) -> None:
    base = torch.randn(5, 7, generator=torch.Generator().manual_seed(1))
    a, b = base.clone(), base.clone()
    corrupt_(a, kind, magnitude, seed=3)
    corrupt_(b, kind, magnitude, seed=3)
    assert not bitwise_equal(a, base)
    assert bitwise_equal(a, b)
    if kind in ("nan", "inf"):
        bad = torch.isnan(a) if kind == "nan" else torch.isinf(a)
        assert int(bad.sum()) == 1 and torch.equal(a[~bad], base[~bad])
    if kind == "ulp":
        changed = a != base
        assert int(changed.sum()) == 1 and a[changed] == torch.nextafter(base[changed], torch.tensor(math.inf))


class _Recorder(TorchDispatchMode):
    """A stand-in for capture: records each op's name, args and output, and runs ops of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[str, list[Any], torch.Tensor | None]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        non_tensor = [a for a in (*args, *kwargs.values()) if not isinstance(a, torch.Tensor)]
        first = out if isinstance(out, torch.Tensor) else out[0] if isinstance(out, (tuple, list)) else None
        if isinstance(first, torch.Tensor) and first.dtype.is_floating_point:
            first.abs().sum()  # an internal op, like computing statistics: must not be touched
            self.rows.append((str(func), non_tensor, first.detach().clone()))
        else:
            self.rows.append((str(func), non_tensor, None))
        return out


def _mlp_step(plan: Plan) -> tuple[Injector, _Recorder, torch.Tensor]:
    w = build("mlp")
    opt = w.make_optimizer()
    inj = Injector(w.model, plan)
    rec = _Recorder()
    with inj.outer():
        with rec:
            with inj.inner():
                loss = w.train_step(opt)
    return inj, rec, loss


def test_injection_modes_are_transparent_when_the_plan_is_empty() -> None:
    _, clean_rec, clean_loss = _mlp_step(Plan())
    w = build("mlp")
    plain_loss = w.train_step(w.make_optimizer())
    assert bitwise_equal(clean_loss, plain_loss)
    _, again, _ = _mlp_step(Plan())
    assert [r[0] for r in again.rows] == [r[0] for r in clean_rec.rows]
    assert all(x is None or bitwise_equal(x, y) for (_, _, x), (_, _, y) in zip(again.rows, clean_rec.rows))


def test_output_fault_is_recorded_as_the_sites_own_output_and_nothing_earlier_changes() -> None:
    _, clean, _ = _mlp_step(Plan())
    site = Site("aten.gelu.default", "forward", 0)
    inj, faulty, _ = _mlp_step(Plan(output_fault=OutputFault("scale", site, 1e-2)))
    assert inj.obs.fault_applied and inj.obs.effective and inj.obs.site_module == "act2"
    first_diff = next(
        i for i, (a, b) in enumerate(zip(clean.rows, faulty.rows)) if a[2] is not None and not bitwise_equal(a[2], b[2])
    )
    assert faulty.rows[first_diff][0] == "aten.gelu.default"
    assert torch.allclose(faulty.rows[first_diff][2], clean.rows[first_diff][2] * 1.01)


def test_backward_site_counts_backward_calls_only() -> None:
    site = Site("aten.mm.default", "backward", 1)
    inj, _, _ = _mlp_step(Plan(output_fault=OutputFault("bf16", site)))
    assert inj.obs.site_reached and inj.obs.fault_applied and inj.obs.site_module == "fc3"


def test_argument_fault_is_seen_by_capture_and_insertions_are_recorded_as_program_ops() -> None:
    _, clean, _ = _mlp_step(Plan())
    arg = ArgFault(Site("aten.gelu.default", "forward", 0), "approximate", "tanh")
    ins = Insertion(Site("aten.addmm.default", "forward", 1), "alias_mul1")
    inj, rec, _ = _mlp_step(Plan(arg_fault=arg, insertion=ins))
    assert inj.obs.arg_before == "none" and inj.obs.inserted
    gelu = [r for r in rec.rows if r[0] == "aten.gelu.default"]
    assert gelu[0][1] == ["tanh"]
    names = [r[0] for r in rec.rows]
    assert len(names) == len(clean.rows) + 2
    i = [k for k, n in enumerate(names) if n == "aten.addmm.default"][1]
    assert names[i + 1 : i + 3] == ["aten.alias.default", "aten.mul.Tensor"]


def test_tf32_noise_rounds_matmul_inputs_only() -> None:
    inj, rec, loss = _mlp_step(Plan(tf32=True))
    _, clean, clean_loss = _mlp_step(Plan())
    assert inj.obs.tf32_calls == sum(1 for r in clean.rows if r[0] in ("aten.addmm.default", "aten.mm.default"))
    first = next(
        i for i, (a, b) in enumerate(zip(clean.rows, rec.rows)) if a[2] is not None and not bitwise_equal(a[2], b[2])
    )
    assert rec.rows[first][0] == "aten.addmm.default"
    assert not bitwise_equal(loss, clean_loss)


def test_site_rule_is_deterministic_and_spreads_over_categories() -> None:
    prof = profile("convnet", 1234)
    import random

    a = choose_sites(prof.calls, "forward", 8, random.Random(5))
    b = choose_sites(prof.calls, "forward", 8, random.Random(5))
    assert a == b and len(set(a)) == 8
    assert len({category(s.op) for s in a}) >= 5
    assert choose_sites(prof.calls, "backward", 4, random.Random(5))


# --------------------------------------------------------------------------- end to end with tracecmp


def _cases(model: str) -> dict[str, Any]:
    return {c.id: c for c in plan_model(profile(model, 1234), seed=0, model_index=0)}


def _run(case: Any, tmp_path: Path) -> Any:
    from workloads.localization.runner import record_run

    torch.set_num_threads(1)
    bench = tmp_path / "benches" / bench_key(case)
    if not bench.exists():
        record_run(case.model, case.bench, bench)
    return run_case(case, bench, tmp_path, keep=False, timeout_s=120)


@pytest.mark.parametrize(
    "pick",
    [
        lambda c: c.kind == "scale" and c.magnitude == 1e-2 and c.phase == "forward" and c.variant == "plain",
        lambda c: c.kind == "bf16" and c.phase == "backward" and c.variant == "plain",
        lambda c: c.kind == "arg" and "gelu.default" in c.id and c.variant == "plain",
    ],
)
def test_benchmark_cases_find_the_injected_op(pick: Any, tmp_path: Path) -> None:
    case = next(c for c in _cases("mlp").values() if pick(c))
    r = _run(case, tmp_path)
    assert r.status == "ok", r.error
    assert r.truth is not None and r.truth.op == case.site.op
    assert r.top1, f"expected {r.truth.where()}, found {r.found.where() if r.found else None}"


def test_identical_runs_report_no_divergence(tmp_path: Path) -> None:
    r = _run(_cases("mlp")["mlp/identical"], tmp_path)
    assert r.status == "ok", r.error
    assert r.outcome == "clean", r.found


def test_tensors_mode_replay_finds_a_fault_below_the_tf32_background(tmp_path: Path) -> None:
    """A 1e-4 fault in threshold_backward, 5x below the TF32 noise its inputs carry: statistics miss it."""
    from workloads.localization.runner import CAPTURE

    case = next(
        c
        for c in _cases("mlp").values()
        if c.kind == "scale" and c.magnitude == 1e-4 and c.variant == "tf32" and c.category == "activation"
    )
    previous = CAPTURE["data"]
    CAPTURE["data"] = "tensors"
    try:
        r = _run(case, tmp_path)
    finally:
        CAPTURE["data"] = previous
    assert r.status == "ok", r.error
    assert r.top1 and r.found is not None and "replay" in r.found.reason, r.found


@pytest.mark.parametrize("rounding", ["nearest", "zero"])
@pytest.mark.parametrize("data", ["stats", "tensors"])
def test_the_tf32_background_alone_is_no_divergence_whichever_way_it_rounds(
    rounding: str, data: str, tmp_path: Path
) -> None:
    from workloads.localization.faults import TF32_ROUNDING
    from workloads.localization.runner import CAPTURE

    previous = CAPTURE["data"], TF32_ROUNDING["how"]
    CAPTURE["data"], TF32_ROUNDING["how"] = data, rounding
    try:
        r = _run(_cases("convnet")["convnet/tf32-only"], tmp_path)
    finally:
        CAPTURE["data"], TF32_ROUNDING["how"] = previous
    assert r.status == "ok", r.error
    assert r.outcome == "clean", r.found


def test_a_matmul_fault_below_the_tf32_background_is_found_where_the_runs_matmuls_are_reproduced(
    tmp_path: Path,
) -> None:
    from workloads.localization.faults import TF32_ROUNDING
    from workloads.localization.runner import CAPTURE

    case = next(
        c
        for c in _cases("mlp").values()
        if c.kind == "noise" and c.magnitude == 1e-4 and c.variant == "tf32" and c.category == "matmul"
    )
    previous = CAPTURE["data"], TF32_ROUNDING["how"]
    CAPTURE["data"], TF32_ROUNDING["how"] = "tensors", "zero"
    try:
        r = _run(case, tmp_path)
    finally:
        CAPTURE["data"], TF32_ROUNDING["how"] = previous
    assert r.status == "ok", r.error
    assert r.ratio is not None and r.ratio < 1  # smaller than the TF32 error at its own site
    assert r.top1 and r.found is not None and "accumulation errors" in r.found.reason, r.found


def test_the_census_counts_clean_tensors_off_by_a_faults_size_from_the_drift_on() -> None:
    import pandas as pd

    from workloads.localization.runner import beyond_fault_size

    tensors = pd.DataFrame(
        {
            "rank": [0, 0, 0, 0, 1, 0, 0],
            "op_id": [3, 7, 9, 11, 8, 12, 13],
            "numel": [10, 10, 10, 1, 10, 10, 10],
            "unit": [0.0039, 0.0039, 0.0039, 0.0039, 0.0039, 0.0039, 0.0],
            "exact": [False, False, True, False, False, False, False],
            # a scalar, another rank, a tensor without statistics and an integer one are left out
            "e_sys": [0.2, 0.06, 0.0, 0.5, 0.5, math.nan, 1.0],
            "e_ext": [0.3, 0.01, 0.0, 0.5, 0.5, math.nan, 1.0],
        }
    )
    assert beyond_fault_size(tensors, 0, 5, 0.05) == {"from_op": 5, "tensors": 2, "norm_mean": 1, "max_min": 0}
    assert beyond_fault_size(tensors, 0, 0, 0.05) == {"from_op": 0, "tensors": 3, "norm_mean": 2, "max_min": 1}
