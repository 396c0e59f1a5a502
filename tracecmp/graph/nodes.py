"""The typed records of a rank's graph that the judges walk: a recorded node, and a tensor's
measured state against the bench. Ids, names and numbers, never tensors.

>>> Node(7, 0, "forward", "op", "aten.gelu.default", "gelu", "mlp.act", "train.py:42", "{}", [3], [8], False, "").module
'mlp.act'
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple


class Node(NamedTuple):
    """One recorded node of a rank (an op, a view or a source), as the judges walk it."""

    op_id: int
    step: int
    phase: str
    kind: str  # "op", "view", "source", ...
    op: str  # the overload, "aten.gelu.default"
    name: str  # a source's name ("fc1.weight"), else the op's
    module: str
    location: str  # the user's source line
    args: str  # the recorded non-tensor arguments (JSON)
    inputs: list[int]  # tensor ids read
    outputs: list[int]  # tensor ids written
    random: bool  # the call drew random numbers
    stack: str


@dataclass(slots=True)
class TensorState:
    """What localization knows about one target tensor's error (views resolve to their base)."""

    known: bool  # compared against a bench tensor (or estimated from known inputs)
    exact: bool  # bitwise identical to its partner
    e_ext: float = 0.0
    e_sys: float = 0.0
    e_rms: float = math.nan  # only with whole tensors
    amax: float = 0.0
    rms: float = 0.0
    numel: int = 0
    lo: float = 0.0  # bench min/max/mean, for inverse and normalization factors
    hi: float = 0.0
    mean: float = 0.0
    nonfinite: bool = False  # the target tensor itself holds NaN/Inf
    is_float: bool = True
    uninit: bool = False  # uninitialized memory: never an input's error
    measured: bool = False
    nonfinite_mismatch: bool = False
    unit: float = 0.0
    same_dtype: bool = True
    tainted: bool = False  # carries error from a root
    # Its NaN/Inf differ from the bench's only where the program handed an op a NaN/Inf (a causal
    # mask of -inf against the bench's finfo.min): given, not computed.
    given: bool = False
    # A mask each run filled with its own dtype's finfo.min or max (metrics.FILLS): its magnitudes
    # are the fill's, its errors those of its finite elements (see at_finite_scale).
    filled: bool = False

    # Error carried on to consumers: the measurement, raised towards what the inputs predicted when a
    # measurement came out lucky (statistics are single samples of a random error), see carried_error.
    c_ext: float = -1.0
    c_sys: float = -1.0
    c_rms: float = -1.0

    def __post_init__(self) -> None:
        if self.c_ext < 0:
            self.c_ext, self.c_sys, self.c_rms = self.e_ext, self.e_sys, self.e_rms

    @property
    def spread(self) -> float:
        """How far the values lie around their tensor-wide mean: sqrt(rms^2 - mean^2)."""
        return math.sqrt(max(self.rms * self.rms - self.mean * self.mean, 0.0))

    @property
    def mix_level(self) -> float:
        """Rms-relative error estimate for ops that mix many elements: the error at the extremes,
        converted half-way (geometric mean) between "proportional to magnitude" and "uniform"."""
        ext_as_rms = self.c_ext * math.sqrt(self.amax / self.rms) if self.rms > 0 else self.c_ext
        return max(ext_as_rms, self.c_sys, 0.0 if math.isnan(self.c_rms) else self.c_rms)

    @property
    def level(self) -> float:
        """Rms-relative error estimate (conservative): the largest of what the statistics show."""
        ext_as_rms = self.c_ext * self.amax / self.rms if self.rms > 0 else self.c_ext
        return max(ext_as_rms, self.c_sys, 0.0 if math.isnan(self.c_rms) else self.c_rms)
