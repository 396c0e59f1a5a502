"""The one progress bar: each command's line as it has always read, drawn only when enabled."""

from __future__ import annotations

import sys

import pytest

from tracecmp.verdict import progress
from tracecmp.verdict.progress import Progress, shown, shown_anywhere


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    return now


def test_compare_check_and_ranks_lines(
    clock: list[float], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    bar = Progress("compare", True, 3)
    clock[0] += 1.25
    bar.update("rank 0: measuring", 1)
    bar.close()
    check = Progress("check", True, 200, label_width=26, time_width=6, rate="ops")
    check.update("rank 0: replaying")
    clock[0] += 2.0
    check.update(advance=50)
    ranks = Progress("compare", True, 2, unit="ranks")
    ranks.update(advance=1)
    assert capsys.readouterr().err == (
        f"\rtracecmp compare [{'#' * 10:<30}]  33% {'rank 0: measuring':<28}   1.2s\n"
        f"\rtracecmp check [{'':<30}]   0% {'rank 0: replaying':<26}     0.0s"
        f"\rtracecmp check [{'#' * 7:<30}]  25% {'rank 0: replaying':<26}     25 ops/s    2.0s"
        f"\rtracecmp compare [{'#' * 15:<30}] 1/2 ranks"
    )


def test_silent_unless_enabled(capsys: pytest.CaptureFixture[str]) -> None:
    bar = Progress("check", False, 10)
    bar.update("x", 5)
    bar.close()
    assert bar.done == 5 and capsys.readouterr().err == ""
    assert shown(True, False) and not shown(False, True)


def test_off_a_terminal_a_line_per_tenth_and_stage(clock: list[float], capsys: pytest.CaptureFixture[str]) -> None:
    check = Progress("check", True, 100)
    check.update("rank 0: self-checks")
    for _ in range(25):
        clock[0] += 0.5
        check.update(advance=1)
    check.update("rank 0: statistics")
    check.close()
    assert capsys.readouterr().err.splitlines() == [
        "tracecmp check:   0% rank 0: self-checks (0.0s)",
        "tracecmp check:  10% rank 0: self-checks (5.0s)",
        "tracecmp check:  20% rank 0: self-checks (10.0s)",
        "tracecmp check:  25% rank 0: statistics (12.5s)",
    ]
    assert shown_anywhere(None, True) and not shown_anywhere(None, False) and not shown_anywhere(False, True)
