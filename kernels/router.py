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

On sm_90+ GPUs both run kernels/router_gluon.py where it applies (E = 32 x 2^n <= 256 routed experts in groups of <=
32: Ling-3.0-tiny's 128 / 8): the same bits without the serial pick chain (each expert's rank from one parallel
count; H200, PDL on: router_topk 1.84 vs 2.74 us at 1 and 6 rows, router_align at one row 1.92 vs "rows" 2.97;
bench/results/kernels-router-gluon-h200-20261203.json). router_align takes it at one row ("auto", or variant
"gluon"); LINGC_ROUTER_GLUON=0 / LINGC_ROUTER_GLUON_ALIGN=0 keep this file's kernels. Everything below describes
this file's kernels, which the interpreter, other GPUs and other shapes run.

`router_align` = router_topk then moe_align (`torch.ops.lingc.moe_align`) in ONE launch. Three kernels, chosen by
the launcher's `variant` ("auto", the default: "split" from SPLIT_FROM rows up where N * (k + S) <= MAX_PAIRS,
else "rows" from ROWS_FROM rows up where it applies, else "pairs"):

  "rows" (one program; N <= MAX_ROWS and a sane tile): the tokens are a tensor axis the warps split, one or two
  rows per warp, so every per-row reduction (the k picks, the group scores) is a warp shuffle, never a CTA barrier.
  The align is read off the routing tile itself, without the pair axis: the tile [L, R, G, C] (experts e =
  g*GS + c*L + l, tokens r) keeps each row's pick index i per expert, so, with bits_e = sum_r (row r picked e)
  << r (the only cross-warp step: one int32 sum over the rows),
      count_e  = popcount(bits_e),  padded_e = ceil(count_e / BM) * BM
      offset_e = exclusive prefix sum of padded over the experts in id order (a scan over L, sums over C and G)
      rank     = popcount(bits_e & ((1 << r) - 1))           (pairs of one expert are in row order)
      sorted_pairs[offset_e + rank] = r * (k + S) + i,  block_expert[offset_e / BM + b] = e (b < padded_e / BM)
  and the S shared experts (every row, ids E..E+S-1) follow the routed segments: offset = routed total +
  s * ceil(N / BM) * BM, rank r. The sentinels (NP in sorted_pairs, -1 in block_expert) are stored first and a
  CTA barrier orders them before the scatters. All of it is O(N * E) elementwise work in registers.
  History: on the H200 at N = 1 an earlier version wrote wrong sorted_pairs / block_expert (only some experts'
  blocks); at N = 1 the tile's G axis spans 2 lanes x 4 repeats (TTGIR) and the tl.cumsum over G was the
  suspect. With the G and C prefix sums as comparison sums (253218f) the H200 run of 2f1b249 has rows == pairs,
  all outputs bit for bit, at N = 1 and 6, with and without the shared expert (bench/kernel_router.py).
  "pairs" (one program; N * (k + S) <= MAX_PAIRS; the default at N = 1 until 2026-12-01, when "rows" measured
  2.96 vs 3.87 us there, ROWS_FROM): routes the N rows side by side in a
  [R, G, GS] tile, stores ids, then after a barrier reloads them and aligns the NP pairs with pairwise
  [NP_BLOCK, NP_BLOCK] compares (`_align_pairs`, kernels/moe_align.py's pair axis), writing every cell with
  disjoint stores.
  "split" (grid (N,); N * (k + S) <= MAX_PAIRS): one program routes one row, so the N rows are routed at once on
  N SMs exactly as the router_topk kernel routes them, and only the align runs in one program. Why: one program
  holding all N rows pays for them on one SM ("rows" at N = 6: 10.3 us per launch in the CUDA-graph verify step,
  against ~4 us for one row). Program r stores its row's weights and ids, then (a CTA barrier, then an acq_rel
  gpu-scope atomic add) takes a ticket from an int32 counter; the program drawing the last ticket (N - 1) reloads
  all N rows' ids through L2 (`.cg`: other CTAs wrote them, and L1 is not coherent across SMs), runs the same
  `_align_pairs` as "pairs" (one helper, so the two cannot drift) and stores 0 back to the counter, so the next
  launch or graph replay starts from zero (kernels/kda.py `_update_windows` and kernels/linear.py `_finish` use
  the pattern). Ordering: a program's id stores precede its barrier, the barrier precedes the atomic (the release,
  taken by one thread: cumulative over the stores the barrier ordered); ticket N - 1's acquire reads the whole
  chain of N increments, so every row's stores happen before the last program's reload (its other threads get the
  ticket through shared memory, after a second barrier). No program waits for another (no deadlock whatever the
  scheduling), nothing depends on which program comes last: the same bits as "pairs". The counter
  (`align_counters`: kernels/workspace.py, owner "router_align"; or the `workspace` argument for launches that
  may run concurrently) is touched only after the PDL wait, which returns once the previous launch (its reset
  included) has completed. The last program's critical path: one row's routing, the ticket's round trip (~0.8 us
  in kda), the [NP_BLOCK, NP_BLOCK] align (4 warps: `_split_warps`). H200, CUDA graph, PDL on, N = 6 with the
  shared expert: 7.5 us against 7.8 for "rows"; the verify step 2.795 ms against 2.804 with "rows"
  (bench/results/kernels-router-split-h200-20261130.json).
Anything else runs the router_topk kernel, then lingc.kernels.moe_align.

Why "pairs" scaled badly with N (H200, Ling-3.0-tiny, k + S = 9, in the CUDA-graph step: 4.0 us at N = 1,
9.0 us at N = 6, slower than router_topk + moe_align's 6.9 us), from its sm_90 code (Triton 3.6 ttgir / ptxas):
at N = 6 the [8, 8, 16] tile gets 4 warps, and Triton's layout puts the warps on the group and expert axes, so
each of the k picks (a serial chain) and each group reduction crosses warps through shared memory: 118 bar.sync
in the kernel against 7 at N = 1, plus [64, 64] pair tiles (228 registers) and a store -> barrier -> L2 reload
of the ids. "rows" at N = 6 (R = 8, 4 warps x 2 rows): 5 bar.sync (1 in the group ranking, 3 in the
cross-warp row sum of bits_e, 1 ordering the sentinels), none in the pick chain, ~2150 instructions per warp
(pairs: ~2700), 86 registers; at N = 1 (1 warp): 2 bar.sync, ~1500 instructions (pairs: 7 and ~1760). (Counts
from the PTX; no barrier sits in a loop.) Critical path, any N: the bias load (before gdc_wait), one logits load
(L2), the group scores and ranking, k serial picks of one in-warp int64 max each (in registers over G x C, then
the lane shuffles), the row sum of bits_e, in-warp scans, the scatters. So N = 6 should cost about N = 1 plus 3
barriers and twice the per-thread elementwise work (8 tile cells per thread instead of 4), with no store ->
reload. Timed on the H200 (bench/kernel_router.py, 705c4f1, PDL off): N = 6 with the shared expert 8.19 us
(pairs 9.11), without it 6.25 (9.00); N = 1 3.8 us both.
Registers: the tile holds R * G * GS / (32 * warps) elements per thread, kept <= ROW_ELEMENTS_PER_THREAD:
E = 128 runs every N <= 16 with 4-8 per thread (64-120 registers), E = 512 (Ling-3.0-flash) every N <= 16 with
16-32 (167-245 registers, no spills; sm_90, ptxas of Triton 3.6); larger tiles take "pairs" or the two kernels.

Tiles: router_topk and "pairs" route rows in a [R_BLOCK, G_BLOCK, GS_BLOCK] tile (rows x groups x experts of a
group, padded to powers of two; router_topk has one row per program), "rows" in the [L, R, G, C] tile above. A
candidate is an int64 key (order-preserving bits of the fp32 biased score, then NO_ID - id), so each of the k
picks is ONE max reduction that yields both the best score and its lowest id; the pick's unbiased score is the
same sigmoid of the same logit ("pairs", router_topk: reloaded as a scalar; "rows": a max over the picked cell).

Bytes per row: reads E logits (4 B) + E bias (4 B, shared, L2-resident), writes 8k B (weights, ids);
router_align also writes (NP + E*(BM-1)) * 4 B of sorted_pairs and 4 B per block of block_expert.
The file holds router_topk and the three router_align kernels (~700 lines): they share the routing helpers, the
align helper and the ordering contract, and they stay side by side for timing (bench/kernel_router.py).

PDL placement (shared/docs/kernels.md section 1.5): with the constexpr PDL on, the expert bias (a weight no
earlier kernel writes) is loaded before `gdc_wait()`, the logits after it, and `gdc_launch_dependents()` follows
the last logits load (in "rows", the tile load; it reads no logits after it). In "split" the trigger follows the
row's logits loads as in router_topk, before the ids reload: those ids are this launch's own stores, not an
earlier kernel's output, and a dependent's own `gdc_wait` still waits for this whole grid (the last program's
align included) to complete before it reads anything. The ticket is taken after the wait (see "split" above).
With PDL off no GDC call is emitted (the interpreter cannot run them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lingc.knobs import env_int
from lingc.kernels import workspace as _workspace
from lingc.kernels.moe_align import moe_align
from lingc.kernels import router_gluon
from lingc.kernels.pdl import pdl_supported, pdl_trigger, pdl_wait
import lingc.ops  # noqa: F401  (registers torch.ops.lingc.*, used by the references)
from lingc.ops.moe import align_sizes

# Tunables. None changes the arithmetic (every reduction is an exact max/min), only the thread layout.
MAX_EXPERTS = 4096
MAX_PAIRS = 64                 # router_align "pairs" runs for N * (top_k + S) <= MAX_PAIRS
MAX_ROWS = 16                  # router_align "rows" runs for N <= MAX_ROWS (bits_e is a 16-bit row mask)
ROW_LANES = 32                 # "rows": experts of a group per lane chunk (L = min(32, GS padded)); rows fill the rest
ROW_MAX_WARPS = 8
ROW_ELEMENTS_PER_THREAD = 32   # "rows": tile cells per thread (E = 512, N = 16: 32 -> 245 registers); more spill
ALIGN_VARIANTS = ("auto", "rows", "pairs", "split", "gluon")   # "gluon": kernels/router_gluon.py (GPU, one row)
ROWS_FROM = env_int("LINGC_ROUTER_ROWS_FROM", 1)   # "auto": "rows" from this many rows up (where
                # "split" does not apply), "pairs" below. H200 2026-12-01 with the shared expert, PDL on: N = 1 rows
                # 2.96 us vs pairs 3.87 (bench/results/kernels-router-warp-h200-20261201.json), and the decode step
                # 1.295 vs 1.318 ms with rows at one row (step-ab-h200-20261201.json); N = 6 rows 7.07 vs split 7.17
                # vs pairs 9.23. (2026-11-30 had measured N = 1 pairs 3.10 vs rows 3.32.) LINGC_ROUTER_ROWS_FROM=2:
                # "pairs" at one row
SPLIT_FROM = env_int("LINGC_ROUTER_SPLIT_FROM", 2)   # "auto": "split" from this many rows up where
                # N * (top_k + S) <= MAX_PAIRS (LINGC_ROUTER_SPLIT_FROM=99 turns it off for an A/B)
ALIGN_COUNTERS = 1             # "split": one int32 ticket counter per launch (kernels/workspace.py)
SPLIT_WARPS = 4                # "split": num_warps (at least; _split_warps), from the H200 sweep
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
        pdl_wait()
    weights, ids = _route_rows(logits_ptr, stride_row, rows, N, bias, GS, n_group, topk_group, scale,
                               1, G_BLOCK, GS_BLOCK, TOP_K, K_BLOCK, NO_ID)
    if PDL:
        pdl_trigger()
    if SHARED > 0:
        weights, ids = _append_shared(weights, ids, GS * n_group, TOP_K, SHARED, K_BLOCK)
    _store_rows(w_ptr, ids_ptr, rows, N, weights, ids, TOP_K + SHARED, K_BLOCK)


@triton.jit
def _router_align_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, sorted_ptr, block_expert_ptr, total_ptr,
                         N, stride_row, GS, n_group, topk_group, scale, E, max_padded, n_blocks,
                         R_BLOCK: tl.constexpr, G_BLOCK: tl.constexpr, GS_BLOCK: tl.constexpr,
                         TOP_K: tl.constexpr, SHARED: tl.constexpr, K_BLOCK: tl.constexpr, NO_ID: tl.constexpr,
                         NP_BLOCK: tl.constexpr, BM: tl.constexpr, BM_BLOCK: tl.constexpr, FILL: tl.constexpr,
                         PDL: tl.constexpr):
    rows = tl.arange(0, R_BLOCK)                                                  # all N rows side by side
    bias = _load_bias(bias_ptr, GS, n_group, G_BLOCK, GS_BLOCK)
    if PDL:
        pdl_wait()
    weights, ids = _route_rows(logits_ptr, stride_row, rows, N, bias, GS, n_group, topk_group, scale,
                               R_BLOCK, G_BLOCK, GS_BLOCK, TOP_K, K_BLOCK, NO_ID)
    if PDL:
        pdl_trigger()
    if SHARED > 0:
        weights, ids = _append_shared(weights, ids, GS * n_group, TOP_K, SHARED, K_BLOCK)
    _store_rows(w_ptr, ids_ptr, rows, N, weights, ids, TOP_K + SHARED, K_BLOCK)
    tl.debug_barrier()                        # the ids stored by every thread are visible to the pair-axis loads
    _align_pairs(ids_ptr, sorted_ptr, block_expert_ptr, total_ptr, N * (TOP_K + SHARED), E, BM, max_padded,
                 n_blocks, NP_BLOCK, BM_BLOCK, FILL, "")


@triton.jit
def _align_pairs(ids_ptr, sorted_ptr, block_expert_ptr, total_ptr, NP, E, BM: tl.constexpr, max_padded, n_blocks,
                 NP_BLOCK: tl.constexpr, BM_BLOCK: tl.constexpr, FILL: tl.constexpr, CACHE: tl.constexpr):
    """moe_align over the NP = N * (k + S) stored ids (kernels/moe_align.py's pair axis), E experts counting the
    shared ones: every cell of sorted_pairs, block_expert and total, with disjoint stores (no sentinel pass).
    CACHE is the ids load's cache modifier: "" where this CTA stored them ("pairs"), ".cg" (L2) where other CTAs
    of the launch did ("split": L1 is not coherent across SMs)."""
    # rank, bucket count and offset of each pair
    offs = tl.arange(0, NP_BLOCK)
    pvalid = offs < NP
    e = tl.load(ids_ptr + offs, mask=pvalid, other=E, cache_modifier=CACHE)       # [NP_BLOCK], padding = E
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


# ---- router_align "split": one row per program, the last program to finish aligns ---------------------------------


@triton.jit
def _router_align_split_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, sorted_ptr, block_expert_ptr, total_ptr,
                               count_ptr, N, stride_row, GS, n_group, topk_group, scale, E, max_padded, n_blocks,
                               G_BLOCK: tl.constexpr, GS_BLOCK: tl.constexpr, TOP_K: tl.constexpr,
                               SHARED: tl.constexpr, K_BLOCK: tl.constexpr, NO_ID: tl.constexpr,
                               NP_BLOCK: tl.constexpr, BM: tl.constexpr, BM_BLOCK: tl.constexpr, FILL: tl.constexpr,
                               PDL: tl.constexpr):
    """Program r routes row r as _router_topk_kernel does and stores it; the program drawing ticket N - 1 from
    count_ptr (int32, zero between launches) aligns all N rows' ids and zeroes the counter (module docstring)."""
    rows = tl.program_id(0) + tl.arange(0, 1)                                     # one row per program
    bias = _load_bias(bias_ptr, GS, n_group, G_BLOCK, GS_BLOCK)                   # a weight: before the wait
    if PDL:
        pdl_wait()          # also orders the ticket after the previous launch's counter reset (it has completed)
    weights, ids = _route_rows(logits_ptr, stride_row, rows, N, bias, GS, n_group, topk_group, scale,
                               1, G_BLOCK, GS_BLOCK, TOP_K, K_BLOCK, NO_ID)
    if PDL:
        pdl_trigger()       # after the last read of an earlier kernel's output (the logits): the ids reload below
                            # reads this launch's stores, and dependents gdc_wait for the whole grid anyway
    if SHARED > 0:
        weights, ids = _append_shared(weights, ids, GS * n_group, TOP_K, SHARED, K_BLOCK)
    _store_rows(w_ptr, ids_ptr, rows, N, weights, ids, TOP_K + SHARED, K_BLOCK)
    tl.debug_barrier()      # every thread's id stores come before the ticket (release) is taken
    ticket = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    if ticket == N - 1:     # every row is stored (its release is in the chain of N increments this acquire reads)
        _align_pairs(ids_ptr, sorted_ptr, block_expert_ptr, total_ptr, N * (TOP_K + SHARED), E, BM, max_padded,
                     n_blocks, NP_BLOCK, BM_BLOCK, FILL, ".cg")
        tl.store(count_ptr, 0)                                                    # ready for the next launch


# ---- router_align "rows": tokens on warps, the align read off the routing tile ------------------------------------
# Tile [L, R, G, C]: L experts of a group per lane chunk (min(32, GS padded)), R rows (tokens), G groups, C chunks per
# group; expert e = g*GS + c*L + l. Triton 3.6 orders a tile's axes for its layout by pointer contiguity, ties in
# axis order; the expert offsets go through tl.where, so no axis looks contiguous and every load and store gets
# order (L, R, G, C): lanes on L then R, warps on R, G and C in registers. A row then never spans two warps (so no
# per-row reduction needs a CTA barrier), and the scatter stores need no layout conversion. The launcher keeps
# warps <= R / (rows per warp); test_router_rows.py compiles the kernel for sm_90 to check the layout.


@triton.jit
def _popcount16(x):
    """Set bits of each int32 in [0, 2^16) (SWAR, exact integer ops)."""
    x = x - ((x >> 1) & 0x5555)
    x = (x & 0x3333) + ((x >> 2) & 0x3333)
    x = (x + (x >> 4)) & 0x0F0F
    return (x + (x >> 8)) & 0x1F


@triton.jit
def _group_max(x):
    """max over C and L of [L, R, G, C] -> [1, R, G, 1] (in-register axis first, then the lanes)."""
    return tl.max(tl.max(x, axis=3, keep_dims=True), axis=0, keep_dims=True)


@triton.jit
def _row_max(x):
    """max over G, C and L of [L, R, G, C] -> [1, R, 1, 1]."""
    return tl.max(tl.max(tl.max(x, axis=2, keep_dims=True), axis=3, keep_dims=True), axis=0, keep_dims=True)


@triton.jit
def _row_picks(score, biased, eid, valid, g, n_group, topk_group, R_BLOCK: tl.constexpr, G_BLOCK: tl.constexpr,
               C_BLOCK: tl.constexpr, L_BLOCK: tl.constexpr, TOP_K: tl.constexpr, K_BLOCK: tl.constexpr,
               NO_ID: tl.constexpr):
    """The k picks of every row of the tile, as _route_rows (same keys, same order, same bits):
    (scores [K, R, 1, 1] in pick order, their sum [1, R, 1, 1] summed in pick order, ids [K, R, 1, 1],
    pick index per tile cell [L, R, G, C] (-1: not picked))."""
    key = tl.where(valid, _order_key(biased, eid, NO_ID), -(2**63))
    # group score = best + second best biased score (the best counted once: equal to it if two lanes tie)
    m1 = _group_max(biased)                                                       # [1, R, G, 1]
    ties = tl.sum(tl.sum((biased == m1).to(tl.int32), axis=3, keep_dims=True), axis=0, keep_dims=True)
    m2 = tl.where(ties > 1, m1, _group_max(tl.where(biased == m1, float("-inf"), biased)))
    gvalid = g < n_group
    gscore = tl.where(gvalid, m1 + m2, float("-inf"))                             # [1, R, G, 1]
    # keep group g if fewer than topk_group groups beat it (higher score, or equal score and lower id)
    gs_other = tl.permute(gscore, (2, 1, 0, 3))                                   # [G', R, 1, 1]
    g_other = tl.arange(0, G_BLOCK)[:, None, None, None]
    beats = (gs_other > gscore) | ((gs_other == gscore) & (g_other < g))          # [G', R, G, 1]
    keep = gvalid & (tl.sum(beats.to(tl.int32), axis=0, keep_dims=True) < topk_group)
    key = tl.where(keep, key, -(2**63))
    kk = tl.arange(0, K_BLOCK)[:, None, None, None]                               # [K, 1, 1, 1]
    scores = tl.zeros([K_BLOCK, R_BLOCK, 1, 1], dtype=tl.float32)
    ids = tl.zeros([K_BLOCK, R_BLOCK, 1, 1], dtype=tl.int32)
    picks = tl.full([L_BLOCK, R_BLOCK, G_BLOCK, C_BLOCK], -1, tl.int32)
    total = tl.zeros([1, R_BLOCK, 1, 1], dtype=tl.float32)
    for i in tl.static_range(TOP_K):
        e = NO_ID - (_row_max(key) & 0xFFFFFFFF).to(tl.int32)                   # [1, R, 1, 1]
        hit = eid == e
        s = _row_max(tl.where(hit, score, float("-inf")))                         # the pick's sigmoid score
        total = total + s                                                         # in pick order, one by one
        scores = tl.where(kk == i, s, scores)
        ids = tl.where(kk == i, e, ids)
        key = tl.where(hit, -(2**63), key)
        picks = tl.where(hit, i, picks)
    return scores, total, ids, picks


@triton.jit
def _router_align_rows_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, sorted_ptr, block_expert_ptr, total_ptr,
                              N, stride_row, n_group, topk_group, scale, max_padded, n_blocks,
                              BM: tl.constexpr, GS: tl.constexpr, R_BLOCK: tl.constexpr, G_BLOCK: tl.constexpr,
                              C_BLOCK: tl.constexpr,
                              L_BLOCK: tl.constexpr, TOP_K: tl.constexpr, SHARED: tl.constexpr,
                              K_BLOCK: tl.constexpr, NO_ID: tl.constexpr, FILL: tl.constexpr, PDL: tl.constexpr):
    W: tl.constexpr = TOP_K + SHARED                                              # pairs per row
    l = tl.arange(0, L_BLOCK)[:, None, None, None]                                # [L, 1, 1, 1]
    r = tl.arange(0, R_BLOCK)[None, :, None, None]                                # [1, R, 1, 1]
    g = tl.arange(0, G_BLOCK)[None, None, :, None]                                # [1, 1, G, 1]
    c = tl.arange(0, C_BLOCK)[None, None, None, :]                                # [1, 1, 1, C]
    kk = tl.arange(0, K_BLOCK)[:, None, None, None]                               # [K, 1, 1, 1]
    rvalid = r < N
    j = c * L_BLOCK + l                                                           # expert inside its group
    valid = rvalid & (g < n_group) & (j < GS)                                     # [L, R, G, C]
    eid = g * GS + j
    cell = tl.where(valid, eid, 0)              # (a select: no axis looks contiguous, see the section comment)
    bias = tl.load(bias_ptr + cell, mask=valid, other=0.0).to(tl.float32)         # a weight: before the wait
    if PDL:
        pdl_wait()
    x = tl.load(logits_ptr + r.to(tl.int64) * stride_row + cell, mask=valid, other=0.0).to(tl.float32)
    if PDL:
        pdl_trigger()
    NP = N * W
    for start in range(0, max_padded, FILL):                                      # sentinels first
        cells = start + tl.arange(0, FILL)
        tl.store(sorted_ptr + cells, NP + 0 * cells, mask=cells < max_padded)
    for start in range(0, n_blocks, FILL):
        cells = start + tl.arange(0, FILL)
        tl.store(block_expert_ptr + cells, -1 + 0 * cells, mask=cells < n_blocks)
    eid = tl.where(valid, eid, NO_ID)
    score = tl.sigmoid(x)
    biased = tl.where(valid, score + bias, float("-inf"))
    scores, total, ids, picks = _row_picks(score, biased, eid, valid, g, n_group, topk_group, R_BLOCK, G_BLOCK,
                                           C_BLOCK, L_BLOCK, TOP_K, K_BLOCK, NO_ID)
    weights = scores / (total + 1e-20) * scale
    shared = (kk >= TOP_K) & (kk < W)                                             # [K, 1, 1, 1]
    weights = tl.where(shared, 1.0, weights)
    ids = tl.where(shared, GS * n_group + kk - TOP_K, ids)
    row_cells = r * W + kk                                                        # [K, R, 1, 1]
    tl.store(w_ptr + row_cells, weights, mask=rvalid & (kk < W))
    tl.store(ids_ptr + row_cells, ids, mask=rvalid & (kk < W))
    _align_from_picks(picks, valid, eid, r, kk, N, BM, sorted_ptr, block_expert_ptr, total_ptr, GS * n_group,
                      TOP_K, SHARED)


@triton.jit
def _align_from_picks(picks, valid, eid, r, kk, N, BM: tl.constexpr, sorted_ptr, block_expert_ptr, total_ptr, E_ROUTED,
                      TOP_K: tl.constexpr, SHARED: tl.constexpr):
    """moe_align's scatters from the pick tile (the sentinels are already stored): bits_e = the rows that picked e
    (the one cross-warp sum), then per cell the expert's count, segment offset and the row's rank in it."""
    W: tl.constexpr = TOP_K + SHARED
    picked = (picks >= 0) & valid                                                 # [L, R, G, C]
    bits = tl.sum(tl.where(picked, 1 << r, 0), axis=1, keep_dims=True)            # [L, 1, G, C]
    padded = (_popcount16(bits) + BM - 1) // BM * BM + 0 * r                      # [L, R, G, C]
    chunk = tl.sum(padded, axis=0, keep_dims=True)                                # [1, R, G, C]
    group = tl.sum(chunk, axis=3, keep_dims=True)                                 # [1, R, G, 1]
    # exclusive prefix sums over G and C as comparison sums, not tl.cumsum: at N = 1 the G axis spans 2 lanes with 4
    # repeats each, and a scan there is the suspect for the wrong offsets seen on the H200 (module docstring)
    g_other = tl.arange(0, group.shape[2])[:, None, None, None]                   # [G', 1, 1, 1]
    g_here = tl.arange(0, group.shape[2])[None, None, :, None]                    # [1, 1, G, 1]
    before_g = tl.sum(tl.where(g_other < g_here, tl.permute(group, (2, 1, 0, 3)), 0), axis=0, keep_dims=True)
    c_other = tl.arange(0, chunk.shape[3])[:, None, None, None]                   # [C', 1, 1, 1]
    c_here = tl.arange(0, chunk.shape[3])[None, None, None, :]                    # [1, 1, 1, C]
    before_c = tl.sum(tl.where(c_other < c_here, tl.permute(chunk, (3, 1, 2, 0)), 0), axis=0, keep_dims=True)
    offset = before_g + before_c + (tl.cumsum(padded, 0) - padded)
    routed = tl.sum(group, axis=2, keep_dims=True)                                # [1, R, 1, 1] rows in use
    rank = _popcount16(bits & ((1 << r) - 1))
    tl.debug_barrier()                    # every warp's sentinels land before the scatters below overwrite some
    tl.store(sorted_ptr + offset + rank, r * W + picks, mask=picked)
    tl.store(block_expert_ptr + offset // BM + r, eid + 0 * r, mask=valid & (r < padded // BM))  # r = block b
    # shared expert s = kk - TOP_K: rows 0..N-1 in order after the routed segments, each padded to pad_n
    shared = (kk >= TOP_K) & (kk < W)                                             # [K, 1, 1, 1]
    pad_n = (N + BM - 1) // BM * BM
    base = routed + (kk - TOP_K) * pad_n                                          # [K, R, 1, 1]
    tl.store(sorted_ptr + base + r, r * W + kk, mask=shared & (r < N))
    tl.store(block_expert_ptr + base // BM + r, E_ROUTED + kk - TOP_K + 0 * r, mask=shared & (r < pad_n // BM))
    first = (kk == 0) & (r == 0)
    tl.store(total_ptr + 0 * (kk + r), routed + SHARED * pad_n + 0 * kk, mask=first)


def _num_warps(tile_elements: int) -> int:
    for limit, warps in NUM_WARPS_BY_TILE:
        if tile_elements <= limit:
            return warps
    return NUM_WARPS_MAX


def _split_warps(route_elements: int) -> int:
    """num_warps of the "split" kernel: SPLIT_WARPS, or more where router_topk's one-row tile wants more.

    H200 (bench/results/kernels-router-split-h200-20261130.json, CUDA graph, PDL on, E = 128 + 1 shared): at N = 2
    (32-pair tile) 1 warp 7.8 us, 2 warps 4.7, 4 warps 4.6; at N = 6 (64 pairs) 1 warp 10.2, 2 warps 12.0, 4 warps
    7.5 ("rows" 7.8, router_topk + moe_align 8.2). The last program's align is the critical path, and at 1 warp its
    [NP_BLOCK, NP_BLOCK] tiles are ~5100 PTX instructions (sm_90) against ~1550 + 36 bar.sync at 4."""
    return max(_num_warps(route_elements), SPLIT_WARPS)


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
    if router_gluon.eligible(logits.device, logits.shape[1], n_group, topk_group, top_k) and router_gluon.router_topk(
            logits, expert_bias, weights, ids, n_group, topk_group, top_k, routed_scaling_factor, fused_shared, pdl):
        return weights, ids
    launch = {"launch_pdl": True} if pdl else {}
    tile = _tile(n_group, group_size, top_k, fused_shared)
    _router_topk_kernel[(N,)](logits, expert_bias, weights, ids, N, logits.stride(0), group_size, n_group, topk_group,
                              float(routed_scaling_factor), **tile, PDL=pdl,
                              num_warps=_num_warps(tile["G_BLOCK"] * tile["GS_BLOCK"]), **launch)
    return weights, ids


def _rows_launch(N: int, n_group: int, group_size: int, top_k: int, fused_shared: int) -> dict | None:
    """Constexprs and num_warps of the "rows" kernel, or None where it does not apply (N > MAX_ROWS, or a tile
    over ROW_ELEMENTS_PER_THREAD per thread). Warps only split rows: a warp's lanes cover the L experts of a
    chunk and then 32 / L rows, so warps = R / (32 / L) (at least 1, at most ROW_MAX_WARPS)."""
    if not 1 <= N <= MAX_ROWS:
        return None
    gs_block, g_block, r_block = (triton.next_power_of_2(v) for v in (group_size, n_group, N))
    lanes = min(ROW_LANES, gs_block)
    warps = min(ROW_MAX_WARPS, max(1, r_block // max(1, 32 // lanes)))
    if r_block * g_block * gs_block > ROW_ELEMENTS_PER_THREAD * 32 * warps:
        return None
    return dict(GS=group_size, R_BLOCK=r_block, G_BLOCK=g_block, C_BLOCK=gs_block // lanes, L_BLOCK=lanes,
                TOP_K=top_k, SHARED=fused_shared, NO_ID=_NO_ID, FILL=FILL_BLOCK, num_warps=warps,
                K_BLOCK=max(lanes, triton.next_power_of_2(top_k + fused_shared)))   # >= L: [K, R] tiles fill lanes


def align_counters(device: torch.device | str) -> torch.Tensor:
    """router_align "split"'s default ticket counter on a device (int32 [ALIGN_COUNTERS], kernels/workspace.py):
    zeroed on first use and kept (a captured CUDA graph points at it); every launch leaves it zero."""
    return _workspace.counters(device, "router_align", ALIGN_COUNTERS)


def _check_workspace(counters: torch.Tensor, device: torch.device) -> None:
    if not isinstance(counters, torch.Tensor) or counters.dtype != torch.int32 or not counters.is_contiguous() \
            or counters.numel() < ALIGN_COUNTERS or counters.device != device:
        got = (f"{counters.numel()} {counters.dtype} counters on {counters.device}"
               if isinstance(counters, torch.Tensor) else f"a {type(counters).__name__}")
        raise ValueError(f"router_align: workspace holds {got}, want a contiguous int32 tensor of >= {ALIGN_COUNTERS} "
                         f"zeroed ticket counter(s) on {device}")


def router_align(logits: torch.Tensor, expert_bias: torch.Tensor, n_group: int, topk_group: int, top_k: int,
                 routed_scaling_factor: float, num_experts: int, block_m: int, fused_shared: int = 0, *,
                 pdl: bool = False, variant: str = "auto", workspace: torch.Tensor | None = None,
                 split_warps: int | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights, ids, sorted_pairs, block_expert, total) = router_topk then moe_align on its ids.

    num_experts = E + fused_shared. One launch: variant "split" (N programs, one per row) or "pairs" (one program)
    where N * (top_k + fused_shared) <= MAX_PAIRS, "rows" (one program) where `_rows_launch` allows it (N <=
    MAX_ROWS, tile small enough), else "pairs" where that applies; otherwise the router_topk kernel, then
    moe_align. "auto" (the default) takes "split" from SPLIT_FROM rows up where it applies, else "rows" from
    ROWS_FROM rows up where that applies, else "pairs" (or the two kernels). Every path gives the same bits, so
    the choice by N keeps row invariance.
    workspace: "split"'s int32 ticket counter (>= ALIGN_COUNTERS, zero; default: the device's, `align_counters`);
    each launch leaves it zero. Launches that may run concurrently on one device (other streams) need one each.
    split_warps overrides "split"'s num_warps (`_split_warps`; benchmark sweeps only).
    """
    logits, group_size = _check(logits, expert_bias, n_group, topk_group, top_k)
    _check_shared(fused_shared)
    N, E = logits.shape
    if num_experts != E + fused_shared or block_m < 1:
        raise ValueError(f"router_align: want num_experts == E + fused_shared ({E} + {fused_shared}) and "
                         f"block_m >= 1, got {num_experts}, {block_m}")
    if variant not in ALIGN_VARIANTS:
        raise ValueError(f"router_align: variant must be one of {ALIGN_VARIANTS}, got {variant!r}")
    if workspace is not None:
        _check_workspace(workspace, logits.device)
    if split_warps is not None and split_warps not in (1, 2, 4, 8):
        raise ValueError(f"router_align: split_warps must be 1, 2, 4 or 8, got {split_warps!r}")
    width = top_k + fused_shared
    num_pairs = N * width
    fits_pairs = 0 < num_pairs <= MAX_PAIRS
    use_gluon = N == 1 and (variant == "gluon" or (variant == "auto" and router_gluon.ALIGN)) \
        and router_gluon.eligible(logits.device, E, n_group, topk_group, top_k)
    if variant == "gluon" and not use_gluon:
        raise ValueError(f"router_align: variant 'gluon' needs one row on a GPU where kernels/router_gluon.py "
                         f"runs (sm_90+, E = 32 x warps up to 256, groups of <= 32), got N={N}, E={E}, "
                         f"n_group={n_group} on {logits.device}")
    use_split = fits_pairs and (variant == "split" or (variant == "auto" and N >= SPLIT_FROM))
    use_rows = not use_split and (variant == "rows" or (variant == "auto" and N >= ROWS_FROM))
    rows = _rows_launch(N, n_group, group_size, top_k, fused_shared) if use_rows else None
    if rows is None and not fits_pairs:
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
    outputs = (weights, ids, sorted_pairs, block_expert, total)
    if use_gluon and router_gluon.router_align(logits, expert_bias, outputs, n_group, topk_group, top_k,
                                               routed_scaling_factor, fused_shared, block_m, max_padded, n_blocks,
                                               pdl):
        return outputs
    if rows is not None:
        _router_align_rows_kernel[(1,)](
            logits, expert_bias, *outputs, N, logits.stride(0), n_group, topk_group, float(routed_scaling_factor),
            max_padded, n_blocks, BM=block_m, **rows, PDL=pdl, **launch)
        return outputs
    tile = _tile(n_group, group_size, top_k, fused_shared)
    align = dict(NP_BLOCK=max(MIN_NP_BLOCK, triton.next_power_of_2(num_pairs)),
                 BM=block_m, BM_BLOCK=max(2, triton.next_power_of_2(block_m)), FILL=FILL_BLOCK)
    scalars = (logits.stride(0), group_size, n_group, topk_group, float(routed_scaling_factor), num_experts,
               max_padded, n_blocks)
    if use_split:
        counters = workspace if workspace is not None else align_counters(dev)
        _router_align_split_kernel[(N,)](
            logits, expert_bias, *outputs, counters, N, *scalars, **tile, **align, PDL=pdl,
            num_warps=split_warps or _split_warps(tile["G_BLOCK"] * tile["GS_BLOCK"]), **launch)
        return outputs
    r_block = triton.next_power_of_2(N)
    _router_align_kernel[(1,)](
        logits, expert_bias, *outputs, N, *scalars, R_BLOCK=r_block, **tile, **align, PDL=pdl,
        num_warps=_num_warps(r_block * tile["G_BLOCK"] * tile["GS_BLOCK"]), **launch)
    return outputs


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
