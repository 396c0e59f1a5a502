"""Narrowing a compiled region that is a root to the first FX node that departs.

The replay's value of every FX node is compared with the bench's value of the eager op that
node stands for (a graph that computes something else than the eager program: a custom op, a
pass that changed a node), and with what the compiled code dispatched for that node (a wrong
kernel: an extern kernel that misbehaves). The first node that departs is named, with its module
and source line. In graph mode every node is an op of the trace and localize names it directly.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from tracecmp.aten.args import decode_call
from tracecmp.aten.opclass import base_name, draws_random
from tracecmp.aten.schema import VIEW, op_info, resolve
from tracecmp.comparison.compiled.pairing import Pairing
from tracecmp.comparison.compiled.units import PROPAGATION, PartIndex, Unit, same_values
from tracecmp.comparison.tolerances import Tolerances
from tracecmp.numerics.replay.measure import Scale
from tracecmp.numerics.units import EPS, FP32_EPS, canonical_dtype, eps_of, is_float_dtype
from tracecmp.trace.compiled import GraphNode, GraphPart, RegionCall

_MISSING = object()


def run_part(
    part: GraphPart, outside: Callable[[str, bool], Any], recorded: Mapping[str, Any], *, golden: bool
) -> dict[str, Any]:
    """Every node of ``part`` run again: in float64 (``golden``), or in the recorded dtypes with
    eager kernels. Placeholders take ``outside(name, golden)``. A node that cannot run here (a
    custom op whose library is not loaded, a random op) takes what the compiled code recorded for
    it, when it recorded something; else it, and everything after it that needs it, is missing."""
    import torch

    env: dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in env:
            value = outside(name, golden)
            if isinstance(value, torch.Tensor):
                env[name] = value.to(torch.float64) if golden and value.is_floating_point() else value.clone()
            elif isinstance(value, (int, float)):  # a size the forward saved for a backward of dynamic shape
                env[name] = value
            else:
                env[name] = _MISSING
        return env[name]

    for n in part.nodes:
        if n.op in ("placeholder", "output"):
            continue
        inputs = [get(i) for i in n.inputs]
        if any(v is _MISSING for v in inputs):
            env[n.name] = _MISSING
            continue
        if n.op == "getitem":
            index = json.loads(n.args).get("index", 0)
            source = inputs[0] if inputs else _MISSING
            env[n.name] = source[index] if isinstance(source, (list, tuple)) and index < len(source) else _MISSING
            continue
        func = resolve(n.op)
        call = None
        if func is not None and hasattr(func, "_schema"):
            arguments = _with_sizes(json.loads(n.args), get)
            info = op_info(func)
            # A random op draws other numbers here, unless all it could draw is a dropout of 0
            # (attention kernels: random by schema, deterministic at dropout_p=0).
            if arguments is not None and (
                not info.random or (info.dropout and all(not arguments.get(name, 0.0) for (_, name), _ in info.dropout))
            ):
                call = decode_call(func, arguments, inputs, golden=golden)
        result = _MISSING
        if call is not None:
            try:
                with torch.no_grad():
                    result = func(*call[0], **call[1])
            except Exception:  # noqa: BLE001 - a node that will not run here is not replayed
                result = _MISSING
        if result is _MISSING and isinstance(recorded.get(n.name), torch.Tensor):
            value = recorded[n.name]
            result = value.to(torch.float64) if golden and value.is_floating_point() else value.clone()
        env[n.name] = result
    return env


def _with_sizes(value: Any, size_of: Callable[[str], Any]) -> Any:
    """Recorded arguments with the symbolic sizes capture named (``"<node sym_size_int>"``) set to
    the values those nodes (or the placeholders a backward reads them from) took in this replay,
    as ``size_of(name)`` gives them; None when one is unknown."""
    if isinstance(value, str) and value.startswith("<node ") and value.endswith(">"):
        size = size_of(value[6:-1])
        return size if isinstance(size, (int, float)) and not isinstance(size, bool) else None
    if isinstance(value, list):
        items = [_with_sizes(v, size_of) for v in value]
        return None if any(i is None and v is not None for i, v in zip(items, value)) else items
    if isinstance(value, dict):
        if "tensor" in value or "complex" in value:
            return value
        items = {k: _with_sizes(v, size_of) for k, v in value.items()}
        return None if any(items[k] is None and value[k] is not None for k in value) else items
    return value


def as_tensor(value: Any) -> Any:
    import torch

    return value if isinstance(value, torch.Tensor) else None


@dataclass(frozen=True)
class PartReplay:
    """A region's graph part and its values run again from its recorded inputs: in float64
    (``ref``) and in the recorded dtypes with eager kernels (``honest``), by node name."""

    part: GraphPart
    ref: Mapping[str, Any]
    honest: Mapping[str, Any]


def narrow_region(
    unit: Unit,
    replay: PartReplay,
    t_get: Callable[[int], Any],
    b_get: Callable[[int], Any] | None,
    pairing: Pairing,
    measured: Mapping[int, Any],
    tol: Tolerances,
) -> tuple[str, str]:
    """The first FX node (graph order) where the region departs from what it should compute: why,
    and the node's module (its innermost ``nn_module_stack`` entry); ("", "") where none does.

    Two ways to depart: the graph's own float64 value of the node differs from the bench's value
    of the eager op it stands for (the graph computes something else: a custom op, a pass that
    changed a node), or what the compiled code dispatched for the node (an extern kernel) differs
    from that float64 value by more than eager kernels do (a wrong kernel).
    """
    part, ref, honest = replay.part, replay.ref, replay.honest
    carried = max((measured[t].level for t in unit.inputs if t in measured and measured[t].is_float), default=0.0)
    index = pairing.index(unit.call)
    if index is None:
        return "", ""
    computing = [n for n in part.nodes if n.op not in ("placeholder", "output", "getitem") and index.leaves_group(n)]
    peers = [
        (n.name, tuple(as_tensor(ref.get(n.name)).shape), None)
        for n in computing
        if as_tensor(ref.get(n.name)) is not None
    ]
    wrong = _wrong_kernels(part, ref, honest, recorded_by_node(unit.call, t_get, pairing), tol)
    by_name = index.by_name
    agreeing: set[str] = set()  # nodes whose value matched the bench's
    unmatched: set[str] = set()  # computing nodes with no eager counterpart (a custom op, a fused pattern)
    for n in computing:
        r, h = as_tensor(ref.get(n.name)), as_tensor(honest.get(n.name))
        if r is None or h is None or not r.is_floating_point() or is_view_op(n.op):
            continue
        scale = Scale.of(r)
        honest_error = scale.error(h)
        unit_eps = EPS.get(canonical_dtype(str(h.dtype).removeprefix("torch.")), FP32_EPS)
        if n.name in wrong:
            return (
                f"narrowed to {_where(n)}: what the compiled code computed for it is off by {wrong[n.name]:.1e} "
                f"from a float64 replay of the region's inputs ({honest_error:.1e} for eager kernels)",
                n.module,
            )
        bench = pairing.bench_tensor(unit, n.name, tuple(r.shape), peers)
        if bench is None:
            unmatched.add(n.name)
            continue
        departure = _departure(r, bench, b_get, pairing)
        if departure is None:
            continue
        bound = tol.margin * (carried * PROPAGATION + honest_error) + tol.local * unit_eps
        if departure <= bound:
            agreeing.add(n.name)
            continue
        cause = _unmatched_cause(n, by_name, unmatched, agreeing)
        eager = n.original or n.op
        if cause is not None:
            return (
                f"narrowed to {_where(cause)}, which has no eager counterpart: the values it feeds ({n.name}) "
                f"differ from the bench's {eager} by {departure:.1e} (eager rounding {honest_error:.1e})",
                cause.module,
            )
        return (
            f"narrowed to {_where(n)}: the graph's own value there differs from the bench's {eager} by "
            f"{departure:.1e} (eager rounding {honest_error:.1e}): the graph computes something else from here",
            n.module,
        )
    return "", ""


def narrow_by_statistics(
    unit: Unit, pairing: Pairing, measured: Mapping[int, Any], tol: Tolerances, *, shadows: bool = True
) -> tuple[str, str]:
    """Without tensors: the first FX node (graph order) that departs from what the bench computes;
    why, and its module. ("", "") where none does, as far as statistics and the graph tell.

    Capture records what the compiled code dispatched for a node: every node under aot_eager, the
    extern kernels (matmuls, convolutions) under inductor, whose fused kernels dispatch nothing;
    for those, the statistics of the forward graph run again eagerly at capture (``values``),
    unless ``shadows`` is False (a replay of the region measures them better).
    A node departs when its recorded value differs from the bench's value of the eager op it
    stands for by more than its inputs carried in; one that reads values the bench cannot vouch
    for (no op recorded them: fused code; or the bench never ran their op: code the target added)
    names the earliest of them after the last agreeing values. A forward node
    the graph rounds to a lower precision and back, where the bench has no such casts, departs by
    structure (:func:`_round_trip`), recorded or not. What no op recorded may carry what the region
    is allowed as a whole (``region_units``); a recorded node with no eager counterpart, its own
    rounding.
    """
    part, index = unit.graph.parts.get(unit.call.part), pairing.index(unit.call)
    if part is None or index is None or unit.call.part != "forward":
        # A backward part's matmuls have twins of one shape that its compiled code runs in any
        # order: which recorded value is whose, statistics cannot tell (a replay can).
        return "", ""
    carried_in = max((measured[t].level for t in unit.inputs if t in measured and measured[t].is_float), default=0.0)
    computing = [n for n in part.nodes if n.op not in ("placeholder", "output", "getitem") and index.leaves_group(n)]
    judged = {n.name for n in computing}
    # A shadow run that computes otherwise than the compiled code (inductor keeps a bf16 round trip
    # inside a fused kernel in float32) says nothing of the code that ran, nor does the graph's structure.
    faithful = shadow_faithful(unit.call, index, pairing, tol)
    unit.unfaithful = unit.unfaithful or not faithful
    recorded = _node_values(unit.call, index, pairing, shadows and faithful)
    peers = [(n.name, pairing.t_shape[recorded[n.name]], recorded[n.name]) for n in computing if n.name in recorded]
    level: dict[str, float] = {}  # how far each node's value may lie from the bench's, as known so far
    agreeing: set[str] = set()
    unrecorded: set[str] = set()  # nodes the bench cannot vouch for: fused code, ops it never ran
    for n in part.nodes:
        incoming = max((level.get(i, carried_in) for i in n.inputs), default=carried_in)
        level[n.name] = incoming
        if n.name not in judged or is_view_op(n.op):
            continue
        low = _round_trip(n, unit, index, pairing) if faithful else None
        if low is not None:
            return f"narrowed to {_where(low)}: {_ROUND_TRIP.format(low.dtypes[0])}", low.module
        unit_eps = EPS.get(canonical_dtype(n.dtypes[0]) if n.dtypes else "float32", FP32_EPS)
        tensor = recorded.get(n.name)
        if tensor is None:  # fused code: what it computed is nowhere in the trace
            unrecorded.add(n.name)
            level[n.name] = incoming * PROPAGATION + tol.region_units * unit_eps
            continue
        bench = pairing.bench_tensor(unit, n.name, pairing.t_shape.get(tensor, ()), peers, tensor)
        theirs = pairing.b_stats.get(pairing.measured_as(bench)) if bench is not None else None
        mine = pairing.t_stats.get(tensor)
        if mine is None or theirs is None:  # no bench value: its own rounding on what came in
            if _added(n, unit.call, pairing):
                unrecorded.add(n.name)
            level[n.name] = incoming * PROPAGATION + tol.local * unit_eps
            continue
        departure = level[n.name] = _stats_departure(mine, theirs)
        bound = tol.margin * (incoming * PROPAGATION + tol.local * unit_eps)
        if departure <= bound:
            agreeing.add(n.name)
            continue
        if _misfiled(n, mine, unit, pairing, peers, max(bound, departure / 10)):
            # Extern kernels run out of graph order (an attention's backward matmuls): the value
            # capture filed under this node is another node's. Unknown, not wrong.
            level[n.name] = incoming * PROPAGATION + tol.region_units * unit_eps
            continue
        cause = _unmatched_cause(n, index.by_name, unrecorded, agreeing)
        where, what = (cause, "which the bench cannot vouch for: the values it feeds") if cause else (n, "its value")
        return (
            f"narrowed by statistics to {_where(where)}, {what} ({n.name}) differ from the bench's "
            f"{n.original or n.op} by {departure:.1e}, more than came in ({incoming:.1e})",
            where.module,
        )
    return "", ""


_ROUND_TRIP = "the graph rounds its value to {} and back, a round trip the bench does not make"


def _added(n: GraphNode, call: RegionCall, pairing: Pairing) -> bool:
    """Whether ``n`` is an op the bench never ran, a suspect for what departs after it. A random
    one is the same draw made otherwise (native_dropout against eager's bernoulli_); a copy changes
    nothing (dropout at p=0 is a clone in a graph, nothing in eager)."""
    return not pairing.has_counterpart(call, n) and not _draws(n) and not same_values(n)


def shadow_faithful(call: RegionCall, index: PartIndex, pairing: Pairing, tol: Tolerances) -> bool:
    """Whether capture's shadow run computed what the compiled code did, where both hold a value
    (the extern kernels): each dispatched value lies within the rounding a whole region is allowed
    (``region_units``) of the shadow's value of a node of its op and shape (capture may have filed
    it under a twin of its node: inductor runs extern kernels out of graph order)."""
    for name, ops in call.nodes.items():
        node = index.by_name.get(name)
        outputs = pairing.t_outputs.get(ops[-1]) if ops else None
        mine = pairing.t_stats.get(outputs[0]) if outputs else None
        if node is None or mine is None or not node.dtypes:
            continue
        shape = tuple(pairing.t_shape.get(outputs[0], ()))  # its own: capture may have filed it under another node
        twins = [
            stats
            for other, (stats, other_shape) in call.values.items()
            if other_shape == shape and getattr(index.by_name.get(other), "op", None) == node.op
        ]
        unit_eps = EPS.get(canonical_dtype(node.dtypes[0]), FP32_EPS)
        if twins and min(_stats_departure(mine, stats) for stats in twins) > tol.region_units * unit_eps:  # type: ignore[arg-type]
            return False
    return True


def _node_values(call: RegionCall, index: PartIndex, pairing: Pairing, shadows: bool) -> dict[str, int]:
    """The target tensor of each node's value: capture's shadow run's statistics of it (``shadows``,
    where they are faithful: each named after its very node), else what the compiled code
    dispatched for it (filed by the order of dispatch).

    A node a compiler pass made (a pattern's replacement: no autograd number, no line of user
    code) carries the metadata of what it replaced, not of an eager op that computes its value:
    its shadow value stands for nothing in the bench, and it stays unseen, as fused code."""
    recorded = {
        name: pairing.t_outputs[ops[-1]][0] for name, ops in call.nodes.items() if pairing.t_outputs.get(ops[-1])
    }
    if shadows:
        for name in call.values:
            node = index.by_name.get(name)
            # A node of several values (var_mean: its first, the variance, is no eager op's) is
            # seen through its getitems.
            if node is not None and (node.seq_nr >= 0 or node.location) and len(node.shapes) <= 1:
                recorded[name] = pairing.shadow_tensor(call, name)
    return recorded


def _misfiled(
    n: GraphNode,
    mine: tuple[float, float, float, float],
    unit: Unit,
    pairing: Pairing,
    peers: list[tuple[str, tuple[int, ...], int]],
    near: float,
) -> bool:
    """Whether the value filed under ``n`` lies within ``near`` of the bench value of another node
    of its op and shape (nearer than to its own node's, as the caller chooses ``near``). Capture
    files what compiled code dispatched by op name, so only a node of the same op can be the
    value's own; a shadow value (a negative id) is its very node's."""
    index = pairing.index(unit.call)
    shape, mine_id = next(((s, t) for name, s, t in peers if name == n.name), (None, None))
    if index is None or mine_id is None or mine_id < 0:
        return False
    for other, other_shape, tensor in peers:
        other_node = index.by_name.get(other)
        if other == n.name or other_shape != shape or other_node is None or other_node.op != n.op:
            continue
        bench = pairing.bench_tensor(unit, other, other_shape, peers, tensor)
        theirs = pairing.b_stats.get(pairing.measured_as(bench)) if bench is not None else None
        if theirs is not None and _stats_departure(mine, theirs) <= near:
            return True
    return False


_CASTS = ("_to_copy", "convert_element_type")


def _round_trip(n: GraphNode, unit: Unit, index: PartIndex, pairing: Pairing) -> GraphNode | None:
    """Where ``n`` narrows a float value to a lower precision the bench does not narrow it to (no
    eager counterpart of the cast), and a cast within two nodes widens it back: the node computed
    in the lower precision between them, else ``n`` itself (a value rounded and nothing else)."""
    narrowed = _cast_dtypes(n, index)
    if narrowed is None or eps_of(narrowed[0]) <= eps_of(narrowed[1]) or not n.shapes:
        return None
    if pairing.bench_tensor(unit, n.name, n.shapes[0], []) is not None:
        return None
    low, wide = narrowed
    frontier: list[tuple[GraphNode, GraphNode | None]] = [(n, None)]
    for _ in range(3):
        reached = []
        for node, between in frontier:
            for user in index.users[node.name]:
                cast = _cast_dtypes(user, index)
                if cast == (wide, low):
                    return between or n
                if user.dtypes and canonical_dtype(user.dtypes[0]) == low:
                    reached.append((user, between or (None if is_view_op(user.op) else user)))
        frontier = reached
    return None


def _cast_dtypes(n: GraphNode, index: PartIndex) -> tuple[str, str] | None:
    """``(to, from)`` of a float cast node, else None."""
    source = index.by_name.get(n.inputs[0]) if n.inputs else None
    if base_name(n.op) not in _CASTS or not n.dtypes or source is None or not source.dtypes:
        return None
    to, made_from = canonical_dtype(n.dtypes[0]), canonical_dtype(source.dtypes[0])
    return (to, made_from) if to != made_from and is_float_dtype(to) and is_float_dtype(made_from) else None


def _draws(n: GraphNode) -> bool:
    """Whether the node's op drew random numbers (the schema says it may, its arguments that it did)."""
    func = resolve(n.op) if n.op.count(".") >= 2 else None
    if func is None or not hasattr(func, "_schema") or not op_info(func).random:
        return False
    try:
        args = json.loads(n.args)
    except ValueError:
        args = {}
    return draws_random(n.op, args if isinstance(args, dict) else None)


def _stats_departure(mine: tuple[float, float, float, float], theirs: tuple[float, float, float, float]) -> float:
    """Relative distance of two tensors' (min, max, mean, norm): extremes against the larger
    magnitude, norms against the larger norm (lower bounds of the elementwise error, as metrics.py's)."""
    lo, hi, _, norm = mine
    b_lo, b_hi, _, b_norm = theirs
    values = (lo, hi, norm, b_lo, b_hi, b_norm)
    if not all(math.isfinite(v) for v in values):
        return 0.0 if values[:3] == values[3:] else math.inf
    amax = max(abs(lo), abs(hi), abs(b_lo), abs(b_hi), 1e-300)
    ext = max(abs(hi - b_hi), abs(lo - b_lo)) / amax
    size = max(abs(norm), abs(b_norm), 1e-300)
    return max(ext, abs(norm - b_norm) / size)


def _wrong_kernels(
    part: GraphPart, ref: Mapping[str, Any], honest: Mapping[str, Any], recorded: Mapping[str, Any], tol: Tolerances
) -> dict[str, float]:
    """The nodes whose value the compiled code dispatched wrong (an extern kernel off by more than
    eager kernels are from a float64 replay), with the error of what was filed under them.

    Capture files a region's dispatched ops under its nodes in dispatch order, and inductor may run
    the extern kernels of one op in another order than its graph's (the four matmuls of an
    attention's backward): a value that departs from the node it was filed under but fits another
    departing node of the same op and shape is that node's, and neither is wrong. A node is wrong
    when no departing value of its op fits it.
    """

    def fits(value: Any, name: str) -> bool:
        r, h = as_tensor(ref.get(name)), as_tensor(honest.get(name))
        if r is None or h is None or value.shape != r.shape:
            return False
        unit_eps = EPS.get(canonical_dtype(str(h.dtype).removeprefix("torch.")), FP32_EPS)
        scale = Scale.of(r)
        return scale.error(value) <= max(tol.replay_margin * scale.error(h), tol.replay_local * unit_eps)

    departing: dict[str, list[str]] = defaultdict(list)  # op -> nodes whose filed value departs
    for n in part.nodes:
        value, r = as_tensor(recorded.get(n.name)), as_tensor(ref.get(n.name))
        if (
            value is not None
            and r is not None
            and r.is_floating_point()
            and value.shape == r.shape
            and not fits(value, n.name)
        ):
            departing[n.op].append(n.name)
    wrong: dict[str, float] = {}
    for names in departing.values():
        for name in names:
            if not any(fits(recorded[other], name) for other in names if other != name):
                wrong[name] = Scale.of(ref[name]).error(recorded[name])
    return wrong


def is_view_op(op: str) -> bool:
    """Whether ``op`` returns views of its inputs (it computes nothing to compare)."""
    func = resolve(op) if op.count(".") >= 2 else None
    if func is None or not hasattr(func, "_schema"):
        return False
    returns = op_info(func).returns
    return bool(returns) and all(kind == VIEW for kind, _ in returns)


def _where(n: GraphNode) -> str:
    return f"FX node {n.name} ({n.op}, {n.module or '<top>'}{', ' + n.location if n.location else ''})"


def _unmatched_cause(
    node: GraphNode, by_name: Mapping[str, GraphNode], unmatched: set[str], agreeing: set[str]
) -> GraphNode | None:
    """The earliest node without an eager counterpart between ``node`` and the values upstream of
    it that still agreed with the bench (views and getitems are looked through)."""
    order = {name: i for i, name in enumerate(by_name)}
    found: list[str] = []
    todo, seen = list(node.inputs), set(node.inputs)
    while todo:
        name = todo.pop()
        if name in agreeing or name not in by_name:
            continue
        if name in unmatched:
            found.append(name)
        other = by_name[name]
        if other.op == "placeholder":
            continue
        for i in other.inputs:
            if i not in seen:
                seen.add(i)
                todo.append(i)
    return by_name[min(found, key=order.__getitem__)] if found else None


def recorded_by_node(call: RegionCall, t_get: Callable[[int], Any], pairing: Pairing) -> dict[str, Any]:
    """What the compiled code dispatched for a node (boundary mode), by node name: its last op's
    first output, read from the trace."""
    out: dict[str, Any] = {}
    for name, ops in call.nodes.items():
        outputs = pairing.t_outputs.get(ops[-1]) if ops else None
        if outputs:
            out[name] = t_get(outputs[0])
    return out


def _departure(ref: Any, bench_tensor: int, b_get: Callable[[int], Any] | None, pairing: Pairing) -> float | None:
    """How far the bench's value lies from the float64 reference ``ref`` (relative): from whole
    tensors when the bench has them, else from its statistics (lower bounds, as metrics.py's)."""
    if b_get is not None and bench_tensor >= 0:  # a negative id: a shadow run's statistics
        value = b_get(bench_tensor)
        if value is not None and value.shape == ref.shape:
            return Scale.of(ref).error(value)
    measured = pairing.measured_as(bench_tensor)
    stats = pairing.b_stats.get(measured) if measured is not None else None
    if stats is None:
        return None
    lo, hi, mean, norm = stats
    r = ref.detach().to("cpu")
    if not bool(r.isfinite().all()) or r.numel() == 0:
        return None
    amax = max(float(r.abs().max()), abs(lo), abs(hi), 1e-300)
    n = r.numel()
    rms = max(float(r.norm()) / math.sqrt(n), abs(norm) / math.sqrt(n), 1e-300)
    ext = max(abs(float(r.max()) - hi), abs(float(r.min()) - lo)) / amax
    sys_ = max(abs(float(r.norm()) - norm) / math.sqrt(n), abs(float(r.mean()) - mean)) / rms
    return max(ext, sys_)
