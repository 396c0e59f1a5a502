"""Every tensor subclass and layout users meet gives a clean capture or a clear skip, never a crash.

The statistics kernel reads memory at ``data_ptr()``; a DTensor's (FSDP2's parameters), a
FakeTensor's or a functional tensor's is 0, and handing it over killed the process. Each kind
runs in a fresh interpreter per path (native kernel and C per-op path, or the torch reference),
so a crash fails this test instead of the test run.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from typing import Any

import pytest
import torch

from tests.conftest import ROOT
from tracecmp._compat import TORCH_VERSION
from tracecmp.capture import mode as capture_mode
from tracecmp.capture import stats as capture_stats
from tracecmp.capture.tensorkinds import TRACED_OP

_NATIVE_BUILT = capture_mode._crecord is not None and capture_stats.native_available()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module", params=["native", "reference"])
def facts(request: pytest.FixtureRequest) -> dict[str, dict[str, Any]]:
    path = request.param
    if path == "native" and not _NATIVE_BUILT:
        if os.environ.get("TRACECMP_REQUIRE_NATIVE") == "1":
            pytest.fail("TRACECMP_REQUIRE_NATIVE=1 but the native extensions are not built")
        pytest.skip("the native extensions are not built")
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRACECMP_FORCE_REFERENCE="0" if path == "native" else "1")
    result = subprocess.run(
        [sys.executable, "-m", "tests.integration.tensor_kinds_program", path, str(_free_port())],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, f"the capture crashed (exit {result.returncode}):\n{result.stderr[-3000:]}"
    cases = {}
    for line in result.stdout.splitlines():
        if line.startswith("{"):
            case = json.loads(line)
            assert "error" not in case, case.get("error")
            cases[case["case"]] = case
    return cases


def _case(facts: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    case = facts[name]
    if "unavailable" in case:  # torch itself cannot run the case untraced (an older torch)
        pytest.skip(f"torch {torch.__version__} cannot run the {name} case: {case['unavailable']}")
    return case


def _recorded(case: dict[str, Any], name: str) -> bool:
    """Whether a tensor row of the trace holds the statistics of the case's tensor ``name``."""
    want = case["expected"][name]

    def same(a: float, b: float) -> bool:
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12)

    return any(all(same(a, b) for a, b in zip(row[:4], want[:4])) and row[4:] == want[4:] for row in case["stats"])


def _mentions(case: dict[str, Any], word: str) -> bool:
    return any(word in reason for reason in case["skipped"])


@pytest.mark.parametrize(
    "name", ["dtensor", "fsdp2", "fake", "functional", "nested", "sparse", "meta", "subclasses", "other_layouts"]
)
def test_capture_runs_to_the_end_and_changes_nothing(facts: dict[str, dict[str, Any]], name: str) -> None:
    case = _case(facts, name)
    assert case["complete"]
    assert case["equal"], "the captured run computed other values than the plain one"


def test_dtensor_ops_are_recorded_on_their_local_shards(facts: dict[str, dict[str, Any]]) -> None:
    case = _case(facts, "dtensor")
    assert "aten.mm.default" in case["ops"] and "aten.relu.default" in case["ops"]
    assert _recorded(case, "result")
    assert not _mentions(case, "DTensor"), case["skipped"]


def test_fsdp2_training_records_every_phase_and_the_updated_shards(facts: dict[str, dict[str, Any]]) -> None:
    case = _case(facts, "fsdp2")
    assert case["phases"] == ["backward", "forward", "optimizer"]
    for name in case["expected"]:
        assert _recorded(case, name), name
    assert not _mentions(case, "DTensor"), case["skipped"]


def test_fake_tensor_ops_pass_through_unrecorded(facts: dict[str, dict[str, Any]]) -> None:
    case = _case(facts, "fake")
    assert case["ops"] == ["aten.randn.default", "aten.exp.default"]
    # torch >= 2.2 runs FakeTensorMode below capture's mode, which counts the ops it lets pass
    # (ones, mul, sum); torch 2.1 runs it above capture's, so they never reach capture at all.
    assert case["skipped"] == ({TRACED_OP: 3} if TORCH_VERSION >= (2, 2) else {})


def test_functionalized_code_is_recorded(facts: dict[str, dict[str, Any]]) -> None:
    case = _case(facts, "functional")
    assert {"aten.clone.default", "aten.add.Tensor", "aten.mul.Tensor"} <= set(case["ops"])
    assert _recorded(case, "result")


def test_nested_tensors_skip_with_a_reason_and_jagged_ones_record_their_values(
    facts: dict[str, dict[str, Any]],
) -> None:
    case = _case(facts, "nested")
    assert _mentions(case, "nested tensor: no single shape")
    assert _recorded(case, "jagged_values")


def test_sparse_tensors_skip_with_a_reason_and_dense_results_have_statistics(facts: dict[str, dict[str, Any]]) -> None:
    case = _case(facts, "sparse")
    assert _mentions(case, "sparse_coo layout")
    assert _recorded(case, "product")


def test_meta_tensors_are_recorded_without_values(facts: dict[str, dict[str, Any]]) -> None:
    case = _case(facts, "meta")
    assert "aten.mm.default" in case["ops"] and "meta" in case["devices"]


def test_other_subclasses_unwrap_and_plain_subclasses_have_statistics(facts: dict[str, dict[str, Any]]) -> None:
    case = _case(facts, "subclasses")
    assert _recorded(case, "two_a")  # TwoTensor's inner ops reach the mode
    assert _recorded(case, "tagged")  # as_subclass keeps storage: the reference reads it


def test_quantized_and_mkldnn_tensors_skip_with_a_reason(facts: dict[str, dict[str, Any]]) -> None:
    case = _case(facts, "other_layouts")
    assert _mentions(case, "quantized tensor") and _mentions(case, "_mkldnn layout")
