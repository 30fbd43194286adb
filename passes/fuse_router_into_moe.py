"""fuse_router_into_moe: at one token the MoE GEMMs route the token themselves; the router launch goes away.

Before (per MoE layer called on one token; after fuse_moe_align, fuse_swiglu and fuse_shared_expert; k' = k + S):
    L1_mlp_router_align = lingc.router_align(L1_mlp_gate_linear, w_..._expert_bias, 8, 4, 8, 2.5, 129, 16, 1)
    L1_mlp_getitem = getitem(L1_mlp_router_align, 0)                                     # weights f32[1, k']
    L1_mlp_getitem_2 = getitem(L1_mlp_router_align, 2)                                   # sorted_pairs, 3, 4
    L1_mlp_moe_up_act = lingc.moe_up_act(x, w_..._w13_interleaved_with_shared, sp, be, tot, 9, 16, 0.0)
    L1_mlp_moe_down = lingc.moe_down(L1_mlp_moe_up_act, w_..._w2_with_shared, sp, be, tot, 16)
    ... = lingc.combine_add_rmsnorm(res, L1_mlp_moe_down, L1_mlp_getitem, ...)
After:
    L1_mlp_moe_up_act = lingc.moe_up_act_routed(x, w_..._w13_..., L1_mlp_gate_linear, w_..._expert_bias, 8, 4, 8,
                                                2.5, 1, 0.0)
    L1_mlp_moe_down = lingc.moe_down_routed(L1_mlp_moe_up_act, w_..._w2_..., L1_mlp_gate_linear,
                                            w_..._expert_bias, 8, 4, 8, 2.5, 1)
    L1_mlp_moe_down_out = getitem(L1_mlp_moe_down, 0)                                    # [k', h]
    L1_mlp_moe_down_weights = getitem(L1_mlp_moe_down, 1)                                # the combine's weights
    ... = lingc.combine_add_rmsnorm(res, L1_mlp_moe_down_out, L1_mlp_moe_down_weights, ...)

Why: at one token the router is a latency-bound launch between the gate GEMV and the up-GEMM, both of which wait
for it; kernels/moe_routed.py's programs find their pair's expert from the gate's logits (a few hundred instructions
a program) and the down-GEMM writes the combine's weights, so a MoE layer runs one launch and one dependent round
trip fewer. Values: the ops are router_topk + the pair-grid GEMMs (lingc/ops/moe.py), the same picks, weights and
pair rows as router_align + moe_up_act + moe_down: numerics unchanged (the kernels run decode's aligned tiles).

Opt-in (LINGC_FUSE_ROUTER_INTO_MOE=1 or `--passes all,fuse_router_into_moe`): measured slower on an H100. The
routing in a Triton program costs more than the router launch it removes (kernels/moe_routed.py's docstring: one MoE
layer 20.6 -> 25.4 us alone in the kept form; greedy decode 1.306 -> 1.520 ms with the first form,
bench/results/step-ab-h100-20261206-router-into-moe.json, greedy parity held).

Left alone: layers on more than one token a call (verify, extend, prefill: fuse_align_into_moe's pair grid or the
aligned GEMMs), more than ROUTED_MAX_EXPERTS routed experts (Ling-3.0-flash's 512), layers whose router is not a
router_align read only by one moe_up_act + moe_down and the weights' readers (fuse_moe's moe_fused, fuse_norm_router's
add_rmsnorm_router, tp's ep_align). `lingc compile --tp N` turns a routed layer back into router_align + the aligned
GEMMs before sharding it (`unfuse`, called by passes/tp.py).
"""

from __future__ import annotations

import operator
from typing import Any

import torch.fx as fx

from lingc.knobs import env_flag
from lingc.modules import MOE_BLOCK_M
from lingc.ops import OPS
from lingc.ops.moe import ROUTED_MAX_EXPERTS
from lingc.program import Program
from lingc.passes.base import Pass
from lingc.passes.matchers import align_readers, calls, carried_meta, getitems


def _layer(router: fx.Node, order: dict[fx.Node, int]) -> tuple[fx.Node, fx.Node, list[fx.Node]] | str:
    """(moe_up_act, moe_down, the weights' getitems) of a one-token router_align, or why not (order: the graph's
    node positions, for the weights' readers)."""
    if any(u.target is not operator.getitem for u in router.users):
        return f"{router.name}: a reader takes its outputs as a tuple"
    reads = getitems(router)
    if reads.get(1):
        return f"{router.name}: its expert ids are read ({', '.join(g.name for g in reads[1])})"
    found = align_readers(router, 2)
    if isinstance(found, str):
        return found
    up, down = found
    if down.args[0] is not up:
        return f"{down.name} does not read {up.name}"
    shared = router.args[8] if len(router.args) > 8 else 0
    pairs = router.args[4] + shared
    if up.args[5] != pairs:
        return f"{up.name}: {up.args[5]} pairs a token, the router gives {pairs}"
    rows = getattr(up.meta.get("lingc.tensor"), "shape", (None,))[0]
    if rows != pairs:
        return f"{up.name}: {rows} pair rows a call, not one token's {pairs}"
    routed = router.args[6] - shared
    if routed > ROUTED_MAX_EXPERTS:
        return f"{router.name}: {routed} routed experts, past ROUTED_MAX_EXPERTS = {ROUTED_MAX_EXPERTS}"
    weights = reads.get(0, [])
    early = [u.name for w in weights for u in w.users if order[u] < order[down]]
    if early:
        return f"{router.name}: its weights are read before {down.name} ({', '.join(early)})"
    return up, down, weights


def _route(graph: fx.Graph, router: fx.Node, up: fx.Node, down: fx.Node, weights: list[fx.Node]) -> fx.Node:
    """Rewrite one layer in place (module docstring): the moe_down becomes the moe_down_routed (name kept), its
    readers read `<name>_out`, the weights' readers `<name>_weights`. Returns the moe_down_routed."""
    route = router.args[:6] + (router.args[8] if len(router.args) > 8 else 0,)   # logits .. scale, fused_shared
    up.target, up.args = OPS.moe_up_act_routed, (up.args[0], up.args[1], *route, up.args[7])
    up.meta.pop("lingc.launch", None)            # fuse_shared_expert's shared_last: the aligned kernel's hint
    readers = list(down.users)
    out_meta = down.meta.get("lingc.tensor")
    w_meta = weights[0].meta.get("lingc.tensor") if weights else None
    down.target, down.args = OPS.moe_down_routed, (up, down.args[1], *route)
    down.meta["lingc.tensor"] = [out_meta, w_meta]
    with graph.inserting_after(down):
        wts = graph.call_function(operator.getitem, (down, 1))
        out = graph.call_function(operator.getitem, (down, 0))
    for item, meta, field in ((out, out_meta, "out"), (wts, w_meta, "weights")):
        item.meta = {**carried_meta(down), "lingc.tensor": meta}
        item._rename(f"{down.name}_{field}")
    for r in readers:
        r.replace_input_with(down, out)
    for w in weights:
        w.replace_all_uses_with(wts)
    for n in [*weights, *[g for gs in getitems(router).values() for g in gs if g not in weights]]:
        graph.erase_node(n)
    graph.erase_node(router)
    return down


def unfuse(graph: fx.Graph, down: fx.Node, num_experts: int) -> fx.Node:
    """moe_up_act_routed + moe_down_routed -> router_align + moe_up_act + moe_down, in place (the tp pass shards the
    aligned form); num_experts: the stack's (routed + shared). Returns the moe_down."""
    up = down.args[0]
    logits, bias, n_group, topk_group, top_k, scale, shared = down.args[2:9]
    with graph.inserting_before(up):
        router = graph.call_function(OPS.router_align, (logits, bias, n_group, topk_group, top_k, scale, num_experts,
                                                        MOE_BLOCK_M, shared))
        outs = [graph.call_function(operator.getitem, (router, i)) for i in (0, 2, 3, 4)]
    router.meta = carried_meta(up)
    router._rename(up.name.replace("moe_up_act", "router_align") if "moe_up_act" in up.name else up.name + "_router")
    for o, field in zip(outs, ("weights", "sorted_pairs", "block_expert", "total")):
        o.meta = dict(router.meta)
        o._rename(f"{router.name}_{field}")
    up.target, up.args = OPS.moe_up_act, (up.args[0], up.args[1], *outs[1:], top_k + shared, MOE_BLOCK_M, up.args[9])
    reads = getitems(down)
    down.target, down.args = OPS.moe_down, (up, down.args[1], *outs[1:], MOE_BLOCK_M)
    meta = down.meta.get("lingc.tensor")
    if isinstance(meta, (list, tuple)):
        down.meta["lingc.tensor"] = meta[0]
    for g in reads.get(0, []):
        g.replace_all_uses_with(down)
    for g in reads.get(1, []):
        g.replace_all_uses_with(outs[0])
    for g in [g for gs in reads.values() for g in gs]:
        graph.erase_node(g)
    return down


class FuseRouterIntoMoe(Pass):
    name = "fuse_router_into_moe"
    summary = "one token: router_align + moe_up_act + moe_down -> moe_up_act_routed + moe_down_routed (-1 launch)"
    after = ("partition", "fuse_swiglu", "fuse_moe_align", "fuse_shared_expert", "fuse_moe", "bf16_router",
             "fuse_norm_linear", "fuse_combine_norm", "specialize_greedy", "fuse_align_into_moe", "fuse_norm_router")
    changes_numerics = False
    # opt-in (`--passes all,fuse_router_into_moe` or LINGC_FUSE_ROUTER_INTO_MOE=1): slower on an H100 (docstring)
    in_all = env_flag("LINGC_FUSE_ROUTER_INTO_MOE", False)

    def apply(self, program: Program) -> dict[str, Any]:
        routed: list[str] = []
        skipped: list[str] = []
        for gname, graph in program.graphs.items():
            order = {n: i for i, n in enumerate(graph.nodes)}     # rewrites add nodes only after the down-GEMM
            for router in calls(graph, "router_align"):
                found = _layer(router, order)
                if isinstance(found, str):
                    skipped.append(f"{gname}: {found}")
                    continue
                routed.append(f"{gname}:{_route(graph, router, *found).name}")
            graph.lint()
        return {"matches": len(routed), "routed": routed, "skipped": skipped}
