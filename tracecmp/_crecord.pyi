# The C contract of tracecmp._crecord (csrc/record*.cpp): the capture mode's per-op path in C.
#
# Imported by tracecmp.capture.native only, configured there with what tracecmp.capture.mode
# hands it. dispatch() does what CaptureMode.__torch_dispatch__ (the reference) does, on the same
# objects: it reads and writes the mode's instance dict by the names below, so a trace is the same
# row for row whichever runs (tests/integration/test_native_capture.py). A renamed attribute of
# the mode or of what it holds is a change to this contract, and to the C code.
from typing import Any, Callable, Protocol

class Buffer:
    """A growable column of numbers, the interface of ``array.array`` that tracecmp.trace.columns
    uses: typecode ``'q'`` (int64), ``'i'`` (int32), ``'d'`` (float64) or ``'b'`` (int8). Its
    buffer's format is the typecode; it never moves its storage while a view of it is alive (an
    append that would raises BufferError)."""

    def __init__(self, typecode: str) -> None: ...
    @property
    def typecode(self) -> str: ...
    def append(self, value: int | float, /) -> None: ...
    def extend(self, values: Any, /) -> None: ...
    def truncate(self, size: int, /) -> None:
        """Keep the first ``size`` values (the storage stays)."""
    def __len__(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...

class Scope(Protocol):
    """tracecmp.capture.modules.ModuleScope, as dispatch() reads it (instance dict)."""

    current: str
    depth: int
    seq_info: dict[int, tuple[str, str]]
    claims: int
    claim_floor: int
    def owner(self, param: Any) -> str: ...

class Locator(Protocol):
    """tracecmp.capture.location.Locator, as dispatch() reads it (instance dict)."""

    _code: dict[int, str | bool]
    _text: dict[tuple[int, int], str]
    def _classify(self, code: Any) -> str | bool: ...

class Columns(Protocol):
    """tracecmp.trace.columns.Columns: dispatch() appends rows to ``parts`` as ``kinds`` lays
    them out, and calls ``_rollback`` when a value cannot be stored."""

    parts: tuple[Any, ...]
    kinds: bytes
    def _rollback(self, rows: int) -> None: ...

class Ids(Protocol):
    """tracecmp.capture.identity.TensorIds, as dispatch() reads and writes it (instance dict)."""

    known: dict[int, Any]  # id(tensor) -> its weak record (rec_type: tid, version, group, key)
    next_id: int
    writes: dict[int, list[list[Any]]]  # view family -> [[version after, tensor id]], at most 16
    unsettled: list[tuple[Any, list[Any]]]  # (record, [version, tensor id]) of the last op's writes
    held: list[Any]  # written views kept alive until the next settle
    forget_cb: Callable[[Any], Any]  # the weak records' callback (forget bound to ``known``)

class Collectives(Protocol):
    """tracecmp.capture.collectives.CollectiveRecorder, as dispatch() reads it (instance dict)."""

    awaited_groups: dict[int, list[int]]  # an op reading one of these view families goes to ``slow``

class Checker(Protocol):
    """tracecmp.capture.selfcheck.SelfChecker, as dispatch() reads and writes it for the calls it
    gathers through a recipe (instance dict; record_check.cpp)."""

    full: bool
    recipes: dict[tuple[Any, ...], Any]  # signature -> Recipe, None, SEEN_ONCE or SEEN_BEFORE
    _stream: int  # the splitmix64 state the samples are drawn from
    _residuals: list[float]  # a NaN per queued call, its ticket's place
    _coarse: list[float]
    _queued: int
    _queue_max: int

class Mode(Protocol):
    """tracecmp.capture.mode.CaptureMode, as dispatch() reads and writes it (instance dict)."""

    ids: Ids
    collectives: Collectives
    step: int
    in_optimizer: bool
    rows: Columns
    tensor_rows: Columns
    saved_bytes: int
    scope: Scope
    _locator: Locator
    _next_op: int
    _row_limit: int
    _max_bytes: int
    _save_data: bool
    _plain: bool
    _stack: bool
    _args_memo: dict[tuple[Any, ...], str]
    _args: Any  # .encode(info, key, args, kwargs) -> str
    _dtypes: dict[Any, str]
    _on_limit: Callable[[], Any]
    # Self-checks (capture/selfcheck.py): None / absent when they are off.
    _check_kinds: dict[Any, Any] | None  # op -> its check, None: unchecked
    _checker: Checker
    check_rows: Columns
    _deferred_rows: list[int]  # check row per ticket
    # The reference's methods it calls for what it does not record itself.
    def _enter(self, t: Any, rec: Any, phase: str, module: str, location: str, stack: str) -> int: ...
    def _outputs(
        self, info: Any, op_id: int, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, inputs: list[Any]
    ) -> tuple[list[int], bool]: ...
    def _value(self, t: Any, tid: int, op_id: int, index: int, view_of: int) -> None: ...
    def _bare(self, t: Any, tid: int, op_id: int, index: int, view_of: int) -> None: ...
    def _written(self, t: Any, op_id: int, outputs: list[int]) -> None: ...
    def _unbumped(self, t: Any, tid: int) -> None: ...
    def _dtype(self, dtype: Any) -> str: ...
    def _check_before(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...
    def _check_after(self, plan: Any, op_id: int, out: Any) -> None: ...
    def _learn(
        self, signature: tuple[Any, ...], func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
    ) -> None: ...
    def _resolve_checks(self) -> None: ...

def configure(
    *,
    slow: Callable[..., Any],
    tensor_type: type,
    op_overload: type,
    op_infos: dict[int, Any],
    one_fresh: Any,
    marker: object,
    scan_value: Callable[[Any, list[Any]], Any],
    plain_types: tuple[type, ...],
    rec_type: type,
    current_node: Callable[[], Any],
    sequence_nr: Callable[[], int],
    grad_enabled: Callable[[], bool],
    inference_enabled: Callable[[], bool],
    num_threads: Callable[[], int],
    stats_module: Any,
    native_codes: dict[Any, int],
    parallel_min: int,
    view_kind: Any,
    write_kind: Any,
    fresh_kind: Any,
    parameter_type: type,
    strided: Any,
    stack_len: Callable[[], int],
    graph_task: Callable[[], int],
    recipe_kinds: tuple[Callable[..., Any], ...],
) -> None:
    """Once per process, before any dispatch(): the reference's helpers and types (kept for the
    process's life). ``slow`` is the reference ``CaptureMode.__torch_dispatch__``, called for every
    op this path does not record itself; ``stats_module._native_stats`` is read per tensor (it may
    change). TypeError when one of them is missing or not of its kind."""

def dispatch(
    mode: Mode, func: Any, types: tuple[type, ...], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None, /
) -> Any:
    """``CaptureMode.__torch_dispatch__`` in C: bind it to a mode with ``types.MethodType``.
    RuntimeError when configure() was not called."""

def passthrough(
    mode: Any, func: Any, types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any] | None = None, /
) -> Any:
    """Re-dispatch the op as dispatch() does, recording nothing: what a capture built on a dispatch
    mode pays before it records anything (benchmarks/overhead_ablation.py)."""

def forget(known: dict[int, Any], rec: Any, /) -> None:
    """TensorIds.forget as the weak records' callback: drop ``rec`` from ``known`` (by
    ``rec.key``) unless another record replaced it there. TypeError when ``known`` is not a dict."""
