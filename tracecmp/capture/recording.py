"""A capture session around a whole program (``tracecmp record``): armed before it runs, started
at its first module forward, ended at its last selected step or when it exits.

>>> recording = Recording(None, {"steps": frozenset({0, 1})})   # doctest: +SKIP
>>> recording.arm(); run the program; recording.finish(None)    # doctest: +SKIP
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any, ClassVar

import torch

from tracecmp.capture.folders import rank_and_world
from tracecmp.capture.modules import is_compiling
from tracecmp.capture.session import TraceCompare
from tracecmp.errors import CaptureWriteError, TracecmpError, TraceExistsError
from tracecmp.trace.reader import step_ranges
from tracecmp.trace.writer import existing_trace


class _ProgramSession(TraceCompare):
    """A session that ends itself once its last selected step is on disk."""

    recording: Recording

    def _after_last_step(self) -> None:
        self.__exit__(None, None, None)  # commit, remove every hook and mode: full speed from here
        self.recording.ended_early(self)


class Recording:
    """Capture of a program run by ``tracecmp record``; see the module docstring."""

    _armed: ClassVar[Recording | None] = None  # the recording of this process, from arm() on

    def __init__(
        self,
        path: Path | None,
        options: dict[str, Any],
        *,
        exit_after: bool = False,
        quiet: bool = False,
        program: str = "the program",
    ) -> None:
        self.path = path
        self.options = options
        self.exit_after = exit_after
        self.quiet = quiet
        self.program = program
        self.session: _ProgramSession | None = None
        self._original_call: Any = None  # Module.__call__ while ours stands in for it
        self._rank = rank_and_world()[0]
        self._made = False  # check_folder made the folder (removed again if nothing is recorded)
        self._disowned = False  # this process is a child forked from the recorded one (_disown)

    def say(self, text: str) -> None:
        """One line on stderr, from rank 0 only, unless quiet."""
        if not self.quiet and self._rank == 0:
            print(f"tracecmp: {text}", file=sys.stderr, flush=True)

    def check_folder(self) -> None:
        """Refuse an existing trace or a folder that cannot be made, before the program runs."""
        if self.path is None:
            return
        found = existing_trace(self.path, self._rank)
        if found is not None and not self.options.get("overwrite"):
            raise TraceExistsError(
                f"already holds a trace ({found.relative_to(self.path)}); pass --force to replace it, or choose another -o",
                path=self.path,
            )
        try:
            self._made = not self.path.exists()
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CaptureWriteError(f"cannot make the trace folder: {exc.strerror or exc}", path=self.path) from exc

    def arm(self) -> None:
        """Start capture at the first call of any ``torch.nn.Module``.

        ``Module.__call__`` is wrapped until that call rather than a global module hook installed:
        ``torch.compile``'s wrapper warns about global hooks whenever one exists.
        """
        original = torch.nn.Module.__call__

        def first_call(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            if not is_compiling():  # Dynamo tracing a call: it sees the plain call
                self.disarm()
                self._start()
            return original(module, *args, **kwargs)

        self._original_call = original
        torch.nn.Module.__call__ = first_call  # type: ignore[method-assign]
        Recording._armed = self

    def disarm(self) -> None:
        """Put ``Module.__call__`` back (once armed and not yet called)."""
        if self._original_call is not None:
            torch.nn.Module.__call__ = self._original_call  # type: ignore[method-assign]
            self._original_call = None

    def _disown(self) -> None:
        """In a child forked from the recorded process (a DataLoader worker calling a transform
        module first): never start there, and leave the parent's folder and lines alone at its end.
        A session already running is dropped by its own fork handler (``TraceCompare._disown``)."""
        self._disowned = True
        self.disarm()

    def _start(self) -> None:
        session = _ProgramSession(self.path, **self.options)
        session.recording = self
        session.announce = False
        try:
            session.__enter__()
        except TracecmpError as exc:  # the program goes on, unrecorded
            warnings.warn(f"tracecmp: not recording: {exc}", stacklevel=2)
            return
        self.session = session
        steps = self.options.get("steps")
        which = "every step" if steps is None else f"step{'s' if len(steps) > 1 else ''} {step_ranges(sorted(steps))}"
        self.say(f"recording {which} of {self.program} into {session.path}")

    def ended_early(self, session: TraceCompare) -> None:
        """The last selected step is on disk: report it, and end the program if asked to."""
        self.say(session.summary() + ("" if self.exit_after else "; the program runs on at full speed"))
        if self.exit_after:
            self.say(f"ending the program after step {session.current_step - 1} (--exit-after)")
            raise SystemExit(0)

    def finish(self, error: BaseException | None) -> None:
        """The program ended (``error``: the exception that ended it): end capture, say what it holds."""
        if self._disowned:
            return
        self.disarm()
        session = self.session
        if session is None:
            if self._made and self.path is not None:
                try:
                    self.path.rmdir()  # an empty folder would only look like a trace
                except OSError:
                    pass
            self.say(
                f"nothing recorded: {self.program} never ran the forward of a torch.nn.Module "
                "(tracecmp record starts at the first one; wrap other code in `with tracecmp.TraceCompare():`)"
            )
            return
        if TraceCompare._active is session:
            session.__exit__(type(error) if error is not None else None, error, error.__traceback__ if error else None)
            if session.stopped is None:
                self.say(session.summary())
            elif error is None or isinstance(error, SystemExit):  # an exception carries this as a note
                self.say(f"{session.path} is incomplete ({session.stopped.get('reason')}); it keeps {session.kept()}")


def _disown_after_fork() -> None:
    """In a child forked from the recorded process: see :meth:`Recording._disown`."""
    if Recording._armed is not None:
        Recording._armed._disown()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_disown_after_fork)
