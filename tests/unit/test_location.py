"""Where an op was called from: the first user frame, found on any thread's stack."""

from __future__ import annotations

import threading

from tracecmp.capture.location import Locator


def test_a_stack_shallower_than_asked_has_no_location() -> None:
    """The autograd engine's device threads call capture's hooks straight from C++: their Python
    stacks may hold fewer frames than a lookup skips, which must read as no location, not fail."""
    found: list[tuple[str, str]] = []
    locator = Locator()
    thread = threading.Thread(target=lambda: found.append((locator.location(50), locator.stack(50))))
    thread.start()
    thread.join()
    assert found == [("", "")]
    assert locator.location(0).startswith("test_location.py:")
