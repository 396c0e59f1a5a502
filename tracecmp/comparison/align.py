"""Pair the nodes of a target trace with those of a bench trace, even when the op sequences differ.

Pairing works per rank, in three passes:

1. *Sources* (parameters, buffers, inputs) pair by name within a step.
2. *Scopes*: the ops of each (step, phase, module) scope are aligned as sequences of structural keys
   (op name, output shapes; never dtypes, so a bf16 run pairs with an fp32 one). Identical sequences
   pair position by position; otherwise keys that occur equally often on both sides are *anchors*
   (TroubleShooter's idea), anchors pair in order, and only the stretches between anchors go through
   an LCS dynamic programme. One extra op (a ``contiguous``, a ``_to_copy`` cast) therefore shifts
   nothing else, and a fused op against its decomposition leaves just those ops unpaired.
3. *Leftovers*: nodes unpaired after pass 2 (a module renamed, a backward op attributed to another
   module) are aligned the same way per (step, phase), ignoring the module.

Everything is hashing and list comparison except the DP on differing stretches, so 200,000-op traces
align in seconds.

>>> align_sequences(["a", "b", "c"], ["a", "x", "b", "c"])
[(0, 0), (1, 2), (2, 3)]
"""
from __future__ import annotations

import difflib
from collections import Counter, defaultdict
from typing import Hashable, Sequence

import pandas as pd

# Above this many DP cells a stretch is matched with difflib's longest-block recursion instead,
# and above the second (two long sequences with nothing in common to anchor on) window by window.
_DP_CELLS = 250_000
_DIFFLIB_CELLS = 50_000_000


def _windowed_pairs(a: Sequence[int], b: Sequence[int], window: int = 1000) -> list[tuple[int, int]]:
    """Match two long sequences window by window (``a``'s k-th window against the proportional
    stretch of ``b``), each with difflib: bounded cost, monotone, good where they mostly agree."""
    n, m = len(a), len(b)
    pairs: list[tuple[int, int]] = []
    j0 = 0
    for i0 in range(0, n, window):
        i1 = min(n, i0 + window)
        j1 = m if i1 == n else min(m, max(j0, round(i1 * m / n)) + window // 4)
        matcher = difflib.SequenceMatcher(None, a[i0:i1], b[j0:j1], autojunk=False)
        block = [(i0 + blk.a + k, j0 + blk.b + k) for blk in matcher.get_matching_blocks() for k in range(blk.size)]
        pairs.extend(block)
        j0 = block[-1][1] + 1 if block else j0
    return pairs


def _lcs_pairs(a: Sequence[int], b: Sequence[int]) -> list[tuple[int, int]]:
    """Longest common subsequence of two short int sequences, as index pairs (DP, O(len(a)*len(b)))."""
    n, m = len(a), len(b)
    if n == 0 or m == 0:
        return []
    if n * m > _DIFFLIB_CELLS:
        return _windowed_pairs(a, b)
    if n * m > _DP_CELLS:
        matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
        return [(blk.a + k, blk.b + k) for blk in matcher.get_matching_blocks() for k in range(blk.size)]
    # lengths[i][j] = LCS of a[i:], b[j:]; filled backwards so the walk below goes forwards and
    # prefers the earliest match (an extra op is left unpaired, not its twin further on).
    lengths = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
        row, below = lengths[i], lengths[i + 1]
        ai = a[i]
        for j in range(m - 1, -1, -1):
            row[j] = below[j + 1] + 1 if ai == b[j] else max(below[j], row[j + 1])
    pairs: list[tuple[int, int]] = []
    i = j = 0
    while i < n and j < m:
        if a[i] == b[j]:
            pairs.append((i, j))
            i += 1
            j += 1
        elif lengths[i + 1][j] >= lengths[i][j + 1]:
            i += 1
        else:
            j += 1
    return pairs


def align_sequences(a: Sequence[Hashable], b: Sequence[Hashable]) -> list[tuple[int, int]]:
    """Index pairs ``(i, j)`` with ``a[i] == b[j]``, increasing in both, anchored then DP-filled.

    >>> align_sequences(list("abcabc"), list("abcXabc"))
    [(0, 0), (1, 1), (2, 2), (3, 4), (4, 5), (5, 6)]
    """
    if list(a) == list(b):
        return [(i, i) for i in range(len(a))]
    codes: dict[Hashable, int] = {}
    ca = [codes.setdefault(k, len(codes)) for k in a]
    cb = [codes.setdefault(k, len(codes)) for k in b]
    count_a, count_b = Counter(ca), Counter(cb)
    anchors = {k for k, n in count_a.items() if count_b.get(k) == n}
    ia = [i for i, k in enumerate(ca) if k in anchors]
    ib = [j for j, k in enumerate(cb) if k in anchors]
    ka, kb = [ca[i] for i in ia], [cb[j] for j in ib]
    if ka == kb:
        anchor_pairs = list(zip(ia, ib))
    else:
        anchor_pairs = [(ia[x], ib[y]) for x, y in _lcs_pairs(ka, kb)]
    pairs: list[tuple[int, int]] = []
    prev_i = prev_j = -1
    for i, j in [*anchor_pairs, (len(ca), len(cb))]:
        if i - prev_i > 1 and j - prev_j > 1:
            stretch = _lcs_pairs(ca[prev_i + 1 : i], cb[prev_j + 1 : j])
            pairs.extend((prev_i + 1 + x, prev_j + 1 + y) for x, y in stretch)
        if i < len(ca):
            pairs.append((i, j))
        prev_i, prev_j = i, j
    return pairs


def node_keys(ops: pd.DataFrame, tensors: pd.DataFrame) -> list[tuple]:
    """Structural key of every node of ``ops`` (in row order): kind, op or source name, output shapes."""
    shape_of = dict(zip(tensors["tensor_id"].tolist(), (tuple(s) for s in tensors["shape"].tolist())))
    keys = []
    for kind, op, name, outputs in zip(ops["kind"].tolist(), ops["op"].tolist(), ops["name"].tolist(), ops["outputs"].tolist()):
        shapes = tuple(shape_of.get(t) for t in outputs)
        keys.append((kind, name if kind == "source" and name else op, shapes))
    return keys


def align_nodes(t_ops: pd.DataFrame, t_tensors: pd.DataFrame, b_ops: pd.DataFrame, b_tensors: pd.DataFrame) -> dict[int, int]:
    """``{target op_id: bench op_id}`` for one rank (see the module docstring for the passes)."""
    t_keys, b_keys = node_keys(t_ops, t_tensors), node_keys(b_ops, b_tensors)
    t_rows = _rows(t_ops, t_keys)
    b_rows = _rows(b_ops, b_keys)
    pairs: dict[int, int] = {}

    # Pass 1 and 2: named sources by (step, name), everything else by (step, phase, module).
    def scope(row: tuple) -> tuple:
        op_id, step, phase, kind, module, name, key = row
        if kind == "source" and name:
            return ("source", step, name)
        return ("scope", step, phase, module)

    _align_groups(t_rows, b_rows, scope, pairs)
    # Pass 3: leftovers per (step, phase), ignoring modules; then named sources across steps.
    t_left = [r for r in t_rows if r[0] not in pairs]
    paired_b = set(pairs.values())
    b_left = [r for r in b_rows if r[0] not in paired_b]
    if t_left and b_left:
        _align_groups(t_left, b_left, lambda r: (r[1], r[2]), pairs)
    return pairs


def _rows(ops: pd.DataFrame, keys: list[tuple]) -> list[tuple]:
    return list(zip(ops["op_id"].tolist(), ops["step"].tolist(), ops["phase"].tolist(), ops["kind"].tolist(),
                    ops["module"].tolist(), ops["name"].tolist(), keys))


def _align_groups(t_rows: list[tuple], b_rows: list[tuple], scope, pairs: dict[int, int]) -> None:
    t_groups: dict[tuple, list[tuple]] = defaultdict(list)
    b_groups: dict[tuple, list[tuple]] = defaultdict(list)
    for r in t_rows:
        t_groups[scope(r)].append(r)
    for r in b_rows:
        b_groups[scope(r)].append(r)
    for name, t_group in t_groups.items():
        b_group = b_groups.get(name)
        if not b_group:
            continue
        for i, j in align_sequences([r[6] for r in t_group], [r[6] for r in b_group]):
            pairs[t_group[i][0]] = b_group[j][0]
