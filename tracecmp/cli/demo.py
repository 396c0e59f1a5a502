"""``tracecmp demo``: capture, compare and report on a built-in model with an emulated fault."""

from __future__ import annotations

import argparse
import time

# The names of tracecmp.demo.FAULTS, spelled out so that building the CLI does not import torch.
FAULT_NAMES = ("fp16-matmul", "gelu-tanh", "softmax-fp16")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="run the whole job on a built-in model with an emulated fault (no downloads)",
        description="Train a small built-in transformer twice (bench: fp32 on the CPU; target: the same "
        "with an emulated fault), capture both, compare them and write the report. Faults: "
        "fp16-matmul: an NPU whose matrix units compute in fp16 (the loss-scaled gradient overflows); "
        "gelu-tanh: GELU swapped for its tanh approximation in one block; "
        "softmax-fp16: a softmax kernel computing in fp16.",
    )
    parser.add_argument("-o", "--out", default="tracecmp-demo", help="output folder (default: %(default)s)")
    parser.add_argument(
        "--fault", choices=FAULT_NAMES, default="fp16-matmul", help="emulated fault (default: %(default)s)"
    )
    parser.add_argument("--steps", type=int, default=2, help="training steps per run (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=1234, help="seed of weights and data (default: %(default)s)")
    parser.add_argument(
        "--emulated-npu",
        action="store_true",
        help="run the target on the emulated NPU of tracecmp's source checkout (a PrivateUse1 device "
        "'npu' over host memory, built with c++ on first use) instead of the CPU; the exit code is then "
        "compare's: 1 when the runs diverge",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Exit code 0 when the demo ran; it prints whether the divergence found is the emulated one.
    With ``--emulated-npu``, compare's exit code (the device path gated like a comparison)."""
    from tracecmp.cli.compare import exit_status
    from tracecmp.demo import FAULTS, run_demo

    fault = FAULTS[args.fault]
    where = "on the emulated npu " if args.emulated_npu else ""
    print(f"tracecmp demo: bench runs in fp32 on the CPU; the target {where}emulates {fault.description}")
    start = time.perf_counter()
    outcome = run_demo(args.out, fault=args.fault, steps=args.steps, seed=args.seed, emulated_npu=args.emulated_npu)
    for name, losses in (("bench ", outcome.bench_losses), ("target", outcome.target_losses)):
        print(f"  {name} losses: {', '.join(f'{v:.6f}' for v in losses)}")
    print()
    print(outcome.result.summary())
    print()
    d = outcome.result.first_divergence
    if outcome.found:
        print(f"Found it: the first divergence is in {fault.module} ({fault.op}), where the emulated fault is.")
    elif d is None:
        print(f"Missed it: no divergence found, but the emulated fault is in {fault.module} ({fault.op}).")
    else:
        print(
            f"Missed it: localized to {d.module or '<top>'}, but the emulated fault is in {fault.module} ({fault.op})."
        )
    print(f"Report: {outcome.report}  (traces and CSV tables beside it; {time.perf_counter() - start:.1f} s)")
    return exit_status(outcome.result.status) if args.emulated_npu else 0
