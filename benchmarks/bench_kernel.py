"""Throughput of the fused C++ statistics pass against pure torch and against a memory copy.

For each size and dtype, three things read the same CPU tensor, interleaved round by round so
that machine noise hits them alike; the table shows medians in GB/s of input read:

* ``C++``: ``tensor_stats_row`` (min, max, mean, norm, NaN/Inf counts, checksum; Python call
  included);
* ``torch``: the best pure-torch equivalent, ``torch.aminmax`` + ``sum`` + ``vector_norm`` in the
  tensor's dtype with NaN/Inf read off min/max, plus one ``tolist`` to get host numbers (no
  counts, no checksum, less precise accumulation);
* ``copy``: ``dst.copy_(src)`` of the same tensor (reads it once and writes it once).

Run: ``python benchmarks/bench_kernel.py`` (add ``--threads 1`` for one thread only; by default
torch's thread count, then one). From ``PARALLEL_MIN`` elements the pass runs on torch's
intra-op threads (``TRACECMP_CSTATS_POOL=threads``: on its own pool instead). The kernel
uses the best instruction set the CPU has; ``TRACECMP_CSTATS_ISA=avx2`` (or ``baseline``) in the
environment caps it, to compare copies. The last line names the copy that ran.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from typing import Callable

import torch

from tracecmp.capture import native
from tracecmp.capture.stats import native_available, tensor_stats_row

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


def torch_equivalent(x: torch.Tensor) -> list[float]:
    """min, max, sum, norm and NaN/Inf presence with the fewest torch passes."""
    lo, hi = torch.aminmax(x)
    total = x.sum()
    norm = torch.linalg.vector_norm(x)
    # NaN anywhere makes min/max NaN; an Inf shows in them: no extra pass for the flags.
    flags = torch.stack([lo.isnan(), lo.isinf() | hi.isinf()]).to(x.dtype)
    return torch.cat([torch.stack([lo, hi, total, norm]), flags]).tolist()


def median_seconds(fns: list[Callable[[], object]], budget_s: float, min_rounds: int) -> list[float]:
    """Median time of each function, timed in interleaved rounds."""
    for fn in fns:  # warm up (page faults, thread pools, lazy init)
        fn()
    times: list[list[float]] = [[] for _ in fns]
    start = time.perf_counter()
    while len(times[0]) < min_rounds or time.perf_counter() - start < budget_s:
        for fn, acc in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - t0)
    return [statistics.median(acc) for acc in times]


def bench(numel: int, dtype: torch.dtype, budget_s: float) -> tuple[float, float, float]:
    """GB/s of input read for the C++ pass, the torch equivalent and a copy."""
    x = torch.randn(numel, dtype=torch.float32).to(dtype)
    dst = torch.empty_like(x)
    fns: list[Callable[[], object]] = [lambda: tensor_stats_row(x), lambda: torch_equivalent(x), lambda: dst.copy_(x)]
    secs = median_seconds(fns, budget_s, min_rounds=15)
    nbytes = x.numel() * x.element_size()
    return tuple(nbytes / s / 1e9 for s in secs)  # type: ignore[return-value]


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo where there is one."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="65536,262144,1048576,16777216", help="comma-separated element counts")
    parser.add_argument("--dtypes", default="fp32,bf16", help=f"comma-separated, of {','.join(DTYPES)}")
    parser.add_argument("--threads", default=f"{torch.get_num_threads()},1", help="thread counts to run, in order")
    parser.add_argument("--budget", type=float, default=1.0, help="seconds of timing per row (at least 15 rounds)")
    args = parser.parse_args()
    if not native_available():
        raise SystemExit("tracecmp._cstats is not built: pip install --no-build-isolation -e .")
    load = os.getloadavg()[0]
    print("| elements | dtype | threads | C++ GB/s | torch GB/s | copy GB/s | C++ / torch | C++ / copy |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for numel in (int(s) for s in args.sizes.split(",")):
            for name in args.dtypes.split(","):
                ours, ref, copy = bench(numel, DTYPES[name], args.budget)
                print(
                    f"| {numel:,} | {name} | {threads} | {ours:.1f} | {ref:.1f} | {copy:.1f} "
                    f"| {ours / ref:.2f}x | {ours / copy:.0%} |",
                    flush=True,
                )
    print(
        f"\n{cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, kernel copy {native.cstats.ISA}, "
        f"threads from {native.cstats.POOL} (parallel from {native.cstats.PARALLEL_MIN:,} elements); "
        f"1-min load average {load:.2f} before, {os.getloadavg()[0]:.2f} after"
    )


if __name__ == "__main__":
    main()
