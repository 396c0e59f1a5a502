"""Alignment of target and bench nodes: structural keys, anchors, DP on the differing stretches."""

from __future__ import annotations

from typing import Callable

import pytest

import tracecmp
from tests.tracebuild import Ref, TraceBuilder
from tracecmp.comparison.align import align_nodes, align_sequences


def _pairs(
    tmp_path, target: Callable[[TraceBuilder], None], bench: Callable[[TraceBuilder], None], **kw
) -> tuple[dict, object, object]:
    bt, bb = TraceBuilder(**kw), TraceBuilder(**kw)
    target(bt)
    bench(bb)
    t = tracecmp.load(bt.write(tmp_path / "t")).rank(0)
    b = tracecmp.load(bb.write(tmp_path / "b")).rank(0)
    return align_nodes(t.ops, t.tensors, b.ops, b.tensors), t, b


def _blocks(
    b: TraceBuilder,
    n: int = 6,
    extra_in: int | None = None,
    missing_in: int | None = None,
    dtype: str = "float32",
    cast_in: int | None = None,
) -> None:
    """n identical blocks (linear, relu, add): the shape of a repeated transformer stack."""
    x: Ref = b.source("input.0", shape=(4, 8), dtype=dtype)
    for i in range(n):
        m = f"blocks.{i}"
        w = b.param(f"{m}.fc.weight", shape=(8, 8), dtype=dtype)
        if cast_in == i:
            x = b.op("aten._to_copy.default", [x], shape=(4, 8), dtype="bfloat16", module=m)
        h = b.op("aten.mm.default", [x, w], shape=(4, 8), dtype=dtype, module=f"{m}.fc")
        if extra_in == i:
            h = b.op("aten.clone.default", [h], shape=(4, 8), dtype=dtype, module=f"{m}.fc")
        if missing_in != i:
            h = b.op("aten.relu.default", [h], shape=(4, 8), dtype=dtype, module=f"{m}.act")
        x = b.op("aten.add.Tensor", [x, h], shape=(4, 8), dtype=dtype, module=m)


def _by_name(ops) -> dict[int, tuple]:
    return {int(r.op_id): (r.op, r.module, r.name) for r in ops.itertuples()}


def test_identical_sequences_pair_one_to_one(tmp_path):
    pairs, t, b = _pairs(tmp_path, _blocks, _blocks)
    assert pairs == {i: i for i in range(len(t.ops))}


def test_one_extra_op_in_target_shifts_nothing_else(tmp_path):
    pairs, t, b = _pairs(tmp_path, lambda x: _blocks(x, extra_in=2), _blocks)
    tn, bn = _by_name(t.ops), _by_name(b.ops)
    unpaired = [tn[o] for o in tn if o not in pairs]
    assert unpaired == [("aten.clone.default", "blocks.2.fc", "")]
    assert len(pairs) == len(b.ops)
    assert all(tn[o] == bn[p] for o, p in pairs.items())


def test_one_missing_op_in_target_leaves_only_the_bench_op_unpaired(tmp_path):
    pairs, t, b = _pairs(tmp_path, lambda x: _blocks(x, missing_in=4), _blocks)
    tn, bn = _by_name(t.ops), _by_name(b.ops)
    assert len(pairs) == len(t.ops)
    assert [bn[o] for o in bn if o not in set(pairs.values())] == [("aten.relu.default", "blocks.4.act", "")]
    assert all(tn[o] == bn[p] for o, p in pairs.items())


def test_dtype_differences_do_not_prevent_pairing(tmp_path):
    pairs, t, b = _pairs(tmp_path, lambda x: _blocks(x, dtype="bfloat16"), _blocks)
    assert len(pairs) == len(t.ops) == len(b.ops)


def test_an_inserted_cast_is_the_only_unpaired_node(tmp_path):
    pairs, t, b = _pairs(tmp_path, lambda x: _blocks(x, cast_in=3), _blocks)
    tn = _by_name(t.ops)
    assert [tn[o][0] for o in tn if o not in pairs] == ["aten._to_copy.default"]
    assert len(pairs) == len(b.ops)


def _norm_fused(b: TraceBuilder) -> None:
    x = b.source("input.0", shape=(4, 8))
    w = b.param("ln.weight", shape=(8,))
    y = b.op("npu.fused_layer_norm.default", [x, w], shape=(4, 8), module="ln")
    y = b.op("aten.gelu.default", [y], shape=(4, 8), module="act")
    b.op("aten.sum.default", [y], shape=(), module="")


def _norm_decomposed(b: TraceBuilder) -> None:
    x = b.source("input.0", shape=(4, 8))
    w = b.param("ln.weight", shape=(8,))
    mean = b.op("aten.mean.dim", [x], shape=(4, 1), module="ln")
    centered = b.op("aten.sub.Tensor", [x, mean], shape=(4, 8), module="ln")
    var = b.op("aten.var.correction", [x], shape=(4, 1), module="ln")
    rstd = b.op("aten.rsqrt.default", [var], shape=(4, 1), module="ln")
    normed = b.op("aten.mul.Tensor", [centered, rstd], shape=(4, 8), module="ln")
    y = b.op("aten.mul.Tensor", [normed, w], shape=(4, 8), module="ln")
    y = b.op("aten.gelu.default", [y], shape=(4, 8), module="act")
    b.op("aten.sum.default", [y], shape=(), module="")


def test_fused_op_against_its_decomposition(tmp_path):
    pairs, t, b = _pairs(tmp_path, _norm_fused, _norm_decomposed)
    tn, bn = _by_name(t.ops), _by_name(b.ops)
    assert [tn[o][0] for o in tn if o not in pairs] == ["npu.fused_layer_norm.default"]
    assert {tn[o][0] for o in pairs} == {"source.input", "source.parameter", "aten.gelu.default", "aten.sum.default"}
    assert all(tn[o] == bn[p] for o, p in pairs.items())
    # and the comparison runs through it: the fused op and the six bench ops form one region,
    # judged at its output, which is measured against the bench's last decomposition op (the
    # tensor the paired gelu reads); nothing is left unpaired.
    result = tracecmp.compare(tmp_path / "t", tmp_path / "b")
    fused = result.nodes[result.nodes["op"] == "npu.fused_layer_norm.default"].iloc[0]
    assert fused["status"] == "agrees"
    assert int(fused["op_id"]) in set(result.tensors["op_id"])
    (region,) = result.regions
    assert region.kind == "fused" and region.target_ops == (int(fused["op_id"]),) and len(region.bench_ops) == 6
    assert fused["region"] == region.region_id
    assert result.unpaired_bench.empty and result.agrees


def test_renamed_module_pairs_in_the_leftover_pass(tmp_path):
    def target(b: TraceBuilder) -> None:
        x = b.source("input.0", shape=(4, 8))
        y = b.op("aten.relu.default", [x], shape=(4, 8), module="model.act")
        b.op("aten.sum.default", [y], shape=(), module="model")

    def bench(b: TraceBuilder) -> None:
        x = b.source("input.0", shape=(4, 8))
        y = b.op("aten.relu.default", [x], shape=(4, 8), module="act")
        b.op("aten.sum.default", [y], shape=(), module="")

    pairs, _, _ = _pairs(tmp_path, target, bench)
    assert pairs == {0: 0, 1: 1, 2: 2}


def test_sources_pair_by_name_not_by_position(tmp_path):
    def target(b: TraceBuilder) -> None:
        b.param("b.weight", shape=(3,))
        b.param("a.weight", shape=(3,))

    def bench(b: TraceBuilder) -> None:
        b.param("a.weight", shape=(3,))
        b.param("b.weight", shape=(3,))

    pairs, _, _ = _pairs(tmp_path, target, bench)
    assert pairs == {0: 1, 1: 0}


def test_inputs_named_differently_pair_where_their_shape_is_the_only_such(tmp_path):
    # A compiled target names what its compiled frame took ("input_ids"), never a labels tensor
    # only its loss function read; an older trace names a positional argument "input.0".
    def target(b: TraceBuilder) -> None:
        ids = b.source("input_ids", shape=(2, 16), dtype="int64")
        labels = b.source("", shape=(2, 15), dtype="int64")
        mask = b.source("", shape=(2, 16), dtype="int64")
        b.op("aten.add.Tensor", [ids, mask], shape=(2, 16), dtype="int64")
        b.op("aten.neg.default", [labels], shape=(2, 15), dtype="int64")

    def bench(b: TraceBuilder) -> None:
        ids = b.source("input.0", shape=(2, 16), dtype="int64")
        labels = b.source("labels", shape=(2, 15), dtype="int64")
        mask = b.source("attention_mask", shape=(2, 16), dtype="int64")
        b.op("aten.add.Tensor", [ids, mask], shape=(2, 16), dtype="int64")
        b.op("aten.neg.default", [labels], shape=(2, 15), dtype="int64")

    pairs, _, _ = _pairs(tmp_path, target, bench)
    assert pairs[1] == 1  # the one (2, 15) source on each side: labels
    # Two (2, 16) sources on each side left after the names: which is which is not guessed.
    assert 0 not in pairs and 2 not in pairs
    assert pairs[3] == 3 and pairs[4] == 4


def test_steps_and_phases_are_separate_scopes(tmp_path):
    def run(b: TraceBuilder, extra: bool) -> None:
        x = b.source("input.0", shape=(2,))
        b.op("aten.relu.default", [x], shape=(2,), module="m")
        if extra:
            b.op("aten.clone.default", [x], shape=(2,), module="m", phase="backward")
        b.op("aten.neg.default", [x], shape=(2,), module="m", phase="backward")
        b.step()
        b.op("aten.relu.default", [x], shape=(2,), module="m")

    pairs, t, b = _pairs(tmp_path, lambda x: run(x, True), lambda x: run(x, False))
    assert pairs == {0: 0, 1: 1, 3: 2, 4: 3}


@pytest.mark.parametrize(
    "a,b,expected",
    [
        ("abc", "abc", [(0, 0), (1, 1), (2, 2)]),
        ("xabc", "abc", [(1, 0), (2, 1), (3, 2)]),
        ("abcx", "abc", [(0, 0), (1, 1), (2, 2)]),
        ("aXc", "aYc", [(0, 0), (2, 2)]),
        ("", "abc", []),
        ("aab", "ab", [(0, 0), (2, 1)]),
    ],
)
def test_align_sequences_small_cases(a, b, expected):
    assert align_sequences(list(a), list(b)) == expected


def test_long_sequence_with_one_insertion_pairs_everything_else():
    keys = [("op", i % 7, (i % 3,)) for i in range(5000)]
    target = keys[:100] + [("extra", 0, ())] + keys[100:]
    pairs = align_sequences(target, keys)
    assert len(pairs) == len(keys)
    assert all(target[i] == keys[j] for i, j in pairs)
    assert (100, 100) not in pairs and (101, 100) in pairs


def test_reordered_ops_still_pair_without_crashing():
    a = [("op", i) for i in range(50)]
    b = a[25:] + a[:25]
    pairs = align_sequences(a, b)
    assert len(pairs) == 25 and all(a[i] == b[j] for i, j in pairs)


def test_long_sequences_without_anchors_still_pair_monotonically():
    import random

    rng = random.Random(0)
    bench = [("op", rng.randrange(40), (rng.randrange(5),)) for _ in range(30_000)]
    target = [k for k in bench if rng.random() > 0.01]  # 1% missing, 1% extra: few keys keep equal counts
    for _ in range(300):
        target.insert(rng.randrange(len(target)), ("op", rng.randrange(40), (rng.randrange(5),)))
    pairs = align_sequences(target, bench)
    assert all(target[i] == bench[j] for i, j in pairs)
    assert all(p[0] < q[0] and p[1] < q[1] for p, q in zip(pairs, pairs[1:]))
    assert len(pairs) > 0.95 * len(bench)
