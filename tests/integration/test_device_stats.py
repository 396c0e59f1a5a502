"""Statistics of accelerator tensors: computed on the device, brought to the host once per chunk.

On an accelerator a host sync per op would serialise the device queue. The ops that force one are
known: ``_local_scalar_dense`` (``.item()``, ``bool(t)``), data-dependent shapes (``nonzero``,
``masked_select``, boolean-mask indexing) and copies to another device. A recorder mode entered
*outside* the capture sees every op the capture itself runs, so the test can count them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tracecmp
from tracecmp.capture import mode as capture_mode
from tracecmp.capture.stats import reference_stats, stats_tensor_reference, unpack_stats

SYNCING = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
    torch.ops.aten.is_nonzero.default,
}


class SyncCounter(TorchDispatchMode):
    """Counts ops that would block the host on an accelerator."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.ops += 1
        boolean_index = func is torch.ops.aten.index.Tensor and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None
        )
        to_host = func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default) and (
            kwargs.get("device") is not None or func is torch.ops.aten.copy_.default
        )
        if func in SYNCING or boolean_index or to_host:
            self.syncs.append(str(func))
        return func(*args, **kwargs)


@pytest.mark.parametrize(
    "values",
    [
        torch.tensor([1.0, float("nan"), -2.0, float("inf")]),
        torch.tensor([float("nan"), float("nan")]),
        torch.tensor([], dtype=torch.float32),
        torch.tensor(3.5, dtype=torch.bfloat16),
        torch.arange(7, dtype=torch.int32),
        torch.tensor([True, False, True]),
        torch.randn(5, 3, dtype=torch.float16).t(),
    ],
    ids=["nan-inf", "all-nan", "empty", "0-dim-bf16", "int", "bool", "fp16-strided"],
)
def test_device_statistics_need_no_host_sync_and_match_the_definition(values: torch.Tensor) -> None:
    counter = SyncCounter()
    with counter:
        packed = stats_tensor_reference(values)
    assert counter.syncs == [], f"per-tensor statistics synced the host: {counter.syncs}"
    assert packed.device == values.device and packed.dtype == torch.float64
    got, want = unpack_stats(packed), reference_stats(values)
    for name, a, b in zip(got._fields, got, want):
        assert a == b or (a != a and b != b), name


def test_capture_on_a_device_syncs_once_per_chunk_not_per_op(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = capture_mode.CaptureMode._device

    def as_accelerator(self: capture_mode.CaptureMode, device: torch.device) -> tuple[str, int]:
        name, kind = real(self, device)
        return name, capture_mode._DEFERRED if kind == capture_mode._CPU else kind

    monkeypatch.setattr(capture_mode.CaptureMode, "_device", as_accelerator)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    x = torch.randn(4, 8)
    counter = SyncCounter()
    flushes: list[int] = []
    gather = capture_mode.CaptureMode._gather_deferred_stats

    def counting_gather(self: capture_mode.CaptureMode) -> None:
        flushes.append(len(counter.syncs))
        gather(self)

    monkeypatch.setattr(capture_mode.CaptureMode, "_gather_deferred_stats", counting_gather)
    with counter:
        with tracecmp.TraceCompare(tmp_path / "t", model=model) as tc:
            for _ in range(2):
                model(x).sum().backward()
                tc.step()
    ops = tracecmp.load(tmp_path / "t").to_frame()
    recorded = int((ops["kind"] == "op").sum())
    assert recorded > 20
    # Before each flush nothing synced: every sync belongs to the flush that gathers the chunk.
    assert flushes and flushes[0] == 0
    per_flush = [b - a for a, b in zip(flushes, flushes[1:] + [len(counter.syncs)])]
    assert max(per_flush) <= 2, f"syncs per flush: {per_flush} for {recorded} recorded ops"
