"""Pair the nodes of a target trace with those of a bench trace, even when the op sequences differ.

Pairing works per rank, in three passes:

1. *Sources* (parameters, buffers, inputs) pair by name within a step.
2. *Scopes*: the ops of each (step, phase, module) scope are aligned as sequences of structural keys
   (op name, output shapes; never dtypes, so a bf16 run pairs with an fp32 one). Identical sequences
   pair position by position; otherwise keys that occur equally often on both sides are *anchors*
   (TroubleShooter's idea), anchors pair in order, and only the stretches between anchors go through
   an LCS dynamic programme. One extra op (a ``contiguous``, a ``_to_copy`` cast) therefore shifts
   nothing else, and a fused op against its decomposition leaves just those ops unpaired.
3. *Leftovers*: nodes unpaired after pass 2 are aligned again within their module (two ops whose
   order flipped), then per (step, phase), ignoring the module (a module renamed, a backward op
   attributed to another module).
4. *Lone sources*: a source still unpaired pairs with the bench's within its step where its shape
   is the only such on each side (an input named differently on the two sides).

Everything is hashing and list comparison except the DP on differing stretches, so 200,000-op traces
align in seconds.

>>> align_sequences(["a", "b", "c"], ["a", "x", "b", "c"])
[(0, 0), (1, 2), (2, 3)]
"""

from __future__ import annotations

import difflib
import math
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any, Hashable, Iterable, Mapping, Sequence

import pandas as pd

from tracecmp.aten.opclass import base_name, is_copy
from tracecmp.trace import boundedjson
from tracecmp.verdict.records import Region

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
    for kind, op, name, outputs in zip(
        ops["kind"].tolist(), ops["op"].tolist(), ops["name"].tolist(), ops["outputs"].tolist()
    ):
        shapes = tuple(shape_of.get(t) for t in outputs)
        keys.append((kind, name if kind == "source" and name else op, shapes))
    return keys


def align_nodes(
    t_ops: pd.DataFrame, t_tensors: pd.DataFrame, b_ops: pd.DataFrame, b_tensors: pd.DataFrame
) -> dict[int, int]:
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
    # Pass 3: leftovers, first within their own module (ops whose order flipped there: autocast's
    # casts move where AccumulateGrad detaches a bias gradient), then per (step, phase) ignoring
    # modules. Straight to the second, one module's leftover shifted every later module's by one.
    for leftover_scope in (lambda r: (r[1], r[2], r[4]), lambda r: (r[1], r[2])):
        t_left = [r for r in t_rows if r[0] not in pairs]
        paired_b = set(pairs.values())
        b_left = [r for r in b_rows if r[0] not in paired_b]
        if t_left and b_left:
            _align_groups(t_left, b_left, leftover_scope, pairs)
    _pair_lone_sources(t_rows, b_rows, pairs)
    return pairs


def _pair_lone_sources(t_rows: list[tuple], b_rows: list[tuple], pairs: dict[int, int]) -> None:
    """Pass 4: sources still unpaired pair within a step where their output shapes are each side's
    only such: an input the two sides name differently (a compiled target knows the arguments of
    its compiled frames only, not a ``labels`` its loss function took), or an older trace's
    ``input.0`` against its keyword's name."""
    paired_b = set(pairs.values())

    def lone(rows: list[tuple], taken: Iterable[int]) -> dict[tuple, int]:
        seen: Counter = Counter()
        first: dict[tuple, int] = {}
        for op_id, step, _phase, kind, _module, _name, key in rows:
            if kind == "source" and op_id not in taken:
                seen[(step, key[2])] += 1
                first.setdefault((step, key[2]), op_id)
        return {k: op_id for k, op_id in first.items() if seen[k] == 1 and all(s is not None for s in k[1])}

    t_lone, b_lone = lone(t_rows, pairs), lone(b_rows, paired_b)
    for key, op_id in t_lone.items():
        if key in b_lone:
            pairs[op_id] = b_lone[key]


def _rows(ops: pd.DataFrame, keys: list[tuple]) -> list[tuple]:
    return list(
        zip(
            ops["op_id"].tolist(),
            ops["step"].tolist(),
            ops["phase"].tolist(),
            ops["kind"].tolist(),
            ops["module"].tolist(),
            ops["name"].tolist(),
            keys,
        )
    )


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


# ---------------------------------------------------------------------------------------- regions
#
# One-to-one pairing leaves ops unpaired where the two runs compute the same values differently:
# a fused kernel against its decomposition, a different decomposition, casts autocast inserts on
# one side. ``find_regions`` groups them by dataflow into Regions (records.Region), judged at their
# boundary. It works on the pairs ``align_nodes`` made, in four steps:
#
# 1. Pairs whose inputs contradict the dataflow (the target op reads a value whose partner is not
#    what the bench op reads, and that bench value comes from a paired op) are undone: a key match
#    inside a region, not a counterpart.
# 2. Unpaired ops form clusters per side (connected through the tensors they pass each other,
#    within one step and phase).
# 3. Clusters are linked where their values meet: a paired op reads, in the same argument position,
#    a target cluster's output and a bench cluster's output (the fused op's output and the last op
#    of its decomposition); or both sides' clusters wrote the last version of the same tensor in
#    place (a fused optimizer's parameters). A one-sided value change upstream of the other side's
#    compensating change (q and k each scaled by sqrt(scale) against the scores scaled once) is
#    linked across the pairs in between, which then belong to the region. What is left unlinked
#    in a scope joins that scope's region.
# 4. Each linked group is a Region; its outputs get the bench tensors they stand for.

_PASS_ARGS = {
    "mul": ("other", 1.0),
    "div": ("other", 1.0),
    "add": ("other", 0.0),
    "sub": ("other", 0.0),
    "pow": ("exponent", 1.0),
}
_NEAR = 12  # ops between a one-sided change and the other side's compensating one (merge rule, step 3)


def is_pass_through(op: str, args: str, kind: str) -> bool:
    """An op that moves, casts or copies values without computing (a view, ``_to_copy``, ``clone``,
    ``mul`` by 1): on one side only it changes nothing but the dtype's rounding.

    >>> is_pass_through("aten._to_copy.default", '{"dtype": "bfloat16"}', "op")
    True
    >>> is_pass_through("aten.mul.Tensor", '{"self": {"tensor": 0}, "other": 1.0}', "op"), is_pass_through("aten.mul.Tensor", '{"other": 0.5}', "op")
    (True, False)
    """
    if kind == "view" or is_copy(op):
        return True
    name = base_name(op).rstrip("_")
    rule = _PASS_ARGS.get(name)
    if rule is None:
        return False
    try:
        parsed = boundedjson.loads(args, max_bytes=boundedjson.ARGS_MAX_BYTES) if args else {}
    except ValueError:
        return False
    value = parsed.get(rule[0]) if isinstance(parsed, dict) else None
    return isinstance(value, (int, float)) and not isinstance(value, bool) and float(value) == rule[1]


@dataclass(slots=True)
class _Node:
    op_id: int
    step: int
    phase: str
    kind: str
    op: str
    module: str
    args: str
    inputs: list[int]
    outputs: list[int]
    inplace: bool


@dataclass
class SideGraph:
    """One trace's nodes and tensors as plain lookups (what region finding walks)."""

    nodes: dict[int, _Node]
    order: list[int]  # op ids in execution order
    producer: dict[int, int]  # tensor id -> op id
    base: dict[int, int]  # view tensor id -> the non-view tensor it shows
    numel: dict[int, int]
    consumers: dict[int, list[int]]  # tensor id -> op ids that read it
    shape: dict[int, tuple[int, ...]]

    @classmethod
    def of(
        cls,
        ops: pd.DataFrame,
        inputs: list[list[int]],
        outputs: list[list[int]],
        tensors: pd.DataFrame,
        base: Mapping[int, int],
    ) -> "SideGraph":
        """From a trace's ops (rows in execution order) with their id lists, and its tensors."""
        columns = [ops[c].tolist() for c in ("op_id", "step", "phase", "kind", "op", "module", "args", "inplace")]
        nodes: dict[int, _Node] = {}
        producer: dict[int, int] = {}
        consumers: dict[int, list[int]] = defaultdict(list)
        for (op_id, step, phase, kind, op, module, args, inplace), ins, outs in zip(zip(*columns), inputs, outputs):
            nodes[op_id] = _Node(op_id, step, phase, kind, op, module, args or "", list(ins), list(outs), bool(inplace))
            for t in outs:
                producer[t] = op_id
            for t in ins:
                consumers[t].append(op_id)
        shapes = {
            t: tuple(int(d) for d in s) if s is not None else ()
            for t, s in zip(tensors["tensor_id"].tolist(), tensors["shape"].tolist())
        }
        numel = {t: math.prod(s) for t, s in shapes.items()}
        return cls(nodes, list(nodes), producer, dict(base), numel, consumers, shapes)

    def root(self, tid: int) -> int:
        return self.base.get(tid, tid)


@dataclass
class RegionMatch:
    """What :func:`find_regions` found for one rank."""

    pairs: dict[int, int]  # the one-to-one pairs that stand (region members removed)
    regions: list[Region]
    partners: dict[int, int]  # target tensor id -> bench tensor id at region outputs (views resolved)
    # (target op id, input position) -> region id: the bench reads there what a bench-only region made
    bench_only: dict[tuple[int, int], int]
    member_of: dict[int, int]  # target op id -> region id
    bench_member_of: dict[int, int]  # bench op id -> region id


class _Union:
    def __init__(self) -> None:
        self.parent: dict[tuple[str, int], tuple[str, int]] = {}

    def find(self, x: tuple[str, int]) -> tuple[str, int]:
        parent = self.parent
        root = x
        while parent.setdefault(root, root) != root:
            root = parent[root]
        while parent[x] != root:
            parent[x], x = root, parent[x]
        return root

    def union(self, a: tuple[str, int], b: tuple[str, int]) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


@dataclass(frozen=True)
class _Correspondence:
    """How the two sides' values correspond: the paired ones, and where those of unpaired ops meet
    (step 3 of :func:`find_regions`)."""

    corr: dict[int, int]  # target tensor -> bench tensor, made by consistent pairs
    meet: dict[int, int]  # target tensor -> bench tensor, both made by unpaired ops
    one_t: dict[int, int]  # target tensor made by a target-only op -> the bench tensor read there
    one_b: dict[tuple[int, int], int]  # (target consumer, position) -> bench tensor made by a bench-only op
    linked: set[tuple[str, int]]  # the unpaired ops a value of the other side meets


def find_regions(t: SideGraph, b: SideGraph, pairs: Mapping[int, int], rank: int = 0, first_id: int = 0) -> RegionMatch:
    """Group what one-to-one pairing left over into regions (see the comment above).

    >>> match = find_regions(target_graph, bench_graph, align_nodes(...))   # doctest: +SKIP
    >>> [r.describe() for r in match.regions]                                # doctest: +SKIP
    ['fused: 1 target op against 12 bench ops in attn.core (forward)']
    """
    pairs = dict(pairs)
    corr = _consistent_pairs(t, b, pairs)
    paired_b = set(pairs.values())
    # A source only paired ops read (a parameter that enters the first compared step as a source on
    # one side and as the optimizer's output on the other) is compared as a source, not a region.
    free_t = [o for o in t.order if o not in pairs and not _read_by_pairs_only(t, o, pairs)]
    free_b = [o for o in b.order if o not in paired_b and not _read_by_pairs_only(b, o, paired_b)]
    if not free_t and not free_b:
        return RegionMatch(pairs, [], _source_partners(t, b, pairs, set()), {}, {}, {})
    in_t, in_b = set(free_t), set(free_b)
    _unpair_contradicted(t, b, pairs, corr, in_t, in_b)
    groups = _cluster_free(t, b, free_t, free_b, in_t, in_b)
    # Step 3: where the two sides' values meet.
    values = _meet(t, b, pairs, corr, groups, in_t, in_b)
    _merge_compensating(t, b, pairs, groups, in_t, in_b, values)

    # Clusters that met nothing join their scope's region (dead ends: detach, .item() reads).
    _join_residue(t, b, groups, in_t, in_b, values.linked)
    _absorb_constants(t, b, pairs, groups, in_t, in_b)

    # Step 4: the regions.
    members: dict[tuple[str, int], tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
    for key in [("t", o) for o in in_t] + [("b", o) for o in in_b]:
        members[groups.find(key)][0 if key[0] == "t" else 1].append(key[1])
    regions: list[Region] = []
    partners: dict[int, int] = {}
    member_of: dict[int, int] = {}
    bench_member_of: dict[int, int] = {}
    bench_only: dict[tuple[int, int], int] = {}
    bench_to_target = {B: T for T, B in corr.items()}
    ordered = sorted(members.values(), key=lambda m: (min(m[0]) if m[0] else math.inf, min(m[1]) if m[1] else math.inf))
    for t_ops, b_ops in ordered:
        t_ops.sort()
        b_ops.sort()
        region_id = first_id + len(regions)
        region = _region(region_id, rank, t, b, t_ops, b_ops, values, bench_to_target)
        regions.append(region)
        for o in t_ops:
            member_of[o] = region_id
        for o in b_ops:
            bench_member_of[o] = region_id
        for T, B in region.outputs:
            rt, rb = t.root(T), b.root(B)
            if t.numel.get(rt) == b.numel.get(rb) or _broadcasts(t.shape.get(rt), b.shape.get(rb)):
                partners.setdefault(rt, rb)
    for rt, rb in _source_partners(t, b, pairs, in_t).items():
        partners.setdefault(rt, rb)
    for (t_op, position), B in values.one_b.items():
        region_id = bench_member_of.get(b.producer.get(B, -1))
        if region_id is not None:
            bench_only[(t_op, position)] = region_id
    return RegionMatch(pairs, regions, partners, bench_only, member_of, bench_member_of)


def _cluster_free(
    t: SideGraph, b: SideGraph, free_t: list[int], free_b: list[int], in_t: set[int], in_b: set[int]
) -> _Union:
    """Each side's free ops, joined with the free ops of the same step and phase whose outputs they read."""
    groups = _Union()
    for side, graph, free in (("t", t, free_t), ("b", b, free_b)):
        members = in_t if side == "t" else in_b
        for o in free:
            node = graph.nodes[o]
            groups.find((side, o))
            for tid in node.inputs:
                p = graph.producer.get(tid)
                if p in members and (graph.nodes[p].step, graph.nodes[p].phase) == (node.step, node.phase):
                    groups.union((side, o), (side, p))
    return groups


def _meet(
    t: SideGraph,
    b: SideGraph,
    pairs: Mapping[int, int],
    corr: dict[int, int],
    groups: _Union,
    in_t: set[int],
    in_b: set[int],
) -> _Correspondence:
    """Where the values of unpaired ops reach a pair or the other side's final versions (step 3):
    the clusters meeting there joined, and the values recorded."""
    meet: dict[int, int] = {}
    one_t: dict[int, int] = {}
    one_b: dict[tuple[int, int], int] = {}
    linked: set[tuple[str, int]] = set()
    for t_op in t.order:
        b_op = pairs.get(t_op)
        if b_op is None:
            continue
        for position, (T, B) in enumerate(zip(t.nodes[t_op].inputs, b.nodes[b_op].inputs)):
            pt, pb = t.producer.get(T), b.producer.get(B)
            open_t, open_b = pt in in_t, pb in in_b
            if open_t and open_b:
                groups.union(("t", pt), ("b", pb))
                linked.update((("t", pt), ("b", pb)))
                meet.setdefault(T, B)
            elif open_t:
                one_t.setdefault(T, B)
                linked.add(("t", pt))
            elif open_b:
                one_b[(t_op, position)] = B
                linked.add(("b", pb))
    for T, B in _final_versions(t, b, corr, in_t, in_b):
        groups.union(("t", t.producer[T]), ("b", b.producer[B]))
        linked.update((("t", t.producer[T]), ("b", b.producer[B])))
        meet.setdefault(T, B)
    return _Correspondence(corr, meet, one_t, one_b, linked)


def _source_partners(t: SideGraph, b: SideGraph, pairs: Mapping[int, int], in_regions: set[int]) -> dict[int, int]:
    """For target sources outside regions and pairs: the bench tensor a paired reader reads in the
    same argument position, where the shapes are equal (a parameter entering the first compared
    step, which the bench made in an earlier one)."""
    found: dict[int, int] = {}
    for o in t.order:
        if o in pairs or o in in_regions or t.nodes[o].kind != "source":
            continue
        for T in t.nodes[o].outputs:
            for c in t.consumers.get(T, ()):
                if c not in pairs:
                    continue
                for position, read in enumerate(t.nodes[c].inputs):
                    if read == T and position < len(b.nodes[pairs[c]].inputs):
                        rt, rb = t.root(T), b.root(b.nodes[pairs[c]].inputs[position])
                        if t.shape.get(rt) == b.shape.get(rb):
                            found.setdefault(rt, rb)
    return found


def _read_by_pairs_only(graph: SideGraph, op_id: int, paired: Mapping[int, int] | set[int]) -> bool:
    """Whether ``op_id`` is a source whose values only paired ops read."""
    node = graph.nodes[op_id]
    if node.kind != "source":
        return False
    readers = [c for x in node.outputs for c in graph.consumers.get(x, ())]
    return bool(readers) and all(c in paired for c in readers)


def _unpair_contradicted(
    t: SideGraph, b: SideGraph, pairs: dict[int, int], corr: dict[int, int], in_t: set[int], in_b: set[int]
) -> None:
    """Undo pairs of pass-through ops that say one region-made target value is two different bench
    values, where the other route carries it to a paired computation and theirs never does.

    The fused attention's output is saved for its backward through a ``detach``; the eager side
    saves its softmax probabilities the same way. With equal shapes the two detaches pair, and
    would say the attention output *is* the probabilities, while the transpose that leads to the
    output projection says what it really is. Only paired ops that go on to compute show how
    values correspond; a saved-for-backward chain ends in the other region and shows nothing. The
    undone ops join the regions around them (their ops are added to ``in_t`` and ``in_b``)."""
    evidence: dict[int, list[tuple[int, int]]] = defaultdict(list)  # target root -> (bench root, pair's target op)
    for t_op in t.order:
        b_op = pairs.get(t_op)
        if b_op is None:
            continue
        for T, B in zip(t.nodes[t_op].inputs, b.nodes[b_op].inputs):
            if t.producer.get(T) in in_t and b.producer.get(B) in in_b:
                evidence[t.root(T)].append((b.root(B), t_op))
    for routes in evidence.values():
        if len({bench for bench, _ in routes}) < 2:
            continue
        reach = {t_op: not _passes(t, t_op) or _reaches_computation(t, pairs, t_op) for _, t_op in routes}
        if not any(reach.values()):
            continue
        for _, t_op in routes:
            if not reach[t_op]:
                _dissolve_chain(t, pairs, corr, in_t, in_b, t_op)


def _passes(graph: SideGraph, op_id: int) -> bool:
    node = graph.nodes[op_id]
    return is_pass_through(node.op, node.args, node.kind)


def _reaches_computation(t: SideGraph, pairs: Mapping[int, int], start: int) -> bool:
    """Whether ``start``'s outputs, moved only by pass-through ops, are read by a paired op that computes."""
    frontier, seen = [start], {start}
    while frontier:
        op_id = frontier.pop()
        for T in t.nodes[op_id].outputs:
            for c in t.consumers.get(T, ()):
                if c in seen:
                    continue
                seen.add(c)
                if not _passes(t, c):
                    if c in pairs:
                        return True
                    continue
                frontier.append(c)
    return False


def _dissolve_chain(
    t: SideGraph, pairs: dict[int, int], corr: dict[int, int], in_t: set[int], in_b: set[int], start: int
) -> None:
    """Unpair ``start`` and the paired pass-through ops that move its outputs on."""
    frontier = [start]
    while frontier:
        op_id = frontier.pop()
        if op_id not in pairs:
            continue
        in_b.add(pairs.pop(op_id))
        in_t.add(op_id)
        for T in t.nodes[op_id].outputs:
            corr.pop(T, None)
            frontier.extend(c for c in t.consumers.get(T, ()) if c in pairs and _passes(t, c))


def _broadcasts(a: tuple[int, ...] | None, b: tuple[int, ...] | None) -> bool:
    """One shape is the other broadcast (a [T, T] mask and the bench's [B, 1, T, T] one): their
    statistics (extremes, mean, rms) compare, element by element they do not.

    >>> _broadcasts((8, 8), (4, 1, 8, 8)), _broadcasts((8, 8), (4, 8))
    (True, False)
    """
    if a is None or b is None or a == b:
        return False
    small, large = sorted((a, b), key=len)
    padded = (1,) * (len(large) - len(small)) + small
    stretched = any(x != y for x, y in zip(padded, large))
    return (
        stretched
        and all(x == y or x == 1 or y == 1 for x, y in zip(padded, large))
        and (all(x in (y, 1) for x, y in zip(padded, large)) or all(y in (x, 1) for x, y in zip(padded, large)))
    )


def _consistent_pairs(t: SideGraph, b: SideGraph, pairs: dict[int, int]) -> dict[int, int]:
    """Undo pairs whose inputs contradict the dataflow (step 1); returns the tensor correspondence
    (target tensor -> bench tensor, views included) of the pairs that stand."""
    corr: dict[int, int] = {}
    paired_b = set(pairs.values())
    for t_op in t.order:
        b_op = pairs.get(t_op)
        if b_op is None:
            continue
        tn, bn = t.nodes[t_op], b.nodes[b_op]
        if tn.kind != "source" and _contradicts(tn, bn, t, b, corr, paired_b):
            del pairs[t_op]
            paired_b.discard(b_op)
            continue
        for T, B in zip(tn.outputs, bn.outputs):
            corr[T] = B
    return corr


def _contradicts(tn: _Node, bn: _Node, t: SideGraph, b: SideGraph, corr: Mapping[int, int], paired_b: set[int]) -> bool:
    for T, B in zip(tn.inputs, bn.inputs):
        known = corr.get(T)
        if known is None or known == B:
            continue  # a value only the target made (a region's output), or the same value
        if corr.get(t.root(T), -1) == b.root(B):
            continue  # the same value, read through another view
        if b.producer.get(B) in paired_b:
            return True  # the bench op reads another paired value: not this op's counterpart
    return False


def _written(graph: SideGraph, node: _Node) -> list[tuple[int, int]]:
    """(new version, old version) tensor ids for what an in-place op wrote, from its schema and
    recorded arguments; positional (output k wrote input k) where the schema is unknown."""
    if not node.inplace:
        return []
    from tracecmp.aten.schema import WRITE, op_info, resolve

    func = resolve(node.op)
    try:
        args = boundedjson.loads(node.args, max_bytes=boundedjson.ARGS_MAX_BYTES) if node.args else {}
    except ValueError:
        args = {}
    if func is None or not hasattr(func, "_schema") or not isinstance(args, dict):
        return list(zip(node.outputs, node.inputs))
    info = op_info(func)
    written: list[int] = []
    for kind, ref in info.returns:
        if kind != WRITE or ref is None:
            return []  # a fresh return too: outputs cannot be told apart by position
        written.extend(_tensor_inputs(args.get(ref[1]), node.inputs))
    for ref in info.extra_writes:
        written.extend(_tensor_inputs(args.get(ref[1]), node.inputs))
    if len(written) != len(node.outputs):
        return []
    return list(zip(node.outputs, written))


def _tensor_inputs(value: Any, inputs: list[int]) -> list[int]:
    items = value if isinstance(value, list) else [value]
    out = []
    for item in items:
        if (
            isinstance(item, dict)
            and set(item) == {"tensor"}
            and isinstance(item["tensor"], int)
            and item["tensor"] < len(inputs)
        ):
            out.append(inputs[item["tensor"]])
    return out


def _versions(graph: SideGraph, ops: Iterable[int]) -> tuple[dict[int, int], dict[int, int]]:
    """For the in-place writes among ``ops``: each version's first version, and each first
    version's last."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for o in ops:
        for new, old in _written(graph, graph.nodes[o]):
            origin = first.get(old, old)
            first[new] = origin
            last[origin] = new
    return first, last


def _final_versions(
    t: SideGraph, b: SideGraph, corr: Mapping[int, int], in_t: set[int], in_b: set[int]
) -> list[tuple[int, int]]:
    """(target tensor, bench tensor): the last versions of a tensor both sides' unpaired ops wrote
    in place and nothing read afterwards (a fused optimizer's parameters and moments)."""
    writers_t = [o for o in t.order if o in in_t and t.nodes[o].inplace]
    writers_b = [o for o in b.order if o in in_b and b.nodes[o].inplace]
    if not writers_t or not writers_b:
        return []
    first_t, last_t = _versions(t, writers_t)
    _, last_b = _versions(b, writers_b)
    found = []
    for origin, final in last_t.items():
        if any(c not in in_t for c in t.consumers.get(final, ())):
            continue  # read by a paired op: the meeting there decides
        bench_origin = corr.get(origin)
        if bench_origin is None:
            continue
        bench_final = last_b.get(bench_origin)
        if bench_final is not None and bench_final in b.producer:
            found.append((final, bench_final))
    return found


def _join_residue(
    t: SideGraph, b: SideGraph, groups: _Union, in_t: set[int], in_b: set[int], linked: set[tuple[str, int]]
) -> None:
    """Clusters no value of the other side meets (dead ends such as a ``detach`` nothing reads, a
    bench's ``.item()`` reads of its step counters) join the two-sided region of their (step,
    phase, module) scope, or else the other such clusters of the scope."""
    keys = [("t", o) for o in sorted(in_t)] + [("b", o) for o in sorted(in_b)]
    clusters: dict[tuple[str, int], list[tuple[str, int]]] = defaultdict(list)
    for key in keys:
        clusters[groups.find(key)].append(key)
    linked_roots = {groups.find(k) for k in linked}

    def scope(key: tuple[str, int]) -> tuple:
        node = (t if key[0] == "t" else b).nodes[key[1]]
        return (node.step, node.phase, node.module)

    two_sided: dict[tuple, tuple[str, int]] = {}
    for root, members in clusters.items():
        if root in linked_roots and {k[0] for k in members} == {"t", "b"}:
            for key in members:
                two_sided.setdefault(scope(key), root)
    leftover: dict[tuple, list[tuple[str, int]]] = defaultdict(list)
    for root, members in clusters.items():
        if root in linked_roots:
            continue
        target = next((two_sided[scope(k)] for k in members if scope(k) in two_sided), None)
        if target is not None:
            groups.union(root, target)
        else:
            leftover[scope(members[0])].append(root)
    for roots in leftover.values():
        for root in roots[1:]:
            groups.union(roots[0], root)


def _absorb_constants(
    t: SideGraph, b: SideGraph, pairs: dict[int, int], groups: _Union, in_t: set[int], in_b: set[int]
) -> None:
    """A pair that only feeds one region, on both sides, and either reads no tensor (a constant:
    ``scalar_tensor(-inf)`` against ``scalar_tensor(finfo.min)``) or was called with other
    arguments, is part of that region's computation: a key match, not a counterpart."""
    for t_op in sorted(pairs, reverse=True):  # consumers first, so a chain of such pairs goes in whole
        b_op = pairs[t_op]
        tn, bn = t.nodes[t_op], b.nodes[b_op]
        if tn.kind == "source" or (tn.inputs and tn.args == bn.args):
            continue
        uses_t = {c for x in tn.outputs for c in t.consumers.get(x, ())}
        uses_b = {c for x in bn.outputs for c in b.consumers.get(x, ())}
        if not uses_t or not uses_b or not uses_t <= in_t or not uses_b <= in_b:
            continue
        roots = {groups.find(("t", c)) for c in uses_t} | {groups.find(("b", c)) for c in uses_b}
        if len(roots) != 1:
            continue
        del pairs[t_op]
        in_t.add(t_op)
        in_b.add(b_op)
        groups.union(("t", t_op), roots.pop())
        groups.union(("t", t_op), ("b", b_op))


def _merge_compensating(
    t: SideGraph,
    b: SideGraph,
    pairs: dict[int, int],
    groups: _Union,
    in_t: set[int],
    in_b: set[int],
    values: _Correspondence,
) -> None:
    """Link a one-sided change of values with the other side's change that makes up for it within a
    few ops, and the pairs between them (step 3): the target scales q and k by sqrt(scale) where the
    bench scales the scores once, and in the backward the bench scales the scores' gradient where
    the target scales the gradients of q and k. The pairs on the way are dissolved into the region
    (their ops join ``in_t`` and ``in_b``)."""
    one_t, one_b, meet = values.one_t, values.one_b, values.meet
    changing_t = {t.producer[T] for T in one_t if not _cluster_passes(t, groups, ("t", t.producer[T]), in_t)}
    changing_b: dict[int, list[tuple[int, int]]] = defaultdict(list)  # target consumer -> (position, bench op)
    for (t_op, position), B in one_b.items():
        pb = b.producer.get(B)
        if pb is not None and not _cluster_passes(b, groups, ("b", pb), in_b):
            changing_b[t_op].append((position, pb))
    dissolved: set[int] = set()
    if not changing_t or not changing_b:
        return

    def dissolve(path_end: int | None, previous: Mapping[int, int | None], anchor: tuple[str, int]) -> None:
        step = path_end
        while step is not None:
            if step in pairs:
                b_op = pairs.pop(step)
                in_t.add(step)
                in_b.add(b_op)
                groups.union(anchor, ("t", step))
                groups.union(anchor, ("b", b_op))
                dissolved.add(step)
            step = previous.get(step)

    # A target-only change, then the bench's further down.
    for start in sorted(changing_t):
        origin = t.nodes[start]
        starts = [c for T in origin.outputs for c in t.consumers.get(T, ()) if c in pairs or c in dissolved]
        previous = _walk_near(t, pairs, dissolved, starts, origin)
        for consumer in [c for c in previous if c in changing_b]:
            for position, pb in changing_b[consumer]:
                groups.union(("t", start), ("b", pb))
                # The compensated value is where the two sides meet again.
                meet.setdefault(t.nodes[consumer].inputs[position], one_b[(consumer, position)])
            dissolve(previous[consumer], previous, ("t", start))
    # A bench-only change, then the target's further down (the backward of the case above).
    for consumer, changes in sorted(changing_b.items()):
        if consumer not in pairs and consumer not in dissolved:
            continue
        previous = _walk_near(t, pairs, dissolved, [consumer], t.nodes[consumer])
        for op_id in list(previous):
            for T in t.nodes[op_id].outputs:
                for c in t.consumers.get(T, ()):
                    if c not in changing_t:
                        continue
                    for _, pb in changes:
                        groups.union(("t", c), ("b", pb))
                    for out in t.nodes[c].outputs:
                        if out in one_t:
                            meet.setdefault(out, one_t[out])
                    dissolve(op_id, previous, ("t", c))


def _walk_near(
    t: SideGraph, pairs: Mapping[int, int], dissolved: set[int], starts: list[int], origin: _Node
) -> dict[int, int | None]:
    """Paired (or dissolved) target ops downstream of ``starts`` within ``_NEAR`` ops of the same
    step and phase as ``origin``, each with the op it was reached from."""
    previous: dict[int, int | None] = {s: None for s in starts}
    frontier = [(s, 1) for s in starts]
    while frontier:
        op_id, depth = frontier.pop(0)
        if depth >= _NEAR:
            continue
        for T in t.nodes[op_id].outputs:
            for c in t.consumers.get(T, ()):
                node = t.nodes[c]
                if (
                    (c in pairs or c in dissolved)
                    and c not in previous
                    and (node.step, node.phase) == (origin.step, origin.phase)
                ):
                    previous[c] = op_id
                    frontier.append((c, depth + 1))
    return previous


def _cluster_passes(graph: SideGraph, groups: _Union, key: tuple[str, int], members: set[int]) -> bool:
    """Whether every op of ``key``'s cluster only moves or casts values."""
    root = groups.find(key)
    side = key[0]
    return all(
        is_pass_through(graph.nodes[o].op, graph.nodes[o].args, graph.nodes[o].kind)
        for o in members
        if groups.find((side, o)) == root
    )


def _region(
    region_id: int,
    rank: int,
    t: SideGraph,
    b: SideGraph,
    t_ops: list[int],
    b_ops: list[int],
    values: _Correspondence,
    bench_to_target: Mapping[int, int],
) -> Region:
    """The region of the target ops ``t_ops`` and the bench ops ``b_ops``: its inputs, its outputs
    (where the two sides' values meet) and its kind."""
    corr, meet, one_t = values.corr, values.meet, values.one_t
    set_b = set(b_ops)
    made_t = {x for o in t_ops for x in t.nodes[o].outputs}
    made_b = {x for o in b_ops for x in b.nodes[o].outputs}
    inputs: list[tuple[int | None, int | None]] = []
    seen_b: set[int] = set()
    for o in t_ops:
        for T in t.nodes[o].inputs:
            if T in made_t or any(T == x for x, _ in inputs):
                continue
            B = corr.get(T)
            inputs.append((T, B))
            if B is not None:
                seen_b.add(B)
    for o in b_ops:
        for B in b.nodes[o].inputs:
            if B not in made_b and B not in seen_b:
                seen_b.add(B)
                # A value both runs hold that only the bench side reads here (the fused backward
                # reads q, k, v where the target's chain reads its own saved copies of them).
                inputs.append((bench_to_target.get(B), B))
    outputs: list[tuple[int, int]] = []
    for o in t_ops:
        for T in t.nodes[o].outputs:
            B = meet.get(T)
            if B is None and not set_b:
                B = one_t.get(T)
            if B is not None and (B in made_b or not set_b):
                outputs.append((T, B))
    computing_t = [o for o in t_ops if t.nodes[o].kind == "op"]
    computing_b = [o for o in b_ops if b.nodes[o].kind == "op"]
    passes = all(is_pass_through(t.nodes[o].op, t.nodes[o].args, t.nodes[o].kind) for o in t_ops) and all(
        is_pass_through(b.nodes[o].op, b.nodes[o].args, b.nodes[o].kind) for o in b_ops
    )
    paired_in = [B for _, B in inputs if B is not None]
    if passes and not set_b and len(paired_in) == 1:
        # A cast or copy the bench lacks whose output nothing downstream reads (a loss cast for
        # logging): it stands for the value it was made from, the bench's own tensor.
        mapped = {T for T, _ in outputs}
        outputs.extend(
            (T, paired_in[0]) for o in t_ops for T in t.nodes[o].outputs if T not in mapped and t.nodes[o].kind == "op"
        )
    if passes:
        kind = "pass-through"
    elif t_ops and b_ops:
        kind = "fused" if (len(computing_t) == 1) != (len(computing_b) == 1) else "rewritten"
    else:
        kind = "extra" if t_ops else "missing"
    lead = t.nodes[t_ops[0]] if t_ops else b.nodes[b_ops[0]]
    modules = [t.nodes[o].module for o in (computing_t or t_ops)] or [b.nodes[o].module for o in (computing_b or b_ops)]
    return Region(
        region_id=region_id,
        rank=rank,
        step=int(lead.step),
        phase=lead.phase,
        module=_common_module(modules),
        kind=kind,
        target_ops=tuple(t_ops),
        bench_ops=tuple(b_ops),
        inputs=tuple(inputs),
        outputs=tuple(outputs),
        target_names=tuple(t.nodes[o].op for o in t_ops),
        bench_names=tuple(b.nodes[o].op for o in b_ops),
    )


def _common_module(modules: list[str]) -> str:
    """The longest dotted prefix all ``modules`` share ("" when none)."""
    if not modules:
        return ""
    parts = [m.split(".") if m else [] for m in modules]
    common: list[str] = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)
