"""Fault injection for the localization benchmark: two dispatch modes around ``TraceCompare``.

A target run is wrapped like this (the order matters)::

    inj = Injector(model, plan)
    with inj.outer():                                  # FaultMode: corrupts outputs, tf32 noise
        with tracecmp.TraceCompare(path, model=model) as tc:
            with inj.inner():                          # SiteMode: counts calls, rewrites, inserts
                train_step()
            tc.step()

The innermost mode sees each program call first. ``SiteMode`` names it ("the k-th call of op X in
phase P"), rewrites its non-tensor arguments when it is the argument-fault site (so capture records
the changed arguments, as when a program really calls ``gelu(approximate='tanh')``), and marks the
call as pending before passing it on. Capture records the call and forwards it to ``FaultMode``,
which acts only on the pending call, not on capture's own internal ops: it rounds matmul inputs
to tf32 and corrupts the site's output in place, so capture records the corrupted values as that
op's own output. After the call returns, ``SiteMode`` takes the output's checksum (with every mode
disabled, so nothing extra is recorded) to find the exact row of the trace later, and may add an
exact extra op (clone, ``mul`` by 1.0) that capture records as part of the program.

Both modes are pure pass-throughs when the plan is empty, and the bench run uses the same stack.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

OUTPUT_FAULTS = ("scale", "noise", "bf16", "fp16", "nan", "inf", "ulp")
MAGNITUDES = (1e-6, 1e-4, 1e-2, 1e-1)
INSERTIONS = ("clone", "mul1", "alias_mul1")

# Inputs rounded to tf32 in the "other device" background noise, by argument position. These are
# the ops that cuBLAS/cuDNN run on tensor cores when TF32 is allowed; the bias of addmm/baddbmm
# and everything elementwise stay fp32 there too.
TF32_ARGS: dict[str, tuple[int, ...]] = {
    "aten.mm.default": (0, 1),
    "aten.addmm.default": (1, 2),
    "aten.bmm.default": (0, 1),
    "aten.baddbmm.default": (1, 2),
    "aten.convolution.default": (0, 1),
    "aten.convolution_backward.default": (0, 1, 2),
}

_INT_VIEW = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def round_tf32(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) with its mantissa rounded to tf32's 10 bits, round-to-nearest-even.

    Done on the bit pattern, so it is exact and device independent; NaN and Inf pass unchanged,
    and a value that rounds past the largest finite number becomes Inf, as the hardware does.

    >>> round_tf32(torch.tensor([1.0 + 2**-11, 1.0 + 3 * 2**-11])).tolist()
    [1.0, 1.001953125]
    """
    if x.dtype != torch.float32:
        return x
    bits = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    keep_lsb = (bits >> 13) & 1
    rounded = (bits + 0x0FFF + keep_lsb) & 0xFFFFE000
    special = (bits & 0x7F800000) == 0x7F800000  # exponent all ones: Inf or NaN
    out = torch.where(special, bits, rounded)
    out = torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)
    return out.view(torch.float32).reshape(x.shape)


def truncate_tf32(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) with the 13 mantissa bits tf32 lacks cleared: rounding toward zero, as a
    tensor core does that takes float32 operands as they are. Its error is biased (every product
    shrinks), unlike :func:`round_tf32`'s.

    >>> truncate_tf32(torch.tensor([1.0 + 3 * 2**-11])).tolist()
    [1.0009765625]
    """
    if x.dtype != torch.float32:
        return x
    return (x.contiguous().view(torch.int32) & ~0x1FFF).view(torch.float32).reshape(x.shape)


def in_layout_of(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``values`` in ``x``'s memory layout. A tensor core rounds its operands inside the kernel, so
    the kernel still sees the layout the program passed (a weight's ``t()``); handing it a
    contiguous copy instead can change its summation order, and with it bits that a replay of the
    recorded call, in the recorded layout, reproduces."""
    out = torch.empty_like(x)  # keeps a dense tensor's strides
    out.copy_(values)
    return out


# How the background rounds matmul/conv inputs to tf32 (``--tf32-rounding``, set in every worker).
TF32_ROUNDINGS: dict[str, Any] = {"nearest": round_tf32, "zero": truncate_tf32}
TF32_ROUNDING = {"how": "nearest"}


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` hold the same bits (NaN payloads and signed zeros included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.dtype.is_floating_point:
        return bool(torch.equal(a, b))
    view = _INT_VIEW[a.element_size()]
    return bool(torch.equal(a.contiguous().view(view), b.contiguous().view(view)))


def relative_change(clean: torch.Tensor, other: torch.Tensor) -> float:
    """``||other - clean|| / ||clean||`` in float64; inf when ``other`` has a NaN/Inf ``clean`` lacks.

    >>> relative_change(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.5]))
    0.1
    """
    a, b = clean.detach().double(), other.detach().double()
    if not torch.equal(torch.isfinite(a), torch.isfinite(b)):
        return math.inf
    finite = torch.isfinite(a)
    diff = float((b[finite] - a[finite]).norm())
    scale = float(a[finite].norm())
    return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)


def corrupt_(t: torch.Tensor, kind: str, magnitude: float, seed: int) -> None:
    """Apply one output fault to ``t`` in place (float tensors only).

    >>> x = torch.ones(4); corrupt_(x, "scale", 0.5, 0); x.tolist()
    [1.5, 1.5, 1.5, 1.5]
    """
    with torch.no_grad():
        if kind == "scale":
            t.copy_((t.double() * (1.0 + magnitude)).to(t.dtype))
        elif kind == "noise":
            # A private generator: drawing from the global one would shift every later random op.
            gen = torch.Generator().manual_seed(seed)
            noise = torch.randn(t.shape, generator=gen, dtype=torch.float64)
            t.copy_((t.double() * (1.0 + magnitude * noise)).to(t.dtype))
        elif kind in ("bf16", "fp16"):
            low = torch.bfloat16 if kind == "bf16" else torch.float16
            t.copy_(t.to(low).to(t.dtype))
        elif kind in ("nan", "inf", "ulp"):
            # One element: NaN, Inf, or the next representable value (the smallest possible fault,
            # which only a bitwise comparison can see).
            flat_index = random.Random(seed).randrange(t.numel())
            index = tuple(_unravel(flat_index, t.shape))
            if kind == "ulp":
                t[index] = torch.nextafter(t[index], torch.tensor(math.inf, dtype=t.dtype))
            else:
                t[index] = math.nan if kind == "nan" else math.inf
        else:
            raise ValueError(f"unknown output fault {kind!r}")


@dataclass(frozen=True, order=True)
class Site:
    """The ``k``-th call (0-based) of aten overload ``op`` in ``phase`` of the (single) step."""

    op: str
    phase: str
    k: int

    def __str__(self) -> str:
        return f"{self.op}#{self.k} ({self.phase})"


@dataclass(frozen=True)
class OutputFault:
    """Corrupt the first floating output of the call at ``site``."""

    kind: str  # one of OUTPUT_FAULTS
    site: Site
    magnitude: float = 0.0
    seed: int = 0


@dataclass(frozen=True)
class ArgFault:
    """Call ``site`` with the non-tensor argument ``name`` set to ``value``."""

    site: Site
    name: str
    value: Any


@dataclass(frozen=True)
class Insertion:
    """Add exact extra ops (``how`` in INSERTIONS) after the single output of ``site``."""

    site: Site
    how: str


@dataclass(frozen=True)
class Plan:
    """Everything one run does differently from a clean run."""

    output_fault: OutputFault | None = None
    arg_fault: ArgFault | None = None
    insertion: Insertion | None = None
    tf32: bool = False


@dataclass
class CallRecord:
    """One program call as the profiling pass saw it (no tensors kept)."""

    site: Site
    module: str  # our own expectation of the module path
    is_view: bool
    mutable: bool
    random: bool
    n_tensor_inputs: int
    n_float_outputs: int
    single_output: bool  # exactly one returned value, a tensor: where an insertion may go
    aliases_input: bool  # a non-mutating op whose output shares storage with an input (_unsafe_view)
    float_varies: bool  # the first floating output is non-empty and not constant
    args: dict[str, Any]  # non-tensor arguments by schema name


@dataclass
class Observation:
    """What the injection did in one run; filled in as the run goes."""

    site_reached: bool = False
    fault_applied: bool = False
    effective: bool | None = None  # the fault changed at least one bit
    site_checksums: list[int] = field(default_factory=list)  # outputs of the fault/arg site
    site_module: str | None = None  # our own expectation of the site's module
    arg_before: Any = None
    inserted: bool = False
    tf32_calls: int = 0
    fault_size: float | None = None  # ||faulty - clean|| / ||clean|| of the site's output


def _float_outputs(out: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(out)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.dtype.is_floating_point]


def _results(func: Any, args: tuple, kwargs: dict, out: Any) -> list[torch.Tensor]:
    """What a call produced: its floating outputs, or for an in-place op that returns nothing
    (``_fused_adamw_``, ``_foreach_add_``) the floating tensors it wrote."""
    floats = _float_outputs(out)
    if floats or not func._schema.is_mutable:
        return floats
    written = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(a.name)
            written.extend(_float_outputs(value))
    return written


def set_argument(
    func: torch._ops.OpOverload, args: tuple, kwargs: dict, name: str, value: Any
) -> tuple[tuple, dict, Any]:
    """Return ``(args, kwargs, old_value)`` with the schema argument ``name`` replaced by ``value``."""
    schema_args = func._schema.arguments
    position = next((i for i, a in enumerate(schema_args) if a.name == name), None)
    if position is None:
        raise ValueError(f"{func} has no argument {name!r}")
    if position < len(args):
        old = args[position]
        args = (*args[:position], value, *args[position + 1 :])
    else:
        old = kwargs.get(name, schema_args[position].default_value)
        kwargs = {**kwargs, name: value}
    return args, kwargs, old


def argument_values(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Non-tensor arguments of a call by schema name, defaults filled in."""
    values: dict[str, Any] = {}
    for i, a in enumerate(func._schema.arguments):
        v = args[i] if i < len(args) else kwargs.get(a.name, a.default_value if a.has_default_value() else None)
        if not isinstance(v, (torch.Tensor, list, tuple)) or (
            isinstance(v, (list, tuple)) and not any(isinstance(e, torch.Tensor) for e in v)
        ):
            values[a.name] = v
    return values


class _Shared:
    """State passed from the inner mode to the outer one for the call in flight."""

    def __init__(self) -> None:
        self.pending: torch._ops.OpOverload | None = None
        self.site: Site | None = None


class _Phases:
    """forward / backward / optimizer, as the benchmark defines them (independently of capture)."""

    def __init__(self) -> None:
        self.in_optimizer = 0
        self._handles: list[Any] = []

    def current(self) -> str:
        if self.in_optimizer:
            return "optimizer"
        return "backward" if torch._C._current_autograd_node() is not None else "forward"

    def install(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        def enter(*_: Any) -> None:
            self.in_optimizer += 1

        def leave(*_: Any) -> None:
            self.in_optimizer -= 1

        self._handles = [register_optimizer_step_pre_hook(enter), register_optimizer_step_post_hook(leave)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class _Modules:
    """Our own module expectation: forward from module hooks, backward through autograd seq numbers.

    A backward op belongs to the module whose forward created its autograd node. The node created
    by a forward op has sequence number ``counter - 1`` right after the op, and the first op to see
    a counter value is the one that created the node before it.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.names = {id(m): name for name, m in model.named_modules()}
        self.stack: list[str] = []
        self.by_seq: dict[int, str] = {}
        self._handles: list[Any] = []

    def install(self) -> None:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        def pre(module: torch.nn.Module, *_: Any) -> None:
            self.stack.append(self.names.get(id(module), self.stack[-1] if self.stack else ""))

        def post(module: torch.nn.Module, *_: Any) -> None:
            if self.stack:
                self.stack.pop()

        self._handles = [register_module_forward_pre_hook(pre), register_module_forward_hook(post, always_call=True)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.stack = []

    def expected(self, phase: str) -> str:
        if phase == "forward":
            return self.stack[-1] if self.stack else ""
        if phase == "backward":
            node = torch._C._current_autograd_node()
            return self.by_seq.get(node._sequence_nr(), "?") if node is not None else "?"
        return ""

    def after_forward_op(self, module: str) -> None:
        self.by_seq.setdefault(torch._C._autograd._get_sequence_nr() - 1, module)


class SiteMode(TorchDispatchMode):
    """The inner mode: names every program call, applies argument faults and insertions."""

    def __init__(
        self,
        plan: Plan,
        shared: _Shared,
        obs: Observation,
        phases: _Phases,
        modules: _Modules,
        profile: list[CallRecord] | None,
        outputs: dict[Site, torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.plan, self.shared, self.obs = plan, shared, obs
        self.phases, self.modules, self.profile = phases, modules, profile
        self.outputs = outputs
        self.counts: Counter[tuple[str, str]] = Counter()
        watch = [f.site for f in (plan.output_fault, plan.arg_fault) if f is not None]
        self.watch = set(watch)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = str(func)
        phase = self.phases.current()
        k = self.counts[(name, phase)]
        self.counts[(name, phase)] = k + 1
        site = Site(name, phase, k)
        module = self.modules.expected(phase)
        arg_fault = self.plan.arg_fault
        original = None
        if arg_fault is not None and site == arg_fault.site:
            original = (args, kwargs)
            args, kwargs, self.obs.arg_before = set_argument(func, args, kwargs, arg_fault.name, arg_fault.value)
        self.shared.pending, self.shared.site = func, site
        try:
            out = func(*args, **kwargs)
        finally:
            self.shared.pending = None
        if phase == "forward":
            self.modules.after_forward_op(module)
        if site in self.watch:
            self.obs.site_reached = True
            self.obs.site_module = module
            self.obs.site_checksums = _checksums(_results(func, args, kwargs, out))
        if original is not None:
            # Did the changed argument change anything? (Argument-fault ops are functional, so
            # running the original call again, outside every mode, has no side effect.)
            with _disable_current_modes():  # nothing of this may reach capture
                reference = func(*original[0], **original[1])
                self.obs.effective = not all(
                    bitwise_equal(a, b) for a, b in zip(_float_outputs(out), _float_outputs(reference))
                )
                self.obs.fault_size = relative_change(_float_outputs(reference)[0], _float_outputs(out)[0])
        insertion = self.plan.insertion
        if insertion is not None and site == insertion.site and isinstance(out, torch.Tensor):
            out = _insert(out, insertion.how)
            self.obs.inserted = True
        if self.profile is not None:
            self.profile.append(_call_record(site, module, func, args, kwargs, out))
        if self.outputs is not None:
            floats = [t for t in _float_outputs(out) if t.numel() > 0]
            if floats:
                with _disable_current_modes():
                    self.outputs[site] = floats[0].detach().clone()
        return out


def _insert(out: torch.Tensor, how: str) -> torch.Tensor:
    # Called from inside SiteMode, so capture (the next mode down) records these as program ops.
    aten = torch.ops.aten
    if how == "clone":
        return aten.clone.default(out)
    if how == "mul1":
        return aten.mul.Tensor(out, 1.0)
    if how == "alias_mul1":
        return aten.mul.Tensor(aten.alias.default(out), 1.0)
    raise ValueError(f"unknown insertion {how!r}")


def _checksums(out: Any) -> list[int]:
    from tracecmp.capture.stats import checksum_reference

    with _disable_current_modes():
        return [int(checksum_reference(t)) for t in _float_outputs(out)]


def _call_record(site: Site, module: str, func: Any, args: tuple, kwargs: dict, out: Any) -> CallRecord:
    flat_in, _ = tree_flatten((args, kwargs))
    floats = [t for t in _float_outputs(out) if t.numel() > 0]
    in_storages = {t.untyped_storage().data_ptr() for t in flat_in if isinstance(t, torch.Tensor)}
    varies = False
    if floats and floats[0].numel() > 1:
        with _disable_current_modes():
            first = floats[0].detach()
            low, high = torch.aminmax(first)
            if not (bool(torch.isfinite(low)) and bool(torch.isfinite(high))):
                # rare: select the finite values (a copy), which the common case need not pay for
                first = first[torch.isfinite(first)]
                low, high = (first.min(), first.max()) if first.numel() else (low, low)
            varies = first.numel() > 1 and bool(low != high)
    return CallRecord(
        site=site,
        module=module,
        is_view=func.is_view,
        mutable=func._schema.is_mutable,
        random=torch.Tag.nondeterministic_seeded in func.tags,
        n_tensor_inputs=sum(isinstance(t, torch.Tensor) for t in flat_in),
        n_float_outputs=len(floats),
        single_output=isinstance(out, torch.Tensor),
        aliases_input=bool(floats) and floats[0].untyped_storage().data_ptr() in in_storages,
        float_varies=varies,
        args=argument_values(func, args, kwargs),
    )


class FaultMode(TorchDispatchMode):
    """The outer mode: acts only on the call SiteMode marked pending, never on capture's own ops."""

    def __init__(self, plan: Plan, shared: _Shared, obs: Observation) -> None:
        super().__init__()
        self.plan, self.shared, self.obs = plan, shared, obs

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.shared.pending is not func:
            return func(*args, **kwargs)
        self.shared.pending = None
        site = self.shared.site
        name = str(func)
        if self.plan.tf32 and name in TF32_ARGS:
            positions = TF32_ARGS[name]
            args = tuple(
                in_layout_of(a, TF32_ROUNDINGS[TF32_ROUNDING["how"]](a))
                if i in positions and isinstance(a, torch.Tensor)
                else a
                for i, a in enumerate(args)
            )
            self.obs.tf32_calls += 1
        out = func(*args, **kwargs)
        fault = self.plan.output_fault
        if fault is not None and site == fault.site:
            floats = [t for t in _results(func, args, kwargs, out) if t.numel() > 0]
            if floats:
                target = floats[0]
                before = target.clone()
                corrupt_(target, fault.kind, fault.magnitude, fault.seed)
                self.obs.fault_applied = True
                self.obs.effective = not bitwise_equal(before, target)
                self.obs.fault_size = relative_change(before, target)
        return out


class Injector:
    """Builds the two modes for one run of ``model`` under ``plan``; see the module docstring.

    >>> model = torch.nn.Linear(4, 2)
    >>> inj = Injector(model, Plan(output_fault=OutputFault("scale", Site("aten.addmm.default", "forward", 0), 0.1)))
    >>> with inj.outer(), inj.inner():
    ...     y = model(torch.ones(1, 4))
    >>> inj.obs.fault_applied, inj.obs.effective
    (True, True)
    """

    def __init__(self, model: torch.nn.Module, plan: Plan, profile: bool = False, keep_outputs: bool = False) -> None:
        self.plan = plan
        self.obs = Observation()
        self.calls: list[CallRecord] | None = [] if profile else None
        # Each call's first floating output (a copy), to measure the tf32 background per site.
        self.outputs: dict[Site, torch.Tensor] | None = {} if keep_outputs else None
        self._shared = _Shared()
        self._phases = _Phases()
        self._modules = _Modules(model)
        # One SiteMode for the whole run, so that call counts go on across steps when a run
        # enters inner() once per step (as it must: TraceCompare leaves and re-enters its own
        # mode at a step's hand-over, which pops whatever mode sits above it).
        self._site_mode = SiteMode(plan, self._shared, self.obs, self._phases, self._modules, self.calls, self.outputs)

    @contextmanager
    def outer(self) -> Iterator[None]:
        with FaultMode(self.plan, self._shared, self.obs):
            yield

    @contextmanager
    def inner(self) -> Iterator[None]:
        self._phases.install()
        self._modules.install()
        try:
            with self._site_mode:
                yield
        finally:
            self._modules.remove()
            self._phases.remove()


def _unravel(flat: int, shape: torch.Size) -> list[int]:
    """The index of element ``flat`` of a contiguous tensor of ``shape`` (torch.unravel_index is 2.2+)."""
    index = []
    for size in reversed(shape):
        flat, position = divmod(flat, size)
        index.append(position)
    return index[::-1]
