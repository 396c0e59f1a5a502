"""Capture overhead of a ``torch.compile``d training step, side by side: untraced, boundary, graph.

One process per (model, backend): the model is compiled once (inside a session that records no
step, so that capture knows its regions), then rounds interleave the configurations so machine
noise hits each alike; every figure is the median step time as a ratio to the untraced compiled
step's. Each traced configuration records every step of its round in one session (statistics,
hand-overs to the writer every second as by default).

    python benchmarks/bench_compile.py                              # both models, both backends
    python benchmarks/bench_compile.py --models tiny --backends aot_eager --rounds 2
    python benchmarks/bench_compile.py --threads 1                  # at one intra-op thread

``--compile-time`` also times the first compile of the model outside a session and inside one
(capture traces each graph through AOT autograd a second time), caches warm for both.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODELS = {
    "tiny": dict(layers=2, dim=32, heads=4, batch=2, length=8),
    "gpt-d256": dict(layers=4, dim=256, heads=8, batch=8, length=64),
}
CONFIGS = ("compiled", "boundary", "graph", "boundary-tensors")
STEPS = {"tiny": 40, "gpt-d256": 8}


def worker(model_name: str, backend: str, rounds: int, threads: int | None, compile_time: bool) -> dict[str, Any]:
    import torch

    sys.path.insert(0, str(ROOT))
    import tracecmp
    from workloads.compile_models import VOCAB, TinyGPT

    if threads:
        torch.set_num_threads(threads)
    spec = MODELS[model_name]
    torch.manual_seed(0)
    model = TinyGPT(layers=spec["layers"], dim=spec["dim"], heads=spec["heads"])
    g = torch.Generator().manual_seed(0)
    batch = (
        torch.randint(0, VOCAB, (spec["batch"], spec["length"]), generator=g),
        torch.randint(0, VOCAB, (spec["batch"], spec["length"]), generator=g),
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, backend=backend)
    tmp = Path(tempfile.mkdtemp(prefix="bench-compile-"))
    out: dict[str, Any] = {"model": model_name, "backend": backend, "threads": torch.get_num_threads()}

    def step() -> None:
        compiled(*batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    if compile_time:
        step()  # fills inductor's caches, so both timed compiles below find them alike
        torch._dynamo.reset()
        start = time.perf_counter()
        step()
        out["compile_plain_s"] = time.perf_counter() - start
        torch._dynamo.reset()
        start = time.perf_counter()
        with tracecmp.TraceCompare(tmp / "compile", model=model, steps=[]):
            step()
        out["compile_traced_s"] = time.perf_counter() - start
    else:
        with tracecmp.TraceCompare(tmp / "warm", model=model, steps=[]):
            step()
    for _ in range(3):
        step()
    times: dict[str, list[float]] = {c: [] for c in CONFIGS}
    n = STEPS[model_name]
    for r in range(rounds):
        for config in CONFIGS:
            if config == "compiled":
                for _ in range(n):
                    start = time.perf_counter()
                    step()
                    times[config].append(time.perf_counter() - start)
                continue
            mode, _, data = config.partition("-")
            with tracecmp.TraceCompare(tmp / f"{config}-{r}", model=model, compiled=mode, data=data or "stats") as tc:
                for _ in range(n):
                    start = time.perf_counter()
                    step()
                    tc.step()
                    times[config].append(time.perf_counter() - start)
    shutil.rmtree(tmp, ignore_errors=True)  # the tensors rounds' traces: gigabytes of a d256 model
    base = statistics.median(times["compiled"])
    out["compiled_ms"] = base * 1e3
    for config in CONFIGS[1:]:
        out[config] = statistics.median(times[config]) / base
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--backends", nargs="*", default=["inductor", "aot_eager"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    parser.add_argument("--compile-time", action="store_true")
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "BACKEND"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, args.rounds, args.threads, args.compile_time)))
        return
    print(f"load: {os.getloadavg()[0]:.2f} (1 min)", flush=True)
    header = f"{'model':<10} {'backend':<10} {'thr':>3} {'compiled ms':>11} " + " ".join(
        f"{c:>17}" for c in CONFIGS[1:]
    )
    if args.compile_time:
        header += f" {'compile s plain':>16} {'traced':>7}"
    print(header)
    for model in args.models:
        for backend in args.backends:
            command = [sys.executable, __file__, "--worker", model, backend, "--rounds", str(args.rounds)]
            if args.threads:
                command += ["--threads", str(args.threads)]
            if args.compile_time:
                command.append("--compile-time")
            done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            if done.returncode or not lines:
                print(f"{model:<10} {backend:<10} failed: {done.stderr.strip().splitlines()[-1:]}")
                continue
            row = json.loads(lines[-1])
            text = f"{model:<10} {backend:<10} {row['threads']:>3} {row['compiled_ms']:>11.2f} " + " ".join(
                f"{row[c]:>16.2f}x" for c in CONFIGS[1:]
            )
            if args.compile_time:
                text += f" {row['compile_plain_s']:>16.1f} {row['compile_traced_s']:>7.1f}"
            print(text, flush=True)


if __name__ == "__main__":
    main()
