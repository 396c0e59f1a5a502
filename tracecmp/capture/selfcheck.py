"""Capture-time self-check: did each op compute what its own recorded inputs ask? (issue 36)

Around one op call, :meth:`SelfChecker.prepare` gathers, *before* the op runs (an in-place op
overwrites its inputs), the input values behind a small random sample of output elements or rows;
:meth:`SelfChecker.finish` recomputes those outputs from them in float64 and compares. A kernel
fault (a wrong scale, inputs silently rounded to fp16/bf16, noise) is so visible on the op that made
it, without any bench run. In a capture (``finish(defer=True)``) only the gathering happens at the
op: the recomputation of calls alike (the same op, constants, shapes and dtypes: an optimizer's
per-parameter ops, a model's repeated layers) waits for the step's hand-over, where one float64
pass serves all of them (:meth:`SelfChecker.collect`). Pointwise ops and exact copies go further:
once a signature (op, other arguments, input dtypes and shapes) recurs, its :class:`Recipe` lets
the C per-op path draw the sample and read the values behind it by pointer, with no Python at the
op (``csrc/record_check.cpp``; :meth:`SelfChecker.gather_sampled` and
:meth:`SelfChecker.finish_sampled` are its reference).

The residual of one sampled element, ``ref`` its float64 recomputation::

    r = |out - ref| / (eps_out * |ref| + eps_acc * scale + tiny)

``eps_out`` is the output dtype's machine epsilon, ``eps_acc`` the epsilon of the precision the
kernel works in (float32 on CPU for float32, bf16 and fp16 ops; TF32/bf16/fp16 where float32
matmuls or convolutions may run on reduced-precision matrix units), ``tiny`` the output dtype's
smallest normal number (flushed subnormals and exact zeros stay finite), and ``scale`` the
magnitude of what the kernel combined: the same op applied to absolute inputs (``|A| @ |B| +
|bias|``, ``conv(|x|, |w|) + |b|``, ``sum |x|``), for pointwise ops ``|f(|x|...)|``, the size of
the op's terms before they cancel (so an internal step such as ``1 + erf(x)`` in gelu, or ``alpha
* b`` in add, does not pass for a fault), and 0 for ops rounded once or accurate to their result
(``mul``, ``exp``). The residual of a check is the largest over its sample; an output non-finite
where the (output-rounded) reference is finite gives ``inf``; an element whose reference is itself
NaN or Inf (from NaN/Inf inputs, ``gelu(-inf)``) is not judged: kernels differ there.

Why honest kernels stay within :func:`limit_for`: rounding the result once costs at most half an
``eps_out`` relative to ``|ref|`` (r <= 1/2); a few-ulp transcendental, or steps of the working
precision, cost a few ``eps_acc`` of ``scale``. Summing ``n`` terms adds, beside that, an error
that grows like ``sqrt(n)`` rounding steps of the running sum (randomly signed roundings), which
is at most ``scale``. Because ``r`` is a mediant of the two sources, r <= max(output part,
accumulation part), and the accumulation part only counts in proportion to its share of the
denominator, ``eps_acc / (eps_out + eps_acc)``: it matters at float32 (share 1/2), hardly at bf16
(share 2^-16). Hence ``limit = BASE + GROWTH * sqrt(n) * eps_acc / (eps_out + eps_acc)``. A fault
of relative size ``d`` gives ``r ~ d / eps_out * |ref| / (|ref| + scale)``: 8400 for 1e-3 on a
float32 pointwise op, still ~300 for a K=4096 random-sign float32 matmul (|ref|/scale ~
1/sqrt(K), limit 19), and 6.4 for 5% on bf16, all above the limit (``tests/unit/test_selfcheck.py``).
The same 1/sqrt(n) makes a fault in one long random-sign sum (a dot product, a full ``sum`` of
10^5 terms) hard to see: such calls check, but their residual separates less.

Pointwise ops of 16-bit outputs may round intermediate terms (``alpha * b`` in add) at their own
precision: the terms' cancellation ``|f(|x|)| - |f(x)|`` joins the scale at ``eps_out``. A reduction
to a single element keeps per-thread partial sums in the output dtype, so 16-bit ones accumulate at
``eps_out``. Left out: out= overloads, random ops, ops whose result jumps with a rounded quotient
(remainder, floor_divide, rounding div), pointwise ops of integer-only inputs, 16-bit transposed
convolutions (CPU sums overlapping taps at 16 bits), ``_addmm_activation`` with gelu, a
convolution's bias gradient and, with ``full``, grouped or transposed weight gradients, fused
attention with dropout (its draws) or a causal mask over unequal lengths (kernels align it
differently), and attention's backward. Fused attention's output rows are recomputed from the
row's query and its batch and head's keys and values; its ``scale`` is the weighted ``|v|``,
widened by the scores' own reach (``|q|·|k|``, whose float32 rounding exp turns into relative
error), and 16-bit kernels may round the weights at the output's precision. A sampled
convolution (and its gradients) recomputes each sampled element from the taps that made it,
gathered by index; ``full`` recomputes whole batch elements (input, output) or output channels
(weight gradient), as transposed convolutions always do.
16-bit convolution gradients are summed at 16 bits with cancellation, and 16-bit batch norms
normalize with statistics held at 16 bits: so wide an allowance per element that a 5% scale hides
in each; their checks also fit one scale through the whole sample (:func:`_coherent`), which
rounding errors of either sign do not make and a scaled kernel does. Batch norm is layer norm's
computation over each channel's batch and positions: sampled channels are checked whole.
``nll_loss`` reads one log-probability a row: its loss from every row, its gradient at the
sampled rows' targets (the only nonzero of each row). 2-D max pooling's output is the largest of
its window's taps, exactly; its gradient, at the elements sampled windows picked, the sum of the
output gradients of every window that picked each.

>>> import torch
>>> checker = SelfChecker(sample=8)
>>> a, b = torch.randn(64, 64), torch.randn(64, 64)
>>> plan = checker.prepare(torch.ops.aten.mm.default, (a, b), {})
>>> [c.residual <= c.limit for c in checker.finish(plan, a @ b)]
[True]
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_flatten

from tracecmp.aten.rounding import REDUCED_MODELS
from tracecmp.capture import native
from tracecmp.capture.stats import tensor_stats

__all__ = [
    "QUEUE_MAX",
    "RECIPE_KINDS",
    "SUMS_AT_16_BITS",
    "Check",
    "Plan",
    "Recipe",
    "SelfChecker",
    "draw",
    "limit_for",
    "special_ops",
]

aten = torch.ops.aten
F64 = torch.float64
EPS32 = torch.finfo(torch.float32).eps
# Epsilons of the formats a float32 matmul/conv may run at on matrix units (10 or 7 mantissa bits).
REDUCED_EPS = {"tf32": 2.0**-10, "bf16": 2.0**-7, "fp16": 2.0**-10}
# limit = BASE + GROWTH * sqrt(n) * share (module docstring). BASE covers output rounding (1/2) and
# few-ulp kernels; GROWTH covers randomly signed roundings of a running sum of n terms, including
# positive-only sums, where the running sum is as large as the result (measured in the tests).
BASE = 3.0
GROWTH = 0.5
# Ops that only move values are recomputed whole in float64: up to this many input elements
# (128 MiB of float64), so that a check never holds much more memory than the op itself.
MOVED_MAX = 1 << 24
# The t-statistic of a scale fitted through a sample that rounding alone stays below (:func:`_coherent`).
COHERENT_T = 8.0
# Deferred checks held at most (their gathered values) before they are recomputed together.
QUEUE_MAX = 4096
# Deferred checks of calls alike are stacked this many at a time while they wait.
CHUNK = 8
# Exact copies: same dtype must be bit-equal; a cast may round once (half an ulp).
EXACT_LIMIT = {True: 0.0, False: 0.5}


class Check(NamedTuple):
    """The self-check of one output of one op call (see the module docstring for ``residual``).

    >>> Check(0, 0.4, 3.4, 16, "pointwise").residual <= 3.4
    True
    """

    index: int  # position among the op's tensor outputs, in tree_flatten order of ``out``
    # float on CPU; a 0-d float64 tensor on the output's device elsewhere; NaN until collected
    # where deferred (``ticket``)
    residual: float | torch.Tensor
    limit: float  # what an honest kernel stays within for this op, dtype, accumulation length
    sampled: int  # elements (pointwise, exact, matmul, batch) or rows (rows) recomputed
    how: str  # "pointwise", "matmul", "batch", "rows", "exact"
    # A float32 matmul/conv allowed reduced precision: its residual under the precision's whole
    # allowance, in units of ``limit`` (``residual`` is then the best of its rounding models, held
    # to float32 accumulation). Elsewhere equal to ``residual``.
    coarse: float | torch.Tensor | None = None
    # A deferred check (finish(defer=True)): its place in what SelfChecker.collect returns next.
    ticket: int | None = None


class _Batch(NamedTuple):
    """A recomputation as one function of tensors gathered per call, so that the calls alike
    (same function, constants, shapes and dtypes: ``key``) of a step share its float64 ops.
    The tensors are the call's own copies: the program may write its inputs before they are read."""

    key: tuple[Any, ...]
    # the gathered tensors stacked, one leading row per call -> (ref, scale[, excess]), each (calls, ...)
    fn: Callable[..., tuple[torch.Tensor, ...]]
    tensors: tuple[torch.Tensor, ...]
    # the same -> the recomputation under each of the device's rounding models (see _Target.fitted)
    fitted: Callable[..., list[torch.Tensor]] | None = None


class _Target(NamedTuple):
    """One output to compare: which, where its sampled values are, and their float64 recomputation."""

    index: int
    gather: Callable[[torch.Tensor], torch.Tensor]  # the op's output -> its sampled values
    # -> (ref, scale[, excess]) float64; excess: terms' magnitude the kernel may round at eps_out.
    # None where ``batch`` recomputes it.
    ref: Callable[[], tuple[torch.Tensor, ...]] | None
    n: int  # accumulation length (terms summed per output element)
    eps_acc: float | None  # working precision's epsilon; None: min(eps_out, float32's)
    how: str
    sampled: int
    source_dtype: torch.dtype | None = None  # exact copies: the dtype copied from
    # float32 matmul/conv at a declared reduced precision: the recomputation with its operands
    # rounded by each way a device may round them (aten.rounding.REDUCED_MODELS)
    fitted: Callable[[], list[torch.Tensor]] | None = None
    # Also fit one scale through the sample (:func:`_coherent`): where the per-element allowance
    # is wide (16-bit sums with cancellation) a scaled output still shows as a whole.
    coherent: bool = False
    # The recomputation as a function of gathered tensors, in place of ``ref`` and ``fitted``: for
    # this call alone, or once for all its calls alike where the check is deferred.
    batch: _Batch | None = None

    def recompute(self) -> tuple[torch.Tensor, ...]:
        """``(ref, scale[, excess])`` of this call alone, in float64."""
        if self.batch is None:
            assert self.ref is not None
            return self.ref()
        return tuple(v[0] if v.dim() else v for v in self.batch.fn(*(t[None] for t in self.batch.tensors)))


class Plan(NamedTuple):
    """What :meth:`SelfChecker.prepare` gathered for one op call; handed back to ``finish``."""

    func: Any
    targets: tuple[_Target, ...]
    # What the op wrote where it returns nothing (an in-place _foreach_ op: its self list)
    written: tuple[torch.Tensor, ...] = ()


def limit_for(n: int, eps_out: float, eps_acc: float) -> float:
    """The residual an honest kernel stays within, summing ``n`` terms (module docstring).

    >>> round(limit_for(1, 2.0**-23, 2.0**-23), 3)
    3.25
    """
    return BASE + GROWTH * math.sqrt(n) * eps_acc / (eps_out + eps_acc)


def _plain(t: object) -> bool:
    """A dense tensor with data: not a subclass (fake, functional, DTensor), sparse, or meta."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided and not t.is_meta  # type: ignore[union-attr]


def _real(t: torch.Tensor) -> bool:
    return not (t.is_complex() or t.numel() == 0)


def _floating(*tensors: torch.Tensor | None) -> bool:
    """Every tensor given (None skipped) is a plain, real, non-empty floating tensor."""
    return all(t is None or (_plain(t) and _real(t) and t.is_floating_point()) for t in tensors)


def _bind(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The op's arguments by schema name, defaults filled in."""
    names, defaults = _schema_arguments(func)
    bound = dict(zip(names, args))
    for name in names[len(args) :]:
        if name in kwargs:
            bound[name] = kwargs[name]
        elif name in defaults:
            bound[name] = defaults[name]
    return bound


@functools.lru_cache(maxsize=None)
def _schema_arguments(func: Any) -> tuple[tuple[str, ...], dict[str, Any]]:
    """An overload's argument names in order, and the defaults of those that have one (read once:
    walking a schema costs more than the rest of a check's preparation)."""
    arguments = func._schema.arguments
    return tuple(a.name for a in arguments), {a.name: a.default_value for a in arguments if a.has_default_value()}


def _take(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Elements at row-major logical ``index`` of ``t`` (any strides, expanded views too): a fresh
    tensor of index's shape, so gathering never copies the whole of ``t``."""
    return torch.take(t, index if t.is_cpu else index.to(t.device))


def _row_index(rows: torch.Tensor, length: int) -> torch.Tensor:
    """Flat indices of whole rows ``rows`` of a row-major (R, length) layout: shape (k, length)."""
    return rows[:, None] * length + torch.arange(length)


def _nonneg(x: Any) -> Any:
    """|x| for the scale: tensors and numbers alike, bools (masks, flags) untouched."""
    if isinstance(x, torch.Tensor):
        return x if x.dtype == torch.bool else x.abs()
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return abs(x)
    return x


def _finite_scale(scale: torch.Tensor) -> torch.Tensor:
    # An absolute-input recomputation may overflow (exp(|x|)) or leave its domain: an unbounded or
    # undefined scale would excuse anything, so count it as nothing beyond the relative term.
    return torch.nan_to_num(scale, nan=0.0, posinf=0.0, neginf=0.0)


def _eps_matrix(dtype: torch.dtype, device: torch.device, conv: bool, declared: str | None) -> float | None:
    """Working epsilon of a matmul or convolution, where it may differ from the default."""
    if dtype == torch.float32:
        if declared is not None:
            return REDUCED_EPS[declared]
        if device.type == "cuda":
            if conv:
                return REDUCED_EPS["tf32"] if torch.backends.cudnn.allow_tf32 else None
            precision = torch.get_float32_matmul_precision()
            if precision == "medium":
                return REDUCED_EPS["bf16"]
            if precision == "high" or torch.backends.cuda.matmul.allow_tf32:
                return REDUCED_EPS["tf32"]
    elif device.type == "cuda" and not conv:
        # cuBLAS may reduce split-K partial sums in the output's own 16-bit format where allowed.
        flag = {
            torch.float16: "allow_fp16_reduced_precision_reduction",
            torch.bfloat16: "allow_bf16_reduced_precision_reduction",
        }
        if getattr(torch.backends.cuda.matmul, flag.get(dtype, ""), False):
            return torch.finfo(dtype).eps
    return None


_set_grad_enabled = torch._C._set_grad_enabled


class _Quietly:
    """Grad off around a check's own ops (``torch.no_grad`` without building a context object
    per call: ``torch.set_grad_enabled`` is a class, constructed at every call)."""

    __slots__ = ("_grad",)

    def __enter__(self) -> None:
        self._grad = torch.is_grad_enabled()
        _set_grad_enabled(False)

    def __exit__(self, *exc: object) -> None:
        _set_grad_enabled(self._grad)


class SelfChecker:
    """Recomputes a sample of each op call's outputs in float64 and reports residuals.

    ``sample``: elements (or rows) per output; ``seed``: of the checker's own CPU generator (the
    program's RNG is never touched); ``full``: recompute every element; ``reduced_precision``:
    "tf32", "bf16" or "fp16" where the device's matrix units run float32 matmuls/convolutions so.

    >>> import torch
    >>> checker = SelfChecker(sample=4)
    >>> x = torch.randn(10)
    >>> plan = checker.prepare(torch.ops.aten.exp.default, (x,), {})
    >>> check, = checker.finish(plan, torch.exp(x))
    >>> (check.how, check.sampled, check.residual <= check.limit)
    ('pointwise', 4, True)
    >>> checker.prepare(torch.ops.aten.bernoulli.default, (x,), {}) is None
    True
    """

    def __init__(self, sample: int = 16, seed: int = 0, full: bool = False, reduced_precision: str | None = None):
        if reduced_precision is not None and reduced_precision not in REDUCED_EPS:
            raise ValueError(
                f"reduced_precision must be one of {sorted(REDUCED_EPS)} or None, not {reduced_precision!r}"
            )
        self.sample, self.full, self.reduced_precision = sample, full, reduced_precision
        self._gen = torch.Generator().manual_seed(seed)
        self._starts = random.Random(seed)  # where runs of adjacent indices start (:meth:`_block`)
        # Each op overload seen: its check, or None where it has none (read by the C capture path too)
        self.kinds: dict[Any, Callable[..., tuple[_Target, ...] | None] | None] = {}
        # Deferred checks by what their calls alike share
        self._queue: dict[tuple[Any, ...], _Group] = {}
        self._queued = 0
        # Residuals and coarse residuals of the deferred checks by ticket, until collected (NaN: not measured)
        self._residuals: list[float | torch.Tensor] = []
        self._coarse: list[float | torch.Tensor] = []
        self._shared: dict[tuple[Any, ...], tuple[tuple[Any, ...], Any]] = {}
        self._quietly = _Quietly()
        # Sampled pointwise checks on the per-op path (read and written by csrc/record_check.cpp
        # too): each signature's recipe (None: checked the usual way), those made, the draws' stream.
        self.recipes: dict[tuple[Any, ...], Recipe | None] = {}
        self._made: list[Recipe] = []
        self._used: set[int] = set()  # ids of the recipes that served a call since the last collect
        self._stream = seed & _MASK64
        self._queue_max = QUEUE_MAX

    def shared(self, key: tuple[Any, ...], make: Callable[[], Any]) -> tuple[tuple[Any, ...], Any]:
        """The first key equal to ``key`` and what ``make`` made for it: one object for all calls alike."""
        found = self._shared.get(key)
        if found is None:
            found = self._shared[key] = (key, make())
        return found

    # --- the two calls around an op ---

    def prepare(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Plan | None:
        """Gather what the check of this call needs; None where the op is not checkable.

        >>> import torch
        >>> SelfChecker().prepare(torch.ops.aten.nonzero.default, (torch.ones(3),), {}) is None
        True
        """
        kind = self.kind_of(func)
        if kind is None:
            return None
        try:
            with self._quietly:
                targets = kind(self, func, args, kwargs)
        except (RuntimeError, TypeError, ValueError, IndexError):
            # An argument combination this module does not model: leave the call unchecked
            # rather than fail the user's program.
            return None
        if not targets:
            return None
        return Plan(func, targets, _written(kind, func, args, kwargs))

    def kind_of(self, func: Any) -> Callable[..., tuple[_Target, ...] | None] | None:
        """The check an op overload gets (None: none), classified at its first call (the per-op
        path reads the result from ``kinds``).

        >>> import torch
        >>> checker = SelfChecker()
        >>> checker.kind_of(torch.ops.aten.nonzero.default) is None
        True
        >>> checker.kind_of(torch.ops.aten.exp.default) is not None
        True
        """
        kind = self.kinds.get(func, _UNSEEN)
        if kind is _UNSEEN:
            kind = self.kinds[func] = _classify(func)
        return kind

    def finish(self, plan: Plan, out: Any, defer: bool = False) -> list[Check]:
        """Compare the op's outputs ``out`` against the float64 recomputation planned for them.

        With ``defer``, the sampled outputs are gathered now and the recomputation of a check that
        has calls alike waits, to run once for all of them: such a check carries a ``ticket``, its
        place in what :meth:`collect` returns next.

        >>> import torch
        >>> checker, x = SelfChecker(), torch.randn(5)
        >>> plan = checker.prepare(torch.ops.aten.mul.Tensor, (x, 2.0), {})
        >>> [c.residual for c in checker.finish(plan, x * 2.0)]
        [0.0]
        >>> plan = checker.prepare(torch.ops.aten.mul.Tensor, (x, 2.0), {})
        >>> (check,) = checker.finish(plan, x * 2.0, defer=True)
        >>> residuals, coarse = checker.collect()
        >>> (check.ticket, residuals[check.ticket])
        (0, 0.0)
        """
        outs = _tensors_of(out) or list(plan.written)
        checks = []
        with self._quietly:
            for target in plan.targets:
                if target.index >= len(outs):
                    continue
                o = outs[target.index]
                if not (_plain(o) and o.is_floating_point() and o.numel()):
                    continue
                try:
                    got = target.gather(o.detach())
                    if defer and target.batch is not None:
                        checks.append(self._enqueue(target, got, o.dtype))
                    else:
                        checks.append(self._compare(target, got, o.dtype))
                except (RuntimeError, TypeError, ValueError, IndexError):
                    continue  # a call this module does not model after all: unchecked, never the program's error
        if not checks and plan.targets and plan.targets[0].how == "pointwise":
            # A pointwise op of floating inputs whose output is not floating (a comparison) always is.
            self.kinds[plan.func] = None
        if self._queued >= QUEUE_MAX:
            self._resolve()
        return checks

    def collect(self) -> tuple[list[float | torch.Tensor], list[float | torch.Tensor]]:
        """The residuals and coarse residuals of every deferred check since the last collect, by
        ticket (NaN: a group this module could not recompute after all, not measured and never
        passed); tickets start again from 0."""
        self._resolve()
        self._forget_recipes()
        taken = self._residuals, self._coarse
        self._residuals, self._coarse = [], []
        return taken

    def _forget_recipes(self) -> None:
        """Keep the recipes that served a call since the last collect, the signatures that have
        none, and those first seen since then, once more (unless there are too many): a signature
        whose constants change every step (an integer step count) never recurs, and its entries
        would grow without bound."""
        used, self._used = self._used, set()
        for recipe in self.recipes.values():  # a call's recipes are kept together
            if isinstance(recipe, Recipe) and recipe.more and any(id(r) in used for r in (recipe, *recipe.more)):
                used.update(id(r) for r in (recipe, *recipe.more))
        kept = {
            s: SEEN_BEFORE if r is SEEN_ONCE else r
            for s, r in self.recipes.items()
            if r is None or r is SEEN_ONCE or (isinstance(r, Recipe) and id(r) in used)
        }
        if len(kept) > RECIPES_MAX:
            kept = {s: r for s, r in kept.items() if isinstance(r, Recipe)}
        self.recipes = kept
        self._made = [r for r in self._made if id(r) in used]

    def _resolve(self) -> None:
        """Recompute the queued checks, one float64 pass per group of calls alike."""
        queue, self._queue, self._queued = self._queue, {}, 0
        with self._quietly:
            alike: dict[tuple[Any, ...], list[Recipe]] = {}
            for recipe in self._made:
                if recipe.tickets:
                    self._used.add(id(recipe))
                    key = (recipe.target.batch.key, recipe.target.source_dtype, recipe.out_dtype, recipe.inputs)
                    alike.setdefault((*key, recipe.masks), []).append(recipe)
            for recipes in alike.values():
                self._resolve_sampled(recipes)
            for (out_dtype, *_), group in queue.items():
                try:
                    residual, coarse, _ = _recompute(group.target, *group.stacked(), out_dtype)
                except (RuntimeError, TypeError, ValueError, IndexError):
                    continue
                if residual.device.type == "cpu":
                    residual, coarse = residual.tolist(), coarse.tolist()
                for ticket, value, rough in zip(group.tickets, residual, coarse):
                    self._residuals[ticket], self._coarse[ticket] = value, rough

    def _enqueue(self, target: _Target, got: torch.Tensor, out_dtype: torch.dtype) -> Check:
        batch = target.batch
        assert batch is not None
        key = (out_dtype, got.shape, got.device, batch.key, target.n, target.eps_acc, target.how)
        key += (target.coherent, target.source_dtype)
        limit = _limits(target, out_dtype)[-1]
        group = self._queue.get(key)
        if group is None:
            group = self._queue[key] = _Group(target)
        ticket = len(self._residuals)
        self._residuals.append(math.nan)
        self._coarse.append(math.nan)
        group.add(batch.tensors, got, ticket)
        self._queued += 1
        return Check(target.index, math.nan, limit, target.sampled, target.how, math.nan, ticket)

    @staticmethod
    def _compare(target: _Target, got: torch.Tensor, out_dtype: torch.dtype) -> Check:
        alone = [t[None] for t in target.batch.tensors] if target.batch is not None else []
        residual, coarse, limit = _recompute(target, alone, got[None], out_dtype)
        if residual.device.type == "cpu":
            return Check(target.index, float(residual), limit, target.sampled, target.how, float(coarse))
        return Check(target.index, residual[0], limit, target.sampled, target.how, coarse[0])

    # --- sampled checks: one recipe per signature, the per-op path gathers ---

    def signature(
        self, func: Any, key: tuple[Any, ...], tensors: Sequence[torch.Tensor]
    ) -> tuple[tuple[Any, ...], list[float]] | None:
        """What calls checked by one recipe share, and this call's own floats: the op, the memo
        key of its other arguments (``trace.args.scan``) with each float argument in it left open
        (an optimizer's step size changes every step; its value is gathered with the call), and
        each tensor's dtype and shape. None where the op is of no kind with recipes (or ``full``
        asks for every element).

        >>> import torch
        >>> checker, x = SelfChecker(), torch.ones(3)
        >>> _ = checker.prepare(torch.ops.aten.mul.Tensor, (x, 0.5), {})
        >>> checker.signature(torch.ops.aten.mul.Tensor, ("T", (float, 0.5)), [x])[1]
        [0.5]
        """
        kind = self.kind_of(func)  # classified here at an op's first call: its signature noted then
        if self.full or kind not in RECIPE_KINDS:
            return None
        # Only a pointwise op's floats (RECIPE_KINDS[0]) are gathered per call; another's (a
        # layer norm's eps) stay in the signature, so calls with other floats get their own recipe.
        floats = [item[1] for item in key if _float_item(item)] if kind is RECIPE_KINDS[0] else []
        if floats:
            key = tuple(float if _float_item(item) else item for item in key)
        parts: list[Any] = [func, key]
        for t in tensors:
            parts += (t.dtype, t.shape)
        return tuple(parts), floats

    def learn(
        self, signature: tuple[Any, ...], func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any
    ) -> None:
        """After a call of ``signature`` without a recipe (checked the usual way): at its first, a
        note that it was seen; at the next, its recipe, or None where the per-op path cannot gather
        its calls (accelerator tensors, tensors in lists, a non-floating output, a negated view)."""
        if signature not in self.recipes:
            self.recipes[signature] = SEEN_ONCE
            return
        recipe = None
        try:
            with self._quietly:
                recipe = _recipe(self, func, args, kwargs, out)
        except (RuntimeError, TypeError, ValueError, IndexError):
            pass
        if recipe is not None:
            self._made += (recipe, *recipe.more)
            self._used.add(id(recipe))  # kept across the next collect, even before it serves a call
            self._used.update(id(piece) for piece in recipe.more)
        self.recipes[signature] = recipe

    def gather_sampled(
        self, recipe: Recipe, tensors: Sequence[torch.Tensor], floats: Sequence[float] = ()
    ) -> tuple[torch.Tensor, list[float]] | None:
        """Before the op: the sampled positions (drawn from the checker's stream) and its inputs'
        values there, in float64, then the call's ``floats`` (:meth:`signature`); None where a
        tensor is not one the per-op path reads (the call is then checked the usual way, nothing
        drawn)."""
        if not all(_sampled_readable(t) for t in tensors):
            return None
        values: list[float] = []
        if recipe.grid is not None and recipe.grid[0] == GRID_ROWS:
            _, block, kept, along, *order = recipe.grid
            count = math.prod(recipe.sizes[d] for d in order[:kept])
            self._stream, (start,) = draw(self._stream, count - block + 1, 1)
            picked = torch.arange(start, start + block)
            rows = _row_index(picked, recipe.numel // count)
            with self._quietly:
                for t in tensors:
                    if t.dim() < len(order):  # a layer norm's weight: whole
                        values += t.reshape(-1).to(F64).tolist()
                        continue
                    view = t.permute(*order)  # its rows, each as long as its own (a mean's: 1)
                    along_t = math.prod(view.shape[kept:])
                    values += _take(view, _row_index(picked, along_t)).to(F64).reshape(-1).tolist()
            index = _take(torch.arange(recipe.numel).reshape(recipe.sizes).permute(*order), rows) if along else picked
            return index.reshape(-1), values + list(floats)
        if recipe.grid is not None and recipe.grid[0] == GRID_CHANNELS:
            block, channels = recipe.grid[1], recipe.sizes[1]
            self._stream, (start,) = draw(self._stream, channels - block + 1, 1)
            with self._quietly:
                for t in tensors:
                    if t.dim() == 1:  # a weight, bias or statistic: one value a channel
                        values += t[start : start + block].to(F64).tolist()
                    else:
                        values += t.narrow(1, start, block).transpose(0, 1).to(F64).reshape(-1).tolist()
            index = torch.arange(recipe.numel).reshape(recipe.sizes).narrow(1, start, block).transpose(0, 1)
            return index.reshape(block, -1)[:, list(recipe.grid[2:])].reshape(-1), values + list(floats)
        if recipe.grid is not None and recipe.grid[0] == GRID_ATTENTION:
            index, attended = self._attended(recipe, tensors)
            return index, attended + list(floats)
        if recipe.grid is not None and recipe.grid[0] == GRID_PICKED:
            picked_rows = self._picked(recipe, tensors)
            if picked_rows is None:
                return None
            index, picked_values = picked_rows
            return index, picked_values + list(floats)
        if recipe.grid is not None and recipe.grid[0] == GRID_CONV:
            self._stream, flat = draw(self._stream, recipe.numel, recipe.k)
            index = torch.tensor(flat)
            with self._quietly:
                for shape, t in zip(recipe.shapes, _conv_terms(recipe.grid, tensors, index)):
                    values += t.to(F64).reshape(-1).tolist() if math.prod(shape) else []
            return index, values + list(floats)
        if recipe.grid is not None and recipe.grid[0] == GRID_PLACED:
            self._stream, flat = draw(self._stream, recipe.numel, recipe.k)
            index = torch.tensor(flat)
            with self._quietly:
                values = _placed(tensors[0], recipe.sizes, recipe.grid, index).to(F64).tolist()
            return index, values + list(floats)
        if recipe.grid is not None:
            _, rows, cols, a, b, _ = recipe.grid
            *batches, m, n = recipe.sizes
            at = 0  # a bmm's matrix: drawn first
            if batches:
                self._stream, (at,) = draw(self._stream, batches[0], 1)
                tensors = [t[at] for t in tensors]
            self._stream, (j,) = draw(self._stream, n - cols + 1, 1)
            self._stream, (i,) = draw(self._stream, m - rows + 1, 1)
            index = ((torch.arange(i, i + rows) * n)[:, None] + torch.arange(j, j + cols)).reshape(-1) + at * m * n
            with self._quietly:
                for position, t in enumerate(tensors):
                    block = t[i : i + rows] if position == a else t[:, j : j + cols] if position == b else None
                    if block is None:
                        block = _take(t.expand(recipe.sizes), index)
                    values += block.reshape(-1).to(F64).tolist()
            return index, values + list(floats)
        self._stream, flat = draw(self._stream, recipe.numel, recipe.k)
        index = torch.tensor(flat)
        with self._quietly:
            for t in tensors:
                values += _take(t if t.shape == recipe.sizes else t.expand(recipe.sizes), index).to(F64).tolist()
        return index, values + list(floats)

    def _attended(self, recipe: Recipe, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[float]]:
        """A GRID_ATTENTION recipe's block gathered (:class:`Recipe`): the output's positions and
        the values (queries, keys, values, mask rows, the rows' positions)."""
        _, block, _, masked = recipe.grid  # type: ignore[misc]
        q, k, v = tensors[:3]
        batch, heads, length, _ = q.shape
        self._stream, (pair,) = draw(self._stream, batch * heads, 1)
        self._stream, (start,) = draw(self._stream, length - block + 1, 1)
        at = divmod(pair, heads)
        with self._quietly:
            parts = [q[at][start : start + block], k[at], v[at]]
            if masked:
                parts.append(tensors[3].expand(batch, heads, length, k.shape[2])[at][start : start + block])
            values = [x for part in parts for x in part.to(F64).reshape(-1).tolist()]
        rows = pair * length + torch.arange(start, start + block)
        return _row_index(rows, v.shape[-1]).reshape(-1), values + [float(start + r) for r in range(block)]

    def _picked(self, recipe: Recipe, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[float]] | None:
        """A GRID_PICKED recipe's rows gathered (:class:`Recipe`): the output's positions and the
        values; None where a target lies outside the classes (the kernel's error, not a check's)."""
        _, role, ignore, per_row = recipe.grid  # type: ignore[misc]
        backward = role == NLL_LOSS_BACKWARD
        x, target = tensors[int(backward)], tensors[int(backward) + 1]
        weight = tensors[int(backward) + 2] if len(tensors) == 3 + 2 * backward else None
        rows, classes = (x.shape[0] if x.dim() == 2 else 1), x.shape[-1]
        if backward:
            self._stream, drawn = draw(self._stream, rows, recipe.k)
        else:
            drawn = list(range(rows))
        picked = torch.tensor(drawn, dtype=torch.int64)
        with self._quietly:
            t = target.reshape(-1)[picked].to(torch.int64)
            kept = t != ignore
            if bool(((t < 0) | (t >= classes))[kept].any()):
                return None
            t = torch.where(kept, t, 0)
            w = weight[t].to(F64) if weight is not None else torch.ones(len(drawn), dtype=F64)
            w = torch.where(kept, w, 0.0)
            if backward:
                grad, total = tensors[0], tensors[-1]
                g = grad.reshape(-1)[picked] if grad.dim() else grad.reshape(1).expand(len(drawn))
                values = g.to(F64).tolist() + w.tolist() + total.to(F64).reshape(1).tolist()
                return picked * classes + t, values
            picked_x = torch.where(kept, x.reshape(rows, classes)[picked, t].to(F64), 0.0)
        return (picked if per_row else torch.zeros(1, dtype=torch.int64)), picked_x.tolist() + w.tolist()

    def gather_call(
        self, recipe: Recipe, tensors: Sequence[torch.Tensor], floats: Sequence[float] = ()
    ) -> list[tuple[Recipe, torch.Tensor, list[float]]] | None:
        """:meth:`gather_sampled` of a call for its recipe and each of the recipe's ``more`` in
        turn (the floats with the first): each recipe with what it gathered, or None (nothing
        drawn) where one cannot gather."""
        state, pieces = self._stream, []
        for piece in (recipe, *recipe.more):
            gathered = self.gather_sampled(piece, tensors, floats if piece is recipe else ())
            if gathered is None:
                self._stream = state
                return None
            pieces.append((piece, *gathered))
        return pieces

    def finish_sampled(self, recipe: Recipe, index: torch.Tensor, values: list[float], out: Any) -> int | None:
        """After the op: queue the call's sampled inputs and outputs with its recipe's calls; its
        ticket (:meth:`collect`), or None where the output is not what the recipe expects (unchecked)."""
        outputs = out if isinstance(out, (tuple, list)) else ()
        if recipe.out_index >= 0:  # one of the op's outputs
            out = outputs[recipe.out_index] if len(outputs) > recipe.out_index else None
        more = [outputs[e[0]] if len(outputs) > e[0] else None for e in recipe.extras]
        expected = [(out, recipe.out_dtype, recipe.out_sizes)]
        expected += [(t, dtype, e[1]) for t, e, (_, dtype) in zip(more, recipe.extras, recipe.extra_targets)]
        for t, dtype, sizes in expected:  # every output read, or none
            if not (isinstance(t, torch.Tensor) and _sampled_readable(t) and t.dtype == dtype and t.shape == sizes):
                return None
        with self._quietly:
            values = values + _take(out, index).to(F64).tolist()
            if more:  # at the block's rows: its first element's kept positions (GRID_ROWS: leading)
                length = recipe.k // recipe.sampled
                rows = index.reshape(-1, length)[:, 0]
                if recipe.grid is not None and recipe.grid[0] == GRID_CHANNELS:
                    rows = rows // math.prod(recipe.sizes[2:]) % recipe.sizes[1]
                else:
                    rows = rows // length
                for t in more:
                    values += _take(t, rows).to(F64).tolist()
        recipe.values.extend(values)
        ticket = len(self._residuals)
        self._residuals += [math.nan] * (1 + len(more))
        self._coarse += [math.nan] * (1 + len(more))
        recipe.tickets.append(ticket)
        self._queued += 1
        return ticket

    def _resolve_sampled(self, recipes: list[Recipe]) -> None:
        """Recompute the queued calls of recipes alike (the same recomputation, output dtype and
        masks: one op's calls on tensors of other shapes) in one float64 pass, and file their residuals."""
        tickets, parts = [], []
        first = recipes[0]
        k, floats = first.k, len(first.floats)
        widths = [math.prod(shape) for shape in first.shapes]
        outputs = [k] + [extra[-1] for extra in first.extras]  # values of each output, per call
        width = sum(widths) + floats + sum(outputs)
        for recipe in recipes:
            tickets += recipe.tickets
            # Each view let go at once (a clone): the per-op path appends to the array again.
            parts.append(torch.frombuffer(recipe.values, dtype=F64).clone())
            _clear(recipe.values)
            recipe.tickets.clear()
        try:  # a failure leaves these calls' residuals NaN: not measured, never passed
            parts = [part.view(-1, width) for part in parts]
            rows, end = (torch.cat(parts) if len(parts) > 1 else parts[0]), sum(widths)
            gathered = [
                part.reshape(len(rows), *shape) for part, shape in zip(rows[:, :end].split(widths, 1), first.shapes)
            ]
            inputs = [gathered[i].bool() if i in first.masks else gathered[i] for i in first.inputs]
            got = rows[:, end + floats :].split(outputs, 1)
            checked = [_recompute_by_floats(self, first, inputs, rows[:, end : end + floats], got[0])]
            for (target, dtype), values in zip(first.extra_targets, got[1:]):
                checked.append(_recompute(target, inputs, values, dtype)[:2])
        except (RuntimeError, TypeError, ValueError, IndexError):
            return
        for j, (residual, coarse) in enumerate(checked):  # an output's ticket: the call's first, plus j
            for ticket, value, rough in zip(tickets, residual.tolist(), coarse.tolist()):
                self._residuals[ticket + j], self._coarse[ticket + j] = value, rough

    # --- sampling (the checker's own generator, on the CPU) ---

    def _pick(self, n: int, count: int) -> torch.Tensor:
        """``count`` random indices below n, or all of them (full, or n small)."""
        if self.full or n <= count:
            return torch.arange(n)
        return torch.randint(n, (count,), generator=self._gen)

    def _block(self, n: int, count: int) -> tuple[int, int]:
        """``(start, size)`` of a random run of ``count`` adjacent indices below n, or all of them
        (full, or n small)."""
        if self.full or n <= count:
            return 0, n
        return self._starts.randrange(n - count + 1), count

    def _sample(self, n: int, factor: int = 1, most: int | None = None) -> torch.Tensor:
        """``factor * sample`` (at most ``most``) random flat indices below n, or all of them
        (full, or n small)."""
        return self._pick(n, min(self.sample * factor, most) if most is not None else self.sample * factor)


class _Group:
    """Deferred checks of calls alike: the first call's target, and what differs between the
    calls (gathered tensors, gathered output, ticket), stacked every CHUNK calls so that few
    objects are held until they are recomputed (and the garbage collector has little to walk)."""

    __slots__ = ("chunks", "pending", "target", "tickets")

    def __init__(self, target: _Target) -> None:
        self.target = target
        self.tickets: list[int] = []
        self.pending: list[tuple[torch.Tensor, ...]] = []  # per call: its gathered tensors, then its output
        self.chunks: list[list[torch.Tensor]] = []  # stacked columns of CHUNK calls each

    def add(self, tensors: tuple[torch.Tensor, ...], got: torch.Tensor, ticket: int) -> None:
        self.pending.append((*tensors, got))
        self.tickets.append(ticket)
        if len(self.pending) == CHUNK:
            self.chunks.append([torch.stack(column) for column in zip(*self.pending)])
            self.pending = []

    def stacked(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Every call's gathered tensors, one leading row per call, and their outputs likewise."""
        if not self.chunks and len(self.pending) == 1:
            columns = [t[None] for t in self.pending[0]]  # viewed, not copied: taps may be large
        else:
            chunks = self.chunks + ([[torch.stack(c) for c in zip(*self.pending)]] if self.pending else [])
            columns = [torch.cat(c) if len(c) > 1 else c[0] for c in zip(*chunks)]
        return columns[:-1], columns[-1]


def _recompute(
    target: _Target, stacked: Sequence[torch.Tensor], got: torch.Tensor, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Residual, coarse residual (one per call) and the judged limit of calls alike of ``target``
    (outputs ``got``, one leading row per call): its call alone, or those of a batch key, whose
    recomputation then runs once on the tensors they gathered, ``stacked``."""
    batch = target.batch
    if batch is None:
        assert target.ref is not None
        ref, scale, *excess = target.ref()
        fitted = [model[None] for model in target.fitted()] if target.fitted is not None else None
        return _residual_rows(target, got, ref[None], scale[None], excess, fitted, out_dtype)
    ref, scale, *excess = batch.fn(*stacked)
    fitted = batch.fitted(*stacked) if batch.fitted is not None else None
    return _residual_rows(target, got, ref, scale, excess, fitted, out_dtype)


def _fitted(target: _Target) -> bool:
    """Whether the device's rounding models recompute this target too."""
    return target.fitted is not None or (target.batch is not None and target.batch.fitted is not None)


def _tensors_of(out: Any) -> list[torch.Tensor]:
    """An op's tensor outputs in ``tree_flatten`` order: ops return a tensor, or a tuple or list of
    tensors (and None), or nests of those; without building a pytree spec per call."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for item in out for t in _tensors_of(item)]
    return []


def _limits(target: _Target, out_dtype: torch.dtype) -> tuple[float, float]:
    """What an honest kernel stays within for this target: the limit of its residual against the
    float64 value, and the one it is judged by (that under float32 accumulation, where the target
    is fitted by the device's rounding models)."""
    eps_out, _ = _finfo(out_dtype)
    if target.how == "exact":
        limit = EXACT_LIMIT[target.source_dtype == out_dtype]
    else:
        limit = limit_for(target.n, eps_out, target.eps_acc if target.eps_acc is not None else _working_eps(eps_out))
    return limit, (limit_for(target.n, eps_out, EPS32) if _fitted(target) else limit)


def _per_call(x: torch.Tensor, calls: int) -> torch.Tensor:
    """One row per call (its sampled values flat); a 0-d value (a zero scale) broadcasts as it is."""
    return x if x.dim() == 0 else x.reshape(calls, -1)


def _residual_rows(
    target: _Target,
    got: torch.Tensor,
    ref: torch.Tensor,
    scale: torch.Tensor,
    excess: Sequence[torch.Tensor],
    fitted: list[torch.Tensor] | None,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """For calls alike of ``target`` (a leading row each): the residual of each call, its coarse
    residual (module docstring, :class:`Check`), and the limit the residual is judged by."""
    calls = got.shape[0]
    got = got.reshape(calls, -1)
    # Compute where the output lives unless that is the host (a copy to the CPU): a device
    # tensor never comes back to the host here.
    device = got.device if got.device.type != "cpu" else ref.device
    got = got.to(device, F64)
    ref, scale = _per_call(ref, calls).to(device), _per_call(scale, calls).to(device)
    eps_out, tiny = _finfo(out_dtype)
    eps_acc = target.eps_acc if target.eps_acc is not None else _working_eps(eps_out)
    if excess:
        scale = scale + _per_call(excess[0], calls).to(device) * (eps_out / eps_acc)
    r = (got - ref).abs() / (eps_out * ref.abs() + eps_acc * scale + tiny)
    limit, judged = _limits(target, out_dtype)
    rounded = ref.to(out_dtype).to(F64)  # overflow to inf by the output's rounding is honest
    residual = _worst(r, got, rounded)
    if target.coherent:
        residual = torch.maximum(residual, _coherent(got, ref, eps_out) * limit)
    if fitted is None:
        return residual, residual, limit
    # Where a rounding model of the device reproduces the call, float32 accumulation is all
    # the freedom left: a fault far inside the reduced precision's allowance shows.
    best = None
    for model in fitted:
        model = _per_call(model, calls).to(device)
        worst = _worst((got - model).abs() / (eps_out * model.abs() + EPS32 * scale + tiny), got, rounded)
        best = worst if best is None else torch.minimum(best, worst)
    assert best is not None
    return best, residual * (judged / limit), judged


def _worst(r: torch.Tensor, got: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """Each row's largest residual ``r``, with non-finite values judged by class (module docstring)."""
    worst = r.amax(-1)
    if got.device.type == "cpu" and bool(worst.isfinite().all()):  # every element finite: the usual case
        return worst
    # Where float64 itself makes NaN or Inf (from NaN/Inf inputs, gelu(-inf) = -inf * 0) kernels
    # legitimately differ: such an element says nothing. NaN or Inf where float64 is finite is a fault.
    same_class = ~rounded.isfinite()
    return torch.where(got.isfinite() & rounded.isfinite(), r, torch.where(same_class, 0.0, math.inf)).amax(-1)


def _coherent(got: torch.Tensor, ref: torch.Tensor, eps_out: float) -> torch.Tensor:
    """Per row, one scale fitted through the sample, ``got ~ (1 + s) * ref``, in units of what an
    honest kernel stays within: ``min(|t| / COHERENT_T, |s| / eps_out)``, ``t`` the fit's t-statistic.

    Rounding errors take either sign whatever the value, so over many elements they fit no scale
    (``|t|`` below 4 in 16-bit convolution gradients of millions of elements); a scaled kernel
    fits its own exactly. ``|s|`` must also exceed one unit of the output's precision: a kernel
    that rounds toward zero carries a coherent bias below that. Non-finite elements are left out.
    """
    keep = got.isfinite() & ref.isfinite()
    g, r = torch.where(keep, got, 0.0), torch.where(keep, ref, 0.0)
    n, rr = keep.sum(-1), (r * r).sum(-1)
    s = ((g - r) * r).sum(-1) / rr
    spread = g - r - s[:, None] * r
    se = ((spread * spread).sum(-1) / (n - 1) / rr).sqrt()
    units = torch.minimum((s / se).abs() / COHERENT_T, s.abs() / eps_out)
    return torch.where((n > 2) & (rr > 0), units.nan_to_num(nan=0.0), 0.0)


def _rounding_models(dtype: torch.dtype, eps_acc: float | None) -> tuple[Callable[[torch.Tensor], torch.Tensor], ...]:
    """How a device may round the float32 operands of a matmul/conv allowed ``eps_acc``."""
    if dtype != torch.float32 or eps_acc is None:
        return ()
    precision = "bf16" if eps_acc == REDUCED_EPS["bf16"] else "tf32" if eps_acc == REDUCED_EPS["tf32"] else None
    return tuple(rounding for _, rounding in REDUCED_MODELS[precision]) if precision else ()


# Older torch CPU kernels sum bf16/fp16 rows (mv, softmax and layer norm backward) partly in the
# output's own precision: measured on 2.1, not on 2.13; versions between are given the benefit.
SUMS_AT_16_BITS = tuple(int(part) for part in torch.__version__.split(".")[:2] if part.isdigit()) < (2, 5)


def _working_eps(eps_out: float) -> float:
    """The precision a kernel of output epsilon ``eps_out`` accumulates in where nothing else is
    known: float32 (or the output's own, if finer), or a 16-bit output's own on older torch."""
    return eps_out if SUMS_AT_16_BITS and eps_out > EPS32 else min(eps_out, EPS32)


_UNSEEN = object()
_FINFO: dict[torch.dtype, tuple[float, float]] = {}


def _finfo(dtype: torch.dtype) -> tuple[float, float]:
    """(eps, smallest normal) of a floating dtype, cached (torch.finfo is slow to build)."""
    if dtype not in _FINFO:
        info = torch.finfo(dtype)
        _FINFO[dtype] = (info.eps, info.tiny)
    return _FINFO[dtype]


# --- pointwise ---

# Discontinuous in a computed quotient (a/b rounded near an integer jumps by |b|): a float32 kernel
# and a float64 recomputation may honestly land on different sides.
_DISCONTINUOUS = {"floor_divide", "floor_divide_", "remainder", "remainder_"}
_DISCONTINUOUS_OVERLOADS = {"Tensor_mode", "Scalar_mode", "decimals"}  # div(rounding_mode=), round(decimals=)


# One correctly rounded operation per element (or an exact one): the result is the float64 value
# rounded once, so no intermediate term earns an allowance and a fault of a few units shows.
_ROUNDED_ONCE = frozenset(
    name + suffix
    for name in (
        "mul", "div", "neg", "abs", "relu", "sqrt", "reciprocal", "clamp", "clamp_min", "clamp_max",
        "maximum", "minimum", "where", "masked_fill", "threshold_backward", "leaky_relu", "hardtanh",
        "sign", "fill", "add", "sub",
    )
    for suffix in ("", "_")
)  # fmt: skip
# Accurate to a few units of their result everywhere (vectorized libm): no intermediate term of
# another size, and f(|x|) would be no measure (exp(|x|) for exp(-20)).
_RELATIVE = frozenset(
    name + suffix
    for name in ("exp", "exp2", "log", "log2", "log10", "sigmoid", "tanh", "rsqrt")
    for suffix in ("", "_")
)


def _pointwise(
    checker: SelfChecker, func: Any, args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[_Target, ...] | None:
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if not tensors or any(isinstance(a, (list, tuple)) for a in (*args, *kwargs.values())):
        return None
    if not all(_plain(t) and _real(t) for t in tensors) or not any(t.is_floating_point() for t in tensors):
        return None
    shapes = {t.shape for t in tensors}
    shape = shapes.pop() if len(shapes) == 1 else torch.broadcast_shapes(*shapes)
    devices = {t.device for t in tensors if t.dim()}
    if len(devices) > 1:
        return None
    flat = checker._sample(math.prod(shape))
    k = flat.numel()
    slots: list[torch.Tensor] = []

    def gathered(a: Any) -> Any:
        if not isinstance(a, torch.Tensor):
            return a
        if a.dim() == 0:  # a scalar tensor, for each sampled element; a copy: in-place ops write it
            t = a.detach().clone()
            t = t if devices and t.device not in devices else t.expand(k)  # a host scalar broadcasts as it is
        else:
            t = _take(a if a.shape == shape else a.expand(shape), flat)
        slots.append(t)
        return _SLOT

    template = _template(args, kwargs, gathered)
    batch = _pointwise_batch(checker, func, args, kwargs, template, tuple((t.dtype, t.device) for t in slots), k)
    target = _batched(
        0, functools.partial(_gathered, flat), batch._replace(tensors=tuple(slots)), 1, None, "pointwise", k
    )
    # A host scalar beside device tensors stacks with nothing alike: recomputed for its call alone.
    return (target if all(t.dim() for t in slots) else target._replace(batch=None),)


def _template(
    args: Sequence[Any], kwargs: dict[str, Any], slot: Callable[[Any], Any]
) -> tuple[list[Any], dict[str, Any]]:
    """A pointwise call's arguments with ``slot(a)`` for each one (a tensor: _SLOT where its
    gathered values go), and a ``dtype`` asked for as float64."""
    return (
        [slot(a) for a in args],
        {k: (F64 if k == "dtype" and v is not None else slot(v)) for k, v in kwargs.items()},
    )


def _pointwise_batch(
    checker: SelfChecker,
    func: Any,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    template: tuple[list[Any], dict[str, Any]],
    slots: tuple[Any, ...],
    k: int,
) -> _Batch:
    """The float64 recomputation of a pointwise call (its gathered tensors still to be set):
    one object for every call alike (same op, constants, slots and sample: fewer objects held
    until the hand-over)."""
    relative = _relative(func, args, kwargs)
    key = (func, relative, _constants(template), slots, k)
    key, fn = checker.shared(key, lambda: functools.partial(_pointwise_values, func, template, relative))
    return _Batch(key, fn, ())


def _gathered(flat: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The output's elements at the sampled row-major indices ``flat``."""
    return _take(out, flat)


_SLOT = object()  # where a gathered tensor goes in a pointwise call's arguments

# --- sampled checks gathered on the per-op path (csrc/record_check.cpp mirrors these) ---

_MASK64 = (1 << 64) - 1
# A signature seen once: its recipe is made at its next call (one seen once may never recur). Not
# a tuple, so the C path takes it for "no recipe yet" as it does a missing one. Kept across one
# collect as SEEN_BEFORE: a step longer than flush_secs is handed over at every boundary, and an
# op called once a step (a loss, an optimizer's update of a parameter of a shape of its own) would
# otherwise never have its recipe made.
SEEN_ONCE = "seen once"
SEEN_BEFORE = "seen before the last collect"
# Signatures without a recipe kept at most across a collect (SelfChecker._forget_recipes).
RECIPES_MAX = 4096
# Calls the per-op path gathers: at most this many input tensors and dimensions (record_check.cpp).
RECIPE_TENSORS, RECIPE_DIMS = 8, 16
# What the per-op path gathers, by the statistics kernel's dtype codes (csrc/record_check.cpp):
# inputs of these dtypes, outputs of the floating ones (the first four).
_SAMPLED_CODES = {
    torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3, torch.uint8: 4, torch.int8: 5,
    torch.int16: 6, torch.int32: 7, torch.int64: 8, torch.bool: 9,
}  # fmt: skip
_FLOATING_CODES = 4


class Recipe(NamedTuple):
    """How the calls of one signature (:meth:`SelfChecker.signature`) of a pointwise op, an
    exact copy, a 2-D matmul, a sum or mean, a softmax, a layer or batch norm, a convolution or
    their gradients are checked: the per-op path draws
    ``k`` row-major positions below ``numel``, gathers every input tensor's value there
    (broadcast to ``sizes``) before the op and the output's after it (in its own shape,
    ``out_sizes``: a reshaping copy's differs), all in float64, onto ``values``; the checker
    recomputes them together at the hand-over. A ``grid`` reads blocks instead: a matmul's
    rows of A and columns of B (its output at their crossings), a reduction's or softmax's
    whole rows (its output at those rows, or along them). Its first fourteen fields are read by
    position in C."""

    sizes: tuple[int, ...]  # what the inputs broadcast to (a pointwise op's output shape)
    numel: int
    k: int
    limit: float
    out_code: int  # the output dtype's code in _SAMPLED_CODES
    values: Any  # float64 number array: per call, k values of each input, then k of the output
    tickets: list[int]  # per queued call, its place in what SelfChecker.collect returns
    out_sizes: tuple[int, ...]
    # GRID_MATMUL, rows, columns, A, B, bias: the block's size and which tensors play which part
    # (bias -1: none), of one drawn matrix where the output has three dimensions (a bmm); GRID_ROWS, rows, kept, along, *order: a block of adjacent rows of every
    # tensor viewed with its dimensions in ``order``, the first ``kept`` of them numbering the
    # rows, and the output read at those rows (along 0) or along them (1). A row of a tensor is
    # as long as its own dimensions after ``kept`` (a layer norm's saved mean: 1), and one of
    # fewer dimensions than the first is read whole (its weight). GRID_PLACED, dim, start, step,
    # taken, dropped: a gradient placed into zeros at ``taken`` positions of ``dim`` from ``start``
    # by ``step`` (``dropped``: a select's, whose gradient lacks ``dim``), read at the sampled
    # positions of the output where they hold it, 0 elsewhere. GRID_CONV, role, dims, groups,
    # *stride, *padding, *dilation: a (not transposed) convolution's sampled output (role
    # CONV_OUTPUT), input gradient or weight gradient elements, each with the terms it sums
    # (:func:`_output_taps` and the two like it), 0 for both factors of a tap that reads nothing.
    # GRID_CHANNELS, block, *positions: a block of adjacent channels (dimension 1) of every tensor
    # of the first's shape, each whole, one value a channel of 1-D ones; the output read in each
    # at ``positions`` (of its batch and positions, row-major), its extras at them (a batch
    # norm's). GRID_PICKED, role, ignore_index, per_row: an ``nll_loss_forward`` (role NLL_LOSS)
    # reads every row's input at its target and the target's class weight (0 for both where the
    # target is ``ignore_index``), its output at 0 (its total weight as an extra) or at every row
    # (``per_row``: no reduction); its backward (NLL_LOSS_BACKWARD) at ``k`` drawn rows the output
    # gradient (at the row where ``per_row``) and class weight, then the total weight, its output
    # at each row's target. GRID_ATTENTION, block, causal, masked: fused attention's block of
    # adjacent query rows of one batch and head (both drawn), read with that head's keys and values
    # whole, the mask's rows there (``masked``) and the rows' positions; its output at those rows.
    # None for elementwise recipes.
    grid: tuple[int, ...] | None
    how: str  # what the check rows say (Check.how)
    sampled: int  # and how many elements or rows they say were recomputed
    out_index: int  # which of the op's outputs is checked (-1: the op returns one tensor)
    # More outputs checked with it (a layer norm's mean and 1/std), each read at the block's rows
    # (a GRID_ROWS recipe whose rows come first in order): (index, sizes, dtype code, limit, rows)
    extras: tuple[tuple[int, tuple[int, ...], int, float, int], ...]
    # Recipes of the same call's other outputs, each gathered from its tensors after this one's
    # and queued with tickets of its own (a convolution backward's weight gradient)
    more: tuple[Recipe, ...]
    target: _Target  # the recomputation of calls alike
    out_dtype: torch.dtype
    slots: int  # input tensors gathered per call
    shapes: tuple[tuple[int, ...], ...]  # the values gathered of each, per call
    inputs: tuple[int, ...]  # those the recomputation takes, in its order (a copy's source alone)
    masks: tuple[int, ...]  # those that are bool (gathered as 0.0 and 1.0)
    # The float arguments of the call that taught it (each call's own are gathered after its
    # tensors), and where they go: (op, its arguments with _SLOT for a tensor, _FLOAT for a float)
    floats: tuple[float, ...] = ()
    skeleton: tuple[Any, ...] = ()
    extra_targets: tuple[tuple[_Target, torch.dtype], ...] = ()  # the extras' recomputations and dtypes

    def target_for(self, checker: SelfChecker, floats: Sequence[float]) -> _Target:
        """The recomputation of this recipe's calls that took ``floats``."""
        func, (args, kwargs) = self.skeleton
        values = iter(floats)
        args = [next(values) if a is _FLOAT else a for a in args]
        kwargs = {name: (next(values) if v is _FLOAT else v) for name, v in kwargs.items()}
        slots = tuple((torch.bool if i in self.masks else F64, torch.device("cpu")) for i in range(self.slots))
        batch = _pointwise_batch(checker, func, args, kwargs, (args, kwargs), slots, self.k)
        return self.target._replace(batch=batch)


GRID_MATMUL, GRID_ROWS, GRID_PLACED, GRID_CONV, GRID_CHANNELS, GRID_PICKED, GRID_ATTENTION = 0, 1, 2, 3, 4, 5, 6
CONV_OUTPUT, CONV_INPUT_GRADIENT, CONV_WEIGHT_GRADIENT = 0, 1, 2  # a GRID_CONV's roles
NLL_LOSS, NLL_LOSS_BACKWARD = 0, 1  # a GRID_PICKED's roles


def draw(state: int, n: int, k: int) -> tuple[int, list[int]]:
    """``k`` positions below ``n`` from a splitmix64 stream at ``state``, and the state after:
    each draw scaled to ``n`` by the high half of a 128-bit product (the C path's arithmetic).
    Where ``n <= k``, every position in turn, nothing drawn (the usual path reads them all).

    >>> draw(0, 10, 3)
    (15755400384260043839, [8, 4, 0])
    >>> draw(0, 2, 3)
    (0, [0, 1, 0])
    """
    if n <= k:
        return state, [i % n for i in range(k)]
    picked = []
    for _ in range(k):
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        picked.append(((z ^ (z >> 31)) * n) >> 64)
    return state, picked


def _sampled_readable(t: torch.Tensor) -> bool:
    """A tensor the per-op path reads by pointer: plain, dense, on the CPU, not a negated view."""
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.layout == torch.strided
        and t.is_cpu
        and not t.is_neg()
        and t.data_ptr() != 0
    )


def _recipe(checker: SelfChecker, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> Recipe | None:
    values = (*args, *kwargs.values())
    tensors = [a for a in values if isinstance(a, torch.Tensor)]
    listed = [a for a in values if isinstance(a, (list, tuple))]
    if not 0 < len(tensors) <= RECIPE_TENSORS or any(isinstance(x, torch.Tensor) for a in listed for x in a):
        return None
    if not all(_sampled_readable(t) and t.dtype in _SAMPLED_CODES for t in tensors):
        return None
    kind = checker.kinds.get(func)
    # Recipes that find the outputs they check among the op's outputs themselves
    of_outputs = {
        _convolution: _convolution_recipe,
        _convolution_backward: _convolution_recipe,
        _batch_norm: _batch_norm_recipe,
        _batch_norm_backward: _batch_norm_recipe,
        _attention: _attention_recipe,
        _nll_loss: _nll_recipe,
        _nll_loss_backward: _nll_recipe,
    }.get(kind)
    if of_outputs is not None:
        return of_outputs(checker, func, args, kwargs, out, tensors)
    outputs = out
    if kind in (_layer_norm, _layer_norm_backward):  # a layer norm's output or input gradient first
        out = out[0] if isinstance(out, (tuple, list)) and out else None
    if not isinstance(out, torch.Tensor) or _SAMPLED_CODES.get(out.dtype, _FLOATING_CODES) >= _FLOATING_CODES:
        return None
    if not _sampled_readable(out):
        return None
    if kind is _matmul:
        return _matmul_recipe(checker, func, args, kwargs, out, tensors)
    if kind is _layer_norm_backward:
        return _layer_norm_backward_recipe(checker, func, args, kwargs, out, tensors)
    if kind is _layer_norm:
        return _layer_norm_recipe(checker, func, args, kwargs, outputs, tensors)
    if kind in (_reduction, _softmax):
        return _rows_recipe(checker, func, args, kwargs, out, tensors)
    if kind is _scattered:
        return _placed_recipe(checker, func, args, kwargs, out, tensors)
    sizes = tuple(torch.broadcast_shapes(*(t.shape for t in tensors)))
    if len(sizes) > RECIPE_DIMS or out.dim() > RECIPE_DIMS:
        return None
    k = checker.sample
    masks = tuple(i for i, t in enumerate(tensors) if t.dtype == torch.bool)
    floats: tuple[float, ...] = ()
    skeleton: tuple[Any, ...] = ()
    if checker.kinds.get(func) is _copy:
        source = _copy_source(func, tensors)
        if source is None or out.numel() != math.prod(sizes) or any(type(a) is float for a in values):
            return None
        batch = _Batch(("exact", F64, (k,), torch.device("cpu")), _exact_values, ())
        target = _batched(0, _gathered, batch, 1, None, "exact", k, tensors[source].dtype)
        inputs: tuple[int, ...] = (source,)
    elif kind is _moved:  # ones_like, zeros_like, full_like: the same constant everywhere
        value = _constant_of(func, args, kwargs)
        if value is None or len(tensors) != 1 or tuple(out.shape) != sizes:
            return None
        exact = torch.tensor(value, dtype=out.dtype).item() == value  # else the output rounds it once
        batch = _Batch(("constant", value, (k,)), functools.partial(_constant_values, value), ())
        target = _batched(0, _gathered, batch, 1, None, "exact", k, out.dtype if exact else F64)
        inputs = (0,)
    else:
        if listed or tuple(out.shape) != sizes or not any(t.is_floating_point() for t in tensors):
            return None
        slots = tuple((torch.bool if t.dtype == torch.bool else F64, torch.device("cpu")) for t in tensors)
        template = _template(args, kwargs, lambda a: _SLOT if isinstance(a, torch.Tensor) else a)
        batch = _pointwise_batch(checker, func, args, kwargs, template, slots, k)
        target = _batched(0, _gathered, batch, 1, None, "pointwise", k)
        inputs = tuple(range(len(tensors)))
        floats = tuple(a for a in values if type(a) is float)
        if floats:
            slot = lambda a: _SLOT if isinstance(a, torch.Tensor) else _FLOAT if type(a) is float else a  # noqa: E731
            skeleton = (func, _template(args, kwargs, slot))
    limit = _limits(target, out.dtype)[-1]
    code, gathered, shape = _SAMPLED_CODES[out.dtype], _number_array(), tuple(out.shape)
    numel, shapes = math.prod(sizes), ((k,),) * len(tensors)
    return Recipe(
        sizes,
        numel,
        k,
        limit,
        code,
        gathered,
        [],
        shape,
        None,
        target.how,
        k,
        -1,
        (),
        (),
        target,
        out.dtype,
        len(tensors),
        shapes,
        inputs,
        masks,
        floats,
        skeleton,
    )


def _matmul_recipe(
    checker: SelfChecker,
    func: Any,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    out: torch.Tensor,
    tensors: list[torch.Tensor],
) -> Recipe | None:
    """A 2-D ``mm`` or ``addmm`` (alpha and beta 1), or a ``bmm``, at full float32 or 16-bit
    precision: the usual path's block of rows and columns (:func:`_matmul`), of one drawn matrix
    of a ``bmm``, read by the per-op path."""
    name = func.overloadpacket.__name__
    b = _bind(func, args, kwargs)
    if name not in ("mm", "addmm", "bmm") or checker.reduced_precision is not None or b.get("beta", 1) != 1:
        return None
    if b.get("alpha", 1) != 1 or any(type(a) is float for a in (*args, *kwargs.values())):
        return None
    A, B = (b["mat1"], b["mat2"]) if name == "addmm" else (b["self"], b["mat2"])
    dims = 3 if name == "bmm" else 2
    if A.dim() != dims or B.dim() != dims or A.dtype != B.dtype or not A.is_floating_point():
        return None
    if _eps_matrix(A.dtype, A.device, False, None) is not None or out.shape != (*A.shape[:-1], B.shape[-1]):
        return None
    if dims == 3 and (A.shape[0] != B.shape[0] or not A.shape[0]):
        return None
    (m, K), n = A.shape[-2:], B.shape[-1]
    cols = min(n, math.isqrt(max(checker.sample - 1, 0)) + 1)
    rows = min(m, -(-checker.sample // cols))
    roles = (1, 2, 0) if name == "addmm" else (0, 1, -1)
    shapes = {roles[0]: (rows, K), roles[1]: (K, cols)}
    if name == "addmm":
        shapes[0] = (rows * cols,)
    constants = (1, 1, False, True)
    ordered = tuple(shapes[i] for i in range(len(tensors)))
    inputs = roles[:2] + ((0,) if name == "addmm" else ())
    key = ("matmul", constants, tuple((F64, shapes[i], torch.device("cpu")) for i in inputs), None)
    batch = _Batch(key, functools.partial(_matmul_values, constants, None), ())
    target = _batched(0, _gathered, batch, K + (name == "addmm"), None, "matmul", rows * cols)
    limit = _limits(target, out.dtype)[-1]
    code, gathered = _SAMPLED_CODES[out.dtype], _number_array()
    return Recipe(
        tuple(out.shape),
        out.numel(),
        rows * cols,
        limit,
        code,
        gathered,
        [],
        tuple(out.shape),
        (GRID_MATMUL, rows, cols, *roles),
        "matmul",
        rows * cols,
        -1,
        (),
        (),
        target,
        out.dtype,
        len(tensors),
        ordered,
        inputs,
        (),
    )


def _rows_recipe(
    checker: SelfChecker,
    func: Any,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    out: torch.Tensor,
    tensors: list[torch.Tensor],
) -> Recipe | None:
    """A ``sum`` or ``mean`` (rows: the reduced dimensions), or a softmax, log-softmax or their
    backward (rows along ``dim``): the usual path's rows (:func:`_reduction`, :func:`_softmax`),
    a block of adjacent ones, read by the per-op path."""
    name = func.overloadpacket.__name__
    b = _bind(func, args, kwargs)
    x = tensors[0]
    if any(type(a) is float for a in (*args, *kwargs.values())) or not x.is_floating_point() or not x.dim():
        return None
    if any(t.shape != x.shape or not t.is_floating_point() for t in tensors):
        return None
    reduction = checker.kinds.get(func) is _reduction
    dims = ([d % x.dim() for d in b.get("dim") or ()] or range(x.dim())) if reduction else [b["dim"] % x.dim()]
    if not reduction and (b.get("dtype") not in (None, x.dtype) or out.shape != x.shape):
        return None
    kept = [d for d in range(x.dim()) if d not in dims]
    count, length = math.prod(x.shape[d] for d in kept), math.prod(x.shape[d] for d in dims)
    block = min(checker.sample, count)
    if not count or not length or block * length * len(tensors) > GATHER_BUDGET:  # a sum over nothing: 0
        return None
    shapes = ((block, length),) * len(tensors)
    device = torch.device("cpu")
    if reduction:
        if out.numel() != count:
            return None
        divisor = length if name == "mean" else 1
        # As the usual path: a 16-bit reduction to one element accumulates at its own eps.
        eps_acc = torch.finfo(out.dtype).eps if count == 1 and out.dtype in (torch.float16, torch.bfloat16) else None
        batch = _Batch(("sum", divisor, F64, shapes[0], device), functools.partial(_sums, divisor), ())
        target, k = _batched(0, _gathered, batch, length, eps_acc, "rows", block), block
    else:
        batch = _Batch(("softmax", name, shapes, device), functools.partial(_softmax_values, name), ())
        target, k = _batched(0, _gathered, batch, length, None, "rows", block), block * length
    grid = (GRID_ROWS, block, len(kept), int(not reduction), *kept, *dims)
    limit = _limits(target, out.dtype)[-1]
    code, gathered = _SAMPLED_CODES[out.dtype], _number_array()
    inputs = tuple(range(len(tensors)))
    sizes, shape = tuple(x.shape), tuple(out.shape)
    return Recipe(
        sizes, count * length, k, limit, code, gathered, [], shape, grid, "rows", block, -1, (), (), target, out.dtype,
        len(tensors), shapes, inputs, (),
    )  # fmt: skip


def _convolution_recipe(
    checker: SelfChecker, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any, tensors: list[torch.Tensor]
) -> Recipe | None:
    """A (not transposed) convolution at full float32 or 16-bit precision: sampled output
    elements, or a backward's sampled input and weight gradient elements (a recipe each, the
    second in ``more``), each with the terms it sums, as the usual path reads them
    (:func:`_convolution_elements` and the two like it), gathered by the per-op path."""
    b = _bind(func, args, kwargs)
    backward = checker.kinds.get(func) is _convolution_backward
    x, w = b["input"], b["weight"]
    grad, bias = (b["grad_output"], None) if backward else (None, b["bias"])
    geometry = [list(b[name]) for name in ("stride", "padding", "dilation")]
    d = x.dim() - 2
    if checker.reduced_precision is not None or b["transposed"] or d < 1 or w.dim() != x.dim():
        return None
    if any(len(g) != d for g in geometry) or not _floating(x, w, bias, grad) or x.dtype != w.dtype:
        return None
    if _eps_matrix(w.dtype, w.device, True, None) is not None:
        return None
    wanted = [grad, x, w] if backward else [x, w, *([bias] if bias is not None else [])]
    if len(tensors) != len(wanted) or any(t is not u for t, u in zip(tensors, wanted)):
        return None
    groups, kernel = b["groups"], math.prod(w.shape[2:])
    out_size = _output_size(x, w, b)
    if groups < 1 or x.shape[1] != w.shape[1] * groups or w.shape[0] % groups or min(out_size) <= 0:
        return None
    if grad is not None and list(grad.shape) != [x.shape[0], w.shape[0], *out_size]:
        return None
    tail = (d, groups, *(v for g in geometry for v in g))
    device = torch.device("cpu")

    def made(role: int, index: int, t: Any, k: int, width: int, coherent: bool) -> Recipe | None:
        # Each slot's terms (k, width) or nothing (a tensor the role does not read); the bias (k,)
        shape = {CONV_OUTPUT: [x.shape[0], w.shape[0], *out_size], CONV_INPUT_GRADIENT: list(x.shape)}
        if not isinstance(t, torch.Tensor) or not _sampled_readable(t) or t.dtype != w.dtype:
            return None
        if list(t.shape) != shape.get(role, list(w.shape)) or len(t.shape) > RECIPE_DIMS:
            return None
        reads = {CONV_OUTPUT: (0, 1, 2), CONV_INPUT_GRADIENT: (0, 2), CONV_WEIGHT_GRADIENT: (0, 1)}[role]
        shapes = tuple(((k,) if i == 2 and not backward else (k, width)) if i in reads else (0,)
                       for i in range(len(tensors)))  # fmt: skip
        inputs = tuple(i for i in reads if i < len(tensors))
        key = ("conv terms", tuple(shapes[i] for i in inputs), device)
        batch = _Batch(key, _term_sums, ())
        eps_acc = torch.finfo(w.dtype).eps if coherent else None
        n = width + (bias is not None)
        target = _batched(0, _gathered, batch, n, eps_acc, "matmul", k, coherent=coherent)
        limit = _limits(target, t.dtype)[-1]
        sizes = tuple(t.shape)
        return Recipe(
            sizes, math.prod(sizes), k, limit, _SAMPLED_CODES[t.dtype], _number_array(), [], sizes,
            (GRID_CONV, role, *tail), "matmul", k, index, (), (), target, t.dtype, len(tensors), shapes, inputs, (),
        )  # fmt: skip

    if not backward:
        width = math.prod(w.shape[1:])
        return made(CONV_OUTPUT, -1, out, _conv_sample(checker, width, False), width, False)
    # As the usual path: 16-bit kernels' sums are fitted one scale through a wider sample.
    sixteen = w.dtype in (torch.float16, torch.bfloat16)
    mask, outputs = b["output_mask"], out if isinstance(out, (tuple, list)) else ()
    terms = x.shape[0] * math.prod(out_size)
    recipes = []
    if mask[0] and len(outputs) > 0:
        width = w.shape[0] // groups * kernel
        recipes.append(made(CONV_INPUT_GRADIENT, 0, outputs[0], _conv_sample(checker, width, sixteen), width, sixteen))
    if mask[1] and len(outputs) > 1:
        recipes.append(made(CONV_WEIGHT_GRADIENT, 1, outputs[1], _conv_sample(checker, terms, sixteen), terms, sixteen))
    if not recipes or None in recipes:
        return None
    first, *rest = recipes
    return first._replace(more=tuple(rest))  # type: ignore[union-attr]


def _conv_terms(grid: Sequence[int], tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> list[torch.Tensor]:
    """What a GRID_CONV recipe gathers of each of the call's tensors at sampled positions ``flat``:
    the two factors of every term summed (both 0 where a tap reads nothing), the bias, or nothing."""
    _, role, d, groups, *rest = grid
    b = {"stride": rest[:d], "padding": rest[d : 2 * d], "dilation": rest[2 * d :], "groups": groups}
    nothing = torch.empty(0)
    if role == CONV_OUTPUT:
        left, right, valid, *bias = _output_taps(
            tensors[0], tensors[1], tensors[2] if len(tensors) > 2 else None, b, flat
        )
    elif role == CONV_INPUT_GRADIENT:
        grad, x, w = tensors
        left, right, valid = _input_gradient_taps(grad, x.shape, w, b, flat)
    else:
        grad, x, w = tensors
        left, right, valid = _weight_gradient_taps(grad, x, w.shape, b, flat)
    left, right = (torch.where(valid, t.to(F64), 0.0).flatten(1) for t in (left, right))
    if role == CONV_OUTPUT:
        return [left, right, *bias]
    return [left, nothing, right] if role == CONV_INPUT_GRADIENT else [left, right, nothing]


def _term_sums(left: torch.Tensor, right: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Float64 value and scale of sums of products of gathered terms (..., width), plus a bias."""
    terms = left * right
    # |l * r| is |l| * |r| exactly: the scale from the same products.
    value, scale = terms.sum(-1), terms.abs().sum(-1)
    if bias is not None:
        value, scale = value + bias, scale + bias.abs()
    return value, scale


def _batch_norm_recipe(
    checker: SelfChecker,
    func: Any,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    outputs: Any,
    tensors: list[torch.Tensor],
) -> Recipe | None:
    """A ``native_batch_norm`` (:func:`_batch_norm`) or its backward (:func:`_batch_norm_backward`)
    at a block of adjacent channels: those channels of its input (and output gradient) whole, its
    weight, bias and statistics at them; its output (input gradient) along them, and at them its
    saved mean and 1/std in training (its weight and bias gradients), as extras."""
    backward = checker.kinds.get(func) is _batch_norm_backward
    if func.overloadpacket.__name__ != ("native_batch_norm_backward" if backward else "native_batch_norm"):
        return None
    b = _bind(func, args, kwargs)
    x, weight = b["input"], b["weight"]
    first = b["grad_out"] if backward else x
    training = bool(b["train"] if backward else b["training"])
    if backward:
        mean, rstd = (b["save_mean"], b["save_invstd"]) if training else (b["running_mean"], b["running_var"])
        wanted = [i for i, wants in enumerate(b["output_mask"]) if wants]
        per_channel = [weight, mean, rstd]
    else:
        mean, rstd = b["running_mean"], b["running_var"]
        wanted = [0, 1, 2] if training else [0]
        per_channel = [weight, b["bias"], *(() if training else (mean, rstd))]
    if first is not tensors[0] or x.dim() < 2 or (backward or not training) and (mean is None or rstd is None):
        return None
    if not isinstance(outputs, (tuple, list)) or len(outputs) != 3 or not wanted or wanted[0] != 0:
        return None
    channels, length = x.shape[1], x.numel() // max(x.shape[1], 1)
    if any(not t.is_floating_point() or (t.shape != x.shape and t.shape != (channels,)) for t in tensors):
        return None
    if not length or any(t.shape != x.shape for t in tensors[: 1 + backward]) or outputs[0].shape != x.shape:
        return None
    block = min(checker.sample, max(1, CHANNEL_BUDGET // ((1 + backward) * length)), channels)
    # The output is compared at a few positions of each channel, as the usual path compares it (an
    # honest kernel's largest error over a whole channel, 10^5 elements, passes its allowance).
    positions = tuple(sorted(checker._pick(length, min(4 * checker.sample, CHANNEL_POSITIONS)).tolist()))
    position = {id(t): i for i, t in enumerate(tensors)}
    if x is not tensors[int(backward)] or any(t is not None and id(t) not in position for t in per_channel):
        return None
    inputs = tuple(range(1 + backward)) + tuple(position[id(t)] for t in per_channel if t is not None)
    shapes = tuple((block, length) if t.shape == x.shape else (block,) for t in tensors)
    # CPU kernels of 16-bit inputs normalize with statistics held at the input's precision (as
    # the usual path: a 5% scale then shows only as a scale fitted through the channels).
    sixteen = not backward and x.dtype in (torch.float16, torch.bfloat16)
    eps_acc = torch.finfo(x.dtype).eps if sixteen else None
    if backward:
        constants: tuple[Any, ...] = (weight is not None, training, b["eps"])
        values = _batch_norm_backward_channels_values
    else:
        constants = (weight is not None, b["bias"] is not None, training, b["eps"])
        values = _batch_norm_channels_values
    device = torch.device("cpu")
    targets, limits = [], []
    for which in wanted:
        key = ("batch_norm channels", backward, which, constants, positions, tuple(shapes[i] for i in inputs), device)
        batch = _Batch(key, functools.partial(values, which, constants, torch.tensor(positions)), ())
        n = length if training or which else 1
        targets.append(_batched(which, _gathered, batch, n, eps_acc, "rows", block, coherent=sixteen and not which))
        t = outputs[which]
        if not isinstance(t, torch.Tensor) or not _sampled_readable(t):
            return None
        if _SAMPLED_CODES.get(t.dtype, _FLOATING_CODES) >= _FLOATING_CODES or (which and t.shape != (channels,)):
            return None
        limits.append(_limits(targets[-1], t.dtype)[-1])
    out = outputs[0]
    extras = tuple((which, (channels,), _SAMPLED_CODES[outputs[which].dtype], limit, block)
                   for which, limit in zip(wanted[1:], limits[1:]))  # fmt: skip
    return Recipe(
        tuple(x.shape), x.numel(), block * len(positions), limits[0], _SAMPLED_CODES[out.dtype], _number_array(), [],
        tuple(out.shape), (GRID_CHANNELS, block, *positions), "rows", block, 0, extras, (), targets[0], out.dtype,
        len(tensors),
        shapes, inputs, (), extra_targets=tuple((t, outputs[w].dtype) for t, w in zip(targets[1:], wanted[1:])),
    )  # fmt: skip


def _batch_norm_channels_values(
    which: int,
    constants: tuple[bool, bool, bool, float],
    positions: torch.Tensor,
    values: torch.Tensor,
    *per_channel: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 ``ref`` of a batch norm's output at ``positions`` of gathered channels ``values``
    (..., block, length) (``which`` 0), or of its saved mean (1) or 1/std (2) at them, from the
    weight and bias that are given, then in evaluation the running mean and variance, at them
    (..., block)."""
    has_weight, has_bias, training, eps = constants
    given = iter(t[..., None] for t in per_channel)
    w = next(given) if has_weight else None
    bb = next(given) if has_bias else None
    if training:
        mean = values.mean(-1, keepdim=True)
        rstd = ((values - mean).square().mean(-1, keepdim=True) + eps).rsqrt()  # centred (Tensor.var is slower)
        # The variance cancels by the mean's own size (E x^2 - mean^2), not by that of |x|.
        stats = (mean, rstd, values.abs().mean(-1, keepdim=True), 1 + mean.abs() * rstd)
    else:  # running statistics are read, not summed
        mean = next(given)
        rstd = (next(given) + eps).rsqrt()
        stats = (mean, rstd, mean.abs(), torch.ones_like(mean))
    value, scale = _normalization(values[..., positions], lambda: stats, w, bb)[which]()
    return (value.flatten(-2), scale.flatten(-2)) if which == 0 else (value, scale)


def _batch_norm_backward_channels_values(
    which: int,
    constants: tuple[bool, bool, float],
    positions: torch.Tensor,
    gs: torch.Tensor,
    xs: torch.Tensor,
    *per_channel: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 ``ref`` of a batch norm's input gradient at ``positions`` of gathered channels of the
    output gradient and input ``gs``, ``xs`` (..., block, length) (``which`` 0), or of its weight (1) or
    bias (2) gradient at them, from the weight if given and the statistics the op reads (saved
    mean and 1/std in training, running mean and variance in evaluation) at them (..., block)."""
    has_weight, training, eps = constants
    given = iter(t[..., None] for t in per_channel)
    w = next(given) if has_weight else None
    mu, rs = next(given), next(given)
    if not training:
        rs = (rs + eps).rsqrt()
    xhat = (xs - mu) * rs
    spread = (xs.abs() + mu.abs()) * rs  # what xhat is known to: x - mean cancels
    if which == 1:
        return (gs * xhat).sum(-1), (gs.abs() * spread).sum(-1)
    if which == 2:
        return gs.sum(-1), gs.abs().sum(-1)
    gw = gs * w if w is not None else gs
    at_gw, at_xhat, at_spread = gw[..., positions], xhat[..., positions], spread[..., positions]
    if not training:
        return (at_gw * rs).flatten(-2), (at_gw.abs() * rs).flatten(-2)
    value = rs * (at_gw - gw.mean(-1, keepdim=True) - at_xhat * (gw * xhat).mean(-1, keepdim=True))
    spreads = (gw.abs() * spread).mean(-1, keepdim=True)
    scale = rs * (at_gw.abs() + gw.abs().mean(-1, keepdim=True) + at_spread * spreads)
    return value.flatten(-2), scale.flatten(-2)


def _placed_recipe(
    checker: SelfChecker,
    func: Any,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    out: torch.Tensor,
    tensors: list[torch.Tensor],
) -> Recipe | None:
    """``select_backward`` or ``slice_backward`` (:func:`_scattered`): at sampled positions of the
    output, the gradient's element placed there or 0, exactly."""
    geometry = _placement(func, _bind(func, args, kwargs))
    grad = tensors[0]
    if geometry is None or len(tensors) != 1 or not grad.is_floating_point() or out.dtype != grad.dtype:
        return None
    sizes, grid = geometry
    if tuple(out.shape) != sizes or not out.numel() or len(sizes) > RECIPE_DIMS:
        return None
    k = checker.sample
    batch = _Batch(("exact", F64, (k,), torch.device("cpu")), _exact_values, ())
    target = _batched(0, _gathered, batch, 1, None, "exact", k, grad.dtype)
    limit = _limits(target, out.dtype)[-1]
    code, gathered = _SAMPLED_CODES[out.dtype], _number_array()
    return Recipe(
        sizes, math.prod(sizes), k, limit, code, gathered, [], sizes, grid, "exact", k, -1, (), (), target, out.dtype,
        1, ((k,),), (0,), (),
    )  # fmt: skip


def _placement(func: Any, b: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """A select's or slice's backward: the output's sizes and the GRID_PLACED grid, or None where
    its gradient's shape is not the one it places."""
    grad, sizes = b["grad_output"], tuple(int(size) for size in b["input_sizes"])
    if not sizes:
        return None
    dim = b["dim"] % len(sizes)
    if func.overloadpacket.__name__ == "select_backward":
        start, step, taken, dropped = b["index"] % sizes[dim], 1, 1, 1
    else:
        start, end, step = slice(b["start"], b["end"], b["step"]).indices(sizes[dim])
        taken, dropped = len(range(start, end, step)), 0
    expected = (*sizes[:dim], *([] if dropped else [taken]), *sizes[dim + 1 :])
    if tuple(grad.shape) != expected or step < 1:
        return None
    return sizes, (GRID_PLACED, dim, start, step, taken, dropped)


def _placed(grad: torch.Tensor, sizes: Sequence[int], grid: Sequence[int], flat: torch.Tensor) -> torch.Tensor:
    """The values a GRID_PLACED recipe's op puts at row-major positions ``flat`` of ``sizes``:
    the gradient's element placed there, or 0 (in its dtype, on its device)."""
    _, dim, start, step, taken, dropped = grid
    coords = _unravel(flat, sizes)
    at = coords[dim] - start
    inside = (at >= 0) & (at % step == 0) & (at // step < taken)
    source = coords[:dim] + ([] if dropped else [(at // step).clamp(0, max(taken - 1, 0))]) + coords[dim + 1 :]
    picked = _take(grad, _offset(source, grad.shape) if source else torch.zeros_like(flat))
    return torch.where(inside.to(grad.device), picked, torch.zeros((), dtype=grad.dtype, device=grad.device))


def _normalized_rows(
    checker: SelfChecker, x: torch.Tensor, normalized: int, mean: torch.Tensor, rstd: torch.Tensor, read: int
) -> tuple[int, int, int, tuple[int, ...]] | None:
    """A layer norm's rows for its recipes (normalized over the last ``normalized`` dimensions of
    ``x``): their number and length, the block read and the GRID_ROWS grid (its output read along
    them); None where the saved mean and 1/std are not one a row, or ``read`` tensors of the
    block's rows would pass the gather budget."""
    dims = list(range(x.dim() - normalized, x.dim()))
    kept = [d for d in range(x.dim()) if d not in dims]
    saved = [x.shape[d] if d in kept else 1 for d in range(x.dim())]
    if not kept or list(mean.shape) != saved or list(rstd.shape) != saved:
        return None
    count, length = math.prod(x.shape[d] for d in kept), math.prod(x.shape[d] for d in dims)
    block = min(checker.sample, count)
    if not length or block * length * read > GATHER_BUDGET:  # empty rows: nothing to read
        return None
    return count, length, block, (GRID_ROWS, block, len(kept), 1, *kept, *dims)


def _layer_norm_recipe(
    checker: SelfChecker,
    func: Any,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    outputs: Any,
    tensors: list[torch.Tensor],
) -> Recipe | None:
    """A layer norm (:func:`_layer_norm`) at a block of adjacent rows: those rows of its input, its
    weight and bias whole; its output along the rows, its mean and 1/std at them (extras)."""
    b = _bind(func, args, kwargs)
    x, weight, bias = b["input"], b["weight"], b["bias"]
    if x is not tensors[0] or not all(t.is_floating_point() for t in tensors) or len(outputs) != 3:
        return None
    out, mean, rstd = outputs
    if not all(isinstance(t, torch.Tensor) and _sampled_readable(t) for t in (mean, rstd)) or out.shape != x.shape:
        return None
    if any(t.dim() >= x.dim() or t.dtype not in _SAMPLED_CODES for t in tensors[1:]):
        return None
    if any(_SAMPLED_CODES.get(t.dtype, _FLOATING_CODES) >= _FLOATING_CODES for t in (mean, rstd)):
        return None
    rows = _normalized_rows(checker, x, len(b["normalized_shape"]), mean, rstd, 1)
    if rows is None:
        return None
    count, length, block, grid = rows
    constants = (weight is not None, bias is not None, b["eps"])
    shapes = ((block, length), *((t.numel(),) for t in tensors[1:]))
    device = torch.device("cpu")
    targets = []
    for which in range(3):
        key = ("layer_norm rows", which, constants, shapes, device)
        batch = _Batch(key, functools.partial(_layer_norm_rows_values, which, constants), ())
        targets.append(_batched(which, _gathered, batch, length, None, "rows", block))
    limits = [_limits(target, t.dtype)[-1] for target, t in zip(targets, outputs)]
    extras = tuple((which, tuple(outputs[which].shape), _SAMPLED_CODES[outputs[which].dtype], limits[which], block)
                   for which in (1, 2))  # fmt: skip
    code, gathered = _SAMPLED_CODES[out.dtype], _number_array()
    return Recipe(
        tuple(x.shape), count * length, block * length, limits[0], code, gathered, [], tuple(out.shape), grid,
        "rows", block, 0, extras, (), targets[0], out.dtype, len(tensors), shapes, tuple(range(len(tensors))), (),
        extra_targets=((targets[1], mean.dtype), (targets[2], rstd.dtype)),
    )  # fmt: skip


def _layer_norm_rows_values(
    which: int, constants: tuple[bool, bool, float], values: torch.Tensor, *affine: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_layer_norm_values` of gathered whole rows (..., k, length): the output at every
    column of them."""
    cols = torch.arange(values.shape[-1], device=values.device).expand(*values.shape[:-2], values.shape[-1])
    return _layer_norm_values(which, constants, values, cols, *affine)


def _layer_norm_backward_recipe(
    checker: SelfChecker,
    func: Any,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    out: torch.Tensor,
    tensors: list[torch.Tensor],
) -> Recipe | None:
    """A layer norm's input gradient (:func:`_layer_norm_backward`) at a block of adjacent rows:
    those rows of the output gradient and input, the saved mean and 1/std there, the weight (and
    bias, unused) whole; the gradient read along the rows."""
    b = _bind(func, args, kwargs)
    grad, x, mean, rstd, weight = b["grad_out"], b["input"], b["mean"], b["rstd"], b["weight"]
    if not b["output_mask"][0] or not all(t.is_floating_point() for t in tensors) or grad is not tensors[0]:
        return None
    if grad.shape != x.shape or out.shape != x.shape or any(t.dim() >= x.dim() for t in tensors[4:]):
        return None
    rows = _normalized_rows(checker, x, len(b["normalized_shape"]), mean, rstd, 2)
    if rows is None:
        return None
    count, length, block, grid = rows
    shapes = tuple((block, length) if t.dim() == x.dim() and t.shape == x.shape else (block,) if t.dim() == x.dim()
                   else (t.numel(),) for t in tensors)  # fmt: skip
    # In the values function's order: input, output gradient, mean, 1/std[, weight]
    position = {id(t): i for i, t in enumerate(tensors)}
    inputs = tuple(position[id(t)] for t in (x, grad, mean, rstd, weight) if t is not None)
    device = torch.device("cpu")
    key = ("layer_norm_backward", tuple(shapes[i] for i in inputs), device)
    batch = _Batch(key, _layer_norm_backward_values, ())
    target = _batched(0, _gathered, batch, length, None, "rows", block)
    limit = _limits(target, out.dtype)[-1]
    code, gathered = _SAMPLED_CODES[out.dtype], _number_array()
    return Recipe(
        tuple(x.shape), count * length, block * length, limit, code, gathered, [], tuple(out.shape), grid, "rows",
        block, 0, (), (), target, out.dtype, len(tensors), shapes, inputs, (),
    )  # fmt: skip


def _recompute_by_floats(
    checker: SelfChecker, recipe: Recipe, inputs: list[torch.Tensor], floats: torch.Tensor, got: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual and coarse residual of each of a recipe's calls (a row each in ``inputs``,
    ``floats``, ``got``): one float64 pass for the calls that took the same floats."""
    if not floats.shape[1]:
        residual, coarse, _ = _recompute(recipe.target, inputs, got, recipe.out_dtype)
        return residual, coarse
    residual, coarse = torch.empty(len(got), dtype=F64), torch.empty(len(got), dtype=F64)
    values, calls = torch.unique(floats, dim=0, return_inverse=True)
    if len(values) > 1:
        # An optimizer's step size or bias correction changes every step: one pass for all of
        # them where the op takes its floats as tensors, rather than a pass per step.
        try:
            if _recompute_by_columns(recipe, inputs, floats, got, residual, coarse):
                return residual, coarse
        except (RuntimeError, TypeError, ValueError, IndexError):
            pass  # the calls are recomputed float by float below
    for i, taken in enumerate(values.tolist()):
        picked = calls == i
        target = recipe.target_for(checker, taken)
        residual[picked], coarse[picked], _ = _recompute(
            target, [t[picked] for t in inputs], got[picked], recipe.out_dtype
        )
    return residual, coarse


def _recompute_by_columns(
    recipe: Recipe,
    inputs: list[torch.Tensor],
    floats: torch.Tensor,
    got: torch.Tensor,
    residual: torch.Tensor,
    coarse: torch.Tensor,
) -> bool:
    """:func:`_recompute_by_floats` in one float64 pass (two for an add whose ``alpha`` is 1 in
    some calls only), each float argument a column of the calls' values (:func:`_column_plan`),
    into ``residual`` and ``coarse``; False where the op cannot take its floats so."""
    func, (args, kwargs) = recipe.skeleton
    names = _schema_arguments(func)[0]
    taking = tuple(names[i] for i, a in enumerate(args) if a is _FLOAT) + tuple(
        name for name, v in kwargs.items() if v is _FLOAT
    )
    plan = _column_plan(func, taking)
    if plan is None:
        return False
    overload, folded = plan
    columns = iter(floats.split(1, dim=1))  # (calls, 1) each: broadcast along the sampled values
    scale = None
    if folded is not None:  # the last float scales the tensor argument ``folded``
        at = names.index(folded)
        if at >= len(args) or args[at] is not _SLOT:
            return False
        scale, slot = floats[:, -1:], sum(a is _SLOT for a in args[:at])
        inputs = [t * scale if i == slot else t for i, t in enumerate(inputs)]
    column_args = [next(columns) if a is _FLOAT else a for a in args]
    column_kwargs = {name: (next(columns) if v is _FLOAT else v) for name, v in kwargs.items()}
    if folded is not None:
        column_kwargs[taking[-1]] = 1
    # Whether an add or sub rounds once depends on its alpha being 1 (_pointwise_batch): calls
    # split by it; any other op's is the same for all its calls.
    ones = (scale == 1).reshape(-1) if scale is not None else torch.ones(len(got), dtype=torch.bool)
    for once in (True, False):
        picked = ones if once else ~ones
        if not bool(picked.any()):
            continue
        template = (
            [a[picked] if isinstance(a, torch.Tensor) else a for a in column_args],
            {k: (v[picked] if isinstance(v, torch.Tensor) else v) for k, v in column_kwargs.items()},
        )
        alpha = {taking[-1]: 1 if once else 2} if scale is not None else {}
        relative = _relative(func, args, {**kwargs, **alpha})
        batch = _Batch((), functools.partial(_pointwise_values, overload, template, relative), ())
        residual[picked], coarse[picked], _ = _recompute(
            recipe.target._replace(batch=batch), [t[picked] for t in inputs], got[picked], recipe.out_dtype
        )
    return True


# A pointwise op's float argument that scales one of its tensors: folded into that tensor's
# gathered values where the calls took other values (_recompute_by_columns).
_FOLDED = {"add": "other", "sub": "other", "addcdiv": "tensor1", "addcmul": "tensor1"}


_TENSOR_TYPES = ("Tensor", "Optional[Tensor]")


@functools.lru_cache(maxsize=None)
def _column_plan(func: Any, taking: tuple[str, ...]) -> tuple[Any, str | None] | None:
    """How a pointwise overload takes per-call values of its float arguments ``taking`` as tensors:
    the overload of its op with a tensor at each (``mul.Tensor`` for ``mul.Scalar``; itself where
    the float stood for a tensor), and the argument its last float scales where that one is an
    ``alpha`` or ``value`` (None where it is not); None where it has no such overload.

    >>> from torch.ops import aten
    >>> _column_plan(aten.mul.Scalar, ("other",))
    (<OpOverload(op='aten.mul', overload='Tensor')>, None)
    >>> _column_plan(aten.addcdiv_.default, ("value",))
    (<OpOverload(op='aten.addcdiv_', overload='default')>, 'tensor1')
    >>> _column_plan(aten.elu.default, ("alpha",)) is None
    True
    """
    folded = _FOLDED.get(func.overloadpacket.__name__.rstrip("_"))
    if taking and taking[-1] in ("alpha", "value") and folded is not None:
        taking = taking[:-1]
    else:
        folded = None

    def form(overload: Any, wanted: bool) -> list[tuple[str, str, bool, bool]]:
        """Each argument's name, type, and whether it is keyword-only and written; a taken one's
        type is a tensor's (optional or not) in the overload sought."""
        return [
            (
                a.name,
                ("Tensor" if wanted or str(a.type) in _TENSOR_TYPES else "") if a.name in taking else str(a.type),
                a.kwarg_only,
                bool(a.alias_info and a.alias_info.is_write),
            )
            for a in overload._schema.arguments
        ]

    wanted = form(func, True)
    packet = func.overloadpacket
    for name in packet.overloads():
        overload = getattr(packet, name)
        if form(overload, False) == wanted and len(overload._schema.returns) == len(func._schema.returns):
            return overload, folded
    return None


def _relative(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a pointwise op's float64 value is what the kernel rounds, relative to itself (its
    terms' sizes need no scale): it rounds once (an add of alpha 1, a mul), or is one of the
    functions computed to within a few ulps of their own value (exp, tanh)."""
    name = func.overloadpacket.__name__
    return (name in _ROUNDED_ONCE and _alpha(func, args, kwargs) == 1) or name in _RELATIVE


def _float_item(item: Any) -> bool:
    """A float argument in a memo key (``trace.args.scan_value`` writes it ``(float, value)``)."""
    return type(item) is tuple and len(item) == 2 and item[0] is float


_FLOAT = object()  # where a call's own float goes in a recipe's skeleton


def _copy_source(func: Any, tensors: Sequence[torch.Tensor]) -> int | None:
    """Which of an exact copy's tensors it copies from (``src`` of ``copy_``, else ``self``); None
    for an embedding (its rows are picked by index: checked the usual way)."""
    name = func.overloadpacket.__name__
    if name == "copy_":
        return 1 if len(tensors) == 2 else None
    return 0 if name in ("_to_copy", "clone", "_unsafe_view") and len(tensors) == 1 else None


def _number_array() -> Any:
    """A growable float64 array the per-op path appends to (the C module's where it is built)."""
    return native.NUMBER_ARRAY("d")


def _clear(values: Any) -> None:
    if hasattr(values, "truncate"):
        values.truncate(0)
    else:
        del values[:]


@functools.lru_cache(maxsize=None)
def _alpha_position(func: Any) -> int | None:
    """Where an overload takes ``alpha`` (add, sub), None where it takes none."""
    names = _schema_arguments(func)[0]
    return names.index("alpha") if "alpha" in names else None


def _alpha(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """The call's ``alpha`` (1 where the op has none or the call leaves the default)."""
    position = _alpha_position(func)
    if position is None:
        return 1
    return args[position] if position < len(args) else kwargs.get("alpha", 1)


def _constants(template: tuple[list[Any], dict[str, Any]]) -> tuple[Any, ...]:
    """A call's arguments other than its tensors, hashable: part of what makes calls alike."""
    args, kwargs = template
    return tuple(("T" if a is _SLOT else (type(a), a)) for a in args) + tuple(
        (k, "T" if v is _SLOT else (type(v), v)) for k, v in kwargs.items()
    )


def _pointwise_values(
    func: Any, template: tuple[list[Any], dict[str, Any]], relative: bool, *tensors: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """The float64 value, scale and excess of a pointwise op at gathered inputs (any leading rows)."""
    slots = iter(t if t.dtype == torch.bool else t.to(F64) for t in tensors)
    args = [next(slots) if a is _SLOT else a for a in template[0]]
    kwargs = {k: (next(slots) if v is _SLOT else v) for k, v in template[1].items()}
    # Each call on fresh copies: an in-place overload writes its (gathered) self.
    fresh = lambda a: a.clone() if isinstance(a, torch.Tensor) else a  # noqa: E731
    value = func(*map(fresh, args), **{k: fresh(v) for k, v in kwargs.items()})
    # An element computed from NaN/Inf is judged by nobody's float64: kernels differ there
    # (fp32 gelu(inf) is NaN). NaN marks it unjudged (see _worst).
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            value = torch.where(a.isfinite(), value, math.nan)
    if relative:
        zero = torch.zeros((), dtype=F64, device=value.device)
        return value, zero, zero
    # The op on absolute values: the size of its terms before they cancel (|a| + |alpha b|
    # for add, |x| for gelu's x (1 + erf)), what intermediate roundings are relative to. An
    # input's own size is no such measure: addcmul's value * t1 * t2 may be far below t1.
    on_abs = _finite_scale(func(*map(_nonneg, args), **{k: _nonneg(v) for k, v in kwargs.items()}).abs())
    # How far the op's terms cancel (|f(|x|)| - |f(x)|): 16-bit kernels may round such
    # intermediate terms (alpha * b in add) at the output's own precision.
    return value, on_abs, (on_abs - value.abs()).clamp(min=0)


def _batched(
    index: int,
    gather: Callable[[torch.Tensor], torch.Tensor],
    batch: _Batch,
    n: int,
    eps_acc: float | None,
    how: str,
    sampled: int,
    source_dtype: torch.dtype | None = None,
    coherent: bool = False,
) -> _Target:
    """A target recomputed by ``batch``: for its call alone, or with its calls alike when deferred."""
    return _Target(index, gather, None, n, eps_acc, how, sampled, source_dtype, None, coherent, batch)


# --- matmul family ---


def _matmul(checker: SelfChecker, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[_Target, ...] | None:
    b = _bind(func, args, kwargs)
    name = func.overloadpacket.__name__
    if name == "_addmm_activation" and b["use_gelu"]:
        return None  # the fused gelu's approximation differs by backend
    first, second = {
        "mm": ("self", "mat2"),
        "bmm": ("self", "mat2"),
        "addmm": ("mat1", "mat2"),
        "_addmm_activation": ("mat1", "mat2"),
        "baddbmm": ("batch1", "batch2"),
        "mv": ("self", "vec"),
        "addmv": ("mat", "vec"),
        "dot": ("self", "tensor"),
    }[name]
    bias = b["self"] if first != "self" else None
    beta, alpha = b.get("beta", 1), b.get("alpha", 1)
    if beta == 0:
        bias = None  # torch ignores self (NaN included) when beta is 0
    A, B = b[first].detach(), b[second].detach()
    if not _floating(A, B):
        return None
    if bias is not None and not (_plain(bias) and _real(bias)):
        return None
    out_shape = {"mv": A.shape[:1], "addmv": A.shape[:1], "dot": torch.Size()}.get(name)
    if out_shape is None:
        out_shape = (*A.shape[:-1], B.shape[-1])
    # One layout for all: A (batch, m, K), B (batch, K, n).
    A3 = A.reshape((1,) * (3 - A.dim()) + A.shape) if A.dim() < 3 else A
    B3 = B[:, None] if B.dim() == 1 else B
    B3 = B3[None] if B3.dim() == 2 else B3
    batch, m, K = A3.shape
    n = B3.shape[-1]
    grid = A.dim() == 2
    if grid:
        # A matrix (any strides): a block of adjacent rows of A and one of adjacent columns of B,
        # whose every crossing is a sampled element (16 elements from 4 + 4 vectors of K, not
        # 16 + 16). Adjacent: the columns of a row-major B (the rows of a column-major A) then
        # share their cache lines, where scattered ones would read a line per element.
        j, cols = checker._block(n, math.isqrt(max(checker.sample - 1, 0)) + 1)
        i, count = checker._block(m, -(-checker.sample // cols))
        flat = torch.tensor([r * n + c for r in range(i, i + count) for c in range(j, j + cols)])
        rows32 = A.narrow(0, i, count).clone()
        cols32 = B3.select(0, 0).narrow(1, j, cols).clone()  # (K, cols)
    else:
        flat = checker._sample(batch * m * n)
        bb, i, j = flat // (m * n), (flat // n) % m, flat % n
        rows32 = _take(A3, _row_index(bb * m + i, K))
        cols32 = _take(B3.transpose(-1, -2), _row_index(bb * n + j, K))
    tensors = [rows32, cols32]
    if bias is not None:
        tensors.append(_take(bias.detach().expand(out_shape), flat))
    relu = name == "_addmm_activation"
    eps_acc = _eps_matrix(A.dtype, A.device, False, checker.reduced_precision)
    models = _rounding_models(A.dtype, eps_acc)
    constants = (alpha, beta, relu, grid)
    fn = functools.partial(_matmul_values, constants, None)
    fitted = functools.partial(_matmul_models, constants, models) if models else None
    key = ("matmul", constants, tuple((t.dtype, t.shape, t.device) for t in tensors), eps_acc)
    batch_of = _Batch(key, fn, tuple(tensors), fitted)
    gather = functools.partial(_gathered, flat)
    return (_batched(0, gather, batch_of, K + (bias is not None), eps_acc, "matmul", flat.numel()),)


def _matmul_values(
    constants: tuple[float, float, bool, bool],
    rounding: Callable[[torch.Tensor], torch.Tensor] | None,
    rows: torch.Tensor,
    cols: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 value and scale of sampled matmul elements from their rows and columns: each
    row with each column (``grid``: rows (..., r, K), columns (..., K, c)), or row ``i`` with
    column ``i`` (both (..., k, K)) (operands rounded first by a device's ``rounding`` model,
    where given)."""
    alpha, beta, relu, grid = constants
    if rounding is not None:
        rows, cols = rounding(rows), rounding(cols)
    rows, cols = rows.to(F64), cols.to(F64)
    if grid:
        value = alpha * (rows @ cols).flatten(-2)
        scale = abs(alpha) * (rows.abs() @ cols.abs()).flatten(-2)
    else:
        value = alpha * (rows * cols).sum(-1)
        scale = abs(alpha) * (rows.abs() * cols.abs()).sum(-1)
    if bias is not None:
        b64 = bias.to(F64)
        value, scale = value + beta * b64, scale + abs(beta) * b64.abs()
    return (value.clamp(min=0) if relu else value), scale


def _matmul_models(
    constants: tuple[float, float, bool, bool],
    models: Sequence[Callable[[torch.Tensor], torch.Tensor]],
    rows: torch.Tensor,
    cols: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    return [_matmul_values(constants, rounding, rows, cols, bias)[0] for rounding in models]


# --- convolution ---


def _convolution(
    checker: SelfChecker, func: Any, args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[_Target, ...] | None:
    b = _bind(func, args, kwargs)
    x, w, bias = b["input"], b["weight"], b["bias"]
    if not _floating(x, w, bias) or x.dim() != w.dim():
        return None
    if b["transposed"] and w.dtype in (torch.float16, torch.bfloat16):
        return None  # 16-bit transposed convolutions may sum overlapping taps at 16 bits (CPU col2im)
    eps_acc = _eps_matrix(w.dtype, w.device, True, checker.reduced_precision)
    models = _rounding_models(w.dtype, eps_acc) if x.dtype == torch.float32 else ()
    if not (checker.full or b["transposed"]):
        element = _convolution_elements(checker, x, w, bias, b, eps_acc, models)
        return (element,) if element is not None else None
    picked = checker._sample(x.shape[0])
    xs32 = x.detach().index_select(0, picked.to(x.device))
    xs = xs32.to(F64)
    w64 = w.detach().to(F64)
    b64 = bias.detach().to(F64) if bias is not None else None
    rest = (b["stride"], b["padding"], b["dilation"], b["transposed"], b["output_padding"], b["groups"])

    def ref() -> tuple[torch.Tensor, torch.Tensor]:
        value = torch.convolution(xs, w64, b64, *rest)
        scale = torch.convolution(xs.abs(), w64.abs(), b64.abs() if b64 is not None else None, *rest)
        return value, scale

    def gather(o: torch.Tensor) -> torch.Tensor:
        return o.index_select(0, picked.to(o.device))

    per_output = (w.shape[0] // b["groups"] if b["transposed"] else w.shape[1]) * math.prod(w.shape[2:])

    def fitted() -> list[torch.Tensor]:
        w32 = w.detach()
        return [torch.convolution(r(xs32).to(F64), r(w32).to(F64), b64, *rest) for r in models]

    n = per_output + (bias is not None)
    return (_Target(0, gather, ref, n, eps_acc, "batch", picked.numel(), None, fitted if models else None),)


class _Gradients(NamedTuple):
    """One ``convolution_backward`` call as its gradients' checks read it."""

    grad: torch.Tensor
    x: torch.Tensor
    w: torch.Tensor
    b: dict[str, Any]  # the call's arguments by name
    eps_acc: float | None
    models: tuple[Callable[[torch.Tensor], torch.Tensor], ...]  # float32 operands' rounding on the device
    coherent: bool  # also fit one scale through the sample (16-bit sums)

    @property
    def rest(self) -> tuple[Any, ...]:
        b = self.b
        return (b["stride"], b["padding"], b["dilation"], b["transposed"], b["output_padding"], b["groups"])


def _convolution_backward(
    checker: SelfChecker, func: Any, args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[_Target, ...] | None:
    """The input and weight gradients: sampled elements from their taps, or (``full``,
    transposed) the input gradient of whole batch elements, from their output gradient and the
    weight, and the weight gradient of output channels, from the whole batch's input and those
    channels' output gradient (ungrouped, not transposed). The bias gradient is left unchecked.

    16-bit kernels sum taps and batch at 16 bits with cancellation (measured: 50x a float32
    allowance), an allowance under which a 5% scale hides in every element; their checks also
    fit one scale through the sample (``coherent``)."""
    b = _bind(func, args, kwargs)
    grad, x, w = b["grad_output"], b["input"], b["weight"]
    mask = b["output_mask"]
    if not _floating(grad, x, w) or x.dim() != w.dim():
        return None
    sixteen = w.dtype in (torch.float16, torch.bfloat16)
    declared = _eps_matrix(w.dtype, w.device, True, checker.reduced_precision)
    eps_acc = torch.finfo(w.dtype).eps if sixteen else declared
    models = _rounding_models(w.dtype, declared) if grad.dtype == torch.float32 else ()
    call = _Gradients(grad, x, w, b, eps_acc, models, sixteen)
    targets = []
    if not (checker.full or b["transposed"]):
        if mask[0]:
            targets.append(_input_gradient_elements(checker, call))
        if mask[1]:
            targets.append(_weight_gradient_elements(checker, int(mask[0]), call))
    else:
        if mask[0]:
            targets.append(_input_gradient(checker, call))
        if mask[1] and b["groups"] == 1 and not b["transposed"]:
            targets.append(_weight_gradient(checker, int(mask[0]), call))
    return tuple(targets) or None


def _input_gradient(checker: SelfChecker, call: _Gradients) -> _Target:
    grad, x, w, _, eps_acc, models, coherent = call
    rest = call.rest
    picked = checker._sample(x.shape[0])
    gs32 = grad.detach().index_select(0, picked.to(grad.device))
    shape = (picked.numel(), *x.shape[1:])

    def input_grad(g: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        empty = torch.empty(shape, dtype=F64, device=g.device)
        return aten.convolution_backward.default(g, empty, weight, None, *rest, [True, False, False])[0]

    def ref() -> tuple[torch.Tensor, torch.Tensor]:
        g64, w64 = gs32.to(F64), w.detach().to(F64)
        return input_grad(g64, w64), input_grad(g64.abs(), w64.abs())

    def gather(o: torch.Tensor) -> torch.Tensor:
        return o.index_select(0, picked.to(o.device))

    def fitted() -> list[torch.Tensor]:
        return [input_grad(r(gs32).to(F64), r(w.detach()).to(F64)) for r in models]

    # Each input element sums over the output channels of its group and the kernel's taps.
    transposed, groups = rest[3], rest[5]
    per_input = (w.shape[1] if transposed else w.shape[0] // groups) * math.prod(w.shape[2:])
    return _Target(
        0, gather, ref, per_input, eps_acc, "batch", picked.numel(), None, fitted if models else None, coherent
    )


def _weight_gradient(checker: SelfChecker, index: int, call: _Gradients) -> _Target:
    grad, x, w, _, eps_acc, models, coherent = call
    rest = call.rest
    picked = checker._sample(w.shape[0])
    gs32 = grad.detach().index_select(1, picked.to(grad.device))
    x32 = x.detach()
    shape = (picked.numel(), *w.shape[1:])

    def weight_grad(g: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        # An output channel's weight gradient reads only that channel's output gradient.
        empty = torch.empty(shape, dtype=F64, device=g.device)
        return aten.convolution_backward.default(g, inputs, empty, None, *rest, [False, True, False])[1]

    def ref() -> tuple[torch.Tensor, torch.Tensor]:
        g64, x64 = gs32.to(F64), x32.to(F64)
        return weight_grad(g64, x64), weight_grad(g64.abs(), x64.abs())

    def gather(o: torch.Tensor) -> torch.Tensor:
        return o.index_select(0, picked.to(o.device))

    def fitted() -> list[torch.Tensor]:
        return [weight_grad(r(gs32).to(F64), r(x32).to(F64)) for r in models]

    # Each weight element sums over the batch and the output's positions.
    per_weight = grad.shape[0] * math.prod(grad.shape[2:])
    return _Target(
        index, gather, ref, per_weight, eps_acc, "rows", picked.numel(), None, fitted if models else None, coherent
    )


# Sampled convolutions read, per sampled element, only the terms it sums (gathered by index
# arithmetic, as im2col would for that element alone): a float64 recomputation of whole batch
# elements costs 7-15x the convolution itself. Where one scale is fitted through the sample (16
# bits) it is held to this many gathered values a call (a weight gradient's element reads the
# whole batch at every output position) ...
GATHER_BUDGET = 1 << 19
# ... and where each element's own residual judges it, to this many (at least one element): a 5%
# scale of a float32 sum of 10^5 random-sign terms lies ~1000x beyond its limit of ~80, in any
# element, while reading a deep layer's 16 elements of 4608 terms each cost ~1 ms a call.
CONV_TERMS = 1 << 14
# A batch norm's sampled channels are recomputed whole (its statistics read every element): at
# most this many elements a call, and at least one channel. A scaled kernel shows in any element.
CHANNEL_BUDGET = 1 << 14
# ... and its output compared at most at this many positions of each (a recipe's grid holds them)
CHANNEL_POSITIONS = 120


def _grid(per_dim: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per-dimension (k, size_j) tensors, each viewed to broadcast over (k, size_1, ..., size_d)."""
    d = len(per_dim)
    return [t.reshape(t.shape[0], *(t.shape[1] if i == j else 1 for i in range(d))) for j, t in enumerate(per_dim)]


def _offset(positions: Sequence[torch.Tensor], sizes: Sequence[int]) -> torch.Tensor:
    """Row-major offsets of per-dimension positions (broadcast together) in a grid of ``sizes``."""
    flat = positions[0]
    for p, size in zip(positions[1:], sizes[1:]):
        flat = flat * size + p
    return flat


def _unravel(flat: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    """Per-dimension indices of row-major ``flat`` indices into a grid of ``sizes``."""
    out = []
    for size in reversed(sizes):
        out.append(flat % size)
        flat = flat // size
    return out[::-1]


def _all(masks: Sequence[torch.Tensor]) -> torch.Tensor:
    valid = masks[0]
    for m in masks[1:]:
        valid = valid & m
    return valid


def _dots(
    gather: Callable[[torch.Tensor], torch.Tensor],
    operands: tuple[torch.Tensor, ...],
    n: int,
    eps_acc: float | None,
    models: tuple[Callable[[torch.Tensor], torch.Tensor], ...],
    coherent: bool = False,
) -> _Target:
    """A target of per-sample dot products of gathered operands ``(left, right, valid[, bias])``,
    each (k, ...), summed where ``valid``; fitted by the device's rounding ``models`` if any."""
    fitted = functools.partial(_dot_models, models) if models else None
    key = ("dots", tuple((t.dtype, t.shape, t.device) for t in operands))
    batch = _Batch(key, functools.partial(_dot_values, None), operands, fitted)
    return _batched(0, gather, batch, n, eps_acc, "matmul", operands[0].shape[0], coherent=coherent)


def _dot_values(
    rounding: Callable[[torch.Tensor], torch.Tensor] | None,
    left: torch.Tensor,
    right: torch.Tensor,
    valid: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 value and scale of dot products over everything after the sample's dimension (the
    second of ``valid``'s leading two: any calls before it)."""
    if rounding is not None:
        left, right = rounding(left), rounding(right)
    tail = valid.dim() - 2  # the summed dimensions, after (calls, sample); valid may broadcast over some
    terms = torch.where(valid, left.to(F64) * right.to(F64), 0.0).flatten(-tail)
    # |l * r| is |l| * |r| exactly: the scale from the same products, not a second pass over both.
    value, scale = terms.sum(-1), terms.abs().sum(-1)
    if bias is not None:
        value, scale = value + bias.to(F64), scale + bias.to(F64).abs()
    return value, scale


def _dot_models(
    models: Sequence[Callable[[torch.Tensor], torch.Tensor]], *operands: torch.Tensor
) -> list[torch.Tensor]:
    return [_dot_values(rounding, *operands)[0] for rounding in models]


def _output_size(x: torch.Tensor, w: torch.Tensor, b: dict[str, Any]) -> list[int]:
    """A (not transposed) convolution's output positions per spatial dimension."""
    stride, padding, dilation = b["stride"], b["padding"], b["dilation"]
    size, kernel = x.shape[2:], w.shape[2:]
    return [(size[j] + 2 * padding[j] - dilation[j] * (kernel[j] - 1) - 1) // stride[j] + 1 for j in range(len(size))]


def _convolution_elements(
    checker: SelfChecker,
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    b: dict[str, Any],
    eps_acc: float | None,
    models: tuple[Callable[[torch.Tensor], torch.Tensor], ...],
) -> _Target | None:
    """Sampled output elements of a (not transposed) convolution, each from its receptive field."""
    out_size = _output_size(x, w, b)
    if min(out_size, default=1) <= 0:
        return None
    width = math.prod(w.shape[1:])
    flat = checker._pick(x.shape[0] * w.shape[0] * math.prod(out_size), _conv_sample(checker, width, False))
    operands = _output_taps(x, w, bias, b, flat)
    n_acc = width + (bias is not None)
    return _dots(lambda out: _take(out, flat), operands, n_acc, eps_acc, models)


def _output_taps(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, b: dict[str, Any], flat: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """``(x taps, weights, valid[, bias])`` of a (not transposed) convolution's output elements at
    row-major positions ``flat``: (k, group_in, *kernel) each, valid where a tap reads the input
    (not its padding), and the bias (k,)."""
    stride, padding, dilation, groups = b["stride"], b["padding"], b["dilation"], b["groups"]
    (batch, channels, *size), (out_channels, group_in, *kernel) = x.shape, w.shape
    n, co, *o = _unravel(flat, (batch, out_channels, *_output_size(x, w, b)))
    taps = [o[j][:, None] * stride[j] - padding[j] + torch.arange(kernel[j]) * dilation[j] for j in range(len(size))]
    valid = _all(_grid([(p >= 0) & (p < size[j]) for j, p in enumerate(taps)]))[:, None]  # (k, 1, *kernel)
    spatial = _offset(_grid([p.clamp(0, size[j] - 1) for j, p in enumerate(taps)]), size)[:, None]
    first = (co // (out_channels // groups)) * group_in
    chan = (n[:, None] * channels + first[:, None] + torch.arange(group_in)).reshape(-1, group_in, *[1] * len(size))
    xs32 = _take(x.detach(), chan * math.prod(size) + spatial)  # (k, group_in, *kernel)
    ws32 = _take(w.detach(), _row_index(co, group_in * math.prod(kernel))).reshape(xs32.shape)
    operands = (xs32, ws32, valid.to(xs32.device))
    return operands + ((_take(bias.detach(), co),) if bias is not None else ())


def _input_gradient_elements(checker: SelfChecker, call: _Gradients) -> _Target:
    """Sampled elements of a (not transposed) convolution's input gradient, each from the output
    gradient's elements its taps reach and the weights that reached them."""
    grad, x, w, b, eps_acc, models, coherent = call
    n_acc = w.shape[0] // b["groups"] * math.prod(w.shape[2:])
    flat = checker._pick(x.numel(), _conv_sample(checker, n_acc, coherent))
    operands = _input_gradient_taps(grad, x.shape, w, b, flat)
    return _dots(lambda out: _take(out, flat), operands, n_acc, eps_acc, models, coherent)


def _input_gradient_taps(
    grad: torch.Tensor, x_shape: Sequence[int], w: torch.Tensor, b: dict[str, Any], flat: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(output gradients, weights, valid)`` that a (not transposed) convolution's input gradient
    sums at row-major positions ``flat`` (of an input of ``x_shape``): (k, group_out, *kernel) each."""
    stride, padding, dilation, groups = b["stride"], b["padding"], b["dilation"], b["groups"]
    (batch, channels, *size), (out_channels, group_in, *kernel) = x_shape, w.shape
    out_size, group_out = list(grad.shape[2:]), out_channels // groups
    n, ci, *p = _unravel(flat, (batch, channels, *size))
    # Tap t of output position o reads input position o * stride - padding + t * dilation.
    reach = [p[j][:, None] + padding[j] - torch.arange(kernel[j]) * dilation[j] for j in range(len(size))]
    valid = _all(
        _grid([(r >= 0) & (r % stride[j] == 0) & (r // stride[j] < out_size[j]) for j, r in enumerate(reach)])
    )[:, None]  # (k, 1, *kernel)
    spatial = _offset(_grid([(r // stride[j]).clamp(0, out_size[j] - 1) for j, r in enumerate(reach)]), out_size)
    co = ((ci // group_in) * group_out)[:, None] + torch.arange(group_out)  # (k, group_out)
    shape = (-1, group_out, *[1] * len(size))
    gs32 = _take(
        grad.detach(), (n[:, None] * out_channels + co).reshape(shape) * math.prod(out_size) + spatial[:, None]
    )
    taps = torch.arange(math.prod(kernel)).reshape(kernel)
    ws32 = _take(w.detach(), (co * group_in + (ci % group_in)[:, None]).reshape(shape) * math.prod(kernel) + taps)
    return gs32, ws32, valid.to(gs32.device)


def _weight_gradient_elements(checker: SelfChecker, index: int, call: _Gradients) -> _Target:
    """Sampled elements of a (not transposed) convolution's weight gradient, each a sum over the
    batch and the output positions of output gradient times the input its tap read."""
    grad, x, w, b, eps_acc, models, coherent = call
    terms = grad.shape[0] * math.prod(grad.shape[2:])
    flat = checker._pick(w.numel(), _conv_sample(checker, terms, coherent))
    operands = _weight_gradient_taps(grad, x, w.shape, b, flat)
    return _dots(lambda out: _take(out, flat), operands, terms, eps_acc, models, coherent)._replace(index=index)


def _conv_sample(checker: SelfChecker, width: int, coherent: bool) -> int:
    """How many of a convolution's (or its gradient's) elements a check reads, each a sum of
    ``width`` terms: with one scale fitted through them (16-bit gradients), four times the sample
    within GATHER_BUDGET; else the sample within CONV_TERMS; at least one."""
    if coherent:
        return min(4 * checker.sample, max(1, GATHER_BUDGET // max(width, 1)))
    return min(checker.sample, max(1, CONV_TERMS // max(width, 1)))


def _weight_gradient_taps(
    grad: torch.Tensor, x: torch.Tensor, w_shape: Sequence[int], b: dict[str, Any], flat: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(output gradients, inputs, valid)`` that a (not transposed) convolution's weight gradient
    sums at row-major positions ``flat`` (of a weight of ``w_shape``): (k, batch, *out_size) each."""
    stride, padding, dilation, groups = b["stride"], b["padding"], b["dilation"], b["groups"]
    (batch, channels, *size), (out_channels, group_in, *kernel) = x.shape, w_shape
    out_size, group_out = list(grad.shape[2:]), out_channels // groups
    co, cl, *t = _unravel(flat, (out_channels, group_in, *kernel))
    read = [torch.arange(out_size[j]) * stride[j] - padding[j] + t[j][:, None] * dilation[j] for j in range(len(size))]
    valid = _all(_grid([(r >= 0) & (r < size[j]) for j, r in enumerate(read)]))[:, None]  # (k, 1, *out_size)
    spatial = _offset(_grid([r.clamp(0, size[j] - 1) for j, r in enumerate(read)]), size)[:, None]
    ci = (co // group_out) * group_in + cl
    shape = (-1, batch, *[1] * len(size))
    images = torch.arange(batch)
    xs32 = _take(x.detach(), (images * channels + ci[:, None]).reshape(shape) * math.prod(size) + spatial)
    positions = torch.arange(math.prod(out_size)).reshape(out_size)
    gs32 = _take(grad.detach(), (images * out_channels + co[:, None]).reshape(shape) * math.prod(out_size) + positions)
    return gs32, xs32, valid.to(gs32.device)


# --- reductions and row ops (softmax, layer norm) ---


def _row_view(x: torch.Tensor, dims: Sequence[int]) -> tuple[torch.Tensor, int, int]:
    """``x`` viewed with ``dims`` (the reduced or normalized ones) moved last, no copy: the view,
    its number of rows (flat over the kept dims, in order) and the row length."""
    red = sorted({d % x.dim() for d in dims}) if x.dim() else []
    kept = [d for d in range(x.dim()) if d not in red]
    return x.permute(*kept, *red), math.prod(x.shape[d] for d in kept), math.prod(x.shape[d] for d in red)


def _rows(view: torch.Tensor, rows: torch.Tensor, length: int) -> torch.Tensor:
    """Rows ``rows`` of a ``_row_view``, (k, length) float64."""
    return _take(view, _row_index(rows, length)).to(F64)


def _reduction(
    checker: SelfChecker, func: Any, args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[_Target, ...] | None:
    b = _bind(func, args, kwargs)
    x = b["self"].detach()
    if not (_plain(x) and _real(x) and x.is_floating_point()):
        return None
    dims = b.get("dim")
    view, count, length = _row_view(x, range(x.dim()) if not dims else dims)
    # Adjacent rows: where the reduced dims are the outer ones (a bias gradient, a sum over the
    # batch) a row's elements lie a whole row of x apart, and adjacent rows share their cache lines.
    start, size = checker._block(count, checker.sample)
    rows = torch.arange(start, start + size)
    divisor = length if func.overloadpacket.__name__ == "mean" else 1
    if count == 1:
        # A reduction of everything (a loss): its sums taken now, rather than a copy of the whole
        # input held until the hand-over.
        values = _whole_sums(x)
        fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] = functools.partial(_summed, divisor)
    else:
        values = _take(view, _row_index(rows, length))
        fn = functools.partial(_sums, divisor)
    out_dtype = b.get("dtype") or x.dtype
    # A reduction to one element runs in parallel with per-thread partial sums kept in the output
    # dtype (TensorIterator's two-pass reduction): a 16-bit output then accumulates at its own eps.
    eps_acc = torch.finfo(out_dtype).eps if count == 1 and out_dtype in (torch.float16, torch.bfloat16) else None
    batch = _Batch(("sum", count == 1, divisor, values.dtype, values.shape, values.device), fn, (values,))
    return (_batched(0, lambda o: _take(o, rows), batch, length, eps_acc, "rows", rows.numel()),)


def _whole_sums(x: torch.Tensor) -> torch.Tensor:
    """``[[sum, sum of magnitudes]]`` of ``x``'s elements, float64 on its device: the sum exact to
    float64 rounding, the magnitudes (a scale) summed at float32 or better. On the CPU the sum is
    the statistics pass's (pairwise float64, ~20x faster than torch's float64 sum of float32)."""
    magnitude = torch.linalg.vector_norm(x, 1, dtype=torch.promote_types(x.dtype, torch.float32)).to(F64)
    if x.is_cpu and x.numel():
        stats = tensor_stats(x)
        if not (stats.nan_count or stats.inf_count):
            return torch.stack([torch.tensor(stats.mean * x.numel(), dtype=F64), magnitude])[None]
    return torch.stack([x.sum(dtype=F64), magnitude])[None]


def _summed(divisor: int, sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole reduction's value and magnitude (over ``divisor``) from its float64 sum and sum of
    magnitudes (:func:`_reduction`), one row a call."""
    return sums[..., :1] / divisor, sums[..., 1:] / divisor


def _sums(divisor: int, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row sums (over ``divisor``) of gathered rows, and of their magnitudes, in float64."""
    values = values.to(F64)
    return values.sum(-1) / divisor, values.abs().sum(-1) / divisor


def _softmax(
    checker: SelfChecker, func: Any, args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[_Target, ...] | None:
    b = _bind(func, args, kwargs)
    name = func.overloadpacket.__name__
    backward = name.endswith("_backward_data")
    tensors = [b["grad_output"].detach(), b["output"].detach()] if backward else [b["self"].detach()]
    if not _floating(*tensors) or len({t.shape for t in tensors}) > 1:
        return None
    # _safe_softmax(dtype=) rounds its input to dtype first: not the float64 softmax of the input.
    if b.get("dtype") not in (None, tensors[0].dtype):
        return None
    dims = [b["dim"]]
    _, count, length = _row_view(tensors[0], dims)
    rows = checker._sample(count)
    values = [_rows(_row_view(t, dims)[0], rows, length) for t in tensors]

    def gather(o: torch.Tensor) -> torch.Tensor:
        return _take(_row_view(o, dims)[0], _row_index(rows, length))

    return (_Target(0, gather, functools.partial(_softmax_values, name, *values), length, None, "rows", rows.numel()),)


def _softmax_values(name: str, *rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 value and scale of a softmax, log-softmax (of ``x``) or their backward (of
    ``grad, output``) along the last dimension of gathered rows (any leading ones)."""
    if name in ("_softmax", "_safe_softmax", "_log_softmax"):
        x = rows[0].to(F64)
        if name == "_log_softmax":
            shifted = x - x.max(-1, keepdim=True).values
            lse = shifted.exp().sum(-1, keepdim=True).log()
            return shifted - lse, shifted.abs() + lse.abs() + 1
        value = torch.softmax(x, -1)
        if name == "_safe_softmax":  # a row masked whole (every score -inf) is zeros, not NaN
            value = value.masked_fill(x.isneginf().all(-1, keepdim=True), 0.0)
        return value, value.abs()
    g, y = (t.to(F64) for t in rows)
    if name == "_softmax_backward_data":
        return y * (g - (g * y).sum(-1, keepdim=True)), y.abs() * (g.abs() + (g * y).abs().sum(-1, keepdim=True))
    return g - y.exp() * g.sum(-1, keepdim=True), g.abs() + y.exp() * g.abs().sum(-1, keepdim=True)


def _attention(
    checker: SelfChecker, func: Any, args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[_Target, ...] | None:
    """Fused attention's output, a sample of query rows: softmax(q k^T * scale + mask) v in float64
    from the row's query and its batch and head's keys and values."""
    b = _bind(func, args, kwargs)
    q, k, v = (b[name].detach() for name in ("query", "key", "value"))
    mask = b.get("attn_mask", b.get("attn_bias"))
    if b.get("dropout_p", 0.0) != 0.0 or not _floating(q, k, v):
        return None  # dropout draws: no recomputation reproduces it
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3]:
        return None  # grouped-query heads and other layouts are left out
    batch, heads, length, width = q.shape
    source = k.shape[2]
    causal = bool(b.get("is_causal", False))
    if causal and length != source:
        return None  # kernels align a causal mask of unequal lengths differently
    if mask is not None and not (_plain(mask) and mask.dim() <= 4):
        return None
    factor = b.get("scale") or 1.0 / math.sqrt(width)
    rows = checker._sample(batch * heads * length)
    pair, position = rows // length, rows % length
    queries = _take(q, _row_index(rows, width)).to(F64)  # (r, E)
    keys = k.reshape(batch * heads, source, width)[pair.to(k.device)].to(F64)  # (r, S, E)
    values = v.reshape(batch * heads, source, v.shape[-1])[pair.to(v.device)].to(F64)  # (r, S, Ev)
    # Each sampled row a call of one row: its query, its head's keys and values, its mask row
    # (added: a boolean one as 0 where it keeps, -inf where it hides), its position.
    rest = [position.to(F64)[:, None]]
    if mask is not None:
        full = mask.detach().expand(batch, heads, length, source).reshape(batch * heads * length, source)
        bias = full[rows.to(mask.device)]
        if bias.dtype == torch.bool:
            bias = torch.zeros(bias.shape, dtype=F64, device=bias.device).masked_fill(~bias, -math.inf)
        bias = bias.to(F64)
        rest.insert(0, bias[:, None])

    def ref() -> tuple[torch.Tensor, ...]:
        device = queries.device
        row = [t.to(device) for t in rest]
        found = _attention_values(factor, causal, queries[:, None], keys, values, *row)
        return tuple(t[:, 0] for t in found)

    def gather(o: torch.Tensor) -> torch.Tensor:
        return _take(o, _row_index(rows, o.shape[-1]))

    return (_Target(0, gather, ref, source, None, "rows", rows.numel()),)


def _attention_recipe(
    checker: SelfChecker,
    func: Any,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    outputs: Any,
    tensors: list[torch.Tensor],
) -> Recipe | None:
    """CPU flash attention (:func:`_attention`) at a block of adjacent query rows of one batch and
    head, read with that head's keys and values whole and the mask's rows (GRID_ATTENTION)."""
    if func.overloadpacket.__name__ != "_scaled_dot_product_flash_attention_for_cpu":
        return None
    b = _bind(func, args, kwargs)
    q, k, v, mask = b["query"], b["key"], b["value"], b.get("attn_mask")
    if b.get("dropout_p", 0.0) != 0.0 or not _floating(q, k, v):
        return None
    order = [q, k, v] + ([mask] if mask is not None else [])
    if len(order) != len(tensors) or any(a is not t for a, t in zip(order, tensors)):
        return None
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3]:
        return None
    batch, heads, length, width = q.shape
    source, causal = k.shape[2], bool(b.get("is_causal", False))
    if (
        not (batch and heads and length and source and width)
        or causal
        and length != source
        or q.shape[-1] != k.shape[-1]
    ):
        return None
    if mask is not None:
        if mask.dim() > 4 or not mask.is_floating_point():  # the kernel adds it (bool masks arrive as -inf)
            return None
        try:
            torch.broadcast_shapes(mask.shape, (batch, heads, length, source))
        except RuntimeError:
            return None
        if mask.expand(batch, heads, length, source).shape != (batch, heads, length, source):
            return None
    out = outputs[0] if isinstance(outputs, (tuple, list)) and outputs else None
    if not isinstance(out, torch.Tensor) or out.shape != (*q.shape[:3], v.shape[-1]) or not _sampled_readable(out):
        return None
    if _SAMPLED_CODES.get(out.dtype, _FLOATING_CODES) >= _FLOATING_CODES:
        return None
    block = min(checker.sample, length)
    shapes = ((block, width), (source, width), (source, v.shape[-1]))
    shapes += ((block, source),) * (mask is not None) + ((block,),)
    if sum(math.prod(shape) for shape in shapes) > GATHER_BUDGET:
        return None
    factor = b.get("scale") or 1.0 / math.sqrt(width)
    kinds = (factor, causal)
    batch_of = _Batch(("attention", kinds, shapes), functools.partial(_attention_values, *kinds), ())
    target = _batched(0, _gathered, batch_of, source, None, "rows", block)
    grid = (GRID_ATTENTION, block, int(causal), int(mask is not None))
    return Recipe(
        tuple(out.shape), batch * heads, block * v.shape[-1], _limits(target, out.dtype)[-1],
        _SAMPLED_CODES[out.dtype], _number_array(), [], tuple(out.shape), grid, "rows", block, 0, (), (), target,
        out.dtype, len(tensors), shapes, tuple(range(len(shapes))), (),
    )  # fmt: skip


def _attention_values(
    factor: float, causal: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention's output at gathered query rows (calls, block, E) from their head's keys and
    values (calls, S, E), the rows of the mask it adds (where there is one) and the rows'
    positions (for ``causal``), in float64: value, scale and excess as :func:`_attention`."""
    *mask, positions = rest
    scores = torch.einsum("cre,cse->crs", q, k) * factor
    # exp(s) errs by the absolute error of s: a unit of what its products add up to
    reach = torch.einsum("cre,cse->crs", q.abs(), k.abs()) * abs(factor)
    if mask:
        scores = scores + mask[0]
    if causal:
        ahead = torch.arange(k.shape[1], device=q.device)[None, None, :] > positions[..., None]
        scores = scores.masked_fill(ahead, -math.inf)
    weights = torch.softmax(scores, -1)
    value = torch.einsum("crs,csv->crv", weights, v)
    weighted = torch.einsum("crs,csv->crv", weights, v.abs())
    spread = torch.einsum("crs,csv->crv", weights * reach, v.abs())
    # Scores and sums run in float32; 16-bit kernels round the weights to the output's dtype
    # before they weight the values: that part is rounded at eps_out (the excess).
    return value, _finite_scale(weighted + spread), _finite_scale(weighted)


def _normalization(
    values: torch.Tensor, stats: Callable[[], tuple[torch.Tensor, ...]], w: torch.Tensor | None, bb: torch.Tensor | None
) -> tuple[Callable[[], tuple[torch.Tensor, torch.Tensor]], ...]:
    """``ref`` of a normalization's output, mean and 1/std over rows ``values`` (..., k, length),
    from ``stats() = (mean, rstd, mean|x|, reach)``: ``reach`` is what rstd's relative error grows by."""

    def normalized() -> tuple[torch.Tensor, torch.Tensor]:
        mean, rstd, mean_abs, reach = stats()
        value = (values - mean) * rstd
        # Errors of the mean (~ mean|x|), of x - mean, and of rstd relative all reach the output
        # multiplied by rstd * |w|; the bias adds its own rounding.
        scale = (mean_abs + (values - mean).abs()) * rstd * reach
        if w is not None:
            value, scale = value * w, scale * w.abs()
        if bb is not None:
            value, scale = value + bb, scale + bb.abs()
        return value, scale

    def mean_ref() -> tuple[torch.Tensor, torch.Tensor]:
        mean, _, mean_abs, _ = stats()
        return mean[..., 0], mean_abs[..., 0]

    def rstd_ref() -> tuple[torch.Tensor, torch.Tensor]:
        _, rstd, mean_abs, _ = stats()
        return rstd[..., 0], (rstd * (1 + mean_abs * rstd))[..., 0]

    return normalized, mean_ref, rstd_ref


def _layer_norm(
    checker: SelfChecker, func: Any, args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[_Target, ...] | None:
    b = _bind(func, args, kwargs)
    x, weight, bias = b["input"], b["weight"], b["bias"]
    if not _floating(x, weight, bias):
        return None
    x = x.detach()
    view, count, length = _row_view(x, range(x.dim() - len(b["normalized_shape"]), x.dim()))
    rows = checker._sample(count)
    # The statistics read whole rows; the output is compared at sampled columns of them.
    cols = checker._pick(length, checker.sample)
    # Copies: a deferred check reads them after the optimizer stepped the parameters in place.
    affine = tuple(t.detach().reshape(-1).clone() for t in (weight, bias) if t is not None)
    tensors = (_take(view, _row_index(rows, length)), cols, *affine)
    constants = (weight is not None, bias is not None, b["eps"])
    shapes = tuple((t.dtype, t.shape, t.device) for t in tensors)
    per_row = functools.partial(_gathered, rows)
    crossings = (rows[:, None] * length + cols[None, :]).reshape(-1)
    gathers = (functools.partial(_gathered, crossings), per_row, per_row)
    return tuple(
        _batched(
            which,
            gathers[which],
            _Batch(
                ("layer_norm", which, constants, shapes),
                functools.partial(_layer_norm_values, which, constants),
                tensors,
            ),
            length,
            None,
            "rows",
            rows.numel(),
        )
        for which in range(3)
    )


def _layer_norm_values(
    which: int, constants: tuple[bool, bool, float], values: torch.Tensor, cols: torch.Tensor, *affine: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 ``ref`` of a layer norm's output at columns ``cols`` (..., c) of gathered rows
    ``values`` (..., k, length) (``which`` 0), or of its mean (1) or 1/std (2), from the weight and
    bias (..., length) that are given."""
    has_weight, has_bias, eps = constants
    values = values.to(F64)
    mean = values.mean(-1, keepdim=True)
    # Centred in float64 (Tensor.var's one-pass update is slower, no more exact here).
    rstd = ((values - mean).square().mean(-1, keepdim=True) + eps).rsqrt()
    mean_abs = values.abs().mean(-1, keepdim=True)
    stats = (mean, rstd, mean_abs, 1 + mean_abs * rstd)
    if which:
        return _normalization(values, lambda: stats, None, None)[which]()
    picked = values.gather(-1, cols.unsqueeze(-2).expand(*values.shape[:-1], cols.shape[-1]))
    given = iter(a.to(F64).gather(-1, cols).unsqueeze(-2) for a in affine)
    w = next(given) if has_weight else None
    bb = next(given) if has_bias else None
    value, scale = _normalization(picked, lambda: stats, w, bb)[0]()
    return value.flatten(-2), scale.flatten(-2)


def _layer_norm_backward(
    checker: SelfChecker, func: Any, args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[_Target, ...] | None:
    """The input gradient (output 0) of sampled rows, from the saved mean and rstd the op reads:
    ``rstd * (g w - mean(g w) - xhat mean(g w xhat))`` with ``xhat = (x - mean) rstd``. The weight
    and bias gradients sum over every row and are left unchecked."""
    b = _bind(func, args, kwargs)
    grad, x, mean, rstd, weight = b["grad_out"], b["input"], b["mean"], b["rstd"], b["weight"]
    if not b["output_mask"][0]:
        return None
    if not _floating(grad, x, mean, rstd, weight):
        return None
    dims = range(x.dim() - len(b["normalized_shape"]), x.dim())
    view, count, length = _row_view(x.detach(), dims)
    rows = checker._sample(count)
    index = _row_index(rows, length)
    # In their own dtype, the weight a copy: the optimizer steps it before the hand-over recomputes.
    tensors = [
        _take(view, index),  # (r, L)
        _take(_row_view(grad.detach(), dims)[0], index),  # (r, L)
        _take(mean.detach().reshape(-1), rows),  # (r,)
        _take(rstd.detach().reshape(-1), rows),  # (r,)
    ]
    if weight is not None:
        tensors.append(weight.detach().reshape(-1).clone())  # (L,)
    key = ("layer_norm_backward", tuple((t.dtype, t.shape, t.device) for t in tensors))
    gather = functools.partial(_gathered, index)
    return (
        _batched(
            0, gather, _Batch(key, _layer_norm_backward_values, tuple(tensors)), length, None, "rows", rows.numel()
        ),
    )


def _layer_norm_backward_values(
    xs: torch.Tensor, gs: torch.Tensor, mu: torch.Tensor, rs: torch.Tensor, w: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 ``(ref, scale)`` of a layer norm's input gradient at gathered rows of its input and
    output gradient (..., r, L), from the saved mean and 1/std (..., r) and the weight (..., L)."""
    xs, gs = xs.to(F64), gs.to(F64)
    mu, rs = mu.to(F64)[..., None], rs.to(F64)[..., None]
    xhat = (xs - mu) * rs
    gw = gs * w.to(F64)[..., None, :] if w is not None else gs
    value = rs * (gw - gw.mean(-1, keepdim=True) - xhat * (gw * xhat).mean(-1, keepdim=True))
    # Each term's rounding reaches the output times rstd: the row means of |g w| and |g w xhat|
    # bound what their sums may carry, and xhat is known to |x| + |mean| (x - mean cancels).
    spread = (xs.abs() + mu.abs()) * rs
    scale = rs * (gw.abs() + gw.abs().mean(-1, keepdim=True) + spread * (gw.abs() * spread).mean(-1, keepdim=True))
    return value, scale


# --- batch norm: layer norm's computation over the batch and positions of each channel ---


def _channels(x: torch.Tensor, channels: torch.Tensor) -> torch.Tensor:
    """Whole channels (dimension 1) of ``x`` as float64 rows (k, batch * positions), in the order
    ``_row_view(x, [0, 2, ...])`` lays them out: copied by channel, with no index per element."""
    picked = x.detach().index_select(1, channels.to(x.device)).to(F64)
    return picked.movedim(1, 0).reshape(channels.numel(), -1)


def _batch_norm(
    checker: SelfChecker, func: Any, args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[_Target, ...] | None:
    """Sampled channels: the output at sampled positions of each and, in training, the saved mean
    and 1/std, from the channel's own values (in evaluation, from the running statistics)."""
    b = _bind(func, args, kwargs)
    x, weight, bias = b["input"], b["weight"], b["bias"]
    name = func.overloadpacket.__name__
    training = b.get("training", name != "_native_batch_norm_legit_no_training")
    running = (b.get("running_mean"), b.get("running_var"))
    if x.dim() < 2 or not _floating(x, weight, bias, *(() if training else running)):
        return None
    if not training and None in running:
        return None
    dims = [0, *range(2, x.dim())]
    _, count, length = _row_view(x.detach(), dims)
    rows = checker._sample(count, 1, max(1, CHANNEL_BUDGET // length))
    values = _channels(x, rows)
    given = [t for t in (weight, bias, *(() if training else running)) if t is not None]
    per_channel = [_take(t.detach().reshape(-1), rows).to(F64) for t in given]
    constants = (weight is not None, bias is not None, training, b["eps"])
    # The statistics read whole channels; the output is compared at sampled positions of them.
    positions = checker._pick(length, 4 * checker.sample)
    ref = lambda which: functools.partial(  # noqa: E731
        _batch_norm_channels_values, which, constants, positions, values, *per_channel
    )
    crossings = rows[:, None] * length + positions[None, :]
    at = lambda o: _take(_row_view(o, dims)[0], crossings).flatten()  # noqa: E731
    n = length if training else 1
    # CPU kernels of 16-bit inputs normalize with statistics held at the input's precision: so
    # wide an allowance that a 5% scale shows only as a scale fitted through the channels.
    sixteen = x.dtype in (torch.float16, torch.bfloat16)
    eps_acc = torch.finfo(x.dtype).eps if sixteen else None
    targets = [_Target(0, at, ref(0), n, eps_acc, "rows", rows.numel(), coherent=sixteen)]
    if training:
        per_row = lambda o: _take(o, rows)  # noqa: E731
        targets += [
            _Target(1, per_row, ref(1), length, eps_acc, "rows", rows.numel()),
            _Target(2, per_row, ref(2), length, eps_acc, "rows", rows.numel()),
        ]
    return tuple(targets)


def _batch_norm_backward(
    checker: SelfChecker, func: Any, args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[_Target, ...] | None:
    """Sampled channels: the input gradient at sampled positions, ``rstd (g w - mean(g w) -
    xhat mean(g w xhat))`` in training (``g w rstd`` in evaluation), and the weight and bias
    gradients ``sum g xhat`` and ``sum g``, from the statistics the op reads."""
    b = _bind(func, args, kwargs)
    grad, x, weight, train, mask = b["grad_out"], b["input"], b["weight"], b["train"], b["output_mask"]
    mean, invstd = (b["save_mean"], b["save_invstd"]) if train else (b["running_mean"], b["running_var"])
    if mean is None or invstd is None or x.dim() < 2:
        return None
    if not _floating(grad, x, weight, mean, invstd):
        return None
    dims = [0, *range(2, x.dim())]
    _, count, length = _row_view(x.detach(), dims)
    rows = checker._sample(count, 1, max(1, CHANNEL_BUDGET // (2 * length)))
    xs, gs = _channels(x, rows), _channels(grad, rows)
    per_channel = [_take(t.detach().reshape(-1), rows).to(F64) for t in (weight, mean, invstd) if t is not None]
    constants = (weight is not None, bool(train), b["eps"])
    # The means read whole channels; the input gradient is compared at sampled positions of them.
    positions = checker._pick(length, 4 * checker.sample)
    ref = lambda which: functools.partial(  # noqa: E731
        _batch_norm_backward_channels_values, which, constants, positions, gs, xs, *per_channel
    )
    crossings = rows[:, None] * length + positions[None, :]
    at = lambda o: _take(_row_view(o, dims)[0], crossings).flatten()  # noqa: E731
    per_row = lambda o: _take(o, rows)  # noqa: E731
    present = [(which, at if which == 0 else per_row) for which, wants in enumerate(mask) if wants]
    n_input = length if train else 1
    return tuple(
        _Target(index, gather, ref(which), n_input if which == 0 else length, None, "rows", rows.numel())
        for index, (which, gather) in enumerate(present)
    )


# --- negative log-likelihood: the loss reads one log-probability a row ---


def _nll_rows(
    x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Flat indices of each row's target element in ``x`` ((N, C) or (C,)) and the rows' class
    weights (0 where the target is ignored) in float64, on x's device; None for other layouts."""
    if x.dim() not in (1, 2) or target.dim() != x.dim() - 1 or target.numel() > GATHER_BUDGET:
        return None
    t = target.detach().reshape(-1)
    keep = t != ignore_index
    t = torch.where(keep, t, 0)
    flat = torch.arange(t.numel(), device=t.device) * x.shape[-1] + t
    w = _take(weight.detach(), t).to(F64) if weight is not None else torch.ones(t.shape, dtype=F64, device=t.device)
    return flat, torch.where(keep, w, 0.0)


def _nll_loss(
    checker: SelfChecker, func: Any, args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[_Target, ...] | None:
    """The loss from every row's picked log-probability (``-sum w x / sum w`` for a mean,
    ``-sum w x``, or per row), and the total weight."""
    b = _bind(func, args, kwargs)
    x, target, weight = b["self"], b["target"], b["weight"]
    if not all(_plain(t) and _real(t) for t in (x, target)) or not x.is_floating_point():
        return None
    rows = _nll_rows(x, target, weight, b["ignore_index"])
    if rows is None:
        return None
    flat, w = rows
    terms = -w * _take(x.detach(), flat).to(F64)
    reduction = b["reduction"]  # 0 none, 1 mean, 2 sum

    def loss() -> tuple[torch.Tensor, torch.Tensor]:
        if reduction == 0:
            return terms, terms.abs()
        divisor = w.sum() if reduction == 1 else 1.0
        return (terms.sum() / divisor)[None], (terms.abs().sum() / divisor)[None]

    def total() -> tuple[torch.Tensor, torch.Tensor]:
        return w.sum()[None], w.sum()[None]

    if reduction == 0:
        return (_Target(0, lambda o: o.detach().reshape(-1), loss, 1, None, "matmul", terms.numel()),)
    scalar = lambda o: o.detach().reshape(1)
    return (
        _Target(0, scalar, loss, terms.numel(), None, "matmul", terms.numel()),
        _Target(1, scalar, total, terms.numel(), None, "matmul", terms.numel()),
    )


def _nll_loss_backward(
    checker: SelfChecker, func: Any, args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[_Target, ...] | None:
    """Each sampled row's one nonzero gradient, at its target: ``-g w / total_weight`` (mean),
    ``-g w`` (sum, or per row)."""
    b = _bind(func, args, kwargs)
    grad, x, target, weight, total = b["grad_output"], b["self"], b["target"], b["weight"], b["total_weight"]
    if not all(_plain(t) and _real(t) for t in (grad, x, target, total)) or not x.is_floating_point():
        return None
    rows = _nll_rows(x, target, weight, b["ignore_index"])
    if rows is None:
        return None
    flat, w = rows
    picked = checker._sample(flat.numel()).to(flat.device)
    reduction = b["reduction"]
    g = grad.detach().reshape(-1).to(F64)
    g = g[picked] if reduction == 0 else g.expand(picked.numel())
    divisor = total.detach().to(F64).reshape(()) if reduction == 1 else 1.0
    value = -g * w[picked] / divisor

    def ref() -> tuple[torch.Tensor, torch.Tensor]:
        return value, value.abs()

    at = flat[picked]
    return (_Target(0, lambda o: _take(o, at), ref, 1, None, "matmul", picked.numel()),)


def _nll_recipe(
    checker: SelfChecker,
    func: Any,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    outputs: Any,
    tensors: list[torch.Tensor],
) -> Recipe | None:
    """An ``nll_loss_forward`` (:func:`_nll_loss`) from every row's input at its target and class
    weight (its loss, and its total weight as an extra), or its backward (:func:`_nll_loss_backward`)
    at a sample of rows, each row's one nonzero gradient at its target (GRID_PICKED)."""
    backward = checker.kinds.get(func) is _nll_loss_backward
    b = _bind(func, args, kwargs)
    x, target, weight = b["self"], b["target"], b["weight"]
    reduction, per_row = b["reduction"], int(b["reduction"] == 0)
    order = [x, target] + ([weight] if weight is not None else [])
    if backward:
        order = [b["grad_output"], *order, b["total_weight"]]
    if len(order) != len(tensors) or any(a is not t for a, t in zip(order, tensors)):
        return None
    if x.dim() not in (1, 2) or target.dim() != x.dim() - 1 or not x.is_floating_point() or not x.shape[-1]:
        return None
    if target.is_floating_point() or target.dtype == torch.bool or not isinstance(b["ignore_index"], int):
        return None
    rows, classes = (x.shape[0] if x.dim() == 2 else 1), x.shape[-1]
    if not rows or rows > GATHER_BUDGET or weight is not None and weight.shape != (classes,):
        return None
    out = outputs if backward else outputs[0] if isinstance(outputs, (tuple, list)) and len(outputs) == 2 else None
    if not isinstance(out, torch.Tensor) or not _sampled_readable(out) or out.dtype not in _SAMPLED_CODES:
        return None
    if _SAMPLED_CODES[out.dtype] >= _FLOATING_CODES:
        return None
    grid = (GRID_PICKED, NLL_LOSS_BACKWARD if backward else NLL_LOSS, b["ignore_index"], per_row)
    cpu = torch.device("cpu")
    if backward:
        grad, total = b["grad_output"], b["total_weight"]
        if grad.shape != (target.shape if per_row else ()) or total.shape != () or out.shape != x.shape:
            return None
        k = checker.sample
        batch = _Batch(("nll_loss backward", reduction, k, cpu), functools.partial(_nll_backward_values, reduction), ())
        target_of = _batched(0, _gathered, batch, 1, None, "matmul", k)
        return Recipe(
            tuple(x.shape), rows, k, _limits(target_of, out.dtype)[-1], _SAMPLED_CODES[out.dtype], _number_array(),
            [], tuple(out.shape), grid, "matmul", k, -1, (), (), target_of, out.dtype, len(tensors),
            ((k,), (k,), (1,)), (0, 1, 2), (),
        )  # fmt: skip
    total = outputs[1]
    if out.shape != (target.shape if per_row else ()):
        return None
    n = 1 if per_row else rows
    batch = _Batch(("nll_loss", reduction, rows, cpu), functools.partial(_nll_values, reduction), ())
    target_of = _batched(0, _gathered, batch, n, None, "matmul", rows if per_row else 1)
    extras: tuple[tuple[int, tuple[int, ...], int, float, int], ...] = ()
    extra_targets: tuple[tuple[_Target, torch.dtype], ...] = ()
    if not per_row:  # the total weight, summed from the same class weights
        if not (isinstance(total, torch.Tensor) and total.shape == () and total.dtype in _SAMPLED_CODES):
            return None
        summed = _batched(
            1, _gathered, _Batch(("nll_loss total", rows, cpu), _nll_total_values, ()), n, None, "matmul", 1
        )
        extras = ((1, (), _SAMPLED_CODES[total.dtype], _limits(summed, total.dtype)[-1], 1),)
        extra_targets = ((summed, total.dtype),)
    return Recipe(
        tuple(x.shape), rows, rows if per_row else 1, _limits(target_of, out.dtype)[-1], _SAMPLED_CODES[out.dtype],
        _number_array(), [], tuple(out.shape), grid, "matmul", rows if per_row else 1, 0, extras, (), target_of,
        out.dtype, len(tensors), ((rows,), (rows,)), (0, 1), (), extra_targets=extra_targets,
    )  # fmt: skip


def _nll_values(reduction: int, picked: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss of calls (a row each) from every row's picked input and class weight: ``-sum w x /
    sum w`` (mean), ``-sum w x`` (sum), or ``-w x`` per row (none); and the size of its terms."""
    terms = -weights * picked
    if reduction == 0:
        return terms, terms.abs()
    divisor = weights.sum(-1, keepdim=True) if reduction == 1 else 1.0
    return terms.sum(-1, keepdim=True) / divisor, terms.abs().sum(-1, keepdim=True) / divisor


def _nll_total_values(picked: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An ``nll_loss_forward``'s total weight: the sum of the rows' class weights."""
    total = weights.sum(-1, keepdim=True)
    return total, total


def _nll_backward_values(
    reduction: int, grad: torch.Tensor, weights: torch.Tensor, total: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The one nonzero gradient of each sampled row, at its target: ``-g w / total_weight`` (mean),
    ``-g w`` (sum, or per row)."""
    value = -grad * weights / (total if reduction == 1 else 1.0)
    return value, value.abs()


# --- copies and casts: the output is the input's value ---


def _copy(checker: SelfChecker, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[_Target, ...] | None:
    b = _bind(func, args, kwargs)
    name = func.overloadpacket.__name__
    if name == "embedding":
        weight, indices = b["weight"].detach(), b["indices"].detach()
        if not (_plain(weight) and _plain(indices) and _real(weight) and indices.numel()) or weight.dim() != 2:
            return None
        width = weight.shape[1]
        flat = checker._sample(indices.numel() * width)
        picked = _take(indices, flat // width).to(torch.int64) * width + (flat % width).to(indices.device)
        src = _take(weight, picked)
    else:
        # _unsafe_view: the input's elements in the same row-major order, in another shape.
        source = (b["src"] if name == "copy_" else b["self"]).detach()
        shape = b["self"].shape
        if not (_plain(source) and _plain(b["self"]) and _real(source)) or source.is_complex():
            return None
        flat = checker._sample(math.prod(shape))
        src = _take(source.expand(shape), flat)
    return (_exact(lambda o: _take(o, flat), src),)


def _exact(gather: Callable[[torch.Tensor], torch.Tensor], values: torch.Tensor) -> _Target:
    """A check that the gathered output is ``values`` exactly (or rounded once, for a cast)."""
    batch = _Batch(("exact", values.dtype, values.shape, values.device), _exact_values, (values,))
    return _batched(0, gather, batch, 1, None, "exact", values.numel(), values.dtype)


def _constant_of(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> float | None:
    """The value a ``ones_like``, ``zeros_like``, ``full_like``, ``new_ones`` or ``new_zeros`` call
    fills with (None for another op, or a fill that is not a real number)."""
    name = func.overloadpacket.__name__
    if name in ("ones_like", "zeros_like", "new_ones", "new_zeros"):
        return 1.0 if "ones" in name else 0.0
    fill = _bind(func, args, kwargs).get("fill_value") if name == "full_like" else None
    return float(fill) if isinstance(fill, (bool, int, float)) else None


def _constant_values(value: float, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``value`` at every gathered element of ``like`` (one row per call), exactly."""
    return torch.full_like(like, value, dtype=F64), torch.zeros((), dtype=F64, device=like.device)


def _exact_values(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # The source's own values, exactly (float64 holds every real dtype but 64-bit integers' tails).
    return values.to(F64), torch.zeros((), dtype=F64, device=values.device)


def _embedding_backward(
    checker: SelfChecker, func: Any, args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[_Target, ...] | None:
    """An embedding's weight gradient at a sample of (row, column) of rows the batch used: the sum of
    that column of ``grad_output`` over the tokens of that row (over their count, with
    ``scale_grad_by_freq``; zero for ``padding_idx``)."""
    b = _bind(func, args, kwargs)
    grad, indices = b["grad_output"].detach(), b["indices"].detach()
    if not (_plain(grad) and _plain(indices) and _real(grad) and grad.is_floating_point() and indices.numel()):
        return None
    width = grad.shape[-1]
    tokens = indices.numel()
    if grad.numel() != tokens * width:
        return None
    flat_indices = indices.reshape(-1).to(torch.int64)
    picked = checker._sample(tokens * width)
    token, column = picked // width, picked % width
    rows = _take(flat_indices, token)  # the weight rows sampled: rows some token used
    same = flat_indices[None, :] == rows[:, None].to(flat_indices.device)  # (k, tokens)
    columns = _take(grad, torch.arange(tokens)[None, :] * width + column[:, None]).to(F64)  # (k, tokens)
    counts = same.sum(-1)
    # On the CPU the longest sum is known at no cost; elsewhere the batch bounds it (no host wait).
    terms = int(counts.max()) if same.device.type == "cpu" else tokens
    padding, by_frequency = b["padding_idx"], bool(b["scale_grad_by_freq"])
    flat_out = rows * width + column

    def ref() -> tuple[torch.Tensor, torch.Tensor]:
        used = same.to(F64)
        value, scale = (used * columns).sum(-1), (used * columns.abs()).sum(-1)
        if by_frequency:
            value, scale = value / counts.clamp(min=1), scale / counts.clamp(min=1)
        keep = (rows != padding).to(value.device, F64)
        return value * keep, scale * keep

    # 16-bit gradients are summed at their own precision (the CPU kernel: 46x the float32 allowance).
    eps_acc = torch.finfo(grad.dtype).eps if grad.dtype in (torch.float16, torch.bfloat16) else None
    return (_Target(0, lambda o: _take(o, flat_out), ref, max(terms, 1), eps_acc, "rows", picked.numel()),)


def _scattered(
    checker: SelfChecker, func: Any, args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[_Target, ...] | None:
    """``select_backward`` and ``slice_backward``: zeros of the input's size with the gradient
    written at the selected index or slice. A sampled element is the gradient's element it maps
    to, or exactly zero."""
    b = _bind(func, args, kwargs)
    grad = b["grad_output"].detach()
    geometry = _placement(func, b) if _plain(grad) and _real(grad) else None
    if geometry is None:
        return None
    sizes, grid = geometry
    flat = checker._sample(math.prod(sizes))
    return (_exact(lambda o: _take(o, flat), _placed(grad, sizes, grid, flat)),)


def _pairs(value: Any, default: Sequence[int]) -> list[int]:
    """A pooling argument's two values (one given stands for both; none given: ``default``)."""
    values = [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]
    return list(default) if not values else values * 2 if len(values) == 1 else values


def _pool_size(size: int, kernel: int, stride: int, padding: int, dilation: int, ceil_mode: bool) -> int:
    """A max pooling's output length (ATen's ``pooling_output_shape``).

    >>> _pool_size(112, 3, 2, 1, 1, False), _pool_size(5, 2, 2, 0, 1, True)
    (56, 3)
    """
    out = (size + 2 * padding - dilation * (kernel - 1) - 1 + (stride - 1 if ceil_mode else 0)) // stride + 1
    # ceil_mode: the last window must start inside the input or its left padding
    return out - 1 if ceil_mode and (out - 1) * stride >= size + padding else out


def _pool_geometry(b: dict[str, Any], x: torch.Tensor) -> tuple[list[int], ...] | None:
    """A 2-D max pooling's kernel, stride, padding, dilation and output size, or None (not 2-D)."""
    if x.dim() not in (3, 4):
        return None
    kernel = _pairs(b["kernel_size"], ())
    stride = _pairs(b.get("stride", []), kernel)
    padding, dilation = _pairs(b.get("padding", 0), (0, 0)), _pairs(b.get("dilation", 1), (1, 1))
    size = list(x.shape[-2:])
    ceil_mode = bool(b.get("ceil_mode", False))
    out = [_pool_size(size[j], kernel[j], stride[j], padding[j], dilation[j], ceil_mode) for j in range(2)]
    if any(len(v) != 2 for v in (kernel, stride, padding, dilation)) or min(out) <= 0 or min(stride) <= 0:
        return None
    return kernel, stride, padding, dilation, size, out


def _max_pool(
    checker: SelfChecker, func: Any, args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[_Target, ...] | None:
    """``max_pool2d_with_indices``: a sampled output element is the largest of its window's taps
    (padding and taps past the edge left out), exactly. The indices output is not checked."""
    b = _bind(func, args, kwargs)
    x = b["self"].detach()
    geometry = _pool_geometry(b, x) if _floating(x) else None
    if geometry is None:
        return None
    kernel, stride, padding, dilation, size, out = geometry
    planes = math.prod(x.shape[:-2])
    flat = checker._sample(planes * math.prod(out))
    plane, *o = _unravel(flat, (planes, *out))
    taps = [o[j][:, None] * stride[j] - padding[j] + torch.arange(kernel[j]) * dilation[j] for j in range(2)]
    valid = _all(_grid([(p >= 0) & (p < size[j]) for j, p in enumerate(taps)]))  # (k, *kernel)
    spatial = _offset(_grid([p.clamp(0, size[j] - 1) for j, p in enumerate(taps)]), size)
    values = _take(x, plane.reshape(-1, 1, 1) * math.prod(size) + spatial)
    # A NaN tap wins, as in the kernel (amax propagates it)
    maxima = values.masked_fill(~valid.to(values.device), -math.inf).amax((-2, -1))
    return (_exact(lambda o: _take(o, flat), maxima),)


def _max_pool_backward(
    checker: SelfChecker, func: Any, args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[_Target, ...] | None:
    """``max_pool2d_with_indices_backward``: a sampled input element's gradient is the sum of the
    output gradients whose window picked it (the forward's ``indices``), among the windows that
    reach it (at most one per kernel tap). The elements are those sampled windows picked: most
    of the input is picked by none, its gradient zero whatever the kernel's scale."""
    b = _bind(func, args, kwargs)
    grad, x, indices = b["grad_output"].detach(), b["self"].detach(), b["indices"].detach()
    if not (_floating(grad) and _plain(indices) and _plain(x)) or indices.shape != grad.shape:
        return None
    geometry = _pool_geometry(b, x)
    if geometry is None or list(grad.shape[-2:]) != geometry[-1] or grad.shape[:-2] != x.shape[:-2]:
        return None
    kernel, stride, padding, dilation, size, out = geometry
    planes = math.prod(x.shape[:-2])
    chosen = checker._sample(planes * math.prod(out))
    picks = _take(indices, chosen).cpu()
    if not bool(((picks >= 0) & (picks < math.prod(size))).all()):
        return None
    plane = chosen // math.prod(out)
    flat = plane * math.prod(size) + picks
    at = [picks // size[1], picks % size[1]]
    # The window o reaches position p through tap t where o * stride - padding + t * dilation == p.
    reach = [at[j][:, None] + padding[j] - torch.arange(kernel[j]) * dilation[j] for j in range(2)]
    ok = [(r >= 0) & (r % stride[j] == 0) & (r // stride[j] < out[j]) for j, r in enumerate(reach)]
    windows = _offset(_grid([(r // stride[j]).clamp(0, out[j] - 1) for j, r in enumerate(reach)]), out)
    windows = plane.reshape(-1, 1, 1) * math.prod(out) + windows  # (k, *kernel)
    picked = _all(_grid(ok)) & (_take(indices, windows).cpu() == (at[0] * size[1] + at[1]).reshape(-1, 1, 1))
    terms = _take(grad, windows)
    mask = picked.to(terms.device)
    # A 16-bit gradient may be summed at its own precision, so wide an allowance that a scaled
    # kernel shows only as one scale fitted through the sample
    short = grad.dtype in (torch.float16, torch.bfloat16)
    eps_acc = torch.finfo(grad.dtype).eps if short else None
    batch = _Batch(("masked sums", terms.dtype, terms.shape, terms.device), _masked_sums, (terms, mask))
    gather = lambda o: _take(o, flat)  # noqa: E731
    return (_batched(0, gather, batch, math.prod(kernel), eps_acc, "pointwise", flat.numel(), coherent=short),)


def _masked_sums(terms: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 sums of the gathered terms where ``mask`` holds, over the last two dimensions, and
    of their magnitudes."""
    values = torch.where(mask, terms.to(F64), 0.0).flatten(-2)
    return values.sum(-1), values.abs().sum(-1)


def _moved(checker: SelfChecker, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[_Target, ...] | None:
    """Ops that only move or make values (a reshape's copy, a scatter into zeros, a concatenation,
    a constant): the same op on float64 copies of the inputs, sampled, must be the output exactly.
    Recomputed whole, as cheap as the op itself (it only moves memory)."""
    tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
    if not all(_plain(t) and not t.is_complex() for t in tensors):
        return None
    if func is aten.cat.default:
        return _concatenated(checker, func, args, kwargs)
    # Empty inputs move nothing (a cache's first ``cat`` onto an empty tensor): judged by the rest.
    if sum(t.numel() for t in tensors) > MOVED_MAX:
        return None
    widened = lambda a: a.detach().to(F64) if isinstance(a, torch.Tensor) and a.is_floating_point() else a  # noqa: E731
    f_args = [[widened(t) for t in a] if isinstance(a, (list, tuple)) else widened(a) for a in args]
    f_kwargs = {k: (F64 if k == "dtype" and v is not None else widened(v)) for k, v in kwargs.items()}
    value = func(*f_args, **f_kwargs)
    if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.numel() == 0:
        return None
    flat = checker._sample(value.numel())
    picked = _take(value, flat)
    scale = torch.zeros((), dtype=F64, device=picked.device)
    # Exact where the output keeps float64's values (same dtype as what it moved, a constant it
    # holds exactly): limit 0. A constant it cannot hold (0.1 in bf16) is rounded once.
    constant = _constant_of(func, args, kwargs)
    if constant is not None:
        made = kwargs.get("dtype") or tensors[0].dtype
        dtype = made if torch.tensor(constant, dtype=made).item() == constant else F64
    else:
        dtype = next((t.dtype for t in tensors if t.is_floating_point() and t.numel()), None)
    return (_Target(0, lambda o: _take(o, flat), lambda: (picked, scale), 1, None, "exact", flat.numel(), dtype),)


def _concatenated(
    checker: SelfChecker, func: Any, args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[_Target, ...] | None:
    """A concatenation at sampled positions of its output: the element of the input that lies
    there (past the inputs before it along ``dim``), exactly; only those elements read, however
    long the inputs (a cache's keys and values grow every step)."""
    b = _bind(func, args, kwargs)
    # 1-D empty tensors are skipped by cat whatever their dim; other empty ones place nothing.
    parts = [t.detach() for t in b["tensors"] if not (t.dim() == 1 and t.numel() == 0)]
    if not parts or not all(t.is_floating_point() for t in parts) or len({t.device for t in parts}) > 1:
        return None
    dim = b["dim"] % parts[0].dim()
    sizes = [t.shape[dim] for t in parts]
    shape = (*parts[0].shape[:dim], sum(sizes), *parts[0].shape[dim + 1 :])
    if any(
        t.dim() != len(shape) or t.shape[:dim] + t.shape[dim + 1 :] != shape[:dim] + shape[dim + 1 :] for t in parts
    ):
        return None
    numel, inner = math.prod(shape), math.prod(shape[dim + 1 :])
    if not numel:
        return None
    flat = checker._sample(numel)
    along, outer, within = (flat // inner) % shape[dim], flat // (inner * shape[dim]), flat % inner
    ends = torch.tensor(sizes).cumsum(0)
    which = torch.searchsorted(ends, along, right=True)
    device = parts[0].device
    picked = torch.empty(flat.shape, dtype=F64, device=device)
    for i, t in enumerate(parts):
        here = which == i
        if sizes[i] and bool(here.any()):
            local = (outer[here] * sizes[i] + along[here] - (ends[i] - sizes[i])) * inner + within[here]
            picked[here.to(device)] = _take(t, local).to(F64)
    scale = torch.zeros((), dtype=F64, device=device)
    dtypes = {t.dtype for t in parts}
    source = parts[0].dtype if len(dtypes) == 1 else F64  # mixed: the output promotes, rounding once
    return (_Target(0, lambda o: _take(o, flat), lambda: (picked, scale), 1, None, "exact", flat.numel(), source),)


# How a _foreach_ overload's per-tensor call is spelled: its lists' elements are tensors or scalars.
_FOREACH_OVERLOADS = {
    "List": ("Tensor", "default"),
    "Scalar": ("Scalar", "default"),
    "ScalarList": ("Scalar", "default"),
}


def _foreach(
    checker: SelfChecker, func: Any, args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[_Target, ...] | None:
    """A pointwise ``_foreach_`` op (what optimizers run on accelerators): each list position
    checked as the plain op's call on that position's tensors and scalars, output ``i`` the list's
    ``i``-th tensor."""
    packet = getattr(aten, func.overloadpacket.__name__[len("_foreach_") :], None)
    if packet is None or not args or not isinstance(args[0], (list, tuple)):
        return None
    wanted = _FOREACH_OVERLOADS.get(func._overloadname, ("Tensor", "Scalar", "default"))
    targets: list[_Target] = []
    for i in range(len(args[0])):
        call = [a[i] if isinstance(a, (list, tuple)) else a for a in args]
        for name in wanted:
            single = getattr(packet, name, None)
            bound = _bound_call(single, call, kwargs) if single is not None else None
            if bound is None or _classify(single) is not _pointwise:
                continue
            found = _pointwise(checker, single, *bound)
            if found:
                targets.extend(t._replace(index=i) for t in found)
            break
    return tuple(targets) or None


def _fused_adam(
    checker: SelfChecker, func: Any, args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[_Target, ...] | None:
    """A fused Adam or AdamW step (``_fused_adam_``, ``_fused_adamw_``): for a sample of each
    parameter's elements, the new parameter, first and second moment recomputed in float64 from the
    values before the step. Outputs are the lists it writes, in order: parameters, first moments,
    second moments (see :func:`_written`). Steps with a loss scaler's ``grad_scale``/``found_inf``
    are left out (whether the step ran at all is the scaler's decision)."""
    b = _bind(func, args, kwargs)
    if b.get("grad_scale") is not None or b.get("found_inf") is not None:
        return None
    params, grads, avgs, squares, highest, steps = (
        list(b[name]) for name in ("self", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "state_steps")
    )
    count = len(params)
    amsgrad, maximize = bool(b["amsgrad"]), bool(b["maximize"])
    beta1, beta2, decay, eps = (float(b[name]) for name in ("beta1", "beta2", "weight_decay", "eps"))
    lr = b["lr"].detach().to(F64) if isinstance(b["lr"], torch.Tensor) else float(b["lr"])
    decoupled = func.overloadpacket.__name__ == "_fused_adamw_"
    if not all(len(group) == count for group in (grads, avgs, squares, steps)) or (amsgrad and len(highest) != count):
        return None
    targets: list[_Target] = []
    for i in range(count):
        tensors = [params[i], grads[i], avgs[i], squares[i]] + ([highest[i]] if amsgrad else [])
        if not _floating(*tensors):
            continue
        flat = checker._sample(params[i].numel())
        p, g, m, v, *top = (_take(t.detach(), flat).to(F64) for t in tensors)
        step = steps[i].detach().to(F64)  # already advanced by the optimizer before the call
        targets.extend(
            _adam_targets(i, count, flat, (p, g, m, v, top), step, lr, (beta1, beta2, decay, eps), decoupled, maximize)
        )
    return tuple(targets) or None


def _adam_targets(
    i: int,
    count: int,
    flat: torch.Tensor,
    values: tuple,
    step: torch.Tensor,
    lr: float | torch.Tensor,
    hyper: tuple[float, float, float, float],
    decoupled: bool,
    maximize: bool,
) -> list[_Target]:
    """The three recomputed outputs of parameter ``i``'s Adam step (see :func:`_fused_adam`)."""
    p, g, m, v, top = values
    beta1, beta2, decay, eps = hyper
    g = -g if maximize else g
    if decoupled:
        kept = p * (1 - lr * decay)
    else:
        kept, g = p, g + decay * p
    m_new = beta1 * m + (1 - beta1) * g
    v_new = beta2 * v + (1 - beta2) * g * g
    second = torch.maximum(top[0], v_new) if top else v_new
    correction1, correction2 = 1 - beta1**step, 1 - beta2**step
    update = (lr / correction1) * m_new / (second.sqrt() / correction2.sqrt() + eps)
    # Each term is rounded a few times at the working precision (the bias corrections, a root, a
    # quotient): the terms' own sizes are the scale.
    results = (
        (kept - update, kept.abs() + 4 * update.abs()),
        (m_new, (beta1 * m).abs() + ((1 - beta1) * g).abs()),
        (v_new, (beta2 * v).abs() + ((1 - beta2) * g * g).abs()),
    )
    return [
        _Target(k * count + i, lambda o: _take(o, flat), lambda r=r: r, 1, None, "pointwise", flat.numel())
        for k, r in enumerate(results)
    ]


def _written(
    kind: Callable[..., Any], func: Any, args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[torch.Tensor, ...]:
    """What an op that returns nothing wrote, in its checks' output order: an in-place
    ``_foreach_`` op's self list; a fused Adam step's parameters, first and second moments."""
    if kind is _foreach and func._schema.returns == []:
        return tuple(args[0])
    if kind is _fused_adam:
        b = _bind(func, args, kwargs)
        return (*b["self"], *b["exp_avgs"], *b["exp_avg_sqs"])
    return ()


def _bound_call(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]] | None:
    """``(args, kwargs)`` for ``func`` where they fit its schema by kind (tensor or number),
    positional values beyond its positional arguments passed as its keyword-only ones in order
    (``_foreach_addcdiv_``'s scalars are ``addcdiv_``'s ``value``); None where they do not fit."""
    arguments = func._schema.arguments
    positional = [a for a in arguments if not a.kwarg_only]
    keyword = [a for a in arguments if a.kwarg_only]
    extra = list(args[len(positional) :])
    if len(extra) > len(keyword):
        return None
    kwargs = {**kwargs, **{a.name: value for a, value in zip(keyword, extra)}}
    for value, arg in zip(args, positional):
        if (str(arg.type) in ("Tensor", "Optional[Tensor]")) != isinstance(value, torch.Tensor):
            return None
    if not all(name in {a.name for a in arguments} for name in kwargs):
        return None
    return list(args[: len(positional)]), kwargs


# The kinds whose calls have recipes (the C path compares an op's kind with them); the first,
# pointwise ops, the one whose float arguments are left out of a signature and gathered per call.
RECIPE_KINDS = (
    _pointwise, _copy, _matmul, _reduction, _softmax, _layer_norm, _layer_norm_backward, _scattered, _convolution,
    _convolution_backward, _batch_norm, _batch_norm_backward, _moved, _nll_loss, _nll_loss_backward, _attention,
)  # fmt: skip


def _classify(func: Any) -> Callable[..., tuple[_Target, ...] | None] | None:
    """Which checker an op overload gets (cached by the caller per overload)."""
    if func.overloadpacket.__name__.startswith("_foreach_"):
        return _foreach
    special = _special().get(func)
    if special is not None:
        return special
    if torch.Tag.pointwise not in func.tags or torch.Tag.nondeterministic_seeded in func.tags:
        return None
    if func.overloadpacket.__name__ in _DISCONTINUOUS or func._overloadname in _DISCONTINUOUS_OVERLOADS:
        return None
    # In-place overloads write only self (checked on a gathered copy); out= overloads are left out.
    writes = [a for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    first = func._schema.arguments[0].name if func._schema.arguments else None
    if writes and (len(writes) > 1 or writes[0].name != first or writes[0].kwarg_only):
        return None
    return _pointwise


_SPECIAL: dict[Any, Callable[..., tuple[_Target, ...] | None]] = {}


def special_ops() -> frozenset[Any]:
    """The op overloads checked by a rule of their own, not by the pointwise tag."""
    return frozenset(_special())


def _special() -> dict[Any, Callable[..., tuple[_Target, ...] | None]]:
    """The non-pointwise overloads checked, built once (a name missing from this torch is skipped)."""
    if not _SPECIAL:
        table = {
            _matmul: ["mm", "addmm", "bmm", "baddbmm", "mv", "addmv", "dot", "_addmm_activation"],
            _convolution: ["convolution"],
            _convolution_backward: ["convolution_backward"],
            _reduction: ["sum.dim_IntList", "mean.dim", "sum", "mean"],
            _softmax: [
                "_softmax",
                "_safe_softmax",
                "_log_softmax",
                "_softmax_backward_data",
                "_log_softmax_backward_data",
            ],
            _layer_norm: ["native_layer_norm"],
            _attention: [
                "_scaled_dot_product_flash_attention_for_cpu",
                "_scaled_dot_product_efficient_attention",
                "_scaled_dot_product_flash_attention",
                "_scaled_dot_product_cudnn_attention",
                "_scaled_dot_product_fused_attention_overrideable",
            ],
            _layer_norm_backward: ["native_layer_norm_backward"],
            _batch_norm: [
                "native_batch_norm",
                "_native_batch_norm_legit",
                "_native_batch_norm_legit.no_stats",
                "_native_batch_norm_legit_no_training",
                "_batch_norm_with_update",
            ],
            _batch_norm_backward: ["native_batch_norm_backward"],
            _nll_loss: ["nll_loss_forward"],
            _nll_loss_backward: ["nll_loss_backward"],
            _embedding_backward: ["embedding_dense_backward"],
            _max_pool: ["max_pool2d_with_indices"],
            _max_pool_backward: ["max_pool2d_with_indices_backward"],
            _fused_adam: ["_fused_adam_", "_fused_adamw_", "_fused_adam_.tensor_lr", "_fused_adamw_.tensor_lr"],
            _copy: ["_to_copy", "copy_", "clone", "embedding", "_unsafe_view"],
            _scattered: ["select_backward", "slice_backward"],
            _moved: [
                "cat",
                "stack",
                "index_select",
                "gather",
                "repeat",
                "tril",
                "triu",
                "constant_pad_nd",
                "zeros_like",
                "ones_like",
                "full_like",
                "new_zeros",
                "new_ones",
            ],
        }
        for kind, names in table.items():
            for name in names:
                packet, _, overload = name.partition(".")
                op = getattr(getattr(aten, packet, None), overload or "default", None)
                if op is not None:
                    _SPECIAL[op] = kind
    return _SPECIAL
