"""``tracecmp ab --bench CMD --target CMD -o OUT``: record both runs the same way, then compare them.

The two commands are recorded with the same capture options (the usual cause of two traces that
cannot be compared is two runs captured differently), into ``OUT/traces/bench`` and
``OUT/traces/target``; then ``tracecmp compare`` writes its tables and report to ``OUT``. Exit codes
are compare's: 0 the runs agree, 1 a divergence was found, 2 bad input (or a run left no trace),
3 nothing diverged but not everything could be compared.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from tracecmp.errors import TracecmpError


def add_parser(subparsers: Any) -> None:
    from tracecmp.cli.record import add_capture_options

    parser = subparsers.add_parser(
        "ab",
        help="record a bench command and a target command the same way, then compare them",
        description=__doc__.split("\n\n")[1].replace("\n", " ") if __doc__ else None,
        epilog='example: tracecmp ab -o ab --bench "python train.py --device cpu" --target "python train.py --device npu"',
    )
    parser.add_argument("--bench", required=True, metavar="CMD", help="the reference run's command line, quoted")
    parser.add_argument("--target", required=True, metavar="CMD", help="the run under suspicion's command line, quoted")
    add_capture_options(parser)
    parser.set_defaults(out="tracecmp-ab")
    parser.add_argument("--tol", metavar="SPEC", default="", help="tolerances, as for tracecmp compare")
    parser.add_argument(
        "--strict", action="store_true", help="exit 1 also when anything was left unpaired or uncompared"
    )
    parser.add_argument("--allow-incomplete", action="store_true", help="as for tracecmp compare")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tracecmp.cli.main import main as tracecmp_main
    from tracecmp.cli.record import options_argv

    out = Path(args.out)
    paths = {name: out / "traces" / name for name in ("bench", "target")}
    for name in ("bench", "target"):
        command = shlex.split(getattr(args, name))
        if not command:
            raise TracecmpError(f"--{name} is empty")
        record = vars(args).copy()
        record.update(out=str(paths[name]), force=True, exit_after=args.steps is not None, quiet=False)
        argv = [sys.executable, "-m", "tracecmp", "record", *options_argv(argparse.Namespace(**record)), "--", *command]
        print(f"tracecmp ab: recording the {name}: {shlex.join(command)}", file=sys.stderr, flush=True)
        status = subprocess.run(argv).returncode
        if status:
            print(
                f"tracecmp ab: the {name} exited with status {status}; comparing what its trace holds", file=sys.stderr
            )
    compare = ["compare", str(paths["target"]), str(paths["bench"]), "-o", str(out)]
    compare += ["--tol", args.tol] if args.tol else []
    compare += [flag for flag in ("--strict", "--allow-incomplete") if getattr(args, flag[2:].replace("-", "_"))]
    return tracecmp_main(compare)
