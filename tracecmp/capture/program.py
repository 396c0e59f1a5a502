"""Running a user's program unchanged, in this process, as ``python`` would (for ``tracecmp record``).

The program is a script, a module (``-m``) or code (``-c``). It runs as ``__main__`` with the
``sys.argv`` and ``sys.path[0]`` that ``python`` gives it, and ends as it would have: its exit
status, its traceback (printed by ``sys.excepthook``, without this module's frames), Ctrl-C ending
the process by SIGINT. A command that names another interpreter, or interpreter options this
process cannot take on after it started (``-O``, ``-X dev`` ...), is run by that interpreter
instead (:func:`reexec_argv`), and a ``torchrun`` command is rewritten so that each worker runs
``tracecmp record`` on the program (:func:`torchrun_argv`).
"""

from __future__ import annotations

import os
import re
import runpy
import shutil
import signal
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tracecmp.errors import TracecmpError

_PYTHON = re.compile(r"^python(\d+(\.\d+)*)?(\.exe)?$")
_OPTIONS_WITH_VALUE = ("-X", "-W", "--check-hash-based-pycs")
_HARMLESS_OPTIONS = ("-u",)  # what this process can still honour after it started


@dataclass
class Program:
    """What to run: ``kind`` is "script", "module" or "code"; ``args`` become ``sys.argv[1:]``."""

    kind: str
    target: str
    args: list[str] = field(default_factory=list)
    python: str | None = None  # the interpreter the command named, if any
    python_options: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return {"script": self.target, "module": f"-m {self.target}", "code": "-c ..."}[self.kind]


def parse_command(argv: list[str]) -> Program:
    """The program of a command line: ``train.py ARGS``, ``python [OPTS] train.py ARGS``,
    ``-m pkg.mod ARGS``, ``python -m pkg.mod ARGS`` or ``python -c CODE ARGS``.

    >>> parse_command(["python", "-u", "train.py", "--lr", "0.1"])
    Program(kind='script', target='train.py', args=['--lr', '0.1'], python='python', python_options=['-u'])
    """
    if not argv:
        raise TracecmpError("no program given: tracecmp record [OPTIONS] -- python train.py ARGS")
    python, options = None, []
    rest = list(argv)
    if _PYTHON.match(Path(rest[0]).name):
        python = rest.pop(0)
    while rest and rest[0].startswith("-") and rest[0] not in ("-m", "-c", "-", "--"):
        if python is None:
            raise TracecmpError(
                f"interpreter option {rest[0]!r} without an interpreter: name it (python {rest[0]} ...)"
            )
        option = rest.pop(0)
        options.append(option)
        if option in _OPTIONS_WITH_VALUE and rest:
            options.append(rest.pop(0))
    if rest and rest[0] == "--":
        rest.pop(0)
    if not rest:
        raise TracecmpError("no script, -m module or -c code in the command")
    if rest[0] in ("-m", "-c"):
        if len(rest) < 2:
            raise TracecmpError(f"{rest[0]} needs an argument")
        return Program("module" if rest[0] == "-m" else "code", rest[1], rest[2:], python, options)
    if rest[0] == "-":
        raise TracecmpError("a program read from stdin cannot be recorded; save it to a file")
    return Program("script", rest[0], rest[1:], python, options)


def needs_other_interpreter(program: Program) -> bool:
    """True when the command names an interpreter other than this one, or options it cannot take on now."""
    if any(option not in _HARMLESS_OPTIONS for option in program.python_options):
        return True
    if program.python is None:
        return False
    found = shutil.which(program.python) or program.python
    try:
        return not os.path.samefile(found, sys.executable)
    except OSError:
        return True


def reexec_argv(program: Program, record_argv: list[str]) -> list[str]:
    """``python [OPTS] -m tracecmp record RECORD_ARGV -- PROGRAM`` for the interpreter the command named."""
    python = shutil.which(program.python or "") or program.python or sys.executable
    target = {"script": [program.target], "module": ["-m", program.target], "code": ["-c", program.target]}[
        program.kind
    ]
    return [python, *program.python_options, "-m", "tracecmp", "record", *record_argv, "--", *target, *program.args]


def is_torchrun(argv: list[str]) -> bool:
    """``torchrun ...`` or ``python -m torch.distributed.run ...``."""
    if not argv:
        return False
    if Path(argv[0]).name in ("torchrun", "torchrun.exe"):
        return True
    return _PYTHON.match(Path(argv[0]).name) is not None and argv[1:3] == ["-m", "torch.distributed.run"]


def torchrun_argv(argv: list[str], record_argv: list[str]) -> list[str]:
    """The same torchrun launch with each worker running ``python -m tracecmp record RECORD_ARGV -- PROGRAM``.

    >>> torchrun_argv(["torchrun", "--nproc-per-node", "2", "train.py", "--lr", "1"], ["--steps", "0"])
    ['torchrun', '--nproc-per-node', '2', '-m', 'tracecmp', 'record', '--steps', '0', '--', 'train.py', '--lr', '1']
    """
    from torch.distributed.run import get_args_parser

    head = 1 if Path(argv[0]).name.startswith("torchrun") else 3
    launcher, rest = argv[:head], argv[head:]
    try:
        parsed = get_args_parser().parse_args(rest)
    except SystemExit:
        raise TracecmpError(f"cannot read the torchrun command: {' '.join(argv)}") from None
    if parsed.no_python:
        raise TracecmpError("torchrun --no-python runs an executable, not a Python program: nothing to record")
    script_at = len(rest) - len(parsed.training_script_args) - 1
    options = [token for token in rest[:script_at] if token not in ("-m", "--module")]
    program = (["-m"] if parsed.module else []) + [parsed.training_script, *parsed.training_script_args]
    return [*launcher, *options, "-m", "tracecmp", "record", *record_argv, "--", *program]


@dataclass
class Outcome:
    """How the program ended: its exit status, and the exception that ended it (if any)."""

    status: int
    exception: BaseException | None = None
    interrupted: bool = False  # an unhandled KeyboardInterrupt: end the process by SIGINT


def run_program(program: Program, before_exit: Callable[[BaseException | None], None]) -> Outcome:
    """Run ``program`` as ``__main__`` here; ``before_exit(exception)`` runs once it ended, before
    its traceback is printed (it ends the capture, adding notes to the exception)."""
    if "-u" in program.python_options:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.reconfigure(write_through=True)  # type: ignore[union-attr]
            except (AttributeError, ValueError):
                pass
    saved_argv, saved_path0 = sys.argv, sys.path[0] if sys.path else None
    error: BaseException | None = None
    try:
        if program.kind == "script":
            script = Path(program.target)
            if not script.exists():
                raise FileNotFoundError(
                    f"can't open file {str(script.resolve())!r}: [Errno 2] No such file or directory"
                )
            sys.argv = [program.target, *program.args]
            _set_path0(str(script.resolve().parent))  # python resolves links for sys.path[0]
            if script.is_file():
                _run_script(os.path.abspath(program.target))
            else:  # a folder or zip file with a __main__.py
                runpy.run_path(program.target, run_name="__main__")
        elif program.kind == "module":
            sys.argv = [program.target, *program.args]  # run_module puts the module's file here
            _set_path0(os.getcwd())
            runpy.run_module(program.target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *program.args]
            _set_path0("")
            _run_code(program.target)
    except BaseException as exc:  # noqa: BLE001 - the program's own end, whatever it is
        error = exc
    try:
        before_exit(error)
    finally:
        sys.argv = saved_argv
        if saved_path0 is not None and sys.path:
            sys.path[0] = saved_path0
    return _outcome(error)


def _set_path0(value: str) -> None:
    if sys.path:
        sys.path[0] = value
    else:
        sys.path.append(value)


def _run_script(path: str) -> None:
    """Run the file ``path`` as ``python path`` does: ``__file__`` absolute, ``sys.argv[0]`` as given
    (``runpy.run_path`` would set it to the path it was handed)."""
    from importlib.machinery import SourceFileLoader

    with open(path, "rb") as fh:
        source = fh.read()
    _run_main(
        compile(source, path, "exec", dont_inherit=True),
        __file__=path,
        __cached__=None,
        __loader__=SourceFileLoader("__main__", path),
    )


def _run_code(code: str) -> None:
    _run_main(compile(code, "<string>", "exec", dont_inherit=True), __loader__=None)


def _run_main(code: types.CodeType, **attributes: object) -> None:
    """Execute ``code`` in a fresh ``__main__`` module, which is ``sys.modules["__main__"]`` meanwhile."""
    import builtins

    main = types.ModuleType("__main__")
    main.__dict__.update(__builtins__=builtins, __spec__=None, __package__=None, __annotations__={}, **attributes)
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = main
    try:
        exec(code, main.__dict__)  # noqa: S102 - the user's own program
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved


def _outcome(error: BaseException | None) -> Outcome:
    if error is None:
        return Outcome(0)
    if isinstance(error, SystemExit):
        code = error.code
        if code is None:
            return Outcome(0, error)
        if isinstance(code, int):
            return Outcome(code & 0xFF if code >= 0 else code & 0xFF, error)
        print(code, file=sys.stderr)  # sys.exit("message"): Python prints it and exits 1
        return Outcome(1, error)
    if isinstance(error, FileNotFoundError) and error.__traceback__ is not None and error.__traceback__.tb_next is None:
        print(f"{Path(sys.executable).name}: {error}", file=sys.stderr)  # python's own words for a missing script
        return Outcome(2, error)
    trimmed = _user_traceback(error.__traceback__)
    sys.excepthook(type(error), error.with_traceback(trimmed), trimmed)
    return Outcome(1, error, interrupted=isinstance(error, KeyboardInterrupt))


def _user_traceback(tb: types.TracebackType | None) -> types.TracebackType | None:
    """The traceback from the program's first frame on (this module's and runpy's frames dropped)."""
    ours = {os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>"}
    while tb is not None and (
        tb.tb_frame.f_code.co_filename in ours or os.path.abspath(tb.tb_frame.f_code.co_filename) in ours
    ):
        tb = tb.tb_next
    return tb


def end_like_python(outcome: Outcome) -> int:
    """The exit status to return; an unhandled Ctrl-C ends the process by SIGINT, as Python does."""
    if outcome.interrupted:
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 130  # only if the signal did not end the process
    return outcome.status
