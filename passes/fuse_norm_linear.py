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

KDA's gated o_norm (per head: rmsnorm(x) * w * sigmoid(gate)) and the o_proj reading it (H heads of D):
Before:
    L0_attention_gated_rmsnorm = lingc.gated_rmsnorm(L0_attention_view_3, w_L0_attention_o_norm_weight,
                                                     L0_attention_view_4, 1e-06)                # [1, 1, H, D]
    L0_attention_view_5 = aten.view(L0_attention_gated_rmsnorm, [1, 1, -1])                     # [1, 1, H*D]
    L0_attention_o_proj_linear = lingc.linear(L0_attention_view_5, w_L0_attention_o_proj_weight)
After:
    L0_attention_gated_rmsnorm_linear = lingc.gated_rmsnorm_linear(L0_attention_view_3, w_L0_attention_o_norm_weight,
        L0_attention_view_4, 1e-06, w_L0_attention_o_proj_weight, None)                          # [1, 1, h]
    L0_attention_o_proj_linear = aten.view(L0_attention_gated_rmsnorm_linear, [1, 1, -1])
Only where the norm's one reader is that reshape and the reshape's one reader the linear (always, in Ling-3).
Any weight size: a K block of the GEMV holds whole heads, so the norm needs no prologue over K (kernels/linear.py
GATED); -18 launches in Ling-3.0-tiny's decode step and as many in verify. Opt-in (LINGC_NORM_LINEAR_GATED=1): the
H200 measured the fused GEMV slower than the pair it replaces (GATED below).

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
carries: declared numerics-changing, gated on logits + greedy parity like fuse_projections. The gated kernel sums a
head's squares in the GEMV's block layout, not the gated_rmsnorm kernel's, with the same consequence.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from lingc.knobs import env_flag, env_int
from lingc.ops import OPS
from lingc.program import Program
from lingc.passes.base import Pass
from lingc.passes.matchers import calls, carried_meta

aten = torch.ops.aten
MAX_WEIGHT_ELEMENTS = env_int("LINGC_NORM_LINEAR_MAX_WEIGHT", 1 << 20)  # larger weights lose on the H200
# (module docstring): they keep norm + linear. The environment variable is an A/B knob for bench/device_step.py.
# KDA's gated o_norm -> o_proj (gated_rmsnorm_linear): off by default. On the H200 the GATED GEMV took 10.5 us against
# 6.8 for the gated_rmsnorm + linear pair (8.9 vs 5.7 with PDL; bench/kernel_linear.py --gated, results/
# kernel-linear-gated-h200-20261130.json), 10.2 us a layer in the decode step against 4.7 + 1.8 (results/
# launches-h200-20261130-c.json); LINGC_NORM_LINEAR_GATED=1 turns it on. Since 2026-12-05 a PDL launch of it on sm_90
# runs kernels/linear_tma.py's Gluon kernel (GATED: the weight ring fills before the wait as o_proj's does); still
# slower: 6.52 vs 5.18 us alone at one row, greedy decode +25 us and verify +55 in the step (2026-12-05,
# step-ab-h200-20261205.json; A/B: bench/device_step.py --variant 'gated:lingc.passes.fuse_norm_linear.GATED=True')
GATED = env_flag("LINGC_NORM_LINEAR_GATED", False)
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
    fused.meta = carried_meta(norm)
    if "lingc.dtype" in lin.meta:                    # bf16_router's mark belongs to the op that runs the GEMV now
        fused.meta["lingc.dtype"] = lin.meta.pop("lingc.dtype")
    fused._rename(norm.name + "_linear")
    rows = tuple(lin.meta["lingc.tensor"].shape[:-1])
    if views:                                        # the linear read a reshaped normed: reshape y the same way
        with graph.inserting_after(fused):
            y = graph.call_function(operator.getitem, (fused, 0))
        y.meta = carried_meta(lin)
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


def _gated_reader(program: Program, norm: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(linear, reshape) when the gated_rmsnorm's only reader is one reshape to [..., H*D] whose only reader is a
    linear over a plain [N, H*D] weight in the norm's stage (KDA's o_norm -> o_proj); None otherwise."""
    x_meta = norm.args[0].meta.get("lingc.tensor") if isinstance(norm.args[0], fx.Node) else None
    users = list(norm.users)
    if x_meta is None or len(x_meta.shape) < 2 or len(users) != 1 or users[0].target not in RESHAPES:
        return None
    k = x_meta.shape[-1] * x_meta.shape[-2]
    view = users[0]
    readers = list(view.users)
    if (_last_dim(view) != k or len(readers) != 1 or readers[0].target is not OPS.linear
            or readers[0].args[0] is not view):
        return None
    lin = readers[0]
    weight = lin.args[1]
    if not (weight.op == "get_attr" and program.weights[weight.target].dim() == 2
            and program.weights[weight.target].shape[1] == k
            and lin.meta.get("lingc.stage") == norm.meta.get("lingc.stage")):
        return None
    return lin, view


def _fuse_gated(graph: fx.Graph, norm: fx.Node, lin: fx.Node, view: fx.Node, order: dict[fx.Node, float]) -> fx.Node:
    """gated_rmsnorm_linear before `norm`; the linear becomes a view of its y; the norm and the reshape go."""
    x, norm_weight, gate, eps = norm.args
    weight = lin.args[1]
    with graph.inserting_before(norm):
        fused = graph.call_function(OPS.gated_rmsnorm_linear, (x, norm_weight, gate, eps, weight, _out_dtype(lin)))
    if order[weight] > order[norm]:
        fused.prepend(weight)
        order[weight] = order[norm] - 0.5
    fused.meta = carried_meta(norm)
    y_meta = lin.meta.get("lingc.tensor")
    if y_meta is not None:
        fused.meta["lingc.tensor"] = type(y_meta)((*x.meta["lingc.tensor"].shape[:-2], y_meta.shape[-1]), y_meta.dtype)
    fused._rename(norm.name + "_linear")
    rows = tuple(y_meta.shape[:-1]) if y_meta is not None else (-1,)
    lin.target, lin.args, lin.kwargs = aten.view.default, (fused, [*rows, -1]), {}
    graph.erase_node(view)
    graph.erase_node(norm)
    return fused


class FuseNormLinear(Pass):
    name = "fuse_norm_linear"
    summary = ("rmsnorm / add_rmsnorm + a linear reading it -> one rmsnorm_linear / add_rmsnorm_linear (the norm "
               "runs in the GEMV's prologue); KDA's gated o_norm + o_proj -> gated_rmsnorm_linear")
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
        counts = {"rmsnorm": 0, "add_rmsnorm": 0, "gated_rmsnorm": 0, "want_normed": 0}
        for gname, graph in program.graphs.items():
            order = {n: float(i) for i, n in enumerate(graph.nodes)}
            for norm in calls(graph, "gated_rmsnorm") if GATED else []:
                reader = _gated_reader(program, norm)
                if reader is None:
                    continue
                lin_name = reader[0].name
                fused = _fuse_gated(graph, norm, *reader, order)
                counts["gated_rmsnorm"] += 1
                fused_nodes.append(f"{gname}:{fused.name} <- {lin_name}")
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
