"""Replay's memory bounds: large pointwise calls get their float64 reference in pieces, large
outputs are measured in pieces, and the value cache makes room for a large op; none of it
changes what replay measures."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import tracecmp
from tests.tracebuild import TraceBuilder
from tracecmp.numerics.replay import ELEMENT_ULPS, OwnError, Replayer, measure, replay_ops, replayer

A = torch.ops.aten
SHAPE = (3, 5003)  # 15,009 elements: four pieces of 4,096 and a short last one
PIECE = 4096


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _nan_at_three(t: torch.Tensor) -> torch.Tensor:
    out = t.clone()
    out.view(-1)[[7, 4100, 15000]] = float("nan")
    return out


def _trace(path: Path) -> Path:
    """An Adam step's elementwise ops, activations whose vectorized and scalar kernels round
    differently (gelu-tanh, sigmoid, pow), ops in bf16, a broadcast add, reductions and a matmul,
    with a scaled output and NaN where the replay has none among them."""
    g = torch.Generator().manual_seed(0)
    b = TraceBuilder(data=True)
    w = b.param("fc.weight", torch.randn(SHAPE, generator=g))
    grad = b.source("input.0", torch.randn(SHAPE, generator=g))
    m = b.source("input.1", torch.randn(SHAPE, generator=g) * 0.1)
    v = b.source("input.2", torch.rand(SHAPE, generator=g) * 0.01)
    bias = b.source("input.3", torch.randn(SHAPE[1], generator=g))
    b.call(A.gelu.default, grad, approximate="tanh", module="act")
    b.call(A.gelu.default, w, approximate="tanh", module="act", fault=lambda t: t * (1 + 1e-4))
    b.call(A.sigmoid.default, grad, module="act")
    b.call(A.pow.Tensor_Scalar, v, 1.7)
    b.call(A.mul.Tensor, grad, w, fault=_nan_at_three)
    b.call(A.add.Tensor, grad, bias)  # broadcast: replayed whole
    b.call(A.where.self, b.call(A.gt.Scalar, grad, 0.0), grad, w)
    half = b.call(A._to_copy.default, grad, dtype=torch.bfloat16)
    b.call(A.mul.Tensor, half, b.call(A._to_copy.default, w, dtype=torch.bfloat16))
    b.call(A._foreach_mul.Scalar, [grad, w], 0.5, phase="optimizer")
    m2 = b.call(A.lerp_.Scalar, m, grad, 0.1, phase="optimizer")
    v2 = b.call(A.addcmul_.default, v, grad, grad, value=0.001, phase="optimizer")
    denom = b.call(A.add_.Scalar, b.call(A.sqrt.default, v2, phase="optimizer"), 1e-8, phase="optimizer")
    b.call(A.addcdiv_.default, w, m2, denom, value=-1e-3, phase="optimizer")
    # Laid out transposed alike (a channels-last activation and its gradient): pieces in memory order.
    across = b.source("input.6", torch.randn(SHAPE[::-1], generator=g).t())
    b.call(A.gelu.default, across, approximate="tanh", module="act")
    b.call(A.mul.Tensor, across, b.source("input.7", torch.randn(SHAPE[::-1], generator=g).t()))
    b.call(A._log_softmax.default, grad, 1, False)  # a reduction: whole reference, measured in pieces
    b.call(
        A.mm.default,
        b.source("input.4", torch.randn(40, 16, generator=g)),
        b.source("input.5", torch.randn(16, 500, generator=g)),
    )
    return b.write(path)


@pytest.mark.parametrize("reduced", [None, "tf32"])
def test_calls_replayed_in_pieces_measure_as_whole_ones(tmp_path, monkeypatch, one_thread, reduced):
    """With ``reduced`` the matmul's roundings and accumulation bounds are measured in pieces too."""
    rank = tracecmp.load(_trace(tmp_path / "run")).rank(0)
    whole = replay_ops(rank, detail=ELEMENT_ULPS, reduced=reduced)
    pieced_calls = []
    monkeypatch.setattr(measure, "_PIECE_ELEMENTS", PIECE)
    real = measure.pieces_of

    def counted(inputs, span, order=None):
        pieced_calls.append(span)
        return real(inputs, span, order)

    for module in (measure, replayer):  # both cut calls into pieces
        monkeypatch.setattr(module, "pieces_of", counted)
    pieced = replay_ops(rank, detail=ELEMENT_ULPS, reduced=reduced)
    assert len(pieced_calls) >= 12 * 4  # every large pointwise call went piece by piece
    assert set(whole) == set(pieced)
    names = dict(zip(rank.ops["op_id"], rank.ops["op"]))
    measured = [o for o, e in whole.items() if isinstance(e, OwnError)]
    assert len(measured) >= 20
    for op_id in measured:
        a, b = whole[op_id], pieced[op_id]
        assert isinstance(b, OwnError)
        for field in dataclasses.fields(OwnError):
            x, y = getattr(a, field.name), getattr(b, field.name)
            # Norms added from pieces may differ from one whole norm in the last bits.
            same = y == pytest.approx(x, rel=1e-13, abs=0) if field.name in ("error", "honest", "fits") else y == x
            assert same, (names[op_id], field.name, x, y)
    errs = {names[o]: e for o, e in whole.items() if isinstance(e, OwnError) and e.error > 4 * e.honest}
    assert set(errs) == {"aten.gelu.default", "aten.mul.Tensor"}  # the scaled gelu and the NaNs
    assert any(e.nonfinite == 3 for e in errs.values())
    matmul = next(e for o, e in whole.items() if names[o] == "aten.mm.default")
    assert (len(matmul.fits), len(matmul.bounds)) == ((3, 4) if reduced else (0, 0))


@pytest.mark.parametrize(
    "op,args",
    [(A.gelu.default, {"approximate": "tanh"}), (A.sigmoid.default, {}), (A.pow.Tensor_Scalar, {"exponent": 1.7})],
)
def test_a_reference_made_in_pieces_has_the_bits_of_a_whole_one(op, args, one_thread):
    """Where a kernel's vectorized and scalar paths round differently, pieces that start at
    multiples of the vector width leave every element on the path it takes in the whole call."""
    x = torch.rand(SHAPE, generator=torch.Generator().manual_seed(1)) + 0.5
    name = str(op)
    recorded = {"self": {"tensor": 0}, **args}
    whole = measure.run_outputs(name, recorded, [x], golden=True)
    spans = [(start, min(start + PIECE, x.numel())) for start in range(0, x.numel(), PIECE)]
    first = measure.run_outputs(name, recorded, measure.pieces_of([x], spans[0]), golden=True)
    assert whole is not None and first is not None
    reference = measure.Reference(first[0], call=(name, recorded, [x], spans, 0))
    pieces = torch.cat([reference.piece(i) for i in range(len(spans))])
    assert torch.equal(pieces.view(torch.int64), whole[0].reshape(-1).view(torch.int64))
    # ... which a piece boundary off the vector width would not keep.
    odd = torch.cat(
        [measure.run_outputs(name, recorded, [x.view(-1)[s : s + 7]], golden=True)[0] for s in range(0, x.numel(), 7)]
    )
    if name != "aten.pow.Tensor_Scalar":  # float64 pow takes one path here
        assert not torch.equal(odd, whole[0].reshape(-1))


def test_pieces_are_only_for_pointwise_calls_over_one_shape(monkeypatch):
    monkeypatch.setattr(measure, "_PIECE_ELEMENTS", PIECE)
    x, y = torch.ones(SHAPE), torch.ones(SHAPE)
    assert measure.piece_spans("aten.add.Tensor", [x, y], [SHAPE]) == [
        (0, 4096),
        (4096, 8192),
        (8192, 12288),
        (12288, 15009),
    ]
    assert measure.piece_spans("aten._foreach_add.List", [x, y], [SHAPE]) is not None
    assert measure.piece_spans("aten.add.Tensor", [x, torch.tensor(2.0)], [SHAPE]) is not None  # a scalar operand
    assert measure.piece_spans("aten.add.Tensor", [x, torch.ones(SHAPE[1])], [SHAPE]) is None  # broadcast
    across = x.t().contiguous().t()
    assert measure.piece_spans("aten.add.Tensor", [across, y], [SHAPE]) is None  # laid out otherwise
    assert measure.piece_spans("aten.add.Tensor", [across, y.t().contiguous().t()], [SHAPE]) is not None  # alike
    assert measure.piece_spans("aten.add.Tensor", [x[:, :100], y[:, :100]], [(3, 100)]) is None  # small
    assert measure.piece_spans("aten._log_softmax.default", [x], [SHAPE]) is None
    assert measure.piece_spans("aten._foreach_norm.Scalar", [x], [()]) is None


def test_the_cache_makes_room_for_a_large_op(tmp_path):
    g = torch.Generator().manual_seed(0)
    b = TraceBuilder(data=True)
    small = [b.source(f"input.{i}", torch.randn(1000, generator=g)) for i in range(8)]
    for ref in small:
        b.call(A.relu.default, ref)
    big = b.source("input.big", torch.randn(20_000, generator=g))
    b.call(A.exp.default, big)
    rank = tracecmp.load(b.write(tmp_path / "run")).rank(0)
    ops = rank.ops
    exp = int(ops.loc[ops["op"] == "aten.exp.default", "op_id"].item())
    limit = 100_000  # bytes: all the small values fit, the large op's 160,000 do not
    with Replayer(rank, cache_bytes=limit) as replayer:
        for op_id in ops.loc[ops["op"] == "aten.relu.default", "op_id"]:
            assert isinstance(replayer.replay(int(op_id)), OwnError)
        assert replayer._cache_bytes > 30_000
        assert isinstance(replayer.replay(exp), OwnError)
        # The values it does not read were dropped before it ran (its own are too large to keep).
        assert replayer._cache_bytes == 0
