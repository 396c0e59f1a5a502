"""Hand-made traces for tests: build a dataflow op by op, write it through the real trace writer.

>>> import torch
>>> b = TraceBuilder()
>>> x = b.source("input.0", torch.ones(2, 3))
>>> w = b.param("fc.weight", torch.eye(3))
>>> y = b.op("aten.mm.default", [x, w], torch.ones(2, 3), module="fc")
>>> z = b.op("aten.relu.default", [y], torch.ones(2, 3), module="act")
>>> b.step()                       # the next ops belong to step 1
>>> b.write("/tmp/tracebuild-doctest")   # doctest: +SKIP

Outputs can be real tensors (statistics derived with the reference implementation, shape and
dtype read from the tensor, whole tensors saved when ``data=True``) or described by
``shape``/``dtype``/``stats`` alone. :meth:`TraceBuilder.call` runs a real aten op on the values
of its arguments and records it the way capture would (op name, schema-named arguments, views).
Two builders fed the same calls with different numbers give a target and a bench; :func:`twin`
replays one recipe twice.

>>> b = TraceBuilder()
>>> x = b.source("input.0", torch.randn(4, 8))
>>> w = b.param("fc.weight", torch.randn(16, 8))
>>> y = b.call(torch.ops.aten.mm.default, x, b.call(torch.ops.aten.t.default, w, module="fc"), module="fc")
>>> g = b.call(torch.ops.aten.gelu.default, y, approximate="tanh", module="act")
>>> b.value(g).shape
torch.Size([4, 16])
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from tracecmp.capture.stats import STAT_FIELDS, reference_stats
from tracecmp.trace.schema import CHECKS_SCHEMA, OPS_SCHEMA, TENSORS_SCHEMA
from tracecmp.trace.writer import RankWriter, write_run_manifest

__all__ = ["Ref", "TraceBuilder", "stats_of", "fake_stats", "twin"]


@dataclass(frozen=True)
class Ref:
    """A tensor value in the trace being built (what an op consumes or produces)."""

    tensor_id: int
    op_id: int
    shape: tuple[int, ...]
    dtype: str


def round_tf32(x: torch.Tensor) -> torch.Tensor:
    """``x`` (finite float32) rounded to TF32's 10-bit mantissa, to nearest even: a TF32 device, written
    apart from the rounding models under test."""
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0x0FFF + ((bits >> 13) & 1)) & ~0x1FFF).view(torch.float32)


def _dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


def stats_of(tensor: torch.Tensor) -> dict[str, Any]:
    """The recorded statistics of a real tensor, as a dict of the schema's stat columns.

    >>> stats_of(torch.tensor([1.0, 3.0]))["mean"]
    2.0
    """
    return dict(zip(STAT_FIELDS, reference_stats(tensor)))


def fake_stats(
    shape: Sequence[int],
    *,
    mean: float = 0.0,
    std: float = 1.0,
    nan: int = 0,
    inf: int = 0,
    checksum: int | None = None,
) -> dict[str, Any]:
    """Plausible statistics of a Gaussian-like tensor without making one (for large fake traces).

    The checksum defaults to a hash of the other numbers, so equal statistics mean equal checksums.

    >>> fake_stats((10,), mean=1.0, std=0.0)["norm"]
    3.1622776601683795
    """
    numel = math.prod(shape)
    finite = max(numel - nan - inf, 0)
    spread = 3.0 * std
    stats = {
        "min": mean - spread if numel else math.nan,
        "max": mean + spread if numel else math.nan,
        "mean": mean if finite else math.nan,
        "norm": math.sqrt(finite * (mean * mean + std * std)),
        "nan_count": nan,
        "inf_count": inf,
    }
    if checksum is None:
        checksum = hash(tuple(round(v, 12) if isinstance(v, float) and math.isfinite(v) else v for v in stats.values()))
    stats["checksum"] = int(checksum) & 0x7FFFFFFFFFFFFFFF
    return stats


class TraceBuilder:
    """Accumulates nodes and tensors in execution order; :meth:`write` commits them as a trace.

    ``data=True`` also saves the tensors given as real outputs (like capture's ``data="tensors"``).
    ``complete=False`` writes a trace whose capture did not finish.
    """

    def __init__(
        self, *, rank: int = 0, world_size: int = 1, device: str = "cpu", data: bool = False, complete: bool = True
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.data = data
        self.complete = complete
        self.current_step = 0
        self.ops: list[dict[str, Any]] = []
        self.tensors: list[dict[str, Any]] = []
        self.saved: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}  # real values of tensors given as tensors (for call())
        self.compiled: dict[str, Any] | None = None  # a record of compiled regions (trace/compiled.py), if any
        self.checks: list[dict[str, Any]] | None = None  # self-check rows (capture/selfcheck.py), if any
        self._next_tensor = 0

    # -- building ------------------------------------------------------------------------------

    def self_check(
        self,
        of: Ref,
        residual: float,
        limit: float = 4.0,
        *,
        sampled: int = 16,
        how: str = "rows",
        coarse: float | None = None,
    ) -> None:
        """Record what capture's self-check found for the op that made ``of`` (its output 0;
        ``coarse``: see ``CHECKS_SCHEMA``, default the residual); a builder given none writes a
        trace recorded without self-checks."""
        self.checks = self.checks or []
        self.checks.append(
            {
                "op_id": of.op_id,
                "index": 0,
                "residual": residual,
                "limit": limit,
                "coarse": residual if coarse is None else coarse,
                "sampled": sampled,
                "how": how,
            }
        )

    def step(self) -> None:
        """Start the next step (like ``TraceCompare.step()``)."""
        self.current_step += 1

    def source(
        self,
        name: str,
        value: torch.Tensor | Sequence[int] | None = None,
        dtype: str | torch.dtype = "float32",
        stats: Mapping[str, Any] | None = None,
        *,
        kind: str = "input",
        shape: Sequence[int] | None = None,
        module: str = "",
        phase: str = "forward",
        location: str = "",
    ) -> Ref:
        """A named source tensor: ``kind`` is input, parameter, buffer or tensor.

        ``value`` is a real tensor, or a shape: ``b.source("input.0", (4, 8), "bfloat16", fake_stats((4, 8)))``.
        """
        if value is not None and not isinstance(value, torch.Tensor):
            shape, value = tuple(value), None
        (ref,) = self._node(
            f"source.{kind}",
            [],
            [value] if value is not None else None,
            kind="source",
            name=name,
            shapes=None if shape is None else [shape],
            dtypes=[dtype],
            stats=None if stats is None else [stats],
            module=module,
            phase=phase,
            location=location,
        )
        return ref

    def param(self, name: str, value: torch.Tensor | None = None, **kw: Any) -> Ref:
        """A parameter source (``source.parameter``), e.g. ``b.param("fc1.weight", w)``."""
        return self.source(name, value, kind="parameter", **kw)

    def op(
        self,
        op: str,
        inputs: Sequence[Ref],
        out: torch.Tensor | Sequence[torch.Tensor] | None = None,
        *,
        shape: Sequence[int] | Sequence[Sequence[int]] | None = None,
        dtype: str | torch.dtype | Sequence[str | torch.dtype] = "float32",
        stats: Mapping[str, Any] | Sequence[Mapping[str, Any] | None] | None = None,
        module: str = "",
        phase: str = "forward",
        args: Mapping[str, Any] | None = None,
        location: str = "",
        random: bool = False,
        inplace: bool = False,
        seq_nr: int = -1,
        stack: str = "",
    ) -> Any:
        """Record one op; returns its output :class:`Ref` (a tuple when it has several outputs).

        ``out`` is a tensor or a list of tensors; without it give ``shape`` (one shape or a list;
        default: the first input's, as for an elementwise op) and optionally ``dtype`` and ``stats``
        (default: :func:`fake_stats` of the shape).
        """
        outs: list[torch.Tensor] | None
        if out is None and shape is None:
            # Without numbers or a shape, an elementwise op: the first input's shape and dtype.
            shape = inputs[0].shape if inputs else ()
            if inputs and dtype == "float32":
                dtype = inputs[0].dtype
        if out is None:
            outs = None
        elif isinstance(out, torch.Tensor):
            outs = [out]
        else:
            outs = list(out)
        shapes: list[Sequence[int]] | None = None
        if shape is not None:
            shapes = [shape] if not shape or isinstance(shape[0], int) else list(shape)  # type: ignore[list-item]
        n = len(outs) if outs is not None else (len(shapes) if shapes is not None else 1)
        dtypes = [dtype] * n if isinstance(dtype, (str, torch.dtype)) else list(dtype)
        stat_list = None if stats is None else ([stats] * n if isinstance(stats, Mapping) else list(stats))
        refs = self._node(
            op,
            inputs,
            outs,
            kind="op",
            name="",
            shapes=shapes,
            dtypes=dtypes,
            stats=stat_list,
            module=module,
            phase=phase,
            location=location,
            args=args,
            random=random,
            inplace=inplace,
            seq_nr=seq_nr,
            stack=stack,
        )
        if not refs:
            return None  # an op that hands back no tensor (``.item()``'s number)
        return refs[0] if len(refs) == 1 else tuple(refs)

    def view(
        self,
        op: str,
        base: Ref,
        shape: Sequence[int] | None = None,
        *,
        module: str = "",
        phase: str = "forward",
        args: Mapping[str, Any] | None = None,
        location: str = "",
    ) -> Ref:
        """A view op: its output aliases ``base`` and carries no statistics."""
        (ref,) = self.views(
            op,
            base,
            [tuple(base.shape if shape is None else shape)],
            module=module,
            phase=phase,
            args=args,
            location=location,
        )
        return ref

    def views(
        self,
        op: str,
        base: Ref,
        shapes: Sequence[Sequence[int]],
        *,
        module: str = "",
        phase: str = "forward",
        args: Mapping[str, Any] | None = None,
        location: str = "",
    ) -> tuple[Ref, ...]:
        """A view op with one output per shape (``unbind``, ``split``), each aliasing ``base``."""
        op_id = len(self.ops)
        tids = [self._tensor_id() for _ in shapes]
        self.ops.append(
            self._op_row(op_id, op, "view", "", module, phase, location, args, [base], tids, False, False, -1, "")
        )
        for index, (tid, shape) in enumerate(zip(tids, shapes)):
            self.tensors.append(self._tensor_row(tid, op_id, index, tuple(shape), base.dtype, base.tensor_id, None))
        return tuple(Ref(tid, op_id, tuple(shape), base.dtype) for tid, shape in zip(tids, shapes))

    def value(self, ref: Ref) -> torch.Tensor:
        """The real tensor behind ``ref`` (only for tensors recorded from real values)."""
        return self.values[ref.tensor_id]

    def call(
        self,
        op: Any,
        *args: Any,
        module: str = "",
        phase: str = "forward",
        location: str = "",
        random: bool = False,
        fault: Callable[[torch.Tensor], torch.Tensor]
        | Sequence[Callable[[torch.Tensor], torch.Tensor] | None]
        | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run the aten overload ``op`` on the real values behind the :class:`Ref` arguments and record it.

        Non-tensor arguments are recorded as capture records them (JSON keyed by schema argument
        name). View ops become view nodes. ``fault`` rewrites the first output before it is
        recorded (to inject a wrong result); a sequence rewrites each output by position (``None``
        leaves one as is). Returns a :class:`Ref`, or a tuple for several outputs.
        """

        def unwrap(v: Any) -> Any:
            if isinstance(v, Ref):
                return self.values[v.tensor_id]
            if isinstance(v, (list, tuple)):
                return type(v)(unwrap(x) for x in v)
            return v

        refs = [a for a in _flatten(args) + _flatten(list(kwargs.values())) if isinstance(a, Ref)]
        result = op(*unwrap(args), **{k: unwrap(v) for k, v in kwargs.items()})
        outs = list(result) if isinstance(result, (tuple, list)) else [result]
        outs = [o for o in outs if isinstance(o, torch.Tensor)]
        rewrites = [fault] if callable(fault) else list(fault or ())
        for index, rewrite in enumerate(rewrites):
            if rewrite is not None:
                outs[index] = rewrite(outs[index])
        recorded_args = _schema_args(op, args, kwargs)
        name = str(op)
        if getattr(op, "is_view", False) and outs and refs:
            views = self.views(
                name,
                refs[0],
                [tuple(o.shape) for o in outs],
                module=module,
                phase=phase,
                args=recorded_args,
                location=location,
            )
            for ref, tensor in zip(views, outs):
                self.values[ref.tensor_id] = tensor
            return views[0] if len(views) == 1 and isinstance(result, torch.Tensor) else views
        mutable = bool(getattr(getattr(op, "_schema", None), "is_mutable", False))
        out_refs = self.op(
            name,
            refs,
            [o.detach().clone() for o in outs],
            module=module,
            phase=phase,
            args=recorded_args,
            location=location,
            random=random,
            inplace=mutable,
        )
        ref_list = [out_refs] if isinstance(out_refs, Ref) else list(out_refs or ())
        for ref, tensor in zip(ref_list, outs):
            self.values[ref.tensor_id] = tensor.detach().clone()
        return out_refs

    # -- writing -------------------------------------------------------------------------------

    def write(
        self, path: str | Path, *, options: Mapping[str, Any] | None = None, chunk_ops: int | None = None
    ) -> Path:
        """Write the run manifest and this builder's rank folder; returns the run folder.

        ``chunk_ops`` splits the nodes into several committed chunks (as a long capture does).
        """
        root = Path(path)
        opts = {"data": "tensors" if self.data else "stats", **dict(options or {})}
        write_run_manifest(root, options=opts)
        writer = RankWriter(root, rank=self.rank, world_size=self.world_size, device=self.device)
        size = chunk_ops or max(len(self.ops), 1)
        by_producer: dict[int, list[dict[str, Any]]] = {}
        for row in self.tensors:
            by_producer.setdefault(row["op_id"], []).append(row)
        for index, start in enumerate(range(0, max(len(self.ops), 1), size)):
            ops = self.ops[start : start + size]
            tensors = [t for o in ops for t in by_producer.get(o["op_id"], [])]
            data = {}
            for t in tensors:
                if t["tensor_id"] in self.saved:
                    t["data_key"] = f"{index}/t{t['tensor_id']}"
                    data[t["data_key"]] = self.saved[t["tensor_id"]]
            last = start + size >= len(self.ops)
            op_ids = {o["op_id"] for o in ops}
            # The last chunk takes the checks of ops no chunk holds (a malformed trace, on purpose).
            orphan = last and self.checks is not None
            held = {o["op_id"] for o in self.ops} if orphan else set()
            checks = (
                None
                if self.checks is None
                else [c for c in self.checks if c["op_id"] in op_ids or (orphan and c["op_id"] not in held)]
            )
            writer.write_chunk(
                _columns(ops, OPS_SCHEMA.names),
                _columns(tensors, TENSORS_SCHEMA.names),
                data or None,
                steps=sorted({o["step"] for o in ops}),
                compiled=self.compiled if index == 0 else None,
                checks=None if checks is None else _columns(checks, CHECKS_SCHEMA.names),
            )
        writer.close(complete=self.complete)
        return root

    # -- internals -----------------------------------------------------------------------------

    def _tensor_id(self) -> int:
        tid = self._next_tensor
        self._next_tensor += 1
        return tid

    def _node(
        self,
        op: str,
        inputs: Sequence[Ref],
        outs: list[torch.Tensor] | None,
        *,
        kind: str,
        name: str,
        shapes: list[Sequence[int]] | None,
        dtypes: list[Any],
        stats: list[Mapping[str, Any] | None] | None,
        module: str,
        phase: str,
        location: str,
        args: Mapping[str, Any] | None = None,
        random: bool = False,
        inplace: bool = False,
        seq_nr: int = -1,
        stack: str = "",
    ) -> list[Ref]:
        op_id = len(self.ops)
        refs: list[Ref] = []
        rows: list[dict[str, Any]] = []
        n = len(outs) if outs is not None else len(shapes or [()])
        for index in range(n):
            tid = self._tensor_id()
            if outs is not None:
                tensor = outs[index]
                out_shape, out_dtype, out_stats = tuple(tensor.shape), _dtype_name(tensor.dtype), stats_of(tensor)
                if stats is not None and stats[index] is not None:
                    out_stats.update(stats[index])
                if self.data:
                    self.saved[tid] = tensor.detach().clone()
                self.values[tid] = tensor.detach()
            else:
                out_shape = tuple(shapes[index]) if shapes else ()
                out_dtype = _dtype_name(dtypes[min(index, len(dtypes) - 1)])
                out_stats = fake_stats(out_shape)
                if stats is not None and stats[index] is not None:
                    out_stats.update(stats[index])
            if stats is not None and stats[index] is None:  # recorded without statistics
                out_stats = None
            rows.append(self._tensor_row(tid, op_id, index, out_shape, out_dtype, -1, out_stats))
            refs.append(Ref(tid, op_id, out_shape, out_dtype))
        self.ops.append(
            self._op_row(
                op_id,
                op,
                kind,
                name,
                module,
                phase,
                location,
                args,
                inputs,
                [r.tensor_id for r in refs],
                inplace,
                random,
                seq_nr,
                stack,
            )
        )
        self.tensors.extend(rows)
        return refs

    def _op_row(
        self,
        op_id: int,
        op: str,
        kind: str,
        name: str,
        module: str,
        phase: str,
        location: str,
        args: Mapping[str, Any] | None,
        inputs: Iterable[Ref],
        outputs: list[int],
        inplace: bool,
        random: bool,
        seq_nr: int,
        stack: str,
    ) -> dict[str, Any]:
        return {
            "op_id": op_id,
            "step": self.current_step,
            "phase": phase,
            "kind": kind,
            "op": op,
            "name": name,
            "module": module,
            "location": location,
            "args": json.dumps(dict(args or {}), sort_keys=True),
            "inputs": [r.tensor_id for r in inputs],
            "outputs": outputs,
            "inplace": inplace,
            "random": random,
            "seq_nr": seq_nr,
            "stack": stack,
        }

    @staticmethod
    def _tensor_row(
        tid: int,
        op_id: int,
        index: int,
        shape: Sequence[int],
        dtype: str,
        view_of: int,
        stats: Mapping[str, Any] | None,
    ) -> dict[str, Any]:
        row: dict[str, Any] = {
            "tensor_id": tid,
            "op_id": op_id,
            "index": index,
            "shape": list(shape),
            "dtype": dtype,
            "device": "cpu",
            "view_of": view_of,
            "has_stats": stats is not None,
            "data_key": "",
        }
        for key in STAT_FIELDS:
            default: Any = 0 if key in ("nan_count", "inf_count", "checksum") else math.nan
            row[key] = default if stats is None else stats.get(key, default)
        return row


def _flatten(values: Sequence[Any]) -> list[Any]:
    out: list[Any] = []
    for v in values:
        out.extend(_flatten(v) if isinstance(v, (list, tuple)) else [v])
    return out


def _schema_args(op: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Arguments as capture records them: schema name -> value, tensors as {"tensor": i}."""
    counter = [0]

    def enc(v: Any) -> Any:
        if isinstance(v, (Ref, torch.Tensor)):
            counter[0] += 1
            return {"tensor": counter[0] - 1}
        if isinstance(v, (list, tuple)):
            return [enc(x) for x in v]
        if isinstance(v, (torch.dtype, torch.layout, torch.memory_format)):
            return str(v).removeprefix("torch.")
        if isinstance(v, torch.device):
            return str(v)
        if isinstance(v, float) and not math.isfinite(v):
            return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
        return v

    schema = getattr(op, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    out = {names[i] if i < len(names) else str(i): enc(v) for i, v in enumerate(args)}
    out.update({k: enc(v) for k, v in kwargs.items()})
    return out


def _columns(rows: list[dict[str, Any]], names: Sequence[str]) -> dict[str, list[Any]]:
    return {k: [r[k] for r in rows] for k in names}


def twin(recipe: Callable[[TraceBuilder, bool], None], target: str | Path, bench: str | Path, **kw: Any) -> None:
    """Build and write a target and a bench from one recipe ``recipe(builder, is_target)``.

    >>> def recipe(b, is_target):  # doctest: +SKIP
    ...     x = b.source("input.0", torch.ones(3))
    ...     b.op("aten.relu.default", [x], torch.ones(3) * (2 if is_target else 1))
    >>> twin(recipe, "runs/t", "runs/b")  # doctest: +SKIP
    """
    for path, is_target in ((target, True), (bench, False)):
        builder = TraceBuilder(**kw)
        recipe(builder, is_target)
        builder.write(path)
