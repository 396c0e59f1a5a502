"""GPT-2 from ``transformers``: the target's attention fused (``attn_implementation="sdpa"``), the
bench's eager (matmul, softmax, matmul), same seed, weights and batch, one training step each.

A clean pair must agree (no root, exit code 0 on the CLI). With one real fault elsewhere in the
target (an MLP ``addmm`` or the GELU's ``tanh`` scaled by 1 + 1e-3, a backward ``mm`` or a
``native_layer_norm_backward`` likewise), the first divergence must be that call, never the fused
attention. Ground truth is the target trace's k-th call of the op in the phase the fault mode saw.

    python benchmarks/bench_gpt2_fused.py                        # 2 layers, statistics
    python benchmarks/bench_gpt2_fused.py --data tensors
    python benchmarks/bench_gpt2_fused.py --size small           # GPT-2 small, 12 layers, 124M
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import tracecmp  # noqa: E402
from workloads.localization.faults import corrupt_  # noqa: E402

SIZES = {
    # Dropout off: both sides then draw nothing, so a clean pair differs by rounding alone.
    "tiny": dict(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=64),
    "small": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024),  # 124M parameters
}
BATCH = {"tiny": (4, 16), "small": (2, 32)}


@dataclass(frozen=True)
class Fault:
    """Scale the ``k``-th call of ``op`` in ``phase`` (its first float output) by 1 + ``magnitude``."""

    name: str
    op: str
    phase: str
    k: int
    magnitude: float = 1e-3


def faults(layers: int) -> list[Fault]:
    last = layers - 1
    return [
        # Per block, forward addmm calls are c_attn, attn c_proj, mlp c_fc, mlp c_proj.
        Fault("addmm (last block's mlp.c_fc)", "aten.addmm.default", "forward", 4 * last + 2),
        Fault("tanh (last block's GELU)", "aten.tanh.default", "forward", last),
        Fault("backward mm (first block's mlp.c_proj grad)", "aten.mm.default", "backward", None),  # type: ignore[arg-type]
        Fault(
            "native_layer_norm_backward (first block's ln_2)",
            "aten.native_layer_norm_backward.default",
            "backward",
            2 * last + 1,
        ),
    ]


class FaultMode(TorchDispatchMode):
    """Entered outside ``TraceCompare``: corrupts one call's output before capture reads it."""

    def __init__(self, fault: Fault | None, optimizing: list[bool]) -> None:
        super().__init__()
        self.fault, self.optimizing = fault, optimizing
        self.counts: dict[tuple[str, str], int] = {}
        self.applied = False

    def phase(self) -> str:
        if self.optimizing[0]:
            return "optimizer"
        return "backward" if torch._C._current_autograd_node() is not None else "forward"

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        key = (str(func), self.phase())
        k = self.counts.get(key, 0)
        self.counts[key] = k + 1
        f = self.fault
        if f is not None and key == (f.op, f.phase) and k == f.k:
            first = next(
                t
                for t in (out if isinstance(out, (tuple, list)) else [out])
                if isinstance(t, torch.Tensor) and t.is_floating_point()
            )
            corrupt_(first, "scale", f.magnitude, 0)
            self.applied = True
        return out


def build(size: str, layers: int | None, attention: str) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    shape = dict(SIZES[size], **({"n_layer": layers} if layers else {}))
    config = GPT2Config(**shape, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    config._attn_implementation = attention
    torch.manual_seed(1234)
    return GPT2LMHeadModel(config).train()


def run(
    path: Path, size: str, layers: int | None, attention: str, data: str, fault: Fault | None
) -> tuple[float, bool]:
    """One step (forward, backward, AdamW) captured into ``path``; returns the loss and whether the
    fault was applied."""
    model = build(size, layers, attention)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch, seq = BATCH[size]
    tokens = torch.randint(0, model.config.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(7))
    optimizing = [False]
    mode = FaultMode(fault, optimizing)
    with mode, tracecmp.TraceCompare(str(path), model=model, data=data) as tc:
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]).loss
        loss.backward()
        optimizing[0] = True
        opt.step()
        opt.zero_grad(set_to_none=True)
        optimizing[0] = False
        tc.step()
    return float(loss.detach()), mode.applied


def truth(path: Path, fault: Fault) -> tuple[int, str]:
    """The faulted call's op id and module in the target trace."""
    ops = tracecmp.load(str(path)).rank(0).ops
    rows = ops[(ops["op"] == fault.op) & (ops["phase"] == fault.phase)].sort_values("op_id")
    row = rows.iloc[fault.k]
    return int(row["op_id"]), str(row["module"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--layers", type=int, help="override the size's layer count")
    parser.add_argument("--data", choices=("stats", "tensors"), default="stats")
    parser.add_argument("--keep", type=Path, help="keep the traces here")
    args = parser.parse_args(argv)
    layers = args.layers or SIZES[args.size]["n_layer"]
    work = args.keep or Path(tempfile.mkdtemp(prefix="gpt2-fused-"))
    work.mkdir(parents=True, exist_ok=True)
    params = sum(p.numel() for p in build(args.size, args.layers, "eager").parameters())
    print(
        f"GPT-2 {args.size}, {layers} layers, {params / 1e6:.1f}M parameters, data={args.data}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    failures = 0
    try:
        bench = work / "bench-eager"
        start = time.perf_counter()
        bench_loss, _ = run(bench, args.size, args.layers, "eager", args.data, None)
        clean = work / "target-sdpa-clean"
        clean_loss, _ = run(clean, args.size, args.layers, "sdpa", args.data, None)
        print(f"losses: eager {bench_loss!r}, sdpa {clean_loss!r} (captured in {time.perf_counter() - start:.1f} s)")
        start = time.perf_counter()
        cli = subprocess.run(
            [sys.executable, "-m", "tracecmp", "compare", str(clean), str(bench), "-o", str(work / "clean-report")],
            capture_output=True,
            text=True,
        )
        result = tracecmp.compare(str(clean), str(bench))
        regions = result.regions_frame()
        fused = regions[regions["kind"] == "fused"] if len(regions) else regions
        ok = cli.returncode == 0 and result.agrees and not result.suspects
        failures += not ok
        print(
            f"clean pair: CLI exit {cli.returncode}, {len(result.suspects)} roots, {len(regions)} regions "
            f"({len(fused)} fused), compare {time.perf_counter() - start:.1f} s (CLI and API) -> {'OK' if ok else 'FAIL'}"
        )
        if not ok:
            print(result.summary())
        plan = faults(layers)
        # The first block's mlp.c_proj weight gradient: the backward mm calls run last block first,
        # two per Linear-like layer (input grad, weight grad), lm_head's first.
        for f in plan:
            if f.k is None:
                ops = tracecmp.load(str(clean)).rank(0).ops
                mms = ops[(ops["op"] == f.op) & (ops["phase"] == "backward")].sort_values("op_id")
                mods = mms["module"].tolist()
                picks = [i for i, m in enumerate(mods) if m.endswith("h.0.mlp.c_proj")]
                plan[plan.index(f)] = Fault(f.name, f.op, f.phase, picks[-1] if picks else len(mods) // 2, f.magnitude)
        for f in plan:
            path = work / f"target-sdpa-{f.op.split('.')[1]}"
            loss, applied = run(path, args.size, args.layers, "sdpa", args.data, f)
            if not applied:
                print(f"{f.name}: the run never made call {f.k} of {f.op} in {f.phase}")
                failures += 1
                continue
            op_id, module = truth(path, f)
            start = time.perf_counter()
            result = tracecmp.compare(str(path), str(bench))
            first = result.first_divergence
            named = first is not None and first.op_id == op_id
            failures += not named
            said = "nothing" if first is None else f"{first.op} in {first.module} [{first.phase}] #{first.op_id}"
            print(
                f"{f.name}: truth {f.op} in {module} [{f.phase}] #{op_id}; first divergence {said}; "
                f"{len(result.suspects)} roots; {time.perf_counter() - start:.1f} s -> {'NAMED' if named else 'MISSED'}"
            )
            if not named:
                print(result.summary())
            if not args.keep:
                shutil.rmtree(path, ignore_errors=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print("all as expected" if not failures else f"{failures} not as expected")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
