"""Compare kept traces again and fingerprint every verdict: proof that a change to the judging
code left its results alone, case by case, without capturing anything again.

A benchmark run with ``--keep --workdir DIR`` leaves ``DIR/targets/<case>`` and
``DIR/benches/<bench>``. This compares each target with its bench using the code checked out now
and writes one line per case: the verdict, the counts, the first divergence and every suspect
(op id, op, module, phase, step, kind, reason, score). Two fingerprint files written before and
after a change must be equal::

    python -m benchmarks.localization --data stats --keep --workdir /tmp/loc --jobs 2
    python -m benchmarks.localization.recompare /tmp/loc --out before.jsonl     # on the old code
    python -m benchmarks.localization.recompare /tmp/loc --out after.jsonl      # on the new code
    python -m benchmarks.localization.recompare --diff before.jsonl after.jsonl

``--fused`` and ``--data`` plan the cases as the benchmark run that kept them did. ``--realsize``
reads a ``realsize.py --keep --workdir DIR`` folder instead (``DIR/<model>/clean-*`` and
``DIR/<model>/cases/*``, each against its fp32 bench). ``--tracecmp-from TREE`` compares with the
``tracecmp`` package of another checkout (with its built extensions), this script unchanged::

    python -m benchmarks.localization.recompare --realsize /tmp/rs --out before.jsonl --tracecmp-from /tmp/old
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from workloads.localization.cases import plan_all
from workloads.localization.models import FAMILIES
from workloads.localization.runner import MODEL_SEED, bench_key


def fingerprint(result: Any) -> dict[str, Any]:
    """What a compare concluded, as plain values (equal iff the verdicts are the same)."""

    def record(d: Any) -> list[Any]:
        return [d.op_id, d.op, d.module, d.phase, d.step, d.rank, d.kind, d.reason, repr(d.score)]

    return {
        "verdict": result.verdict(),
        "counts": result.counts(),
        "first": None if result.first_divergence is None else record(result.first_divergence),
        "suspects": [record(d) for d in result.suspects],
        "regions": len(result.regions),
        "warnings": list(result.warnings),
    }


def recompare(work: Path, cases: list[Any], out: Path) -> int:
    """Compare every kept case in ``work``; one JSON line per case into ``out``. Returns the count."""
    import tracecmp

    start = time.perf_counter()
    done = 0
    with out.open("w") as sink:
        for i, case in enumerate(cases, 1):
            target = work / "targets" / case.id.replace("/", "__").replace(":", "_")
            bench = work / "benches" / bench_key(case)
            if not target.is_dir() or not bench.is_dir():
                continue
            try:
                line = fingerprint(tracecmp.compare(str(target), str(bench)))
            except Exception as exc:  # a failing compare is a result to keep, not a crash
                line = {"error": f"{type(exc).__name__}: {exc}"}
            sink.write(json.dumps({"id": case.id, **line}, sort_keys=True) + "\n")
            done += 1
            if i % 100 == 0:
                print(f"[{i}/{len(cases)} {time.perf_counter() - start:.0f}s]", file=sys.stderr)
    return done


def recompare_realsize(work: Path, out: Path) -> int:
    """Compare every kept real-size pair in ``work``; one JSON line per pair into ``out``."""
    import tracecmp

    done = 0
    with out.open("w") as sink:
        for model in sorted(p for p in work.iterdir() if p.is_dir()):
            for target in sorted(model.glob("clean-*")) + sorted((model / "cases").glob("*")):
                if not (target / "manifest.json").exists():
                    continue
                bench = model / ("bench-fp32-scaler" if "amp-fp16" in target.name else "bench-fp32")
                try:
                    line = fingerprint(tracecmp.compare(str(target), str(bench)))
                except Exception as exc:  # a failing compare is a result to keep, not a crash
                    line = {"error": f"{type(exc).__name__}: {exc}"}
                sink.write(json.dumps({"id": f"{model.name}/{target.name}", **line}, sort_keys=True) + "\n")
                done += 1
    return done


def diff(before: Path, after: Path) -> int:
    """Print the cases whose fingerprints differ; exit status 1 when any does."""
    old = {json.loads(line)["id"]: line for line in before.read_text().splitlines()}
    new = {json.loads(line)["id"]: line for line in after.read_text().splitlines()}
    changed = sorted(k for k in old.keys() & new.keys() if old[k] != new[k])
    only = sorted(old.keys() ^ new.keys())
    for key in changed:
        print(f"differs: {key}\n  before: {old[key]}\n  after:  {new[key]}")
    for key in only:
        print(f"in one file only: {key}")
    print(f"{len(old.keys() & new.keys())} cases in both, {len(changed)} differ, {len(only)} in one only")
    return 1 if changed or only else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.localization.recompare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("workdir", nargs="?", type=Path, help="a benchmark's --keep --workdir folder")
    parser.add_argument("--out", type=Path, help="the fingerprint file to write (JSON lines)")
    parser.add_argument("--fused", action="store_true", help="the kept run was the fused variant")
    parser.add_argument("--seed", type=int, default=0, help="the kept run's --seed")
    parser.add_argument("--sites", type=int, default=4, help="the kept run's --sites")
    parser.add_argument("--diff", nargs=2, type=Path, metavar=("BEFORE", "AFTER"), help="compare two fingerprint files")
    parser.add_argument("--realsize", action="store_true", help="WORKDIR was kept by realsize.py")
    parser.add_argument("--tracecmp-from", type=Path, help="compare with the tracecmp package of this checkout")
    args = parser.parse_args(argv)
    if args.diff:
        return diff(*args.diff)
    if args.workdir is None or args.out is None:
        parser.error("give WORKDIR and --out, or --diff BEFORE AFTER")
    if args.tracecmp_from is not None:
        sys.path.insert(0, str(args.tracecmp_from.resolve()))  # before tracecmp is first imported
        sys.modules.pop("tracecmp", None)
    torch.set_num_threads(1)  # as the benchmark's workers: compares do not depend on it, replays might
    warnings.simplefilter("ignore")
    if args.realsize:
        count = recompare_realsize(args.workdir, args.out)
        print(f"{count} pairs compared into {args.out}", file=sys.stderr)
        return 0 if count else 2
    if args.fused:
        from benchmarks.localization.fused import plan_fused

        cases = plan_fused(seed=args.seed, model_seed=MODEL_SEED)
    else:
        cases = plan_all(FAMILIES, seed=args.seed, model_seed=MODEL_SEED, sites_per_fault=args.sites)
    count = recompare(args.workdir, cases, args.out)
    print(f"{count} cases compared into {args.out}", file=sys.stderr)
    return 0 if count else 2


if __name__ == "__main__":
    sys.exit(main())
