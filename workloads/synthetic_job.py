"""A data-parallel job's traces made without running it: many ranks, for what compare costs at scale.

Every rank trains the same residual MLP (``layers`` blocks of ``x + gelu(x @ W.T)``) on its own
batch for ``steps`` steps, DDP-style: its backward's weight gradients go into buckets, each bucket
is divided by the world size and all-reduced (a ``c10d.allreduce_`` node with capture's collective
record), and SGD updates each weight from its slice of the reduced bucket. Every op runs on real
values and is written as capture writes it (:class:`_Recorder`, through the trace writer); the
all-reduce sums the ranks' buckets, so target and bench agree bit for bit except where a fault is
put: ``fault_rank`` computes one GELU with its tanh approximation in step 0, and every other rank
inherits it through the all-reduce.

    python -m workloads.synthetic_job OUT --world 64 --layers 64   # OUT/target, OUT/bench
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tracecmp.capture.stats import STAT_FIELDS, reference_stats
from tracecmp.trace.schema import OPS_SCHEMA, TENSORS_SCHEMA
from tracecmp.trace.writer import RankWriter, write_run_manifest

A = torch.ops.aten


@dataclass(frozen=True)
class Ref:
    """A recorded tensor value: its id, and its real value."""

    tensor_id: int
    value: torch.Tensor


class _Recorder:
    """One rank's ops and tensors, recorded as capture records them and written as one chunk."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world, self.step = rank, world, 0
        self.ops: list[dict[str, Any]] = []
        self.tensors: list[dict[str, Any]] = []

    def source(self, op: str, name: str, value: torch.Tensor) -> Ref:
        return self._record(op, "source", [], [value], name=name, phase="forward")[0]

    def call(self, op: Any, *args: Any, module: str = "", phase: str = "forward", **kwargs: Any) -> Ref:
        """Run the aten overload ``op`` on the values behind the :class:`Ref` arguments; record it."""

        def value(v: Any) -> Any:
            return v.value if isinstance(v, Ref) else [value(x) for x in v] if isinstance(v, list) else v

        inputs = [a for a in args for a in (a if isinstance(a, list) else [a]) if isinstance(a, Ref)]
        out = op(*(value(a) for a in args), **kwargs)
        names = [a.name for a in op._schema.arguments]
        seen: list[int] = []
        encoded = {names[i]: _encode(v, seen) for i, v in enumerate(args)} | {
            k: _encode(v, seen) for k, v in kwargs.items()
        }
        kind = "view" if op.is_view else "op"
        return self._record(str(op), kind, inputs, [out], module=module, phase=phase, args=encoded)[0]

    def collective(self, sent: Ref, received: torch.Tensor, key: str, meta: dict[str, Any]) -> Ref:
        """An all-reduce as capture records it: what the rank sent in, what it received out."""
        args = {"tensors": [{"tensor": 0}], "collective": {**meta, "sent": [0], "received": [0]}}
        (ref,) = self._record(
            "c10d.allreduce_.default", "op", [sent], [received], name=key, phase="backward", args=args
        )
        self.ops[-1]["inplace"] = True
        return ref

    def _record(
        self,
        op: str,
        kind: str,
        inputs: list[Ref],
        outs: list[torch.Tensor],
        *,
        name: str = "",
        module: str = "",
        phase: str,
        args: dict[str, Any] | None = None,
    ) -> list[Ref]:
        op_id = len(self.ops)
        refs = []
        for index, out in enumerate(outs):
            ref = Ref(len(self.tensors), out.detach().clone())
            stats = dict(zip(STAT_FIELDS, reference_stats(ref.value))) if kind != "view" else {}
            base = inputs[0].tensor_id if kind == "view" else -1
            row = {"tensor_id": ref.tensor_id, "op_id": op_id, "index": index, "shape": list(out.shape)}
            row |= {"dtype": str(out.dtype).removeprefix("torch."), "device": "cpu", "view_of": base}
            row |= {"has_stats": bool(stats), "data_key": ""}
            row |= {
                k: stats.get(k, 0 if k in ("nan_count", "inf_count", "checksum") else math.nan) for k in STAT_FIELDS
            }
            self.tensors.append(row)
            refs.append(ref)
        self.ops.append(
            {"op_id": op_id, "step": self.step, "phase": phase, "kind": kind, "op": op, "name": name}
            | {"module": module, "location": "", "args": json.dumps(args or {}, sort_keys=True), "stack": ""}
            | {"inputs": [r.tensor_id for r in inputs], "outputs": [r.tensor_id for r in refs]}
            | {"inplace": False, "random": False, "seq_nr": -1}
        )
        return refs

    def write(self, path: Path) -> None:
        writer = RankWriter(path, rank=self.rank, world_size=self.world)
        writer.write_chunk(
            {k: [row[k] for row in self.ops] for k in OPS_SCHEMA.names},
            {k: [row[k] for row in self.tensors] for k in TENSORS_SCHEMA.names},
            steps=sorted({row["step"] for row in self.ops}),
        )
        writer.close(complete=True)


def _encode(v: Any, tensors: list[int]) -> Any:
    """A call's argument as capture records it: a tensor as its place among the call's tensors."""
    if isinstance(v, Ref):
        tensors.append(v.tensor_id)
        return {"tensor": len(tensors) - 1}
    if isinstance(v, list):
        return [_encode(x, tensors) for x in v]
    return v


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
    ranks = [_Recorder(r, shape.world) for r in range(shape.world)]
    gen = torch.Generator().manual_seed(0)
    initial = [torch.randn(shape.width, shape.width, generator=gen) / shape.width**0.5 for _ in range(shape.layers)]
    weights = [[b.source("source.parameter", f"layers.{i}.weight", w) for i, w in enumerate(initial)] for b in ranks]
    for step in range(shape.steps):
        buckets = []
        for rank, b in enumerate(ranks):
            b.step = step
            faulty = fault and step == 0 and rank == shape.fault_rank
            buckets.append(_forward_backward(b, weights[rank], shape, step, faulty))
        for k in range(len(buckets[0])):
            reduced = sum(buckets[r][k].value for r in range(shape.world))
            meta = {"kind": "all_reduce", "reduce": "sum", "group": "0", "ranks": list(range(shape.world)), "bucket": k}
            for rank, b in enumerate(ranks):
                received = b.collective(buckets[rank][k], reduced, f"0#{step * 1000 + k}", meta)
                _update(b, weights[rank], received, k, shape)
    write_run_manifest(path, options={"data": "stats"})
    for b in ranks:
        b.write(path)


def _forward_backward(b: _Recorder, weights: list[Ref], shape: JobShape, step: int, faulty: bool) -> list[Ref]:
    """One rank's forward and backward; its gradient buckets, divided by the world size."""
    gen = torch.Generator().manual_seed(1000 * step + b.rank)
    h = b.source("source.input", "x", torch.randn(shape.batch, shape.width, generator=gen))
    saved = []
    for i, w in enumerate(weights):
        where = f"layers.{i}"
        pre = b.call(A.mm.default, h, b.call(A.t.default, w, module=where), module=where)
        tanh = faulty and i == shape.fault_layer
        act = b.call(A.gelu.default, pre, approximate="tanh" if tanh else "none", module=where)
        saved.append((h, pre))
        h = b.call(A.add.Tensor, h, act, module=where)
    grad = b.call(A.mul.Scalar, h, 2.0 / h.value.numel(), phase="backward")  # of mean(h ** 2)
    grads: list[Ref] = [grad] * len(weights)
    for i in reversed(range(len(weights))):
        where, (x, pre) = f"layers.{i}", saved[i]
        g_act = b.call(A.gelu_backward.default, grad, pre, module=where, phase="backward")
        g_t = b.call(A.t.default, g_act, module=where, phase="backward")
        grads[i] = b.call(A.mm.default, g_t, x, module=where, phase="backward")
        g_x = b.call(A.mm.default, g_act, weights[i], module=where, phase="backward")
        grad = b.call(A.add.Tensor, grad, g_x, module=where, phase="backward")
    buckets = []
    for start in range(0, len(weights), shape.bucket_layers):
        flat = [b.call(A.view.default, g, [-1], phase="backward") for g in grads[start : start + shape.bucket_layers]]
        bucket = b.call(A.cat.default, flat, phase="backward")
        buckets.append(b.call(A.div.Scalar, bucket, shape.world, phase="backward"))
    return buckets


def _update(b: _Recorder, weights: list[Ref], received: Ref, index: int, shape: JobShape) -> None:
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
