"""fuse_combine_norm: a MoE layer's combine and the residual add + RMSNorm that reads it -> one combine_add_rmsnorm.

At batch 1 the combine is a ~1 us launch that sums k + 1 rows of h and writes one row, which the next layer's
add_rmsnorm (another ~1.5 us launch) reads back. The fused op does both in one program per token: the combine's
row (its order, its rounding to the activation dtype), then the add and the norm (kernels/moe.py, reusing
kernels/rmsnorm.py's row code): -1 launch per MoE layer whose output goes into an add_rmsnorm (Ling-3.0-tiny's
decode step: 23, verify 23; the last layer's combine feeds the final norm).

Before (fuse_shared_expert has removed shared_out; h hidden):
    L1_mlp_moe_combine = lingc.moe_combine(L1_mlp_moe_down, L1_mlp_router_align_1)                 # [N, h]
    L1_mlp_view_2 = aten.view(L1_mlp_moe_combine, [1, 1, h])
    L2_input_layernorm_add_rmsnorm = lingc.add_rmsnorm(L1_add, L1_mlp_view_2, w_L2_input_layernorm_weight, 1e-06)
After:
    L2_input_layernorm_combine_add_rmsnorm = lingc.combine_add_rmsnorm(L1_add, L1_mlp_moe_down,
        L1_mlp_router_align_1, w_L2_input_layernorm_weight, 1e-06)                                  # (normed, residual)
The norm's readers (getitem 0 normed, 1 new residual) read the fused op, whose outputs come in the same order. It
matches a moe_combine without shared_out whose only reader is an add_rmsnorm, directly or through one view only
the add_rmsnorm reads (either argument of the add: it is commutative bit for bit). A combine read by anything else
(an add_rmsnorm_linear, the draft chain's returned hidden state) stays.

Numerics unchanged: the op's reference is the composition (lingc/ops/moe.py) and its kernel runs the combine's and
the add_rmsnorm's row code, bit-identical to the two kernels (tests/kernels/test_combine_norm.py; on the H200:
bench/kernel_moe.py `check_combine_norm`). The tp pass splits it back (`unfuse`) before it rewrites the combine into
its expert-parallel form.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from lingc.ops import OPS
from lingc.passes.base import Pass
from lingc.passes.matchers import add_rmsnorm_reader, carried_meta, replace_add_rmsnorm
from lingc.program import Program

VIEW = torch.ops.aten.view.default


def _match(combine: fx.Node) -> tuple[fx.Node | None, fx.Node, fx.Node] | None:
    """(view or None, add_rmsnorm, residual) when `combine` (no shared_out) feeds exactly one add_rmsnorm."""
    if len(combine.args) > 2 and combine.args[2] is not None or combine.kwargs.get("shared_out") is not None:
        return None
    return add_rmsnorm_reader(combine)


def _fuse(graph: fx.Graph, combine: fx.Node, view: fx.Node | None, norm: fx.Node, residual: fx.Node) -> fx.Node:
    expert_out, topk_weights = combine.args[:2]
    _, _, weight, eps = norm.args
    with graph.inserting_before(norm):
        fused = graph.call_function(OPS.combine_add_rmsnorm, (residual, expert_out, topk_weights, weight, eps))
    return replace_add_rmsnorm(graph, norm, fused, "combine", view, combine)


def unfuse(graph: fx.Graph, fused: fx.Node) -> fx.Node:
    """Split a combine_add_rmsnorm back into moe_combine -> view -> add_rmsnorm (the tp pass rewrites the combine);
    returns the add_rmsnorm, which takes over the fused node's readers."""
    residual, expert_out, topk_weights, weight, eps = fused.args
    with graph.inserting_before(fused):
        combine = graph.call_function(OPS.moe_combine, (expert_out, topk_weights))
        x = graph.call_function(VIEW, (combine, list(residual.meta["lingc.tensor"].shape)))
        norm = graph.call_function(OPS.add_rmsnorm, (residual, x, weight, eps))
    meta = carried_meta(fused)
    for node in (combine, x, norm):
        node.meta = dict(meta)
    res_meta = residual.meta["lingc.tensor"]
    x.meta["lingc.tensor"] = res_meta
    combine.meta["lingc.tensor"] = type(res_meta)((int(topk_weights.meta["lingc.tensor"].shape[0]),
                                                   int(res_meta.shape[-1])), res_meta.dtype)
    name = fused.name
    fused.replace_all_uses_with(norm)
    graph.erase_node(fused)
    norm._rename(name.replace("combine_add_rmsnorm", "add_rmsnorm"))
    combine._rename(name.replace("combine_add_rmsnorm", "moe_combine"))
    return norm


class FuseCombineNorm(Pass):
    name = "fuse_combine_norm"
    summary = "moe_combine + the add_rmsnorm reading it -> one combine_add_rmsnorm (-1 launch per MoE layer)"
    # after the passes that make the combine shared_out-free or take it (fuse_shared_expert, the opt-in fuse_moe), and
    # after fuse_norm_linear, which folds some add_rmsnorms into GEMVs first; pdl runs after it
    after = ("partition", "fuse_add_norm", "fuse_shared_expert", "fuse_moe", "fuse_norm_linear")
    changes_numerics = False

    def apply(self, program: Program) -> dict[str, Any]:
        fused: list[str] = []
        for gname, graph in program.graphs.items():
            for combine in [n for n in graph.nodes if n.op == "call_function" and n.target is OPS.moe_combine]:
                m = _match(combine)
                if m is not None:
                    fused.append(f"{gname}:{_fuse(graph, combine, *m).name}")
            graph.lint()
        return {"matches": len(fused), "fused": fused}

