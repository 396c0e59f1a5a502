"""The outcome of a comparison: verdict, first divergence, suspects, per-node and per-tensor tables."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import networkx as nx
import pandas as pd

from tracecmp.comparison.tolerances import Tolerances
from tracecmp.errors import TracecmpError
from tracecmp.trace.reader import Trace
from tracecmp.verdict.drawing import draw
from tracecmp.verdict.records import Divergence, Drift, Region, SkippedStep, layer_site, op_counts

NODE_COLUMNS = (
    "rank",
    "op_id",
    "bench_op_id",
    "region",
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
    "self_check",
    "metric",
    "root_kind",
    "reason",
)


# Why a bench node is in ``unpaired_bench`` (the target's own reasons are in ``nodes.reason``).
BENCH_UNPAIRED = "no partner in the target: the two runs' op sequences differ here"
# Groups of what could not be compared that the terminal summary lists (all of them: uncompared.csv).
SUMMARY_GROUPS = 5


@dataclass
class CompareResult:
    """What :func:`tracecmp.compare` found.

    ``nodes`` has one row per target node (see :data:`NODE_COLUMNS`; ``status`` is one of
    :data:`tracecmp.verdict.records.STATUSES`, ``error``/``introduced`` are in rounding units of the
    node's dtype; ``own_error``/``honest_error`` are the replay's relative errors of the recorded
    output and of an honest replay, NaN where the op was not replayed; ``self_check`` the
    target's own check at capture, its residual over what the op's dtype allows (over 1 failed),
    NaN where it was not checked); ``tensors`` one row per
    compared tensor; ``unpaired_bench`` the bench nodes that
    found no partner.

    >>> result = tracecmp.compare("runs/target", "runs/bench")   # doctest: +SKIP
    >>> print(result.summary())                                 # doctest: +SKIP
    """

    target: Trace
    bench: Trace
    first_divergence: Divergence | None
    suspects: list[Divergence]
    nodes: pd.DataFrame
    tensors: pd.DataFrame
    unpaired_bench: pd.DataFrame
    tolerances: Tolerances = field(default_factory=Tolerances)
    warnings: list[str] = field(default_factory=list)
    # what statistics alone could not tell (faults below a stated size), which does not block agreement
    notes: list[str] = field(default_factory=list)
    exact: bool = False
    ranks: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    regions: list[Region] = field(default_factory=list)  # many-to-many correspondences, by region_id
    job: Any = None  # several ranks: tracecmp.comparison.ranks.JobReport (ranks side by side, paths)
    # steps whose update the target's loss scaler skipped on overflows the bench did not have
    skipped_steps: list[SkippedStep] = field(default_factory=list)
    # where each rank's runs drifted apart (rounding a network amplified): faults smaller than the
    # drift are out of statistics' reach beyond it; those it would have named are left undecided
    drifts: list[Drift] = field(default_factory=list)

    @property
    def agrees(self) -> bool:
        """True only if every node on both sides was paired and compared and nothing diverged."""
        if self.first_divergence is not None or self.warnings_block_agreement:
            return False
        counted = self.nodes[self.nodes["kind"] != "view"]
        return (
            bool(len(counted)) and bool(counted["status"].isin(["agrees", "noise"]).all()) and self.unpaired_bench.empty
        )

    @property
    def warnings_block_agreement(self) -> bool:
        """Something was left out (an incomplete trace, a rank or step only one run has)."""
        return bool(self.warnings) or not (self.target.complete and self.bench.complete)

    @property
    def status(self) -> str:
        """The verdict in one word: "diverged", "agree", "no root" (a loss scaler skipped steps the
        bench made; nothing else was found) or "incomplete" (nothing diverged among what could be
        compared, but not everything could be: see :meth:`uncompared_groups`)."""
        if self.first_divergence is not None:
            return "diverged"
        if self.agrees:
            return "agree"
        return "no root" if self.skipped_steps else "incomplete"

    def uncompared_groups(self) -> pd.DataFrame:
        """What could not be compared, one row per (side, status, op, module, reason), largest first:
        ``count`` nodes, the steps they lie in and the first op id. Modules are written with their
        layer numbers as ``#`` (one line of the model's code in every layer). Views are left out.

        >>> result.uncompared_groups().head()  # doctest: +SKIP
        """
        columns = ["side", "status", "op", "module", "reason", "count", "steps", "first_op_id"]
        target = self.nodes[self.nodes["status"].isin(["uncompared", "unpaired"]) & (self.nodes["kind"] != "view")]
        target = target.assign(side="target", reason=target["reason"].replace("", "no reason recorded"))
        frames = [target[["side", "status", "op", "module", "reason", "step", "op_id"]]]
        if len(self.unpaired_bench):
            bench = self.unpaired_bench[self.unpaired_bench["kind"] != "view"]
            frames.append(
                bench.assign(side="bench", status="unpaired", reason=BENCH_UNPAIRED)[
                    ["side", "status", "op", "module", "reason", "step", "op_id"]
                ]
            )
        rows = pd.concat(frames, ignore_index=True)
        if rows.empty:
            return pd.DataFrame(columns=columns)
        rows["module"] = rows["module"].fillna("").map(layer_site)
        grouped = rows.groupby(["side", "status", "op", "module", "reason"], sort=False)
        out = grouped.agg(
            count=("op_id", "size"),
            steps=("step", lambda s: ",".join(map(str, sorted({int(v) for v in s})))),
            first_op_id=("op_id", "min"),
        ).reset_index()
        return out.sort_values(["count", "first_op_id"], ascending=[False, True], ignore_index=True)[columns]

    def counts(self) -> dict[str, int]:
        """Node counts behind the verdict (views left out)."""
        counted = self.nodes[self.nodes["kind"] != "view"]
        status = counted["status"].value_counts()
        return {
            "target nodes": len(counted),
            "paired": int(counted["bench_op_id"].notna().sum()),
            "in regions": int(counted["region"].notna().sum()) if "region" in counted.columns else 0,
            "unpaired target": int(status.get("unpaired", 0)),
            "unpaired bench": int(len(self.unpaired_bench[self.unpaired_bench["kind"] != "view"]))
            if len(self.unpaired_bench)
            else 0,
            **{name: int(status.get(name, 0)) for name in ("agrees", "noise", "uncompared", "diverged", "nan")},
            "roots": len(self.suspects),
        }

    def graph(self, rank: int = 0, step: int | None = None) -> nx.DiGraph:
        """The target's dataflow graph (see :func:`tracecmp.graph.build_graph`) with this comparison's
        per-node columns (status, error, introduced, metric, bench_op_id, root_kind) as node attributes."""
        from tracecmp.graph import build_graph

        g = build_graph(self.target.rank(rank), step=step, rank=rank)
        rows = self.nodes[self.nodes["rank"] == rank]
        if step is not None:
            rows = rows[rows["step"] == step]
        columns = ("bench_op_id", "status", "error", "introduced", "metric", "root_kind", "reason")
        for record in rows[["op_id", *columns]].to_dict("records"):
            op_id = int(record.pop("op_id"))
            if op_id in g:
                g.nodes[op_id].update({k: (None if _missing(v) else v) for k, v in record.items()})
        return g

    def to_frame(self) -> pd.DataFrame:
        """One row per compared tensor: where it comes from, both dtypes, the metrics, the node's status."""
        return self.tensors.copy()

    def summary(self, *, top: int = 10) -> str:
        """Terminal text: verdict, first divergence, top suspects, counts, completeness warnings."""
        lines = [self.verdict()]
        d = self.first_divergence
        if d is not None:
            lines += [
                "",
                "First divergence:",
                f"  op        {d.op}",
                f"  module    {d.module or '<top>'}",
                f"  phase     {d.phase}, step {d.step}" + (f", rank {d.rank}" if d.rank else ""),
                f"  location  {d.location or '?'}",
                f"  kind      {d.kind}",
                f"  reason    {d.reason}",
            ]
            if d.metrics:
                lines.append("  metrics   " + ", ".join(f"{k}={_fmt(v)}" for k, v in d.metrics.items()))
        if self.suspects:
            lines += [
                "",
                f"Suspects ({len(self.suspects)} root{'s' if len(self.suspects) != 1 else ''}, by introduced error):",
            ]
            ranked = sorted(self.suspects, key=lambda s: -s.score)[:top]
            width = max(len(s.op) for s in ranked)
            for i, s in enumerate(ranked, 1):
                score = f"  {_fmt(s.score)} units" if s.score > 0 and math.isfinite(s.score) else ""
                calls = f"  x{1 + len(s.repeats)} calls" if s.repeats else ""
                lines.append(
                    f"  {i:>2}. {s.op:<{width}}  {(s.module or '<top>')[:40]:<40}  {s.phase:<9} step {s.step:<3} "
                    f"{s.kind:<11}{score}{calls}"
                )
        if self.skipped_steps:
            lines += [
                "",
                "Loss scaler: the target's skipped updates the bench made, on overflows it caught (the "
                "scaler at work, not faults):",
            ]
            for skip in self.skipped_steps:
                lines.append(f"  {skip}")
                if skip.overflows:
                    lines.append(f"    {skip.overflows[0].reason}")
        quiet_drifts = [drift for drift in self.drifts if not drift.undecided]  # the others are warnings
        if quiet_drifts:
            lines += ["", "Drift:"] + [f"  {drift}" for drift in quiet_drifts]
        counts = self.counts()
        lines += ["", "Counts: " + ", ".join(f"{k} {v}" for k, v in counts.items())]
        if self.regions:
            kinds = pd.Series([r.kind for r in self.regions]).value_counts()
            lines.append(
                "Regions (ops matched as groups, judged at their boundary): "
                + ", ".join(f"{n} {kind}" for kind, n in kinds.items())
                + " (regions.csv)"
            )
        replayed = int(self.nodes["own_error"].notna().sum()) if "own_error" in self.nodes else 0
        if replayed:
            computing = int((self.nodes["kind"] == "op").sum())
            lines.append(
                f"Replay: {replayed} of {computing} ops re-run on their recorded inputs in float64 "
                "(own error in nodes.csv: own_error, honest_error)"
            )
        elif counts.get("noise") and not self.exact:
            lines.append(self._noise_line(counts["noise"]))
        if self.status == "incomplete":
            lines += self._uncompared_lines()
        if self.job is not None:
            lines += ["", self.job.summary()]
        lines += [f"note: {n}" for n in self.notes]
        for w in self.warnings:
            lines.append(f"warning: {w}")
        return "\n".join(lines)

    def _noise_line(self, noise: int) -> str:
        """What the summary says of ops within rounding noise where nothing was replayed: a fault
        below that noise shows only in an op's own check at capture, or in a replay."""
        nodes = self.nodes
        within = (nodes["status"] == "noise") & (nodes["kind"] != "view")
        checked = int((within & (nodes["self_check"] <= 1)).sum()) if "self_check" in nodes else 0
        if checked == noise:
            return (
                f"Self-checks: all {noise} ops within rounding noise passed their own check at capture "
                "(nodes.csv: self_check)"
            )
        if checked:
            return (
                f"Replay: none; {noise} ops differ within rounding noise, {checked} of them passed their own "
                f"check at capture; a fault smaller than that noise in the other {noise - checked} cannot be "
                'told apart from statistics: capture the target with data="tensors"'
            )
        return (
            f"Replay: none; {noise} ops differ within rounding noise, and a fault smaller than that noise "
            'cannot be told apart from statistics: capture the target with data="tensors" or self_check="sample"'
        )

    def _uncompared_lines(self) -> list[str]:
        """The summary's account of what could not be compared: the largest groups, and where the
        rest is."""
        groups = self.uncompared_groups()
        if groups.empty:
            return []
        total = int(groups["count"].sum())
        lines = [
            "",
            f"Not compared: {total} node{'s' if total != 1 else ''} in {len(groups)} group"
            f"{'s' if len(groups) != 1 else ''} (all in uncompared.csv with -o):",
        ]
        for row in groups.head(SUMMARY_GROUPS).itertuples():
            where = row.module or "<top>"
            lines.append(f"  {row.count:>5} x {row.op} in {where} ({row.side}, step {row.steps}): {row.reason}")
        if len(groups) > SUMMARY_GROUPS:
            lines.append(f"  ... and {len(groups) - SUMMARY_GROUPS} more groups")
        return lines

    def verdict(self) -> str:
        """One line: DIVERGED / AGREE / INCOMPLETE with the essentials."""
        d = self.first_divergence
        mode = "bitwise " if self.exact else ""
        if d is not None:
            where = (
                f"{d.op} in {d.module or '<top>'} ({d.phase}, step {d.step}{', rank ' + str(d.rank) if d.rank else ''})"
            )
            return f"DIVERGED: {mode}first divergence at {where}" + (f" — {d.location}" if d.location else "")
        if self.agrees:
            if self.exact:
                return "AGREE: every tensor is bitwise identical"
            drift = min(self.drifts, key=lambda x: (x.step, x.op_id), default=None)
            if drift is None:
                return "AGREE: no op diverges beyond rounding noise"
            # Agreement after a drift is weaker: say so in the line people read, not only below.
            rank = f", rank {drift.rank}" if drift.rank else ""
            return (
                f"AGREE: no op diverges beyond rounding noise; from op {drift.op_id} ({drift.op}, step {drift.step}{rank}) "
                f"the runs drifted apart by {drift.error:.0%}, and statistics see a later fault only where it is larger"
            )
        if self.skipped_steps:
            steps = sorted({skip.step for skip in self.skipped_steps})
            named = ", ".join(map(str, steps))
            return (
                f"NO ROOT: the target's loss scaler skipped the update of step{'s' if len(steps) > 1 else ''} {named} on "
                "overflows the bench did not have; what follows from parameters the bench moved is inherited"
            )
        c = self.counts()
        gaps = []
        if c["unpaired target"] or c["unpaired bench"]:
            ops = self.nodes.loc[(self.nodes["status"] == "unpaired") & (self.nodes["kind"] != "view"), "op"]
            if len(self.unpaired_bench):
                ops = pd.concat([ops, self.unpaired_bench.loc[self.unpaired_bench["kind"] != "view", "op"]])
            common = ", ".join(f"{op} x{n}" for op, n in ops.value_counts().head(3).items())
            gaps.append(f"{c['unpaired target']} target / {c['unpaired bench']} bench nodes unpaired: {common}")
        if c["uncompared"]:
            gaps.append(f"{c['uncompared']} nodes uncompared")
        if self.warnings_block_agreement:
            gaps.append("see the warnings")
        return (
            "INCOMPLETE: no divergence found among what could be compared ("
            + "; ".join(gaps or ["nothing compared"])
            + ")"
        )

    def regions_frame(self) -> pd.DataFrame:
        """One row per region (:class:`tracecmp.verdict.records.Region`): what it is, its ops on
        each side (names and ids), its boundary, and its status as judged (that of its target ops).

        >>> result.regions_frame()[["region", "kind", "target_ops", "bench_ops", "status"]]  # doctest: +SKIP
        """
        columns = [
            "rank",
            "region",
            "step",
            "phase",
            "module",
            "kind",
            "status",
            "root",
            "target_ops",
            "bench_ops",
            "target_op_ids",
            "bench_op_ids",
            "inputs",
            "outputs",
        ]
        status = {}
        if len(self.nodes) and "region" in self.nodes.columns:
            members = self.nodes[self.nodes["region"].notna()]
            status = dict(zip(members["region"].astype(int).tolist(), members["status"].tolist()))
        roots = {d.region for d in self.suspects if d.region is not None}
        rows = []
        for r in self.regions:
            rows.append(
                {
                    "rank": r.rank,
                    "region": r.region_id,
                    "step": r.step,
                    "phase": r.phase,
                    "module": r.module,
                    "kind": r.kind,
                    "status": status.get(r.region_id, "" if r.target_ops else "bench-only"),
                    "root": r.region_id in roots,
                    "target_ops": op_counts(r.target_names, views=not _computes(r.target_names)),
                    "bench_ops": op_counts(r.bench_names, views=not _computes(r.bench_names)),
                    "target_op_ids": " ".join(map(str, r.target_ops)),
                    "bench_op_ids": " ".join(map(str, r.bench_ops)),
                    "inputs": " ".join(f"{'-' if t is None else t}:{'-' if b is None else b}" for t, b in r.inputs),
                    "outputs": " ".join(f"{t}:{b}" for t, b in r.outputs),
                }
            )
        return pd.DataFrame(rows, columns=columns)

    def write_tables(self, out_dir: str | Path, *, xlsx: bool = False) -> list[Path]:
        """Write nodes.csv, tensors.csv, suspects.csv, unpaired_bench.csv, regions.csv (ranks.csv for
        several ranks, and compare.xlsx); returns the paths."""
        out = Path(out_dir)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TracecmpError(f"cannot create output folder: {exc.strerror}", path=out) from exc
        tables = {
            "nodes": self.nodes,
            "tensors": self.tensors,
            "suspects": self.suspects_frame(),
            "unpaired_bench": self.unpaired_bench,
            "regions": self.regions_frame(),
            "uncompared": self.uncompared_groups(),
        }
        if self.job is not None:
            tables["ranks"] = self.job.to_frame()
        paths = []
        for name, frame in tables.items():
            path = out / f"{name}.csv"
            frame.to_csv(path, index=False)
            paths.append(path)
        if xlsx:
            paths.append(self._write_xlsx(out / "compare.xlsx", tables))
        return paths

    @staticmethod
    def _write_xlsx(path: Path, tables: dict[str, pd.DataFrame]) -> Path:
        try:
            import openpyxl  # noqa: F401  (pandas' engine; imported here so it stays optional)
        except ImportError as exc:
            raise TracecmpError("XLSX output needs openpyxl: pip install tracecmp[xlsx]", path=path) from exc
        with pd.ExcelWriter(path, engine="openpyxl") as writer:
            for name, frame in tables.items():
                frame.head(1_000_000).to_excel(writer, sheet_name=name[:31], index=False)
        return path

    def suspects_frame(self) -> pd.DataFrame:
        """The suspects as a table, highest score first (``first_divergence`` is the earliest root);
        ``repeats`` are the op ids of the same fault's later calls."""
        columns = [
            "rank",
            "op_id",
            "bench_op_id",
            "region",
            "step",
            "phase",
            "op",
            "module",
            "location",
            "kind",
            "score",
            "reason",
        ]
        rows = [
            {**{c: getattr(s, c) for c in columns}, "repeats": " ".join(map(str, s.repeats))} for s in self.suspects
        ]
        return pd.DataFrame(rows, columns=[*columns, "repeats"])

    def selection(self, top: int = 3) -> Any:
        """A capture filter (:class:`tracecmp.capture.select.Selection`) around the first divergence
        and the top suspects: their modules in their steps, or None without a divergence. Paste
        ``str()`` of it into ``TraceCompare(..., data="tensors", only=...)`` to re-run the target
        with tensors there only (statistics everywhere, tensors for the region: replay then finds
        what statistics hide).

        >>> print(result.selection().code("runs/target"))   # doctest: +SKIP
        tracecmp.TraceCompare("runs/target", model=model, data="tensors", only={"modules": ["blocks.1.mlp"], "steps": [0]})
        """
        from tracecmp.capture.select import around  # only when asked: judging does not load capture

        ranked = sorted(self.suspects, key=lambda s: -s.score)
        return around([d for d in [self.first_divergence, *ranked] if d is not None], top=top)

    def render(self, path: str | Path, depth: int = 2) -> Path:
        """Draw the suspicious subgraph to ``path`` (.svg / .png / .dot by suffix), by the drawing
        :mod:`tracecmp.render` registers for compare's results (:mod:`tracecmp.verdict.drawing`)."""
        return draw("compare", self, path, depth=depth)

    def __repr__(self) -> str:
        return f"<CompareResult {self.verdict()}>"


def _computes(names: tuple[str, ...]) -> bool:
    return bool(op_counts(names))


def _missing(value: Any) -> bool:
    try:
        return value is None or bool(pd.isna(value))
    except (TypeError, ValueError):
        return False


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.3g}"
    return str(value)
