"""Grouped sigmoid router (top-k experts per token) and the router fused with moe_align, launchers and references.

`router_topk` matches `torch.ops.lingc.router_topk` (lingc/ops/moe.py). Per token row of E fp32 logits:
    score   = sigmoid(logit)                            (fp32)
    biased  = score + expert_bias                       (selection only)
    group   = sum of the 2 best biased scores in each of n_group groups of E / n_group experts
    keep the topk_group best groups, then the top_k best biased experts among them
    weight  = score / (sum of the k selected scores + 1e-20) * routed_scaling_factor
With fused_shared = S > 0 (fuse_shared_expert) each row's k picks are followed by S pairs: ids E .. E+S-1 with
weight exactly 1.0, set after the renormalisation (so the routed weights keep their bits); the row has k + S pairs.
Output order (the reference's is unspecified): descending biased score, ties to the lower expert id; group ties
go to the lower group id. The k selected scores are summed one by one in that order, and every other step is
elementwise or an exact max/min, so a row's bits do not depend on the tile layout, on num_warps or on the
other rows: `router_topk` and `router_align` give the same bits for a row.

`router_align` = router_topk then moe_align (`torch.ops.lingc.moe_align`; kernels/moe_align.py documents the
pair-axis algorithm) in ONE launch when N * (top_k + S) <= MAX_PAIRS: a single program routes the N rows side by
side, stores weights and ids, and (after one CTA barrier so every thread sees the stored ids) aligns the pairs in
registers (pairwise ranks, bucket counts and offsets in [NP_BLOCK, NP_BLOCK] tiles). It writes every output cell
itself, with disjoint stores (no torch pre-fill): pair slots, the padding of each expert's last block (sentinel
NP), the tail past the total (NP), the owned blocks' experts and -1 past the total. Larger calls run the
router_topk kernel, then lingc.kernels.moe_align.

Tiles: rows are routed in a [R_BLOCK, G_BLOCK, GS_BLOCK] tile (rows x groups x experts of a group, padded to
powers of two; router_topk has one row per program). A candidate is an int64 key (order-preserving bits of the
fp32 biased score, then NO_ID - id), so each of the k picks is ONE max reduction that yields both the best score
and its lowest id; the pick's unbiased score is the same sigmoid of the same logit, reloaded as a scalar.

Bytes per row: reads E logits (4 B) + E bias (4 B, shared, L2-resident), writes 8k B (weights, ids);
router_align also writes (NP + E*(BM-1)) * 4 B of sorted_pairs and 4 B per block of block_expert.

PDL placement (shared/docs/kernels.md section 1.5): with the constexpr PDL on, the expert bias (a weight no
earlier kernel writes) is loaded before `gdc_wait()`, the logits after it, and `gdc_launch_dependents()` follows
the last logits load. With PDL off no GDC call is emitted.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lingc.kernels.moe_align import moe_align
from lingc.kernels.pdl import pdl_supported
import lingc.ops  # noqa: F401  (registers torch.ops.lingc.*, used by the references)
from lingc.ops.moe import align_sizes

# Tunables. None changes the arithmetic (every reduction is an exact max/min), only the thread layout.
MAX_EXPERTS = 4096
MAX_PAIRS = 64                 # router_align runs fused (one program) for N * top_k <= MAX_PAIRS
MIN_NP_BLOCK = 16              # smallest pair block of the fused kernel (as kernels/moe_align.py)
FILL_BLOCK = 1024              # cells per store of the sentinel tails (sorted_pairs, block_expert)
# (largest routing tile, num_warps), first match: rows x padded E (one row per router_topk program, all N rows
# in router_align's program); small tiles stay in one warp (no cross-warp reductions). The fused kernel's
# [NP_BLOCK, NP_BLOCK] alignment tiles at 64 pairs take ~236 registers per thread at 4 warps (ptxas, sm_90a)
NUM_WARPS_BY_TILE = ((256, 1), (512, 2))
NUM_WARPS_MAX = 4
_NO_ID = 1 << 30               # id of padding lanes, above every expert id


@triton.jit
def _order_key(x, eid, NO_ID: tl.constexpr):
    """int64 keys ordered as (x descending, then id ascending): order-preserving fp32 bits, then NO_ID - id."""
    bits = x.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (NO_ID - eid).to(tl.int64)


@triton.jit
def _route_rows(logits_ptr, stride_row, rows, n_rows, bias, GS, n_group, topk_group, scale,
                R_BLOCK: tl.constexpr, G_BLOCK: tl.constexpr, GS_BLOCK: tl.constexpr, TOP_K: tl.constexpr,
                K_BLOCK: tl.constexpr, NO_ID: tl.constexpr):
    """(weights [R_BLOCK, K_BLOCK] fp32, ids [R_BLOCK, K_BLOCK] int32) of rows [R_BLOCK] (valid: rows < n_rows).

    The rows are routed side by side in a [R_BLOCK, G_BLOCK, GS_BLOCK] tile; bias is [1, G_BLOCK, GS_BLOCK].
    """
    g = tl.arange(0, G_BLOCK)
    j = tl.arange(0, GS_BLOCK)
    rvalid = rows < n_rows                                                        # [R_BLOCK]
    gvalid = g < n_group
    valid = rvalid[:, None, None] & (gvalid[:, None] & (j < GS)[None, :])[None, :, :]
    eid = g[:, None] * GS + j[None, :]                                            # [G_BLOCK, GS_BLOCK]
    eid3 = tl.where(valid, eid[None, :, :], NO_ID)                               # [R_BLOCK, G_BLOCK, GS_BLOCK]
    row_ptrs = logits_ptr + rows.to(tl.int64) * stride_row                        # [R_BLOCK]
    x = tl.load(row_ptrs[:, None, None] + eid3, mask=valid, other=0.0).to(tl.float32)
    biased = tl.where(valid, tl.sigmoid(x) + bias, float("-inf"))
    key = tl.where(valid, _order_key(biased, eid3, NO_ID), -(2**63))
    # group score: the best biased score plus the best of the others (the best's lane, lowest id first, excluded)
    m1 = tl.max(biased, axis=2)                                                   # [R_BLOCK, G_BLOCK]
    first = NO_ID - (tl.max(key, axis=2) & 0xFFFFFFFF).to(tl.int32)
    m2 = tl.max(tl.where(eid3 == first[:, :, None], float("-inf"), biased), axis=2)
    gscore = tl.where(gvalid[None, :], m1 + m2, float("-inf"))
    # keep group i if fewer than topk_group groups beat it (higher score, or equal score and lower id)
    gs_i = gscore[:, :, None]
    gs_j = gscore[:, None, :]
    lower = (g[None, :] < g[:, None])[None, :, :]
    beats = (gs_j > gs_i) | ((gs_j == gs_i) & lower)                              # [R_BLOCK, G_BLOCK, G_BLOCK]
    keep = gvalid[None, :] & (tl.sum(beats.to(tl.int32), axis=2) < topk_group)
    key = tl.where(keep[:, :, None], key, -(2**63))
    # k picks, best first: one max of the packed keys each; the weight's unbiased score is the same sigmoid of
    # the same logit, reloaded (a cached scalar load per row) rather than reduced out of the tile
    kk = tl.arange(0, K_BLOCK)[None, :]                                           # [1, K_BLOCK]
    weights = tl.zeros([R_BLOCK, K_BLOCK], dtype=tl.float32)
    ids = tl.zeros([R_BLOCK, K_BLOCK], dtype=tl.int32)
    total = tl.zeros([R_BLOCK], dtype=tl.float32)
    for i in tl.static_range(TOP_K):
        best = tl.max(tl.max(key, axis=2), axis=1)                               # [R_BLOCK]
        e = NO_ID - (best & 0xFFFFFFFF).to(tl.int32)
        s = tl.sigmoid(tl.load(row_ptrs + e, mask=rvalid, other=0.0).to(tl.float32))
        total = total + s                                                         # in pick order, one by one
        weights = tl.where(kk == i, s[:, None], weights)
        ids = tl.where(kk == i, e[:, None], ids)
        key = tl.where(eid3 == e[:, None, None], -(2**63), key)
    weights = weights / (total[:, None] + 1e-20) * scale
    return weights, ids


@triton.jit
def _load_bias(bias_ptr, GS, n_group, G_BLOCK: tl.constexpr, GS_BLOCK: tl.constexpr):
    """The expert bias as a [1, G_BLOCK, GS_BLOCK] fp32 tile (0 in padding)."""
    g = tl.arange(0, G_BLOCK)
    j = tl.arange(0, GS_BLOCK)
    valid = (g < n_group)[:, None] & (j < GS)[None, :]
    return tl.load(bias_ptr + g[:, None] * GS + j[None, :], mask=valid, other=0.0).to(tl.float32)[None, :, :]


@triton.jit
def _append_shared(weights, ids, first_id, TOP_K: tl.constexpr, SHARED: tl.constexpr, K_BLOCK: tl.constexpr):
    """Columns TOP_K .. TOP_K+SHARED-1 of the [R, K_BLOCK] picks: ids first_id + j, weight 1.0 (shared experts)."""
    kk = tl.arange(0, K_BLOCK)[None, :]
    shared = (kk >= TOP_K) & (kk < TOP_K + SHARED)
    return tl.where(shared, 1.0, weights), tl.where(shared, first_id + kk - TOP_K, ids)


@triton.jit
def _store_rows(w_ptr, ids_ptr, rows, n_rows, weights, ids, WIDTH: tl.constexpr, K_BLOCK: tl.constexpr):
    kk = tl.arange(0, K_BLOCK)[None, :]
    cells = rows[:, None] * WIDTH + kk
    mask = (rows < n_rows)[:, None] & (kk < WIDTH)
    tl.store(w_ptr + cells, weights, mask=mask)
    tl.store(ids_ptr + cells, ids, mask=mask)


@triton.jit
def _router_topk_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, N, stride_row, GS, n_group, topk_group, scale,
                        G_BLOCK: tl.constexpr, GS_BLOCK: tl.constexpr, TOP_K: tl.constexpr, SHARED: tl.constexpr,
                        K_BLOCK: tl.constexpr, NO_ID: tl.constexpr, PDL: tl.constexpr):
    rows = tl.program_id(0) + tl.arange(0, 1)                                     # one row per program
    bias = _load_bias(bias_ptr, GS, n_group, G_BLOCK, GS_BLOCK)
    if PDL:
        tl.extra.cuda.gdc_wait()
    weights, ids = _route_rows(logits_ptr, stride_row, rows, N, bias, GS, n_group, topk_group, scale,
                               1, G_BLOCK, GS_BLOCK, TOP_K, K_BLOCK, NO_ID)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if SHARED > 0:
        weights, ids = _append_shared(weights, ids, GS * n_group, TOP_K, SHARED, K_BLOCK)
    _store_rows(w_ptr, ids_ptr, rows, N, weights, ids, TOP_K + SHARED, K_BLOCK)


@triton.jit
def _router_align_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, sorted_ptr, block_expert_ptr, total_ptr,
                         N, stride_row, GS, n_group, topk_group, scale, E, BM, max_padded, n_blocks,
                         R_BLOCK: tl.constexpr, G_BLOCK: tl.constexpr, GS_BLOCK: tl.constexpr,
                         TOP_K: tl.constexpr, SHARED: tl.constexpr, K_BLOCK: tl.constexpr, NO_ID: tl.constexpr,
                         NP_BLOCK: tl.constexpr, BM_BLOCK: tl.constexpr, FILL: tl.constexpr, PDL: tl.constexpr):
    rows = tl.arange(0, R_BLOCK)                                                  # all N rows side by side
    bias = _load_bias(bias_ptr, GS, n_group, G_BLOCK, GS_BLOCK)
    if PDL:
        tl.extra.cuda.gdc_wait()
    weights, ids = _route_rows(logits_ptr, stride_row, rows, N, bias, GS, n_group, topk_group, scale,
                               R_BLOCK, G_BLOCK, GS_BLOCK, TOP_K, K_BLOCK, NO_ID)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if SHARED > 0:
        weights, ids = _append_shared(weights, ids, GS * n_group, TOP_K, SHARED, K_BLOCK)
    _store_rows(w_ptr, ids_ptr, rows, N, weights, ids, TOP_K + SHARED, K_BLOCK)
    tl.debug_barrier()                        # the ids stored by every thread are visible to the pair-axis loads
    # moe_align over the NP = N * (k + S) pairs (kernels/moe_align.py), E experts counting the shared ones:
    # rank, bucket count and offset of each pair
    NP = N * (TOP_K + SHARED)
    offs = tl.arange(0, NP_BLOCK)
    pvalid = offs < NP
    e = tl.load(ids_ptr + offs, mask=pvalid, other=E)                             # [NP_BLOCK], padding = E
    e_i = e[:, None]
    e_j = e[None, :]
    same = (e_i == e_j) & pvalid[None, :]                                         # [NP_BLOCK, NP_BLOCK]
    rank = tl.sum((same & (offs[None, :] < offs[:, None])).to(tl.int32), axis=1)
    count = tl.sum(same.to(tl.int32), axis=1)
    padded = (count + BM - 1) // BM * BM
    rep = pvalid & (rank == 0)                                                    # one representative per expert
    rep_padded = tl.where(rep, padded, 0)
    offset = tl.sum((e_j < e_i).to(tl.int32) * rep_padded[None, :], axis=1)     # exclusive segment starts
    total = tl.sum(rep_padded, axis=0)
    # sorted_pairs: pair slots, each segment's padding, the tail past the total (disjoint cell sets)
    tl.store(sorted_ptr + offset + rank, offs, mask=pvalid)
    t = tl.arange(0, BM_BLOCK)[None, :]                                           # [1, BM_BLOCK]
    pad = rep[:, None] & (t < (padded - count)[:, None])
    tl.store(sorted_ptr + (offset + count)[:, None] + t, NP + 0 * t, mask=pad)
    for start in range(0, max_padded, FILL):
        cells = start + tl.arange(0, FILL)
        tl.store(sorted_ptr + cells, NP + 0 * cells, mask=(cells >= total) & (cells < max_padded))
    # block_expert: block q < total / BM (<= NP <= NP_BLOCK) belongs to the expert of the last segment starting at
    # or before row q * BM (segments are in expert order); -1 from total / BM on
    q = offs[:, None]                                                             # [NP_BLOCK, 1] block
    owner = tl.max(tl.where(rep[None, :] & (offset[None, :] <= q * BM), e_j, -1), axis=1)
    tl.store(block_expert_ptr + offs, tl.where(offs < total // BM, owner, -1), mask=offs < n_blocks)
    for start in range(NP_BLOCK, n_blocks, FILL):
        blocks = start + tl.arange(0, FILL)
        tl.store(block_expert_ptr + blocks, -1 + 0 * blocks, mask=blocks < n_blocks)
    tl.store(total_ptr, total)


def _num_warps(tile_elements: int) -> int:
    for limit, warps in NUM_WARPS_BY_TILE:
        if tile_elements <= limit:
            return warps
    return NUM_WARPS_MAX


def _check(logits: torch.Tensor, expert_bias: torch.Tensor, n_group: int, topk_group: int,
           top_k: int) -> tuple[torch.Tensor, int]:
    """Validate the router arguments; returns (logits with a unit last stride, group size)."""
    if logits.dim() != 2 or not logits.dtype.is_floating_point:
        raise ValueError(f"router: logits must be a float [N, E] tensor, got {list(logits.shape)} {logits.dtype}")
    N, E = logits.shape
    if expert_bias.shape != (E,) or not expert_bias.dtype.is_floating_point:
        raise ValueError(f"router: expert_bias must be a float [{E}] tensor, got {list(expert_bias.shape)} "
                         f"{expert_bias.dtype}")
    if E > MAX_EXPERTS or n_group < 1 or E % n_group != 0 or E // n_group < 2:
        raise ValueError(f"router: want E <= {MAX_EXPERTS} split into n_group groups of >= 2 experts, "
                         f"got E={E}, n_group={n_group}")
    group_size = E // n_group
    if not 1 <= topk_group <= n_group or not 1 <= top_k <= topk_group * group_size:
        raise ValueError(f"router: want 1 <= topk_group <= n_group and 1 <= top_k <= topk_group * E / n_group, "
                         f"got topk_group={topk_group}, top_k={top_k} (E={E}, n_group={n_group})")
    return (logits if N == 0 or logits.stride(-1) == 1 else logits.contiguous()), group_size


def _tile(n_group: int, group_size: int, top_k: int, fused_shared: int) -> dict:
    return dict(G_BLOCK=triton.next_power_of_2(n_group), GS_BLOCK=triton.next_power_of_2(group_size),
                TOP_K=top_k, SHARED=fused_shared, K_BLOCK=max(2, triton.next_power_of_2(top_k + fused_shared)),
                NO_ID=_NO_ID)


def _check_shared(fused_shared: int) -> None:
    if isinstance(fused_shared, bool) or not isinstance(fused_shared, int) or fused_shared < 0:
        raise ValueError(f"router: fused_shared must be an int >= 0, got {fused_shared!r}")


def router_topk(logits: torch.Tensor, expert_bias: torch.Tensor, n_group: int, topk_group: int, top_k: int,
                routed_scaling_factor: float, fused_shared: int = 0, *,
                pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [N, k+S], ids int32 [N, k+S]) as torch.ops.lingc.router_topk, ids by descending biased score
    and then the S = fused_shared shared experts (E .. E+S-1, weight 1.0)."""
    logits, group_size = _check(logits, expert_bias, n_group, topk_group, top_k)
    _check_shared(fused_shared)
    N = logits.shape[0]
    weights = torch.empty((N, top_k + fused_shared), dtype=torch.float32, device=logits.device)
    ids = torch.empty((N, top_k + fused_shared), dtype=torch.int32, device=logits.device)
    if N == 0:
        return weights, ids
    pdl = pdl and pdl_supported(logits.device)
    launch = {"launch_pdl": True} if pdl else {}
    tile = _tile(n_group, group_size, top_k, fused_shared)
    _router_topk_kernel[(N,)](logits, expert_bias, weights, ids, N, logits.stride(0), group_size, n_group, topk_group,
                              float(routed_scaling_factor), **tile, PDL=pdl,
                              num_warps=_num_warps(tile["G_BLOCK"] * tile["GS_BLOCK"]), **launch)
    return weights, ids


def router_align(logits: torch.Tensor, expert_bias: torch.Tensor, n_group: int, topk_group: int, top_k: int,
                 routed_scaling_factor: float, num_experts: int, block_m: int, fused_shared: int = 0, *,
                 pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights, ids, sorted_pairs, block_expert, total) = router_topk then moe_align on its ids.

    num_experts = E + fused_shared. N * (top_k + fused_shared) <= MAX_PAIRS: one launch of one program;
    larger: the router_topk kernel, then moe_align.
    """
    logits, group_size = _check(logits, expert_bias, n_group, topk_group, top_k)
    _check_shared(fused_shared)
    N, E = logits.shape
    if num_experts != E + fused_shared or block_m < 1:
        raise ValueError(f"router_align: want num_experts == E + fused_shared ({E} + {fused_shared}) and "
                         f"block_m >= 1, got {num_experts}, {block_m}")
    width = top_k + fused_shared
    num_pairs = N * width
    if num_pairs == 0 or num_pairs > MAX_PAIRS:
        weights, ids = router_topk(logits, expert_bias, n_group, topk_group, top_k, routed_scaling_factor,
                                   fused_shared, pdl=pdl)
        return (weights, ids, *moe_align(ids, num_experts, block_m, pdl=pdl))
    dev = logits.device
    max_padded, n_blocks = align_sizes(num_pairs, num_experts, block_m)
    weights = torch.empty((N, width), dtype=torch.float32, device=dev)
    ids = torch.empty((N, width), dtype=torch.int32, device=dev)
    sorted_pairs = torch.empty((max_padded,), dtype=torch.int32, device=dev)
    block_expert = torch.empty((n_blocks,), dtype=torch.int32, device=dev)
    total = torch.empty((1,), dtype=torch.int32, device=dev)
    pdl = pdl and pdl_supported(dev)
    launch = {"launch_pdl": True} if pdl else {}
    tile = _tile(n_group, group_size, top_k, fused_shared)
    r_block = triton.next_power_of_2(N)
    _router_align_kernel[(1,)](
        logits, expert_bias, weights, ids, sorted_pairs, block_expert, total,
        N, logits.stride(0), group_size, n_group, topk_group, float(routed_scaling_factor), num_experts, block_m,
        max_padded, n_blocks, R_BLOCK=r_block, **tile,
        NP_BLOCK=max(MIN_NP_BLOCK, triton.next_power_of_2(num_pairs)), BM_BLOCK=max(2, triton.next_power_of_2(block_m)),
        FILL=FILL_BLOCK, PDL=pdl, num_warps=_num_warps(r_block * tile["G_BLOCK"] * tile["GS_BLOCK"]), **launch)
    return weights, ids, sorted_pairs, block_expert, total


def router_topk_ref(logits: torch.Tensor, expert_bias: torch.Tensor, n_group: int, topk_group: int, top_k: int,
                    routed_scaling_factor: float, fused_shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """lingc's reference router (routed ids in unspecified order, then the shared ones)."""
    return torch.ops.lingc.router_topk(logits, expert_bias, n_group, topk_group, top_k, routed_scaling_factor,
                                       fused_shared)


def router_align_ref(logits: torch.Tensor, expert_bias: torch.Tensor, n_group: int, topk_group: int, top_k: int,
                     routed_scaling_factor: float, num_experts: int, block_m: int, fused_shared: int = 0,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """lingc's reference router_align."""
    return torch.ops.lingc.router_align(logits, expert_bias, n_group, topk_group, top_k, routed_scaling_factor,
                                        num_experts, block_m, fused_shared)


LOWERINGS = {"router_topk": router_topk, "router_align": router_align}
