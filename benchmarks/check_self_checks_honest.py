"""Honest runs must pass their self-checks: the five test families (``workloads.models``) in
float32, bf16 and bf16 autocast, self-checks sampled and full, two Adam steps each; prints each
run's checked outputs and any that failed, and exits 1 if one did.

    python benchmarks/check_self_checks_honest.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tracecmp  # noqa: E402
from tracecmp.graph.checks import own_checks  # noqa: E402
from workloads.models import MODELS, example_batch, loss_of, make_model, make_optimizer  # noqa: E402


def _run(name: str, precision: str, mode: str, path: Path) -> tuple[int, list[str]]:
    """(checked outputs, the failed ops) of one captured run."""
    torch.manual_seed(0)
    model, batch = make_model(name), example_batch(name)
    if precision == "bf16":
        model = model.to(torch.bfloat16)
        batch = tuple(b.to(torch.bfloat16) if b.is_floating_point() else b for b in batch)
    opt = make_optimizer(model, "adam")
    with tracecmp.TraceCompare(path, model=model, self_check=mode, overwrite=True) as tc:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast"):
                loss = loss_of(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            tc.step()
    rank = tracecmp.load(path).rank(0)
    names = dict(zip(rank.ops["op_id"].tolist(), rank.ops["op"].tolist()))
    checks = rank.checks
    assert checks is not None
    failed = [f"{names[o]} {c.residual:.3g} > {c.limit:.3g}" for o, c in own_checks(checks, names).items() if c.failed]
    return len(checks), failed


def main() -> int:
    total, bad = 0, 0
    path = Path(tempfile.mkdtemp(prefix="tracecmp-honest-")) / "run"
    for name in MODELS:
        for precision in ("fp32", "bf16", "autocast"):
            for mode in ("sample", "full"):
                checked, failed = _run(name, precision, mode, path)
                total, bad = total + checked, bad + len(failed)
                print(f"{name} {precision} {mode}: {checked} checked outputs, failed: {failed}", flush=True)
    print(f"{total:,} checked outputs, {bad} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
