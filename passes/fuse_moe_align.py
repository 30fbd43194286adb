"""fuse_moe_align: fuse the MoE router's top-k with the moe_align of its expert ids into one router_align.

Before (per MoE layer; N tokens, E experts, k per token, NP = N * k pairs, BM rows per expert block):
    L1_mlp_router_topk = lingc.router_topk(L1_mlp_gate_linear, w_L1_mlp_gate_expert_bias, 4, 2, 4, 2.5)
    L1_mlp_getitem = getitem(L1_mlp_router_topk, 0)                                     # weights f32[N, k]
    L1_mlp_getitem_1 = getitem(L1_mlp_router_topk, 1)                                   # ids i32[N, k]
    L1_mlp_moe_align = lingc.moe_align(L1_mlp_getitem_1, 16, 16)
    L1_mlp_getitem_2 = getitem(L1_mlp_moe_align, 0)                                     # sorted_pairs
    ...                                                                                 # block_expert, total
After:
    L1_mlp_router_align = lingc.router_align(L1_mlp_gate_linear, w_L1_mlp_gate_expert_bias, 4, 2, 4, 2.5, 16, 16)
    L1_mlp_getitem = getitem(L1_mlp_router_align, 0)                                    # weights
    L1_mlp_getitem_2 = getitem(L1_mlp_router_align, 2)                                  # sorted_pairs, then 3, 4
The old getitems are re-pointed (names kept), so every reader is untouched; the ids getitem is kept
only if something besides moe_align reads it.

router_align returns exactly what the two ops return (lingc/ops/moe.py composes them): numerics
unchanged. At batch 1 the router's top-k and the align are a few microseconds each, mostly launch
(techniques.md sections 6 and 16: "small router / activation / glue kernels"); one kernel does both.
"""

from __future__ import annotations

import operator
from typing import Any

import torch.fx as fx

from lingc.ops import OPS
from lingc.program import Program
from lingc.passes.base import Pass
from lingc.passes.matchers import calls, carried_meta, getitems



def _align_of(topk: fx.Node) -> fx.Node | None:
    """The moe_align that reads the top-k's ids (same stage), or None."""
    if any(u.target is not operator.getitem for u in topk.users):
        return None                                    # a tuple read whole: leave it alone
    for ids in getitems(topk).get(1, []):
        for user in ids.users:
            if (user.target is OPS.moe_align and user.args[0] is ids
                    and user.meta.get("lingc.stage") == topk.meta.get("lingc.stage")
                    and all(u.target is operator.getitem for u in user.users)):
                return user
    return None


def _fuse(graph: fx.Graph, topk: fx.Node, align: fx.Node) -> fx.Node:
    """Insert router_align before the top-k and re-point every getitem of both ops at it."""
    _, num_experts, block_m = align.args
    align_reads = getitems(align)
    with graph.inserting_before(topk):
        # router_topk's optional 7th argument (fused_shared) is router_align's 9th
        fused = graph.call_function(OPS.router_align, (*topk.args[:6], num_experts, block_m, *topk.args[6:]))
    fused.meta = carried_meta(topk)
    fused._rename(topk.name.replace("router_topk", "router_align") if "router_topk" in topk.name
                  else topk.name + "_align")
    for index, reads in align_reads.items():          # sorted_pairs, block_expert, total -> outputs 2, 3, 4
        for read in reads:
            read.args = (fused, index + 2)
    graph.erase_node(align)
    for read in list(topk.users):                     # weights 0, ids 1 keep their index
        if read.users:
            read.args = (fused, read.args[1])
        else:
            graph.erase_node(read)                    # the ids only moe_align read
    graph.erase_node(topk)
    return fused


class FuseMoeAlign(Pass):
    name = "fuse_moe_align"
    summary = "router_topk + moe_align of its ids -> one router_align"
    after = ("partition", "bf16_router")       # bf16_router finds the router gate by its router_topk reader
    changes_numerics = False

    def apply(self, program: Program) -> dict[str, Any]:
        fused_nodes: list[str] = []
        for gname, graph in program.graphs.items():
            for topk in calls(graph, "router_topk"):
                align = _align_of(topk)
                if align is not None:
                    fused_nodes.append(f"{gname}:{_fuse(graph, topk, align).name}")
        return {"matches": len(fused_nodes), "fused": fused_nodes}
