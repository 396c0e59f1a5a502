"""Run the localization cases: capture target and bench, compare, score against the ground truth.

Ground truth comes from the target trace itself: the row whose output carries the checksum of
the faulty output that the injector saw (for a weight fault, the parameter's source row), so a
case is scored against what the run really recorded. Its module is then checked against our own
expectation and any disagreement is reported as a warning (a capture question, not a score).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
import zlib
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.compute as pc
import torch

from benchmarks.localization.cases import VARIANTS, WEIGHT_PERTURBATION, Case, plan_all, quick
from benchmarks.localization.faults import TF32_ROUNDING, TF32_ROUNDINGS, Injector, Observation, Plan, bitwise_equal
from benchmarks.localization.models import FAMILIES, build_workload

MODEL_SEED = 1234
DATA_MODES = ("stats", "tensors")
# What both runs record (``TraceCompare(data=...)``); ``--data`` sets it in every worker. With
# tensors, compare also replays each target op on its recorded inputs (tracecmp.numerics.replay).
CAPTURE = {"data": "stats"}


class HarnessError(Exception):
    """The case could not be set up as intended (not a localization failure)."""


@dataclass
class Record:
    """One reported divergence, flattened for JSON and tables."""

    op: str
    module: str
    phase: str
    step: int
    op_id: int
    kind: str = ""
    reason: str = ""
    score: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    region_ops: list[int] = field(default_factory=list)  # target ops of the region it names, if it names one

    @classmethod
    def of(cls, d: Any, regions: Any = ()) -> "Record":
        region = getattr(d, "region", None)
        members = next((list(r.target_ops) for r in regions if r.region_id == region), []) if region is not None else []
        return cls(
            d.op,
            d.module,
            d.phase,
            int(d.step),
            int(d.op_id),
            str(getattr(d, "kind", "")),
            str(getattr(d, "reason", "")),
            float(getattr(d, "score", 0.0) or 0.0),
            {str(k): _num(v) for k, v in dict(getattr(d, "metrics", {}) or {}).items()},
            members,
        )

    def where(self) -> str:
        return f"{self.op} @ {self.module or '<top>'} [{self.phase}] op_id {self.op_id}"


@dataclass
class Result:
    """The outcome of one case."""

    id: str
    model: str
    kind: str
    variant: str
    phase: str
    magnitude: float
    category: str
    structure: str
    expect_divergence: bool
    counted: bool
    status: str = "ok"  # ok | error (tracecmp raised) | harness (the case could not be set up)
    error: str = ""
    truth: Record | None = None
    found: Record | None = None
    ranked: list[Record] = field(default_factory=list)  # first divergence, then other suspects
    top1: bool = False  # op, phase and module of the first divergence match the truth
    exact: bool = False  # ... and it is the very same node (op_id)
    top3: bool = False
    rank: int | None = None  # 1-based position of the truth among the ranked suspects
    roots: int = 0  # how many roots compare reported
    suspects_exact: bool = False  # every root is the fault itself (or its own backward, for an argument)
    outcome: str = ""  # hit | missed | early | late | same-node-other-attrs | false-alarm | clean | error
    truth_detail: dict[str, Any] = field(default_factory=dict)  # compare's verdict on the true op
    warnings: list[str] = field(default_factory=list)
    seconds: float = 0.0
    fault_size: float | None = None  # relative change the fault made to the site's output
    background: float = 0.0  # relative error the tf32 background alone leaves on that output
    ratio: float | None = None  # fault_size / background: below 1 the fault hides in the noise


def _num(v: Any) -> Any:
    if hasattr(v, "tolist"):  # shapes arrive as numpy arrays
        v = v.tolist()
    if isinstance(v, (list, tuple, str)):
        return str(v) if not isinstance(v, str) else v
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    return f if math.isfinite(f) else str(f)


def record_run(family: str, plan: Plan, path: Path, weight: str = "", weight_seed: int = 0) -> Observation:
    """One training step of ``family`` under ``plan``, captured into ``path``."""
    import tracecmp

    workload = build_workload(family, MODEL_SEED)
    if weight:
        param = dict(workload.model.named_parameters())[weight]
        before = param.detach().clone()
        gen = torch.Generator().manual_seed(weight_seed)
        with torch.no_grad():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float64)
            param.copy_((param.double() * (1.0 + WEIGHT_PERTURBATION * noise)).to(param.dtype))
        if bitwise_equal(before, param.detach()):
            raise HarnessError(f"perturbing {weight} changed no bit")
    optimizer = workload.make_optimizer()
    injector = Injector(workload.model, plan)
    # The emulated TF32 device says so, as a real one does: its float32 matmul precision is not
    # "highest" (compare allows TF32 rounding only for runs that could have used it).
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if plan.tf32 else "highest")
    try:
        with injector.outer():
            with tracecmp.TraceCompare(str(path), model=workload.model, data=CAPTURE["data"]) as tc:
                with injector.inner():
                    workload.train_step(optimizer)
                tc.step()
    finally:
        torch.set_float32_matmul_precision(precision)
    return injector.obs


def find_truth(case: Case, obs: Observation, trace_path: Path) -> tuple[Record, list[str]]:
    """The target-trace row of the injected fault, and warnings from the sanity checks."""
    import tracecmp

    rank = tracecmp.load(str(trace_path)).rank(0)
    ops = rank.ops
    notes: list[str] = []
    if case.kind == "weight":
        rows = ops[(ops["kind"] == "source") & (ops["name"] == case.weight)]
        if rows.empty:
            raise HarnessError(f"the target trace has no source node named {case.weight!r}")
        row = rows.sort_values("op_id").iloc[0]
        expected_module = case.weight.rpartition(".")[0]
        if row["module"] != expected_module:
            notes.append(f"parameter module: trace says {row['module']!r}, owner is {expected_module!r}")
        return _row_record(row), notes
    site = case.site
    assert site is not None
    if not obs.site_reached:
        raise HarnessError(f"the run never called {site}")
    if case.target.arg_fault is not None and not obs.effective:
        raise HarnessError(
            f"setting {case.target.arg_fault.name}={case.target.arg_fault.value!r} changed no output bit of {site}"
        )
    if case.target.output_fault is not None:
        if not obs.fault_applied:
            raise HarnessError(f"{site} never reached the outer fault mode (capture bypassed the mode stack?)")
        if not obs.effective:
            raise HarnessError(f"the {case.kind} fault changed no bit of {site}'s output")
    # From Arrow, not pandas: the DataFrame holds checksums as float64 (nulls on views), which
    # drops their low bits.
    table = rank.tensors_table
    hit = pc.is_in(table["checksum"], value_set=pa.array(obs.site_checksums, type=pa.int64()))
    producers = table.filter(pc.fill_null(hit, False))["op_id"].to_pylist()
    rows = ops[ops["op_id"].isin(producers) & (ops["op"] == site.op)].sort_values("op_id")
    if rows.empty:
        raise HarnessError(f"no row of {site.op} in the target trace holds the faulty output (checksum)")
    row = rows.iloc[0]
    kth = ops[(ops["kind"] == "op") & (ops["op"] == site.op) & (ops["phase"] == site.phase)].sort_values("op_id")
    if case.target.insertion is None and (len(kth) <= site.k or int(kth.iloc[site.k]["op_id"]) != int(row["op_id"])):
        notes.append(f"the {site.k}-th {site.op} in {site.phase} of the trace is not the faulty call")
    if row["phase"] != site.phase:
        notes.append(f"phase: trace says {row['phase']!r}, benchmark saw {site.phase!r}")
    if obs.site_module not in (None, "?") and site.phase != "optimizer" and row["module"] != obs.site_module:
        notes.append(f"module: trace says {row['module']!r}, benchmark expected {obs.site_module!r}")
    return _row_record(row), notes


def _row_record(row: Any) -> Record:
    return Record(str(row["op"]), str(row["module"]), str(row["phase"]), int(row["step"]), int(row["op_id"]))


def _matches(d: Record, truth: Record) -> bool:
    """The true op, phase and module; or the region holding the true op (a fused op's region)."""
    return (d.op, d.phase, d.module) == (truth.op, truth.phase, truth.module) or truth.op_id in d.region_ops


_NODE_FIELDS = (
    "bench_op_id",
    "status",
    "error",
    "introduced",
    "own_error",
    "honest_error",
    "metric",
    "root_kind",
    "reason",
)
_TENSOR_FIELDS = (
    "index",
    "shape",
    "dtype",
    "exact",
    "e_ext",
    "e_sys",
    "norm_rel_diff",
    "max_diff",
    "min_diff",
    "mean_diff",
    "within_tol",
    "nonfinite_mismatch",
    "status",
)


def truth_detail(result: Any, op_id: int) -> dict[str, Any]:
    """What compare measured at the true op: its node verdict, its output tensors' metrics, and how
    many of its inputs compare bitwise equal (a root whose inputs all agree bitwise is unambiguous
    when target and bench run on the same device)."""
    detail: dict[str, Any] = {}
    nodes = result.nodes[(result.nodes["rank"] == 0) & (result.nodes["op_id"] == op_id)]
    if len(nodes):
        detail["node"] = {k: _num(v) for k, v in nodes.iloc[0].items() if k in _NODE_FIELDS and not _blank(v)}
    frame = result.to_frame()
    frame = frame[frame["rank"] == 0] if "rank" in frame.columns else frame
    outputs = frame[frame["op_id"] == op_id]
    detail["outputs"] = [
        {k: _num(v) for k, v in r.items() if k in _TENSOR_FIELDS and not _blank(v)} for r in outputs.to_dict("records")
    ]
    rank = result.target.rank(0)
    ops = rank.ops
    row = ops[ops["op_id"] == op_id]
    if len(row):
        # Views carry no statistics: judge an input by the tensor it views.
        view_of = dict(zip(rank.tensors["tensor_id"].tolist(), rank.tensors["view_of"].tolist()))
        inputs = []
        for t in row.iloc[0]["inputs"]:
            t = int(t)
            while view_of.get(t, -1) not in (-1, None) and not _blank(view_of.get(t)):
                t = int(view_of[t])
            inputs.append(t)
        measured = frame[frame["tensor_id"].isin(inputs)]
        exact = int(measured["exact"].astype(bool).sum()) if "exact" in measured.columns else 0
        detail["inputs"] = f"{exact}/{len(inputs)} bitwise equal, {len(inputs) - len(measured)} not measured"
    return detail


def _blank(v: Any) -> bool:
    return v is None or (isinstance(v, str) and v == "") or (isinstance(v, float) and math.isnan(v))


def suspects_exact(suspects: list[Any], truth: Record) -> bool:
    """True when compare reported the fault and nothing else: every root is the true node, or an
    argument root at that op's own backward in the same module (a changed argument both share)."""
    parts = truth.op.split(".")
    backward = parts[1] + "_backward" if len(parts) >= 3 else ""
    for d in suspects:
        if d.op_id == truth.op_id:
            continue
        name = d.op.split(".")[1] if d.op.count(".") >= 2 else d.op
        if d.kind == "argument" and backward and name == backward and d.module == truth.module:
            continue
        return False
    return bool(suspects)


def score(case: Case, result: Any, truth: Record | None, out: Result) -> None:
    """Fill the scoring fields of ``out`` from a CompareResult."""
    first = result.first_divergence
    regions = getattr(result, "regions", ())
    out.found = Record.of(first, regions) if first is not None else None
    ranked = [out.found] if out.found else []
    for s in list(result.suspects or []):
        rec = Record.of(s, regions)
        if all(rec.op_id != r.op_id for r in ranked):
            ranked.append(rec)
    out.ranked = ranked[:10]
    out.roots = len(result.suspects or [])
    if not case.expect_divergence:
        out.outcome = "clean" if first is None else "false-alarm"
        return
    assert truth is not None
    out.suspects_exact = suspects_exact(result.suspects or [], truth)
    out.top1 = out.found is not None and _matches(out.found, truth)
    out.exact = out.top1 and out.found is not None and out.found.op_id == truth.op_id
    hits = [i for i, r in enumerate(ranked) if _matches(r, truth)]
    out.rank = hits[0] + 1 if hits else None
    out.top3 = bool(hits) and hits[0] < 3
    if out.found is None:
        out.outcome = "missed"
    elif out.top1:
        out.outcome = "hit"
    elif out.found.op_id == truth.op_id:
        out.outcome = "same-node-other-attrs"
    else:
        out.outcome = "early" if out.found.op_id < truth.op_id else "late"
    if not out.top1:
        out.truth_detail = truth_detail(result, truth.op_id)


def _ratio(size: float, background: float) -> float:
    if math.isnan(background):
        return math.nan
    return size / background if background > 0 else math.inf


class _Timeout(Exception):
    pass


def _alarm(*_: Any) -> None:
    raise _Timeout()


def run_case(case: Case, bench_path: Path, work: Path, keep: bool, timeout_s: int) -> Result:
    """Capture the target of ``case``, compare it with ``bench_path`` and score it."""
    import tracecmp

    out = Result(
        case.id,
        case.model,
        case.kind,
        case.variant,
        case.phase,
        case.magnitude,
        case.category,
        case.structure,
        case.expect_divergence,
        case.counted,
        background=case.background,
    )
    target = work / "targets" / case.id.replace("/", "__").replace(":", "_")
    shutil.rmtree(target, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(timeout_s)
    try:
        obs = record_run(
            case.model, case.target, target, case.weight, weight_seed=zlib.crc32(f"{case.model}/{case.weight}".encode())
        )
        out.fault_size = WEIGHT_PERTURBATION if case.weight else obs.fault_size
        if out.fault_size is not None:
            out.ratio = _ratio(out.fault_size, case.background)
        truth = None
        if case.expect_divergence:
            truth, out.warnings = find_truth(case, obs, target)
            out.truth = truth
        result = tracecmp.compare(str(target), str(bench_path))
        score(case, result, truth, out)
    except HarnessError as exc:
        out.status, out.error, out.outcome = "harness", str(exc), "harness"
    except _Timeout:
        out.status, out.error, out.outcome = "error", f"timed out after {timeout_s} s", "error"
    except Exception as exc:  # tracecmp failing on a case is a result to report, not a crash
        out.status, out.outcome = "error", "error"
        out.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-3)}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        out.seconds = time.perf_counter() - start
        if not keep:
            shutil.rmtree(target, ignore_errors=True)
    return out


def bench_key(case: Case) -> str:
    """A folder name for the bench a case needs (shared by every case with the same bench)."""
    ins = case.bench.insertion
    model = case.bench_family
    return f"{model}__clean" if ins is None else f"{model}__{ins.how}_{ins.site.op}_{ins.site.k}"


def _init_worker(data: str = "stats", tf32_rounding: str = "nearest") -> None:
    torch.set_num_threads(1)  # bitwise-equal reductions in bench and target whatever the worker
    warnings.simplefilter("ignore")
    CAPTURE["data"] = data
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


def _pool_map(fn: Any, items: list[Any], jobs: int, data: str, tf32_rounding: str) -> Iterable[Any]:
    if jobs <= 1:
        _init_worker(data, tf32_rounding)
        yield from map(fn, items)
        return
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(jobs, initializer=_init_worker, initargs=(data, tf32_rounding)) as pool:
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
    args = parser.parse_args(argv)
    _init_worker(args.data, args.tf32_rounding)

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
        for path, err in _pool_map(_bench_task, list(benches.values()), args.jobs, args.data, args.tf32_rounding):
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
        for i, r in enumerate(_pool_map(_case_task, todo, args.jobs, args.data, args.tf32_rounding), 1):
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
