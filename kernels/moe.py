"""Fused-MoE Triton kernels: grouped up/down GEMMs over moe_align's blocks, SwiGLU, and the weighted combine.

Jobs (reference ops in lingc/ops/moe.py; letters N tokens, k experts per token, NP = N*k pairs, h hidden,
I expert width, E experts, BM = block_m):
    moe_up        x [N, h] @ w13[e].T for every pair -> [NP, 2I]               (grouped GEMM, plain epilogue)
    moe_up_act    the same on gate/up-interleaved w13, SwiGLU in the epilogue -> [NP, I]
    silu_and_mul  SwiGLU of [gate | up] halves: [..., 2I] -> [..., I]
    moe_down      act [NP, I] @ w2[e].T for every pair -> [NP, h]               (grouped GEMM, unweighted)
    moe_combine   sum_j w[n, j] * expert_out[n*k + j] in fp32, cast, + shared_out -> [N, h]
                  (no shared_out after fuse_shared_expert: the shared expert is pair j = k-1, weight 1.0, and the
                  fp32 sum is cast once)

Grouped GEMM: one program per (N-tile, block of BM sorted rows). It reads `total` and exits at once when its
block starts at or past it, else reads the block's expert from block_expert and its BM pair indices from
sorted_pairs, masks the sentinel rows (pair >= NP), loads A rows `pair // top_k` (x for the up-GEMM, top_k = 1
for the down-GEMM reading act rows), streams the expert's [BLOCK_N, K] weight tile once in BLOCK_K steps
through `tl.dot` on a TILE_M = max(16, BM) row tile (16 is the tensor cores' minimum M), and stores only the
valid pair rows. The grid has min(blocks, NP) block rows (no more can be in use: an expert with c pairs owns
ceil(c / BM) <= c blocks), so at decode (8 pairs on 8 experts) every program does work.

Numerics:
  * GEMMs accumulate in fp32 and round once to the activation dtype. BLOCK_K, the row tile and the dot
    instruction are fixed (never chosen from NP), and each output element is its own row-by-column dot, so
    a pair row's bits do not depend on its position in a block, on the other pairs, or on NP (decode == verify).
    One exception, measured rather than built in: the pair grid (verify, extend) runs swap-AB tiles on tensor cores
    (UP_PAIRS_CONFIG / DOWN_PAIRS_CONFIG: the weight tile as the MMA's M operand, another instruction) where
    decode's aligned launches run the unswapped ones; on the H200 the two give the same bits at 1-16 tokens
    (bench/results/kernels-moe-swap-h200-20261202.json), and the step benchmark's greedy parity (NEXTN == plain
    decoding) checks it end to end. IEEE dots keep one tiling for both.
    Against the reference (F.linear / bmm per pair) the summation order differs: tolerance, not bits.
    bf16/fp16 GEMMs use the tensor cores (mma with fp32 accumulation); fp32 inputs, and every dtype under the
    interpreter (its tl.dot cannot multiply bf16, which it stores as uint16), run an IEEE fp32 dot instead.
  * SwiGLU as `swiglu` in lingc/ops/moe.py: gate and up (already rounded to the activation dtype, exactly as
    moe_up stores them) widened to fp32, silu = g / (1 + exp(-g)) with an IEEE division, clamped when
    limit > 0 (min(silu, L) * clamp(u, -L, L)), one rounding of the product. The fused epilogue rounds the
    fp32 accumulators to the activation dtype first, so moe_up_act == silu_and_mul(moe_up) bit for bit.
    On CUDA, exp is libdevice's __nv_expf without FTZ and division is div.rn, which is what torch's CUDA silu
    compiles to (expf / IEEE division), so silu_and_mul is meant to be bit-exact vs the reference there;
    the interpreter (no libdevice) uses tl.exp, so on CPU it is within tolerance.
  * moe_combine: products w * float(e) rounded in fp32 (kernels launch with fp fusion off: no FMA
    contraction), summed over j in a fixed order, cast, then + shared_out in fp32 rounded once (torch's
    low-precision add). The order is `COMBINE_ORDER[device type]`: torch's CPU sum over the k axis is
    sequential (for h a multiple of its vector chunk), torch's CUDA reduction keeps 4 accumulators
    (acc[j % 4] += p_j, then ((acc0 + acc1) + acc2) + acc3); matching the device's order makes the kernel
    bit-exact vs the reference formula. Either order is row invariant.

Bytes moved at decode (bf16, Ling-3.0-tiny h=1536, I=512, 8 distinct experts): moe_up / moe_up_act read
8 x 2I x h x 2 B = 25.2 MB of w13 (+ x, out: KB); moe_down reads 8 x h x I x 2 B = 12.6 MB of w2; silu_and_mul
and moe_combine move KB. In general: distinct experts x expert bytes (+ activations).

PDL placement (shared/docs/kernels.md section 1.5): with the constexpr PDL on, `gdc_wait()` comes first in
every kernel, since even the GEMMs' weight tiles depend on block_expert, written by moe_align / router_align, and
all stores follow it. One optional exception before the wait, a hint: the down-GEMM (PREFETCH,
LINGC_MOE_DOWN_PREFETCH=1; off by default: the H200 step measured slower with it, see DOWN_PREFETCH) reads total
and its block's expert through L2 and asks L2 for its whole [BLOCK_N, K] weight tile. The align that wrote them is
two kernels back (align -> up-GEMM -> down-GEMM): the down-GEMM launches only when every up-GEMM program has passed
its own wait (the trigger follows the wait), so the align has completed and the tile is right, and its 12.6 MB
stream while the up-GEMM runs. Correctness never depends on it: the tile is loaded again after the wait, and a stale
expert id (PDL off upstream) would only waste bandwidth. The down-GEMM's PRELOAD (on by default at decode's pair
counts, DOWN_PRELOAD) goes further on the same grounds: before the wait it reads total and its block's expert (.cg)
and loads its whole weight tile into registers; after the wait only the act rows. Here correctness does rely on the
align being complete, so the pdl pass launches a moe_down without PDL where the launch just before it produced or
wrote its align (passes/pdl.py PREWAIT_INPUTS; never in lingc's graphs, where the up-GEMM sits between). With PDL
off the loads are stream-ordered anyway. The up-GEMM's SHARED_EARLY (moe_up_act's shared_last, a hint of
fuse_shared_expert, at one token) computes the fused shared expert's tile before the wait: at one token that expert
owns block top_k - 1 and pair top_k - 1 whatever the routing, so the tile reads nothing the align wrote, only x
(moe_up_act_pairs' likewise at any token count: program row top_k - 1 is token 0's shared pair),
which the norm before the router wrote two launches back; the wait comes right before its stores (the output may
reuse memory an earlier kernel still reads), then the trigger. The pdl pass launches a moe_up_act without PDL where
the launch just before it produced or wrote x (PREWAIT_INPUTS). `gdc_launch_dependents()` follows the last load of
data an earlier kernel wrote (the K loop's A rows, the SwiGLU inputs, the combine inputs). With PDL off no GDC call
is emitted (the interpreter cannot run them).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from lingc.knobs import env_flag
from lingc.kernels import moe_tma, router_gluon
from lingc.kernels.pdl import (late_trigger, pdl_launch_next, pdl_supported, pdl_trigger, pdl_trigger_late, pdl_wait,
                               pdl_wait_late, prefetch_l2)
from lingc.kernels.rmsnorm import _add_rmsnorm_row, _num_warps as _norm_warps
import lingc.ops  # noqa: F401  (registers torch.ops.lingc.*, used by the references)
from lingc.ops.moe import PAIR_GRID_PICKS, PAIR_GRID_TOKENS, align_sizes


class GemmConfig(NamedTuple):
    """Tiling of a grouped GEMM. block_k changes the summation order: fixed per model, never chosen from NP."""
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    swap_ab: bool = False    # the dot as W [BN, BK] @ A^T [BK, TILE_M] (the weight as the MMA's M operand); no preload


# Tunables. Decode has 8 active blocks, so the N-tiles must supply the CTAs: the up-GEMM (N = 2I = 1024)
# gets 8 x 32 = 256 programs, the down-GEMM (N = h = 1536) 8 x 48 = 384, each streaming a 32-row weight
# tile over K in 256-byte rows with 3 tiles in flight (num_stages 4; the down-GEMM's K = I = 512 is only 4 tiles, and
# 3 stages measured best there: 5.8 vs 6.1 us at 1 token, 18.7 vs 20.7 at 6, 50.2 vs 51.6 at 64, same bits, stages
# do not enter the arithmetic; bench/results/kernels-moe-stages-h200-20261130.json).
# Every other decode up-GEMM tiling tried in the step since (H100, 2026-12-06, one process each,
# step-ab-h100-20261206-combine-late.json / -b.json) was slower, greedy decode against 1.305-1.314 ms: 3 stages
# 1.349, 6 stages 1.348, 8 warps 1.348, block_k 256 at 3 stages 1.340. Nor did other tile widths help (H100,
# 2026-12-06, step-ab-h100-20261206-moe-block-n.json, greedy decode against 1.3067 / 1.3088 ms): the up-GEMM at
# block_n 16 (576 programs) 1.330, at 16 with 6 stages 1.349; the down-GEMM at 16 1.397, at 64 1.319; both at 16 1.428.
# The up-GEMM at 2 warps: 1.3290 against 1.3175-1.3193 (another H100, step-ab-h100-20261206-launch-shapes.json).
UP_CONFIG = GemmConfig(block_n=32, block_k=128, num_warps=4, num_stages=4)     # moe_up and moe_up_act
DOWN_CONFIG = GemmConfig(block_n=32, block_k=128, num_warps=4, num_stages=3)   # moe_down
# The pair grid's tilings (moe_up_act_pairs / moe_down_pairs: verify and extend, 2-16 tokens): swap-AB, 64 weight
# rows a program, 3 stages. On the H200 (bf16) they give the unswapped tiles' bits at 1-16 tokens, and at 6 tokens
# with the shared expert (54 pairs) the up-GEMM took 34.4 vs 36.5-37.0 us, the down-GEMM 18.7 vs 20.1
# (bench/results/kernels-moe-swap-h200-20261202.json). The step, greedy verify: 2.388 -> 2.316 ms (the up-GEMM's
# alone: 2.355; step-ab-h200-20261202-d.json). At one token (decode's aligned launches) the swapped tiling was slower
# (10.9 vs 10.6 us; decode 1.226 vs 1.193 ms with 144 programs; -c.json), so UP_CONFIG / DOWN_CONFIG stay unswapped.
# IEEE dots (fp32 inputs, the interpreter) ignore these and run UP_CONFIG / DOWN_CONFIG: there the orientation
# changes the summation order, and the pair grid must keep the aligned launches' bits.
UP_PAIRS_CONFIG = GemmConfig(block_n=64, block_k=128, num_warps=4, num_stages=3, swap_ab=True)
DOWN_PAIRS_CONFIG = GemmConfig(block_n=64, block_k=128, num_warps=4, num_stages=3, swap_ab=True)
# the down-GEMM's pre-wait L2 prefetch: off by default. With it and the MLA split's on, the H200 decode step measured
# 1.538 ms against 1.485 without both (bench/results/step-ab-h200-20261130-c.json); with it alone 1.474 against 1.413
# (NEXTN 4.079 vs 3.987 ms; step-ab-h200-20261130-e.json). LINGC_MOE_DOWN_PREFETCH=1 turns it on
DOWN_PREFETCH = env_flag("LINGC_MOE_DOWN_PREFETCH", False)
# the down-GEMM's register preload of its whole weight tile, before its PDL wait, so the tile streams from HBM while
# the up-GEMM runs. Only at <= PRELOAD_MAX_PAIRS pairs (a decode step's 9) and K <= PRELOAD_MAX_K: the H200 step
# (bench/results/step-ab-h200-20261201.json) measured decode 1.328 vs 1.356 ms with it, but verify (54 pairs, ~2000
# programs whose early-resident preloads crowd the up-GEMM) 2.727 vs 2.638. It never changes bits (same chunks, same
# order of dots), so the pair count may choose it. PDL launches only: without PDL nothing overlaps the preload and
# the unpipelined chunk loop is slower (8.8 vs 6.4 us a launch in the PDL-off attribution,
# bench/results/launches-h200-20261201.json). LINGC_MOE_DOWN_PRELOAD=0 turns it off.
DOWN_PRELOAD = env_flag("LINGC_MOE_DOWN_PRELOAD", True)
# TILE_PREFETCH: after the wait and the expert lookup, each program asks L2 for its whole [BLOCK_N, K] weight tile
# (one prefetch.global.L2 a 128 B line: 96 KB a decode up-GEMM program, all 28 MB of the step's picks at once) before
# its K loop streams the tile 3 stages deep; nothing else streams then (the router has finished), so it only brings the
# requests forward. Bench A/B knobs, off: measured slower on an H100 (2026-12-05; the decode up-GEMM alone 13.7-14.3
# vs 11.6 us, bench/results/kernel-l2-prefetch-experts-h100-20261205.json; greedy decode / verify 1.3764 / 2.8811 ms up
# only, 1.3754 / 2.9247 with the down-GEMM's, against 1.3371 / 2.6375, step-ab-prefetch-h100-20261205.json): the line
# prefetches issued ahead of the K loop delay it. The down-GEMM's applies where it does not preload (verify's pair
# grid). Never changes bits (a hint). LINGC_MOE_UP_TILE_PREFETCH=1 / LINGC_MOE_DOWN_TILE_PREFETCH=1
UP_TILE_PREFETCH = env_flag("LINGC_MOE_UP_TILE_PREFETCH", False)
DOWN_TILE_PREFETCH = env_flag("LINGC_MOE_DOWN_TILE_PREFETCH", False)
# the up-GEMM's shared-expert tile before the PDL wait (shared_last, SHARED_EARLY in _moe_gemm_kernel; moe_up_act at
# one token, moe_up_act_pairs at any): the fused shared expert's 3 MB of w13 stream while the router routes, off the
# up-GEMM's post-wait path. Same bits. It paid behind router.py's ~3 us pick-chain router (greedy decode 1.199 ->
# 1.191 ms, step-ab-h200-20261203.json) and costs behind the Gluon router (kernels/router_gluon.py, ~1.9 us): greedy
# decode 1.1545 / 1.1532 ms without it against 1.191 / 1.185 and 1.188 / 1.188 with it, NEXTN and verify level
# (step-ab-h200-20261203-p.json). So "auto" (the default) runs it only where the Gluon router does not route the
# layer (judged from the device and the stack's routed experts, one fused shared expert assumed); LINGC_MOE_SHARED_EARLY
# =1 / =0 forces it on / off. Forced on behind the Gluon router on an H100 (2026-12-06): greedy decode 1.3407 against
# 1.3175-1.3193 ms (step-ab-h100-20261206-launch-shapes.json)
SHARED_EARLY = os.environ.get("LINGC_MOE_SHARED_EARLY", "auto").strip().lower() or "auto"
if SHARED_EARLY not in ("auto", "1", "0"):
    raise ValueError(f"environment variable LINGC_MOE_SHARED_EARLY={SHARED_EARLY!r}: want auto, 1 or 0")
# Where the SHARED_EARLY rows let the next kernel launch: in pdl_wait, after their compute. Triggering at entry
# instead (the routed rows still trigger after their wait) measured level on the H200 (decode 1.199 / 1.189 against
# 1.190-1.193 ms, NEXTN level; bench/results/step-ab-h200-20261203-b.json), so that knob was removed.
PRELOAD_MAX_K = 512          # 4 chunks of [128, 32] bf16: 64 registers a thread at 4 warps
PRELOAD_MAX_PAIRS = 16
# the pair grid (moe_up_act_pairs / moe_down_pairs, fuse_align_into_moe): one program row per (token, expert) pair,
# the expert's first pair doing the expert's rows; at most PAIR_GRID_TOKENS tokens (a token per row slot of the
# MIN_TILE_M tile) and PAIR_GRID_PICKS pairs a token (lingc/ops/moe.py); past either, the launcher aligns the ids
PAIR_GRID_FALLBACK_BM = 16   # block_m of that fallback (lingc.modules.MOE_BLOCK_M)
PREFETCH_LINE = 64           # elements per prefetch request (128 B of bf16)
MIN_TILE_M = 16              # tl.dot needs M >= 16; smaller block_m is padded with masked rows
ACT_BLOCK = 1024             # silu_and_mul: output columns per program (I = 512: one program per row)
ACT_NUM_WARPS = 4
COMBINE_BLOCK_H = 512        # moe_combine: hidden columns per program
COMBINE_NUM_WARPS = 4
SEQUENTIAL, INTERLEAVE4 = 0, 1   # moe_combine summation orders over k (see the module docstring)
COMBINE_ORDER = {"cpu": SEQUENTIAL, "cuda": INTERLEAVE4}
# no FMA contraction (products and sums round separately, as torch's kernels do); libdevice exp without FTZ
FP_OPTIONS = {"enable_fp_fusion": False, "enable_reflect_ftz": False}


@triton.jit
def _swiglu(gate, up, limit, HAS_LIMIT: tl.constexpr, LIBDEVICE_EXP: tl.constexpr):
    """silu(gate) * up in fp32 (clamped when HAS_LIMIT), unrounded; gate and up in any float dtype."""
    g = gate.to(tl.float32)
    u = up.to(tl.float32)
    if LIBDEVICE_EXP:
        e = tl.extra.cuda.libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    act = tl.math.div_rn(g, 1.0 + e)
    if HAS_LIMIT:
        act = tl.minimum(act, limit, propagate_nan=tl.PropagateNan.ALL)
        u = tl.minimum(tl.maximum(u, -limit, propagate_nan=tl.PropagateNan.ALL), limit,
                       propagate_nan=tl.PropagateNan.ALL)
    return act * u


@triton.jit
def _acc_dot(a, w, acc, IEEE_DOT: tl.constexpr):
    """acc + a @ w on tensor cores, or in full fp32 (IEEE_DOT: fp32 weights, the interpreter)."""
    if IEEE_DOT:
        return tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, w, acc)


@triton.jit
def _preload_tile(w_ptr, block_expert_ptr, pid_m, pid_n, N, K, stride_we, stride_wn,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_CHUNKS: tl.constexpr):
    """PRELOAD: the program's whole weight tile as K_CHUNKS [BLOCK_K, BLOCK_N] chunks in registers, the values
    _gemm_tile's loop loads (zeros past K and N). block_expert through L2 (.cg): under PDL this runs before the
    wait, and its writer (the align) is two kernels back (module docstring)."""
    expert = tl.load(block_expert_ptr + pid_m, cache_modifier=".cg").to(tl.int64)
    return _preload_expert_tile(w_ptr, expert, pid_n, N, K, stride_we, stride_wn, BLOCK_N, BLOCK_K, K_CHUNKS)


@triton.jit
def _preload_expert_tile(w_ptr, expert, pid_n, N, K, stride_we, stride_wn,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_CHUNKS: tl.constexpr):
    """_preload_tile of a known expert."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]  # [BK, BN]
    ws = ()
    for c in tl.static_range(K_CHUNKS):
        mask = (c * BLOCK_K + offs_k < K)[:, None] & (offs_n < N)[None, :]
        ws = ws + (tl.load(w_ptrs + c * BLOCK_K, mask=mask, other=0.0, eviction_policy="evict_first"),)
    return ws


@triton.jit
def _block_rows(sorted_ptr, block_expert_ptr, pid_m, num_pairs, BLOCK_M: tl.constexpr, TILE_M: tl.constexpr,
                CG: tl.constexpr = False):
    """Block pid_m's expert and its TILE_M pair indices (num_pairs past BLOCK_M); in range for every block of
    the grid, in use or not, so a kernel may load them together with `total` (one L2 round trip, not two).
    CG: through L2 only (.cg), for the down-GEMM's PRELOAD before its PDL wait (module docstring)."""
    offs_m = tl.arange(0, TILE_M)
    if CG:
        expert = tl.load(block_expert_ptr + pid_m, cache_modifier=".cg").to(tl.int64)
        pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + offs_m, mask=offs_m < BLOCK_M, other=num_pairs,
                        cache_modifier=".cg")                                                          # [TILE_M]
    else:
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + offs_m, mask=offs_m < BLOCK_M, other=num_pairs)  # [TILE_M]
    return expert, pairs


@triton.jit
def _pair_rows(ids_ptr, p, num_pairs, PAIR_ROWS: tl.constexpr, TILE_M: tl.constexpr, PR_BLOCK: tl.constexpr,
               CG: tl.constexpr = False):
    """BY_IDS: pair p's expert, whether p is that expert's first pair (flat order), and the expert's pairs as a
    [TILE_M] row tile, slot r holding token r's pair (num_pairs where token r did not pick the expert). A token
    picks an expert at most once (router_topk's ids are distinct per row), so a slot holds at most one pair and an
    earlier pair of the expert is an earlier token's; the launcher keeps N <= TILE_M. The expert is a scalar load
    (the weight addresses wait on nothing else); the ids as a [TILE_M, PR_BLOCK] (token, pick) tile beside it.
    CG: through L2 only (.cg), for the down-GEMM's PRELOAD before its PDL wait (module docstring)."""
    rows = tl.arange(0, TILE_M)
    cols = tl.arange(0, PR_BLOCK)
    idx = rows[:, None] * PAIR_ROWS + cols[None, :]                                     # [TILE_M, PR_BLOCK]
    mask = (cols < PAIR_ROWS)[None, :] & (idx < num_pairs)
    if CG:
        expert = tl.load(ids_ptr + p, cache_modifier=".cg")
        ids = tl.load(ids_ptr + idx, mask=mask, other=-1, cache_modifier=".cg")
    else:
        expert = tl.load(ids_ptr + p)
        ids = tl.load(ids_ptr + idx, mask=mask, other=-1)
    pairs = tl.min(tl.where(ids == expert, idx, num_pairs), axis=1)                    # [TILE_M]; -1 never matches
    first = tl.sum(((pairs < num_pairs) & (rows < p // PAIR_ROWS)).to(tl.int32), axis=0) == 0
    return expert.to(tl.int64), pairs, first


@triton.jit
def _loop_masks(valid, n_ok, k_ok, EVEN_K: tl.constexpr, SWAP_AB: tl.constexpr):
    """(A mask, W mask) of one BLOCK_K step of _gemm_tile_rows' loop: A [TILE_M, BK] and W [BK, BN], or their
    transposes under SWAP_AB; EVEN_K: every K column in range (no K mask)."""
    if SWAP_AB:
        if EVEN_K:
            a_mask, w_mask = valid[None, :], n_ok[:, None]
        else:
            a_mask, w_mask = valid[None, :] & k_ok[:, None], n_ok[:, None] & k_ok[None, :]
    else:
        if EVEN_K:
            a_mask, w_mask = valid[:, None], n_ok[None, :]
        else:
            a_mask, w_mask = valid[:, None] & k_ok[None, :], k_ok[:, None] & n_ok[None, :]
    return a_mask, w_mask


@triton.jit
def _gemm_tile(a_ptr, w_ptr, out_ptr, sorted_ptr, block_expert_ptr, pid_m, pid_n,
               num_pairs, N, K, stride_am, stride_we, stride_wn, stride_om, limit,
               TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, TILE_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
               SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr, IEEE_DOT: tl.constexpr,
               LIBDEVICE_EXP: tl.constexpr, A_CG: tl.constexpr, ws, K_CHUNKS: tl.constexpr):
    """One grouped-GEMM tile: N-tile pid_n of block pid_m (which must be in use), stored. Shared by
    _moe_gemm_kernel and kernels/moe_fused.py, so the two give a tile the same bits. A_CG loads the A rows
    through L2 only (.cg): the fused kernel's down tiles read rows other programs of the same launch wrote.
    K_CHUNKS > 0: the weight tile is `ws` (_preload_tile), the same chunks in the same order of dots."""
    expert, pairs = _block_rows(sorted_ptr, block_expert_ptr, pid_m, num_pairs, BLOCK_M, TILE_M)
    _gemm_tile_rows(a_ptr, w_ptr, out_ptr, expert, pairs, pid_n, num_pairs, N, K, stride_am, stride_we, stride_wn,
                    stride_om, limit, TOP_K, TILE_M, BLOCK_N, BLOCK_K, EVEN_K, SWIGLU, HAS_LIMIT, IEEE_DOT,
                    LIBDEVICE_EXP, A_CG, ws, K_CHUNKS)


@triton.jit
def _gemm_tile_rows(a_ptr, w_ptr, out_ptr, expert, pairs, pid_n,
                    num_pairs, N, K, stride_am, stride_we, stride_wn, stride_om, limit,
                    TOP_K: tl.constexpr, TILE_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                    SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr, IEEE_DOT: tl.constexpr,
                    LIBDEVICE_EXP: tl.constexpr, A_CG: tl.constexpr, ws, K_CHUNKS: tl.constexpr,
                    SWAP_AB: tl.constexpr = False, WAIT_STORE: tl.constexpr = False):
    """_gemm_tile on a block's expert and pairs already loaded (_block_rows). WAIT_STORE: the PDL wait goes right
    before the stores (a tile computed before the wait: _moe_gemm_kernel's SHARED_EARLY). SWAP_AB (the pipelined
    loop only): the dot runs as acc^T [BLOCK_N, TILE_M] += W [BLOCK_N, BK] @ A^T [BK, TILE_M], the weight tile as the
    MMA's M operand (at BLOCK_N >= 64 and 4 warps a Hopper wgmma reading both operands from shared memory), then one
    transpose before the epilogue. Each output element is still its own row-by-column dot over the same BLOCK_K
    steps, the same for every row count; on the H200 (bf16) its bits equal the unswapped tile's (measured, not
    guaranteed by construction: another MMA instruction), while an IEEE (fp32) dot's summation order differs."""
    valid = pairs < num_pairs
    rows = tl.where(valid, pairs // TOP_K, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]                                    # [TILE_M, BK]
    w_ptrs = w_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]  # [BK, BN]
    acc = tl.zeros((TILE_M, BLOCK_N), dtype=tl.float32)
    for c in tl.static_range(K_CHUNKS):                      # PRELOAD: every A chunk at once, then the dots
        a_mask = valid[:, None] & (c * BLOCK_K + offs_k < K)[None, :]
        if A_CG:
            a = tl.load(a_ptrs + c * BLOCK_K, mask=a_mask, other=0.0, cache_modifier=".cg")
        else:
            a = tl.load(a_ptrs + c * BLOCK_K, mask=a_mask, other=0.0)
        acc = _acc_dot(a, ws[c], acc, IEEE_DOT)
    if K_CHUNKS == 0:
        if SWAP_AB:       # A^T [BK, TILE_M] and W [BN, BK] tiles into acc^T [BN, TILE_M], transposed after the loop
            a_ptrs = a_ptr + rows[None, :] * stride_am + offs_k[:, None]
            w_ptrs = w_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
            acc = tl.zeros((BLOCK_N, TILE_M), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a_mask, w_mask = _loop_masks(valid, n_ok, k0 + offs_k < K, EVEN_K, SWAP_AB)
            w = tl.load(w_ptrs, mask=w_mask, other=0.0, eviction_policy="evict_first")
            if A_CG:
                a = tl.load(a_ptrs, mask=a_mask, other=0.0, cache_modifier=".cg")
            else:
                a = tl.load(a_ptrs, mask=a_mask, other=0.0)
            if SWAP_AB:
                acc = _acc_dot(w, a, acc, IEEE_DOT)
            else:
                acc = _acc_dot(a, w, acc, IEEE_DOT)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if SWAP_AB:
            acc = tl.trans(acc)
    h = acc.to(out_ptr.dtype.element_ty)  # the one rounding moe_up stores; the fused epilogue starts from it
    out_rows = out_ptr + pairs.to(tl.int64)[:, None] * stride_om
    if WAIT_STORE:      # the output may reuse memory an earlier kernel still reads: stores only after the wait
        pdl_wait()
    if SWIGLU:
        gate, up = tl.split(tl.reshape(h, (TILE_M, BLOCK_N // 2, 2)))  # interleaved: even columns gate, odd up
        act = _swiglu(gate, up, limit, HAS_LIMIT, LIBDEVICE_EXP).to(out_ptr.dtype.element_ty)
        offs_o = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(out_rows + offs_o[None, :], act, mask=valid[:, None] & (offs_o < N // 2)[None, :])
    else:
        tl.store(out_rows + offs_n[None, :], h, mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _prefetch_expert_tile(w_ptr, expert, pid_n, num_experts, N, K, stride_we, stride_wn, BLOCK_N: tl.constexpr,
                          K_LINES: tl.constexpr, LINE: tl.constexpr):
    """Ask L2 for expert's [BLOCK_N, K] weight tile of N-tile pid_n (one prefetch.global.L2 a 128 B line); the id is
    clamped, so even a stale one names a real expert's lines."""
    expert = tl.minimum(tl.maximum(expert, 0), num_experts - 1).to(tl.int64)
    rows = tl.minimum(pid_n * BLOCK_N + tl.arange(0, BLOCK_N), N - 1).to(tl.int64)
    cols = tl.minimum(tl.arange(0, K_LINES) * LINE, K - 1)
    prefetch_l2(w_ptr + expert * stride_we + rows[:, None] * stride_wn + cols[None, :])


@triton.jit
def _prefetch_tile(w_ptr, block_expert_ptr, total_ptr, pid_m, pid_n, num_experts, N, K, stride_we, stride_wn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, K_LINES: tl.constexpr, LINE: tl.constexpr):
    """PREFETCH (before the wait): ask L2 for the [BLOCK_N, K] weight tile of this program's block, read through L2
    (.cg) from the align two kernels back."""
    total = tl.load(total_ptr, cache_modifier=".cg")
    if pid_m * BLOCK_M < total:
        expert = tl.load(block_expert_ptr + pid_m, cache_modifier=".cg")
        _prefetch_expert_tile(w_ptr, expert, pid_n, num_experts, N, K, stride_we, stride_wn, BLOCK_N, K_LINES, LINE)


@triton.jit
def _moe_gemm_kernel(a_ptr, w_ptr, out_ptr, sorted_ptr, block_expert_ptr, total_ptr,
                     num_pairs, num_experts, N, K, stride_am, stride_we, stride_wn, stride_om, limit,
                     TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, TILE_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                     SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr, IEEE_DOT: tl.constexpr,
                     LIBDEVICE_EXP: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
                     K_LINES: tl.constexpr, LINE: tl.constexpr, K_CHUNKS: tl.constexpr = 0,
                     BY_IDS: tl.constexpr = False, PAIR_ROWS: tl.constexpr = 1, PR_BLOCK: tl.constexpr = 16,
                     SWAP_AB: tl.constexpr = False, SHARED_EARLY: tl.constexpr = False,
                     TILE_PREFETCH: tl.constexpr = False):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    ws = ()
    if SHARED_EARLY:
        # the stack's last expert is a fused shared one (the launcher's shared_last), pair TOP_K - 1 of every token,
        # and program row TOP_K - 1 runs its GEMM for every token: on the pair grid (BY_IDS) that row is token 0's
        # shared pair, the expert's first (the other shared rows exit); aligned, at one token, it is the shared
        # expert's block (moe_align's layout at one token, whatever the routing: each routed pick owns one block, in
        # expert order, the shared expert E after them) with its one pair. The tile needs nothing the router or the
        # align wrote, and x is two launches back (the norm before the router), so under PDL it runs before the
        # wait, which comes right before its stores (module docstring). Same rows, same tile: same bits
        if pid_m % TOP_K == TOP_K - 1:
            if pid_m == TOP_K - 1:
                r = tl.arange(0, TILE_M)
                pairs = tl.where(r < num_pairs // TOP_K, r * TOP_K + TOP_K - 1, num_pairs)
                _gemm_tile_rows(a_ptr, w_ptr, out_ptr, (num_experts - 1).to(tl.int64), pairs, pid_n, num_pairs, N,
                                K, stride_am, stride_we, stride_wn, stride_om, limit, TOP_K, TILE_M, BLOCK_N,
                                BLOCK_K, EVEN_K, SWIGLU, HAS_LIMIT, IEEE_DOT, LIBDEVICE_EXP, True, ws, 0, SWAP_AB,
                                PDL)
                if PDL:
                    pdl_trigger()
            return
    if BY_IDS:                # the pair grid (sorted_ptr = the router's ids): program row pid_m = pair pid_m
        if K_CHUNKS > 0:      # PRELOAD: the router is two kernels back, as the align is (module docstring)
            expert, pairs, first = _pair_rows(sorted_ptr, pid_m, num_pairs, PAIR_ROWS, TILE_M, PR_BLOCK, True)
            if not first:
                return
            ws = _preload_expert_tile(w_ptr, expert, pid_n, N, K, stride_we, stride_wn, BLOCK_N, BLOCK_K, K_CHUNKS)
        if PDL:
            pdl_wait()
        if K_CHUNKS == 0:
            expert, pairs, first = _pair_rows(sorted_ptr, pid_m, num_pairs, PAIR_ROWS, TILE_M, PR_BLOCK)
            if not first:
                return
            if TILE_PREFETCH:     # the whole tile asked of L2 at once, ahead of the K loop's pipelined loads
                _prefetch_expert_tile(w_ptr, expert, pid_n, num_experts, N, K, stride_we, stride_wn, BLOCK_N,
                                      K_LINES, LINE)
    else:
        if K_CHUNKS > 0:          # PRELOAD (the down-GEMM): the align is two kernels back, see the module docstring
            total = tl.load(total_ptr, cache_modifier=".cg")
            if pid_m * BLOCK_M >= total:
                return
            ws = _preload_tile(w_ptr, block_expert_ptr, pid_m, pid_n, N, K, stride_we, stride_wn, BLOCK_N, BLOCK_K,
                               K_CHUNKS)
            # the block's pairs too (the same align wrote them): after the wait only the act rows
            expert, pairs = _block_rows(sorted_ptr, block_expert_ptr, pid_m, num_pairs, BLOCK_M, TILE_M, True)
        if PDL:
            if PREFETCH:
                _prefetch_tile(w_ptr, block_expert_ptr, total_ptr, pid_m, pid_n, num_experts, N, K, stride_we,
                               stride_wn, BLOCK_M, BLOCK_N, K_LINES, LINE)
            pdl_wait()
    if K_CHUNKS == 0 and not BY_IDS:
        # total, the block's expert and its pairs in one L2 round trip, not two (the block exists whether in use or
        # not). Same bits as loading them after the check; with the held norm input (kernels/linear.py) and the
        # 16-warp norms, decode 1.231 -> 1.211 / 1.220 ms on the H200 (step-ab-h200-20261201-j.json; alone: noise)
        expert, pairs = _block_rows(sorted_ptr, block_expert_ptr, pid_m, num_pairs, BLOCK_M, TILE_M)
        total = tl.load(total_ptr)
        if pid_m * BLOCK_M >= total:
            return
        if TILE_PREFETCH:         # the whole tile asked of L2 at once, ahead of the K loop's pipelined loads
            _prefetch_expert_tile(w_ptr, expert, pid_n, num_experts, N, K, stride_we, stride_wn, BLOCK_N, K_LINES,
                                  LINE)
    _gemm_tile_rows(a_ptr, w_ptr, out_ptr, expert, pairs, pid_n, num_pairs, N, K, stride_am, stride_we, stride_wn,
                    stride_om, limit, TOP_K, TILE_M, BLOCK_N, BLOCK_K, EVEN_K, SWIGLU, HAS_LIMIT, IEEE_DOT,
                    LIBDEVICE_EXP, False, ws, K_CHUNKS, SWAP_AB)
    if PDL:
        pdl_trigger()


@triton.jit
def _silu_and_mul_kernel(h_ptr, out_ptr, stride_h, stride_o, inter, limit,
                         BLOCK: tl.constexpr, HAS_LIMIT: tl.constexpr, LIBDEVICE_EXP: tl.constexpr,
                         PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    if PDL:
        pdl_wait()
    gate = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0)
    up = tl.load(h_ptr + row * stride_h + inter + cols, mask=mask, other=0.0)
    if PDL:
        pdl_trigger()
    act = _swiglu(gate, up, limit, HAS_LIMIT, LIBDEVICE_EXP).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, act, mask=mask)


@triton.jit
def _routed_sum(e_ptr, w_ptr, local_ptr, n, cols, mask, stride_e, stride_w, stride_l, TOP_K: tl.constexpr,
                ORDER: tl.constexpr, HAS_LOCAL: tl.constexpr, E_CG: tl.constexpr, MUL_RN: tl.constexpr):
    """sum_j w[n, j] * expert_out[n*k + j, cols] in fp32, in the order ORDER (unrounded). MUL_RN: each product as
    an explicit round-to-nearest multiply, which no fp-fusion setting contracts into an FMA (kernels compiled with
    fusion on use it to keep the combine kernel's bits, which launches with fusion off)."""
    # HAS_LOCAL (ep_combine, kernels/ep.py): pair j counts only where local_ids[n, j] >= 0; another rank's pair
    # contributes exactly +0.0 (as the reference) and its expert row is never loaded
    acc0 = tl.zeros(cols.shape, dtype=tl.float32)
    acc1 = tl.zeros(cols.shape, dtype=tl.float32)
    acc2 = tl.zeros(cols.shape, dtype=tl.float32)
    acc3 = tl.zeros(cols.shape, dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        w = tl.load(w_ptr + n * stride_w + j).to(tl.float32)
        e_mask = mask
        if HAS_LOCAL:
            mine = tl.load(local_ptr + n * stride_l + j) >= 0
            e_mask = mask & mine
        if E_CG:
            e = tl.load(e_ptr + (n * TOP_K + j) * stride_e + cols, mask=e_mask, other=0.0,
                        cache_modifier=".cg").to(tl.float32)
        else:
            e = tl.load(e_ptr + (n * TOP_K + j) * stride_e + cols, mask=e_mask, other=0.0).to(tl.float32)
        if MUL_RN:
            p = tl.extra.cuda.libdevice.mul_rn(e, w)
        else:
            p = e * w
        if HAS_LOCAL:
            p = tl.where(mine, p, 0.0)
        if ORDER == 0:
            acc0 = acc0 + p
        else:  # accumulator j % 4 (torch's CUDA reduction with 4 accumulators per thread)
            if j % 4 == 0:
                acc0 = acc0 + p
            elif j % 4 == 1:
                acc1 = acc1 + p
            elif j % 4 == 2:
                acc2 = acc2 + p
            else:
                acc3 = acc3 + p
    routed = acc0
    if ORDER == 1:
        routed = ((acc0 + acc1) + acc2) + acc3
    return routed


@triton.jit
def _combine_row(e_ptr, w_ptr, local_ptr, s_ptr, out_ptr, n, cols, mask, stride_e, stride_w, stride_l, stride_s,
                 stride_o, TOP_K: tl.constexpr, ORDER: tl.constexpr, HAS_SHARED: tl.constexpr,
                 HAS_LOCAL: tl.constexpr, E_CG: tl.constexpr, PDL: tl.constexpr):
    """moe_combine of token n over the columns cols: stored. Shared by _moe_combine_kernel, kernels/ep.py (HAS_LOCAL)
    and kernels/moe_fused.py (E_CG: expert rows other programs of the same launch wrote, loaded through L2 only).
    Elementwise per column, so the bits do not depend on how many columns a program takes."""
    routed = _routed_sum(e_ptr, w_ptr, local_ptr, n, cols, mask, stride_e, stride_w, stride_l, TOP_K, ORDER,
                         HAS_LOCAL, E_CG, False)
    if HAS_SHARED:
        shared = tl.load(s_ptr + n * stride_s + cols, mask=mask, other=0.0)
    if PDL:
        pdl_trigger()
    out_ty = out_ptr.dtype.element_ty
    if HAS_SHARED:
        out = (routed.to(out_ty).to(tl.float32) + shared.to(tl.float32)).to(out_ty)
    else:
        out = routed.to(out_ty)
    tl.store(out_ptr + n * stride_o + cols, out, mask=mask)


@triton.jit
def _moe_combine_kernel(e_ptr, w_ptr, local_ptr, s_ptr, out_ptr, H, stride_e, stride_w, stride_l, stride_s, stride_o,
                        TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, ORDER: tl.constexpr, HAS_SHARED: tl.constexpr,
                        PDL: tl.constexpr, HAS_LOCAL: tl.constexpr = False):
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    if PDL:
        pdl_wait()
    _combine_row(e_ptr, w_ptr, local_ptr, s_ptr, out_ptr, n, cols, mask, stride_e, stride_w, stride_l, stride_s,
                 stride_o, TOP_K, ORDER, HAS_SHARED, HAS_LOCAL, False, PDL)


@triton.jit
def _combine_add_rmsnorm_kernel(e_ptr, w_ptr, res_ptr, nw_ptr, out_ptr, res_out_ptr, H, stride_e, stride_w,
                                stride_res, stride_out, stride_res_out, eps,
                                TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, ORDER: tl.constexpr,
                                MUL_RN: tl.constexpr, PDL: tl.constexpr, ENTRY_TRIGGER: tl.constexpr,
                                LATE_TRIGGER: tl.constexpr = False):
    """combine_add_rmsnorm of token n: the combine's row (as _combine_row, cast to the activation dtype), then
    kernels/rmsnorm.py's add + norm row code on it; one program per token holds the whole row. LATE_TRIGGER (PDL,
    not with ENTRY_TRIGGER): the trigger after the row's loads, not right after the wait (kernels/pdl.py
    LATE_TRIGGER_ROWS)."""
    if PDL:
        if ENTRY_TRIGGER:   # the next launch (a projection) reads only weights before its wait (kernels/pdl.py)
            pdl_launch_next()
    n = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    nw = tl.load(nw_ptr + cols, mask=mask, other=0.0)
    if PDL:
        pdl_wait_late(LATE_TRIGGER)
    routed = _routed_sum(e_ptr, w_ptr, w_ptr, n, cols, mask, stride_e, stride_w, 0, TOP_K, ORDER, False, False,
                         MUL_RN)
    res = tl.load(res_ptr + n * stride_res + cols, mask=mask, other=0.0)
    if PDL:
        pdl_trigger_late(LATE_TRIGGER)
    _add_rmsnorm_row(res, routed.to(res.dtype), nw, out_ptr + n * stride_out, res_out_ptr + n * stride_res_out, cols,
                     mask, H, eps)


def _interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


def _ieee_dot(a: torch.Tensor) -> bool:
    """Whether the GEMMs run an IEEE fp32 dot (fp32 inputs, or the interpreter, which cannot multiply bf16) rather
    than tensor-core MMAs."""
    return _interpreting() or a.dtype == torch.float32


def _float_dtype(t: torch.Tensor, op: str, name: str) -> None:
    if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{op}: {name} must be float32, bfloat16 or float16, got {t.dtype}")


def _check_align(op: str, sorted_pairs: torch.Tensor, block_expert: torch.Tensor, total: torch.Tensor,
                 num_pairs: int, num_experts: int, block_m: int) -> None:
    """moe_align's outputs must be int32 vectors of the sizes align_sizes gives for these NP, E, BM."""
    if block_m < 1:
        raise ValueError(f"{op}: block_m must be >= 1, got {block_m}")
    max_padded, blocks = align_sizes(num_pairs, num_experts, block_m)
    for name, t, n in (("sorted_pairs", sorted_pairs, max_padded), ("block_expert", block_expert, blocks),
                       ("total", total, 1)):
        if t.dtype != torch.int32 or t.shape != (n,):
            raise ValueError(f"{op}: {name} is {list(t.shape)} {t.dtype}, want [{n}] int32 "
                             f"(moe_align of {num_pairs} pairs, {num_experts} experts, block_m {block_m})")


def _out(op: str, out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if out.shape != shape or out.dtype != like.dtype or not out.is_contiguous():
        raise ValueError(f"{op}: out is {list(out.shape)} {out.dtype}, want contiguous {list(shape)} {like.dtype}")
    return out


def preload_chunks(preload: bool, k: int, block_k: int, num_pairs: int) -> int:
    """K chunks of a weight tile preloaded into registers (K_CHUNKS): all of them where `preload` is asked for,
    K <= PRELOAD_MAX_K and there are at most PRELOAD_MAX_PAIRS pairs; else 0 (the pipelined loop). Shared by the
    down-GEMM and kernels/moe_fused.py's down tiles."""
    return triton.cdiv(k, block_k) if preload and k <= PRELOAD_MAX_K and num_pairs <= PRELOAD_MAX_PAIRS else 0


def _check_gemm(op: str, a: torch.Tensor, w: torch.Tensor, swiglu: bool, config: GemmConfig) -> tuple[int, int, int]:
    """A grouped GEMM's operands (a [R, K], w [E, N, K] of one float dtype, even N for SwiGLU, a sane tiling):
    (E, N, K), or ValueError naming the op."""
    _float_dtype(a, op, "activations")
    if a.dim() != 2 or w.dim() != 3 or w.shape[2] != a.shape[1] or w.dtype != a.dtype:
        raise ValueError(f"{op}: activations {list(a.shape)} {a.dtype} and weights {list(w.shape)} {w.dtype}: "
                         "want [R, K] and [E, N, K] of one dtype")
    num_experts, n, k = w.shape
    if swiglu and n % 2:
        raise ValueError(f"{op}: interleaved w13 has {n} rows, want an even number (gate/up pairs)")
    if config.block_n % 2 or config.block_k < 16 or (config.swap_ab and config.block_n < 16):
        raise ValueError(f"{op}: bad tiling {config}")
    return num_experts, n, k


def _launch_setup(op: str, a: torch.Tensor, w: torch.Tensor, k: int,
                  pdl: bool) -> tuple[torch.Tensor, bool, dict, bool]:
    """For a non-empty launch (K > 0, weights contiguous along K): (a with unit stride along K, pdl where supported,
    the launch keywords, whether the interpreter runs it)."""
    if k == 0:
        raise ValueError(f"{op}: empty reduction (K = 0)")
    if w.stride(2) != 1:
        raise ValueError(f"{op}: weights must be contiguous along K (stride {w.stride()})")
    pdl = pdl and pdl_supported(a.device)
    return a if a.stride(1) == 1 else a.contiguous(), pdl, {"launch_pdl": True} if pdl else {}, _interpreting()


def _grouped_gemm(op: str, a: torch.Tensor, w: torch.Tensor, sorted_pairs: torch.Tensor,
                  block_expert: torch.Tensor, total: torch.Tensor, top_k: int, block_m: int, limit: float,
                  swiglu: bool, pdl: bool, out: torch.Tensor | None, config: GemmConfig,
                  prefetch: bool = False, preload: bool = False, shared_last: bool = False,
                  tile_prefetch: bool = False) -> torch.Tensor:
    """Shared launcher of the three grouped GEMMs: a [R, K] rows (pair p reads row p // top_k), w [E, N, K].
    prefetch: the pre-wait L2 prefetch of the weight tile (PDL only; the down-GEMM, module docstring).
    preload: the whole weight tile into registers first, before the PDL wait (the down-GEMM; K <= PRELOAD_MAX_K and
    at most PRELOAD_MAX_PAIRS pairs).
    shared_last: w's last expert is a fused shared expert, pair top_k - 1 of every row (fuse_shared_expert); at one
    row its tile runs before the PDL wait (SHARED_EARLY), without the align.
    tile_prefetch: after the wait, each program asks L2 for its whole weight tile before its K loop (TILE_PREFETCH;
    a GPU hint, never in the interpreter; programs that preload skip it)."""
    num_experts, n, k = _check_gemm(op, a, w, swiglu, config)
    num_pairs = a.shape[0] * top_k
    _check_align(op, sorted_pairs, block_expert, total, num_pairs, num_experts, block_m)
    out = _out(op, out, (num_pairs, n // 2 if swiglu else n), a)
    if num_pairs == 0 or n == 0:
        return out
    a, pdl, launch, interpret = _launch_setup(op, a, w, k, pdl)
    grid = (triton.cdiv(n, config.block_n), min(block_expert.numel(), num_pairs))
    chunks = preload_chunks(preload and not config.swap_ab, k, config.block_k, num_pairs)
    # one token: the shared expert's block is block top_k - 1
    shared = _shared_early(shared_last and a.shape[0] == 1 and grid[1] == top_k, top_k, chunks, a.device, num_experts)
    if op == "moe_up_act" and config is UP_CONFIG and moe_tma.eligible(
            a, w, block_m, limit, pdl, shared["SHARED_EARLY"] or chunks > 0 or prefetch or tile_prefetch) \
            and moe_tma.launch(a, w, out, sorted_pairs, block_expert, total, top_k, block_m):
        return out      # the Hopper TMA path (kernels/moe_tma.py, opt-in LINGC_MOE_UP_TMA=1): the same tiles of K
    _moe_gemm_kernel[grid](
        a, w, out, sorted_pairs, block_expert, total,
        num_pairs, num_experts, n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0), float(limit),
        TOP_K=top_k, BLOCK_M=block_m, TILE_M=max(MIN_TILE_M, triton.next_power_of_2(block_m)),
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, EVEN_K=k % config.block_k == 0,
        SWIGLU=swiglu, HAS_LIMIT=limit > 0, IEEE_DOT=_ieee_dot(a),
        LIBDEVICE_EXP=a.is_cuda and not interpret, PDL=pdl, PREFETCH=prefetch and pdl,
        K_LINES=triton.next_power_of_2(triton.cdiv(k, PREFETCH_LINE)), LINE=PREFETCH_LINE,
        K_CHUNKS=chunks, SWAP_AB=config.swap_ab, **shared,
        TILE_PREFETCH=tile_prefetch and a.is_cuda and not interpret and chunks == 0,
        num_warps=config.num_warps, num_stages=config.num_stages, **FP_OPTIONS, **launch)
    return out


def _shared_early(shared_last: bool, top_k: int, chunks: int, device: torch.device, num_experts: int) -> dict:
    """The SHARED_EARLY constexpr of an up-GEMM launch whose layout allows the early shared tile (shared_last: the
    caller checked it), from the module's SHARED_EARLY ("1", "0", or "auto": on unless the Gluon router routes this
    stack's num_experts - 1 routed experts on this device)."""
    on = SHARED_EARLY in ("1", True) or (SHARED_EARLY == "auto" and not (
        shared_last and router_gluon.routes(device, num_experts - 1)))
    return {"SHARED_EARLY": bool(shared_last and on and top_k >= 2 and chunks == 0)}


def _pairs_config(pairs: GemmConfig, aligned: GemmConfig, a: torch.Tensor) -> GemmConfig:
    """The pair grid's tiling: `pairs` where the dot runs on tensor cores, else (IEEE dots: fp32, the interpreter)
    the aligned launches' `aligned`, whose summation order the pair grid must keep."""
    return aligned if _ieee_dot(a) else pairs


def _pair_gemm(op: str, a: torch.Tensor, w: torch.Tensor, topk_ids: torch.Tensor, top_k: int, limit: float,
               swiglu: bool, pdl: bool, out: torch.Tensor | None, config: GemmConfig,
               preload: bool = False, shared_last: bool = False, tile_prefetch: bool = False) -> torch.Tensor:
    """The grouped GEMMs on the pair grid (BY_IDS): program row p = pair p of the router's ids [N, k'] (k' picks +
    shared per token), which runs the GEMM for every pair of its expert if p is that expert's first pair and exits
    otherwise; no align. top_k: pairs per A row (k' for the up-GEMM, 1 for the down-GEMM). Past PAIR_GRID_TOKENS
    tokens or PAIR_GRID_PICKS pairs a token (prefill, large batches) it aligns the ids itself (moe_align, one more
    launch) and runs the align-grid kernel: the same values."""
    if topk_ids.dim() != 2 or topk_ids.dtype != torch.int32:
        raise ValueError(f"{op}: topk_ids is {list(topk_ids.shape)} {topk_ids.dtype}, want [N, k] int32")
    n_tokens, pair_rows = topk_ids.shape
    num_pairs = topk_ids.numel()
    if not topk_ids.is_contiguous():
        topk_ids, preload = topk_ids.contiguous(), False      # a copy launch right before: no pre-wait reads of it
    if n_tokens > PAIR_GRID_TOKENS or pair_rows > PAIR_GRID_PICKS:
        from lingc.kernels.moe_align import moe_align
        aligned = moe_align(topk_ids, w.shape[0], PAIR_GRID_FALLBACK_BM, pdl=pdl)
        return _grouped_gemm(op, a, w, *aligned, top_k, PAIR_GRID_FALLBACK_BM, limit, swiglu, pdl, out, config,
                             shared_last=shared_last, tile_prefetch=tile_prefetch)
    num_experts, n, k = _check_gemm(op, a, w, swiglu, config)
    if a.shape[0] * top_k != num_pairs:
        raise ValueError(f"{op}: {a.shape[0]} activation rows x {top_k} != {num_pairs} pairs of topk_ids "
                         f"{list(topk_ids.shape)}")
    out = _out(op, out, (num_pairs, n // 2 if swiglu else n), a)
    if num_pairs == 0 or n == 0:
        return out
    a, pdl, launch, interpret = _launch_setup(op, a, w, k, pdl)
    chunks = preload_chunks(preload and pdl and not config.swap_ab, k, config.block_k, num_pairs)
    shared = _shared_early(shared_last and top_k == pair_rows, top_k, chunks, a.device, num_experts)
    _moe_gemm_kernel[(triton.cdiv(n, config.block_n), num_pairs)](
        a, w, out, topk_ids, topk_ids, topk_ids,
        num_pairs, num_experts, n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0), float(limit),
        TOP_K=top_k, BLOCK_M=MIN_TILE_M, TILE_M=MIN_TILE_M,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, EVEN_K=k % config.block_k == 0,
        SWIGLU=swiglu, HAS_LIMIT=limit > 0, IEEE_DOT=_ieee_dot(a),
        LIBDEVICE_EXP=a.is_cuda and not interpret, PDL=pdl, PREFETCH=False,
        K_LINES=triton.next_power_of_2(triton.cdiv(k, PREFETCH_LINE)), LINE=PREFETCH_LINE,
        K_CHUNKS=chunks, BY_IDS=True, PAIR_ROWS=pair_rows, PR_BLOCK=triton.next_power_of_2(pair_rows),
        SWAP_AB=config.swap_ab, **shared, TILE_PREFETCH=tile_prefetch and a.is_cuda and not interpret and chunks == 0,
        num_warps=config.num_warps, num_stages=config.num_stages, **FP_OPTIONS, **launch)
    return out


def moe_up_act_pairs(x: torch.Tensor, w13_interleaved: torch.Tensor, topk_ids: torch.Tensor, limit: float, *,
                     pdl: bool = False, out: torch.Tensor | None = None, config: GemmConfig | None = None,
                     shared_last: bool = False) -> torch.Tensor:
    """moe_up_act on the pair grid: x [N, h], topk_ids [N, k] int32 -> [NP, I]; the bits of moe_up_act over
    moe_align(topk_ids) (each pair row is its own dot, whatever block it sits in). shared_last as moe_up_act's:
    the shared expert's tile (every token's last pair) runs before the PDL wait."""
    return _pair_gemm("moe_up_act_pairs", x, w13_interleaved, topk_ids, topk_ids.shape[-1], limit, True, pdl, out,
                      config or _pairs_config(UP_PAIRS_CONFIG, UP_CONFIG, x), shared_last=shared_last,
                      tile_prefetch=UP_TILE_PREFETCH)


def moe_down_pairs(act: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, *, pdl: bool = False,
                   out: torch.Tensor | None = None, config: GemmConfig | None = None) -> torch.Tensor:
    """moe_down on the pair grid: act [NP, I], topk_ids [N, k] -> [NP, h]; the weight tile preloaded before the PDL
    wait as moe_down's (the ids' writer, the router, is two kernels back)."""
    return _pair_gemm("moe_down_pairs", act, w2, topk_ids, 1, 0.0, False, pdl, out,
                      config or _pairs_config(DOWN_PAIRS_CONFIG, DOWN_CONFIG, act),
                      preload=DOWN_PRELOAD, tile_prefetch=DOWN_TILE_PREFETCH)


def moe_up(x: torch.Tensor, w13: torch.Tensor, sorted_pairs: torch.Tensor, block_expert: torch.Tensor,
           total: torch.Tensor, top_k: int, block_m: int, *, pdl: bool = False, out: torch.Tensor | None = None,
           config: GemmConfig | None = None) -> torch.Tensor:
    """Grouped up-GEMM: x [N, h], w13 [E, 2I, h] -> [NP, 2I] in x.dtype (pair p reads token p // top_k).

    `config` overrides UP_CONFIG (benchmark sweeps; lingc never passes it); pdl is dropped where unsupported.
    """
    return _grouped_gemm("moe_up", x, w13, sorted_pairs, block_expert, total, top_k, block_m, 0.0,
                         False, pdl, out, config or UP_CONFIG, tile_prefetch=UP_TILE_PREFETCH)


def moe_up_act(x: torch.Tensor, w13_interleaved: torch.Tensor, sorted_pairs: torch.Tensor,
               block_expert: torch.Tensor, total: torch.Tensor, top_k: int, block_m: int, limit: float, *,
               pdl: bool = False, out: torch.Tensor | None = None, config: GemmConfig | None = None,
               shared_last: bool = False) -> torch.Tensor:
    """moe_up with the SwiGLU epilogue on gate/up-interleaved w13 (row 2j gate_j, 2j+1 up_j): [NP, I].

    Bit-identical to silu_and_mul(moe_up(x, w13, ...), limit) on the non-interleaved w13. shared_last (a launch hint
    of fuse_shared_expert, node meta `lingc.launch`): w13's last expert is a fused shared expert, every token's pair
    top_k - 1; at one token its tile runs before the PDL wait (SHARED_EARLY), same bits.
    """
    return _grouped_gemm("moe_up_act", x, w13_interleaved, sorted_pairs, block_expert, total, top_k, block_m,
                         limit, True, pdl, out, config or UP_CONFIG, shared_last=shared_last,
                         tile_prefetch=UP_TILE_PREFETCH)


def moe_down(act: torch.Tensor, w2: torch.Tensor, sorted_pairs: torch.Tensor, block_expert: torch.Tensor,
             total: torch.Tensor, block_m: int, *, pdl: bool = False, out: torch.Tensor | None = None,
             config: GemmConfig | None = None) -> torch.Tensor:
    """Grouped down-GEMM, unweighted: act [NP, I], w2 [E, h, I] -> [NP, h] in act.dtype (pair p reads row p)."""
    return _grouped_gemm("moe_down", act, w2, sorted_pairs, block_expert, total, 1, block_m, 0.0,
                         False, pdl, out, config or DOWN_CONFIG, prefetch=DOWN_PREFETCH, preload=DOWN_PRELOAD and pdl,
                         tile_prefetch=DOWN_TILE_PREFETCH)


def silu_and_mul(h: torch.Tensor, limit: float, *, pdl: bool = False,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU on concatenated [gate | up] rows: h [..., 2I] -> [..., I] (limit 0: no clamp)."""
    _float_dtype(h, "silu_and_mul", "h")
    if h.dim() == 0 or h.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: h is {list(h.shape)}, want [..., 2I]")
    inter = h.shape[-1] // 2
    out = _out("silu_and_mul", out, (*h.shape[:-1], inter), h)
    h2 = h.reshape(-1, 2 * inter)  # [R, 2I]
    if h2.stride(-1) != 1:
        h2 = h2.contiguous()
    out2 = out.view(-1, inter)  # [R, I]
    if h2.shape[0] == 0 or inter == 0:
        return out
    pdl = pdl and pdl_supported(h.device)
    launch = {"launch_pdl": True} if pdl else {}
    block = min(ACT_BLOCK, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(h2.shape[0], triton.cdiv(inter, block))](
        h2, out2, h2.stride(0), out2.stride(0), inter, float(limit),
        BLOCK=block, HAS_LIMIT=limit > 0, LIBDEVICE_EXP=h.is_cuda and not _interpreting(), PDL=pdl,
        num_warps=ACT_NUM_WARPS, **FP_OPTIONS, **launch)
    return out


def moe_combine(expert_out: torch.Tensor, topk_weights: torch.Tensor, shared_out: torch.Tensor | None = None, *,
                pdl: bool = False, out: torch.Tensor | None = None, order: int | None = None) -> torch.Tensor:
    """sum_j w[n, j] * expert_out[n*k + j] (fp32), cast, + shared_out: [NP, h], [N, k], [N, h] -> [N, h].

    Without shared_out (fuse_shared_expert: the shared expert is one of the k pairs) the sum is cast and stored.
    `order` overrides COMBINE_ORDER[device type] (SEQUENTIAL or INTERLEAVE4; for the GPU check).
    """
    _float_dtype(expert_out, "moe_combine", "expert_out")
    shared = expert_out if shared_out is None else shared_out         # the dtype and h of the output
    _float_dtype(shared, "moe_combine", "shared_out")
    if topk_weights.dim() != 2 or shared.dim() != 2 or expert_out.dim() != 2:
        raise ValueError(f"moe_combine: want expert_out [NP, h], topk_weights [N, k], shared_out [N, h]; got "
                         f"{list(expert_out.shape)}, {list(topk_weights.shape)}, {list(shared.shape)}")
    n, k = topk_weights.shape
    h = shared.shape[1]
    if (shared_out is not None and shared_out.shape[0] != n) or expert_out.shape != (n * k, h):
        raise ValueError(f"moe_combine: expert_out {list(expert_out.shape)}, topk_weights {list(topk_weights.shape)}"
                         f", shared_out {list(shared.shape) if shared_out is not None else None}: want [N*k, h], "
                         "[N, k], [N, h] or None")
    out = _out("moe_combine", out, (n, h), shared)
    if n == 0 or h == 0:
        return out
    e2, s2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (expert_out, shared))
    order = COMBINE_ORDER.get(shared.device.type, SEQUENTIAL) if order is None else order
    pdl = pdl and pdl_supported(shared.device)
    launch = {"launch_pdl": True} if pdl else {}
    block = min(COMBINE_BLOCK_H, triton.next_power_of_2(h))
    _moe_combine_kernel[(n, triton.cdiv(h, block))](
        e2, topk_weights, topk_weights, s2, out, h, e2.stride(0), topk_weights.stride(0), 0, s2.stride(0),
        out.stride(0),
        TOP_K=k, BLOCK_H=block, ORDER=order, HAS_SHARED=shared_out is not None, PDL=pdl,
        num_warps=COMBINE_NUM_WARPS, **FP_OPTIONS, **launch)
    return out


def combine_add_rmsnorm(residual: torch.Tensor, expert_out: torch.Tensor, topk_weights: torch.Tensor,
                        weight: torch.Tensor, eps: float, *, pdl: bool = False,
                        order: int | None = None, entry_trigger: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new_residual) = add_rmsnorm(residual, moe_combine(expert_out, topk_weights)) in one launch, bit for
    bit the two kernels: residual [..., h] (N rows), expert_out [N*k, h], topk_weights [N, k], weight [h].
    entry_trigger (a launch hint, PDL only): let the next kernel launch at entry (kernels/pdl.py)."""
    _float_dtype(expert_out, "combine_add_rmsnorm", "expert_out")
    h = residual.shape[-1]
    n = residual.numel() // max(h, 1)
    if topk_weights.dim() != 2 or topk_weights.shape[0] != n or expert_out.shape != (n * topk_weights.shape[1], h) \
            or expert_out.dtype != residual.dtype or weight.shape != (h,):
        raise ValueError(f"combine_add_rmsnorm: residual {list(residual.shape)} {residual.dtype}, expert_out "
                         f"{list(expert_out.shape)} {expert_out.dtype}, topk_weights {list(topk_weights.shape)}, "
                         f"weight {list(weight.shape)}: want N rows of h, [N*k, h] of the residual's dtype, [N, k], "
                         f"[h]")
    out = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
    residual_out = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
    if n == 0:
        return out, residual_out
    res2 = residual.reshape(n, h)
    res2 = res2 if res2.stride(-1) == 1 else res2.contiguous()
    e2 = expert_out if expert_out.stride(-1) == 1 else expert_out.contiguous()
    order = COMBINE_ORDER.get(residual.device.type, SEQUENTIAL) if order is None else order
    pdl = pdl and pdl_supported(residual.device)
    launch = {"launch_pdl": True} if pdl else {}
    block = triton.next_power_of_2(h)
    _combine_add_rmsnorm_kernel[(n,)](
        e2, topk_weights, res2, weight, out.view(n, h), residual_out.view(n, h), h, e2.stride(0),
        topk_weights.stride(0), res2.stride(0), h, h, eps,
        TOP_K=topk_weights.shape[1], BLOCK_H=block, ORDER=order,
        MUL_RN=residual.is_cuda and not _interpreting(), PDL=pdl, ENTRY_TRIGGER=pdl and entry_trigger,
        LATE_TRIGGER=late_trigger("combine_add_rmsnorm", pdl, n, entry_trigger),
        num_warps=_norm_warps(block),
        enable_reflect_ftz=False, **launch)   # fusion on, as the add_rmsnorm kernel; mul_rn without FTZ, as the combine
    return out, residual_out


def interleave_w13(w13: torch.Tensor) -> torch.Tensor:
    """[E, 2I, h] gate rows then up rows -> gate/up interleaved (row 2j = gate_j, row 2j+1 = up_j), a copy."""
    num_experts, two_i, h = w13.shape
    return w13.view(num_experts, 2, two_i // 2, h).transpose(1, 2).reshape(num_experts, two_i, h).contiguous()


def moe_up_ref(x, w13, sorted_pairs, block_expert, total, top_k, block_m):
    """lingc's reference up-GEMM."""
    return torch.ops.lingc.moe_up(x, w13, sorted_pairs, block_expert, total, top_k, block_m)


def moe_up_act_ref(x, w13_interleaved, sorted_pairs, block_expert, total, top_k, block_m, limit):
    """lingc's reference up-GEMM + SwiGLU on interleaved w13."""
    return torch.ops.lingc.moe_up_act(x, w13_interleaved, sorted_pairs, block_expert, total, top_k, block_m, limit)


def silu_and_mul_ref(h, limit):
    """lingc's reference SwiGLU on [gate | up] halves."""
    return torch.ops.lingc.silu_and_mul(h, limit)


def moe_down_ref(act, w2, sorted_pairs, block_expert, total, block_m):
    """lingc's reference down-GEMM."""
    return torch.ops.lingc.moe_down(act, w2, sorted_pairs, block_expert, total, block_m)


def moe_combine_ref(expert_out, topk_weights, shared_out=None):
    """lingc's reference combine."""
    return torch.ops.lingc.moe_combine(expert_out, topk_weights, shared_out)


LOWERINGS = {
    "combine_add_rmsnorm": combine_add_rmsnorm,
    "moe_up": moe_up,
    "moe_up_act": moe_up_act,
    "silu_and_mul": silu_and_mul,
    "moe_down": moe_down,
    "moe_combine": moe_combine,
    "moe_up_act_pairs": moe_up_act_pairs,
    "moe_down_pairs": moe_down_pairs,
}
