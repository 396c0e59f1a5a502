"""``torch.compile`` under capture: never change what Dynamo compiles.

Two things in a capture session could change the user's compiled program:

* the capture mode itself: a dispatch mode that does not ignore compile internals makes Dynamo
  skip every frame while it is active, and a frame skipped once stays uncompiled after the mode
  exits (``CaptureMode.ignore_compile_internals`` is True for that reason);
* capture's global module and optimizer hooks: Dynamo traces global hooks into the graph and
  guards on how many there are, so a frame compiled while they are installed is a variant that
  is only valid with them, compiled again once the session ends (a second compile of the whole
  model) and reused by the next session.

:class:`HiddenHooks` takes capture's hooks out of torch's hook tables for the duration of every
Dynamo compilation (its start and end callbacks) and puts them back after: Dynamo then traces
and guards the program as it would without tracecmp, and the compiled code is the same.

Importing Dynamo costs seconds, so a session that never meets ``torch.compile`` never imports
it: :func:`when_imported` acts at once when ``torch._dynamo`` is loaded already, else the moment
something (``torch.compile``) loads it.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings
from typing import Any, Callable, Iterable

_DYNAMO = "torch._dynamo"


class _AfterExec(importlib.abc.Loader):
    """A loader that runs another loader, then the callbacks waiting for the module."""

    def __init__(self, loader: Any, callbacks: list[Callable[[], None]]) -> None:
        self._loader = loader
        self._callbacks = callbacks

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        for callback in list(self._callbacks):
            try:
                callback()
            except Exception as exc:  # noqa: BLE001 - never break the user's import of torch._dynamo
                warnings.warn(f"tracecmp: could not prepare for torch.compile ({type(exc).__name__}: {exc})", stacklevel=2)


class _ImportWatch(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of one module so that callbacks run once it is loaded."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.callbacks: list[Callable[[], None]] = []
        self._busy = False

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name or self._busy or not self.callbacks:
            return None
        self._busy = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy = False
        if spec is not None and spec.loader is not None:
            spec.loader = _AfterExec(spec.loader, self.callbacks)
        return spec


_watch: _ImportWatch | None = None


def when_imported(callback: Callable[[], None]) -> Callable[[], None]:
    """Run ``callback`` now if Dynamo is loaded, else right after it is; returns a function that
    cancels a callback still waiting.

    >>> cancel = when_imported(lambda: None); cancel()
    """
    global _watch
    if _DYNAMO in sys.modules:
        callback()
        return lambda: None
    if _watch is None:
        _watch = _ImportWatch(_DYNAMO)
    if _watch not in sys.meta_path:
        sys.meta_path.insert(0, _watch)
    _watch.callbacks.append(callback)

    def cancel() -> None:
        if _watch is not None and callback in _watch.callbacks:
            _watch.callbacks.remove(callback)
            if not _watch.callbacks and _watch in sys.meta_path:
                sys.meta_path.remove(_watch)

    return cancel


class HiddenHooks:
    """Removes the hooks ``handles()`` names from torch's tables while Dynamo compiles.

    ``handles`` returns the live ``RemovableHandle`` objects at the moment a compilation starts
    (they change as recording starts and stops between steps).

    >>> hidden = HiddenHooks(lambda: [])
    >>> hidden.install(); hidden.remove()
    """

    def __init__(self, handles: Callable[[], Iterable[Any]]) -> None:
        self._handles = handles
        self._taken: list[tuple[dict[Any, Any], Any, Any]] = []
        self._handler: Any = None
        self._cancel: Callable[[], None] | None = None

    def install(self) -> None:
        if self._cancel is None:
            self._cancel = when_imported(self._register)

    def _register(self) -> None:
        try:
            from torch._dynamo.callback import callback_handler
        except ImportError:  # a torch without compile callbacks (< 2.2): hooks stay visible to Dynamo
            return

        callback_handler.register_start_callback(self._hide)
        callback_handler.register_end_callback(self._restore)
        self._handler = callback_handler

    def remove(self) -> None:
        if self._cancel is not None:
            self._cancel()
            self._cancel = None
        self._restore()
        if self._handler is not None:
            self._handler.remove_start_callback(self._hide)
            self._handler.remove_end_callback(self._restore)
            self._handler = None

    def _hide(self, *_: Any) -> None:
        self._restore()  # never hide twice (a compile that did not end)
        for handle in self._handles():
            table = handle.hooks_dict_ref() if handle.hooks_dict_ref is not None else None
            if table is not None and handle.id in table:
                self._taken.append((table, handle.id, table.pop(handle.id)))

    def _restore(self, *_: Any) -> None:
        for table, key, hook in self._taken:
            table[key] = hook
        self._taken = []
