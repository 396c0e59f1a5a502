"""A 100M+ model compiled against itself eager: does a clean ``torch.compile`` read AGREE?

GPT-2 small (124M parameters, random weights from ``transformers``' config, dropout off) runs one
training step (forward and backward) eagerly as the bench, and compiled as the target, once per
capture mode. Each target is compared with the bench; a clean compiler must give no root. The
model is compiled inside a session that records no step, so capture knows its regions.

    python benchmarks/check_compile_large.py                        # inductor, both modes
    python benchmarks/check_compile_large.py --backend aot_eager --length 64
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--modes", nargs="*", default=["boundary", "graph"], choices=["boundary", "graph"])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=32)
    args = parser.parse_args()

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    sys.path.insert(0, str(ROOT))
    import tracecmp

    print(f"load: {os.getloadavg()[0]:.2f} (1 min), torch {torch.__version__}", flush=True)
    torch.manual_seed(0)
    config = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.length), generator=g)
    tmp = Path(tempfile.mkdtemp(prefix="check-compile-"))

    def step(fn: object) -> None:
        fn(input_ids=ids, labels=ids).loss.backward()  # type: ignore[operator]
        model.zero_grad(set_to_none=True)

    start = time.perf_counter()
    with tracecmp.TraceCompare(tmp / "bench", model=model) as tc:
        step(model)
        tc.step()
    bench = tracecmp.load(tmp / "bench")
    print(
        f"GPT-2 small, {params / 1e6:.0f}M parameters, batch {args.batch}x{args.length}; "
        f"eager bench traced in {time.perf_counter() - start:.1f} s, {len(bench.rank(0).ops):,} ops",
        flush=True,
    )

    compiled = torch.compile(model, backend=args.backend)
    start = time.perf_counter()
    with tracecmp.TraceCompare(tmp / "warm", model=model, steps=[]):
        step(compiled)
    print(f"compiled with {args.backend} in {time.perf_counter() - start:.1f} s", flush=True)
    for mode in args.modes:
        start = time.perf_counter()
        with tracecmp.TraceCompare(tmp / mode, model=model, compiled=mode) as tc:
            step(compiled)
            tc.step()
        target = tracecmp.load(tmp / mode)
        rank = target.rank(0)
        traced = time.perf_counter() - start
        start = time.perf_counter()
        result = tracecmp.compare(target, bench)
        statuses = result.nodes["status"].value_counts().to_dict()
        first = result.first_divergence
        # The result's own verdict: no root is not "agree" when some of it could not be compared.
        verdict = result.verdict() if first is None else f"DIVERGED at {first.op} in {first.module}: {first.reason}"
        print(
            f"{mode:<9} regions {len(rank.compiled.graphs)} graphs / {len(rank.compiled.calls)} calls, "
            f"{len(rank.ops):,} ops; traced {traced:.1f} s, compared {time.perf_counter() - start:.1f} s: "
            f"{verdict}; node states {statuses}",
            flush=True,
        )
        for warning in result.warnings:
            print(f"  warning: {warning}")


if __name__ == "__main__":
    main()
