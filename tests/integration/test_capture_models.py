"""Real models traced over two training steps, read back with tracecmp.load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import tracecmp
from workloads.models import MODELS, example_batch, make_model, make_optimizer, train_step

# (module, op) pairs each model's forward and backward must contain, named as named_modules() does.
EXPECTED = {
    "mlp": (
        {("fc1", "aten.addmm.default"), ("act1", "aten.relu.default"), ("act2", "aten.gelu.default")},
        {
            ("fc1", "aten.mm.default"),
            ("act1", "aten.threshold_backward.default"),
            ("act2", "aten.gelu_backward.default"),
        },
    ),
    "convnet": (
        {("conv1", "aten.convolution.default"), ("bn1", "aten.native_batch_norm.default")},
        {("conv1", "aten.convolution_backward.default"), ("bn2", "aten.native_batch_norm_backward.default")},
    ),
    "transformer": (
        {("ln1", "aten.native_layer_norm.default"), ("attn", "aten.bmm.default"), ("mlp.1", "aten.gelu.default")},
        {
            ("ln1", "aten.native_layer_norm_backward.default"),
            ("attn", "aten.bmm.default"),
            ("mlp.0", "aten.mm.default"),
        },
    ),
    "lstm": (
        {("lstm", "aten.mkldnn_rnn_layer.default"), ("head", "aten.addmm.default")},
        {("lstm", "aten.mkldnn_rnn_layer_backward.default"), ("head", "aten.mm.default")},
    ),
    "gpt2": (
        {("transformer.h.0.mlp.c_fc", "aten.addmm.default"), ("transformer.h.1.attn", "aten.bmm.default")},
        {
            ("transformer.h.0.mlp.c_fc", "aten.mm.default"),
            ("transformer.h.1.ln_1", "aten.native_layer_norm_backward.default"),
        },
    ),
}


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every model of workloads.models traced for two Adam steps (GPT-2 also with SGD below)."""
    out = {}
    for name in MODELS:
        torch.manual_seed(0)
        model, batch = make_model(name), example_batch(name)
        opt = make_optimizer(model, "sgd" if name == "convnet" else "adam")
        path = tmp_path_factory.mktemp(name) / "trace"
        with tracecmp.TraceCompare(path, model=model) as tc:
            for _ in range(2):
                train_step(model, opt, batch)
                tc.step()
        out[name] = path
    return out


@pytest.mark.parametrize("name", MODELS)
def test_two_training_steps_have_every_phase(traces: dict[str, Path], name: str) -> None:
    trace = tracecmp.load(traces[name])
    assert trace.complete
    assert trace.rank(0).manifest["steps"] == [0, 1]
    ops = trace.to_frame()
    for step in (0, 1):
        assert set(ops[ops["step"] == step]["phase"]) == {"forward", "backward", "optimizer"}
    # The optimizer updates every parameter in place, each step.
    optimizer = ops[(ops["phase"] == "optimizer") & ops["inplace"]]
    assert len(optimizer) >= len(list(make_model(name).parameters()))


@pytest.mark.parametrize("name", MODELS)
def test_module_paths_of_forward_and_backward_ops(traces: dict[str, Path], name: str) -> None:
    ops = tracecmp.load(traces[name]).to_frame()
    known = {path for path, _ in make_model(name).named_modules()}
    assert set(ops["module"]) <= known
    forward, backward = EXPECTED[name]
    for step in (0, 1):
        at = ops[ops["step"] == step]
        seen_fwd = set(zip(at[at["phase"] == "forward"]["module"], at[at["phase"] == "forward"]["op"]))
        seen_bwd = set(zip(at[at["phase"] == "backward"]["module"], at[at["phase"] == "backward"]["op"]))
        assert forward <= seen_fwd, forward - seen_fwd
        assert backward <= seen_bwd, backward - seen_bwd


@pytest.mark.parametrize("name", MODELS)
def test_backward_ops_follow_their_forward_op(traces: dict[str, Path], name: str) -> None:
    """A backward op's seq_nr names the forward op that made its autograd node: same module, same line."""
    ops = tracecmp.load(traces[name]).to_frame()
    forward = ops[(ops["phase"] == "forward") & (ops["seq_nr"] >= 0)]
    backward = ops[(ops["phase"] == "backward") & (ops["seq_nr"] >= 0)]
    assert len(backward) > 0
    pairs = backward.merge(forward, on=["step", "seq_nr"], suffixes=("", "_fwd"))
    assert len(pairs) >= 0.9 * len(backward)
    assert (pairs["module"] == pairs["module_fwd"]).all()
    assert (pairs["location"] == pairs["location_fwd"]).all()


def test_gpt2_backward_attribution_matches_the_weights(traces: dict[str, Path]) -> None:
    """Each Conv1D's backward matmuls land in that Conv1D, never in a dropout or a neighbour.

    torch's ModuleTracker files layer 0's MLP backward under layer 1's attention dropout here.
    """
    trace = tracecmp.load(traces["gpt2"])
    ops, tensors = trace.rank(0).ops, trace.rank(0).tensors
    model = make_model("gpt2")
    conv1d = {n: m for n, m in model.named_modules() if type(m).__name__ == "Conv1D"}
    assert len(conv1d) == 8
    backward = ops[ops["phase"] == "backward"]
    for name, module in conv1d.items():
        for step in (0, 1):
            mms = backward[
                (backward["module"] == name) & (backward["op"] == "aten.mm.default") & (backward["step"] == step)
            ]
            assert len(mms) == 2, (name, step)  # grad of the input and grad of the weight
            out_shapes = {tuple(tensors.set_index("tensor_id")["shape"][o[0]]) for o in mms["outputs"]}
            assert tuple(module.weight.shape) in out_shapes, name
    dropouts = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout)}
    matmuls = backward[backward["op"].isin(["aten.mm.default", "aten.bmm.default", "aten.addmm.default"])]
    assert not set(matmuls["module"]) & dropouts
    # Gradient accumulation (AccumulateGrad: no sequence number) belongs to the parameter's module.
    accumulate = backward[backward["seq_nr"] == -1]
    owners = {n.rpartition(".")[0] for n, _ in model.named_parameters()}
    assert len(accumulate) > 0 and set(accumulate["module"]) <= owners


def test_gpt2_sources_are_named(traces: dict[str, Path]) -> None:
    ops = tracecmp.load(traces["gpt2"]).to_frame()
    sources = ops[ops["kind"] == "source"]
    params = sources[sources["op"] == "source.parameter"]
    names = {n for n, _ in make_model("gpt2").named_parameters()}
    assert set(params["name"]) == names  # tied lm_head/wte weight appears once, as transformer.wte.weight
    assert (params["step"] == 0).all()  # step 1 reads the values step 0's optimizer wrote
    # Named by the forward parameter they were passed for: GPT2LMHeadModel(tokens) gives input_ids.
    assert set(sources[sources["op"] == "source.input"]["name"]) == {"input_ids"}


def test_step_selection_records_only_chosen_steps(tmp_path: Path) -> None:
    model, batch = make_model("mlp"), example_batch("mlp")
    opt = make_optimizer(model)
    with tracecmp.TraceCompare(tmp_path / "t", model=model, steps=[1, 3]) as tc:
        for _ in range(4):
            train_step(model, opt, batch)
            tc.step()
    trace = tracecmp.load(tmp_path / "t")
    ops = trace.to_frame()
    assert sorted(ops["step"].unique()) == [1, 3]
    assert trace.rank(0).manifest["steps"] == [1, 3]
    # Weights changed in the unrecorded step 2 re-enter step 3 as named sources with new statistics.
    sources = ops[(ops["op"] == "source.parameter") & (ops["step"] == 3)]
    assert set(sources["name"]) == {n for n, _ in model.named_parameters()}
    # So does the optimizer state, named after its parameter.
    state = ops[(ops["op"] == "source.tensor") & (ops["step"] == 3)]
    assert {"fc1.weight.exp_avg", "fc1.weight.exp_avg_sq", "fc3.bias.step"} <= set(state["name"])
    assert set(state["phase"]) == {"optimizer"}


def test_no_model_given_names_the_top_module_root(tmp_path: Path) -> None:
    model, batch = make_model("mlp"), example_batch("mlp")
    with tracecmp.TraceCompare(tmp_path / "t") as tc:
        model(batch[0]).sum().backward()
        tc.step()
    ops = tracecmp.load(tmp_path / "t").to_frame()
    assert {"fc1", "fc2", "fc3"} <= set(ops[ops["phase"] == "backward"]["module"])
    assert "fc1.weight" in set(ops[ops["op"] == "source.parameter"]["name"])
    assert set(ops[ops["op"] == "source.input"]["name"]) == {"x"}  # MLP.forward(self, x)


def test_custom_torch_library_ops_are_recorded(tmp_path: Path) -> None:
    """Vendor kernels (torch.ops.npu.*) arrive like this: ops registered through torch.library."""
    if hasattr(torch.library, "custom_op"):

        @torch.library.custom_op("tracecmp_test::scale", mutates_args=())
        def scale(x: torch.Tensor, factor: float) -> torch.Tensor:
            return x * factor

        @scale.register_fake
        def _(x: torch.Tensor, factor: float) -> torch.Tensor:
            return torch.empty_like(x)

        scale.register_autograd(
            lambda ctx, grad: (torch.ops.tracecmp_test.scale(grad, ctx.factor), None),
            setup_context=lambda ctx, inputs, output: setattr(ctx, "factor", inputs[1]),
        )

        @torch.library.custom_op("tracecmp_test::bump_", mutates_args=("x",))
        def bump_(x: torch.Tensor) -> None:
            x.add_(1.0)

    else:  # torch < 2.4: a Library with kernels per dispatch key, as C++ vendor libraries register
        library = torch.library.Library("tracecmp_test", "DEF")  # noqa: F841 - registered while alive
        library.define("scale(Tensor x, float factor) -> Tensor")
        library.define("bump_(Tensor(a!) x) -> ()")
        library.impl("scale", lambda x, factor: x * factor, "CPU")

        def bump_kernel(x: torch.Tensor) -> None:
            x.add_(1.0)

        library.impl("bump_", bump_kernel, "CPU")

        class Scale(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
                ctx.factor = factor
                with torch._C._AutoDispatchBelowAutograd():
                    return torch.ops.tracecmp_test.scale(x, factor)

            @staticmethod
            def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
                return torch.ops.tracecmp_test.scale(grad, ctx.factor), None

        library.impl("scale", Scale.apply, "Autograd")

    class Scaler(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.ops.tracecmp_test.scale(x, 0.5)

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)
            self.scaler = Scaler()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.scaler(self.fc(x))

    model = Scaled()
    with tracecmp.TraceCompare(tmp_path / "t", model=model):
        y = model(torch.randn(2, 4))
        y.sum().backward()
        buf = torch.zeros(3)
        torch.ops.tracecmp_test.bump_(buf)
        buf.sum()
    ops = tracecmp.load(tmp_path / "t").to_frame()
    scaled = ops[ops["op"] == "tracecmp_test.scale.default"]
    assert set(scaled["phase"]) == {"forward", "backward"}
    assert set(scaled["module"]) == {"scaler"}
    assert '"factor":0.5' in scaled.iloc[0]["args"]
    bump = ops[ops["op"] == "tracecmp_test.bump_.default"].iloc[0]
    assert bump["inplace"] and len(bump["outputs"]) == 1
    consumer = ops[ops["op"] == "aten.sum.default"].iloc[-1]
    assert list(consumer["inputs"]) == list(bump["outputs"])  # the sum reads the bumped value


def test_inference_mode_run(tmp_path: Path) -> None:
    model, batch = make_model("gpt2").eval(), example_batch("gpt2")
    with torch.inference_mode(), tracecmp.TraceCompare(tmp_path / "t", model=model) as tc:
        model(batch[0])
        x = torch.ones(3)
        x.mul_(2)  # in-place on an inference tensor: no version counter, still recorded
        x.sum()
        tc.step()
    trace = tracecmp.load(tmp_path / "t")
    ops = trace.to_frame()
    assert set(ops["phase"]) == {"forward"}
    assert len(ops[ops["kind"] == "op"]) > 40
    assert (ops["seq_nr"] == -1).all()
    mul = ops[ops["op"] == "aten.mul_.Tensor"].iloc[-1]
    assert list(ops[ops["op"] == "aten.sum.default"].iloc[-1]["inputs"]) == list(mul["outputs"])
    stats = trace.rank(0).tensors
    assert stats["has_stats"].sum() > 50


def test_no_grad_ops_are_forward_without_seq_nr(tmp_path: Path) -> None:
    model = make_model("mlp")
    with torch.no_grad(), tracecmp.TraceCompare(tmp_path / "t", model=model):
        model(example_batch("mlp")[0])
    ops = tracecmp.load(tmp_path / "t").to_frame()
    assert set(ops["phase"]) == {"forward"} and (ops["seq_nr"] == -1).all()
    assert {"fc1", "fc2", "fc3"} <= set(ops["module"])


def test_custom_autograd_function_backward_belongs_to_its_module(tmp_path: Path) -> None:
    """A Python autograd.Function's node is made before its forward runs (with grad off), so no op
    claims it; the module's post-hook finds it in the output graph."""

    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            (x,) = ctx.saved_tensors
            return grad * 2 * x

    class Inner(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = Square.apply(x)
            return y + y.argmax(dim=-1, keepdim=True)  # argmax makes no node of its own

    class Outer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)
            self.inner = Inner()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(self.fc(x)) * 3

    model = Outer()
    with tracecmp.TraceCompare(tmp_path / "t", model=model):
        model(torch.randn(2, 4)).sum().backward()
    ops = tracecmp.load(tmp_path / "t").to_frame()
    backward = ops[ops["phase"] == "backward"]
    square_grad = backward[(backward["op"] == "aten.mul.Tensor") & (backward["module"] == "inner")]
    assert len(square_grad) == 2  # grad * 2, then * x
    assert set(backward[backward["op"] == "aten.mm.default"]["module"]) == {"fc"}
    assert (ops[ops["op"] == "aten.argmax.default"]["seq_nr"] == -1).all()
