"""Run one localization case: capture target (and bench), compare, score against the ground truth.

Ground truth comes from the target trace itself: the row whose output carries the checksum of
the faulty output that the injector saw (for a weight fault, the parameter's source row), so a
case is scored against what the run really recorded. Its module is then checked against our own
expectation and any disagreement is reported as a warning (a capture question, not a score).

The benchmark (``python -m benchmarks.localization``) runs every case through :func:`run_case` in a
pool and tabulates the results; the smoke tests run a few.
"""

from __future__ import annotations

import math
import shutil
import signal
import time
import traceback
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
import torch

from workloads.localization.cases import WEIGHT_PERTURBATION, Case
from workloads.localization.faults import Injector, Observation, Plan, bitwise_equal
from workloads.localization.models import build_workload

if TYPE_CHECKING:
    import pandas as pd

MODEL_SEED = 1234
DATA_MODES = ("stats", "tensors")
# What both runs record (``TraceCompare(data=...)``); ``--data`` sets it in every worker. With
# tensors, compare also replays each target op on its recorded inputs (tracecmp.numerics.replay).
CAPTURE = {"data": "stats", "self_check": "off"}


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
            with tracecmp.TraceCompare(
                str(path), model=workload.model, data=CAPTURE["data"], self_check=CAPTURE["self_check"]
            ) as tc:
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
    kth = ops[(ops["kind"] == "op") & (ops["op"] == site.op) & (ops["phase"] == site.phase)].sort_values("op_id")
    # The call whose outputs hold most of the site's checksums, the site's own call among equals:
    # another call may hold one of them (two batch norms' backward fed the same gradient return
    # the same bias gradient), or all (a call repeated on the same inputs).
    held = rows["op_id"].map(producers.count)
    rows = rows[held == held.max()]
    own = rows[rows["op_id"] == int(kth.iloc[site.k]["op_id"])] if len(kth) > site.k else rows.iloc[:0]
    row = (own if not own.empty else rows).iloc[0]
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


def beyond_fault_size(tensors: pd.DataFrame, rank: int, from_op: int, size: float) -> dict[str, int]:
    """How many compared float tensors a clean pair made from op ``from_op`` on (where its runs
    drifted apart, or its first op), and how many of them differ from the bench's by ``size`` (a
    fault's relative size) or more, in norm/mean and at the extremes (max/min). Where clean tensors
    differ that much, statistics cannot tell a fault of that size from the pair's own rounding.

    >>> import pandas as pd
    >>> t = pd.DataFrame({"rank": [0, 0, 0, 0], "op_id": [3, 7, 8, 9], "numel": [10, 10, 10, 10],
    ...                   "unit": [0.0039, 0.0039, 0.0, 0.0039], "exact": [False, False, False, True],
    ...                   "e_sys": [0.2, 0.06, 1.0, 0.0], "e_ext": [0.3, 0.01, 1.0, 0.0]})
    >>> beyond_fault_size(t, 0, 5, 0.05)  # op 8's output holds integers: not counted
    {'from_op': 5, 'tensors': 2, 'norm_mean': 1, 'max_min': 0}
    """
    rows = tensors[
        (tensors["rank"] == rank) & (tensors["op_id"] >= from_op) & (tensors["numel"] > 1) & (tensors["unit"] > 0)
    ]
    rows = rows[rows["e_sys"].notna()]
    off = rows[~rows["exact"].astype(bool)]
    return {
        "from_op": from_op,
        "tensors": len(rows),
        "norm_mean": int((off["e_sys"] >= size).sum()),
        "max_min": int((off["e_ext"] >= size).sum()),
    }
