"""Results draw through the drawing render registers (``tracecmp.verdict.drawing``): the results
import no renderer, and ``tracecmp.compare`` / ``tracecmp.check`` load render so that theirs draw."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tracecmp.errors import TracecmpError
from tracecmp.verdict.drawing import draw, register_drawing


def test_a_registered_drawing_gets_the_result_the_path_and_the_options(tmp_path: Path) -> None:
    calls = []

    def drawing(result: object, path: Path, **options: object) -> Path:
        calls.append((result, path, options))
        return Path(path)

    register_drawing("test-kind", drawing)
    assert draw("test-kind", "result", tmp_path / "x.svg", depth=3) == tmp_path / "x.svg"
    assert calls == [("result", tmp_path / "x.svg", {"depth": 3})]


def test_a_kind_without_a_drawing_says_what_to_load(tmp_path: Path) -> None:
    with pytest.raises(TracecmpError, match="import tracecmp.render"):
        draw("no-such-kind", object(), tmp_path / "x.svg")


def test_the_public_judges_load_render_and_the_judges_alone_do_not() -> None:
    code = (
        "import sys, tracecmp.comparison, tracecmp.checking\n"
        "alone = 'tracecmp.render' in sys.modules\n"
        "import tracecmp\n"
        "assert tracecmp.compare is tracecmp.comparison.compare and tracecmp.check is tracecmp.checking.check\n"
        "assert tracecmp.CompareResult is tracecmp.comparison.CompareResult\n"
        "print(alone, 'tracecmp.render' in sys.modules)\n"
    )
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.split("\n")[0] == "False True"
