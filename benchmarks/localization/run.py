"""The localization benchmark: plan the fault cases, run each in a pool (capture target and bench,
compare, score against the ground truth: workloads/localization/runner.py), and print the tables.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterable

import torch

from workloads.localization.cases import VARIANTS, Case, plan_all, quick
from workloads.localization.faults import TF32_ROUNDING, TF32_ROUNDINGS, Plan
from workloads.localization.models import FAMILIES
from workloads.localization.runner import CAPTURE, DATA_MODES, MODEL_SEED, Result, bench_key, record_run, run_case


def _init_worker(data: str = "stats", tf32_rounding: str = "nearest", self_check: str = "off") -> None:
    torch.set_num_threads(1)  # bitwise-equal reductions in bench and target whatever the worker
    warnings.simplefilter("ignore")
    CAPTURE["data"] = data
    CAPTURE["self_check"] = self_check
    TF32_ROUNDING["how"] = tf32_rounding


def _bench_task(args: tuple[str, Plan, str]) -> tuple[str, str]:
    family, plan, path = args
    try:
        shutil.rmtree(path, ignore_errors=True)
        record_run(family, plan, Path(path))
    except Exception as exc:
        return path, f"{type(exc).__name__}: {exc}"
    return path, ""


def _case_task(args: tuple[Case, str, str, bool, int]) -> Result:
    case, bench, work, keep, timeout_s = args
    return run_case(case, Path(bench), Path(work), keep, timeout_s)


def _pool_map(fn: Any, items: list[Any], jobs: int, data: str, tf32_rounding: str, self_check: str) -> Iterable[Any]:
    if jobs <= 1:
        _init_worker(data, tf32_rounding, self_check)
        yield from map(fn, items)
        return
    import multiprocessing as mp

    initargs = (data, tf32_rounding, self_check)
    with mp.get_context("spawn").Pool(jobs, initializer=_init_worker, initargs=initargs) as pool:
        yield from pool.imap_unordered(fn, items)


# ---------------------------------------------------------------------------------------- report


def pct(hits: int, n: int) -> str:
    return f"{100.0 * hits / n:.1f}% ({hits}/{n})" if n else "-"


def _scored(results: list[Result]) -> list[Result]:
    return [r for r in results if r.expect_divergence and r.status != "harness"]


def _ratio_bucket(r: Result) -> str:
    if r.ratio is None or math.isnan(r.ratio):
        return "unknown"
    for bound, name in ((1, "a: < 1x"), (10, "b: 1-10x"), (100, "c: 10-100x")):
        if r.ratio < bound:
            return name
    return "d: >= 100x"


def tables(results: list[Result], seconds: float, command: str) -> str:
    """The Markdown report: totals, per-group tables, negatives, failures."""
    pos = _scored(results)
    neg = [r for r in results if not r.expect_divergence]
    n = len(pos)
    alarms = [r for r in neg if r.counted and r.outcome != "clean"]
    plain = [r for r in pos if r.variant == "plain"]
    tf32 = [r for r in pos if r.variant == "tf32"]
    visible = [r for r in tf32 if r.ratio is not None and r.ratio >= 10]
    lines = [
        f"Command: `{command}`",
        "",
        f"- cases: {len(results)} ({n} faults scored, {len(neg)} negatives, "
        f"{sum(r.status == 'harness' for r in results)} not set up, {sum(r.status == 'error' for r in results)} tracecmp errors); "
        f"runtime {seconds:.0f} s",
        f"- **top-1: {pct(sum(r.top1 for r in pos), n)}** (goal >= 95%); exact node: {pct(sum(r.exact for r in pos), n)}; "
        f"**top-3: {pct(sum(r.top3 for r in pos), n)}**",
        f"- suspects exactly the fault (no other root; goal >= 95%): {pct(sum(r.suspects_exact for r in pos), n)}; "
        f"plain variant: {pct(sum(r.suspects_exact for r in plain), len(plain))}",
        f"- top-1 with identical structure and no background noise (variant plain): "
        f"{pct(sum(r.top1 for r in plain), len(plain))} (goal 100%)",
        f"- top-1 under tf32 background where the fault is >= 10x the background at its site: "
        f"{pct(sum(r.top1 for r in visible), len(visible))} (all tf32 cases: {pct(sum(r.top1 for r in tf32), len(tf32))})",
        f"- **false alarms: {len(alarms)} of {sum(r.counted for r in neg)} negatives** (goal 0); "
        f"tf32 background alone flagged: {sum(1 for r in neg if not r.counted and r.outcome != 'clean')} of "
        f"{sum(not r.counted for r in neg)} (reported apart: a device that runs matmuls in tf32 is noise, not a fault)",
        "",
        "Outcomes: *missed* = no divergence reported; *early* = an op before the true one was named "
        "(a false alarm inside a faulty run); *late* = a later op was named (the error was followed "
        "downstream past its source).",
        "",
    ]
    lines += group_table("By variant", pos, lambda r: r.variant)
    lines += group_table("By fault kind", pos, lambda r: r.kind)
    lines += group_table("By phase", pos, lambda r: r.phase)
    lines += group_table(
        "By magnitude (scale and noise)",
        [r for r in pos if r.kind in ("scale", "noise")],
        lambda r: f"{r.kind} {r.magnitude:.0e}",
    )
    lines += group_table("By op category", pos, lambda r: r.category)
    lines += group_table("tf32 variant by fault size / background error at the site", tf32, _ratio_bucket)
    lines += _cross_table(pos)
    if any(r.variant in ("fused", "fused-plain") for r in results):
        from benchmarks.localization.fused import fused_tables

        lines += fused_tables(results)
    lines += ["### Negatives", "", "| case | outcome | reported |", "|---|---|---|"]
    for r in neg:
        reported = r.found.where() if r.found else (r.error.splitlines()[0] if r.error else "")
        lines.append(f"| {r.id} | {r.outcome or r.status} | {reported} |")
    lines.append("")
    fails = [
        r for r in results if (r.expect_divergence and not r.top1) or (not r.expect_divergence and r.outcome != "clean")
    ]
    lines += ["### Failures", ""]
    lines += [_failure(r) for r in fails] or ["none"]
    lines.append("")
    return "\n".join(lines)


def group_table(title: str, rows: list[Result], key: Any) -> list[str]:
    groups: dict[str, list[Result]] = defaultdict(list)
    for r in rows:
        groups[key(r)].append(r)
    out = [
        f"### {title}",
        "",
        "| group | n | top-1 | top-3 | exact node | missed | early | late | suspects exact |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in sorted(groups):
        g = groups[name]
        out.append(
            f"| {name} | {len(g)} | {pct(sum(r.top1 for r in g), len(g))} | {pct(sum(r.top3 for r in g), len(g))} | "
            f"{sum(r.exact for r in g)} | {sum(r.outcome == 'missed' for r in g)} | {sum(r.outcome == 'early' for r in g)} | "
            f"{sum(r.outcome == 'late' for r in g)} | {pct(sum(r.suspects_exact for r in g), len(g))} |"
        )
    return out + [""]


def _cross_table(rows: list[Result]) -> list[str]:
    cells: dict[tuple[str, str], dict[str, list[Result]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        cells[(r.model, r.kind)][r.variant].append(r)
    variants = list(
        dict.fromkeys([*(v for v in VARIANTS if any(r.variant == v for r in rows)), *(r.variant for r in rows)])
    )
    out = [
        "### By model x fault kind x variant (top-1 hits/n, top-3 in brackets)",
        "",
        "| model | kind | " + " | ".join(variants) + " |",
        "|---|---|" + "---|" * len(variants),
    ]
    for model, kind in sorted(cells, key=lambda mk: (FAMILIES.index(mk[0]) if mk[0] in FAMILIES else 99, mk[1])):
        parts = []
        for v in variants:
            g = cells[(model, kind)].get(v, [])
            parts.append(f"{sum(r.top1 for r in g)}/{len(g)} [{sum(r.top3 for r in g)}]" if g else "-")
        out.append(f"| {model} | {kind} | " + " | ".join(parts) + " |")
    return out + [""]


def _g(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def _failure(r: Result) -> str:
    head = f"- `{r.id}`"
    if r.structure:
        head += f" ({r.structure})"
    if r.status != "ok":
        return f"{head}: {r.status}: {r.error.splitlines()[0] if r.error else ''}"
    if not r.expect_divergence:
        assert r.found is not None
        return f"{head}: false alarm: {r.found.where()} kind={r.found.kind} reason={r.found.reason!r} metrics={r.found.metrics}"
    assert r.truth is not None
    found = (
        f"{r.found.where()} (kind {r.found.kind}, score {r.found.score:.3g}: {r.found.reason})"
        if r.found
        else "no divergence"
    )
    text = f"{head}: **{r.outcome}**; expected {r.truth.where()}; found {found}; truth rank {r.rank or '-'}"
    if r.fault_size is not None:
        text += f"; fault size {r.fault_size:.2g}"
        if r.variant == "tf32":
            text += f", background {r.background:.2g} (ratio {r.ratio:.2g})" if r.ratio is not None else ""
    d = r.truth_detail
    if d:
        node = d.get("node", {})
        text += "\n  - true op in compare: " + ", ".join(f"{k}={_g(v)}" for k, v in node.items())
        for o in d.get("outputs", [])[:2]:
            text += "\n  - output " + ", ".join(f"{k}={_g(v)}" for k, v in o.items())
        if "inputs" in d:
            text += f"\n  - inputs: {d['inputs']}"
    if r.warnings:
        text += f"\n  - harness notes: {'; '.join(r.warnings)}"
    return text


# ------------------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.localization [--quick] [--jobs N] [--models a,b] [--case SUBSTR]``."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.localization", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="every 7th fault case, every negative")
    parser.add_argument(
        "--fused",
        action="store_true",
        help="the fused variant instead (fused against eager, both directions; see fused.py)",
    )
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes")
    parser.add_argument("--models", default=",".join(FAMILIES), help=f"comma-separated subset of {FAMILIES}")
    parser.add_argument(
        "--case", action="append", default=[], help="run only cases whose id contains this (repeatable)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault-site rule")
    parser.add_argument("--sites", type=int, default=4, help="sites per output fault, magnitude and phase")
    parser.add_argument("--list", action="store_true", help="list the planned cases and exit")
    parser.add_argument("--json", type=Path, help="write every case result here")
    parser.add_argument("--markdown", type=Path, help="write the report here as well")
    parser.add_argument("--workdir", type=Path, help="where traces go (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep target and bench traces (implies a printed workdir)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds allowed per case")
    parser.add_argument(
        "--data",
        choices=DATA_MODES,
        default="stats",
        help="what both runs record; with tensors, compare also replays every target op",
    )
    parser.add_argument(
        "--tf32-rounding",
        choices=sorted(TF32_ROUNDINGS),
        default="nearest",
        help="how the tf32 background rounds matmul/conv inputs: to nearest even, or toward "
        "zero (a tensor core fed float32 as is)",
    )
    parser.add_argument(
        "--self-check",
        choices=("off", "sample", "full"),
        default="off",
        help="both runs check each op's own computation at capture (TraceCompare(self_check=...))",
    )
    args = parser.parse_args(argv)
    _init_worker(args.data, args.tf32_rounding, args.self_check)

    families = tuple(m for m in args.models.split(",") if m)
    unknown = [m for m in families if m not in FAMILIES]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {FAMILIES}")
    start = time.perf_counter()
    if args.fused:
        from benchmarks.localization.fused import plan_fused

        cases = plan_fused(seed=args.seed, model_seed=MODEL_SEED)
    else:
        cases = plan_all(families, seed=args.seed, model_seed=MODEL_SEED, sites_per_fault=args.sites)
    if args.quick:
        cases = quick(cases)
    if args.case:
        cases = [c for c in cases if any(s in c.id for s in args.case)]
    if args.list:
        for c in cases:
            print(c.id, c.structure)
        print(f"{len(cases)} cases", file=sys.stderr)
        return 0
    if not cases:
        print("no case matches", file=sys.stderr)
        return 2

    work = args.workdir or Path(tempfile.mkdtemp(prefix="tracecmp-loc-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        benches = {bench_key(c): (c.bench_family, c.bench, str(work / "benches" / bench_key(c))) for c in cases}
        failed_bench: dict[str, str] = {}
        for path, err in _pool_map(
            _bench_task, list(benches.values()), args.jobs, args.data, args.tf32_rounding, args.self_check
        ):
            if err:
                failed_bench[path] = err
        results: list[Result] = []
        todo = []
        for c in cases:
            path = benches[bench_key(c)][2]
            if path in failed_bench:
                r = Result(
                    c.id,
                    c.model,
                    c.kind,
                    c.variant,
                    c.phase,
                    c.magnitude,
                    c.category,
                    c.structure,
                    c.expect_divergence,
                    c.counted,
                    status="error",
                    outcome="error",
                    error=f"bench capture failed: {failed_bench[path]}",
                )
                results.append(r)
            else:
                todo.append((c, path, str(work), args.keep, args.timeout))
        # Slow models first so the pool does not end on one long tail.
        todo.sort(key=lambda t: FAMILIES.index(t[0].model) if t[0].model in FAMILIES else 0, reverse=True)
        for i, r in enumerate(
            _pool_map(_case_task, todo, args.jobs, args.data, args.tf32_rounding, args.self_check), 1
        ):
            results.append(r)
            bad = (r.expect_divergence and not r.top1) or (not r.expect_divergence and r.outcome != "clean")
            if bad or i % 25 == 0:
                print(f"[{i}/{len(todo)} {time.perf_counter() - start:.0f}s] {r.id}: {r.outcome}", file=sys.stderr)
    finally:
        if args.keep:
            print(f"traces kept in {work}", file=sys.stderr)
        elif args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    order = {c.id: i for i, c in enumerate(cases)}
    results.sort(key=lambda r: order[r.id])
    seconds = time.perf_counter() - start
    command = "python -m benchmarks.localization " + " ".join(argv if argv is not None else sys.argv[1:])
    publish(tables(results, seconds, command.strip()), results, args)
    return 0


def publish(report: str, results: Iterable[Any], args: argparse.Namespace) -> None:
    """Print the report; write it to ``--markdown`` and every case result to ``--json`` when asked."""
    print(report)
    if args.markdown:
        args.markdown.write_text(report)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1, default=str))
