"""Record the real-script corpus with ``tracecmp record``, compare each target with its bench with
``tracecmp compare``, and print the verdicts as a markdown table.

The scripts, their variants and the running and judging live in :mod:`workloads.realscripts` (the
test ``tests/integration/test_realscripts.py`` uses the same); this is the command line and the table.
Every script runs unchanged, as ``tracecmp record -o TRACE -- python SCRIPT ARGS``; the bench of a
variant is the script's float32 run without a bug (with the same attention path as the target where
that matters), recorded once and shared by the variants that use it. Compare runs as the CLI does
(exit code and terminal summary), its roots read from the ``suspects.csv`` it writes and what it
could not compare from ``uncompared.csv``.

    python benchmarks/realscripts/run.py                              # the whole corpus
    python benchmarks/realscripts/run.py --scripts nanogpt --variants 'clean-*' --keep --workdir /tmp/rs
    python benchmarks/realscripts/run.py --list
    python benchmarks/realscripts/run.py --table /tmp/rs/results.json --short

Each variant states what issue #34 asks of it: a clean pair reads AGREE with exit 0, a bug is named
first at its op and module (as the only root where the bug sits in one module). The ``met`` column
says whether tracecmp does so today.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: workloads/ and tracecmp from this checkout
    sys.path.insert(0, str(ROOT))

from workloads.realscripts.corpus import SCRIPTS, select  # noqa: E402
from workloads.realscripts.runner import CompareRun, Result, load_results, run_variants, save_results  # noqa: E402


def _cell(text: str, width: int = 90) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= width else text[: width - 1] + "…"


def first_root(cmp: CompareRun | None) -> str:
    if cmp is None or not cmp.first:
        return ""
    r = cmp.first
    return f"{r.get('op', '')} in {r.get('module') or '<top>'} ({r.get('phase', '')}, step {r.get('step', '')})"


def roots_cell(cmp: CompareRun) -> str:
    """The number of roots, and the calls they cover where a root repeats (each micro-batch, step)."""
    n, calls = len(cmp.roots), cmp.calls
    return str(n) + (f" ({calls} calls)" if calls > n else "")


def markdown(results: list[Result], *, short: bool = False) -> str:
    """The table; ``short``: the verdict's word and exit code only, without the wanted column (the
    benchmarks README's form)."""
    if short:
        head = "| script | variant | verdict (exit) | first root (op, module) | roots | record s | compare s | met |"
        rule = "|---|---|---|---|---|---|---|---|"
    else:
        head = (
            "| script | variant | verdict | exit | first root (op, module) | roots | record s | compare s | "
            "wanted (#34) | met |"
        )
        rule = "|---|---|---|---|---|---|---|---|---|---|"
    rows = [head, rule]
    for r in results:
        cmp = r.compare
        if cmp is None:
            verdict, code, roots, ctime = _cell("RECORD FAILED: " + r.note), "", "", ""
        else:
            verdict = cmp.word if short else _cell(cmp.verdict)
            code, roots, ctime = str(cmp.returncode), roots_cell(cmp), f"{cmp.seconds:.1f}"
        met = "yes" if r.met else "**no**"
        root = _cell(first_root(cmp), 110 if short else 70)  # the short table has room for the module
        if short:
            rows.append(
                f"| {r.script} | {r.variant} | {verdict} ({code}) | {root} | {roots} | {r.target.seconds:.1f} | "
                f"{ctime} | {met} |"
            )
        else:
            rows.append(
                f"| {r.script} | {r.variant} | {verdict} | {code} | {root} | {roots} | {r.target.seconds:.1f} | "
                f"{ctime} | {r.expect} | {met} |"
            )
    missed = [r for r in results if not r.met]
    if missed and not short:
        rows += ["", "What tracecmp says where the case is not met:", ""]
        rows += [f"- {r.script} {r.variant}: {_cell(diagnosis(r), 600)}" for r in missed]
    return "\n".join(rows)


def uncompared_lines(cmp: CompareRun, top: int = 3) -> list[str]:
    """The largest groups of what compare could not compare (``uncompared.csv``)."""
    lines = []
    for row in cmp.uncompared[:top]:
        lines.append(
            f"{row.get('side', '?')} {row.get('status', '?')}: {row.get('count', '?')} x {row.get('op', '?')} "
            f"in {row.get('module') or '<top>'} (step {row.get('steps', '?')}): {row.get('reason', '')}"
        )
    if len(cmp.uncompared) > top:
        lines.append(f"and {len(cmp.uncompared) - top} more groups")
    return lines


def other_roots(cmp: CompareRun) -> list[str]:
    """The roots besides the first divergence, as op, module, phase and step, with their calls."""
    first = (cmp.first.get("op"), cmp.first.get("module") or "", cmp.first.get("phase"), cmp.first.get("step"))
    skipped = False
    out = []
    for x in cmp.roots:
        key = (x.get("op"), x.get("module") or "", x.get("phase"), x.get("step"))
        if key == first and not skipped:  # the first divergence is one of the roots
            skipped = True
            continue
        calls = 1 + len((x.get("repeats") or "").split())
        out.append(
            f"{key[0]} in {key[1] or '<top>'} ({key[2]}, step {key[3]}, {x.get('kind', '?')})"
            + (f" x{calls} calls" if calls > 1 else "")
        )
    return out


def diagnosis(r: Result) -> str:
    """One line on what tracecmp said in a case that is not met: the first root's kind and reason,
    the other roots, what INCOMPLETE left out, a refusal, or why a record failed."""
    cmp = r.compare
    if cmp is None:
        return "record failed: " + r.note
    parts = []
    if cmp.first:
        parts.append(f"{cmp.first.get('kind', '?')}: {cmp.first.get('reason', '')}")
        first = cmp.roots[0] if cmp.roots else {}
        calls = 1 + len((first.get("repeats") or "").split())
        if calls > 1:
            parts.append(f"x{calls} calls")
        others = other_roots(cmp)
        if others:
            more = f" and {len(others) - 4} more" if len(others) > 4 else ""
            parts.append("other roots: " + ", ".join(others[:4]) + more)
    else:
        parts.append(cmp.verdict)
        parts += uncompared_lines(cmp)
    parts += [f"warning: {w}" for w in cmp.warnings[:2]]
    own = [line for line in r.target.own_lines + r.bench.own_lines if "warn" in line.lower() or "error" in line.lower()]
    parts += own[:2]
    return "; ".join(parts) or cmp.verdict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scripts", help=f"comma-separated, of {', '.join(SCRIPTS)} (default: all)")
    parser.add_argument("--variants", help="comma-separated names or fnmatch patterns, e.g. 'clean-*,bug-ln-eps'")
    parser.add_argument("--workdir", help="where traces, script outputs and comparisons go (default: a temp folder)")
    parser.add_argument("--keep", action="store_true", help="keep the traces and comparison folders")
    parser.add_argument("--tiny", action="store_true", help="the scripts' smallest sizes (as the CI test runs them)")
    parser.add_argument("--record-args", default="", help='extra options for tracecmp record, e.g. "--data tensors"')
    parser.add_argument("--compare-args", default="", help="extra options for tracecmp compare")
    parser.add_argument("--report", action="store_true", help="let compare write report.html too")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every process (0: unset)")
    parser.add_argument("--markdown", help="also write the table to this file")
    parser.add_argument("--short", action="store_true", help="the short table (verdict word, no wanted column)")
    parser.add_argument("--list", action="store_true", help="list the variants and exit")
    parser.add_argument("--table", metavar="RESULTS", help="print the table of a run's results.json again and exit")
    args = parser.parse_args(argv)

    if args.table:
        print(markdown(load_results(Path(args.table)), short=args.short))
        return 0

    scripts = args.scripts.split(",") if args.scripts else None
    unknown = set(scripts or ()) - set(SCRIPTS)
    if unknown:
        parser.error(f"unknown scripts: {', '.join(sorted(unknown))}")
    variants = select(scripts, args.variants.split(",") if args.variants else None)
    if args.list or not variants:
        for v in variants:
            target = " ".join(v.target) or "(the bench's command)"
            print(f"{v.script:<11} {v.name:<26} target: {target:<40} bench: {' '.join(v.bench) or '-'}")
        return 0 if variants else 2

    temp = args.workdir is None
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="realscripts-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    log(f"workdir {workdir}")
    try:
        results = run_variants(
            variants,
            workdir,
            tiny=args.tiny,
            record_args=tuple(shlex.split(args.record_args)),
            compare_args=tuple(shlex.split(args.compare_args)),
            report=args.report,
            threads=args.threads,
            log=log,
        )
    finally:
        if not args.keep:
            for sub in ("traces", "runs", "compare"):
                shutil.rmtree(workdir / sub, ignore_errors=True)
    table = markdown(results, short=args.short)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    if not temp or args.keep:
        save_results(results, workdir / "results.json")
        log(f"results in {workdir / 'results.json'}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
