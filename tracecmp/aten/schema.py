"""What tracecmp knows about an operator, read once from its schema and cached.

An op's schema says, through its alias annotations, which arguments it writes (``Tensor(a!)``)
and which returns are views of an argument (``Tensor(a)``) — the same information torch's own
functionalization and ``torch.utils._python_dispatch`` rely on. :func:`op_info` turns that into
a small record so capture's per-op path only does lookups and replay knows what a call returned.

>>> info = op_info(torch.ops.aten.add_.Tensor)
>>> info.name, info.returns, info.extra_writes
('aten.add_.Tensor', ((1, (0, 'self')),), ())
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from tracecmp.aten.opclass import is_collective

# Return kinds.
FRESH = 0  # a new tensor (gets statistics)
WRITE = 1  # the argument it names, written in place (a new version, gets statistics)
VIEW = 2  # a view of the argument it names (no statistics)
SCRATCH = 3  # a new tensor holding kernel scratch space, partly uninitialized (no statistics)
BUFFER = 4  # one of the op's arguments handed back, partly written: not a new value (not recorded)

# record_function ranges (the optimizer's "Optimizer.step#Adam.step") reach the dispatcher as ops.
_SKIPPED_NAMESPACES = ("profiler.",)
# Allocators whose results hold whatever was in memory: their statistics would differ run to run.
_UNINITIALIZED = ("aten::empty", "aten::new_empty", "aten::_empty")
# Returns that are a kernel's workspace for its backward: their bytes differ between identical
# runs, so statistics of them would make every determinism check fail.
_SCRATCH_RETURNS = {"aten::mkldnn_rnn_layer": 3, "aten::_cudnn_rnn": 3, "aten::miopen_rnn": 3}
# Returns of fused attention kernels that are bookkeeping, not results: a random generator's seed
# and offset, the varlen batch offsets and the debug mask. Where a kernel has no use for them they
# are uninitialized memory (all of them on the CPU in torch 2.1; the generator's without dropout on
# CUDA), so statistics of them would differ between identical runs.
SCRATCH_NAMES = frozenset(
    {"philox_seed", "philox_offset", "rng_state", "unused", "cum_seq_q", "cum_seq_k", "debug_attn_mask"}
)
# Returns that are an argument handed back after the op wrote part of it, with no alias
# annotation: FSDP2's all-gather buffer holds only this rank's shard (the other return, a view of
# it) until the all-gather fills the rest, so it stays the uninitialised value it was.
_BUFFER_RETURNS = {"fsdp::all_gather_copy_in": 1}

ArgRef = tuple[int, str]  # (position in args, name in kwargs): where a schema argument arrives
ONE_FRESH: tuple[tuple[int, ArgRef | None], ...] = ((FRESH, None),)


@dataclass(frozen=True)
class OpInfo:
    """Per-operator facts from its schema."""

    name: str  # "aten.mm.default", "npu.fused_x.default"
    arg_names: tuple[str, ...]  # schema names of the arguments, in order
    returns: tuple[tuple[int, ArgRef | None], ...]  # (kind, aliased argument) per schema return
    extra_writes: tuple[ArgRef, ...]  # written arguments that no return hands back (foreach_, running stats)
    kind: str  # "view" when every return is a view and nothing is written, else "op"
    inplace: bool  # the op writes at least one argument
    random: bool  # the op draws from a random generator
    schema: bool  # False for operators without a schema (higher-order ops): outputs are walked generically
    record: bool = True  # False for bookkeeping ops that compute nothing (profiler ranges)
    uninitialized: bool = False  # outputs are uninitialized memory (empty*): no statistics, no data
    host_rng: bool = False  # random and the CPU can run it: ``rng="host"`` draws it there (rng.py)
    writes: tuple[ArgRef, ...] = ()  # every argument the op writes
    dropout: tuple[tuple[ArgRef, float], ...] = ()  # ``dropout=0.0``: the arguments to set, and to what
    rewritable: bool = False  # host_rng or dropout: the only ops the session's rewrites look at
    collective: bool = False  # c10d / _c10d_functional: recorded by capture/collectives.py
    write_only: tuple[str, ...] = ()  # keyword-only written arguments (out=): their content is never read


def _alias_sets(alias_info: Any) -> set[str]:
    return set(alias_info.before_set) if alias_info is not None else set()


def _has_cpu_kernel(func: Any) -> bool:
    """Whether the CPU can run ``func`` (its own CPU kernel or a composite one)."""
    try:
        return torch._C._dispatch_has_computed_kernel_for_dispatch_key(func.name(), "CPU")
    except (AttributeError, RuntimeError):
        return False


# Float arguments that make an op drop values, and the value that turns the dropping off.
_DROPOUT_ARGS = {"dropout_p": 0.0, "dropout": 0.0, "keep_prob": 1.0}


def _dropout_rewrites(base: str, arguments: list[Any], refs: list[ArgRef]) -> tuple[tuple[ArgRef, float], ...]:
    """The arguments ``dropout=0.0`` sets: drop probabilities to 0, keep probabilities and the
    backward's rescaling to 1 (autograd computes the backward's scale from the original ``p``)."""
    rewrites = []
    for arg, ref in zip(arguments, refs):
        if str(arg.type).rstrip("?") != "float":
            continue
        value = _DROPOUT_ARGS.get(arg.name)
        if value is None and "dropout" in base and arg.name == "p":
            value = 1.0 if base == "_fused_dropout" else 0.0  # _fused_dropout's p is the keep probability
        elif value is None and arg.name == "scale" and (base.endswith("dropout_backward") or base == "_masked_scale"):
            value = 1.0
        if value is not None:
            rewrites.append((ref, value))
    return tuple(rewrites)


def _build(func: Any) -> OpInfo:
    name = str(func)
    if name.startswith(_SKIPPED_NAMESPACES):
        return OpInfo(name, (), (), (), "op", False, False, False, record=False)
    schema = getattr(func, "_schema", None)
    tags = getattr(func, "tags", ()) or ()
    random = torch.Tag.nondeterministic_seeded in tags
    if schema is None:
        return OpInfo(name, (), (), (), "op", False, random, False)
    arguments = list(schema.arguments)
    # Not every sampling op carries the tag (vendor ops): one that takes a Generator draws from it.
    random = random or any(str(a.type).rstrip("?") == "Generator" for a in arguments)
    # Keyword-only arguments arrive in kwargs, the others positionally (trailing defaults may be absent).
    refs: list[ArgRef] = [(-1 if a.kwarg_only else i, a.name) for i, a in enumerate(arguments)]
    writes = [i for i, a in enumerate(arguments) if a.alias_info is not None and a.alias_info.is_write]
    returns: list[tuple[int, ArgRef | None]] = []
    returned_writes: set[int] = set()
    scratch = _SCRATCH_RETURNS.get(schema.name)
    buffer = _BUFFER_RETURNS.get(schema.name)
    for position, ret in enumerate(schema.returns):
        info = ret.alias_info
        if info is None:
            returns.append(
                (
                    SCRATCH
                    if position == scratch or ret.name in SCRATCH_NAMES
                    else BUFFER
                    if position == buffer
                    else FRESH,
                    None,
                )
            )
            continue
        sets = _alias_sets(info)
        # A list return (`Tensor(a)[]`) carries its alias set on the elements; fall back to the
        # first argument with a matching write-ness, which is how such schemas are written.
        candidates = [
            i
            for i, a in enumerate(arguments)
            if a.alias_info is not None and bool(a.alias_info.is_write) == bool(info.is_write)
        ]
        matched = [i for i in candidates if sets & _alias_sets(arguments[i].alias_info)] or candidates[:1]
        if not matched:
            returns.append((FRESH, None))
            continue
        index = matched[0]
        if info.is_write:
            returned_writes.add(index)
            returns.append((WRITE, refs[index]))
        else:
            returns.append((VIEW, refs[index]))
    extra = tuple(refs[i] for i in writes if i not in returned_writes)
    is_view = bool(returns) and not writes and all(kind == VIEW for kind, _ in returns)
    host_rng = random and _has_cpu_kernel(func)
    dropout = _dropout_rewrites(schema.name.split("::")[-1], arguments, refs)
    return OpInfo(
        name,
        tuple(a.name for a in arguments),
        ONE_FRESH if returns == list(ONE_FRESH) else tuple(returns),  # shared: the per-op path tests `is`
        extra,
        "view" if is_view else "op",
        bool(writes),
        random,
        True,
        uninitialized=schema.name.startswith(_UNINITIALIZED),
        host_rng=host_rng,
        writes=tuple(refs[i] for i in writes),
        dropout=dropout,
        rewritable=host_rng or bool(dropout),
        collective=is_collective(name),
        write_only=tuple(arguments[i].name for i in writes if arguments[i].kwarg_only),
    )


# id(func) -> its OpInfo, read by the per-op path before it calls op_info: OpOverload's __hash__ is
# Python code, an int's is not. Operators are long-lived singletons; _PINNED keeps each one seen
# alive all the same, so that no other object can take its id while it is cached.
OP_INFOS: dict[int, OpInfo] = {}
_PINNED: list[Any] = []


def op_info(func: Any) -> OpInfo:
    """The cached :class:`OpInfo` of ``func`` (an ``OpOverload`` or any dispatched operator)."""
    info = OP_INFOS.get(id(func))
    if info is None:
        info = OP_INFOS[id(func)] = _build(func)
        _PINNED.append(func)
    return info


def arg_value(ref: ArgRef, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The value of the schema argument ``ref`` in this call (None when defaulted away)."""
    position, name = ref
    if 0 <= position < len(args):
        return args[position]
    return kwargs.get(name)


# Ops that exist only once a torch module defining them is imported: inductor's prims
# (``prims.fma`` in its softmax backward) are in the graphs inductor compiles.
_DEFINED_BY = {"prims": "torch._inductor.inductor_prims"}
_imported: set[str] = set()


@lru_cache(maxsize=None)
def resolve(name: str) -> Any:
    """The operator a recorded name stands for (``"aten.mm.default"``), or None where this torch
    has no such overload (a vendor op whose library is not loaded)."""
    namespace, _, rest = name.partition(".")
    packet_name, _, overload = rest.rpartition(".")
    while True:
        try:
            packet = getattr(getattr(torch.ops, namespace), packet_name)
            return getattr(packet, overload)
        except (AttributeError, RuntimeError):
            module = _DEFINED_BY.get(namespace)
            if module is None or module in _imported:
                return None
            _imported.add(module)
            try:
                importlib.import_module(module)
            except ImportError:  # a torch without it
                return None


def outputs_in_order(
    func: Any, result: Any, args: tuple[Any, ...] | list[Any], kwargs: dict[str, Any]
) -> list[torch.Tensor]:
    """A call's tensors in the order capture numbers its outputs: the returns, then the written
    arguments that no return hands back (``OpInfo.extra_writes``)."""
    info = op_info(func)
    if not info.schema:
        return [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
    returns = info.returns
    values = (result,) if len(returns) == 1 else (result if returns else ())
    produced: list[torch.Tensor] = []
    for (kind, _), value in zip(returns, values):
        if kind != BUFFER:
            produced.extend(_tensors_in(value))
    for ref in info.extra_writes:
        produced.extend(_tensors_in(arg_value(ref, tuple(args), kwargs)))
    return produced


def _tensors_in(value: Any) -> list[torch.Tensor]:
    items = [value] if isinstance(value, torch.Tensor) else (value if isinstance(value, (list, tuple)) else ())
    return [item for item in items if isinstance(item, torch.Tensor)]
