"""A disk that fills up or turns read-only, or a permission lost, during capture.

Capture stops recording with one warning, the training goes on untouched, and the trace stays
readable and says it is incomplete, why, and which steps it keeps whole. ``on_error="raise"``
fails fast instead.

The full disk is a real 256 KiB tmpfs where this machine lets the test mount one (root), and also,
everywhere, the trace writer's own file calls failing once the same quota is used up, which is
what its code sees on a full disk: ``write`` raising ``OSError(ENOSPC)``, space given back when
a file is removed.
"""

from __future__ import annotations

import builtins
import errno
import os
import shutil
import subprocess
import uuid
import warnings
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import tracecmp
import tracecmp.trace.writer as writer_module
from tracecmp.cli.inspect import summarize
from workloads.models import example_batch, make_model, make_optimizer, train_step

QUOTA = 256 << 10
STEPS = 6


class _Quota:
    """The trace writer's ``open`` on a disk of ``budget`` bytes holding the folder ``root``:
    a write that would take more than the space left fails with ``error``, and every write fails
    after :meth:`break_now` (a folder turned read-only, a permission lost). Removing files gives
    their space back, as on a real disk."""

    def __init__(self, root: Path, error: int, budget: int) -> None:
        self.root, self.error, self.budget, self.broken = root, error, budget, False

    def break_now(self, error: int | None = None) -> None:
        self.error = self.error if error is None else error
        self.broken = True

    def fail(self) -> OSError:
        return OSError(self.error, os.strerror(self.error))

    def used(self, besides: Path) -> int:
        return sum(f.stat().st_size for f in self.root.rglob("*") if f.is_file() and f != besides)

    def open(self, file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if "w" not in mode:
            return builtins.open(file, mode, *args, **kwargs)
        if self.broken:
            raise self.fail()
        return _QuotaFile(builtins.open(file, mode, *args, **kwargs), Path(file), self)


class _QuotaFile:
    def __init__(self, handle: Any, path: Path, quota: _Quota) -> None:
        self._handle, self._path, self._quota, self._written = handle, path, quota, 0

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        quota = self._quota
        if quota.broken or quota.used(self._path) + self._written + size > quota.budget:
            raise quota.fail()
        self._written += size
        return self._handle.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)

    def __enter__(self) -> "_QuotaFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._handle.close()


class SmallDisk:
    """A folder on a small disk: a tmpfs when mounting works here, else the writer's quota."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch, *, mount: bool) -> None:
        self.root = root
        self.quota: _Quota | None = None
        self.mounted = mount and _mount_tmpfs(root)
        if not self.mounted:
            self.quota = _Quota(root, errno.ENOSPC, QUOTA)
            monkeypatch.setattr(writer_module, "open", self.quota.open, raising=False)

    def make_read_only(self, error: int = errno.EROFS) -> None:
        if self.mounted:
            subprocess.run(["mount", "-o", "remount,ro", str(self.root)], check=True, timeout=30)
        else:
            assert self.quota is not None
            self.quota.break_now(error)

    def release(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.root)], check=False, timeout=30)


def _mount_tmpfs(root: Path) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={QUOTA}", f"tracecmp-test-{uuid.uuid4().hex[:8]}", str(root)],
        capture_output=True,
        timeout=30,
    )
    return result.returncode == 0


@pytest.fixture(params=["tmpfs", "failing-writer"])
def small_disk(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SmallDisk]:
    """Both kinds everywhere: "tmpfs" falls back to the failing writer where mounting is not allowed."""
    root = tmp_path / "disk"
    root.mkdir()
    disk = SmallDisk(root, monkeypatch, mount=request.param == "tmpfs")
    try:
        yield disk
    finally:
        disk.release()


def _train(path: Path | None, *, on_step: Any = None, **options: Any) -> tuple[list[torch.Tensor], list[str]]:
    """Train the MLP for STEPS steps (traced into ``path`` unless None); its parameters and the
    warnings capture gave."""
    torch.manual_seed(0)
    model, batch = make_model("mlp"), example_batch("mlp")
    opt = make_optimizer(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if path is None:
            for _ in range(STEPS):
                train_step(model, opt, batch)
        else:
            with tracecmp.TraceCompare(path, model=model, flush_secs=0, **options) as tc:
                for step in range(STEPS):
                    train_step(model, opt, batch)
                    tc.step()
                    if on_step is not None:
                        on_step(tc, step)
    found = [str(w.message) for w in caught if issubclass(w.category, tracecmp.CaptureWarning)]
    return [p.detach().clone() for p in model.parameters()], found


def _assert_untouched(params: list[torch.Tensor]) -> None:
    reference, _ = _train(None)
    assert all(torch.equal(a, b) for a, b in zip(params, reference)), "the training changed"


def _assert_kept_whole_steps(path: Path, reason: str | None) -> list[int]:
    trace = tracecmp.load(path)
    assert trace.complete is False
    steps = trace.rank(0).manifest["steps"]
    assert steps == list(range(len(steps))) and len(steps) < STEPS
    ops = trace.to_frame()
    for step in steps:
        assert set(ops[ops["step"] == step]["phase"]) == {"forward", "backward", "optimizer"}
    stopped = trace.rank(0).stopped
    if reason is not None:
        assert stopped is not None and stopped["kind"] == "write-error" and reason in stopped["reason"]
        assert stopped["last_step"] == (steps[-1] if steps else None)
        assert reason in summarize(path)
    return steps


def test_a_full_disk_stops_recording_with_one_warning_and_the_training_goes_on(small_disk: SmallDisk) -> None:
    path = small_disk.root / "run"
    params, warned = _train(path, data="tensors")  # ~90 KB a step: the disk fills in step 2 or 3
    assert len(warned) == 1, warned
    assert "No space left on device" in warned[0] and "the run goes on" in warned[0] and str(path) in warned[0]
    _assert_untouched(params)
    steps = _assert_kept_whole_steps(path, "No space left on device")
    assert steps, "the first chunk fits on the disk"
    assert not list((path / "rank0").glob("*.tmp"))  # the half-written chunk gave its space back


def test_on_error_raise_fails_fast_on_a_full_disk(small_disk: SmallDisk) -> None:
    with pytest.raises(tracecmp.CaptureWriteError, match="No space left on device"):
        _train(small_disk.root / "run", data="tensors", on_error="raise")
    _assert_kept_whole_steps(small_disk.root / "run", "No space left on device")


def test_a_folder_turned_read_only_stops_recording(small_disk: SmallDisk) -> None:
    path = small_disk.root / "run"

    def turn_read_only(tc: tracecmp.TraceCompare, step: int) -> None:
        if step == 1:
            tc.sync()  # steps 0 and 1 are on disk before the folder turns read-only
            small_disk.make_read_only()

    params, warned = _train(path, on_step=turn_read_only)
    assert len(warned) == 1 and "Read-only file system" in warned[0], warned
    _assert_untouched(params)
    # The manifest cannot say why (the folder is read-only): it still says incomplete.
    assert _assert_kept_whole_steps(path, None) == [0, 1]


def test_a_permission_lost_stops_recording(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # As root no chmod takes a permission away: the writer's file calls fail as they would.
    quota = _Quota(tmp_path, errno.EACCES, 1 << 40)
    monkeypatch.setattr(writer_module, "open", quota.open, raising=False)
    path = tmp_path / "run"

    def lose_permission(tc: tracecmp.TraceCompare, step: int) -> None:
        if step == 1:
            tc.sync()
            quota.break_now()

    params, warned = _train(path, on_step=lose_permission)
    assert len(warned) == 1 and "Permission denied" in warned[0], warned
    _assert_untouched(params)
    assert _assert_kept_whole_steps(path, None) == [0, 1]


def test_a_folder_that_cannot_be_created_is_an_error_at_once(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(tracecmp.CaptureWriteError, match="cannot write the trace") as caught:
        with tracecmp.TraceCompare(blocker / "run"):
            pass
    assert str(blocker / "run") in str(caught.value)
