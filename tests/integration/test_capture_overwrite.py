"""An existing trace is never replaced silently: a second capture into its folder is refused
unless asked to overwrite it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import tracecmp


def _capture(path: Path, steps: int, **options: object) -> None:
    with tracecmp.TraceCompare(path, **options) as tc:
        for step in range(steps):
            torch.ones(3).mul(step + 1).sum()
            tc.step()


def test_a_second_capture_into_a_trace_is_refused_and_the_trace_kept(tmp_path: Path) -> None:
    path = tmp_path / "run"
    _capture(path, 3)
    with pytest.raises(
        tracecmp.TraceExistsError, match=r"already holds a trace.*overwrite=True \(CLI: --force\)"
    ) as caught:
        _capture(path, 1)
    assert str(path) in str(caught.value)
    trace = tracecmp.load(path)
    assert trace.complete and trace.rank(0).manifest["steps"] == [0, 1, 2]


def test_overwrite_replaces_the_trace_and_what_a_larger_run_left(tmp_path: Path) -> None:
    path = tmp_path / "run"
    _capture(path, 3)
    # An earlier run with two ranks left rank1/ behind.
    shutil.copytree(path / "rank0", path / "rank1")
    manifest = json.loads((path / "rank1" / "manifest.json").read_text())
    (path / "rank1" / "manifest.json").write_text(json.dumps({**manifest, "rank": 1}))
    (path / "notes.txt").write_text("the user's own file")
    _capture(path, 1, overwrite=True)
    trace = tracecmp.load(path)
    assert trace.ranks == [0] and trace.rank(0).manifest["steps"] == [0]
    assert not (path / "rank1").exists()
    assert (path / "notes.txt").read_text() == "the user's own file"  # only trace files are removed


def test_a_folder_with_a_foreign_manifest_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "run"
    path.mkdir()
    (path / "manifest.json").write_text('{"name": "some other tool"}')
    with pytest.raises(tracecmp.TraceExistsError):
        _capture(path, 1)
    assert json.loads((path / "manifest.json").read_text()) == {"name": "some other tool"}


def test_a_trace_that_lost_its_manifests_is_still_refused(tmp_path: Path) -> None:
    path = tmp_path / "run"
    _capture(path, 2)
    (path / "manifest.json").unlink()
    (path / "rank0" / "manifest.json").unlink()
    with pytest.raises(tracecmp.TraceExistsError, match="chunk-00000.json"):
        _capture(path, 1)


def test_an_existing_folder_without_a_trace_is_used(tmp_path: Path) -> None:
    path = tmp_path / "run"
    path.mkdir()
    (path / "README").write_text("bench run of 2024-05-01")
    _capture(path, 1)
    assert tracecmp.load(path).complete
    assert (path / "README").exists()
