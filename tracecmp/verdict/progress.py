"""The one-line progress bar on stderr that compare, the many-rank compare and check draw."""

from __future__ import annotations

import sys
import time

WIDTH = 30  # characters of the bar itself


def shown(forced: bool | None, large: bool) -> bool:
    """Whether to draw: as ``forced`` when given, else on a terminal and for ``large`` work only."""
    return forced if forced is not None else (sys.stderr.isatty() and large)


def shown_anywhere(forced: bool | None, large: bool) -> bool:
    """Whether to report: as ``forced`` when given, else for ``large`` work, on a terminal or not
    (a log file or a CI job gets a line per tenth done, see :class:`Progress`)."""
    return forced if forced is not None else large


class Progress:
    """``tracecmp COMMAND [####      ] ...`` redrawn in place with ``\\r``; silent unless ``enabled``.
    Where stderr is no terminal (a log, a CI job) it writes a whole line instead, each time another
    tenth is done or the stage changes.

    After the bar comes the share done, the stage's ``label`` padded to ``label_width`` and the
    seconds elapsed in ``time_width`` characters; ``rate`` (a unit, "ops") puts how many per second
    before the time. With ``unit`` ("ranks") the line ends in the count done instead ("1/2 ranks").
    """

    def __init__(
        self,
        command: str,
        enabled: bool,
        total: int,
        *,
        label_width: int = 28,
        time_width: int = 5,
        rate: str = "",
        unit: str = "",
    ) -> None:
        self.command, self.enabled = command, enabled
        self.total, self.done = max(total, 1), 0
        self.label_width, self.time_width, self.rate, self.unit = label_width, time_width, rate, unit
        self.label = ""
        self.start = time.monotonic()
        self.terminal = sys.stderr.isatty()
        self._written = (-1, "")  # (tenths done, stage) of the last line written off a terminal

    def update(self, label: str | None = None, advance: int = 0) -> None:
        """Count ``advance`` more done, name the stage ``label`` (if given) and redraw."""
        self.done += advance
        if label is not None:
            self.label = label
        if not self.enabled:
            return
        frac = min(self.done / self.total, 1.0)
        if not self.terminal:
            mark = (int(frac * 10), self.label)
            if mark != self._written:
                self._written = mark
                elapsed = time.monotonic() - self.start
                sys.stderr.write(f"tracecmp {self.command}: {frac:4.0%} {self.label} ({elapsed:.1f}s)\n")
                sys.stderr.flush()
            return
        line = f"\rtracecmp {self.command} [{'#' * int(frac * WIDTH):<{WIDTH}}]"
        if self.unit:
            line += f" {self.done}/{self.total} {self.unit}"
        else:
            elapsed = time.monotonic() - self.start
            line += f" {frac:4.0%} {self.label:<{self.label_width}}"
            if self.rate:
                line += " " + (f"{self.done / elapsed:6.0f} {self.rate}/s" if elapsed > 0.5 and self.done else "")
            line += f" {elapsed:{self.time_width}.1f}s"
        sys.stderr.write(line)
        sys.stderr.flush()

    def close(self) -> None:
        """End the line (when drawn)."""
        if self.enabled and self.terminal:
            sys.stderr.write("\n")
            sys.stderr.flush()
