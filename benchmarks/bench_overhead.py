"""Capture overhead of one training step, side by side: plain, tracecmp, msprobe, TorchLens.

Each (model, configuration, thread count) runs in its own worker process (msprobe and TorchLens
patch torch globally, so they cannot share a process with the others), the workers of a model are
interleaved round by round so machine noise hits every configuration alike, and every figure is
reported as a ratio to the plain step's median at the same thread count.

Thread counts: torch's default (what users get: one per core) and one thread beside it, unless
``--threads`` (or ``BENCH_THREADS``, which older commands set) says otherwise. Besides the table of
steps it prints the scaling table: per model and thread count, the time tracecmp adds to a step,
and the statistics pass's own GB/s inside the traced step (its calls timed in two extra steps)
against the machine's read bandwidth (a worker that times ``sum()`` over 512 MiB, once per round
and thread count, interleaved with the rest). Beside wall-clock steps it reports the process's CPU
time per step: on a machine other jobs load, CPU time at one thread moves much less than wall
time (with more threads it counts torch's threads spinning between ops, so read it at one).

    python benchmarks/bench_overhead.py                      # all models, all configurations
    python benchmarks/bench_overhead.py --models mlp --rounds 2
    python benchmarks/bench_overhead.py --configs plain tracecmp-stats --threads default 1 2
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

MODELS = ("mlp", "block64", "transformer512", "resnet50", "gpt2", "gpt2-small")
CONFIGS = (
    "plain",
    "tracecmp-stats",
    "tracecmp-stats-det",
    "tracecmp-selfcheck",
    "tracecmp-tensors",
    "msprobe-statistics",
    "msprobe-tensor",
    "torchlens-fwd",
)
# Slow peers on big models would take many minutes a step; fewer steps keep the run bounded. The
# small models run long enough (over a second traced) that tracecmp's time-based hand-overs to its
# writer (flush_secs=1) fall inside the timed steps, not only into the exit.
STEPS = {"mlp": 300, "block64": 150, "transformer512": 6, "resnet50": 4, "gpt2": 6, "gpt2-small": 3}
PEER_STEPS = 20  # at most, for msprobe and TorchLens (20-300 ms a step on the small models)
HEAVY = {"resnet50", "transformer512", "gpt2-small"}
BANDWIDTH_MIB = 512  # the read-bandwidth probe's buffer: well beyond any core's caches


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
            self.mlp = torch.nn.Sequential(
                torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.ln1(x)
            x = x + self.attn(h, h, h, need_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    torch.manual_seed(0)
    if name == "mlp":
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 128),
            torch.nn.ReLU(),
            torch.nn.Linear(128, 128),
            torch.nn.ReLU(),
            torch.nn.Linear(128, 10),
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
    elif name in ("gpt2", "gpt2-small"):
        from transformers import GPT2Config, GPT2LMHeadModel

        # gpt2: 4 layers at d256; gpt2-small: GPT-2 small itself (GPT2Config() defaults, 124M).
        small = name == "gpt2-small"
        config = (
            GPT2Config() if small else GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=2048, n_positions=128)
        )
        model = GPT2LMHeadModel(config)
        vocab = config.vocab_size
        tokens = torch.randint(0, vocab, (2, 129))
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        loss_fn = lambda out: F.cross_entropy(out.logits.reshape(-1, vocab), y.reshape(-1))  # noqa: E731
    else:
        raise SystemExit(f"unknown model {name}")
    model.train()
    adam = torch.optim.AdamW if name == "gpt2-small" else torch.optim.Adam
    opt = adam(model.parameters(), lr=1e-4)

    def step() -> Any:
        loss = loss_fn(model(x))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return model, x, step


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def set_threads() -> None:
    """Torch's thread count for this worker: ``BENCH_THREADS`` when set, else torch's default."""
    import torch

    threads = os.environ.get("BENCH_THREADS", "default")
    if threads != "default":
        torch.set_num_threads(int(threads))


def read_bandwidth() -> dict[str, Any]:
    """The machine's read bandwidth at this worker's thread count: best of ``sum()`` over 512 MiB."""
    import torch

    set_threads()
    buf = torch.ones(BANDWIDTH_MIB * 2**20 // 4)
    best = float("inf")
    for _ in range(6):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return {"read_gbs": buf.numel() * 4 / best / 1e9, "threads": torch.get_num_threads()}


def timed_statistics(step: Callable[[], Any], tc: Any, steps: int) -> dict[str, float]:
    """Run ``steps`` more traced steps with the statistics pass's calls timed: its GB/s in place.

    The pass reads each output right after the op that wrote it, so this is its speed inside a real
    step (caches as the model leaves them), not on a tensor read over and over.
    """
    from tracecmp.capture import stats

    real = getattr(stats, "_native_stats", None)
    if real is None:  # the reference serves (or an older tracecmp): nothing to time
        return {}
    import torch

    width = {code: torch.empty(0, dtype=dtype).element_size() for dtype, code in stats._NATIVE_CODES.items()}
    seconds, nbytes = 0.0, 0

    def timed(ptr: int, shape: Any, strides: Any, code: int, numel: int, threads: int) -> tuple[Any, ...]:
        nonlocal seconds, nbytes
        t0 = time.perf_counter()
        row = real(ptr, shape, strides, code, numel, threads)
        seconds += time.perf_counter() - t0
        nbytes += numel * width[code]
        return row

    stats._native_stats = timed
    try:
        for _ in range(steps):
            step()
            tc.step()
    finally:
        stats._native_stats = real
    return {"stats_s": seconds / steps, "stats_bytes": nbytes / steps}


def worker(name: str, config: str, steps: int, workdir: Path) -> dict[str, Any]:
    """Time ``steps`` steps after one warm-up step; report median and mean seconds, ops and bytes per step.

    The mean counts tracecmp's exit too (the last hand-over and waiting for the writer), so work
    that a step boundary defers is paid for in it.
    """
    import torch

    if config == "bandwidth":
        return read_bandwidth()
    set_threads()
    tracecmp_root = os.environ.get("BENCH_TRACECMP", str(ROOT))  # --baseline: an older tracecmp
    if config == "tracecmp-stats-det":
        sys.path.insert(0, tracecmp_root)
        import tracecmp

        tracecmp.seed_all(0, deterministic=True)
    model, x, step = build(name)
    times: list[float] = []
    closing = 0.0
    ops = trace_bytes = None
    extra: dict[str, Any] = {"threads": torch.get_num_threads()}
    cpu: list[float] = []  # process CPU time per step: moves less with other jobs' load (see the README)
    if config == "plain":
        step()
        for _ in range(steps):
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    elif config.startswith("tracecmp"):
        sys.path.insert(0, tracecmp_root)
        import tracecmp

        path = workdir / "trace"
        data = "tensors" if config == "tracecmp-tensors" else "stats"
        options = {"self_check": "sample"} if config == "tracecmp-selfcheck" else {}
        with tracecmp.TraceCompare(path, model=model, data=data, **options) as tc:
            step()
            tc.step()
            tc.sync()
            for _ in range(steps):
                t0, c0 = time.perf_counter(), time.process_time()
                step()
                tc.step()  # the step boundary hands finished steps to the writer when due: part of the cost
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
            t0 = time.perf_counter()
            tc.sync()
            closing = time.perf_counter() - t0
            if config == "tracecmp-stats":
                extra.update(timed_statistics(step, tc, 2))
        frame = tracecmp.load(path).to_frame()
        ops = int(frame["step"].between(1, steps).sum()) / steps
        trace_bytes = folder_bytes(path) / (frame["step"].max() + 1)
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
        **({"cpu_median_s": statistics.median(cpu)} if cpu else {}),
        **extra,
    }


# ----------------------------------------------------------------------------- driver
def run_worker(
    python: str, name: str, config: str, steps: int, timeout: float, threads: str, tracecmp_root: Path = ROOT
) -> dict[str, Any] | str:
    workdir = Path(tempfile.mkdtemp(prefix=f"ovh-{name}-{config}-"))
    cmd = [python, __file__, "--worker", name, config, "--steps", str(steps), "--workdir", str(workdir)]
    env = dict(
        os.environ,
        PYTHONPATH=f"{tracecmp_root}{os.pathsep}{ROOT}",
        BENCH_TRACECMP=str(tracecmp_root),
        BENCH_THREADS=threads,
        MSPROBE_LOG_LEVEL="3",
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
    parser.add_argument(
        "--threads", nargs="*", help="torch thread counts to run, 'default' for torch's own (default: default 1)"
    )
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(*args.worker, args.steps, args.workdir)), flush=True)
        return

    peer_python = os.environ.get("PEER_PYTHON") or str(ROOT / "benchmarks/.peerenv/bin/python")
    have_peers = Path(peer_python).exists()
    # BENCH_THREADS, as older commands set it, stands for a single --threads value.
    threads = args.threads or ([os.environ["BENCH_THREADS"]] if os.environ.get("BENCH_THREADS") else ["default", "1"])
    results: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    notes: dict[tuple[str, str, str], str] = {}
    configs = list(args.configs)
    if args.baseline:
        configs += [f"{c}@baseline" for c in args.configs if c.startswith("tracecmp")]
    print(f"load average before: {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
    loads = [os.getloadavg()[0]]
    for model in args.models:
        steps = max(2, int(STEPS[model] * args.steps_scale))
        for round_index in range(args.rounds):
            for setting in threads:
                for config in ["bandwidth", *configs]:
                    key = (model, config, setting)
                    peer = config.startswith(("msprobe", "torchlens"))
                    if peer and not have_peers:
                        notes[key] = "peers not installed (benchmarks/peers.sh)"
                        continue
                    # The slow tensor dumps of the peers get one round on the heavy models: minutes a step.
                    if config == "msprobe-tensor" and model in HEAVY and round_index:
                        continue
                    python = peer_python if peer else sys.executable
                    n = (
                        2
                        if (config == "msprobe-tensor" and model in HEAVY)
                        else (min(steps, PEER_STEPS) if peer else steps)
                    )
                    name, _, baseline = config.partition("@")
                    root = args.baseline.resolve() if baseline else ROOT
                    out = run_worker(python, model, name, n, args.timeout, setting, root)
                    if isinstance(out, str):
                        notes[key] = out
                    else:
                        results.setdefault(key, []).append(out)
                    shown = out if isinstance(out, str) else round(out.get("median_s", out.get("read_gbs", 0.0)), 4)
                    loads.append(os.getloadavg()[0])
                    print(
                        f"[{model} round {round_index} threads {setting} {config}] {shown} (load {loads[-1]:.2f})",
                        file=sys.stderr,
                        flush=True,
                    )

    def label(setting: str) -> str:
        """``default (N)`` for torch's default count, as the workers reported it."""
        counts = {r["threads"] for (_, _, s), runs in results.items() if s == setting for r in runs if "threads" in r}
        count = "/".join(str(c) for c in sorted(counts)) or "?"
        return f"default ({count})" if setting == "default" else count

    def median_of(key: tuple[str, str, str], field: str) -> float | None:
        values = [r[field] for r in results.get(key, []) if field in r]
        return statistics.median(values) if values else None

    print(
        f"load average (1 min) over the run: {min(loads):.2f}-{max(loads):.2f}, median {statistics.median(loads):.2f}\n"
    )
    print(
        "| model | threads | configuration | step (median) | ratio to plain | added per step | mean incl. writes "
        "| ratio (means) | CPU time per step (median) | ratio (CPU) | ops/step | trace bytes/step |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model in args.models:
        for setting in threads:
            base = median_of((model, "plain", setting), "median_s")
            base_mean = median_of((model, "plain", setting), "mean_s")
            base_cpu = median_of((model, "plain", setting), "cpu_median_s")
            for config in configs:
                key = (model, config, setting)
                runs = results.get(key)
                if not runs:
                    print(
                        f"| {model} | {label(setting)} | {config} | - | - | - | - | - | - | - | - | {notes.get(key, 'not run')} |"
                    )
                    continue
                median = statistics.median(r["median_s"] for r in runs)
                if config == "torchlens-fwd":
                    ref = statistics.median(r["plain_fwd_s"] for r in runs)
                    ratio, added = median / ref, median - ref
                    name = "torchlens (forward only)"
                else:
                    ratio = median / base if base else float("nan")
                    added = median - base if base else float("nan")
                    name = config
                ops = runs[0].get("ops")
                mean = median_of(key, "mean_s")
                mean_text = "-" if mean is None else f"{mean * 1e3:.2f} ms"
                mean_ratio = "-" if mean is None or not base_mean else f"{mean / base_mean:.2f}x"
                cpu = median_of(key, "cpu_median_s")
                cpu_text = "-" if cpu is None else f"{cpu * 1e3:.2f} ms"
                cpu_ratio = "-" if cpu is None or not base_cpu else f"{cpu / base_cpu:.2f}x"
                print(
                    f"| {model} | {label(setting)} | {name} | {median * 1e3:.2f} ms | {ratio:.2f}x | {added * 1e3:.2f} ms | "
                    f"{mean_text} | {mean_ratio} | {cpu_text} | {cpu_ratio} | {'-' if ops is None else f'{ops:.0f}'} "
                    f"| {fmt_bytes(runs[0].get('bytes'))} |"
                )
    if "plain" in configs and "tracecmp-stats" in configs:
        print_scaling(args.models, threads, label, median_of, results)


def print_scaling(
    models: list[str],
    threads: list[str],
    label: Callable[[str], str],
    median_of: Callable[[tuple[str, str, str], str], float | None],
    results: dict[tuple[str, str, str], list[dict[str, Any]]],
) -> None:
    """Per model and thread count: time added per step, and the statistics pass's GB/s in place."""
    heads = [label(s) for s in threads]
    print("\nScaling: time tracecmp-stats adds to a step (medians), and its statistics pass's read rate inside")
    print("the step (GB/s read / the machine's read bandwidth at that thread count, same run)\n")
    print(
        "| model | "
        + " | ".join(f"added, {h} threads" for h in heads)
        + (f" | added {heads[0]} / added {heads[-1]}" if len(threads) > 1 else "")
        + " | "
        + " | ".join(f"pass, {h}: GB/s (share of bandwidth), ms per step" for h in heads)
        + " |"
    )
    print("|---|" + "---|" * (2 * len(threads) + (len(threads) > 1)))
    for model in models:
        added: list[float | None] = []
        passes: list[str] = []
        for setting in threads:
            plain = median_of((model, "plain", setting), "median_s")
            traced = median_of((model, "tracecmp-stats", setting), "median_s")
            added.append(traced - plain if plain is not None and traced is not None else None)
            runs = [r for r in results.get((model, "tracecmp-stats", setting), []) if r.get("stats_s")]
            bandwidth = median_of((model, "bandwidth", setting), "read_gbs")
            if runs:
                gbs = statistics.median(r["stats_bytes"] / r["stats_s"] / 1e9 for r in runs)
                ms = statistics.median(r["stats_s"] for r in runs) * 1e3
                share = f" ({gbs / bandwidth:.0%} of {bandwidth:.1f})" if bandwidth else ""
                passes.append(f"{gbs:.1f}{share}, {ms:.1f} ms")
            else:
                passes.append("-")
        cells = ["-" if a is None else f"{a * 1e3:.1f} ms" for a in added]
        if len(threads) > 1:
            first, last = added[0], added[-1]
            cells.append(f"{first / last:.2f}" if first is not None and last else "-")
        print(f"| {model} | " + " | ".join(cells + passes) + " |")


if __name__ == "__main__":
    main()
