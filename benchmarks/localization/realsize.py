"""Localization at real size: reduced-precision runs against fp32 read as noise, faults are found.

    python -m benchmarks.localization.realsize                        # every model and precision
    python -m benchmarks.localization.realsize --models gpt2-small --precisions amp-bf16 --sites 2
    python -m benchmarks.localization.realsize --workdir /tmp/rs --keep   # keep the traces ...
    python -m benchmarks.localization.realsize --workdir /tmp/rs --resume   # ... compare them again

Models (``realmodels.py``): GPT-2 small, BERT-base, ResNet-50 (b8, 224) and an 8-layer Llama at
d1024, random weights from configs. Each *target* runs in one precision (``bf16``: the whole model
and its optimizer in bfloat16; ``amp-bf16``; ``amp-fp16`` with a GradScaler) and is compared with
an fp32 *bench* of the same script, over two training steps.

* **Clean pairs** must give no root at all. Their compare runs in a fresh process, so that its
  time and peak RSS are its own (loading included).
* **Faults** go to seeded sites chosen as in the small benchmark (``cases.choose_sites``: op
  categories in seeded order, then a seeded op and call, in the forward, backward and optimizer
  phases of either step): the first floating output scaled by 1.05 (``scale``), one element set
  to NaN (``nan``), or one non-tensor argument changed (``arg``: eps x10, gelu's approximation
  swapped, a scalar constant x1.05). Each fault runs in one of the three precisions, in turn.
  Top-1: the first divergence is the injected op (op, phase, module). *Suspects exact*: every
  root reported is the injected node itself, or the backward of an op whose argument changed.

Traces of every case stay in ``--workdir`` with ``--keep`` (a few MB each with statistics), and
``--resume`` captures only what is not there yet and compares everything again (what a change to
compare needs).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
import zlib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable

import torch

from benchmarks.localization.realmodels import BENCH_OF, EXTRA_MODELS, PRECISIONS, REAL_MODELS, build_real
from benchmarks.localization.run import group_table, pct, publish
from workloads.localization.cases import Case, choose_sites
from workloads.localization.faults import ArgFault, CallRecord, Injector, Observation, OutputFault, Plan, Site
from workloads.localization.runner import HarnessError, Record, Result, find_truth, score

STEPS = {"n": 2}  # training steps per run (``--steps``, set in every worker)
SCALE = 0.05
FAULT_KINDS = ("scale", "nan", "arg")
MODEL_SEED = 1234
_PHASES = ("forward", "backward", "optimizer", "forward", "backward")
# Non-tensor arguments a program might get wrong, and how: an epsilon off by ten, the other GELU,
# another negative slope, any other floating constant (a scale, an exponent, a beta) off by 5%.
_EPS_ARGS = ("eps",)
_SCALAR_ARGS = ("other", "exponent", "scale", "value", "weight", "alpha", "beta", "negative_slope", "momentum")


def _changed(name: str, old: Any) -> Any:
    """The mistaken value of argument ``name`` (None when it cannot be changed sensibly)."""
    if name == "approximate":
        return "none" if old == "tanh" else "tanh"
    if isinstance(old, bool) or not isinstance(old, (int, float)) or not math.isfinite(old):
        return None
    if name in _EPS_ARGS:
        return old * 10 if old else None
    if name in _SCALAR_ARGS and old not in (0, 1, -1):
        return old * 1.05
    return None


def arg_candidates(calls: list[CallRecord]) -> list[tuple[CallRecord, str, Any]]:
    """Calls with an argument that can be changed, with the argument and its mistaken value."""
    out = []
    for c in calls:
        if c.is_view or c.random or not c.site.op.startswith("aten.") or c.n_float_outputs == 0 or c.mutable:
            continue
        for name, old in sorted(c.args.items()):
            new = _changed(name, old)
            if new is not None:
                out.append((c, name, new))
                break
    return out


@dataclass
class RealCase:
    """One real-size case: a clean pair (``kind`` "clean") or a fault in one precision."""

    id: str
    model: str
    precision: str
    kind: str  # clean | scale | nan | arg
    phase: str = ""
    site: Site | None = None
    arg: str = ""
    value: Any = None

    @property
    def plan(self) -> Plan:
        if self.kind in ("scale", "nan"):
            assert self.site is not None
            fault = OutputFault(
                self.kind, self.site, SCALE if self.kind == "scale" else 0.0, seed=zlib.crc32(self.id.encode())
            )
            return Plan(output_fault=fault)
        if self.kind == "arg":
            assert self.site is not None
            return Plan(arg_fault=ArgFault(self.site, self.arg, self.value))
        return Plan()

    def as_case(self) -> Case:
        """The small benchmark's case record, for its ground-truth and scoring helpers."""
        return Case(
            self.id,
            self.model,
            self.kind,
            self.precision,
            self.phase,
            SCALE if self.kind == "scale" else 0.0,
            self.plan,
            Plan(),
            expect_divergence=self.kind != "clean",
        )


@dataclass
class RealResult(Result):
    """A small-benchmark result plus what the real-size report adds."""

    precision: str = ""
    compare_s: float = 0.0
    compare_rss_mb: float = 0.0
    capture_s: float = 0.0
    losses: list[float] = field(default_factory=list)
    trace_mb: float = 0.0
    skipped: list[int] = field(default_factory=list)  # steps the target's loss scaler skipped on overflows it caught
    verdict: str = ""  # the clean pair's verdict, its first word (AGREE, INCOMPLETE, NO ROOT, DIVERGED)
    drift: str = ""  # where the runs drifted apart (op id, its max/min difference) and the ops left undecided
    beyond: dict[str, int] | None = None  # tensors compared from the drift on (or all), and those off by a fault's size


SELF_CHECK_ENV = "TRACECMP_BENCH_SELF_CHECK"


def _dir_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def capture(
    family: str, precision: str, path: Path, plan: Plan, data: str, profile: bool = False
) -> tuple[Observation, list[CallRecord], list[float], float]:
    """Two training steps of ``family`` in ``precision`` under ``plan``, captured into ``path``."""
    import tracecmp

    workload = build_real(family, precision, MODEL_SEED)
    injector = Injector(workload.model, plan, profile=profile)
    shutil.rmtree(path, ignore_errors=True)
    start = time.perf_counter()
    with injector.outer():
        # --self-check reaches capture processes (spawned) through the environment.
        self_check = os.environ.get(SELF_CHECK_ENV, "off")
        with tracecmp.TraceCompare(str(path), model=workload.model, data=data, self_check=self_check) as tc:
            for _ in range(STEPS["n"]):
                # inner() per step: tc.step() may leave and re-enter capture's mode, which pops
                # any mode entered above it.
                with injector.inner():
                    workload.train_step()
                tc.step()
    return injector.obs, injector.calls or [], workload.losses, time.perf_counter() - start


_COMPARE_CHILD = r"""
import json, resource, sys, time
import tracecmp
from workloads.localization.runner import beyond_fault_size
start = time.perf_counter()
result = tracecmp.compare(sys.argv[1], sys.argv[2], progress=False)
seconds = time.perf_counter() - start
drift = result.drifts[0] if result.drifts else None
beyond = beyond_fault_size(result.tensors, drift.rank if drift else 0, drift.op_id if drift else 0, float(sys.argv[3]))
roots = [dict(op=d.op, module=d.module, phase=d.phase, step=d.step, op_id=d.op_id, kind=d.kind, reason=d.reason,
              score=d.score) for d in result.suspects]
print(json.dumps({"seconds": seconds, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "roots": roots, "skipped": [skip.step for skip in result.skipped_steps],
                  "verdict": result.verdict().split(":")[0],
                  "drift": "; ".join(f"op {d.op_id} ({d.error:.0%}), {len(d.undecided)} undecided" for d in result.drifts),
                  "beyond": beyond}))
"""


def compare_fresh(target: Path, bench: Path, timeout_s: int) -> dict[str, Any]:
    """``tracecmp.compare`` in a fresh process: its roots, wall time and peak RSS."""
    env = dict(os.environ)
    out = subprocess.run(
        [sys.executable, "-c", _COMPARE_CHILD, str(target), str(bench), str(SCALE)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
    )
    if out.returncode != 0:
        raise RuntimeError(
            f"compare failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}"
        )
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------- planning


def parse_sites(text: str) -> dict[str, int]:
    """``"4"`` (every kind) or ``"scale=2,nan=1,arg=1"``: sites per fault kind, model and precision.

    >>> parse_sites("3"), parse_sites("scale=2,nan=1")
    ({'scale': 3, 'nan': 3, 'arg': 3}, {'scale': 2, 'nan': 1, 'arg': 0})
    """
    if "=" not in text:
        return {kind: int(text) for kind in FAULT_KINDS}
    out = {kind: 0 for kind in FAULT_KINDS}
    for item in filter(None, text.split(",")):
        kind, _, n = item.partition("=")
        if kind not in out:
            raise ValueError(f"unknown fault kind {kind!r}; choose from {FAULT_KINDS}")
        out[kind] = int(n)
    return out


def plan_cases(
    family: str,
    calls_by_precision: dict[str, list[CallRecord]],
    sites: dict[str, int],
    seed: int,
    kinds: Iterable[str] = FAULT_KINDS,
) -> list[RealCase]:
    """Fault cases of ``family``: ``sites[kind]`` per fault kind and precision, phases in turn."""
    cases: list[RealCase] = []
    for precision, calls in calls_by_precision.items():
        for kind in kinds:
            n_sites = sites.get(kind, 0)
            rng = random.Random(zlib.crc32(f"{seed}/{family}/{precision}/{kind}".encode()))
            if kind == "arg":
                candidates = arg_candidates(calls)
                # One call per (op, argument) first, so that the cases spread over ops.
                by_key: dict[tuple[str, str], list[tuple[CallRecord, str, Any]]] = {}
                for c, name, new in candidates:
                    by_key.setdefault((c.site.op, name), []).append((c, name, new))
                keys = sorted(by_key)
                rng.shuffle(keys)
                for op, name in keys[:n_sites]:
                    c, name, new = rng.choice(by_key[(op, name)])
                    cases.append(
                        RealCase(
                            f"{family}/{precision}/arg:{name}={new:.6g}@{op}#{c.site.k}:{c.site.phase}"
                            if isinstance(new, float)
                            else f"{family}/{precision}/arg:{name}={new}@{op}#{c.site.k}:{c.site.phase}",
                            family,
                            precision,
                            "arg",
                            c.site.phase,
                            c.site,
                            name,
                            new,
                        )
                    )
                continue
            per_phase: dict[str, int] = {}
            for i in range(n_sites):
                phase = _PHASES[i % len(_PHASES)]
                per_phase[phase] = per_phase.get(phase, 0) + 1
            for phase, n in per_phase.items():
                for site in choose_sites(calls, phase, n, rng):
                    cases.append(
                        RealCase(
                            f"{family}/{precision}/{kind}@{site.op}#{site.k}:{phase}",
                            family,
                            precision,
                            kind,
                            phase,
                            site,
                        )
                    )
    return cases


# ------------------------------------------------------------------------------------- running


def _init_worker(steps: int = 2) -> None:
    torch.set_num_threads(1)  # bitwise-reproducible reductions, and the machine is shared
    warnings.simplefilter("ignore")
    STEPS["n"] = steps


def _bench_task(args: tuple[str, str, str, str]) -> tuple[str, str, float]:
    family, precision, path, data = args
    try:
        _, _, _, seconds = capture(family, precision, Path(path), Plan(), data)
    except Exception as exc:  # reported with every case that needs this bench
        return path, f"{type(exc).__name__}: {exc}", 0.0
    return path, "", seconds


def _clean_task(
    args: tuple[str, str, str, str, bool],
) -> tuple[str, str, list[dict[str, Any]], list[float], float, str]:
    family, precision, path, data, profile = args
    try:
        # profile: record every call, to choose fault sites from (slow; not needed for clean pairs alone)
        _, calls, losses, seconds = capture(family, precision, Path(path), Plan(), data, profile=profile)
    except Exception as exc:
        return family, precision, [], [], 0.0, f"{type(exc).__name__}: {exc}"
    return family, precision, [_call_json(c) for c in calls], losses, seconds, ""


def _fault_task(args: tuple[RealCase, str, str, str]) -> tuple[RealCase, dict[str, Any]]:
    case, path, data, obs_file = args
    try:
        obs, _, losses, seconds = capture(case.model, case.precision, Path(path), case.plan, data)
        info = {"obs": asdict(obs), "losses": losses, "capture_s": seconds}
    except Exception as exc:
        info = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-3)}"}
    Path(obs_file).write_text(json.dumps(info, default=str))
    return case, info


def _pool(fn: Any, items: list[Any], jobs: int, steps: int = 2) -> Iterable[Any]:
    """``fn`` over ``items`` in ``jobs`` spawned processes, a fresh one per item (a real-size run's
    memory goes back when it ends)."""
    if not items:
        return
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(
        max(1, jobs), initializer=_init_worker, initargs=(steps,), maxtasksperchild=1
    ) as pool:
        yield from pool.imap_unordered(fn, items)


def score_case(
    case: RealCase, target: Path, bench: Path, info: dict[str, Any], fresh: bool, timeout_s: int
) -> RealResult:
    """Compare a captured case with its bench and score it."""
    import tracecmp

    rc = case.as_case()
    out = RealResult(
        case.id,
        case.model,
        case.kind,
        case.precision,
        case.phase,
        rc.magnitude,
        rc.category,
        "",
        rc.expect_divergence,
        True,
        precision=case.precision,
    )
    out.losses = info.get("losses", [])
    out.capture_s = info.get("capture_s", 0.0)
    if "error" in info:
        out.status, out.outcome, out.error = "error", "error", "capture: " + info["error"]
        return out
    try:
        out.trace_mb = _dir_mb(target)
        if not rc.expect_divergence:
            measured = compare_fresh(target, bench, timeout_s) if fresh else None
            result = tracecmp.compare(str(target), str(bench), progress=False) if measured is None else None
            if measured is not None:
                out.compare_s, out.compare_rss_mb = measured["seconds"], measured["rss_mb"]
                out.roots = len(measured["roots"])
                out.skipped = list(measured.get("skipped", []))
                out.verdict, out.drift = measured.get("verdict", ""), measured.get("drift", "")
                out.beyond = measured.get("beyond")
                out.ranked = [
                    Record(r["op"], r["module"], r["phase"], r["step"], r["op_id"], r["kind"], r["reason"], r["score"])
                    for r in sorted(measured["roots"], key=lambda r: r["op_id"])
                ][:10]
                out.found = out.ranked[0] if out.ranked else None
                out.outcome = "clean" if not out.roots else "false-alarm"
                return out
            assert result is not None
            score(rc, result, None, out)
            return out
        obs = Observation(**info["obs"])
        truth, out.warnings = find_truth(rc, obs, target)
        out.truth = truth
        out.fault_size = obs.fault_size
        start = time.perf_counter()
        result = tracecmp.compare(str(target), str(bench), progress=False)
        out.compare_s = time.perf_counter() - start
        score(rc, result, truth, out)
    except HarnessError as exc:
        out.status, out.error, out.outcome = "harness", str(exc), "harness"
    except Exception as exc:
        out.status, out.outcome = "error", "error"
        out.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-3)}"
    return out


def _slug(text: str) -> str:
    return text.replace("/", "__").replace(":", "_").replace("#", "_").replace("=", "_")


# ------------------------------------------------------------------------------------- report


def report(results: list[RealResult], seconds: float, command: str, data: str) -> str:
    clean = [r for r in results if r.kind == "clean"]
    faults = [r for r in results if r.kind != "clean" and r.status != "harness"]
    n = len(faults)
    lines = [
        f"Command: `{command}` (runtime {seconds:.0f} s; {data})",
        "",
        f"- clean pairs with no root: {sum(r.status == 'ok' and r.roots == 0 for r in clean)} of {len(clean)} (goal: all)",
        f"- **top-1: {pct(sum(r.top1 for r in faults), n)}** (goal >= 95%); "
        f"suspects exactly the fault: {pct(sum(r.suspects_exact for r in faults), n)} (goal >= 95%)",
        f"- cases not set up: {sum(r.status == 'harness' for r in results)}; tracecmp errors: {sum(r.status == 'error' for r in results)}",
        "",
        "### Clean pairs (target against its fp32 bench, 2 steps)",
        "",
        (
            "| model | precision | losses (target) | roots | verdict | steps its loss scaler skipped | runs drifted apart from "
            f"| tensors off by {SCALE:.0%} or more in norm/mean, max/min: of those from the drift on (or all) | compare | peak RSS "
            "| trace |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in clean:
        losses = ", ".join(f"{v:.4f}" for v in r.losses)
        roots = str(r.roots) if r.status == "ok" else r.status
        skipped = ", ".join(map(str, r.skipped)) or "-"
        beyond = "-"
        if r.beyond and r.beyond["tensors"]:
            b, n = r.beyond, r.beyond["tensors"]
            beyond = (
                f"{b['norm_mean']:,} ({b['norm_mean'] / n:.0%}), {b['max_min']:,} ({b['max_min'] / n:.0%}) of {n:,}"
            )
        lines.append(
            f"| {r.model} | {r.precision} | {losses} | {roots} | {r.verdict or '-'} | {skipped} | {r.drift or '-'} | {beyond} | "
            f"{r.compare_s:.1f} s | {r.compare_rss_mb:,.0f} MB | "
            f"{r.trace_mb:,.1f} MB |"
        )
    lines.append("")
    lines += group_table("Faults by kind", faults, lambda r: r.kind)
    lines += group_table("Faults by model", faults, lambda r: r.model)
    lines += group_table("Faults by precision", faults, lambda r: r.precision)
    lines += group_table("Faults by phase", faults, lambda r: r.phase)
    lines += ["### Roots of clean pairs", ""]
    for r in clean:
        for d in r.ranked:
            lines.append(f"- `{r.id}`: {d.where()} [{d.kind}] {d.reason}")
        if r.status != "ok":
            lines.append(f"- `{r.id}`: {r.status}: {r.error.splitlines()[0] if r.error else ''}")
    lines += ["", "### Fault cases not found first, or with other suspects", ""]
    bad = [r for r in faults if not r.top1 or not r.suspects_exact]
    for r in bad:
        found = r.found.where() + f" [{r.found.kind}] {r.found.reason}" if r.found else "no divergence"
        truth = r.truth.where() if r.truth else "?"
        lines.append(f"- `{r.id}`: {r.outcome}, {r.roots} roots; truth {truth}; first {found}")
        for d in r.ranked[:4]:
            if r.truth is None or d.op_id != r.truth.op_id:
                lines.append(f"  - also {d.where()} [{d.kind}] {d.reason}")
        if r.error:
            lines.append(f"  - {r.error.splitlines()[0]}")
    if not bad:
        lines.append("none")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.localization.realsize",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--models",
        default=",".join(REAL_MODELS),
        help=f"comma-separated subset of {REAL_MODELS}, or of {EXTRA_MODELS} (on request only)",
    )
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help=f"comma-separated subset of {PRECISIONS}")
    parser.add_argument("--kinds", default=",".join(FAULT_KINDS), help=f"fault kinds, of {FAULT_KINDS}")
    parser.add_argument(
        "--sites",
        type=parse_sites,
        default="scale=2,nan=1,arg=1",
        help="sites per fault kind, model and precision: N, or KIND=N,... (default scale=2,nan=1,arg=1)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the site rule")
    parser.add_argument("--data", choices=("stats", "tensors"), default="stats")
    parser.add_argument(
        "--self-check", choices=("off", "sample", "full"), default="off", help="every run checks each op at capture"
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=2,
        help="training steps per run (whole-tensor traces of real-size models take ~8 GB a step)",
    )
    parser.add_argument("--clean-only", action="store_true", help="clean pairs only (no fault cases)")
    parser.add_argument("--case", action="append", default=[], help="only cases whose id contains this")
    parser.add_argument(
        "--within",
        default="",
        help="fault sites only in modules whose path contains this (e.g. attention.self); site seeds as without it",
    )
    parser.add_argument("--jobs", type=int, default=1, help="capture processes at once (each holds a model)")
    parser.add_argument("--workdir", type=Path, help="where traces go (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the traces in --workdir")
    parser.add_argument("--resume", action="store_true", help="capture only what --workdir lacks, compare everything")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds allowed per compare")
    parser.add_argument("--json", type=Path, help="write every case result here")
    parser.add_argument("--markdown", type=Path, help="write the report here as well")
    args = parser.parse_args(argv)
    os.environ[SELF_CHECK_ENV] = args.self_check
    _init_worker(args.steps)
    families = [m for m in args.models.split(",") if m]
    precisions = [p for p in args.precisions.split(",") if p]
    kinds = [k for k in args.kinds.split(",") if k]
    for name, values, known in (
        ("models", families, REAL_MODELS + EXTRA_MODELS),
        ("precisions", precisions, PRECISIONS),
        ("kinds", kinds, FAULT_KINDS),
    ):
        if not set(values) <= set(known):
            parser.error(f"unknown {name} {sorted(set(values) - set(known))}; choose from {known}")
    if args.resume and args.workdir is None:
        parser.error("--resume needs --workdir")
    start = time.perf_counter()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="tracecmp-realsize-"))
    work.mkdir(parents=True, exist_ok=True)
    keep = args.keep or args.resume
    results: list[RealResult] = []
    try:
        for family in families:
            results += _run_model(family, precisions, kinds, args, work)
            if not keep:
                shutil.rmtree(work / family, ignore_errors=True)
    finally:
        if args.workdir is None and not keep:
            shutil.rmtree(work, ignore_errors=True)
        elif keep:
            print(f"traces kept in {work}", file=sys.stderr)
    command = "python -m benchmarks.localization.realsize " + " ".join(argv if argv is not None else sys.argv[1:])
    publish(report(results, time.perf_counter() - start, command.strip(), args.data), results, args)
    return 0


def _run_model(
    family: str, precisions: list[str], kinds: list[str], args: argparse.Namespace, work: Path
) -> list[RealResult]:
    keep = args.keep or args.resume
    root = work / family
    root.mkdir(parents=True, exist_ok=True)
    say = lambda text: print(f"[{family}] {text}", file=sys.stderr, flush=True)  # noqa: E731
    benches = {BENCH_OF[p] for p in precisions}
    todo = [
        (family, b, str(root / f"bench-{b}"), args.data)
        for b in sorted(benches)
        if not (args.resume and (root / f"bench-{b}" / "manifest.json").exists())
    ]
    for path, err, seconds in _pool(_bench_task, todo, args.jobs, args.steps):
        say(f"bench {Path(path).name}: {err or f'{seconds:.0f} s'}")
    calls_by_precision: dict[str, list[CallRecord]] = {}
    infos: dict[str, dict[str, Any]] = {}
    profile = not args.clean_only
    done = "calls" if profile else "clean"
    todo = [
        (family, p, str(root / f"clean-{p}"), args.data, profile)
        for p in precisions
        if not (args.resume and (root / f"{done}-{p}.json").exists())
    ]
    for _, p, calls, losses, seconds, err in _pool(_clean_task, todo, args.jobs, args.steps):
        say(f"clean {p}: {err or f'{seconds:.0f} s, {len(calls)} calls, losses {losses}'}")
        (root / f"clean-{p}.json").write_text(
            json.dumps({"losses": losses, "capture_s": seconds} if not err else {"error": err})
        )
        if profile:
            (root / f"calls-{p}.json").write_text(json.dumps(calls))
    for p in precisions:
        infos[p] = json.loads((root / f"clean-{p}.json").read_text())
        if profile:
            calls_by_precision[p] = [_call_from_json(c) for c in json.loads((root / f"calls-{p}.json").read_text())]
    results: list[RealResult] = []
    for p in precisions:
        case = RealCase(f"{family}/{p}/clean", family, p, "clean")
        if args.case and not any(s in case.id for s in args.case):
            continue
        r = score_case(case, root / f"clean-{p}", root / f"bench-{BENCH_OF[p]}", infos[p], True, args.timeout)
        say(f"clean {p}: {r.roots} roots, compare {r.compare_s:.1f} s, {r.compare_rss_mb:.0f} MB")
        results.append(r)
    if args.clean_only:
        return results
    if args.within:
        calls_by_precision = {
            p: [c for c in calls if args.within in c.module] for p, calls in calls_by_precision.items()
        }
    cases = plan_cases(family, calls_by_precision, args.sites, args.seed, [k for k in kinds])
    if args.case:
        cases = [c for c in cases if any(s in c.id for s in args.case)]
    paths = {c.id: (str(root / "cases" / _slug(c.id)), str(root / "cases" / (_slug(c.id) + ".json"))) for c in cases}
    (root / "cases").mkdir(exist_ok=True)
    todo = [
        (c, paths[c.id][0], args.data, paths[c.id][1])
        for c in cases
        if not (args.resume and Path(paths[c.id][1]).exists())
    ]
    for i, (c, info) in enumerate(_pool(_fault_task, todo, args.jobs, args.steps), 1):
        say(f"captured {i}/{len(todo)} {c.id}" + (f": {info['error'].splitlines()[0]}" if "error" in info else ""))
    for c in cases:
        obs_file = Path(paths[c.id][1])
        info = json.loads(obs_file.read_text()) if obs_file.exists() else {"error": "not captured"}
        r = score_case(c, Path(paths[c.id][0]), root / f"bench-{BENCH_OF[c.precision]}", info, False, args.timeout)
        say(f"{c.id}: {r.outcome}, {r.roots} roots" + (" (suspects exact)" if r.suspects_exact else ""))
        results.append(r)
        if not keep:
            shutil.rmtree(paths[c.id][0], ignore_errors=True)
    return results


def _call_json(c: CallRecord) -> dict[str, Any]:
    """A call record as plain JSON (its arguments' values as text where they are not numbers)."""
    d = {f.name: getattr(c, f.name) for f in fields(c)}
    d["site"] = {"op": c.site.op, "phase": c.site.phase, "k": c.site.k}
    d["args"] = {k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v) for k, v in c.args.items()}
    return d


def _call_from_json(d: dict[str, Any]) -> CallRecord:
    site = Site(**d.pop("site"))
    return CallRecord(site=site, **d)


if __name__ == "__main__":
    sys.exit(main())
