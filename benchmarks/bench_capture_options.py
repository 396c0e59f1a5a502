"""Cost of the capture options that fix randomness and watch for overflow, per training step.

Configurations, all with statistics capture except ``plain``: the default capture, the same after
``seed_all(deterministic=True)``, ``rng="host"``, ``dropout=0.0``, ``overflow="record"`` and
``overflow="raise"``. They run interleaved, round by round, in one process (the options are per
session, determinism is a global switch set per round), and every figure is the median step time
as a ratio to the plain step's median, in wall time and in this process's CPU time (which other
jobs on a shared machine disturb less).

    python benchmarks/bench_capture_options.py                    # block64 and mlp, 5 rounds
    python benchmarks/bench_capture_options.py --models block64 --rounds 9 --steps 10
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tracecmp  # noqa: E402
from benchmarks.bench_overhead import build  # noqa: E402

CONFIGS: dict[str, dict[str, Any]] = {
    "plain": {},
    "stats": {},
    "stats, seed_all(deterministic=True)": {},
    'stats, rng="host"': {"rng": "host"},
    "stats, dropout=0.0": {"dropout": 0.0},
    'stats, overflow="record"': {"overflow": "record"},
    'stats, overflow="raise"': {"overflow": "raise"},
}


def _steps(
    step: Callable[[], Any], count: int, model: Any, options: dict[str, Any] | None, workdir: Path
) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of ``count`` steps, traced with ``options`` unless they are None."""
    times = []
    if options is None:
        for _ in range(count):
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            times.append((time.perf_counter() - t0, time.process_time() - c0))
        return times
    path = workdir / "trace"
    with tracecmp.TraceCompare(path, model=model, **options) as tc:
        for _ in range(count):
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            tc.step()  # the step boundary hands finished steps to the writer when due: part of the cost
            times.append((time.perf_counter() - t0, time.process_time() - c0))
        # The session's exit hands over the steps still buffered and waits for the writer: spread
        # over the steps like the hand-overs a longer run would make on its way.
        t0, c0 = time.perf_counter(), time.process_time()
    wall, cpu = (time.perf_counter() - t0) / count, (time.process_time() - c0) / count
    times = [(w + wall, c + cpu) for w, c in times]
    shutil.rmtree(path)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=["block64", "mlp"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    workdir = Path(tempfile.mkdtemp(prefix="bench-options-"))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} rounds x {args.steps} steps")
    for name in args.models:
        model, _, step = build(name)
        step()  # warm-up
        times: dict[str, list[tuple[float, float]]] = {config: [] for config in CONFIGS}
        order = list(CONFIGS.items())
        for round_ in range(args.rounds):
            random.Random(round_).shuffle(order)  # no configuration always runs right after another
            for config, options in order:
                tracecmp.seed_all(0, deterministic="deterministic=True" in config)
                times[config] += _steps(step, args.steps, model, None if config == "plain" else options, workdir)
        tracecmp.seed_all(0, deterministic=False)
        wall0 = statistics.median(w for w, _ in times["plain"])
        cpu0 = statistics.median(c for _, c in times["plain"])
        print(f"\n{name}: plain step {wall0 * 1e3:.2f} ms wall, {cpu0 * 1e3:.2f} ms CPU")
        print(f"  {'configuration':40s} {'wall ms':>9s} {'ratio':>6s} {'CPU ms':>9s} {'ratio':>6s}")
        for config, values in times.items():
            wall = statistics.median(w for w, _ in values)
            cpu = statistics.median(c for _, c in values)
            print(f"  {config:40s} {wall * 1e3:9.2f} {wall / wall0:6.2f} {cpu * 1e3:9.2f} {cpu / cpu0:6.2f}")
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
