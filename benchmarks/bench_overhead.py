"""Capture overhead of one training step, side by side: plain, tracecmp, msprobe, TorchLens.

Each (model, configuration) runs in its own worker process (msprobe and TorchLens patch torch
globally, so they cannot share a process with the others), the workers of a model are interleaved
round by round so machine noise hits every configuration alike, and every figure is reported as a
ratio to the plain step's median.

    python benchmarks/bench_overhead.py                      # all models, all configurations
    python benchmarks/bench_overhead.py --models mlp --rounds 2
    PEER_PYTHON=benchmarks/.peerenv/bin/python python benchmarks/bench_overhead.py
    python benchmarks/bench_overhead.py --models mlp --baseline /tmp/old   # also an older tracecmp

``--baseline DIR`` runs every tracecmp configuration a second time with the ``tracecmp`` package
found in DIR (say ``git archive <commit> tracecmp | tar -x -C DIR``, plus the built extension),
interleaved with the rest, so a before/after comparison sees the same machine noise.

The peers come from ``benchmarks/peers.sh`` (their own virtual environment); without it the msprobe
and TorchLens rows are skipped and say so.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]

MODELS = ("mlp", "block64", "transformer512", "resnet50", "gpt2")
CONFIGS = (
    "plain",
    "tracecmp-stats",
    "tracecmp-stats-det",
    "tracecmp-tensors",
    "msprobe-statistics",
    "msprobe-tensor",
    "torchlens-fwd",
)
# Slow peers on big models would take many minutes a step; fewer steps keep the run bounded. The
# small models run long enough (over a second traced) that tracecmp's time-based hand-overs to its
# writer (flush_secs=1) fall inside the timed steps, not only into the exit.
STEPS = {"mlp": 300, "block64": 150, "transformer512": 6, "resnet50": 4, "gpt2": 6}
PEER_STEPS = 20  # at most, for msprobe and TorchLens (20-300 ms a step on the small models)
HEAVY = {"resnet50", "transformer512"}


# ----------------------------------------------------------------------------- models (worker side)
def build(name: str) -> tuple[Any, Any, Callable[[], Any]]:
    """``(model, inputs, step)`` where ``step()`` runs forward, backward and an optimizer step."""
    import torch
    import torch.nn.functional as F

    class Block(torch.nn.Module):
        """Pre-norm attention + GELU MLP, the shape of a GPT layer."""

        def __init__(self, dim: int, heads: int) -> None:
            super().__init__()
            self.ln1 = torch.nn.LayerNorm(dim)
            self.attn = torch.nn.MultiheadAttention(dim, heads, batch_first=True)
            self.ln2 = torch.nn.LayerNorm(dim)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.ln1(x)
            x = x + self.attn(h, h, h, need_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    torch.manual_seed(0)
    if name == "mlp":
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)
        )
        x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
        loss_fn = lambda out: F.cross_entropy(out, y)  # noqa: E731
    elif name == "block64":
        model = Block(64, 4)
        x = torch.randn(4, 32, 64)
        loss_fn = lambda out: out.float().pow(2).mean()  # noqa: E731
    elif name == "transformer512":
        model = torch.nn.Sequential(*[Block(512, 8) for _ in range(4)])
        x = torch.randn(4, 128, 512)
        loss_fn = lambda out: out.float().pow(2).mean()  # noqa: E731
    elif name == "resnet50":
        from transformers import ResNetConfig, ResNetForImageClassification

        model = ResNetForImageClassification(ResNetConfig(num_labels=10))
        x, y = torch.randn(8, 3, 224, 224), torch.randint(0, 10, (8,))
        loss_fn = lambda out: F.cross_entropy(out.logits, y)  # noqa: E731
    elif name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=2048, n_positions=128)
        model = GPT2LMHeadModel(config)
        tokens = torch.randint(0, 2048, (2, 129))
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        loss_fn = lambda out: F.cross_entropy(out.logits.reshape(-1, 2048), y.reshape(-1))  # noqa: E731
    else:
        raise SystemExit(f"unknown model {name}")
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)

    def step() -> Any:
        loss = loss_fn(model(x))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return model, x, step


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def worker(name: str, config: str, steps: int, workdir: Path) -> dict[str, Any]:
    """Time ``steps`` steps after one warm-up step; report median and mean seconds, ops and bytes per step.

    The mean counts tracecmp's exit too (the last hand-over and waiting for the writer), so work
    that a step boundary defers is paid for in it.
    """
    import torch

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    tracecmp_root = os.environ.get("BENCH_TRACECMP", str(ROOT))  # --baseline: an older tracecmp
    if config == "tracecmp-stats-det":
        sys.path.insert(0, tracecmp_root)
        import tracecmp

        tracecmp.seed_all(0, deterministic=True)
    model, x, step = build(name)
    times: list[float] = []
    closing = 0.0
    ops = trace_bytes = None
    if config == "plain":
        step()
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    elif config.startswith("tracecmp"):
        sys.path.insert(0, tracecmp_root)
        import tracecmp

        path = workdir / "trace"
        data = "tensors" if config == "tracecmp-tensors" else "stats"
        with tracecmp.TraceCompare(path, model=model, data=data) as tc:
            step()
            tc.step()
            tc.sync()
            for _ in range(steps):
                t0 = time.perf_counter()
                step()
                tc.step()  # the step boundary hands finished steps to the writer when due: part of the cost
                times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
        closing = time.perf_counter() - t0
        frame = tracecmp.load(path).to_frame()
        ops = int((frame["step"] >= 1).sum()) / steps
        trace_bytes = folder_bytes(path) / (steps + 1)
    elif config.startswith("msprobe"):
        from msprobe.pytorch import PrecisionDebugger

        task = "statistics" if config == "msprobe-statistics" else "tensor"
        dump = workdir / "dump"
        debugger = PrecisionDebugger(dump_path=str(dump), task=task, level="L1")
        for index in range(steps + 1):
            t0 = time.perf_counter()
            debugger.start(model=model)
            step()
            debugger.stop()
            debugger.step()
            if index:
                times.append(time.perf_counter() - t0)
        counts = []
        for dump_json in dump.rglob("dump.json"):
            counts.append(len(json.loads(dump_json.read_text()).get("data", {})))
        ops = statistics.median(counts) if counts else None
        trace_bytes = folder_bytes(dump) / (steps + 1)
    elif config == "torchlens-fwd":
        import torchlens

        # TorchLens records forward passes only: its figure is a forward-pass ratio (see README).
        model.eval()
        with torch.no_grad():
            model(x)
            plain = []
            for _ in range(steps):
                t0 = time.perf_counter()
                model(x)
                plain.append(time.perf_counter() - t0)
        traced = []
        for _ in range(steps):
            t0 = time.perf_counter()
            log = torchlens.trace(model, x, save=None)
            traced.append(time.perf_counter() - t0)
        ops = len(getattr(log, "layer_list", []) or [])
        return {"median_s": statistics.median(traced), "plain_fwd_s": statistics.median(plain), "ops": ops, "bytes": 0}
    else:
        raise SystemExit(f"unknown config {config}")
    return {
        "median_s": statistics.median(times),
        "mean_s": (sum(times) + closing) / len(times),
        "ops": ops,
        "bytes": trace_bytes,
    }


# ----------------------------------------------------------------------------- driver
def run_worker(
    python: str, name: str, config: str, steps: int, timeout: float, tracecmp_root: Path = ROOT
) -> dict[str, Any] | str:
    workdir = Path(tempfile.mkdtemp(prefix=f"ovh-{name}-{config}-"))
    cmd = [python, __file__, "--worker", name, config, "--steps", str(steps), "--workdir", str(workdir)]
    env = dict(
        os.environ, PYTHONPATH=f"{tracecmp_root}{os.pathsep}{ROOT}", BENCH_TRACECMP=str(tracecmp_root), MSPROBE_LOG_LEVEL="3"
    )
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=workdir)
    except subprocess.TimeoutExpired:
        return f"timeout after {timeout:.0f}s"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return "failed: " + " | ".join(tail)
    return json.loads(lines[-1][len("RESULT ") :])


def fmt_bytes(value: float | None) -> str:
    if value is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1024 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps-scale", type=float, default=1.0)
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "CONFIG"))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--baseline", type=Path, help="a folder holding an older tracecmp package to compare with")
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(*args.worker, args.steps, args.workdir)), flush=True)
        return

    peer_python = os.environ.get("PEER_PYTHON") or str(ROOT / "benchmarks/.peerenv/bin/python")
    have_peers = Path(peer_python).exists()
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    notes: dict[tuple[str, str], str] = {}
    configs = list(args.configs)
    if args.baseline:
        configs += [f"{c}@baseline" for c in args.configs if c.startswith("tracecmp")]
    for model in args.models:
        steps = max(2, int(STEPS[model] * args.steps_scale))
        for round_index in range(args.rounds):
            for config in configs:
                peer = config.startswith(("msprobe", "torchlens"))
                if peer and not have_peers:
                    notes[(model, config)] = "peers not installed (benchmarks/peers.sh)"
                    continue
                # The slow tensor dumps of the peers get one round on the heavy models: minutes a step.
                if config == "msprobe-tensor" and model in HEAVY and round_index:
                    continue
                python = peer_python if peer else sys.executable
                n = 2 if (config == "msprobe-tensor" and model in HEAVY) else (min(steps, PEER_STEPS) if peer else steps)
                name, _, baseline = config.partition("@")
                out = run_worker(python, model, name, n, args.timeout, args.baseline.resolve() if baseline else ROOT)
                if isinstance(out, str):
                    notes[(model, config)] = out
                else:
                    results.setdefault((model, config), []).append(out)
                print(f"[{model} round {round_index} {config}] {out if isinstance(out, str) else round(out['median_s'], 4)}",
                      file=sys.stderr, flush=True)

    print(
        "| model | configuration | step (median) | ratio to plain | added per step | mean incl. writes | ratio (means) "
        "| ops/step | trace bytes/step |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for model in args.models:
        base_runs = results.get((model, "plain"))
        base = statistics.median(r["median_s"] for r in base_runs) if base_runs else None
        base_mean = statistics.median(r["mean_s"] for r in base_runs if "mean_s" in r) if base_runs else None
        for config in configs:
            runs = results.get((model, config))
            if not runs:
                print(f"| {model} | {config} | - | - | - | - | - | - | {notes.get((model, config), 'not run')} |")
                continue
            median = statistics.median(r["median_s"] for r in runs)
            if config == "torchlens-fwd":
                ref = statistics.median(r["plain_fwd_s"] for r in runs)
                ratio, added = median / ref, median - ref
                label = "torchlens (forward only)"
            else:
                ratio = median / base if base else float("nan")
                added = median - base if base else float("nan")
                label = config
            ops = runs[0].get("ops")
            means = [r["mean_s"] for r in runs if "mean_s" in r]
            mean = statistics.median(means) if means else None
            mean_text = "-" if mean is None else f"{mean * 1e3:.2f} ms"
            mean_ratio = "-" if mean is None or not base_mean else f"{mean / base_mean:.2f}x"
            print(
                f"| {model} | {label} | {median * 1e3:.2f} ms | {ratio:.2f}x | {added * 1e3:.2f} ms | {mean_text} | "
                f"{mean_ratio} | {'-' if ops is None else f'{ops:.0f}'} | {fmt_bytes(runs[0].get('bytes'))} |"
            )


if __name__ == "__main__":
    main()
