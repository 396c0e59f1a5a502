"""Distributed training runs captured under torchrun, for test_distributed.py and the benchmarks.

``torchrun --nproc_per_node 2 -m tests.integration.dist_program OUT SETUP [SETUP ...]`` trains a
small MLP for two steps per setup (``ddp``, ``fsdp2``, ``tp``: tensor parallel through
``parallelize_module``) over gloo and captures each variant into ``OUT/<setup>/<variant>``:
``bench`` and ``clean`` (two clean runs), ``forward`` (rank 1 alone computes GELU with its tanh
approximation), ``backward`` (rank 1 alone scales one gradient in backward, before the
gradients are reduced) and, for DDP, ``overflow`` (rank 1 alone overflows to Inf in forward). Each rank writes ``OUT/facts-<rank>.json``: per setup, the DDP bucket
all-reduce's recorded statistics next to those of the gradients it produced.

``... -m tests.integration.dist_program OUT killed`` runs DDP with rank 1 killed by SIGKILL in
the optimizer step of step 1, once rank 0 has closed its trace.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes

import tracecmp
from tracecmp.capture.stats import reference_stats

STEPS = 2


class MLP(torch.nn.Module):
    def __init__(self, fault: str, rank: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 4)
        self.approximate = "tanh" if fault == "forward" and rank == 1 else "none"
        self.scale_grad = fault == "backward" and rank == 1
        self.blow_up = fault == "overflow" and rank == 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if self.blow_up:
            h = h * 1e30 * 1e30  # finite, then Inf on rank 1: NaN reaches rank 0 through the all-reduce
        if self.scale_grad and h.requires_grad:
            h.register_hook(lambda g: g * 1.001)  # rank 1's backward, before the gradients are reduced
        return self.down(F.gelu(h, approximate=self.approximate))


def build(setup: str, fault: str, rank: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = MLP(fault, rank)
    if setup == "ddp" or setup == "killed":
        return torch.nn.parallel.DistributedDataParallel(model)
    if setup == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.up)
        fully_shard(model.down)
        fully_shard(model)
        return model
    if setup == "tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        return model
    raise SystemExit(f"unknown setup {setup!r}")


def batch(setup: str, rank: int, step: int) -> torch.Tensor:
    # Data parallel ranks see their own data; tensor parallel ranks all see the same batch.
    generator = torch.Generator().manual_seed(100 * step + (0 if setup == "tp" else rank + 1))
    return torch.randn(4, 8, generator=generator)


def _stats(t: torch.Tensor) -> list[float]:
    return list(reference_stats(t.detach()))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def plain(setup: str, rank: int) -> list[torch.Tensor]:
    """The same training without capture: its parameters, to hold the captured run's to."""
    model = build(setup, "", rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        model(batch(setup, rank, step)).sum().backward()
        opt.step()
        opt.zero_grad()
    return [_local(p).detach().clone() for p in model.parameters()]


def run(out: Path, setup: str, variant: str, rank: int, facts: dict[str, Any]) -> None:
    fault = variant if variant in ("forward", "backward", "overflow") else ""
    model = build(setup, fault, rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracecmp.TraceCompare(out / setup / variant, model=model) as tc:
        for step in range(STEPS):
            model(batch(setup, rank, step)).sum().backward()
            if setup == "ddp" and variant == "bench" and step == 0:
                # What each bucket's all-reduce must have received: its parameters' reduced
                # gradients, flattened in bucket order (read with capture's mode out of the way).
                with _disable_current_modes():
                    buckets = model.reducer._get_zeros_like_grad_buckets()
                    facts["buckets"] = [
                        _stats(torch.cat([p.grad.reshape(-1) for p in b.parameters()])) for b in buckets
                    ]
            opt.step()
            opt.zero_grad()
            tc.step()
    if variant == "bench":  # capture changed nothing the program computed
        reference = plain(setup, rank)
        facts["transparent"] = all(torch.equal(_local(p).detach(), q) for p, q in zip(model.parameters(), reference))


def killed(out: Path, rank: int) -> None:
    model = build("ddp", "", rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    done = out / "rank0-closed"
    with tracecmp.TraceCompare(out / "killed" / "target", model=model) as tc:
        for step in range(STEPS):
            model(batch("ddp", rank, step)).sum().backward()
            if rank == 1 and step == STEPS - 1:
                deadline = time.monotonic() + 60
                while not done.exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
                os.kill(os.getpid(), signal.SIGKILL)  # mid-step: after backward, before the optimizer
            opt.step()
            opt.zero_grad()
            tc.step()
            tc.sync()  # every finished step on disk, so what the kill loses is the step in progress
    done.touch()


def main() -> None:
    out = Path(sys.argv[1])
    setups = sys.argv[2:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    if setups == ["killed"]:
        killed(out, rank)
        return  # rank 1 is gone: no collective may follow
    facts: dict[str, Any] = {}
    for setup in setups:
        for variant in ("bench", "clean", "forward", "backward") + (("overflow",) if setup == "ddp" else ()):
            run(out, setup, variant, rank, facts.setdefault(setup, {}))
    dist.barrier()
    (out / f"facts-{rank}.json").write_text(json.dumps(facts))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
