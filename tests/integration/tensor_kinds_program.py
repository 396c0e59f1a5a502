"""Every kind of tensor users meet, captured: run by test_tensor_kinds.py in a fresh interpreter.

``python -m tests.integration.tensor_kinds_program native|reference PORT`` runs each case twice,
without and with ``TraceCompare``, and prints one JSON line of facts per case: whether the
outputs are bitwise equal, which ops were recorded, what the rank manifest says was skipped and
why, and the statistics to check. A crash of the native kernel kills this process, not pytest.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

import tracecmp
from tracecmp.capture import mode as capture_mode
from tracecmp.capture import stats as capture_stats
from tracecmp.capture.stats import reference_stats

NATIVE = sys.argv[1] == "native"
capture_mode.USE_NATIVE = NATIVE
capture_stats.set_force_reference(not NATIVE)


def _stats(t: torch.Tensor) -> list[float]:
    s = reference_stats(t)
    return [s.min, s.max, s.mean, s.norm, s.nan_count, s.inf_count, s.checksum]


# A case returns the program's outputs (captured and plain must be bitwise equal) and the tensors
# whose statistics the trace must hold.
Case = Callable[[], tuple[list[torch.Tensor], dict[str, torch.Tensor]]]


def dtensor() -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    a = distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])
    b = distribute_tensor(torch.randn(3, 2), mesh, [Replicate()])
    c = (a @ b).relu()
    return [c.to_local()], {"result": c.to_local()}


def fsdp2() -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    params = [p.to_local().detach() for p in model.parameters()]
    return params, {f"param{i}": p for i, p in enumerate(params)}


def fake() -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = torch.randn(3).exp()
    with FakeTensorMode():
        x = torch.ones(5)
        (x * 2).sum()
    return [real], {}


def functional() -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    def f(x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        y.add_(1)
        return y * 2

    out = torch.func.functionalize(f)(torch.randn(3))
    return [out], {"result": out}


def nested() -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    parts = [torch.randn(2), torch.randn(3)]
    strided = torch.nested.nested_tensor(parts).sin()
    jagged = torch.nested.nested_tensor(parts, layout=torch.jagged).sin()
    return [*strided.unbind(), *jagged.unbind()], {"jagged_values": jagged.values()}


def sparse() -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    s = torch.randn(3, 3).relu().to_sparse()
    doubled = (s * 2).to_dense()
    product = torch.sparse.mm(s, torch.randn(3, 2))
    return [doubled, product], {"product": product}


def meta() -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    x = torch.ones(3, 4, device="meta")
    y = (x @ x.T).relu()
    return [torch.tensor(list(y.shape))], {}


def subclasses() -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    from torch.testing._internal.two_tensor import TwoTensor

    class Tagged(torch.Tensor):  # a subclass with storage of its own, no __torch_dispatch__
        pass

    two = TwoTensor(torch.randn(3), torch.randn(3)) * 3
    tagged = torch.randn(3).as_subclass(Tagged).exp()
    return [two.a, two.b, tagged.as_subclass(torch.Tensor)], {"two_a": two.a, "tagged": tagged}


def other_layouts() -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    back = q.dequantize() * 2
    dense = torch.randn(2, 3).to_mkldnn().to_dense() + 1
    return [back, dense], {}


CASES: dict[str, Case] = {
    "dtensor": dtensor,
    "fsdp2": fsdp2,
    "fake": fake,
    "functional": functional,
    "nested": nested,
    "sparse": sparse,
    "meta": meta,
    "subclasses": subclasses,
    "other_layouts": other_layouts,
}


def run(name: str, case: Case) -> dict[str, Any]:
    torch.manual_seed(0)
    try:
        plain, _ = case()
    except Exception as exc:  # noqa: BLE001 - torch cannot run it untraced (DTensor, FSDP2 before 2.4)
        return {"case": name, "unavailable": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
    torch.manual_seed(0)
    path = tempfile.mkdtemp() + "/run"
    with tracecmp.TraceCompare(path) as tc:
        captured, expected = case()
        tc.step()
    trace = tracecmp.load(path).rank(0)
    ops, tensors = trace.ops, trace.tensors
    recorded = ops[ops["kind"] != "source"]
    value_rows = tensors[tensors["has_stats"]]
    return {
        "case": name,
        "equal": len(plain) == len(captured) and all(torch.equal(a, b) for a, b in zip(plain, captured)),
        "ops": recorded["op"].tolist(),
        "phases": sorted(set(ops["phase"])),
        "skipped": trace.manifest["info"].get("capture_skipped", {}),
        "devices": sorted(set(tensors["device"])),
        "stats": [
            [r.min, r.max, r.mean, r.norm, r.nan_count, r.inf_count, r.checksum] for r in value_rows.itertuples()
        ],
        "expected": {key: _stats(value.detach()) for key, value in expected.items()},  # after the capture
        "complete": trace.complete,
    }


def main() -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = sys.argv[2]
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        for name, case in CASES.items():
            try:
                facts = run(name, case)
            except Exception:  # noqa: BLE001 - reported per case, so every case runs
                facts = {"case": name, "error": traceback.format_exc()}
            print(json.dumps(facts), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
