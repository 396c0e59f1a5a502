"""Record the real-script corpus with ``tracecmp record``, compare each target with its bench with
``tracecmp compare``, and print the verdicts as a markdown table.

Every script in this folder is run unchanged, as ``tracecmp record -o TRACE -- python SCRIPT ARGS``;
the bench of a variant is the script's float32 run without a bug (with the same attention path as
the target where that matters), recorded once and shared by the variants that use it. Compare runs
as the CLI does (exit code and terminal summary), its roots read from the ``suspects.csv`` it writes.

    python benchmarks/realscripts/run.py                              # the whole corpus
    python benchmarks/realscripts/run.py --scripts nanogpt --variants 'clean-*' --keep --workdir /tmp/rs
    python benchmarks/realscripts/run.py --list

Each variant states what issue #34 asks of it: a clean pair reads AGREE with exit 0, a bug is named
first at its op and module (as the only root where the bug sits in one module). The ``met`` column
says whether tracecmp does so today.
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

# ---------------------------------------------------------------------------------------------
# the corpus


@dataclass(frozen=True)
class Script:
    name: str
    file: str
    args: tuple[str, ...]  # the small size every run of the script gets
    tiny: tuple[str, ...] = ()  # smaller still (the CI test); appended after args


@dataclass(frozen=True)
class Expect:
    """What issue #34 asks of a variant. ``module`` is None for a clean pair (AGREE, exit 0);
    otherwise the first root's module, one of ``ops`` as a substring of its op, and ``single`` when
    it must be the only root (the bug sits in one module)."""

    module: str | None = None
    ops: tuple[str, ...] = ()
    single: bool = True
    note: str = ""
    also: tuple[str, ...] = ()  # other modules that are as right an answer

    def modules(self) -> tuple[str, ...]:
        return () if self.module is None else (self.module, *self.also)

    def describe(self) -> str:
        if self.module is None:
            return "AGREE, exit 0"
        where = f"{'|'.join(self.ops) or '?'} in {' or '.join(m or '<top>' for m in self.modules())}"
        return where + (", only root" if self.single else "")


@dataclass(frozen=True)
class Variant:
    script: str
    name: str
    target: tuple[str, ...]  # the target's options
    bench: tuple[str, ...]  # the bench's options (float32, no bug)
    expect: Expect
    description: str = ""


SCRIPTS = {
    "nanogpt": Script(
        "nanogpt",
        "nanogpt_train.py",
        ("--max-iters", "2", "--eval-iters", "2", "--n-layer", "2", "--n-embd", "32", "--block-size", "32"),
        tiny=("--max-iters", "1", "--eval-iters", "1", "--n-embd", "16", "--block-size", "16", "--batch-size", "2"),
    ),
    "hf_trainer": Script(
        "hf_trainer",
        "hf_trainer.py",
        ("--max-steps", "3", "--n-layer", "2", "--n-embd", "32", "--seq-len", "32"),
        tiny=("--max-steps", "2", "--n-embd", "16", "--seq-len", "16", "--batch-size", "2", "--num-samples", "16"),
    ),
    "vision": Script(
        "vision",
        "vision_train.py",
        ("--max-steps", "3", "--image-size", "16", "--batch-size", "8"),
        tiny=("--max-steps", "2", "--image-size", "8", "--batch-size", "4", "--num-samples", "16"),
    ),
}

_NANO_NOFLASH = ("--no-flash",)
_HF_EAGER = ("--attn-implementation", "eager")

VARIANTS = [
    # nanoGPT: eval loop of loss.item() before step 0, 2 micro-batches, clipping, cosine LR, checkpoint
    Variant("nanogpt", "clean-bf16", ("--dtype", "bfloat16"), (), Expect(), "bf16 autocast, flash attention (SDPA)"),
    Variant(
        "nanogpt",
        "clean-bf16-noflash",
        ("--dtype", "bfloat16", *_NANO_NOFLASH),
        _NANO_NOFLASH,
        Expect(),
        "bf16 autocast, hand-written attention",
    ),
    Variant(
        "nanogpt",
        "clean-noflash-vs-flash",
        _NANO_NOFLASH,
        (),
        Expect(),
        "float32 hand-written attention against the float32 SDPA bench (same math, other ops)",
    ),
    Variant(
        "nanogpt",
        "bug-ln-eps",
        ("--bug", "ln-eps"),
        (),
        Expect("transformer.h.1.ln_2", ("layer_norm",)),
        "block 1's ln_2 eps 1e-6 instead of 1e-5",
    ),
    Variant(
        "nanogpt",
        "bug-gelu-tanh",
        ("--bug", "gelu-tanh"),
        (),
        Expect("transformer.h.1.mlp.gelu", ("gelu",)),
        "block 1's GELU with the tanh approximation",
    ),
    Variant(
        "nanogpt",
        "bug-attn-scale",
        ("--bug", "attn-scale"),
        (),
        Expect("transformer.h.1.attn", ("scaled_dot_product", "attention")),
        "block 1's SDPA with scale 1/d instead of 1/sqrt(d)",
    ),
    Variant(
        "nanogpt",
        "bug-attn-scale-noflash",
        ("--bug", "attn-scale", *_NANO_NOFLASH),
        _NANO_NOFLASH,
        Expect("transformer.h.1.attn", ("mul",)),
        "block 1's hand-written attention scaled by 1/d instead of 1/sqrt(d)",
    ),
    Variant(
        "nanogpt",
        "bug-softmax-bf16",
        ("--bug", "softmax-bf16", *_NANO_NOFLASH),
        _NANO_NOFLASH,
        Expect("transformer.h.1.attn", ("softmax", "_to_copy")),
        "block 1's softmax in bfloat16, against the hand-written-attention bench",
    ),
    Variant(
        "nanogpt",
        "bug-softmax-bf16-vs-flash",
        ("--bug", "softmax-bf16"),
        (),
        Expect("transformer.h.1.attn", ("softmax", "_to_copy", "attention")),
        "block 1 hand-written with a bfloat16 softmax, against the SDPA bench",
    ),
    # transformers.Trainer: GPT-2 from a config, grad accumulation 2, bf16 through TrainingArguments
    Variant("hf_trainer", "clean-bf16", ("--bf16",), (), Expect(), "bf16 (accelerate's autocast), SDPA attention"),
    Variant(
        "hf_trainer",
        "clean-bf16-eager",
        ("--bf16", *_HF_EAGER),
        _HF_EAGER,
        Expect(),
        "bf16 (accelerate's autocast), eager attention",
    ),
    Variant(
        "hf_trainer",
        "bug-ln-eps",
        ("--bug", "ln-eps"),
        (),
        Expect("transformer.h.0.ln_1", ("layer_norm",), single=False, note="config-wide: every LayerNorm"),
        "config layer_norm_epsilon=1e-6 (every LayerNorm)",
    ),
    Variant(
        "hf_trainer",
        "bug-gelu",
        ("--bug", "gelu"),
        (),
        Expect("transformer.h.0.mlp.act", ("gelu", "tanh", "pow", "mul"), single=False, note="config-wide"),
        'config activation_function="gelu" instead of "gelu_new" (every MLP)',
    ),
    Variant(
        "hf_trainer",
        "bug-attn-scale",
        ("--bug", "attn-scale"),
        (),
        Expect("transformer.h.0.attn", ("scaled_dot_product", "attention"), single=False, note="config-wide"),
        "config scale_attn_weights=False (every block)",
    ),
    Variant(
        "hf_trainer",
        "bug-layer-scale",
        ("--bug", "layer-scale"),
        (),
        Expect("transformer.h.1.attn", ("scaled_dot_product", "attention")),
        "config scale_attn_by_inverse_layer_idx=True (block 1's scores halved; block 0 unchanged)",
    ),
    Variant(
        "hf_trainer",
        "bug-softmax-bf16",
        ("--bug", "softmax-bf16"),
        _HF_EAGER,
        Expect("transformer.h.0.attn", ("softmax", "_to_copy"), single=False, note="every block"),
        "a custom attention function with a bfloat16 softmax, against the eager-attention bench",
    ),
    # vision: ResNet-ish CNN, nn.Module transforms in 2 DataLoader workers, SGD momentum
    Variant("vision", "clean-fp32-rerun", (), (), Expect(), "the bench's own command again (workers, determinism)"),
    Variant("vision", "clean-bf16", ("--dtype", "bfloat16"), (), Expect(), "bf16 autocast"),
    Variant("vision", "bug-bn-eps", ("--bug", "bn-eps"), (), Expect("bn1", ("batch_norm",)), "stem BatchNorm eps 1e-3"),
    Variant(
        "vision",
        "bug-pool-swap",
        ("--bug", "pool-swap"),
        (),
        Expect("maxpool", ("avg_pool2d", "max_pool2d")),
        "stem max-pool replaced by an average pool",
    ),
    Variant(
        "vision",
        "bug-relu6",
        ("--bug", "relu6"),
        (),
        Expect("layer1.0.relu", ("hardtanh", "relu", "clamp")),
        "layer1.0 uses ReLU6 (no activation exceeds 6 at this size: an op change with equal values)",
    ),
    Variant(
        "vision",
        "bug-norm-bf16",
        ("--bug", "norm-bf16"),
        (),
        Expect("", ("source",), also=("conv1",), note="the input batch (made in the workers) or its first reader"),
        "Normalize transform computed in bfloat16 in the DataLoader workers: the model's input differs",
    ),
]


def select(scripts: list[str] | None, patterns: list[str] | None) -> list[Variant]:
    """The variants of ``scripts`` (all when None) whose name matches one of ``patterns`` (fnmatch)."""
    chosen = []
    for v in VARIANTS:
        if scripts and v.script not in scripts:
            continue
        if patterns and not any(fnmatch.fnmatchcase(v.name, p) for p in patterns):
            continue
        chosen.append(v)
    return chosen


# ---------------------------------------------------------------------------------------------
# running


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
    returncode: int
    seconds: float
    verdict: str  # the summary's first line (DIVERGED / AGREE / INCOMPLETE / NO ROOT), or the error
    summary: str
    first: dict[str, str] = field(default_factory=dict)  # the summary's "First divergence:" block
    roots: list[dict[str, str]] = field(default_factory=list)  # suspects.csv (every root)
    warnings: list[str] = field(default_factory=list)
    out: str = ""  # compare's -o folder (nodes.csv, suspects.csv, ...)

    @property
    def word(self) -> str:
        return self.verdict.split(":", 1)[0] if self.verdict else "?"


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


def _env(threads: int) -> dict[str, str]:
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    pythonpath = os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p)
    env = {**os.environ, "PATH": path, "PYTHONPATH": pythonpath, "PYTHONUNBUFFERED": "1"}
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    return env


def _slug(args: tuple[str, ...]) -> str:
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
    (the script's outputs, checkpoints included, land there)."""
    full = (*script.args, *(script.tiny if tiny else ()), *args)
    key = f"{script.name}-{_slug(args)}" + ("-rerun" if rerun else "")
    trace = workdir / "traces" / key
    cwd = workdir / "runs" / key
    cwd.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "tracecmp", "record", "-o", str(trace), "--force", *record_args, "--"]
    argv += [sys.executable, str(HERE / script.file), *full]
    start = time.perf_counter()
    try:
        proc = subprocess.run(argv, cwd=cwd, env=_env(threads), capture_output=True, text=True, timeout=timeout)
        rc, stderr = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, stderr = -9, f"{exc.stderr or ''}\ntimed out after {timeout:.0f} s"
        stderr = stderr if isinstance(stderr, str) else stderr.decode(errors="replace")
    seconds = time.perf_counter() - start
    (cwd / "record.stderr").write_text(stderr)
    own = [line for line in stderr.splitlines() if line.startswith("tracecmp:")]
    return RecordRun(script.name, full, str(trace), rc, seconds, own, stderr[-4000:])


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
    """``tracecmp compare TARGET BENCH -o OUT`` as a user runs it: exit code, summary, suspects.csv."""
    argv = [sys.executable, "-m", "tracecmp", "compare", target, bench, "-o", str(out), *compare_args]
    if not report:
        argv.append("--no-report")
    start = time.perf_counter()
    try:
        proc = subprocess.run(argv, env=_env(threads), capture_output=True, text=True, timeout=timeout)
        rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired:
        rc, stdout, stderr = -9, "", f"timed out after {timeout:.0f} s"
    seconds = time.perf_counter() - start
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.txt").write_text(stdout + ("\n--- stderr ---\n" + stderr if stderr else ""))
    verdict = next(
        (line for line in stdout.splitlines() if re.match(r"(DIVERGED|AGREE|INCOMPLETE|NO ROOT)\b", line)), ""
    )
    if not verdict:
        lines = [line for line in (stderr or stdout).splitlines() if line.strip()]
        verdict = "ERROR: " + (lines[-1] if lines else f"exit {rc}, no output")
    first = _first_divergence(stdout)
    warnings = [line[len("warning: ") :] for line in stdout.splitlines() if line.startswith("warning: ")]
    roots: list[dict[str, str]] = []
    suspects = out / "suspects.csv"
    if suspects.exists() and rc in (0, 1):
        with suspects.open(newline="") as f:
            roots = list(csv.DictReader(f))
    return CompareRun(rc, seconds, verdict, stdout[-8000:], first, roots, warnings, str(out))


def compare_api(target: str, bench: str) -> CompareRun:
    """The same as :func:`compare_cli` through ``tracecmp.compare`` in this process (no interpreter
    start: the CI test's way); the exit code is the CLI's rule, 1 with a divergence, else 0."""
    import tracecmp

    start = time.perf_counter()
    result = tracecmp.compare(target, bench)
    summary = result.summary()
    seconds = time.perf_counter() - start
    roots = [{k: str(v) for k, v in row.items()} for row in result.suspects_frame().to_dict("records")]
    rc = 1 if result.first_divergence is not None else 0
    warnings = [line[len("warning: ") :] for line in summary.splitlines() if line.startswith("warning: ")]
    return CompareRun(rc, seconds, result.verdict(), summary, _first_divergence(summary), roots, warnings)


def _first_divergence(stdout: str) -> dict[str, str]:
    """The summary's "First divergence:" block as {op, module, phase, step, location, kind, reason}
    (suspects.csv is ordered by score, not with the first divergence first)."""
    lines = stdout.splitlines()
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
    """Does the comparison say what issue #34 asks of this variant?"""
    if cmp is None:
        return False
    if expect.module is None:
        return cmp.returncode == 0 and cmp.word == "AGREE"
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
    log=None,
) -> list[Result]:
    """Record every target and bench (each bench once), compare each pair; one after another."""
    recorded: dict[tuple[str, tuple[str, ...]], RecordRun] = {}

    def get(script: str, args: tuple[str, ...]) -> RecordRun:
        if (script, args) not in recorded:
            if log:
                log(f"record {script} {' '.join(args) or '(bench)'}")
            run = record(SCRIPTS[script], args, workdir, tiny=tiny, record_args=record_args, threads=threads)
            if log:
                log(f"  {run.seconds:.1f} s, exit {run.returncode}" + ("" if run.ok else f" — {run.failure()}"))
            recorded[(script, args)] = run
        return recorded[(script, args)]

    results = []
    for v in variants:
        bench = get(v.script, v.bench)
        if v.target == v.bench:  # the bench's own command again, into a trace of its own
            key = (v.script, (*v.target, "(rerun)"))
            if key not in recorded:
                if log:
                    log(f"record {v.script} {' '.join(v.target) or '(bench)'} again")
                recorded[key] = record(
                    SCRIPTS[v.script],
                    v.target,
                    workdir,
                    tiny=tiny,
                    record_args=record_args,
                    threads=threads,
                    rerun=True,
                )
            target = recorded[key]
        else:
            target = get(v.script, v.target)
        cmp = None
        note = ""
        if target.ok and bench.ok:
            if log:
                log(f"compare {v.script} {v.name}")
            out = workdir / "compare" / f"{v.script}-{v.name}"
            cmp = compare_cli(target.trace, bench.trace, out, compare_args=compare_args, report=report, threads=threads)
            if log:
                log(f"  {cmp.seconds:.1f} s, exit {cmp.returncode}: {cmp.verdict[:160]}")
        else:
            note = (target if not target.ok else bench).failure()
        results.append(
            Result(v.script, v.name, v.description, v.expect.describe(), target, bench, cmp, judge(v.expect, cmp), note)
        )
    return results


# ---------------------------------------------------------------------------------------------
# the table


def _cell(text: str, width: int = 90) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= width else text[: width - 1] + "…"


def first_root(cmp: CompareRun | None) -> str:
    if cmp is None or not cmp.first:
        return ""
    r = cmp.first
    return f"{r.get('op', '')} in {r.get('module') or '<top>'} ({r.get('phase', '')}, step {r.get('step', '')})"


def markdown(results: list[Result]) -> str:
    head = (
        "| script | variant | verdict | exit | first root (op, module) | roots | record s | compare s | "
        "wanted (#34) | met |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = [head]
    for r in results:
        cmp = r.compare
        if cmp is None:
            verdict, code, roots, ctime = _cell("RECORD FAILED: " + r.note), "", "", ""
        else:
            verdict, code, roots, ctime = (
                _cell(cmp.verdict),
                str(cmp.returncode),
                str(len(cmp.roots)),
                f"{cmp.seconds:.1f}",
            )
        rows.append(
            f"| {r.script} | {r.variant} | {verdict} | {code} | {_cell(first_root(cmp), 70)} | {roots} | "
            f"{r.target.seconds:.1f} | {ctime} | {r.expect} | {'yes' if r.met else '**no**'} |"
        )
    missed = [r for r in results if not r.met]
    if missed:
        rows += ["", "What tracecmp says where the case is not met:", ""]
        rows += [f"- {r.script} {r.variant}: {_cell(diagnosis(r), 600)}" for r in missed]
    return "\n".join(rows)


def left_out(nodes_csv: Path, top: int = 3) -> list[str]:
    """The target nodes compare left unpaired or uncompared, grouped by status, op, module and line."""
    if not nodes_csv.exists():
        return []
    groups: dict[tuple[str, str, str, str], int] = {}
    with nodes_csv.open(newline="") as f:
        for row in csv.DictReader(f):
            if row.get("kind") != "view" and row.get("status") in ("unpaired", "uncompared"):
                key = (row["status"], row["op"], row.get("module") or "<top>", row.get("location") or "?")
                groups[key] = groups.get(key, 0) + 1
    ranked = sorted(groups.items(), key=lambda item: -item[1])[:top]
    return [f"{status}: {op} in {module} at {location} x{n}" for (status, op, module, location), n in ranked]


def diagnosis(r: Result) -> str:
    """One line on what tracecmp said in a case that is not met: the first root's kind and reason,
    what INCOMPLETE left out, the crash, or why a record failed."""
    cmp = r.compare
    if cmp is None:
        return "record failed: " + r.note
    parts = []
    if cmp.first:
        parts.append(f"{cmp.first.get('kind', '?')}: {cmp.first.get('reason', '')}")
        first = (cmp.first.get("op"), cmp.first.get("module") or "", cmp.first.get("phase"), cmp.first.get("step"))
        counts: dict[tuple[str | None, ...], int] = {}
        for x in cmp.roots:
            key = (x.get("op"), x.get("module") or "", x.get("phase"), x.get("step"))
            counts[key] = counts.get(key, 0) + 1
        counts[first] = counts.get(first, 1) - 1  # the first divergence is one of the roots
        others = [
            f"{op} in {module or '<top>'} ({phase}, step {step})" + (f" x{n}" if n > 1 else "")
            for (op, module, phase, step), n in counts.items()
            if n > 0
        ]
        if others:
            more = f" and {len(others) - 4} more" if len(others) > 4 else ""
            parts.append("other roots: " + ", ".join(others[:4]) + more)
    elif cmp.word != "AGREE":
        parts.append(cmp.verdict)
        parts += left_out(Path(cmp.out) / "nodes.csv")
    parts += [f"warning: {w}" for w in cmp.warnings[:2]]
    own = [line for line in r.target.own_lines + r.bench.own_lines if "warn" in line.lower() or "error" in line.lower()]
    parts += own[:2]
    return "; ".join(parts) or cmp.verdict


def load_results(path: Path) -> list[Result]:
    """The results a run wrote (``results.json``), judged again against the variants as they are now."""
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
    parser.add_argument("--list", action="store_true", help="list the variants and exit")
    parser.add_argument("--table", metavar="RESULTS", help="print the table of a run's results.json again and exit")
    args = parser.parse_args(argv)

    if args.table:
        print(markdown(load_results(Path(args.table))))
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
    log = lambda msg: print(msg, file=sys.stderr, flush=True)
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
    table = markdown(results)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    if not temp or args.keep:
        (workdir / "results.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
        log(f"results in {workdir / 'results.json'}")
    elif temp:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
