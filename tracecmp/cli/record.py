"""``tracecmp record [OPTIONS] -- python train.py ARGS``: capture a program without editing it.

The program runs unchanged, in this process, as ``__main__``; its exit status, output, ``sys.argv``
and ``__main__`` are what they are without tracecmp. Capture starts at the first forward of a
``torch.nn.Module`` (model construction and weight initialisation are not recorded), each
``optimizer.step()`` ends a step, module paths read as the outermost running module's
``named_modules()`` spells them. After the last selected step the trace is committed and marked
complete, everything tracecmp installed is removed and the program runs on at full speed (or ends
there with ``--exit-after``). Only this process is recorded: DataLoader workers and other processes
the program starts record nothing.

Under torchrun either form works, each rank writing ``rank<R>/`` of one trace folder::

    tracecmp record -o runs/bench -- torchrun --nproc-per-node 2 train.py
    torchrun --nproc-per-node 2 -m tracecmp record -o runs/bench -- train.py
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

DESCRIPTION = """Run a Python program unchanged and record every op of its first steps (each
optimizer.step() ends a step) into a trace folder. Exit status, output, sys.argv and __main__ are
the program's own; tracecmp's few lines on stderr start with "tracecmp:" (--quiet drops them)."""

EPILOG = """examples:
  tracecmp record -- python train.py --lr 0.1
  tracecmp record -o runs/target --steps 0-3 --data tensors -- -m mypkg.train
  tracecmp record -o runs/bench -- torchrun --nproc-per-node 2 train.py
Without -o the trace goes to $TRACECMP_DIR/<program>-<date>-<time> (TRACECMP_DIR defaults to ./tracecmp-traces)."""


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "record",
        help="capture a program without editing it: tracecmp record -- python train.py",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_capture_options(parser)
    parser.add_argument(
        "--exit-after", action="store_true", help="end the program (status 0) once the last selected step is recorded"
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="print nothing of tracecmp's own on stderr")
    parser.add_argument(
        "program",
        nargs=argparse.REMAINDER,
        metavar="-- COMMAND",
        help="the program: python train.py ARGS, -m pkg.mod ARGS, torchrun ... train.py",
    )
    parser.set_defaults(run=run)


def add_capture_options(parser: argparse.ArgumentParser) -> None:
    """The options of a capture (shared with ``tracecmp ab``)."""
    parser.add_argument(
        "-o", "--out", help="trace folder (default: a new folder under $TRACECMP_DIR or ./tracecmp-traces)"
    )
    parser.add_argument("-f", "--force", action="store_true", help="replace a trace already in the folder")
    parser.add_argument(
        "--steps",
        default="0,1",
        type=parse_steps,
        help="steps to record: 0,1 (default), 0-3, 2,5 or all; each optimizer.step() ends a step",
    )
    parser.add_argument(
        "--data",
        choices=("stats", "tensors"),
        default="stats",
        help="stats: statistics of every tensor (default); tensors: also the tensors themselves",
    )
    parser.add_argument(
        "--only",
        metavar="SPEC",
        help='with --data tensors: save tensors only for these ops, e.g. "modules=h.1,h.2;steps=0" '
        "(fields modules, ops, steps, phases; statistics stay on for every op)",
    )
    parser.add_argument("--stack", action="store_true", help="keep each op's whole user stack")
    parser.add_argument(
        "--rng",
        choices=("device", "host"),
        default="device",
        help="host: random ops on an accelerator draw from the CPU generator (same numbers on every device)",
    )
    parser.add_argument("--no-dropout", action="store_true", help="every dropout acts with p=0")
    parser.add_argument(
        "--overflow",
        choices=("record", "raise"),
        help="note (or stop at) the first op whose finite inputs gave NaN/Inf",
    )
    parser.add_argument("--sync", action="store_true", help="every step is on disk when the next begins")
    parser.add_argument(
        "--flush-secs",
        type=float,
        default=1.0,
        metavar="S",
        help="hand steps to the writer every S seconds (default 1)",
    )
    parser.add_argument(
        "--self-check",
        choices=("off", "sample", "full"),
        default="off",
        help="check each op's own computation against its inputs in float64 as it runs: on a sample "
        "of its outputs, or all of them (default off)",
    )
    parser.add_argument(
        "--self-check-sample",
        type=int,
        default=16,
        metavar="N",
        help="with --self-check sample: output elements (or rows) checked per op call (default 16)",
    )
    parser.add_argument(
        "--on-error",
        choices=("warn", "raise"),
        default="warn",
        help="when the trace cannot be written: warn and let the program go on (default), or stop it",
    )


def parse_steps(text: str) -> frozenset[int] | None:
    """``"0,1"``, ``"0-3"``, ``"2,5-6"`` or ``"all"`` (None).

    >>> sorted(parse_steps("0,2-4"))
    [0, 2, 3, 4]
    """
    if text.strip().lower() == "all":
        return None
    steps: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            lo, hi = int(first), int(last) if last else int(first)
            if lo < 0 or hi < lo or hi - lo > 1_000_000:
                raise ValueError(part)
            steps.update(range(lo, hi + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a step list: {text!r} (try 0,1 or 0-3 or all)") from None
    return frozenset(steps)


def capture_options(args: argparse.Namespace) -> dict[str, Any]:
    """TraceCompare's keyword arguments from the parsed options."""
    return {
        "steps": args.steps,
        "data": args.data,
        "only": args.only,
        "stack": args.stack,
        "rng": args.rng,
        "dropout": 0.0 if args.no_dropout else None,
        "overflow": args.overflow,
        "sync": args.sync,
        "flush_secs": args.flush_secs,
        "overwrite": args.force,
        "on_error": args.on_error,
        "self_check": args.self_check,
        "self_check_sample": args.self_check_sample,
    }


def options_argv(args: argparse.Namespace) -> list[str]:
    """The parsed capture options as command-line options again (for another interpreter, or each torchrun worker)."""
    argv = ["-o", args.out] if args.out else []
    argv += ["--steps", "all" if args.steps is None else ",".join(map(str, sorted(args.steps)))]
    argv += ["--data", args.data, "--rng", args.rng, "--flush-secs", repr(args.flush_secs), "--on-error", args.on_error]
    argv += ["--self-check", args.self_check, "--self-check-sample", str(args.self_check_sample)]
    for flag, on in (
        ("--force", args.force),
        ("--stack", args.stack),
        ("--no-dropout", args.no_dropout),
        ("--sync", args.sync),
        ("--exit-after", args.exit_after),
        ("--quiet", args.quiet),
    ):
        argv += [flag] if on else []
    argv += ["--only", args.only] if args.only else []
    return argv + (["--overflow", args.overflow] if args.overflow else [])


def run(args: argparse.Namespace) -> int:
    from tracecmp.capture.program import (
        end_like_python,
        is_torchrun,
        needs_other_interpreter,
        parse_command,
        reexec_argv,
        run_program,
        torchrun_argv,
    )
    from tracecmp.capture.recording import Recording
    from tracecmp.errors import TracecmpError

    command = list(args.program)
    if command and command[0] == "--":
        command = command[1:]
    own = options_argv(args)
    if is_torchrun(command):
        argv = torchrun_argv(command, own)
        _say(args, f"each torchrun worker records its rank: {' '.join(argv)}")
        _exec(argv)
    program = parse_command(command)
    if needs_other_interpreter(program):
        _exec(reexec_argv(program, own))
    if args.exit_after and args.steps is None:
        raise TracecmpError("--exit-after needs --steps: with every step recorded there is no last one")
    recording = Recording(
        Path(args.out) if args.out else None,
        capture_options(args),
        exit_after=args.exit_after,
        quiet=args.quiet,
        program=program.describe(),
    )
    recording.check_folder()  # an existing trace or an unwritable folder: refused before the program runs
    recording.arm()
    outcome = run_program(program, recording.finish)
    return end_like_python(outcome)


def _say(args: argparse.Namespace, text: str) -> None:
    if not args.quiet:
        print(f"tracecmp: {text}", file=sys.stderr, flush=True)


def _exec(argv: list[str]) -> None:
    """Replace this process with ``argv`` (the program keeps this process's id, streams and signals)."""
    from tracecmp.errors import TracecmpError

    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        raise TracecmpError(f"cannot run {argv[0]}: {exc.strerror}") from exc
