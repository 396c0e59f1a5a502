"""A compiled region against the eager ops it replaces, on hand-built traces (no model is run).

The bench runs ``relu(x * w)`` eagerly (``aten.mul`` in ``fc``, ``aten.relu`` in ``act``), then a
sum. The target recorded the first two as one compiled region (``compiled.forward``) whose graph
says which eager ops its nodes came from; the sum runs eagerly after it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

import tracecmp
from tests.tracebuild import TraceBuilder
from tracecmp.trace.compiled import CompiledGraph, GraphNode, GraphPart, RegionCall

X = torch.tensor([[1.5, -2.0, 0.25, 3.0], [-0.5, 1.0, -1.25, 2.5]])
W = torch.tensor([[0.5, 1.5, -2.0, 1.0], [2.0, -0.75, 0.5, -1.5]])


def _bench(path: Path) -> Path:
    b = TraceBuilder()
    x, w = b.source("input.0", X), b.param("fc.weight", W)
    y = b.call(torch.ops.aten.mul.Tensor, x, w, module="fc")
    r = b.call(torch.ops.aten.relu.default, y, module="act")
    b.call(torch.ops.aten.sum.default, r)
    return b.write(path)


def _graph(relu_op: str = "aten.relu.default", relu_args: str = '{"self":{"tensor":0}}') -> CompiledGraph:
    nodes = (
        GraphNode("primals_1", "placeholder"),
        GraphNode("primals_2", "placeholder"),
        GraphNode(
            "mul",
            "aten.mul.Tensor",
            ("primals_1", "primals_2"),
            '{"self":{"tensor":0},"other":{"tensor":1}}',
            "fc",
            "model.py:3",
            1,
            "aten.mul.Tensor",
            ((2, 4),),
            ("float32",),
        ),
        GraphNode(
            "relu", relu_op, ("mul",), relu_args, "act", "model.py:4", 2, "aten.relu.default", ((2, 4),), ("float32",)
        ),
        GraphNode("output", "output", ("relu",)),
    )
    return CompiledGraph(
        "g0",
        "0/0",
        "inductor",
        "model.py:2 forward",
        "",
        ("L['x']", "L['self'].fc.weight"),
        {"forward": GraphPart("forward", nodes, (), 1)},
    )


def _target(
    path: Path,
    region: Callable[[torch.Tensor], torch.Tensor],
    graph: CompiledGraph,
    data: bool,
    values: dict[str, torch.Tensor] | None = None,
) -> Path:
    """A target that ran ``graph`` as one compiled region computing ``region(X * W)``; ``values``:
    what capture's shadow run measured of its nodes (fused code dispatches nothing)."""
    b = TraceBuilder(data=data)
    x, w = b.source("input.0", X), b.param("fc.weight", W)
    out = region(X * W)
    y = b.op("compiled.forward", [x, w], out, module="")
    b.ops[-1]["name"] = graph.id
    b.call(torch.ops.aten.sum.default, y)
    call = RegionCall(
        graph=graph.id,
        part="forward",
        mode="boundary",
        step=0,
        op_id=y.op_id,
        first_op=y.op_id,
        last_op=y.op_id,
        inputs=(x.tensor_id, w.tensor_id),
        outputs=(y.tensor_id,),
        values={name: (_stats(v), tuple(v.shape)) for name, v in (values or {}).items()},
    )
    b.compiled = {"graphs": [graph.to_json()], "calls": [call.to_json()]}
    return b.write(path)


def _stats(t: torch.Tensor) -> tuple[float, float, float, float]:
    d = t.double()
    return float(d.min()), float(d.max()), float(d.mean()), float(d.norm())


def test_a_clean_region_pairs_with_the_op_it_replaces_and_agrees(tmp_path: Path) -> None:
    bench = _bench(tmp_path / "bench")
    target = _target(tmp_path / "target", torch.relu, _graph(), data=False)
    result = tracecmp.compare(target, bench)
    assert result.first_divergence is None
    region = result.nodes[result.nodes["op"] == "compiled.forward"].iloc[0]
    measured = result.tensors[result.tensors["op_id"] == region["op_id"]]
    relu_out = tracecmp.load(bench).rank(0).ops.query("op == 'aten.relu.default'")["outputs"].iloc[0][0]
    assert measured["bench_tensor_id"].tolist() == [relu_out]
    assert region["status"] == "agrees"
    assert result.status == "agree", result.summary()
    # What statistics cannot see inside is said, and does not block agreement.
    assert any("judged by statistics" in n for n in result.notes) and not result.warnings


def test_a_region_computing_wrong_is_a_root(tmp_path: Path) -> None:
    bench = _bench(tmp_path / "bench")
    target = _target(tmp_path / "target", lambda y: torch.relu(y) * 1.01, _graph(), data=True)
    first = tracecmp.compare(target, bench).first_divergence
    assert first is not None and first.op == "compiled.forward"
    assert "computes its graph wrongly" in first.reason  # its own error against the replay of its graph


def test_a_graph_departing_from_the_eager_ops_is_narrowed_to_its_node(tmp_path: Path) -> None:
    # A pass swapped relu for a leaky relu: the region computes its graph faithfully, but the graph
    # is not the eager program. The replay finds the node where it departs.
    bench = _bench(tmp_path / "bench")
    graph = _graph("aten.leaky_relu.default", '{"self":{"tensor":0},"negative_slope":0.5}')
    target = _target(tmp_path / "target", lambda y: torch.nn.functional.leaky_relu(y, 0.5), graph, data=True)
    first = tracecmp.compare(target, bench).first_divergence
    assert first is not None and first.op == "compiled.forward"
    assert "narrowed to FX node relu (aten.leaky_relu.default, act, model.py:4)" in first.reason


def test_a_region_without_tensors_is_allowed_a_graph_of_rounding(tmp_path: Path) -> None:
    bench = _bench(tmp_path / "bench")
    # A few float32 units apart (reordered arithmetic): noise. Far more: a root.
    close = _target(tmp_path / "close", lambda y: torch.relu(y) * (1 + 2e-7), _graph(), data=False)
    assert tracecmp.compare(close, bench).first_divergence is None
    far = _target(tmp_path / "far", lambda y: torch.relu(y) * 1.01, _graph(), data=False)
    first = tracecmp.compare(far, bench).first_divergence
    assert first is not None and first.op == "compiled.forward" and "no replay measured" in first.reason


# -- fused code measured by capture's shadow run: a graph that departs, named at its node ----------

LEAKY = ("aten.leaky_relu.default", '{"self":{"tensor":0},"negative_slope":0.5}')


def _leaky(y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.leaky_relu(y, 0.5)


def test_fused_nodes_measured_at_capture_name_the_departing_node_without_tensors(tmp_path: Path) -> None:
    bench = _bench(tmp_path / "bench")
    y = X * W
    clean = _target(tmp_path / "clean", torch.relu, _graph(), False, {"mul": y, "relu": torch.relu(y)})
    assert tracecmp.compare(clean, bench).status == "agree"
    # A pass swapped the relu: the shadow run's value of that node departs from the eager relu's.
    target = _target(tmp_path / "target", _leaky, _graph(*LEAKY), False, {"mul": y, "relu": _leaky(y)})
    first = tracecmp.compare(target, bench).first_divergence
    assert first is not None and (first.op, first.module) == ("compiled.forward", "act")
    assert "narrowed by statistics to FX node relu (aten.leaky_relu.default, act" in first.reason
    # Without them the region is judged whole, at no module of its own.
    whole = _target(tmp_path / "whole", _leaky, _graph(*LEAKY), False)
    first = tracecmp.compare(whole, bench).first_divergence
    assert first is not None and first.module == "" and "no replay measured" in first.reason


def test_a_compiled_bench_with_another_graph_pairs_node_for_node(tmp_path: Path) -> None:
    # Both runs compiled; the target's graph differs (the relu swapped), so the regions are not
    # twins op for op: each node pairs with the bench graph's node of its eager op and module, and
    # the bench's value is what its own shadow run measured.
    y = X * W
    bench = _target(tmp_path / "bench", torch.relu, _graph(), False, {"mul": y, "relu": torch.relu(y)})
    assert tracecmp.compare(bench, bench).status == "agree"
    target = _target(tmp_path / "target", _leaky, _graph(*LEAKY), False, {"mul": y, "relu": _leaky(y)})
    result = tracecmp.compare(target, bench)
    first = result.first_divergence
    assert first is not None and (first.op, first.module) == ("compiled.forward", "act"), result.summary()
    assert "narrowed by statistics to FX node relu" in first.reason
    assert result.counts()["unpaired bench"] == 0  # the bench's region stands where the target's does


def test_a_module_the_bench_implements_with_other_ops_pairs_by_what_it_hands_on(tmp_path: Path) -> None:
    # The bench's ``act`` clamps (``clamp_min``) where the target's graph says relu: no eager op of
    # the bench stands for the node, so the value ``act`` hands on pairs with the bench's.
    b = TraceBuilder()
    x, w = b.source("input.0", X), b.param("fc.weight", W)
    y = b.call(torch.ops.aten.mul.Tensor, x, w, module="fc")
    r = b.call(torch.ops.aten.clamp_min.default, y, 0.0, module="act")
    b.call(torch.ops.aten.sum.default, r)
    bench = b.write(tmp_path / "bench")
    y = X * W
    clean = _target(tmp_path / "clean", torch.relu, _graph(), False, {"mul": y, "relu": torch.relu(y)})
    assert tracecmp.compare(clean, bench).status == "agree"
    target = _target(tmp_path / "target", _leaky, _graph(*LEAKY), False, {"mul": y, "relu": _leaky(y)})
    first = tracecmp.compare(target, bench).first_divergence
    assert first is not None and (first.op, first.module) == ("compiled.forward", "act")
    assert "narrowed by statistics to FX node relu" in first.reason


# -- which eager value a node stands for: unbind's outputs, a pass's rewrites, views ----------------
#
# Attention's heads the common way: ``qkv(x).view(B, T, 3, H, hd).permute(2, 0, 3, 1, 4).unbind(0)``.
# Eager records q, k and v as three views of the projection's output, with one shape and no
# statistics of their own; the graph says which is which by its getitems.

ATEN = torch.ops.aten
QKV_X = torch.linspace(-1.0, 1.3, 48).reshape(1, 4, 12)
QKV_W = torch.linspace(0.5, 1.7, 48).reshape(1, 4, 12)
HEADS = (1, 2, 4, 2)  # q, k, v: (B, H, T, hd)


def _heads_bench(path: Path, *, data: bool = True) -> Path:
    """Eager: ``q, k, v = (x * w).view(1, 4, 3, 2, 2).permute(2, 0, 3, 1, 4).unbind(0)``, then ``q * k + v``."""
    b = TraceBuilder(data=data)
    x, w = b.source("input.0", QKV_X), b.param("qkv.weight", QKV_W)
    y = b.call(ATEN.mul.Tensor, x, w, module="qkv")
    heads = b.call(
        ATEN.permute.default,
        b.call(ATEN.view.default, y, [1, 4, 3, 2, 2], module="attn"),
        [2, 0, 3, 1, 4],
        module="attn",
    )
    q, k, v = b.call(ATEN.unbind.int, heads, module="attn")
    out = b.call(ATEN.add.Tensor, b.call(ATEN.mul.Tensor, q, k, module="attn"), v, module="attn")
    b.call(ATEN.sum.default, out)
    return b.write(path)


def _node(
    name: str,
    op: str,
    inputs: tuple[str, ...],
    args: dict,
    module: str,
    seq: int,
    original: str,
    shapes: tuple[tuple[int, ...], ...],
) -> GraphNode:
    return GraphNode(
        name, op, inputs, json.dumps(args), module, f"model.py:{seq}", seq, original, shapes, ("float32",) * len(shapes)
    )


def _heads_nodes() -> list[GraphNode]:
    """The graph's nodes up to the getitems of the unbind."""
    t = {"tensor": 0}
    return [
        GraphNode("primals_1", "placeholder"),
        GraphNode("primals_2", "placeholder"),
        _node(
            "mul",
            "aten.mul.Tensor",
            ("primals_1", "primals_2"),
            {"self": t, "other": {"tensor": 1}},
            "qkv",
            1,
            "aten.mul.Tensor",
            ((1, 4, 12),),
        ),
        _node(
            "view",
            "aten.view.default",
            ("mul",),
            {"self": t, "size": [1, 4, 3, 2, 2]},
            "attn",
            2,
            "aten.view.default",
            ((1, 4, 3, 2, 2),),
        ),
        _node(
            "permute",
            "aten.permute.default",
            ("view",),
            {"self": t, "dims": [2, 0, 3, 1, 4]},
            "attn",
            3,
            "aten.permute.default",
            ((3, 1, 2, 4, 2),),
        ),
        _node("unbind", "aten.unbind.int", ("permute",), {"self": t}, "attn", 4, "aten.unbind.int", (HEADS,) * 3),
        *(
            _node(f"getitem_{i}", "getitem", ("unbind",), {"index": i}, "attn", 4, "aten.unbind.int", (HEADS,))
            for i in range(3)
        ),
    ]


def _graph_of(nodes: list[GraphNode], outputs: tuple[str, ...]) -> CompiledGraph:
    part = GraphPart("forward", (*nodes, GraphNode("output", "output", outputs)), (), len(outputs))
    return CompiledGraph(
        "g0", "0/0", "inductor", "model.py:1 forward", "", ("L['x']", "L['self'].qkv.weight"), {"forward": part}
    )


def _region_target(
    path: Path,
    graph: CompiledGraph,
    outs: list[torch.Tensor],
    *,
    data: bool,
    after: Callable[[TraceBuilder, list], None],
) -> Path:
    """A target that ran ``graph`` as one compiled region returning ``outs``, then ``after``."""
    b = TraceBuilder(data=data)
    x, w = b.source("input.0", QKV_X), b.param("qkv.weight", QKV_W)
    refs = b.op("compiled.forward", [x, w], outs, module="")
    refs = [refs] if not isinstance(refs, tuple) else list(refs)
    b.ops[-1]["name"] = graph.id
    call = RegionCall(
        graph=graph.id,
        part="forward",
        mode="boundary",
        step=0,
        op_id=refs[0].op_id,
        first_op=refs[0].op_id,
        last_op=refs[0].op_id,
        inputs=(x.tensor_id, w.tensor_id),
        outputs=tuple(r.tensor_id for r in refs),
    )
    after(b, refs)
    b.compiled = {"graphs": [graph.to_json()], "calls": [call.to_json()]}
    return b.write(path)


def test_a_pass_that_scales_k_is_narrowed_to_it_against_the_bench_k(tmp_path: Path) -> None:
    # A pass scaled k (the unbind's output 1): its product carries the getitem's metadata, so it
    # stands for one of the eager unbind's three same-shaped outputs; the getitem says which.
    t = {"tensor": 0}
    nodes = [
        *_heads_nodes(),
        _node(
            "mul_k",
            "aten.mul.Tensor",
            ("getitem_1",),
            {"self": t, "other": 1.5},
            "attn",
            4,
            "aten.unbind.int",
            (HEADS,),
        ),
        _node(
            "mul_1",
            "aten.mul.Tensor",
            ("getitem_0", "mul_k"),
            {"self": t, "other": {"tensor": 1}},
            "attn",
            5,
            "aten.mul.Tensor",
            (HEADS,),
        ),
        _node(
            "add",
            "aten.add.Tensor",
            ("mul_1", "getitem_2"),
            {"self": t, "other": {"tensor": 1}},
            "attn",
            6,
            "aten.add.Tensor",
            (HEADS,),
        ),
    ]
    q, k, v = (QKV_X * QKV_W).view(1, 4, 3, 2, 2).permute(2, 0, 3, 1, 4).unbind(0)
    bench = _heads_bench(tmp_path / "bench")
    target = _region_target(
        tmp_path / "target",
        _graph_of(nodes, ("add",)),
        [q * (k * 1.5) + v],
        data=True,
        after=lambda b, refs: b.call(ATEN.sum.default, refs[0]),
    )
    first = tracecmp.compare(target, bench).first_divergence
    assert first is not None and first.op == "compiled.forward"
    # Against the bench's k, not "no eager counterpart", nor q's or v's values.
    assert (
        "narrowed to FX node mul_k (aten.mul.Tensor, attn, model.py:4): the graph's own value there differs from "
        "the bench's aten.unbind.int by 3.3e-01" in first.reason
    )


def test_nodes_a_pass_rewrote_inside_a_softmax_stand_for_none_of_its_outputs(tmp_path: Path) -> None:
    # Inductor's stable softmax rewrites ``x - amax(x)``: the rewritten nodes have no sequence
    # number, and the last carries the softmax's name though it holds x - amax(x), not the
    # softmax. A later pass changed a constant (2.0 -> 2.5): that node is where the graph departs.
    x = torch.linspace(-2.0, 1.0, 8).reshape(2, 4)
    b = TraceBuilder(data=True)
    xb = b.source("input.0", x)
    soft = b.call(ATEN._softmax.default, xb, -1, False, module="attn")
    b.call(ATEN.sum.default, b.call(ATEN.mul.Tensor, soft, 2.0, module="scale"))
    bench = b.write(tmp_path / "bench")
    t, two = {"tensor": 0}, {"tensor": 0}
    nodes = [
        GraphNode("primals_1", "placeholder"),
        _node(
            "amax",
            "aten.amax.default",
            ("primals_1",),
            {"self": t, "dim": [-1], "keepdim": True},
            "attn",
            -1,
            "aten.amax.default",
            ((2, 1),),
        ),
        _node(
            "sub",
            "aten.sub.Tensor",
            ("primals_1", "amax"),
            {"self": t, "other": {"tensor": 1}},
            "attn",
            -1,
            "aten._softmax.default",
            ((2, 4),),
        ),
        _node("exp", "aten.exp.default", ("sub",), {"self": t}, "attn", 7, "aten._softmax.default", ((2, 4),)),
        _node(
            "sum_1",
            "aten.sum.dim_IntList",
            ("exp",),
            {"self": t, "dim": [-1], "keepdim": True},
            "attn",
            7,
            "aten._softmax.default",
            ((2, 1),),
        ),
        _node(
            "div",
            "aten.div.Tensor",
            ("exp", "sum_1"),
            {"self": t, "other": {"tensor": 1}},
            "attn",
            7,
            "aten._softmax.default",
            ((2, 4),),
        ),
        _node(
            "mul", "aten.mul.Tensor", ("div",), {"self": two, "other": 2.5}, "scale", 8, "aten.mul.Tensor", ((2, 4),)
        ),
    ]
    graph = CompiledGraph(
        "g0",
        "0/0",
        "inductor",
        "model.py:1 forward",
        "",
        ("L['x']",),
        {"forward": GraphPart("forward", (*nodes, GraphNode("output", "output", ("mul",))), (), 1)},
    )
    tb = TraceBuilder(data=True)
    xt = tb.source("input.0", x)
    out = tb.op("compiled.forward", [xt], torch.softmax(x, -1) * 2.5)
    tb.ops[-1]["name"] = graph.id
    tb.call(ATEN.sum.default, out)
    call = RegionCall(
        graph=graph.id,
        part="forward",
        mode="boundary",
        step=0,
        op_id=out.op_id,
        first_op=out.op_id,
        last_op=out.op_id,
        inputs=(xt.tensor_id,),
        outputs=(out.tensor_id,),
    )
    tb.compiled = {"graphs": [graph.to_json()], "calls": [call.to_json()]}
    first = tracecmp.compare(tb.write(tmp_path / "target"), bench).first_divergence
    assert first is not None and first.op == "compiled.forward"
    assert (
        "narrowed to FX node mul (aten.mul.Tensor, scale, model.py:8): the graph's own value there differs from "
        "the bench's aten.mul.Tensor" in first.reason
    )


def test_a_region_returning_q_k_v_is_not_compared_with_the_projection_they_view(tmp_path: Path) -> None:
    # A graph break right after the unbind: the region returns q, k and v. Eager's are views of
    # the projection's output, which capture keeps no statistics of: q is not the projection.
    q, k, v = (QKV_X * QKV_W).view(1, 4, 3, 2, 2).permute(2, 0, 3, 1, 4).unbind(0)

    def after(b: TraceBuilder, refs: list) -> None:
        out = b.call(ATEN.add.Tensor, b.call(ATEN.mul.Tensor, refs[0], refs[1], module="attn"), refs[2], module="attn")
        b.call(ATEN.sum.default, out)

    graph = _graph_of(_heads_nodes(), ("getitem_0", "getitem_1", "getitem_2"))
    target = _region_target(tmp_path / "target", graph, [q.clone(), k.clone(), v.clone()], data=False, after=after)
    result = tracecmp.compare(target, _heads_bench(tmp_path / "bench", data=False))
    assert result.first_divergence is None
    region = result.nodes[result.nodes["op"] == "compiled.forward"].iloc[0]
    assert region["status"] not in ("diverged", "agrees")  # not compared: neither wrong nor right


def test_a_replay_takes_the_sizes_a_backward_reads_from_its_forward() -> None:
    # Under dynamic shapes a backward graph's placeholders include sizes its forward saved
    # (``sym_size_int``); nodes sized by them run, and so does every node after them.
    from tracecmp.comparison.compiled.narrow import run_part

    nodes = (
        GraphNode("sym_size_int", "placeholder"),
        GraphNode("tangents_1", "placeholder"),
        _node(
            "view",
            "aten.view.default",
            ("tangents_1",),
            {"self": {"tensor": 0}, "size": ["<node sym_size_int>", 3]},
            "fc",
            1,
            "aten.view.default",
            ((2, 3),),
        ),
        _node(
            "relu", "aten.relu.default", ("view",), {"self": {"tensor": 0}}, "act", 2, "aten.relu.default", ((2, 3),)
        ),
        GraphNode("output", "output", ("relu",)),
    )
    given = {"sym_size_int": 2, "tangents_1": torch.linspace(-1.0, 1.0, 6)}
    values = run_part(GraphPart("backward", nodes), lambda name, golden: given.get(name), {}, golden=True)
    assert torch.equal(values["relu"], given["tangents_1"].double().view(2, 3).relu())


def _two_matmuls(tmp_path: Path, wrong: float) -> tracecmp.CompareResult:
    """Eager: ``(x @ w1 + x @ w2) * 2``. The target's region computes it with a graph whose last
    node a pass changed (``* 2.5``), and its compiled code dispatched the two matmuls in the other
    order than its graph's (capture files them by order); ``wrong`` scales what it dispatched for
    the second one."""
    x, w1, w2 = (
        torch.linspace(-1.0, 1.0, 12).reshape(3, 4),
        torch.linspace(0.5, 2.0, 16).reshape(4, 4),
        torch.linspace(-1.5, 0.5, 16).reshape(4, 4),
    )
    b = TraceBuilder(data=True)
    refs = b.source("input.0", x), b.param("fc1.weight", w1), b.param("fc2.weight", w2)
    added = b.call(
        ATEN.add.Tensor,
        b.call(ATEN.mm.default, refs[0], refs[1], module="fc1"),
        b.call(ATEN.mm.default, refs[0], refs[2], module="fc2"),
        module="out",
    )
    b.call(ATEN.sum.default, b.call(ATEN.mul.Tensor, added, 2.0, module="scale"))
    bench = b.write(tmp_path / "bench")
    t = {"tensor": 0}
    mm = {"self": t, "mat2": {"tensor": 1}}
    nodes = (
        *(GraphNode(f"primals_{i}", "placeholder") for i in (1, 2, 3)),
        _node("mm", "aten.mm.default", ("primals_1", "primals_2"), mm, "fc1", 1, "aten.mm.default", ((3, 4),)),
        _node("mm_1", "aten.mm.default", ("primals_1", "primals_3"), mm, "fc2", 2, "aten.mm.default", ((3, 4),)),
        _node(
            "add",
            "aten.add.Tensor",
            ("mm", "mm_1"),
            {"self": t, "other": {"tensor": 1}},
            "out",
            3,
            "aten.add.Tensor",
            ((3, 4),),
        ),
        _node("mul", "aten.mul.Tensor", ("add",), {"self": t, "other": 2.5}, "scale", 4, "aten.mul.Tensor", ((3, 4),)),
        GraphNode("output", "output", ("mul",)),
    )
    graph = CompiledGraph(
        "g0",
        "0/0",
        "inductor",
        "model.py:1 forward",
        "",
        ("L['x']", "L['w1']", "L['w2']"),
        {"forward": GraphPart("forward", nodes, (), 1)},
    )
    tb = TraceBuilder(data=True)
    xs = tb.source("input.0", x), tb.param("fc1.weight", w1), tb.param("fc2.weight", w2)
    second = tb.op("aten.mm.out", [xs[0], xs[2]], x @ w2 * wrong)  # dispatched first: filed under mm
    first = tb.op("aten.mm.out", [xs[0], xs[1]], x @ w1)
    out = tb.op("compiled.forward", list(xs), (x @ w1 + x @ w2 * wrong) * 2.5)
    tb.ops[-1]["name"] = graph.id
    tb.call(ATEN.sum.default, out)
    call = RegionCall(
        graph=graph.id,
        part="forward",
        mode="boundary",
        step=0,
        op_id=out.op_id,
        first_op=second.op_id,
        last_op=out.op_id,
        inputs=tuple(r.tensor_id for r in xs),
        outputs=(out.tensor_id,),
        nodes={"mm": (second.op_id,), "mm_1": (first.op_id,)},
    )
    tb.compiled = {"graphs": [graph.to_json()], "calls": [call.to_json()]}
    return tracecmp.compare(tb.write(tmp_path / "target"), bench)


def test_extern_kernels_dispatched_out_of_graph_order_are_not_wrong_kernels(tmp_path: Path) -> None:
    first = _two_matmuls(tmp_path / "clean", 1.0).first_divergence
    assert first is not None and first.op == "compiled.forward"
    assert (
        "narrowed to FX node mul (aten.mul.Tensor, scale, model.py:4): the graph's own value there differs"
        in first.reason
    )
    # A wrong kernel is still named, whichever node capture filed its value under.
    first = _two_matmuls(tmp_path / "wrong", 1.01).first_divergence
    assert first is not None and first.op == "compiled.forward"
    assert (
        "narrowed to FX node mm_1 (aten.mm.default, fc2, model.py:2): what the compiled code computed for it is "
        "off" in first.reason
    )


def test_a_module_hands_on_its_last_value_unless_a_submodule_computes_after_it() -> None:
    from tracecmp.comparison.compiled.units import PartIndex

    def node(name: str, module: str) -> GraphNode:
        return GraphNode(name, "aten.mul.Tensor", (), "{}", module)

    scaled = PartIndex(GraphPart("forward", (node("a", "attn"), node("p", "attn.proj"), node("s", "attn"))))
    assert scaled.module_exit("attn").name == "s"  # the attention's output, scaled after its projection
    plain = PartIndex(GraphPart("forward", (node("a", "attn"), node("p", "attn.proj"))))
    assert plain.module_exit("attn") is None  # the projection computes what attn hands on
    assert plain.module_exit("attn.proj").name == "p"
