"""Gated-MLA decode kernels: weight-absorbed split-KV attention over the paged latent cache, cache write, RoPE, gate,
and fuse_mla's prep (RoPE + kv norm + cache write in one launch).

One file past the style's ~400 lines on purpose: mla_prep and the gated v_absorb share the rope and gate helpers with
the kernels they replace, which is what makes them bit-identical to those.

Letters (lingc/ops/mla.py): B requests, T new tokens, M = B*T queries, H heads, N nope dim, Rr rope dim,
R kv_lora rank, L = R + Rr cached values per token, Vd value dim, NP pages of PS rows, MP pages per request,
S = cdiv(MP*PS, SPLIT_ROWS) key splits.

`mla_attention` (one launcher, four kernels, all of them written out by the kernels themselves; on sm_90 the split is
kernels/mla_gluon.py's wgmma kernel where it applies, four queries' heads a tile and the split's cache rows in shared
memory before the PDL wait, its partial O in bf16, other bits than the Triton split below but row invariant the same
way):
    1. q_absorb   grid (H, R/QA_BLOCK_R, M) q_lat[m, h] = q_nope[m, h] @ W_uk[h]      fp32 sum, stored in the
                                            cache dtype (it is an MMA operand in stage 2); QA_TILE (opt-in): grid
                                            (H, R/QA_BLOCK_R, cdiv(M, 16)), 16 queries as one dot's rows
    2. split      grid (B*cdiv(T,QPP), S)   one program = QPP consecutive queries of a request, all H heads, the
                                            cache rows [s*SPLIT_ROWS, (s+1)*SPLIT_ROWS) that any of them sees:
                                            scores q_lat.c_kv + q_rope.k_rope on tensor cores ([QPP*H, R] x
                                            [R, BLOCK_N], the (query, head) pairs as MMA rows, each row masked
                                            to its own query's visible rows),
                                            fp32 online softmax (exp2), o[h] = sum p c_kv; writes the unnormalised
                                            partial (m, l, o[H, R]) in fp32
    3. combine    grid (M*H, R/CB_BLOCK_R)  o_lat = sum_s 2^(m_s - max) o_s / sum_s 2^(m_s - max) l_s (fp32)
    4. v_absorb   grid (H, Vd/VA_BLOCK_V, M) out[m, h] = W_uv[h] @ o_lat[m, h]          fp32 sum, one rounding
                                            (VA_TILE, opt-in: 16 queries a program as one dot's rows, o_lat
                                            stored by 3 in the cache dtype);
                                            with a gate (GATE, fuse_mla) then out * sigmoid(g[m, h]), the
                                            sigmoid_gate kernel's arithmetic on the rounded output (_head_gate)
Why four: the absorptions read the 4 MB kv_b weight (2 MB each half); a split program needs all H heads'
q_lat, so computing it there would re-read W_uk once per split. Separate GEMV kernels spread each half over
128 programs per query (a verify chain's queries re-read the slice from L2; one query per program replaced a loop
over the queries, which cost 6.5 / 5.3 us at 6 queries) and, under PDL, load their weight slice before the wait.
The combine is separate so that it is a plain elementwise-parallel pass over R (no re-reading of partials).
COMBINE_ABSORB (off: slower at verify on the H100) runs 3 and 4 as one launch, grid (M*H, R/CB_BLOCK_R): each
program combines its latent block, multiplies it by its [Vd, CB_BLOCK_R] slice of W_uv (loaded before the PDL wait)
and publishes the fp32 partial; the last of a (query, head)'s programs by an int32 ticket (kernels/workspace.py
counters, left zero) sums the partials in block order and gates. Row invariant and deterministic the same way;
other bits than 4's one sum over R.

Row invariance (a verify chain of T queries gives each query the bits of a T=1 decode step): every query is
computed with the same instruction sequence whatever T and B are. The absorptions and the combine give each query
its own programs; the split gives it QPP MMA-row slots of a fixed tile (a T = 1 call fills one and repeats its
query in the others, storing nothing from them), and an MMA row's bits depend only on that row's operands, the
row reductions (max, sum) on that row's values in a layout that is the same for every row. The steps a tile runs
past a query's last visible row (its chain's later queries see more) are exact no-ops for it: its scores there
are -inf, so alpha = 2^0 = 1, p = 0, l + 0 = l and acc * 1 + 0 = acc. Split boundaries are
fixed multiples of SPLIT_ROWS from row 0; a split that starts past the query's position does nothing and the
combine reads only the query's own pos // SPLIT_ROWS + 1 splits, in blocks of CB_BLOCK_S with a fixed
reduction shape, so the split count S (from the capacity MP*PS) never enters a query's arithmetic either.

Numerics vs torch.ops.lingc.mla_attention (which expands K/V with kv_b in fp32): q_lat and the softmax
probabilities are rounded to the cache dtype before their MMAs (bf16: about 3 significant digits; fp32 uses
IEEE dots), exp2 with log2(e) folded into the scale. Measured in the interpreter over the test shapes
(tests/kernels/test_mla.py, |out| up to ~2): bf16 max abs error 7.8e-3 (one bf16 ulp of the largest outputs,
7e-3 of max|ref|), fp32 4.8e-7 (3.7e-7 relative). bench/kernel_mla.py records the error at real size.

Bytes per call (Ling-3.0-tiny, bf16): the visible cache rows (pos+1) * L * 2 per query, 9.4 MB at 8192 rows
(T > 1 queries of one request re-read the same rows, mostly from L2: their programs are adjacent in the grid),
kv_b 4 MB, partials M * S_visible * H * R * 4 written and read once (2.1 MB per query at 8192 rows and
SPLIT_ROWS=128, L2-resident; half that where the Gluon split stores them in bf16, kernels/mla_gluon.py PARTIAL_BF16).

`mla_cache_write` scatters the M latent rows into their flat cache rows (one program per row). `rope` and
`sigmoid_gate` are one-program-per-token elementwise kernels replacing ~10 and ~4 small torch launches; their
math mirrors the reference (fp32, inv_freq from a float64 power rounded to fp32, IEEE division, no FMA
contraction in rope) but libm-level differences in cos/sin/exp may move a bf16 result by an ulp.

`mla_prep` (fuse_mla) replaces five launches: rope(q_pe), rope(k_pe), the kv_a rmsnorm, the cat and mla_cache_write.
One program per token ropes its q_pe for all heads (q_rope out) and writes [rmsnorm(c_kv) | rope(k_pe)] into its
cache row, each rounded to the activation dtype and then to the cache dtype, as the five do. Same bits, by
construction: the norm is kernels/rmsnorm.py's row code (_rmsnorm_row) on a row addressed as that kernel addresses
it, at its BLOCK_N, num_warps (2 at R = 512) and fp fusion (on: the sum of squares contracts into FMAs; the PTX
reduction sequence is the rmsnorm kernel's, checked offline for sm_90 at Ling-3.0-tiny's shapes); the ropes are the
rope kernel's helpers (_rope_inv_freq, _rope_cos_sin, _rope_rotate) with MUL_RN, every product an explicit mul.rn
that fusion cannot contract (the rope kernel launches with fusion off; compiled so, the rope code's float SASS
instructions are the fusion-off kernel's). Bit-equal on the H200 at 1 and 6 tokens, PDL on and off
(bench/kernel_mla.py's mla_prep row); the interpreter is exact (tests/kernels/test_mla_prep.py). Bytes: q_pe,
c_kv, k_pe in, q_rope out, one cache row out, the norm weight.

PDL placement (shared/docs/kernels.md section 1.5): with the constexpr PDL on, kv_b and mla_prep's norm weight
(weights, written by no earlier kernel) are loaded before `gdc_wait()` (mla_prep also computes its inv_freq there),
and so are the split's and the combine's query positions (EARLY_POS): a kernel's pre-wait code runs only once the
launch two back has completed (kernels/pdl.py), and for the split (two back) and the combine (three back) that is
the launch before mla_attention or an earlier one, which is where the positions were written, whoever wrote them
(in lingc's graphs the step's first launches). Every activation, the cache, page table and cache rows (and
mla_prep's positions) are loaded after it, and `gdc_launch_dependents()` follows the last dependent load. One
optional hint comes before the wait: the split (PREFETCH, LINGC_MLA_PREFETCH=1, off by default: measured slower in
the H200 step; the chain's last query's programs only) reads its query's position and page-table row through L2 and
asks L2 for its visible cache rows, which earlier steps wrote (the positions and page table are written at the step's
start, many kernels back); nothing reads the prefetch, so a stale value costs bandwidth, never correctness. With PDL
off no GDC call is emitted (the Triton interpreter cannot run them, kernels.md section 1.2).
"""

from __future__ import annotations

import math
import struct

import torch
import triton
import triton.language as tl

from lingc.knobs import env_flag, env_int
from lingc.kernels import mla_gluon, workspace
from lingc.kernels.pdl import (late_trigger, pdl_launch_next, pdl_supported, pdl_trigger, pdl_trigger_late, pdl_wait,
                               pdl_wait_late, prefetch_l2)
from lingc.kernels.rmsnorm import MAX_BLOCK_N as MAX_NORM_BLOCK, _num_warps as _norm_warps, _rmsnorm_row
import lingc.ops  # noqa: F401  (registers torch.ops.lingc.*, used by the references)

# Tunables. SPLIT_ROWS and BLOCK_N (cache rows per MMA step) and CB_BLOCK_S shape the arithmetic of a query;
# none of them may depend on T, B or the positions. SPLIT_ROWS must be a multiple of BLOCK_N.
SPLIT_ROWS = 128         # cache rows per split: 8192 rows -> 64 splits at T = 1, 384 programs at T = 6
SPLIT_STAGES = 2
# SPLIT_ROWS / BLOCK_N / CB_BLOCK_R were 64 / 32 / 64 (a split per SM at T = 1) until f1d7132 (2026-12-01). The H200
# step with 128 / 64 / 128 (bench/results/step-ab-h200-20261201-f.json, one process, baseline first and last):
# verify 2.586 / 2.587 -> 2.518 ms, NEXTN 3.689 / 3.700 -> 3.608, decode 1.258 / 1.277 -> 1.263 (noise). A numerics
# change (other split boundaries and MMA steps: another fp32 summation order; a query's bits still do not depend on
# T). 256-row splits: verify 2.507 but decode 1.283; 128 / 128 / 64: 2.533 / 1.252.
# Split program shape by cache dtype and accumulator size (fixed per model, so row invariance holds): cache rows per
# MMA step (BLOCK_N, the K dim of the P @ C_kv MMA, >= 16) and warps. ptxas for sm_90, bf16 H=16 R=512 at 4 warps,
# compiled with the launch's divisibility hints (without them the cache loads are not vectorised and the counts
# mislead): 128 / 64 takes 212 registers, 94 KB of shared memory, no spills (64 / 32: 182, 56 KB): 2 CTAs an SM
# either way, so a 6-query verify's 384 split programs run ~1.5 waves (768, ~3 waves, before). H=32 (Flash) needs
# 8 warps (150 registers at 64 / 32, before the chunks); fp32 (IEEE dots, test models) spills at 32 rows, so 16 rows
# and 8 warps (91 registers). A ptxas register cap of 168 (3 CTAs, 112 bytes of spills; at 64 / 32) measured no
# faster on the H200 (6 queries 46.5 vs 46.5-46.9 us, 1 query 22.0 vs 18.5;
# bench/results/kernels-mla-cap-h200-20261130.json) and was removed.
BLOCK_N = 64
BLOCK_N_FP32 = 16
# The split program loads its latent columns (q_lat and the cache's c_kv) as SPLIT_CHUNKS column chunks of R / 4 and
# runs the scores MMA chunk by chunk on one accumulator, in the unchunked order (so the bits are those of one
# [H, R] x [R, BLOCK_N] dot), and the P @ C_kv MMA per chunk. With the page size a constexpr too (no integer division
# by a runtime value in the row addressing), the H200 measured 16.7 vs 18.1 us at 1 query and 40.7 vs 46.1 us at 6
# (bench/results/kernels-mla-split-h200-20261130.json), same bits; 2 or 8 chunks were slower at one of the two.
SPLIT_CHUNKS = 4
# MMA rows of a split program (bf16 / fp16 caches): QPP = SPLIT_TILE_ROWS // BLOCK_H queries of one request share a
# program, their (query, head) pairs stacked as the MMAs' rows, so a verify chain reads a split's cache rows once per
# QPP queries, and at 64 rows the MMAs are Hopper wgmma. Every call takes the same tile whatever T is (a T = 1 decode
# fills one of its QPP slots), so a query's bits do not depend on T. 16 (QPP = 1 at H = 16, mma.sync, 4 warps) is
# the one-query program; 64 (QPP = 4: wgmma, 8 warps, 221 KB of shared memory, 1 CTA an SM) reads a 6-query chain's
# cache rows twice instead of six times. H200, context 8192 (bench/results/kernels-mla-pack-h200-20261203.json):
# mla_attention 29.8 vs 35.6 us at 6 queries but 20.1 vs 16.9 at one; in the step (step-ab-h200-20261203-f.json)
# greedy verify 2.308 vs 2.322 ms but decode 1.204 vs 1.191, so 16 stays the default and LINGC_MLA_TILE_ROWS=64 is
# the verify-leaning choice: row invariant on the H200 either way, but a numerics change against 16 (the two gave
# other bits for some queries of a 6-query chain, max |diff| 7.6e-6: kernels-mla-tile-h200-20261203.json), so the
# tile cannot follow T. fp32 caches (IEEE dots, test models) keep one query a program.
SPLIT_TILE_ROWS = env_int("LINGC_MLA_TILE_ROWS", 16)
SMALL_ACC = 16 * 512     # QPP * BLOCK_H * BLOCK_R up to this: SPLIT_WARPS_SMALL_ACC warps, else SPLIT_WARPS
SPLIT_WARPS_SMALL_ACC = 4
SPLIT_WARPS = 8
CB_BLOCK_S = 128         # splits combined per step (a fixed reduction shape): 16384 rows in one step
# latent columns per combine program (M*H x R/64 programs: 128 at T = 1; the columns do not enter the arithmetic, so
# the same bits at any value). 128 until 2026-12-04: with the Gluon split's bf16 partials, 64 measured greedy verify
# 2.199 against 2.210 / 2.213 ms and greedy NEXTN 3.132 against 3.146 / 3.147, decode level (1.148 against 1.149 /
# 1.150; bench/results/step-ab-h200-20261204-a.json, where CB_BLOCK_S = 64, another reduction shape, was slower);
# on an H100 (2026-12-06, step-ab-h100-20261206-launch-shapes.json) 32 and 128 both cost greedy verify 20-35 us
CB_BLOCK_R = 64
# the combine reads a query's partials in one round trip where all S splits fit one CB_BLOCK_S step (capacity up to
# 16384 rows): the maximum from the step's own loads instead of a load of the maxima first. Same bits (the combine's
# test compares both paths), so the query count may choose it: COMBINE_ONE_STEP is the most queries (B * T) a launch
# takes it at. On both GPUs it helps one query and costs six: H200 (2026-12-05, step-ab-h200-20261205.json, on at
# every count) greedy decode 1.1255 vs 1.1318 / 1.1287 ms, greedy verify 2.1318 vs 2.1248 / 2.1267; H100 (2026-12-06,
# step-ab-h100-20261206-launch-shapes.json) decode 1.3144 / 1.3150 vs 1.3175-1.3193, verify 2.6206 / 2.6085 vs
# 2.5991-2.6153 (three base rows). So 1 (decode, the draft): LINGC_MLA_COMBINE_ONE_STEP=N (0 off, 16 every launch).
# Confirmed at 1 on a third H100 (step-ab-h100-20261206-one-step.json, greedy parity held): decode 1.3036 / 1.3051 and
# 1.3082 / 1.3093 against 1.3076 / 1.3082 and 1.3098 / 1.3081 off, verify level, at 16 verify 2-4 us slower: a small
# gain, at the edge of that machine's run-to-run spread
COMBINE_ONE_STEP = env_int("LINGC_MLA_COMBINE_ONE_STEP", 1)
# the combine and v_absorb in one launch (_combine_absorb_kernel: each combine program multiplies its latent block
# by its W_uv slice, the last of a (query, head)'s R / CB_BLOCK_R programs sums the partials): one launch fewer a
# layer, a numerics change of the output (a split sum over R where v_absorb sums R at once). H100 (2026-12-06,
# 8428b6d; no H200 was lent): mla_attention alone 11.8 vs 14.9 us at one query, 23.2 vs 23.1 at six
# (bench/results/kernels-mla-combine-absorb-h100-20261206.json); in the step (step-ab-h100-20261206.json, two rows
# against three baselines) greedy decode 1.3102 / 1.3108 vs 1.3119-1.3128 ms but greedy verify 2.5999 / 2.5983 vs
# 2.5869-2.5888 and NEXTN 3.772 / 3.770 vs 3.762: a loss on verify, so off. It cannot follow T: a verify query must
# keep a decode step's bits (row invariance, the greedy parity). LINGC_MLA_COMBINE_ABSORB=1 turns it on. Needs
# M * H <= CA_COUNTERS (else the two launches run)
COMBINE_ABSORB = env_flag("LINGC_MLA_COMBINE_ABSORB", False)
CA_COUNTERS = 1 << 12    # ticket counters, one per (query, head): 16 KiB a device (kernels/workspace.py)
# The absorptions' blocks do not enter their sums (the same bits at any value). H100, 2026-12-06
# (step-ab-h100-20261206-launch-shapes.json): QA_BLOCK_R 32 or 128 cost greedy verify 20-30 us; VA_BLOCK_V 8 or 32 level
QA_BLOCK_R = 64          # q_absorb: latent columns per program (grid H x R/64 = 128 at real size)
VA_BLOCK_V = 16          # v_absorb: value rows per program (grid H x Vd/16 = 128 at real size)
GEMV_WARPS = 4
# q_absorb's early path (EARLY: under PDL, its q load and sum before the wait); LINGC_MLA_QABSORB_EARLY=0 turns it off
QA_EARLY = env_flag("LINGC_MLA_QABSORB_EARLY", True)
# q_absorb's entry trigger (under PDL): the split launches when q_absorb starts, not when it has passed its wait, so
# the split's pre-wait cache reads overlap q_absorb and mla_prep's tail. Safe because the split reads nothing before
# its wait that the two launches before it write: the positions and the page table come from the step's head, and
# the Gluon split copies the cache rows of this step's tokens (mla_prep's) only after its wait (kernels/mla_gluon.py
# UNIT); the Triton split reads only the positions there. H200 (bench/results/step-ab-h200-20261204-b.json, one
# process): greedy verify 2.189 / 2.192 ms against 2.201 without, greedy NEXTN 3.127 / 3.117 against 3.136, decode
# level (1.147 / 1.140 against 1.145); PDL on == off over the whole step (greedy tokens) and mla_attention alone 13.8
# against 15.6 us at one query, 22.8 against 24.8 at six (kernels-mla-gluon-entry-h200-20261204.json against -bf16-).
# LINGC_MLA_QABSORB_ENTRY=0 turns it off
QA_ENTRY = env_flag("LINGC_MLA_QABSORB_ENTRY", True)
# q_absorb's tile form (QA_TILE): program (h, rblock, m-tile) runs its QA_TILE_M queries as the rows of one dot on one
# load of its weight slice (tensor cores for 2-byte inputs), where the per-query form runs a program per query (an fp32
# FMA sum): a 6-query verify launches 128 programs instead of 768 and reads each 16 KB slice once instead of six times
# (12.6 MB of L2 reads, beside the split's early cache copies, QA_ENTRY). A numerics change of q_lat (the dot's fp32
# summation order instead of the FMA tree), row invariant either way. Off: faster alone but not in the step. H100
# (2026-12-06, 8c002b6): mla_attention alone 20.15 vs 22.30 us at 6 queries, 14.27 vs 14.78 at one
# (bench/results/kernels-mla-absorb-tiles-h100-20261206.json), but greedy decode 1.3207-1.3225 ms against
# 1.3151-1.3187 with it alone and verify level (step-ab-h100-20261206-absorb-tiles-b.json). A likely cause, not
# measured: the dot stages its operands in shared memory (20 KB a CTA against 1 KB), so the Gluon split (221 KB a
# CTA), which launches at q_absorb's entry (QA_ENTRY), cannot start its early cache copies on an SM that holds a
# q_absorb CTA: 216 + 20 KB (+ 1 KB reserved a CTA) exceed an SM's 228 KB, where 216 + 1 KB fit. A tile whose
# operands take under ~10 KB (QA_BLOCK_R 16) would test that. LINGC_MLA_QABSORB_TILE=1 turns it on
QA_TILE = env_flag("LINGC_MLA_QABSORB_TILE", False)
QA_TILE_M = 16           # queries an absorb tile (tl.dot's minimum M); more queries run more tiles
# v_absorb's tile form (VA_TILE): the same for v_absorb, program (h, vblock, m-tile), [QA_TILE_M, R] x [R, VA_BLOCK_V]
# on one load of its weight slice. Its dot takes o_lat in the cache dtype, so the combine stores o_lat rounded to it
# (bf16: one more rounding than the fp32 o_lat of the per-query form): a numerics change of the output, row
# invariant either way. Off: H100 (2026-12-06) alone 19.98 vs 21.34 us at 6 queries, 14.98 vs 14.85 at one, but
# greedy decode 1.3207-1.3221 ms against 1.3151-1.3187 and verify level or slower in the step (same files; 16 KB of
# shared memory a CTA beside the dense projection's early TMA ring, likely the same cause). With both on: decode
# +6-10 us, verify level (step-ab-h100-20261206-absorb-tiles.json). LINGC_MLA_VABSORB_TILE=1 turns it on
VA_TILE = env_flag("LINGC_MLA_VABSORB_TILE", False)
MIN_DOT = 16             # tl.dot wants every dim >= 16: heads and rope dims are padded up to this
LOG2E = 1.4426950408889634
# the split's pre-wait L2 prefetch: off by default (the H200 step measured slower with it and the MoE down-GEMM's on,
# kernels/moe.py DOWN_PREFETCH); LINGC_MLA_PREFETCH=1 turns it on
SPLIT_PREFETCH = env_flag("LINGC_MLA_PREFETCH", False)
# the split and the combine read their query's position before the PDL wait (under PDL; why that is safe: the module
# docstring's PDL placement), so the split's post-wait chain starts at the page-table load and the
# combine's at its partials (H200 stall samples at 6 queries: the pos load was ~3% of the split's, 2026-12-03,
# bench/device_ncu.py). Same bits. LINGC_MLA_EARLY_POS=0 turns it off
EARLY_POS = env_flag("LINGC_MLA_EARLY_POS", True)
PREFETCH_LINE = tl.constexpr(64)   # cache elements per prefetch request (128 B of bf16)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------------------------- attention


@triton.jit
def _q_absorb_kernel(q_ptr, w_ptr, out_ptr, M, T, stride_qb, stride_qt, stride_qh, stride_w,
                     H: tl.constexpr, N: tl.constexpr, R: tl.constexpr, HEAD_ROWS: tl.constexpr,
                     BLOCK_NOPE: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
                     ENTRY: tl.constexpr = False, TILE_M: tl.constexpr = 0, IEEE: tl.constexpr = False):
    """q_lat[m, h, rblock] = sum_n q_nope[m, h, n] * kv_b[h*HEAD_ROWS + n, rblock]; program (h, rblock, m), or with
    TILE_M > 0 (QA_TILE) program (h, rblock, m-tile): the tile's TILE_M queries as the rows of one dot
    [TILE_M, N] x [N, BLOCK_R] on one load of the weight slice (IEEE: fp32 inputs and an IEEE dot, for fp32 caches and
    the interpreter). A row of the dot depends only on its own query's q, so a query's bits do not depend on M or on
    its slot in the tile (rows past M are zero and stored nowhere).
    EARLY (under PDL): q is loaded (through L2) and the sum run before the wait. q_nope's writer, the q projection,
    is two launches back (mla_prep or the cache write sits between; the pdl pass launches mla_attention without PDL
    where the launch just before it produced or wrote q_nope, passes/pdl.py PREWAIT_INPUTS). ENTRY (under PDL): the
    split may launch at this kernel's entry (QA_ENTRY: what the split reads before its wait is older than the
    launch before this one, kernels/mla_gluon.py)."""
    if PDL and ENTRY:
        pdl_launch_next()
    h = tl.program_id(0)
    offs_n = tl.arange(0, BLOCK_NOPE)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_n, mask_r = offs_n < N, offs_r < R
    w_rows = (h * HEAD_ROWS + offs_n).to(tl.int64)
    w = tl.load(w_ptr + w_rows[:, None] * stride_w + offs_r[None, :],
                mask=mask_n[:, None] & mask_r[None, :], other=0.0)                     # [BLOCK_NOPE, BLOCK_R]
    if PDL and not EARLY:
        pdl_wait()
    if TILE_M > 0:
        offs_m = tl.program_id(2) * TILE_M + tl.arange(0, TILE_M)
        mask_m = offs_m < M
        b, t = offs_m // T, offs_m % T
        q = tl.load(q_ptr + b.to(tl.int64)[:, None] * stride_qb + (t * stride_qt + h * stride_qh)[:, None]
                    + offs_n[None, :], mask=mask_m[:, None] & mask_n[None, :], other=0.0,
                    cache_modifier=".cg")                                              # [TILE_M, BLOCK_NOPE]
        if IEEE:
            q_lat = tl.dot(q.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            q_lat = tl.dot(q, w)                                                       # [TILE_M, BLOCK_R] fp32
        rows = (offs_m * H + h).to(tl.int64)
        out_ptrs = out_ptr + rows[:, None] * R + offs_r[None, :]
        out_mask = mask_m[:, None] & mask_r[None, :]
    else:
        m = tl.program_id(2)
        b, t = m // T, m % T
        q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + t * stride_qt + h * stride_qh + offs_n,
                    mask=mask_n, other=0.0, cache_modifier=".cg").to(tl.float32)       # [BLOCK_NOPE]
        q_lat = tl.sum(q[:, None] * w.to(tl.float32), axis=0)                         # [BLOCK_R]
        out_ptrs = out_ptr + (m * H + h).to(tl.int64) * R + offs_r
        out_mask = mask_r
    if PDL:
        if EARLY:     # the load and the sum ran before the wait; only the store (q_lat may reuse freed memory) after
            pdl_wait()
        pdl_trigger()
    tl.store(out_ptrs, q_lat.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _prefetch_split(kv_ptr, pages_ptr, pos_ptr, b, t, s, PS: tl.constexpr, CAP, stride_page, stride_row, stride_pages_b,
                    stride_pos_b, stride_pos_t, L, SPLIT: tl.constexpr, NUM_PAGES: tl.constexpr,
                    L_LINES: tl.constexpr):
    """PREFETCH (before the wait): ask L2 for this split's visible cache rows. The positions and the page table are
    written at the step's start, many kernels back (complete), and every visible row but the newest by earlier
    steps; read through L2 (.cg) and clamped, a stale value only names other real rows (a hint, never read)."""
    pos = tl.load(pos_ptr + b.to(tl.int64) * stride_pos_b + t * stride_pos_t, cache_modifier=".cg").to(tl.int32)
    rows = s * SPLIT + tl.arange(0, SPLIT)
    valid = rows < tl.minimum(pos + 1, CAP)
    page = tl.load(pages_ptr + b.to(tl.int64) * stride_pages_b + rows // PS, mask=valid, other=0,
                   cache_modifier=".cg")
    page = tl.minimum(tl.maximum(page, 0), NUM_PAGES - 1).to(tl.int64)
    base = page * stride_page + (rows % PS) * stride_row                                # [SPLIT]
    cols = tl.minimum(tl.arange(0, L_LINES) * PREFETCH_LINE, L - 1)                     # one address per 128 B
    base = tl.where(valid, base, 0)                                                     # invisible rows: row 0
    prefetch_l2(kv_ptr + base[:, None] + cols[None, :])


@triton.jit
def _tile_last_pos(pos_b, stride_pos_t, t0, T, QPP: tl.constexpr, CACHE: tl.constexpr):
    """The largest position of a split tile's live queries t0 .. min(t0 + QPP, T) - 1, from scalar loads (a
    reduction over the tile's rows would put a CTA barrier in the prologue; at QPP = 1 this is the one load)."""
    last = tl.load(pos_b + t0 * stride_pos_t, cache_modifier=CACHE).to(tl.int32)
    for i in tl.static_range(1, QPP):
        ti = tl.minimum(t0 + i, T - 1)
        last = tl.maximum(last, tl.load(pos_b + ti * stride_pos_t, cache_modifier=CACHE).to(tl.int32))
    return last


@triton.jit
def _split_kernel(qlat_ptr, qrope_ptr, kv_ptr, pages_ptr, pos_ptr, part_o_ptr, part_ml_ptr,
                  T, S, CAP, qk_scale,
                  stride_rb, stride_rt, stride_rh, stride_page, stride_row, stride_pages_b,
                  stride_pos_b, stride_pos_t,
                  PS: tl.constexpr, H: tl.constexpr, R: tl.constexpr, RR: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
                  SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
                  PREFETCH: tl.constexpr = False, NUM_PAGES: tl.constexpr = 1, L_LINES: tl.constexpr = 1,
                  CHUNKS: tl.constexpr = 1, EARLY_POS: tl.constexpr = False, QPP: tl.constexpr = 1):
    """Unnormalised softmax partials of QPP consecutive queries of one request over their visible rows of split s,
    all heads at once: the MMAs' rows are (query, head) pairs, so the split's cache rows are read once for QPP
    queries. A tile's slots past the chain's end repeat its last query and store nothing."""
    tile = tl.program_id(0)
    s = tl.program_id(1)
    tiles_t = (T + QPP - 1) // QPP
    b, t0 = tile // tiles_t, (tile % tiles_t) * QPP
    BLOCK_M: tl.constexpr = QPP * BLOCK_H
    RC: tl.constexpr = BLOCK_R // CHUNKS
    offs_q = tl.arange(0, BLOCK_M)
    offs_h = offs_q % BLOCK_H
    t_live = t0 + offs_q // BLOCK_H
    live = t_live < T
    t = tl.minimum(t_live, T - 1)                                                     # [BLOCK_M] query of a row
    m = b * T + t
    offs_c = tl.arange(0, RC)
    offs_e = tl.arange(0, BLOCK_E)
    mask_h, mask_e = offs_h < H, offs_e < RR
    pos_b = pos_ptr + b.to(tl.int64) * stride_pos_b
    if PDL and EARLY_POS:   # written at the step's start, many launches back: before the wait (module docstring)
        pos = tl.load(pos_b + t * stride_pos_t, cache_modifier=".cg").to(tl.int32)
        last = _tile_last_pos(pos_b, stride_pos_t, t0, T, QPP, ".cg")
    if PDL:
        if PREFETCH:
            t_last = tl.minimum(t0 + QPP, T) - 1
            if t_last == T - 1:     # the chain's last query sees every row the others do: one request per line
                _prefetch_split(kv_ptr, pages_ptr, pos_ptr, b, t_last, s, PS, CAP, stride_page, stride_row,
                                stride_pages_b, stride_pos_b, stride_pos_t, R + RR, SPLIT, NUM_PAGES, L_LINES)
        pdl_wait()
    if not (PDL and EARLY_POS):
        pos = tl.load(pos_b + t * stride_pos_t).to(tl.int32)
        last = _tile_last_pos(pos_b, stride_pos_t, t0, T, QPP, "")
    start = s * SPLIT
    end_q = tl.minimum(tl.minimum(start + SPLIT, pos + 1), CAP)   # a row's visible rows [start, end_q)
    end = tl.minimum(tl.minimum(start + SPLIT, last + 1), CAP)     # the tile's: every row loops to it
    dot_ty = kv_ptr.dtype.element_ty
    q_lat = ()
    acc = ()
    for j in tl.static_range(CHUNKS):
        cols = j * RC + offs_c
        q_lat = q_lat + (tl.load(qlat_ptr + (m * H + offs_h)[:, None].to(tl.int64) * R + cols[None, :],
                                 mask=mask_h[:, None] & (cols < R)[None, :], other=0.0),)      # [BLOCK_M, RC]
        acc = acc + (tl.zeros([BLOCK_M, RC], tl.float32),)
    q_rope = tl.load(qrope_ptr + b.to(tl.int64) * stride_rb + (t * stride_rt + offs_h * stride_rh)[:, None]
                     + offs_e[None, :], mask=mask_h[:, None] & mask_e[None, :], other=0.0).to(dot_ty)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    for j0 in range(start, end, BLOCK_N):
        rows = j0 + tl.arange(0, BLOCK_N)
        valid = rows < end
        page = tl.load(pages_ptr + b.to(tl.int64) * stride_pages_b + rows // PS, mask=valid, other=0)
        base = page.to(tl.int64) * stride_page + (rows % PS) * stride_row                # [BLOCK_N]
        c = ()
        for j in tl.static_range(CHUNKS):
            cols = j * RC + offs_c
            c = c + (tl.load(kv_ptr + base[:, None] + cols[None, :], mask=valid[:, None] & (cols < R)[None, :],
                             other=0.0),)                                                # [BLOCK_N, RC]
        k_rope = tl.load(kv_ptr + base[:, None] + R + offs_e[None, :], mask=valid[:, None] & mask_e[None, :],
                         other=0.0)
        # one accumulation chain in the unchunked order: the latent columns 0 .. R-1, then the rope part
        scores = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if IEEE:
            for j in tl.static_range(CHUNKS):
                scores = tl.dot(q_lat[j], tl.trans(c[j]), scores, input_precision="ieee")
            scores = tl.dot(q_rope, tl.trans(k_rope), scores, input_precision="ieee")
        else:
            for j in tl.static_range(CHUNKS):
                scores = tl.dot(q_lat[j], tl.trans(c[j]), scores)
            scores = tl.dot(q_rope, tl.trans(k_rope), scores)                           # [BLOCK_M, BLOCK_N] fp32
        scores = tl.where(rows[None, :] < end_q[:, None], scores * qk_scale, float("-inf"))
        # finite wherever the row sees a row of this split (then its first step has one); a row that sees none
        # (an earlier query of the tile, or a padded slot) keeps 0 there instead of -inf - -inf = NaN: not stored
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        if QPP > 1:     # one query a program: its first step has a visible row whenever the loop runs
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        pv = p.to(dot_ty)
        new_acc = ()
        for j in tl.static_range(CHUNKS):
            if IEEE:
                new_acc = new_acc + (tl.dot(pv, c[j], acc[j] * alpha[:, None], input_precision="ieee"),)
            else:
                new_acc = new_acc + (tl.dot(pv, c[j], acc[j] * alpha[:, None]),)          # [BLOCK_M, RC]
        acc = new_acc
        m_i = m_new
    if PDL:
        pdl_trigger()
    keep = mask_h & live & (end_q > start)
    row = (m * S + s).to(tl.int64) * H + offs_h                                       # [BLOCK_M] partial rows
    tl.store(part_ml_ptr + row * 2, m_i, mask=keep)
    tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=keep)
    for j in tl.static_range(CHUNKS):
        cols = j * RC + offs_c
        tl.store(part_o_ptr + row[:, None] * R + cols[None, :], acc[j], mask=keep[:, None] & (cols < R)[None, :])


@triton.jit
def _combine_loads(part_o_ptr, part_ml_ptr, rows, s0, n_splits, offs_r, mask_r, H: tl.constexpr, R: tl.constexpr,
                   BLOCK_S: tl.constexpr):
    """One combine step's partials, splits s0 .. s0 + BLOCK_S - 1 of a (query, head) whose split 0 is partial row
    `rows`: the maxima [BLOCK_S] (-inf past n_splits), the sums [BLOCK_S] (0 there) and O [BLOCK_S, BLOCK_R] in fp32."""
    offs_s = s0 + tl.arange(0, BLOCK_S)
    mask_s = offs_s < n_splits
    prow = rows + offs_s * H                                                           # [BLOCK_S]
    m_s = tl.load(part_ml_ptr + prow * 2, mask=mask_s, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + prow * 2 + 1, mask=mask_s, other=0.0)
    o_s = tl.load(part_o_ptr + prow[:, None] * R + offs_r[None, :], mask=mask_s[:, None] & mask_r[None, :],
                  other=0.0).to(tl.float32)
    return m_s, l_s, o_s


@triton.jit
def _combine_pos(pos_ptr, b, t, stride_pos_b, stride_pos_t, EARLY: tl.constexpr):
    """A query's position; EARLY (under PDL, before the wait) through the L2 (`.cg`): it is written many launches
    back, as in the split."""
    if EARLY:
        return tl.load(pos_ptr + b.to(tl.int64) * stride_pos_b + t * stride_pos_t, cache_modifier=".cg").to(tl.int32)
    return tl.load(pos_ptr + b.to(tl.int64) * stride_pos_b + t * stride_pos_t).to(tl.int32)


@triton.jit
def _combine_sums(part_o_ptr, part_ml_ptr, rows, n_splits, offs_r, mask_r, H: tl.constexpr, R: tl.constexpr,
                  S_POW2: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, ONE_STEP: tl.constexpr):
    """(o_sum [BLOCK_R], l_sum [BLOCK_S]) of a (query, head)'s visible splits 0 .. n_splits - 1, whose split 0 is
    partial row `rows`: o_lat = o_sum / sum(l_sum). Fixed blocks in a fixed order."""
    l_sum = tl.zeros([BLOCK_S], tl.float32)
    o_sum = tl.zeros([BLOCK_R], tl.float32)
    if ONE_STEP and S_POW2 <= BLOCK_S:
        # every split fits one step: the maximum comes from the step's own loads, so the partials are read in one
        # round trip instead of two (the maxima, then the step). The same values in the same ops as the loop's one
        # iteration below (the maximum is exact over the same splits), so the same bits at any capacity
        m_s, l_s, o_s = _combine_loads(part_o_ptr, part_ml_ptr, rows, 0, n_splits, offs_r, mask_r, H, R, BLOCK_S)
        m_max = tl.max(m_s, axis=0)
        w = tl.exp2(m_s - m_max)                                                       # 0 on masked splits
        l_sum += w * l_s
        o_sum += tl.sum(w[:, None] * o_s, axis=0)
    else:
        all_s = tl.arange(0, S_POW2)
        m_all = tl.load(part_ml_ptr + (rows + all_s * H) * 2, mask=all_s < n_splits, other=float("-inf"))
        m_max = tl.max(m_all, axis=0)                        # exact: max does not depend on the order
        for s0 in range(0, n_splits, BLOCK_S):
            m_s, l_s, o_s = _combine_loads(part_o_ptr, part_ml_ptr, rows, s0, n_splits, offs_r, mask_r, H, R,
                                           BLOCK_S)
            w = tl.exp2(m_s - m_max)                                                   # 0 on masked splits
            l_sum += w * l_s
            o_sum += tl.sum(w[:, None] * o_s, axis=0)
    return o_sum, l_sum


@triton.jit
def _combine_kernel(part_o_ptr, part_ml_ptr, pos_ptr, olat_ptr, T, S, stride_pos_b, stride_pos_t,
                    H: tl.constexpr, R: tl.constexpr, SPLIT: tl.constexpr, S_POW2: tl.constexpr,
                    BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr,
                    PDL: tl.constexpr, EARLY_POS: tl.constexpr = False, ONE_STEP: tl.constexpr = False):
    """o_lat[m, h, rblock] from the query's visible splits 0 .. pos // SPLIT (in that order, fixed blocks)."""
    mh = tl.program_id(0)
    m, h = mh // H, mh % H
    b, t = m // T, m % T
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    if PDL and EARLY_POS:   # as in the split: the positions are written many launches back
        pos = _combine_pos(pos_ptr, b, t, stride_pos_b, stride_pos_t, True)
    if PDL:
        pdl_wait()
    if not (PDL and EARLY_POS):
        pos = _combine_pos(pos_ptr, b, t, stride_pos_b, stride_pos_t, False)
    n_splits = tl.minimum(pos // SPLIT + 1, S)
    rows = (m * S).to(tl.int64) * H + h                      # partial row of split 0; split s adds s * H
    o_sum, l_sum = _combine_sums(part_o_ptr, part_ml_ptr, rows, n_splits, offs_r, mask_r, H, R, S_POW2, BLOCK_S,
                                 BLOCK_R, ONE_STEP)
    if PDL:
        pdl_trigger()
    out = o_sum / tl.sum(l_sum, axis=0)
    tl.store(olat_ptr + mh.to(tl.int64) * R + offs_r, out, mask=mask_r)


@triton.jit
def _combine_absorb_kernel(part_o_ptr, part_ml_ptr, pos_ptr, w_ptr, pv_ptr, count_ptr, out_ptr, g_ptr, T, S,
                           stride_pos_b, stride_pos_t, stride_w, stride_gb, stride_gt, stride_gh,
                           H: tl.constexpr, N: tl.constexpr, R: tl.constexpr, VD: tl.constexpr,
                           HEAD_ROWS: tl.constexpr, SPLIT: tl.constexpr, S_POW2: tl.constexpr,
                           BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_VD: tl.constexpr,
                           GATE: tl.constexpr, PDL: tl.constexpr, ENTRY_TRIGGER: tl.constexpr,
                           EARLY_POS: tl.constexpr = False, ONE_STEP: tl.constexpr = False):
    """COMBINE_ABSORB: the combine and v_absorb of a (query, head) in one launch, grid (M*H, R/BLOCK_R). A program
    combines its latent block as _combine_kernel does (the same o_lat bits), multiplies it by its [VD, BLOCK_R]
    slice of W_uv (loaded before the PDL wait) and publishes the fp32 partial [VD]; the program that draws the last
    ticket of the (query, head)'s counter sums the R/BLOCK_R partials in block order, applies the gate as v_absorb
    does and stores the output (and zeroes the counter for the next launch). No float atomics: the same bits
    whichever program comes last; other bits than _v_absorb_kernel's one sum over R (a split sum)."""
    if PDL:
        if ENTRY_TRIGGER:   # the next launch (the dense projection) reads only weights before its wait (kernels/pdl.py)
            pdl_launch_next()
    mh = tl.program_id(0)
    m, h = mh // H, mh % H
    b, t = m // T, m % T
    rb = tl.program_id(1)
    offs_r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_v = tl.arange(0, BLOCK_VD)
    mask_r, mask_v = offs_r < R, offs_v < VD
    w_rows = (h * HEAD_ROWS + N + offs_v).to(tl.int64)
    w = tl.load(w_ptr + w_rows[:, None] * stride_w + offs_r[None, :],
                mask=mask_v[:, None] & mask_r[None, :], other=0.0)                     # [BLOCK_VD, BLOCK_R]
    if PDL and EARLY_POS:
        pos = _combine_pos(pos_ptr, b, t, stride_pos_b, stride_pos_t, True)
    if PDL:
        pdl_wait()
    if not (PDL and EARLY_POS):
        pos = _combine_pos(pos_ptr, b, t, stride_pos_b, stride_pos_t, False)
    if GATE:
        g = tl.load(g_ptr + b.to(tl.int64) * stride_gb + t * stride_gt + h * stride_gh).to(tl.float32)
    n_splits = tl.minimum(pos // SPLIT + 1, S)
    rows = (m * S).to(tl.int64) * H + h
    o_sum, l_sum = _combine_sums(part_o_ptr, part_ml_ptr, rows, n_splits, offs_r, mask_r, H, R, S_POW2, BLOCK_S,
                                 BLOCK_R, ONE_STEP)
    if PDL and not ENTRY_TRIGGER:
        pdl_trigger()
    o_lat = o_sum / tl.sum(l_sum, axis=0)                                              # _combine_kernel's bits
    pv = tl.sum(w.to(tl.float32) * o_lat[None, :], axis=1)                            # [BLOCK_VD]
    n_rb = tl.num_programs(1)
    pv_row = pv_ptr + mh.to(tl.int64) * n_rb * VD
    tl.store(pv_row + rb * VD + offs_v, pv, mask=mask_v)
    tl.debug_barrier()  # every thread's partial is written before the ticket (release) is taken
    ticket = tl.atomic_add(count_ptr + mh, 1, sem="acq_rel", scope="gpu")
    if ticket == n_rb - 1:
        out = tl.zeros([BLOCK_VD], tl.float32)
        for i in range(0, n_rb):                                                       # fixed order 0 .. R/BLOCK_R
            out += tl.load(pv_row + i * VD + offs_v, mask=mask_v, other=0.0, cache_modifier=".cg")
        if GATE:   # round as the ungated kernel stores, then the gate kernel's product (rounded by the store)
            ty = out_ptr.dtype.element_ty
            out = out.to(ty).to(tl.float32) * _head_gate(g).to(ty).to(tl.float32)
        tl.store(out_ptr + mh.to(tl.int64) * VD + offs_v, out.to(out_ptr.dtype.element_ty), mask=mask_v)
        tl.store(count_ptr + mh, 0)                                                   # ready for the next launch


@triton.jit
def _v_absorb_kernel(olat_ptr, w_ptr, out_ptr, g_ptr, M, T, stride_w, stride_gb, stride_gt, stride_gh,
                     H: tl.constexpr, N: tl.constexpr, R: tl.constexpr, VD: tl.constexpr, HEAD_ROWS: tl.constexpr,
                     BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, GATE: tl.constexpr, PDL: tl.constexpr,
                     ENTRY_TRIGGER: tl.constexpr, TILE_M: tl.constexpr = 0, IEEE: tl.constexpr = False):
    """out[m, h, vblock] = sum_r kv_b[h*HEAD_ROWS + N + vblock, r] * o_lat[m, h, r]; program (h, vblock, m), or with
    TILE_M > 0 (VA_TILE) program (h, vblock, m-tile): the tile's TILE_M queries' o_lat rows (in the cache dtype, as
    the combine stores them there) as one dot [TILE_M, R] x [R, BLOCK_V] on one load of the weight slice (IEEE: fp32
    inputs and an IEEE dot); a query's bits depend only on its own row.
    GATE (fuse_mla): then out * sigmoid(g[m, h]) with the gate kernel's arithmetic on the rounded output."""
    if PDL:
        if ENTRY_TRIGGER:   # the next launch (the dense projection) reads only weights before its wait (kernels/pdl.py)
            pdl_launch_next()
    h = tl.program_id(0)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_r = tl.arange(0, BLOCK_R)
    mask_v, mask_r = offs_v < VD, offs_r < R
    w_rows = (h * HEAD_ROWS + N + offs_v).to(tl.int64)
    w = tl.load(w_ptr + w_rows[:, None] * stride_w + offs_r[None, :],
                mask=mask_v[:, None] & mask_r[None, :], other=0.0)                     # [BLOCK_V, BLOCK_R]
    if TILE_M == 0:
        w = w.to(tl.float32)           # before the wait, as the per-query form always did
    ty = out_ptr.dtype.element_ty
    if PDL:
        pdl_wait()
    if TILE_M > 0:
        offs_m = tl.program_id(2) * TILE_M + tl.arange(0, TILE_M)
        mask_m = offs_m < M
        rows = (offs_m * H + h).to(tl.int64)
        o = tl.load(olat_ptr + rows[:, None] * R + offs_r[None, :], mask=mask_m[:, None] & mask_r[None, :],
                    other=0.0)                                                         # [TILE_M, BLOCK_R]
        if GATE:
            b, t = offs_m // T, offs_m % T
            g = tl.load(g_ptr + b.to(tl.int64) * stride_gb + t * stride_gt + h * stride_gh, mask=mask_m,
                        other=0.0).to(tl.float32)
        if PDL:
            pdl_trigger()
        if IEEE:
            out = tl.dot(o.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            out = tl.dot(o, tl.trans(w))                                               # [TILE_M, BLOCK_V] fp32
        if GATE:   # round as the ungated kernel stores, then the gate kernel's product (rounded by the store)
            out = out.to(ty).to(tl.float32) * _head_gate(g).to(ty).to(tl.float32)[:, None]
        tl.store(out_ptr + rows[:, None] * VD + offs_v[None, :], out.to(ty), mask=mask_m[:, None] & mask_v[None, :])
    else:
        m = tl.program_id(2)
        o = tl.load(olat_ptr + (m * H + h).to(tl.int64) * R + offs_r, mask=mask_r, other=0.0).to(tl.float32)
        if GATE:
            b, t = m // T, m % T
            g = tl.load(g_ptr + b.to(tl.int64) * stride_gb + t * stride_gt + h * stride_gh).to(tl.float32)
        if PDL:
            pdl_trigger()
        out = tl.sum(w * o[None, :], axis=1)                                           # [BLOCK_V]
        if GATE:   # round as the ungated kernel stores, then the gate kernel's product (rounded by the store)
            out = out.to(ty).to(tl.float32) * _head_gate(g).to(ty).to(tl.float32)
        tl.store(out_ptr + (m * H + h).to(tl.int64) * VD + offs_v, out.to(ty), mask=mask_v)


# --------------------------------------------------------------------------------- cache write, rope, gate


@triton.jit
def _cache_write_kernel(kv_ptr, latent_ptr, locs_ptr, T, L, stride_row, stride_lb, stride_lt,
                        stride_locs_b, stride_locs_t, BLOCK_L: tl.constexpr, PDL: tl.constexpr):
    """kv_pages.flat[cache_locs[b, t]] = latent[b, t] (cast to the cache dtype)."""
    m = tl.program_id(0)
    b, t = m // T, m % T
    offs = tl.arange(0, BLOCK_L)
    mask = offs < L
    if PDL:
        pdl_wait()
    loc = tl.load(locs_ptr + b.to(tl.int64) * stride_locs_b + t * stride_locs_t).to(tl.int64)
    x = tl.load(latent_ptr + b.to(tl.int64) * stride_lb + t * stride_lt + offs, mask=mask)
    if PDL:
        pdl_trigger()
    tl.store(kv_ptr + loc * stride_row + offs, x.to(kv_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mul(a, b, MUL_RN: tl.constexpr):
    """a * b rounded once (fp32 or float64). MUL_RN: an explicit `mul.rn`, the instruction a fusion-off kernel emits
    for a multiply; no fp-fusion setting contracts it into an FMA, so a kernel compiled with fusion on (mla_prep, for
    its norm) computes the fusion-off rope kernel's products. Inline PTX rather than libdevice's mul_rn, which the
    default FTZ reflection turns into mul.rn.ftz. Else a plain multiply (fusion off, or the interpreter, which runs
    no PTX and contracts nothing)."""
    if MUL_RN:
        if a.dtype == tl.float64:
            return tl.inline_asm_elementwise("mul.rn.f64 $0, $1, $2;", "=d,d,d", [a, b], dtype=tl.float64,
                                             is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                             is_pure=True, pack=1)
    else:
        return a * b


@triton.jit
def _rope_inv_freq(HALF, ln_theta_hi, ln_theta_lo, BLOCK_HALF: tl.constexpr, MUL_RN: tl.constexpr):
    """inv_freq[i] = 1 / theta^(2i / dim) as the reference: the exponent and the division in fp32 (IEEE), the power in
    float64 (ln theta arrives as two fp32 halves: scalar arguments are fp32) rounded to fp32. [BLOCK_HALF] fp32."""
    offs_i = tl.arange(0, BLOCK_HALF)
    expo = tl.math.div_rn((2 * offs_i).to(tl.float32), tl.zeros([BLOCK_HALF], tl.float32) + 2 * HALF)
    ln_theta = (tl.zeros([1], tl.float64) + ln_theta_hi) + ln_theta_lo                   # exact in float64
    power = tl.exp(_mul(expo.to(tl.float64), ln_theta, MUL_RN)).to(tl.float32)
    return tl.math.div_rn(tl.full([BLOCK_HALF], 1.0, tl.float32), power)


@triton.jit
def _rope_pairs(src, mask):
    """(x_even, x_odd) in fp32 of the interleaved pairs at src (pointers to each pair's first element)."""
    return tl.load(src, mask=mask, other=0.0).to(tl.float32), tl.load(src + 1, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _rope_cos_sin(pos, inv_freq, MUL_RN: tl.constexpr):
    """cos and sin of the angles pos * inv_freq (fp32 position, [BLOCK_HALF] fp32)."""
    angle = _mul(pos, inv_freq, MUL_RN)                                                # [BLOCK_HALF]
    return tl.cos(angle), tl.sin(angle)


@triton.jit
def _rope_rotate(xe, xo, cos, sin, MUL_RN: tl.constexpr):
    """(xe cos - xo sin, xo cos + xe sin) in fp32, every product rounded (no FMA), as the reference."""
    return (_mul(xe, cos, MUL_RN) - _mul(xo, sin, MUL_RN), _mul(xo, cos, MUL_RN) + _mul(xe, sin, MUL_RN))


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, out_ptr, T, NH, HALF, ln_theta_hi, ln_theta_lo,
                 stride_xb, stride_xt, stride_xh, stride_pos_b, stride_pos_t,
                 BLOCK_NH: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr):
    """Interleaved-pair RoPE of one token's NH vectors, written de-interleaved: [xe c - xo s | xo c + xe s]."""
    m = tl.program_id(0)
    b, t = m // T, m % T
    offs_h = tl.arange(0, BLOCK_NH)
    offs_i = tl.arange(0, BLOCK_HALF)
    mask = (offs_h < NH)[:, None] & (offs_i < HALF)[None, :]
    inv_freq = _rope_inv_freq(HALF, ln_theta_hi, ln_theta_lo, BLOCK_HALF, False)
    if PDL:
        pdl_wait()
    pos = tl.load(pos_ptr + b.to(tl.int64) * stride_pos_b + t * stride_pos_t).to(tl.float32)
    src = x_ptr + b.to(tl.int64) * stride_xb + t * stride_xt + offs_h[:, None] * stride_xh + 2 * offs_i[None, :]
    xe, xo = _rope_pairs(src, mask)                                                    # [BLOCK_NH, BLOCK_HALF]
    if PDL:
        pdl_trigger()
    cos, sin = _rope_cos_sin(pos, inv_freq, False)
    lo, hi = _rope_rotate(xe, xo, cos[None, :], sin[None, :], False)
    dst = out_ptr + (m * NH + offs_h[:, None]).to(tl.int64) * (2 * HALF) + offs_i[None, :]
    ty = out_ptr.dtype.element_ty
    tl.store(dst, lo.to(ty), mask=mask)
    tl.store(dst + HALF, hi.to(ty), mask=mask)


@triton.jit
def _head_gate(g):
    """sigmoid(g) of fp32 logits as the reference computes it: exp in float64 rounded once (expf to < 1 ulp), IEEE
    division; fp32, for the caller to round to the activation dtype. Shared by the gate kernel and v_absorb's GATE."""
    e = tl.exp((-g).to(tl.float64)).to(tl.float32)
    return tl.math.div_rn(tl.full(g.shape, 1.0, tl.float32), 1.0 + e)


@triton.jit
def _sigmoid_gate_kernel(x_ptr, g_ptr, out_ptr, T, H, V, stride_xb, stride_xt, stride_xh,
                         stride_gb, stride_gt, stride_gh,
                         BLOCK_H: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr):
    """out[b, t, h] = x[b, t, h] * sigmoid(g[b, t, h]): sigmoid in fp32, rounded to x's dtype, product rounded."""
    m = tl.program_id(0)
    b, t = m // T, m % T
    offs_h = tl.arange(0, BLOCK_H)
    offs_v = tl.arange(0, BLOCK_V)
    mask_h = offs_h < H
    mask = mask_h[:, None] & (offs_v < V)[None, :]
    if PDL:
        pdl_wait()
    g = tl.load(g_ptr + b.to(tl.int64) * stride_gb + t * stride_gt + offs_h * stride_gh, mask=mask_h,
                other=0.0).to(tl.float32)
    x = tl.load(x_ptr + b.to(tl.int64) * stride_xb + t * stride_xt + offs_h[:, None] * stride_xh + offs_v[None, :],
                mask=mask, other=0.0)
    if PDL:
        pdl_trigger()
    gate = _head_gate(g).to(x.dtype)
    out = x.to(tl.float32) * gate.to(tl.float32)[:, None]
    tl.store(out_ptr + (m * H + offs_h[:, None]).to(tl.int64) * V + offs_v[None, :], out.to(x.dtype), mask=mask)


# --------------------------------------------------------------------------------------------------- prep


@triton.jit
def _mla_prep_kernel(q_ptr, c_ptr, k_ptr, w_ptr, kv_ptr, locs_ptr, pos_ptr, qout_ptr,
                     T, NH, HALF, R, ln_theta_hi, ln_theta_lo, eps,
                     stride_qb, stride_qt, stride_qh, stride_c, stride_k, stride_row,
                     stride_locs_b, stride_locs_t, stride_pos_b, stride_pos_t,
                     BLOCK_NH: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_R: tl.constexpr,
                     MUL_RN: tl.constexpr, PDL: tl.constexpr, LATE_TRIGGER: tl.constexpr = False,
                     ENTRY_TRIGGER: tl.constexpr = False):
    """Token m: q_rope[m] = rope(q_pe[m]); cache row cache_locs[m] = [rmsnorm(c_kv[m]) | rope(k_pe[m])].

    The norm is the rmsnorm kernel's: the same row code (_rmsnorm_row) on a row addressed as it addresses one
    (c_kv as [M, R], row = program id), the launcher gives it that kernel's BLOCK_N and num_warps and its fp fusion
    (on); the ropes run the rope kernel's code with every product an explicit round-to-nearest multiply (MUL_RN) so
    that fusion cannot contract them (the rope kernel launches with fusion off). ENTRY_TRIGGER (PDL only): the next
    launch, mla_attention's q_absorb, may start at this kernel's entry (the launcher's entry_trigger)."""
    if PDL:
        if ENTRY_TRIGGER:
            pdl_launch_next()
    m = tl.program_id(0)
    row = m.to(tl.int64)
    b, t = m // T, m % T
    offs_h = tl.arange(0, BLOCK_NH)
    offs_i = tl.arange(0, BLOCK_HALF)
    cols = tl.arange(0, BLOCK_R)
    mask_i, mask_r = offs_i < HALF, cols < R
    mask_q = (offs_h < NH)[:, None] & mask_i[None, :]
    w = tl.load(w_ptr + cols, mask=mask_r, other=0.0)
    inv_freq = _rope_inv_freq(HALF, ln_theta_hi, ln_theta_lo, BLOCK_HALF, MUL_RN)
    if PDL:
        pdl_wait_late(LATE_TRIGGER)
    pos = tl.load(pos_ptr + b.to(tl.int64) * stride_pos_b + t * stride_pos_t).to(tl.float32)
    loc = tl.load(locs_ptr + b.to(tl.int64) * stride_locs_b + t * stride_locs_t).to(tl.int64)
    qe, qo = _rope_pairs(q_ptr + b.to(tl.int64) * stride_qb + t * stride_qt + offs_h[:, None] * stride_qh
                         + 2 * offs_i[None, :], mask_q)                                # [BLOCK_NH, BLOCK_HALF]
    ke, ko = _rope_pairs(k_ptr + row * stride_k + 2 * offs_i, mask_i)                  # [BLOCK_HALF]
    x = tl.load(c_ptr + row * stride_c + cols, mask=mask_r, other=0.0)                 # [BLOCK_R]
    if PDL:
        pdl_trigger_late(LATE_TRIGGER)
    cos, sin = _rope_cos_sin(pos, inv_freq, MUL_RN)
    q_lo, q_hi = _rope_rotate(qe, qo, cos[None, :], sin[None, :], MUL_RN)
    dst = qout_ptr + (m * NH + offs_h[:, None]).to(tl.int64) * (2 * HALF) + offs_i[None, :]
    tl.store(dst, q_lo.to(qout_ptr.dtype.element_ty), mask=mask_q)
    tl.store(dst + HALF, q_hi.to(qout_ptr.dtype.element_ty), mask=mask_q)
    # the cache row rounds as the unfused ops do: to the activation dtype (rmsnorm's, rope's outputs), then to the
    # cache dtype (mla_cache_write)
    cache_row = kv_ptr + loc * stride_row
    normed = _rmsnorm_row(x, w, R, eps).to(c_ptr.dtype.element_ty)
    tl.store(cache_row + cols, normed.to(kv_ptr.dtype.element_ty), mask=mask_r)
    k_lo, k_hi = _rope_rotate(ke, ko, cos, sin, MUL_RN)
    k_ty = k_ptr.dtype.element_ty
    tl.store(cache_row + R + offs_i, k_lo.to(k_ty).to(kv_ptr.dtype.element_ty), mask=mask_i)
    tl.store(cache_row + R + HALF + offs_i, k_hi.to(k_ty).to(kv_ptr.dtype.element_ty), mask=mask_i)


# ------------------------------------------------------------------------------------------------ launchers


def _pow2(n: int, least: int = 1) -> int:
    return max(least, triton.next_power_of_2(n))


def _fp32(v: float) -> float:
    """v rounded to the nearest fp32 (as a Python float)."""
    return struct.unpack("f", struct.pack("f", v))[0]


def split_shape(block_h: int, block_r: int, fp32: bool, tile_rows: int | None = None) -> tuple[int, int]:
    """(queries a split program, its num_warps) for padded heads block_h and latent block_r; tile_rows defaults to
    SPLIT_TILE_ROWS at call time (fp32 caches: one query a program)."""
    tile_rows = SPLIT_TILE_ROWS if tile_rows is None else tile_rows
    qpp = 1 if fp32 else max(1, tile_rows // block_h)
    warps = SPLIT_WARPS_SMALL_ACC if qpp * block_h * block_r <= SMALL_ACC and not fp32 else SPLIT_WARPS
    return qpp, warps


def _split_chunks(block_r: int) -> int:
    """Column chunks of the split program's latent (SPLIT_CHUNKS while a chunk keeps tl.dot's minimum width)."""
    return SPLIT_CHUNKS if block_r // SPLIT_CHUNKS >= MIN_DOT else 1


def _ln_theta(theta: float) -> tuple[float, float]:
    """ln(theta) as two fp32 halves (hi + lo, exact in float64): the rope kernels' scalar arguments are fp32."""
    hi = _fp32(math.log(theta))
    return hi, _fp32(math.log(theta) - hi)


def _interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


def _launch_opts(pdl: bool, device: torch.device) -> tuple[bool, dict]:
    pdl = pdl and pdl_supported(device)
    return pdl, ({"launch_pdl": True} if pdl else {})


def _want(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _inner_contiguous(t: torch.Tensor) -> torch.Tensor:
    """t itself if its last dim is dense, else a contiguous copy (every kernel reads rows with unit stride)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_attention(q_nope, q_rope, kv_pages, kv_b_weight, page_rows, positions) -> tuple[int, ...]:
    """(B, T, H, N, Rr, R, Vd) after validating every shape and dtype; ValueError names what is wrong."""
    _want(q_nope.dim() == 4, f"mla_attention: q_nope must be [B, T, H, N], got {list(q_nope.shape)}")
    B, T, H, N = q_nope.shape
    _want(q_rope.dim() == 4 and tuple(q_rope.shape[:3]) == (B, T, H),
          f"mla_attention: q_rope is {list(q_rope.shape)}, want [{B}, {T}, {H}, Rr]")
    _want(kv_b_weight.dim() == 2 and kv_b_weight.shape[0] % H == 0 and kv_b_weight.shape[0] // H > N,
          f"mla_attention: kv_b_weight is {list(kv_b_weight.shape)}, want [H * (N + Vd), R] with H={H}, N={N}")
    R, Rr = kv_b_weight.shape[1], q_rope.shape[3]
    Vd = kv_b_weight.shape[0] // H - N
    _want(kv_pages.dim() == 3 and kv_pages.shape[2] == R + Rr,
          f"mla_attention: kv_pages is {list(kv_pages.shape)}, want [NP, PS, {R + Rr}] (R={R} + Rr={Rr})")
    _want(page_rows.dim() == 2 and page_rows.shape[0] == B,
          f"mla_attention: page_rows is {list(page_rows.shape)}, want [{B}, MP]")
    _want(tuple(positions.shape) == (B, T), f"mla_attention: positions is {list(positions.shape)}, want [{B}, {T}]")
    for name, t in (("page_rows", page_rows), ("positions", positions)):
        _want(t.dtype in (torch.int32, torch.int64), f"mla_attention: {name} must be int32/int64, got {t.dtype}")
    dtypes = {q_nope.dtype, q_rope.dtype, kv_pages.dtype, kv_b_weight.dtype}
    _want(len(dtypes) == 1 and q_nope.dtype in DTYPES,
          f"mla_attention: q_nope, q_rope, kv_pages, kv_b_weight must share one of {DTYPES}, got "
          f"{q_nope.dtype}, {q_rope.dtype}, {kv_pages.dtype}, {kv_b_weight.dtype}")
    _want(kv_pages.stride(-1) == 1, "mla_attention: kv_pages rows must be contiguous")
    return B, T, H, N, Rr, R, Vd


def _mla_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_pages: torch.Tensor, kv_b_weight: torch.Tensor,
                   page_rows: torch.Tensor, positions: torch.Tensor, scale: float,
                   gate: torch.Tensor | None = None, *, pdl: bool = False,
                   split_rows: int | None = None, block_n: int | None = None, split_warps: int | None = None,
                   split_stages: int | None = None, combine_block_s: int | None = None,
                   combine_block_r: int | None = None, entry_trigger: bool = False,
                   combine_absorb: bool | None = None, late_q: bool = False) -> torch.Tensor:
    """`mla_attention` with the split tunables exposed (tests use small splits; the bench sweeps them). A tunable
    left None is the module's value at call time (bench/device_step.py --variant overrides those)."""
    split_rows = SPLIT_ROWS if split_rows is None else split_rows
    split_stages = SPLIT_STAGES if split_stages is None else split_stages
    combine_block_s = CB_BLOCK_S if combine_block_s is None else combine_block_s
    combine_block_r = CB_BLOCK_R if combine_block_r is None else combine_block_r
    B, T, H, N, Rr, R, Vd = _check_attention(q_nope, q_rope, kv_pages, kv_b_weight, page_rows, positions)
    _want(gate is None or (tuple(gate.shape) == (B, T, H) and gate.is_floating_point()),
          f"mla_attention: gate is {None if gate is None else list(gate.shape)} "
          f"{None if gate is None else gate.dtype}, want [{B}, {T}, {H}] float logits")
    block_h, block_r, fp32 = _pow2(H, MIN_DOT), _pow2(R, MIN_DOT), kv_pages.dtype == torch.float32
    if block_n is None:
        block_n = BLOCK_N_FP32 if fp32 else BLOCK_N
    qpp, auto_warps = split_shape(block_h, block_r, fp32)
    split_warps = auto_warps if split_warps is None else split_warps
    _want(block_n >= MIN_DOT and split_rows % block_n == 0,
          f"mla_attention: want block_n >= {MIN_DOT} dividing split_rows, got {block_n}, {split_rows}")
    dev, M = q_nope.device, B * T
    out = torch.empty((B, T, H, Vd), dtype=q_nope.dtype, device=dev)
    if M == 0:
        return out
    q_nope, q_rope, kv_b = _inner_contiguous(q_nope), _inner_contiguous(q_rope), _inner_contiguous(kv_b_weight)
    PS = kv_pages.shape[1]
    capacity = page_rows.shape[1] * PS                                                 # MP * PS cache rows
    S = triton.cdiv(capacity, split_rows)
    gluon = mla_gluon.eligible(kv_pages, q_rope, H, R, Rr, split_rows)
    part_dtype = torch.bfloat16 if gluon and mla_gluon.PARTIAL_BF16 else torch.float32
    q_lat = torch.empty((M, H, R), dtype=kv_pages.dtype, device=dev)                   # [M, H, R]
    part_o = torch.empty((M, S, H, R), dtype=part_dtype, device=dev)                   # [M, S, H, R]
    part_ml = torch.empty((M, S, H, 2), dtype=torch.float32, device=dev)               # [M, S, H, (m, l)]
    pdl, launch = _launch_opts(pdl, dev)
    head_rows = N + Vd
    qa_tile = QA_TILE_M if QA_TILE else 0
    _q_absorb_kernel[(H, triton.cdiv(R, QA_BLOCK_R), triton.cdiv(M, qa_tile) if qa_tile else M)](
        q_nope, kv_b, q_lat, M, T, q_nope.stride(0), q_nope.stride(1), q_nope.stride(2), kv_b.stride(0),
        H=H, N=N, R=R, HEAD_ROWS=head_rows, BLOCK_NOPE=_pow2(N), BLOCK_R=QA_BLOCK_R, PDL=pdl,
        EARLY=QA_EARLY and not late_q, ENTRY=QA_ENTRY, TILE_M=qa_tile, IEEE=fp32 or _interpreting(),
        num_warps=GEMV_WARPS, **launch)
    gluon = gluon and mla_gluon.launch(
        q_lat, q_rope, kv_pages, page_rows, positions, part_o, part_ml, B, T, S, capacity, scale * LOG2E, pdl)
    if not gluon:
        if part_o.dtype != torch.float32:      # the Gluon launch failed to compile: the Triton split's fp32 partials
            part_o = torch.empty((M, S, H, R), dtype=torch.float32, device=dev)
        _split_kernel[(B * triton.cdiv(T, qpp), S)](
            q_lat, q_rope, kv_pages, page_rows, positions, part_o, part_ml, T, S, capacity, scale * LOG2E,
            q_rope.stride(0), q_rope.stride(1), q_rope.stride(2), kv_pages.stride(0), kv_pages.stride(1),
            page_rows.stride(0), positions.stride(0), positions.stride(1),
            PS=PS, H=H, R=R, RR=Rr, BLOCK_H=block_h, BLOCK_R=block_r, BLOCK_E=_pow2(Rr, MIN_DOT), SPLIT=split_rows,
            BLOCK_N=block_n, IEEE=fp32, PDL=pdl, PREFETCH=pdl and SPLIT_PREFETCH, NUM_PAGES=kv_pages.shape[0],
            L_LINES=_pow2(triton.cdiv(R + Rr, PREFETCH_LINE.value)), CHUNKS=_split_chunks(block_r),
            EARLY_POS=EARLY_POS, QPP=qpp, num_warps=split_warps, num_stages=split_stages, **launch)
    g, g_strides = (gate, gate.stride()) if gate is not None else (out, (0, 0, 0))   # out: a never-read stand-in
    if (COMBINE_ABSORB if combine_absorb is None else combine_absorb) and M * H <= CA_COUNTERS:
        blocks = triton.cdiv(R, combine_block_r)
        partials = torch.empty((M * H, blocks, Vd), dtype=torch.float32, device=dev)
        _combine_absorb_kernel[(M * H, blocks)](
            part_o, part_ml, positions, kv_b, partials, workspace.counters(dev, "mla_combine_absorb", CA_COUNTERS),
            out, g, T, S, positions.stride(0), positions.stride(1), kv_b.stride(0), *g_strides,
            H=H, N=N, R=R, VD=Vd, HEAD_ROWS=head_rows, SPLIT=split_rows, S_POW2=_pow2(S, MIN_DOT),
            BLOCK_S=combine_block_s, BLOCK_R=combine_block_r, BLOCK_VD=_pow2(Vd), GATE=gate is not None, PDL=pdl,
            ENTRY_TRIGGER=pdl and entry_trigger, EARLY_POS=EARLY_POS, ONE_STEP=M <= COMBINE_ONE_STEP,
            num_warps=GEMV_WARPS, **launch)
        return out
    va_tile = QA_TILE_M if VA_TILE else 0                  # the tile form's o_lat in the cache dtype (its dot's input)
    o_lat = torch.empty((M, H, R), dtype=kv_pages.dtype if va_tile else torch.float32, device=dev)   # [M, H, R]
    _combine_kernel[(M * H, triton.cdiv(R, combine_block_r))](
        part_o, part_ml, positions, o_lat, T, S, positions.stride(0), positions.stride(1),
        H=H, R=R, SPLIT=split_rows, S_POW2=_pow2(S, MIN_DOT), BLOCK_S=combine_block_s, BLOCK_R=combine_block_r, PDL=pdl,
        EARLY_POS=EARLY_POS, ONE_STEP=M <= COMBINE_ONE_STEP, num_warps=GEMV_WARPS, **launch)
    _v_absorb_kernel[(H, triton.cdiv(Vd, VA_BLOCK_V), triton.cdiv(M, va_tile) if va_tile else M)](
        o_lat, kv_b, out, g, M, T, kv_b.stride(0), *g_strides, H=H, N=N, R=R, VD=Vd, HEAD_ROWS=head_rows,
        BLOCK_V=VA_BLOCK_V, BLOCK_R=block_r, GATE=gate is not None, PDL=pdl, ENTRY_TRIGGER=pdl and entry_trigger,
        TILE_M=va_tile, IEEE=fp32 or _interpreting(), num_warps=GEMV_WARPS, **launch)
    return out


def mla_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_pages: torch.Tensor, kv_b_weight: torch.Tensor,
                  page_rows: torch.Tensor, positions: torch.Tensor, scale: float, gate: torch.Tensor | None = None,
                  *, pdl: bool = False, entry_trigger: bool = False, late_q: bool = False) -> torch.Tensor:
    """Weight-absorbed split-KV decode attention, as torch.ops.lingc.mla_attention: [B, T, H, Vd] in q's dtype.

    q_nope [B, T, H, N], q_rope [B, T, H, Rr] (rotated), kv_pages [NP, PS, R + Rr], kv_b_weight
    [H * (N + Vd), R], page_rows [B, MP] int, positions [B, T] int (query t sees rows j <= positions[b, t];
    positions must be < MP * PS). gate [B, T, H] (fuse_mla): the output times sigmoid(gate) as sigmoid_gate
    computes it, in v_absorb's epilogue. pdl is dropped where unsupported. entry_trigger (a launch hint, PDL only):
    the last kernel, v_absorb, lets the next launch start at its entry (kernels/pdl.py). late_q (a launch hint):
    q_absorb loads q_nope after its PDL wait, never before it (QA_EARLY off for this launch): the pdl pass sets it
    where the launch before triggers at its entry (passes/pdl.py PREP_ENTRY_TRIGGER), since q_nope's writer, two
    launches back, may then still run when q_absorb's pre-wait code does.
    """
    return _mla_attention(q_nope, q_rope, kv_pages, kv_b_weight, page_rows, positions, scale, gate, pdl=pdl,
                          entry_trigger=entry_trigger, late_q=late_q)


def mla_cache_write(kv_pages: torch.Tensor, latent: torch.Tensor, cache_locs: torch.Tensor, *,
                    pdl: bool = False) -> None:
    """kv_pages.view(-1, L)[cache_locs] = latent, as torch.ops.lingc.mla_cache_write (mutates kv_pages)."""
    _want(kv_pages.dim() == 3 and latent.dim() == 3 and latent.shape[2] == kv_pages.shape[2],
          f"mla_cache_write: kv_pages is {list(kv_pages.shape)}, latent {list(latent.shape)}; "
          f"want [NP, PS, L] and [B, T, L]")
    _want(tuple(cache_locs.shape) == tuple(latent.shape[:2]) and cache_locs.dtype in (torch.int32, torch.int64),
          f"mla_cache_write: cache_locs is {list(cache_locs.shape)} {cache_locs.dtype}, "
          f"want {list(latent.shape[:2])} int64")
    _want(kv_pages.is_contiguous(), "mla_cache_write: kv_pages must be contiguous (rows are addressed flat)")
    B, T, L = latent.shape
    if B * T == 0:
        return None
    latent = _inner_contiguous(latent)
    pdl, launch = _launch_opts(pdl, kv_pages.device)
    _cache_write_kernel[(B * T,)](kv_pages, latent, cache_locs, T, L, kv_pages.stride(1), latent.stride(0),
                                  latent.stride(1), cache_locs.stride(0), cache_locs.stride(1),
                                  BLOCK_L=_pow2(L), PDL=pdl, num_warps=GEMV_WARPS, **launch)
    return None


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float, *, pdl: bool = False) -> torch.Tensor:
    """Interleaved-pair RoPE of x [B, T, n, Rr] at positions [B, T], de-interleaved output, as torch.ops.lingc.rope."""
    _want(x.dim() == 4 and x.shape[3] % 2 == 0, f"rope: x must be [B, T, n, Rr] with Rr even, got {list(x.shape)}")
    B, T, NH, RR = x.shape
    _want(tuple(positions.shape) == (B, T), f"rope: positions is {list(positions.shape)}, want [{B}, {T}]")
    out = torch.empty((B, T, NH, RR), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x = _inner_contiguous(x)
    pdl, launch = _launch_opts(pdl, x.device)
    # no FMA contraction: xe*cos - xo*sin rounds each product like the reference
    _rope_kernel[(B * T,)](x, positions, out, T, NH, RR // 2, *_ln_theta(theta),
                           x.stride(0), x.stride(1), x.stride(2), positions.stride(0), positions.stride(1),
                           BLOCK_NH=_pow2(NH), BLOCK_HALF=_pow2(RR // 2), PDL=pdl, num_warps=GEMV_WARPS,
                           enable_fp_fusion=False, **launch)
    return out


def sigmoid_gate(x: torch.Tensor, gate_logits: torch.Tensor, *, pdl: bool = False) -> torch.Tensor:
    """x [B, T, H, V] * sigmoid(gate_logits [B, T, H]) (fp32, cast to x's dtype), as torch.ops.lingc.sigmoid_gate."""
    _want(x.dim() == 4 and tuple(gate_logits.shape) == tuple(x.shape[:3]),
          f"sigmoid_gate: x is {list(x.shape)}, gate_logits {list(gate_logits.shape)}; want [B, T, H, V] and [B, T, H]")
    B, T, H, V = x.shape
    out = torch.empty((B, T, H, V), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x = _inner_contiguous(x)
    pdl, launch = _launch_opts(pdl, x.device)
    _sigmoid_gate_kernel[(B * T,)](x, gate_logits, out, T, H, V, x.stride(0), x.stride(1), x.stride(2),
                                   gate_logits.stride(0), gate_logits.stride(1), gate_logits.stride(2),
                                   BLOCK_H=_pow2(H), BLOCK_V=_pow2(V), PDL=pdl, num_warps=GEMV_WARPS, **launch)
    return out


def mla_prep(q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor, kv_norm_weight: torch.Tensor,
             kv_pages: torch.Tensor, cache_locs: torch.Tensor, positions: torch.Tensor, theta: float, eps: float, *,
             pdl: bool = False, entry_trigger: bool = False) -> torch.Tensor:
    """rope(q_pe) and the cache rows [rmsnorm(c_kv) | rope(k_pe)] in one launch, as torch.ops.lingc.mla_prep.

    q_pe [B, T, H, Rr], c_kv [B, T, R], k_pe [B, T, Rr] (views of the projections), kv_norm_weight [R], kv_pages
    [NP, PS, R + Rr] (written at cache_locs [B, T]), positions [B, T]. Returns q_rope [B, T, H, Rr] in q_pe's dtype.
    pdl is dropped where unsupported. entry_trigger (a launch hint, PDL only): the next launch may start at this
    kernel's entry (passes/pdl.py PREP_ENTRY_TRIGGER: mla_attention, whose q_absorb reads only kv_b before its wait and
    whose split, launched at q_absorb's entry, reads only older cache rows, positions and page rows before its own).
    """
    _want(q_pe.dim() == 4 and q_pe.shape[3] % 2 == 0,
          f"mla_prep: q_pe must be [B, T, H, Rr] with Rr even, got {list(q_pe.shape)}")
    B, T, H, Rr = q_pe.shape
    _want(c_kv.dim() == 3 and tuple(c_kv.shape[:2]) == (B, T),
          f"mla_prep: c_kv is {list(c_kv.shape)}, want [{B}, {T}, R]")
    R = c_kv.shape[2]
    _want(tuple(k_pe.shape) == (B, T, Rr), f"mla_prep: k_pe is {list(k_pe.shape)}, want [{B}, {T}, {Rr}]")
    _want(tuple(kv_norm_weight.shape) == (R,), f"mla_prep: kv_norm_weight is {list(kv_norm_weight.shape)}, want [{R}]")
    _want(kv_pages.dim() == 3 and kv_pages.shape[2] == R + Rr and kv_pages.is_contiguous(),
          f"mla_prep: kv_pages is {list(kv_pages.shape)}, want contiguous [NP, PS, {R + Rr}] (R={R} + Rr={Rr})")
    for name, t in (("cache_locs", cache_locs), ("positions", positions)):
        _want(tuple(t.shape) == (B, T) and t.dtype in (torch.int32, torch.int64),
              f"mla_prep: {name} is {list(t.shape)} {t.dtype}, want [{B}, {T}] int32/int64")
    _want(triton.next_power_of_2(R) <= MAX_NORM_BLOCK, f"mla_prep: c_kv rows of {R} exceed one block")
    q_rope = torch.empty((B, T, H, Rr), dtype=q_pe.dtype, device=q_pe.device)
    if B * T == 0:
        return q_rope
    # c_kv and k_pe as [M, R] / [M, Rr] rows: the norm then addresses its row as the rmsnorm kernel does
    c2, k2 = _inner_contiguous(c_kv.reshape(B * T, R)), _inner_contiguous(k_pe.reshape(B * T, Rr))
    q_pe = _inner_contiguous(q_pe)
    pdl, launch = _launch_opts(pdl, q_pe.device)
    block_r = triton.next_power_of_2(R)
    _mla_prep_kernel[(B * T,)](
        q_pe, c2, k2, kv_norm_weight, kv_pages, cache_locs, positions, q_rope, T, H, Rr // 2, R, *_ln_theta(theta), eps,
        q_pe.stride(0), q_pe.stride(1), q_pe.stride(2), c2.stride(0), k2.stride(0), kv_pages.stride(1),
        cache_locs.stride(0), cache_locs.stride(1), positions.stride(0), positions.stride(1),
        BLOCK_NH=_pow2(H), BLOCK_HALF=_pow2(Rr // 2), BLOCK_R=block_r,
        MUL_RN=q_pe.is_cuda and not _interpreting(), PDL=pdl,
        LATE_TRIGGER=late_trigger("mla_prep", pdl, B * T, entry_trigger), ENTRY_TRIGGER=pdl and entry_trigger,
        num_warps=_norm_warps(block_r), **launch)
    return q_rope


# ----------------------------------------------------------------------------------------------- references


def mla_attention_ref(q_nope, q_rope, kv_pages, kv_b_weight, page_rows, positions, scale, gate=None) -> torch.Tensor:
    """lingc's reference MLA attention (expands K/V with kv_b in fp32; then the head gate if given)."""
    return torch.ops.lingc.mla_attention(q_nope, q_rope, kv_pages, kv_b_weight, page_rows, positions, scale, gate)


def mla_cache_write_ref(kv_pages, latent, cache_locs) -> None:
    """lingc's reference cache write (mutates kv_pages)."""
    torch.ops.lingc.mla_cache_write(kv_pages, latent, cache_locs)


def rope_ref(x, positions, theta) -> torch.Tensor:
    """lingc's reference RoPE."""
    return torch.ops.lingc.rope(x, positions, theta)


def sigmoid_gate_ref(x, gate_logits) -> torch.Tensor:
    """lingc's reference head gate."""
    return torch.ops.lingc.sigmoid_gate(x, gate_logits)


def mla_prep_ref(q_pe, c_kv, k_pe, kv_norm_weight, kv_pages, cache_locs, positions, theta, eps) -> torch.Tensor:
    """lingc's reference prep (rope, rmsnorm, cat and cache write composed; mutates kv_pages)."""
    return torch.ops.lingc.mla_prep(q_pe, c_kv, k_pe, kv_norm_weight, kv_pages, cache_locs, positions, theta, eps)


LOWERINGS = {
    "mla_attention": mla_attention,
    "mla_cache_write": mla_cache_write,
    "rope": rope,
    "sigmoid_gate": sigmoid_gate,
    "mla_prep": mla_prep,
}
