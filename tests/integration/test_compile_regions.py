"""Compiled regions in a trace: ``compiled="boundary"`` and ``compiled="graph"`` on a small transformer.

One TinyGPT with a graph break (two compiled graphs, eager code between them) is compiled once per
backend in a session that records nothing, then traced by the tests in both modes: compiling
with inductor on two cores takes a minute, so the compiled model is shared.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import tracecmp
from tracecmp._compat import TORCH_VERSION
from tracecmp.trace.compiled import GRAPH_LABEL
from workloads.compile_models import FAULTS, CountingBackend, TinyGPT, between_blocks, tiny_batch

# torch < 2.2 guards compiled code on capture's global hooks: a session would describe copies of
# the graphs compiled for it, so capture records compiled code there without regions (README).
pytestmark = pytest.mark.skipif(TORCH_VERSION < (2, 2), reason="compiled regions are recorded from torch 2.2 on")


class Compiled:
    """A compiled TinyGPT with a graph break, and what a step of it does."""

    def __init__(self, backend: str, tmp: Path) -> None:
        torch.manual_seed(11)
        self.model = TinyGPT(layers=2, graph_break=True, between=between_blocks, custom_gelu=True)
        self.backend = CountingBackend(backend)
        self.compiled = torch.compile(self.model, backend=self.backend)
        self.batch = tiny_batch()
        # Compiled inside a session that records no step: the regions are known to capture.
        with tracecmp.TraceCompare(tmp / "warm", model=self.model, steps=[]):
            self.step()

    def step(self) -> torch.Tensor:
        loss = self.compiled(*self.batch)
        loss.backward()
        self.model.zero_grad(set_to_none=True)
        return loss.detach()

    def trace(self, path: Path, *, eager: bool = False, **options: Any) -> tracecmp.Trace:
        """One step traced: compiled, or ``eager`` (the bench: the same model, not compiled)."""
        with tracecmp.TraceCompare(path, model=self.model, **options) as tc:
            if eager:
                self.model(*self.batch).backward()
                self.model.zero_grad(set_to_none=True)
            else:
                self.step()
            tc.step()
        return tracecmp.load(path)


@pytest.fixture(scope="module", params=["aot_eager", "inductor"])
def compiled(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Compiled]:
    yield Compiled(request.param, tmp_path_factory.mktemp(request.param))


def _call_nodes(trace: tracecmp.Trace) -> list[Any]:
    return trace.rank(0).compiled.calls


def test_boundary_mode_records_regions_with_module_paths(compiled: Compiled, tmp_path: Path) -> None:
    runs = compiled.backend.runs
    trace = compiled.trace(tmp_path / "b", compiled="boundary")
    assert compiled.backend.runs == runs + 2  # both graphs ran compiled
    assert trace.options["compiled"] == "boundary"
    rank = trace.rank(0)
    ops = rank.ops
    record = rank.compiled
    assert len(record.graphs) == 2
    assert (
        sorted((c.part, c.mode) for c in record.calls) == [("backward", "boundary")] * 2 + [("forward", "boundary")] * 2
    )
    boundary = ops[ops["op"].isin(["compiled.forward", "compiled.backward"])]
    assert len(boundary) == 4
    assert set(boundary["name"]) == set(record.graphs)
    # The graphs name every node's module from its metadata.
    for graph in record.graphs.values():
        assert graph.backend == compiled.backend.inner
        forward = graph.parts["forward"]
        modules = {n.module for n in forward.nodes if n.op.startswith("aten.")}
        assert any(m.startswith("blocks.") for m in modules)
        assert "backward" in graph.parts
    assert {"blocks.0.ln1", "blocks.1.mlp.fc", "head"} <= {
        n.module for g in record.graphs.values() for n in g.parts["forward"].nodes
    }
    # What the compiled code dispatched inside (inductor: its extern kernels) carries the module
    # of the node it runs.
    inside = ops[ops["op"].str.startswith("aten.addmm")]
    assert "blocks.1.mlp.fc" in set(inside["module"])
    # Parameters enter the regions by name; the first region reads the token ids.
    sources = set(ops.loc[ops["kind"] == "source", "name"])
    assert {"emb.weight", "blocks.1.mlp.fc.weight", "head.weight"} <= sources


def test_graph_mode_runs_every_node_with_module_paths(compiled: Compiled, tmp_path: Path) -> None:
    runs = compiled.backend.runs
    trace = compiled.trace(tmp_path / "g", compiled="graph")
    assert compiled.backend.runs == runs  # the recorded step ran the graphs, not the compiled code
    assert trace.options["compiled"] == "graph"
    rank = trace.rank(0)
    ops = rank.ops
    assert not ops["op"].isin(["compiled.forward", "compiled.backward"]).any()
    record = rank.compiled
    assert sorted((c.part, c.mode) for c in record.calls) == [("backward", "graph")] * 2 + [("forward", "graph")] * 2
    for call in record.calls:
        graph = record.graphs[call.graph]
        computing = [
            n.name
            for n in graph.parts[call.part].nodes
            if n.op.startswith("aten.") and n.op not in ("aten.sym_size.int",)
        ]
        assert set(computing) <= set(call.nodes), set(computing) - set(call.nodes)
        by_id = ops.set_index("op_id")
        for node in graph.parts[call.part].nodes:
            for op_id in call.nodes.get(node.name, ()):
                if by_id.loc[op_id, "kind"] == "op":
                    assert by_id.loc[op_id, "module"] == node.module
    forward_modules = set(ops.loc[ops["phase"] == "forward", "module"])
    backward_modules = set(ops.loc[ops["phase"] == "backward", "module"])
    assert {"blocks.0.attn.qkv", "blocks.1.mlp.act", "head"} <= forward_modules
    assert {"blocks.0.attn.qkv", "blocks.1.mlp.fc", "head"} <= backward_modules
    assert GRAPH_LABEL == "inductor's graph structure with eager kernels"


def test_eager_code_between_graph_breaks_is_captured(compiled: Compiled, tmp_path: Path) -> None:
    trace = compiled.trace(tmp_path / "e", compiled="boundary")
    rank = trace.rank(0)
    ops = rank.ops
    covered = rank.compiled.region_of()
    eager = ops[~ops["op_id"].isin(covered) & (ops["phase"] == "forward") & (ops["kind"] == "op")]
    assert {"aten.tanh.default", "aten.mul.Tensor"} <= set(eager["op"])
    tanh = eager[eager["op"] == "aten.tanh.default"].iloc[0]
    assert tanh["location"].startswith("compile_models.py:")
    # Its input is the first region's output, its output the second region's input.
    first, second = sorted((c for c in rank.compiled.calls if c.part == "forward"), key=lambda c: c.first_op)
    assert set(first.outputs) & set(tanh["inputs"])
    mul = eager[eager["op"] == "aten.mul.Tensor"].iloc[0]
    assert set(mul["outputs"]) & set(second.inputs)


def test_what_each_mode_computes(compiled: Compiled, tmp_path: Path) -> None:
    """Boundary mode runs the compiled code: bitwise the untraced step. Graph mode runs the
    graphs with eager kernels: bitwise aot_eager's numbers, within rounding of inductor's."""
    plain = _loss_and_grads(compiled)
    for mode in ("boundary", "graph"):
        with tracecmp.TraceCompare(tmp_path / mode, model=compiled.model, compiled=mode, data="tensors") as tc:
            traced = _loss_and_grads(compiled)
            tc.step()
        if mode == "boundary" or compiled.backend.inner == "aot_eager":
            assert [k for k in plain if not torch.equal(plain[k], traced[k])] == []
        else:
            for key in plain:
                torch.testing.assert_close(traced[key], plain[key], rtol=1e-4, atol=1e-5)
    assert torch.equal(_loss_and_grads(compiled)["loss"], plain["loss"])  # and compiled again after


def _loss_and_grads(compiled: Compiled) -> dict[str, torch.Tensor]:
    loss = compiled.compiled(*compiled.batch)
    loss.backward()
    out = {n: p.grad.clone() for n, p in compiled.model.named_parameters()}
    out["loss"] = loss.detach()
    compiled.model.zero_grad(set_to_none=True)
    return out


# -- compiled target against an eager bench, and against a compiled one ---------------------------


@pytest.fixture(scope="module")
def benches(compiled: Compiled, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tracecmp.Trace]:
    root = tmp_path_factory.mktemp("bench")
    return {data: compiled.trace(root / data, eager=True, data=data) for data in ("stats", "tensors")}


@pytest.mark.parametrize("mode,data", [("boundary", "stats"), ("boundary", "tensors"), ("graph", "stats")])
def test_compiled_against_eager_on_a_clean_model_has_no_root(
    compiled: Compiled, benches: dict[str, tracecmp.Trace], tmp_path: Path, mode: str, data: str
) -> None:
    target = compiled.trace(tmp_path / "t", compiled=mode, data=data)
    result = tracecmp.compare(target, benches[data])
    assert result.first_divergence is None, result.first_divergence
    nodes = result.nodes
    regions = nodes[nodes["op"].isin(["compiled.forward", "compiled.backward"])]
    assert len(regions) == (4 if mode == "boundary" else 0)
    # The regions were compared, not skipped: their outputs have bench partners.
    if mode == "boundary":
        measured = result.tensors[result.tensors["op_id"].isin(regions["op_id"])]
        assert set(measured["op_id"]) == set(regions["op_id"])
        assert (regions["status"] != "diverged").all()
    assert any("eager kernels" in w for w in result.warnings) == (mode == "graph")
    if mode == "graph":
        # Forward nodes inductor's partitioner computes again in a backward graph have no eager
        # op (the eager backward reads saved values): none is paired with one.
        record = target.rank(0).compiled
        again = {
            op
            for c in record.calls
            if c.part == "backward"
            for n in record.graphs[c.graph].parts["backward"].nodes
            if n.recomputed
            for op in c.nodes.get(n.name, ())
        }
        assert bool(again) == (compiled.backend.inner == "inductor")
        assert nodes.loc[nodes["op_id"].isin(again), "bench_op_id"].isna().all()


def test_a_fault_in_eager_code_between_graphs_is_found(
    compiled: Compiled, benches: dict[str, tracecmp.Trace], tmp_path: Path
) -> None:
    FAULTS["between"] = 2.002
    try:
        target = compiled.trace(tmp_path / "t", compiled="boundary")
    finally:
        FAULTS["between"] = 2.0
    first = tracecmp.compare(target, benches["stats"]).first_divergence
    assert first is not None
    assert (first.op, first.module, first.phase, first.step) == ("aten.mul.Tensor", "", "forward", 0)


def _faulty_gelu_trace(model: Compiled, path: Path, **options: Any) -> tracecmp.Trace:
    FAULTS["gelu"] = 1.002
    try:
        return model.trace(path, **options)
    finally:
        FAULTS["gelu"] = 1.0


def test_a_fault_inside_a_region_is_found_at_the_region(
    compiled: Compiled, benches: dict[str, tracecmp.Trace], tmp_path: Path
) -> None:
    target = _faulty_gelu_trace(compiled, tmp_path / "t", compiled="boundary")
    first = tracecmp.compare(target, benches["stats"]).first_divergence
    assert first is not None and first.op in ("compiled.forward", "compiled.backward") and first.step == 0
    record = target.rank(0).compiled
    faulty = record.graphs[target.rank(0).ops.set_index("op_id").loc[first.op_id, "name"]]
    assert any(n.op == "tracecmp_tests.gelu.default" for n in faulty.parts["forward"].nodes)


def test_a_fault_inside_a_region_is_narrowed_to_its_node(
    compiled: Compiled, benches: dict[str, tracecmp.Trace], tmp_path: Path
) -> None:
    # Boundary mode with tensors: the region's graph is replayed and the kernel named.
    target = _faulty_gelu_trace(compiled, tmp_path / "b", compiled="boundary", data="tensors")
    first = tracecmp.compare(target, benches["tensors"]).first_divergence
    assert first is not None and first.op.startswith("compiled.")
    assert "to FX node gelu (tracecmp_tests.gelu.default" in first.reason  # by the replay, or by statistics
    assert "blocks.1.mlp.act" in first.reason
    # Graph mode: every node is an op of the trace, and localization names it.
    target = _faulty_gelu_trace(compiled, tmp_path / "g", compiled="graph")
    first = tracecmp.compare(target, benches["stats"]).first_divergence
    assert first is not None
    assert (first.op, first.module, first.phase, first.step) == (
        "tracecmp_tests.gelu.default",
        "blocks.1.mlp.act",
        "forward",
        0,
    )


def test_compiled_against_compiled(compiled: Compiled, tmp_path: Path) -> None:
    bench = compiled.trace(tmp_path / "bench", compiled="boundary")
    clean = compiled.trace(tmp_path / "clean", compiled="boundary")
    assert tracecmp.compare(clean, bench).first_divergence is None
    faulty = _faulty_gelu_trace(compiled, tmp_path / "faulty", compiled="boundary")
    first = tracecmp.compare(faulty, bench).first_divergence
    # The same graphs on both sides: region calls pair with their twins op for op, and the faulty
    # kernel is named itself, at its module, not the region around it.
    assert first is not None and (first.op, first.module) == ("tracecmp_tests.gelu.default", "blocks.1.mlp.act")
