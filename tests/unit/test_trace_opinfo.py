"""What capture reads from op schemas, and how it spells arguments (no live mode)."""

from __future__ import annotations

import json

import pytest
import torch

from tracecmp.aten.schema import FRESH, VIEW, WRITE, op_info
from tracecmp.trace.args import ArgsEncoder, scan

aten = torch.ops.aten


@pytest.mark.parametrize(
    "func,kind,returns,extra,inplace",
    [
        (aten.mm.default, "op", ((FRESH, None),), (), False),
        (aten.add_.Tensor, "op", ((WRITE, (0, "self")),), (), True),
        (aten.add.out, "op", ((WRITE, (-1, "out")),), (), True),
        (aten.t.default, "view", ((VIEW, (0, "self")),), (), False),
        (aten.split.Tensor, "view", ((VIEW, (0, "self")),), (), False),
        (aten._foreach_add_.List, "op", (), ((0, "self"),), True),
        (
            aten._native_batch_norm_legit.default,
            "op",
            ((FRESH, None),) * 3,
            ((3, "running_mean"), (4, "running_var")),
            True,
        ),
    ],
)
def test_schema_alias_info(func: object, kind: str, returns: tuple, extra: tuple, inplace: bool) -> None:
    info = op_info(func)
    assert (info.kind, info.returns, info.extra_writes, info.inplace) == (kind, returns, extra, inplace)
    assert info.name == str(func)


def test_random_uninitialized_and_skipped_ops() -> None:
    assert op_info(aten.bernoulli_.float).random and op_info(aten.randn.default).random
    assert not op_info(aten.mm.default).random
    assert op_info(aten.empty_like.default).uninitialized and op_info(aten.new_empty.default).uninitialized
    assert not op_info(aten.zeros_like.default).uninitialized
    assert not op_info(torch.ops.profiler._record_function_enter_new.default).record


def test_scan_finds_tensors_in_order_and_keys_ignore_their_values() -> None:
    a, b, c = torch.ones(1), torch.zeros(2), torch.ones(3)
    found: list[torch.Tensor] = []
    key = scan((a, [b, c], 2.0), {"alpha": 1}, found)
    assert [t is x for t, x in zip(found, (a, b, c))] == [True, True, True]
    other: list[torch.Tensor] = []
    assert scan((c, [a, b], 2.0), {"alpha": 1}, other) == key  # same call shape, other tensors
    assert scan((a, [b, c], 2), {"alpha": 1}, []) != key  # 2 and 2.0 are different arguments
    assert scan((a, [b, c], True), {"alpha": 1}, []) != scan((a, [b, c], 1), {"alpha": 1}, [])


def test_arguments_json() -> None:
    encoder = ArgsEncoder()
    info = op_info(aten.clamp.default)
    x = torch.ones(2)
    args, kwargs = (x, float("-inf"), float("nan")), {}
    text = encoder.encode(info, scan(args, kwargs, []), args, kwargs)
    assert json.loads(text) == {"self": {"tensor": 0}, "min": "-inf", "max": "nan"}
    info = op_info(aten._to_copy.default)
    kwargs = {"dtype": torch.bfloat16, "layout": torch.strided, "device": torch.device("cpu"),
              "memory_format": torch.channels_last}  # fmt: skip
    text = encoder.encode(info, scan((x,), kwargs, []), (x,), kwargs)
    assert json.loads(text) == {
        "self": {"tensor": 0},
        "dtype": "bfloat16",
        "layout": "strided",
        "device": "cpu",
        "memory_format": "channels_last",
    }
    info = op_info(aten.add.Tensor)
    for value in (0.1, 1e-300, 123456789.123456789):  # floats round-trip exactly
        args = (x, value)
        assert json.loads(encoder.encode(info, scan(args, {}, []), args, {}))["other"] == value
    info = op_info(aten.cat.default)
    args = ([x, x, x], 0)
    assert json.loads(encoder.encode(info, scan(args, {}, []), args, {})) == {
        "tensors": [{"tensor": 0}, {"tensor": 1}, {"tensor": 2}],
        "dim": 0,
    }


def test_memoized_text_matches_a_fresh_encoding() -> None:
    encoder = ArgsEncoder()
    info = op_info(aten.add.Tensor)
    x = torch.ones(2)
    first = encoder.encode(info, scan((x, 2.5), {}, []), (x, 2.5), {})
    again = encoder.encode(info, scan((x, 2.5), {}, []), (x, 2.5), {})
    assert first == again == ArgsEncoder().encode(info, scan((x, 2.5), {}, []), (x, 2.5), {})
    assert encoder.encode(info, scan((x, 3.5), {}, []), (x, 3.5), {}) != first


def test_resolve_finds_inductors_prims_in_a_fresh_interpreter() -> None:
    # A graph inductor compiled names prims.fma (its softmax backward); torch defines it only once
    # inductor is imported, which a process that only compares never does by itself.
    import subprocess
    import sys

    from torch._inductor import inductor_prims

    # fma came with a later torch than inductor's random seed prim.
    name = "prims.fma.default" if hasattr(inductor_prims, "fma") else "prims.inductor_seed.default"
    code = (
        "import sys, torch; from tracecmp.aten.schema import resolve; "
        "assert 'torch._inductor' not in sys.modules; "
        f"assert resolve({name!r}) is not None; assert resolve('prims.no_such_op.default') is None"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
