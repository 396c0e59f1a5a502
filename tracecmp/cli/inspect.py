"""``tracecmp inspect TRACE``: what a trace holds, in one screen."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pandas as pd

TOP_MODULES = 10
NONFINITE_SHOWN = 5


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help="summarise a recorded trace",
        description="Print what a trace holds: completeness, ranks, device, versions, options, "
        "ops per phase and step, busiest modules, dtypes, source tensors, NaN/Inf, size on disk.",
    )
    parser.add_argument("trace", help="trace folder written by TraceCompare")
    parser.set_defaults(run=run)


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _human(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def summarize(path: str | Path) -> str:
    """The text ``tracecmp inspect`` prints for the trace at ``path``.

    >>> print(summarize("runs/bench"))  # doctest: +SKIP
    """
    from tracecmp.trace import load

    trace = load(path)
    manifest = trace.manifest
    ops = trace.to_frame()
    tensors = trace.tensors_frame()
    lines: list[str] = [f"trace     {trace.path}"]
    incomplete = [r for r in trace.ranks if not trace.rank(r).complete]
    if not incomplete:
        lines.append("complete  yes")
    elif len(trace.ranks) == 1:
        lines.append(f"complete  NO: {trace.rank(incomplete[0]).ending()}")
    else:
        lines.append(f"complete  NO: rank(s) {incomplete} did not finish")
        lines.extend(f"  rank {r}: {trace.rank(r).ending()}" for r in incomplete)
    devices = sorted({trace.rank(r).device for r in trace.ranks})
    lines.append(f"ranks     {trace.ranks} of world size {manifest.get('world_size', len(trace.ranks))}")
    lines.append(f"device    {', '.join(devices)}")
    versions = manifest.get("versions", {})
    lines.append("versions  " + ", ".join(f"{k} {v}" for k, v in sorted(versions.items())))
    lines.append(
        f"format    {manifest.get('format')} v{manifest.get('format_version')}, created {manifest.get('created', '?')}"
    )
    options = ", ".join(f"{k}={v}" for k, v in sorted(trace.options.items()))
    lines.append(f"options   {options or '-'}")
    lists = [trace.rank(r).manifest.get("info", {}).get("models") for r in trace.ranks]
    found = sorted({str(m)[:80] for models in lists if isinstance(models, list) for m in models[:20]})
    if found:
        lines.append(f"models    {', '.join(found)} (not given: the outermost modules that ran)")
    seeded = manifest.get("seed_all") or {}
    determinism = manifest.get("determinism") or {}
    if seeded:
        lines.append(f"seeding   seed_all({seeded.get('seed')}, deterministic={seeded.get('deterministic')})")
    else:
        lines.append("seeding   tracecmp.seed_all was not called before capture")
    infos = [trace.rank(r).manifest.get("info") or {} for r in trace.ranks]
    threads = sorted({info["threads"] for info in infos if isinstance(info.get("threads"), int)})
    if determinism:
        lines.append(
            f"determin. torch deterministic algorithms {determinism.get('torch_deterministic_algorithms')}, "
            f"cuDNN deterministic {determinism.get('cudnn_deterministic')}"
            + (f", {'/'.join(map(str, threads))} intra-op threads" if threads else "")
        )
    lines.append(f"size      {_human(_size(trace.path))} on disk")
    lines.append("")
    if ops.empty:
        lines.append("no ops recorded")
        return "\n".join(lines)

    computed = ops[ops["kind"] != "source"]
    lines.append(
        f"{len(computed):,} ops ({(computed['kind'] == 'view').sum():,} views), {len(tensors):,} tensor values"
    )
    table = pd.crosstab(computed["step"], computed["phase"], margins=True, margins_name="all")
    lines.append("ops per step and phase:")
    lines.extend("  " + row for row in table.to_string().splitlines())
    lines.append("")

    busiest = computed.groupby("module").size().sort_values(ascending=False).head(TOP_MODULES)
    lines.append(f"top {len(busiest)} modules by op count:")
    lines.extend(f"  {count:>8,}  {module or '<top>'}" for module, count in busiest.items())
    lines.append("")

    dtypes = tensors.groupby("dtype").size().sort_values(ascending=False)
    lines.append("dtypes:    " + ", ".join(f"{dtype} {count:,}" for dtype, count in dtypes.items()))

    sources = ops[ops["kind"] == "source"]
    kinds = sources.groupby("op").size()
    lines.append(
        f"sources:   {len(sources):,}"
        + (
            " (" + ", ".join(f"{op.removeprefix('source.')} {n:,}" for op, n in kinds.items()) + ")"
            if len(kinds)
            else ""
        )
    )

    stats = tensors[tensors["has_stats"]]
    nonfinite = stats[(stats["nan_count"] > 0) | (stats["inf_count"] > 0)]
    lines.append(f"NaN/Inf:   {len(nonfinite):,} tensor values hold NaN or Inf")
    if len(nonfinite):
        producers = ops.set_index(["rank", "op_id"])
        for row in nonfinite.head(NONFINITE_SHOWN).itertuples():
            producer = producers.loc[(row.rank, row.op_id)]
            lines.append(
                f"  tensor {row.tensor_id} (rank {row.rank}) from {producer['op']} in "
                f"{producer['module'] or '<top>'} [{producer['phase']}, step {producer['step']}]: "
                f"{int(row.nan_count)} NaN, {int(row.inf_count)} Inf"
            )
        if len(nonfinite) > NONFINITE_SHOWN:
            lines.append(f"  ... and {len(nonfinite) - NONFINITE_SHOWN:,} more (tracecmp overflow {trace.path})")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    print(summarize(args.trace))
    return 0
