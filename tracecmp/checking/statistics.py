"""Checking ops of a statistics-only trace: replays on random inputs drawn to match the statistics.

A statistics trace holds, per tensor, its shape, dtype, min, max, mean, norm and NaN/Inf counts,
not its values. As msprobe's run_ut does with its statistics dumps, each op is replayed on random
inputs drawn to match: every draw holds the recorded minimum and maximum at random positions,
the rest are Gaussian values with the recorded mean and norm, clipped to the range, NaN/Inf as
many as recorded, and values on the coarser grid (bf16/fp16) their recorded extremes lie on.
Several draws are run in float64 (the reference) and in the recorded dtypes (an honest kernel).

Run_ut then compares a live device against the CPU on those inputs; here the device is gone, so
what can be judged is what the recorded output statistics must be *whatever the values were*:

* **pinned statistics**: a statistic of the output that comes out the same in float64 on every
  draw (to 1e-13 of its scale) depends only on what the draws share with the real inputs, so the
  recorded value must match it: the extremes of a monotone elementwise op (``max gelu(x) =
  gelu(max x)``), a softmax's mean (``1/K``: its rows sum to one), a max or min reduction
  (extremes only for ops with one varying input: where two tensors' values meet is positional,
  and a few draws can agree on it by chance). The
  recorded value errs when it lies more than ``margin`` times further from the float64 value
  than the honest replays do and beyond the floor (``floor`` units of the value for extremes,
  ``mean_floor`` units of the output's rms for mean and norm, which average their elements'
  rounding);
* **the precision grid**: a float32/float64 output whose nonzero extremes both lie on the
  float16 (or bfloat16) grid, from inputs that do not and in draws that never do, was computed
  or rounded at that precision (a float32 kernel lands there by chance once in 2^26, or 2^32),
  unless the output is far smaller than the draws' (a residue where terms cancel has few bits);
* **NaN/Inf from finite inputs**: an error when no honest replay on inputs of these ranges makes
  any (said with the precision that does: inputs rounded to float16 overflow above 65504).

What statistics cannot show, check does not claim: an op none of whose output statistics is
pinned (a matmul's output depends on every input value) is *skipped*, with the advice to capture
its region with tensors; so is an op whose output depends on values no statistic describes
(integer or boolean inputs: indices, masks, token ids). Every verdict here carries
``evidence="statistics"``: weaker evidence than a replay on the recorded inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from tracecmp.aten.opclass import classify
from tracecmp.aten.rounding import reduced_models
from tracecmp.checking.standards import OpVerdict, Standards
from tracecmp.numerics.replay.calls import calls_of, invoke, returned_tensors, static_skip_reason
from tracecmp.numerics.replay.records import RecordedOp
from tracecmp.numerics.units import EPS

_PIN = 1e-13  # a statistic agreeing this closely (of its scale) across draws is pinned
_DRAWS_SMALL = 3
_DRAWS_LARGE = 2
_LARGE = 1 << 20  # input elements above which an op gets the smaller number of draws
_GRIDS = (("float16", torch.float16), ("bfloat16", torch.bfloat16))
_FLOATS = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_DTYPES = {
    **_FLOATS,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_STATS = ("min", "max", "mean", "norm")
_RESIDUE = 1e-2  # an output below this fraction of what honest draws give is cancellation residue (grid test off)


@dataclass(frozen=True)
class TensorSpec:
    """What a statistics trace says of one tensor value."""

    shape: tuple[int, ...]
    dtype: str
    min: float
    max: float
    mean: float
    norm: float
    nan: int
    inf: int
    exact: bool  # the statistics are this tensor's own (or a same-size view's), not a larger base's
    grid: str = ""  # the coarser dtype its extremes lie on ("float16", "bfloat16"), if any

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def on_grid(value: float, grid: torch.dtype) -> bool:
    """Whether ``value`` is exactly representable in ``grid`` (zero and infinities are)."""
    if math.isnan(value):
        return False
    if math.isinf(value):
        return True
    try:
        return float(torch.tensor(value, dtype=torch.float64).to(grid).to(torch.float64)) == value
    except (RuntimeError, OverflowError):
        return False


def _signature(op: RecordedOp, specs: list[TensorSpec], judged: list[tuple[int, int, TensorSpec]]) -> tuple:
    """What decides whether a call's statistics pin its outputs' numbers: the op, its arguments,
    its inputs' shapes, dtypes and signs, and which outputs are judged (the layers of a model call
    their ops alike)."""
    inputs = tuple((s.shape, s.dtype, s.min < 0, s.max > 0, s.min == s.max, s.nan > 0, s.inf > 0) for s in specs)
    return op.name, op.args, inputs, tuple((i, s.dtype) for i, _, s in judged)


def _testable_without_pins(judged: list[tuple[int, int, TensorSpec]], finite_inputs: bool) -> bool:
    """Whether a call's outputs give the tests that need no pinned statistics something to test:
    NaN/Inf from finite inputs, or float extremes that both lie on a coarser grid."""
    for _, _, out in judged:
        if out.nan + out.inf > 0 and finite_inputs:
            return True
        if out.dtype in ("float32", "float64") and out.min != out.max:
            if any(on_grid(out.min, grid) and on_grid(out.max, grid) for _, grid in _GRIDS):
                return True
    return False


def _pins_nothing(op: RecordedOp, judged: list[tuple[int, int, TensorSpec]]) -> OpVerdict:
    """The skipped verdict of a call whose statistics pin none of its outputs' numbers."""
    grid = any(out.dtype in ("float32", "float64") and out.min != out.max for _, _, out in judged)
    tested = " (only that its output is on no coarser precision grid could be tested)" if grid else ""
    return OpVerdict(
        op.op_id,
        "skipped",
        reason="its statistics pin none of its outputs' numbers (they depend on "
        f'every input value){tested}: capture its region with data="tensors" to check it',
    )


def _grid_of(dtype: str, lo: float, hi: float) -> str:
    """The coarsest grid finer dtypes' values ``lo`` and ``hi`` both lie on, "" for none."""
    if dtype not in ("float32", "float64") or not (math.isfinite(lo) and math.isfinite(hi)):
        return ""
    for name, grid in sorted(_GRIDS, key=lambda g: EPS[g[0]], reverse=True):
        if on_grid(lo, grid) and on_grid(hi, grid):
            return name
    return ""


class StatisticsChecker:
    """Checks the ops of one rank of a statistics trace (see the module docstring).

    >>> StatisticsChecker(tracecmp.load("runs/target").rank(0)).check(42)   # doctest: +SKIP
    OpVerdict(op_id=42, status='pass', evidence='statistics', ...)
    """

    def __init__(
        self, rank: Any, *, reduced: str | None = None, standards: Standards | None = None, seed: int = 0
    ) -> None:
        self.reduced = reduced
        self.standards = standards or Standards()
        self.seed = seed
        # Calls (see _signature) whose statistics pinned none of their outputs' numbers: a later
        # call alike draws again only where the NaN or the precision-grid test has something to test.
        self._pins_nothing: set[tuple] = set()
        table = rank.tensors_table.select(
            [
                "tensor_id",
                "op_id",
                "shape",
                "dtype",
                "view_of",
                "has_stats",
                "min",
                "max",
                "mean",
                "norm",
                "nan_count",
                "inf_count",
            ]
        ).to_pydict()
        self.rows: dict[int, tuple] = {
            t: row
            for t, *row in zip(
                table["tensor_id"],
                table["op_id"],
                table["shape"],
                table["dtype"],
                table["view_of"],
                table["has_stats"],
                table["min"],
                table["max"],
                table["mean"],
                table["norm"],
                table["nan_count"],
                table["inf_count"],
            )
        }
        ops = rank.ops_table.select(["op_id", "kind", "op", "args", "inputs", "outputs", "random"]).to_pydict()
        self.ops: dict[int, RecordedOp] = {
            o: RecordedOp(o, k, n, a or "{}", list(i or ()), list(out or ()), bool(r))
            for o, k, n, a, i, out, r in zip(
                ops["op_id"], ops["kind"], ops["op"], ops["args"], ops["inputs"], ops["outputs"], ops["random"]
            )
        }

    # -- what the trace says of a tensor -------------------------------------------------------
    def spec(self, tid: int) -> TensorSpec | None:
        """The statistics of tensor ``tid``, a view's taken from its base; None when there are none."""
        row = self.rows.get(tid)
        if row is None:
            return None
        shape = tuple(row[1] or ())
        numel = math.prod(shape)
        own_dtype = row[2]
        exact = True
        seen = 0
        while not row[4]:  # no statistics of its own: a view
            if row[3] is None or row[3] < 0 or seen > 64:
                return None
            row = self.rows.get(row[3])
            if row is None:
                return None
            seen += 1
        base_numel = math.prod(tuple(row[1] or ()))
        if seen:
            exact = base_numel == numel
        lo, hi, mean, norm, nan, inf = row[5:11]
        if lo is None or hi is None:
            return None
        if seen and base_numel and numel != base_numel and norm is not None:
            norm = norm * math.sqrt(numel / base_numel)
        return TensorSpec(
            shape,
            own_dtype,
            float(lo),
            float(hi),
            float(mean if mean is not None else 0.0),
            float(norm if norm is not None else 0.0),
            int(nan or 0),
            int(inf or 0),
            exact,
            _grid_of(own_dtype, float(lo), float(hi)),
        )

    # -- checking ------------------------------------------------------------------------------
    def check(self, op_id: int) -> OpVerdict:
        op = self.ops[op_id]
        reason = static_skip_reason(op)
        if reason:
            return OpVerdict(op_id, "skipped", reason=reason)
        args = op.arguments()
        assert args is not None
        cls = classify(op.name)
        specs: list[TensorSpec] = []
        for position, tid in enumerate(op.inputs):
            spec = self.spec(tid)
            if spec is None:
                return OpVerdict(
                    op_id,
                    "skipped",
                    reason=f"input {position} has no statistics (a view the trace cannot "
                    "resolve, or uninitialized memory)",
                )
            if spec.dtype not in _DTYPES:
                return OpVerdict(
                    op_id, "skipped", reason=f"input {position} is {spec.dtype}, which random inputs do not cover"
                )
            if spec.dtype not in _FLOATS and spec.min != spec.max and cls.input_rule(position) != "ignore":
                what = "a mask" if spec.dtype == "bool" else "indices or token ids"
                return OpVerdict(
                    op_id,
                    "skipped",
                    reason=f"its output depends on the values of input {position} "
                    f"({spec.dtype}: {what}), which statistics cannot reproduce",
                )
            specs.append(spec)
        outputs = [(i, t, self.spec(t)) for i, t in enumerate(op.outputs)]
        judged = [(i, t, s) for i, t, s in outputs if s is not None and s.dtype in _FLOATS and self.rows[t][4]]
        if not judged:
            return OpVerdict(op_id, "skipped", reason="no floating output with statistics of its own")
        calls = calls_of(op, args)
        if len(calls) > 1:
            return self._check_list_op(op, calls)
        return self._check_call(op, args, specs, judged, seed=op_id)

    def _check_list_op(self, op: RecordedOp, calls: list) -> OpVerdict:
        """A ``_foreach_*`` op, one list element at a time; the worst element decides."""
        worst: OpVerdict | None = None
        for index, call in enumerate(calls):
            specs = [self.spec(t) for t in call.inputs]
            judged = [(i, t, self.spec(t)) for i, t in enumerate(call.outputs)]
            judged = [(i, t, s) for i, t, s in judged if s is not None and s.dtype in _FLOATS and self.rows[t][4]]
            if any(s is None for s in specs) or not judged:
                continue
            found = self._check_call(op, call.args, specs, judged, seed=op.op_id * 1009 + index)  # type: ignore[arg-type]
            if worst is None or _rank(found) > _rank(worst):
                worst = found
        if worst is None:
            return OpVerdict(op.op_id, "skipped", reason="no list element with statistics to check")
        worst.op_id = op.op_id
        return worst

    def _check_call(
        self,
        op: RecordedOp,
        args: dict[str, Any],
        specs: list[TensorSpec],
        judged: list[tuple[int, int, TensorSpec]],
        seed: int,
    ) -> OpVerdict:
        finite_inputs = all(spec.nan == 0 and spec.inf == 0 for spec in specs if spec.dtype in _FLOATS)
        signature = _signature(op, specs, judged)
        if signature in self._pins_nothing and not _testable_without_pins(judged, finite_inputs):
            return _pins_nothing(op, judged)
        drawn = self._draw(op, args, specs, judged, seed)
        if isinstance(drawn, OpVerdict):
            return drawn
        golden_stats, honest_stats = drawn
        found = _Findings()
        findings, checks = found.findings, found.checks
        positional = sum(1 for spec in specs if spec.numel > 1 and spec.min != spec.max) > 1
        for k, (_, _, out) in enumerate(judged):
            # NaN/Inf from finite inputs.
            if out.nan + out.inf > 0 and finite_inputs:
                checks.add("nonfinite")
                if not any(h[k][4] > 0 for h in honest_stats):
                    cause = self._overflow_cause(op, args, specs, judged[k][0])
                    findings.append(
                        (
                            "error",
                            "nan",
                            math.inf,
                            f"{out.nan + out.inf} NaN/Inf in its output from finite inputs, where an honest {out.dtype} "
                            f"replay on inputs drawn to their statistics stays finite{cause}",
                        )
                    )
                continue
            self._check_pinned(out, k, specs, golden_stats, honest_stats, positional, found)
            # The precision grid.
            grid = self._grid_evidence(out, specs, honest_stats, k)
            if grid:
                checks.add("grid")
                findings.append(("error", "computation", 2.0**13, grid))
            elif out.dtype in ("float32", "float64") and out.min != out.max:
                checks.add("grid")
        if not findings and not checks - {"grid", "nonfinite"}:
            self._pins_nothing.add(signature)
            return _pins_nothing(op, judged)
        return _verdict(op, judged, found)

    def _draw(
        self,
        op: RecordedOp,
        args: dict[str, Any],
        specs: list[TensorSpec],
        judged: list[tuple[int, int, TensorSpec]],
        seed: int,
    ) -> tuple[list[list[tuple[float, ...]]], list[list[tuple[float, ...]]]] | OpVerdict:
        """The judged outputs' statistics from a float64 (golden) and an honest replay on each draw
        of inputs matching ``specs``; a skipped verdict where the op cannot be replayed so."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + seed)
        size = sum(spec.numel for spec in specs)
        count = _DRAWS_LARGE if size > _LARGE else _DRAWS_SMALL
        golden_stats: list[list[tuple[float, ...]]] = []
        honest_stats: list[list[tuple[float, ...]]] = []
        for _ in range(count):
            inputs = [draw(spec, generator) for spec in specs]
            golden = invoke(op.name, args, inputs, golden=True)
            models = reduced_models(op.name, inputs, self.reduced)
            honest = invoke(op.name, args, models[0] if models else inputs, golden=False)
            if golden is None or honest is None:
                return OpVerdict(
                    op.op_id, "skipped", reason="it does not run on the CPU on inputs drawn to its statistics"
                )
            g_out, h_out = returned_tensors(op.name, *golden), returned_tensors(op.name, *honest)
            if any(i >= len(g_out) or i >= len(h_out) for i, _, _ in judged):
                return OpVerdict(op.op_id, "skipped", reason="its replay returned fewer outputs than were recorded")
            golden_stats.append([_stats(g_out[i]) for i, _, _ in judged])
            honest_stats.append([_stats(h_out[i]) for i, _, _ in judged])
        return golden_stats, honest_stats

    def _check_pinned(
        self,
        out: TensorSpec,
        k: int,
        specs: list[TensorSpec],
        golden_stats: list[list[tuple[float, ...]]],
        honest_stats: list[list[tuple[float, ...]]],
        positional: bool,
        found: _Findings,
    ) -> None:
        """Judge the statistics of output ``k`` (recorded as ``out``) that every draw gives alike:
        the recorded ones must lie as near them as an honest replay's."""
        s = self.standards
        findings, checks, metrics = found.findings, found.checks, found.metrics
        recorded = (out.min, out.max, out.mean, out.norm)
        numel = max(out.numel, 1)
        rms = out.norm / math.sqrt(numel) if out.norm else 0.0
        for index, name in enumerate(_STATS):
            values = [g[k][index] for g in golden_stats]
            if not all(math.isfinite(v) for v in values) or not all(math.isfinite(h[k][index]) for h in honest_stats):
                continue
            scale = abs(values[0]) if name in ("min", "max") and values[0] != 0 else max(abs(values[0]), rms)
            if scale == 0 or max(abs(v - values[0]) for v in values) > _PIN * scale:
                continue
            if name == "norm" and not all(spec.exact for spec in specs):
                continue
            if name in ("min", "max") and positional:
                # Its extremes depend on where two tensors' values meet (relu's backward: the
                # gradient's largest value passes only where the input is positive): a few
                # draws may agree by chance, the real run need not.
                continue
            checks.add(name)
            predicted = values[0]
            honest_dev = max(abs(h[k][index] - g[k][index]) for h, g in zip(honest_stats, golden_stats))
            deviation = abs(recorded[index] - predicted) if math.isfinite(recorded[index]) else math.inf
            unit = EPS.get(out.dtype, 0.0) * scale
            floor = (s.floor if name in ("min", "max") else s.mean_floor) * unit
            bar = max(s.margin * honest_dev, floor)
            metrics[f"{name}_deviation"] = max(metrics.get(f"{name}_deviation", 0.0), deviation / unit if unit else 0.0)
            if deviation > bar:
                findings.append(
                    (
                        "error",
                        "computation",
                        deviation / bar if bar else math.inf,
                        f"its output's {name} {recorded[index]:.9g} should be {predicted:.9g} whatever its input "
                        f"values were (it is the same on every draw matching their statistics): off by "
                        f"{deviation / unit:.0f} rounding units of {out.dtype}, where an honest {out.dtype} "
                        "replay is "
                        f"off by {honest_dev / unit:.1f}",
                    )
                )
            elif deviation > max(s.warn_margin * honest_dev, floor):
                findings.append(
                    (
                        "warning",
                        "computation",
                        deviation / bar if bar else 0.0,
                        f"its output's {name} is off by {deviation / unit:.1f} rounding units from what its input "
                        f"statistics pin it to ({predicted:.9g}), {deviation / max(honest_dev, 1e-300):.1f}x an "
                        f"honest replay",
                    )
                )

    def _grid_evidence(self, out: TensorSpec, specs: list[TensorSpec], honest_stats: list, k: int) -> str:
        if out.dtype not in ("float32", "float64") or out.min == out.max:
            return ""
        if not all(math.isfinite(v) and v != 0 for v in (out.min, out.max)):
            return ""
        # An output far smaller than an honest kernel makes from inputs of these statistics is
        # what is left where terms cancel (a gradient through a normalization): a residue of a
        # few bits lies on any coarse grid, whatever precision computed it.
        largest = max(abs(out.min), abs(out.max))
        typical = sorted(max(abs(h[k][0]), abs(h[k][1])) for h in honest_stats)[len(honest_stats) // 2]
        if not largest >= _RESIDUE * typical:
            return ""
        for name, grid in _GRIDS:
            if not (on_grid(out.min, grid) and on_grid(out.max, grid)):
                continue
            if any(spec.grid and EPS[spec.grid] >= EPS[name] for spec in specs):
                continue  # inputs on that grid already: exact ops keep them there
            if any(on_grid(h[k][0], grid) and on_grid(h[k][1], grid) for h in honest_stats):
                continue  # an honest kernel lands there on these inputs too
            bits = {"float16": 13, "bfloat16": 16}[name] if out.dtype == "float32" else 42
            return (
                f"its output's extremes ({out.min:.9g}, {out.max:.9g}) both lie on the {name} grid, as an op that "
                f"computes or rounds its result in {name} gives; an honest {out.dtype} kernel on inputs drawn to their "
                f"statistics does not, and lands there by chance once in 2^{2 * bits}"
            )
        return ""

    def _overflow_cause(self, op: RecordedOp, args: dict[str, Any], specs: list[TensorSpec], position: int) -> str:
        """ "; rounding its inputs to float16 reproduces it ..." when that is what makes NaN/Inf here."""
        floats = [spec for spec in specs if spec.dtype in ("float32", "float64")]
        if not floats:
            return ""
        generator = torch.Generator().manual_seed(self.seed + op.op_id)
        inputs = [draw(spec, generator) for spec in specs]
        halved = [x.to(torch.float16).to(x.dtype) if x.dtype in (torch.float32, torch.float64) else x for x in inputs]
        found = invoke(op.name, args, halved, golden=False)
        if found is None:
            return ""
        outs = returned_tensors(op.name, *found)
        if (
            position < len(outs)
            and isinstance(outs[position], torch.Tensor)
            and not bool(torch.isfinite(outs[position]).all())
        ):
            largest = max(max(abs(spec.min), abs(spec.max)) for spec in floats)
            return f"; a replay on its inputs rounded to float16 reproduces it (inputs up to {largest:.3g}" + (
                ", beyond float16's 65504)" if largest > 65504 else ")"
            )
        return ""


def _rank(verdict: OpVerdict) -> tuple[int, float]:
    order = {"skipped": 0, "pass": 1, "warning": 2, "error": 3}
    return order.get(verdict.status, 0), verdict.score


def _stats(value: Any) -> tuple[float, float, float, float, int]:
    """(min, max, mean, norm, NaN/Inf count) of a tensor as capture defines them, in float64."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        return (math.nan,) * 4 + (0,)  # type: ignore[return-value]
    x = value.detach().to(torch.float64).reshape(-1)
    finite = torch.isfinite(x)
    bad = int((~finite).sum())
    kept = x[~torch.isnan(x)]
    lo, hi = (float(kept.min()), float(kept.max())) if kept.numel() else (math.nan, math.nan)
    good = x[finite]
    mean = float(good.mean()) if good.numel() else math.nan
    norm = float(torch.linalg.vector_norm(good)) if good.numel() else 0.0
    return lo, hi, mean, norm, bad


def draw(spec: TensorSpec, generator: torch.Generator) -> torch.Tensor:
    """A random tensor matching ``spec``: its extremes at random positions (when they are this
    tensor's own), Gaussian values with its mean and norm in between, its NaN/Inf count, its grid.

    >>> x = draw(TensorSpec((100,), "float32", -2.0, 3.0, 0.1, 10.0, 0, 0, True), torch.Generator().manual_seed(0))
    >>> float(x.min()), float(x.max())
    (-2.0, 3.0)
    """
    dtype = _DTYPES[spec.dtype]
    n = spec.numel
    if n == 0:
        return torch.empty(spec.shape, dtype=dtype)
    if dtype not in _FLOATS.values():
        if spec.min == spec.max:
            return torch.full(spec.shape, spec.min, dtype=torch.float64).to(dtype)
        if dtype == torch.bool:
            return (torch.rand(spec.shape, generator=generator, dtype=torch.float64) < max(spec.mean, 0.0)).to(dtype)
        low, high = int(spec.min), int(spec.max)
        return torch.randint(low, high + 1, spec.shape, generator=generator, dtype=torch.int64).to(dtype)
    values = torch.empty(n, dtype=torch.float64)
    order = torch.randperm(n, generator=generator)
    nan, inf = min(spec.nan, n), min(spec.inf, max(n - spec.nan, 0))
    values[order[:nan]] = math.nan
    if inf:
        signs = torch.ones(inf, dtype=torch.float64)
        if spec.min == -math.inf and spec.max == math.inf:
            signs[::2] = -1.0
        elif spec.min == -math.inf:
            signs[:] = -1.0
        values[order[nan : nan + inf]] = signs * math.inf
    rest = order[nan + inf :]
    m = rest.numel()
    if m:
        values[rest] = _finite_part(spec, m, generator)
    out = values.reshape(spec.shape)
    if spec.grid:
        out = out.to(_FLOATS[spec.grid]).to(torch.float64)
    return out.to(dtype)


def _finite_part(spec: TensorSpec, m: int, generator: torch.Generator) -> torch.Tensor:
    lo, hi = spec.min, spec.max
    finite_range = math.isfinite(lo) and math.isfinite(hi)
    mean = spec.mean if math.isfinite(spec.mean) else 0.0
    mean_square = spec.norm**2 / m if math.isfinite(spec.norm) else mean * mean
    if not finite_range:
        spread = math.sqrt(max(mean_square - mean * mean, 0.0))
        lo = lo if math.isfinite(lo) else mean - 3 * spread - 1.0
        hi = hi if math.isfinite(hi) else mean + 3 * spread + 1.0
    if lo == hi:
        return torch.full((m,), lo, dtype=torch.float64)
    fixed: list[float] = [lo, hi] if spec.exact and finite_range and m >= 2 else []
    k = m - len(fixed)
    if k <= 0:
        return torch.tensor(fixed[:m], dtype=torch.float64)
    # The rest: mean and mean square chosen so that the whole matches, then clipped to the range.
    rest_mean = (mean * m - sum(fixed)) / k
    rest_square = (mean_square * m - sum(v * v for v in fixed)) / k
    spread = math.sqrt(max(rest_square - rest_mean * rest_mean, 0.0))
    z = torch.randn(k, generator=generator, dtype=torch.float64)
    if k > 1:
        z = (z - z.mean()) / max(float(z.std(unbiased=False)), 1e-300)
    rest = rest_mean + spread * z
    # Values outside the range are drawn again inside it (clipping would pile them up on the
    # bounds, and a tensor whose bounds are not its own would then show them on every draw).
    outside = (rest <= lo) | (rest >= hi)
    count = int(outside.sum())
    if count:
        rest[outside] = lo + (hi - lo) * torch.rand(count, generator=generator, dtype=torch.float64).clamp(
            1e-9, 1 - 1e-9
        )
    if not fixed:
        return rest
    return torch.cat([torch.tensor(fixed, dtype=torch.float64), rest])


@dataclass
class _Findings:
    """What checking a call's outputs found so far."""

    findings: list[tuple[str, str, float, str]] = field(default_factory=list)  # (status, kind, score, reason)
    checks: set[str] = field(default_factory=set)  # what could be tested
    metrics: dict[str, float] = field(default_factory=dict)


def _verdict(op: RecordedOp, judged: list[tuple[int, int, TensorSpec]], found: _Findings) -> OpVerdict:
    """The call's verdict: its worst error, else its worst warning, else a pass."""
    metrics = found.metrics
    dtype = judged[0][2].dtype
    deviations = [v for k, v in metrics.items() if k.endswith("_deviation")]
    if deviations:
        metrics["error_units"] = max(deviations)
    verdict = OpVerdict(
        op.op_id, "pass", "statistics", dtype=dtype, metrics=metrics, checks=",".join(sorted(found.checks))
    )
    for status in ("error", "warning"):
        chosen = [f for f in found.findings if f[0] == status]
        if chosen:
            _, kind, score, reason = max(chosen, key=lambda f: f[2])
            verdict.status, verdict.kind, verdict.score, verdict.reason = status, kind, score, reason
            break
    return verdict
