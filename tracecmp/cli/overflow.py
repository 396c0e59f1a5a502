"""``tracecmp overflow TRACE``: the first op whose finite inputs produced NaN/Inf."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "overflow",
        help="name the first op that produced NaN/Inf from finite inputs",
        description="Exit 0 when no op overflowed, 1 when one did, 2 on bad input.",
    )
    parser.add_argument("trace", help="trace folder written by TraceCompare")
    parser.add_argument("--all", action="store_true", help="list every overflowing op, not only the first")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tracecmp.overflow import find_overflows, recorded_overflows
    from tracecmp.trace import load

    trace = load(args.trace)
    found = find_overflows(trace, limit=None if args.all else 1)
    if not trace.complete:
        why = "; ".join(trace.rank(r).ending() for r in trace.ranks if not trace.rank(r).complete)
        if trace.options.get("overflow") == "raise" and recorded_overflows(trace):
            why = 'capture stopped the run at its first overflow, overflow="raise"'
        print(f"warning: {args.trace} is incomplete ({why}); checked what it holds")
    if not found:
        print("no overflow: every op with finite inputs produced finite outputs")
        return 0
    first = found[0]
    print(f"first overflow: {first.op}")
    print(f"  module   {first.module or '<top>'}")
    print(f"  phase    {first.phase}, step {first.step}, rank {first.rank}")
    print(f"  location {first.location or '?'}")
    print(f"  reason   {first.reason}")
    for position, rng in enumerate(first.inputs):
        print(f"  input {position}  {rng}")
    for position, rng in enumerate(first.outputs):
        print(f"  output {position} {rng}")
    if first.stack:
        print("  stack:\n    " + first.stack.replace("\n", "\n    "))
    for other in found[1:]:
        print(f"also: {other}")
    return 1
