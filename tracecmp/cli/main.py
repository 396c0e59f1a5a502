"""``tracecmp`` entry point: dispatches to one module per subcommand.

Each subcommand module under :mod:`tracecmp.cli` exposes ``add_parser(subparsers)`` and
``run(args) -> int``. Exit codes follow ``diff``: 0 agree / ok, 1 difference found,
2 trouble: bad input or usage (one line naming the file), and also a bug in tracecmp (with its
traceback), since a crash must never read as "difference found" to a CI gate.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from importlib import import_module
from typing import Sequence

from tracecmp.errors import TracecmpError

SUBCOMMANDS = ("record", "ab", "demo", "compare", "check", "inspect", "overflow")


def build_parser() -> argparse.ArgumentParser:
    from tracecmp import __version__

    parser = argparse.ArgumentParser(
        prog="tracecmp", description="Find the first op where two PyTorch runs stop agreeing numerically."
    )
    parser.add_argument("--version", action="version", version=f"tracecmp {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            module = import_module(f"tracecmp.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"tracecmp.cli.{name}":
                raise
            continue
        module.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code.

    >>> main(["--version"])  # doctest: +SKIP
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors already; keep its code
        return int(exc.code or 0)
    if not getattr(args, "command", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.run(args))
    except TracecmpError as exc:
        print(f"tracecmp {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tracecmp: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `tracecmp inspect T | head`: the reader left, nothing went wrong
        _silence_stdout()
        return 0
    except (MemoryError, RecursionError) as exc:
        # The reader bounds what it parses; this is what is left (a table Arrow cannot hold).
        print(
            f"tracecmp {args.command}: error: the input is too large or too deep to read ({type(exc).__name__})",
            file=sys.stderr,
        )
        return 2
    except Exception:  # noqa: BLE001 - a bug must not exit 1, which `compare` reserves for "diverged"
        traceback.print_exc()
        print(
            f"tracecmp {args.command}: internal error (a bug in tracecmp; please report it with the traceback above)",
            file=sys.stderr,
        )
        return 2


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that flushing it at exit raises no second BrokenPipeError."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
