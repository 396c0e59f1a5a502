"""Localization accuracy: inject known faults into a target run and check tracecmp names them.

Run ``python -m benchmarks.localization`` (``--quick`` for a two-minute subset); results and the
command that produced them go to ``benchmarks/README.md`` under "Localization accuracy".
"""
