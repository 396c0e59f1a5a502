"""Where replay's memory goes: each op's own peak resident memory while a tensors trace is replayed.

    python benchmarks/profile_replay_memory.py TRACE [--check] [--top 15]
    python benchmarks/profile_replay_memory.py --capture gpt2-small-2l DIR   # capture, then profile DIR

Replays rank 0's computing ops in execution order in this one process, as compare's
``replay_rank`` does (``--check``: as ``tracecmp check`` does, with element detail and small ops
on one thread), and before each op resets the kernel's high-water mark of resident memory
(Linux: ``/proc/self/clear_refs``), so that each op's own peak can be read after it (``VmHWM``).
Prints the resident size before the replay, the ops with the highest peaks (resident size before
the op, its peak, what it adds, its recorded inputs and outputs) and the largest peak of all.
``--capture`` first captures one Adam step of a model of ``bench_check.py`` with tensors, in a
child process (GPT-2 small with two layers keeps its 50257 x 768 embedding, whose optimizer ops
are the largest). Linux only. To profile another version of tracecmp, put it first on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_BYTES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


def _status() -> dict[str, int]:
    """Resident size now and its high-water mark since the last reset, in bytes."""
    found = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                found[key] = int(value.split()[0]) * 1024
    return found


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def profile(trace_path: Path, check: bool, top: int) -> dict:
    import torch

    import tracecmp
    from tracecmp.numerics.replay import ELEMENT_ULPS, Replayer

    if check:
        torch.set_num_threads(1)  # as the benchmark's one-thread check
    rank = tracecmp.load(trace_path).rank(0)
    ops = rank.ops
    names = dict(zip(ops["op_id"].tolist(), ops["op"].tolist()))
    wanted = ops.loc[ops["kind"] == "op", "op_id"].tolist()
    tensors = rank.tensors_table.select(["tensor_id", "shape", "dtype"]).to_pydict()
    nbytes = {
        t: _BYTES.get(d, 8) * math.prod(s or ())
        for t, s, d in zip(tensors["tensor_id"], tensors["shape"], tensors["dtype"])
    }
    table = rank.ops_table.select(["op_id", "inputs", "outputs"]).to_pydict()
    recorded_bytes = {
        o: sum(nbytes.get(t, 0) for t in [*(i or []), *(out or [])])
        for o, i, out in zip(table["op_id"], table["inputs"], table["outputs"])
    }
    rows = []
    start = time.perf_counter()
    options = {"detail": ELEMENT_ULPS, "small_on_one_thread": True} if check else {}
    with Replayer(rank, **options) as replayer:
        ready = _status()["VmRSS"]
        for op_id in wanted:
            before = _status()["VmRSS"]
            _reset_peak()
            replayer.replay(op_id)
            peak = _status()["VmHWM"]
            rows.append(
                {"op_id": op_id, "op": names[op_id], "before": before, "peak": peak, "recorded": recorded_bytes[op_id]}
            )
    seconds = time.perf_counter() - start
    rows.sort(key=lambda r: -r["peak"])
    return {
        "ready": ready,
        "seconds": seconds,
        "ops": len(wanted),
        "top": rows[:top],
        "peak": rows[0]["peak"] if rows else ready,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path)
    parser.add_argument(
        "--check", action="store_true", help="replay as tracecmp check does (element detail, one thread)"
    )
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument(
        "--capture", metavar="MODEL", help="first capture one step of MODEL (bench_check.py's models) into TRACE"
    )
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    args = parser.parse_args()
    if args.capture:  # in a child process, so that the model is not part of the replay's resident size
        done = subprocess.run(
            [
                sys.executable,
                str(ROOT / "benchmarks" / "bench_check.py"),
                "--child",
                "capture",
                args.capture,
                str(args.trace),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise SystemExit(f"capture failed:\n{done.stderr[-3000:]}")
        made = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"captured {args.capture}: {made['bytes'] / 2**30:.2f} GB in {made['seconds']:.0f} s", file=sys.stderr)
    found = profile(args.trace, args.check, args.top)
    if args.json:
        print(json.dumps(found))
        return
    mb = 2**20
    print(
        f"{found['ops']} ops replayed in {found['seconds']:.0f} s; resident before the replay {found['ready'] / mb:,.0f} MB, "
        f"largest peak {found['peak'] / mb:,.0f} MB"
    )
    print("| op id | op | resident before | peak | added | recorded inputs + outputs |")
    print("|---|---|---|---|---|---|")
    for r in found["top"]:
        print(
            f"| {r['op_id']} | {r['op']} | {r['before'] / mb:,.0f} MB | {r['peak'] / mb:,.0f} MB | "
            f"{(r['peak'] - r['before']) / mb:,.0f} MB | {r['recorded'] / mb:,.0f} MB |"
        )


if __name__ == "__main__":
    main()
