"""How a verdict is drawn, looked up by its kind: the one hook between the results and render.

Render registers a drawing per kind of result (``"compare"``, ``"check"``) when it loads, and a
result's ``render(path)`` looks its kind up here, as a DataFrame's ``plot`` looks up pandas'
plotting backend. So the results stay data and import no renderer, and every layer imports only
the layers below it. ``tracecmp.compare`` and ``tracecmp.check`` load render (:mod:`tracecmp.facade`),
so ``tracecmp.compare(...).render(path)`` always finds its drawing.

>>> from tracecmp.verdict.drawing import draw
>>> draw("compare", result, "out/divergence.svg", depth=2)  # doctest: +SKIP
PosixPath('out/divergence.svg')
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from tracecmp.errors import TracecmpError

Drawing = Callable[..., Path]  # drawing(result, path, **options) -> the path written

_DRAWINGS: dict[str, Drawing] = {}


def register_drawing(kind: str, drawing: Drawing) -> None:
    """Draw results of ``kind`` with ``drawing(result, path, **options)`` (render calls this)."""
    _DRAWINGS[kind] = drawing


def draw(kind: str, result: Any, path: str | Path, **options: Any) -> Path:
    """Draw ``result`` to ``path`` by the drawing registered for ``kind``; the path written."""
    drawing = _DRAWINGS.get(kind)
    if drawing is None:
        raise TracecmpError(
            f"no drawing of {kind} results is loaded: import tracecmp.render first "
            "(tracecmp.compare and tracecmp.check load it)",
            path=path,
        )
    return drawing(result, path, **options)
