"""Capture: record every dispatched op of a PyTorch run into a trace folder.

>>> from tracecmp.capture import TraceCompare
"""

from tracecmp._compat import check_torch

check_torch()

from tracecmp.capture.session import TraceCompare  # noqa: E402

__all__ = ["TraceCompare"]
