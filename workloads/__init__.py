"""Models and fault injection shared by the tests and the benchmarks (which never import each other).

- :mod:`workloads.models`: small models built from a seed, their batches, optimizers, one training step;
- :mod:`workloads.compile_models`: a small transformer and counting backends for ``torch.compile``;
- :mod:`workloads.kernel_faults`: the demo transformer's step under an emulated faulty device kernel;
- :mod:`workloads.localization`: the localization cases: model families, fault injectors, case
  planning, and the runner that captures, compares and scores one case;
- :mod:`workloads.realscripts`: the real-script corpus (issue #34): three training scripts as users
  write them, their variants, and recording, comparing and judging a pair through the CLI.

Not part of the tracecmp distribution: it lives at the repository root beside ``tests/`` and
``benchmarks/``, which import it from there (pytest's ``tests/conftest.py`` and ``python -m
benchmarks...`` put the root on ``sys.path``). It imports tracecmp and torch, never tests or benchmarks.
"""
