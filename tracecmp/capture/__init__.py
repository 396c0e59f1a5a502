"""Capture: record every dispatched op of a PyTorch run into a trace folder.

>>> from tracecmp.capture import TraceCompare
"""
from tracecmp.capture.session import TraceCompare

__all__ = ["TraceCompare"]
