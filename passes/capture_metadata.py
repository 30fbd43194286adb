"""capture_metadata: gather each graph's metadata refill into one capture group at the head of the graph.

The refill (positions from seq_len, page rows and cache rows from the page table, state slots) is
device work derived from relay buffers (techniques.md section 3). This pass
  1. merges identical refill ops (same op, same inputs, no write to those inputs in between), e.g. the
     page rows the draft graph recomputed for every MTP call;
  2. moves every refill op to the head of its graph, in order, when nothing before it writes what it reads;
  3. tags them node.meta['lingc.capture'] = 'metadata', so the runtime captures them as their own group
     (replayed with, or beside, the graph; the GPU issue does the capture).
Before (draft):  ... L6 attention ..., paged_refill_1, ..., paged_refill_2, ...
After:           paged_refill (capture=metadata), step_positions (capture=metadata), ... L6 attention ...
Only order and sharing change: numerics unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from lingc.ops import OPS
from lingc.program import Program
from lingc.passes.base import Pass
from lingc.passes.matchers import is_free, written_inputs

REFILL_OPS = {OPS.gather_rows, OPS.step_positions, OPS.cache_locs, OPS.paged_refill}
INDEX_MATH = {torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor}     # positions + i, counter + k


def _mutated_inputs_of(node: fx.Node) -> set[fx.Node]:
    return written_inputs(node)


def _is_refill(node: fx.Node, group: set[fx.Node]) -> bool:
    """A refill op whose inputs are graph inputs, constants or other refill nodes (through free views)."""
    if node.op != "call_function":
        return False
    index_math = node.target in INDEX_MATH and not node.meta["lingc.tensor"].dtype.is_floating_point
    if node.target not in REFILL_OPS and not index_math and not (is_free(node) and node.args and node.args[0] in group):
        return False
    return all(i.op == "placeholder" or i in group for i in node.all_input_nodes)


class CaptureMetadata(Pass):
    name = "capture_metadata"
    summary = "merge duplicate metadata-refill ops and hoist them into one capture group per graph"
    after = ("partition", "fuse_index_chains")
    changes_numerics = False

    def apply(self, program: Program) -> dict[str, Any]:
        merged, groups = 0, {}
        for gname, graph in program.graphs.items():
            merged += _merge_duplicates(graph)
            groups[gname] = _hoist(graph)
        return {"matches": sum(len(v) for v in groups.values()), "merged": merged, "groups": groups}


def _merge_duplicates(graph: fx.Graph) -> int:
    seen: dict[tuple, fx.Node] = {}
    merged = 0
    for node in list(graph.nodes):
        for w in _mutated_inputs_of(node):
            for key, first in list(seen.items()):
                if w in first.all_input_nodes:
                    del seen[key]              # its input changed: a later copy is not the same value
        if node.op != "call_function" or node.target not in REFILL_OPS:
            continue
        key = (node.target, repr(fx.node.map_arg((node.args, node.kwargs), lambda n: n.name)))
        if key in seen:
            node.replace_all_uses_with(seen[key])
            graph.erase_node(node)
            merged += 1
        else:
            seen[key] = node
    return merged


def _hoist(graph: fx.Graph) -> list[str]:
    head = next((n for n in graph.nodes if n.op != "placeholder"), None)
    if head is None:
        return []
    written: set[fx.Node] = set()
    group: set[fx.Node] = set()
    order: list[fx.Node] = []
    for node in list(graph.nodes):
        if _is_refill(node, group) and not (set(node.all_input_nodes) & written):
            group.add(node)
            order.append(node)
        written |= _mutated_inputs_of(node)
    anchor = None
    for node in order:
        if anchor is None:
            head.prepend(node)
        else:
            anchor.append(node)
        anchor = node
        if not is_free(node):
            node.meta["lingc.capture"] = "metadata"
    return [n.name for n in order if not is_free(n)]
