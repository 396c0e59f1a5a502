"""The trace on disk: schema, crash-safe writer and validating reader."""

from tracecmp.trace.reader import RankTrace, Trace, load
from tracecmp.trace.writer import RankWriter, write_run_manifest

__all__ = ["RankTrace", "RankWriter", "Trace", "load", "write_run_manifest"]
