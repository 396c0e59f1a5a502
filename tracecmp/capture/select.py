"""Which ops a ``data="tensors"`` capture saves tensors for: ``TraceCompare(..., only=...)``.

A whole model's tensors for one step can be many times the model's size. The seeds' workflow
narrows down instead: capture statistics, find the suspicious region, then capture tensors for
that region only. ``only`` restricts the saved tensors to the ops that match every criterion
given (each a list of alternatives); statistics are still recorded for every op, so the trace
stays whole and comparable.

* ``modules``: dotted module paths; an op matches when its module is one of them or inside one
  (``"transformer.h.3"`` takes ``transformer.h.3.attn.c_attn`` too); ``""`` is the top level only.
  Backward ops belong to the module whose forward made them, as everywhere in tracecmp.
* ``ops``: op names, as an overload (``"aten.mm.default"``), a packet (``"aten.mm"``) or a base
  name (``"mm"``).
* ``steps``: step numbers. ``phases``: "forward", "backward", "optimizer".

A selected op's outputs are saved, and so are its inputs, when it runs (also those made by ops
outside the selection or in an earlier chunk): everything a replay of the op needs.

>>> only = Selection.of({"modules": ["blocks.1"], "steps": [0]})
>>> only.matches(0, "backward", "blocks.1.mlp.act", "aten.gelu_backward.default")
True
>>> str(only)
'only={"modules": ["blocks.1"], "steps": [0]}'
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from tracecmp.errors import CaptureError
from tracecmp.trace.schema import PHASES

_FIELDS = ("modules", "ops", "steps", "phases")


@dataclass(frozen=True)
class Selection:
    """The ops a tensors capture keeps tensors for (see the module docstring); empty fields match all."""

    modules: tuple[str, ...] = ()
    ops: tuple[str, ...] = ()
    steps: tuple[int, ...] = ()
    phases: tuple[str, ...] = ()

    @classmethod
    def of(cls, value: Selection | Mapping[str, Any] | str) -> Selection:
        """A selection from a :class:`Selection`, a mapping with the fields above, or the text
        ``"modules=a,b;ops=mm;steps=0,1"`` (the form ``tracecmp`` command lines take)."""
        if isinstance(value, Selection):
            return value
        if isinstance(value, str):
            value = _parse(value)
        if not isinstance(value, Mapping):
            raise CaptureError(
                f"only must be a mapping like {{'modules': [...], 'steps': [...]}}, not {type(value).__name__}"
            )
        unknown = sorted(set(value) - set(_FIELDS))
        if unknown:
            raise CaptureError(f"only has unknown field(s) {unknown}; use {list(_FIELDS)}")
        modules = _strings(value.get("modules"), "modules")
        ops = _strings(value.get("ops"), "ops")
        phases = _strings(value.get("phases"), "phases")
        bad = [p for p in phases if p not in PHASES]
        if bad:
            raise CaptureError(f"only: unknown phase(s) {bad}; use {list(PHASES)}")
        steps_value = value.get("steps")
        try:
            steps = tuple(sorted({int(s) for s in _items(steps_value)})) if steps_value is not None else ()
        except (TypeError, ValueError):
            raise CaptureError(f"only: steps must be step numbers, not {steps_value!r}") from None
        if any(s < 0 for s in steps):
            raise CaptureError("only: steps must not be negative")
        selection = cls(modules, ops, steps, phases)
        if not (modules or ops or steps or phases):
            raise CaptureError("only selects nothing narrower than everything: give modules, ops, steps or phases")
        return selection

    def matches(self, step: int, phase: str, module: str, op: str) -> bool:
        """Whether an op recorded with these facts gets its tensors saved."""
        if self.steps and step not in self.steps:
            return False
        if self.phases and phase not in self.phases:
            return False
        if self.modules and not any(module == m or (m and module.startswith(m + ".")) for m in self.modules):
            return False
        if self.ops:
            parts = op.split(".")
            packet = ".".join(parts[:2])
            base = parts[1] if len(parts) >= 2 else op
            if not any(name in (op, packet, base) for name in self.ops):
                return False
        return True

    def to_dict(self) -> dict[str, list[Any]]:
        """The non-empty fields, as JSON-able lists (what the run manifest records)."""
        return {name: list(getattr(self, name)) for name in _FIELDS if getattr(self, name)}

    def __str__(self) -> str:
        return "only=" + json.dumps(self.to_dict())

    def command_line(self) -> str:
        """The same as text for a command line: ``modules=a,b;steps=0``."""
        return ";".join(f"{k}={','.join(str(x) for x in v)}" for k, v in self.to_dict().items())

    def code(self, path: str = "runs/target") -> str:
        """A capture line to paste: ``TraceCompare("runs/target", model=model, data="tensors", only={...})``."""
        return f'tracecmp.TraceCompare("{path}", model=model, data="tensors", {self})'


def around(records: Iterable[Any], *, top: int = 3) -> Selection | None:
    """A selection around suspects (records with ``module`` and ``step``, first ones first): their
    modules in their steps, for a re-run that saves tensors there only; None without suspects."""
    modules: list[str] = []
    steps: set[int] = set()
    for record in records:
        if len(modules) >= top and record.module not in modules:
            continue
        if record.module not in modules:
            modules.append(record.module)
        steps.add(int(record.step))
    if not modules:
        return None
    # Nested suspects need only the outer module.
    kept = [m for m in modules if not any(o and o != m and m.startswith(o + ".") for o in modules)]
    return Selection(modules=tuple(kept), steps=tuple(sorted(steps)))


def _parse(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        key, sep, value = part.partition("=")
        if not sep:
            raise CaptureError(f"only: expected NAME=VALUE[,VALUE...] in {part!r}")
        out[key.strip()] = [v.strip() for v in value.split(",")] if value.strip() else [""]
    return out


def _items(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, (str, int)):
        return [value]
    try:
        return list(value)
    except TypeError:
        raise CaptureError(f"only: expected a list, not {value!r}") from None


def _strings(value: Any, name: str) -> tuple[str, ...]:
    items = _items(value)
    if not all(isinstance(v, str) for v in items):
        raise CaptureError(f"only: {name} must be strings, not {value!r}")
    return tuple(dict.fromkeys(items))
