"""Compare as a torchrun job: ``torchrun --nproc-per-node N -m tracecmp compare TARGET BENCH -o OUT``.

Each process of the job compares its share of the trace's ranks where they lie: the processes
first tell each other which rank folders they can read (shared storage: all of them; a node's
local disk: its own ranks), each rank goes to one process that can read it, and each process
compares its ranks one after another (:func:`tracecmp.comparison.ranks.compare_rank`). The
ranks' outcomes meet on process 0 through ``torch.distributed`` (a gloo group: the comparison
runs on CPUs whatever the job trained on), which orders the roots across ranks
(:func:`tracecmp.comparison.ranks.job_result`) and alone writes the report. On one machine
without torchrun, :func:`tracecmp.compare`'s process pool does the same.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterable

from tracecmp.comparison.ranks import JobFolders, RankOutcome, compare_rank, job_result, rank_folders, rank_sets
from tracecmp.comparison.result import CompareResult
from tracecmp.errors import CompareError, TracecmpError
from tracecmp.trace.reader import read_manifest
from tracecmp.trace.schema import RUN_MANIFEST

_TIMEOUT = timedelta(hours=2)  # the slowest process's ranks, compared while the others wait


def launched_by_torchrun() -> bool:
    """Whether this process is one of a torchrun job's several (its environment says so)."""
    env = os.environ
    return "MASTER_ADDR" in env and "RANK" in env and int(env.get("WORLD_SIZE", "1") or 1) > 1


class JobGroup:
    """This process's place among the job's processes, and the gloo group they compare over: the
    job's own when it is gloo's, else one made beside it. Closes what it opened."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._owned = not dist.is_initialized()
        if self._owned:
            dist.init_process_group("gloo", timeout=_TIMEOUT)
        self.group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo", timeout=_TIMEOUT)
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()

    def all_gather(self, value: Any) -> list[Any]:
        """Every process's ``value``, in process order."""
        found: list[Any] = [None] * self.size
        self._dist.all_gather_object(found, value, group=self.group)
        return found

    def gather(self, value: Any) -> list[Any] | None:
        """Every process's ``value`` on process 0 (None elsewhere)."""
        found: list[Any] | None = [None] * self.size if self.rank == 0 else None
        self._dist.gather_object(value, found, dst=0, group=self.group)
        return found

    def share(self, value: Any) -> Any:
        """Process 0's ``value``, on every process."""
        box = [value]
        self._dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def close(self) -> None:
        if self._owned and self._dist.is_initialized():
            self._dist.destroy_process_group()

    def __enter__(self) -> JobGroup:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@dataclass(frozen=True)
class _Seen:
    """The rank folders of both traces one process can read."""

    target: list[int]
    bench: list[int]


@dataclass
class _Share:
    """What one process hands process 0: its ranks' outcomes, why others failed, or its crash."""

    outcomes: dict[int, RankOutcome] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    crash: str = ""


def assign_ranks(readable: list[set[int]], ranks: Iterable[int]) -> dict[int, int]:
    """rank -> the process that compares it: one that can read it, the least loaded first.

    >>> assign_ranks([{0, 1, 2, 3}, {0, 1, 2, 3}], [0, 1, 2, 3])
    {0: 0, 1: 1, 2: 0, 3: 1}
    >>> assign_ranks([{0, 1}, {2, 3}], [0, 1, 2, 3])
    {0: 0, 1: 0, 2: 1, 3: 1}
    """
    load = [0] * len(readable)
    owner = {}
    for rank in sorted(ranks):
        able = [p for p, seen in enumerate(readable) if rank in seen]
        if able:
            chosen = min(able, key=lambda p: (load[p], p))
            owner[rank] = chosen
            load[chosen] += 1
    return owner


def compare_in_job(
    target: str | Path, bench: str | Path, group: JobGroup, *, ranks: Iterable[int] | None = None, **options: Any
) -> CompareResult | None:
    """This process's share of a multi-rank comparison under torchrun; the job's result on
    process 0, None on the others. ``options`` are :func:`tracecmp.compare`'s (``tolerances``,
    ``steps``, ``exact``, ``replay``)."""
    t_path, b_path = Path(target), Path(bench)
    if options.get("steps") is not None:
        options["steps"] = sorted(int(s) for s in options["steps"])
    seen = group.all_gather(_Seen(rank_folders(t_path), rank_folders(b_path)))
    t_ranks = sorted({r for s in seen for r in s.target})
    b_ranks = sorted({r for s in seen for r in s.bench})
    # Every process decides from what all of them read: they fail alike, and none waits for another.
    if not t_ranks or not b_ranks:
        raise CompareError("trace holds no rank folders (rank0/ ...)", path=t_path if not t_ranks else b_path)
    warnings: list[str] = []
    common = rank_sets(t_ranks, b_ranks, ranks, warnings, t_path)  # the same on every process
    owner = assign_ranks([set(s.target) & set(s.bench) for s in seen], common)
    share = _compare_share(t_path, b_path, [r for r in common if owner.get(r) == group.rank], options)
    shares = group.gather(share)
    if shares is None:
        return None
    crashed = [s.crash for s in shares if s.crash]
    if crashed:
        raise RuntimeError("a process of the job failed comparing its ranks:\n" + crashed[0])
    outcomes = {r: o for s in shares for r, o in s.outcomes.items()}
    failures = [f for s in shares for f in s.failures]
    failures += [f"rank {r} could not be compared: no process of the job can read it" for r in common if r not in owner]
    folders = JobFolders(
        t_path,
        b_path,
        read_manifest(t_path / RUN_MANIFEST),
        read_manifest(b_path / RUN_MANIFEST),
        common,
        t_ranks,
        b_ranks,
    )
    return job_result(folders, dict(sorted(outcomes.items())), failures, warnings, options)


def _compare_share(t_path: Path, b_path: Path, mine: list[int], options: dict[str, Any]) -> _Share:
    """This process's ranks compared one after another; a rank that cannot be compared is a
    failure the verdict reports, and a crash is handed to process 0, which raises it (a process
    that raised here would leave the others waiting for it)."""
    share = _Share()
    for rank in mine:
        try:
            share.outcomes[rank] = compare_rank(t_path, b_path, rank, options)
        except TracecmpError as exc:
            share.failures.append(f"rank {rank} could not be compared: {exc}")
        except Exception:  # noqa: BLE001 - handed to process 0, raised there
            share.crash = f"rank {rank}:\n{traceback.format_exc()}"
            break
    return share
