"""``check``: judge every op of one run against a float64 replay, with no bench run.

Per rank, the computing ops of the chosen steps are replayed on their recorded inputs where the
trace saved them (:mod:`tracecmp.numerics.replay`, judged by :mod:`tracecmp.checking.standards`), and on
random inputs drawn to their statistics where it did not (:mod:`tracecmp.checking.statistics`,
weaker evidence). Ops that cannot be replayed on the CPU are listed as skipped with the reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import pandas as pd

from tracecmp.aten.opclass import classify
from tracecmp.aten.rounding import REDUCED_MODELS
from tracecmp.checking.result import NODE_COLUMNS, CheckResult
from tracecmp.checking.standards import OpVerdict, Standards, judge_replay
from tracecmp.checking.statistics import StatisticsChecker
from tracecmp.errors import TracecmpError
from tracecmp.graph.checks import OwnCheck, own_checks
from tracecmp.numerics.fits import FIT_BOUND, ModelFit, model_fits
from tracecmp.numerics.precision import reduced_matmul_precision, reduced_precision_possible
from tracecmp.numerics.replay import OwnError, Replayer, Skipped, auto_workers, replay_ops, run_in_workers
from tracecmp.numerics.units import EPS
from tracecmp.trace.reader import RankTrace, Trace, load
from tracecmp.verdict.progress import Progress, shown_anywhere
from tracecmp.verdict.records import Divergence

DATA_MODES = ("auto", "tensors", "statistics")
_PROGRESS_OPS = 2_000  # a bar on a terminal, a line per tenth elsewhere (a log, a CI job)


class CheckError(TracecmpError):
    """A trace cannot be checked as asked (no tensors for ``data="tensors"``, no such step)."""


def _reduced(trace: Trace) -> tuple[str | None, str]:
    """(the precision float32 matmul/conv may run at, or None; how the trace says so)."""
    flags = trace.manifest.get("determinism")
    precision = flags.get("float32_matmul_precision") if isinstance(flags, dict) else None
    if not reduced_precision_possible(trace):
        return None, f"float32_matmul_precision={precision!r} on the CPU: float32 matmuls are held to float32"
    reduced = reduced_matmul_precision(trace)
    if precision in ("high", "medium"):
        return reduced, f"declared: float32_matmul_precision={precision!r}"
    if precision is None:
        return reduced, "possible: the trace does not record float32_matmul_precision"
    return reduced, "possible: the run used an accelerator (TF32 convolutions, HF32 on NPUs)"


def check(
    trace: str | Path | Trace,
    *,
    data: str = "auto",
    standards: Standards | str | None = None,
    steps: Iterable[int] | None = None,
    ranks: Iterable[int] | None = None,
    workers: int | None = None,
    progress: bool | None = None,
) -> CheckResult:
    """Judge every op of one run against a float64 replay of its recorded inputs (no bench run).

    ``data="auto"`` replays ops on their recorded inputs where the trace saved them (``data=
    "tensors"`` at capture, possibly restricted with ``only=``) and on random inputs drawn to
    their statistics elsewhere (weaker evidence); ``"tensors"`` requires saved tensors;
    ``"statistics"`` uses statistics throughout. ``standards`` (a :class:`Standards` or its CLI
    text) sets the thresholds; ``workers`` the processes to replay with (default: chosen by size).

    >>> result = tracecmp.check("runs/target")            # doctest: +SKIP
    >>> result.first_error.op, result.first_error.module  # doctest: +SKIP
    ('aten.gelu.default', 'blocks.1.mlp.act')
    """
    if data not in DATA_MODES:
        raise CheckError(f"data must be one of {DATA_MODES}, not {data!r}")
    if isinstance(standards, str):
        standards = Standards.parse(standards)
    std = standards or Standards()
    trace = _as_trace(trace)
    warnings: list[str] = []
    notes: list[str] = []
    if not trace.complete:
        warnings.append("the trace is incomplete (its capture did not finish): checked as far as it goes")
    chosen = trace.ranks if ranks is None else sorted(set(int(r) for r in ranks))
    missing = [r for r in chosen if r not in trace.ranks]
    if missing:
        raise CheckError(f"trace has no rank {missing[0]} (ranks: {trace.ranks})", path=trace.path)
    wanted_steps = None if steps is None else {int(s) for s in steps}
    reduced, how = _reduced(trace)
    notes.append(
        f"float32 matmul/conv: {how}" + (f"; honest replays round their inputs to {reduced}" if reduced else "")
    )
    plans = _plans(trace, chosen, wanted_steps)
    total = sum(len(ops) for _, _, ops in plans)
    frames, verdicts_all = [], []
    bar = Progress(
        "check", shown_anywhere(progress, total >= _PROGRESS_OPS), total, label_width=26, time_width=6, rate="ops"
    )
    run = _CheckRun(data, std, reduced, workers, bar, warnings, notes)
    evidence_kinds: set[str] = set()
    try:
        for r, rank, ops in plans:
            verdicts = _check_rank(rank, ops, run)
            evidence_kinds.update(v.evidence for v in verdicts.values() if v.evidence)
            frame = _frame(r, ops, verdicts)
            frames.append(frame)
            verdicts_all.append((r, ops, verdicts))
    finally:
        bar.close()
    nodes = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=list(NODE_COLUMNS))
    divergences = _divergences(verdicts_all)
    first = divergences[0] if divergences else None
    suspects = sorted(divergences, key=lambda d: (-d.score if not math.isnan(d.score) else 0.0, d.step, d.op_id))
    evidence = _evidence(evidence_kinds, warnings, notes)
    steps_seen = sorted({int(s) for s in nodes["step"].unique()}) if len(nodes) else []
    return CheckResult(
        trace=trace,
        first_error=first,
        suspects=suspects,
        nodes=nodes,
        standards=std,
        warnings=warnings,
        notes=notes,
        evidence=evidence,
        ranks=chosen,
        steps=steps_seen,
    )


def _as_trace(trace: str | Path | Trace) -> Trace:
    """``trace`` loaded where it is a folder."""
    if isinstance(trace, (str, Path)):
        return load(trace)
    if not isinstance(trace, Trace):
        raise CheckError(f"trace must be a trace folder or a Trace, got {type(trace).__name__}")
    return trace


def _plans(trace: Trace, chosen: list[int], wanted_steps: set[int] | None) -> list[tuple[int, RankTrace, pd.DataFrame]]:
    """Per chosen rank: its computing ops of the wanted steps; a :class:`CheckError` where a step
    was asked for and no rank has an op in it."""
    total = 0
    plans = []
    for r in chosen:
        rank = trace.rank(r)
        ops = rank.ops
        ops = ops[ops["kind"] == "op"]
        if wanted_steps is not None:
            ops = ops[ops["step"].isin(wanted_steps)]
        plans.append((r, rank, ops))
        total += len(ops)
    if wanted_steps is not None and total == 0:
        raise CheckError(
            f"the trace has no op in step(s) {sorted(wanted_steps)} (steps: "
            f"{sorted({s for _, rk, _ in plans for s in rk.manifest.get('steps', [])})})",
            path=trace.path,
        )
    return plans


def _divergences(verdicts_all: list[tuple[int, pd.DataFrame, dict[int, OpVerdict]]]) -> list[Divergence]:
    """The ops judged in error, as divergences in execution order (step, rank, op)."""
    divergences: list[Divergence] = []
    for r, ops, verdicts in verdicts_all:
        info = ops.set_index("op_id")
        for op_id, v in verdicts.items():
            if v.status != "error":
                continue
            row = info.loc[op_id]
            divergences.append(
                Divergence(
                    op=str(row["op"]),
                    module=str(row["module"]),
                    phase=str(row["phase"]),
                    step=int(row["step"]),
                    location=str(row["location"]),
                    op_id=int(op_id),
                    rank=r,
                    kind=v.kind or "computation",
                    reason=v.reason,
                    score=float(v.score),
                    metrics={k: float(x) for k, x in v.metrics.items() if isinstance(x, (int, float))},
                    stack=str(row.get("stack", "") or ""),
                )
            )
    divergences.sort(key=lambda d: (d.step, d.rank, d.op_id))
    return divergences


def _evidence(evidence_kinds: set[str], warnings: list[str], notes: list[str]) -> str:
    """What the verdicts rest on ("tensors", "statistics", "self-check", "mixed" or "none"),
    warning where statistics alone are, noting what no evidence of one run can see."""
    if evidence_kinds & {"self-check", "statistics"}:
        notes.append(
            "a pass says each op computed what its arguments asked; a changed argument or op (a GELU "
            "approximation, an eps) needs a bench run: tracecmp compare TARGET BENCH"
        )
    evidence = "mixed" if len(evidence_kinds) > 1 else (next(iter(evidence_kinds)) if evidence_kinds else "none")
    if evidence_kinds == {"self-check"}:
        evidence = "self-check"
    elif evidence_kinds - {"self-check"}:
        kinds = evidence_kinds - {"self-check"}
        evidence = "mixed" if len(evidence_kinds) > 1 else next(iter(kinds))
    if "statistics" in evidence_kinds:
        warnings.append(
            "statistics-only evidence for some ops: judged on random inputs drawn to their statistics, which "
            "pins only a few numbers (extremes of monotone ops, a softmax's mean, the precision grid, NaN/Inf); "
            "weaker than a replay of recorded inputs"
        )
    return evidence


@dataclass(frozen=True)
class _CheckRun:
    """What every rank of one check is judged with."""

    data: str
    std: Standards
    reduced: str | None
    workers: int | None
    bar: Progress
    warnings: list[str]  # the check's warnings, appended to
    notes: list[str]  # the check's notes, appended to


def _check_rank(rank: RankTrace, ops: pd.DataFrame, run: _CheckRun) -> dict[int, OpVerdict]:
    """Verdicts for the ops ``ops`` of one rank: by replay where it saved tensors, by statistics
    where it did not (or as asked)."""
    op_ids = ops["op_id"].tolist()
    names = dict(zip(ops["op_id"].tolist(), ops["op"].tolist()))
    has_tensors = bool(rank.data_files)
    if run.data == "tensors" and not rank.data_files:
        raise CheckError(
            'the trace holds statistics only, no tensors: capture it with TraceCompare(..., data="tensors") (restricted '
            'to a region with only=... for a large model), or check its statistics with data="statistics" '
            "(tracecmp check --data statistics)",
            path=rank.path,
        )
    count = auto_workers(len(op_ids)) if run.workers is None else max(1, int(run.workers))
    if run.data != "statistics" and has_tensors:
        verdicts, fallback = _replay_verdicts(rank, op_ids, names, count, run)
    else:
        verdicts = {}
        if run.data == "auto":
            run.warnings.append(
                f"rank {rank.rank}: the trace holds no tensors: every op judged from statistics "
                '(capture with TraceCompare(..., data="tensors") for a full check)'
            )
        fallback = op_ids
    if fallback:
        checked = own_checks(rank.checks, dict(zip(rank.ops["op_id"].tolist(), rank.ops["op"].tolist())))
        by_check = [o for o in fallback if o in checked]
        for op_id in by_check:
            verdicts[op_id] = _self_check_verdict(op_id, checked[op_id])
        run.bar.update(f"rank {rank.rank}: self-checks", advance=len(by_check))
        fallback = [o for o in fallback if o not in checked]
        if run.workers is None:  # the few ops left may not pay for starting workers
            count = auto_workers(len(fallback))
    if fallback:
        verdicts.update(_statistics_verdicts(rank, fallback, count, run))
    return verdicts


def _self_check_verdict(op_id: int, check: OwnCheck) -> OpVerdict:
    """An op judged by its own check at capture: its sampled outputs against float64 values
    recomputed from its own inputs (capture/selfcheck.py)."""
    score = check.residual / check.limit if check.limit > 0 else math.inf
    metrics = {"self_check_residual": check.residual, "self_check_limit": check.limit}
    checks = f"self-check ({check.how}, {check.sampled})"
    if check.failed:
        return OpVerdict(
            op_id, "error", "self-check", check.describe(), "computation", score, metrics=metrics, checks=checks
        )
    if math.isnan(check.residual):
        return OpVerdict(op_id, "skipped", reason="its self-check at capture measured nothing")
    return OpVerdict(op_id, "pass", "self-check", check.describe(), score=score, metrics=metrics, checks=checks)


def _replay_verdicts(
    rank: RankTrace, op_ids: list[int], names: dict[int, str], count: int, run: _CheckRun
) -> tuple[dict[int, OpVerdict], list[int]]:
    """The ops replayed on their recorded inputs in ``count`` workers: their verdicts, and the ops
    to judge from statistics instead (their inputs were not saved, with ``data="auto"``)."""
    reduced, std = run.reduced, run.std
    verdicts: dict[int, OpVerdict] = {}
    fallback: list[int] = []
    run.bar.update(f"rank {rank.rank}: replaying")
    found = replay_ops(
        rank,
        op_ids,
        reduced=reduced,
        detail=std.element_ulps,
        workers=count,
        progress=lambda n: run.bar.update(advance=n),
        small_on_one_thread=True,
    )
    own = {o: f for o, f in found.items() if isinstance(f, OwnError)}
    fits = model_fits(own, names) if reduced else {}
    for op_id in op_ids:
        f = found.get(op_id)
        if isinstance(f, OwnError):
            fit = fits.get(names[op_id])
            model = REDUCED_MODELS[reduced][fit.model][0] if fit is not None and reduced else ""
            verdicts[op_id] = judge_replay(f, classify(names[op_id]), std, reduced, fit, model)
        elif isinstance(f, Skipped) and f.data_missing and run.data == "auto":
            fallback.append(op_id)
        elif isinstance(f, Skipped):
            verdicts[op_id] = OpVerdict(op_id, "skipped", reason=f.reason)
        else:
            verdicts[op_id] = OpVerdict(op_id, "skipped", reason="not replayed")
    _explain_precision(rank, verdicts, own, names, reduced, run.notes)
    _precision_notes(rank, own, fits, names, run)
    return verdicts, fallback


def _precision_notes(
    rank: RankTrace, own: dict[int, OwnError], fits: dict[str, ModelFit], names: dict[int, str], run: _CheckRun
) -> None:
    """Where float32 matmul/conv may run reduced: note the calls computed at full float32
    precision, and those a replay on rounded inputs reproduces."""
    reduced, std, notes = run.reduced, run.std, run.notes
    if reduced:
        full = [
            o
            for o, e in own.items()
            if e.dtype == "float32" and classify(names[o]).precision_variable and e.error <= std.floor * EPS["float32"]
        ]
        if full:
            notes.append(
                f"rank {rank.rank}: {len(full)} float32 matmul/conv calls are within {std.floor:g} float32 "
                "rounding units of float64: the run computed them at full float32 precision"
            )
    if fits and reduced:
        counted = {}
        for fit in fits.values():
            counted.setdefault(REDUCED_MODELS[reduced][fit.model][0], []).append(fit.members)
        for how, members in counted.items():
            notes.append(
                f"rank {rank.rank}: {sum(members)} float32 matmul/conv calls are reproduced by inputs rounded "
                f"to {reduced} ({how}): the run computed them at that precision"
            )


def _statistics_verdicts(rank: RankTrace, fallback: list[int], count: int, run: _CheckRun) -> dict[int, OpVerdict]:
    """Verdicts for the ops ``fallback`` from random inputs drawn to their statistics, in ``count``
    workers where the rank is large enough."""
    run.bar.update(f"rank {rank.rank}: statistics")
    options = {"reduced": run.reduced, "standards": run.std}
    if count > 1 and len(fallback) > 1 and rank.manifest.get("chunks"):
        found_stats = run_in_workers(
            rank,
            fallback,
            "tracecmp.checking.statistics:StatisticsChecker.check",
            options,
            workers=count,
            progress=lambda n: run.bar.update(advance=n),
        )
    else:
        checker = StatisticsChecker(rank, **options)  # type: ignore[arg-type]
        found_stats = {}
        for index, op_id in enumerate(fallback, 1):
            found_stats[op_id] = checker.check(op_id)
            if index % 100 == 0:
                run.bar.update(advance=100)
        run.bar.update(advance=len(fallback) % 100)
    return found_stats


def _explain_precision(
    rank: RankTrace,
    verdicts: dict[int, OpVerdict],
    own: dict[int, OwnError],
    names: dict[int, str],
    reduced: str | None,
    notes: list[str],
) -> None:
    """For float32 matmul/conv that err under a full-precision standard: do their outputs match a
    replay on inputs rounded to TF32 or bf16? Then say so (the run computed at reduced precision
    it did not declare: TF32/HF32, or float16-rounded inputs, which share TF32's 10 mantissa bits)."""
    if reduced is not None:
        return
    suspects = [
        o
        for o, v in verdicts.items()
        if v.status == "error" and o in own and own[o].dtype == "float32" and classify(names[o]).precision_variable
    ]
    if not suspects:
        return
    matched: dict[int, str] = {}
    for model in ("tf32", "bf16"):
        with Replayer(rank, reduced=model) as replayer:
            for op_id in suspects:
                if op_id in matched:
                    continue
                found = replayer.replay(op_id)
                if isinstance(found, OwnError) and found.fits:
                    best = min(range(len(found.fits)), key=lambda m: found.fits[m])
                    if found.fits[best] <= FIT_BOUND:
                        matched[op_id] = f"{model} ({REDUCED_MODELS[model][best][0]})"
    for op_id, how in matched.items():
        verdicts[op_id].reason += (
            f"; it matches a replay on inputs rounded to {how}: it computed at reduced precision "
            + ("(10 mantissa bits: TF32/HF32, or float16 inputs)" if how.startswith("tf32") else "(bf16 inputs)")
            + " which the run does not declare"
        )
        verdicts[op_id].kind = "computation"


def _frame(rank: int, ops: pd.DataFrame, verdicts: dict[int, OpVerdict]) -> pd.DataFrame:
    rows = []
    for op_id, step, phase, op, module, location in zip(
        ops["op_id"].tolist(),
        ops["step"].tolist(),
        ops["phase"].tolist(),
        ops["op"].tolist(),
        ops["module"].tolist(),
        ops["location"].tolist(),
    ):
        v = verdicts.get(op_id) or OpVerdict(op_id, "skipped", reason="not checked")
        m = v.metrics
        rows.append(
            (
                rank,
                op_id,
                step,
                phase,
                "op",
                op,
                module,
                location,
                v.status,
                v.evidence,
                v.dtype,
                v.kind,
                v.score if v.status in ("error", "warning") else math.nan,
                m.get("own_error", math.nan),
                m.get("honest_error", math.nan),
                m.get("error_units", math.nan),
                m.get("ratio", math.nan),
                m.get("max_ulps", math.nan),
                m.get("beyond", math.nan),
                m.get("honest_beyond", math.nan),
                m.get("nonfinite", math.nan),
                v.checks,
                v.reason,
            )
        )
    return pd.DataFrame(rows, columns=list(NODE_COLUMNS))
