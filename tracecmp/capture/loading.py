"""Batches from DataLoader workers arrive untraced, as they would have before capture began.

A DataLoader with ``num_workers > 0`` prefetches batches: each worker sends its batch through a
queue, and the training process rebuilds the tensors from shared memory when it takes one
(``torch.empty`` then ``set_`` onto the shared storage, in ``multiprocessing/queues.py``). How many
batches arrive during a given step depends on timing, so recording those rebuilds puts a different
number of ops into each run at places that differ from run to run, and the two runs then pair one
batch's rebuild with another's. They are not the training step's computation either: a batch is
what the program hands its model, and capture records it as a source where the model first reads
it, as it does for the batches prefetched before capture began.

>>> undo = fetch_batches_untraced()  # doctest: +SKIP
>>> undo()                           # doctest: +SKIP
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.data import dataloader


def fetch_batches_untraced() -> Callable[[], None]:
    """Make the multi-process DataLoader iterator take its batches from the workers' queue outside
    every dispatch mode; returns what undoes that. Nested calls each wrap and unwrap in turn."""
    iterator = dataloader._MultiProcessingDataLoaderIter
    original = iterator.__dict__["_try_get_data"]

    @functools.wraps(original)
    def _try_get_data(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _disable_current_modes():
            return original(self, *args, **kwargs)

    iterator._try_get_data = _try_get_data  # type: ignore[method-assign]

    def undo() -> None:
        if iterator.__dict__.get("_try_get_data") is _try_get_data:
            iterator._try_get_data = original  # type: ignore[method-assign]

    return undo
