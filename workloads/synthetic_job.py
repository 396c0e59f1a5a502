"""A data-parallel job's traces made without running it: many ranks, for what compare costs at scale.

Every rank trains the same residual MLP (``layers`` blocks of ``x + gelu(x @ W.T)``) on its own
batch for ``steps`` steps, DDP-style: its backward's weight gradients go into buckets, each bucket
is divided by the world size and all-reduced (a ``c10d.allreduce_`` node with capture's collective
record), and SGD updates each weight from its slice of the reduced bucket. Every op runs on real
values (:class:`tests.tracebuild.TraceBuilder`), the all-reduce sums the ranks' buckets, so
target and bench agree bit for bit except where a fault is put: ``fault_rank`` computes one GELU
with its tanh approximation in step 0, and every other rank inherits it through the all-reduce.

    python -m workloads.synthetic_job OUT --world 64 --layers 64   # OUT/target, OUT/bench
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

from tests.tracebuild import Ref, TraceBuilder

A = torch.ops.aten


@dataclass(frozen=True)
class JobShape:
    """The simulated job: ranks, model and batch sizes, steps, DDP buckets, and the fault."""

    world: int = 64
    layers: int = 64
    width: int = 32
    batch: int = 8
    steps: int = 2
    bucket_layers: int = 16  # weights per DDP bucket
    fault_rank: int = 1
    fault_layer: int = 3
    lr: float = 0.01


def write_job(folder: Path, shape: JobShape = JobShape()) -> tuple[Path, Path]:
    """Write ``folder/target`` (the fault on ``shape.fault_rank``) and ``folder/bench``; their paths."""
    for name in ("target", "bench"):
        _write_run(folder / name, shape, fault=name == "target")
    return folder / "target", folder / "bench"


def _write_run(path: Path, shape: JobShape, fault: bool) -> None:
    builders = [TraceBuilder(rank=r, world_size=shape.world) for r in range(shape.world)]
    gen = torch.Generator().manual_seed(0)
    initial = [torch.randn(shape.width, shape.width, generator=gen) / shape.width**0.5 for _ in range(shape.layers)]
    weights = [[b.param(f"layers.{i}.weight", w.clone()) for i, w in enumerate(initial)] for b in builders]
    for step in range(shape.steps):
        if step:
            for b in builders:
                b.step()
        buckets = []
        for rank, b in enumerate(builders):
            faulty = fault and step == 0 and rank == shape.fault_rank
            buckets.append(_forward_backward(b, weights[rank], shape, step, faulty))
        for k in range(len(buckets[0])):
            reduced = sum(builders[r].value(buckets[r][k]) for r in range(shape.world))
            for rank, b in enumerate(builders):
                received = _all_reduce(b, buckets[rank][k], reduced, k, step, shape.world)
                _update(b, weights[rank], received, k, shape)
    path.mkdir(parents=True, exist_ok=True)
    for b in builders:
        b.write(path)


def _forward_backward(b: TraceBuilder, weights: list[Ref], shape: JobShape, step: int, faulty: bool) -> list[Ref]:
    """One rank's forward and backward; its gradient buckets, divided by the world size."""
    gen = torch.Generator().manual_seed(1000 * step + b.rank)
    h = b.source("input.x", torch.randn(shape.batch, shape.width, generator=gen))
    saved = []
    for i, w in enumerate(weights):
        where = f"layers.{i}"
        pre = b.call(A.mm.default, h, b.call(A.t.default, w, module=where), module=where)
        tanh = faulty and i == shape.fault_layer
        act = b.call(A.gelu.default, pre, approximate="tanh" if tanh else "none", module=where)
        saved.append((h, pre))
        h = b.call(A.add.Tensor, h, act, module=where)
    grad = b.call(A.mul.Scalar, h, 2.0 / h.shape[0] / h.shape[1], phase="backward")  # of mean(h ** 2)
    grads: list[Ref] = [grad] * len(weights)
    for i in reversed(range(len(weights))):
        where, (x, pre) = f"layers.{i}", saved[i]
        g_act = b.call(A.gelu_backward.default, grad, pre, module=where, phase="backward")
        grads[i] = b.call(
            A.mm.default, b.call(A.t.default, g_act, module=where, phase="backward"), x, module=where, phase="backward"
        )
        g_x = b.call(A.mm.default, g_act, weights[i], module=where, phase="backward")
        grad = b.call(A.add.Tensor, grad, g_x, module=where, phase="backward")
    buckets = []
    for start in range(0, len(weights), shape.bucket_layers):
        flat = [b.call(A.view.default, g, [-1], phase="backward") for g in grads[start : start + shape.bucket_layers]]
        bucket = b.call(A.cat.default, flat, phase="backward")
        buckets.append(b.call(A.div.Scalar, bucket, shape.world, phase="backward"))
    return buckets


def _all_reduce(b: TraceBuilder, bucket: Ref, reduced: torch.Tensor, index: int, step: int, world: int) -> Ref:
    """DDP's bucket all-reduce as capture records it: the sum every rank received."""
    meta = {"kind": "all_reduce", "reduce": "sum", "group": "0", "ranks": list(range(world))}
    args = {"tensors": [{"tensor": 0}], "collective": {**meta, "sent": [0], "received": [0], "bucket": index}}
    received = b.op("c10d.allreduce_.default", [bucket], reduced.clone(), phase="backward", args=args, inplace=True)
    b.ops[-1]["name"] = f"0#{step * 1000 + index}"  # the match key, the same on every rank
    b.values[received.tensor_id] = reduced.clone()
    return received


def _update(b: TraceBuilder, weights: list[Ref], received: Ref, index: int, shape: JobShape) -> None:
    """SGD on the weights of bucket ``index``, each from its slice of the reduced bucket."""
    size = shape.width * shape.width
    first = index * shape.bucket_layers
    for i in range(first, min(first + shape.bucket_layers, len(weights))):
        part = b.call(A.slice.Tensor, received, 0, (i - first) * size, (i - first + 1) * size, phase="optimizer")
        grad = b.call(A.view.default, part, [shape.width, shape.width], phase="optimizer")
        weights[i] = b.call(A.sub.Tensor, weights[i], grad, alpha=shape.lr, phase="optimizer")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--world", type=int, default=JobShape.world)
    parser.add_argument("--layers", type=int, default=JobShape.layers)
    parser.add_argument("--steps", type=int, default=JobShape.steps)
    args = parser.parse_args()
    torch.set_num_threads(1)  # tiny ops: threads only contend (the trace does not depend on them)
    write_job(args.out, JobShape(world=args.world, layers=args.layers, steps=args.steps))


if __name__ == "__main__":
    main()
