"""Tracing a step of a ``torch.compile``d model never switches its compilation off.

A dispatch mode that does not ignore compile internals makes Dynamo skip every frame while it is
active, and a module first called then stays uncompiled afterwards; hooks that Dynamo traces
make a variant of the compiled code that is compiled again once they are gone. Each run here
counts what the backend compiled and how often compiled code ran, per step, and keeps every
loss, gradient and parameter: a traced run must match a run that was never traced, bitwise.
"""

from __future__ import annotations

import contextlib
import importlib.util
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import tracecmp
from tracecmp._compat import TORCH_VERSION
from workloads.compile_models import CountingBackend, TinyGPT, tiny_batch

# torch < 2.2 guards compiled code on the global module hooks and has no compile callbacks that
# could hide capture's hooks from it: inside a session each graph compiles again (once per set of
# hooks installed); after the session the code compiled before runs again, and nothing compiles.
HOOKS_GUARDED = TORCH_VERSION < (2, 2)

STEPS = 4


def needs_inductor(backend: str) -> None:
    """Skip where torch's inductor cannot run: torch 2.1's imports ``pkg_resources`` (setuptools)."""
    if backend == "inductor" and importlib.util.find_spec("pkg_resources") is None and TORCH_VERSION < (2, 2):
        pytest.skip("torch 2.1's inductor imports pkg_resources, and setuptools is not installed here")


def _run(
    backend: CountingBackend, trace: Path | None = None, traced_steps: tuple[int, ...] = (0,), fullgraph: bool = True
) -> dict[str, Any]:
    """``STEPS`` training steps of a compiled TinyGPT from a fixed seed; the first two in a session."""
    torch.manual_seed(7)
    model = TinyGPT(layers=1)
    compiled = torch.compile(model, backend=backend, fullgraph=fullgraph)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = tiny_batch()
    seen: dict[str, Any] = {"compiles": [], "runs": []}

    def step(index: int) -> None:
        before = backend.compiles, backend.runs
        loss = compiled(*batch)
        loss.backward()
        seen[f"loss{index}"] = loss.detach().clone()
        for name, param in model.named_parameters():
            seen[f"grad{index}.{name}"] = param.grad.clone()
        opt.step()
        opt.zero_grad(set_to_none=True)
        seen["compiles"].append(backend.compiles - before[0])
        seen["runs"].append(backend.runs - before[1])

    if trace is None:
        for i in range(STEPS):
            step(i)
    else:
        with tracecmp.TraceCompare(trace, model=model, steps=traced_steps) as tc:
            for i in range(2):
                step(i)
                tc.step()
        for i in range(2, STEPS):
            step(i)
    for name, param in model.named_parameters():
        seen[f"param.{name}"] = param.detach().clone()
    return seen


def _same(plain: dict[str, Any], traced: dict[str, Any]) -> list[str]:
    keys = [k for k in plain if k not in ("compiles", "runs")]
    assert traced.keys() == plain.keys()
    return [k for k in keys if not torch.equal(plain[k], traced[k])]


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_traced_compiled_steps_stay_compiled_and_bitwise_equal(tmp_path: Path, inner: str) -> None:
    needs_inductor(inner)
    torch._dynamo.reset()
    backend = CountingBackend(inner)
    plain = _run(backend)
    assert plain["compiles"][0] >= 1 and sum(plain["compiles"][1:]) == 0
    assert all(runs >= 1 for runs in plain["runs"])

    # Compiled before the session (the code above is reused), step 1 traced.
    # (torch < 2.2 records no regions at all: nothing to warn about.)
    with contextlib.nullcontext() if HOOKS_GUARDED else pytest.warns(UserWarning, match="before tracing began"):
        before = _run(backend, tmp_path / "before", traced_steps=(1,))
    assert before["compiles"][2:] == [0, 0]
    assert before["compiles"][:2] == (
        [min(c, plain["compiles"][0]) for c in before["compiles"][:2]] if HOOKS_GUARDED else [0, 0]
    )
    assert before["runs"] == plain["runs"]
    assert _same(plain, before) == []
    notes = tracecmp.load(tmp_path / "before").rank(0).manifest["info"]["compiled_notes"]
    assert (
        "without regions" if HOOKS_GUARDED else "graph(s) were compiled in this process before tracing began"
    ) in notes[0]

    # Compiled inside the traced step: the same code, and it keeps running after the session.
    torch._dynamo.reset()
    fresh_backend = CountingBackend(inner)
    fresh = _run(fresh_backend, tmp_path / "fresh", traced_steps=(0,))
    assert fresh["compiles"][2:] == plain["compiles"][2:] == [0, 0]
    assert HOOKS_GUARDED or fresh["compiles"][:2] == plain["compiles"][:2]
    assert fresh["runs"] == plain["runs"]
    assert _same(plain, fresh) == []
    assert tracecmp.load(tmp_path / "fresh").complete


def test_graph_breaks_compile_as_without_tracing(tmp_path: Path) -> None:
    """A model with a graph break: the same graphs, run as often, with the same numbers."""

    def run(trace: Path | None) -> tuple[CountingBackend, dict[str, Any]]:
        torch._dynamo.reset()
        backend = CountingBackend("aot_eager")
        torch.manual_seed(3)
        model = TinyGPT(layers=2, graph_break=True)
        compiled = torch.compile(model, backend=backend)
        batch = tiny_batch()
        out: dict[str, Any] = {}
        session = tracecmp.TraceCompare(trace, model=model) if trace else None
        if session is not None:
            session.__enter__()
        loss = compiled(*batch)
        loss.backward()
        if session is not None:
            session.__exit__(None, None, None)
        for _ in range(2):
            loss2 = compiled(*batch)
            loss2.backward()
        out["loss"] = loss.detach()
        out.update({n: p.grad.clone() for n, p in model.named_parameters()})
        return backend, out

    plain_backend, plain = run(None)
    traced_backend, traced = run(tmp_path / "t")
    assert plain_backend.compiles >= 2  # the graph break makes two graphs at least
    assert (traced_backend.compiles, traced_backend.runs) == (plain_backend.compiles, plain_backend.runs)
    assert [k for k in plain if not torch.equal(plain[k], traced[k])] == []


@pytest.mark.skipif(HOOKS_GUARDED, reason="torch < 2.2 records no regions: nothing is noted as compiled before")
def test_graphs_compiled_before_a_reset_are_not_noted(tmp_path: Path) -> None:
    """``torch._dynamo.reset()`` drops every compiled graph: a session after it finds none compiled."""
    torch._dynamo.reset()
    model = TinyGPT(layers=1)
    compiled = torch.compile(model, backend=CountingBackend("aot_eager"))
    compiled(*tiny_batch()).backward()
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*before tracing began")
        with tracecmp.TraceCompare(tmp_path / "t", model=model):
            compiled(*tiny_batch()).backward()
    notes = tracecmp.load(tmp_path / "t").rank(0).manifest["info"].get("compiled_notes", [])
    assert not any("before tracing began" in note for note in notes)
