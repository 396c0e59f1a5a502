"""Which faults the benchmark injects where: a seeded rule over the ops each model really runs.

A clean profiling pass lists every program call. Fault sites are chosen per model and phase by
cycling over op *categories* (matmul, conv, norm, softmax, activation, reduction, elementwise,
...) in a seeded order and taking a seeded op and occurrence inside each, so every model gets
several kinds of op in both phases without anyone picking sites by hand.
"""

from __future__ import annotations

import math
import random
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from workloads.localization.faults import (
    INSERTIONS,
    MAGNITUDES,
    ArgFault,
    CallRecord,
    Injector,
    Insertion,
    OutputFault,
    Plan,
    Site,
    bitwise_equal,
    corrupt_,
    relative_change,
)
from workloads.localization.models import FAMILIES, build_workload

VARIANTS = ("plain", "structure", "tf32")
WEIGHT_PERTURBATION = 1e-3

# Keyword rules, first match wins; the op's base name is matched ("native_layer_norm_backward").
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("conv", ("convolution",)),
    ("norm", ("layer_norm", "batch_norm", "group_norm", "instance_norm", "rms_norm")),
    ("softmax", ("softmax",)),
    ("pool", ("pool",)),
    ("loss", ("nll_loss", "mse_loss", "cross_entropy", "binary_cross_entropy")),
    ("matmul", ("mm", "bmm", "matmul", "scaled_dot_product", "embedding")),
    ("activation", ("gelu", "relu", "tanh", "sigmoid", "silu", "threshold", "hardtanh", "elu", "softplus")),
    ("reduction", ("sum", "mean", "amax", "amin", "max", "min", "norm", "var", "std", "prod")),
)

# Realistic non-tensor argument mix-ups: (argument, new value as a function of the old one).
ARG_CHANGES: dict[str, tuple[str, Any]] = {
    "aten.gelu.default": ("approximate", lambda old: "none" if old == "tanh" else "tanh"),
    "aten.gelu_backward.default": ("approximate", lambda old: "none" if old == "tanh" else "tanh"),
    # T5/LLaMA use 1e-6 where GPT-2/BERT-base use 1e-5.
    "aten.native_layer_norm.default": ("eps", lambda old: 1e-5 if old == 1e-6 else 1e-6),
    # Keras/TF default 1e-3 against PyTorch's 1e-5. (native_batch_norm_backward is left out: in
    # training it uses the saved inverse std and ignores its eps.)
    "aten.native_batch_norm.default": ("eps", lambda old: 1e-5 if old == 1e-3 else 1e-3),
    "aten._native_batch_norm_legit_functional.default": ("eps", lambda old: 1e-5 if old == 1e-3 else 1e-3),
    # GAN code uses 0.2, Keras 0.3, PyTorch 0.01.
    "aten.leaky_relu.default": ("negative_slope", lambda old: 0.01 if old == 0.2 else 0.2),
    "aten.leaky_relu_backward.default": ("negative_slope", lambda old: 0.01 if old == 0.2 else 0.2),
}


def category(op: str) -> str:
    """The category of an aten overload name.

    >>> category("aten.native_layer_norm_backward.default"), category("aten.add.Tensor")
    ('norm', 'elementwise')
    """
    base = op.split(".")[1] if op.count(".") >= 2 else op
    for name, keys in CATEGORIES:
        if any(key in base for key in keys):
            return name
    return "elementwise"


@dataclass(frozen=True)
class Case:
    """One benchmark case: a target plan, the bench it is compared with, what should be found."""

    id: str
    model: str
    kind: str  # scale|noise|bf16|fp16|nan|inf|arg|weight, or a negative: identical|exact-op|tf32-only
    variant: str  # plain|structure|tf32 ("-" for negatives)
    phase: str  # phase of the fault ("" for negatives)
    magnitude: float
    target: Plan
    bench: Plan  # the bench's plan: empty, or an insertion (the target "misses" an op)
    weight: str = ""  # parameter perturbed in the target
    structure: str = ""  # "extra:<how>@<site>" or "missing:<how>@<site>"
    expect_divergence: bool = True
    counted: bool = True  # negatives under tf32 noise are reported apart from false alarms
    background: float = 0.0  # tf32 variant: relative error the background alone puts on the site's output
    bench_model: str = ""  # the bench's model when it differs from the target's (fused variant)

    @property
    def bench_family(self) -> str:
        return self.bench_model or self.model

    @property
    def category(self) -> str:
        site = self.site
        return "parameter" if self.kind == "weight" else category(site.op) if site else ""

    @property
    def site(self) -> Site | None:
        fault = self.target.output_fault or self.target.arg_fault
        return fault.site if fault is not None else None


@dataclass
class Profile:
    """The clean run's calls for one model, and the parameters it trains."""

    model: str
    calls: list[CallRecord]
    parameters: list[str] = field(default_factory=list)
    background: dict[Site, float] = field(default_factory=dict)  # tf32 run vs clean run, per call
    outputs: dict[Site, torch.Tensor] = field(default_factory=dict)  # clean first floating outputs


def profile(family: str, seed: int) -> Profile:
    """Run ``family`` once, clean, recording every program call (no capture involved)."""
    workload = build_workload(family, seed)
    # A relative perturbation of an all-zero parameter (GPT-2's biases at init) changes nothing.
    params = [
        n
        for n, p in workload.model.named_parameters()
        if p.requires_grad and p.dtype.is_floating_point and bool(p.detach().ne(0).any())
    ]
    injector = Injector(workload.model, Plan(), profile=True, keep_outputs=True)
    with injector.outer(), injector.inner():
        workload.train_step(workload.make_optimizer())
    noisy = build_workload(family, seed)
    tf32 = Injector(noisy.model, Plan(tf32=True), keep_outputs=True)
    with tf32.outer(), tf32.inner():
        noisy.train_step(noisy.make_optimizer())
    clean, rounded = injector.outputs or {}, tf32.outputs or {}
    background = {
        site: relative_change(clean[site], rounded[site])
        for site in clean.keys() & rounded.keys()
        if clean[site].shape == rounded[site].shape
    }
    return Profile(family, injector.calls or [], params, background, clean)


def _output_site_ok(c: CallRecord) -> bool:
    return (
        c.site.op.startswith("aten.")
        and not c.site.op.split(".")[1].startswith(("empty", "new_empty"))  # uninitialized memory
        and not c.is_view
        and not c.random
        and c.n_tensor_inputs > 0
        and c.n_float_outputs > 0
        and c.float_varies
        # Corrupting an output that shares storage with an input would also change the input,
        # which capture recorded earlier: the fault would have no single true op.
        and (c.mutable or not c.aliases_input)
    )


def _insertion_ok(c: CallRecord) -> bool:
    return _output_site_ok(c) and c.single_output and not c.mutable and c.site.phase == "forward"


def rng_for(seed: int, *parts: str) -> random.Random:
    return random.Random(zlib.crc32("/".join((str(seed), *parts)).encode()))


def choose_sites(calls: list[CallRecord], phase: str, n: int, rng: random.Random) -> list[Site]:
    """``n`` output-fault sites in ``phase``: categories in seeded order, one op each, repeating.

    Distinct ops come first; once every op was used, further rounds take other occurrences.
    """
    by_cat: dict[str, dict[str, list[CallRecord]]] = defaultdict(lambda: defaultdict(list))
    for c in calls:
        if c.site.phase == phase and _output_site_ok(c):
            by_cat[category(c.site.op)][c.site.op].append(c)
    if not by_cat:
        return []
    cats = sorted(by_cat)
    rng.shuffle(cats)
    queues = {}
    for cat in cats:
        ops = sorted(by_cat[cat])
        rng.shuffle(ops)
        queues[cat] = ops
    used: set[Site] = set()
    sites: list[Site] = []
    total = sum(len(v) for ops in by_cat.values() for v in ops.values())
    round_ = 0
    while len(sites) < min(n, total):
        for cat in cats:
            ops = queues[cat]
            op = ops[round_ % len(ops)]
            free = [c.site for c in by_cat[cat][op] if c.site not in used]
            if not free or len(sites) >= n:
                continue
            site = rng.choice(free)
            used.add(site)
            sites.append(site)
        round_ += 1
    return sites


def changes_nothing(prof: Profile, fault: OutputFault) -> bool:
    """True when ``fault`` leaves the clean output's bits as they are (fp16 rounding of -0.25)."""
    clean = prof.outputs.get(fault.site)
    if clean is None:
        return False
    faulty = clean.clone()
    corrupt_(faulty, fault.kind, fault.magnitude, fault.seed)
    return bitwise_equal(clean, faulty)


def plan_model(prof: Profile, seed: int, model_index: int, sites_per_fault: int = 4) -> list[Case]:
    """Every case for one model, in a stable order: each output fault at ``sites_per_fault`` sites
    per phase (all different while the model has enough distinct calls)."""
    m = prof.model
    calls = prof.calls
    output_kinds = [("scale", mag) for mag in MAGNITUDES] + [("noise", mag) for mag in MAGNITUDES]
    output_kinds += [("bf16", 0.0), ("fp16", 0.0), ("nan", 0.0), ("inf", 0.0), ("ulp", 0.0)]

    faults: list[tuple[str, str, float, Plan, str]] = []  # kind, phase, magnitude, plan, weight
    for phase in ("forward", "backward"):
        sites = choose_sites(calls, phase, len(output_kinds) * sites_per_fault, rng_for(seed, m, phase))
        for i in range(len(output_kinds) * sites_per_fault if sites else 0):
            kind, mag = output_kinds[i % len(output_kinds)]
            site = sites[i % len(sites)]
            fault = OutputFault(kind, site, mag, seed=zlib.crc32(f"{seed}/{m}/{site}/{kind}".encode()))
            if changes_nothing(prof, fault):
                continue
            if (kind, site) not in {
                (f[3].output_fault.kind, f[3].output_fault.site) for f in faults if f[3].output_fault
            }:
                faults.append((kind, phase, mag, Plan(output_fault=fault), ""))
    opt_sites = choose_sites(calls, "optimizer", 1, rng_for(seed, m, "optimizer"))
    for site in opt_sites:
        faults.append(("scale", "optimizer", 1e-2, Plan(output_fault=OutputFault("scale", site, 1e-2, seed=seed)), ""))
    arg_rng = rng_for(seed, m, "args")
    for op in sorted({c.site.op for c in calls if c.site.op in ARG_CHANGES}):
        name, change = ARG_CHANGES[op]
        occurrences = [c for c in calls if c.site.op == op]
        call = arg_rng.choice(occurrences)
        fault = ArgFault(call.site, name, change(call.args.get(name)))
        faults.append(("arg", call.site.phase, 0.0, Plan(arg_fault=fault), ""))
    if prof.parameters:
        param = rng_for(seed, m, "weight").choice(prof.parameters)
        faults.append(("weight", "forward", WEIGHT_PERTURBATION, Plan(), param))

    ins_candidates = [c for c in calls if _insertion_ok(c)]
    ins_rng = rng_for(seed, m, "insertion")
    # Early in the forward pass, so that most faults come after the change in structure.
    early = ins_candidates[: max(1, len(ins_candidates) // 2)]
    extra = Insertion(ins_rng.choice(early).site, INSERTIONS[model_index % len(INSERTIONS)]) if early else None
    missing = Insertion(ins_rng.choice(early).site, INSERTIONS[(model_index + 1) % len(INSERTIONS)]) if early else None

    cases: list[Case] = []
    for n, (kind, phase, mag, plan, weight) in enumerate(faults):
        label = _label(kind, mag, plan, weight)
        for variant in VARIANTS:
            target, bench, structure = plan, Plan(), ""
            if variant == "structure":
                if extra is None or missing is None:
                    continue
                if n % 2 == 0:
                    target = Plan(plan.output_fault, plan.arg_fault, extra, plan.tf32)
                    structure = f"extra:{extra.how}@{extra.site}"
                else:
                    bench = Plan(insertion=missing)
                    structure = f"missing:{missing.how}@{missing.site}"
            background = 0.0
            if variant == "tf32":
                target = Plan(plan.output_fault, plan.arg_fault, plan.insertion, tf32=True)
                site = (plan.output_fault or plan.arg_fault).site if not weight else None  # type: ignore[union-attr]
                background = prof.background.get(site, math.nan) if site is not None else 0.0
            cases.append(
                Case(
                    f"{m}/{label}/{variant}",
                    m,
                    kind,
                    variant,
                    phase,
                    mag,
                    target,
                    bench,
                    weight,
                    structure,
                    background=background,
                )
            )

    cases.append(Case(f"{m}/identical", m, "identical", "-", "", 0.0, Plan(), Plan(), expect_divergence=False))
    if extra is not None and missing is not None:
        cases.append(
            Case(
                f"{m}/exact-op-extra",
                m,
                "exact-op",
                "-",
                "",
                0.0,
                Plan(insertion=extra),
                Plan(),
                structure=f"extra:{extra.how}@{extra.site}",
                expect_divergence=False,
            )
        )
        cases.append(
            Case(
                f"{m}/exact-op-missing",
                m,
                "exact-op",
                "-",
                "",
                0.0,
                Plan(),
                Plan(insertion=missing),
                structure=f"missing:{missing.how}@{missing.site}",
                expect_divergence=False,
            )
        )
    cases.append(
        Case(
            f"{m}/tf32-only",
            m,
            "tf32-only",
            "-",
            "",
            0.0,
            Plan(tf32=True),
            Plan(),
            expect_divergence=False,
            counted=False,
        )
    )
    return cases


def _label(kind: str, mag: float, plan: Plan, weight: str) -> str:
    if kind == "weight":
        return f"weight:{weight}"
    if kind == "arg":
        assert plan.arg_fault is not None
        f = plan.arg_fault
        return f"arg:{f.name}={f.value}@{f.site.op}#{f.site.k}:{f.site.phase}"
    assert plan.output_fault is not None
    site = plan.output_fault.site
    size = f"{mag:.0e}" if mag else ""
    return f"{kind}{size}@{site.op}#{site.k}:{site.phase}"


def plan_all(
    families: tuple[str, ...] = FAMILIES, seed: int = 0, model_seed: int = 1234, sites_per_fault: int = 4
) -> list[Case]:
    """Every case for ``families`` (profiling each model once)."""
    cases: list[Case] = []
    for family in families:
        cases += plan_model(profile(family, model_seed), seed, FAMILIES.index(family), sites_per_fault)
    return cases


def quick(cases: list[Case], stride: int = 7) -> list[Case]:
    """A deterministic subset: every negative, and every ``stride``-th fault case of each model.

    Each fault appears once per variant in a row and structure alternates between extra and
    missing ops, so a stride coprime with 6 walks across variants, kinds and both phases.
    """
    out: list[Case] = []
    seen: dict[str, int] = defaultdict(int)
    for case in cases:
        if not case.expect_divergence:
            out.append(case)
            continue
        if seen[case.model] % stride == 0:
            out.append(case)
        seen[case.model] += 1
    return out
