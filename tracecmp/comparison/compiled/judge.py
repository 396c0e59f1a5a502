"""Measuring a compiled unit's own rounding, so that :meth:`Unit.decide` can judge it.

A region's graph runs again from its recorded inputs in float64 (the reference) and in the
recorded dtypes with eager kernels (an honest implementation), as :mod:`tracecmp.numerics.replay`
does for single ops; a region that departs is narrowed to its FX node (:mod:`.narrow`). A
decomposition's rounding is what honest kernels make in its ops.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Callable, Mapping

from tracecmp.comparison.compiled.narrow import (
    PartReplay,
    as_tensor,
    is_view_op,
    narrow_by_statistics,
    narrow_region,
    recorded_by_node,
    run_part,
    shadow_faithful,
)
from tracecmp.comparison.compiled.pairing import Pairing
from tracecmp.comparison.compiled.units import CompiledUnits, Unit
from tracecmp.comparison.tolerances import Tolerances
from tracecmp.numerics.replay import Replayer
from tracecmp.numerics.replay.measure import Scale
from tracecmp.trace.compiled import GraphPart
from tracecmp.trace.reader import RankTrace


def judge_units(
    units: CompiledUnits,
    t_rank: RankTrace,
    b_rank: RankTrace,
    pairing: Pairing,
    measured: Mapping[int, Any],
    own_errors: Mapping[int, Any],
    tol: Tolerances,
) -> None:
    """Measure each unit's own rounding (the target holds tensors).

    A region's graph runs again from its recorded inputs: its own error against the float64
    replay, the error an eager replay in the recorded dtypes makes, and the first FX node where its
    values depart from the eager ones (:func:`narrow_region`). A decomposition's rounding is the sum of
    what honest kernels make in its ops (``own_errors``: :func:`tracecmp.numerics.replay.replay_rank`).
    """
    for unit in units.units:
        if unit.kind == "decomposition":
            honest = [own_errors[o].honest for o in unit.members if o in own_errors]
            if honest and len(honest) == len([o for o in unit.members if o in own_errors or o in unit.judged]):
                unit.rounding = sum(honest)
    regions = [u for u in units.units if u.kind == "region"]
    if not regions:
        return
    # Recorded values by tensor id, views rebuilt from their base, read as replay reads them.
    with Replayer(t_rank) as t_side, Replayer(b_rank) as b_side:
        if not t_side.has_data:
            return
        t_get = t_side.value
        b_get = b_side.value if b_side.has_data else None
        for unit in regions:
            index = pairing.index(unit.call)
            if index is not None and not shadow_faithful(unit.call, index, pairing, tol):
                # The compiled code computes otherwise than its graph (a precision a fused kernel
                # keeps): a replay of the graph says nothing of it. Judged by what it dispatched.
                unit.unfaithful = True
            else:
                try:
                    _judge_region(unit, t_get, b_get, pairing, measured, tol)
                except Exception as exc:  # noqa: BLE001 - a graph this torch cannot run again is not replayed
                    unit.own = None
                    units.warnings.append(
                        f"compiled region {unit.graph.id} at op {unit.judged[0]} not replayed ({type(exc).__name__}: {exc})"
                    )
            # What the recorded nodes show comes first: a replay runs the region from inputs that
            # already carry the departure of a node upstream, and may name a later one.
            narrowed = narrow_by_statistics(unit, pairing, measured, tol, shadows=False)
            if narrowed[0]:
                unit.narrowed, unit.narrowed_module = narrowed
                unit.departed = True


def narrow_units_by_statistics(
    units: CompiledUnits, pairing: Pairing, measured: Mapping[int, Any], tol: Tolerances
) -> int:
    """Where no replay can run (the target holds statistics only): each region's first FX node
    that departs from the bench by its recorded statistics (:func:`narrow_by_statistics`), which
    makes the region a root by its own evidence, named at that node's module. Returns how many
    computing nodes ran in fused code that no op records (what statistics cannot see into)."""
    unseen = 0
    for unit in units.units:
        if unit.kind == "region":
            unit.narrowed, unit.narrowed_module = narrow_by_statistics(unit, pairing, measured, tol)
            unit.departed = bool(unit.narrowed)
            part = unit.graph.parts.get(unit.call.part)
            nodes = part.nodes if part is not None else ()
            unseen += sum(
                n.op not in _NOT_COMPUTING
                and n.name not in unit.call.nodes
                and n.name not in unit.call.values
                and not is_view_op(n.op)
                for n in nodes
            )
    return unseen


# FX nodes that compute nothing of their own: what the region takes, returns and unpacks.
_NOT_COMPUTING = ("placeholder", "output", "getitem")


def _judge_region(
    unit: Unit,
    t_get: Callable[[int], Any],
    b_get: Callable[[int], Any] | None,
    pairing: Pairing,
    measured: Mapping[int, Any],
    tol: Tolerances,
) -> None:
    part = unit.graph.parts.get(unit.call.part)
    outside = _region_inputs(unit, part, t_get, pairing) if part is not None else None
    if part is None or outside is None:
        return
    recorded = recorded_by_node(unit.call, t_get, pairing)
    ref, honest = run_part(part, outside, recorded, golden=True), run_part(part, outside, recorded, golden=False)
    worst: tuple[float, float] | None = None
    for tensor, name in unit.outputs:
        recorded, r, h = t_get(tensor), as_tensor(ref.get(name)), as_tensor(honest.get(name))
        if recorded is None or r is None or h is None or r.shape != recorded.shape or not recorded.is_floating_point():
            continue
        scale = Scale.of(r)
        pair = (scale.error(recorded), scale.error(h))
        if worst is None or _excess(pair) > _excess(worst):
            worst = pair
    unit.own = worst
    if isinstance(outside, _BackwardInputs) and unit.forward_call is not None:
        # The values the forward saved depart first, if any node of the forward does.
        forward_unit = replace(unit, call=unit.forward_call, judged=(unit.forward_call.op_id,), outputs=())
        found, module = narrow_region(
            forward_unit,
            PartReplay(outside.forward_part, outside.forward(True), outside.forward(False)),
            t_get,
            b_get,
            pairing,
            measured,
            tol,
        )
        if found:
            unit.narrowed, unit.narrowed_module = f"what its forward saved departs first: {found}", module
            return
    unit.narrowed, unit.narrowed_module = narrow_region(
        unit, PartReplay(part, ref, honest), t_get, b_get, pairing, measured, tol
    )


def _region_inputs(
    unit: Unit, part: GraphPart, t_get: Callable[[int], Any], pairing: Pairing
) -> Callable[[str, bool], Any] | None:
    """The recorded value of each placeholder of a region's graph part (a backward part's saved
    values come from replaying its forward the same way), or None when the call's inputs do not
    line up with the graph's."""
    call = unit.call
    placeholders = [n.name for n in part.placeholders]
    if call.part != "backward":
        if len(placeholders) != len(call.inputs):
            return None
        inputs = dict(zip(placeholders, call.inputs))
        return lambda name, golden: t_get(inputs[name]) if name in inputs else None
    forward = unit.graph.parts.get("forward")
    if forward is None:
        return None
    fw_recorded = recorded_by_node(unit.forward_call, t_get, pairing) if unit.forward_call is not None else {}
    fw_names = [n.name for n in forward.placeholders]
    tangents = [n for n in placeholders if n.startswith("tangents")]
    grads = list(call.inputs[len(fw_names) :])
    if len(tangents) != len(grads) or len(call.inputs) < len(fw_names):
        return None
    fw_inputs = dict(zip(fw_names, call.inputs[: len(fw_names)]))
    return _BackwardInputs(forward, fw_inputs, dict(zip(tangents, grads)), fw_recorded, t_get)


class _BackwardInputs:
    """A backward part's placeholders: the gradients it received, and what its forward saved,
    computed by replaying the forward from its recorded inputs (in the same precision)."""

    def __init__(
        self,
        forward: GraphPart,
        fw_inputs: dict[str, int],
        tangents: dict[str, int],
        fw_recorded: Mapping[str, Any],
        t_get: Callable[[int], Any],
    ) -> None:
        self.forward_part, self.fw_inputs, self.tangents = forward, fw_inputs, tangents
        self.fw_recorded, self.t_get = fw_recorded, t_get
        self._values: dict[bool, dict[str, Any]] = {}

    def forward(self, golden: bool) -> dict[str, Any]:
        if golden not in self._values:
            inputs, get = self.fw_inputs, self.t_get
            self._values[golden] = run_part(
                self.forward_part, lambda n, g: get(inputs[n]) if n in inputs else None, self.fw_recorded, golden=golden
            )
        return self._values[golden]

    def __call__(self, name: str, golden: bool) -> Any:
        if name in self.tangents:
            return self.t_get(self.tangents[name])
        return self.forward(golden).get(name)


def _excess(pair: tuple[float, float]) -> float:
    own, honest = pair
    return own / honest if honest > 0 else (math.inf if own > 0 else 0.0)
