"""How long ``tracecmp.compare`` takes, and how much memory, on two 200,000-op statistics traces.

The traces are synthetic but shaped like a real capture: a stack of identical transformer blocks
(layer norm, attention with views and softmax, MLP with gelu, residual adds), their backward ops
attributed to the same modules, an Adam-like optimizer update per parameter, several steps,
written in chunks as capture writes them. The bench is float32; the target runs in bfloat16 (every
statistic carries bfloat16-sized rounding noise), has three extra ``clone`` ops the bench lacks,
and one fault: a gelu output scaled by 1.05 in step 1, whose error flows into everything after it
(as a scaling of its statistics, which a layer norm divides out again).

    python benchmarks/bench_compare_scale.py            # 200,000 ops per trace
    python benchmarks/bench_compare_scale.py --ops 20000 --keep /tmp/scale

``compare`` runs in a fresh process so that its peak RSS is its own (loading included).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tracecmp.trace.schema import OPS_SCHEMA, TENSORS_SCHEMA  # noqa: E402
from tracecmp.trace.writer import RankWriter, write_run_manifest  # noqa: E402

BF16_EPS = 2.0**-7
CHUNK_OPS = 20_000
FAULT = {"step": 1, "phase": "forward", "op": "aten.gelu.default"}
_SCALE_FREE = {"aten.native_layer_norm.default"}


class Synth:
    """Writes one rank of a synthetic run node by node (columns kept as lists, flushed per chunk)."""

    def __init__(self, root: Path, *, target: bool, fault_block: int, extra_blocks: set[int], seed: int) -> None:
        self.target = target
        self.fault_block = fault_block
        self.extra_blocks = extra_blocks
        self.dtype = "bfloat16" if target else "float32"
        self.rng = random.Random(seed)  # noise: differs between target and bench
        self.counter: dict[tuple, int] = {}  # per (step, module, op): occurrence, to seed the "true" values
        self.last_stats: dict[int, dict[str, Any]] = {}  # recent tensors' statistics, for exact copies
        write_run_manifest(root, options={"data": "stats", "synthetic": True})
        self.writer = RankWriter(root, rank=0, device="npu:0" if target else "cuda:0")
        self.ops: dict[str, list[Any]] = {k: [] for k in OPS_SCHEMA.names}
        self.tensors: dict[str, list[Any]] = {k: [] for k in TENSORS_SCHEMA.names}
        self.op_id = 0
        self.tensor_id = 0
        self.step = 0
        self.steps: set[int] = set()
        self.error: dict[int, float] = {}  # tensor id -> relative error the target carries (fault-driven)

    # -- recording --------------------------------------------------------------------------------

    def node(
        self,
        op: str,
        inputs: list[int],
        shape: tuple[int, ...],
        *,
        module: str,
        phase: str,
        kind: str = "op",
        name: str = "",
        args: str = "{}",
        scale: float | None = None,
        view_of: int = -1,
        fault: bool = False,
        copy_of: int | None = None,
    ) -> int:
        tid = self.tensor_id
        self.tensor_id += 1
        inherited = max((self.error.get(t, 0.0) for t in inputs), default=0.0)
        # The synthetic error scales every statistic alike; a layer norm divides any scale of its
        # input out again, so its output carries none of it (as a real one would).
        error = 0.05 if fault else 0.0 if op in _SCALE_FREE else inherited * 0.98
        if error > 1e-9:
            self.error[tid] = error
        for key, value in (
            ("op_id", self.op_id),
            ("step", self.step),
            ("phase", phase),
            ("kind", kind),
            ("op", op),
            ("name", name),
            ("module", module),
            ("location", "model.py:%d" % (10 + self.op_id % 300)),
            ("args", args),
            ("inputs", inputs),
            ("outputs", [tid]),
            ("inplace", op.endswith("_.Tensor")),
            ("random", False),
            ("seq_nr", -1),
            ("stack", ""),
        ):
            self.ops[key].append(value)
        key = (self.step, module, op)
        occurrence = self.counter[key] = self.counter.get(key, -1) + 1
        if view_of >= 0:
            stats = None
        elif copy_of is not None:
            stats = self.last_stats[copy_of]
        else:
            # The "true" values depend only on where the op is, so both runs agree on them.
            vals = random.Random(zlib.crc32(repr((self.step, module, op, occurrence, name)).encode()))
            stats = self._stats(vals, shape, scale if scale is not None else 1.0, error)
        if stats is not None:
            self.last_stats[tid] = stats
            if len(self.last_stats) > 4096:
                self.last_stats.pop(next(iter(self.last_stats)))
        row = {
            "tensor_id": tid,
            "op_id": self.op_id,
            "index": 0,
            "shape": list(shape),
            "dtype": self.dtype,
            "device": "cpu",
            "view_of": view_of,
            "has_stats": stats is not None,
            "data_key": "",
        }
        for key in ("min", "max", "mean", "norm", "nan_count", "inf_count", "checksum"):
            row[key] = (
                (0 if key in ("nan_count", "inf_count", "checksum") else math.nan) if stats is None else stats[key]
            )
        for key, value in row.items():
            self.tensors[key].append(value)
        self.op_id += 1
        self.steps.add(self.step)
        if self.op_id % CHUNK_OPS == 0:
            self.flush()
        return tid

    def view(self, op: str, base: int, shape: tuple[int, ...], *, module: str, phase: str) -> int:
        return self.node(op, [base], shape, module=module, phase=phase, kind="view", view_of=base)

    def _stats(self, vals: random.Random, shape: tuple[int, ...], scale: float, error: float) -> dict[str, Any]:
        numel = math.prod(shape)
        lo, hi = -scale * (3 + vals.random()), scale * (3 + vals.random())
        mean, rms = scale * (vals.random() - 0.5) * 0.1, scale * (0.8 + 0.4 * vals.random())
        checksum = vals.getrandbits(62)
        if self.target:
            # bf16 rounding: extremes move by at most half a unit, mean and norm by ~u/sqrt(n).
            u = BF16_EPS
            lo *= 1 + u / 2 * (2 * self.rng.random() - 1)
            hi *= 1 + u / 2 * (2 * self.rng.random() - 1)
            mean += rms * u / math.sqrt(numel) * self.rng.gauss(0, 0.3)
            rms *= 1 + u / math.sqrt(numel) * self.rng.gauss(0, 0.3)
            if error:
                lo, hi, mean, rms = lo * (1 + error), hi * (1 + error), mean * (1 + error), rms * (1 + error)
            checksum ^= self.rng.getrandbits(62) | 1
        return {
            "min": lo,
            "max": hi,
            "mean": mean,
            "norm": rms * math.sqrt(numel),
            "nan_count": 0,
            "inf_count": 0,
            "checksum": checksum,
        }

    def flush(self) -> None:
        if self.ops["op_id"]:
            self.writer.write_chunk(self.ops, self.tensors, steps=sorted(self.steps))
            for column in (*self.ops.values(), *self.tensors.values()):
                column.clear()

    def close(self) -> None:
        self.flush()
        self.writer.close(complete=True)

    # -- the model ----------------------------------------------------------------------------------

    def run(self, *, steps: int, blocks: int, batch: int = 4, seq: int = 128, d: int = 256, heads: int = 4) -> None:
        tokens, dh = batch * seq, d // heads
        params = {}
        for step in range(steps):
            self.step = step
            x = self.node(
                "source.input", [], (batch, seq, d), module="", phase="forward", kind="source", name="input.0"
            )
            saved = []
            for i in range(blocks):
                m = f"blocks.{i}"
                for p, shape in (
                    ("ln1.weight", (d,)),
                    ("attn.qkv.weight", (3 * d, d)),
                    ("attn.proj.weight", (d, d)),
                    ("ln2.weight", (d,)),
                    ("mlp.fc1.weight", (4 * d, d)),
                    ("mlp.fc2.weight", (d, 4 * d)),
                ):
                    params[f"{m}.{p}"] = self.node(
                        "source.parameter",
                        [],
                        shape,
                        module=f"{m}.{p.rsplit('.', 1)[0]}",
                        phase="forward",
                        kind="source",
                        name=f"{m}.{p}",
                        scale=0.05,
                    )
                x, keep = self.block_forward(x, m, params, tokens, batch, seq, d, heads, dh, step)
                saved.append(keep)
            loss = self.node("aten.mean.default", [x], (), module="", phase="forward")
            grad = self.node("aten.ones_like.default", [loss], (), module="", phase="backward")
            grad = self.node(
                "aten.expand.default", [grad], (batch, seq, d), module="", phase="backward", kind="view", view_of=grad
            )
            grads = {}
            for i in reversed(range(blocks)):
                grad = self.block_backward(
                    grad, f"blocks.{i}", params, saved[i], grads, tokens, batch, seq, d, heads, dh
                )
            for name, p in params.items():
                g = grads.get(name, grad)
                module = name.rsplit(".", 1)[0]
                m1 = self.node("aten.mul.Tensor", [g], self._shape(p), module="", phase="optimizer", scale=0.01)
                v = self.node("aten.mul.Tensor", [g, g], self._shape(p), module="", phase="optimizer", scale=1e-4)
                s = self.node("aten.sqrt.default", [v], self._shape(p), module="", phase="optimizer", scale=0.01)
                u = self.node("aten.div.Tensor", [m1, s], self._shape(p), module="", phase="optimizer")
                self.node("aten.add_.Tensor", [p, u], self._shape(p), module="", phase="optimizer", scale=0.05)
                del module

    def _shape(self, tid: int) -> tuple[int, ...]:
        # shapes of recent tensors are in the pending chunk or flushed; parameters are re-created
        # every step, so look up the pending chunk and fall back to a vector.
        ids = self.tensors["tensor_id"]
        if ids and ids[0] <= tid:
            return tuple(self.tensors["shape"][tid - ids[0]])
        return (256,)

    def block_forward(
        self,
        x: int,
        m: str,
        params: dict[str, int],
        tokens: int,
        batch: int,
        seq: int,
        d: int,
        heads: int,
        dh: int,
        step: int,
    ) -> tuple[int, list[int]]:
        f = "forward"
        ln = self.node(
            "aten.native_layer_norm.default",
            [x, params[f"{m}.ln1.weight"]],
            (batch, seq, d),
            module=f"{m}.ln1",
            phase=f,
            args='{"eps":1e-05}',
        )
        flat = self.view("aten.view.default", ln, (tokens, d), module=f"{m}.attn.qkv", phase=f)
        wt = self.view("aten.t.default", params[f"{m}.attn.qkv.weight"], (d, 3 * d), module=f"{m}.attn.qkv", phase=f)
        qkv = self.node("aten.mm.default", [flat, wt], (tokens, 3 * d), module=f"{m}.attn.qkv", phase=f)
        qkv3 = self.view("aten.view.default", qkv, (batch, seq, 3 * d), module=f"{m}.attn", phase=f)
        q, k, v = (self.view("aten.slice.Tensor", qkv3, (batch, seq, d), module=f"{m}.attn", phase=f) for _ in range(3))
        q = self.node(
            "aten.clone.default",
            [self.view("aten.transpose.int", q, (batch, heads, seq, dh), module=f"{m}.attn", phase=f)],
            (batch * heads, seq, dh),
            module=f"{m}.attn",
            phase=f,
        )
        kt = self.node(
            "aten.clone.default",
            [self.view("aten.transpose.int", k, (batch, heads, dh, seq), module=f"{m}.attn", phase=f)],
            (batch * heads, dh, seq),
            module=f"{m}.attn",
            phase=f,
        )
        scores = self.node(
            "aten.bmm.default", [q, kt], (batch * heads, seq, seq), module=f"{m}.attn", phase=f, scale=3.0
        )
        probs = self.node(
            "aten._softmax.default", [scores], (batch * heads, seq, seq), module=f"{m}.attn", phase=f, scale=0.05
        )
        vv = self.node(
            "aten.clone.default",
            [self.view("aten.transpose.int", v, (batch, heads, seq, dh), module=f"{m}.attn", phase=f)],
            (batch * heads, seq, dh),
            module=f"{m}.attn",
            phase=f,
        )
        ctx_raw = self.node("aten.bmm.default", [probs, vv], (batch * heads, seq, dh), module=f"{m}.attn", phase=f)
        ctx = self.view("aten.view.default", ctx_raw, (tokens, d), module=f"{m}.attn.proj", phase=f)
        if self.target and int(m.split(".")[1]) in self.extra_blocks and step == 0:
            ctx = self.node("aten.clone.default", [ctx], (tokens, d), module=f"{m}.attn.proj", phase=f, copy_of=ctx_raw)
        wp = self.view("aten.t.default", params[f"{m}.attn.proj.weight"], (d, d), module=f"{m}.attn.proj", phase=f)
        att = self.node("aten.mm.default", [ctx, wp], (tokens, d), module=f"{m}.attn.proj", phase=f)
        att = self.view("aten.view.default", att, (batch, seq, d), module=f"{m}.attn.proj", phase=f)
        x = self.node("aten.add.Tensor", [x, att], (batch, seq, d), module=m, phase=f)
        ln2 = self.node(
            "aten.native_layer_norm.default",
            [x, params[f"{m}.ln2.weight"]],
            (batch, seq, d),
            module=f"{m}.ln2",
            phase=f,
            args='{"eps":1e-05}',
        )
        flat2 = self.view("aten.view.default", ln2, (tokens, d), module=f"{m}.mlp.fc1", phase=f)
        w1 = self.view("aten.t.default", params[f"{m}.mlp.fc1.weight"], (d, 4 * d), module=f"{m}.mlp.fc1", phase=f)
        h = self.node("aten.mm.default", [flat2, w1], (tokens, 4 * d), module=f"{m}.mlp.fc1", phase=f)
        fault = self.target and step == FAULT["step"] and int(m.split(".")[1]) == self.fault_block
        g = self.node("aten.gelu.default", [h], (tokens, 4 * d), module=f"{m}.mlp.act", phase=f, fault=fault)
        w2 = self.view("aten.t.default", params[f"{m}.mlp.fc2.weight"], (4 * d, d), module=f"{m}.mlp.fc2", phase=f)
        o = self.node("aten.mm.default", [g, w2], (tokens, d), module=f"{m}.mlp.fc2", phase=f)
        o = self.view("aten.view.default", o, (batch, seq, d), module=f"{m}.mlp.fc2", phase=f)
        x = self.node("aten.add.Tensor", [x, o], (batch, seq, d), module=m, phase=f)
        return x, [ln, flat, q, kt, probs, vv, ctx, ln2, flat2, h, g]

    def block_backward(
        self,
        grad: int,
        m: str,
        params: dict[str, int],
        keep: list[int],
        grads: dict[str, int],
        tokens: int,
        batch: int,
        seq: int,
        d: int,
        heads: int,
        dh: int,
    ) -> int:
        b = "backward"
        ln, flat, q, kt, probs, vv, ctx, ln2, flat2, h, g = keep
        go = self.view("aten.view.default", grad, (tokens, d), module=f"{m}.mlp.fc2", phase=b)
        grads[f"{m}.mlp.fc2.weight"] = self.node(
            "aten.mm.default",
            [self.view("aten.t.default", go, (d, tokens), module=f"{m}.mlp.fc2", phase=b), g],
            (d, 4 * d),
            module=f"{m}.mlp.fc2",
            phase=b,
            scale=0.01,
        )
        gg = self.node(
            "aten.mm.default",
            [go, params[f"{m}.mlp.fc2.weight"]],
            (tokens, 4 * d),
            module=f"{m}.mlp.fc2",
            phase=b,
            scale=0.01,
        )
        gh = self.node(
            "aten.gelu_backward.default", [gg, h], (tokens, 4 * d), module=f"{m}.mlp.act", phase=b, scale=0.01
        )
        grads[f"{m}.mlp.fc1.weight"] = self.node(
            "aten.mm.default",
            [self.view("aten.t.default", gh, (4 * d, tokens), module=f"{m}.mlp.fc1", phase=b), flat2],
            (4 * d, d),
            module=f"{m}.mlp.fc1",
            phase=b,
            scale=0.01,
        )
        gl2 = self.node(
            "aten.mm.default",
            [gh, params[f"{m}.mlp.fc1.weight"]],
            (tokens, d),
            module=f"{m}.mlp.fc1",
            phase=b,
            scale=0.01,
        )
        gl2 = self.view("aten.view.default", gl2, (batch, seq, d), module=f"{m}.ln2", phase=b)
        gx = self.node(
            "aten.native_layer_norm_backward.default",
            [gl2, ln2, params[f"{m}.ln2.weight"]],
            (batch, seq, d),
            module=f"{m}.ln2",
            phase=b,
            scale=0.01,
        )
        grads[f"{m}.ln2.weight"] = self.node("aten.sum.dim_IntList", [gl2], (d,), module=f"{m}.ln2", phase=b, scale=0.1)
        grad = self.node("aten.add.Tensor", [grad, gx], (batch, seq, d), module=m, phase=b, scale=0.01)
        gp = self.view("aten.view.default", grad, (tokens, d), module=f"{m}.attn.proj", phase=b)
        grads[f"{m}.attn.proj.weight"] = self.node(
            "aten.mm.default",
            [self.view("aten.t.default", gp, (d, tokens), module=f"{m}.attn.proj", phase=b), ctx],
            (d, d),
            module=f"{m}.attn.proj",
            phase=b,
            scale=0.01,
        )
        gctx = self.node(
            "aten.mm.default",
            [gp, params[f"{m}.attn.proj.weight"]],
            (tokens, d),
            module=f"{m}.attn.proj",
            phase=b,
            scale=0.01,
        )
        gctx = self.view("aten.view.default", gctx, (batch * heads, seq, dh), module=f"{m}.attn", phase=b)
        gprobs = self.node(
            "aten.bmm.default", [gctx, vv], (batch * heads, seq, seq), module=f"{m}.attn", phase=b, scale=0.01
        )
        gv = self.node(
            "aten.bmm.default", [probs, gctx], (batch * heads, seq, dh), module=f"{m}.attn", phase=b, scale=0.01
        )
        gs = self.node(
            "aten._softmax_backward_data.default",
            [gprobs, probs],
            (batch * heads, seq, seq),
            module=f"{m}.attn",
            phase=b,
            scale=0.001,
        )
        gq = self.node("aten.bmm.default", [gs, kt], (batch * heads, seq, dh), module=f"{m}.attn", phase=b, scale=0.01)
        gk = self.node("aten.bmm.default", [q, gs], (batch * heads, dh, seq), module=f"{m}.attn", phase=b, scale=0.01)
        gqkv = self.node("aten.cat.default", [gq, gk, gv], (tokens, 3 * d), module=f"{m}.attn", phase=b, scale=0.01)
        grads[f"{m}.attn.qkv.weight"] = self.node(
            "aten.mm.default",
            [self.view("aten.t.default", gqkv, (3 * d, tokens), module=f"{m}.attn.qkv", phase=b), flat],
            (3 * d, d),
            module=f"{m}.attn.qkv",
            phase=b,
            scale=0.01,
        )
        gln = self.node(
            "aten.mm.default",
            [gqkv, params[f"{m}.attn.qkv.weight"]],
            (tokens, d),
            module=f"{m}.attn.qkv",
            phase=b,
            scale=0.01,
        )
        gln = self.view("aten.view.default", gln, (batch, seq, d), module=f"{m}.ln1", phase=b)
        gx = self.node(
            "aten.native_layer_norm_backward.default",
            [gln, ln, params[f"{m}.ln1.weight"]],
            (batch, seq, d),
            module=f"{m}.ln1",
            phase=b,
            scale=0.01,
        )
        grads[f"{m}.ln1.weight"] = self.node("aten.sum.dim_IntList", [gln], (d,), module=f"{m}.ln1", phase=b, scale=0.1)
        return self.node("aten.add.Tensor", [grad, gx], (batch, seq, d), module=m, phase=b, scale=0.01)


OPS_PER_BLOCK_STEP = 96  # measured: forward 37, backward 29, optimizer 30 (6 parameters x 5)


def generate(root: Path, ops: int, steps: int) -> dict[str, Any]:
    blocks = max(2, round(ops / (steps * OPS_PER_BLOCK_STEP)))
    fault_block = blocks // 2
    extra = {blocks // 5, blocks // 3, (4 * blocks) // 5}
    for name, target in (("bench", False), ("target", True)):
        synth = Synth(root / name, target=target, fault_block=fault_block, extra_blocks=extra, seed=7 if target else 3)
        synth.run(steps=steps, blocks=blocks)
        synth.close()
    return {"blocks": blocks, "steps": steps, "fault_block": fault_block, "extra_blocks": sorted(extra)}


_CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import tracecmp
t = tracecmp.load(sys.argv[1]); b = tracecmp.load(sys.argv[2])
n_t, n_b = len(t.rank(0).ops_table), len(b.rank(0).ops_table)
t1 = time.perf_counter()
r = tracecmp.compare(t, b, progress=False)
t2 = time.perf_counter()
d = r.first_divergence
cpu = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"ops_target": n_t, "ops_bench": n_b, "load_s": t1 - t0, "compare_s": t2 - t1, "total_s": t2 - t0,
                  "cpu_s": cpu.ru_utime + cpu.ru_stime,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "first": None if d is None else [d.op, d.module, d.phase, d.step], "roots": len(r.suspects),
                  "counts": r.counts()}))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=200_000, help="approximate ops per trace (default 200,000)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--keep", type=Path, help="write the traces here and keep them")
    args = parser.parse_args(argv)
    root = args.keep or Path(tempfile.mkdtemp(prefix="tracecmp-scale-"))
    start = time.perf_counter()
    shape = generate(root, args.ops, args.steps)
    generated = time.perf_counter() - start
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(root / "target"), str(root / "bench")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    )
    stats = json.loads(out.stdout.strip().splitlines()[-1])
    fault = f"blocks.{shape['fault_block']}.mlp.act"
    found = stats["first"] == ["aten.gelu.default", fault, "forward", FAULT["step"]]
    print(
        f"traces: {stats['ops_target']:,} target ops, {stats['ops_bench']:,} bench ops "
        f"({shape['blocks']} blocks x {shape['steps']} steps, generated in {generated:.0f} s) in {root}"
    )
    print(
        f"load {stats['load_s']:.1f} s + compare {stats['compare_s']:.1f} s = {stats['total_s']:.1f} s wall, "
        f"{stats['cpu_s']:.1f} s CPU, peak RSS {stats['peak_rss_mb']:.0f} MB"
    )
    print(
        f"first divergence: {stats['first']} ({'the injected fault' if found else 'NOT the injected fault ' + fault}); "
        f"{stats['roots']} roots; counts {stats['counts']}"
    )
    if not args.keep:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return 0 if found else 1


if __name__ == "__main__":
    sys.exit(main())
