"""What a forked child keeps of capture: nothing.

A child forked while capture is armed or running (DataLoader workers, ``multiprocessing``'s fork
and forkserver children, a bare ``os.fork()``) inherits the forking thread's mode stacks, the
module and optimizer hooks, ``tracecmp record``'s wrapper of ``Module.__call__`` and a capture
buffer whose writer thread does not exist there. Its ops are not the run's: the session and the
recording drop all of it in ``os.register_at_fork(after_in_child=...)`` handlers
(:meth:`TraceCompare._disown <tracecmp.capture.session.TraceCompare._disown>`,
:meth:`Recording._disown <tracecmp.capture.recording.Recording._disown>`), so that the per-op path
needs no check of its own. Spawned children and subprocesses start a fresh interpreter and get
nothing to drop.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.overrides as function
import torch.utils._python_dispatch as dispatch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode


def drop_mode(mode: TorchDispatchMode | TorchFunctionMode) -> None:
    """Exit ``mode`` (a dispatch or torch-function mode) wherever it stands on this thread's mode
    stack, keeping the modes entered after it in their order; nothing if it is not there.

    A forked child inherits the stack of the thread that forked, which may be another thread than
    the one that entered the mode, or hold modes the program entered after it.
    """
    stack: Callable[[], list[Any]]
    pop: Callable[[], Any]
    push: Callable[[Any], None]
    if isinstance(mode, TorchFunctionMode):
        stack, pop, push = function._get_current_function_mode_stack, function._pop_mode, function._push_mode
    else:
        stack, pop, push = dispatch._get_current_dispatch_mode_stack, dispatch._pop_mode, dispatch._push_mode
    if not any(entered is mode for entered in stack()):
        return
    above = []
    while (top := pop()) is not mode:
        above.append(top)
    push(mode)
    mode.__exit__(None, None, None)  # as a with-block would leave it (torch's flags of modes in force)
    for entered in reversed(above):
        push(entered)
