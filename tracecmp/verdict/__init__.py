"""The records both judges emit (:class:`Divergence`, :class:`Region`, :class:`Drift`, ...), shared
by ``compare`` and ``check`` and read by render, report and the CLI; nothing here judges."""

from __future__ import annotations

from tracecmp.verdict.records import KINDS, REGION_KINDS, STATUSES, Divergence, Drift, Region, SkippedStep, op_counts

__all__ = ["KINDS", "REGION_KINDS", "STATUSES", "Divergence", "Drift", "Region", "SkippedStep", "op_counts"]
