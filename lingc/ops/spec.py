"""Sampling and speculative-acceptance ops: a counter-based RNG, filtered distributions, token sampling, chain accept.

Everything is a fixed-shape device computation (no host reads, no generator state), so it can sit
inside a captured graph. Letters: B requests, K draft tokens of the chain (steps), V vocabulary.
Per-request sampling parameters are device tensors: temperature [B] (0 = greedy), top_k [B] (0 = off),
top_p [B] (1 = off). Randomness comes from `uniform(seed, counter)`: the same seed and counter give
the same numbers on every device.
"""

from __future__ import annotations

import torch

from lingc.ops.registry import register

_MASK64 = (1 << 64) - 1


def _u64(x: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits (torch has no uint64 arithmetic)."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _MIX1, _MIX2 = _u64(0x9E3779B97F4A7C15), _u64(0xBF58476D1CE4E5B9), _u64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser (Steele et al. 2014), in wrapping int64 arithmetic."""
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


@torch.library.custom_op("lingc::uniform", mutates_args=())
def uniform(seed: torch.Tensor, counter: torch.Tensor, n: int, offset: int = 0) -> torch.Tensor:
    """n uniform floats in [0, 1) per request: seed [B] int64, counter [B] int64 -> [B, n] fp32.

    Value i of request b hashes (seed[b], counter[b] + offset + i); advance the counter by n per call. (offset: a
    constant the caller would otherwise add to counter in a launch of its own.)
    """
    idx = counter.long().unsqueeze(-1) + offset + torch.arange(n, device=counter.device)   # [B, n]
    bits = _splitmix64(_splitmix64(seed.long().unsqueeze(-1)) ^ idx)
    return _shr(bits, 40).float() * (1.0 / (1 << 24))                                       # top 24 bits


@uniform.register_fake
def _(seed, counter, n, offset=0):
    return seed.new_empty((seed.shape[0], n), dtype=torch.float32)


register("uniform")


@torch.library.custom_op("lingc::filtered_probs", mutates_args=())
def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor, filters: int = 3) -> torch.Tensor:
    """The sampling distribution per position: softmax(logits / T) restricted to top-k, then top-p, renormalised.

    logits [B, T, V]; temperature, top_k, top_p [B]. Rows with temperature 0 become one-hot on the
    argmax (greedy), so acceptance and sampling treat greedy as the limit case. Returns fp32 [B, T, V].
    filters (a static bit mask, passes/specialize_sampling.py's copies): 1 top-k may be on, 2 top-p may be on; a
    filter whose bit is clear is off for every row (top_k taken as 0, top_p as 1), so its search is never run.
    With every row's filter already off the result is the default's, bit for bit.
    """
    if not filters & 1:
        top_k = torch.zeros_like(top_k)
    if not filters & 2:
        top_p = torch.ones_like(top_p)
    B, T, V = logits.shape
    x = logits.float()
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).float().view(B, 1, 1)
    x = x / temp
    sorted_x, order = x.sort(dim=-1, descending=True)                                      # [B, T, V]
    rank = torch.arange(V, device=x.device).view(1, 1, V)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V)).view(B, 1, 1)
    keep = (rank < k).expand(B, T, V).clone()
    probs_sorted = torch.softmax(sorted_x.masked_fill(~keep, -torch.inf), dim=-1)
    before = probs_sorted.cumsum(-1) - probs_sorted                                         # mass ahead of each token
    keep &= before < top_p.float().view(B, 1, 1)                                            # always keeps rank 0
    probs_sorted = probs_sorted.masked_fill(~keep, 0.0)
    probs_sorted = probs_sorted / probs_sorted.sum(-1, keepdim=True)
    probs = torch.zeros_like(probs_sorted).scatter_(-1, order, probs_sorted)
    one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy.view(B, 1, 1), one_hot, probs)


@filtered_probs.register_fake
def _(logits, temperature, top_k, top_p, filters=3):
    return logits.new_empty(logits.shape, dtype=torch.float32)


register("filtered_probs")


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token whose CDF interval holds u: probs [..., V], u [...] -> int64 [...]."""
    cdf = probs.cumsum(-1)
    idx = torch.searchsorted(cdf, (u * cdf[..., -1]).unsqueeze(-1).contiguous(), right=True).squeeze(-1)
    return idx.clamp(max=probs.shape[-1] - 1)


@torch.library.custom_op("lingc::sample_tokens", mutates_args=())
def sample_tokens(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per position from probs [B, T, V] with uniforms u [B, T] (inverse CDF). int64 [B, T]."""
    return _inverse_cdf(probs, u)


@sample_tokens.register_fake
def _(probs, u):
    return probs.new_empty(probs.shape[:-1], dtype=torch.int64)


register("sample_tokens")


@torch.library.custom_op("lingc::vocab_expand", mutates_args=())
def vocab_expand(probs: torch.Tensor, inverse_map: torch.Tensor) -> torch.Tensor:
    """A distribution over a token subset as one over the vocabulary: probs [..., N], inverse_map [V] int (the
    subset index of token v, -1 for tokens outside it) -> fp32 [..., V], probs[..., inverse_map[v]] where that is
    >= 0, else 0 (draft_vocab: the sampled draft's distribution, as verify's chain_accept reads it)."""
    inv = inverse_map.long()
    gathered = probs.float().index_select(-1, inv.clamp_min(0))
    return torch.where(inv >= 0, gathered, torch.zeros((), dtype=torch.float32, device=probs.device))


@vocab_expand.register_fake
def _(probs, inverse_map):
    return probs.new_empty((*probs.shape[:-1], inverse_map.shape[0]), dtype=torch.float32)


register("vocab_expand")


@torch.library.custom_op("lingc::chain_accept", mutates_args=())
def chain_accept(draft_ids: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                 target_logits: torch.Tensor, temperature: torch.Tensor,
                 u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify a topk=1 draft chain; returns (accept_len int32 [B], tokens int64 [B, K+1]).

    draft_ids [B, K] proposed after the root; draft_probs [B, K, V] the drafter's distributions;
    target_probs / target_logits [B, K+1, V] the target's at the root and each draft.
    u [B, K+1] uniforms. Draft i is accepted while u_i < min(1, p_t(d_i) / p_d(d_i)) (greedy: while
    it equals the target's argmax). At the first rejection the token is resampled from
    norm(max(0, p_t - p_d)); if all K pass, the bonus comes from p_t at the last position. Either
    stop token is drawn with u_K (only one is ever drawn, and u_K is independent of u_0..u_{K-1}).
    accept_len = accepted drafts + 1 = tokens emitted; tokens[:, :accept_len] are they.
    Lossless: the emitted tokens follow the target's distribution (Leviathan et al. 2023).
    """
    B, K = draft_ids.shape
    greedy = (temperature <= 0).view(B, 1)
    target_argmax = target_logits.argmax(-1)                                               # [B, K+1]
    ids = draft_ids.long().unsqueeze(-1)
    p_t = target_probs[:, :K].gather(-1, ids).squeeze(-1)
    p_d = draft_probs.gather(-1, ids).squeeze(-1).clamp_min(1e-20)
    ok_sampled = u[:, :K] * p_d < p_t                                                      # u < p_t / p_d
    ok = torch.where(greedy, draft_ids.long() == target_argmax[:, :K], ok_sampled)         # [B, K]
    accepted = ok.long().cumprod(-1).sum(-1)                                               # leading run, [B]
    # the token at the stop position: residual resample after a rejection, target sample after all K
    pos = accepted.view(B, 1, 1)
    p_stop = target_probs.gather(1, pos.expand(B, 1, target_probs.shape[-1])).squeeze(1)   # [B, V]
    d_pad = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)
    d_stop = d_pad.gather(1, pos.expand(B, 1, d_pad.shape[-1])).squeeze(1)
    residual = (p_stop - d_stop).clamp_min(0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_stop)
    # the stop token needs a uniform independent of the accept decisions (u_i for a rejection at i is
    # conditioned on u_i >= p_t / p_d, and would bias the residual draw): u[:, K] serves either case
    u_stop = u[:, K]
    stop_token = torch.where(greedy.view(B), target_argmax.gather(1, accepted.view(B, 1)).squeeze(1),
                             _inverse_cdf(residual, u_stop))
    tokens = torch.cat([draft_ids.long(), torch.zeros_like(draft_ids[:, :1]).long()], dim=1)   # [B, K+1]
    tokens = tokens.scatter(1, accepted.view(B, 1), stop_token.view(B, 1))
    return (accepted + 1).to(torch.int32), tokens


@chain_accept.register_fake
def _(draft_ids, draft_probs, target_probs, target_logits, temperature, u):
    B, K = draft_ids.shape
    return draft_ids.new_empty((B,), dtype=torch.int32), draft_ids.new_empty((B, K + 1), dtype=torch.int64)


register("chain_accept")


@torch.library.custom_op("lingc::greedy_accept", mutates_args=())
def greedy_accept(draft_ids: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """chain_accept for all-greedy requests (temperature 0), without distributions: (accept_len int32 [B],
    tokens int64 [B, K+1]) from draft_ids [B, K] and target_logits [B, K+1, V]. Draft i is accepted while it
    equals the target's argmax (lowest id on ties) at its position; the token at the stop position is the
    argmax there. The same values as chain_accept on rows with temperature <= 0 (specialize_greedy's rewrite)."""
    B, K = draft_ids.shape
    target_argmax = target_logits.argmax(-1)                                               # [B, K+1]
    ok = draft_ids.long() == target_argmax[:, :K]
    accepted = ok.long().cumprod(-1).sum(-1)                                               # leading run, [B]
    stop_token = target_argmax.gather(1, accepted.view(B, 1))
    tokens = torch.cat([draft_ids.long(), torch.zeros_like(draft_ids[:, :1]).long()], dim=1)   # [B, K+1]
    return (accepted + 1).to(torch.int32), tokens.scatter(1, accepted.view(B, 1), stop_token)


@greedy_accept.register_fake
def _(draft_ids, target_logits):
    B, K = draft_ids.shape
    return draft_ids.new_empty((B,), dtype=torch.int32), draft_ids.new_empty((B, K + 1), dtype=torch.int64)


register("greedy_accept")


@torch.library.custom_op("lingc::simulate_accept", mutates_args=())
def simulate_accept(accept_len: torch.Tensor, mean: torch.Tensor, u: torch.Tensor, max_accept: int) -> torch.Tensor:
    """Benchmark knob (SGLang's simulated acceptance): where mean[b] > 0, replace accept_len[b] by
    floor(mean) + (u < frac(mean)), clamped to [1, max_accept], so the average is `mean`. mean 0 = off."""
    base = mean.float().floor()
    sim = (base + (u.float() < mean.float() - base).float()).clamp(1, max_accept).to(accept_len.dtype)
    return torch.where(mean > 0, sim, accept_len)


@simulate_accept.register_fake
def _(accept_len, mean, u, max_accept):
    return accept_len.new_empty(accept_len.shape)


register("simulate_accept")


@torch.library.custom_op("lingc::greedy_accept_simulated", mutates_args=())
def greedy_accept_simulated(draft_ids: torch.Tensor, target_logits: torch.Tensor, mean: torch.Tensor,
                            seed: torch.Tensor, counter: torch.Tensor, offset: int,
                            max_accept: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy copies' verify tail in one op (fuse_simulate_accept): greedy_accept, then its accept_len through
    simulate_accept with the uniform at (seed, counter + offset), which nothing else reads. (accept_len, tokens)."""
    accept_len, tokens = greedy_accept(draft_ids, target_logits)
    u = uniform(seed, counter, 1, offset)[:, 0]
    return simulate_accept(accept_len, mean, u, max_accept), tokens


@greedy_accept_simulated.register_fake
def _(draft_ids, target_logits, mean, seed, counter, offset, max_accept):
    B, K = draft_ids.shape
    return draft_ids.new_empty((B,), dtype=torch.int32), draft_ids.new_empty((B, K + 1), dtype=torch.int64)


register("greedy_accept_simulated")


@torch.library.custom_op("lingc::chain_accept_simulated", mutates_args=())
def chain_accept_simulated(draft_ids: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                           target_logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor,
                           mean: torch.Tensor, u_sim: torch.Tensor,
                           max_accept: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The general verify tail in one op (fuse_simulate_accept): chain_accept, then its accept_len through
    simulate_accept(accept_len, mean, u_sim, max_accept). (accept_len, tokens)."""
    accept_len, tokens = chain_accept(draft_ids, draft_probs, target_probs, target_logits, temperature, u)
    return simulate_accept(accept_len, mean, u_sim, max_accept), tokens


@chain_accept_simulated.register_fake
def _(draft_ids, draft_probs, target_probs, target_logits, temperature, u, mean, u_sim, max_accept):
    B, K = draft_ids.shape
    return draft_ids.new_empty((B,), dtype=torch.int32), draft_ids.new_empty((B, K + 1), dtype=torch.int64)


register("chain_accept_simulated")
