"""The C per-op path (``tracecmp._crecord``) records exactly what the Python reference records.

Each program runs twice in a fresh interpreter, once per path, and every op row and tensor row
of the capture must be equal: ids, names, modules, source lines, argument text, statistics.
A fresh interpreter each time because autograd sequence numbers come from a process-wide
counter. The programs cover what the C path does itself (single new tensors, views, in-place
writes, several new outputs, backward and gradient accumulation, ``.item()``) and what it hands
to the reference (new sources, alias updates, undeclared writes, inference tensors, saved data,
argument rewrites, full stacks).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.conftest import ROOT
from tracecmp.capture import mode as capture_mode
from tracecmp.capture import native
from workloads.models import MODELS

pytestmark = pytest.mark.skipif(capture_mode._crecord is None, reason="tracecmp._crecord is not built")

_PROGRAM = textwrap.dedent(
    """
    import ast
    import sys
    import tempfile
    import torch
    import tracecmp
    from tracecmp.capture import mode as capture_mode
    from workloads.models import example_batch, make_model, make_optimizer, train_step

    capture_mode.USE_NATIVE = sys.argv[1] == "native"
    torch.manual_seed(0)
    torch.set_num_threads(1)

    def edges():
        w = torch.randn(4, 4, requires_grad=True)
        x = torch.randn(3, 4)
        base = torch.zeros(3, 4)
        view = base[:, :2]
        view.add_(1.0)                      # a write through a view: alias.update on base
        y = (x @ w + base).relu()
        base[1] = 7.0                       # a write through a view the caller drops at once
        base.mul(2)                         # reads it: alias.update on base, not a new source
        y.sum().backward()
        behind = torch.ones(2)
        with torch.no_grad():
            z = behind * 2
        behind.data.mul_(3)                 # written where capture cannot see it: a new source
        torch.cat([z, behind]).sum()
        with torch.inference_mode():
            inf = torch.ones(3) + 1
            inf.mul_(2)
        torch.empty(5)                      # uninitialized memory: no statistics
        a, b = torch.randn(4, 6).chunk(2)   # several views
        torch.stack([a, b]).max(dim=0)      # several new outputs
        torch.randn(3).sum().item()

    def recipes():
        # Checks the C path gathers itself (capture/selfcheck.py, Recipe): broadcasting, 0-d and
        # integer scalars, floats, masks, 16-bit and strided inputs, in-place ops, copies, casts, constants,
        # matmuls, reductions, softmax, layer norm and its input gradient, gradients placed into zeros,
        # convolutions, batch norms and their gradients, losses and theirs, fused attention.
        x, b = torch.randn(6, 5), torch.randn(5)
        for i in range(3):  # a signature's first two calls teach its recipe
            x.clone().add_(b, alpha=-0.1 * (i + 1))  # a step size: gathered with each call
            y = x * b + 1.5
            y.t().mul_(torch.tensor(2.0))
            z = torch.where(y > 0, y, torch.zeros(()))
            h = x.to(torch.bfloat16).exp().to(torch.float16)
            w = torch.ops.aten._unsafe_view(x.t().contiguous(), [30])
            u = torch.empty(6, 5).copy_(b)
            s = torch.tensor(3.0)
            s += 1
            torch.ones_like(y), torch.full_like(h, 0.1), torch.zeros_like(x, dtype=torch.bfloat16)  # constants
            torch.addmm(b, x.t() @ x, torch.randn(5, 5).t())  # matmuls: blocks of rows and columns
            torch.bmm(torch.randn(4, 6, 7), torch.randn(4, 5, 7).mT), torch.bmm(torch.randn(3, 2, 9).bfloat16(), torch.randn(3, 9, 4).bfloat16())
            # Rows: sums and means over any dimensions, softmax along any, read in blocks
            t = torch.randn(4, 3, 6).transpose(0, 2)
            t.sum([0, 2]), t.mean(1, keepdim=True), h.sum(-1), t.sum(dtype=torch.float64)
            torch.randn(4, 0, 3).sum(1), torch.ones(0, 5).softmax(1)  # empty rows: nothing to read
            p = torch.softmax(t, 1)
            torch.log_softmax(t, 0), torch.ops.aten._softmax_backward_data(t, p, 1, torch.float32)
            _, mean, rstd = torch.ops.aten.native_layer_norm(t, [3, 4], None, None, 1e-5 * (i + 1))  # eps: signed
            torch.ops.aten.native_layer_norm_backward(p, t, [3, 4], mean, rstd, None, None, [True, False, False])
            _, mean, rstd = torch.ops.aten.native_layer_norm(t, [4], b[:4], b[1:], 1e-5)
            torch.ops.aten.native_layer_norm_backward(p, t, [4], mean, rstd, b[:4], b[1:], [True, True, True])
            torch.ops.aten.select_backward(t[:, 1], [6, 3, 4], 1, -2), torch.ops.aten.slice_backward(t, [6, 9, 4], 1, 1, 8, 3)
            # Convolutions: sampled elements with the terms each sums, padding read as nothing
            c, k = torch.randn(2, 4, 9, 8).transpose(2, 3), torch.randn(6, 2, 3, 3)
            o = torch.convolution(c, k, torch.randn(6), [2, 1], [1, 2], [1, 2], False, [0, 0], 2)
            torch.ops.aten.convolution_backward(torch.randn_like(o), c, k, [6], [2, 1], [1, 2], [1, 2], False, [0, 0], 2, [True, True, True])
            torch.ops.aten.convolution_backward(torch.randn_like(o), c, k, None, [2, 1], [1, 2], [1, 2], False, [0, 0], 2, [False, True, False])
            c16, k16 = torch.randn(3, 4, 20, dtype=torch.bfloat16), torch.randn(5, 4, 3, dtype=torch.bfloat16)
            o16 = torch.convolution(c16, k16, None, [1], [1], [1], False, [0], 1)
            torch.ops.aten.convolution_backward(torch.ones_like(o16), c16, k16, None, [1], [1], [1], False, [0], 1, [True, True, False])
            # Losses: every row's input at its target (ignored rows: 0), the backward at drawn rows' targets
            lp, labels = torch.log_softmax(torch.randn(9, 7), 1).t().contiguous().t(), torch.tensor([1, 6, -100, 0, 3, 3, 2, 5, 4])
            cw = torch.rand(7) + 0.5
            loss, total = torch.ops.aten.nll_loss_forward(lp, labels, None, 1, -100)
            torch.ops.aten.nll_loss_forward(lp, labels, cw, 2, -100), torch.ops.aten.nll_loss_forward(lp[0], labels[1], cw, 1, -100)
            rows, _ = torch.ops.aten.nll_loss_forward(lp, labels, cw, 0, -100)
            torch.ops.aten.nll_loss_backward(torch.tensor(0.7), lp, labels, None, 1, -100, total)
            torch.ops.aten.nll_loss_backward(torch.randn(9), lp, labels, cw, 0, -100, total)
            # Fused attention (torch 2.2 on): a block of query rows of one head, with its keys and values whole
            if hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
                aq, ak, av = torch.randn(2, 9, 3, 8).transpose(1, 2), torch.randn(2, 3, 9, 8), torch.randn(2, 3, 9, 8)
                flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
                flash(aq, ak, av), flash(aq, ak, av, is_causal=True), flash(aq, ak, av, attn_mask=torch.randn(9, 9), scale=0.3)
                flash(aq.bfloat16(), ak.bfloat16(), av.bfloat16(), attn_mask=torch.randn(2, 1, 9, 9).bfloat16())
            # Batch norms: adjacent channels whole, per-channel tensors at them, saved statistics as extras
            rm, rv, g6 = torch.zeros(6), torch.ones(6), torch.randn(6)
            _, sm, si = torch.ops.aten.native_batch_norm(o, g6, g6.neg(), rm, rv, True, 0.1, 1e-5)
            torch.ops.aten.native_batch_norm(o.to(torch.bfloat16), None, None, rm, rv, False, 0.1, 1e-5)
            torch.ops.aten.native_batch_norm_backward(o.flip(0), o, g6, rm, rv, sm, si, True, 1e-5, [True, False, True])
            torch.ops.aten.native_batch_norm_backward(o, o, None, rm, rv, None, None, False, 1e-5, [True, True, True])
            (torch.sigmoid(h.float()) + z - u).sum() + w.sum() + s

    programs = {"edges": edges, "recipes": recipes}
    for program, options in ast.literal_eval(sys.argv[2]):
        print("case", program, options)
        model = None if program in programs else make_model(program)
        # Everything stays in the mode's buffers (no hand-over to the writer) to be printed.
        with tracecmp.TraceCompare(tempfile.mkdtemp() + "/run", model=model, flush_secs=3600, **options) as tc:
            if model is None:
                for _ in range(2):
                    programs[program]()
                    tc.step()
            else:
                opt = make_optimizer(model)
                batch = example_batch(program)
                for _ in range(2):
                    train_step(model, opt, batch)
                    tc.step()
            mode = tc._mode
            print("native" if "__torch_dispatch__" in mode.__dict__ else "reference")
            checks = []
            if mode.check_rows is not None:  # self-checks: their deferred residuals filled in first
                mode._gather_deferred_checks()
                checks = list(mode.check_rows)
            for row in [*mode.rows, *mode.tensor_rows, *checks]:
                print(repr(row))
    """
)


CASES = [(name, {}) for name in MODELS] + [
    ("edges", {}),
    ("edges", {"data": "tensors"}),
    ("edges", {"stack": True}),
    ("transformer", {"dropout": 0.0, "rng": "host"}),
    # Self-checks: the C path gathers the calls with a recipe itself and calls the reference's
    # checker for the others.
    ("edges", {"self_check": "sample"}),
    ("recipes", {"self_check": "sample"}),
    ("transformer", {"self_check": "sample"}),
    ("convnet", {"self_check": "sample"}),
]


def _capture(path: str) -> dict[str, list[str]]:
    """Every case's printed rows, captured by ``path`` ("native" or "reference") in one interpreter.

    The cases run one after another in the same order on both paths, so autograd's sequence
    numbers stay in step between them.
    """
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRACECMP_FORCE_REFERENCE="0")
    result = subprocess.run(
        [sys.executable, "-c", _PROGRAM, path, repr(CASES)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    cases: dict[str, list[str]] = {}
    lines: list[str] = []
    for line in result.stdout.splitlines():
        if line.startswith("case "):
            lines = cases.setdefault(line, [])
        else:
            lines.append(line)
    return cases


@pytest.fixture(scope="module")
def captures() -> dict[str, dict[str, list[str]]]:
    return {path: _capture(path) for path in ("native", "reference")}


@pytest.mark.parametrize(("program", "options"), CASES, ids=[f"{p}-{o}" for p, o in CASES])
def test_native_path_records_what_the_reference_records(
    captures: dict[str, dict[str, list[str]]], program: str, options: dict[str, object]
) -> None:
    case = f"case {program} {options}"
    native, reference = captures["native"][case], captures["reference"][case]
    assert native[0] == "native" and reference[0] == "reference"
    assert len(native) == len(reference) > 10
    for mine, theirs in zip(native[1:], reference[1:]):
        assert mine == theirs


def test_native_path_is_bound_to_new_modes(tmp_path: object) -> None:
    import tracecmp

    with tracecmp.TraceCompare(str(tmp_path) + "/run") as tc:
        assert tc._mode is not None
        bound = tc._mode.__dict__.get("__torch_dispatch__")
        assert bound is not None and bound.__func__ is capture_mode._crecord.dispatch
        torch.ones(2) * 2
        assert [row[4] for row in tc._mode.rows] == ["aten.ones.default", "aten.mul.Tensor"]
        assert len(tc._mode.tensor_rows) == 2


def test_forget_drops_only_its_own_record() -> None:
    forget = capture_mode._crecord.forget

    class Rec:
        def __init__(self, key: int) -> None:
            self.key = key

    first, second = Rec(1), Rec(1)
    known = {1: second}
    forget(known, first)  # a dead tensor whose id() was reused: the new record stays
    assert known == {1: second}
    forget(known, second)
    assert known == {}
    with pytest.raises(TypeError):
        forget([], second)


def test_reference_is_forced_by_the_environment() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRACECMP_FORCE_REFERENCE="1")
    code = "from tracecmp.capture import mode; print(mode.USE_NATIVE)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.stdout.strip() == "False", result.stderr


def test_ci_requires_the_native_path() -> None:
    if os.environ.get("TRACECMP_REQUIRE_NATIVE") != "1":
        pytest.skip("TRACECMP_REQUIRE_NATIVE=1 not set")
    assert capture_mode._crecord is not None


def test_a_torch_without_a_helper_falls_back_to_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch._ops, "OpOverload", None)  # configure() requires a type
    try:
        assert capture_mode._load_native() is None
        assert "cannot run with this torch" in (native.error("_crecord") or "")
    finally:
        monkeypatch.undo()
        assert capture_mode._load_native() is not None  # configured again with the real helpers
        assert native.error("_crecord") is None


def test_passthrough_redispatches_without_recording() -> None:
    import types

    from torch.utils._python_dispatch import TorchDispatchMode

    class PassThrough(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.__torch_dispatch__ = types.MethodType(capture_mode._crecord.passthrough, self)

    torch.manual_seed(0)
    layer, x = torch.nn.Linear(3, 4), torch.randn(2, 3)
    expected = torch.nn.functional.gelu(layer(x)).sum()
    expected.backward()
    grad, layer.weight.grad = layer.weight.grad, None
    with PassThrough():
        out = torch.nn.functional.gelu(layer(x)).sum()
        out.backward()
    assert torch.equal(out, expected) and torch.equal(layer.weight.grad, grad)
    with pytest.raises(TypeError):
        capture_mode._crecord.passthrough(None, torch.ops.aten.add.Tensor)


def test_native_path_leaves_the_buffers_aligned_when_a_row_cannot_be_stored(tmp_path: object) -> None:
    import tracecmp

    with tracecmp.TraceCompare(str(tmp_path) + "/run") as tc:
        mode = tc._mode
        assert mode is not None and mode.__dict__.get("__torch_dispatch__") is not None
        torch.ones(2) * 2
        rows = len(mode.rows)
        step, mode.step = mode.step, "not a step"  # the op row's second field cannot be stored
        try:
            with pytest.raises(TypeError):
                torch.ones(2) + 1
        finally:
            mode.step = step
        assert len(mode.rows) == rows  # the failed op (torch.ones) left no part of its row behind
        assert mode.rows.table().num_rows == rows
        torch.ones(2) - 1
        assert [row[4] for row in mode.rows][-1] == "aten.sub.Tensor"
