"""A 2-rank DDP job on the emulated npu, captured, for emulated_npu_cases.py.

``torchrun --nproc_per_node 2 -m tests.integration.npu_dist_program OUT`` trains a small MLP on
``npu`` for two steps per variant over gloo (``workloads.emulated_npu.serve_collectives``: gloo's
collectives on host copies) and captures ``OUT/bench``, ``OUT/clean`` and ``OUT/forward`` (rank 1
alone computes GELU with its tanh approximation). Each rank writes ``OUT/facts-<rank>.json``:
whether capture left the bench's parameters as an untraced run leaves them.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tracecmp
from workloads import emulated_npu

STEPS = 2


class MLP(torch.nn.Module):
    def __init__(self, approximate: str) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 4)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x), approximate=self.approximate))


def train(rank: int, approximate: str = "none", trace_to: Path | None = None) -> list[torch.Tensor]:
    """Two SGD steps of DDP on the npu (captured into ``trace_to`` when given); the parameters."""
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(MLP(approximate).to("npu"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = tracecmp.TraceCompare(trace_to, model=model) if trace_to is not None else contextlib.nullcontext()
    with session as tc:
        for step in range(STEPS):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank)).to("npu")
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            if tc is not None:
                tc.step()
    return [p.detach().cpu() for p in model.parameters()]


def main() -> None:
    out = Path(sys.argv[1])
    emulated_npu.load()
    dist.init_process_group("gloo")
    emulated_npu.serve_collectives()
    rank = dist.get_rank()
    torch.set_num_threads(1)
    plain = train(rank)
    facts = {}
    for variant in ("bench", "clean", "forward"):
        params = train(rank, "tanh" if variant == "forward" and rank == 1 else "none", out / variant)
        if variant == "bench":
            facts["transparent"] = all(torch.equal(p, q) for p, q in zip(params, plain))
    dist.barrier()
    (out / f"facts-{rank}.json").write_text(json.dumps(facts))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
