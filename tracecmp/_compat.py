"""What the environment tracecmp runs in may lack, in one place: an older torch, unbuilt extensions.

torch 2.1 is the oldest tracecmp supports (CI tests it beside the newest): capture relies on
autograd sequence numbers (``torch._C._autograd._get_sequence_nr``) to give backward ops their
module, and on always-called module hooks (``register_module_forward_hook(always_call=True)``);
torch 2.0 has neither. Differences within the supported range that tracecmp handles are noted
where they are handled; this module holds the checks that more than one place needs.

>>> TORCH_VERSION >= OLDEST_TORCH
True
"""
from __future__ import annotations

import os
import re
import sys

import torch

from tracecmp.errors import TracecmpError

OLDEST_TORCH = (2, 1)


def _version(text: str) -> tuple[int, int]:
    """``"2.1.2+cu121"`` -> ``(2, 1)``."""
    match = re.match(r"(\d+)\.(\d+)", text)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


TORCH_VERSION = _version(torch.__version__)


def check_torch() -> None:
    """Refuse, with the reason, a torch older than :data:`OLDEST_TORCH`."""
    if TORCH_VERSION < OLDEST_TORCH:
        raise TracecmpError(
            f"tracecmp needs torch >= {'.'.join(map(str, OLDEST_TORCH))}, this is torch {torch.__version__}: "
            "older releases lack the autograd sequence numbers and module hooks capture relies on"
        )


_announced = False


def announce_references() -> None:
    """Say once per process, in one line on stderr, that capture runs the Python references of
    native extensions that were not built (an install without a C++ compiler). Traces are the same;
    only the per-op cost differs. Silent when ``TRACECMP_FORCE_REFERENCE=1`` asks for them."""
    global _announced
    if _announced or os.environ.get("TRACECMP_FORCE_REFERENCE", "") == "1":
        return
    _announced = True
    from tracecmp.capture import mode, stats

    missing = [name for name, error in (("_cstats", stats.native_error()), ("_crecord", mode.NATIVE_ERROR)) if error]
    if missing:
        print(
            f"tracecmp: native extension{'s' if len(missing) > 1 else ''} {' and '.join(missing)} not built "
            "(no C++ compiler at install?): capture runs the Python reference (same trace, slower)",
            file=sys.stderr,
        )
