"""The judges reading capture's self-checks (``self_check``, :mod:`tracecmp.capture.selfcheck`):
on hand-built traces, an op whose own check failed is a root by its own evidence where statistics
against the bench cannot tell it from what its inputs carried; one whose check passed is cleared of
a statistics-only suspicion; ``check`` judges every checked op by it with no bench at all."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch

import tracecmp
from tests.tracebuild import TraceBuilder, twin
from tracecmp.errors import TraceFormatError
from tracecmp.graph.checks import own_checks

A = torch.ops.aten


def _gelu_after_a_diverged_weight(fault: float, residual: float | None) -> Callable:
    """A weight 1e-3 off the bench's (a root), then a gelu of it whose target output is ``fault``
    further off; ``residual``: the gelu's self-check at capture (None: not checked)."""

    def recipe(b: TraceBuilder, is_target: bool) -> None:
        gen = torch.Generator().manual_seed(0)
        value = torch.randn(512, generator=gen)
        w = b.param("fc.weight", value * (1 + 1e-3) if is_target else value)
        out = torch.nn.functional.gelu(b.value(w)) * ((1 + fault) if is_target else 1.0)
        y = b.op("aten.gelu.default", [w], out, module="act")
        if is_target and residual is not None:
            b.self_check(y, residual, 4.0, how="pointwise")

    return recipe


def _suspects(tmp_path: Path, recipe: Callable) -> list[str]:
    twin(recipe, tmp_path / "t", tmp_path / "b")
    result = tracecmp.compare(tmp_path / "t", tmp_path / "b")
    return sorted(d.op for d in result.suspects)


def test_a_failed_self_check_is_a_root_where_statistics_see_only_inherited_error(tmp_path: Path) -> None:
    # 5e-4 on top of an input 1e-3 off: statistics cannot tell it from what came in.
    assert _suspects(tmp_path / "unchecked", _gelu_after_a_diverged_weight(5e-4, None)) == ["source.parameter"]
    found = _suspects(tmp_path / "checked", _gelu_after_a_diverged_weight(5e-4, 4.2e3))
    assert found == ["aten.gelu.default", "source.parameter"]
    result = tracecmp.compare(tmp_path / "checked" / "t", tmp_path / "checked" / "b")
    gelu = result.nodes[result.nodes["op"] == "aten.gelu.default"].iloc[0]
    assert gelu["root_kind"] == "computation" and "its own check at capture failed" in gelu["reason"]


def test_a_passed_self_check_clears_a_statistics_only_suspicion(tmp_path: Path) -> None:
    # 5% on top of an input 1e-3 off is far beyond what statistics expect from the input: a root,
    # unless the op's own check found it computing what its input asks (the bench then erred).
    assert _suspects(tmp_path / "unchecked", _gelu_after_a_diverged_weight(5e-2, None)) == [
        "aten.gelu.default",
        "source.parameter",
    ]
    assert _suspects(tmp_path / "checked", _gelu_after_a_diverged_weight(5e-2, 0.3)) == ["source.parameter"]


def test_a_passed_self_check_never_overrides_the_bitwise_rule(tmp_path: Path) -> None:
    # Identical inputs, different outputs, in a run that reproduces ops bitwise: a root whatever a
    # sample of its outputs showed.
    def recipe(b: TraceBuilder, is_target: bool) -> None:
        x = b.source("input.0", torch.linspace(-2, 2, 256))
        y = b.op("aten.gelu.default", [x], torch.nn.functional.gelu(b.value(x)) * (1.01 if is_target else 1.0))
        b.op("aten.mul.Tensor", [y, y], b.value(y) * b.value(y))
        if is_target:
            b.self_check(y, 0.1, how="pointwise")

    assert _suspects(tmp_path, recipe) == ["aten.gelu.default"]


def test_check_judges_checked_ops_by_their_self_check_alone(tmp_path: Path) -> None:
    b = TraceBuilder()
    x = b.source("input.0", torch.randn(64, 32))
    w = b.param("fc.weight", torch.randn(16, 32))
    y = b.call(A.mm.default, x, b.call(A.t.default, w, module="fc"), module="fc")
    g = b.call(A.gelu.default, y, module="act")
    b.self_check(y, 0.4, 4.0)
    b.self_check(g, 850.0, 4.0, how="pointwise")
    b.write(tmp_path / "run")
    result = tracecmp.check(tmp_path / "run", data="statistics")
    assert result.first_error is not None
    assert (result.first_error.op, result.first_error.module) == ("aten.gelu.default", "act")
    rows = result.nodes.set_index("op")
    assert rows.loc["aten.mm.default", "status"] == "pass"
    assert rows.loc["aten.mm.default", "evidence"] == "self-check"
    assert "212x beyond" in rows.loc["aten.gelu.default", "reason"]
    assert any("needs a bench run" in n for n in result.notes)


def test_own_checks_takes_each_ops_worst_output() -> None:
    import pandas as pd

    frame = pd.DataFrame(
        {
            "op_id": [3, 3, 5],
            "index": [0, 1, 0],
            "residual": [9.0, float("nan"), 1.0],
            "limit": [4.0, 4.0, 8.0],
            "coarse": [9.0, float("nan"), 1.0],
            "sampled": [16, 16, 4],
            "how": ["rows"] * 3,
        }
    )
    found = own_checks(frame, {3: "aten.mm.default", 5: "aten.gelu.default"})
    assert found[3].index == 0 and found[3].failed
    assert found[5].passed and not found[5].failed
    assert own_checks(None, {}) == {}


def test_a_trace_whose_checks_name_ops_it_does_not_hold_is_refused(tmp_path: Path) -> None:
    b = TraceBuilder()
    x = b.source("input.0", torch.ones(4))
    y = b.op("aten.relu.default", [x], torch.ones(4))
    b.self_check(y, 0.0)
    b.checks[0]["op_id"] = 99  # type: ignore[index]
    b.write(tmp_path / "run")
    with pytest.raises(TraceFormatError, match="self-checks name ops"):
        tracecmp.load(tmp_path / "run").rank(0)


def test_a_rounding_model_counts_only_where_it_reproduces_the_ops_calls() -> None:
    import pandas as pd

    def frame(residuals: list[float]) -> pd.DataFrame:
        n = len(residuals)
        return pd.DataFrame(
            {
                "op_id": list(range(n)),
                "index": [0] * n,
                "residual": residuals,
                "limit": [5.0] * n,
                "coarse": [0.5] * n,  # all within TF32's whole allowance
                "sampled": [16] * n,
                "how": ["matmul"] * n,
            }
        )

    names = {i: "aten.mm.default" for i in range(8)}
    # Three calls the model reproduces and one it does not: that one is a fault.
    found = own_checks(frame([1.0, 2.0, 1.5, 80.0]), names)
    assert [found[i].failed for i in range(4)] == [False, False, False, True]
    # Most calls outside the model: it is not this device's rounding; the whole allowance holds.
    found = own_checks(frame([40.0, 60.0, 1.0, 80.0]), names)
    assert not any(found[i].failed for i in range(4))
    # Too few calls to learn from, on an op and in the rank.
    assert not own_checks(frame([1.0, 80.0]), names)[1].failed
    # An op called twice goes by the rank's other modelled calls, which the model reproduces.
    names = {
        0: "aten.convolution.default",
        1: "aten.convolution.default",
        **{i: "aten.mm.default" for i in range(2, 8)},
    }
    found = own_checks(frame([1.0, 80.0, 1.0, 2.0, 1.0, 1.0, 0.5, 1.0]), names)
    assert [found[i].failed for i in range(8)] == [False, True] + [False] * 6
