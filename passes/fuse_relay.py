"""fuse_relay: a graph's relay reads by one slots tensor in one gather_rows_multi, its relay writes in one
scatter_rows_multi that also does the integer `+ k` of a counter it writes.

Before (step, test-tiny):
    gather_rows    = lingc.gather_rows(relay_seq_len, slots)       # i64[1]
    gather_rows_8  = lingc.gather_rows(relay_root, slots)          # i64[1]
    ... 5 more (temperature f32, top_k i64, top_p f32, seed i64, rng_counter i64)
    add_14 = aten.add.Tensor(gather_rows, 1)                       # read only by the scatter below
    add_15 = aten.add.Tensor(gather_rows_13, 1)
    ...
    scatter_rows   = lingc.scatter_rows(relay_root, slots, view_36)
    scatter_rows_3 = lingc.scatter_rows(relay_seq_len, slots, add_14)
    scatter_rows_4 = lingc.scatter_rows(relay_rng_counter, slots, add_15)
After:
    gather_rows_multi = lingc.gather_rows_multi([relay_seq_len, relay_root, ...], slots)   # 7 x [1]
    gather_rows = getitem(gather_rows_multi, 0); gather_rows_8 = getitem(gather_rows_multi, 1); ...
    ...
    scatter_rows_multi = lingc.scatter_rows_multi([relay_root, relay_seq_len, relay_rng_counter], slots,
                                                  [view_36, gather_rows, gather_rows_13], [0, 1, 1])
Launches: 7 + 2 + 3 -> 2 in the step (the adds were torch kernels, which also ended the PDL run of the Triton
kernels around them).

Rules (per graph, per slots node):
  - gathers: `gather_rows(table, slots)` whose table is a graph input (a relay buffer, the page table) join the
    earliest group of the same slots that is not full (RELAY_MULTI_MAX tables), if nothing from the group's first
    member up to the gather writes its table or slots; the fused op runs where the first member ran, each gather
    node becoming a getitem of it (same name). They read graph inputs only, so they are independent.
  - scatters: `scatter_rows(table, slots, value)` into a graph input, value shaped [B, *row], join a group running
    where its last member ran (groups are built from the graph's end backwards), if the group has no write to the
    same table and nothing between the scatter and that place reads or writes its table, or writes its value's
    buffer or slots (a scatter moves later, never past a read of its buffer).
  - adds: a value that is `aten.add.Tensor(x, k)` / `aten.sub.Tensor(x, k)` (int k, int32 / int64, same dtype as
    x, its only reader the scatter, or the next add of such a chain) is folded: the scatter writes x + sum(k) (one
    add in x's dtype: wrapping integer adds compose exactly). Then x must not be written between the first folded
    add and the fused op either. An add with another reader stays.
  - a group of one gather stays a gather_rows; a group of one scatter becomes a one-table scatter_rows_multi only
    if it folds an add.
Same values, same order of effects on every buffer: numerics unchanged (the ops' references are the compositions).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from lingc.ops import OPS
from lingc.ops.meta import RELAY_MULTI_MAX
from lingc.program import Program
from lingc.passes.base import Pass
from lingc.passes.matchers import KEEP_META_CAPTURE, base_buffer, carried_meta, written_buffers

aten = torch.ops.aten
ADD_OPS = {aten.add.Tensor: 1, aten.sub.Tensor: -1}
INT_DTYPES = (torch.int32, torch.int64)


class _Effects:
    """A graph's nodes in order, with the buffers each one writes and reads (views resolved), computed once."""

    def __init__(self, graph: fx.Graph):
        self.nodes = list(graph.nodes)
        self.order = {n: i for i, n in enumerate(self.nodes)}
        self.writes = {n: written_buffers(n) for n in self.nodes}
        self.reads = {n: {base_buffer(i) for i in n.all_input_nodes} for n in self.nodes}

    def between(self, first: fx.Node, last: fx.Node) -> list[fx.Node]:
        """The nodes after `first` up to and including `last`."""
        return self.nodes[self.order[first] + 1:self.order[last] + 1]


def _dtype(node: fx.Node) -> torch.dtype | None:
    meta = node.meta.get("lingc.tensor")
    return getattr(meta, "dtype", None)


# ---- gathers ----------------------------------------------------------------------------------------------

def _is_relay_gather(node: fx.Node) -> bool:
    """gather_rows(table, slots) of a graph input: a relay buffer (or the page table, if fuse_index_chains left
    one)."""
    return (node.op == "call_function" and node.target is OPS.gather_rows and not node.kwargs
            and len(node.args) == 2 and isinstance(node.args[0], fx.Node) and node.args[0].op == "placeholder"
            and isinstance(node.args[1], fx.Node))


def _gather_groups(graph: fx.Graph) -> list[list[fx.Node]]:
    effects = _Effects(graph)
    groups: list[list[fx.Node]] = []
    for node in effects.nodes:
        if not _is_relay_gather(node):
            continue
        table, slots = node.args
        for group in groups:
            anchor = group[0]
            if anchor.args[1] is not slots or len(group) >= RELAY_MULTI_MAX:
                continue
            if any(effects.writes[n] & {table, base_buffer(slots)}
                   for n in effects.nodes[effects.order[anchor]:effects.order[node]]):
                continue                                   # the table (or slots) changes between: read it later
            group.append(node)
            break
        else:
            groups.append([node])
    return [g for g in groups if len(g) > 1]


def _fuse_gathers(graph: fx.Graph, group: list[fx.Node]) -> fx.Node:
    first = group[0]
    with graph.inserting_before(first):
        fused = graph.call_function(OPS.gather_rows_multi, ([g.args[0] for g in group], first.args[1]))
    fused.meta = carried_meta(first, KEEP_META_CAPTURE) | {"lingc.scope": "relay"}
    stage = first.meta.get("lingc.stage")
    fused._rename(f"{stage}_gather_rows_multi" if stage else "gather_rows_multi")
    for i, gather in enumerate(group):                   # each gather becomes the fused op's output i, same name
        gather.target, gather.args, gather.kwargs = operator.getitem, (fused, i), {}
        for key in ("lingc.capture", "lingc.pdl"):
            gather.meta.pop(key, None)
    return fused


# ---- scatters ---------------------------------------------------------------------------------------------

@dataclass
class _Write:
    """One scatter_rows as the fused op will run it: table[slots] = value + add, value read since `start`."""

    node: fx.Node
    value: fx.Node
    add: int = 0
    folded: list[fx.Node] = field(default_factory=list)   # the add / sub nodes that go, outermost first

    @property
    def table(self) -> fx.Node:
        return self.node.args[0]

    @property
    def slots(self) -> fx.Node:
        return self.node.args[1]

    @property
    def start(self) -> fx.Node:
        return self.folded[-1] if self.folded else self.node


def _fold_adds(value: fx.Node) -> tuple[fx.Node, int, list[fx.Node]]:
    """(x, k, folded): value = x + k through a chain of integer scalar adds / subs that only the chain reads."""
    add, folded = 0, []
    while (value.op == "call_function" and value.target in ADD_OPS and not value.kwargs and len(value.args) == 2
           and isinstance(value.args[0], fx.Node) and type(value.args[1]) is int and len(value.users) == 1
           and _dtype(value) in INT_DTYPES and _dtype(value.args[0]) == _dtype(value)):
        total = add + ADD_OPS[value.target] * value.args[1]
        info = torch.iinfo(_dtype(value))
        if not info.min <= total <= info.max:
            break                                          # the kernel adds a constant of the value's dtype
        add, folded, value = total, folded + [value], value.args[0]
    return value, add, folded


def _relay_write(node: fx.Node) -> _Write | None:
    if not (node.op == "call_function" and node.target is OPS.scatter_rows and not node.kwargs
            and len(node.args) == 3 and all(isinstance(a, fx.Node) for a in node.args)
            and node.args[0].op == "placeholder"):
        return None
    table, slots, value = node.args
    t, s, v = (a.meta.get("lingc.tensor") for a in (table, slots, value))
    if t is None or s is None or v is None or tuple(v.shape) != (s.shape[0], *t.shape[1:]):
        return None                                       # scatter_rows_multi takes [B, *row] values only
    x, add, folded = _fold_adds(value)
    return _Write(node, x, add, folded)


def _safe_at(effects: _Effects, write: _Write, anchor: fx.Node) -> bool:
    """Running `write` just before `anchor` (a later node, or its own scatter) gives the same buffers: nothing
    between its first read of the value and there writes the value's buffer or slots, and nothing after the scatter
    reads or writes its table."""
    skip = {write.node, *write.folded}
    inputs = {base_buffer(write.value), base_buffer(write.slots)}
    after_scatter = effects.order[write.node]
    for n in effects.between(write.start, anchor):
        if n in skip:
            continue
        if effects.writes[n] & inputs:
            return False
        if effects.order[n] > after_scatter and write.table in effects.writes[n] | effects.reads[n]:
            return False
    return True


def _can_join(effects: _Effects, write: _Write, group: list[_Write]) -> bool:
    """`write` may run in the group's op: room left, the same slots, its own table, safe at the group's place
    (group[0], the last in graph order: groups grow backwards)."""
    return (len(group) < RELAY_MULTI_MAX and write.slots is group[0].slots
            and all(m.table is not write.table for m in group) and _safe_at(effects, write, group[0].node))


def _scatter_groups(graph: fx.Graph) -> list[list[_Write]]:
    effects = _Effects(graph)
    groups: list[list[_Write]] = []
    for node in reversed(effects.nodes):
        folded = _relay_write(node)
        if folded is None:
            continue
        plain = _Write(node, node.args[2])
        for write in ([folded, plain] if folded.folded else [folded]):   # the fold may block a join; try both
            group = next((g for g in groups if _can_join(effects, write, g)), None)
            if group is not None:
                group.append(write)
                break
        else:
            groups.append([folded if _safe_at(effects, folded, node) else plain])
    return [sorted(g, key=lambda w: effects.order[w.node]) for g in groups if len(g) > 1 or g[0].folded]


def _fuse_scatters(graph: fx.Graph, group: list[_Write]) -> fx.Node:
    last = group[-1].node
    with graph.inserting_before(last):
        fused = graph.call_function(OPS.scatter_rows_multi, ([w.table for w in group], last.args[1],
                                                             [w.value for w in group], [w.add for w in group]))
    fused.meta = carried_meta(last, KEEP_META_CAPTURE) | {"lingc.scope": "relay"}
    stage = last.meta.get("lingc.stage")
    for w in group:
        graph.erase_node(w.node)
        for add in w.folded:                              # outermost first: each is unused once its reader goes
            graph.erase_node(add)
    fused._rename(f"{stage}_scatter_rows_multi" if stage else "scatter_rows_multi")
    return fused


class FuseRelay(Pass):
    name = "fuse_relay"
    summary = ("a graph's relay reads by one slots tensor -> one gather_rows_multi, its relay writes -> one "
               "scatter_rows_multi with the counters' integer adds folded in")
    after = ("partition", "fuse_index_chains", "capture_metadata")
    changes_numerics = False

    def apply(self, program: Program) -> dict[str, Any]:
        gathers: list[str] = []
        scatters: list[str] = []
        folded: list[str] = []
        for gname, graph in program.graphs.items():
            for group in _gather_groups(graph):
                gathers.append(f"{gname}:{_fuse_gathers(graph, group).name}")
            for group in _scatter_groups(graph):
                folded += [f"{gname}:{a.name}" for w in group for a in w.folded]
                scatters.append(f"{gname}:{_fuse_scatters(graph, group).name}")
        return {"matches": len(gathers) + len(scatters), "gather_rows_multi": gathers,
                "scatter_rows_multi": scatters, "adds_folded": folded}
