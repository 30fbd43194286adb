"""The MoE router's whole front in one op (fuse_norm_router): residual add + RMSNorm, the gate GEMV, the router.

    add_rmsnorm_router(residual, x, norm_weight, eps, gate_weight, expert_bias, n_group, topk_group, top_k,
                       routed_scaling_factor, num_experts, block_m, fused_shared)
        -> (normed, new_residual, weights, ids, sorted_pairs, block_expert, total)

residual / x [..., h], norm_weight [h], gate_weight [E, h], expert_bias [E]. normed and new_residual are
add_rmsnorm's (x's shape, the activation dtype); the gate's logits [N, E] are fp32 (N = rows of x) and never leave
the op; weights / ids [N, k + S] are router_topk's. With block_m > 0 the last three are router_align's moe_align
outputs (num_experts = E + S); with block_m == 0 (the router_topk form, a verify chain's pair grid) they are empty
int32 [0] tensors. The reference is literally the composition it replaces (add_rmsnorm_linear into fp32 logits,
then router_align or router_topk), so the reference backend is bit-identical to the unfused graph.
"""

from __future__ import annotations

import torch

from lingc.ops.moe import align_sizes, router_align, router_topk
from lingc.ops.norm_linear import add_rmsnorm_linear
from lingc.ops.registry import register

# rows (tokens) a fused call takes: the kernel's one ticket counter a row (decode 1, verify 6); fuse_norm_router leaves
# larger calls (prefill chunks) unfused. Here, not in kernels/norm_router.py, so the pass imports no kernel module.
MAX_ROWS = 16

Outputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def no_align(like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router_topk form's three empty int32 [0] align outputs."""
    return tuple(like.new_empty((0,), dtype=torch.int32) for _ in range(3))


@torch.library.custom_op("lingc::add_rmsnorm_router", mutates_args=())
def add_rmsnorm_router(residual: torch.Tensor, x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       gate_weight: torch.Tensor, expert_bias: torch.Tensor, n_group: int, topk_group: int,
                       top_k: int, routed_scaling_factor: float, num_experts: int, block_m: int,
                       fused_shared: int) -> Outputs:
    """(normed, residual + x, weights, ids, sorted_pairs, block_expert, total): add_rmsnorm, the gate in fp32 and
    router_align (block_m > 0) or router_topk (block_m == 0, empty align outputs)."""
    logits, normed, new_residual = add_rmsnorm_linear(residual, x, norm_weight, eps, gate_weight, torch.float32, True)
    logits = logits.reshape(-1, gate_weight.shape[0])
    if block_m > 0:
        routed = router_align(logits, expert_bias, n_group, topk_group, top_k, routed_scaling_factor, num_experts,
                              block_m, fused_shared)
    else:
        routed = (*router_topk(logits, expert_bias, n_group, topk_group, top_k, routed_scaling_factor, fused_shared),
                  *no_align(logits))
    return (normed, new_residual, *routed)


@add_rmsnorm_router.register_fake
def _(residual, x, norm_weight, eps, gate_weight, expert_bias, n_group, topk_group, top_k, routed_scaling_factor,
      num_experts, block_m, fused_shared):
    n, width = x.numel() // x.shape[-1], top_k + fused_shared
    new = lambda shape, dtype: x.new_empty(shape, dtype=dtype)  # noqa: E731
    routed = (new((n, width), torch.float32), new((n, width), torch.int32))
    if block_m > 0:
        max_padded, blocks = align_sizes(n * width, num_experts, block_m)
        aligned = (new((max_padded,), torch.int32), new((blocks,), torch.int32), new((1,), torch.int32))
    else:
        aligned = tuple(new((0,), torch.int32) for _ in range(3))
    return (residual.new_empty(residual.shape), residual.new_empty(residual.shape), *routed, *aligned)


register("add_rmsnorm_router")
