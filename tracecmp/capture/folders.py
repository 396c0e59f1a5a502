"""Where a trace goes when no folder is given: a fresh, auto-named folder that never collides.

``TraceCompare()`` and ``tracecmp record`` without ``-o`` write to
``$TRACECMP_DIR/<program>-<YYYYmmdd-HHMMSS>`` (``TRACECMP_DIR`` defaults to ``tracecmp-traces`` in
the working directory), with ``-2``, ``-3`` ... appended when that name is taken: the folder is
made with an exclusive ``mkdir``, so two runs started in the same second still get two folders.

Every rank of a distributed run must write into the same folder. With a process group, rank 0
makes the folder and hands its name to the other ranks through the group's key-value store (no
collective on the group). Under ``torchrun`` before the group exists, the name comes from what
every worker of one launch shares: the rendezvous id, or else the launching agent's process id
and start time.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

ENV_DIR = "TRACECMP_DIR"
DEFAULT_DIR = "tracecmp-traces"
_STORE_WAIT = timedelta(minutes=10)  # other ranks wait this long for rank 0's folder name
_sessions = [0]  # default folders handed out in this process: the store key of the next one


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size: the process group's, else torchrun's environment
    (before, or without, a process group every worker must still write its own rank), else (0, 1).

    >>> rank_and_world()  # doctest: +SKIP
    (0, 1)
    """
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank, world = os.environ.get("RANK", ""), os.environ.get("WORLD_SIZE", "")
    if rank.isdigit() and world.isdigit() and int(rank) < int(world):
        return int(rank), int(world)
    return 0, 1


def default_root() -> Path:
    """The folder auto-named traces go into: ``$TRACECMP_DIR``, else ``./tracecmp-traces``."""
    return Path(os.environ.get(ENV_DIR) or DEFAULT_DIR)


def program_name() -> str:
    """A short name for the running program: its script's stem, a ``-m`` package's name, else ``python``.

    >>> program_name()  # doctest: +SKIP
    'train'
    """
    argv0 = sys.argv[0] if sys.argv else ""
    if not argv0 or argv0 in ("-c", "-"):
        return "python"
    path = Path(argv0)
    name = path.parent.name if path.stem == "__main__" else path.stem
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name).strip("._")
    return safe or "python"


def make_fresh(root: Path, name: str) -> Path:
    """Create ``root/name`` (or ``name-2``, ``name-3`` ... when taken) exclusively; return it."""
    root.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, 10_000):
        path = root / (name if attempt == 1 else f"{name}-{attempt}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"{root}: no free name for {name} after 10,000 tries")


def default_trace_dir(rank: int, world_size: int) -> Path:
    """A new folder for this run's trace, the same one on every rank (see the module docstring)."""
    root = default_root()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = f"{program_name()}-{stamp}"
    index = _sessions[0]
    _sessions[0] += 1
    if world_size <= 1:
        return make_fresh(root, name)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        store = dist.distributed_c10d._get_default_store()
        key = f"tracecmp/default_dir/{index}"
        if rank == 0:
            path = make_fresh(root, name)
            store.set(key, str(path.resolve()))
            return path
        store.wait([key], _STORE_WAIT)
        return Path(store.get(key).decode())
    path = root / f"{program_name()}-{_launch_id()}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _launch_id() -> str:
    """What every torchrun worker of one launch shares: the rendezvous id, else the agent's pid and start."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    suffix = f"-restart{restart}" if restart not in ("", "0") else ""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return f"{time.strftime('%Y%m%d')}-{run_id[:12]}{suffix}"
    ppid = os.getppid()
    try:
        # Field 22 of /proc/<pid>/stat: the agent's start, in clock ticks since boot.
        started = Path(f"/proc/{ppid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        started = "0"
    return f"{time.strftime('%Y%m%d')}-agent{ppid}-{started}{suffix}"
