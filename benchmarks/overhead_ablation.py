"""Where a traced training step's time goes: dispatch, per-op capture, the statistics pass, writing.

One process, configurations interleaved round by round, one training step (forward, backward,
Adam) of the overhead benchmark's models (``bench_overhead.build``):

* ``plain``: untraced;
* ``empty mode``: an empty ``TorchDispatchMode`` written in Python;
* ``C pass-through``: the same mode with ``tracecmp._crecord.passthrough`` bound as its
  ``__torch_dispatch__``, as capture binds its C per-op path: the op re-dispatched exactly as
  capture does it, nothing recorded. The floor of any capture built on a dispatch mode with a
  CPython-only native part;
* ``no statistics``: tracecmp's per-op path with the statistics pass replaced by a constant row,
  its buffers dropped at each step: everything capture does but reading the tensors;
* ``capture only``: tracecmp's per-op path, its buffers dropped at each step instead of written;
* ``flush_secs=0``: a chunk written per step;
* ``flush_secs=1``: the default, chunks shared by the steps of each second.

Each traced figure is the mean per step over the whole session, its exit included (the last
hand-over and the wait for the writer), so deferred writing is paid for. Beside the wall-clock
time, the process's CPU time per step: on a shared machine it moves less with the load (at one
thread; with more, torch's threads spin between ops and count too).

Then one op alone (``torch.add`` of two 8x8 tensors, and the view ``t()``), in microseconds:
plain, under the empty mode and the C pass-through, captured by the C per-op path and by its
Python reference; and what the writer's thread spends on one chunk (250 MLP steps): building the
Arrow tables from the column buffers (holding the GIL) and encoding them as Parquet (not holding
it).

    BENCH_THREADS=1 python benchmarks/overhead_ablation.py --models mlp block64 --rounds 5
    BENCH_THREADS=1 python benchmarks/overhead_ablation.py --models transformer512 gpt2 --rounds 3 --seconds 3

``BENCH_THREADS`` sets torch's thread count (default: torch's own).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tracecmp  # noqa: E402
from benchmarks.bench_overhead import build  # noqa: E402
from tracecmp.trace.columns import Columns  # noqa: E402
from tracecmp.trace.schema import OPS_SCHEMA, TENSORS_SCHEMA  # noqa: E402

CONFIGS = ("plain", "empty mode", "C pass-through", "no statistics", "capture only", "flush_secs=0", "flush_secs=1")
_NO_STATISTICS = (0.0, 0.0, 0.0, 0.0, 0, 0, 0)


class EmptyMode(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


class PassThroughMode(TorchDispatchMode):
    """A dispatch mode whose ``__torch_dispatch__`` is the C pass-through, bound per instance."""

    def __init__(self) -> None:
        super().__init__()
        from tracecmp.capture import mode as capture_mode
        from tracecmp.capture import native

        if capture_mode._crecord is None:
            raise SystemExit(f"tracecmp._crecord is not available: {native.error('_crecord')}")
        self.__torch_dispatch__ = types.MethodType(capture_mode._crecord.passthrough, self)  # type: ignore[method-assign]


def drop_rows(mode: Any) -> None:
    """Throw the mode's buffered rows away (what "capture only" does instead of writing them)."""
    from tracecmp.capture.native import NUMBER_ARRAY

    mode.rows = Columns(OPS_SCHEMA, number_array=NUMBER_ARRAY)
    mode.tensor_rows = Columns(TENSORS_SCHEMA, number_array=NUMBER_ARRAY)


def per_step(
    config: str, step: Callable[[], Any], model: torch.nn.Module, steps: int, workdir: Path
) -> tuple[float, float]:
    """Mean wall-clock and CPU seconds per step of ``steps`` steps under ``config``."""
    from tracecmp.capture import stats

    t0, c0 = time.perf_counter(), time.process_time()
    if config == "plain":
        for _ in range(steps):
            step()
    elif config in ("empty mode", "C pass-through"):
        mode_type = EmptyMode if config == "empty mode" else PassThroughMode
        for _ in range(steps):
            with mode_type():
                step()
    else:
        path = workdir / "trace"
        flush_secs = 0.0 if config == "flush_secs=0" else 1.0
        native = stats._native_stats
        if config == "no statistics":
            stats._native_stats = lambda *_: _NO_STATISTICS
        try:
            with tracecmp.TraceCompare(path, model=model, flush_secs=flush_secs) as tc:
                mode = tc._mode
                assert mode is not None
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(steps):
                    step()
                    if config in ("capture only", "no statistics"):
                        drop_rows(mode)
                    tc.step()
        finally:
            stats._native_stats = native
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        shutil.rmtree(path)
        return wall / steps, cpu / steps
    return (time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps


def per_op(workdir: Path, rounds: int) -> None:
    """Microseconds per call of one small op and one view: plain, empty mode, C pass-through, C path, Python path."""
    from tracecmp.capture import mode as capture_mode

    a, b = torch.randn(8, 8), torch.randn(8, 8)
    ops = {"add 8x8": lambda: torch.add(a, b), "view t()": lambda: a.t()}

    def timed(op: Callable[[], Any], calls: int = 20000) -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            op()
        return (time.perf_counter() - t0) / calls * 1e6

    def captured(op: Callable[[], Any], native: bool) -> float:
        use_native = capture_mode.USE_NATIVE
        capture_mode.USE_NATIVE = native and capture_mode._crecord is not None
        try:
            with tracecmp.TraceCompare(workdir / "micro", flush_secs=3600) as tc:
                mode = tc._mode
                assert mode is not None
                total = 0.0
                for _ in range(20):  # 1,000 calls at a time, the buffers dropped in between
                    total += timed(op, 1000)
                    drop_rows(mode)
            shutil.rmtree(workdir / "micro")
            return total / 20
        finally:
            capture_mode.USE_NATIVE = use_native

    def under(mode_type: type[TorchDispatchMode]) -> Callable[[Callable[[], Any]], float]:
        def run(op: Callable[[], Any]) -> float:
            with mode_type():
                return timed(op)

        return run

    configs: dict[str, Callable[[Callable[[], Any]], float]] = {
        "plain": timed,
        "empty mode": under(EmptyMode),
        "C pass-through": under(PassThroughMode),
        "captured (C)": lambda op: captured(op, True),
        "captured (Python)": lambda op: captured(op, False),
    }
    times = {(name, config): [] for name in ops for config in configs}
    for _ in range(rounds):
        for name, op in ops.items():
            for config, run in configs.items():
                times[(name, config)].append(run(op))
    print(f"\none op, us per call (median of {rounds} rounds)")
    print(f"  {'op':10s} " + " ".join(f"{config:>17s}" for config in configs))
    for name in ops:
        print(f"  {name:10s} " + " ".join(f"{statistics.median(times[(name, c)]):17.2f}" for c in configs))


def chunk_cost(workdir: Path, rounds: int) -> None:
    """Milliseconds the writer spends on one chunk of 250 MLP steps, by stage (best of ``rounds``)."""
    from tracecmp.trace.writer import parquet_bytes

    model, _, step = build("mlp")
    with tracecmp.TraceCompare(workdir / "chunk", model=model, flush_secs=3600) as tc:
        for _ in range(250):
            step()
            tc.step()
        assert tc._mode is not None
        ops, tensors, _, _ = tc._mode.take()
    shutil.rmtree(workdir / "chunk")

    stages: dict[str, Callable[[], Any]] = {
        "ops: Columns.table()": ops.table,
        "ops: table + Parquet": lambda: parquet_bytes(ops.table()),
        "tensors: Columns.table()": tensors.table,
        "tensors: table + Parquet": lambda: parquet_bytes(tensors.table()),
    }
    print(f"\none chunk of 250 mlp steps ({len(ops):,} op rows, {len(tensors):,} tensor rows), ms, best of {rounds}")
    for name, stage in stages.items():
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            stage()
            best = min(best, time.perf_counter() - t0)
        print(f"  {name:28s} {best * 1e3:7.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=["mlp", "block64"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.5, help="traced seconds per configuration and round")
    args = parser.parse_args()
    if os.environ.get("BENCH_THREADS", "default") != "default":
        torch.set_num_threads(int(os.environ["BENCH_THREADS"]))
    workdir = Path(tempfile.mkdtemp(prefix="overhead-ablation-"))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}")
    for name in args.models:
        model, _, step = build(name)
        for _ in range(3):
            step()
        per_step("capture only", step, model, 2, workdir)  # the first traced steps build caches
        steps = max(5, int(args.seconds / per_step("capture only", step, model, 3, workdir)[0]))
        times: dict[str, list[tuple[float, float]]] = {config: [] for config in CONFIGS}
        for _ in range(args.rounds):
            for config in CONFIGS:
                times[config].append(per_step(config, step, model, steps, workdir))
        plain = statistics.median(wall for wall, _ in times["plain"])
        plain_cpu = statistics.median(cpu for _, cpu in times["plain"])
        print(
            f"\n{name}: {steps} steps per round, {args.rounds} rounds (median of the rounds' means); "
            f"load average {os.getloadavg()[0]:.1f}"
        )
        print(f"  {'configuration':16s} {'ms/step':>8s} {'ratio':>6s} {'CPU ms/step':>12s} {'ratio':>6s}")
        for config, values in times.items():
            wall = statistics.median(w for w, _ in values)
            cpu = statistics.median(c for _, c in values)
            print(f"  {config:16s} {wall * 1e3:8.3f} {wall / plain:6.2f} {cpu * 1e3:12.3f} {cpu / plain_cpu:6.2f}")
    per_op(workdir, args.rounds)
    chunk_cost(workdir, args.rounds)
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
