"""The real-script corpus of issue #34, shared by its benchmark (``benchmarks/realscripts/run.py``,
the CLI and the table) and its test (``tests/integration/test_realscripts.py``, a reduced form):

- ``nanogpt_train.py``, ``hf_trainer.py``, ``vision_train.py``: training scripts as users write them,
  with nothing in them that knows of tracecmp; each runs on its own (``python nanogpt_train.py ...``);
- :mod:`workloads.realscripts.corpus`: the scripts' sizes and their variants (target and bench
  options, and what issue #34 asks of each pair);
- :mod:`workloads.realscripts.runner`: recording through ``tracecmp record``, comparing (the CLI or
  ``tracecmp.compare``), and judging a pair against its variant's expectation.
"""
