"""Whether two traces are runs of one model: the parameters they read, by name and shape.

A target and a bench of one model read the same parameters (each with its shape), whatever their
dtypes, devices, kernels or wrappers (DDP's ``module.``, ``torch.compile``'s ``_orig_mod.``).
Two different models (a nanoGPT against a Hugging Face GPT-2) compared op by op give a verdict on
their programs' differences dressed as numerical ones; compare says so first instead.

>>> overlap = ParameterOverlap({("fc.weight", (4, 2)), ("fc.bias", (4,))}, {("fc.weight", (2, 4)), ("fc.bias", (4,))})
>>> round(overlap.unmatched, 2)
0.67
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pandas as pd

from tracecmp.errors import DifferentModels
from tracecmp.trace.reader import Trace

# More than this share of the parameters either run reads without a partner of the same name and
# shape in the other: different models. One model's runs share every parameter; a share this large
# is no selection or wrapper difference.
MAX_UNMATCHED = 0.25
# Fewer parameters than this on a side say too little to tell models apart (a functional program,
# a hand-built trace): no judgment then.
MIN_PARAMETERS = 4
# Wrappers that prefix every parameter's name and change nothing else.
_WRAPPERS = re.compile(r"(?:^|(?<=\.))(?:module|_orig_mod|_fsdp_wrapped_module|_checkpoint_wrapped_module)\.")
_SHOWN = 3  # examples of each kind of mismatch in the message


def _unwrapped(name: str) -> str:
    """A parameter's name without the wrappers' prefixes.

    >>> _unwrapped("module._orig_mod.h.0.attn.weight")
    'h.0.attn.weight'
    """
    return _WRAPPERS.sub("", name)


def parameters_of(trace: Trace, rank: int) -> set[tuple[str, tuple[int, ...]]]:
    """The (unwrapped name, shape) of every parameter the rank's trace reads."""
    ops, tensors = trace.rank(rank).ops, trace.rank(rank).tensors
    sources = ops[ops["op"] == "source.parameter"]
    if sources.empty:
        return set()
    first_output = {op_id: outputs[0] for op_id, outputs in zip(sources["op_id"], sources["outputs"]) if len(outputs)}
    shapes = dict(zip(tensors["tensor_id"].tolist(), tensors["shape"].tolist()))
    return {
        (_unwrapped(name), tuple(int(n) for n in shapes.get(first_output.get(op_id, -1), ())))
        for op_id, name in zip(sources["op_id"].tolist(), sources["name"].tolist())
        if not pd.isna(name) and name
    }


@dataclass(frozen=True)
class ParameterOverlap:
    """The parameters of a target and a bench, as (name, shape)."""

    target: set[tuple[str, tuple[int, ...]]]
    bench: set[tuple[str, tuple[int, ...]]]

    @property
    def unmatched(self) -> float:
        """The share of all parameters that only one run reads (by name and shape)."""
        union = self.target | self.bench
        return len(self.target ^ self.bench) / len(union) if union else 0.0

    @property
    def judged(self) -> bool:
        """Whether both runs read enough parameters to tell."""
        return min(len(self.target), len(self.bench)) >= MIN_PARAMETERS

    def different(self) -> bool:
        """Whether these are two different models."""
        return self.judged and self.unmatched > MAX_UNMATCHED

    def describe(self) -> str:
        """What differs: parameters whose shapes differ, then those only one run has."""
        t_shapes, b_shapes = dict(self.target), dict(self.bench)
        reshaped = sorted(n for n in t_shapes.keys() & b_shapes.keys() if t_shapes[n] != b_shapes[n])
        parts = [
            f"{name} is {list(t_shapes[name])} in the target, {list(b_shapes[name])} in the bench"
            for name in reshaped[:_SHOWN]
        ]
        for side, mine, other in (("target", t_shapes, b_shapes), ("bench", b_shapes, t_shapes)):
            only = sorted(mine.keys() - other.keys())
            if only:
                more = f" and {len(only) - _SHOWN} more" if len(only) > _SHOWN else ""
                parts.append(f"only the {side} has {', '.join(only[:_SHOWN])}{more}")
        return "; ".join(parts)


def require_one_model(target: Trace, bench: Trace, rank: int = 0) -> None:
    """Raise :class:`~tracecmp.errors.DifferentModels` when the rank's two runs are different models.

    >>> require_one_model(tracecmp.load("runs/target"), tracecmp.load("runs/bench"))  # doctest: +SKIP
    """
    if rank not in target.ranks or rank not in bench.ranks:
        return
    overlap = ParameterOverlap(parameters_of(target, rank), parameters_of(bench, rank))
    if overlap.different():
        raise DifferentModels(
            f"the target and bench are different models: {overlap.unmatched:.0%} of parameters unmatched "
            f"by name and shape ({overlap.describe()}); compare runs of one model, or pass --force "
            "(force=True) to compare these anyway",
            path=target.path,
        )
