"""Record the corpus's scripts with ``tracecmp record``, compare a target with its bench, and judge
the pair against what issue #34 asks of its variant.

Every script runs unchanged, as ``tracecmp record -o TRACE --force -- python SCRIPT ARGS`` in a folder
of its own (its outputs, checkpoints included, land there). Compare runs as the CLI does
(:func:`compare_cli`: exit code, terminal summary, ``suspects.csv`` and ``uncompared.csv``) or in this
process (:func:`compare_api`: the same verdict and exit code without an interpreter start). Exit codes
are the CLI's: 0 agree, 1 diverged, 2 bad input or a refusal (different models), 3 INCOMPLETE.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from workloads.realscripts.corpus import SCRIPTS, VARIANTS, Expect, Script, Variant

ROOT = Path(__file__).resolve().parents[2]  # the repository: children import tracecmp from here

VERDICT_WORDS = ("DIVERGED", "AGREE", "INCOMPLETE", "NO ROOT")


@dataclass
class RecordRun:
    script: str
    args: tuple[str, ...]
    trace: str
    returncode: int
    seconds: float
    own_lines: list[str]  # tracecmp's "tracecmp:" lines on stderr
    stderr_tail: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and (Path(self.trace) / "manifest.json").exists()

    def failure(self) -> str:
        lines = [line for line in self.stderr_tail.splitlines() if line.strip()]
        last = lines[-1] if lines else ""
        return f"record exit {self.returncode}: {last}"[:300]


@dataclass
class CompareRun:
    returncode: int  # the CLI's: 0 agree, 1 diverged, 2 error or refusal, 3 incomplete
    seconds: float
    verdict: str  # the summary's first line (DIVERGED / AGREE / INCOMPLETE / NO ROOT), or "ERROR: ..."
    summary: str
    first: dict[str, str] = field(default_factory=dict)  # the summary's "First divergence:" block
    roots: list[dict[str, str]] = field(default_factory=list)  # suspects.csv: one row per root (fault)
    warnings: list[str] = field(default_factory=list)
    out: str = ""  # compare's -o folder (nodes.csv, suspects.csv, uncompared.csv, ...)
    uncompared: list[dict[str, str]] = field(default_factory=list)  # uncompared.csv: groups, largest first

    @property
    def word(self) -> str:
        """DIVERGED, AGREE, INCOMPLETE, NO ROOT or ERROR."""
        return self.verdict.split(":", 1)[0] if self.verdict else "?"

    @property
    def calls(self) -> int:
        """How many calls the roots cover (a root repeated in each micro-batch is one root)."""
        return sum(1 + len((row.get("repeats") or "").split()) for row in self.roots)


@dataclass
class Result:
    script: str
    variant: str
    description: str
    expect: str
    target: RecordRun
    bench: RecordRun
    compare: CompareRun | None
    met: bool
    note: str = ""


def environment(threads: int = 1) -> dict[str, str]:
    """The children's environment: this interpreter first on PATH, the repository on PYTHONPATH,
    ``threads`` OpenMP threads (0: as it is), Hugging Face offline."""
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    pythonpath = os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p)
    env = {**os.environ, "PATH": path, "PYTHONPATH": pythonpath, "PYTHONUNBUFFERED": "1"}
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    return env


def slug(args: tuple[str, ...]) -> str:
    """A folder name for a run's options (``fp32`` for none)."""
    text = "-".join(a.lstrip("-") for a in args) or "fp32"
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", text)[:80]


def record(
    script: Script,
    args: tuple[str, ...],
    workdir: Path,
    *,
    tiny: bool = False,
    record_args: tuple[str, ...] = (),
    threads: int = 1,
    timeout: float = 900,
    rerun: bool = False,
) -> RecordRun:
    """``tracecmp record -o TRACE --force RECORD_ARGS -- python SCRIPT ARGS``, run in its own folder
    under ``workdir/runs`` (the trace goes to ``workdir/traces``)."""
    full = (*script.args, *(script.tiny if tiny else ()), *args)
    key = f"{script.name}-{slug(args)}" + ("-rerun" if rerun else "")
    trace = workdir / "traces" / key
    cwd = workdir / "runs" / key
    cwd.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "tracecmp", "record", "-o", str(trace), "--force", *record_args, "--"]
    argv += [sys.executable, str(script.path), *full]
    start = time.perf_counter()
    try:
        proc = subprocess.run(argv, cwd=cwd, env=environment(threads), capture_output=True, text=True, timeout=timeout)
        rc, stderr = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, stderr = -9, f"{exc.stderr or ''}\ntimed out after {timeout:.0f} s"
        stderr = stderr if isinstance(stderr, str) else stderr.decode(errors="replace")
    seconds = time.perf_counter() - start
    (cwd / "record.stderr").write_text(stderr)
    own = [line for line in stderr.splitlines() if line.startswith("tracecmp:")]
    return RecordRun(script.name, full, str(trace), rc, seconds, own, stderr[-4000:])


def _rows(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def compare_cli(
    target: str,
    bench: str,
    out: Path,
    *,
    compare_args: tuple[str, ...] = (),
    report: bool = False,
    threads: int = 1,
    timeout: float = 1800,
) -> CompareRun:
    """``tracecmp compare TARGET BENCH -o OUT`` as a user runs it: exit code, summary (kept in
    ``OUT/summary.txt``), ``suspects.csv`` and ``uncompared.csv``."""
    argv = [sys.executable, "-m", "tracecmp", "compare", target, bench, "-o", str(out), *compare_args]
    if not report:
        argv.append("--no-report")
    start = time.perf_counter()
    try:
        proc = subprocess.run(argv, env=environment(threads), capture_output=True, text=True, timeout=timeout)
        rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired:
        rc, stdout, stderr = -9, "", f"timed out after {timeout:.0f} s"
    seconds = time.perf_counter() - start
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.txt").write_text(stdout + ("\n--- stderr ---\n" + stderr if stderr else ""))
    words = "|".join(VERDICT_WORDS)
    verdict = next((line for line in stdout.splitlines() if re.match(rf"({words})\b", line)), "")
    if not verdict or rc not in (0, 1, 3):  # a refusal or a crash: its last line says which
        lines = [line for line in (stderr or stdout).splitlines() if line.strip()]
        verdict = "ERROR: " + (lines[-1] if lines else f"exit {rc}, no output")
    warnings = [line[len("warning: ") :] for line in stdout.splitlines() if line.startswith("warning: ")]
    fresh = rc in (0, 1, 3)  # the tables were written by this run, not left by an earlier one
    roots = _rows(out / "suspects.csv") if fresh else []
    uncompared = _rows(out / "uncompared.csv") if fresh else []
    return CompareRun(
        rc, seconds, verdict, stdout[-8000:], first_divergence(stdout), roots, warnings, str(out), uncompared
    )


def compare_api(target: str, bench: str, **options: object) -> CompareRun:
    """:func:`compare_cli` through ``tracecmp.compare`` in this process (no interpreter start: the
    CI test's way), with the CLI's exit code; a refusal (different models) is exit 2 and "ERROR: ..."."""
    import tracecmp
    from tracecmp.cli.compare import exit_status
    from tracecmp.errors import TracecmpError

    start = time.perf_counter()
    try:
        result = tracecmp.compare(target, bench, **options)
    except TracecmpError as exc:
        return CompareRun(2, time.perf_counter() - start, f"ERROR: {exc}", str(exc))
    summary = result.summary()
    seconds = time.perf_counter() - start
    roots = [{k: str(v) for k, v in row.items()} for row in result.suspects_frame().to_dict("records")]
    uncompared = [{k: str(v) for k, v in row.items()} for row in result.uncompared_groups().to_dict("records")]
    warnings = [line[len("warning: ") :] for line in summary.splitlines() if line.startswith("warning: ")]
    return CompareRun(
        exit_status(result.status),
        seconds,
        result.verdict(),
        summary,
        first_divergence(summary),
        roots,
        warnings,
        uncompared=uncompared,
    )


def first_divergence(summary: str) -> dict[str, str]:
    """The summary's "First divergence:" block as {op, module, phase, step, location, kind, reason}
    (``module`` "" for ``<top>``)."""
    lines = summary.splitlines()
    if "First divergence:" not in lines:
        return {}
    block: dict[str, str] = {}
    for line in lines[lines.index("First divergence:") + 1 :]:
        m = re.match(r"  (\w+)\s+(.*)$", line)
        if not m:
            break
        block[m.group(1)] = m.group(2).strip()
    if "phase" in block:  # "forward, step 0[, rank R]"
        phase, _, rest = block["phase"].partition(", step ")
        block["phase"], block["step"] = phase, rest.split(",")[0]
    if block.get("module") == "<top>":
        block["module"] = ""
    return block


def judge(expect: Expect, cmp: CompareRun | None) -> bool:
    """Does the comparison say what issue #34 asks of this variant? A clean pair: AGREE, exit 0
    (INCOMPLETE, exit 3, is not agreement). A bug: DIVERGED, exit 1, first at one of the expected
    modules and ops, and the only root where ``expect.single``; a bug that changes no value: AGREE,
    exit 0, with a note that names its module and op."""
    if cmp is None:
        return False
    if expect.module is None:
        return cmp.returncode == 0 and cmp.word == "AGREE"
    if expect.equal_values:
        notes = [line for line in cmp.summary.splitlines() if line.startswith("note: ")]
        named = any(
            f"note: {module or '<top>'} computes with " in line and any(op in line for op in expect.ops)
            for line in notes
            for module in expect.modules()
        )
        return cmp.returncode == 0 and cmp.word == "AGREE" and named
    if cmp.returncode != 1 or cmp.word != "DIVERGED" or not cmp.first:
        return False
    first = cmp.first
    if (first.get("module") or "") not in expect.modules():
        return False
    if expect.ops and not any(op in (first.get("op") or "") for op in expect.ops):
        return False
    return len(cmp.roots) == 1 or not expect.single


def run_variants(
    variants: list[Variant],
    workdir: Path,
    *,
    tiny: bool = False,
    record_args: tuple[str, ...] = (),
    compare_args: tuple[str, ...] = (),
    report: bool = False,
    threads: int = 1,
    log: Callable[[str], None] | None = None,
) -> list[Result]:
    """Record every target and bench (each bench once), compare each pair with the CLI, judge it;
    one after another."""
    say = log or (lambda _msg: None)
    recorded: dict[tuple[str, tuple[str, ...]], RecordRun] = {}

    def get(script: str, args: tuple[str, ...], *, rerun: bool = False) -> RecordRun:
        key = (script, (*args, "(rerun)") if rerun else args)
        if key not in recorded:
            say(f"record {script} {' '.join(args) or '(bench)'}" + (" again" if rerun else ""))
            run = record(
                SCRIPTS[script], args, workdir, tiny=tiny, record_args=record_args, threads=threads, rerun=rerun
            )
            say(f"  {run.seconds:.1f} s, exit {run.returncode}" + ("" if run.ok else f" — {run.failure()}"))
            recorded[key] = run
        return recorded[key]

    results = []
    for v in variants:
        bench = get(v.script, v.bench)
        target = get(v.script, v.target, rerun=v.target == v.bench)  # the bench's command again: its own trace
        cmp, note = None, ""
        if target.ok and bench.ok:
            say(f"compare {v.script} {v.name}")
            out = workdir / "compare" / f"{v.script}-{v.name}"
            cmp = compare_cli(target.trace, bench.trace, out, compare_args=compare_args, report=report, threads=threads)
            say(f"  {cmp.seconds:.1f} s, exit {cmp.returncode}: {cmp.verdict[:160]}")
        else:
            note = (target if not target.ok else bench).failure()
        results.append(
            Result(v.script, v.name, v.description, v.expect.describe(), target, bench, cmp, judge(v.expect, cmp), note)
        )
    return results


def save_results(results: list[Result], path: Path) -> None:
    Path(path).write_text(json.dumps([asdict(r) for r in results], indent=1))


def load_results(path: Path) -> list[Result]:
    """The results a run saved (``results.json``), judged again against the variants as they are now.
    Older files without ``uncompared`` read as having none."""
    expects = {(v.script, v.name): v.expect for v in VARIANTS}
    results = []
    for raw in json.loads(Path(path).read_text()):
        cmp = CompareRun(**raw["compare"]) if raw["compare"] else None
        raw = {**raw, "target": RecordRun(**raw["target"]), "bench": RecordRun(**raw["bench"]), "compare": cmp}
        expect = expects.get((raw["script"], raw["variant"]))
        if expect is not None:
            raw.update(expect=expect.describe(), met=judge(expect, cmp))
        results.append(Result(**raw))
    return results
