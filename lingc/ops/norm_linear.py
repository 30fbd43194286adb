"""Norm + linear ops (fuse_norm_linear): an RMSNorm, optionally after the residual add, and the linear that reads it.

    rmsnorm_linear(x, norm_weight, eps, weight, out_dtype, want_normed) -> (y, normed)
    add_rmsnorm_linear(residual, x, norm_weight, eps, weight, out_dtype, want_normed) -> (y, normed, new_residual)
    gated_rmsnorm_linear(x, norm_weight, gate, eps, weight, out_dtype) -> y      (KDA's o_norm -> o_proj)

x / residual [..., K], norm_weight [K], weight [N, K]; y [..., N] in out_dtype (default: the activation dtype),
normed and new_residual [..., K] in the activation dtype. `normed` is the norm's output as the unfused graph had it;
when nothing but the linear reads it the pass sets want_normed = False and the op returns an empty [0] tensor in its
place (the kernel then never writes it). gated_rmsnorm_linear takes x and gate [..., H, D] (gated_rmsnorm's shapes),
norm_weight [D] and weight [N, H*D], and returns y [..., N]: the linear of the norm's output with its heads
flattened; nothing else ever reads that output, so the op never returns it. Each reference is literally the
composition of the ops it replaces (rmsnorm or add_rmsnorm, then linear), so the reference backend is bit-identical
to the unfused graph; the Triton kernel (kernels/linear.py) recomputes the norm in the GEMV's prologue.
"""

from __future__ import annotations

from typing import Optional

import torch

from lingc.ops.linear import linear
from lingc.ops.norm import add_rmsnorm, gated_rmsnorm, rmsnorm
from lingc.ops.registry import register


def _normed_or_empty(normed: torch.Tensor, want_normed: bool) -> torch.Tensor:
    return normed if want_normed else normed.new_empty((0,))


@torch.library.custom_op("lingc::rmsnorm_linear", mutates_args=())
def rmsnorm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                   out_dtype: Optional[torch.dtype], want_normed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rmsnorm(x), weight, out_dtype), rmsnorm(x) or an empty [0] tensor when not wanted)."""
    normed = rmsnorm(x, norm_weight, eps)
    return linear(normed, weight, out_dtype), _normed_or_empty(normed, want_normed)


@rmsnorm_linear.register_fake
def _(x, norm_weight, eps, weight, out_dtype, want_normed):
    y = x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=out_dtype if out_dtype is not None else x.dtype)
    return y, x.new_empty(x.shape if want_normed else (0,))


register("rmsnorm_linear")


@torch.library.custom_op("lingc::add_rmsnorm_linear", mutates_args=())
def add_rmsnorm_linear(residual: torch.Tensor, x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       weight: torch.Tensor, out_dtype: Optional[torch.dtype],
                       want_normed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """add_rmsnorm then linear of its normed output: (y, normed or an empty [0] tensor, residual + x)."""
    normed, new_residual = add_rmsnorm(residual, x, norm_weight, eps)
    return linear(normed, weight, out_dtype), _normed_or_empty(normed, want_normed), new_residual


@add_rmsnorm_linear.register_fake
def _(residual, x, norm_weight, eps, weight, out_dtype, want_normed):
    y = x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=out_dtype if out_dtype is not None else x.dtype)
    return y, x.new_empty(x.shape if want_normed else (0,)), residual.new_empty(residual.shape)


register("add_rmsnorm_linear")

@torch.library.custom_op("lingc::gated_rmsnorm_linear", mutates_args=())
def gated_rmsnorm_linear(x: torch.Tensor, norm_weight: torch.Tensor, gate: torch.Tensor, eps: float,
                         weight: torch.Tensor, out_dtype: Optional[torch.dtype]) -> torch.Tensor:
    """linear(gated_rmsnorm(x, norm_weight, gate, eps) with its last two dims flattened, weight, out_dtype)."""
    return linear(gated_rmsnorm(x, norm_weight, gate, eps).flatten(-2), weight, out_dtype)


@gated_rmsnorm_linear.register_fake
def _(x, norm_weight, gate, eps, weight, out_dtype):
    return x.new_empty((*x.shape[:-2], weight.shape[0]), dtype=out_dtype if out_dtype is not None else x.dtype)


register("gated_rmsnorm_linear")

# the position of the linear's weight among each op's arguments (passes and tp look it up here)
WEIGHT_ARG = {"rmsnorm_linear": 3, "add_rmsnorm_linear": 4, "gated_rmsnorm_linear": 4}
