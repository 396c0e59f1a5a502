"""Localization in compiled targets: faults written into a ``torch.compile``d model, named at their module.

    python -m benchmarks.localization.compiled                                   # every model, backend, mode
    python -m benchmarks.localization.compiled --models tinygpt --backends aot_eager --data stats
    python -m benchmarks.localization.compiled --models gpt2 --gpt2-size small   # GPT-2 124M from its config
    python -m benchmarks.localization.compiled --faults ln-eps,attn-scale         # some fault kinds only
    python -m benchmarks.localization.compiled --gpt2-size small --data tensors --only phases=forward,backward

Models: ``tinygpt`` (:class:`workloads.compile_models.TinyGPT`, 2 layers d32) and ``gpt2``
(transformers' ``GPT2LMHeadModel`` from a config, random weights, dropout 0.0: 2 layers d64 by
default, GPT-2 small's 124M with ``--gpt2-size small``), trained two steps with AdamW, GPT-2 called with keyword
arguments (``input_ids=``, ``labels=``). Each target is compiled with ``--backends`` and captured with
statistics or tensors (``--data``); the bench is the same program eager, and again compiled.

Faults are written into the target model itself, in the first and the last layer (8 per model):
``ln-eps`` (a layer norm's epsilon 1e-5 -> 1e-2), ``gelu`` (the MLP's GELU approximation swapped),
``attn-scale`` (the attention block's output x1.05), ``bf16-act`` (the MLP activation rounded to
bfloat16 and back). *Top-1*: the first divergence's module (a compiled root's module is the FX node
it was narrowed to) is the faulty module. A fault the backend compiles away (the compiled run, untraced,
bit for bit the clean one: inductor keeps a bf16 round trip inside a fused kernel in float32) is
*dropped*: its pairs should read AGREE, and are counted apart. Clean pairs: compiled against eager, compiled against a
second compiled run, and a trace against itself, each read AGREE. *Transparent*: every compiled run
traced gives the losses, gradients and parameters of the same run untraced, bitwise.

Each run is a process of its own (``--run``): Dynamo's caches never carry over between cases.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
FAULTS = ("ln-eps", "gelu", "attn-scale", "bf16-act")
STEPS = 2
SEED = 0


@dataclass
class Case:
    """One comparison: a target run against a bench run (``kind``: a fault, or which clean pair)."""

    model: str
    backend: str
    data: str
    kind: str  # "fault", "dropped" (a fault the backend compiled away), "clean-eager", "clean-compiled", "clean-self"
    fault: str = ""  # "ln-eps@blocks.0.ln1"
    bench: str = "eager"  # "eager" or "compiled"
    expect: str = ""  # the faulty module
    verdict: str = ""
    module: str = ""
    op: str = ""
    met: bool = False
    transparent: bool | None = None
    error: str = ""
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


def sites(model: str, layers: int) -> list[tuple[str, str]]:
    """``(fault, module path)`` of the 8 faults of ``model``: each kind in the first and the last layer."""
    out = []
    for layer in sorted({0, layers - 1}):
        if model == "tinygpt":
            paths = {"ln-eps": "ln1", "gelu": "mlp.act", "attn-scale": "attn", "bf16-act": "mlp.act"}
            prefix = f"blocks.{layer}"
        else:
            paths = {"ln-eps": "ln_1", "gelu": "mlp.act", "attn-scale": "attn", "bf16-act": "mlp.act"}
            prefix = f"transformer.h.{layer}"
        out.extend((kind, f"{prefix}.{paths[kind]}") for kind in FAULTS)
    return out


# ------------------------------------------------------------------------------------- one run


def _build(model: str, gpt2_size: str) -> tuple[Any, Callable[[Any, int], Any], int]:
    """The model, a step function ``(callable, step) -> loss`` and its layer count."""
    import torch

    torch.manual_seed(SEED)
    if model == "tinygpt":
        from workloads.compile_models import TinyGPT, tiny_batch

        net = TinyGPT(layers=2, dim=32, heads=4)
        batches = [tiny_batch(seed=s, batch=2, length=16) for s in range(STEPS)]
        return net, lambda run, step: run(*batches[step]), 2
    import transformers

    size = (
        dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=64)
        if gpt2_size == "small"
        else dict(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32)
    )
    # No dropout in either run: inductor draws from its own seeds, which no eager run reproduces
    # (tracecmp names such a region a random root and asks for dropout=0.0).
    dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    config = transformers.GPT2Config(**size, **dropout, attn_implementation="eager")
    net = transformers.GPT2LMHeadModel(config).train()
    generator = torch.Generator().manual_seed(1)
    length = 32 if gpt2_size == "small" else 16
    batches = [torch.randint(0, size["vocab_size"], (2, 2, length), generator=generator).unbind() for _ in range(STEPS)]
    return net, lambda run, step: run(input_ids=batches[step][0], labels=batches[step][1]).loss, size["n_layer"]


def _inject(net: Any, fault: str) -> None:
    """Write ``fault`` (``kind@module``) into the model."""
    import torch

    kind, _, path = fault.partition("@")
    module = net.get_submodule(path)
    if kind == "ln-eps":
        module.eps = 1e-2
    elif kind == "gelu":
        swapped = torch.nn.GELU() if type(module).__name__ != "GELU" or module.approximate == "tanh" else None
        parent, _, name = path.rpartition(".")
        net.get_submodule(parent).register_module(name, swapped or torch.nn.GELU(approximate="tanh"))
    else:
        # A subclass whose forward changes the output: the model's code changed, as a user's would be
        # (an instance attribute would hide the ops from the module in Dynamo's module stack).
        cls = type(module)

        def scale(out: Any) -> Any:
            return out * 1.05 if kind == "attn-scale" else out.to(torch.bfloat16).to(out.dtype)

        def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = cls.forward(self, *args, **kwargs)
            return (scale(out[0]), *out[1:]) if isinstance(out, tuple) else scale(out)

        module.__class__ = type(f"Faulty{cls.__name__}", (cls,), {"forward": forward})


def _train(
    model: str, backend: str, fault: str, gpt2_size: str, trace: Path | None, data: str, only: str | None = None
) -> dict[str, Any]:
    """Two AdamW steps of the model (compiled unless ``backend`` is "eager"), traced into ``trace``
    when given (``only``: a tensors capture's selection); returns everything transparency compares."""
    import torch

    import tracecmp

    torch._dynamo.reset()
    net, step, _ = _build(model, gpt2_size)
    if fault:
        _inject(net, fault)
    run = net if backend == "eager" else torch.compile(net, backend=backend)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    losses = []
    session = tracecmp.TraceCompare(trace, model=net, data=data, only=only) if trace is not None else None
    if session is not None:
        session.__enter__()
    try:
        for s in range(STEPS):
            loss = step(run, s)
            loss.backward()
            losses.append(loss.detach().clone())
            grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
            opt.step()
            opt.zero_grad()
            if session is not None:
                session.step()
    finally:
        if session is not None:
            session.__exit__(None, None, None)
    return {"losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in net.named_parameters()}}


def _bitwise(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    def same(x: Any, y: Any) -> bool:
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        return bool(
            torch.equal(x.reshape(-1).contiguous().view(torch.uint8), y.reshape(-1).contiguous().view(torch.uint8))
        )

    return all(same(x, y) for x, y in zip(a["losses"], b["losses"])) and all(
        set(a[k]) == set(b[k]) and all(same(a[k][n], b[k][n]) for n in a[k]) for k in ("grads", "params")
    )


def _digest(result: dict[str, Any]) -> str:
    """A hash of everything a run computed (losses, gradients, parameters), bit for bit."""
    import hashlib

    digest = hashlib.sha256()
    tensors = [*result["losses"], *(result[k][n] for k in ("grads", "params") for n in sorted(result[k]))]
    for t in tensors:
        digest.update(t.detach().reshape(-1).contiguous().view(-1).numpy().tobytes())
    return digest.hexdigest()


def run_one(
    model: str, backend: str, data: str, fault: str, gpt2_size: str, out: Path, only: str | None = None
) -> dict[str, Any]:
    """Capture one run into ``out`` (and, compiled, check it against the same run untraced)."""
    warnings.simplefilter("ignore")
    traced = _train(model, backend, fault, gpt2_size, out, data, only if data == "tensors" else None)
    transparent, untraced = None, traced
    if backend != "eager":
        untraced = _train(model, backend, fault, gpt2_size, None, data)
        transparent = _bitwise(traced, untraced)
    return {"transparent": transparent, "digest": _digest(untraced)}


# ------------------------------------------------------------------------------------- the plan


def _capture(args: argparse.Namespace, model: str, backend: str, data: str, fault: str, out: Path) -> dict[str, Any]:
    if (out / "manifest.json").exists() and (out / "run.json").exists():
        return json.loads((out / "run.json").read_text())
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, "-m", "benchmarks.localization.compiled", "--run", model, backend, data, fault or "-"]
    command += [str(out), "--gpt2-size", args.gpt2_size] + (["--only", args.only] if args.only else [])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["exit %d" % done.returncode])[-1][:300]}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    (out / "run.json").write_text(json.dumps(result))
    return result


def _judge(case: Case, target: Path, bench: Path) -> None:
    import tracecmp

    result = tracecmp.compare(target, bench)
    case.verdict = result.verdict().split(":")[0]
    first = result.first_divergence
    if first is not None:
        case.module, case.op = first.module, first.op
    if case.kind == "fault":
        case.met = first is not None and first.module == case.expect
    elif case.kind == "dropped":
        case.met = case.verdict == "AGREE"  # the target computes what the clean run computes
    else:
        case.met = case.verdict == "AGREE"
        if not case.met:
            case.notes.append(result.verdict()[:200])


def plan_and_run(args: argparse.Namespace) -> list[Case]:
    cases: list[Case] = []
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-compiled-"))
    for model in args.models:
        layers = 2 if model == "tinygpt" else (12 if args.gpt2_size == "small" else 2)
        for data in args.data:
            eager = work / model / data / "eager"
            eager.parent.mkdir(parents=True, exist_ok=True)
            bench_run = _capture(args, model, "eager", data, "", eager)
            for backend in args.backends:
                base = work / model / data / backend
                base.mkdir(parents=True, exist_ok=True)
                clean = base / "clean"
                runs = {"clean": _capture(args, model, backend, data, "", clean)}
                rerun = base / "clean-rerun"
                runs["clean-rerun"] = _capture(args, model, backend, data, "", rerun)
                pairs = [
                    ("clean-eager", clean, eager, "eager", "", ""),
                    ("clean-compiled", clean, rerun, "compiled", "", ""),
                ]
                pairs.append(("clean-self", clean, clean, "compiled", "", ""))
                for kind, path in sites(model, layers):
                    if kind not in args.faults:
                        continue
                    fault = f"{kind}@{path}"
                    target = base / fault.replace("@", "__")
                    runs[fault] = _capture(args, model, backend, data, fault, target)
                    # A fault the backend compiles away (inductor computes a bf16 round trip inside a
                    # fused kernel in float32) leaves the run bit for bit the clean one: nothing to find.
                    dropped = runs[fault].get("digest") is not None and runs[fault]["digest"] == runs["clean"].get(
                        "digest"
                    )
                    what = "dropped" if dropped else "fault"
                    pairs.append((what, target, eager, "eager", fault, path))
                    pairs.append((what, target, clean, "compiled", fault, path))
                for kind, target, bench, bench_kind, fault, expect in pairs:
                    case = Case(model, backend, data, kind, fault, bench_kind, expect)
                    started = time.perf_counter()
                    run = runs["clean" if not fault else fault] if target != rerun else runs["clean-rerun"]
                    failed = run.get("error") or (bench_run.get("error") if bench == eager else "")
                    if failed:
                        case.error = failed
                    else:
                        case.transparent = run.get("transparent")
                        try:
                            _judge(case, target, bench)
                        except Exception as exc:  # noqa: BLE001 - a crash of compare is a result to report
                            case.error = f"{type(exc).__name__}: {exc}"[:300]
                    case.seconds = time.perf_counter() - started
                    cases.append(case)
                    print(_line(case), file=sys.stderr, flush=True)
    return cases


def _line(case: Case) -> str:
    what = case.fault or case.kind
    got = case.error or f"{case.verdict} {case.op} in {case.module or '<top>'}"
    return (
        f"[{case.model} {case.backend} {case.data}] {what} vs {case.bench}: {'met' if case.met else 'MISSED'} ({got})"
    )


def table(cases: list[Case]) -> str:
    """The markdown table: per model, backend and mode, clean pairs, top-1 both ways, transparency."""
    rows = [
        "| model | backend | data | clean pairs AGREE | top-1 vs eager | top-1 vs compiled | dropped faults AGREE "
        "| transparent | crashes |"
    ]
    rows.append("|---|---|---|---|---|---|---|---|---|")
    groups: dict[tuple[str, str, str], list[Case]] = {}
    for case in cases:
        groups.setdefault((case.model, case.backend, case.data), []).append(case)
    for (model, backend, data), group in groups.items():
        clean = [c for c in group if c.kind.startswith("clean")]
        eager = [c for c in group if c.kind == "fault" and c.bench == "eager"]
        compiled = [c for c in group if c.kind == "fault" and c.bench == "compiled"]
        dropped = [c for c in group if c.kind == "dropped"]
        checked = [c for c in group if c.transparent is not None]
        rows.append(
            f"| {model} | {backend} | {data} | {sum(c.met for c in clean)} of {len(clean)} | "
            f"{sum(c.met for c in eager)} of {len(eager)} | {sum(c.met for c in compiled)} of {len(compiled)} | "
            f"{sum(c.met for c in dropped)} of {len(dropped)} | "
            f"{sum(bool(c.transparent) for c in checked)} of {len(checked)} | {sum(bool(c.error) for c in group)} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.localization.compiled",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--models", default="tinygpt,gpt2", type=lambda s: s.split(","))
    parser.add_argument("--backends", default="aot_eager,inductor", type=lambda s: s.split(","))
    parser.add_argument("--data", default="stats,tensors", type=lambda s: s.split(","))
    parser.add_argument("--gpt2-size", choices=("tiny", "small"), default="tiny")
    parser.add_argument("--faults", default=",".join(FAULTS), type=lambda s: s.split(","), help="fault kinds to run")
    parser.add_argument("--workdir", type=Path, help="where traces go; cases already captured there are reused")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds allowed per captured run")
    parser.add_argument(
        "--only",
        help="tensors captures save tensors for these ops only, statistics for the rest (TraceCompare's only=, "
        "e.g. 'phases=forward,backward': a 124M model's AdamW steps write about 10 GB of tensors a run)",
    )
    parser.add_argument("--json", type=Path, help="write every case here")
    parser.add_argument("--markdown", type=Path, help="write the table here as well")
    parser.add_argument("--run", nargs=5, metavar=("MODEL", "BACKEND", "DATA", "FAULT", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run:
        model, backend, data, fault, out = args.run
        fault = "" if fault == "-" else fault
        print(json.dumps(run_one(model, backend, data, fault, args.gpt2_size, Path(out), args.only)))
        return 0
    cases = plan_and_run(args)
    text = table(cases)
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps([asdict(c) for c in cases], indent=1))
    return 0 if all(not c.error for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main())
