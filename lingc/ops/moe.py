"""MoE ops: sigmoid router, moe_align, both fused (router_align), expert up/down GEMMs, SwiGLU (+clamp), combine.

Letters: N tokens, E experts, k experts per token, NP = N * k (token, expert) pairs, h hidden,
I expert intermediate size, BM the GEMM block (rows of one expert per block).
Expert weights are stacked: w13 [E, 2I, h] (gate rows then up rows, or interleaved gate/up pairs after
`fuse_swiglu`), w2 [E, h, I]. (shared/docs/architecture.md section 6; techniques.md sections 6-7.)

Shared-expert fusion (`fuse_shared_expert`): the routers' trailing `fused_shared` S (default 0) appends S
pairs to each token's k picks, experts E .. E+S-1 with weight exactly 1.0 (the shared expert is added
unscaled), so the shared expert runs through the grouped GEMMs as one more expert (w13 / w2 [E+S, ...]) and
moe_combine sums it with the routed pairs (no shared_out). Programs without it are unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lingc.ops.linear import ROW_INVARIANT_ROWS
from lingc.ops.registry import register


@torch.library.custom_op("lingc::router_topk", mutates_args=())
def router_topk(logits: torch.Tensor, expert_bias: torch.Tensor, n_group: int, topk_group: int, top_k: int,
                routed_scaling_factor: float, fused_shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid group-limited top-k. logits [N, E] fp32 -> (weights [N, k+S] fp32, expert ids [N, k+S] int32).

    The bias picks experts only; weights are the unbiased scores, renormalised (+1e-20) and scaled.
    A group's score is the sum of its two best biased scores; the topk_group best groups stay eligible.
    S = fused_shared columns follow the k picks: ids E, ..., E+S-1, weight 1.0 (shared experts, unscaled).
    """
    N, E = logits.shape
    # CPU sigmoid is vectorised only from 64 elements on, and its bits differ from the scalar path: with
    # few experts (test-tiny: 16) one decode row would be scalar and a verify chain vectorised, so
    # decode-sized calls go row by row (a verify row then gets decode's bits, as in lingc.linear)
    x = logits.float()
    scores = torch.cat([torch.sigmoid(x[i:i + 1]) for i in range(N)]) if N <= ROW_INVARIANT_ROWS else torch.sigmoid(x)
    biased = scores + expert_bias.float()
    group_scores = biased.view(N, n_group, -1).topk(2, dim=-1).values.sum(-1)           # [N, n_group]
    group_idx = group_scores.topk(topk_group, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
    expert_mask = group_mask.unsqueeze(-1).expand(N, n_group, E // n_group).reshape(N, E)
    masked = biased.masked_fill(expert_mask == 0, float("-inf"))
    ids = masked.topk(top_k, dim=-1, sorted=False).indices                              # [N, k]
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * routed_scaling_factor
    return _append_shared(weights, ids.to(torch.int32), E, fused_shared)


def _append_shared(weights: torch.Tensor, ids: torch.Tensor, num_experts: int,
                   fused_shared: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k picks followed by S = fused_shared pairs per row: ids E .. E+S-1, weight 1.0."""
    if fused_shared == 0:
        return weights, ids
    N = ids.shape[0]
    shared_ids = torch.arange(num_experts, num_experts + fused_shared, dtype=torch.int32, device=ids.device)
    return (torch.cat([weights, weights.new_ones((N, fused_shared))], 1),
            torch.cat([ids, shared_ids.expand(N, fused_shared)], 1))


@router_topk.register_fake
def _(logits, expert_bias, n_group, topk_group, top_k, routed_scaling_factor, fused_shared=0):
    shape = (logits.shape[0], top_k + fused_shared)
    return logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.int32)


register("router_topk")


def align_sizes(num_pairs: int, num_experts: int, block_m: int) -> tuple[int, int]:
    """(max padded rows, blocks) of moe_align's outputs for NP pairs."""
    max_padded = num_pairs + num_experts * (block_m - 1)
    return max_padded, -(-max_padded // block_m)


@torch.library.custom_op("lingc::moe_align", mutates_args=())
def moe_align(expert_ids: torch.Tensor, num_experts: int,
              block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the NP pairs by expert in blocks of BM rows.

    Returns sorted_pairs int32 [NP + E*(BM-1)] (pair indices by expert, stable, each expert padded to a
    multiple of BM with the sentinel NP; the tail past the total is NP too), block_expert int32
    [blocks] (the expert of each block, -1 past the total) and total int32 [1] (padded rows in use).
    """
    flat = expert_ids.reshape(-1).long()
    num_pairs = flat.numel()
    dev = flat.device
    max_padded, blocks = align_sizes(num_pairs, num_experts, block_m)
    # no host reads (bincount and repeat_interleave would size their outputs from device values), so the
    # op can run inside a CUDA graph: counts by scatter_add, each block's expert by a search in the ends
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.sort(flat, stable=True).indices                                      # pairs by expert
    rank = torch.arange(num_pairs, device=dev) - (torch.cumsum(counts, 0) - counts)[flat[order]]
    sorted_pairs = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=dev)
    sorted_pairs[starts[flat[order]] + rank] = order.to(torch.int32)
    block_start = torch.arange(blocks, device=dev) * block_m
    block_expert = torch.searchsorted(ends, block_start, right=True)
    block_expert = torch.where(block_start < ends[-1], block_expert, -1).to(torch.int32)
    total = padded.sum().view(1).to(torch.int32)
    return sorted_pairs, block_expert, total


@moe_align.register_fake
def _(expert_ids, num_experts, block_m):
    max_padded, blocks = align_sizes(expert_ids.numel(), num_experts, block_m)
    new = lambda n: expert_ids.new_empty((n,), dtype=torch.int32)  # noqa: E731
    return new(max_padded), new(blocks), new(1)


register("moe_align")


@torch.library.custom_op("lingc::router_align", mutates_args=())
def router_align(logits: torch.Tensor, expert_bias: torch.Tensor, n_group: int, topk_group: int, top_k: int,
                 routed_scaling_factor: float, num_experts: int, block_m: int, fused_shared: int = 0,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """router_topk then moe_align of its expert ids in one op (fuse_moe_align).

    logits [N, E] fp32 -> (weights f32 [N, k+S], ids i32 [N, k+S], sorted_pairs i32 [NP + E'*(BM-1)],
    block_expert i32 [blocks], total i32 [1]); each output is exactly what the two ops return.
    num_experts E' counts the aligned experts: E + S (S = fused_shared, the appended shared experts).
    """
    weights, ids = router_topk(logits, expert_bias, n_group, topk_group, top_k, routed_scaling_factor, fused_shared)
    sorted_pairs, block_expert, total = moe_align(ids, num_experts, block_m)
    return weights, ids, sorted_pairs, block_expert, total


@router_align.register_fake
def _(logits, expert_bias, n_group, topk_group, top_k, routed_scaling_factor, num_experts, block_m, fused_shared=0):
    N, width = logits.shape[0], top_k + fused_shared
    max_padded, blocks = align_sizes(N * width, num_experts, block_m)
    new = lambda shape, dtype: logits.new_empty(shape, dtype=dtype)  # noqa: E731
    return (new((N, width), torch.float32), new((N, width), torch.int32), new((max_padded,), torch.int32),
            new((blocks,), torch.int32), new((1,), torch.int32))


register("router_align")


def pair_experts(sorted_pairs: torch.Tensor, block_expert: torch.Tensor, total: torch.Tensor,
                 num_pairs: int, block_m: int) -> torch.Tensor:
    """Expert of each pair [NP], recovered from moe_align's outputs (what a GEMM block would read)."""
    rows = torch.arange(sorted_pairs.numel(), device=sorted_pairs.device)
    valid = (sorted_pairs < num_pairs) & (rows < total.long())
    # invalid rows all land in a spare last slot (no boolean indexing: it would read a count on the host)
    dest = torch.where(valid, sorted_pairs.long(), num_pairs)
    out = torch.zeros(num_pairs + 1, dtype=torch.long, device=sorted_pairs.device)
    out.scatter_(0, dest, block_expert[rows // block_m].long())
    return out[:num_pairs]


def _grouped_gemm(x_rows: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """out[p] = x_rows[p] @ weights[experts[p]].T. x_rows [NP, K], weights [E, N, K].

    CPU, decode-sized calls (NP <= 64) go pair by pair, so every pair's bits are independent of how many
    pairs share its expert (verify must match decode); larger CPU calls do one matmul per expert present.
    Those loops read expert ids on the host; on CUDA the op instead stays free of host reads (so the
    reference model can be captured, e.g. by torch.compile): a gather of each pair's expert weights and a
    batched GEMM for small calls, every expert on every row and a gather for large ones. (lingc's own GPU
    path runs the Triton grouped GEMMs of lingc.kernels.moe instead.)
    """
    if x_rows.is_cuda:
        if x_rows.shape[0] <= 64:
            return torch.bmm(weights[experts], x_rows.unsqueeze(-1)).squeeze(-1)
        E, N, _ = weights.shape
        every = (x_rows @ weights.reshape(E * N, -1).T).view(-1, E, N)                   # [NP, E, N]
        return every.gather(1, experts.view(-1, 1, 1).expand(-1, 1, N)).squeeze(1)
    out = x_rows.new_empty((x_rows.shape[0], weights.shape[1]))
    if x_rows.shape[0] <= 64:
        for p, e in enumerate(experts.tolist()):
            out[p:p + 1] = F.linear(x_rows[p:p + 1], weights[e])
        return out
    for e in torch.unique(experts).tolist():
        sel = (experts == e).nonzero().squeeze(-1)
        out[sel] = F.linear(x_rows[sel], weights[e])
    return out


@torch.library.custom_op("lingc::moe_up", mutates_args=())
def moe_up(x: torch.Tensor, w13: torch.Tensor, sorted_pairs: torch.Tensor, block_expert: torch.Tensor,
           total: torch.Tensor, top_k: int, block_m: int) -> torch.Tensor:
    """Up-GEMM of every pair: x [N, h], w13 [E, 2I, h] -> [NP, 2I] in x.dtype (row p reads token p // k)."""
    num_pairs = x.shape[0] * top_k
    experts = pair_experts(sorted_pairs, block_expert, total, num_pairs, block_m)
    tokens = torch.arange(num_pairs, device=x.device) // top_k
    return _grouped_gemm(x[tokens], w13, experts)


@moe_up.register_fake
def _(x, w13, sorted_pairs, block_expert, total, top_k, block_m):
    return x.new_empty((x.shape[0] * top_k, w13.shape[1]))


register("moe_up")


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, out_dtype: torch.dtype) -> torch.Tensor:
    """silu(gate) * up in fp32 (clamped when limit > 0: min(silu(g), L) * clamp(u, -L, L)), rounded once."""
    # dense copies: torch's CPU kernels pick vectorised or scalar paths by layout, and the bits differ
    act = F.silu(gate.float().contiguous())
    upf = up.float().contiguous()
    if limit > 0:
        act = act.clamp(max=limit)
        upf = upf.clamp(-limit, limit)
    return (act * upf).to(out_dtype)


@torch.library.custom_op("lingc::silu_and_mul", mutates_args=())
def silu_and_mul(h: torch.Tensor, limit: float) -> torch.Tensor:
    """SwiGLU on concatenated [gate | up] rows: h [..., 2I] -> [..., I]; limit 0 means no clamp."""
    inter = h.shape[-1] // 2
    return swiglu(h[..., :inter], h[..., inter:], limit, h.dtype)


@silu_and_mul.register_fake
def _(h, limit):
    return h.new_empty((*h.shape[:-1], h.shape[-1] // 2))


register("silu_and_mul")


@torch.library.custom_op("lingc::moe_up_act", mutates_args=())
def moe_up_act(x: torch.Tensor, w13_interleaved: torch.Tensor, sorted_pairs: torch.Tensor,
               block_expert: torch.Tensor, total: torch.Tensor, top_k: int, block_m: int,
               limit: float) -> torch.Tensor:
    """moe_up + silu_and_mul in one op on gate/up-interleaved w13 (row 2j = gate_j, 2j+1 = up_j): [NP, I].

    Each output column is an independent dot product, so the interleave leaves every value's bits as
    they were; the activation then reads even columns as gate and odd columns as up.
    """
    h = moe_up(x, w13_interleaved, sorted_pairs, block_expert, total, top_k, block_m)   # [NP, 2I] interleaved
    return swiglu(h[:, 0::2], h[:, 1::2], limit, h.dtype)


@moe_up_act.register_fake
def _(x, w13_interleaved, sorted_pairs, block_expert, total, top_k, block_m, limit):
    return x.new_empty((x.shape[0] * top_k, w13_interleaved.shape[1] // 2))


register("moe_up_act")


@torch.library.custom_op("lingc::moe_down", mutates_args=())
def moe_down(act: torch.Tensor, w2: torch.Tensor, sorted_pairs: torch.Tensor, block_expert: torch.Tensor,
             total: torch.Tensor, block_m: int) -> torch.Tensor:
    """Down-GEMM of every pair, unweighted: act [NP, I], w2 [E, h, I] -> [NP, h] in act.dtype."""
    experts = pair_experts(sorted_pairs, block_expert, total, act.shape[0], block_m)
    return _grouped_gemm(act, w2, experts)


@moe_down.register_fake
def _(act, w2, sorted_pairs, block_expert, total, block_m):
    return act.new_empty((act.shape[0], w2.shape[1]))


register("moe_down")


# The pair-grid kernels (lingc.kernels.moe, BY_IDS) give each token a row slot of a 16-row MMA tile and read a
# token's picks as one row of a [16, pairs per token] tile: at most PAIR_GRID_TOKENS tokens and PAIR_GRID_PICKS pairs a
# token. Past them the launchers align the ids themselves, and fuse_align_into_moe leaves such layers aligned.
PAIR_GRID_TOKENS = 16
PAIR_GRID_PICKS = 32
# The routed kernels (lingc.kernels.moe_routed: one token, the router inside the GEMMs) rank every routed expert in
# every program: up to this many; fuse_router_into_moe leaves larger routers (Ling-3.0-flash's 512) alone
ROUTED_MAX_EXPERTS = 256


@torch.library.custom_op("lingc::moe_up_act_pairs", mutates_args=())
def moe_up_act_pairs(x: torch.Tensor, w13_interleaved: torch.Tensor, topk_ids: torch.Tensor,
                     limit: float) -> torch.Tensor:
    """moe_up_act with the pairs taken from the router's ids, no align: x [N, h], topk_ids [N, k] int32 -> [NP, I].

    Pair p = n * k + j is token n with expert topk_ids[n, j] (row p of the output, as moe_up_act's). Same values
    as moe_up_act over moe_align(topk_ids): the align only groups the pairs for the kernels (fuse_align_into_moe).
    """
    n, k = topk_ids.shape
    tokens = torch.arange(n * k, device=x.device) // k
    h = _grouped_gemm(x[tokens], w13_interleaved, topk_ids.reshape(-1).long())      # [NP, 2I] interleaved
    return swiglu(h[:, 0::2], h[:, 1::2], limit, h.dtype)


@moe_up_act_pairs.register_fake
def _(x, w13_interleaved, topk_ids, limit):
    return x.new_empty((topk_ids.numel(), w13_interleaved.shape[1] // 2))


register("moe_up_act_pairs")


@torch.library.custom_op("lingc::moe_down_pairs", mutates_args=())
def moe_down_pairs(act: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """moe_down with the pairs taken from the router's ids: act [NP, I], topk_ids [N, k] -> [NP, h] (row p: expert
    topk_ids.flatten()[p])."""
    return _grouped_gemm(act, w2, topk_ids.reshape(-1).long())


@moe_down_pairs.register_fake
def _(act, w2, topk_ids):
    return act.new_empty((act.shape[0], w2.shape[1]))


register("moe_down_pairs")


@torch.library.custom_op("lingc::moe_up_act_routed", mutates_args=())
def moe_up_act_routed(x: torch.Tensor, w13_interleaved: torch.Tensor, logits: torch.Tensor,
                      expert_bias: torch.Tensor, n_group: int, topk_group: int, top_k: int,
                      routed_scaling_factor: float, fused_shared: int, limit: float) -> torch.Tensor:
    """moe_up_act_pairs over router_topk's ids, the router inside the GEMM (fuse_router_into_moe, one token):
    x [N, h], logits [N, E] -> [N*(k+S), I]. The same values as router_topk then moe_up_act_pairs."""
    _, ids = router_topk(logits, expert_bias, n_group, topk_group, top_k, routed_scaling_factor, fused_shared)
    return moe_up_act_pairs(x, w13_interleaved, ids, limit)


@moe_up_act_routed.register_fake
def _(x, w13_interleaved, logits, expert_bias, n_group, topk_group, top_k, routed_scaling_factor, fused_shared,
      limit):
    return x.new_empty((x.shape[0] * (top_k + fused_shared), w13_interleaved.shape[1] // 2))


register("moe_up_act_routed")


@torch.library.custom_op("lingc::moe_down_routed", mutates_args=())
def moe_down_routed(act: torch.Tensor, w2: torch.Tensor, logits: torch.Tensor, expert_bias: torch.Tensor,
                    n_group: int, topk_group: int, top_k: int, routed_scaling_factor: float,
                    fused_shared: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(moe_down_pairs(act, w2, ids), weights) of router_topk(logits, ...), the router inside the GEMM
    (fuse_router_into_moe): act [N*(k+S), I] -> ([N*(k+S), h], [N, k+S] fp32), the combine's weights."""
    weights, ids = router_topk(logits, expert_bias, n_group, topk_group, top_k, routed_scaling_factor, fused_shared)
    return moe_down_pairs(act, w2, ids), weights


@moe_down_routed.register_fake
def _(act, w2, logits, expert_bias, n_group, topk_group, top_k, routed_scaling_factor, fused_shared):
    return (act.new_empty((act.shape[0], w2.shape[1])),
            logits.new_empty((logits.shape[0], top_k + fused_shared), dtype=torch.float32))


register("moe_down_routed")


@torch.library.custom_op("lingc::moe_combine", mutates_args=())
def moe_combine(expert_out: torch.Tensor, topk_weights: torch.Tensor,
                shared_out: torch.Tensor | None = None) -> torch.Tensor:
    """sum_k w[n, k] * expert_out[n*k + j] in fp32, cast to the activation dtype, plus the (unscaled) shared expert.

    expert_out [NP, h], topk_weights [N, k] fp32, shared_out [N, h] -> [N, h]. Without shared_out (after
    fuse_shared_expert the shared expert is pair k-1 of each token, weight 1.0) the sum is cast and returned.
    """
    N, k = topk_weights.shape
    routed = (expert_out.view(N, k, -1).float() * topk_weights.float().unsqueeze(-1)).sum(1)
    if shared_out is None:
        return routed.to(expert_out.dtype)
    return routed.to(shared_out.dtype) + shared_out


@moe_combine.register_fake
def _(expert_out, topk_weights, shared_out=None):
    return expert_out.new_empty((topk_weights.shape[0], expert_out.shape[1]))


register("moe_combine")


@torch.library.custom_op("lingc::combine_add_rmsnorm", mutates_args=())
def combine_add_rmsnorm(residual: torch.Tensor, expert_out: torch.Tensor, topk_weights: torch.Tensor,
                        weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A MoE layer's combine (no shared_out) and the next residual add + RMSNorm as one op (fuse_combine_norm):
    add_rmsnorm(residual, moe_combine(expert_out, topk_weights) viewed as residual) -> (normed, new_residual).
    residual [..., h] with N rows, expert_out [N*k, h], topk_weights [N, k] fp32, weight [h]."""
    from lingc.ops.norm import add_rmsnorm
    x = moe_combine(expert_out, topk_weights).view(residual.shape)
    return add_rmsnorm(residual, x, weight, eps)


@combine_add_rmsnorm.register_fake
def _(residual, expert_out, topk_weights, weight, eps):
    return residual.new_empty(residual.shape), residual.new_empty(residual.shape)


register("combine_add_rmsnorm")


@torch.library.custom_op("lingc::moe_fused", mutates_args=())
def moe_fused(x: torch.Tensor, w13_interleaved: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              sorted_pairs: torch.Tensor, block_expert: torch.Tensor, total: torch.Tensor, top_k: int, block_m: int,
              limit: float, shared_out: torch.Tensor | None = None) -> torch.Tensor:
    """The routed MoE of a layer as one op: moe_combine(moe_down(moe_up_act(...)), topk_weights, shared_out).

    x [N, h], w13_interleaved [E, 2I, h], w2 [E, h, I], topk_weights [N, k] fp32, the align outputs -> [N, h].
    Exactly the composite (fuse_moe builds it from the three ops; kernels/moe_fused.py runs them in one launch).
    """
    act = moe_up_act(x, w13_interleaved, sorted_pairs, block_expert, total, top_k, block_m, limit)
    return moe_combine(moe_down(act, w2, sorted_pairs, block_expert, total, block_m), topk_weights, shared_out)


@moe_fused.register_fake
def _(x, w13_interleaved, w2, topk_weights, sorted_pairs, block_expert, total, top_k, block_m, limit,
      shared_out=None):
    return x.new_empty((topk_weights.shape[0], w2.shape[1]))


register("moe_fused")
