"""Compare every rank of a job, then across ranks: which rank diverged first, where it was born.

Two stages, like the engine users already run them on one machine:

1. **Per rank**, in a process pool (``workers``), each worker loading and comparing one rank of
   the target against the same rank of the bench, under a memory limit of its own
   (``max_memory`` bytes of data per worker, ``RLIMIT_DATA``); one rank pair at a time, so the
   memory a comparison needs does not grow with the number of ranks. A worker hands back only
   tables of verdicts and what the rank's collectives carried (:class:`RankOutcome`). Under
   torchrun the job's processes share the ranks out instead (:mod:`tracecmp.comparison.torchrun`).
2. **Across ranks**, on those summaries (:func:`cross_rank`): collectives matched by their
   keys order the ranks' events (:mod:`tracecmp.trace.links`). A collective whose received data
   diverges on one rank while some *other* contributor sent divergent data is *inherited*, not a
   root: the rank's divergence was carried in; one that hands a rank back its own diverged
   contribution carries that rank's root (:class:`Carried`). The first root of the whole job, in
   that order, is the answer; each rank's first divergence is attributed to its own root or to
   the collective that carried it in, with the path from the root through the collective. The
   job table and the suspects read the same roots (:attr:`JobReport.roots`).

The result is an ordinary :class:`~tracecmp.comparison.result.CompareResult` whose
``first_divergence`` is the job's first root and whose ``job`` (a :class:`JobReport`) shows the
ranks side by side.

>>> result = tracecmp.compare("runs/target", "runs/bench", workers=4)   # doctest: +SKIP
>>> print(result.job.summary())                                         # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Mapping, NamedTuple

import pandas as pd

from tracecmp.comparison.engine import compare_traces
from tracecmp.comparison.result import CompareResult
from tracecmp.comparison.tolerances import Tolerances
from tracecmp.errors import CompareError, TracecmpError
from tracecmp.graph import view_bases
from tracecmp.trace.links import Collective, Epochs, by_key, collectives, job_order
from tracecmp.trace.reader import RankTrace, Trace, load, load_rank, read_manifest
from tracecmp.trace.schema import RUN_MANIFEST
from tracecmp.verdict.progress import Progress, shown
from tracecmp.verdict.records import Divergence, SkippedStep

BAD = ("diverged", "nan")  # statuses of a value that carries a divergence
_PATH_LIMIT = 40  # nodes shown between a root and the collective that carried its error out
_NOISE_SPREAD = 4.0  # a collective may sum its contributors' rounding noise: this many times the largest


@dataclass(frozen=True)
class CallFacts:
    """What one rank's collective carried, as this rank's comparison judged it."""

    call: Collective
    root_kind: str  # the per-rank verdict of the node ("" when not a root)
    sent_status: str  # worst status among the values this rank sent ("" when it sent nothing)
    sent_error: float  # largest error of them, in rounding units (NaN when unknown)
    received_status: str
    received_error: float
    path: tuple[int, ...] = ()  # op ids from this rank's nearest root to what it sent, when that diverged
    internal: tuple[int, ...] = ()  # op ids that are the collective's own completion (gloo's copies)


@dataclass
class RankOutcome:
    """One rank's comparison, as a worker hands it back (tables and small records, no traces)."""

    rank: int
    nodes: pd.DataFrame
    tensors: pd.DataFrame
    unpaired: pd.DataFrame
    roots: list[Divergence]
    warnings: list[str]
    steps: list[int]
    calls: list[CallFacts]
    complete: bool
    ended: str  # how the target rank's capture ended ("" when it closed normally)
    last: str  # where the target rank's trace ends (step, phase, op)
    manifest: dict[str, Any] = field(default_factory=dict)  # the target rank manifest's info
    skipped: list[SkippedStep] = field(default_factory=list)  # steps its loss scaler skipped on caught overflows
    notes: list[str] = field(default_factory=list)  # what statistics could not tell, not blocking agreement


class Carried(NamedTuple):
    """Why a node is no root of its own: what a collective carried into it."""

    rank: int  # the rank whose divergence it carries (its own rank: its own contribution, or noise)
    key: str  # the collective's match key
    why: str = "received"  # "received" (from another rank), "own" (its own contribution), "noise"


@dataclass(frozen=True)
class PathStep:
    """One node on the way from the job's first root to a rank that inherited its divergence."""

    rank: int
    op_id: int
    op: str
    module: str
    phase: str
    step: int
    role: str  # "root", "via", "sent", "received"


@dataclass
class RankLine:
    """One rank, side by side with the others."""

    rank: int
    status: str  # "agrees", "root", "inherited", "diverged", "incomplete", "not compared"
    first: str  # its first divergence, in words ("" if none)
    source: str  # where that divergence came from ("own root", "rank 1 via c10d.allreduce_ 0#3")
    complete: bool
    ended: str


@dataclass
class JobReport:
    """The cross-rank findings: ranks side by side, the first root of the job, the path to the others."""

    origin: Divergence | None
    roots: list[Divergence]  # every rank's own roots, in job order: the suspects
    ranks: list[RankLine]
    paths: dict[int, list[PathStep]]  # rank -> path from the origin's root to its first divergence
    inherited: dict[tuple[int, int], Carried]  # (rank, op_id) -> what a collective carried into it
    layout: list[str]  # world sizes and process groups, where target and bench differ
    incomplete: list[int]  # target ranks whose capture did not finish

    def summary(self) -> str:
        """Terminal text: the ranks side by side, the path through the collectives, layout notes."""
        lines = ["Ranks:"]
        width = max((len(line.first) for line in self.ranks), default=10)
        for line in self.ranks:
            end = "" if line.complete else f"  [incomplete: {line.ended}]"
            lines.append(f"  rank {line.rank:<3} {line.status:<12} {line.first:<{min(width, 70)}}  {line.source}{end}")
        if self.origin is not None:
            d = self.origin
            lines.append(
                f"Born on rank {d.rank}: {d.op} in {d.module or '<top>'} ({d.phase}, step {d.step})"
                + (f" — {d.location}" if d.location else "")
            )
        for rank, path in sorted(self.paths.items()):
            lines.append(f"Path to rank {rank}: " + " -> ".join(_step_text(s) for s in _elide(path)))
        for note in self.layout:
            lines.append(f"layout: {note}")
        return "\n".join(lines)

    def html(self) -> str:
        """The report's "Ranks" section: the ranks side by side, the path through the collectives."""
        from html import escape

        rows = "".join(
            f'<tr class="{escape(line.status)}"><td>{line.rank}</td><td>{escape(line.status)}</td><td>{escape(line.first)}</td>'
            f"<td>{escape(line.source)}</td><td>{'yes' if line.complete else 'no: ' + escape(line.ended)}</td></tr>"
            for line in self.ranks
        )
        parts = [
            '<h2 id="ranks">Ranks</h2>',
            '<p class="note">Each rank\'s first divergence, and where it came from: its own root, or another '
            "rank's, carried in by a collective.</p>",
            "<table><thead><tr><th>rank</th><th>status</th><th>first divergence</th><th>from</th>"
            f"<th>complete</th></tr></thead><tbody>{rows}</tbody></table>",
        ]
        for rank, path in sorted(self.paths.items()):
            steps = " &rarr; ".join(escape(_step_text(s)) for s in _elide(path))
            parts.append(f'<p class="note">Path to rank {rank}: {steps}</p>')
        parts += [f'<div class="warn">{escape(note)}</div>' for note in self.layout]
        return "\n".join(parts)

    def to_frame(self) -> pd.DataFrame:
        """One row per rank: status, first divergence, where it came from, completeness."""
        return pd.DataFrame(
            [vars(line) for line in self.ranks], columns=["rank", "status", "first", "source", "complete", "ended"]
        )


def _step_text(step: PathStep | None) -> str:
    if step is None:
        return "..."
    where = step.module or "<top>"
    return f"[rank {step.rank}] {step.op} ({where}, {step.phase} {step.step}{', ' + step.role if step.role not in ('via',) else ''})"


def _elide(path: list[PathStep], keep: int = 3) -> list[PathStep | None]:
    """The path with its middle elided when long: the root, the last steps before the collective."""
    if len(path) <= 2 * keep + 1:
        return list(path)
    return [*path[:keep], None, *path[-keep - 1 :]]


# ---- stage 1: one rank ------------------------------------------------------------------------


def rank_outcome(result: Any, rank: int, t_rank: RankTrace) -> RankOutcome:
    """What the cross-rank pass needs of ``rank`` in a (single- or multi-rank) comparison result."""
    nodes = result.nodes[result.nodes["rank"] == rank].reset_index(drop=True)
    tensors = (
        result.tensors[result.tensors["rank"] == rank].reset_index(drop=True) if len(result.tensors) else result.tensors
    )
    unpaired = result.unpaired_bench
    if len(unpaired) and "rank" in unpaired.columns:
        unpaired = unpaired[unpaired["rank"] == rank].reset_index(drop=True)
    roots = sorted((d for d in result.suspects if d.rank == rank), key=lambda d: (d.step, d.op_id))
    ops = t_rank.ops
    calls = _call_facts(collectives(ops, rank), nodes, ops, t_rank.tensors)
    info = t_rank.manifest.get("info", {}) if isinstance(t_rank.manifest.get("info"), dict) else {}
    last = ""
    if len(ops):
        tail = ops.loc[ops["op_id"].idxmax()]
        last = f"step {int(tail['step'])}, {tail['phase']}, {tail['op']}"
    return RankOutcome(
        rank=rank,
        nodes=nodes,
        tensors=tensors,
        unpaired=unpaired,
        roots=roots,
        warnings=list(result.warnings),
        notes=list(result.notes),
        steps=list(result.steps),
        calls=calls,
        complete=t_rank.complete,
        ended=_ended(t_rank),
        last=last,
        manifest=info,
        skipped=[skip for skip in result.skipped_steps if skip.rank == rank],
    )


def _ended(t_rank: RankTrace) -> str:
    """How an incomplete rank's capture ended ("" when complete), as the trace says it."""
    return "" if t_rank.complete else t_rank.ending()


def _call_facts(
    calls: list[Collective], nodes: pd.DataFrame, ops: pd.DataFrame, tensors: pd.DataFrame
) -> list[CallFacts]:
    if not calls:
        return []
    status = dict(zip(nodes["op_id"].tolist(), nodes["status"].tolist()))
    error = dict(zip(nodes["op_id"].tolist(), nodes["error"].tolist()))
    root_kind = dict(zip(nodes["op_id"].tolist(), nodes["root_kind"].fillna("").tolist()))
    base = view_bases(tensors)
    producer = dict(zip(tensors["tensor_id"].tolist(), tensors["op_id"].tolist()))
    inputs_of = {int(o): [int(t) for t in ins] for o, ins in zip(ops["op_id"].tolist(), ops["inputs"].tolist())}
    kind_of = dict(zip(ops["op_id"].tolist(), ops["kind"].tolist()))
    inplace = dict(zip(ops["op_id"].tolist(), ops["inplace"].tolist()))
    ordered = sorted(inputs_of)

    def made_by(tid: int) -> int | None:
        return producer.get(base.get(tid, tid))

    def worst(tids: Iterable[int]) -> tuple[str, float]:
        found, err = "", math.nan
        rank_of = {s: i for i, s in enumerate(("", "agrees", "noise", "uncompared", "unpaired", "diverged", "nan"))}
        for tid in tids:
            op = made_by(tid)
            if op is None or op not in status:
                continue
            s = status[op]
            if rank_of.get(s, 0) > rank_of.get(found, 0):
                found = s
            e = error.get(op, math.nan)
            if e == e and not (err == err and err >= e):
                err = float(e)
        return found, err

    def to_root(tid: int) -> tuple[int, ...]:
        path: list[int] = []
        op = made_by(tid)
        while op is not None and len(path) < _PATH_LIMIT and op not in path:
            path.append(op)
            if root_kind.get(op):
                break
            bad = [made_by(t) for t in inputs_of.get(op, [])]
            bad = [o for o in bad if o is not None and (status.get(o) in BAD or root_kind.get(o))]
            if not bad:
                break
            op = max(bad, key=lambda o: (error.get(o, 0.0) if error.get(o, 0.0) == error.get(o, 0.0) else 0.0, -o))
        return tuple(reversed(path))

    facts = []
    for call in calls:
        sent_status, sent_error = worst(call.sent)
        received_status, received_error = worst(call.received)
        path = ()
        if sent_status in BAD:
            bad_sent = [t for t in call.sent if status.get(made_by(t) or -1) in BAD]
            path = to_root(bad_sent[0]) if bad_sent else ()
        facts.append(
            CallFacts(
                call,
                root_kind.get(call.op_id, ""),
                sent_status,
                sent_error,
                received_status,
                received_error,
                path,
                _internal(call, ordered, inputs_of, kind_of, inplace, made_by),
            )
        )
    return facts


def _internal(
    call: Collective,
    ordered: list[int],
    inputs_of: Mapping[int, list[int]],
    kind_of: Mapping[int, str],
    inplace: Mapping[int, bool],
    made_by: Any,
) -> tuple[int, ...]:
    """Ops that are the collective's own completion rather than the program's: an in-place op that
    writes what it received before anything read it (gloo emulates a reduce-scatter so, copying the
    reduced shard in), and the sources and views that feed it and entered the trace after the call."""
    received = set(call.received)
    if not received:
        return ()
    start = ordered.index(call.op_id) + 1 if call.op_id in inputs_of else 0
    for op in ordered[start : start + 8]:
        ins = inputs_of.get(op, [])
        if not ins or not received & set(ins):
            continue
        if not (inplace.get(op) and ins[0] in received):
            return ()  # read first: nothing of its own
        found = [op]
        todo = [made_by(t) for t in ins[1:]]
        while todo:
            p = todo.pop()
            if p is None or p <= call.op_id or p in found:
                continue
            if kind_of.get(p) in ("view", "source"):
                found.append(p)
                todo.extend(made_by(t) for t in inputs_of.get(p, []))
        return tuple(sorted(found))
    return ()


def _single_rank(path: Path, rank: int) -> Trace:
    """A trace with one rank loaded: what a worker needs, and no more."""
    return Trace(path, read_manifest(path / RUN_MANIFEST), {rank: load_rank(path / f"rank{rank}")})


@dataclass(frozen=True)
class _Job:
    target: str
    bench: str
    rank: int
    options: dict[str, Any]


def _run_rank(job: _Job) -> RankOutcome:
    """Worker: compare one rank pair (loaded alone) and summarize it."""
    return compare_rank(Path(job.target), Path(job.bench), job.rank, job.options)


def compare_rank(target: Path, bench: Path, rank: int, options: Mapping[str, Any]) -> RankOutcome:
    """One rank pair loaded alone, compared, and summarized for the cross-rank pass."""
    t_trace, b_trace = _single_rank(target, rank), _single_rank(bench, rank)
    result = compare_traces(t_trace, b_trace, ranks=[rank], progress=False, **options)
    return rank_outcome(result, rank, t_trace.rank(rank))


def _limit_memory(limit: int | None) -> None:
    """In a worker: at most ``limit`` bytes of data (heap and anonymous mappings)."""
    if limit:
        import resource

        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


_OUT_OF_MEMORY = 3  # a worker's exit status when the memory limit stopped it


def _worker_main() -> None:
    """``python -c 'from tracecmp.comparison.ranks import _worker_main; _worker_main()' JOB OUT``:
    compare the rank pairs described by the JSON file JOB one after another, writing each one's
    outcome (or why it failed) into the folder OUT."""
    import gc
    import pickle

    job_file, out = sys.argv[1], Path(sys.argv[2])
    spec = json.loads(Path(job_file).read_text())
    _limit_memory(spec.get("max_memory"))
    options = dict(spec["options"])
    if options.get("tolerances") is not None:
        options["tolerances"] = Tolerances().replace(**options["tolerances"])
    for rank in spec["ranks"]:
        try:
            outcome = _run_rank(_Job(spec["target"], spec["bench"], int(rank), options))
        except MemoryError:
            outcome = None
            gc.collect()  # what the failed comparison held, before the next rank
            (out / f"failed-{rank}.txt").write_text(_OUT_OF_MEMORY_TEXT)
        except TracecmpError as err:
            outcome = None
            (out / f"failed-{rank}.txt").write_text(str(err))
        if outcome is not None:
            with open(out / f"outcome-{rank}.pickle", "wb") as fh:  # read back by this process's parent alone
                pickle.dump(outcome, fh, protocol=pickle.HIGHEST_PROTOCOL)
        del outcome


_OUT_OF_MEMORY_TEXT = "out of memory"


def _in_worker(
    jobs: list[_Job], memory: int | None, folder: Path
) -> tuple[dict[int, RankOutcome], dict[int, str | MemoryError]]:
    """Run ``jobs`` in one fresh interpreter (not a fork of this one, which may hold threads; not
    ``multiprocessing``'s spawn, which re-imports the caller's script), one after another: their
    outcomes by rank, and why the others failed (a MemoryError where the memory limit stopped one)."""
    import dataclasses
    import pickle
    import subprocess

    first = jobs[0]
    options = dict(first.options)
    if options.get("tolerances") is not None and dataclasses.is_dataclass(options["tolerances"]):
        options["tolerances"] = {
            f.name: getattr(options["tolerances"], f.name) for f in dataclasses.fields(options["tolerances"])
        }
    ranks = [job.rank for job in jobs]
    spec = {"target": first.target, "bench": first.bench, "ranks": ranks, "options": options, "max_memory": memory}
    job_file = folder / f"job-{ranks[0]}.json"
    job_file.write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from tracecmp.comparison.ranks import _worker_main; _worker_main()",
            str(job_file),
            str(folder),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    outcomes: dict[int, RankOutcome] = {}
    failed: dict[int, str | MemoryError] = {}
    for rank in ranks:
        result, failure = folder / f"outcome-{rank}.pickle", folder / f"failed-{rank}.txt"
        if result.exists():
            with open(result, "rb") as fh:
                outcomes[rank] = pickle.load(fh)
        elif failure.exists():
            text = failure.read_text()
            failed[rank] = MemoryError(memory) if text == _OUT_OF_MEMORY_TEXT else text
        else:  # the worker died before it got to this rank
            last = (
                done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"worker exit status {done.returncode}"
            )
            failed[rank] = MemoryError(memory) if done.returncode == _OUT_OF_MEMORY else last
    return outcomes, failed


def rank_folders(path: Path) -> list[int]:
    """The ranks a trace folder holds (its ``rank<N>`` folders)."""
    return sorted(int(p.name[4:]) for p in path.glob("rank*") if p.is_dir() and p.name[4:].isdigit())


_SMALL = 32 << 20  # traces this small (tables on disk, both runs) compare faster here than in workers


def default_workers(ranks: int, size: int | None = None) -> int:
    """As many workers as ranks, up to the CPUs this process may use; one (this process) for
    small traces, where starting an interpreter per rank would cost more than comparing them."""
    if size is not None and size < _SMALL:
        return 1
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(ranks, cpus))


def _tables_size(*paths: Path) -> int:
    return sum(f.stat().st_size for path in paths for f in path.glob("rank*/*.parquet"))


def default_memory(workers: int) -> int | None:
    """Data each worker may use: the machine's physical memory shared among workers and this process."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    return int(total / (workers + 1))


def compare_ranks(
    target: str | Path,
    bench: str | Path,
    *,
    ranks: Iterable[int] | None = None,
    workers: int | None = None,
    max_memory: int | None = None,
    progress: bool | None = None,
    **options: Any,
) -> Any:
    """Compare every rank of two multi-rank traces, in a process pool, then across ranks.

    ``workers`` processes (default: one per rank, up to the CPUs; this process alone for traces
    under 32 MB of tables) each compare one rank pair at a
    time with at most ``max_memory`` bytes of data (default: physical memory / (workers + 1));
    ``options`` are :func:`tracecmp.compare`'s. ``workers=1`` compares the ranks one after another
    in this process. The returned result holds every rank's tables; its traces hold the ranks
    the first divergence and its paths go through (load others with :func:`tracecmp.load`).

    >>> result = compare_ranks("runs/target", "runs/bench", workers=2)  # doctest: +SKIP
    """
    t_path, b_path = Path(target), Path(bench)
    if options.get("steps") is not None:
        options["steps"] = sorted(int(s) for s in options["steps"])  # a generator serves one worker only
    for path in (t_path, b_path):
        if not path.is_dir():
            load(path)  # the loader names what is wrong (missing folder, a file, no manifest)
    t_manifest, b_manifest = read_manifest(t_path / RUN_MANIFEST), read_manifest(b_path / RUN_MANIFEST)
    warnings: list[str] = []
    common, t_ranks, b_ranks = _common_rank_folders(t_path, b_path, ranks, warnings)
    workers = default_workers(len(common), _tables_size(t_path, b_path)) if workers is None else max(1, int(workers))
    memory = max_memory if max_memory is not None else (default_memory(workers) if workers > 1 else None)
    jobs = [_Job(str(t_path), str(b_path), r, options) for r in common]
    bar = Progress("compare", shown(progress, True), len(jobs), unit="ranks")
    outcomes, failures = _run_jobs(jobs, workers, memory, bar, t_path)
    bar.close()
    return job_result(
        JobFolders(t_path, b_path, t_manifest, b_manifest, common, t_ranks, b_ranks),
        outcomes,
        failures,
        warnings,
        options,
    )


@dataclass(frozen=True)
class JobFolders:
    """The two traces of a job as a comparison found them: paths, run manifests, and rank folders."""

    target: Path
    bench: Path
    t_manifest: dict[str, Any]
    b_manifest: dict[str, Any]
    common: list[int]  # the ranks compared
    t_ranks: list[int]
    b_ranks: list[int]


def job_result(
    folders: JobFolders,
    outcomes: dict[int, RankOutcome],
    failures: list[str],
    warnings: list[str],
    options: Mapping[str, Any],
) -> CompareResult:
    """The job's result from its ranks' outcomes, however they were compared (in this process, a
    pool, or a torchrun job): the cross-rank pass, the ranks' tables side by side, and the traces
    of the ranks the first divergence and its paths go through, where this process can read them."""
    t_path, b_path = folders.target, folders.bench
    if not outcomes:
        raise CompareError("no rank could be compared: " + "; ".join(failures), path=t_path)
    report = cross_rank(
        outcomes,
        folders.t_manifest,
        folders.b_manifest,
        folders.t_ranks,
        folders.b_ranks,
        _rank_manifests(b_path, folders.common),
    )
    warnings = warnings + failures
    for outcome in outcomes.values():
        warnings += [w if w.startswith("rank ") else f"rank {outcome.rank}: {w}" for w in outcome.warnings]
    needed = {report.origin.rank} if report.origin is not None else {min(outcomes)}
    needed |= set(report.paths)

    def readable(path: Path) -> dict[int, RankTrace]:
        return {r: load_rank(path / f"rank{r}") for r in sorted(needed) if (path / f"rank{r}").is_dir()}

    result = CompareResult(
        target=Trace(t_path, folders.t_manifest, readable(t_path)),
        bench=Trace(b_path, folders.b_manifest, readable(b_path)),
        first_divergence=None,
        suspects=[],
        nodes=pd.concat([o.nodes for o in outcomes.values()], ignore_index=True),
        tensors=pd.concat([o.tensors for o in outcomes.values()], ignore_index=True),
        unpaired_bench=pd.concat([o.unpaired for o in outcomes.values()], ignore_index=True),
        tolerances=options.get("tolerances") if hasattr(options.get("tolerances"), "replace") else _tolerances(options),
        warnings=_dedupe(warnings),
        notes=_dedupe([n for o in outcomes.values() for n in o.notes]),
        exact=bool(options.get("exact", False)),
        ranks=sorted(outcomes),
        steps=sorted({s for o in outcomes.values() for s in o.steps}),
        skipped_steps=sorted((k for o in outcomes.values() for k in o.skipped), key=lambda k: (k.step, k.rank)),
    )
    apply(result, report)
    return result


def _common_rank_folders(
    t_path: Path, b_path: Path, ranks: Iterable[int] | None, warnings: list[str]
) -> tuple[list[int], list[int], list[int]]:
    """The ranks to compare (those both traces hold, among ``ranks`` where given), warning of the
    others, and each trace's rank folders; a :class:`CompareError` where there is none."""
    t_ranks, b_ranks = rank_folders(t_path), rank_folders(b_path)
    if not t_ranks or not b_ranks:
        raise CompareError("trace holds no rank folders (rank0/ ...)", path=t_path if not t_ranks else b_path)
    return rank_sets(t_ranks, b_ranks, ranks, warnings, t_path), t_ranks, b_ranks


def rank_sets(
    t_ranks: list[int], b_ranks: list[int], ranks: Iterable[int] | None, warnings: list[str], t_path: Path
) -> list[int]:
    """The ranks both traces hold, among ``ranks`` where given, warning of the others; a
    :class:`CompareError` where there is none."""
    common = sorted(set(t_ranks) & set(b_ranks))
    if ranks is not None:
        wanted = {int(r) for r in ranks}
        missing = sorted(wanted - set(common))
        if missing:
            warnings.append(f"rank(s) {missing} are not in both traces")
        common = [r for r in common if r in wanted]
    else:
        for name, own, other in (("target", t_ranks, b_ranks), ("bench", b_ranks, t_ranks)):
            only = sorted(set(own) - set(other))
            if only:
                warnings.append(f"rank(s) {only} exist only in the {name} trace and were not compared")
    if not common:
        raise CompareError(f"no common rank to compare (target ranks {t_ranks}, bench ranks {b_ranks})", path=t_path)
    return common


def _run_jobs(
    jobs: list[_Job], workers: int, memory: int | None, bar: Progress, t_path: Path
) -> tuple[dict[int, RankOutcome], list[str]]:
    """Each rank pair compared, in this process (one worker) or in a pool of ``workers``: the
    outcomes by rank, and why the ranks that could not be compared failed."""
    outcomes: dict[int, RankOutcome] = {}
    failures: list[str] = []
    if workers == 1:
        for job in jobs:
            outcomes[job.rank] = _run_rank(job)
            bar.update(advance=1)
    else:
        import tempfile
        from concurrent.futures import ThreadPoolExecutor

        # One interpreter per worker, comparing its share of the ranks one after another: starting
        # one per rank would cost an import of torch each.
        batches = [jobs[i::workers] for i in range(workers) if jobs[i::workers]]
        with tempfile.TemporaryDirectory(prefix="tracecmp-ranks-") as folder, ThreadPoolExecutor(workers) as pool:
            futures = [pool.submit(_in_worker, batch, memory, Path(folder)) for batch in batches]
            failed: dict[int, str | MemoryError] = {}
            for future, batch in zip(futures, batches):
                done, lost = future.result()
                outcomes.update(done)
                failed.update(lost)
                bar.update(advance=len(batch))
        failures = [_failure_text(rank, why, memory, t_path) for rank, why in sorted(failed.items())]
        outcomes = dict(sorted(outcomes.items()))  # rank order, however the workers shared them
    return outcomes, failures


def _failure_text(rank: int, why: str | MemoryError, memory: int | None, t_path: Path) -> str:
    """Why a worker could not compare ``rank``, in the verdict's words."""
    if isinstance(why, MemoryError):
        return (
            f"rank {rank} could not be compared: it needs more than the "
            f"{(memory or 0) / 2**30:.1f} GiB a worker may use (max_memory, or fewer workers)"
        )
    text = why.split(": ", 1)[-1] if why.startswith(str(t_path)) else why
    return f"rank {rank} could not be compared: {text.removeprefix('tracecmp: ')}"


def _tolerances(options: Mapping[str, Any]) -> Any:

    given = options.get("tolerances")
    return Tolerances().replace(**given) if isinstance(given, Mapping) else Tolerances()


def _rank_manifests(path: Path, ranks: Iterable[int]) -> dict[int, dict[str, Any]]:
    manifests = {}
    for r in ranks:
        try:
            manifests[r] = read_manifest(path / f"rank{r}" / "manifest.json")
        except TracecmpError:
            continue
    return manifests


def _dedupe(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


# ---- stage 2: across ranks --------------------------------------------------------------------


def cross_rank(
    outcomes: Mapping[int, RankOutcome],
    t_manifest: Mapping[str, Any] | None = None,
    b_manifest: Mapping[str, Any] | None = None,
    t_ranks: Iterable[int] = (),
    b_ranks: Iterable[int] = (),
    b_rank_manifests: Mapping[int, Mapping[str, Any]] | None = None,
) -> JobReport:
    """Order the ranks' roots through their collectives; find what each rank inherited and from whom."""
    facts = {r: {f.call.key: f for f in o.calls} for r, o in outcomes.items()}
    calls = {r: [f.call for f in o.calls] for r, o in outcomes.items()}
    order = job_order(calls)
    epochs = {r: Epochs(calls[r], order) for r in outcomes}
    table = by_key(c for items in calls.values() for c in items)

    # A root's place in the job: after how many collectives, then rank, then its own order.
    def when(rank: int, op_id: int, step: int) -> tuple[int, int, int, int]:
        return (epochs[rank].of(op_id), step, rank, op_id)

    inherited = _inherited(outcomes, facts, table, order, when)
    roots = [d for o in outcomes.values() for d in o.roots if (d.rank, d.op_id) not in inherited]
    roots.sort(key=lambda d: when(d.rank, d.op_id, d.step))
    origin = roots[0] if roots else None

    lines, paths = [], {}
    for r in sorted(set(t_ranks) | set(outcomes)):
        o = outcomes.get(r)
        if o is None:
            lines.append(RankLine(r, "not compared", "", "no bench rank" if r not in set(b_ranks) else "", True, ""))
            continue
        kept = sorted((d for d in roots if d.rank == r), key=lambda d: d.op_id)  # as the suspects list them
        line, path = _rank_line(o, kept, inherited, table)
        lines.append(line)
        if path:
            paths[r] = _path(r, path, outcomes, facts, inherited, table)
    return JobReport(
        origin=origin,
        roots=roots,
        ranks=lines,
        paths=paths,
        inherited=inherited,
        layout=_layout(
            outcomes, t_manifest or {}, b_manifest or {}, list(t_ranks), list(b_ranks), b_rank_manifests or {}
        ),
        incomplete=[r for r, o in outcomes.items() if not o.complete],
    )


def _rank_line(
    o: RankOutcome,
    kept: list[Divergence],
    inherited: Mapping[tuple[int, int], Carried],
    table: Mapping[str, Mapping[int, Collective]],
) -> tuple[RankLine, str]:
    """One rank's line, from its first divergence and its roots the suspects keep; and the key of
    the collective that carried another rank's divergence in ("" when none did)."""
    r, complete = o.rank, o.complete
    ended = "" if complete else f"{o.ended}; its last op: {o.last}"
    first = _first_diverged(o)
    if first is None and not kept:
        agrees = o.nodes["status"].isin(["agrees", "noise"]).all()
        status = "incomplete" if not complete else "agrees" if agrees else "uncompared"
        return RankLine(r, status, "no divergence in what it holds" if not complete else "", "", complete, ended), ""
    hit = inherited.get((r, first[0])) if first is not None else None
    received = hit is not None and hit.why == "received"
    if kept and (not received or kept[0].op_id <= first[0]):  # type: ignore[index]
        # Its own root comes first, or its first divergence is its own making (an op of the
        # root's region, a value the root's collective handed back).
        root = kept[0]
        text = f"{root.op} in {root.module or '<top>'} ({root.phase}, step {root.step})"
        return RankLine(r, "root", text, f"own root ({root.kind})", complete, ended), ""
    assert first is not None
    op_id, text = first
    if received:
        assert hit is not None
        later = f"; own root later: {kept[0].op} (step {kept[0].step})" if kept else ""
        source = f"from rank {hit.rank} via {table[hit.key][r].op} {hit.key}{later}"
        return RankLine(r, "inherited", text, source, complete, ended), hit.key
    source = "its own contribution, sent and reduced" if hit is not None and hit.why == "own" else ""
    return RankLine(r, "diverged", text, source, complete, ended), ""


def _inherited(
    outcomes: Mapping[int, RankOutcome],
    facts: Mapping[int, Mapping[str, CallFacts]],
    table: Mapping[str, Mapping[int, Collective]],
    order: Mapping[str, int],
    when: Any,
) -> dict[tuple[int, int], tuple[int, str]]:
    """(rank, op id) -> what a collective carried into it: another rank's divergence, the rank's
    own diverged contribution handed back reduced, or only its contributors' rounding noise; for
    the collectives and the ops inside them (gloo's copies)."""
    inherited: dict[tuple[int, int], Carried] = {}
    internal_of: dict[tuple[int, int], str] = {}
    for r, o in outcomes.items():
        for f in o.calls:
            for op in f.internal:
                internal_of[(r, op)] = f.call.key
    # Collectives in job order: a contributor's own inherited status is known before its receivers.
    roots = {(d.rank, d.op_id) for o in outcomes.values() for d in o.roots}
    for key in sorted(table, key=lambda k: order.get(k, 0)):
        for r, call in table[key].items():
            f = facts[r][key]
            # gloo's copies may show a divergence the call's own output read as noise
            copied_root = any((r, op) in roots for op in f.internal)
            if f.received_status not in BAD and not f.root_kind and not copied_root:
                continue
            others = [q for q in call.contributors() if q != r and q in facts and key in facts[q]]
            bad = [q for q in others if facts[q][key].sent_status in BAD]
            if bad:
                inherited[(r, call.op_id)] = Carried(min(bad, key=lambda q: _origin_order(q, facts[q][key], when)), key)
            elif f.sent_status in BAD:
                # What it received is what it sent, reduced with the others' agreeing values: data
                # movement, whose divergence is the rank's own root's, upstream of the call.
                inherited[(r, call.op_id)] = Carried(r, key, "own")
            elif f.root_kind and others:
                # Only rounding noise came in: a sum of several contributors' noise is noise too.
                spread = max(
                    (facts[q][key].sent_error for q in others if facts[q][key].sent_error == facts[q][key].sent_error),
                    default=math.nan,
                )
                if spread == spread and f.received_error <= max(_NOISE_SPREAD, len(call.ranks)) * max(spread, 1.0):
                    inherited[(r, call.op_id)] = Carried(r, key, "noise")
    for (r, op), key in internal_of.items():
        call = table.get(key, {}).get(r)
        if call is not None and (r, call.op_id) in inherited:
            inherited[(r, op)] = inherited[(r, call.op_id)]
    return inherited


def _origin_order(q: int, f: CallFacts, when: Any) -> tuple[int, ...]:
    return when(q, f.path[0], 0) if f.path else (math.inf,)  # type: ignore[return-value]


def _first_diverged(o: RankOutcome) -> tuple[int, str] | None:
    bad = o.nodes[o.nodes["status"].isin(BAD) & (o.nodes["kind"] != "view")]
    if bad.empty:
        return None
    row = bad.loc[bad["op_id"].idxmin()]
    name = f" {row['name']}" if row["kind"] == "op" and str(row["op"]).startswith(("c10d", "_c10d")) else ""
    return int(
        row["op_id"]
    ), f"{row['op']}{name} in {row['module'] or '<top>'} ({row['phase']}, step {int(row['step'])})"


def _path(
    rank: int,
    key: str,
    outcomes: Mapping[int, RankOutcome],
    facts: Mapping[int, Mapping[str, CallFacts]],
    inherited: Mapping[tuple[int, int], Carried],
    table: Mapping[str, Mapping[int, Collective]],
) -> list[PathStep]:
    """From the root that started it to ``rank``'s receiving end of collective ``key``, hop by hop."""
    hops: list[list[PathStep]] = []
    seen = set()
    r, k = rank, key
    while (r, k) not in seen:
        seen.add((r, k))
        call = table[k][r]
        q = inherited[(r, call.op_id)].rank
        sender = facts[q][k]
        steps = [_step(q, op, outcomes[q], "via") for op in sender.path]
        if steps:
            roots = {d.op_id for d in outcomes[q].roots}
            first = sender.path[0]
            role = "received" if (q, first) in inherited else "root" if first in roots else "first divergence"
            steps[0] = replace(steps[0], role=role)
        steps.append(
            PathStep(
                q, sender.call.op_id, sender.call.op, sender.call.module, sender.call.phase, sender.call.step, "sent"
            )
        )
        steps.append(PathStep(r, call.op_id, call.op, call.module, call.phase, call.step, "received"))
        hops.append(steps)
        first = sender.path[0] if sender.path else None
        up = inherited.get((q, first)) if first is not None else None
        if up is None or up.why != "received":
            break
        r, k = q, up.key
    return [s for hop in reversed(hops) for s in hop]


def _step(rank: int, op_id: int, o: RankOutcome, role: str) -> PathStep:
    row = o.nodes[o.nodes["op_id"] == op_id]
    if row.empty:
        return PathStep(rank, op_id, "?", "", "", 0, role)
    row = row.iloc[0]
    return PathStep(rank, op_id, str(row["op"]), str(row["module"]), str(row["phase"]), int(row["step"]), role)


def _layout(
    outcomes: Mapping[int, RankOutcome],
    t_manifest: Mapping[str, Any],
    b_manifest: Mapping[str, Any],
    t_ranks: list[int],
    b_ranks: list[int],
    b_rank_manifests: Mapping[int, Mapping[str, Any]],
) -> list[str]:
    """What differs between the two jobs' shapes, said plainly."""
    notes = []
    t_world, b_world = t_manifest.get("world_size"), b_manifest.get("world_size")
    if t_world is not None and b_world is not None and t_world != b_world:
        notes.append(
            f"world sizes differ: target ran on {t_world} ranks, bench on {b_world}; ranks are compared by "
            "number, which means the same work only where both split it alike"
        )
    if t_ranks and b_ranks and set(t_ranks) != set(b_ranks):
        only_t, only_b = sorted(set(t_ranks) - set(b_ranks)), sorted(set(b_ranks) - set(t_ranks))
        if only_t:
            notes.append(f"target ranks {only_t} have no bench rank to compare with")
        if only_b:
            notes.append(f"bench ranks {only_b} have no target rank to compare with")
    for r, o in sorted(outcomes.items()):
        t_groups = o.manifest.get("process_groups") or {}
        b_info = b_rank_manifests.get(r, {}).get("info", {})
        b_groups = (b_info.get("process_groups") or {}) if isinstance(b_info, dict) else {}
        if t_groups and b_groups and t_groups != b_groups:
            notes.append(
                f"rank {r}: process groups differ: target {json.dumps(t_groups, sort_keys=True)}, "
                f"bench {json.dumps(b_groups, sort_keys=True)}"
            )
            break
    return notes


# ---- the result ---------------------------------------------------------------------------------


def apply(result: Any, report: JobReport) -> None:
    """Put the cross-rank findings into ``result``: the job's first root, its suspects (the roots
    the job table reads), the inherited collectives' verdicts, completeness warnings, and ``result.job``."""
    result.first_divergence = report.origin
    result.suspects = sorted(report.roots, key=lambda d: -d.score)
    if report.inherited and len(result.nodes):
        keys = list(zip(result.nodes["rank"].tolist(), result.nodes["op_id"].tolist()))
        hits = [report.inherited.get(k) for k in keys]
        mask = pd.Series([h is not None for h in hits], index=result.nodes.index)
        result.nodes.loc[mask, "root_kind"] = ""
        result.nodes.loc[mask, "reason"] = [_carried_text(h) for h in hits if h is not None]
    for r in report.incomplete:
        line = next((x for x in report.ranks if x.rank == r), None)
        text = f"target rank {r} is incomplete: {line.ended}" if line is not None else f"target rank {r} is incomplete"
        if text not in result.warnings:
            result.warnings.append(text)
    for note in report.layout:
        if note not in result.warnings:
            result.warnings.append(note)
    result.job = report


def _carried_text(carried: Carried) -> str:
    if carried.why == "received":
        return f"inherited: received through collective {carried.key} from rank {carried.rank}"
    if carried.why == "own":
        return f"collective {carried.key}: this rank's own diverged contribution, reduced and handed back"
    return f"collective {carried.key}: only the contributors' rounding noise"


def attach_cross_rank(result: Any) -> None:
    """The cross-rank pass for a result the engine computed over several ranks in this process."""
    t_ranks = list(result.target.ranks)
    outcomes = {r: rank_outcome(result, r, result.target.rank(r)) for r in result.ranks}
    b_manifests = {r: result.bench.rank(r).manifest for r in result.bench.ranks}
    report = cross_rank(
        outcomes, result.target.manifest, result.bench.manifest, t_ranks, list(result.bench.ranks), b_manifests
    )
    apply(result, report)
