"""From a recorded op to calls of torch: which calls an op makes (a ``_foreach_*`` op one per
list element), whether it can be replayed at all, and running it on given inputs.

>>> register_reference("npu.fast_gelu.default", lambda x: torch.nn.functional.gelu(x, approximate="tanh"))  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from tracecmp.aten.args import decode_call
from tracecmp.aten.schema import op_info, outputs_in_order, resolve
from tracecmp.numerics.replay.records import Call, RecordedOp

_UNINITIALIZED = ("aten.empty", "aten.new_empty", "aten.empty_like", "aten.empty_strided", "aten._empty")


_COLLECTIVES = ("c10d.", "_c10d_functional.", "c10d_functional.", "_dtensor.")


_REFERENCES: dict[str, Callable[..., Any]] = {}


def register_reference(name: str, reference: Callable[..., Any]) -> None:
    """Give replay a CPU reference for an operator the CPU cannot run (a device-only custom op).

    ``reference`` is called like the operator (its schema's arguments, tensors on the CPU, in
    float64 for the reference replay and in the recorded dtypes for the honest one) and returns
    what the operator returns. An operator with a CPU kernel of its own (``torch.library`` with a
    "cpu" or composite implementation) needs none.

    >>> register_reference("npu.fast_gelu.default", lambda x: torch.nn.functional.gelu(x, approximate="tanh"))  # doctest: +SKIP
    """
    if not callable(reference):
        raise TypeError("reference must be callable")
    _REFERENCES[name] = reference


def _has_cpu_kernel(func: Any) -> bool:
    try:
        return bool(torch._C._dispatch_has_computed_kernel_for_dispatch_key(func.name(), "CPU"))
    except (AttributeError, RuntimeError):
        return True  # no way to ask: let the call decide


def static_skip_reason(op: RecordedOp) -> str:
    """Why ``op`` cannot be replayed from any trace ("" when it can be tried): what it is, not
    what the trace holds (see :class:`Replayer` for missing inputs)."""
    if op.kind != "op":
        return "not a computing op (a view, a source or an alias update)"
    if op.draws():
        return "random op: a replay would draw other numbers"
    if op.name.startswith(_UNINITIALIZED):
        return "uninitialized memory (empty): nothing to check"
    if op.name.startswith(_COLLECTIVES) or "all_reduce" in op.name or "all_gather" in op.name:
        return "collective: its result needs the other ranks"
    func = resolve(op.name)
    if func is None:
        return f"this torch has no operator {op.name} (a device-only op whose library is not loaded)"
    if not hasattr(func, "_schema"):
        return "operator without a schema"
    if op.name not in _REFERENCES and not _has_cpu_kernel(func):
        return "no CPU kernel (a device-only op; tracecmp.register_reference gives it one)"
    args = op.arguments()
    if args is None:
        return "its arguments were not recorded"
    opaque = _opaque(args)
    if opaque:
        return f"it takes an object the trace could only name ({opaque})"
    return ""


def _opaque(value: Any) -> str:
    if isinstance(value, str) and value.startswith("<"):
        return value
    if isinstance(value, dict):
        return next((o for o in map(_opaque, value.values()) if o), "")
    if isinstance(value, list):
        return next((o for o in map(_opaque, value) if o), "")
    return ""


def calls_of(op: RecordedOp, args: dict[str, Any]) -> list[Call]:
    """The calls that make up ``op``: itself, or one per list element of a ``_foreach_*`` or fused
    optimizer op (elementwise per element, so memory stays that of one parameter, not the model's)."""
    whole = [Call(op, args, tuple(op.inputs), tuple(op.outputs))]
    base = op.name.split(".")[1] if op.name.count(".") >= 2 else ""
    if not base.startswith(("_foreach_", "_fused_")):
        return whole
    func = resolve(op.name)
    schema = getattr(func, "_schema", None)
    if schema is None:
        return whole
    lists = {
        a.name: len(args[a.name])
        for a in schema.arguments
        if a.name in args
        and isinstance(args[a.name], list)
        and str(a.real_type).startswith(("List[", "Optional[List["))
    }
    lengths = {n for n in lists.values() if n}
    if len(lengths) != 1:
        return whole
    (count,) = lengths
    if count < 2:
        return whole
    # Output groups in capture's order: list returns, then written list arguments.
    info = op_info(func)
    groups: list[int] = []
    for ret in schema.returns:
        if not str(ret.real_type).startswith("List["):
            return whole
        groups.append(count)
    for _, name in info.extra_writes:
        groups.append(lists.get(name, -1))
    if any(g not in (0, count) for g in groups) or sum(groups) != len(op.outputs):
        return whole
    calls = []
    for i in range(count):
        used: list[int] = []

        # Called at once, within this iteration: it means this call's ``used``.
        def pick(value: Any) -> Any:
            if isinstance(value, dict) and set(value) == {"tensor"}:
                index = value["tensor"]
                if not isinstance(index, int) or not 0 <= index < len(op.inputs):
                    raise ValueError
                used.append(op.inputs[index])  # noqa: B023
                return {"tensor": len(used) - 1}  # noqa: B023
            if isinstance(value, list):
                return [pick(v) for v in value]
            return value

        try:
            sub = {
                name: (pick([value[i]]) if name in lists and lists[name] == count else pick(value))
                for name, value in args.items()
            }
        except ValueError:
            return whole
        outputs, offset = [], 0
        for size in groups:
            if size:
                outputs.append(op.outputs[offset + i])
            offset += size
        calls.append(Call(op, sub, tuple(used), tuple(outputs)))
    return calls


_LAST_ERROR: list[str] = [""]  # the message of the latest call that raised (for the skip reason)


def last_error() -> str:
    text = _LAST_ERROR[0].strip().splitlines()[0][:160] if _LAST_ERROR[0].strip() else ""
    return f" ({text})" if text else ""


def invoke(
    name: str, recorded: dict[str, Any], inputs: list[torch.Tensor], *, golden: bool
) -> tuple[Any, tuple, dict] | None:
    """Run op ``name`` with ``recorded`` arguments on ``inputs``; ``golden`` promotes floating
    values to float64. Returns (result, args, kwargs) so written arguments can be read back, or None."""
    func = resolve(name)
    if func is None or not hasattr(func, "_schema"):
        return None
    call = decode_call(func, recorded, inputs, golden=golden)
    if call is None:
        return None
    args, kwargs = call
    target = _REFERENCES.get(name, func)
    try:
        with torch.no_grad():
            result = target(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - an op that will not run on the CPU or in float64 is simply not replayed
        _LAST_ERROR[0] = f"{type(exc).__name__}: {exc}"
        if golden or not any(isinstance(t, torch.Tensor) and t.dtype in _HALVES for t in inputs):
            return None
        return _invoke_widened(func, target, recorded, inputs)
    return result, tuple(args), kwargs


_HALVES = (torch.float16, torch.bfloat16)


def _invoke_widened(
    func: Any, target: Any, recorded: dict[str, Any], inputs: list[torch.Tensor]
) -> tuple[Any, tuple, dict] | None:
    """An honest float16/bfloat16 kernel where this CPU has none (torch 2.1 lacks float16 matmul
    and softmax, for one): the op computed in float32 on the recorded inputs and each output
    rounded once to the dtype the op gives (read from its meta kernel), which is what such kernels
    do (they accumulate in float32). None when the output dtypes cannot be known."""
    from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

    def meta(v: Any) -> Any:
        return (
            torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta") if isinstance(v, torch.Tensor) else v
        )

    wide = [t.float() if isinstance(t, torch.Tensor) and t.dtype in _HALVES else t for t in inputs]
    low = decode_call(func, recorded, inputs, golden=False)
    call = decode_call(func, recorded, wide, golden=False)
    if low is None or call is None:
        return None
    args, kwargs = call
    try:
        with torch.no_grad():
            shapes = func(*tree_map(meta, low[0]), **tree_map(meta, low[1]))  # dtypes of the low-precision call
            result = target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - not even in float32: not replayed (the first error is the reason)
        return None
    expected, _ = tree_flatten(shapes)
    flat, spec = tree_flatten(result)
    if len(expected) != len(flat):
        return None
    rounded = [
        v.to(m.dtype) if isinstance(v, torch.Tensor) and isinstance(m, torch.Tensor) else v
        for v, m in zip(flat, expected)
    ]
    # Arguments the op wrote (in-place, out=) go back to their recorded dtypes too.
    back = {id(w): t.dtype for w, t in zip(wide, inputs) if isinstance(t, torch.Tensor) and w is not t}

    def narrow(v: Any) -> Any:
        return v.to(back[id(v)]) if isinstance(v, torch.Tensor) and id(v) in back else v

    return tree_unflatten(rounded, spec), tuple(tree_map(narrow, tuple(args))), tree_map(narrow, kwargs)


def returned_tensors(name: str, result: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The op's tensors in the order capture numbered its outputs."""
    return outputs_in_order(resolve(name), result, args, kwargs)
