"""fuse_cat_norm: two rmsnorms concatenated along the last dim -> one rmsnorm_cat (one launch, not three).

Before (the MTP layer's input, every MTP forward: 4 in the draft, 1 in extend, mtp_decode / mtp_prefill; h hidden):
    L6_enorm_rmsnorm = lingc.rmsnorm(L6_embedding, w_L6_enorm_weight, 1e-06)          # [B, T, h]
    L6_hnorm_rmsnorm = lingc.rmsnorm(L6_hidden, w_L6_hnorm_weight, 1e-06)             # [B, T, h]
    L6_cat = aten.cat([L6_enorm_rmsnorm, L6_hnorm_rmsnorm], -1)                       # [B, T, 2h]
After:
    L6_cat = lingc.rmsnorm_cat(L6_embedding, w_L6_enorm_weight, L6_hidden, w_L6_hnorm_weight, 1e-06)
The fused node takes the cat's name, so its readers (eh_proj) are untouched. Matched: an aten.cat of exactly two
lingc.rmsnorm nodes along the last dim (-1 or rank - 1), of one shape and dtype and one eps, each read by nothing but
the cat, in the cat's NEXTN stage.

Numerics unchanged: the op is the composition (lingc/ops/norm.py), and the Triton kernel runs each half as the
rmsnorm kernel does, bit for bit (kernels/rmsnorm.py). Saved: two launches and the halves' round trip through
memory per MTP forward (10 per NEXTN step with 5 draft tokens).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from lingc.ops import OPS
from lingc.program import Program
from lingc.passes.base import Pass
from lingc.passes.matchers import KEEP_META_CAPTURE, carried_meta



def _tensor(node: fx.Node) -> Any:
    return node.meta.get("lingc.tensor")


def _norms(cat: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """The cat's two rmsnorm inputs if it matches (module docstring), else None."""
    parts = cat.args[0]
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    if not isinstance(parts, (list, tuple)) or len(parts) != 2:
        return None
    a, b = parts
    if not all(isinstance(n, fx.Node) and n.target is OPS.rmsnorm and len(n.args) == 3 and set(n.users) == {cat}
               and n.meta.get("lingc.stage") == cat.meta.get("lingc.stage") for n in (a, b)):
        return None
    ta, tb = _tensor(a), _tensor(b)
    if ta is None or tb is None or tuple(ta.shape) != tuple(tb.shape) or ta.dtype != tb.dtype:
        return None
    if dim not in (-1, len(ta.shape) - 1) or a.args[2] != b.args[2]:
        return None
    return a, b


class FuseCatNorm(Pass):
    name = "fuse_cat_norm"
    summary = "cat of two rmsnorms along the last dim (the MTP's [enorm; hnorm]) -> one rmsnorm_cat"
    after = ("partition",)
    changes_numerics = False

    def apply(self, program: Program) -> dict[str, Any]:
        fused: list[str] = []
        for gname, graph in program.graphs.items():
            for cat in [n for n in graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.cat.default]:
                norms = _norms(cat)
                if norms is None:
                    continue
                a, b = norms
                (x1, w1, eps), (x2, w2, _) = a.args, b.args
                cat.target, cat.args, cat.kwargs = OPS.rmsnorm_cat, (x1, w1, x2, w2, eps), {}   # name and place kept
                cat.meta = carried_meta(cat, KEEP_META_CAPTURE)
                for norm in (a, b):
                    graph.erase_node(norm)
                fused.append(f"{gname}:{cat.name}")
        return {"matches": len(fused), "fused": fused}
