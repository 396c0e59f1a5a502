"""The on-disk trace format: folder layout, manifests and the two column tables.

A trace is one folder per run::

    RUN/manifest.json              run identity: format name and version, versions, options
    RUN/rank<R>/manifest.json      per rank: device, world size, complete-or-not
    RUN/rank<R>/chunk-<K>.json     the commit record of chunk K: its files' sizes and CRC-32s
    RUN/rank<R>/ops-<K>.parquet    one row per recorded node (op, view or source tensor)
    RUN/rank<R>/tensors-<K>.parquet  one row per tensor value (a version: in-place ops make new ones)
    RUN/rank<R>/data-<K>.safetensors whole tensors, only with ``data="tensors"``
    RUN/rank<R>/compiled-<K>.json  torch.compile'd regions: their graphs and calls (trace/compiled.py)
    RUN/rank<R>/checks-<K>.parquet one row per self-checked op output (capture/selfcheck.py), with
                                   ``self_check`` on

A chunk's files are written to temporary names and renamed, then its commit record (also renamed
into place) lists them with their size and CRC-32; a reader trusts only recorded chunks whose bytes
match, numbered 0, 1, 2, ... without a gap. A run killed mid-step therefore leaves every earlier chunk readable and ``complete: false``.
Nothing is ever pickled: manifests are JSON, tables Parquet, tensors safetensors.

Ids: ``op_id`` and ``tensor_id`` are unique within a rank and increase in execution order.
A node's ``inputs``/``outputs`` hold tensor ids; a tensor row's ``op_id`` is its producer, so
producer -> consumer edges are a join. An in-place op consumes the old version of the tensor it
writes and produces a new id (``inplace`` is true); a view op produces a tensor whose ``view_of``
names its base and carries no statistics.
"""

from __future__ import annotations

import pyarrow as pa

FORMAT_NAME = "tracecmp-trace"
FORMAT_VERSION = 1
# In a data file's safetensors ``__metadata__``: a JSON object {key: memory order} for tensors saved
# from a transposed or permuted layout. Their bytes are in logical order, as in any safetensors file;
# a reader that ignores this entry reads the same values, only not their layout.
MEMORY_ORDER_KEY = "tracecmp.memory_order"

RUN_MANIFEST = "manifest.json"
RANK_MANIFEST = "manifest.json"

PHASES = ("forward", "backward", "optimizer")
KINDS = ("op", "view", "source")
SOURCE_OPS = ("source.parameter", "source.buffer", "source.input", "source.tensor", "source.unread")
# A source whose first recorded use only writes it (an ``out=`` argument, a DDP bucket's view): its
# earlier content is never read, so it is recorded without statistics, like uninitialised memory.
UNREAD_SOURCE = "source.unread"
# A tensor made from Python data (``torch.tensor(x)``, a number written into a tensor), not a
# parameter, buffer or model input: what Python read from the run may be in it.
PYTHON_SOURCE = "source.tensor"
# A kind "view" node made when an op wrote a tensor through another alias (a view, or the base of
# a view): inputs = the tensor's previous value and the written values, output = its new value
# (with statistics). It computes nothing; it keeps producer -> consumer edges right.
ALIAS_UPDATE_OP = "alias.update"

OPS_SCHEMA = pa.schema(
    [
        ("op_id", pa.int64()),
        ("step", pa.int32()),
        ("phase", pa.string()),  # forward | backward | optimizer (sources: phase of first use)
        ("kind", pa.string()),  # op | view | source
        ("op", pa.string()),  # "aten.mm.default", "npu.fused_x.default", "source.parameter", ...
        ("name", pa.string()),  # sources: "fc1.weight", "input.0"; ops: ""
        ("module", pa.string()),  # dotted path as in named_modules(); "" outside any module
        ("location", pa.string()),  # "train.py:42", the first frame outside torch and tracecmp
        ("args", pa.string()),  # JSON of the non-tensor arguments (tensors as {"tensor": index})
        ("inputs", pa.list_(pa.int64())),  # tensor ids read, in argument order
        ("outputs", pa.list_(pa.int64())),  # tensor ids produced, in output order
        ("inplace", pa.bool_()),  # the op wrote one of its inputs
        ("random", pa.bool_()),  # the op draws random numbers
        ("seq_nr", pa.int64()),  # autograd sequence number linking backward to forward, -1 if none
        ("stack", pa.string()),  # full user stack when asked for, else ""
    ]
)

TENSORS_SCHEMA = pa.schema(
    [
        ("tensor_id", pa.int64()),
        ("op_id", pa.int64()),  # producer node
        ("index", pa.int32()),  # position among the producer's outputs
        ("shape", pa.list_(pa.int64())),
        ("dtype", pa.string()),  # "float32", "bfloat16", "int64", ...
        ("device", pa.string()),  # "cpu", "cuda:0", "npu:0"
        ("view_of", pa.int64()),  # base tensor id for view outputs, else -1
        ("has_stats", pa.bool_()),
        ("min", pa.float64()),
        ("max", pa.float64()),
        ("mean", pa.float64()),
        ("norm", pa.float64()),
        ("nan_count", pa.int64()),
        ("inf_count", pa.int64()),
        ("checksum", pa.int64()),
        ("data_key", pa.string()),  # key in the chunk's safetensors file, "" if not saved
    ]
)


# An op's own computation checked at capture on a sample of its outputs, in float64 from its own
# inputs (capture/selfcheck.py): one row per checked output. An op without rows was not checked.
CHECKS_SCHEMA = pa.schema(
    [
        ("op_id", pa.int64()),
        ("index", pa.int32()),  # position among the op's tensor outputs
        ("residual", pa.float64()),  # largest sampled |output - float64 value| in the op's own allowance
        ("limit", pa.float64()),  # the residual an honest kernel stays within (dtype, precision, length)
        # A float32 matmul/conv allowed reduced precision (TF32): its residual under that precision's
        # whole allowance, in units of limit; ``residual`` is then its best rounding model's. Else equal.
        ("coarse", pa.float64()),
        ("sampled", pa.int32()),  # output elements (or rows) recomputed
        ("how", pa.string()),  # "pointwise", "rows", "batch", "full", "exact"
    ]
)


def chunk_record_name(index: int) -> str:
    """File name of chunk ``index``'s commit record."""
    return f"chunk-{index:05d}.json"


STAT_COLUMNS = ("min", "max", "mean", "norm", "nan_count", "inf_count", "checksum")
