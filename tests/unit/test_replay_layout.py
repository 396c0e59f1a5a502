"""Replay that gives the run's bits: inputs laid out in memory as the run had them, and a single
call that a bit-for-bit replay does not reproduce, where it reproduces the op's other calls."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import tracecmp
from tests.tracebuild import TraceBuilder, round_tf32
from tracecmp.aten.args import copy_laid_out
from tracecmp.numerics.replay import replay_rank

A = torch.ops.aten


def test_a_copy_keeps_the_strides_of_a_column_block():
    wide = torch.randn(4, 64)
    block = wide[:, 16:32]
    copy = copy_laid_out(block)
    assert copy.stride() == (64, 1) and torch.equal(copy, block) and copy.data_ptr() != block.data_ptr()
    assert copy_laid_out(torch.randn(3, 4).t()).stride() == (1, 4)  # dense: clone's own strides
    # Overlapping memory, and a block so narrow that its layout would cost far more memory: contiguous.
    assert copy_laid_out(torch.randn(4, 1).expand(4, 5)).is_contiguous()
    assert copy_laid_out(torch.randn(100, 1000)[:, :1]).is_contiguous()


def _lstm_gates(path: Path) -> Path:
    """An LSTM cell's gates as eager LSTMs make them: one matmul, ``unsafe_split`` into four
    column blocks (views in memory the op does not declare), each activated in place."""
    torch.manual_seed(0)
    x, w, b = torch.randn(32, 24), torch.randn(160, 24) / 5, torch.randn(160) / 5
    with tracecmp.TraceCompare(path, data="tensors"):
        gates = torch.addmm(b, x, w.t())
        i, f, g, o = gates.unsafe_split(40, 1)
        i.sigmoid_()
        f.sigmoid_()
        g.tanh_()
        o.sigmoid_()
        (i * g + f * o).sum()
    return path


def test_outputs_of_unsafe_split_are_replayed_with_their_strides(tmp_path):
    rank = tracecmp.load(_lstm_gates(tmp_path / "run")).rank(0)
    ops = rank.ops
    activations = ops[ops["op"].isin(["aten.sigmoid_.default", "aten.tanh_.default"])]["op_id"].tolist()
    assert len(activations) == 4
    own = replay_rank(rank, activations)
    # On contiguous copies of the blocks the vectorized kernel splits rows differently and some
    # elements come out one bit apart; over the strided blocks the replay is the run itself.
    assert all(own[o].bitwise and own[o].error == own[o].honest for o in activations), own


def _tf32_matmuls(path: Path, tf32: bool, flip: int | None = None, exact_sums: bool = False) -> Path:
    """Five matmuls (tanh between), at TF32 in a target (inputs rounded to nearest even, float32
    sums as this CPU makes them, or ``exact_sums``: a device that sums in another order, exactly);
    ``flip`` moves one element of that matmul's output by one ulp."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 48, generator=g)
    b = TraceBuilder(data=True)
    h = b.source("input.0", x)
    for i in range(5):
        w = torch.randn(48, 48, generator=g) / 7
        W = b.param(f"fc{i}.weight", w, module=f"fc{i}")
        hv = b.value(h)

        def device(_: torch.Tensor, hv: torch.Tensor = hv, w: torch.Tensor = w, i: int = i) -> torch.Tensor:
            a, m = (round_tf32(hv), round_tf32(w)) if tf32 else (hv, w)
            out = (a.double() @ m.double()).float() if exact_sums else a @ m
            if i == flip:
                out = out.clone()
                out.view(-1)[7] = torch.nextafter(out.view(-1)[7], torch.tensor(math.inf))
            return out

        h = b.call(A.mm.default, h, W, module=f"fc{i}", fault=device)
        h = b.call(A.tanh.default, h, module=f"act{i}")
    return b.write(path)


def test_one_ulp_in_a_tf32_matmul_is_a_root_where_replays_give_its_other_calls_bit_for_bit(tmp_path):
    bench = _tf32_matmuls(tmp_path / "bench", tf32=False)
    clean = tracecmp.compare(_tf32_matmuls(tmp_path / "clean", tf32=True), bench)
    assert clean.first_divergence is None, clean.first_divergence
    result = tracecmp.compare(_tf32_matmuls(tmp_path / "target", tf32=True, flip=2), bench)
    d = result.first_divergence
    assert d is not None and (d.op, d.module) == ("aten.mm.default", "fc2"), result.suspects
    assert "bit for bit" in d.reason
    # Far inside TF32's own error: the accumulation bound alone calls it noise.
    assert d.metrics["own_error"] < d.metrics["honest_error"]
    assert [s.module for s in result.suspects] == ["fc2"]


@pytest.mark.parametrize("flip", [None, 2])
def test_a_device_that_sums_in_another_order_is_not_held_to_bits(tmp_path, flip):
    bench = _tf32_matmuls(tmp_path / "bench", tf32=False)
    result = tracecmp.compare(_tf32_matmuls(tmp_path / "target", tf32=True, flip=flip, exact_sums=True), bench)
    # No replay gives these calls' bits: one ulp is within what such a device may do.
    assert result.first_divergence is None, result.first_divergence


def _long_matmul(path: Path, threads: int) -> Path:
    """A matmul over 65,536 terms (a weight gradient summed over a long batch), captured on
    ``threads`` intra-op threads: a CPU kernel splits so long a sum by threads."""
    torch.manual_seed(0)
    grad, hidden = torch.randn(32, 65536), torch.randn(65536, 32)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with tracecmp.TraceCompare(path, data="tensors"):
            torch.mm(grad, hidden)
    finally:
        torch.set_num_threads(saved)
    return path


def test_replay_runs_at_the_thread_count_the_run_was_captured_at(tmp_path):
    rank = tracecmp.load(_long_matmul(tmp_path / "run", threads=1)).rank(0)
    assert rank.manifest["info"]["threads"] == 1
    (mm,) = rank.ops[rank.ops["op"] == "aten.mm.default"]["op_id"].tolist()
    # Compare runs on more threads than the capture did: the replay takes the capture's.
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        own = replay_rank(rank, [mm])[mm]
        assert torch.get_num_threads() == 2  # given back after the replay
    finally:
        torch.set_num_threads(saved)
    assert own.bitwise and own.error == own.honest, own


def _scaled_keys(path: Path) -> Path:
    """Attention scores as the math path of scaled dot-product attention makes them: the keys,
    transposed, scaled (an elementwise op keeps its input's transposed strides), then a bmm."""
    torch.manual_seed(0)
    query, key = torch.randn(8, 6, 16), torch.randn(8, 6, 16)
    with tracecmp.TraceCompare(path, data="tensors"):
        keys = key.transpose(-2, -1) * 0.5
        torch.bmm(query, keys)
    return path


def test_a_saved_value_keeps_the_layout_it_had_in_the_run(tmp_path):
    from safetensors.torch import load_file

    rank = tracecmp.load(_scaled_keys(tmp_path / "run")).rank(0)
    ops, tensors = rank.ops, rank.tensors
    (bmm,) = ops[ops["op"] == "aten.bmm.default"]["op_id"].tolist()
    scaled = int(ops[ops["op_id"] == bmm].iloc[0]["inputs"][1])
    value = rank.load_tensor(scaled)
    assert value.shape == (8, 16, 6) and value.stride() == (96, 1, 16)
    # Its bytes are in logical order: a reader that knows nothing of layouts reads the same values.
    key = tensors[tensors["tensor_id"] == scaled].iloc[0]["data_key"]
    (data_file,) = rank.data_files.values()
    assert torch.equal(load_file(data_file)[key], value)
    # Handed the run's layout, the bmm's replay is the run itself (on a contiguous copy of the
    # keys some CPUs' kernels sum in another order).
    own = replay_rank(rank, [bmm])[bmm]
    assert own.bitwise and own.error == own.honest, own


@pytest.mark.parametrize(
    "orders, match",
    [('{"k": [0, 0]}', "not permutations"), ('{"k": [1, 0, 2]}', "3 dimensions for 2"), ("[1, 0", "not valid JSON")],
)
def test_a_malformed_memory_order_is_a_format_error(tmp_path, orders, match):
    from safetensors.torch import save_file

    from tracecmp.errors import TraceFormatError
    from tracecmp.trace.saved import DataFile
    from tracecmp.trace.schema import MEMORY_ORDER_KEY

    path = tmp_path / "data-00000.safetensors"
    save_file({"k": torch.zeros(2, 3)}, str(path), metadata={MEMORY_ORDER_KEY: orders})
    with pytest.raises(TraceFormatError, match=match):
        data = DataFile(path)
        try:
            data.read("k")
        finally:
            data.close()
