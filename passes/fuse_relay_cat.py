"""fuse_relay_cat: a relay write of a torch cat -> the cat's pieces written straight into column slices of the
relay table by the scatter_rows_multi that wrote the cat, one torch launch (and one round trip of its bytes) fewer.

The draft stacks what verify reads, the chain [root, d1 .. dK] and (general graphs) the draft distributions
[p1 .. pK], with `torch.cat` and relays them through a scatter_rows_multi. The cat is the only op of the TP1 step
graphs that runs outside lingc's kernels (bench/launch_audit.py): a torch launch that also ends the PDL run of the
Triton kernels around it, and in the general draft a [B, K, V] fp32 copy (~3 MB at Ling-3's vocabulary) that the
scatter then copies again.

Before (draft_greedy, K = 5):
    draft_cat = aten.cat([draft_view, draft_view_1, draft_greedy_sample, .., draft_greedy_sample_3], 1)   # [B, 6]
    draft_scatter_rows_multi = lingc.scatter_rows_multi([relay_x_draft_gather_rows, relay_x_draft_cat], slots,
                                                        [draft_gather_rows, draft_cat], [0, 0])
After:
    relay_x_draft_cat_col0 = aten.slice.Tensor(relay_x_draft_cat, 1, 0, 1)                              # [S, 1]
    ... _col1 .. _col5
    draft_scatter_rows_multi = lingc.scatter_rows_multi(
        [relay_x_draft_gather_rows, relay_x_draft_cat_col0, .., relay_x_draft_cat_col5], slots,
        [draft_gather_rows, draft_view, draft_view_1, draft_greedy_sample, .., draft_greedy_sample_3], [0] * 7)
The scatter writes column slices of one table: views that share a buffer but no element, which the launcher
checks (kernels/meta.py `_disjoint`) before it runs them in one launch.

Matched: a scatter_rows_multi value that is `aten.cat(pieces, dim)` with dim the first row dim (1, or its negative
form), the scatter its only reader, no integer add folded on it, every piece [B, w_i, *rest] in the table's dtype,
and nothing between the cat and the scatter writing a piece's buffer (the pieces are now read at the scatter).
The table's slices join the op's lists where the cat's value was; the op runs one launch per RELAY_MULTI_MAX
tables (the general draft's 1 + 6 + 5 tables: two launches, for the two cats and one launch before).

Numerics unchanged: the same elements land in the same places (copies and casts only: a cat is exact, and
scatter_rows casts each piece as it cast the cat). Order: after fuse_relay (it makes the scatter_rows_multi);
before pdl, which then chains the scatter to the launch before it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from lingc.ops import OPS
from lingc.program import Program
from lingc.passes.base import Pass
from lingc.passes.matchers import KEEP_META, base_buffer, carried_meta, written_buffers

aten = torch.ops.aten
CAT_OPS = (aten.cat.default,)


def _shape(node: Any) -> tuple[int, ...] | None:
    meta = node.meta.get("lingc.tensor") if isinstance(node, fx.Node) else None
    shape = getattr(meta, "shape", None)
    return None if shape is None else tuple(shape)


def _dtype(node: fx.Node) -> torch.dtype | None:
    return getattr(node.meta.get("lingc.tensor"), "dtype", None)


def _pieces(graph_nodes: list[fx.Node], scatter: fx.Node, table: fx.Node, value: Any, add: int) -> list[fx.Node] | None:
    """The cat's pieces when `value` (written into `table` by `scatter` with `add`) matches (module docstring)."""
    if not (isinstance(value, fx.Node) and value.op == "call_function" and value.target in CAT_OPS
            and add == 0 and len(value.users) == 1 and not value.kwargs):
        return None
    pieces, dim = value.args[0], (value.args[1] if len(value.args) > 1 else 0)
    out_shape, table_shape = _shape(value), _shape(table)
    if out_shape is None or table_shape is None or len(out_shape) < 2 or dim not in (1, 1 - len(out_shape)):
        return None
    if not all(isinstance(p, fx.Node) for p in pieces):
        return None
    shapes = [_shape(p) for p in pieces]
    if any(s is None or len(s) != len(out_shape) or s[0] != out_shape[0] or s[2:] != out_shape[2:] for s in shapes):
        return None
    if sum(s[1] for s in shapes) != table_shape[1] or any(_dtype(p) != _dtype(value) for p in pieces):
        return None
    order = {n: i for i, n in enumerate(graph_nodes)}
    buffers = {base_buffer(p) for p in pieces}
    if any(written_buffers(n) & buffers for n in graph_nodes[order[value] + 1:order[scatter]]):
        return None                                    # a piece changes before the scatter would read it
    return list(pieces)


def _fuse(graph: fx.Graph, scatter: fx.Node) -> list[str]:
    """Rewrite one scatter_rows_multi's cat values in place; returns the cats it removed."""
    tables, slots, values, adds = scatter.args
    nodes = list(graph.nodes)
    new_tables, new_values, new_adds, cats = [], [], [], []
    for table, value, add in zip(tables, values, adds):
        pieces = _pieces(nodes, scatter, table, value, add)
        if pieces is None:
            new_tables.append(table)
            new_values.append(value)
            new_adds.append(add)
            continue
        col = 0
        for i, piece in enumerate(pieces):
            width = _shape(piece)[1]
            with graph.inserting_before(scatter):
                part = graph.call_function(aten.slice.Tensor, (table, 1, col, col + width))
            part.meta = carried_meta(scatter, KEEP_META)
            part._rename(f"{table.name}_col{i}")
            new_tables.append(part)
            new_values.append(piece)
            new_adds.append(0)
            col += width
        cats.append(value)
    if not cats:
        return []
    scatter.args = (new_tables, slots, new_values, new_adds)
    names = [c.name for c in cats]
    for cat in cats:
        graph.erase_node(cat)
    return names


class FuseRelayCat(Pass):
    name = "fuse_relay_cat"
    summary = "a relay write of a torch cat -> its pieces scattered into column slices of the relay table"
    after = ("partition", "specialize_greedy", "fuse_relay")
    changes_numerics = False

    def apply(self, program: Program) -> dict[str, Any]:
        removed: list[str] = []
        for gname, graph in program.graphs.items():
            for scatter in [n for n in graph.nodes if n.op == "call_function" and n.target is OPS.scatter_rows_multi]:
                removed += [f"{gname}:{name}" for name in _fuse(graph, scatter)]
        return {"matches": len(removed), "cats_removed": removed}
