"""A compiled model on a GPU under capture: transparent, its fused code measured, a fault named.

TinyGPT (2 layers d64) on CUDA, compiled with inductor (Triton kernels), trained three AdamW steps
eagerly (the bench) and compiled: clean traced, clean untraced, and with a layer norm's epsilon
changed, traced. Checks, each printed as a line with its result:

* transparency: the clean compiled run traced gives the losses and parameters of the same run
  untraced, bit for bit (deterministic algorithms on: inductor's atomic scatter-adds make even two
  untraced runs differ otherwise);
* the shadow run of fused code: each forward region call records its nodes' statistics (measured
  on the device, read back once per call);
* the clean compiled target against the eager bench reads AGREE; the faulty one is named at its
  layer norm, against the eager bench and against the clean compiled run.

    python benchmarks/check_compile_cuda.py            # needs a CUDA device and Triton
    python benchmarks/check_compile_cuda.py cpu        # the same on the CPU, a dry run
"""

from __future__ import annotations

import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def train(path: Path | None, compiled: bool, fault: bool, device: str) -> dict[str, Any]:
    import torch

    import tracecmp
    from workloads.compile_models import TinyGPT, tiny_batch

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyGPT(layers=2, dim=64, heads=4).to(device)
    if fault:
        model.blocks[1].ln1.eps = 1e-2
    run = torch.compile(model, backend="inductor") if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = [tuple(t.to(device) for t in tiny_batch(seed=s, batch=4, length=32)) for s in range(3)]
    session = tracecmp.TraceCompare(path, model=model) if path is not None else None
    if session is not None:
        session.__enter__()
    losses = []
    try:
        for idx, targets in batches:
            loss = run(idx, targets)
            loss.backward()
            losses.append(loss.detach().clone())
            opt.step()
            opt.zero_grad()
            if session is not None:
                session.step()
    finally:
        if session is not None:
            session.__exit__(None, None, None)
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def bitwise(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return all(torch.equal(x, y) for x, y in zip(a["losses"], b["losses"])) and all(
        torch.equal(a["params"][n], b["params"][n]) for n in a["params"]
    )


def main() -> int:
    import torch

    import tracecmp

    warnings.simplefilter("ignore")
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"  # "cpu": the same checks, as a dry run
    # Inductor's scatter-adds (the embedding's gradient) are atomic across threads: without this two
    # runs, traced or not, may differ in the last bits, and transparency could not be told apart.
    torch.use_deterministic_algorithms(True)
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    work = Path(tempfile.mkdtemp(prefix="compile-cuda-"))
    started = time.perf_counter()
    train(work / "bench", compiled=False, fault=False, device=device)
    clean = train(work / "clean", compiled=True, fault=False, device=device)
    untraced = train(None, compiled=True, fault=False, device=device)
    train(work / "fault", compiled=True, fault=True, device=device)
    checks = {"transparent (traced == untraced, bitwise)": bitwise(clean, untraced)}
    calls = [c for c in tracecmp.load(work / "clean").rank(0).compiled.calls if c.part == "forward"]
    checks["every forward call measured by its shadow run"] = bool(calls) and all(len(c.values) > 20 for c in calls)
    agree = tracecmp.compare(work / "clean", work / "bench")
    checks["clean compiled vs eager: AGREE"] = agree.status == "agree"
    for bench in ("bench", "clean"):
        result = tracecmp.compare(work / "fault", work / bench)
        first = result.first_divergence
        if first is None or first.module != "blocks.1.ln1":
            print(f"     {first.op if first else ''}: {first.reason[:400] if first else result.verdict()}")
            print("     " + " | ".join(n[:300] for n in result.notes))
        named = first.module if first is not None else "no root"
        checks[f"ln-eps vs {bench}: named at blocks.1.ln1 ({named})"] = named == "blocks.1.ln1"
    for what, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {what}")
    name = torch.cuda.get_device_name() if device == "cuda" else device
    print(f"torch {torch.__version__}, {name}, {time.perf_counter() - started:.0f} s")
    if not agree.status == "agree":
        print(agree.summary())
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
