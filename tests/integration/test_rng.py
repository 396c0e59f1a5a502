"""Randomness under capture: rng="host" draws like the CPU, dropout=0.0 turns dropout off,
random ops are marked, and compare explains a divergence that starts at a random op.

No accelerator here: ``rng._FORCE_HOST_FOR_TESTS`` treats CPU tensors as device tensors, so the
host path (copy to the host, draw, copy back or move to the device) runs and is checked bitwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tracecmp
from tracecmp.aten.schema import arg_value, op_info
from tracecmp.capture import rng
from workloads.models import example_batch, make_model, make_optimizer, train_step

aten = torch.ops.aten


@pytest.fixture
def force_host(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Run the host path on CPU tensors; returns the names of the ops that took it."""
    taken: list[str] = []
    real = rng.host_call

    def spy(func: Any, info: Any, args: tuple, kwargs: dict) -> Any:
        taken.append(info.name)
        return real(func, info, args, kwargs)

    monkeypatch.setattr(rng, "_FORCE_HOST_FOR_TESTS", True)
    monkeypatch.setattr(rng, "host_call", spy)
    return taken


def _x() -> torch.Tensor:
    return torch.rand(6, 5) * 0.8 + 0.1


# (op, builder of its arguments): every random op the host path must replay exactly.
CASES: list[tuple[Any, Callable[[], tuple[tuple, dict]]]] = [
    (aten.randn.default, lambda: (([4, 3],), {"dtype": torch.float32, "device": torch.device("cpu")})),
    (aten.randn.generator, lambda: (([4, 3],), {"generator": torch.Generator().manual_seed(5)})),
    (aten.rand.default, lambda: (([7],), {"dtype": torch.float64})),
    (aten.randint.low, lambda: ((2, 9, [10]), {})),
    (aten.randint.default, lambda: ((9, [10]), {})),
    (aten.randperm.default, lambda: ((12,), {"device": torch.device("cpu")})),
    (aten.rand_like.default, lambda: ((_x(),), {})),
    (aten.randn_like.default, lambda: ((_x(),), {"dtype": torch.float64})),
    (aten.randint_like.default, lambda: ((_x(), 7), {})),
    (aten.bernoulli.default, lambda: ((_x(),), {})),
    (aten.bernoulli.p, lambda: ((_x(), 0.3), {})),
    (aten.bernoulli_.float, lambda: ((torch.empty(6, 5), 0.7), {})),
    (aten.bernoulli_.Tensor, lambda: ((torch.empty(6, 5), _x()), {})),
    (aten.native_dropout.default, lambda: ((_x(), 0.4, True), {})),
    (aten.normal.Tensor_Tensor, lambda: ((_x(), _x()), {})),
    (aten.normal.Tensor_float, lambda: ((_x(), 2.0), {})),
    (aten.normal.float_Tensor, lambda: ((1.0, _x()), {})),
    (aten.normal.float_float, lambda: ((0.0, 1.0, [5]), {})),
    (aten.normal_.default, lambda: ((torch.empty(6, 5), 1.0, 3.0), {})),
    (aten.uniform_.default, lambda: ((torch.empty(6, 5), -2.0, 2.0), {})),
    (aten.random_.default, lambda: ((torch.empty(6, 5),), {})),
    (getattr(aten.random_, "from"), lambda: ((torch.empty(6, 5), 3, 40), {})),
    (aten.random_.to, lambda: ((torch.empty(6, 5), 40), {})),
    (aten.exponential_.default, lambda: ((torch.empty(6, 5), 1.5), {})),
    (aten.geometric_.default, lambda: ((torch.empty(6, 5), 0.3), {})),
    (aten.cauchy_.default, lambda: ((torch.empty(6, 5),), {})),
    (aten.log_normal_.default, lambda: ((torch.empty(6, 5),), {})),
    (aten.multinomial.default, lambda: ((_x(), 3), {})),
    (aten.poisson.default, lambda: ((_x() * 5,), {})),
    (aten._standard_gamma.default, lambda: ((_x() + 0.5,), {})),
    (aten.rrelu_with_noise.default, lambda: ((_x() - 0.5, torch.empty(6, 5), 0.1, 0.3, True), {})),
    (aten.randn.out, lambda: (([4, 3],), {"out": torch.empty(4, 3)})),
    (aten.normal.Tensor_Tensor_out, lambda: ((_x(), _x()), {"out": torch.empty(6, 5)})),
    (aten.bernoulli.out, lambda: ((_x(),), {"out": torch.empty(6, 5)})),
]


def _flat(out: Any) -> list[torch.Tensor]:
    return [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("op, build", CASES, ids=[str(op) for op, _ in CASES])
def test_host_path_replays_each_random_op_bitwise(op: Any, build: Callable, monkeypatch: pytest.MonkeyPatch) -> None:
    info = op_info(op)
    assert info.random and info.host_rng, f"{op} is not taken for a host-drawn random op"
    torch.manual_seed(11)
    args_e, kwargs_e = build()
    expected = op(*args_e, **kwargs_e)
    torch.manual_seed(11)
    args, kwargs = build()
    monkeypatch.setattr(rng, "_FORCE_HOST_FOR_TESTS", True)
    got = rng.host_call(op, info, args, kwargs)
    pairs = list(zip(_flat(expected), _flat(got), strict=True))
    # Written arguments hold the same values as the plain call wrote into them.
    pairs += [(arg_value(ref, args_e, kwargs_e), arg_value(ref, args, kwargs)) for ref in info.writes]
    for e, g in pairs:
        assert e.dtype == g.dtype and e.shape == g.shape
        assert torch.equal(e.nan_to_num(), g.nan_to_num()) and torch.equal(e.isnan(), g.isnan())
    # The op returns its argument exactly where the plain call does (in-place and out= ops), and
    # never one of the host copies.
    inputs = [*args, *kwargs.values()]
    for e, g in zip(_flat(expected), _flat(got)):
        assert any(e is a for a in (*args_e, *kwargs_e.values())) == any(g is a for a in inputs)


def test_random_ops_are_found_from_the_schema() -> None:
    """Every aten op tagged nondeterministic_seeded or taking a Generator is random; the CPU-runnable ones go to the host."""
    for name in ("randn", "bernoulli_", "native_dropout", "multinomial", "rand_like", "randperm", "normal"):
        packet = getattr(aten, name)
        for overload in packet.overloads():
            op = getattr(packet, overload)
            assert op_info(op).random, op
    assert not op_info(aten.mm.default).random and not op_info(aten.empty_like.default).random
    # Fused device kernels draw inside: the CPU cannot replay them, so they stay on the device.
    # (torch 2.1's flash attention also has a CPU kernel, so only the efficient one is device-only there.)
    assert op_info(aten._fused_dropout.default).random and not op_info(aten._fused_dropout.default).host_rng
    assert not op_info(aten._scaled_dot_product_efficient_attention.default).host_rng


def test_factories_for_a_device_draw_on_the_host_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``meta`` standing in for an accelerator: the device argument becomes the CPU for the
    draw (the CPU generator advances exactly as for a CPU call) and the result moves to the device."""
    monkeypatch.setattr(rng, "_NOT_ACCELERATORS", ("cpu",))
    meta = torch.device("meta")
    for op, args in ((aten.randn.default, ([2, 3],)), (aten.randperm.default, (7,)), (aten.randint.low, (0, 5, [4]))):
        torch.manual_seed(5)
        op(*args, device=torch.device("cpu"))
        after_cpu_draw = torch.get_rng_state()
        torch.manual_seed(5)
        out = rng.host_call(op, op_info(op), args, {"device": meta})
        assert out.device == meta and out.shape == op(*args, device=meta).shape
        assert torch.equal(torch.get_rng_state(), after_cpu_draw), op
    assert rng._accelerator((), {"device": torch.device("cuda", 1)}) == torch.device("cuda", 1)


def test_cpu_tensors_are_left_alone_without_forcing() -> None:
    info = op_info(aten.bernoulli_.float)
    t = torch.empty(3)
    assert rng._accelerator((t, 0.5), {}) is None
    assert rng._accelerator((torch.empty(3, device="meta"), 0.5), {}) is None
    assert rng.host_call(aten.bernoulli_.float, info, (t, 0.5), {}) is t


def _trace(
    path: Path,
    name: str = "transformer",
    seed: int = 3,
    steps: int = 2,
    steps_recorded: list[int] | None = None,
    **options: Any,
) -> Path:
    model = make_model(name)
    opt = make_optimizer(model)
    batch = example_batch(name)
    tracecmp.seed_all(seed)
    with tracecmp.TraceCompare(path, model=model, steps=steps_recorded, **options) as tc:
        for _ in range(steps):
            train_step(model, opt, batch)
            tc.step()
    return path


def _checksums(path: Path) -> np.ndarray:
    """The checksums of every value the ops made, in order (sources left out: a tensor the
    program still holds may enter the trace again as a source where its record was collected
    first, which depends on when the garbage collector ran)."""
    rank = tracecmp.load(path).rank(0)
    sources = set(rank.ops.loc[rank.ops["kind"] == "source", "op_id"].tolist())
    tensors = rank.tensors[~rank.tensors["op_id"].isin(sources)]
    return tensors["checksum"].fillna(0).to_numpy()


def test_dropout_masks_with_host_rng_equal_a_plain_cpu_run(tmp_path: Path, force_host: list[str]) -> None:
    forced = _checksums(_trace(tmp_path / "forced", rng="host"))
    assert force_host and set(force_host) == {"aten.bernoulli_.float"}, force_host  # the host path really ran
    rng._FORCE_HOST_FOR_TESTS = False  # (monkeypatch restores it too)
    plain = _checksums(_trace(tmp_path / "plain"))
    host = _checksums(_trace(tmp_path / "host", rng="host"))
    assert len(plain) == len(forced) == len(host)
    assert np.array_equal(plain, host) and np.array_equal(plain, forced)
    assert tracecmp.compare(tmp_path / "forced", tmp_path / "plain", exact=True).first_divergence is None
    assert tracecmp.load(tmp_path / "host").manifest["options"]["rng"] == "host"


def test_random_column_marks_the_ops_that_draw(tmp_path: Path) -> None:
    x = torch.randn(8, 8, requires_grad=True)
    with tracecmp.TraceCompare(tmp_path / "t") as tc:
        y = F.dropout(x, 0.5, training=True)  # CPU: empty_like, bernoulli_, div_, mul
        y = y + torch.randn(8, 8) + torch.rand_like(y)
        y = y[torch.randperm(8)]
        z, _ = aten.native_dropout.default(y, 0.3, True)
        z.sum().backward()
        tc.step()
    frame = tracecmp.load(tmp_path / "t").to_frame()
    marked = set(frame.loc[frame["random"], "op"])
    assert marked == {
        "aten.bernoulli_.float",
        "aten.randn.default",
        "aten.rand_like.default",
        "aten.randperm.default",
        "aten.native_dropout.default",
    }
    assert not frame.loc[
        frame["op"].isin(["aten.empty_like.default", "aten.div_.Scalar", "aten.mul.Tensor"]), "random"
    ].any()


class Droppy(torch.nn.Module):
    """Dropout every way torch offers: modules, functional calls with literal p, attention, RNN, a raw aten op."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.drop = torch.nn.Dropout(0.5)
        self.drop2d = torch.nn.Dropout2d(0.3)
        self.attn = torch.nn.MultiheadAttention(8, 2, dropout=0.4, batch_first=True)
        self.lstm = torch.nn.LSTM(8, 8, num_layers=2, dropout=0.5, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.fc(x))
        h = F.dropout(h, 0.25, training=self.training) + F.alpha_dropout(h, 0.2, training=self.training)
        h = self.drop2d(h.unsqueeze(-1)).squeeze(-1)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        h = h + F.scaled_dot_product_attention(h, h, h, dropout_p=0.3)
        h = h + self.lstm(h)[0]
        return aten.native_dropout.default(h, 0.5, True)[0]


def _droppy_run(path: Path | None, seed: int, **options: Any) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = Droppy()
    x = torch.randn(2, 5, 8)
    torch.manual_seed(seed)
    if path is None:
        out = model(x)
        out.sum().backward()
    else:
        with tracecmp.TraceCompare(path, model=model, **options) as tc:
            out = model(x)
            out.sum().backward()
            tc.step()
    return out.detach(), model.fc.weight.grad


def test_dropout_off_makes_every_dropout_the_identity(tmp_path: Path) -> None:
    out_a, grad_a = _droppy_run(tmp_path / "a", seed=1, dropout=0.0)
    out_b, grad_b = _droppy_run(tmp_path / "b", seed=2, dropout=0.0)
    assert torch.equal(out_a, out_b) and torch.equal(grad_a, grad_b)
    assert np.array_equal(_checksums(tmp_path / "a"), _checksums(tmp_path / "b"))
    assert tracecmp.compare(tmp_path / "a", tmp_path / "b", exact=True).first_divergence is None
    # The same as the model with every drop probability at 0 (forward and backward: the raw
    # native_dropout's backward rescaling was set to 1 as well).
    torch.manual_seed(0)
    model = Droppy()
    x = torch.randn(2, 5, 8)
    model.drop.p = model.drop2d.p = model.attn.dropout = model.lstm.dropout = 0.0
    h = model.drop(model.fc(x))
    h = F.dropout(h, 0.0) + F.alpha_dropout(h, 0.0, training=True)
    h = model.drop2d(h.unsqueeze(-1)).squeeze(-1)
    h = h + model.attn(h, h, h, need_weights=False)[0]
    h = h + F.scaled_dot_product_attention(h, h, h)
    h = h + model.lstm(h)[0]
    h.sum().backward()
    assert torch.equal(out_a, h.detach()) and torch.equal(grad_a, model.fc.weight.grad)
    # Without the option the same run does drop.
    assert _droppy_run(None, seed=1)[0].ne(out_a).any()
    assert tracecmp.load(tmp_path / "a").manifest["options"]["dropout"] == 0.0


def test_compare_explains_a_divergence_that_starts_at_a_random_op(tmp_path: Path) -> None:
    _trace(tmp_path / "target", seed=1)
    _trace(tmp_path / "bench", seed=2)
    first = tracecmp.compare(tmp_path / "target", tmp_path / "bench").first_divergence
    assert first is not None
    assert (first.kind, first.op, first.module) == ("random", "aten.bernoulli_.float", "attn")
    assert "random op" in first.reason and 'rng="host"' in first.reason and "seed_all" in first.reason
    # Seeded alike, the same runs agree.
    _trace(tmp_path / "bench2", seed=1)
    assert tracecmp.compare(tmp_path / "target", tmp_path / "bench2", exact=True).first_divergence is None


def test_bad_options_are_capture_errors(tmp_path: Path) -> None:
    for options in ({"rng": "gpu"}, {"dropout": 0.1}, {"dropout": True}, {"overflow": "warn"}):
        with pytest.raises(tracecmp.CaptureError):
            tracecmp.TraceCompare(tmp_path / "t", **options)


def test_dropout_off_holds_in_steps_that_are_not_recorded(tmp_path: Path) -> None:
    # Step 0 is not recorded: its dropout must be off too, or step 1 starts from other weights.
    _trace(tmp_path / "all", dropout=0.0)
    _trace(tmp_path / "second", dropout=0.0, steps_recorded=[1])
    assert tracecmp.load(tmp_path / "second").rank(0).manifest["steps"] == [1]
    compared = tracecmp.compare(tmp_path / "second", tmp_path / "all", exact=True, steps=[1])
    assert compared.first_divergence is None
    # Had step 0 kept its dropout, the parameters entering step 1 would already differ.
    model = make_model("transformer")
    opt = make_optimizer(model)
    batch = example_batch("transformer")
    tracecmp.seed_all(3)
    train_step(model, opt, batch)
    with tracecmp.TraceCompare(tmp_path / "late", model=model, steps=[1], dropout=0.0) as tc:
        tc.step()
        train_step(model, opt, batch)
        tc.step()
    first = tracecmp.compare(tmp_path / "late", tmp_path / "all", exact=True, steps=[1]).first_divergence
    assert first is not None and first.kind == "source"


def test_host_rng_holds_in_steps_that_are_not_recorded(tmp_path: Path, force_host: list[str]) -> None:
    with tracecmp.TraceCompare(tmp_path / "t", steps=[1], rng="host") as tc:
        torch.randn(3)
        tc.step()
        torch.rand(3)
        tc.step()
    assert force_host == ["aten.randn.default", "aten.rand.default"]
    assert tracecmp.load(tmp_path / "t").to_frame()["op"].tolist() == ["aten.rand.default"]


class FusedOrNot(torch.nn.Module):
    """Dropout as an accelerator runs it (one fused native_dropout) or as the CPU does (F.dropout:
    bernoulli_, div_, mul)."""

    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h = aten.native_dropout.default(h, 0.5, True)[0] if self.fused else F.dropout(h, 0.5)
        return h.relu()


def test_a_fused_dropout_against_its_decomposition_is_named_a_random_draw(tmp_path: Path) -> None:
    """Alignment pairs the fused call with the bench's ops as a region; its inputs agree and its
    output does not, because it drew: named a random draw, as a lone random op is."""
    for name, fused, seed in (("target", True, 1), ("bench", False, 2)):
        torch.manual_seed(0)
        model, x = FusedOrNot(fused), torch.randn(4, 8)
        torch.manual_seed(seed)
        with tracecmp.TraceCompare(tmp_path / name, model=model) as tc:
            model(x).sum().backward()
            tc.step()
    first = tracecmp.compare(tmp_path / "target", tmp_path / "bench").first_divergence
    assert first is not None
    assert (first.kind, first.op, first.phase) == ("random", "aten.native_dropout.default", "forward"), first
    assert first.region is not None and 'rng="host"' in first.reason
