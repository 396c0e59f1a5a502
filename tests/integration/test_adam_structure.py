"""torch.optim's Adam and AdamW, as capture records them, are what comparison/adam.py recognizes,
and the bound it draws from their arithmetic holds for the steps they take.

The recognition reads the recorded graph (lerp_, mul_, addcmul_, sqrt, div, add_, addcdiv_), so
it depends on how this torch's optimizers are written: this test runs on every torch CI covers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tracecmp
from tracecmp.aten.opclass import base_name
from tracecmp.comparison import adam
from tracecmp.graph import Node, view_bases
from tracecmp.trace.reader import load

LR, DECAY, STEPS = 1e-2, 0.1, 3


@pytest.mark.parametrize("implementation", ["single", "foreach", "fused"])
@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_every_adam_update_is_recognized_and_bounded(tmp_path: Path, name: str, implementation: str) -> None:
    if implementation == "fused" and not hasattr(torch.ops.aten, f"_fused_{name.lower()}_"):
        pytest.skip(f"this torch has no fused {name}")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(32, 8), torch.nn.Linear(8, 4))
    kind = {"foreach": implementation == "foreach"} if implementation != "fused" else {"fused": True}
    try:
        optimizer = getattr(torch.optim, name)(model.parameters(), lr=LR, weight_decay=DECAY, **kind)
    except RuntimeError as exc:  # an older torch's fused kernels run on CUDA only
        pytest.skip(str(exc))
    params = list(model.parameters())
    moved = []  # per step: the largest change of any parameter element the update made
    with tracecmp.TraceCompare(tmp_path / "t", model=model) as tc:
        for step in range(STEPS):
            ids = torch.randint(0, 16, (6,))  # rows 16-31 never get a gradient
            model(ids).pow(2).sum().backward()
            if step == 1:
                params[1].grad[:, :2] = 0.0  # a zero gradient after non-zero ones
            before = [p.detach().clone() * (1 - LR * DECAY if name == "AdamW" else 1.0) for p in params]
            optimizer.step()
            optimizer.zero_grad()
            moved.append(max(float((p.detach() - b).abs().max()) for p, b in zip(params, before)))
            tc.step()

    rank = load(tmp_path / "t").rank(0)
    ops, base = rank.ops, view_bases(rank.tensors)
    columns = ["op_id", "step", "phase", "kind", "op", "name", "module", "location", "args", "inputs", "outputs"]
    nodes = [Node(*row[:9], list(row[9]), list(row[10]), False, "") for row in ops[columns].itertuples(index=False)]
    producer = {t: (n, k) for n in nodes for k, t in enumerate(n.outputs) if t not in base}
    tensors = rank.tensors.set_index("tensor_id")

    def value_of(tid: int) -> float:
        return float(tensors.loc[base.get(tid, tid), "mean"])

    bounds: dict[int, set[float]] = {}
    updates = 0
    for node in nodes:
        if base_name(node.op) not in adam.ADAM_UPDATES:
            continue
        fused = "_fused_" in node.op
        for k in range(len(params) if fused else len(node.outputs)):
            updates += 1
            found = adam.adam_update_bound(node, k, producer, base, value_of)
            assert found is not None, f"{node.op} {node.args} not recognized as Adam's update"
            assert found[0] == node.inputs[k]  # the parameter, first among the inputs
            bounds.setdefault(int(node.step), set()).add(round(found[1], 12))
    assert updates == len(params) * STEPS
    for step, step_moved in enumerate(moved):
        (bound,) = bounds[step]  # one learning rate, one step number
        exact = bound / adam._SLACK
        assert step_moved <= exact * (1 + 1e-5), (step, step_moved, exact)
        assert step_moved >= 0.5 * exact, (step, step_moved, exact)  # a bound that says something
