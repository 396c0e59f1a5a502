"""``tracecmp compare TARGET BENCH [-o OUT]``: name the first op where two runs stop agreeing.

Exit codes follow ``diff``: 0 no divergence, 1 divergence found (with ``--strict`` also when
something could not be paired or compared), 2 bad input or usage.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, NoReturn

from tracecmp.errors import TracecmpError

INCOMPLETE_EXIT = 3  # nothing diverged, but not everything could be compared


def int_list(text: str) -> list[int]:
    """``--steps``/``--ranks`` as argparse reads them: comma-separated integers (``0,2``)."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "compare",
        help="find the first op where a target run diverges from a bench run",
        description="Compare two traces (target first, bench second). Exit 0 when no op diverges, "
        "1 when one does, 2 on bad input (different models included), 3 when nothing diverged but "
        "not everything could be compared (INCOMPLETE: the summary lists what and why).",
    )
    parser.add_argument("target", help="trace folder of the run under suspicion (NPU, bf16, new kernel, ...)")
    parser.add_argument("bench", help="trace folder of the reference run")
    parser.add_argument("-o", "--out", metavar="OUT", help="folder for the tables (CSV) and the HTML report")
    parser.add_argument(
        "--exact", action="store_true", help="bitwise determinism check: any difference is a divergence"
    )
    parser.add_argument(
        "--replay",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="re-run every target op on its recorded inputs in float64 to measure its own error "
        '(needs a target captured with data="tensors"; default: whenever it has them)',
    )
    parser.add_argument("--steps", type=int_list, metavar="S,S", help="compare only these steps")
    parser.add_argument("--ranks", type=int_list, metavar="R,R", help="compare only these ranks")
    parser.add_argument(
        "--tol",
        metavar="SPEC",
        default="",
        help='tolerances, e.g. "bf16=0.016:1e-5,fp32=1.3e-6:1e-5,margin=4,local=4,ambient=8,downstream=32,'
        'replay_margin=4,replay_local=4,allow_tf32=0"',
    )
    parser.add_argument("--xlsx", action="store_true", help="also write compare.xlsx (needs openpyxl)")
    parser.add_argument("--no-report", action="store_true", help="with -o, write only the tables")
    parser.add_argument(
        "--strict", action="store_true", help="exit 1 also when anything was left unpaired or uncompared"
    )
    parser.add_argument(
        "--allow-incomplete",
        action="store_true",
        help="exit 0, not 3, when nothing diverged but not everything could be compared",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="compare even two runs that share too little to be the same model (exit 2 without it)",
    )
    parser.add_argument("--top", type=int, default=10, metavar="N", help="suspects shown in the summary (default 10)")
    parser.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="several ranks: compare them in N worker processes (default: one per rank, up to the "
        "CPUs; in this process for small traces). Under torchrun each process of the job compares "
        "its share of the ranks and process 0 writes the report",
    )
    parser.add_argument(
        "--max-memory",
        type=float,
        metavar="GB",
        help="several ranks: data memory each worker may use (default: physical memory / (workers + 1))",
    )
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: on a terminal, for large traces)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tracecmp.comparison import Tolerances, compare
    from tracecmp.comparison.torchrun import launched_by_torchrun

    if launched_by_torchrun():
        return _run_in_job(args)
    tolerances = Tolerances.parse(args.tol) if args.tol else None
    result = compare(
        args.target,
        args.bench,
        tolerances=tolerances,
        steps=args.steps,
        ranks=args.ranks,
        exact=args.exact,
        replay=args.replay,
        progress=args.progress,
        workers=args.workers,
        max_memory=int(args.max_memory * 2**30) if args.max_memory else None,
        force=args.force,
    )
    return _report(result, args)


def _run_in_job(args: argparse.Namespace) -> NoReturn:
    """Under torchrun: each process compares its share of the ranks, process 0 reports the job,
    and every process exits as process 0 does."""
    from tracecmp.comparison import Tolerances
    from tracecmp.comparison.api import compare_job
    from tracecmp.comparison.torchrun import JobGroup

    group = JobGroup()
    code = 2  # what the others exit with if process 0 fails
    try:
        result = compare_job(
            args.target,
            args.bench,
            group,
            tolerances=Tolerances.parse(args.tol) if args.tol else None,
            steps=args.steps,
            ranks=args.ranks,
            exact=args.exact,
            replay=args.replay,
            force=args.force,
        )
        if result is not None:
            code = _report(result, args)
    except BaseException:
        group.share(code)
        group.close()
        raise
    _leave(int(group.share(code)))


def _leave(code: int) -> NoReturn:
    """End this process of the job at once, with ``code``, once the verdict is shared.

    Its files are written and closed; what is left is gloo's teardown and the interpreter's, and
    one of those once kept a finished process from exiting (torch 2.1, on a loaded machine: the
    report written, the job never ending). Nothing in a comparison's process needs them.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _report(result: Any, args: argparse.Namespace) -> int:
    """Print the summary, write the tables and the report where asked; the exit code."""
    print(result.summary(top=args.top))
    selection = result.selection()
    if selection is not None:
        print(
            f"\nRe-run the target with tensors around the suspects only:\n  {selection.code(args.target)}\n"
            f'  or: tracecmp record -o {args.target} -f --data tensors --only "{selection.command_line()}" -- COMMAND'
        )
    if args.out:
        paths = result.write_tables(args.out, xlsx=args.xlsx)
        if not args.no_report:
            try:
                from tracecmp.render import write_report

                paths.append(write_report(result, args.out))
            except TracecmpError as exc:
                print(f"warning: report not written: {exc}", file=sys.stderr)
        print(f"\nwrote {', '.join(str(p) for p in paths)}")
    return exit_status(result.status, strict=args.strict, allow_incomplete=args.allow_incomplete)


def exit_status(status: str, *, strict: bool = False, allow_incomplete: bool = False) -> int:
    """The exit code of a verdict (``CompareResult.status``, ``CheckResult.status``): 0 agree (and
    "no root": a loss scaler skipped steps), 1 diverged, 3 incomplete; ``strict`` makes anything
    short of agreement 1, ``allow_incomplete`` makes incomplete 0."""
    if status == "diverged" or (strict and status != "agree"):
        return 1
    if status == "incomplete" and not allow_incomplete:
        return INCOMPLETE_EXIT
    return 0
