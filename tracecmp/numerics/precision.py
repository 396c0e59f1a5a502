"""At what precision a run may have computed its float32 matmul/conv, from what its trace records.

A float32 matmul may run at reduced precision (TF32 on GPUs, HF32 on NPUs, bf16 under
``torch.set_float32_matmul_precision("medium")``); both judges then hold such calls to that
precision's rounding, not float32's.
"""

from __future__ import annotations

from tracecmp.trace.reader import Trace


def reduced_precision_possible(trace: Trace) -> bool:
    """Could this run have computed float32 matmul/conv at reduced precision (TF32, HF32)?

    Yes on any accelerator (cuDNN allows TF32 convolutions by default; NPUs use HF32), when
    ``torch.get_float32_matmul_precision()`` was not "highest", and for traces that do not
    record the switches; no for CPU runs at full precision, whose float32 matmuls then differ
    only by summation order.

    >>> reduced_precision_possible(tracecmp.load("runs/bench"))  # doctest: +SKIP
    False
    """
    flags = trace.manifest.get("determinism")
    if not isinstance(flags, dict) or "float32_matmul_precision" not in flags:
        return True
    if flags["float32_matmul_precision"] != "highest":
        return True
    return any(not trace.rank(r).device.startswith("cpu") for r in trace.ranks)


def reduced_matmul_precision(*traces: Trace) -> str:
    """The precision float32 matmul/conv may run at when allowed to: "bf16" where a trace recorded
    ``torch.set_float32_matmul_precision("medium")``, else "tf32" (TF32, or HF32 on NPUs)."""
    for trace in traces:
        flags = trace.manifest.get("determinism")
        if isinstance(flags, dict) and flags.get("float32_matmul_precision") == "medium":
            return "bf16"
    return "tf32"
