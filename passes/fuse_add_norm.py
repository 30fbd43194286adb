"""fuse_add_norm: fuse each residual add with the rmsnorm of its result into one add_rmsnorm.

Before (per decoder layer, twice: after the mixer and after the FFN; h hidden):
    L1_add = lingc.add(L0_add_1, L1_attention_o_proj_linear)                              # [B, T, h]  new residual
    L1_post_attention_layernorm_rmsnorm = lingc.rmsnorm(L1_add, w_L1_post_attention_layernorm_weight, 1e-06)
After:
    L1_post_attention_layernorm_add_rmsnorm = lingc.add_rmsnorm(L0_add_1, L1_attention_o_proj_linear,
                                                                w_L1_post_attention_layernorm_weight, 1e-06)
    L1_post_attention_layernorm_rmsnorm = getitem(L1_post_attention_layernorm_add_rmsnorm, 0)   # normed
    L1_add = getitem(L1_post_attention_layernorm_add_rmsnorm, 1)                                # new residual
The add and norm nodes become the getitems (names kept), so the add's other readers (the next residual
add, a relay write) and the norm's readers are untouched. An add that only the norm reads (the last
layer's, before the final norm) is erased instead.

The op does what add then rmsnorm did, in the same arithmetic (lingc/ops/norm.py), so numerics are
unchanged; at batch 1 one launch and one round trip of the residual through memory disappear per add.
An add fuses with the first rmsnorm (graph order) that reads it directly, in the same NEXTN stage.
"""

from __future__ import annotations

import operator
from typing import Any

import torch.fx as fx

from lingc.ops import OPS
from lingc.program import Program
from lingc.passes.base import Pass
from lingc.passes.matchers import calls, carried_meta



def _norm_of(add: fx.Node, order: dict[fx.Node, float]) -> fx.Node | None:
    """The first rmsnorm (graph order) whose input is `add` itself, in the same stage; None if there is none."""
    norms = [u for u in add.users if u.target is OPS.rmsnorm and len(u.args) == 3 and u.args[0] is add
             and u.meta.get("lingc.stage") == add.meta.get("lingc.stage")]
    return min(norms, key=order.__getitem__) if norms else None


def _fuse(graph: fx.Graph, add: fx.Node, norm: fx.Node, order: dict[fx.Node, float]) -> fx.Node:
    """Insert add_rmsnorm before `add`; the norm and the add become its getitems, keeping their names."""
    residual, x = add.args
    _, weight, eps = norm.args
    if weight.op == "get_attr" and order[weight] > order[add]:
        add.prepend(weight)                            # a weight read is free to move up; the fused op needs it here
        order[weight] = order[add] - 0.5
    with graph.inserting_before(add):
        fused = graph.call_function(OPS.add_rmsnorm, (residual, x, weight, eps))
    fused.meta = carried_meta(norm)
    fused._rename(norm.name.replace("rmsnorm", "add_rmsnorm") if "rmsnorm" in norm.name else norm.name + "_add")
    norm.target, norm.args, norm.kwargs = operator.getitem, (fused, 0), {}             # normed
    if add.users:                                      # besides the norm, which reads fused now
        add.target, add.args, add.kwargs = operator.getitem, (fused, 1), {}            # new residual
    else:
        graph.erase_node(add)                          # only the norm read it: now nobody does
    return fused


class FuseAddNorm(Pass):
    name = "fuse_add_norm"
    summary = "residual add + the next rmsnorm -> one add_rmsnorm (normed, new residual)"
    after = ("partition",)
    changes_numerics = False

    def apply(self, program: Program) -> dict[str, Any]:
        fused_nodes: list[str] = []
        for gname, graph in program.graphs.items():
            order: dict[fx.Node, float] = {n: float(i) for i, n in enumerate(graph.nodes)}
            for add in calls(graph, "add"):
                norm = _norm_of(add, order)
                if norm is None:
                    continue
                fused_nodes.append(f"{gname}:{_fuse(graph, add, norm, order).name}")
        return {"matches": len(fused_nodes), "fused": fused_nodes}
