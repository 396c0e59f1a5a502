"""Replay of whole ranks: every op in order, or spread over worker processes that each open
the trace themselves.

>>> own = replay_rank(tracecmp.load("runs/target").rank(0))   # doctest: +SKIP
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch

from tracecmp.aten.rounding import REDUCED_MODELS
from tracecmp.errors import TracecmpError, TraceFormatError
from tracecmp.numerics.replay.records import OwnError, Skipped
from tracecmp.numerics.replay.replayer import CACHE_BYTES, Replayer

_PROGRESS_EVERY = 1000


def replay_rank(
    rank: Any,
    op_ids: Iterable[int] | None = None,
    *,
    reduced: str | None = None,
    progress: Callable[[int], None] | None = None,
    workers: int = 1,
) -> dict[int, OwnError]:
    """Own errors of the ops ``op_ids`` (default: all) of a :class:`~tracecmp.trace.reader.RankTrace`.

    ``reduced`` as for :class:`Replayer`. Ops that could not be replayed are absent from the
    result (:func:`replay_ops` says why). Needs a trace with saved tensors; returns ``{}`` for a
    statistics-only trace.
    """
    found = replay_ops(rank, op_ids, reduced=reduced, progress=progress, workers=workers)
    return {op_id: own for op_id, own in found.items() if isinstance(own, OwnError)}


def replay_ops(
    rank: Any,
    op_ids: Iterable[int] | None = None,
    *,
    reduced: str | None = None,
    detail: Mapping[str, float] | None = None,
    progress: Callable[[int], None] | None = None,
    workers: int | None = 1,
    cache_bytes: int = CACHE_BYTES,
    small_on_one_thread: bool = False,
) -> dict[int, OwnError | Skipped]:
    """Replay the computing ops ``op_ids`` (default: all) of a rank: ``{op_id: OwnError | Skipped}``.

    ``workers``: processes to spread the ops over (each opens the trace itself and runs
    ``cores / workers`` torch threads); ``None`` picks by the trace's size (one process for small
    traces, where starting workers costs more than it saves). ``progress(n)`` is called as ops
    finish (n ops since the previous call).

    >>> found = replay_ops(tracecmp.load("runs/target").rank(0), detail=ELEMENT_ULPS)  # doctest: +SKIP
    """
    if reduced not in (None, *REDUCED_MODELS):
        raise ValueError(f"reduced must be None or one of {sorted(REDUCED_MODELS)}, not {reduced!r}")
    table = rank.ops_table.select(["op_id", "kind"]).to_pydict()
    computing = {o for o, k in zip(table["op_id"], table["kind"]) if k == "op"}
    wanted = sorted(computing) if op_ids is None else sorted(o for o in set(op_ids) if o in computing)
    if not any(rank.tensors_table.column("data_key").to_pylist()) and not rank.data_files:
        return {}
    if workers is None:
        workers = auto_workers(len(wanted))
    if workers > 1 and len(wanted) > 1 and rank.manifest.get("chunks"):
        options = {
            "reduced": reduced,
            "detail": None if detail is None else dict(detail),
            "cache_bytes": cache_bytes,
            "small_on_one_thread": small_on_one_thread,
        }
        return run_in_workers(
            rank,
            wanted,
            "tracecmp.numerics.replay.replayer:Replayer.replay",
            options,
            workers=workers,
            progress=progress,
        )
    results: dict[int, OwnError | Skipped] = {}
    with Replayer(
        rank, reduced=reduced, detail=detail, cache_bytes=cache_bytes, small_on_one_thread=small_on_one_thread
    ) as replayer:
        if not replayer.has_data:
            return {}
        done = 0
        for op_id in wanted:
            results[op_id] = replayer.replay(op_id)
            done += 1
            if progress is not None and done % _PROGRESS_EVERY == 0:
                progress(_PROGRESS_EVERY)
        if progress is not None and done % _PROGRESS_EVERY:
            progress(done % _PROGRESS_EVERY)
    return results


_WORKER_MIN_OPS = 4000  # below this many ops, starting worker processes costs more than it saves


def auto_workers(ops: int) -> int:
    """Worker processes :func:`replay_ops` uses for ``ops`` ops when asked to choose: one per
    core (at most 8) for large traces, one otherwise; ``TRACECMP_REPLAY_WORKERS`` overrides."""
    forced = os.environ.get("TRACECMP_REPLAY_WORKERS", "")
    if forced.isdigit() and int(forced) > 0:
        return int(forced)
    if ops < _WORKER_MIN_OPS:
        return 1
    return max(1, min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1, 8))


def _rank_files(rank: Any) -> dict[str, Any]:
    """What a worker needs to open the rank itself: its folder, table files and data files."""
    folder = Path(rank.path)
    chunks = rank.manifest.get("chunks") or []
    ops = [str(folder / c["ops"]["file"]) for c in chunks if isinstance(c.get("ops"), dict)]
    tensors = [str(folder / c["tensors"]["file"]) for c in chunks if isinstance(c.get("tensors"), dict)]
    return {
        "path": str(folder),
        "rank": int(rank.rank),
        "ops": ops,
        "tensors": tensors,
        "data": {int(k): str(v) for k, v in rank.data_files.items()},
    }


class _WorkerRank:
    """A rank opened by a worker from files its parent already validated (no second CRC pass)."""

    def __init__(self, files: Mapping[str, Any]) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        from tracecmp.trace.schema import OPS_SCHEMA, TENSORS_SCHEMA

        self.path = Path(files["path"])
        self.rank = files["rank"]
        self.manifest: dict[str, Any] = {}
        self.data_files = {int(k): Path(v) for k, v in files["data"].items()}
        ops_columns = [c for c in OPS_SCHEMA.names if c not in ("stack", "location", "name")]
        ops_schema = pa.schema([OPS_SCHEMA.field(c) for c in ops_columns])
        self.ops_table = pa.concat_tables(
            [pq.read_table(p, columns=ops_columns).cast(ops_schema) for p in files["ops"]]
        )
        self.tensors_table = pa.concat_tables(
            [pq.read_table(p).select(TENSORS_SCHEMA.names).cast(TENSORS_SCHEMA) for p in files["tensors"]]
        )


_WORKER: dict[str, Any] = {}


def _worker_init(threads: int) -> None:
    torch.set_num_threads(max(1, threads))


def _worker_run(files: Mapping[str, Any], job: str, options: Mapping[str, Any], op_ids: list[int]) -> list[Any] | str:
    """One range of ops in a worker process: ``job`` ("module:Class.method") built once per worker
    on the rank with ``options``; a ``TracecmpError``'s message instead on bad input."""
    from importlib import import_module

    try:
        key = (files["path"], job, repr(sorted(options.items())))
        if _WORKER.get("key") != key:
            old = _WORKER.pop("worker", None)
            if old is not None and hasattr(old, "close"):
                old.close()
            module, _, name = job.partition(":")
            factory, _, method = name.partition(".")
            worker = getattr(import_module(module), factory)(_WorkerRank(files), **options)
            _WORKER.update(key=key, worker=worker, method=method)
        call = getattr(_WORKER["worker"], _WORKER["method"])
        return [call(op_id) for op_id in op_ids]
    except TracecmpError as exc:
        return str(exc)


def run_in_workers(
    rank: Any,
    op_ids: list[int],
    job: str,
    options: Mapping[str, Any],
    *,
    workers: int,
    progress: Callable[[int], None] | None = None,
) -> dict[int, Any]:
    """``{op_id: job(op_id)}`` computed by ``workers`` processes, each opening the rank itself.

    ``job`` names a class and method, ``"module:Class.method"``, built once per worker as
    ``Class(rank, **options)`` (:class:`Replayer` and ``replay``, say). The ops go out as
    contiguous ranges (neighbours share inputs, so each worker's cache keeps working), several
    per worker to balance the load; each worker runs ``torch.get_num_threads() // workers``
    threads. Processes are spawned, not forked: forking after torch started its thread pools can hang.
    """
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    files = _rank_files(rank)
    ranges = max(workers * 8, 1)
    size = max(1, math.ceil(len(op_ids) / ranges))
    parts = [op_ids[i : i + size] for i in range(0, len(op_ids), size)]
    threads = max(1, torch.get_num_threads() // workers)
    results: dict[int, Any] = {}
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        max_workers=workers, mp_context=context, initializer=_worker_init, initargs=(threads,)
    ) as pool:
        pending = {pool.submit(_worker_run, files, job, dict(options), part): part for part in parts}
        try:
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    part = pending.pop(future)
                    found = future.result()
                    if isinstance(found, str):
                        raise TraceFormatError(found)
                    results.update(zip(part, found))
                    if progress is not None:
                        progress(len(part))
        except BaseException:
            for future in pending:
                future.cancel()
            raise
    return results
