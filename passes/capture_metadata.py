"""capture_metadata: gather each graph's metadata refill into one capture group at the head of the graph.

The refill (positions from seq_len, page rows and cache rows from the page table, state slots) is
device work derived from relay buffers (techniques.md section 3). This pass
  1. merges identical refill ops (same op, same inputs, no write to those inputs in between), e.g. the
     page rows the draft graph recomputed for every MTP call, and the paged_refills of column slices of one
     positions tensor into one paged_refill of the whole tensor (the draft's one per MTP call: the same page-table
     row each time, one cache row per position), whose cache rows the old readers take as column slices;
  2. moves every refill op to the head of its graph, in order, when nothing before it writes what it reads;
  3. tags them node.meta['lingc.capture'] = 'metadata', so the runtime captures them as their own group
     (replayed with, or beside, the graph; the GPU issue does the capture).
Before (draft):  ... L6 attention ..., paged_refill_1, ..., paged_refill_2, ...
After:           paged_refill (capture=metadata), step_positions (capture=metadata), ... L6 attention ...
Sliced refills (draft, K MTP calls):
Before:  draft_slice = aten.slice(draft_step_positions, 1, 0, 1)
         draft_paged_refill = lingc.paged_refill(page_table, slots, draft_slice, 16)
         ... draft_slice_2 = aten.slice(draft_step_positions, 1, 1, 2); draft_paged_refill_1 ...
After:   draft_paged_refill = lingc.paged_refill(page_table, slots, draft_step_positions, 16)
         draft_paged_refill_locs = aten.slice(getitem(draft_paged_refill, 1), 1, 0, 1), ..._1 (1, 2), ...
K - 1 launches fewer a draft step (4 in Ling-3.0-tiny's: each the 584-entry page-table row again).
Then a paged_refill of step_positions' output (the step's, verify's and the draft's) becomes one step_refill, which
computes the positions in the same launch (one launch fewer a graph):
Before:  step_positions = lingc.step_positions(gather_rows, 1)
         model_paged_refill = lingc.paged_refill(page_table, slots, step_positions, 16)
After:   step_refill = lingc.step_refill(gather_rows, 1, page_table, slots, 16)
         step_positions = getitem(step_refill, 0)     (the old nodes stay, under their names, as its getitems)
Only order and sharing change: numerics unchanged (the same integers).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from lingc.ops import OPS
from lingc.program import Program
from lingc.passes.base import Pass
from lingc.passes.matchers import carried_meta, is_free, written_inputs

REFILL_OPS = {OPS.gather_rows, OPS.step_positions, OPS.cache_locs, OPS.paged_refill, OPS.step_refill}
INDEX_MATH = {torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor}     # positions + i, counter + k
# the sliced-refill merge and step_refill (2026-12-05; on the H200 step_refill is bit-exact, 1.17 us against 0.65 +
# 1.17 for the two launches, kernels-meta-h200-20261205.json, and the default passes keep greedy parity,
# step-parity-h200-20261205.json; no step A/B yet); False keeps the refills as they were, for an A/B:
# bench/device_step.py --variant 'refills:lingc.passes.capture_metadata.MERGE_REFILLS=False'
MERGE_REFILLS = True


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
        merged, sliced, with_positions, groups = 0, [], [], {}
        for gname, graph in program.graphs.items():
            merged += _merge_duplicates(graph)
            if MERGE_REFILLS:
                sliced += [f"{gname}:{name}" for name in _merge_sliced_refills(graph)]
                with_positions += [f"{gname}:{name}" for name in _fuse_positions(graph)]
            groups[gname] = _hoist(graph)
        return {"matches": sum(len(v) for v in groups.values()), "merged": merged, "merged_slices": sliced,
                "step_refill": with_positions, "groups": groups}


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


def _column_slice(node: fx.Node) -> tuple[fx.Node, int, int] | None:
    """(base, start, end) where node is aten.slice(base, 1, start, end) of a 2-D base with step 1 and bounds inside
    it; else None."""
    if node.op != "call_function" or node.target is not torch.ops.aten.slice.Tensor or node.kwargs:
        return None
    base, dim, start, end, step = (list(node.args) + [None] * 5)[:5]
    shape = getattr(base.meta.get("lingc.tensor"), "shape", None) if isinstance(base, fx.Node) else None
    if shape is None or len(shape) != 2 or dim not in (1, -1) or step not in (None, 1):
        return None
    if not isinstance(start, int) or not isinstance(end, int) or not 0 <= start < end <= shape[1]:
        return None
    return base, start, end


def _merge_sliced_refills(graph: fx.Graph) -> list[str]:
    """Runs of paged_refill(page_table, slots, positions[:, a:b], PS) over column slices of one positions tensor
    (nothing in between writing their inputs) -> the first of them over the whole tensor; readers of the others'
    page rows read its rows (the same page-table row), readers of each one's cache rows a column slice [a, b) of its
    cache rows. Returns the names of the refills that now cover a run."""
    groups: dict[tuple, list[tuple[fx.Node, int, int]]] = {}
    closed: list[list[tuple[fx.Node, int, int]]] = []
    for node in graph.nodes:
        for w in _mutated_inputs_of(node):
            for key in [k for k in groups if w in k[:3]]:
                closed.append(groups.pop(key))         # a write to page_table, slots or positions ends a run
        if node.op != "call_function" or node.target is not OPS.paged_refill or node.kwargs or len(node.args) != 4:
            continue
        page_table, slots, positions, page_size = node.args
        sliced = _column_slice(positions) if isinstance(positions, fx.Node) else None
        if sliced is None or any(u.target is not operator.getitem for u in node.users):
            continue
        base, start, end = sliced
        groups.setdefault((page_table, slots, base, page_size), []).append((node, start, end))
    names = []
    for run in closed + list(groups.values()):
        if len(run) < 2:
            continue
        first = run[0][0]
        page_table, slots, positions, page_size = first.args
        first.args = (page_table, slots, _column_slice(positions)[0], page_size)     # now over every position
        items = {u.args[1]: u for u in first.users}
        with graph.inserting_after(first):
            rows = items[0] if 0 in items else graph.call_function(operator.getitem, (first, 0))
        with graph.inserting_after(rows):
            locs = items[1] if 1 in items else graph.call_function(operator.getitem, (first, 1))
        meta = carried_meta(first)
        for n in (rows, locs):
            n.meta = {**meta, **n.meta}
        parts: set[fx.Node] = set()          # the slices of locs: readers of locs that stay
        for refill, start, end in reversed(run):          # the first last: its old readers read locs directly
            with graph.inserting_after(locs):
                part = graph.call_function(torch.ops.aten.slice.Tensor, (locs, 1, start, end))
            part.meta = dict(meta)
            part._rename(f"{refill.name}_locs")
            parts.add(part)
            if refill is first:
                locs.replace_all_uses_with(part, delete_user_cb=lambda user: user not in parts)
            else:
                for item in list(refill.users):
                    item.replace_all_uses_with(rows if item.args[1] == 0 else part)
                    graph.erase_node(item)
                graph.erase_node(refill)
        names.append(first.name)
    return names


def _fuse_positions(graph: fx.Graph) -> list[str]:
    """paged_refill(page_table, slots, step_positions(seq_lens, T), PS) -> step_refill(seq_lens, T, page_table,
    slots, PS) where the step_positions was: its positions replace step_positions' for every reader, its page and
    cache rows the refill's. Only where the refill reads step_positions itself, page_table and slots are graph inputs
    and nothing between the two writes them. Returns the step_refill nodes' names."""
    fused = []
    for refill in [n for n in graph.nodes if n.target is OPS.paged_refill and not n.kwargs and len(n.args) == 4]:
        page_table, slots, positions, page_size = refill.args
        if not (isinstance(positions, fx.Node) and positions.target is OPS.step_positions and not positions.kwargs
                and len(positions.args) == 2 and all(u.target is operator.getitem for u in refill.users)
                and all(isinstance(t, fx.Node) and t.op == "placeholder" for t in (page_table, slots))):
            continue                                        # (placeholders: defined where the step_refill goes)
        between, node = set(), positions.next
        while node is not refill:
            between |= _mutated_inputs_of(node)
            node = node.next
        if between & {page_table, slots}:
            continue
        seq_lens, tokens = positions.args
        with graph.inserting_before(positions):
            step = graph.call_function(OPS.step_refill, (seq_lens, tokens, page_table, slots, page_size))
        step.meta = carried_meta(positions)
        name = positions.name
        step._rename(name.replace("step_positions", "step_refill") if "step_positions" in name else f"{name}_refill")
        positions.target, positions.args, positions.kwargs = operator.getitem, (step, 0), {}   # same node, same name
        positions.meta.pop("lingc.capture", None)
        for item in list(refill.users):                    # the refill's page and cache rows: outputs 1 and 2
            item.args = (step, item.args[1] + 1)
        graph.erase_node(refill)
        fused.append(step.name)
    return fused


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
