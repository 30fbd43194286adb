"""fuse_norm_router: add_rmsnorm_linear (the post-attention norm in the gate GEMV) + the router reading its logits
-> one add_rmsnorm_router (opt-in: on the H200 the step measured level in decode, +4 us in verify; docs/measurements.md,
ninth session).

At batch 1 a MoE layer's router front is two dependent launches around 0.4 MB of gate weight: the norm + gate GEMV
(2.59 us a layer in the H200 decode step) and router_align (2.09; verify 2.87 + 2.41 with router_topk). The fused
op's kernel (kernels/norm_router.py, Gluon, sm_90) loads its gate-weight slice before its PDL wait, computes the
norm and its logits slice in G programs per row, and the last program of each row to finish (an atomic ticket)
routes the row: one launch instead of two, 23 times a step.

Before (fuse_norm_linear, fuse_moe_align / fuse_align_into_moe, fuse_shared_expert):
    L1_post_attention_layernorm_add_rmsnorm_linear = lingc.add_rmsnorm_linear(L0_add_1, L1_attention_o_proj_linear,
        w_L1_post_attention_layernorm_weight, 1e-06, w_L1_mlp_gate_weight, torch.float32, True)
    L1_mlp_gate_linear_y = getitem(L1_post_attention_layernorm_add_rmsnorm_linear, 0)
    L1_add = getitem(..., 2);  L1_post_attention_layernorm_rmsnorm = getitem(..., 1)
    L1_mlp_gate_linear = aten.view(L1_mlp_gate_linear_y, [N, E])
    L1_mlp_router_align = lingc.router_align(L1_mlp_gate_linear, w_L1_mlp_gate_expert_bias, 4, 2, 4, 2.5, 17, 16, 1)
After:
    L1_post_attention_layernorm_add_rmsnorm_router = lingc.add_rmsnorm_router(L0_add_1, L1_attention_o_proj_linear,
        w_L1_post_attention_layernorm_weight, 1e-06, w_L1_mlp_gate_weight, w_L1_mlp_gate_expert_bias,
        4, 2, 4, 2.5, 17, 16, 1)                    # router_topk form: num_experts 0, block_m 0
    L1_add = getitem(..., 1);  L1_post_attention_layernorm_rmsnorm = getitem(..., 0);  router outputs: 2 ..
The existing getitems are re-pointed (their names and tensor metadata stay). It matches a router_topk / router_align
whose logits are an add_rmsnorm_linear's fp32 output 0 (directly or through one view), read by nothing else, at
most lingc/ops/norm_router.py MAX_ROWS rows (prefill keeps its two kernels).

The moe_up_act / moe_up_act_pairs that reads the fused op's normed output loses fuse_shared_expert's launch hint
shared_last: its early shared tile reads x before the PDL wait, and x is now written by the launch just before it
(passes/pdl.py would otherwise launch it without PDL). On the H200 that tile is off anyway behind the Gluon router
(kernels/moe.py SHARED_EARLY "auto").

Numerics: the reference op is the composition (bit-identical on the reference backend); the fused kernel computes
the logits and the norm in its own fp32 order (kernels/norm_router.py), so on the GPU the routing may differ in
rare near-ties from the unfused kernels: changes_numerics. Decode and verify rows run the same per-row code, so
greedy NEXTN == plain decoding still holds. The tp pass splits it back (`unfuse`) before sharding.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.fx as fx

from lingc.knobs import env_flag
from lingc.ops import OPS
from lingc.ops.norm_router import MAX_ROWS
from lingc.passes.base import Pass
from lingc.passes.matchers import calls, carried_meta
from lingc.program import Program, TensorMeta

VIEW = torch.ops.aten.view.default
UP_GEMMS = ("moe_up_act", "moe_up_act_pairs")


def _getitems(node: fx.Node) -> list[fx.Node]:
    return [u for u in node.users if u.target is operator.getitem]


def _match(router: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None] | None:
    """(add_rmsnorm_linear, its logits getitem, the view or None) when `router` reads only that op's fp32 logits."""
    if router.kwargs:
        return None
    logits = router.args[0]
    view = None
    if logits.op == "call_function" and logits.target is VIEW:
        view, logits = logits, logits.args[0]
        if len(view.users) != 1:
            return None
    if not (logits.op == "call_function" and logits.target is operator.getitem and logits.args[1] == 0
            and len(logits.users) == 1):
        return None
    lin = logits.args[0]
    if lin.op != "call_function" or lin.target is not OPS.add_rmsnorm_linear or lin.kwargs:
        return None
    meta = logits.meta.get("lingc.tensor")
    x = lin.args[1]
    rows_meta = x.meta.get("lingc.tensor") if isinstance(x, fx.Node) else None
    if not isinstance(meta, TensorMeta) or meta.dtype != torch.float32 or not isinstance(rows_meta, TensorMeta):
        return None
    if not 1 <= math.prod(rows_meta.shape[:-1]) <= MAX_ROWS:
        return None
    if any(u.target is not operator.getitem for n in (lin, router) for u in n.users):
        return None                        # the tuple itself read somewhere: its outputs cannot be re-pointed
    return lin, logits, view


def _router_args(router: fx.Node) -> tuple:
    """(bias, n_group, topk_group, top_k, scale, num_experts, block_m, fused_shared) of router_align / router_topk
    (router_topk: num_experts = block_m = 0)."""
    if router.target is OPS.router_align:
        bias, n_group, topk_group, top_k, scale, num_experts, block_m, *rest = router.args[1:]
    else:
        bias, n_group, topk_group, top_k, scale, *rest = router.args[1:]
        num_experts = block_m = 0
    return bias, n_group, topk_group, top_k, scale, num_experts, block_m, (rest[0] if rest else 0)


def _fuse(graph: fx.Graph, router: fx.Node, lin: fx.Node, logits: fx.Node, view: fx.Node | None) -> fx.Node:
    residual, x, norm_weight, eps, gate_weight = lin.args[:5]
    bias, n_group, topk_group, top_k, scale, num_experts, block_m, shared = _router_args(router)
    with graph.inserting_before(lin):
        fused = graph.call_function(OPS.add_rmsnorm_router, (residual, x, norm_weight, eps, gate_weight, bias, n_group,
                                                             topk_group, top_k, scale, num_experts, block_m, shared))
    fused.meta = carried_meta(lin)
    lin_meta, router_meta = lin.meta.get("lingc.tensor"), router.meta.get("lingc.tensor")
    if isinstance(lin_meta, (list, tuple)) and isinstance(router_meta, (list, tuple)):
        empty = [TensorMeta((0,), torch.int32)] * 3
        fused.meta["lingc.tensor"] = [lin_meta[1], lin_meta[2], *router_meta, *([] if block_m else empty)]
    for item in _getitems(lin):            # normed (1) -> 0, new residual (2) -> 1
        if item is not logits:
            item.args = (fused, item.args[1] - 1)
    for item in _getitems(router):         # weights, ids[, sorted_pairs, block_expert, total] -> 2 ..
        item.args = (fused, item.args[1] + 2)
    for node in (router, view, logits, lin):
        if node is not None:
            graph.erase_node(node)
    fused._rename(lin.name.replace("add_rmsnorm_linear", "add_rmsnorm_router") if "add_rmsnorm_linear" in lin.name
                  else f"{lin.name}_router")
    _drop_shared_last(fused)
    return fused


def _drop_shared_last(fused: fx.Node) -> None:
    """The up-GEMM reading the fused op's normed output loses its pre-wait hint (module docstring)."""
    stack = [u for u in fused.users if u.target is operator.getitem and u.args[1] == 0]
    while stack:
        node = stack.pop()
        for user in node.users:
            if user.op == "call_function" and user.target is VIEW:
                stack.append(user)
            elif user.op == "call_function" and user.target in tuple(OPS[n] for n in UP_GEMMS):
                hints = {k: v for k, v in user.meta.get("lingc.launch", {}).items() if k != "shared_last"}
                if hints:
                    user.meta["lingc.launch"] = hints
                else:
                    user.meta.pop("lingc.launch", None)


def unfuse(graph: fx.Graph, fused: fx.Node) -> fx.Node:
    """Split an add_rmsnorm_router back into add_rmsnorm_linear -> view -> router_align / router_topk (the tp pass
    rewrites the router's align); returns the router. The fused op's getitems read the two again."""
    (residual, x, norm_weight, eps, gate_weight, bias, n_group, topk_group, top_k, scale, num_experts, block_m,
     shared) = fused.args
    num_routed = int(gate_weight.meta["lingc.tensor"].shape[0])
    x_meta = x.meta["lingc.tensor"]
    rows = math.prod(x_meta.shape[:-1])
    with graph.inserting_before(fused):
        lin = graph.call_function(OPS.add_rmsnorm_linear, (residual, x, norm_weight, eps, gate_weight, torch.float32,
                                                           True))
        logits = graph.call_function(operator.getitem, (lin, 0))
        view = graph.call_function(VIEW, (logits, [rows, num_routed]))
        route = (view, bias, n_group, topk_group, top_k, scale)
        router = graph.call_function(OPS.router_align, (*route, num_experts, block_m, shared)) if block_m \
            else graph.call_function(OPS.router_topk, (*route, shared))
    meta = carried_meta(fused)
    for node in (lin, logits, view, router):
        node.meta = dict(meta)
    logits_meta = TensorMeta((*x_meta.shape[:-1], num_routed), torch.float32)
    logits.meta["lingc.tensor"] = logits_meta
    view.meta["lingc.tensor"] = TensorMeta((rows, num_routed), torch.float32)
    fused_meta = fused.meta.get("lingc.tensor")
    if isinstance(fused_meta, (list, tuple)):
        lin.meta["lingc.tensor"] = [logits_meta, fused_meta[0], fused_meta[1]]
        router.meta["lingc.tensor"] = list(fused_meta[2:7 if block_m else 4])
    for item in _getitems(fused):
        index = item.args[1]
        item.args = (lin, index + 1) if index < 2 else (router, index - 2)
    name = fused.name
    graph.erase_node(fused)
    lin._rename(name.replace("add_rmsnorm_router", "add_rmsnorm_linear"))
    router._rename(name.replace("add_rmsnorm_router", "router_align" if block_m else "router_topk"))
    return router


class FuseNormRouter(Pass):
    name = "fuse_norm_router"
    summary = "add_rmsnorm_linear (gate) + router -> one add_rmsnorm_router (-1 launch a MoE layer)"
    after = ("partition", "bf16_router", "fuse_add_norm", "fuse_moe_align", "fuse_shared_expert", "fuse_norm_linear",
             "fuse_align_into_moe", "fuse_combine_norm")
    changes_numerics = True      # on the GPU: the fused kernel's own fp32 order (module docstring)
    tolerance = 0.01             # as fuse_norm_linear's (a normed element may move by one bf16 rounding)
    in_all = env_flag("LINGC_FUSE_NORM_ROUTER", False)   # opt-in: level / slower on the H200 (docstring)

    def apply(self, program: Program) -> dict[str, Any]:
        fused: list[str] = []
        for gname, graph in program.graphs.items():
            for router in [*calls(graph, "router_align"), *calls(graph, "router_topk")]:
                m = _match(router)
                if m is not None:
                    fused.append(f"{gname}:{_fuse(graph, router, *m).name}")
            graph.lint()
        return {"matches": len(fused), "fused": fused}
