"""The building blocks of the reference model: Linear, RMSNorm, KDA, gated MLA, dense MLP and MoE.

Each `forward` states the math in calls of `torch.ops.lingc.*` (lingc.ops). Parameter names follow the
checkpoint's (`q_proj.weight`, `A_log`, `dense.weight`, ...) except where lingc stacks tensors:
`gate_up_proj` ([gate; up] rows of a dense or shared MLP) and `experts.w13` / `experts.w2`; the
loader (lingc.checkpoint) maps those. Letters: B batch, T tokens, h hidden, H heads, D KDA head dim,
P = H * D, N = B * T, E experts, k experts per token.
"""

from __future__ import annotations

import torch
from torch import nn

from lingc.config import LingConfig
from lingc.ops import OPS as ops
from lingc.state import StepMeta

MOE_BLOCK_M = 16   # rows per expert block in moe_align / moe_up / moe_down (the GEMM's BLOCK_M)


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T, no bias; computes in the weight's dtype, returns out_dtype (default x's)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, out_dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype)
        self.out_dtype = out_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.out_dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = _param(dim, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rmsnorm(x, self.weight, self.eps)


class ShortConv(nn.Module):
    """Holds one depthwise conv weight [P, 1, W] (fp32, as in the checkpoint)."""

    def __init__(self, channels: int, width: int):
        super().__init__()
        self.weight = _param(channels, 1, width, dtype=torch.float32)

    def forward(self, x: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor,
                staging: torch.Tensor | None) -> torch.Tensor:
        if staging is not None:                     # verify chain: stage, commit later
            return ops.kda_conv_staged(x, self.weight, conv_pool, slots, staging)
        return ops.kda_conv(x, self.weight, conv_pool, slots)


class KDA(nn.Module):
    """Kimi Delta Attention with the safe gate (architecture.md section 4)."""

    def __init__(self, c: LingConfig, dtype: torch.dtype):
        super().__init__()
        h, H, D, P = c.hidden_size, c.kda_heads, c.head_dim, c.kda_dim
        for name in ("q_proj", "k_proj", "v_proj", "f_proj", "g_proj"):
            setattr(self, name, Linear(h, P, dtype))
        self.b_proj = Linear(h, H, dtype)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (ShortConv(P, c.short_conv_kernel_size) for _ in range(3))
        self.A_log = _param(H, dtype=torch.float32)
        self.dt_bias = _param(P, dtype=torch.float32)
        self.o_norm = RMSNorm(D, c.rms_norm_eps, dtype)
        self.o_proj = Linear(P, h, dtype)
        self.heads, self.head_dim, self.lower_bound = H, D, float(c.kda_lower_bound)

    def forward(self, x: torch.Tensor, meta: StepMeta, state: dict[str, torch.Tensor]) -> torch.Tensor:
        B, T, _ = x.shape
        heads = (B, T, self.heads, self.head_dim)
        q = self.q_conv1d(self.q_proj(x), state["conv_q"], meta.slots, state.get("staging_conv_q")).view(heads)
        k = self.k_conv1d(self.k_proj(x), state["conv_k"], meta.slots, state.get("staging_conv_k")).view(heads)
        v = self.v_conv1d(self.v_proj(x), state["conv_v"], meta.slots, state.get("staging_conv_v")).view(heads)
        f = self.f_proj(x).view(heads)
        b = self.b_proj(x)                                                         # [B, T, H]
        args = (q, k, v, f, b, self.A_log, self.dt_bias, state["recurrent"], meta.slots)
        if "staging_recurrent" in state:              # verify chain: per-position states to staging
            o = ops.kda_recurrent_staged(*args, state["staging_recurrent"], self.lower_bound)
        else:                                         # chunked for prompts, token by token for decode
            o = (ops.kda_chunk if T > 16 else ops.kda_recurrent)(*args, self.lower_bound)
        o = ops.gated_rmsnorm(o, self.o_norm.weight, self.g_proj(x).view(heads), self.o_norm.eps)
        return self.o_proj(o.view(B, T, -1))


class MLA(nn.Module):
    """Gated multi-head latent attention over a compact latent cache (architecture.md section 5)."""

    def __init__(self, c: LingConfig, dtype: torch.dtype):
        super().__init__()
        h, H = c.hidden_size, c.num_attention_heads
        self.heads, self.nope, self.rope_dim, self.v_dim = H, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.kv_rank, self.theta, self.scale = c.kv_lora_rank, float(c.rope_theta), c.qk_head_dim ** -0.5
        if c.q_lora_rank is None:
            self.q_proj = Linear(h, H * c.qk_head_dim, dtype)
        else:
            self.q_a_proj = Linear(h, c.q_lora_rank, dtype)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, dtype)
            self.q_b_proj = Linear(c.q_lora_rank, H * c.qk_head_dim, dtype)
        self.query = self._q_single if c.q_lora_rank is None else self._q_lora
        self.kv_a_proj_with_mqa = Linear(h, c.mla_latent_dim, dtype)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps, dtype)
        self.kv_b_proj = Linear(c.kv_lora_rank, H * (c.qk_nope_head_dim + c.v_head_dim), dtype)
        self.g_proj = Linear(h, H, dtype)
        self.dense = Linear(H * c.v_head_dim, h, dtype)

    def _q_single(self, x: torch.Tensor) -> torch.Tensor:
        return self.q_proj(x)

    def _q_lora(self, x: torch.Tensor) -> torch.Tensor:
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(self, x: torch.Tensor, meta: StepMeta, state: dict[str, torch.Tensor]) -> torch.Tensor:
        B, T, _ = x.shape
        positions = meta.positions
        q = self.query(x).view(B, T, self.heads, -1)                             # [B, T, H, nope + rope]
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        q_rope = ops.rope(q_rope, positions, self.theta)
        c_kv, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope_dim], dim=-1)
        k_rope = ops.rope(k_rope.unsqueeze(2), positions, self.theta).squeeze(2)  # one k_rope per token
        latent = torch.cat([self.kv_a_layernorm(c_kv), k_rope], dim=-1)          # [B, T, 576]
        ops.mla_cache_write(state["kv_pages"], latent, meta.cache_locs)
        o = ops.mla_attention(q_nope, q_rope, state["kv_pages"], self.kv_b_proj.weight, meta.page_rows, positions,
                              self.scale)
        o = ops.sigmoid_gate(o, self.g_proj(x))                                    # [B, T, H, v]
        return self.dense(o.reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU MLP with gate and up rows stacked in one weight; limit > 0 clamps (Flash shared experts)."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, limit: float = 0.0):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * inter, dtype)
        self.down_proj = Linear(inter, hidden, dtype)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x), self.limit))


class Router(nn.Module):
    """The MoE gate: fp32 weight [E, h] and selection bias [E]."""

    def __init__(self, c: LingConfig):
        super().__init__()
        self.weight = _param(c.num_experts, c.hidden_size, dtype=torch.float32)
        self.expert_bias = _param(c.num_experts, dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, torch.float32)                           # [N, E] fp32 logits


class Experts(nn.Module):
    """Stacked routed-expert weights: w13 [E, 2I, h] ([gate; up] rows per expert), w2 [E, h, I]."""

    def __init__(self, c: LingConfig, dtype: torch.dtype):
        super().__init__()
        E, h, inter = c.num_experts, c.hidden_size, c.moe_intermediate_size
        self.w13 = _param(E, 2 * inter, h, dtype=dtype)
        self.w2 = _param(E, h, inter, dtype=dtype)


class MoE(nn.Module):
    """Grouped sigmoid router + routed experts (weights x 2.5) + one unscaled shared expert (section 6)."""

    def __init__(self, c: LingConfig, layer: int, dtype: torch.dtype):
        super().__init__()
        self.gate = Router(c)
        self.experts = Experts(c, dtype)
        shared_inter = c.moe_shared_expert_intermediate_size * c.num_shared_experts
        self.shared_experts = MLP(c.hidden_size, shared_inter, dtype, c.shared_limit(layer))
        self.limit = c.expert_limit(layer)
        self.routing = (c.n_group, c.topk_group, c.num_experts_per_tok, float(c.routed_scaling_factor))
        self.num_experts = c.num_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, h = x.shape
        x = x.view(B * T, h)                                                       # [N, h]
        weights, expert_ids = ops.router_topk(self.gate(x), self.gate.expert_bias, *self.routing)
        top_k = self.routing[2]
        sorted_pairs, block_expert, total = ops.moe_align(expert_ids, self.num_experts, MOE_BLOCK_M)
        up = ops.moe_up(x, self.experts.w13, sorted_pairs, block_expert, total, top_k, MOE_BLOCK_M)
        act = ops.silu_and_mul(up, self.limit)                                     # [N * k, I]
        down = ops.moe_down(act, self.experts.w2, sorted_pairs, block_expert, total, MOE_BLOCK_M)
        return ops.moe_combine(down, weights, self.shared_experts(x)).view(B, T, h)
