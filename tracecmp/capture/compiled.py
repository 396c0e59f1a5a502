"""``torch.compile`` under capture: never change what Dynamo compiles.

Two things in a capture session could change the user's compiled program:

* the capture mode itself: a dispatch mode that does not ignore compile internals makes Dynamo
  skip every frame while it is active, and a frame skipped once stays uncompiled after the mode
  exits (``CaptureMode.ignore_compile_internals`` is True for that reason);
* capture's global module and optimizer hooks: Dynamo traces global hooks into the graph and
  guards on how many there are, so a frame compiled while they are installed is a variant that
  is only valid with them, compiled again once the session ends (a second compile of the whole
  model) and reused by the next session.

:class:`HiddenHooks` takes capture's hooks out of torch's hook tables for the duration of every
Dynamo compilation (its start and end callbacks) and puts them back after: Dynamo then traces
and guards the program as it would without tracecmp, and the compiled code is the same.

Importing Dynamo costs seconds, so a session that never meets ``torch.compile`` never imports
it: :func:`when_imported` acts at once when ``torch._dynamo`` is loaded already, else the moment
something (``torch.compile``) loads it.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib.abc
import importlib.util
import json
import os
import re
import sys
import warnings
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable

import torch
from torch._C._autograd import _get_sequence_nr
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten

from tracecmp._compat import TORCH_VERSION
from tracecmp.aten.schema import op_info
from tracecmp.capture.inputs import name_of_source
from tracecmp.capture.stats import stats_tensor_reference, tensor_stats_row
from tracecmp.trace.args import ArgsEncoder
from tracecmp.trace.compiled import BOUNDARY_OPS, CompiledGraph, GraphNode, GraphPart, RegionCall
from tracecmp.trace.schema import ALIAS_UPDATE_OP

_DYNAMO = "torch._dynamo"
_HOOK_WARNING = r"Using `torch.compile\(module\)` when there are global hooks on modules"


class _AfterExec(importlib.abc.Loader):
    """A loader that runs another loader, then the callbacks waiting for the module."""

    def __init__(self, loader: Any, callbacks: list[Callable[[], None]]) -> None:
        self._loader = loader
        self._callbacks = callbacks

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        for callback in list(self._callbacks):
            try:
                callback()
            except Exception as exc:  # noqa: BLE001 - never break the user's import of torch._dynamo
                warnings.warn(
                    f"tracecmp: could not prepare for torch.compile ({type(exc).__name__}: {exc})", stacklevel=2
                )


class _ImportWatch(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of one module so that callbacks run once it is loaded."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.callbacks: list[Callable[[], None]] = []
        self._busy = False

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name or self._busy or not self.callbacks:
            return None
        self._busy = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy = False
        if spec is not None and spec.loader is not None:
            spec.loader = _AfterExec(spec.loader, self.callbacks)
        return spec


_watch: _ImportWatch | None = None


def when_imported(callback: Callable[[], None]) -> Callable[[], None]:
    """Run ``callback`` now if Dynamo is loaded, else right after it is; returns a function that
    cancels a callback still waiting.

    >>> cancel = when_imported(lambda: None); cancel()
    """
    global _watch
    if _DYNAMO in sys.modules:
        callback()
        return lambda: None
    if _watch is None:
        _watch = _ImportWatch(_DYNAMO)
    if _watch not in sys.meta_path:
        sys.meta_path.insert(0, _watch)
    _watch.callbacks.append(callback)

    def cancel() -> None:
        if _watch is not None and callback in _watch.callbacks:
            _watch.callbacks.remove(callback)
            if not _watch.callbacks and _watch in sys.meta_path:
                sys.meta_path.remove(_watch)

    return cancel


class HiddenHooks:
    """Removes the hooks ``handles()`` names from torch's tables while Dynamo compiles.

    ``handles`` returns the live ``RemovableHandle`` objects at the moment a compilation starts
    (they change as recording starts and stops between steps).

    >>> hidden = HiddenHooks(lambda: [])
    >>> hidden.install(); hidden.remove()
    """

    def __init__(self, handles: Callable[[], Iterable[Any]]) -> None:
        self._handles = handles
        self._taken: list[tuple[dict[Any, Any], Any, Any]] = []
        self._handler: Any = None
        self._cancel: Callable[[], None] | None = None
        self._filter: Any = None
        self._unwrap: Callable[[], None] | None = None  # torch < 2.2: puts Dynamo's own compile back

    def install(self) -> None:
        if self._cancel is None:
            self._cancel = when_imported(self._register)
        # torch warns at every call of a compiled module while global module hooks exist: those
        # are capture's, whose extra call for the wrapper module capture expects.
        warnings.filterwarnings("ignore", message=_HOOK_WARNING, category=UserWarning)
        self._filter = warnings.filters[0]

    def _register(self) -> None:
        try:
            from torch._dynamo.callback import callback_handler
        except ImportError:  # torch < 2.2 has no compile callbacks: Dynamo's compile of a frame, wrapped
            from torch._dynamo import convert_frame, skipfiles

            # Its compiled modules call global hooks from a frame Dynamo watches: it would compile
            # capture's hooks themselves. tracecmp's files are skipped, as torch's own are.
            skipfiles.add("tracecmp")

            original = convert_frame._compile

            @functools.wraps(original)
            def compile_hidden(*args: Any, **kwargs: Any) -> Any:
                self._hide()
                try:
                    return original(*args, **kwargs)
                finally:
                    self._restore()

            convert_frame._compile = compile_hidden
            self._unwrap = lambda: setattr(convert_frame, "_compile", original)
            return

        callback_handler.register_start_callback(self._hide)
        callback_handler.register_end_callback(self._restore)
        self._handler = callback_handler

    def remove(self) -> None:
        if self._cancel is not None:
            self._cancel()
            self._cancel = None
        if self._filter is not None:
            with contextlib.suppress(ValueError):
                warnings.filters.remove(self._filter)
            getattr(warnings, "_filters_mutated", lambda: None)()  # the filter cache, refreshed
            self._filter = None
        self._restore()
        if self._handler is not None:
            self._handler.remove_start_callback(self._hide)
            self._handler.remove_end_callback(self._restore)
            self._handler = None
        if self._unwrap is not None:
            self._unwrap()
            self._unwrap = None

    def _hide(self, *_: Any) -> None:
        self._restore()  # never hide twice (a compile that did not end)
        for handle in self._handles():
            table = handle.hooks_dict_ref() if handle.hooks_dict_ref is not None else None
            if table is not None and handle.id in table:
                self._taken.append((table, handle.id, table.pop(handle.id)))

    def _restore(self, *_: Any) -> None:
        for table, key, hook in self._taken:
            table[key] = hook
        self._taken = []


# ---------------------------------------------------------------------------------------------
# Compiled regions: every graph Dynamo compiles during a session, and each call of it.
#
# Dynamo hands each graph to the backend through ``OutputGraph.call_user_compiler``. While a
# session is open that method is wrapped: the backend compiles as always, and what it returns
# is wrapped in a :class:`Region` that Dynamo calls in its place. A Region passes the call
# straight through unless a session records, so the code the user runs after the session is the
# backend's own (one Python call more per region). At compile time the Dynamo graph also goes
# through AOT autograd a second time, with the decompositions and partitioner of the backend
# (inductor's for inductor, none for others) and compilers that keep the forward and backward
# FX graphs: the record of which ops the region covers, with each node's module from its
# metadata, and, in ``compiled="graph"`` mode, the graphs that run op by op under the capture.

_ACTIVE: Any = None  # the RegionCapture of the open session, if any
_ORIGINAL_COMPILER: Any = None
_wrapped_graphs = 0  # graphs described so far in this process (ids "g0", "g1", ...)
_warned_unseen = 0  # graphs compiled outside any session that a warning named already
# Dynamo's graph count and _wrapped_graphs when a session last found Dynamo holding no compiled code
# (a new process, or torch._dynamo.reset(), which leaves the count as it was): graphs before that
# cannot run any more.
_counts_when_empty = (0, 0)
_ROOT = re.compile(r"^[LG]\[['\"]([^'\"]+)['\"]\]")
_STEP = re.compile(r"\._modules\[['\"]([^'\"]+)['\"]\]|\[['\"]?([^'\"\]]+)['\"]?\]")
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
_STAND_IN = torch.empty(0)  # counts as a tensor for the args encoder: a node whose value is one


@dataclass
class _RawNode:
    """A node as compiled: what it computes, and the module keys its metadata gives."""

    name: str
    op: str
    inputs: tuple[str, ...]
    args: str
    module_key: int | None  # id() of the innermost module, as nn_module_stack keys it
    module_name: str  # the same module as Dynamo's source expression ("L['self'].blocks.0.fc")
    location: str
    seq_nr: int
    original: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    made_by_pass: bool = False  # no trace of user code (a compiler pass made it): its module is inferred
    recomputed: bool = False  # a forward node copied into the backward graph (GraphNode.recomputed)


@dataclass
class _RawPart:
    kind: str
    nodes: list[_RawNode]
    mutated: tuple[int, ...] = ()
    user_outputs: int = 0
    gm: Any = None  # the part's FX GraphModule
    shadow: Any = None  # its shadow module (_shadow_module), made at its first call; False: none


@dataclass
class RawGraph:
    """What capture knows of one compiled graph, independent of any session's model names."""

    id: str
    compile_id: str
    backend: str
    code: str
    frame_self: Any  # weakref to the compiled frame's ``self`` (a module or an optimizer), or None
    optimizer: bool  # the compiled frame is an optimizer's method
    sources: tuple[str, ...]
    input_names: tuple[str | None, ...]  # "input.0", "attention_mask" for the root model's inputs
    parts: dict[str, _RawPart] = field(default_factory=dict)
    runner: Callable[..., Any] | None = None  # the graphs run op by op (AOT autograd's runtime)
    note: str = ""


class Region:
    """What Dynamo calls instead of the backend's compiled function (see above)."""

    __slots__ = ("compiled", "graph", "__weakref__")

    def __init__(self, compiled: Callable[..., Any], graph: RawGraph) -> None:
        self.compiled = compiled
        self.graph = graph

    def __call__(self, *args: Any) -> Any:
        capture = _ACTIVE
        if capture is None or not capture.recording:
            return self.compiled(*args)
        return capture.call(self, args)


def _wrapped_call_user_compiler(self: Any, gm: Any, *example_inputs: Any) -> Any:
    # torch < 2.3 passes no example inputs: the method reads them from the OutputGraph itself.
    compiled = _ORIGINAL_COMPILER(self, gm, *example_inputs)
    if _ACTIVE is None or not callable(compiled):
        return compiled
    return Region(compiled, _describe(self, gm, example_inputs[0] if example_inputs else self.example_inputs()))


def _describe(output_graph: Any, gm: Any, example_inputs: Any) -> RawGraph:
    """The RawGraph of a graph Dynamo just compiled; never raises (a failure becomes its note)."""
    tx = getattr(output_graph, "root_tx", None)
    code = getattr(tx, "f_code", None)
    f_locals = getattr(tx, "f_locals", None) or {}
    frame_self = f_locals.get("self")
    try:
        from torch._guards import CompileContext

        compile_id = str(CompileContext.current_compile_id() or "")
    except ImportError:  # pragma: no cover - a torch without compile ids
        compile_id = ""
    global _wrapped_graphs
    graph_id = f"g{_wrapped_graphs}"
    _wrapped_graphs += 1
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    sources = tuple(_source_name(getattr(p, "_dynamo_source", None)) for p in placeholders)
    graph = RawGraph(
        id=graph_id,
        compile_id=compile_id,
        backend=_backend_name(getattr(output_graph, "compiler_fn", None)),
        code=f"{os.path.basename(code.co_filename)}:{code.co_firstlineno} {code.co_name}" if code is not None else "",
        frame_self=_weak(frame_self),
        optimizer=isinstance(frame_self, torch.optim.Optimizer),
        sources=sources,
        input_names=_input_names(sources, code, frame_self),
    )
    try:
        _trace_parts(graph, gm, example_inputs)
    except Exception as exc:  # noqa: BLE001 - the user's compile must never fail because of capture
        graph.parts, graph.runner = {}, None
        graph.note = f"AOT autograd could not trace this graph again ({type(exc).__name__}: {exc}); recorded at its boundary only"
    return graph


def _trace_parts(graph: RawGraph, gm: Any, example_inputs: Any) -> None:
    """Run AOT autograd on the Dynamo graph with compilers that keep its parts (see above)."""
    import torch._functorch.config as functorch_config
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import default_partition
    from torch._guards import TracingContext, detect_fake_mode, tracing

    decompositions: Any = None
    partition: Any = default_partition
    fake_mode = detect_fake_mode(example_inputs)
    inductor_fake: Any = contextlib.nullcontext()
    if graph.backend == "inductor":
        from torch._inductor.compile_fx import select_decomp_table
        from torch._inductor.virtualized import V

        decompositions = select_decomp_table()
        from torch._inductor.compile_fx import partition_fn as partition  # joint passes, then min-cut

        # Inductor's joint-graph passes read its fake mode from V, which its own compile sets: the
        # random-seed pass runs on every graph that draws (dropout), and fails without it.
        inductor_fake = V.set_fake_mode(fake_mode)

    def compiler(kind: str) -> Callable[..., Any]:
        def compile_part(part_gm: Any, _inputs: Any) -> Callable[..., Any]:
            nodes = [_raw_node(n, kind == "backward") for n in part_gm.graph.nodes]
            graph.parts[kind] = _RawPart(kind, nodes, gm=part_gm)
            return _boxed(_GraphRunner(part_gm, kind, graph))

        return compile_part

    dynamo_context = TracingContext.try_get()
    # A context of our own: the backend's compile keeps the one Dynamo made, untouched.
    context = TracingContext(fake_mode)
    if dynamo_context is not None:
        # Dynamo hands over the real inputs; AOT autograd finds here how Dynamo made each one fake
        # (its symbols and their sources). Made fake afresh, an input gets symbols of no source in
        # Dynamo's ShapeEnv, and a guard on one (a view's stride) breaks Dynamo's guard building.
        context.tensor_to_context.update(dynamo_context.tensor_to_context)
    # The trace shares Dynamo's ShapeEnv: what it assumes of a size must not become a guard of the
    # user's compiled code (a recompile that an untraced run would not make).
    no_guards = fake_mode.shape_env.suppress_guards() if fake_mode.shape_env is not None else contextlib.nullcontext()
    patch = (
        functorch_config.patch(force_non_lazy_backward_lowering=True)
        if hasattr(functorch_config, "force_non_lazy_backward_lowering")
        else contextlib.nullcontext()
    )
    with tracing(context), no_guards, patch, inductor_fake:
        graph.runner = aot_module_simplified(
            gm,
            list(example_inputs),
            fw_compiler=compiler("forward"),
            bw_compiler=compiler("backward"),
            inference_compiler=compiler("inference"),
            decompositions=decompositions,
            partition_fn=partition,
            keep_inference_input_mutations=True,
        )
    meta = getattr(context, "fw_metadata", None)
    first = graph.parts.get("inference") or graph.parts.get("forward")
    if meta is not None and first is not None:
        first.mutated = tuple(int(i) for i in getattr(meta, "mutated_inp_runtime_indices", ()))
        first.user_outputs = int(getattr(meta, "num_outputs", 0))


def _raw_node(node: Any, backward: bool = False) -> _RawNode:
    """A node's record as compiled (module paths are resolved per session, see RegionCapture)."""
    import operator

    meta = node.meta
    op, inputs, args = node.op, (), "{}"
    if node.op == "call_function":
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            info = op_info(target)
            op = info.name
            inputs, args = _encode_args(info, node.args, node.kwargs)
        elif target is operator.getitem and len(node.args) == 2 and isinstance(node.args[1], int):
            op, args = "getitem", json.dumps({"index": node.args[1]})
            inputs = (node.args[0].name,) if isinstance(node.args[0], torch.fx.Node) else ()
        else:
            op = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)
            inputs = tuple(a.name for a in node.all_input_nodes)
    elif node.op == "output":
        flat = tree_flatten(node.args[0])[0]
        inputs = tuple(a.name if isinstance(a, torch.fx.Node) else "" for a in flat)
    stack = meta.get("nn_module_stack") or meta.get("fwd_nn_module_stack") or {}
    key, qualified = None, ""
    if stack:
        last_key, value = list(stack.items())[-1]
        key = int(last_key) if str(last_key).isdigit() else None
        qualified = str(value[0]) if isinstance(value, tuple) and value else str(value)
    frames = _FRAME.findall(meta.get("stack_trace") or "")
    location = f"{os.path.basename(frames[-1][0])}:{frames[-1][1]}" if frames else ""
    original = meta.get("original_aten")
    shapes, dtypes = _example_shapes(meta.get("val"))
    seq = meta.get("seq_nr", -1)
    return _RawNode(
        name=node.name,
        op=op,
        inputs=tuple(inputs),
        args=args,
        module_key=key,
        module_name=qualified,
        location=location,
        seq_nr=seq if isinstance(seq, int) else -1,
        original=op_info(original).name if isinstance(original, torch._ops.OpOverload) else "",
        shapes=shapes,
        dtypes=dtypes,
        made_by_pass=node.op == "call_function" and not stack and "stack_trace" not in meta and "seq_nr" not in meta,
        recomputed=backward and meta.get("partitioner_tag") == "is_forward",
    )


def _encode_args(info: Any, args: Any, kwargs: Any) -> tuple[tuple[str, ...], str]:
    """A node's arguments as an op's ``args`` JSON: tensor-valued nodes become ``{"tensor": i}``
    in the order their names are returned; nodes of a fixed int (a static size) become the int."""
    import torch

    names: list[str] = []

    def swap(value: Any) -> Any:
        if isinstance(value, torch.fx.Node):
            val = value.meta.get("val")
            if isinstance(val, torch.Tensor):
                names.append(value.name)
                return _STAND_IN
            if isinstance(val, (int, float, bool)) and not isinstance(val, torch.SymInt):
                return val
            return f"<node {value.name}>"  # a symbolic value: not replayable, named for a reader
        if isinstance(value, (list, tuple)):
            return type(value)(swap(v) for v in value)
        return value

    swapped_args = tuple(swap(a) for a in args)
    swapped_kwargs = {k: swap(v) for k, v in kwargs.items()}
    return tuple(names), ArgsEncoder._dump(info, swapped_args, swapped_kwargs)


def _example_shapes(val: Any) -> tuple[tuple[tuple[int, ...], ...], tuple[str, ...]]:
    values = val if isinstance(val, (list, tuple)) else [val]
    shapes, dtypes = [], []
    for v in values:
        if isinstance(v, torch.Tensor):
            shapes.append(tuple(int(s) if isinstance(s, int) else -1 for s in v.shape))
            dtypes.append(str(v.dtype).removeprefix("torch."))
    return tuple(shapes), tuple(dtypes)


def _source_name(source: Any) -> str:
    if source is None:
        return ""
    name = getattr(source, "name", "")
    try:
        return str(name() if callable(name) else name)
    except Exception:  # noqa: BLE001 - a source that cannot name itself
        return type(source).__name__


def _backend_name(fn: Any) -> str:
    for _ in range(4):
        name = getattr(fn, "_compiler_name", None) or getattr(fn, "compiler_name", None)
        if isinstance(name, str):
            return name
        inner = getattr(fn, "_torchdynamo_orig_backend", None)
        if inner is None:
            break
        fn = inner
    name = getattr(fn, "__name__", None)
    return name if isinstance(name, str) else type(fn).__name__


def _input_names(sources: tuple[str, ...], code: Any, frame_self: Any) -> tuple[str | None, ...]:
    """The input names (:mod:`tracecmp.capture.inputs`) of the graph inputs that are the compiled
    module's ``forward`` arguments (Dynamo's resume functions keep the argument names)."""
    if code is None or not isinstance(frame_self, torch.nn.Module):
        return (None,) * len(sources)
    forward = frame_self.forward
    return tuple(name_of_source(source, forward) for source in sources)


def _weak(obj: Any) -> Any:
    try:
        return weakref.ref(obj)
    except TypeError:
        return None


def _qualified_path(qualified: str, prefix: str) -> str:
    """``"L['self'].blocks[0]._modules['fc']"`` as a path below ``prefix``: ``prefix.blocks.0.fc``."""
    hit = _ROOT.match(qualified)
    rest = qualified[hit.end() :] if hit else qualified
    parts: list[str] = []
    position = 0
    while position < len(rest):
        if rest[position] == ".":
            step = _STEP.match(rest, position)
            if step is not None and step.start() == position and rest.startswith("._modules", position):
                parts.append(next(g for g in step.groups() if g))
                position = step.end()
                continue
            end = position + 1
            while end < len(rest) and rest[end] not in ".[":
                end += 1
            parts.append(rest[position + 1 : end])
            position = end
        elif rest[position] == "[":
            step = _STEP.match(rest, position)
            if step is None:
                break
            parts.append(next(g for g in step.groups() if g))
            position = step.end()
        else:
            break
    path = ".".join(p for p in parts if p)
    return f"{prefix}.{path}" if prefix and path else prefix or path


def _boxed(fn: Callable[..., Any]) -> Callable[[list[Any]], Any]:
    """AOT autograd's boxed calling convention: one list of inputs, which the callee may empty."""

    def boxed(args: list[Any]) -> Any:
        values = list(args)
        args.clear()
        return fn(*values)

    boxed._boxed_call = True  # type: ignore[attr-defined]
    return boxed


class _GraphRunner:
    """One part's FX graph run node by node; under a ``compiled="graph"`` recording each node's
    ops are filed under the node's module and source line."""

    def __init__(self, gm: Any, kind: str, graph: RawGraph) -> None:
        self.gm = gm
        self.kind = kind
        self.graph_id = graph.id

    def __call__(self, *args: Any) -> Any:
        capture = _ACTIVE
        call = capture.running(self.graph_id, self.kind) if capture is not None else None
        if call is None:
            return torch.fx.Interpreter(self.gm).run(*args)
        return _NodeInterpreter(self.gm, capture, call).run(*args)


# Backends whose compiled code dispatches every FX node as an eager op: capture records each
# node's value as it ran, and a shadow run would add nothing.
_DISPATCHES_EVERY_NODE = frozenset(
    {"eager", "aot_eager", "aot_eager_decomp_partition", "aot_eager_default_partitioner"}
)


def _shadowable(target: Any) -> bool:
    """Whether a shadow run may call ``target``: it computes, draws nothing and writes nothing (the
    user's random streams and tensors stay as they are)."""
    if isinstance(target, torch._ops.OpOverload):
        info = op_info(target)
        return info.schema and info.record and not info.inplace and not info.collective
    return getattr(target, "__module__", None) == "_operator"  # getitem, the arithmetic of sizes


def _draws(n: Any) -> bool:
    """Whether node ``n`` draws random numbers: a random op, unless each of its drop probabilities is
    off (a fused attention kernel at ``dropout_p=0.0``)."""
    info = op_info(n.target) if isinstance(n.target, torch._ops.OpOverload) else None
    if info is None or not info.random:
        return False
    if not info.dropout:
        return True
    for (position, name), off in info.dropout:
        value = n.args[position] if 0 <= position < len(n.args) else n.kwargs.get(name, off)
        if value != off:
            return True
    return False


_NOTED: dict[str, tuple[Any, tuple[int, ...]]] = {}  # what the shadow run now running measured


def _note(name: str, value: Any) -> None:
    """Called by a shadow module after node ``name``: keeps its value's statistics and shape."""
    if isinstance(value, torch.Tensor) and value.numel():
        _NOTED[name] = (tensor_stats_row(value) if value.is_cpu else stats_tensor_reference(value), tuple(value.shape))


def _shadow_module(gm: Any) -> Any:
    """A copy of graph part ``gm`` that calls :func:`_note` after each computing node of a float
    value and returns nothing, without the nodes that draw or write (and what reads them).

    Generated code runs the nodes at the cost of the eager ops themselves: an interpreter's
    per-node Python overhead would be more than a small compiled step."""
    graph = torch.fx.Graph()
    copied: dict[Any, Any] = {}
    for n in gm.graph.nodes:
        if n.op == "output":
            graph.output(None)
            continue
        left_out = n.op == "call_function" and (not _shadowable(n.target) or _draws(n))
        if left_out or any(i not in copied for i in n.all_input_nodes):
            continue
        copied[n] = graph.node_copy(n, copied.__getitem__)
        if n.op == "call_function" and _measured(n):
            graph.call_function(_note, (n.name, copied[n]))
    return torch.fx.GraphModule(gm, graph)


def _measured(n: Any) -> bool:
    """Whether a node's value gets statistics: a float tensor that is not a view of its input. A
    node of several values is left out: its first may be no eager op's (``var_mean``'s variance,
    inside a layer norm), and its getitems take the values on."""
    value = n.meta.get("val")
    is_view = isinstance(n.target, torch._ops.OpOverload) and op_info(n.target).kind == "view"
    return isinstance(value, torch.Tensor) and value.is_floating_point() and not is_view


def _shadow_values(part: _RawPart, args: tuple[Any, ...]) -> dict[str, tuple[Any, tuple[int, ...]]]:
    """Each computing node's statistics (as :func:`tensor_stats_row` or, on a device, a packed
    tensor) and shape, from graph part ``part`` run with eager kernels on its inputs ``args``.

    Fused code dispatches nothing: this is the only record of what its nodes computed. Nothing of
    the user's changes: capture's mode, autograd and autocast are off (the graph holds autocast's
    casts already), random and writing nodes do not run (nor what reads them).
    """
    placeholders = [n for n in part.gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(args) or not all(_fits(p.meta.get("val"), a) for p, a in zip(placeholders, args)):
        return {}  # the part takes other inputs than the region (AOT autograd merged or added some)
    if part.shadow is None:
        try:
            part.shadow = _shadow_module(part.gm)
        except Exception:  # noqa: BLE001 - a graph that cannot be copied is not shadowed
            part.shadow = False
    if part.shadow is False:
        return {}
    devices = sorted({a.device.index or 0 for a in args if isinstance(a, torch.Tensor) and a.is_cuda})
    _NOTED.clear()
    # No node that draws runs; the generators are kept all the same, should a kernel draw unasked.
    with torch.random.fork_rng(devices=devices), _disable_current_modes(), torch.no_grad(), torch._C._DisableAutocast():
        try:
            part.shadow(*args)
        except Exception:  # noqa: BLE001 - what ran before the failure is kept
            pass
    values = dict(_NOTED)
    _NOTED.clear()
    return values


def _fits(example: Any, value: Any) -> bool:
    if isinstance(example, torch.Tensor):
        return isinstance(value, torch.Tensor) and value.dtype == example.dtype and value.dim() == example.dim()
    return not isinstance(value, torch.Tensor)


def _host_values(
    values: dict[str, tuple[Any, tuple[int, ...]]],
) -> dict[str, tuple[tuple[float, ...], tuple[int, ...]]]:
    """Shadow statistics as ``(min, max, mean, norm)`` floats; a device's packed rows are read in
    one transfer."""
    packed = [(name, stats) for name, (stats, _) in values.items() if isinstance(stats, torch.Tensor)]
    rows = {}
    if packed:
        with _disable_current_modes():  # capture's own reading, not an op of the program
            rows = dict(zip((n for n, _ in packed), torch.stack([p for _, p in packed]).cpu().tolist()))
    return {
        name: (tuple(float(x) for x in rows.get(name, stats)[:4]), shape) for name, (stats, shape) in values.items()
    }


class _NodeInterpreter(torch.fx.Interpreter):
    def __init__(self, gm: Any, capture: RegionCapture, call: _Call) -> None:
        super().__init__(gm)
        self._capture = capture
        self._call = call

    def run_node(self, n: Any) -> Any:
        if n.op != "call_function":
            return super().run_node(n)
        return self._capture.run_node(self._call, n, super().run_node)


@dataclass
class _Call:
    """A region call being recorded."""

    graph: CompiledGraph
    part: str
    how: str  # boundary | graph
    module: str
    location: str
    first_op: int
    inputs: list[int]
    rows: Any  # the mode's row buffer when the call began (a flush in between swaps it)
    row0: int
    forward: int = -1
    node_ops: dict[str, tuple[int, ...]] = field(default_factory=dict)
    shadow: dict[str, tuple[Any, tuple[int, ...]]] = field(default_factory=dict)  # _shadow_values

    @functools.cached_property
    def nodes(self) -> dict[str, GraphNode]:
        part = self.graph.parts.get(self.part)
        return {n.name: n for n in part.nodes} if part is not None else {}

    def record(self, step: int, op_id: int, last_op: int, outputs: list[int]) -> RegionCall:
        return RegionCall(
            graph=self.graph.id,
            part=self.part,
            mode=self.how,
            step=step,
            op_id=op_id,
            first_op=self.first_op,
            last_op=last_op,
            inputs=tuple(self.inputs),
            outputs=tuple(outputs),
            forward=self.forward,
            nodes=dict(self.node_ops),
            values=_host_values(self.shadow),
        )


class RegionCapture:
    """A session's capture of compiled regions: wraps what Dynamo compiles while the session is
    open, records each call of a compiled region while it records, and hands the records to the
    writer with each chunk (:meth:`take`). ``how`` is ``"boundary"`` or ``"graph"``
    (:mod:`tracecmp.trace.compiled` says what each records); a boundary call of fused code also
    records its forward nodes' statistics (:func:`_shadow_values`)."""

    def __init__(self, mode: Any, scope: Any, locator: Any, how: str) -> None:
        self.mode = mode
        self.scope = scope
        self.locator = locator
        self.how = how
        self.recording = False
        self.notes: list[str] = []
        self._graphs: dict[str, CompiledGraph] = {}  # RawGraph id -> as named in this session
        self._new: list[CompiledGraph] = []  # not handed to the writer yet
        self._calls: list[RegionCall] = []
        self._forward: _Call | None = None
        self._backward: list[_Call] = []
        self._cancel: Callable[[], None] | None = None
        self._modules: dict[tuple[str, str], str] = {}  # (graph, part) -> the region's module
        self._matches: dict[tuple[Any, ...], list[int | None]] = {}  # dispatched ops -> their nodes, per graph part

    # -- installation ----------------------------------------------------------------------------
    def install(self) -> None:
        global _ACTIVE
        if TORCH_VERSION < (2, 2):
            # Dynamo guards compiled code on the global module hooks there: in a session every graph
            # compiles again, and regions would describe those copies, not the user's code.
            self.notes.append("torch < 2.2: compiled code is recorded as the dispatcher sees it, without regions")
            return
        _ACTIVE = self
        self._cancel = when_imported(self._patch)

    def _patch(self) -> None:
        global _ORIGINAL_COMPILER, _warned_unseen, _counts_when_empty
        from torch._dynamo import convert_frame
        from torch._dynamo.output_graph import OutputGraph
        from torch._dynamo.utils import counters

        if _ORIGINAL_COMPILER is None:
            _ORIGINAL_COMPILER = OutputGraph.call_user_compiler
            OutputGraph.call_user_compiler = _wrapped_call_user_compiler
        compiled = counters["stats"]["unique_graphs"]
        if not convert_frame.output_codes.seen_ids:  # no live code Dynamo made: nothing compiled can run
            _counts_when_empty, _warned_unseen = (compiled, _wrapped_graphs), 0
        unseen = (compiled - _counts_when_empty[0]) - (_wrapped_graphs - _counts_when_empty[1])
        if unseen > 0:
            note = (
                f"{unseen} graph(s) were compiled in this process before tracing began (Dynamo's count "
                "since it last held no compiled code): a call of one is recorded as the dispatcher sees it "
                "(no region boundary; inductor's fused kernels unseen, their inputs named after nothing). "
                "Start TraceCompare before the compiled model's first call (steps= picks the recorded "
                "steps) to record them as regions."
            )
            self.notes.append(note)  # every session's manifest says so
            if unseen > _warned_unseen:  # a warning once per graph, not at every later session
                _warned_unseen = unseen
                warnings.warn(f"tracecmp: {note}", stacklevel=4)

    def remove(self) -> None:
        global _ACTIVE, _ORIGINAL_COMPILER
        if self._cancel is not None:
            self._cancel()
            self._cancel = None
        if _ORIGINAL_COMPILER is not None:
            from torch._dynamo.output_graph import OutputGraph

            OutputGraph.call_user_compiler = _ORIGINAL_COMPILER
            _ORIGINAL_COMPILER = None
        if _ACTIVE is self:
            _ACTIVE = None
        self.recording = False

    def take(self) -> dict[str, Any] | None:
        """The graphs first called and the calls finished since the last take, as a chunk's record."""
        if not self._new and not self._calls:
            return None
        payload = {"graphs": [g.to_json() for g in self._new], "calls": [c.to_json() for c in self._calls]}
        self._new, self._calls = [], []
        return payload

    # -- a call -----------------------------------------------------------------------------------
    def call(self, region: Region, args: tuple[Any, ...]) -> Any:
        raw = region.graph
        graph = self._resolved(raw)
        mode, scope = self.mode, self.scope
        part = "inference" if "inference" in graph.parts else "forward"
        phase = "optimizer" if mode.in_optimizer or raw.optimizer else "forward"
        module = self._region_module(graph, part)
        location = self.locator.location(1)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        self._name_inputs(raw, args)
        first = mode._next_op
        in_ids = mode.tensor_ids(tensors, phase, module, location)
        how = "graph" if self.how == "graph" and raw.runner is not None and part in graph.parts else "boundary"
        call = _Call(graph, part, how, module, location, first, in_ids, mode.rows, len(mode.rows))
        seq0 = _get_sequence_nr()
        if how == "graph":
            self._forward = call
            try:
                out = raw.runner(*args)
            finally:
                self._forward = None
        else:
            raw_part = raw.parts.get(part)
            if raw.backend not in _DISPATCHES_EVERY_NODE and raw_part is not None and raw_part.gm is not None:
                # Fused code dispatches nothing: its forward nodes' statistics come from a shadow run (a
                # compiled bench's too, whatever it saves). Before the compiled code runs: it may write
                # its inputs, which the graph reads as they were.
                call.shadow = _shadow_values(raw_part, args)
            out = region.compiled(*args)
        seq1 = _get_sequence_nr()
        leaves = tree_flatten(out)[0]
        outs = _unique([t for t in leaves if isinstance(t, torch.Tensor)])
        if how == "boundary":
            written_at = graph.parts[part].mutated if part in graph.parts else ()
            written = _unique([args[i] for i in written_at if i < len(args) and isinstance(args[i], torch.Tensor)])
            fresh = [t for t in outs if not _among(t, tensors)]
            op_id, ids = mode.append_node(BOUNDARY_OPS[part], graph.id, phase, module, location, in_ids, fresh, written)
            known = {**{id(t): i for t, i in zip(tensors, in_ids)}, **dict(zip(map(id, fresh), ids[len(written) :]))}
            self._tag(call, len(mode.rows) - 1)
        else:
            op_id, known = -1, {id(t): _or(mode.ids.current(t), -1) for t in outs}
        # One id per returned value, in order (-1: not a tensor), as the graph's outputs are.
        out_ids = [known.get(id(v), -1) if isinstance(v, torch.Tensor) else -1 for v in leaves]
        self._calls.append(call.record(mode.step, op_id, mode._next_op - 1, out_ids))
        node = _aot_node(outs, seq0, seq1)
        if node is not None:
            scope.claim(node._sequence_nr(), module, location)
            if part == "forward":
                self._watch_backward(node, graph, how, module, in_ids, first)
        return out

    def running(self, graph_id: str, kind: str) -> _Call | None:
        """The graph-mode call whose part ``kind`` of graph ``graph_id`` runs now, if recorded."""
        if not self.recording:
            return None
        call = self._forward if kind != "backward" else (self._backward[-1] if self._backward else None)
        if call is None or call.graph.id != self._graphs.get(graph_id, call.graph).id or call.how != "graph":
            return None
        return call

    def run_node(self, call: _Call, n: Any, run: Callable[[Any], Any]) -> Any:
        """Run one FX node of a graph-mode call, its ops filed under the node's module and line."""
        node = call.nodes.get(n.name)
        mode, scope = self.mode, self.scope
        first, rows, row0 = mode._next_op, mode.rows, len(mode.rows)
        scope.enter(node.module if node is not None and node.module else call.module)
        try:
            result = run(n)
        finally:
            scope.leave()
        if mode._next_op > first:
            call.node_ops[n.name] = tuple(range(first, mode._next_op))
        if node is not None and node.location and mode.rows is rows:
            for index in range(row0, len(rows)):
                rows.set(index, "location", node.location)
        return result

    # -- backward ---------------------------------------------------------------------------------
    def _watch_backward(
        self, node: Any, graph: CompiledGraph, how: str, module: str, fw_inputs: list[int], fw_first: int
    ) -> None:
        holder: list[_Call] = []

        def begins(grad_outputs: Any) -> None:
            if _ACTIVE is not self or not self.recording:
                return
            mode = self.mode
            location = self.locator.location(1)
            grads = [g for g in grad_outputs if isinstance(g, torch.Tensor)]
            first = mode._next_op
            grad_ids = mode.tensor_ids(grads, "backward", module, location)
            call = _Call(
                graph,
                "backward",
                how,
                module,
                location,
                first,
                [*fw_inputs, *grad_ids],
                mode.rows,
                len(mode.rows),
                forward=fw_first,
            )
            holder[:] = [call]
            self._backward.append(call)

        def ends(grad_inputs: Any, grad_outputs: Any) -> None:
            if not holder or not self._backward or self._backward[-1] is not holder[0]:
                return
            call = self._backward.pop()
            holder.clear()
            mode = self.mode
            outs = _unique([g for g in grad_inputs if isinstance(g, torch.Tensor)])
            if call.how == "boundary":
                op_id, ids = mode.append_node(
                    BOUNDARY_OPS["backward"], graph.id, "backward", module, call.location, call.inputs, outs
                )
                known = dict(zip(map(id, outs), ids))
                self._tag(call, len(mode.rows) - 1)
            else:
                op_id, known = -1, {id(t): _or(mode.ids.current(t), -1) for t in outs}
            # One id per gradient the backward returned, None ones as -1: the graph's outputs.
            out_ids = [known.get(id(g), -1) if isinstance(g, torch.Tensor) else -1 for g in grad_inputs]
            self._calls.append(call.record(mode.step, op_id, mode._next_op - 1, out_ids))

        node.register_prehook(begins)
        node.register_hook(ends)

    # -- names -----------------------------------------------------------------------------------
    def _resolved(self, raw: RawGraph) -> CompiledGraph:
        """``raw`` with module paths in this session's names; noted for the writer at first use."""
        graph = self._graphs.get(raw.id)
        if graph is not None:
            return graph
        owner = raw.frame_self() if raw.frame_self is not None else None
        frame_path = (self.scope.path_of_module(owner) or "") if isinstance(owner, torch.nn.Module) else ""
        parts = {
            kind: GraphPart(
                kind,
                _fill_modules(part.nodes, [self._node(n, frame_path) for n in part.nodes]),
                part.mutated,
                part.user_outputs,
            )
            for kind, part in raw.parts.items()
        }
        graph = CompiledGraph(raw.id, raw.compile_id, raw.backend, raw.code, frame_path, raw.sources, parts, raw.note)
        self._graphs[raw.id] = graph
        self._new.append(graph)
        return graph

    def _node(self, n: _RawNode, frame_path: str) -> GraphNode:
        module = self.scope.path_of(n.module_key) if n.module_key is not None else None
        if module is None:
            module = _qualified_path(n.module_name, frame_path) if n.module_name else frame_path
        return GraphNode(
            n.name, n.op, n.inputs, n.args, module, n.location, n.seq_nr, n.original, n.shapes, n.dtypes, n.recomputed
        )

    def _region_module(self, graph: CompiledGraph, part: str) -> str:
        """The compiled frame's module, else the deepest module every node of the part lies in."""
        key = (graph.id, part)
        if key not in self._modules:
            nodes = graph.parts[part].nodes if part in graph.parts else ()
            paths = [n.module.split(".") for n in nodes if n.op not in ("placeholder", "output")]
            common = ".".join(os.path.commonprefix(paths)) if paths else ""
            self._modules[key] = graph.module or common
        return self._modules[key]

    def _name_inputs(self, raw: RawGraph, args: tuple[Any, ...]) -> None:
        inputs = self.scope.inputs
        for value, name in zip(args, raw.input_names):
            if name and isinstance(value, torch.Tensor) and id(value) not in inputs:
                inputs[id(value)] = (name, weakref.ref(value))

    def _tag(self, call: _Call, end: int) -> None:
        """File the ops a boundary call's compiled code dispatched (rows ``row0`` to ``end``) under
        the FX nodes they run, by the longest common subsequence of op names (``aten.mm.out``
        runs an ``aten.mm`` node); ops of no node (AOT autograd's own detaches) keep the region's."""
        rows = call.rows
        if self.mode.rows is not rows:
            return  # handed to the writer mid-call (a full buffer): left as recorded
        part = call.graph.parts.get(call.part)
        nodes = [n for n in part.nodes if n.op not in ("placeholder", "output", "getitem")] if part is not None else []
        recorded = [(index, row[0], row[3], row[4]) for index, row in zip(range(call.row0, end), rows.rows(call.row0))]
        candidates = [r for r in recorded if r[2] == "op" or (r[2] == "view" and r[3] != ALIAS_UPDATE_OP)]
        keys = tuple(_op_key(r[3]) for r in candidates)
        # Compiled code dispatches the same ops at every call: the matching is made once.
        match = self._matches.get((call.graph.id, call.part, keys))
        if match is None:
            match = [None] * len(candidates)
            matcher = difflib.SequenceMatcher(None, keys, [_op_key(n.op) for n in nodes], autojunk=False)
            for block in matcher.get_matching_blocks():
                for k in range(block.size):
                    match[block.a + k] = block.b + k
            self._matches[(call.graph.id, call.part, keys)] = match
        node_of = {r[0]: nodes[m] for r, m in zip(candidates, match) if m is not None}
        matched: dict[str, list[int]] = {}
        for index, op_id, _, _ in recorded:
            node = node_of.get(index)
            if node is not None:
                matched.setdefault(node.name, []).append(op_id)
            rows.set(index, "module", node.module if node is not None and node.module else call.module)
            # A line of the compiled code ("<eval_with_key>.3:26") means nothing to a reader.
            rows.set(index, "location", node.location if node is not None and node.location else call.location)
        call.node_ops.update({k: tuple(v) for k, v in matched.items()})


def _fill_modules(raw: list[_RawNode], nodes: list[GraphNode]) -> tuple[GraphNode, ...]:
    """Nodes a compiler pass made (inductor's pattern replacements) carry no module stack: they
    take the deepest module shared by the nearest nodes around them that have one. (A node of
    user code outside any module has none either, and keeps the frame's.)"""
    known = {r.name for r in raw if not r.made_by_pass}
    by_name = {n.name: n for n in nodes}
    users: dict[str, list[str]] = {}
    for n in nodes:
        for i in n.inputs:
            users.setdefault(i, []).append(n.name)
    out = []
    for n in nodes:
        if n.name in known or n.op in ("placeholder", "output"):
            out.append(n)
            continue
        found: list[list[str]] = []
        for step in (lambda name: by_name[name].inputs if name in by_name else (), lambda name: users.get(name, ())):
            frontier, seen = [n.name], {n.name}
            for _ in range(4):  # a few hops: the neighbours of a replaced pattern
                frontier = [m for name in frontier for m in step(name) if m not in seen and not seen.add(m)]
                hits = [by_name[m].module for m in frontier if m in known]
                if hits:
                    found.extend(h.split(".") for h in hits)
                    break
        module = ".".join(os.path.commonprefix(found)) if found else n.module
        out.append(replace(n, module=module))
    return tuple(out)


def _op_key(op: str) -> tuple[str, str]:
    parts = op.split(".")
    return (parts[0], parts[1]) if len(parts) >= 2 else (op, "")


def _aot_node(outs: list[Any], first: int, end: int) -> Any:
    """The autograd node AOT autograd made for this call (``CompiledFunctionBackward``), if any."""
    todo = [t.grad_fn for t in outs if t.grad_fn is not None]
    seen: set[int] = set()
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        seq = node._sequence_nr()
        if not first <= seq < end:
            continue
        if node.name() == "CompiledFunctionBackward":
            return node
        todo.extend(next_node for next_node, _ in node.next_functions)
    return None


def _among(t: Any, tensors: list[Any]) -> bool:
    return any(t is other for other in tensors)


def _unique(tensors: list[Any]) -> list[Any]:
    seen: set[int] = set()
    out = []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _or(value: int | None, default: int) -> int:
    return default if value is None else value
