"""Capture on an accelerator, counted: host waits per recorded step and capture's overhead on the
emulated NPU (``workloads/emulated_npu``) beside the CPU's, on bench_overhead's d512 transformer.

On a device, capture computes each output's statistics with torch ops on the device and brings
them to the host once per hand-over to the writer, so a recorded step should wait for the device
no more often than the plain step does, plus at most one. The emulator counts every wait a real
device would make (copies to the host, ``.item()``, value-sized outputs, synchronize) and this
script reports them per step, traced and plain. The emulator runs every op on the CPU kernels
(with a copy of each input, its fallback's price), so its times say what capture adds on the
device path, not how fast an NPU is.

    PYTHONPATH=$PWD python benchmarks/bench_device.py                 # 3 rounds of 2 steps
    PYTHONPATH=$PWD python benchmarks/bench_device.py --rounds 5 --steps 3

A second table counts the host waits of the capture options on workloads' small MLP (2 steps).
Rounds alternate plain and traced steps on each device so machine noise hits both alike.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import tracecmp
from benchmarks.bench_overhead import build
from workloads import emulated_npu
from workloads.models import example_batch, make_model, make_optimizer, train_step

MODEL = "transformer512"


def _steps(model: Any, x: torch.Tensor, opt: torch.optim.Optimizer, count: int, tc: Any = None) -> list[float]:
    """``count`` training steps (bench_overhead's loss and optimizer); the seconds of each."""
    times = []
    for _ in range(count):
        start = time.perf_counter()
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if tc is not None:
            tc.step()
        if x.device.type != "cpu":
            torch.ops.emulated_npu.synchronize()  # the step's end, as a timed device loop waits for it
        times.append(time.perf_counter() - start)
    return times


def measure(device: str, rounds: int, steps: int) -> dict[str, Any]:
    """Median plain and traced step times on ``device``, and the emulator's counts per step."""
    model, x, _ = build(MODEL)
    model, x = model.to(device), x.to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    _steps(model, x, opt, 1)  # warm-up: allocations, lazy initialisation
    plain: list[float] = []
    traced: list[float] = []
    waits = {"plain": 0, "traced": 0}
    ops = 0
    for _ in range(rounds):
        if device != "cpu":
            emulated_npu.reset_counters()
        plain += _steps(model, x, opt, steps)
        if device != "cpu":
            counts = emulated_npu.counters()
            waits["plain"] += counts.d2h_copies + counts.syncs - steps  # less the timing's own synchronize
            emulated_npu.reset_counters()
        with tempfile.TemporaryDirectory() as folder:
            with tracecmp.TraceCompare(Path(folder) / "t", model=model) as tc:
                traced += _steps(model, x, opt, steps, tc)
            if device != "cpu":  # the session's close (the last hand-over) counted too
                counts = emulated_npu.counters()
                waits["traced"] += counts.d2h_copies + counts.syncs - steps
            ops += len(tracecmp.load(Path(folder) / "t").to_frame())
    total = rounds * steps
    return {
        "device": device,
        "plain_ms": 1e3 * statistics.median(plain),
        "traced_ms": 1e3 * statistics.median(traced),
        "ops_per_step": ops / total,
        "waits_plain": waits["plain"] / total if device != "cpu" else None,
        "waits_traced": waits["traced"] / total if device != "cpu" else None,
    }


OPTIONS: dict[str, dict[str, Any]] = {
    "stats": {},
    'overflow="record"': {"overflow": "record"},
    'overflow="raise"': {"overflow": "raise"},
    'data="tensors"': {"data": "tensors"},
}


def waits_by_option(steps: int = 2) -> list[tuple[str, int, int]]:
    """(option, host waits, ops recorded) of ``steps`` Adam steps of workloads' mlp on the npu."""
    rows = []
    for name, options in OPTIONS.items():
        torch.manual_seed(0)
        model = make_model("mlp").to("npu")
        batch = tuple(t.to("npu") for t in example_batch("mlp"))
        opt = make_optimizer(model)
        emulated_npu.reset_counters()
        with tempfile.TemporaryDirectory() as folder:
            with tracecmp.TraceCompare(Path(folder) / "t", model=model, **options) as tc:
                for _ in range(steps):
                    train_step(model, opt, batch)
                    tc.step()
            counts = emulated_npu.counters()
            rows.append((name, counts.d2h_copies + counts.syncs, len(tracecmp.load(Path(folder) / "t").to_frame())))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="steps per round and configuration")
    args = parser.parse_args()
    emulated_npu.load()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {MODEL}, {args.rounds}x{args.steps} steps")
    print("| device | plain step | traced step | overhead | ops recorded / step | host waits / step, plain | traced |")
    print("|---|---|---|---|---|---|---|")
    for device in ("cpu", "npu"):
        r = measure(device, args.rounds, args.steps)
        waits = ("-", "-") if r["waits_plain"] is None else (f"{r['waits_plain']:.2f}", f"{r['waits_traced']:.2f}")
        print(
            f"| {device} | {r['plain_ms']:.0f} ms | {r['traced_ms']:.0f} ms | {r['traced_ms'] / r['plain_ms']:.2f}x "
            f"| {r['ops_per_step']:.0f} | {waits[0]} | {waits[1]} |",
            flush=True,
        )
    print()
    print("| workloads' mlp on the npu, 2 steps | host waits | ops recorded |")
    print("|---|---|---|")
    for name, waits, ops in waits_by_option():
        print(f"| {name} | {waits} | {ops} |")


if __name__ == "__main__":
    main()
