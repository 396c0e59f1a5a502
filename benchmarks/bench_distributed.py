"""Many ranks: capture overhead of a DDP step, and compare time and memory for 1, 2 and 4 ranks.

    python benchmarks/bench_distributed.py overhead            # torchrun, 2 ranks over gloo
    python benchmarks/bench_distributed.py calls               # one process: what recording a collective costs
    python benchmarks/bench_distributed.py compare --ranks 1,2,4
    python benchmarks/bench_distributed.py accuracy [--setups ddp,fsdp2,tp] [--json]
    python benchmarks/bench_distributed.py scale [--world 64] [--layers 64] [--processes 4]

``overhead`` times a 2-rank DDP training step of an MLP stack plain and captured, alternating in
one launch (medians; the ratio is what to read on a noisy machine), and what a collective costs
captured: a synchronous all-reduce, one with ``async_op=True`` waited on, and a functional one
whose wait is implicit (its AsyncCollectiveTensor's first use).

``compare`` captures the same per-rank run (DDP, a fault on the last rank) with 1, 2 and 4 ranks, then
times ``tracecmp.compare`` on each in a fresh process: in that process alone (``workers=1``)
and with one worker per rank; peak RSS of the comparing process and of its largest worker.

``accuracy`` captures a small transformer-like MLP (two residual blocks: LayerNorm, up, GELU, down)
on 2 gloo ranks for 2 steps under DDP, FSDP2 and tensor parallelism: two clean runs, and faults on
one rank alone (rank 0 or 1) in one step alone (0 or 1): ``forward`` (GELU's tanh approximation in
block 1), ``backward`` (block 0's gradient scaled by 1.001, before it is reduced) and ``nan`` (block
0's hidden activation overflows to Inf in forward; NaN follows). Per case: the first divergence right (op, rank,
step, phase: top-1), and the suspects exactly the fault (one root; each other rank agrees or
inherited it through a collective).

``scale`` writes a simulated data-parallel job (``workloads/synthetic_job.py``: ``--world`` ranks of
a residual MLP, DDP buckets all-reduced, a fault on rank 1) and compares it both ways: a process
pool of ``--processes`` workers, and a torchrun job of ``--processes`` processes over gloo; wall
time and peak RSS of each process.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _torchrun(n: int, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(n),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(_free_port()),
            str(Path(__file__).resolve()),
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=3600,
    )
    if done.returncode != 0:
        raise SystemExit(done.stderr[-4000:])
    return done.stdout


# ---- inside torchrun ----------------------------------------------------------------------------


def _model(width: int, blocks: int, fault: bool) -> Any:
    import torch
    import torch.nn.functional as F

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = torch.nn.LayerNorm(width)
            self.up = torch.nn.Linear(width, 2 * width)
            self.down = torch.nn.Linear(2 * width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(F.gelu(self.up(self.norm(x)), approximate="tanh" if fault else "none"))

    return torch.nn.Sequential(*[Block() for _ in range(blocks)], torch.nn.Linear(width, 8))


def _step(model: Any, opt: Any, x: Any) -> None:
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def overhead_worker(folder: Path, reps: int, steps: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    import tracecmp

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(_model(256, 4, False))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(rank))
    for _ in range(3):
        _step(ddp, opt, x)
    plain_t, captured_t, ops = [], [], 0
    for rep in range(reps):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            _step(ddp, opt, x)
        dist.barrier()
        plain_t.append((time.perf_counter() - start) / steps)
        with tracecmp.TraceCompare(folder / f"r{rep}", model=ddp) as tc:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                _step(ddp, opt, x)
                tc.step()
            dist.barrier()
            captured_t.append((time.perf_counter() - start) / steps)
        ops = len(tracecmp.load(folder / f"r{rep}").rank(rank).ops_table) // steps
    calls: dict[str, tuple[float, float]] = {}
    t = torch.ones(1024)

    def sync() -> None:
        dist.all_reduce(t)

    def async_op() -> None:
        dist.all_reduce(t, async_op=True).wait()

    def functional() -> None:
        y = funcol.all_reduce(t, "sum", dist.group.WORLD)
        y.mul(1.0)  # the first use waits (AsyncCollectiveTensor)

    def nothing() -> None:
        t.mul(1.0)  # the one op the functional case adds

    for name, call in (("sync", sync), ("async_op", async_op), ("functional", functional), ("mul", nothing)):
        times = []
        for captured in (False, True):
            n = 200
            dist.barrier()
            if captured:
                with tracecmp.TraceCompare(folder / f"calls-{name}") as tc:
                    start = time.perf_counter()
                    for _ in range(n):
                        call()
                    took = time.perf_counter() - start
            else:
                start = time.perf_counter()
                for _ in range(n):
                    call()
                took = time.perf_counter() - start
            times.append(took / n)
        calls[name] = (times[0], times[1])
        dist.barrier()
    if rank == 0:
        print(
            json.dumps(
                {
                    "plain_ms": 1e3 * statistics.median(plain_t),
                    "captured_ms": 1e3 * statistics.median(captured_t),
                    "ops_per_step": ops,
                    "threads": torch.get_num_threads(),
                    "calls_us": {k: (1e6 * a, 1e6 * b) for k, (a, b) in calls.items()},
                }
            )
        )
    dist.destroy_process_group()


def capture_worker(out: str, steps: int, width: int, blocks: int) -> None:
    import torch
    import torch.distributed as dist

    import tracecmp

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for variant in ("bench", "target"):
        torch.manual_seed(0)
        last = rank == dist.get_world_size() - 1  # the fault's rank: the last, so one rank has it too
        ddp = torch.nn.parallel.DistributedDataParallel(_model(width, blocks, variant == "target" and last))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        with tracecmp.TraceCompare(Path(out) / variant, model=ddp) as tc:
            for step in range(steps):
                x = torch.randn(16, width, generator=torch.Generator().manual_seed(100 * step + rank))
                _step(ddp, opt, x)
                tc.step()
    dist.destroy_process_group()


ACCURACY_FAULTS = ("forward", "backward", "nan")
# The op each fault makes, as the first divergence must name it.
FAULT_OPS = {"forward": "aten.gelu.default", "backward": "aten.mul.Tensor", "nan": "aten.mul.Tensor"}
FAULT_PHASES = {"forward": "forward", "backward": "backward", "nan": "forward"}


def _accuracy_cases() -> list[tuple[str, int, int]]:
    """(fault, rank, step) of every fault case; ("clean", -1, -1) is the clean pair."""
    return [("clean", -1, -1)] + [(f, r, s) for f in ACCURACY_FAULTS for r in (0, 1) for s in (0, 1)]


def _case_name(fault: str, rank: int, step: int) -> str:
    return fault if fault == "clean" else f"{fault}-r{rank}-s{step}"


def _accuracy_model(setup: str, width: int) -> Any:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    class Block(torch.nn.Module):
        def __init__(self, index: int) -> None:
            super().__init__()
            self.index = index
            self.norm = torch.nn.LayerNorm(width)
            self.up = torch.nn.Linear(width, 2 * width)
            self.down = torch.nn.Linear(2 * width, width)
            self.fault = ""  # set per step by the capture loop

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.up(self.norm(x))
            if self.fault == "nan" and self.index == 0:
                h = h * 1e30 * 1e30  # Inf where the bench is finite; NaN downstream (inf - inf, 0 * inf)
            if self.fault == "backward" and self.index == 0 and h.requires_grad:
                h.register_hook(lambda g: g * 1.001)
            tanh = self.fault == "forward" and self.index == 1
            return x + self.down(F.gelu(h, approximate="tanh" if tanh else "none"))

    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(0), Block(1), torch.nn.Linear(width, 4))
    if setup == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    if setup == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model[:2]:
            fully_shard(block)
        fully_shard(model)
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plan = {
        f"{i}.{name}": style for i in (0, 1) for name, style in (("up", ColwiseParallel()), ("down", RowwiseParallel()))
    }
    parallelize_module(model, mesh, plan)
    return model


def accuracy_worker(out: str, setups: list[str], width: int) -> None:
    import torch
    import torch.distributed as dist

    import tracecmp

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    for setup in setups:
        for variant, (fault, fault_rank, fault_step) in [("bench", ("clean", -1, -1))] + [
            (_case_name(*case), case) for case in _accuracy_cases()
        ]:
            model = _accuracy_model(setup, width)
            blocks = [m for m in model.modules() if hasattr(m, "fault")]
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            with tracecmp.TraceCompare(Path(out) / setup / variant, model=model) as tc:
                for step in range(2):
                    for block in blocks:
                        block.fault = fault if (rank, step) == (fault_rank, fault_step) else ""
                    seed = 100 * step + (0 if setup == "tp" else rank + 1)  # tensor parallel ranks share a batch
                    x = torch.randn(4, width, generator=torch.Generator().manual_seed(seed))
                    model(x).square().mean().backward()
                    opt.step()
                    opt.zero_grad()
                    tc.step()
    dist.destroy_process_group()


def _judge_case(folder: Path, setup: str, fault: str, fault_rank: int, fault_step: int) -> dict[str, Any]:
    """One case compared: the first divergence, the suspects, and whether they are the fault exactly."""
    import tracecmp

    result = tracecmp.compare(folder / setup / _case_name(fault, fault_rank, fault_step), folder / setup / "bench")
    d = result.first_divergence
    ranks = {line.rank: line.status for line in result.job.ranks}
    found = {
        "setup": setup,
        "case": _case_name(fault, fault_rank, fault_step),
        "first": f"{d.op} rank {d.rank} step {d.step} {d.phase}" if d else None,
        "suspects": [f"{s.op} rank {s.rank} step {s.step} {s.phase} ({s.kind})" for s in result.suspects],
        "ranks": ranks,
    }
    if fault == "clean":
        found["right"] = found["exact"] = d is None and result.agrees
        return found

    def is_fault(s: Any) -> bool:
        return (s.op, s.rank, s.step, s.phase) == (FAULT_OPS[fault], fault_rank, fault_step, FAULT_PHASES[fault])

    found["right"] = d is not None and is_fault(d)
    found["exact"] = (
        found["right"]
        and len(result.suspects) == 1
        and ranks.get(fault_rank) == "root"
        and all(status in ("agrees", "inherited") for r, status in ranks.items() if r != fault_rank)
    )
    return found


def accuracy(setups: list[str], width: int, as_json: bool) -> None:
    folder = Path(tempfile.mkdtemp(prefix="tracecmp-accuracy-"))
    start = time.perf_counter()
    _torchrun(2, "accuracy-worker", str(folder), ",".join(setups), str(width))
    captured = time.perf_counter() - start
    cases = [_judge_case(folder, setup, *case) for setup in setups for case in _accuracy_cases()]
    if as_json:
        print(json.dumps(cases, indent=1))
    print(f"captured {len(setups) * 14} runs in {captured:.0f} s ({folder})")
    print("| setup | clean pair AGREE | top-1 | suspects exactly the fault |")
    print("|---|---:|---:|---:|")
    total = {"top": 0, "exact": 0, "faults": 0}
    for setup in setups:
        mine = [c for c in cases if c["setup"] == setup]
        faults = [c for c in mine if c["case"] != "clean"]
        clean = next(c for c in mine if c["case"] == "clean")
        top, exact = sum(c["right"] for c in faults), sum(c["exact"] for c in faults)
        total["top"] += top
        total["exact"] += exact
        total["faults"] += len(faults)
        print(f"| {setup} | {'yes' if clean['right'] else 'NO'} | {top}/{len(faults)} | {exact}/{len(faults)} |")
    print(f"| all | | {total['top']}/{total['faults']} | {total['exact']}/{total['faults']} |")
    for c in cases:
        if not c["exact"]:
            print(f"  {c['setup']} {c['case']}: first {c['first']}; ranks {c['ranks']}")
            for s in c["suspects"][:6]:
                print(f"      {s}")


def peak_rss_kb() -> int:
    """This process's own peak RSS in KiB: VmHWM (ru_maxrss carries the parent's over fork and exec)."""
    import resource

    for line in Path("/proc/self/status").read_text().splitlines() if Path("/proc/self/status").exists() else []:
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def scale_worker(target: str, bench: str) -> None:
    """One process of a torchrun compare: its wall time and peak RSS, printed by process 0."""

    from tracecmp.comparison.api import compare_job
    from tracecmp.comparison.torchrun import JobGroup

    start = time.perf_counter()
    with JobGroup() as group:
        result = compare_job(target, bench, group)
        mine = {"wall": time.perf_counter() - start, "rss": peak_rss_kb()}
        found = group.gather(mine)
    if result is not None:
        d = result.first_divergence
        exact = [(s.rank, s.op) for s in result.suspects] == [(d.rank, d.op)] if d else False
        print(json.dumps({"processes": found, "first": f"{d.op} rank {d.rank}" if d else None, "exact": exact}))


def scale(world: int, layers: int, processes: int) -> None:
    import resource

    import torch

    import tracecmp

    sys.path.insert(0, str(ROOT))  # workloads/ and the trace builder in tests/
    from workloads.synthetic_job import JobShape, write_job

    torch.set_num_threads(1)
    folder = Path(tempfile.mkdtemp(prefix=f"tracecmp-scale{world}-"))
    start = time.perf_counter()
    target, bench = write_job(folder, JobShape(world=world, layers=layers))
    made = time.perf_counter() - start
    ops = len(tracecmp.load(target).rank(0).ops_table)
    size = sum(f.stat().st_size for f in folder.glob("*/rank*/*.parquet"))
    print(
        f"{world} ranks x {ops:,} ops ({size / 2**20:.1f} MB of tables, both runs), written in {made:.0f} s "
        f"(peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB) in {folder}"
    )
    pooled = _compare_in_fresh_process(folder, processes)
    print(
        f"pool of {processes}: wall {pooled['wall']:.1f} s, comparing process {pooled['rss'] / 1024:.0f} MB, "
        f"largest worker {pooled['child_rss'] / 1024:.0f} MB, first divergence {pooled['first']}"
    )
    start = time.perf_counter()
    job = json.loads(_torchrun(processes, "scale-worker", str(target), str(bench)).strip().splitlines()[-1])
    walls = ", ".join(f"{p['wall']:.1f}" for p in job["processes"])
    rss = ", ".join(f"{p['rss'] / 1024:.0f}" for p in job["processes"])
    print(
        f"torchrun, {processes} processes: launch to exit {time.perf_counter() - start:.1f} s; per process wall "
        f"[{walls}] s, peak RSS [{rss}] MB; first divergence {job['first']}, suspects exactly it: {job['exact']}"
    )


def calls_alone(n: int) -> None:
    """What recording a collective costs, without a second rank to wait for (world size 1)."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    import tracecmp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    t = torch.ones(1024)
    cases = {
        "sync": lambda: dist.all_reduce(t),
        "async_op": lambda: dist.all_reduce(t, async_op=True).wait(),
        "functional": lambda: funcol.all_reduce(t, "sum", dist.group.WORLD).mul(1.0),
    }
    folder = Path(tempfile.mkdtemp(prefix="tracecmp-calls-"))
    for name, call in cases.items():
        for _ in range(20):
            call()
        start = time.perf_counter()
        for _ in range(n):
            call()
        plain = (time.perf_counter() - start) / n
        with tracecmp.TraceCompare(folder / name):
            for _ in range(20):
                call()
            start = time.perf_counter()
            for _ in range(n):
                call()
            captured = (time.perf_counter() - start) / n
        print(
            f"  {name:<11} plain {1e6 * plain:8.1f} us  captured {1e6 * captured:8.1f} us  (+{1e6 * (captured - plain):.1f} us)"
        )
    # The floor of any dispatch mode: an empty one, with and without ignore_compile_internals.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Empty(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            return func(*args, **(kwargs or {}))

    class EmptyIgnoringCompile(Empty):
        @classmethod
        def ignore_compile_internals(cls) -> bool:
            return True

    for mode in (Empty, EmptyIgnoringCompile):
        with mode():
            for _ in range(5):
                cases["sync"]()
            start = time.perf_counter()
            for _ in range(50):
                cases["sync"]()
            print(f"  sync under an empty {mode.__name__}: {1e6 * (time.perf_counter() - start) / 50:.1f} us")
    dist.destroy_process_group()


# ---- driver -------------------------------------------------------------------------------------


def _compare_in_fresh_process(folder: Path, workers: int) -> dict[str, Any]:
    code = f"""
import json, resource, time, tracecmp
start = time.perf_counter()
r = tracecmp.compare({str(folder / "target")!r}, {str(folder / "bench")!r}, workers={workers}, progress=False)
wall = time.perf_counter() - start
d = r.first_divergence
from benchmarks.bench_distributed import peak_rss_kb
print(json.dumps({{"wall": wall, "rss": peak_rss_kb(),
                   "child_rss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
                   "first": f"{{d.op}} rank {{d.rank}}" if d else None, "nodes": len(r.nodes)}}))
"""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    over = sub.add_parser("overhead")
    over.add_argument("--reps", type=int, default=7)
    over.add_argument("--steps", type=int, default=10)
    sub.add_parser("calls").add_argument("--calls", type=int, default=300)
    cmp_ = sub.add_parser("compare")
    cmp_.add_argument("--ranks", default="1,2,4")
    cmp_.add_argument("--steps", type=int, default=30)
    cmp_.add_argument("--width", type=int, default=64)
    cmp_.add_argument("--blocks", type=int, default=12)
    acc = sub.add_parser("accuracy")
    acc.add_argument("--setups", default="ddp,fsdp2,tp")
    acc.add_argument("--width", type=int, default=16)
    acc.add_argument("--json", action="store_true")
    sub.add_parser("accuracy-worker").add_argument("args", nargs=3)
    sc = sub.add_parser("scale")
    sc.add_argument("--world", type=int, default=64)
    sc.add_argument("--layers", type=int, default=64)
    sc.add_argument("--processes", type=int, default=4)
    sub.add_parser("scale-worker").add_argument("args", nargs=2)
    sub.add_parser("overhead-worker").add_argument("args", nargs=3)
    sub.add_parser("capture-worker").add_argument("args", nargs=4)
    args = parser.parse_args()
    if args.what == "overhead-worker":
        folder, reps, steps = args.args
        overhead_worker(Path(folder), int(reps), int(steps))
    elif args.what == "capture-worker":
        out, steps, width, blocks = args.args
        capture_worker(out, int(steps), int(width), int(blocks))
    elif args.what == "accuracy-worker":
        out, setups, width = args.args
        accuracy_worker(out, setups.split(","), int(width))
    elif args.what == "scale-worker":
        scale_worker(*args.args)
    elif args.what == "scale":
        scale(args.world, args.layers, args.processes)
    elif args.what == "accuracy":
        accuracy(args.setups.split(","), args.width, args.json)
    elif args.what == "calls":
        calls_alone(args.calls)
    elif args.what == "overhead":
        folder = tempfile.mkdtemp(prefix="tracecmp-bench-")  # one trace folder for both ranks, as under any torchrun
        found = json.loads(
            _torchrun(2, "overhead-worker", folder, str(args.reps), str(args.steps)).strip().splitlines()[-1]
        )
        print(
            f"2-rank DDP step ({found['ops_per_step']} ops recorded per rank, {found['threads']} thread(s) per rank): "
            f"plain {found['plain_ms']:.2f} ms, captured {found['captured_ms']:.2f} ms, "
            f"x{found['captured_ms'] / found['plain_ms']:.2f}"
        )
        for name, (plain, captured) in found["calls_us"].items():
            print(f"  {name:<11} plain {plain:8.1f} us  captured {captured:8.1f} us  (+{captured - plain:.1f} us)")
    else:
        for n in [int(r) for r in args.ranks.split(",")]:
            folder = Path(tempfile.mkdtemp(prefix=f"tracecmp-ranks{n}-"))
            _torchrun(n, "capture-worker", str(folder), str(args.steps), str(args.width), str(args.blocks))
            size = sum(f.stat().st_size for f in folder.glob("*/rank*/*.parquet"))
            for workers in sorted({1, n}):
                found = _compare_in_fresh_process(folder, workers)
                print(
                    f"ranks {n} workers {workers}: {found['nodes']:,} nodes ({size / 2**20:.1f} MB of tables), "
                    f"wall {found['wall']:.1f} s, peak RSS {found['rss'] / 1024:.0f} MB, largest worker "
                    f"{found['child_rss'] / 1024:.0f} MB, first divergence {found['first']}"
                )


if __name__ == "__main__":
    main()
