"""Gated-MLA ops: interleaved RoPE, the compact latent cache write, and attention over that cache.

Letters: B batch, T new tokens, S cache slots, H heads, R = kv_lora_rank (512), Rr = rope dim (64),
L = R + Rr latent values cached per token (576), N nope dim (128), Vd value dim (128).
The cache row of a token is [rmsnorm(c_kv) (R) | rope(k_rope) (Rr)]. Attention expands K/V from the
latent with kv_b_proj in the reference; kernels may absorb it instead.
(shared/docs/architecture.md section 5.)
"""

from __future__ import annotations

import torch

from lingc.ops.registry import register


def rope_inv_freq(dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """inv_freq[i] = theta^(-2i/dim), i < dim/2, fp32."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))


@torch.library.custom_op("lingc::rope", mutates_args=())
def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Interleaved-pair RoPE on x [B, T, n, Rr] at positions [B, T]; output in de-interleaved order.

    Pair (x_2i, x_2i+1) turns by positions * theta^(-2i/Rr); the result is
    [x_e cos - x_o sin | x_o cos + x_e sin] (HF / TF523 layout). fp32 inside.
    """
    dim = x.shape[-1]
    angles = positions.float().unsqueeze(-1) * rope_inv_freq(dim, theta, x.device)   # [B, T, Rr/2]
    cos, sin = angles.cos().unsqueeze(-2), angles.sin().unsqueeze(-2)                # [B, T, 1, Rr/2]
    xf = x.float()
    xe, xo = xf[..., 0::2], xf[..., 1::2]
    return torch.cat([xe * cos - xo * sin, xo * cos + xe * sin], dim=-1).to(x.dtype)


@rope.register_fake
def _(x, positions, theta):
    return x.new_empty(x.shape)


register("rope")


@torch.library.custom_op("lingc::mla_cache_write", mutates_args=("kv_cache",))
def mla_cache_write(kv_cache: torch.Tensor, latent: torch.Tensor, positions: torch.Tensor) -> None:
    """kv_cache[b, positions[b, t]] = latent[b, t]; kv_cache [B, S, L], latent [B, T, L], positions [B, T]."""
    B, T, L = latent.shape
    index = positions.long().unsqueeze(-1).expand(B, T, L)
    kv_cache.scatter_(1, index, latent.to(kv_cache.dtype))


@mla_cache_write.register_fake
def _(kv_cache, latent, positions):
    return None


register("mla_cache_write")


@torch.library.custom_op("lingc::mla_attention", mutates_args=())
def mla_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, kv_b_weight: torch.Tensor,
                  positions: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of new queries over the latent cache; key slot j is visible to query t iff j <= positions[b, t].

    q_nope [B, T, H, N], q_rope [B, T, H, Rr] (already rotated), kv_cache [B, S, R + Rr],
    kv_b_weight [H * (N + Vd), R] (per head: k_nope rows then v rows). Returns [B, T, H, Vd].
    Scores, softmax and the value sum are fp32.
    """
    B, T, H, N = q_nope.shape
    R = kv_b_weight.shape[1]
    Vd = kv_b_weight.shape[0] // H - N
    latent = kv_cache.float()
    c_kv, k_rope = latent[..., :R], latent[..., R:]                                   # [B, S, R], [B, S, Rr]
    kv = (c_kv @ kv_b_weight.float().T).view(B, -1, H, N + Vd)                        # [B, S, H, N+Vd]
    k_nope, v = kv[..., :N], kv[..., N:]
    scores = torch.einsum("bthn,bshn->bhts", q_nope.float(), k_nope)
    scores = scores + torch.einsum("bthr,bsr->bhts", q_rope.float(), k_rope)
    slots = torch.arange(kv_cache.shape[1], device=kv_cache.device)
    visible = slots.view(1, 1, 1, -1) <= positions.view(B, 1, T, 1)                  # [B, 1, T, S]
    probs = torch.softmax((scores * scale).masked_fill(~visible, -torch.inf), dim=-1)
    out = torch.einsum("bhts,bshv->bthv", probs, v)
    return out.to(q_nope.dtype).contiguous()


@mla_attention.register_fake
def _(q_nope, q_rope, kv_cache, kv_b_weight, positions, scale):
    B, T, H, N = q_nope.shape
    Vd = kv_b_weight.shape[0] // H - N
    return q_nope.new_empty((B, T, H, Vd))


register("mla_attention")
