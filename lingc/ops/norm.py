"""Norm and gate ops: rmsnorm, add_rmsnorm, rmsnorm_cat, embedding_rmsnorm[_cat], gated_rmsnorm (KDA o_norm),
sigmoid_gate (MLA head gate), l2norm helper.

All compute in fp32 and round once to the input dtype, Llama style: normalise, cast back, then scale
by the weight (shared/docs/architecture.md section 3).
"""

from __future__ import annotations

import torch

from lingc.ops.linear import ROW_INVARIANT_ROWS
from lingc.ops.registry import register


@torch.library.custom_op("lingc::rmsnorm", mutates_args=())
def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) in fp32, cast to x.dtype, times weight. x [..., N], weight [N]."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed).to(x.dtype).contiguous()


@rmsnorm.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape)


register("rmsnorm")


@torch.library.custom_op("lingc::add_rmsnorm", mutates_args=())
def add_rmsnorm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm in one op (fuse_add_norm): (rmsnorm(residual + x), residual + x).

    residual, x [..., N] of one dtype, weight [N]. The same arithmetic as lingc.add then lingc.rmsnorm,
    so both outputs are bit-identical to the pair's; the Triton kernel (kernels/rmsnorm.py) returns them
    in this order too.
    """
    new_residual = residual + x                                        # lingc.add
    return rmsnorm(new_residual, weight, eps), new_residual


@add_rmsnorm.register_fake
def _(residual, x, weight, eps):
    return residual.new_empty(residual.shape), residual.new_empty(residual.shape)


register("add_rmsnorm")


@torch.library.custom_op("lingc::rmsnorm_cat", mutates_args=())
def rmsnorm_cat(x1: torch.Tensor, weight1: torch.Tensor, x2: torch.Tensor, weight2: torch.Tensor,
                eps: float) -> torch.Tensor:
    """Two norms concatenated along the last dim in one op (fuse_cat_norm; the MTP layer's [enorm(e); hnorm(h)]):
    cat([rmsnorm(x1, weight1, eps), rmsnorm(x2, weight2, eps)], -1). x1, x2 [..., N] of one shape and dtype."""
    return torch.cat([rmsnorm(x1, weight1, eps), rmsnorm(x2, weight2, eps)], dim=-1)


@rmsnorm_cat.register_fake
def _(x1, weight1, x2, weight2, eps):
    return x1.new_empty((*x1.shape[:-1], 2 * x1.shape[-1]))


register("rmsnorm_cat")


@torch.library.custom_op("lingc::embedding_rmsnorm", mutates_args=())
def embedding_rmsnorm(input_ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The token gather and the first norm that reads it in one op (fuse_embed_norm; layer 0's input norm):
    (rmsnorm(embedding(input_ids, table), weight, eps), embedding(input_ids, table)). input_ids [B, T] int,
    table [V, N], weight [N] -> two [B, T, N]; the second is the residual stream's start."""
    x = torch.ops.lingc.embedding(input_ids, table)
    return rmsnorm(x, weight, eps), x


@embedding_rmsnorm.register_fake
def _(input_ids, table, weight, eps):
    shape = (*input_ids.shape, table.shape[-1])
    return table.new_empty(shape), table.new_empty(shape)


register("embedding_rmsnorm")


@torch.library.custom_op("lingc::embedding_rmsnorm_cat", mutates_args=())
def embedding_rmsnorm_cat(input_ids: torch.Tensor, table: torch.Tensor, weight1: torch.Tensor, x2: torch.Tensor,
                          weight2: torch.Tensor, eps: float) -> torch.Tensor:
    """rmsnorm_cat with its first input gathered from the table (fuse_embed_norm; the MTP layer's
    [enorm(embed(ids)); hnorm(h)]): rmsnorm_cat(embedding(input_ids, table), weight1, x2, weight2, eps)."""
    return rmsnorm_cat(torch.ops.lingc.embedding(input_ids, table), weight1, x2, weight2, eps)


@embedding_rmsnorm_cat.register_fake
def _(input_ids, table, weight1, x2, weight2, eps):
    return x2.new_empty((*x2.shape[:-1], 2 * x2.shape[-1]))


register("embedding_rmsnorm_cat")


@torch.library.custom_op("lingc::gated_rmsnorm", mutates_args=())
def gated_rmsnorm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """KDA output norm: rmsnorm over the last dim, times weight, times sigmoid(gate); fp32 inside.

    x [B, T, H, D] (recurrence output), weight [D] shared by all heads, gate [B, T, H, D].
    """
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float() * torch.sigmoid(gate.float())).to(x.dtype).contiguous()


@gated_rmsnorm.register_fake
def _(x, weight, gate, eps):
    return x.new_empty(x.shape)


register("gated_rmsnorm")


@torch.library.custom_op("lingc::sigmoid_gate", mutates_args=())
def sigmoid_gate(x: torch.Tensor, gate_logits: torch.Tensor) -> torch.Tensor:
    """Gated MLA: x [B, T, H, V] * sigmoid(gate_logits [B, T, H]) computed in fp32, cast back, multiplied in x.dtype.

    torch's CPU sigmoid takes a vectorised or a scalar path by the size and layout of what it is given, and the two
    round differently (an ulp on an AMD EPYC host). So up to ROW_INVARIANT_ROWS tokens each token's H logits go
    through it on their own, dense: a verify chain's gates get a decode step's bits, and a column view of a fused
    projection (fuse_projections) the bits of the unfused linear's output."""
    rows = gate_logits.float().reshape(-1, gate_logits.shape[-1])
    if rows.shape[0] <= ROW_INVARIANT_ROWS:
        gate = torch.cat([torch.sigmoid(rows[i:i + 1].contiguous()) for i in range(rows.shape[0])])
    else:
        gate = torch.sigmoid(rows.contiguous())
    gate = gate.view(gate_logits.shape).to(x.dtype)
    return (x * gate.unsqueeze(-1)).contiguous()


@sigmoid_gate.register_fake
def _(x, gate_logits):
    return x.new_empty(x.shape)


register("sigmoid_gate")


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla's l2norm: x / sqrt(sum(x^2) + eps), eps inside the root (not F.normalize). fp32 in, fp32 out."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)
