"""A session lets go of the program's process groups when it ends."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import tracecmp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not dist.is_available(), reason="torch without distributed")
def test_the_session_holds_no_process_group_after_it_ends(tmp_path: Path) -> None:
    # Held past the session (the capture mode sits in a reference cycle until a collection), a
    # group the program destroys lived on to the interpreter's exit, where gloo's threads aborted
    # the process ("terminate called without an active exception").
    store = dist.TCPStore("127.0.0.1", _free_port(), 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        pg = dist.group.WORLD
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
        before = sys.getrefcount(pg)
        with tracecmp.TraceCompare(tmp_path / "trace", model=model):
            model(torch.randn(2, 4)).sum().backward()
            dist.all_reduce(torch.ones(3))
        assert sys.getrefcount(pg) == before  # no collection run: what the session held is gone
        frame = tracecmp.load(tmp_path / "trace").to_frame()
        assert frame["op"].str.contains("allreduce").any()
    finally:
        dist.destroy_process_group()
