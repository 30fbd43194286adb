"""fuse_align_into_moe: the MoE GEMMs group the router's pairs by expert themselves; the align goes away.

Before (per MoE layer; after fuse_moe_align, fuse_swiglu and fuse_shared_expert; k' = k picks + S shared per token):
    L1_mlp_router_align = lingc.router_align(L1_mlp_gate_linear, w_..._expert_bias, 8, 4, 8, 2.5, 129, 16, 1)
    L1_mlp_getitem = getitem(L1_mlp_router_align, 0)                                     # weights f32[N, k']
    L1_mlp_getitem_2 = getitem(L1_mlp_router_align, 2)                                   # sorted_pairs, 3, 4
    L1_mlp_moe_up_act = lingc.moe_up_act(x, w_..._w13_interleaved_with_shared, sp, be, tot, 9, 16, 0.0)
    L1_mlp_moe_down = lingc.moe_down(L1_mlp_moe_up_act, w_..._w2_with_shared, sp, be, tot, 16)
After:
    L1_mlp_router_topk = lingc.router_topk(L1_mlp_gate_linear, w_..._expert_bias, 8, 4, 8, 2.5, 1)
    L1_mlp_getitem = getitem(L1_mlp_router_topk, 0)                                      # weights, as before
    L1_mlp_router_topk_ids = getitem(L1_mlp_router_topk, 1)                              # ids i32[N, k']
    L1_mlp_moe_up_act = lingc.moe_up_act_pairs(x, w_..._w13_interleaved_with_shared, L1_mlp_router_topk_ids, 0.0)
    L1_mlp_moe_down = lingc.moe_down_pairs(L1_mlp_moe_up_act, w_..._w2_with_shared, L1_mlp_router_topk_ids)
(router_topk + moe_align, without fuse_moe_align, is rewritten the same way: the moe_align goes.)

Why: at a verify chain's 6 tokens the align is most of router_align's time (one program routes each row, then
the last one aligns the 54 pairs: 8.8 us against 4.2 for router_topk in the CUDA-graph chain on the H200), while
the GEMMs can find their rows from the ids in a few instructions: the up / down kernels run on a pair grid, one
program row per (token, expert) pair; the expert's first pair (flat order) runs the GEMM tile for every token
that picked that expert, the others exit (kernels/moe.py `_pair_rows`). Values: moe_up_act_pairs(x, w, ids) ==
moe_up_act(x, w, *moe_align(ids)) bit for bit (a pair row's dot does not depend on the block it sits in; tests and
bench/kernel_moe.py `_pairs_rows` on the H200). Past PAIR_GRID_TOKENS = 16 tokens or PAIR_GRID_PICKS = 32 pairs a
token (lingc/ops/moe.py) the launchers align the ids themselves: the same values, one more launch per GEMM.

Left alone: layers with fewer than MIN_TOKENS tokens a call (decode, the draft's one-token MTP forwards: measured
slower there, see MIN_TOKENS) or past the pair grid's limits (the launchers would align twice), the prefill graphs
(prefill, mtp_prefill: chunks past 16 tokens) and layers whose align outputs anything else reads (fuse_moe's
moe_fused, tp's ep_align) or whose up-GEMM is the plain moe_up (+ silu_and_mul: without fuse_swiglu).
`lingc compile --tp N` runs after this pass and turns a paired layer back into moe_up_act / moe_down over its
ep_align (passes/tp.py).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from lingc.ops import OPS
from lingc.modules import MOE_BLOCK_M
from lingc.ops.moe import PAIR_GRID_PICKS, PAIR_GRID_TOKENS
from lingc.program import Program, TensorMeta
from lingc.passes.base import Pass
from lingc.passes.matchers import KEEP_META, align_readers, calls, carried_meta, getitems, output_getitem

# Layers run on fewer tokens a call keep the aligned GEMMs. H200, Ling-3.0-tiny, one process (bench/device_step.py
# --variant, bench/results/step-ab-h200-20261202.json): with every layer paired, verify 2.444 / 2.442 -> 2.390 /
# 2.386 ms but the decode step 1.212 / 1.202 -> 1.232 / 1.235 (about 1 us a MoE layer at one token, where the align
# is cheap: router_align "rows", and the pair grid's prologue is on the path); so a layer is paired from 2 tokens up
MIN_TOKENS = 2


def _layer(src: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node] | str:
    """(router, its align's readers = the up-GEMM and down-GEMM) for a router_align or moe_align, or why not."""
    if any(u.target is not operator.getitem for u in src.users):
        return f"{src.name}: a reader takes its outputs as a tuple"
    found = align_readers(src, 2 if src.target is OPS.router_align else 0)      # sorted_pairs, block_expert, total
    if isinstance(found, str):
        return found
    up, down = found
    if src.target is OPS.router_align:
        router = src
    else:
        ids = src.args[0]
        router = ids.args[0] if ids.target is operator.getitem else None
        if router is None or router.target is not OPS.router_topk or ids.args[1] != 1:
            return f"{src.name}: its ids do not come from a router_topk"
    if down.args[0] is not up:
        return f"{down.name} does not read {up.name}"
    top_k = _pairs_per_token(router)
    if up.args[5] != top_k or up.args[6] != MOE_BLOCK_M:
        return f"{up.name}: {up.args[5]} pairs a token in blocks of {up.args[6]}, the router gives " \
               f"{top_k} (blocks of {MOE_BLOCK_M} wanted)"
    if top_k > PAIR_GRID_PICKS:
        return f"{up.name}: {top_k} pairs a token, past PAIR_GRID_PICKS = {PAIR_GRID_PICKS}"
    pairs = getattr(up.meta.get("lingc.tensor"), "shape", (None,))[0]
    if isinstance(pairs, int) and pairs // top_k < MIN_TOKENS:
        return f"{up.name}: {pairs // top_k} token(s) a call, below MIN_TOKENS = {MIN_TOKENS}"
    if isinstance(pairs, int) and pairs // top_k > PAIR_GRID_TOKENS:     # the launchers would align twice
        return f"{up.name}: {pairs // top_k} tokens a call, past PAIR_GRID_TOKENS = {PAIR_GRID_TOKENS}"
    return router, up, down


def _router_topk(graph: fx.Graph, router: fx.Node) -> tuple[fx.Node, fx.Node]:
    """(router_topk, its ids getitem): router_align becomes router_topk (weights and ids keep their getitems)."""
    if router.target is OPS.router_align:
        with graph.inserting_before(router):
            # router_align(logits, bias, n_group, topk_group, k, scale, E, BM[, S]) -> router_topk(..., scale[, S])
            topk = graph.call_function(OPS.router_topk, (*router.args[:6], *router.args[8:]))
        topk.meta = carried_meta(router)
        if isinstance(router.meta.get("lingc.tensor"), (list, tuple)):
            topk.meta["lingc.tensor"] = list(router.meta["lingc.tensor"][:2])      # weights, ids
        topk._rename(router.name.replace("router_align", "router_topk") if "router_align" in router.name
                     else router.name + "_topk")
        for read in list(router.users):
            if read.args[1] < 2:
                read.args = (topk, read.args[1])
        router = topk
    had_ids = 1 in getitems(router)
    ids = output_getitem(graph, router, 1, f"{router.name}_ids", KEEP_META)
    if not had_ids and "lingc.tensor" not in ids.meta:
        weights = getitems(router).get(0, [None])[0]
        shape = getattr(weights.meta.get("lingc.tensor"), "shape", None) if weights is not None else None
        if shape is not None:
            ids.meta["lingc.tensor"] = TensorMeta(tuple(shape), torch.int32)
    return router, ids


def _pair(graph: fx.Graph, src: fx.Node, router: fx.Node, up: fx.Node, down: fx.Node) -> fx.Node:
    """Rewrite one layer (module docstring); returns its router_topk."""
    router, ids = _router_topk(graph, router)
    # in place: names, meta (shapes, scope) and readers stay
    up.target, up.args = OPS.moe_up_act_pairs, (up.args[0], up.args[1], ids, up.args[7])
    down.target, down.args = OPS.moe_down_pairs, (up, down.args[1], ids)
    for g in [g for gs in getitems(src).values() for g in gs]:     # the align's outputs: dead now
        if not g.users:
            graph.erase_node(g)
    if not src.users:
        graph.erase_node(src)
    return router


def unfuse(graph: fx.Graph, down: fx.Node, num_experts: int) -> fx.Node:
    """moe_up_act_pairs + moe_down_pairs -> moe_align(ids) + moe_up_act + moe_down, in place (the tp pass shards the
    aligned form); returns the moe_down."""
    up, ids = down.args[0], down.args[2]
    top_k = _pairs_per_token(ids.args[0])
    with graph.inserting_before(up):
        align = graph.call_function(OPS.moe_align, (ids, num_experts, MOE_BLOCK_M))
        outs = [graph.call_function(operator.getitem, (align, i)) for i in range(3)]
    align.meta = carried_meta(up)
    align._rename(up.name.replace("moe_up_act", "moe_align") if "moe_up_act" in up.name else up.name + "_align")
    for o, field in zip(outs, ("sorted_pairs", "block_expert", "total")):
        o.meta = dict(align.meta)
        o._rename(f"{align.name}_{field}")
    up.target, up.args = OPS.moe_up_act, (up.args[0], up.args[1], *outs, top_k, MOE_BLOCK_M, up.args[3])
    down.target, down.args = OPS.moe_down, (up, down.args[1], *outs, MOE_BLOCK_M)
    return down


def _pairs_per_token(router: fx.Node) -> int:
    """k' of a router_topk or router_align: its top_k plus its fused_shared (the last optional argument)."""
    shared_at = 8 if router.target is OPS.router_align else 6
    return router.args[4] + (router.args[shared_at] if len(router.args) > shared_at else 0)


class FuseAlignIntoMoe(Pass):
    name = "fuse_align_into_moe"
    summary = "router_align (or moe_align) + moe_up_act + moe_down -> router_topk + the pair-grid GEMMs (no align)"
    after = ("partition", "fuse_swiglu", "fuse_moe_align", "fuse_shared_expert", "fuse_moe", "bf16_router",
             "fuse_norm_linear", "fuse_combine_norm", "specialize_greedy")
    changes_numerics = False

    def apply(self, program: Program) -> dict[str, Any]:
        paired: list[str] = []
        skipped: list[str] = []
        for gname, graph in program.graphs.items():
            if gname.endswith("prefill"):
                continue          # a prefill chunk is past PAIR_GRID_TOKENS (not seen in a symbolic shape)
            for src in [*calls(graph, "router_align"), *calls(graph, "moe_align")]:
                found = _layer(src)
                if isinstance(found, str):
                    skipped.append(f"{gname}: {found}")
                    continue
                router = _pair(graph, src, *found)
                paired.append(f"{gname}:{router.name}")
            graph.lint()
        return {"matches": len(paired), "paired": paired, "skipped": skipped}
