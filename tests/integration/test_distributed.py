"""Many ranks under torchrun (2 processes, gloo, CPU): DDP, FSDP2 and a tensor-parallel MLP.

One ``torchrun`` launch captures every run the tests compare (``dist_program.py``): per setup a
bench, a clean target, and targets with a fault on rank 1 alone, in forward and in backward
before the gradients are reduced. A second launch kills rank 1 with SIGKILL mid-step.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import tracecmp
from tests.conftest import ROOT
from tracecmp.overflow import find_overflows
from tracecmp.trace.links import collectives

SETUPS = ("ddp", "fsdp2", "tp")
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="torchrun with gloo is tested on Linux")


def _has(module: str, name: str) -> bool:
    try:
        return hasattr(importlib.import_module(module), name)
    except ImportError:
        return False


# What each setup needs of torch (FSDP2 and public DTensor came with torch 2.4-2.6).
MISSING = {
    "ddp": "",
    "fsdp2": ""
    if _has("torch.distributed.fsdp", "fully_shard")
    else "this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)",
    "tp": ""
    if _has("torch.distributed.tensor", "distribute_tensor")
    and _has("torch.distributed.device_mesh", "init_device_mesh")
    else "this torch has no public DTensor (torch.distributed.tensor, device_mesh)",
}
AVAILABLE = tuple(setup for setup in SETUPS if not MISSING[setup])


def _available(setup: str) -> None:
    if MISSING[setup]:
        pytest.skip(MISSING[setup])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _torchrun(out: Path, *setups: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(_free_port()),
            "-m",
            "tests.integration.dist_program",
            str(out),
            *setups,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    done = _torchrun(out, *AVAILABLE)
    assert done.returncode == 0, done.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("killed")
    done = _torchrun(out, "killed")
    assert done.returncode != 0, "rank 1 was to be killed"
    assert "SIGKILL" in done.stderr or "Signal 9" in done.stderr, done.stderr[-3000:]
    return out / "killed" / "target"


@pytest.mark.parametrize("setup", SETUPS)
def test_a_clean_distributed_target_agrees_with_a_clean_bench(runs: Path, setup: str) -> None:
    _available(setup)
    result = tracecmp.compare(runs / setup / "clean", runs / setup / "bench")
    assert result.first_divergence is None and result.agrees, result.summary()
    assert [line.status for line in result.job.ranks] == ["agrees", "agrees"]


@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("fault,op", [("forward", "aten.gelu.default"), ("backward", "aten.mul.Tensor")])
def test_a_fault_on_rank_1_is_named_there_and_rank_0_inherits_it_through_a_collective(
    runs: Path, setup: str, fault: str, op: str
) -> None:
    _available(setup)
    result = tracecmp.compare(runs / setup / fault, runs / setup / "bench")
    first = result.first_divergence
    assert first is not None and first.rank == 1 and first.op == op, result.summary()
    assert first.phase == fault and first.step == 0
    # One root: the copies around the collectives move data, and rank 0 inherits.
    assert [(d.rank, d.op) for d in result.suspects] == [(1, op)], result.summary()
    rank0, rank1 = result.job.ranks
    assert rank1.status == "root" and op in rank1.first
    assert rank0.status == "inherited" and "from rank 1 via" in rank0.source, result.job.summary()
    # Rank 0's divergence is not a root of its own: the collective carried it in.
    assert not [d for d in result.suspects if d.rank == 0 and d.op.startswith(("c10d.", "_c10d_functional."))]
    path = result.job.paths[0]
    assert path[0].rank == 1 and path[-2].role == "sent" and path[-2].rank == 1
    assert path[-1].role == "received" and path[-1].rank == 0 and path[-1].op == path[-2].op


def test_capture_changes_nothing_the_ranks_compute(runs: Path) -> None:
    for rank in (0, 1):
        facts = json.loads((runs / f"facts-{rank}.json").read_text())
        assert {setup: facts[setup]["transparent"] for setup in AVAILABLE} == dict.fromkeys(AVAILABLE, True)


def test_the_recorded_all_reduce_statistics_are_the_reduced_gradients(runs: Path) -> None:
    trace = tracecmp.load(runs / "ddp" / "bench")
    for rank in trace.ranks:
        facts = json.loads((runs / f"facts-{rank}.json").read_text())["ddp"]
        tensors = trace.rank(rank).tensors.set_index("tensor_id")
        buckets = [c for c in collectives(trace.rank(rank).ops, rank) if c.step == 0 and c.bucket is not None]
        assert [c.bucket for c in buckets] == list(range(len(facts["buckets"])))
        for call, expected in zip(buckets, facts["buckets"]):
            row = tensors.loc[call.received[0]]
            assert row["has_stats"]
            recorded = [row[c] for c in ("min", "max", "mean", "norm", "nan_count", "inf_count", "checksum")]
            assert recorded[4:] == expected[4:] and recorded[:2] == expected[:2]
            assert all(math.isclose(a, b, rel_tol=1e-12) for a, b in zip(recorded[2:4], expected[2:4]))
            sent = tensors.loc[call.sent[0]]
            assert sent["checksum"] != row["checksum"], "what a rank sent differs from the sum it received"
    buckets = trace.rank(0).manifest["info"]["ddp_buckets"]
    assert sorted(name for bucket in buckets for name in bucket) == sorted(
        f"module.{n}" for n in ("up.weight", "up.bias", "down.weight", "down.bias")
    )


def test_ddp_copies_its_buckets_out_in_backward_under_each_gradients_module(runs: Path) -> None:
    # The copy-out runs in the autograd engine's final callback, where no node is running.
    ops = tracecmp.load(runs / "ddp" / "bench").rank(0).ops
    copies = ops[(ops["op"] == "aten.copy_.default") & (ops["step"] == 0)]
    assert len(copies) == 4 and set(copies["phase"]) == {"backward"}
    assert sorted(copies["module"]) == ["module.down", "module.down", "module.up", "module.up"]


def test_each_collective_names_its_group_reduction_and_match_key(runs: Path) -> None:
    for setup, kinds in (("ddp", {"all_reduce"}), ("fsdp2", {"all_gather", "reduce_scatter"}), ("tp", {"all_reduce"})):
        if setup not in AVAILABLE:
            continue
        trace = tracecmp.load(runs / setup / "bench")
        per_rank = [collectives(trace.rank(r).ops, r) for r in trace.ranks]
        assert kinds <= {c.kind for c in per_rank[0]} <= kinds | {"broadcast"}  # DDP broadcasts in forward
        assert all(c.root == 0 for calls in per_rank for c in calls if c.kind == "broadcast")
        assert [c.key for c in per_rank[0]] == [c.key for c in per_rank[1]]  # matched one to one
        assert all(c.ranks == (0, 1) and c.group for calls in per_rank for c in calls)
        assert all(
            c.reduce in ("sum", "avg")
            for calls in per_rank
            for c in calls
            if c.kind in ("all_reduce", "reduce_scatter")
        )
        for r in trace.ranks:
            assert "capture_skipped" not in trace.rank(r).manifest["info"] or not any(
                "collective" in reason for reason in trace.rank(r).manifest["info"]["capture_skipped"]
            )


def test_the_first_overflow_of_the_job_is_where_it_was_born(runs: Path) -> None:
    found = find_overflows(runs / "ddp" / "overflow")
    first = found[0]
    assert first.rank == 1 and first.op == "aten.mul.Tensor" and first.phase == "forward", found[:3]
    assert not [o for o in found if o.rank == 0 and o.op.startswith("c10d.")], "rank 0 only received it"


def test_ranks_are_compared_in_worker_processes_as_in_this_one(runs: Path) -> None:
    here = tracecmp.compare(runs / "ddp" / "forward", runs / "ddp" / "bench", workers=1)
    pooled = tracecmp.compare(runs / "ddp" / "forward", runs / "ddp" / "bench", workers=2, max_memory=6 << 30)
    assert (pooled.first_divergence.rank, pooled.first_divergence.op_id) == (
        here.first_divergence.rank,
        here.first_divergence.op_id,
    )
    assert pooled.job.to_frame().equals(here.job.to_frame())
    assert len(pooled.nodes) == len(here.nodes)


def test_a_killed_rank_leaves_the_others_readable_and_compare_names_it(killed: Path, runs: Path) -> None:
    trace = tracecmp.load(killed)
    assert trace.rank(0).complete and trace.rank(0).manifest["steps"] == [0, 1]
    assert not trace.rank(1).complete and trace.rank(1).manifest["steps"] == [0]
    result = tracecmp.compare(killed, runs / "ddp" / "bench")
    assert not result.agrees
    assert any(w.startswith("target rank 1 is incomplete") and "killed" in w for w in result.warnings), result.warnings
    lines = {line.rank: line for line in result.job.ranks}
    assert lines[0].complete and not lines[1].complete and lines[1].status == "incomplete"
    assert "INCOMPLETE" in result.verdict()


def test_a_world_size_that_differs_is_said_plainly(runs: Path, tmp_path: Path) -> None:
    import shutil

    single = tmp_path / "one-rank"
    shutil.copytree(runs / "ddp" / "bench", single)
    shutil.rmtree(single / "rank1")
    manifest = json.loads((single / "manifest.json").read_text())
    manifest["world_size"] = 1
    (single / "manifest.json").write_text(json.dumps(manifest))
    result = tracecmp.compare(runs / "ddp" / "clean", single)
    assert any("world sizes differ: target ran on 2 ranks, bench on 1" in w for w in result.warnings), result.warnings
    assert any("target ranks [1] have no bench rank" in w for w in result.warnings)
    assert not result.agrees


def _compare_under_torchrun(processes: int, target: Path, bench: Path, out: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
        + ["--master_addr", "127.0.0.1", "--master_port", str(_free_port())]
        + ["-m", "tracecmp", "compare", str(target), str(bench), "-o", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A simulated 4-rank DDP job (target and bench), a fault on rank 1: one rank per process."""
    from workloads.synthetic_job import JobShape, write_job

    return write_job(tmp_path_factory.mktemp("job4"), JobShape(world=4, layers=8, bucket_layers=4))


@pytest.mark.parametrize("processes", [2, 4])
def test_compare_as_a_torchrun_job_gives_the_pools_verdict_and_report(
    runs: Path, four_ranks: tuple[Path, Path], tmp_path: Path, processes: int, capsys: pytest.CaptureFixture[str]
) -> None:
    from tracecmp.cli.main import main

    # 2 processes: the captured 2-rank DDP run; 4: the simulated 4-rank job.
    target, bench = (runs / "ddp" / "forward", runs / "ddp" / "bench") if processes == 2 else four_ranks
    assert main(["compare", str(target), str(bench), "-o", str(tmp_path / "pool"), "--workers", "2"]) == 1
    pooled = capsys.readouterr().out
    done = _compare_under_torchrun(processes, target, bench, tmp_path / "job")
    # Process 0 exits 1 (diverged), the others as it decided, unless torchrun ended them first.
    assert done.returncode == 1 and "exitcode  : 1" in done.stderr, done.stderr[-3000:]
    assert "exitcode  : 2" not in done.stderr
    assert [line for line in done.stdout.splitlines() if not line.startswith("wrote")] == [
        line for line in pooled.splitlines() if not line.startswith("wrote")
    ]
    written = sorted(p.name for p in (tmp_path / "pool").iterdir())
    assert sorted(p.name for p in (tmp_path / "job").iterdir()) == written and "report.html" in written
    for name in written:
        pool, job = ((tmp_path / side / name).read_text().splitlines() for side in ("pool", "job"))
        assert [line for line in job if "<footer>" not in line] == [line for line in pool if "<footer>" not in line]


def test_a_torchrun_job_given_a_bad_trace_says_why_and_exits_2(runs: Path, tmp_path: Path) -> None:
    # Every process reads the same folders and fails alike, none waiting for another; torchrun may
    # end the others once the first has exited, before they print the same line.
    missing = tmp_path / "no-such-trace"
    done = _compare_under_torchrun(2, missing, runs / "ddp" / "bench", tmp_path / "job")
    assert done.returncode != 0
    said = done.stderr.count(f"tracecmp compare: error: {missing}: trace holds no rank folders")
    assert said >= 1, done.stderr[-3000:]
    assert "exitcode  : 2" in done.stderr and "exitcode  : 1" not in done.stderr
    assert not (tmp_path / "job").exists()
