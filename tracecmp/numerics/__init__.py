"""Numerics shared by both judges: rounding models, and replay of recorded ops in float64
(:mod:`tracecmp.numerics.replay`). Nothing here knows of a bench or of a verdict."""
