"""The outcome of ``check``: the verdict, the first erring op, the ranked suspects, one row per op."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import networkx as nx
import pandas as pd

from tracecmp.checking.standards import Standards
from tracecmp.errors import TracecmpError
from tracecmp.trace.reader import Trace
from tracecmp.verdict.drawing import draw
from tracecmp.verdict.records import Divergence

if TYPE_CHECKING:
    from tracecmp.capture.select import Selection

NODE_COLUMNS = (
    "rank",
    "op_id",
    "step",
    "phase",
    "kind",
    "op",
    "module",
    "location",
    "status",
    "evidence",
    "dtype",
    "finding",
    "score",
    "own_error",
    "honest_error",
    "error_units",
    "ratio",
    "max_ulps",
    "beyond",
    "honest_beyond",
    "nonfinite",
    "checks",
    "reason",
)
# check's statuses in the words of compare's pictures (render/subgraph.py, render/chart.py).
RENDER_STATUS = {"pass": "agrees", "warning": "noise", "error": "diverged", "skipped": "uncompared"}


@dataclass
class CheckResult:
    """What :func:`tracecmp.check` found.

    ``nodes`` has one row per computing op (see :data:`NODE_COLUMNS`): ``status`` is pass,
    warning, error or skipped; ``evidence`` "tensors" (replayed on its recorded inputs) or
    "statistics" (on random inputs drawn to its statistics: weaker) or "self-check" (its
    outputs recomputed in float64 from its own inputs at capture, on a sample); ``own_error`` and
    ``honest_error`` the normwise relative errors of the recorded output and of an honest replay
    against float64; ``error_units`` the former in rounding units of the dtype; ``reason`` the
    finding, or why the op was skipped.

    >>> result = tracecmp.check("runs/target")     # doctest: +SKIP
    >>> print(result.summary())                   # doctest: +SKIP
    """

    trace: Trace
    first_error: Divergence | None
    suspects: list[Divergence]
    nodes: pd.DataFrame
    standards: Standards = field(default_factory=Standards)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    evidence: str = "tensors"  # "tensors", "statistics", "self-check", "mixed" or "none"
    ranks: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True when no op errs (warnings and skipped ops aside; see :meth:`counts`)."""
        return self.first_error is None

    # Names the report and picture code of ``compare`` reads.
    @property
    def first_divergence(self) -> Divergence | None:
        return self.first_error

    @property
    def target(self) -> Trace:
        return self.trace

    @property
    def agrees(self) -> bool:
        return self.passed and not self.counts().get("skipped", 0)

    def counts(self) -> dict[str, int]:
        """Ops per status, and per evidence among the judged ones."""
        status = self.nodes["status"].value_counts()
        out = {"ops": len(self.nodes), **{s: int(status.get(s, 0)) for s in ("pass", "warning", "error", "skipped")}}
        evidence = self.nodes.loc[self.nodes["status"] != "skipped", "evidence"].value_counts()
        for name in ("tensors", "self-check", "statistics"):
            if evidence.get(name, 0):
                out[f"by {name}"] = int(evidence[name])
        return out

    def skipped(self) -> pd.DataFrame:
        """Skipped ops grouped by reason: how many, which op names."""
        rows = self.nodes[self.nodes["status"] == "skipped"]
        if rows.empty:
            return pd.DataFrame(columns=["reason", "ops", "names"])
        grouped = rows.groupby("reason").agg(
            ops=("op_id", "size"), names=("op", lambda s: ", ".join(sorted(set(s))[:4]))
        )
        return grouped.reset_index().sort_values("ops", ascending=False).reset_index(drop=True)

    def selection(self, top: int = 3) -> Selection | None:
        """A capture filter around the first error and the top suspects (their modules, in their
        steps), or around the ops with warnings when nothing erred: paste it into
        ``TraceCompare(..., data="tensors", only=...)`` to re-run with tensors there only."""
        from tracecmp.capture.select import around  # only when asked: judging does not load capture

        records: list[Any] = [d for d in [self.first_error, *self.suspects] if d is not None]
        if not records:
            warned = self.nodes[self.nodes["status"] == "warning"].sort_values(["step", "op_id"])
            records = list(warned[["module", "step"]].itertuples(index=False))
        return around(records, top=top)

    @property
    def status(self) -> str:
        """The verdict in one word: "diverged" (an op errs), "agree" (every judged op passes) or
        "incomplete" (no op could be judged), in the words :class:`CompareResult` uses."""
        if self.first_error is not None:
            return "diverged"
        c = self.counts()
        return "agree" if c["pass"] + c["warning"] else "incomplete"

    def verdict(self) -> str:
        """One line: ERROR / PASS / INCOMPLETE with the essentials."""
        d = self.first_error
        weak = (
            " (statistics only: weaker evidence)"
            if self.evidence == "statistics"
            else (" (partly from statistics: weaker evidence)" if self.evidence == "mixed" else "")
        )
        if d is not None:
            where = (
                f"{d.op} in {d.module or '<top>'} ({d.phase}, step {d.step}{', rank ' + str(d.rank) if d.rank else ''})"
            )
            return f"ERROR: first erring op {where}" + (f" — {d.location}" if d.location else "") + weak
        c = self.counts()
        judged = c["pass"] + c["warning"]
        if judged == 0:
            return "INCOMPLETE: no op could be judged (see the skipped ops)"
        text = f"PASS: none of {judged} judged ops errs"
        if c["warning"]:
            text += f" ({c['warning']} with warnings)"
        if c["skipped"]:
            text += f"; {c['skipped']} ops could not be judged"
        return text + weak

    def summary(self, *, top: int = 10) -> str:
        """Terminal text: verdict, first erring op, suspects, counts, skipped ops, notes, warnings."""
        lines = [self.verdict()]
        d = self.first_error
        if d is not None:
            lines += [
                "",
                "First erring op:",
                f"  op        {d.op}",
                f"  module    {d.module or '<top>'}",
                f"  phase     {d.phase}, step {d.step}" + (f", rank {d.rank}" if d.rank else ""),
                f"  location  {d.location or '?'}",
                f"  kind      {d.kind}",
                f"  reason    {d.reason}",
            ]
            evidence = self._evidence_of(d)
            if evidence:
                lines.append(f"  evidence  {evidence}")
        if self.suspects:
            lines += [
                "",
                f"Suspects ({len(self.suspects)} erring op{'s' if len(self.suspects) != 1 else ''}, by how far "
                "beyond the standard):",
            ]
            ranked = self.suspects[:top]
            width = max(len(s.op) for s in ranked)
            for i, s in enumerate(ranked, 1):
                lines.append(
                    f"  {i:>2}. {s.op:<{width}}  {(s.module or '<top>')[:40]:<40}  {s.phase:<9} step {s.step:<3} "
                    f"{_fmt(s.score)}x"
                )
        lines += ["", "Counts: " + ", ".join(f"{k} {v}" for k, v in self.counts().items())]
        skipped = self.skipped()
        if len(skipped):
            lines.append("Skipped (never counted as passing):")
            for row in skipped.head(6).itertuples():
                lines.append(f"  {row.ops:>5}  {row.reason} [{row.names}]")
            if len(skipped) > 6:
                lines.append(f"  ... {len(skipped) - 6} more reasons in nodes.csv")
        for note in self.notes:
            lines.append(f"note: {note}")
        selection = self.selection()
        if selection is not None:
            lines += ["", "Re-run with tensors around the suspects only:", f"  {selection.code(str(self.trace.path))}"]
        for w in self.warnings:
            lines.append(f"warning: {w}")
        return "\n".join(lines)

    def _evidence_of(self, d: Divergence) -> str:
        row = self.nodes[(self.nodes["rank"] == d.rank) & (self.nodes["op_id"] == d.op_id)]
        if row.empty:
            return ""
        evidence = str(row.iloc[0]["evidence"])
        if evidence == "statistics":
            return "statistics only (random inputs drawn to the recorded statistics): weaker than a replay of recorded inputs"
        if evidence == "self-check":
            return "its own check at capture: sampled outputs recomputed in float64 from its own inputs"
        return "a replay of its recorded inputs in float64 and in its own dtypes"

    def to_frame(self) -> pd.DataFrame:
        """One row per computing op (``nodes``)."""
        return self.nodes.copy()

    def suspects_frame(self) -> pd.DataFrame:
        """The erring ops as a table, by how far beyond the standard (first error marked)."""
        columns = ["rank", "op_id", "step", "phase", "op", "module", "location", "kind", "score", "reason"]
        rows = [{c: getattr(s, c) for c in columns} for s in self.suspects]
        frame = pd.DataFrame(rows, columns=columns)
        # Whether each finding stands on a replay of recorded inputs or on statistics (weaker).
        evidence = dict(zip(zip(self.nodes["rank"], self.nodes["op_id"]), self.nodes["evidence"]))
        frame.insert(
            len(columns) - 2, "evidence", [evidence.get((r, o), "") for r, o in zip(frame["rank"], frame["op_id"])]
        )
        first = self.first_error
        frame.insert(
            0,
            "first",
            [first is not None and (r, o) == (first.rank, first.op_id) for r, o in zip(frame["rank"], frame["op_id"])],
        )
        return frame

    def write_tables(self, out_dir: str | Path) -> list[Path]:
        """Write check_ops.csv, check_suspects.csv and check_skipped.csv; returns their paths."""
        out = Path(out_dir)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TracecmpError(f"cannot create output folder: {exc.strerror}", path=out) from exc
        paths = []
        tables = (
            ("check_ops", self.nodes),
            ("check_suspects", self.suspects_frame()),
            ("check_skipped", self.skipped()),
        )
        for name, frame in tables:
            path = out / f"{name}.csv"
            try:
                frame.to_csv(path, index=False)
            except OSError as exc:
                raise TracecmpError(f"cannot write a table: {exc.strerror}", path=path) from exc
            paths.append(path)
        return paths

    def render_nodes(self) -> pd.DataFrame:
        """``nodes`` in the columns compare's pictures read: status in compare's words, error in rounding units."""
        frame = self.nodes.copy()
        frame["status"] = frame["status"].map(RENDER_STATUS).fillna("uncompared")
        frame.loc[(frame["finding"] == "nan") & (self.nodes["status"] == "error"), "status"] = "nan"
        frame["error"] = frame["error_units"]
        frame["introduced"] = math.nan
        frame["metric"] = ""
        frame["root_kind"] = frame["finding"]
        return frame

    def graph(self, rank: int = 0, step: int | None = None) -> nx.DiGraph:
        """The trace's dataflow graph with check's per-op columns as node attributes."""
        from tracecmp.graph import build_graph

        g = build_graph(self.trace.rank(rank), step=step, rank=rank)
        rows = self.render_nodes()
        rows = rows[rows["rank"] == rank]
        for record in rows[["op_id", "status", "error", "root_kind", "reason"]].to_dict("records"):
            op_id = int(record.pop("op_id"))
            if op_id in g:
                g.nodes[op_id].update({k: v for k, v in record.items() if not (isinstance(v, float) and math.isnan(v))})
        return g

    def render(self, path: str | Path, depth: int = 2) -> Path:
        """Draw the first erring op with its producers and consumers to ``path`` (.svg/.png/.dot), by
        the drawing :mod:`tracecmp.render` registers for check's results (:mod:`tracecmp.verdict.drawing`)."""
        return draw("check", self, path, depth=depth)

    def __repr__(self) -> str:
        return f"<CheckResult {self.verdict()}>"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if math.isinf(value):
            return "inf"
        return f"{value:.3g}"
    return str(value)
