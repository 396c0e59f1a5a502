"""``tracecmp check`` at scale: ops replayed per second and peak memory on real models' tensors traces.

For each model of the overhead benchmark (``bench_overhead.build``: GPT-2 4x256 and ResNet-50,
batch 8, both with Adam) one training step is captured with ``data="tensors"`` (in a child
process), then checked in fresh child processes, one per configuration, so that each peak RSS
is that configuration's alone: one process at torch's default thread count, one process at one
thread, and two worker processes. Configurations run in rounds, interleaved, so machine noise
hits them alike. ``--filtered`` also captures the same step with tensors for one module only
(``only={"modules": [...]}``), under a device fault inside that module (its matmuls, convolutions
and attention read float16-rounded inputs), reports both traces' sizes and what ``check`` names. ``--models gpt2-small``
captures GPT-2 small (124M parameters, 2 x 128 tokens) with tensors; ``--configs replay_rank``
measures compare's path (``replay_rank``) beside check's; replay's peak RSS there is the figure
issue 21 asks to keep under 3 GB. ``--baseline DIR`` runs every configuration a second time, with
the tracecmp in DIR, interleaved (before and after a change, side by side).

    python benchmarks/bench_check.py --models gpt2 resnet50 --rounds 2 --filtered
    python benchmarks/bench_check.py --models gpt2-small --configs one-thread replay_rank --rounds 1 --baseline /tmp/before
    python benchmarks/bench_check.py --margins

``--margins`` measures no time: it checks the integration tests' clean and faulty runs of the demo
transformer and prints how far each sits from the standards (the figures behind them).

Traces go to a temporary folder under ``--workdir`` (default /tmp) and are deleted afterwards.
Run it under ``flock /work/wt/bigmem.lock`` (ResNet-50's trace is ~3 GB, GPT-2 small's ~10 GB).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("default-threads", "one-thread", "two-workers")
FILTERS = {
    "gpt2": "transformer.h.1",
    "gpt2-small": "transformer.h.5",
    "gpt2-small-2l": "transformer.h.1",
    "gpt2-small-amp": "transformer.h.5",
    "resnet50": "resnet.encoder.stages.2",
    "mlp": "2",
    "block64": "mlp",
}


def _build(name: str) -> tuple[Any, Any]:
    """(model, step) for ``name``: the overhead benchmark's models, GPT-2 small, GPT-2 small with
    two layers (``gpt2-small-2l``: the same 50257 x 768 embedding, whose optimizer ops are the
    largest, in a sixth of the trace), and GPT-2 small under autocast to bfloat16 (``gpt2-small-amp``,
    issue 21's target: ``GPT2Config()`` defaults)."""
    if not name.startswith("gpt2-small"):
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from bench_overhead import build

        model, _, step = build(name)
        return model, step
    import torch
    import torch.nn.functional as F
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    import contextlib

    layers = 2 if name == "gpt2-small-2l" else 12
    config = GPT2Config() if name == "gpt2-small-amp" else GPT2Config(n_positions=128, n_layer=layers)
    model = GPT2LMHeadModel(config).train()  # 124M parameters (12 layers), vocab 50257
    tokens = torch.randint(0, 50257, (2, 129))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)

    def step() -> Any:
        amp = torch.autocast("cpu", dtype=torch.bfloat16) if name == "gpt2-small-amp" else contextlib.nullcontext()
        with amp:
            loss = F.cross_entropy(model(x).logits.reshape(-1, 50257), y.reshape(-1))  # autocast runs it in float32
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return model, step


class _Fp16Inputs:
    """A device fault for the filtered captures: inside one module's forward, matmuls, convolutions
    and attention read their float32 inputs rounded to float16 (and write float32), as a unit fed
    half precision would; outside it everything runs as usual."""

    def __init__(self, model: Any, module: str) -> None:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        aten = torch.ops.aten
        ops = {
            aten.mm.default,
            aten.addmm.default,
            aten.bmm.default,
            aten.convolution.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default,
        }
        owner = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                kwargs = kwargs or {}
                if owner.active and func in ops:
                    args = [
                        a.half().float() if isinstance(a, torch.Tensor) and a.dtype == torch.float32 else a
                        for a in args
                    ]
                return func(*args, **kwargs)

        self.active = False
        self.mode = Mode()
        target = model.get_submodule(module)
        target.register_forward_pre_hook(lambda *_: setattr(self, "active", True))
        target.register_forward_hook(lambda *_: setattr(self, "active", False))


def capture(name: str, path: Path, only: str | None) -> dict[str, Any]:
    """Child: one step of ``name`` captured with tensors (after one untraced warm-up step); with
    ``only``, tensors for that module alone and a float16-input fault inside it (``_Fp16Inputs``)."""
    import contextlib

    import tracecmp

    model, step = _build(name)
    step()
    start = time.perf_counter()
    extra = {"only": {"modules": [only]}} if only else {}
    fault = _Fp16Inputs(model, only).mode if only else contextlib.nullcontext()
    with fault, tracecmp.TraceCompare(path, model=model, data="tensors", dropout=0.0, **extra) as tc:
        step()
        tc.step()
    seconds = time.perf_counter() - start
    found: dict[str, Any] = {}
    if only:
        result = tracecmp.check(path, progress=False)
        d = result.first_error
        found = {
            "first_error": None if d is None else f"{d.op} in {d.module} ({d.phase})",
            "errors": result.counts()["error"],
            "by_tensors": result.counts().get("by tensors", 0),
        }
    return {"seconds": seconds, "bytes": sum(p.stat().st_size for p in path.rglob("*") if p.is_file()), **found}


def margins() -> list[dict[str, Any]]:
    """Child: how far the standards sit from clean runs and from faults, on the demo transformer's
    Adam step (the integration tests' runs, from ``workloads/kernel_faults.py``).

    For a clean run: the largest ratio of an op's own error to an honest replay's among the ops
    whose error exceeds the floor (there the ratio decides; an op errs beyond ``margin`` = 4), and
    the largest error in rounding units. For a fault: the faulty op's ratio, its error in rounding
    units, and its score (how many times beyond the standard; > 1 errs)."""
    import torch

    sys.path.insert(0, str(ROOT))
    import tracecmp
    from workloads.kernel_faults import capture as capture_demo

    torch.set_num_threads(1)
    runs: list[tuple[str, dict[str, Any]]] = [
        ("clean float32", {}),
        ("clean whole-bf16", {"dtype": torch.bfloat16}),
        ("clean autocast-bf16", {"autocast": True}),
        ("clean TF32 (declared)", {"tf32": True}),
        ("clean float32, statistics only", {"data": "stats"}),
        *((f"fault {f}", {"fault": f}) for f in ("gelu-tanh", "layer-norm-eps", "matmul-fp16-inputs", "softmax-fp16")),
        *(
            (f"fault {f}, statistics only", {"fault": f, "data": "stats"})
            for f in ("gelu-tanh", "matmul-fp16", "softmax-fp16")
        ),
    ]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for index, (name, options) in enumerate(runs):
            fault = options.pop("fault", None)
            result = tracecmp.check(capture_demo(Path(folder) / str(index), fault, **options), progress=False)
            nodes = result.nodes
            judged = nodes[nodes["status"] != "skipped"]
            d = result.first_error
            row: dict[str, Any] = {
                "run": name,
                "ops": len(nodes),
                "judged": len(judged),
                "errors": int((nodes["status"] == "error").sum()),
                "warnings": int((nodes["status"] == "warning").sum()),
            }
            if d is None:
                above = judged[judged["error_units"] > 4]
                row["worst_ratio"] = float(above["ratio"].max()) if len(above) else 0.0
                row["worst_units"] = float(judged["error_units"].max())
            else:
                hit = nodes[(nodes["op_id"] == d.op_id) & (nodes["rank"] == d.rank)].iloc[0]
                row.update(
                    first_error=f"{d.op} in {d.module}",
                    ratio=float(hit["ratio"]),
                    units=float(hit["error_units"]),
                    score=float(d.score),
                )
            rows.append(row)
    return rows


def replay(path: Path, config: str) -> dict[str, Any]:
    """Child: ``tracecmp.check`` (or compare's ``replay_rank`` with ``config="replay_rank"``) on a trace."""
    import torch

    import tracecmp
    from tracecmp.numerics.replay import replay_rank

    try:
        import tracecmp.checking  # noqa: F401 - imports are not replay time
    except ImportError:  # --baseline: a tracecmp from before check
        pass

    config = config.partition("@")[0]  # "<config>@baseline": the same, run with another tracecmp
    if config == "one-thread":
        torch.set_num_threads(1)
    workers = 2 if config == "two-workers" else 1
    threads = torch.get_num_threads()
    start = time.perf_counter()
    if config.startswith("replay_rank"):
        trace = tracecmp.load(path)
        found = replay_rank(trace.rank(0))
        ops, judged, errors = int((trace.rank(0).ops["kind"] == "op").sum()), len(found), -1
    else:
        result = tracecmp.check(path, workers=workers, progress=False)
        counts = result.counts()
        ops, judged, errors = counts["ops"], counts["pass"] + counts["warning"] + counts["error"], counts["error"]
    seconds = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return {
        "seconds": seconds,
        "ops": ops,
        "judged": judged,
        "errors": errors,
        "ops_per_s": ops / seconds,
        "peak_rss": rss,
        "peak_worker_rss": children,
        "threads": threads,
    }


def _child(args: list[str], timeout: int, root: Path = ROOT) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        raise SystemExit(f"child {args} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _mb(value: float) -> str:
    return f"{value / 2**20:,.0f} MB" if value < 2**30 else f"{value / 2**30:.2f} GB"


def _print_margins(rows: list[dict[str, Any]]) -> None:
    print(
        "| run | ops | judged | errors | warnings | first error | its own/honest error | its rounding units | "
        "its score | clean: largest own/honest above the floor | clean: largest rounding units |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "first_error" in r:
            tail = f"{r['first_error']} | {r['ratio']:.3g} | {r['units']:.3g} | {r['score']:.3g} | | "
        else:
            tail = f"— | | | | {r['worst_ratio']:.2f} | {r['worst_units']:.3g}"
        print(f"| {r['run']} | {r['ops']} | {r['judged']} | {r['errors']} | {r['warnings']} | {tail} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--models",
        nargs="+",
        default=["gpt2", "resnet50"],
        choices=["gpt2", "resnet50", "gpt2-small", "gpt2-small-2l", "gpt2-small-amp", "mlp", "block64"],
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=[*CONFIGS, "replay_rank"])
    parser.add_argument(
        "--filtered", action="store_true", help="also capture with tensors for one module and compare sizes"
    )
    parser.add_argument("--only-replay", action="store_true", help="measure compare's replay_rank only (peak RSS)")
    parser.add_argument(
        "--baseline",
        type=Path,
        help="also run every configuration with the tracecmp in this folder "
        "(say `git archive <commit> | tar -x -C DIR` plus its built extension), interleaved",
    )
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--timeout", type=int, default=3600)
    parser.add_argument(
        "--margins",
        action="store_true",
        help="only: how far the standards sit from clean runs and faults on the demo transformer (no timing)",
    )
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, *rest = args.child
        if kind == "capture":
            print(json.dumps(capture(rest[0], Path(rest[1]), rest[2] if len(rest) > 2 else None)))
        else:
            print(json.dumps(replay(Path(rest[0]), rest[1])))
        return
    if args.margins:
        _print_margins(margins())
        return
    configs = ["replay_rank"] if args.only_replay else args.configs
    if args.baseline is not None:
        configs = [c for config in configs for c in (f"{config}@baseline", config)]
    print(
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; torch threads by default; rounds {args.rounds}"
    )
    rows = []
    for name in args.models:
        folder = Path(tempfile.mkdtemp(prefix=f"bench-check-{name}-", dir=args.workdir))
        try:
            trace = folder / "whole"
            made = _child(["--child", "capture", name, str(trace)], args.timeout)
            print(f"{name}: captured one step with tensors in {made['seconds']:.1f} s, {_mb(made['bytes'])}")
            if args.filtered:
                narrow = folder / "narrow"
                cut = _child(["--child", "capture", name, str(narrow), FILTERS[name]], args.timeout)
                print(
                    f"{name}: only={{'modules': ['{FILTERS[name]}']}}: {_mb(cut['bytes'])} "
                    f"({cut['bytes'] / made['bytes']:.1%} of the whole step), captured in {cut['seconds']:.1f} s; "
                    f"with float16 inputs to its matmuls/convolutions/attention, check names {cut['first_error']} "
                    f"({cut['errors']} erring ops, {cut['by_tensors']} judged on tensors)"
                )
                shutil.rmtree(narrow, ignore_errors=True)
            found: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
            for _ in range(args.rounds):
                for config in configs:
                    root = args.baseline if config.endswith("@baseline") else ROOT
                    found[config].append(_child(["--child", "replay", str(trace), config], args.timeout, root))
            for config, runs in found.items():
                seconds = statistics.median(r["seconds"] for r in runs)
                rss = max(r["peak_rss"] for r in runs)
                workers = max(r["peak_worker_rss"] for r in runs)
                first = runs[0]
                rows.append(
                    (
                        name,
                        config,
                        first["ops"],
                        first["judged"],
                        first["errors"],
                        seconds,
                        first["ops"] / seconds,
                        rss,
                        workers,
                        made["bytes"],
                    )
                )
                print(
                    f"  {config:16s} {first['ops']} ops ({first['judged']} judged, {first['errors']} errors) "
                    f"median {seconds:.1f} s = {first['ops'] / seconds:.0f} ops/s, peak RSS {_mb(rss)}"
                    + (f", workers {_mb(workers)} each" if workers else "")
                )
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    print(
        "\n| model | configuration | ops | judged | errors | median time | ops/s | peak RSS | worker peak RSS | trace |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, config, ops, judged, errors, seconds, rate, rss, workers, size in rows:
        print(
            f"| {name} | {config} | {ops} | {judged} | {errors} | {seconds:.1f} s | {rate:.0f} | {_mb(rss)} | "
            f"{_mb(workers) if workers else '—'} | {_mb(size)} |"
        )


if __name__ == "__main__":
    main()
