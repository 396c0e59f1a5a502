"""``tracecmp.compare``: the facade over the one-process core (:mod:`tracecmp.comparison.engine`)
and the many-rank orchestrator (:mod:`tracecmp.comparison.ranks`).

>>> result = tracecmp.compare("runs/target", "runs/bench")   # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping

from tracecmp.comparison.engine import compare_traces
from tracecmp.comparison.programs import require_one_model
from tracecmp.comparison.ranks import attach_cross_rank, compare_ranks
from tracecmp.comparison.result import CompareResult
from tracecmp.comparison.tolerances import Tolerances
from tracecmp.comparison.torchrun import JobGroup, compare_in_job
from tracecmp.errors import CompareError, DifferentModels
from tracecmp.trace.reader import Trace, load


def _as_trace(value: str | Path | Trace, what: str) -> Trace:
    if isinstance(value, Trace):
        return value
    if isinstance(value, (str, Path)):
        return load(value)
    raise CompareError(f"{what} must be a trace folder or a Trace, got {type(value).__name__}")


def compare(
    target: str | Path | Trace,
    bench: str | Path | Trace,
    *,
    tolerances: Tolerances | Mapping[str, Any] | None = None,
    steps: Iterable[int] | None = None,
    ranks: Iterable[int] | None = None,
    exact: bool = False,
    replay: bool | None = None,
    progress: bool | None = None,
    workers: int | None = None,
    max_memory: int | None = None,
    force: bool = False,
) -> CompareResult:
    """Compare a target run with a bench run and name the first op that went wrong.

    ``exact=True`` checks bitwise determinism instead: every difference is a divergence and the roots
    are the ops whose outputs changed while their inputs were bitwise equal. ``replay`` re-runs every
    target op on its recorded inputs in float64 (:mod:`tracecmp.numerics.replay`), which needs a
    target captured with ``data="tensors"`` and finds an op's own error even where its inputs
    already differ from the bench by more; default: whenever the target holds tensors.
    ``progress`` forces the stderr progress bar on or off (default: on for large traces on a
    terminal). Traces of several ranks given as folders are compared rank by rank in a process
    pool of ``workers`` (default: one per rank, up to the CPUs; 1: one after another here), each
    worker holding one rank pair with at most ``max_memory`` bytes of data, and then across ranks
    (:mod:`tracecmp.comparison.ranks`): ``result.job`` shows the ranks side by side. Two runs
    that are different models (:mod:`tracecmp.comparison.programs`) raise
    :class:`~tracecmp.errors.DifferentModels` unless ``force``; forced, the verdict carries a
    warning and never reads AGREE.

    >>> result = tracecmp.compare("runs/target", "runs/bench")   # doctest: +SKIP
    >>> result.first_divergence.op, result.first_divergence.module  # doctest: +SKIP
    ('aten.gelu.default', 'blocks.1.mlp.act')
    """
    if tolerances is None:
        tol = Tolerances()
    elif isinstance(tolerances, Tolerances):
        tol = tolerances
    elif isinstance(tolerances, Mapping):
        tol = Tolerances().replace(**tolerances)
    else:
        raise CompareError(f"tolerances must be a Tolerances or a mapping, got {type(tolerances).__name__}")
    if isinstance(target, (str, Path)) and isinstance(bench, (str, Path)) and _multi_rank(target, bench):
        return _warned(
            _models_warning(_as_trace(target, "target"), _as_trace(bench, "bench"), force),
            compare_ranks(
                target,
                bench,
                ranks=ranks,
                workers=workers,
                max_memory=max_memory,
                progress=progress,
                tolerances=tol,
                steps=steps,
                exact=exact,
                replay=replay,
            ),
        )
    t_trace, b_trace = _as_trace(target, "target"), _as_trace(bench, "bench")
    models = _models_warning(t_trace, b_trace, force)  # reads rank 0's tables, which the comparison reuses
    result = compare_traces(
        t_trace, b_trace, tolerances=tol, steps=steps, ranks=ranks, exact=exact, replay=replay, progress=progress
    )
    if len(result.ranks) > 1:  # order the ranks' roots through their collectives
        attach_cross_rank(result)
    return _warned(models, result)


def compare_job(
    target: str | Path, bench: str | Path, group: JobGroup, *, force: bool = False, **options: Any
) -> CompareResult | None:
    """:func:`compare` as one process of a torchrun job (:mod:`tracecmp.comparison.torchrun`):
    this process compares its share of the ranks; process 0 gets the job's result, the others
    None. ``options``: :func:`compare`'s ``tolerances`` (a :class:`Tolerances`), ``steps``,
    ``ranks``, ``exact``, ``replay``.

    >>> with JobGroup() as group:                                          # doctest: +SKIP
    ...     result = compare_job("runs/target", "runs/bench", group)
    """
    options["tolerances"] = options.get("tolerances") or Tolerances()
    result = compare_in_job(target, bench, group, **options)
    if result is None:
        return None
    return _warned(_models_warning(_as_trace(target, "target"), _as_trace(bench, "bench"), force), result)


def _models_warning(t_trace: Trace, b_trace: Trace, force: bool) -> str:
    """Raises :class:`DifferentModels` for two different models; forced, its message as a warning."""
    common = sorted(set(t_trace.ranks) & set(b_trace.ranks))
    try:
        require_one_model(t_trace, b_trace, common[0] if common else 0)
    except DifferentModels as exc:
        if not force:
            raise
        return str(exc.message)
    return ""


def _warned(warning: str, result: CompareResult) -> CompareResult:
    if warning:
        result.warnings.insert(0, warning)
    return result


def _multi_rank(target: str | Path, bench: str | Path) -> bool:
    """Whether either folder holds more than one rank (then :mod:`tracecmp.comparison.ranks` compares)."""

    def ranks(path: str | Path) -> int:
        root = Path(path)
        return sum(1 for p in root.glob("rank*") if p.is_dir() and p.name[4:].isdigit()) if root.is_dir() else 0

    return max(ranks(target), ranks(bench)) > 1
