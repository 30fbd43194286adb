"""fuse_swiglu: interleave each expert's w13 rows and fuse the MoE up-GEMM with its SwiGLU (+clamp).

Before (per MoE layer, NP = tokens * k pairs, I = expert intermediate size):
    up  = lingc.moe_up(x, w13, sorted_pairs, block_expert, total, k, BM)        # [NP, 2I]  rows: gate | up
    act = lingc.silu_and_mul(up, limit)                                          # [NP, I]
After:
    act = lingc.moe_up_act(x, w13_interleaved, sorted_pairs, block_expert, total, k, BM, limit)   # [NP, I]
where w13_interleaved[e, 2j] = gate_j and [e, 2j + 1] = up_j (weight_info layout = gu_interleaved).

Every output column is its own dot product, so the permutation leaves each value's bits unchanged and the
activation rounds once, as before: numerics unchanged (techniques.md section 7). The full-width [NP, 2I]
intermediate and one launch per MoE layer disappear. Shared experts and dense MLPs (plain linear +
silu_and_mul) are left alone.
"""

from __future__ import annotations

from typing import Any

import torch

from lingc.ops import OPS
from lingc.program import Program
from lingc.passes.base import Pass
from lingc.passes.matchers import calls, carried_meta, drop_unused_weights, get_weight_node

LAYOUT = "gu_interleaved"


def interleave_w13(w13: torch.Tensor) -> torch.Tensor:
    """[E, 2I, h] with gate rows then up rows -> rows alternating gate_j, up_j."""
    E, two_i, h = w13.shape
    inter = two_i // 2
    return torch.stack([w13[:, :inter], w13[:, inter:]], dim=2).reshape(E, two_i, h).contiguous()


class FuseSwiglu(Pass):
    name = "fuse_swiglu"
    summary = "interleave expert w13 rows; fuse moe_up + silu_and_mul into moe_up_act (SwiGLU epilogue)"
    changes_numerics = False

    def apply(self, program: Program) -> dict[str, Any]:
        matches, layers = 0, []
        for gname, graph in program.graphs.items():
            for up in calls(graph, "moe_up"):
                users = list(up.users)
                if len(users) != 1 or users[0].target is not OPS.silu_and_mul:
                    continue
                act = users[0]
                w13 = up.args[1]
                new_name = w13.target + "_interleaved"
                if new_name not in program.weights:
                    program.weights[new_name] = interleave_w13(program.weights[w13.target])
                    program.weight_info[new_name] = {"layout": LAYOUT}
                w_node = get_weight_node(graph, new_name, before=w13)
                x, _, sorted_pairs, block_expert, total, top_k, block_m = up.args
                with graph.inserting_before(up):
                    fused = graph.call_function(OPS.moe_up_act, (x, w_node, sorted_pairs, block_expert, total,
                                                                 top_k, block_m, act.args[1]))
                fused.meta = {"lingc.scope": up.meta.get("lingc.scope", ""), "lingc.layout": LAYOUT,
                              **carried_meta(up, ("lingc.stage",))}   # NEXTN stage kept
                fused._rename(up.name.replace("moe_up", "moe_up_act"))
                act.replace_all_uses_with(fused)
                graph.erase_node(act)
                graph.erase_node(up)
                matches += 1
                layers.append(f"{gname}:{fused.name}")
        drop_unused_weights(program)
        return {"matches": matches, "fused": layers}
