"""``tracecmp check TRACE [-o OUT]``: judge every op of one run against a float64 replay.

Exit codes as ``compare``: 0 when no op errs (with ``--strict``: also none skipped), 1 when one
does, 2 on bad input or usage, 3 when no op could be judged (``--allow-incomplete``: 0).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tracecmp.cli.compare import exit_status, int_list
from tracecmp.errors import TracecmpError


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "check",
        help="judge every op of one run against a float64 replay of its recorded inputs (no bench)",
        description="Replay every op of a trace on the CPU, in float64 and in its recorded dtypes, and judge it. "
        "Exit 0 when no op errs, 1 when one does, 2 on bad input.",
    )
    parser.add_argument("trace", help="trace folder written by TraceCompare")
    parser.add_argument("-o", "--out", metavar="OUT", help="folder for the tables (CSV) and the HTML report")
    parser.add_argument(
        "--data",
        choices=("auto", "tensors", "statistics"),
        default="auto",
        help="tensors: replay recorded inputs (the trace must hold them); statistics: random inputs "
        "drawn to the recorded statistics (weaker); auto (default): tensors where saved",
    )
    parser.add_argument("--steps", type=int_list, metavar="S,S", help="check only these steps")
    parser.add_argument("--ranks", type=int_list, metavar="R,R", help="check only these ranks")
    parser.add_argument(
        "--standards",
        metavar="SPEC",
        default="",
        help='thresholds, e.g. "margin=4,floor=4,warn_margin=2,share=0.001,mean_floor=1,fp32_ulps=4"',
    )
    parser.add_argument("--workers", type=int, metavar="N", help="processes to replay with (default: by trace size)")
    parser.add_argument("--no-report", action="store_true", help="with -o, write only the tables")
    parser.add_argument("--strict", action="store_true", help="exit 1 also when an op could not be judged")
    parser.add_argument(
        "--allow-incomplete", action="store_true", help="exit 0, not 3, when no op could be judged at all"
    )
    parser.add_argument("--top", type=int, default=10, metavar="N", help="suspects shown in the summary (default 10)")
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: on a terminal, for long runs)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tracecmp.checking import Standards, check

    if args.workers is not None and args.workers < 1:
        raise TracecmpError("--workers must be at least 1")
    standards = Standards.parse(args.standards) if args.standards else None
    result = check(
        args.trace,
        data=args.data,
        standards=standards,
        steps=args.steps,
        ranks=args.ranks,
        workers=args.workers,
        progress=args.progress,
    )
    print(result.summary(top=args.top))
    if args.out:
        paths = result.write_tables(args.out)
        if not args.no_report:
            try:
                from tracecmp.render.check_report import write_report

                paths.append(write_report(result, args.out))
            except TracecmpError as exc:
                print(f"warning: report not written: {exc}", file=sys.stderr)
        print(f"\nwrote {', '.join(str(p) for p in paths)}")
    if args.strict and result.counts()["skipped"]:
        return 1
    return exit_status(result.status, allow_incomplete=args.allow_incomplete)
