"""Where capture-time self-checks spend their time: by op inside a training step, and the same
check's preparation hot in a loop beside right after a big kernel.

``bench_overhead.py --configs plain tracecmp-stats tracecmp-selfcheck`` says what the checks add to
a step; this script says where it goes and why per-call tuning stops paying:

1. **In the step.** ``SelfChecker.prepare`` (before each checked op: the sampled inputs gathered),
   ``finish`` (after it: the sampled outputs gathered, the check queued) and ``collect`` (the
   float64 recomputation of the queued checks, at each hand-over to the writer) are timed around
   every call of a few traced steps; the table lists the ops that cost most, per call and per step.
   Calls the C per-op path gathers through a recipe never reach ``prepare`` and are not listed.
2. **Hot and cold.** The preparation of a few representative calls is timed in a loop (its code
   and data in the caches), then once after each of many big kernels (a 64 MiB copy, a 1024 x 1024
   matmul), which evict the interpreter's code and objects as a training step's kernels do.
3. **Alternated** (``--rounds N``): what the checks add to a whole step, measured in one process,
   configurations taking turns round by round (plain, statistics, checks, checks with nothing
   checked in Python: only the calls with a recipe), a few steps each after two untimed ones.
   Separate processes (``bench_overhead.py``) differ by more than the checks cost at two threads
   on this machine; within one process that noise is shared.

    python benchmarks/bench_self_check_cost.py                       # d512 transformer, 2 threads
    python benchmarks/bench_self_check_cost.py --model resnet50 --threads 1 --top 15
    python benchmarks/bench_self_check_cost.py --rounds 8 --steps 4 --alternated-only
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _timed(
    totals: dict[tuple[str, str], list[float]], phase: str, method: Callable[..., Any], name_of: Callable[..., str]
) -> Callable[..., Any]:
    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            entry = totals[(phase, name_of(*args))]
            entry[0] += 1
            entry[1] += time.perf_counter() - start

    return timed


def _op_name(func: Any) -> str:
    return str(func).removeprefix("aten.")


def in_step(model_name: str, steps: int, top: int) -> None:
    """Time every checker call of ``steps`` traced steps (after one untimed), by phase and op."""
    import tracecmp
    from benchmarks.bench_overhead import build
    from tracecmp.capture.selfcheck import SelfChecker

    model, _, step = build(model_name)
    step()
    totals: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0, 0.0])
    originals = SelfChecker.prepare, SelfChecker.finish, SelfChecker.collect
    with tempfile.TemporaryDirectory() as folder:
        plain = time.perf_counter()
        for _ in range(steps):
            step()
        plain = (time.perf_counter() - plain) / steps
        with tracecmp.TraceCompare(Path(folder) / "trace", model=model, self_check="sample") as tc:
            step()
            tc.step()
            SelfChecker.prepare = _timed(totals, "prepare", originals[0], lambda func, *_: _op_name(func))  # type: ignore[method-assign]
            SelfChecker.finish = _timed(totals, "finish", originals[1], lambda plan, *_: _op_name(plan.func))  # type: ignore[method-assign]
            SelfChecker.collect = _timed(totals, "collect", originals[2], lambda *_: "(all queued checks)")  # type: ignore[method-assign]
            try:
                traced = time.perf_counter()
                for _ in range(steps):
                    step()
                    tc.step()
                traced = (time.perf_counter() - traced) / steps
            finally:
                SelfChecker.prepare, SelfChecker.finish, SelfChecker.collect = originals  # type: ignore[method-assign]
    spent = sum(seconds for _, seconds in totals.values()) / steps
    calls = sum(n for (phase, _), (n, _) in totals.items() if phase == "prepare") / steps
    print(
        f"{model_name}: plain step {plain * 1e3:.1f} ms, traced with checks {traced * 1e3:.1f} ms; "
        f"in the checker {spent * 1e3:.1f} ms a step ({spent / plain:.0%} of the plain step), "
        f"{calls:.0f} checked calls a step\n"
    )
    print("| phase | op | calls a step | us a call | ms a step |")
    print("|---|---|---:|---:|---:|")
    for (phase, name), (n, seconds) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"| {phase} | {name} | {n / steps:.0f} | {seconds / n * 1e6:.1f} | {seconds / steps * 1e3:.2f} |")
    print()


def hot_and_cold(reps: int) -> None:
    """One call's preparation in a loop, and after each of ``reps`` big kernels."""
    import torch

    from tracecmp.capture.selfcheck import SelfChecker

    aten = torch.ops.aten
    checker = SelfChecker()
    x, y = torch.randn(512, 512), torch.randn(512, 2048)
    p, g = torch.randn(512, 2048), torch.randn(512, 2048)
    w, b = torch.randn(512), torch.randn(512)
    calls = {
        "mm (512 x 512) @ (512 x 2048)": (aten.mm.default, (x, y)),
        "add_ of a 512 x 2048 parameter": (aten.add_.Tensor, (p, g)),
        "gelu of 512 x 2048": (aten.gelu.default, (g,)),
        "native_layer_norm of 4 x 128 x 512": (
            aten.native_layer_norm.default,
            (torch.randn(4, 128, 512), [512], w, b, 1e-5),
        ),
    }
    source, sink = torch.randn(16 << 20), torch.empty(16 << 20)
    left, right = torch.randn(1024, 1024), torch.randn(1024, 1024)
    before: dict[str, Callable[[], Any]] = {
        "hot (in a loop)": lambda: None,
        "after a 64 MiB copy": lambda: sink.copy_(source),
        "after a 1024 x 1024 matmul": lambda: left @ right,
    }
    print(f"| call ({torch.get_num_threads()} threads) | " + " | ".join(f"prepare, {k}" for k in before) + " |")
    print("|---|" + "---:|" * len(before))
    for label, (func, args) in calls.items():
        cells = []
        for evict in before.values():
            spent = 0.0
            for _ in range(reps):
                evict()
                start = time.perf_counter()
                checker.prepare(func, args, {})
                spent += time.perf_counter() - start
            cells.append(f"{spent / reps * 1e6:.0f} us")
        print(f"| {label} | " + " | ".join(cells) + " |")


def _classify_only(self: Any, func: Any, args: Any, kwargs: Any) -> None:
    """``SelfChecker.prepare`` that checks nothing but still classifies the op: the per-op path
    sends an op it has no kind for to the Python reference, every call."""
    self.kind_of(func)


def alternated(model_name: str, rounds: int, steps: int) -> None:
    """Steps of each configuration in turn, ``rounds`` times, in this process: medians and what
    the checks add beside statistics alone, as a share of the plain step."""
    import statistics

    import tracecmp
    from benchmarks.bench_overhead import build
    from tracecmp.capture.selfcheck import SelfChecker

    model, _, step = build(model_name)
    step()
    prepare = SelfChecker.prepare
    configs = ("plain", "statistics", "checks", "checks with a recipe only")
    times: dict[str, list[float]] = {c: [] for c in configs}
    for _ in range(rounds):
        for config in configs:
            with tempfile.TemporaryDirectory() as folder:
                if config == "plain":
                    for i in range(steps + 2):
                        start = time.perf_counter()
                        step()
                        if i >= 2:
                            times[config].append(time.perf_counter() - start)
                    continue
                if config == "checks with a recipe only":  # the usual path's checks left out
                    SelfChecker.prepare = _classify_only  # type: ignore[method-assign]
                mode = "off" if config == "statistics" else "sample"
                try:
                    with tracecmp.TraceCompare(Path(folder) / "trace", model=model, self_check=mode) as tc:
                        for i in range(steps + 2):  # the first two teach the recipes
                            start = time.perf_counter()
                            step()
                            tc.step()
                            if i >= 2:
                                times[config].append(time.perf_counter() - start)
                finally:
                    SelfChecker.prepare = prepare  # type: ignore[method-assign]
    median = {c: statistics.median(t) for c, t in times.items()}
    print(
        f"| {model_name}, alternated ({rounds} rounds of {steps} steps) | step (median) | the plain step's"
        " | added by the checks |"
    )
    print("|---|---:|---:|---:|")
    for config in configs:
        added = median[config] - median["statistics"]
        share = f"{added * 1e3:.3g} ms ({added / median['plain']:.1%} of the plain step)" if "checks" in config else ""
        ratio = median[config] / median["plain"]
        print(f"| {config} | {median[config] * 1e3:.3g} ms | {ratio:.2f}x | {share} |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="transformer512", help="a model of bench_overhead.py")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own)")
    parser.add_argument("--steps", type=int, default=3, help="timed traced steps")
    parser.add_argument("--top", type=int, default=12, help="ops listed")
    parser.add_argument("--reps", type=int, default=200, help="prepares timed per call and setting")
    parser.add_argument("--rounds", type=int, default=0, help="also the alternated table, of this many rounds")
    parser.add_argument("--alternated-only", action="store_true", help="only the alternated table")
    args = parser.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.alternated_only:
        in_step(args.model, args.steps, args.top)
        hot_and_cold(args.reps)
    if args.rounds:
        alternated(args.model, args.rounds, args.steps)


if __name__ == "__main__":
    main()
