"""fuse_all_reduce_norm: a tensor-parallel all_reduce and the add_rmsnorm that reads it -> one all_reduce_add_rmsnorm.

Runs after the tp pass (which inserts every all_reduce, passes/tp.py), as part of `lingc compile --tp N`. After a
row-parallel projection or a MoE layer's combine, the partial sum goes through `all_reduce` and then into the
residual add + the next RMSNorm; on the GPU the fused op is one launch: the one-shot all-reduce over NVLink, then
the add and the norm in the same program (kernels/allreduce.py), instead of two launches and a round trip of the
sum through memory.

Before (a MoE layer's output, [N, h] viewed back to [B, T, h]):
    L2_mlp_ep_combine_all_reduce = lingc.all_reduce(L2_mlp_ep_combine, 2)
    view_7 = aten.view(L2_mlp_ep_combine_all_reduce, [1, 1, 1536])
    L3_input_layernorm_add_rmsnorm = lingc.add_rmsnorm(getitem_12, view_7, w_L3_input_layernorm_weight, 1e-06)
After:
    view_7 = aten.view(L2_mlp_ep_combine, [1, 1, 1536])                         # the partial, viewed alike
    L3_input_layernorm_all_reduce_add_rmsnorm = lingc.all_reduce_add_rmsnorm(getitem_12, view_7,
                                                    w_L3_input_layernorm_weight, 1e-06, 2)
The norm's readers (getitem 0: normed, getitem 1: new residual) read the fused op, whose outputs come in the same
order. It matches an all_reduce whose only reader is an add_rmsnorm, directly or through one view that only the
add_rmsnorm reads. An all_reduce read by an `add_rmsnorm_linear` (fuse_norm_linear folded the norm into a small
GEMM, e.g. the router gate) stays as it is: that launch already does the norm.

Numerics unchanged: the op's reference is the two ops' composition (lingc/ops/dist.py), and its kernel reuses
kernels/rmsnorm.py's row code, bit-identical to the pair of kernels (tests/kernels/test_allreduce.py). The
residual may be either argument of the add (the add is commutative bit for bit).
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


def _fuse(graph: fx.Graph, ar: fx.Node, view: fx.Node | None, norm: fx.Node, residual: fx.Node) -> fx.Node:
    partial, world_size = ar.args[0], ar.args[1]
    _, _, weight, eps = norm.args
    with graph.inserting_before(norm):
        x = partial
        if view is not None:
            x = graph.call_function(VIEW, (partial, *view.args[1:]))
            x.meta = carried_meta(view)
            x._rename(view.name)
        fused = graph.call_function(OPS.all_reduce_add_rmsnorm, (residual, x, weight, eps, world_size))
    return replace_add_rmsnorm(graph, norm, fused, "all_reduce", view, ar)


class FuseAllReduceNorm(Pass):
    name = "fuse_all_reduce_norm"
    summary = "all_reduce + the add_rmsnorm reading it -> one all_reduce_add_rmsnorm"
    requires = ("tp",)
    changes_numerics = False
    runs_after = "tp (runs with --tp N)"     # `lingc passes`: run by run_tp_stage, never by --passes

    def apply(self, program: Program) -> dict[str, Any]:
        fused: list[str] = []
        for gname, graph in program.graphs.items():
            for ar in [n for n in graph.nodes if n.op == "call_function" and n.target is OPS.all_reduce]:
                m = add_rmsnorm_reader(ar)
                if m is not None:
                    fused.append(f"{gname}:{_fuse(graph, ar, *m).name}")
            graph.lint()
        return {"matches": len(fused), "fused": fused}
