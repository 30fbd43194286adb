"""Gated-MLA ops: interleaved RoPE, the compact latent cache write, attention over that cache, and fused forms.

Letters: B batch, T new tokens, NP pages of PS rows, MP pages per request, H heads, R = kv_lora_rank (512),
Rr = rope dim (64),
L = R + Rr latent values cached per token (576), N nope dim (128), Vd value dim (128).
The cache row of a token is [rmsnorm(c_kv) (R) | rope(k_rope) (Rr)]. Attention expands K/V from the
latent with kv_b_proj in the reference; kernels may absorb it instead.
(shared/docs/architecture.md section 5.)

fuse_mla's forms are defined as the compositions they replace, so the reference backend gives the same bits:
`mla_prep` = rope(q_pe) + [rmsnorm(c_kv) | rope(k_pe)] written by mla_cache_write; `mla_attention(..., gate)` =
sigmoid_gate(mla_attention(...), gate).
"""

from __future__ import annotations

from typing import Optional

import torch

from lingc.ops.norm import rmsnorm, sigmoid_gate
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


@torch.library.custom_op("lingc::mla_cache_write", mutates_args=("kv_pages",))
def mla_cache_write(kv_pages: torch.Tensor, latent: torch.Tensor, cache_locs: torch.Tensor) -> None:
    """Write each new token's latent row into the paged cache: kv_pages [NP, PS, L] seen flat as
    [NP * PS, L]; latent [B, T, L]; cache_locs [B, T] int64 flat row of each token (lingc.cache_locs)."""
    flat = kv_pages.view(-1, kv_pages.shape[-1])
    flat[cache_locs.reshape(-1).long()] = latent.reshape(-1, latent.shape[-1]).to(kv_pages.dtype)


@mla_cache_write.register_fake
def _(kv_pages, latent, cache_locs):
    return None


register("mla_cache_write")


def _attend_one(q_nope, q_rope, c_kv, k_rope, kv_b, pos, scale, H, N, Vd):
    """One request, T queries over its S cache rows, all fp32: [T, H, Vd]."""
    kv = (c_kv @ kv_b.T).view(-1, H, N + Vd)                                          # [S, H, N+Vd]
    k_nope, v = kv[..., :N], kv[..., N:]
    scores = torch.einsum("thn,shn->hts", q_nope, k_nope) + torch.einsum("thr,sr->hts", q_rope, k_rope)
    visible = torch.arange(c_kv.shape[0], device=c_kv.device).view(1, 1, -1) <= pos.view(1, -1, 1)
    probs = torch.softmax((scores * scale).masked_fill(~visible, -torch.inf), dim=-1)
    return torch.einsum("hts,shv->thv", probs, v)


@torch.library.custom_op("lingc::mla_attention", mutates_args=())
def mla_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_pages: torch.Tensor, kv_b_weight: torch.Tensor,
                  page_rows: torch.Tensor, positions: torch.Tensor, scale: float,
                  gate: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of new queries over each request's paged latent cache.

    q_nope [B, T, H, N], q_rope [B, T, H, Rr] (already rotated), kv_pages [NP, PS, R + Rr],
    kv_b_weight [H * (N + Vd), R] (per head: k_nope rows then v rows), page_rows [B, MP] the pages of
    each request in order, positions [B, T]. Logical slot j (page j // PS) is visible to query t iff
    j <= positions[b, t]. Returns [B, T, H, Vd]; scores, softmax and the value sum are fp32. Short
    chains (T <= 16) attend one query at a time, so a verify position computes exactly what a decode
    step computes. gate [B, T, H] (fuse_mla), if given: the output goes through sigmoid_gate(out, gate).
    """
    B, T, H, N = q_nope.shape
    R = kv_b_weight.shape[1]
    Vd = kv_b_weight.shape[0] // H - N
    kv_b = kv_b_weight.float()
    out = q_nope.new_empty((B, T, H, Vd), dtype=torch.float32)
    for b in range(B):
        latent = kv_pages[page_rows[b].long()].reshape(-1, kv_pages.shape[-1]).float()   # [MP * PS, L]
        c_kv, k_rope = latent[:, :R], latent[:, R:]
        qn, qr = q_nope[b].float(), q_rope[b].float()
        steps = [slice(t, t + 1) for t in range(T)] if T <= 16 else [slice(0, T)]
        for sl in steps:
            out[b, sl] = _attend_one(qn[sl], qr[sl], c_kv, k_rope, kv_b, positions[b, sl], scale, H, N, Vd)
    out = out.to(q_nope.dtype)
    return out if gate is None else sigmoid_gate(out, gate)


@mla_attention.register_fake
def _(q_nope, q_rope, kv_pages, kv_b_weight, page_rows, positions, scale, gate=None):
    B, T, H, N = q_nope.shape
    Vd = kv_b_weight.shape[0] // H - N
    return q_nope.new_empty((B, T, H, Vd))


register("mla_attention")


@torch.library.custom_op("lingc::mla_prep", mutates_args=("kv_pages",))
def mla_prep(q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor, kv_norm_weight: torch.Tensor,
             kv_pages: torch.Tensor, cache_locs: torch.Tensor, positions: torch.Tensor, theta: float,
             eps: float) -> torch.Tensor:
    """An MLA layer's work between its projections and its attention, in one op (fuse_mla): returns q_rope.

    q_pe [B, T, H, Rr] (the query's rope part), c_kv [B, T, R] and k_pe [B, T, Rr] (kv_a_proj's two parts),
    kv_norm_weight [R] (kv_a_layernorm), kv_pages [NP, PS, R + Rr], cache_locs [B, T], positions [B, T].
    Exactly the ops it replaces: q_rope = rope(q_pe); the row [rmsnorm(c_kv) | rope(k_pe)] goes to each token's
    cache row as mla_cache_write writes it.
    """
    q_rope = rope(q_pe, positions, theta)
    k_rope = rope(k_pe.unsqueeze(2), positions, theta).squeeze(2)                       # one k_rope per token
    mla_cache_write(kv_pages, torch.cat([rmsnorm(c_kv, kv_norm_weight, eps), k_rope], dim=-1), cache_locs)
    return q_rope


@mla_prep.register_fake
def _(q_pe, c_kv, k_pe, kv_norm_weight, kv_pages, cache_locs, positions, theta, eps):
    return q_pe.new_empty(q_pe.shape)


register("mla_prep")
