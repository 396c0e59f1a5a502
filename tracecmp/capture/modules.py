"""Module attribution and source names: which module an op ran in, and what a tensor is called.

Forward ops take the module on top of a stack kept by global module forward hooks.

Backward ops belong to the module whose forward created their autograd node. Each autograd node
carries a sequence number from a thread-local counter that only grows; a node is created just
before its op reaches the dispatcher, so while a forward op is dispatched the newest number is its
node's (``torch.autograd._get_sequence_nr() - 1``). When that number is new since the previous op
returned, capture *claims* it for the op's module (an op that makes no node, such as ``argmax``,
finds no new number), and the backward engine later reports the running node
(``torch._C._current_autograd_node()``), whose number leads back to the module. Nodes that no
dispatched op creates (custom ``autograd.Function`` nodes, made before their forward runs with
grad off) are claimed when their module returns: its post-hook walks the outputs' ``grad_fn``
graph and claims every unclaimed node numbered since its pre-hook. Innermost modules return
first, so each node goes to the innermost module that created it. torch's ``ModuleTracker``
instead follows gradient hooks on module inputs and outputs, which files ops under the wrong
module when tensors skip modules (GPT-2's residual stream); sequence numbers do not depend on
which tensors flow where.

Under ``torch.compile`` the hooks do nothing while Dynamo traces them: a hook with side effects
would be traced into the compiled graph (its effects replayed afterwards, or a graph break made
where the user's program has none). Modules run inside a compiled region are known from the
graph's node metadata instead (:mod:`tracecmp.capture.compiled`).
"""

from __future__ import annotations

import weakref
from typing import Any, Iterator

import torch
from torch._C._autograd import _get_sequence_nr
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from tracecmp.capture.inputs import named_inputs
from tracecmp.capture.location import Locator

# Dynamo folds this call to a constant while it traces a hook (True) and never calls it at run time.
is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)

_Named = dict[int, tuple[str, "weakref.ref[Any]"]]


def _tensors_in(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors inside a module's output: tensors, sequences, mappings (transformers' ModelOutput)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 4 and isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item, depth + 1)
    elif depth < 4 and isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item, depth + 1)


def _uncompiled(name: str) -> str:
    """``name`` without the ``_orig_mod`` steps of ``torch.compile``'s wrapper modules."""
    if "_orig_mod" not in name:
        return name
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


def _named(table: _Named, name: str, tensor: Any) -> None:
    """Name ``tensor`` in ``table``, and the local shard a DTensor (FSDP2, tensor parallel) holds:
    capture records the ops on shards (tensorkinds.py), so that is the tensor it meets."""
    table.setdefault(id(tensor), (name, weakref.ref(tensor)))
    local = getattr(tensor, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        table.setdefault(id(local), (name, weakref.ref(local)))


def _fsdp_params(model: torch.nn.Module) -> Iterator[Any]:
    """FSDP2's per-parameter records (``FSDPParam``) of the modules ``fully_shard`` wrapped."""
    for module in model.modules():
        state_of = getattr(module, "_get_fsdp_state", None)
        if state_of is None:
            continue
        group = getattr(state_of(), "_fsdp_param_group", None)
        if group is not None:
            yield from getattr(group, "fsdp_params", ())


def _lookup(table: _Named, obj: Any) -> str | None:
    hit = table.get(id(obj))
    if hit is not None and hit[1]() is obj:
        return hit[0]
    return None


class ModuleScope:
    """Module stack, autograd-node claims and the names of parameters, buffers and inputs."""

    def __init__(self, model: torch.nn.Module | None, locator: Locator) -> None:
        self.model = model
        self.locator = locator
        self.current = ""  # dotted path of the innermost running module
        self.depth = 0
        self.seq_info: dict[int, tuple[str, str]] = {}  # autograd sequence number -> (module, location)
        self.claims = 0  # how many sequence numbers have been claimed so far
        self.claim_floor = 0  # sequence numbers below it were made before the last op returned
        self._stack: list[tuple[str, int, int]] = []  # (path, sequence number at pre-hook, claims then)
        self._modules: _Named = {}
        self.params: _Named = {}
        self.buffers: _Named = {}
        self.inputs: _Named = {}
        self._extra: _Named = {}  # grads and optimizer state, rebuilt lazily
        self._extra_stamp: Any = None
        self._grads: _Named = {}  # parameters' gradients -> their modules, for grad_module
        self.optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._handles: list[Any] = []
        self._marks: list[int] = []
        self._stale = False  # the model may have new modules or parameters since it was named
        self._unnamed: dict[int, weakref.ref[Any]] = {}  # parameters looked for in vain, not to look again
        self.roots: list[str] = []  # class names of the outermost modules found running (no model given)
        if model is not None:
            self.add_root(model)

    # -- names ---------------------------------------------------------------------------------
    def add_root(self, root: torch.nn.Module) -> None:
        """Name ``root``'s modules, parameters and buffers as ``root.named_*()`` does.

        A ``torch.compile``d module (an ``OptimizedModule``, at the root or in place of a
        submodule) takes the names of the module it wraps: ``blocks.0.fc``, not
        ``blocks.0._orig_mod.fc``, as in the uncompiled model a bench run has.
        """
        for name, module in root.named_modules():
            self._modules.setdefault(id(module), (_uncompiled(name), weakref.ref(module)))
        names = {}
        for name, param in root.named_parameters():
            _named(self.params, _uncompiled(name), param)
            names[id(param)] = _uncompiled(name)
        for name, buf in root.named_buffers():
            _named(self.buffers, _uncompiled(name), buf)
        for fsdp_param in _fsdp_params(root):
            # FSDP2 all-gathers a parameter from its padded shard, a tensor of its own: its name too.
            name = names.get(id(getattr(fsdp_param, "sharded_param", None)))
            shard = getattr(fsdp_param, "_sharded_param_data", None)
            if name is not None and isinstance(shard, torch.Tensor):
                _named(self.params, name, shard)

    def unversioned(self) -> list[torch.Tensor]:
        """Parameter tensors written behind their version counters: FSDP2's shards, which the
        optimizer updates through DTensors holding other tensors on the same memory, and its
        unsharded parameters, refilled in place by each all-gather. Their recorded values go
        stale from one step to the next."""
        if self.model is None:
            return []
        found = []
        for fsdp_param in _fsdp_params(self.model):
            sharded = getattr(fsdp_param, "sharded_param", None)
            for t in (
                getattr(fsdp_param, "_sharded_param_data", None),
                getattr(sharded, "_local_tensor", None),
                getattr(fsdp_param, "_unsharded_param", None),
            ):
                if isinstance(t, torch.Tensor):
                    found.append(t)
        return found

    def mark_stale(self) -> None:
        """The model may have changed (a new step): name it again at the next lookup that misses.

        Walking ``named_modules``/``named_parameters`` costs ~0.1 ms per step on a small model,
        as much as recording its ops; most steps never meet a module or parameter they cannot name.
        """
        self._stale = self.model is not None

    def _renamed(self) -> bool:
        """Name the model again if it is stale; whether that happened (a miss is worth a retry)."""
        if not self._stale:
            return False
        self._stale = False
        assert self.model is not None
        self.add_root(self.model)
        return True

    def name_inputs(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Remember the root model's tensor arguments by the ``forward`` parameter they were passed
        for and their path inside it (:mod:`tracecmp.capture.inputs`)."""
        # torch.compile's wrapper takes (*args, **kwargs): the wrapped model's forward names them.
        forward = getattr(module, "_orig_mod", module).forward
        for name, tensor in named_inputs(forward, args, kwargs):
            self.inputs[id(tensor)] = (name, weakref.ref(tensor))

    def source(self, tensor: torch.Tensor, stamp: Any) -> tuple[str, str]:
        """``(op, name)`` of a tensor entering the trace: a parameter, buffer, input or other tensor."""
        for _ in range(2):  # a second look after naming a stale model again
            name = _lookup(self.params, tensor)
            if name is not None:
                return "source.parameter", name
            name = _lookup(self.buffers, tensor)
            if name is not None:
                return "source.buffer", name
            seen = self._unnamed.get(id(tensor))
            if (
                isinstance(tensor, torch.nn.Parameter)
                and self.model is not None
                and (seen is None or seen() is not tensor)
            ):
                # A parameter swapped in during the step (FSDP2's unsharded parameters): look again, once.
                self._unnamed[id(tensor)] = weakref.ref(tensor)
                self._stale = True
            if not self._renamed():
                break
        name = _lookup(self.inputs, tensor)
        if name is not None:
            return "source.input", name
        if self._extra_stamp != stamp:
            self._rebuild_extra()
            self._extra_stamp = stamp
        return "source.tensor", _lookup(self._extra, tensor) or ""

    def grad_module(self, tensors: list[torch.Tensor]) -> str:
        """The module of the parameter whose gradient is among ``tensors`` ("" when none is):
        what an op of backward's final callbacks, which no autograd node runs, belongs to."""
        for fresh in (False, True):
            if fresh:  # gradients are made and replaced as training goes: look at them again, once
                self._grads = {}
                for name, ref in self.params.values():
                    grad = getattr(ref(), "grad", None)
                    if isinstance(grad, torch.Tensor):
                        _named(self._grads, name.rpartition(".")[0], grad)
            for t in tensors:
                module = _lookup(self._grads, t)
                if module is not None:
                    return module
        return ""

    def _rebuild_extra(self) -> None:
        """Name gradients (``fc1.weight.grad``) and optimizer state (``fc1.weight.exp_avg``)."""
        extra: _Named = {}
        params = [(name, ref()) for name, ref in self.params.values()]
        for name, param in params:
            if param is not None and param.grad is not None:
                _named(extra, f"{name}.grad", param.grad)
        names = {id(p): n for n, p in params if p is not None}
        for optimizer in list(self.optimizers):
            for param, state in optimizer.state.items():
                pname = names.get(id(param))
                if pname is None or not isinstance(state, dict):
                    continue
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        _named(extra, f"{pname}.{key}", value)
        self._extra = extra

    def owner(self, param: Any) -> str:
        """Path of the module holding ``param`` ("" if unknown), for gradient accumulation in backward."""
        name = _lookup(self.params, param)
        if name is None and self._renamed():
            name = _lookup(self.params, param)
        return (name or "").rpartition(".")[0]

    # -- hooks ---------------------------------------------------------------------------------
    def install(self) -> None:
        """Start following module calls (called when a recorded step begins)."""
        self.begin_step()
        self._handles = [
            register_module_forward_pre_hook(self._pre),
            register_module_forward_hook(self._post, always_call=True),
        ]
        if self.model is not None:
            self._handles.append(self.model.register_forward_pre_hook(self._root_pre, with_kwargs=True))

    def begin_step(self) -> None:
        """Start a recorded step's bookkeeping (with the hooks installed, or already in place)."""
        self.mark_stale()  # parameters replaced since the last step get names
        self._stack.clear()
        self.inputs.clear()  # a step's inputs are named when its forward starts
        self.current, self.depth = "", 0
        self.claim_floor = _get_sequence_nr()  # nodes made while not recording are not ours
        self._marks.append(self.claim_floor)
        if len(self._marks) > 2:  # keep the claims of this and the previous recorded step
            cutoff = self._marks.pop(0)
            self.seq_info = {s: v for s, v in self.seq_info.items() if s >= cutoff}

    @property
    def hook_handles(self) -> list[Any]:
        """The handles of the hooks installed now (empty between recorded steps)."""
        return list(self._handles)

    def remove(self) -> None:
        """Stop following module calls."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _root_pre(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if is_compiling():
            return
        self.name_inputs(module, args, kwargs)

    def _pre(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if is_compiling():
            return
        path = _lookup(self._modules, module)
        if path is None and self._renamed():
            path = _lookup(self._modules, module)
        if not self._stack and self.model is None:
            # No model given: each top-level module is a root, named "" like named_modules() does.
            if path is None:
                self.add_root(module)
                self.roots.append(type(module).__name__)
                path = ""
            if path == "":
                self.name_inputs(module, args, {})
        elif path is None:
            # A module outside the model's tree: inside a known module it counts as that module,
            # at top level it is "outside any module".
            path = self.current
        self._stack.append((path, _get_sequence_nr(), self.claims))
        self.current, self.depth = path, len(self._stack)

    def _post(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if is_compiling() or not self._stack:
            return
        path, first, claims = self._stack.pop()
        self.current = self._stack[-1][0] if self._stack else ""
        self.depth = len(self._stack)
        end = _get_sequence_nr()
        if end - first > self.claims - claims:
            # Some nodes made during this call were claimed by no op: walk back from the outputs.
            self._claim_graph(output, first, end, (path, self.locator.location(1)))

    def enter(self, path: str) -> None:
        """Run the next ops inside module ``path`` until :meth:`leave` (nodes of a compiled graph,
        whose module comes from the graph's metadata, not from hooks)."""
        self._stack.append((path, _get_sequence_nr(), self.claims))
        self.current, self.depth = path, len(self._stack)

    def leave(self) -> None:
        """End the innermost :meth:`enter`."""
        self._stack.pop()
        self.current = self._stack[-1][0] if self._stack else ""
        self.depth = len(self._stack)

    def path_of(self, module_id: int) -> str | None:
        """Path of the live module whose ``id()`` is ``module_id`` (graph metadata names modules by id)."""
        hit = self._modules.get(module_id)
        if hit is None and self._renamed():
            hit = self._modules.get(module_id)
        return hit[0] if hit is not None and hit[1]() is not None else None

    def path_of_module(self, module: Any) -> str | None:
        """Path of ``module`` in the model, if it is part of it."""
        path = _lookup(self._modules, module)
        if path is None and self._renamed():
            path = _lookup(self._modules, module)
        return path

    def claim(self, seq: int, module: str, location: str) -> None:
        """File the autograd node ``seq`` under ``module`` (its backward ops' module) unless claimed."""
        if seq not in self.seq_info:
            self.seq_info[seq] = (module, location)
            self.claims += 1

    def _claim_graph(self, output: Any, first: int, end: int, entry: tuple[str, str]) -> None:
        todo = [t.grad_fn for t in _tensors_in(output) if t.grad_fn is not None]
        seen: set[int] = set()
        while todo:
            node = todo.pop()
            if node is None:
                continue
            seq = node._sequence_nr()
            if seq < first or seq >= end or seq in seen:
                continue
            seen.add(seq)
            if seq not in self.seq_info:
                self.seq_info[seq] = entry
                self.claims += 1
            todo.extend(next_node for next_node, _ in node.next_functions)
