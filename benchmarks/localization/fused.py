"""The fused variant: one side runs a part fused, the other eager, and tracecmp must still agree.

For each part of :mod:`workloads.localization.fused_models` (attention, RMSNorm, SwiGLU, AdamW)
and each direction (the target fused and the bench eager, and the reverse) the cases are:

- *clean*: no fault; the comparison must report no root at all;
- *elsewhere*: the output faults of the plain variant at sites outside the part, chosen by the
  same seeded rule over the target's calls; each also runs as *fused-plain* (bench and target in
  the target's configuration), so the two variants' first divergences can be set side by side;
- *inside*: the output of the part's last op in each phase scaled by 1 + 1e-3 (the fused op
  itself where the target runs it fused); found when the first divergence is that op or the
  region holding it.

>>> cases = plan_fused(seed=0)   # doctest: +SKIP
"""

from __future__ import annotations

import zlib
from typing import Iterable

from workloads.localization.cases import CallRecord, Case, Profile, changes_nothing, choose_sites, profile, rng_for
from workloads.localization.faults import OutputFault, Plan
from workloads.localization.fused_models import PARTS, FusedConfig

VARIANTS = ("fused", "fused-plain")
DIRECTIONS = ("fused-target", "fused-bench")
INSIDE_MAGNITUDE = 1e-3
# The fault kinds placed elsewhere, per phase (a subset of the plain variant's, all kinds of it).
ELSEWHERE = (
    ("scale", 1e-4),
    ("noise", 1e-2),
    ("scale", 1e-1),
    ("bf16", 0.0),
    ("fp16", 0.0),
    ("nan", 0.0),
    ("inf", 0.0),
)
# Where each part's ops sit: modules (forward and backward) or the optimizer phase.
SCOPES: dict[str, tuple[str, ...]] = {
    "attn": ("attn.core",),
    "norm": ("norm1", "norm2", "norm_f"),
    "mlp": ("mlp.act",),
    "optim": (),
}


def inside(call: CallRecord, part: str) -> bool:
    """Whether ``call`` belongs to ``part`` (its module, or the optimizer step for AdamW)."""
    if part == "optim":
        return call.site.phase == "optimizer"
    if call.site.phase == "optimizer":
        return False
    return any(call.module == s or call.module.startswith(s + ".") for s in SCOPES[part])


def _inside_sites(calls: list[CallRecord], part: str) -> list[CallRecord]:
    """The part's last computing call in each phase (the fused op itself when it runs fused)."""
    chosen = []
    for phase in ("forward", "backward", "optimizer"):
        candidates = [
            c
            for c in calls
            if c.site.phase == phase
            and inside(c, part)
            and not c.is_view
            and c.n_tensor_inputs > 0
            and (c.n_float_outputs > 0 or c.mutable)
            and not c.site.op.split(".")[1].startswith(("empty", "new_empty", "zeros", "detach"))
        ]
        if candidates:
            chosen.append(candidates[-1])
    return chosen


def plan_fused(seed: int = 0, parts: Iterable[str] = PARTS, model_seed: int = 1234) -> list[Case]:
    """Every fused-variant case, in a stable order (profiling each configuration once)."""
    profiles: dict[str, Profile] = {}
    cases: list[Case] = []
    for part in parts:
        fused = FusedConfig().with_part(part, "fused").family
        eager = FusedConfig().family
        for direction in DIRECTIONS:
            target, bench = (fused, eager) if direction == "fused-target" else (eager, fused)
            if target not in profiles:
                profiles[target] = profile(target, model_seed)
            prof = profiles[target]
            prefix = f"{part}/{direction}"
            cases.append(
                Case(
                    f"{prefix}/clean",
                    target,
                    "clean",
                    "fused",
                    "",
                    0.0,
                    Plan(),
                    Plan(),
                    expect_divergence=False,
                    bench_model=bench,
                )
            )
            outside = [c for c in prof.calls if not inside(c, part)]
            for phase in ("forward", "backward"):
                sites = choose_sites(outside, phase, len(ELSEWHERE), rng_for(seed, "fused", part, direction, phase))
                for (kind, magnitude), site in zip(ELSEWHERE, sites):
                    fault = OutputFault(kind, site, magnitude, seed=zlib.crc32(f"{seed}/{part}/{site}/{kind}".encode()))
                    if changes_nothing(prof, fault):
                        continue
                    label = f"{kind}{f'{magnitude:.0e}' if magnitude else ''}@{site.op}#{site.k}:{phase}"
                    plan = Plan(output_fault=fault)
                    cases.append(
                        Case(
                            f"{prefix}/{label}/fused",
                            target,
                            kind,
                            "fused",
                            phase,
                            magnitude,
                            plan,
                            Plan(),
                            bench_model=bench,
                        )
                    )
                    cases.append(
                        Case(
                            f"{prefix}/{label}/fused-plain", target, kind, "fused-plain", phase, magnitude, plan, Plan()
                        )
                    )
            for call in _inside_sites(prof.calls, part):
                site = call.site
                fault = OutputFault("scale", site, INSIDE_MAGNITUDE, seed=seed)
                label = f"inside:scale1e-03@{site.op}#{site.k}:{site.phase}"
                cases.append(
                    Case(
                        f"{prefix}/{label}",
                        target,
                        "inside",
                        "fused",
                        site.phase,
                        INSIDE_MAGNITUDE,
                        Plan(output_fault=fault),
                        Plan(),
                        bench_model=bench,
                    )
                )
    return cases


def fused_tables(results: list) -> list[str]:
    """Markdown: per part and direction, the clean pair's roots, elsewhere faults' top-1 in the
    fused and the fused-plain variant, and the inside faults; then the goals' totals."""
    groups: dict[tuple[str, str], list] = {}
    for r in results:
        if r.variant not in VARIANTS:
            continue
        part, direction = r.id.split("/")[:2]
        groups.setdefault((part, direction), []).append(r)

    def hits(rows: list) -> str:
        scored = [r for r in rows if r.status == "ok"]
        return f"{sum(r.top1 for r in scored)}/{len(scored)}" if rows else "-"

    lines = [
        "### Fused variant: fused against eager, both directions",
        "",
        "| part | direction | clean pair | elsewhere, fused | elsewhere, fused-plain | same top-1 | inside |",
        "|---|---|---|---|---|---|---|",
    ]
    totals = {"clean": [], "fused": [], "plain": [], "same": [], "inside": []}
    for (part, direction), rows in groups.items():
        clean = [r for r in rows if r.kind == "clean"]
        fused = [r for r in rows if r.variant == "fused" and r.expect_divergence and r.kind != "inside"]
        plain = {r.id.rsplit("/", 1)[0]: r for r in rows if r.variant == "fused-plain"}
        same = [
            r
            for r in fused
            if r.id.rsplit("/", 1)[0] in plain
            and r.found is not None
            and plain[r.id.rsplit("/", 1)[0]].found is not None
            and (r.found.op, r.found.module, r.found.phase)
            == (
                plain[r.id.rsplit("/", 1)[0]].found.op,
                plain[r.id.rsplit("/", 1)[0]].found.module,
                plain[r.id.rsplit("/", 1)[0]].found.phase,
            )
        ]
        inside_rows = [r for r in rows if r.kind == "inside"]
        roots = [len(r.ranked) for r in clean]
        lines.append(
            f"| {part} | {direction} | {'no root' if roots == [0] else f'{roots} roots'} | {hits(fused)} | "
            f"{hits(list(plain.values()))} | {len(same)}/{len(fused)} | {hits(inside_rows)} |"
        )
        totals["clean"] += clean
        totals["fused"] += fused
        totals["plain"] += list(plain.values())
        totals["same"] += same
        totals["inside"] += inside_rows
    clean_ok = sum(1 for r in totals["clean"] if not r.ranked)
    lines += [
        "",
        f"- clean fused/eager pairs with 0 roots: {clean_ok}/{len(totals['clean'])} (goal: all)",
        f"- faults elsewhere, top-1: fused {hits(totals['fused'])}, fused-plain {hits(totals['plain'])}; "
        f"same first divergence in both: {len(totals['same'])}/{len(totals['fused'])} (goal 100%)",
        f"- a fault inside the fused part named (the op or its region): {hits(totals['inside'])} (goal: all)",
        "",
    ]
    return lines
