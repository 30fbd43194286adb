"""fuse_norm_linear: fold each RMSNorm (and the residual add before it) into the prologue of a linear that reads it.

Before (an MoE layer's post-attention norm, after fuse_add_norm and bf16_router; h hidden, E experts):
    L1_post_attention_layernorm_add_rmsnorm = lingc.add_rmsnorm(L0_add_1, L1_attention_o_proj_linear,
                                                                w_L1_post_attention_layernorm_weight, 1e-06)
    L1_add = getitem(L1_post_attention_layernorm_add_rmsnorm, 1)                              # [1, 1, h]
    L1_post_attention_layernorm_rmsnorm = getitem(L1_post_attention_layernorm_add_rmsnorm, 0)  # [1, 1, h]
    L1_mlp_view = aten.view(L1_post_attention_layernorm_rmsnorm, [1, h])
    L1_mlp_gate_linear = lingc.linear(L1_mlp_view, w_L1_mlp_gate_weight, torch.float32)       # [1, E]
    L1_mlp_moe_up_act = lingc.moe_up_act(L1_mlp_view, ...)
After:
    L1_post_attention_layernorm_add_rmsnorm_linear = lingc.add_rmsnorm_linear(L0_add_1, L1_attention_o_proj_linear,
        w_L1_post_attention_layernorm_weight, 1e-06, w_L1_mlp_gate_weight, torch.float32, True)
    L1_mlp_gate_linear_y = getitem(L1_post_attention_layernorm_add_rmsnorm_linear, 0)         # [1, 1, E]
    L1_post_attention_layernorm_rmsnorm = getitem(L1_post_attention_layernorm_add_rmsnorm_linear, 1)   # normed
    L1_add = getitem(L1_post_attention_layernorm_add_rmsnorm_linear, 2)                       # new residual
    L1_mlp_view = aten.view(L1_post_attention_layernorm_rmsnorm, [1, h])
    L1_mlp_gate_linear = aten.view(L1_mlp_gate_linear_y, [1, -1])                             # [1, E]
    L1_mlp_moe_up_act = lingc.moe_up_act(L1_mlp_view, ...)
A plain rmsnorm (layer 0's input norm, MLA's q_a_layernorm -> q_b) becomes rmsnorm_linear -> (y, normed).

Which norms: every rmsnorm / add_rmsnorm whose normed output a `linear` over a plain 2-D weight [N, K] reads, in
the same NEXTN stage, directly or through reshapes that keep the last dim K. With several such linears the first
in graph order fuses (the router gate before the shared expert's gate_up); the others, and every other reader,
keep reading `normed`, which the op then writes (want_normed = True; False when only the fused linear read it,
and the op skips that write). The op runs where the norm ran (the linear's weight read moves up if needed); the
norm and the linear nodes become its getitems (or a view of y) under their old names, so readers are untouched.

Which weights: only those of at most MAX_WEIGHT_ELEMENTS (1 Mi) elements. Every program of the fused GEMV first
sums the squares of its input rows over all of K before its weight stream starts, and on the H200 that prologue
costs more than the norm launch it saves once the weight is large (bench/kernel_linear.py --norm, b2fb088's
parent 705c4f1, Ling-3.0-tiny, M = 1, fused vs rmsnorm + linear): router 128x1536 4.22 vs 5.12 us and q_a
norm -> q_b 3072x256 3.73 vs 4.16 us win; the MLA projection 848x1536 6.74 vs 5.80, the KDA projection
10256x1536 17.90 vs 12.22, the dense gate_up 9216x1536 17.66 vs 11.65 and the lm_head 157184x1536 153.3 vs
114.9 us lose. So at Ling-3.0-tiny's size the pass fuses the 23 router gates and the 6 q_b (-29 launches).

Numerics: the reference ops are the composition of the ops they replace, so the reference backend is bit-identical
to the unfused graph. The Triton kernel sums the squares of a row in another order than the rmsnorm kernel's one
tl.sum, so its rstd can differ in the last fp32 bit and a normed element by one bf16 rounding, which the GEMV then
carries: declared numerics-changing, gated on logits + greedy parity like fuse_projections.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from lingc.ops import OPS
from lingc.program import Program
from lingc.passes.base import Pass
from lingc.passes.matchers import calls

aten = torch.ops.aten
KEEP_META = ("lingc.scope", "lingc.stage")
MAX_WEIGHT_ELEMENTS = 1 << 20   # larger weights lose on the H200 (module docstring): they keep norm + linear
RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)   # keep the values and their order


def _last_dim(node: fx.Node) -> int | None:
    meta = node.meta.get("lingc.tensor")
    return meta.shape[-1] if meta is not None and hasattr(meta, "shape") and meta.shape else None


def _out_dtype(lin: fx.Node) -> torch.dtype | None:
    return lin.args[2] if len(lin.args) > 2 else lin.kwargs.get("out_dtype")


def _linear_reader(program: Program, norm: fx.Node, normed: fx.Node,
                   order: dict[fx.Node, float]) -> tuple[fx.Node, list[fx.Node]] | None:
    """The first linear (graph order) over a plain [N, K] weight that reads `normed` in the norm's stage, directly or
    through reshapes keeping the last dim K, with those reshapes; None if there is none."""
    k = _last_dim(normed)
    found: list[tuple[fx.Node, list[fx.Node]]] = []
    stack: list[tuple[fx.Node, list[fx.Node]]] = [(normed, [])]
    while stack:
        node, path = stack.pop()
        for user in node.users:
            if not user.args or user.args[0] is not node:
                continue
            if user.target is OPS.linear:
                weight = user.args[1]
                if (weight.op == "get_attr" and program.weights[weight.target].dim() == 2
                        and program.weights[weight.target].shape[1] == k
                        and program.weights[weight.target].numel() <= MAX_WEIGHT_ELEMENTS
                        and user.meta.get("lingc.stage") == norm.meta.get("lingc.stage")):
                    found.append((user, path))
            elif user.target in RESHAPES and _last_dim(user) == k:
                stack.append((user, path + [user]))
    return min(found, key=lambda f: order[f[0]]) if found else None


def _fuse(graph: fx.Graph, norm: fx.Node, normed: fx.Node, lin: fx.Node, views: list[fx.Node],
          order: dict[fx.Node, float]) -> fx.Node:
    """Insert the fused op before `norm`; re-point the norm's outputs and the linear to it; drop what is dead."""
    add = norm.target is OPS.add_rmsnorm
    weight = lin.args[1]
    with graph.inserting_before(norm):
        fused = graph.call_function(OPS.add_rmsnorm_linear if add else OPS.rmsnorm_linear,
                                    (*norm.args, weight, _out_dtype(lin), True))
    if order[weight] > order[norm]:
        fused.prepend(weight)                        # a weight read is free to move up; the fused op needs it here
        order[weight] = order[norm] - 0.5
    fused.meta = {k: norm.meta[k] for k in KEEP_META if k in norm.meta}
    if "lingc.dtype" in lin.meta:                    # bf16_router's mark belongs to the op that runs the GEMV now
        fused.meta["lingc.dtype"] = lin.meta.pop("lingc.dtype")
    fused._rename(norm.name + "_linear")
    rows = tuple(lin.meta["lingc.tensor"].shape[:-1])
    if views:                                        # the linear read a reshaped normed: reshape y the same way
        with graph.inserting_after(fused):
            y = graph.call_function(operator.getitem, (fused, 0))
        y.meta = {k: lin.meta[k] for k in KEEP_META if k in lin.meta}
        y._rename(lin.name + "_y")
        lin.target, lin.args, lin.kwargs = aten.view.default, (y, [*rows, -1]), {}
    else:
        lin.target, lin.args, lin.kwargs = operator.getitem, (fused, 0), {}
    for view in reversed(views):                     # reshapes only the linear read are dead now
        if not view.users:
            graph.erase_node(view)
    if add:                                          # the old getitems: normed (0) -> 1, new residual (1) -> 2
        for item in list(norm.users):
            item.args = (fused, item.args[1] + 1)
        graph.erase_node(norm)
    else:
        norm.target, norm.args, norm.kwargs = operator.getitem, (fused, 1), {}
    if not normed.users:                             # nothing but the fused linear read the norm's output
        graph.erase_node(normed)
        fused.args = (*fused.args[:-1], False)
    return fused


class FuseNormLinear(Pass):
    name = "fuse_norm_linear"
    summary = ("rmsnorm / add_rmsnorm + a linear reading it -> one rmsnorm_linear / add_rmsnorm_linear (the norm "
               "runs in the GEMV's prologue)")
    # after the passes whose matchers look for the plain norm -> linear pattern (bf16_router and fuse_moe_align
    # find the router gate as a linear, fuse_shared_expert the shared expert's gate_up, fuse_kda the projection's
    # split) and after the two that build what it fuses (fuse_add_norm's op, fuse_projections' wide linear)
    after = ("partition", "bf16_router", "fuse_projections", "fuse_add_norm", "fuse_moe_align", "fuse_shared_expert",
             "fuse_kda")
    changes_numerics = True
    # max |delta| of logits x (1 + |logit|), as fuse_projections: the Triton kernel's rstd may differ from the
    # rmsnorm kernel's in the last bit (another summation order), moving a bf16 normed element by one rounding;
    # the reference backend is bit-exact (its op is the composition)
    tolerance = 0.01

    def apply(self, program: Program) -> dict[str, Any]:
        fused_nodes: list[str] = []
        counts = {"rmsnorm": 0, "add_rmsnorm": 0, "want_normed": 0}
        for gname, graph in program.graphs.items():
            order = {n: float(i) for i, n in enumerate(graph.nodes)}
            norms = calls(graph, "rmsnorm") + calls(graph, "add_rmsnorm")
            for norm in sorted(norms, key=order.__getitem__):
                add = norm.target is OPS.add_rmsnorm
                normed = next((u for u in norm.users if u.target is operator.getitem and u.args[1] == 0), None) \
                    if add else norm
                reader = _linear_reader(program, norm, normed, order) if normed is not None else None
                if reader is None:
                    continue
                lin, views = reader
                lin_name = lin.name
                fused = _fuse(graph, norm, normed, lin, views, order)
                counts["add_rmsnorm" if add else "rmsnorm"] += 1
                counts["want_normed"] += bool(fused.args[-1])
                fused_nodes.append(f"{gname}:{fused.name} <- {lin_name}")
        return {"matches": len(fused_nodes), "fused": fused_nodes, "norms_fused": counts}
