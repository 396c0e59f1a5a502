"""The cross-rank pass on hand-built per-rank outcomes: order through collectives, inheritance, paths."""

from __future__ import annotations

import math

import pandas as pd

from tracecmp.comparison.ranks import CallFacts, RankOutcome, cross_rank
from tracecmp.trace.links import Collective, Epochs, job_order
from tracecmp.verdict.records import Divergence

COLUMNS = [
    "rank",
    "op_id",
    "bench_op_id",
    "step",
    "phase",
    "kind",
    "op",
    "name",
    "module",
    "location",
    "status",
    "error",
    "introduced",
    "own_error",
    "honest_error",
    "metric",
    "root_kind",
    "reason",
]


def _nodes(rank: int, rows: list[tuple[int, str, str, str, float, str]]) -> pd.DataFrame:
    """rows: (op_id, op, phase, status, error, root_kind)."""
    return pd.DataFrame(
        [
            {
                "rank": rank,
                "op_id": op_id,
                "bench_op_id": op_id,
                "step": 0,
                "phase": phase,
                "kind": "op",
                "op": op,
                "name": "0#0" if op.startswith("c10d") else "",
                "module": "mlp",
                "location": "train.py:1",
                "status": status,
                "error": error,
                "introduced": 0.0,
                "own_error": math.nan,
                "honest_error": math.nan,
                "metric": "",
                "root_kind": root,
                "reason": "",
            }
            for op_id, op, phase, status, error, root in rows
        ],
        columns=COLUMNS,
    )


def _root(rank: int, op_id: int, op: str, phase: str) -> Divergence:
    return Divergence(
        op=op,
        module="mlp",
        phase=phase,
        step=0,
        location="train.py:1",
        op_id=op_id,
        rank=rank,
        kind="computation",
        reason="",
        score=10.0,
    )


def _outcome(rank: int, nodes: pd.DataFrame, roots: list[Divergence], calls: list[CallFacts]) -> RankOutcome:
    return RankOutcome(rank, nodes, pd.DataFrame(), pd.DataFrame(), roots, [], [0], calls, True, "", "")


def _call(rank: int, op_id: int, key: str = "0#0") -> Collective:
    return Collective(
        rank, op_id, key, "all_reduce", (0, 1), "0", "sum", op="c10d.allreduce_.default", phase="backward"
    )


def test_job_order_follows_every_rank_and_survives_a_rank_that_stopped() -> None:
    calls = {
        0: [_call(0, 1, "0#0"), _call(0, 5, "0#1"), _call(0, 9, "0#2")],
        1: [_call(1, 2, "0#0"), _call(1, 3, "0#1")],
    }
    order = job_order(calls)
    assert order == {"0#0": 0, "0#1": 1, "0#2": 2}
    epochs = Epochs(calls[1], order)
    assert (epochs.of(0), epochs.of(2), epochs.of(100)) == (-1, 0, 1)


def test_a_collective_that_received_another_ranks_divergence_is_inherited_not_a_root() -> None:
    # Rank 1: a root in forward (op 3) flows into what it sends (op 7) at all-reduce 0#0 (op 8).
    one = _outcome(
        1,
        _nodes(
            1,
            [
                (3, "aten.gelu.default", "forward", "diverged", 50.0, "computation"),
                (7, "aten.mm.default", "backward", "diverged", 40.0, ""),
                (8, "c10d.allreduce_.default", "backward", "diverged", 30.0, ""),
            ],
        ),
        [_root(1, 3, "aten.gelu.default", "forward")],
        [CallFacts(_call(1, 8), "", "diverged", 40.0, "diverged", 30.0, path=(3, 7))],
    )
    # Rank 0 sent what agrees, received what does not: per rank, the all-reduce looks like a root.
    zero = _outcome(
        0,
        _nodes(
            0,
            [
                (5, "aten.mm.default", "backward", "agrees", 0.0, ""),
                (6, "c10d.allreduce_.default", "backward", "diverged", 30.0, "computation"),
            ],
        ),
        [_root(0, 6, "c10d.allreduce_.default", "backward")],
        [CallFacts(_call(0, 6), "computation", "agrees", 0.0, "diverged", 30.0)],
    )
    report = cross_rank({0: zero, 1: one}, t_ranks=[0, 1], b_ranks=[0, 1])
    assert (report.origin.rank, report.origin.op) == (1, "aten.gelu.default")
    assert report.inherited[(0, 6)] == (1, "0#0", "received")
    lines = {line.rank: line for line in report.ranks}
    assert lines[0].status == "inherited" and "from rank 1" in lines[0].source
    assert lines[1].status == "root"
    path = report.paths[0]
    assert [(s.rank, s.op_id, s.role) for s in path] == [
        (1, 3, "root"),
        (1, 7, "via"),
        (1, 8, "sent"),
        (0, 6, "received"),
    ]
    assert "Path to rank 0" in report.summary()


def test_a_collective_that_only_sums_its_contributors_noise_is_not_a_root() -> None:
    one = _outcome(
        1,
        _nodes(1, [(8, "c10d.allreduce_.default", "backward", "noise", 1.0, "")]),
        [],
        [CallFacts(_call(1, 8), "", "noise", 1.5, "noise", 1.0)],
    )
    zero = _outcome(
        0,
        _nodes(0, [(6, "c10d.allreduce_.default", "backward", "diverged", 3.0, "computation")]),
        [_root(0, 6, "c10d.allreduce_.default", "backward")],
        [CallFacts(_call(0, 6), "computation", "noise", 1.2, "diverged", 3.0)],
    )
    report = cross_rank({0: zero, 1: one}, t_ranks=[0, 1], b_ranks=[0, 1])
    assert report.origin is None


def test_a_collective_whose_inputs_all_agree_but_whose_output_differs_stays_a_root() -> None:
    one = _outcome(
        1,
        _nodes(1, [(8, "c10d.allreduce_.default", "backward", "diverged", 900.0, "computation")]),
        [_root(1, 8, "c10d.allreduce_.default", "backward")],
        [CallFacts(_call(1, 8), "computation", "agrees", 0.0, "diverged", 900.0)],
    )
    zero = _outcome(
        0,
        _nodes(0, [(6, "c10d.allreduce_.default", "backward", "diverged", 900.0, "computation")]),
        [_root(0, 6, "c10d.allreduce_.default", "backward")],
        [CallFacts(_call(0, 6), "computation", "agrees", 0.0, "diverged", 900.0)],
    )
    report = cross_rank({0: zero, 1: one}, t_ranks=[0, 1], b_ranks=[0, 1])
    assert report.origin is not None and report.origin.op == "c10d.allreduce_.default"
    assert not report.inherited


def test_the_job_table_reads_the_roots_the_suspects_list() -> None:
    # Rank 0's all-reduce looks like a root per rank, yet it only summed rounding noise: the
    # suspects drop it, so its line must not read "own root" either.
    one = _outcome(
        1,
        _nodes(1, [(8, "c10d.allreduce_.default", "backward", "noise", 1.0, "")]),
        [],
        [CallFacts(_call(1, 8), "", "noise", 1.5, "noise", 1.0)],
    )
    zero = _outcome(
        0,
        _nodes(0, [(6, "c10d.allreduce_.default", "backward", "diverged", 3.0, "computation")]),
        [_root(0, 6, "c10d.allreduce_.default", "backward")],
        [CallFacts(_call(0, 6), "computation", "noise", 1.2, "diverged", 3.0)],
    )
    report = cross_rank({0: zero, 1: one}, t_ranks=[0, 1], b_ranks=[0, 1])
    assert report.roots == [] and report.inherited[(0, 6)].why == "noise"
    assert [line.status for line in report.ranks] == ["diverged", "agrees"]


def test_what_a_rank_sent_and_got_back_reduced_is_its_own_roots_not_a_new_one() -> None:
    # Rank 1's root (op 3) reaches what it sends; the reduce-scatter hands its shard back reduced,
    # diverged, and gloo's copy of it (op 9) is internal to the call: neither is a root.
    one = _outcome(
        1,
        _nodes(
            1,
            [
                (3, "aten.gelu.default", "forward", "diverged", 50.0, "argument"),
                (8, "c10d._reduce_scatter_base_.default", "backward", "diverged", 30.0, "computation"),
                (9, "source.tensor", "backward", "diverged", 30.0, "source"),
            ],
        ),
        [_root(1, 3, "aten.gelu.default", "forward"), _root(1, 9, "source.tensor", "backward")],
        [CallFacts(_call(1, 8), "computation", "diverged", 40.0, "diverged", 30.0, path=(3,), internal=(9,))],
    )
    zero = _outcome(
        0,
        _nodes(0, [(6, "c10d._reduce_scatter_base_.default", "backward", "diverged", 30.0, "computation")]),
        [_root(0, 6, "c10d._reduce_scatter_base_.default", "backward")],
        [CallFacts(_call(0, 6), "computation", "agrees", 0.0, "diverged", 30.0)],
    )
    report = cross_rank({0: zero, 1: one}, t_ranks=[0, 1], b_ranks=[0, 1])
    assert [(d.rank, d.op_id) for d in report.roots] == [(1, 3)]
    assert report.inherited[(1, 8)] == (1, "0#0", "own") and report.inherited[(1, 9)].why == "own"
    lines = {line.rank: line for line in report.ranks}
    assert (lines[0].status, lines[1].status) == ("inherited", "root")
    assert "aten.gelu.default" in lines[1].first


def test_a_torchrun_job_gives_each_rank_to_one_process_that_can_read_it() -> None:
    from tracecmp.comparison.torchrun import assign_ranks

    # Shared storage: round the processes; each node's own disk: its own ranks; a rank no process
    # reads is left out (the verdict names it).
    assert assign_ranks([{0, 1, 2, 3}] * 3, range(4)) == {0: 0, 1: 1, 2: 2, 3: 0}
    assert assign_ranks([{0, 1}, {0, 1}, {2, 3}, {2, 3}], range(5)) == {0: 0, 1: 1, 2: 2, 3: 3}
