"""What judging by self-checks costs after capture: ``check`` on a statistics trace with
self-checks, beside ``compare`` of the same target against its bench, on a nanoGPT-sized step
(``bench_overhead.py``'s transformer512: 4 blocks, d512, 4 x 128 tokens) and the smaller models.

Capture overhead with self-checks on is ``bench_overhead.py --configs plain tracecmp-stats
tracecmp-selfcheck``; this script times the judging side, in one process, one after the other, a
median of ``--rounds``:

    python benchmarks/bench_self_check.py --models transformer512 gpt2 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _capture(name: str, path: Path, self_check: str) -> None:
    import tracecmp
    from benchmarks.bench_overhead import build

    model, _, step = build(name)
    with tracecmp.TraceCompare(path, model=model, self_check=self_check, overwrite=True) as tc:
        for _ in range(2):
            step()
            tc.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["transformer512", "gpt2"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.mkdtemp(prefix="tracecmp-selfcheck-")))
    args = parser.parse_args()
    import torch

    import tracecmp

    print(
        "| model | ops | compare s | check (statistics + self-checks) s | check / compare | ops judged by self-check |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name in args.models:
        target, bench = args.workdir / f"{name}-target", args.workdir / f"{name}-bench"
        _capture(name, target, "sample")
        _capture(name, bench, "off")
        compare_s, check_s = [], []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            tracecmp.compare(target, bench, progress=False)
            compare_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            result = tracecmp.check(target, data="statistics", progress=False)
            check_s.append(time.perf_counter() - t0)
        counts = result.counts()
        judged = counts["pass"] + counts["warning"] + counts["error"]
        c, k = statistics.median(compare_s), statistics.median(check_s)
        print(
            f"| {name} | {counts['ops']:,} | {c:.2f} | {k:.2f} | {k / c:.2f}x | "
            f"{counts.get('by self-check', 0):,} of {judged:,} |",
            flush=True,
        )
    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
