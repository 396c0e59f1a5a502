"""Measuring a recorded output against its float64 reference: normwise and element errors,
in pieces for large outputs, and the bound on what float32 accumulation of products can add.

>>> errors_against(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0], dtype=torch.float64))
(0.0, 0.0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterator, Sequence

import torch

from tracecmp.aten.opclass import base_name
from tracecmp.aten.rounding import FP32_UNIT
from tracecmp.aten.schema import resolve
from tracecmp.numerics.replay.calls import invoke, last_error, returned_tensors
from tracecmp.numerics.replay.records import OwnError
from tracecmp.numerics.units import TINY
from tracecmp.trace.args import memory_order


class Detail:
    """Accumulates the element-level measurements of one call's outputs (``OwnError`` detail fields).

    Written for memory: beyond the reference, one float64 copy of the output and the spacing are
    alive at a time (in-place arithmetic, no masked copies); a large output is added piece by
    piece (:class:`Gauge`), so that these copies are a piece's, not the output's.
    """

    def __init__(self) -> None:
        self.nonfinite = self.honest_nonfinite = self.elements = self.integer_mismatch = 0
        self.max_ulps = self.honest_max_ulps = 0.0
        self.beyond = self.honest_beyond = 0  # counts

    def add(
        self, recorded: torch.Tensor, honest: torch.Tensor, ref: torch.Tensor, finite: torch.Tensor, bound: float
    ) -> None:
        """Count in the elements of ``recorded`` and ``honest`` (or of one piece of them) against
        ``ref``, the float64 reference of the same elements (``finite``: where it is finite)."""
        spacing = _ulp(ref, recorded.dtype)
        for name, value in (("", recorded), ("honest_", honest)):
            out = value.detach().to(torch.float64, copy=True)
            bad = torch.isfinite(out).logical_and_(finite).logical_not_()
            if bool(bad.any()):
                same = (out == ref).logical_or_(torch.isnan(out).logical_and_(torch.isnan(ref)))
                mismatch = int(bad.logical_and(same.logical_not_()).sum())
            else:
                mismatch = 0
            ulps = out.sub_(ref).abs_().div_(spacing).masked_fill_(bad, 0.0)
            top = float(ulps.max()) if ulps.numel() else 0.0
            over = int((ulps > bound).sum())
            del out, ulps, bad
            setattr(self, name + "nonfinite", getattr(self, name + "nonfinite") + mismatch)
            setattr(self, name + "max_ulps", max(getattr(self, name + "max_ulps"), top))
            setattr(self, name + "beyond", getattr(self, name + "beyond") + over)
        self.elements += recorded.numel()

    def fields(self) -> dict[str, Any]:
        total = max(self.elements, 1)
        return {
            "nonfinite": self.nonfinite,
            "honest_nonfinite": self.honest_nonfinite,
            "max_ulps": self.max_ulps,
            "honest_max_ulps": self.honest_max_ulps,
            "beyond": self.beyond / total,
            "honest_beyond": self.honest_beyond / total,
            "elements": self.elements,
            "integer_mismatch": self.integer_mismatch,
        }


def _ulp(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at each element's magnitude (its subnormal spacing near zero)."""
    finfo = torch.finfo(dtype) if dtype.is_floating_point else torch.finfo(torch.float64)
    magnitude = ref.abs().nan_to_num_(nan=finfo.tiny, posinf=finfo.tiny).clamp_(min=finfo.tiny)
    _, exponent = torch.frexp(magnitude)
    return torch.ldexp(magnitude.fill_(finfo.eps), exponent.sub_(1))


def combine(op_id: int, parts: list[OwnError]) -> OwnError:
    """One op's own error from its calls' (the list elements of a ``_foreach_*`` op)."""
    if len(parts) == 1:
        return parts[0]
    worst = max(parts, key=lambda p: excess(p.error, p.honest))
    width = max(len(p.fits) for p in parts)
    fits = tuple(max((p.fits[m] for p in parts if m < len(p.fits)), default=0.0) for m in range(width))
    reach = max(len(p.bounds) for p in parts)
    bounds = tuple(max((p.bounds[m] for p in parts if m < len(p.bounds)), default=0.0) for m in range(reach))
    elements = sum(p.elements for p in parts)
    share = (lambda f: sum(getattr(p, f) * p.elements for p in parts) / elements) if elements else (lambda f: 0.0)
    return OwnError(
        op_id,
        worst.error,
        worst.honest,
        worst.dtype,
        misrounded=any(p.misrounded for p in parts),
        fits=fits,
        bounds=bounds,
        bitwise=all(p.bitwise for p in parts),
        informative=any(p.informative for p in parts),
        nonfinite=sum(p.nonfinite for p in parts),
        honest_nonfinite=sum(p.honest_nonfinite for p in parts),
        max_ulps=max(p.max_ulps for p in parts),
        honest_max_ulps=max(p.honest_max_ulps for p in parts),
        beyond=share("beyond"),
        honest_beyond=share("honest_beyond"),
        elements=elements,
        integer_mismatch=sum(p.integer_mismatch for p in parts),
    )


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaN where NaN is, same signed zeros).

    A NaN's payload and sign are no result: one kernel's vectorized and scalar loops make
    different NaN bits from the same NaN input (a bfloat16 division by 49 on CPU does), so only
    where NaN is counts.
    """
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return bool(torch.equal(a, b))
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}.get(a.element_size())
    if ints is None:
        return bool(torch.equal(a, b))
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return False
    if bool(nan_a.any()):
        a, b = a.masked_fill(nan_a, 0.0), b.masked_fill(nan_b, 0.0)
    return bool(torch.equal(a.contiguous().view(ints), b.contiguous().view(ints)))


# Ops whose every output element is a sum of products of one element of each operand (a bias
# added in): replayed on the operands' absolute values they give the sum of the terms' sizes,
# and on ones the number of terms.
_SUMS_OF_PRODUCTS = frozenset(
    {
        "mm",
        "bmm",
        "addmm",
        "addmm_",
        "baddbmm",
        "addbmm",
        "matmul",
        "linear",
        "mv",
        "addmv",
        "dot",
        "vdot",
        "outer",
        "ger",
        "einsum",
        "tensordot",
        "convolution",
        "_convolution",
        "convolution_backward",
        "conv1d",
        "conv2d",
        "conv3d",
        "conv_transpose1d",
        "conv_transpose2d",
        "conv_transpose3d",
    }
)


def bound_fits(
    name: str, args: dict[str, Any], sets: list[list[torch.Tensor]], recorded: list[tuple[int, torch.Tensor | None]]
) -> tuple[float, ...]:
    """Per input set (each rounding of the operands, then the operands as they are): the largest
    ratio, over the recorded outputs' elements, of the distance from a float64 replay on that set
    to :func:`_accumulation_bound`. () where the op is not a sum of products or a replay fails.
    The ratios are taken piece by piece (``_PIECE_ELEMENTS``): a piece's temporaries, not an output's."""
    if base_name(name) not in _SUMS_OF_PRODUCTS or any(r is None for _, r in recorded):
        return ()
    ones = invoke(name, args, [torch.ones_like(x) if x.is_floating_point() else x for x in sets[-1]], golden=True)
    if ones is None:
        return ()
    counts = returned_tensors(name, *ones)
    fits = []
    for inputs in sets:
        exact = invoke(name, args, inputs, golden=True)
        sizes = invoke(name, args, [x.abs() if x.is_floating_point() else x for x in inputs], golden=True)
        if exact is None or sizes is None:
            return ()
        exact_out, size_out = returned_tensors(name, *exact), returned_tensors(name, *sizes)
        worst = 0.0
        for position, value in recorded:
            if max(position, 0) >= min(len(exact_out), len(size_out), len(counts)):
                return ()
            center = exact_out[position]
            if (
                value.shape != center.shape
                or counts[position].shape != center.shape
                or size_out[position].shape != center.shape
            ):
                return ()
            flat = [t.reshape(-1) for t in (counts[position], size_out[position], center, value)]
            for start in range(0, center.numel(), _PIECE_ELEMENTS):
                count, size, middle, got = (t[start : start + _PIECE_ELEMENTS] for t in flat)
                if bool((~torch.isfinite(got) & torch.isfinite(middle)).any()):
                    return tuple([math.inf] * len(sets))
                bound = _accumulation_bound(count, size, middle)
                gap = (got.to(torch.float64) - middle).abs()
                finite = torch.isfinite(middle) & torch.isfinite(gap)
                if bool(finite.any()):
                    ratio = gap[finite] / bound[finite].clamp_min(TINY)
                    worst = max(worst, float(ratio.max()))
            del flat
        del exact, sizes, exact_out, size_out  # before the next set's replays
        fits.append(worst)
    return tuple(fits)


def _accumulation_bound(count: torch.Tensor, size: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """How far a float32 result may lie from the exact sum of ``count`` products whose sizes add up
    to ``size``, whatever order and blocking a device sums them in: gamma(n) * size with gamma(n)
    = n * 2u / (1 - n * 2u), u float32's unit (2u: rounding toward zero, as some accumulators do,
    errs up to a whole unit), plus rounding the result itself. (The products of TF32- or
    bf16-rounded operands are exact in float32: 11 + 11 and 8 + 8 significant bits.)"""
    n = count.to(torch.float64).abs()
    unit = 2.0 * FP32_UNIT
    gamma = (n * unit) / (1.0 - (n * unit).clamp_max(0.5))
    return gamma * size.abs() + FP32_UNIT * exact.abs()


@dataclass(frozen=True, slots=True)
class Scale:
    """A reference output in float64 and the magnitudes its errors are measured on (finite positions)."""

    ref: torch.Tensor
    finite: torch.Tensor
    all_finite: bool
    amax: float
    norm: float

    @classmethod
    def of(cls, reference: torch.Tensor) -> Scale:
        ref = reference.detach().to(torch.float64)
        finite = torch.isfinite(ref)
        all_finite = bool(finite.all())
        amax, norm = _Size().add(ref, finite, all_finite).total()
        return cls(ref, finite, all_finite, amax, norm)

    def error(self, value: Any, center: torch.Tensor | None = None) -> float:
        """Relative error of ``value`` against the reference, or its distance from ``center`` on
        the reference's scale; inf for a non-tensor or a shape that differs."""
        if not isinstance(value, torch.Tensor) or value.shape != self.ref.shape:
            return math.inf
        if center is None:
            return _relative(value.detach(), self.ref, self.finite, self.amax, self.norm, self.all_finite)
        middle = center.detach().to(torch.float64)
        finite = torch.isfinite(middle)
        return _relative(value.detach(), middle, finite, self.amax, self.norm, bool(finite.all()))


# A pointwise call over more elements than this gets its float64 reference in pieces of this many
# elements, and any output larger than this is measured in such pieces: the float64 copies and
# the measurement's temporaries are then a piece's, not the output's. A multiple of every
# vector width, so that a piece's elements take the path they take in a whole call.
_PIECE_ELEMENTS = 1 << 21


# Elementwise ops that torch does not tag pointwise.
_ELEMENTWISE = frozenset({"aten._to_copy.default", "aten.copy.default", "aten.copy_.default"})


@lru_cache(maxsize=None)
def _pointwise(name: str) -> bool:
    """Whether each output element of ``name`` depends only on the input elements at its own
    position (torch's ``pointwise`` tag; a ``_foreach_`` op's list elements, where the op it
    applies to each is pointwise)."""
    if name in _ELEMENTWISE:
        return True
    func = resolve(name)
    if func is None:
        return False
    if torch.Tag.pointwise in getattr(func, "tags", ()):
        return True
    namespace, _, rest = name.partition(".")
    packet = rest.rpartition(".")[0]
    if namespace != "aten" or not packet.startswith("_foreach_"):
        return False
    single = getattr(torch.ops.aten, packet.removeprefix("_foreach_"), None)
    overloads = single.overloads() if single is not None else []
    return any(torch.Tag.pointwise in getattr(getattr(single, o), "tags", ()) for o in overloads)


def piece_spans(
    name: str, inputs: Sequence[torch.Tensor], shapes: Sequence[Sequence[int] | None]
) -> list[tuple[int, int]] | None:
    """The flat ranges to make a call's float64 reference in, one at a time (see
    ``_PIECE_ELEMENTS``), or None to make it whole: a pointwise op whose outputs all have one
    shape and more elements than a piece, and whose inputs have that shape, dense in one memory
    order (contiguous, or all transposed alike: see :func:`shared_order`), or are scalars (no
    broadcasting, so that a piece of every input makes that piece of the output)."""
    if not shapes or any(shape is None for shape in shapes):
        return None
    shape = tuple(shapes[0])  # type: ignore[arg-type]
    count = math.prod(shape)
    if count <= _PIECE_ELEMENTS or any(tuple(other) != shape for other in shapes):  # type: ignore[arg-type]
        return None
    if not inputs or not _pointwise(name):
        return None
    if any(x.dim() and tuple(x.shape) != shape for x in inputs):
        return None
    order = shared_order(inputs)
    if any(x.dim() and not _in_order(x, order).is_contiguous() for x in inputs):
        return None
    return [(start, min(start + _PIECE_ELEMENTS, count)) for start in range(0, count, _PIECE_ELEMENTS)]


def shared_order(inputs: Sequence[torch.Tensor]) -> list[int] | None:
    """The memory order of a call's first non-scalar input (None: logical order). Pieces run over
    memory in that order, where every input is laid out alike (a channels-last activation and its
    gradient), so that each piece is a view and its elements take the kernel path they take whole."""
    return next((memory_order(x) for x in inputs if x.dim()), None)


def _in_order(x: torch.Tensor, order: list[int] | None) -> torch.Tensor:
    return x.permute(order) if order is not None else x


def _flat(x: torch.Tensor, order: list[int] | None) -> torch.Tensor:
    """``x``'s elements in ``order`` (a view where ``x`` is laid out so, else a copy)."""
    return _in_order(x, order).reshape(-1)


def pieces_of(
    inputs: Sequence[torch.Tensor], span: tuple[int, int], order: list[int] | None = None
) -> list[torch.Tensor]:
    """The elements ``span`` of each input, flattened in ``order`` (scalars whole)."""
    start, stop = span
    return [_flat(x, order)[start:stop] if x.dim() else x for x in inputs]


def run_outputs(
    name: str, args: dict[str, Any], inputs: list[torch.Tensor], *, golden: bool
) -> list[torch.Tensor] | None:
    """A call's outputs in capture's order (see :func:`invoke`), or None when it cannot run. The
    arguments it was called with go: a float64 replay's copies of inputs it does not return with them."""
    found = invoke(name, args, inputs, golden=golden)
    return None if found is None else returned_tensors(name, *found)


class Reference:
    """One output's float64 reference: whole, or made piece by piece over flat spans of a
    pointwise call (``call``: its name, arguments, recorded inputs, spans, and which output;
    ``value`` is then the first piece), its elements in memory ``order`` (None: logical)."""

    def __init__(
        self,
        value: torch.Tensor,
        call: tuple[str, dict[str, Any], list[torch.Tensor], list[tuple[int, int]], int] | None = None,
        order: list[int] | None = None,
    ) -> None:
        self.value = value
        self.call = call
        self.order = order
        self.spans: list[tuple[int, int]] | None = call[3] if call is not None else None

    def split(self, tensors: Sequence[Any]) -> None:
        """Measure a whole reference in pieces where it and ``tensors`` are large and contiguous."""
        count = self.value.numel()
        if (
            self.call is None
            and count > _PIECE_ELEMENTS
            and all(isinstance(t, torch.Tensor) and t.is_contiguous() for t in (self.value, *tensors))
        ):
            self.spans = [(start, min(start + _PIECE_ELEMENTS, count)) for start in range(0, count, _PIECE_ELEMENTS)]

    def piece(self, index: int) -> torch.Tensor | None:
        """Piece ``index`` (the whole reference when there are no spans), None when it cannot be made."""
        if self.spans is None:
            return self.value
        if self.call is None:
            start, stop = self.spans[index]
            return self.value.view(-1)[start:stop]
        if index == 0:
            return self.value
        name, args, inputs, spans, position = self.call
        made = run_outputs(name, args, pieces_of(inputs, spans[index], self.order), golden=True)
        if made is None or position >= len(made) or made[position].shape != (spans[index][1] - spans[index][0],):
            return None
        return made[position]


class Gauge:
    """One recorded output measured against its float64 reference, piece by piece: the relative
    errors of the recorded output, of each replay (the honest one first) and of float32's
    accumulation, how far the recorded output lies from each replay, and the element detail.
    On a reference in one piece this is what ``Scale.error`` and ``Detail.add`` give."""

    def __init__(self, recorded: torch.Tensor, replays: list[Any], accumulated: Any, reference: Reference) -> None:
        self.recorded, self.replays, self.accumulated, self.reference = recorded, replays, accumulated, reference
        self.size = _Size()
        self.own = _Distance()
        self.from_reference = [_Distance() for _ in replays]  # each replay's error
        self.from_replays = [_Distance() for _ in replays] if accumulated is not None else []  # recorded from each
        self.unit = _Distance()
        # Replays of another kind or shape than the recorded output are infinitely far.
        usable = [isinstance(r, torch.Tensor) and r.shape == recorded.shape for r in replays]
        for distance, ok in zip(self.from_reference, usable):
            distance.infinite = not ok
        for distance, ok in zip(self.from_replays, usable):
            distance.infinite = not ok
        self.unit.infinite = accumulated is not None and not (
            isinstance(accumulated, torch.Tensor) and accumulated.shape == recorded.shape
        )
        reference.split(
            [
                recorded,
                *(r for r, ok in zip(replays, usable) if ok),
                *([accumulated] if accumulated is not None and not self.unit.infinite else []),
            ]
        )
        self.flat: dict[int, torch.Tensor] = {}  # flattened tensors (views where contiguous), for pieces

    def _piece(self, value: Any, span: tuple[int, int] | None) -> Any:
        if span is None or not isinstance(value, torch.Tensor):
            return value
        flat = self.flat.get(id(value))
        if flat is None:
            flat = self.flat[id(value)] = _flat(value, self.reference.order)
        return flat[span[0] : span[1]]

    def _pieces(self) -> Iterator[tuple[tuple[int, int] | None, torch.Tensor | None]]:
        spans = self.reference.spans
        for index, span in enumerate(spans if spans is not None else [None]):
            ref = self.reference.piece(index)
            yield span, None if ref is None else ref.detach().to(torch.float64)

    def run(self, detail: Detail | None, bound: float) -> str:
        """Measure every piece; a reason when a piece of the reference could not be made, else ""."""
        for span, ref in self._pieces():
            if ref is None:
                return "its float64 replay failed on part of its elements" + last_error()
            finite = torch.isfinite(ref)
            all_finite = bool(finite.all())
            self.size.add(ref, finite, all_finite)
            recorded = self._piece(self.recorded, span).detach()
            self.own.add(recorded, ref, finite, all_finite)
            for distance, replay in zip(self.from_reference, self.replays):
                if not distance.infinite:
                    distance.add(self._piece(replay, span).detach(), ref, finite, all_finite)
            if self.accumulated is not None and not self.unit.infinite:
                self.unit.add(self._piece(self.accumulated, span).detach(), ref, finite, all_finite)
            for distance, replay in zip(self.from_replays, self.replays):
                if not distance.infinite:
                    middle = self._piece(replay, span).detach().to(torch.float64)
                    middle_finite = torch.isfinite(middle)
                    distance.add(recorded, middle, middle_finite, bool(middle_finite.all()))
            if detail is not None:
                detail.add(recorded, self._piece(self.replays[0], span), ref, finite, bound)
        return ""

    def errors(self) -> tuple[float, float]:
        """(the recorded output's relative error, the honest replay's)."""
        amax, norm = self.size.total()
        error, honest = self.own.relative(amax, norm), self.from_reference[0].relative(amax, norm)
        if (
            error > 0
            and honest == 0
            and self.recorded.is_floating_point()
            and all(
                ref is not None and _only_flushed(self._piece(self.recorded, span), ref) for span, ref in self._pieces()
            )
        ):
            error = 0.0
        return error, honest

    def other_errors(self) -> list[float]:
        """The relative errors of the replays after the honest one (the other roundings)."""
        amax, norm = self.size.total()
        return [d.relative(amax, norm) for d in self.from_reference[1:]]

    def accumulated_error(self) -> float:
        """The relative error of the plain float32 replay (its accumulation error)."""
        return self.unit.relative(*self.size.total())

    def fits(self) -> list[float]:
        """How far the recorded output lies from each replay, on the reference's scale."""
        amax, norm = self.size.total()
        return [d.relative(amax, norm) for d in self.from_replays]


def excess(error: float, honest: float) -> float:
    return error / honest if honest > 0 else (math.inf if error > 0 else 0.0)


def is_float(dtype: str) -> bool:
    return dtype in ("float32", "float64", "float16", "bfloat16")


def errors_against(recorded: torch.Tensor, honest: Any, reference: Any) -> tuple[float, float] | None:
    """(relative error of ``recorded``, relative error of ``honest``), both against ``reference``."""
    if not comparable(recorded, honest, reference):
        return None
    return errors_on(recorded, honest, Scale.of(reference))


def comparable(recorded: torch.Tensor, honest: Any, reference: Any, piece: int | None = None) -> bool:
    """Whether the replay gave tensors of the recorded output's shape (and not complex ones);
    ``piece``: the reference is the first piece, of that many elements, of a flattened one."""
    if not (isinstance(reference, torch.Tensor) and isinstance(honest, torch.Tensor) and not reference.is_complex()):
        return False
    if piece is not None:
        return recorded.shape == honest.shape and reference.shape == (piece,)
    return recorded.shape == reference.shape == honest.shape


def errors_on(recorded: torch.Tensor, honest: torch.Tensor, scale: Scale) -> tuple[float, float]:
    error, honest_error = scale.error(recorded), scale.error(honest)
    if error > 0 and honest_error == 0 and recorded.is_floating_point() and _only_flushed(recorded, scale.ref):
        error = 0.0
    return error, honest_error


def _only_flushed(recorded: torch.Tensor, ref: torch.Tensor) -> bool:
    """Whether ``recorded`` differs from ``ref`` only where it holds zero for a denormal. Where an
    op is exact (a max, a copy, a sum that needs no rounding) any difference is the op's doing,
    unless it is only denormals flushed to zero, as many accelerators do."""
    out = recorded.to(torch.float64)
    differs = out != ref
    return bool(((out[differs] == 0) & (ref[differs].abs() < torch.finfo(recorded.dtype).tiny)).all())


def _relative(
    value: torch.Tensor,
    ref: torch.Tensor,
    finite: torch.Tensor,
    scale: float,
    norm: float,
    all_finite: bool | None = None,
) -> float:
    """``max(max|v - ref| / max|ref|, ||v - ref|| / ||ref||)`` over the reference's finite
    positions; inf when NaN/Inf sit where the reference has none (or differ from its own).
    One float64 copy of ``value`` is made and worked on in place."""
    return _Distance().add(value, ref, finite, all_finite).relative(scale, norm)


def _total_norm(norms: list[float]) -> float:
    """The norm of a vector from the norms of its pieces (one piece: its own, unchanged)."""
    if not norms:
        return 0.0
    return norms[0] if len(norms) == 1 else math.hypot(*norms)


class _Size:
    """The largest magnitude and the norm of a reference's finite elements, added piece by piece."""

    __slots__ = ("amax", "norms")

    def __init__(self) -> None:
        self.amax = 0.0
        self.norms: list[float] = []

    def add(self, ref: torch.Tensor, finite: torch.Tensor, all_finite: bool) -> _Size:
        masked = ref if all_finite else torch.where(finite, ref, 0.0)
        amax = float(torch.linalg.vector_norm(masked, ord=math.inf)) if masked.numel() else 0.0
        if amax > 0:
            self.norms.append(float(torch.linalg.vector_norm(masked)))
        self.amax = max(self.amax, amax)
        return self

    def total(self) -> tuple[float, float]:
        """(largest magnitude, norm)."""
        return self.amax, _total_norm(self.norms) if self.amax > 0 else 0.0


class _Distance:
    """How far a value lies from a center (the float64 reference, or a replay), added piece by
    piece over the center's finite positions: the largest difference and the norm of the
    differences, or infinite where NaN/Inf sit where the center has none (or other ones)."""

    __slots__ = ("worst", "norms", "infinite")

    def __init__(self) -> None:
        self.worst = 0.0
        self.norms: list[float] = []
        self.infinite = False

    def add(
        self, value: torch.Tensor, center: torch.Tensor, finite: torch.Tensor, all_finite: bool | None = None
    ) -> _Distance:
        if self.infinite:
            return self
        out = value.to(torch.float64, copy=True)
        if all_finite is None:
            all_finite = bool(finite.all())
        if not all_finite:
            special = ~finite
            got, want = out[special], center[special]
            if not bool(((got == want) | (torch.isnan(got) & torch.isnan(want))).all()):
                self.infinite = True
                return self
            out = torch.where(finite, out, 0.0)  # equal there: no difference
            center = torch.where(finite, center, 0.0)
        if not bool(torch.isfinite(out).all()):
            self.infinite = True
            return self
        diff = out.sub_(center).abs_()
        worst = float(diff.max()) if diff.numel() else 0.0
        if worst > 0.0:
            self.norms.append(float(torch.linalg.vector_norm(diff)))
        self.worst = max(self.worst, worst)
        return self

    def relative(self, scale: float, norm: float) -> float:
        """The distance relative to a reference of largest magnitude ``scale`` and norm ``norm``."""
        if self.infinite:
            return math.inf
        if self.worst == 0.0:
            return 0.0
        if scale == 0.0:
            return math.inf
        return max(self.worst / scale, _total_norm(self.norms) / max(norm, TINY))
