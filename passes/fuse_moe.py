"""fuse_moe: a MoE layer's up-GEMM + SwiGLU, down-GEMM and weighted combine -> one moe_fused op.

Before (per MoE layer after fuse_swiglu; N tokens, k pairs per token, NP = N * k):
    L1_mlp_moe_up_act = lingc.moe_up_act(L1_mlp_view, w_..._w13_interleaved, sorted_pairs, block_expert, total,
                                         k, BM, limit)                                         # [NP, I]
    L1_mlp_moe_down = lingc.moe_down(L1_mlp_moe_up_act, w_..._w2, sorted_pairs, block_expert, total, BM)  # [NP, h]
    L1_mlp_moe_combine = lingc.moe_combine(L1_mlp_moe_down, L1_mlp_getitem[, shared_out])            # [N, h]
After:
    L1_mlp_moe_fused = lingc.moe_fused(L1_mlp_view, w_..._w13_interleaved, w_..._w2, L1_mlp_getitem,
                                       sorted_pairs, block_expert, total, k, BM, limit[, shared_out])   # [N, h]
at the combine's place (every input is defined by then); the combine's readers read the fused op.

moe_fused is exactly that composite (lingc/ops/moe.py), and its kernel (kernels/moe_fused.py, one persistent
launch) runs the three kernels' tile code: numerics unchanged, bit for bit. Saves two launches per MoE layer
and lets the down-GEMM's weight stream start while the up-GEMM's last tiles run. A group fuses only where the
up-GEMM is read only by the down-GEMM, the down-GEMM only by the combine, both read the same align outputs and
all three are in one stage (where they name one). The tp pass splits moe_fused back (`unfuse`): its expert
parallelism rewrites the separate combine.

Opt-in (not in `all`, `--passes all,fuse_moe` adds it): on the H200 the kernel is bit-identical to the three
kernels but slower: 20.1 vs 17.6 us at 1 token, 88.1 vs 61.6 us at 6 with 2 programs per SM (6b5b75d), and
19.2-25.3 / 64.1-137.7 us over 1-16 programs per SM (f5d05a7; bench/kernel_moe.py, cold weights;
results/kernels-moe-fused-*); the Ling-3.0-tiny decode step 1.609 vs 1.446 ms with it, PDL on
(results/step-fuse-moe-h200-20261130.json). A persistent program walks its tiles one after another, so fewer
weight tiles are in flight than when each tile has its own program (288 up and 432 down programs at decode,
all resident at once).
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from lingc.ops import OPS
from lingc.program import Program, TensorMeta
from lingc.passes.base import Pass
from lingc.passes.matchers import KEEP_META, calls, carried_meta



def _group(combine: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(up, down) feeding this combine as the only reader of each, or None."""
    down = combine.args[0]
    if not isinstance(down, fx.Node) or down.target is not OPS.moe_down or list(down.users) != [combine]:
        return None
    up = down.args[0]
    if not isinstance(up, fx.Node) or up.target is not OPS.moe_up_act or list(up.users) != [down]:
        return None
    if tuple(up.args[2:5]) != tuple(down.args[2:5]) or up.args[6] != down.args[5]:
        return None                                     # not the same align outputs / block size
    stages = {n.meta.get("lingc.stage") for n in (up, down, combine)} - {None}   # graphs before partition: none
    return (up, down) if len(stages) <= 1 else None


def _fuse(graph: fx.Graph, up: fx.Node, down: fx.Node, combine: fx.Node) -> fx.Node:
    x, w13, sorted_pairs, block_expert, total, top_k, block_m, limit = up.args
    weights, shared = combine.args[1], (combine.args[2] if len(combine.args) > 2 else None)
    args = (x, w13, down.args[1], weights, sorted_pairs, block_expert, total, top_k, block_m, limit)
    with graph.inserting_before(combine):
        fused = graph.call_function(OPS.moe_fused, args + ((shared,) if shared is not None else ()))
    fused.meta = carried_meta(combine, (*KEEP_META, "lingc.tensor"))
    fused._rename(combine.name.replace("moe_combine", "moe_fused") if "moe_combine" in combine.name
                  else combine.name + "_fused")
    combine.replace_all_uses_with(fused)
    for node in (combine, down, up):
        graph.erase_node(node)
    return fused


def unfuse(graph: fx.Graph, fused: fx.Node) -> fx.Node:
    """moe_fused -> moe_up_act, moe_down, moe_combine at its place (the tp pass shards the separate ops); returns
    the combine, which takes over the fused node's readers."""
    x, w13, w2, weights, sorted_pairs, block_expert, total, top_k, block_m, limit, *shared = fused.args
    meta = carried_meta(fused)
    base = fused.name.replace("moe_fused", "") if "moe_fused" in fused.name else fused.name + "_"
    with graph.inserting_before(fused):
        up = graph.call_function(OPS.moe_up_act, (x, w13, sorted_pairs, block_expert, total, top_k, block_m, limit))
        down = graph.call_function(OPS.moe_down, (up, w2, sorted_pairs, block_expert, total, block_m))
        combine = graph.call_function(OPS.moe_combine, (down, weights, *shared))
    out = fused.meta.get("lingc.tensor")
    w2_meta = w2.meta.get("lingc.tensor")
    pairs = out.shape[0] * top_k if out is not None else None
    shapes = {"moe_up_act": (pairs, w2_meta.shape[2]) if pairs and w2_meta else None,      # [NP, I]
              "moe_down": (pairs, w2_meta.shape[1]) if pairs and w2_meta else None}         # [NP, h]
    for node, op in ((up, "moe_up_act"), (down, "moe_down"), (combine, "moe_combine")):
        node.meta = dict(meta)
        node._rename(base + op)
        if op == "moe_combine" and out is not None:
            node.meta["lingc.tensor"] = out
        elif shapes[op] is not None:
            node.meta["lingc.tensor"] = TensorMeta(shapes[op], out.dtype)
    fused.replace_all_uses_with(combine)
    graph.erase_node(fused)
    return combine


class FuseMoe(Pass):
    name = "fuse_moe"
    summary = "moe_up_act + moe_down + moe_combine -> one moe_fused; not in all"
    after = ("partition", "fuse_swiglu", "fuse_moe_align", "fuse_shared_expert", "bf16_router")
    changes_numerics = False
    in_all = False        # opt-in: slower than the three kernels on the H200 (module docstring)

    def apply(self, program: Program) -> dict[str, Any]:
        fused_nodes: list[str] = []
        for gname, graph in program.graphs.items():
            for combine in calls(graph, "moe_combine"):
                group = _group(combine)
                if group is not None:
                    fused_nodes.append(f"{gname}:{_fuse(graph, *group, combine).name}")
        return {"matches": len(fused_nodes), "fused": fused_nodes}
