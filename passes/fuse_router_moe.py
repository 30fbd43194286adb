"""fuse_router_moe: at one token, route inside the MoE GEMMs and drop the router_align launch.

Before (a one-token graph: decode, MTP draft; after fuse_moe_align and fuse_shared_expert):
    L1_mlp_router_align = lingc.router_align(L1_mlp_gate, w_L1_mlp_gate_expert_bias, 8, 4, 8, 2.5, 129, 16, 1)
    L1_mlp_getitem = getitem(L1_mlp_router_align, 0)                     # weights f32[1, 9]
    sp, be, tot = getitem(L1_mlp_router_align, 2), ..., 3), ..., 4)     # the align
    L1_mlp_moe_up_act = lingc.moe_up_act(x, w13i, sp, be, tot, 9, 16, 0.0)
    L1_mlp_moe_down = lingc.moe_down(L1_mlp_moe_up_act, w2, sp, be, tot, 16)
After:
    L1_mlp_moe_up_act_routed = lingc.moe_up_act_routed(x, w13i, L1_mlp_gate, w_..._expert_bias, 8, 4, 8, 2.5, 129,
                                                       16, 1, 0.0)        # (act, weights, ids)
    L1_mlp_moe_up_act = getitem(L1_mlp_moe_up_act_routed, 0)
    L1_mlp_getitem = getitem(L1_mlp_moe_up_act_routed, 1)                # readers (the combine) untouched
    L1_mlp_moe_down = lingc.moe_down_routed(L1_mlp_moe_up_act, w2, L1_mlp_gate, w_..._expert_bias, 8, 4, 8, 2.5,
                                            129, 16, 1)
Each program of the two GEMMs routes the token itself from the logits (kernels/moe_routed.py): one launch fewer a
MoE layer in the chain router GEMV -> [align] -> up -> down. The ops are defined as router_align followed by the
GEMM on its outputs (lingc/ops/moe.py), and the kernels give the same bits as the three kernels they replace
(tests/kernels/test_moe_routed.py): numerics unchanged.

Where: every router_align whose logits have one row (static shape) and whose align outputs (sorted_pairs,
block_expert, total) are read by exactly one moe_up_act and the moe_down that reads that up-GEMM's output, in the
same stage; its weights and ids move to the routed up-GEMM's outputs. Graphs of more tokens (verify, prefill) keep
router_align: there the align groups the pairs of many tokens by expert, which one program cannot redo cheaply.
"""

from __future__ import annotations

import operator
from typing import Any

import torch.fx as fx

from lingc.ops import OPS
from lingc.passes.base import Pass
from lingc.passes.matchers import calls
from lingc.program import Program, tensor_meta

KEEP_META = ("lingc.scope", "lingc.stage")


def _getitems(node: fx.Node) -> dict[int, list[fx.Node]]:
    out: dict[int, list[fx.Node]] = {}
    for user in node.users:
        if user.target is operator.getitem:
            out.setdefault(user.args[1], []).append(user)
    return out


def _one_row(node: fx.Node) -> bool:
    meta = tensor_meta(node) if isinstance(node, fx.Node) else None
    return meta is not None and hasattr(meta, "shape") and len(meta.shape) == 2 and meta.shape[0] == 1


def _match(router: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(moe_up_act, moe_down) fed by this router_align's align alone, or None."""
    if not _one_row(router.args[0]) or any(u.target is not operator.getitem for u in router.users):
        return None
    items = _getitems(router)
    align = [items.get(i, []) for i in (2, 3, 4)]
    if any(len(reads) != 1 for reads in align):
        return None
    readers = {u for reads in align for u in reads[0].users}
    ups = [u for u in readers if u.target is OPS.moe_up_act]
    downs = [u for u in readers if u.target is OPS.moe_down]
    if len(ups) != 1 or len(downs) != 1 or len(readers) != 2:
        return None
    up, down = ups[0], downs[0]
    stage = router.meta.get("lingc.stage")
    width = router.args[4] + (router.args[8] if len(router.args) > 8 else 0)
    if (tuple(up.args[2:5]) != tuple(r[0] for r in align) or tuple(down.args[2:5]) != tuple(r[0] for r in align)
            or down.args[0] is not up or list(up.users) != [down] or up.args[5] != width
            or up.args[6] != router.args[7] or down.args[5] != router.args[7]
            or len({n.meta["lingc.stage"] for n in (router, up, down) if "lingc.stage" in n.meta}) > 1):
        return None
    return up, down


def _fuse(graph: fx.Graph, router: fx.Node, up: fx.Node, down: fx.Node) -> tuple[fx.Node, fx.Node]:
    route = tuple(router.args[:8]) + ((router.args[8] if len(router.args) > 8 else 0),)   # ... num_experts, BM, S
    x, w13, limit = up.args[0], up.args[1], up.args[7]
    items = _getitems(router)
    with graph.inserting_before(up):
        fused_up = graph.call_function(OPS.moe_up_act_routed, (x, w13, *route, limit))
        act = graph.call_function(operator.getitem, (fused_up, 0))
    for node in (fused_up, act):
        node.meta = {k: up.meta[k] for k in KEEP_META if k in up.meta}
    name = up.name
    up.replace_all_uses_with(act)
    graph.erase_node(up)
    act._rename(name)
    fused_up._rename(name + "_routed")
    for index in (0, 1):                         # weights, ids: now the routed up-GEMM's outputs 1 and 2
        for read in items.get(index, []):
            if read.users:
                read.args = (fused_up, index + 1)
            else:
                graph.erase_node(read)
    with graph.inserting_before(down):
        fused_down = graph.call_function(OPS.moe_down_routed, (act, down.args[1], *route))
    fused_down.meta = {k: down.meta[k] for k in KEEP_META if k in down.meta}
    name = down.name
    down.replace_all_uses_with(fused_down)
    graph.erase_node(down)
    fused_down._rename(name.replace("moe_down", "moe_down_routed") if "moe_down" in name else name + "_routed")
    for index in (2, 3, 4):
        for read in items.get(index, []):
            graph.erase_node(read)
    _move_after(graph, fused_up)
    graph.erase_node(router)
    return fused_up, fused_down


def _move_after(graph: fx.Graph, producer: fx.Node) -> None:
    """Getitems of `producer` that sit before it (the router's old weights / ids reads) move right after it."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for user in sorted(producer.users, key=order.__getitem__):
        if order[user] < order[producer]:
            producer.append(user)


class FuseRouterMoe(Pass):
    name = "fuse_router_moe"
    summary = "one token: the MoE up/down GEMMs route for themselves, no router_align launch"
    after = ("partition", "fuse_swiglu", "fuse_moe_align", "fuse_shared_expert", "bf16_router", "fuse_norm_linear",
             "fuse_combine_norm", "fuse_moe", "fuse_projections", "fuse_add_norm")
    changes_numerics = False

    def apply(self, program: Program) -> dict[str, Any]:
        fused: list[str] = []
        for gname, graph in program.graphs.items():
            for router in calls(graph, "router_align"):
                match = _match(router)
                if match is not None:
                    up, down = _fuse(graph, router, *match)
                    fused.append(f"{gname}:{up.name},{down.name}")
        return {"matches": len(fused), "fused": fused}
