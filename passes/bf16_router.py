"""bf16_router: run the MoE router gate and the lm_head in bf16 instead of fp32 (numerics change).

Before:  logits = lingc.linear(x, gate_weight: f32[E, h], torch.float32)      # fp32 matvec
After:   logits = lingc.linear(x, gate_weight: bf16[E, h], torch.float32)     # bf16 matvec, fp32 result
(and the same for lm_head [V, h]). `linear` computes in its weight's dtype, so only the weights change
dtype; the nodes get meta lingc.dtype = bf16. Both matvecs are pure bandwidth at batch 1, so this
halves their bytes (techniques.md section 9: about +10% on the blog's step). Rounding changes and
router top-k ties can flip, so --verify checks greedy parity and |delta logits| <= `tolerance`.
"""

from __future__ import annotations

from typing import Any

import torch

from lingc.ops import OPS
from lingc.program import Program
from lingc.passes.base import Pass
from lingc.passes.matchers import calls, consumers

LM_HEAD = "lm_head.weight"


class Bf16Router(Pass):
    name = "bf16_router"
    summary = "router gate and lm_head weights and matvecs from fp32 to bf16"
    changes_numerics = True
    tolerance = 0.05      # max |delta| on fp32 logits; at test sizes bf16 rounding moves logits by ~1e-3

    def apply(self, program: Program) -> dict[str, Any]:
        lowered: set[str] = set()
        matches = 0
        for graph in program.graphs.values():
            for lin in calls(graph, "linear"):
                weight = lin.args[1]
                is_router = any(c.target in (OPS.router_topk, OPS.router_align) for c in consumers(lin))
                if not (is_router or weight.target == LM_HEAD):
                    continue
                if program.weights[weight.target].dtype != torch.bfloat16 and weight.target not in lowered:
                    program.weights[weight.target] = program.weights[weight.target].to(torch.bfloat16)
                    lowered.add(weight.target)
                lin.meta["lingc.dtype"] = "bf16"
                matches += 1
        return {"matches": matches, "weights_lowered": sorted(lowered)}
