"""Skinny GEMM y = x @ weight.T for decode / verify row counts (M <= 16): two Triton kernels, launcher, reference.

Also the launchers of fuse_norm_linear's rmsnorm_linear / add_rmsnorm_linear, whose norm runs in a constexpr
prologue of the same two kernels (section NORM below); the file is past the ~400 lines of the style guide because
the prologue is part of the kernels, and the two kernels and their launch code belong together.

Contract of `torch.ops.lingc.linear` (lingc/ops/linear.py): x [..., K] is cast to weight.dtype, weight is
[N, K] (bf16; fp32 for the router and the reference lm_head), the product accumulates in fp32, is rounded
once to weight.dtype (what the reference's F.linear in the weight dtype returns) and then cast to
out_dtype (default x.dtype). Letters: M rows (prod of x's leading dims), N output features, K input
features, S the split-K factor, R rows per fma program; BN / BK / BM the block sizes.

Two kernels, one per shape class (CONFIG_TABLE, chosen from (N, K, dtype), never from M):
  dot (swap-AB, tensor cores): program (n, s) owns BN features and the s-th of S slices of K, streams
      W[BN, BK] blocks through a 4-stage cp.async pipeline and multiplies them with xT[BK, BM], BM = 16:
          acc[BN, BM] += tl.dot(W[n-tile, k-block], xT[k-block, :])     # fp32 accumulator
      All rows ride along for free (rows >= M are zero), so M = 1 and M = 16 cost the same.
  fma (CUDA cores): program (g, n, s) owns R rows and BN features; each lane keeps a running fp32 sum over
      the slice's blocks, acc[R, BN, BK] = fma(W, x, acc), then one tl.sum over BK. Small BN and wide BK put
      every program of a small weight in one wave (fastest at M = 1), but each row group re-reads the weight
      (from L2), so it is only used where the weight is small (and for fp32, where a "dot" would be an
      FMA loop anyway: input_precision="ieee", never TF32).
Row invariance (a verify chain must reproduce decode's bits): M is not specialised, every M <= 16 runs the
same compiled kernel, and an output element depends only on its own row of x and on the config.

Split-K (S > 1, where BN-wide tiles alone would leave most of the 132 SMs idle): each program writes its fp32
partial to a workspace [S, M, N], then takes a ticket from its tile's int32 counter (an acq_rel atomic after
a CTA barrier, so the partial is visible first). The program that draws the last ticket (S - 1) sums the S
partials in the fixed order 0, 1, ..., S-1, stores the result and resets the counter to 0 for the next
launch (or CUDA-graph replay). No float atomics: results are deterministic whichever program comes last.
The workspace is one per device (`device_workspace`, allocated and zeroed on first use, never resized); a
shape whose split would not fit it runs with S = 1. Launches on concurrent streams pass their own.

Bytes per call: N*K*w (the weight, read once) + M*K*x + M*N*y, plus 2*S*M*N*4 of L2-resident partials when
S > 1. At M = 1 it is the weight stream; bench/kernel_linear.py reports GB/s against it.

Rows M > 16 (prefill chunks) fall back to torch.nn.functional.linear in the weight dtype, then the cast:
the reference's own batched path, which cuBLAS runs near its matrix peak.

PDL (shared/docs/kernels.md section 1.5): with the constexpr PDL on, x, the workspace and the counters are touched
only after `gdc_wait()`; `gdc_launch_dependents()` follows the main loop (the last load of anything an earlier kernel
wrote). Weights are written by no earlier kernel, and two ways of reading them before the wait were measured in the
H200 decode step (bench/results/step-ab-h200-20261201-c.json, same bits throughout):
  - an L2 prefetch of the first PREFETCH_BLOCKS blocks of each first-wave program's slice (LINGC_LINEAR_PREFETCH_BLOCKS;
    the default until 2026-12-01 was 16, every slice): off is faster, decode 1.281 -> 1.249 ms, verify 2.613 ->
    2.584. So it is off (0); the knob stays for A/Bs.
  - "dot" programs loading their slice's first blocks into registers (32 / 64 KiB, or only slices that fit whole):
    1.281 -> 1.326-1.379 ms. Not kept. Only the small "fma" slices (FMA_PRELOAD, the router GEMV) preload. Why, from
    the reverted kernel's sm_90 SASS (9e7b19b, o_proj's shape, compiled offline with the launch's divisibility
    hints): the preload is 32 vectorised LDG.E.128 per thread issued before ACQBULK (griddepcontrol.wait), as meant,
    but after the wait each preloaded block goes registers -> shared memory (STS, MEMBAR.ALL.CTA, BAR.SYNC) before
    its wgmma, one block at a time with a wait on each wgmma, where the loop feeds wgmma from cp.async (LDGSTS)
    stages that overlap the MMAs. A register preload so pays only where the kernel before runs long enough to land
    it (the MoE down-GEMM's, behind the 12 us up-GEMM); o_proj follows a ~1 us gated_rmsnorm. A preload worth trying
    would land the weight slice in shared memory before the wait (cp.async or TMA, which Triton's pipeliner does not
    place before gdc_wait; Gluon could).
With PDL off no GDC or prefetch instruction exists (the interpreter cannot run them).

NORM (constexpr; rmsnorm_linear / add_rmsnorm_linear, lingc/ops/norm_linear.py): the linear's x is
rmsnorm(h) with h = x, or (HAS_RESIDUAL) h = residual + x added in fp32 and rounded once to the activation dtype,
exactly as add_rmsnorm forms the new residual. Every program first sums the squares of its rows' h over all of K
(not only its slice; NORM_BLOCK-wide lanes, one tl.sum at the end) and takes rstd = rsqrt(sum / K + eps) as the
rmsnorm kernel does; the main loop then rebuilds each x block as the rmsnorm reference rounds it,
round_act(nw * round_act(h * rstd)) in fp32 products, before the usual cast to the weight dtype. The programs of
the first N tile (n == 0; for fma every row group) store the new residual and, with WRITE_NORMED, the normed
block of their own K slice, so split-K writes each element exactly once. Row invariance holds as above: a row's
rstd and blocks depend only on that row. The sum of squares runs in another order than the rmsnorm kernel's one
tl.sum over the row, so rstd can differ in its last bit and a bf16 normed element by one rounding: the pass
declares a numerics change. Bytes: the linear's, plus the norm weight (K*x) and the new residual / normed
(M*K*x each) written once; every program also re-reads its rows of x (and the residual) for the prologue and the
norm weight in its slice, from L2 (at M = 1, K = 1536: 3-6 KB per program). Saved: one launch (~1.5-3 us at
batch 1) and the normed round trip through memory. Under PDL the prologue reads activations, so it follows
gdc_wait. Rows M > 16 run the unfused kernels (the rmsnorm kernel, then F.linear), bit for bit as before.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from lingc.knobs import env_flag, env_int
from lingc.kernels import linear_tma
from lingc.kernels.kda import _sigmoid
from lingc.kernels.workspace import indexed
from lingc.kernels.pdl import pdl_supported, pdl_trigger, pdl_wait, prefetch_l2
import lingc.ops  # noqa: F401  (registers torch.ops.lingc.*, used by the reference)
from lingc.ops.linear import ROW_INVARIANT_ROWS

MAX_ROWS = ROW_INVARIANT_ROWS   # rows the kernel takes; more go to F.linear (prefill)
BLOCK_M = 16                    # the padded row block; >= tl.dot's minimum of 16 and >= MAX_ROWS
WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class LinearConfig:
    """Tunables of one launch; chosen from (N, K, weight dtype) only, never from M.
    kind "dot": _linear_dot_kernel (all rows in one program, tensor cores); "fma": _linear_fma_kernel (groups
    of `rows` rows per program, CUDA-core FMAs; M rows take cdiv(M, rows) programs per tile)."""
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    kind: str = "dot"
    rows: int = 1


# Config table by shape class, from the H200 sweep in bench/results/kernel-linear-sweep-h200-20261130.json
# (bench/kernel_linear.py --sweep; times are per call, cold weights, in a CUDA graph). First match wins.
# Row: (weight element size, largest weight bytes N*K*size, config); split_k 0 means `_auto_split`.
#   bf16 <= 1 MiB  (kda_b / MLA gate, q_a, bf16 router): fma, 4 features x 512 of K per block, one wave
#   bf16 larger    (projections, MLP, lm_head): dot, 64-feature tiles, split K until ~128 programs
#   fp32 <= 4 MiB  (fp32 router): fma with split 4;  fp32 larger (fp32 lm_head): fma, 8-feature tiles
# "dot" costs the same at M = 1 and M = 6; "fma" (one row per program) is faster at M = 1 but re-reads the
# weight (from L2) once per row, so it only pays where the weight is small. The fp32 lm_head is the exception
# (no fast fp32 dot): ~cuBLAS at M = 1, ~2x cuBLAS at M = 6 (rows=4 would trade: 1.2x at M = 1, 1x at M = 6).
CONFIG_TABLE: tuple[tuple[int, int, LinearConfig], ...] = (
    (2, 1 << 20, LinearConfig(block_n=4, block_k=512, split_k=1, num_warps=4, num_stages=3, kind="fma")),
    (2, 1 << 62, LinearConfig(block_n=64, block_k=128, split_k=0, num_warps=4, num_stages=4, kind="dot")),
    (4, 4 << 20, LinearConfig(block_n=4, block_k=256, split_k=4, num_warps=4, num_stages=3, kind="fma")),
    (4, 1 << 62, LinearConfig(block_n=8, block_k=256, split_k=1, num_warps=4, num_stages=3, kind="fma")),
)
SPLIT_TARGET_PROGRAMS = 128   # auto split: grow S (powers of two) until tiles * S reaches ~ one program per SM,
MIN_SLICE_BLOCKS = 3          # keeping >= 3 BK blocks per slice (the ticket + partial pass costs ~0.4 us)
PREFETCH_PROGRAMS = tl.constexpr(264)      # PDL: programs of the first wave (2 per SM) prefetch their first blocks...
PREFETCH_BLOCKS = tl.constexpr(env_int("LINGC_LINEAR_PREFETCH_BLOCKS", 0))  # ...this many
                     # (at most; not past their slice), into L2, before gdc_wait. 0 (off): the H200 decode step is
                     # 32 us faster without it (module docstring); 16 covers every slice of the Ling shapes
# "fma" kind, unsplit, weight slice <= FMA_PRELOAD_ELEMENTS a program (the bf16 router: 4 x 1536): the slice goes
# into registers before the PDL wait instead of an L2 prefetch (LINGC_LINEAR_FMA_PRELOAD=0 turns it off)
FMA_PRELOAD = env_flag("LINGC_LINEAR_FMA_PRELOAD", True)
FMA_PRELOAD_ELEMENTS = 8192   # 64 bf16 a thread at 4 warps
WORKSPACE_FLOATS = 1 << 20    # the per-device split-K workspace: 4 MiB of fp32 partials (S * 16 * N <= this)
WORKSPACE_COUNTERS = 1 << 14  # and 64 KiB of tile counters
NORM_BLOCK_K = 512            # NORM prologue: K elements per row per step of the sum of squares (untuned; K <= 1536
                              # is 3 steps; the [16, 512] fp32 lane sums of a "dot" program are 64 registers a thread)


@triton.jit
def _prefetch_slice(w_ptr, offs_n, k_start, k_end, N, K, stride_wn, program,
                    BLOCK_K: tl.constexpr, LINE: tl.constexpr):
    """First-wave programs ask L2 for the first PREFETCH_BLOCKS blocks of their weight rows (one request per
    LINE elements); later programs would only add requests for lines they are about to load anyway."""
    if program < PREFETCH_PROGRAMS:
        rows = tl.minimum(offs_n, N - 1).to(tl.int64) * stride_wn              # [BN]
        for b in tl.static_range(PREFETCH_BLOCKS):
            if k_start + b * BLOCK_K < k_end:
                cols = k_start + b * BLOCK_K + tl.arange(0, BLOCK_K // LINE) * LINE  # [BK / LINE]
                cols = tl.minimum(cols, tl.minimum(k_end, K) - 1)
                prefetch_l2(w_ptr + rows[:, None] + cols[None, :])


@triton.jit
def _finish(acc, y_ptrs, part_ptr, part_offs, count_ptr, out_mask, pid_s, slice_size, w_ptr,
            SPLIT_K: tl.constexpr):
    """Store acc (rounded to the weight dtype, then to y's); with SPLIT_K > 1 go through the workspace:
    publish the partial, take a ticket, and let the last of the S programs sum partials 0..S-1 in order."""
    w_dtype = w_ptr.dtype.element_ty
    y_dtype = y_ptrs.dtype.element_ty
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(w_dtype).to(y_dtype), mask=out_mask)
    else:
        tl.store(part_ptr + pid_s * slice_size + part_offs, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is written before the ticket (release) is taken
        ticket = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            total = tl.zeros(acc.shape, dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):                                # fixed order 0..S-1
                total += tl.load(part_ptr + s * slice_size + part_offs, mask=out_mask, other=0.0,
                                 cache_modifier=".cg")
            tl.store(y_ptrs, total.to(w_dtype).to(y_dtype), mask=out_mask)
            tl.store(count_ptr, 0)                                            # ready for the next launch


@triton.jit
def _residual_sum(x_ptrs, res_ptrs, mask, HAS_RESIDUAL: tl.constexpr):
    """h = x, or residual + x added in fp32 and rounded once to the activation dtype (torch's `residual + x`,
    as add_rmsnorm forms the new residual)."""
    x = tl.load(x_ptrs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptrs, mask=mask, other=0.0)
        x = (res.to(tl.float32) + x.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _norm_rstd(x_ptr, res_ptr, offs_r, r_ok, K, stride_xm, stride_rm, eps,
               ROWS: tl.constexpr, NORM_BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """NORM prologue: rstd [ROWS] = rsqrt(sum(h^2) / K + eps) of each row's h over the whole of K (not just this
    program's slice), as the rmsnorm kernel computes it; per-lane fp32 sums over NORM_BLOCK-wide blocks, then one
    sum, so a row's rstd depends on nothing but the row (row invariance)."""
    sq = tl.zeros([ROWS, NORM_BLOCK], dtype=tl.float32)
    for k0 in range(0, K, NORM_BLOCK):
        cols = k0 + tl.arange(0, NORM_BLOCK)                                 # [NB]
        mask = r_ok[:, None] & (cols < K)[None, :]
        h = _residual_sum(x_ptr + offs_r[:, None] * stride_xm + cols[None, :],
                          res_ptr + offs_r[:, None] * stride_rm + cols[None, :], mask, HAS_RESIDUAL)
        hf = h.to(tl.float32)
        sq += hf * hf
    return tl.math.rsqrt(tl.sum(sq, axis=1) / K + eps)                      # [R]


@triton.jit
def _held_rstd(x_ptr, res_ptr, offs_r, r_ok, K, stride_xm, stride_rm, eps,
               ROWS: tl.constexpr, NORM_BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCKS: tl.constexpr):
    """_norm_rstd unrolled over the BLOCKS blocks of K (every block's loads issued at once, one L2 round trip), the
    same sums in the same order, also returning the h blocks for the fma kernel's main loop (HOLD_H)."""
    sq = tl.zeros([ROWS, NORM_BLOCK], dtype=tl.float32)
    hs = ()
    for b in tl.static_range(BLOCKS):
        cols = b * NORM_BLOCK + tl.arange(0, NORM_BLOCK)                     # [NB]
        mask = r_ok[:, None] & (cols < K)[None, :]
        hs = hs + (_residual_sum(x_ptr + offs_r[:, None] * stride_xm + cols[None, :],
                                 res_ptr + offs_r[:, None] * stride_rm + cols[None, :], mask, HAS_RESIDUAL),)
    for b in tl.static_range(BLOCKS):
        hf = hs[b].to(tl.float32)
        sq += hf * hf
    return tl.math.rsqrt(tl.sum(sq, axis=1) / K + eps), hs                  # [R], BLOCKS x [R, NB]


@triton.jit
def _x_block(x_ptrs, res_ptrs, mask, nw_ptrs, nw_mask, rstd, res_out_ptrs, normed_ptrs, store_mask,
             NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, WRITE_NORMED: tl.constexpr, h_held=None,
             HELD: tl.constexpr = False):
    """One block of the linear's input in the activation dtype: x itself, or (NORM) the norm's output rebuilt
    from x (+ residual) with the rmsnorm reference's roundings: h * rstd in fp32 rounded to the activation dtype,
    times the norm weight in fp32 (exact for two bf16 factors), rounded again. With NORM, where store_mask holds
    (the programs of the first N tile) the new residual and the normed block are written too. rstd and the
    norm weight pointers come shaped to broadcast against the block (rows on either axis). HELD: h is h_held, the
    block _held_rstd loaded (the same values), not loaded again."""
    if NORM:
        if HELD:
            h = h_held
        else:
            h = _residual_sum(x_ptrs, res_ptrs, mask, HAS_RESIDUAL)
        nw = tl.load(nw_ptrs, mask=nw_mask, other=0.0)
        normed = (h.to(tl.float32) * rstd).to(h.dtype)
        xb = (nw.to(tl.float32) * normed.to(tl.float32)).to(h.dtype)
        if HAS_RESIDUAL:
            tl.store(res_out_ptrs, h, mask=store_mask)
        if WRITE_NORMED:
            tl.store(normed_ptrs, xb, mask=store_mask)
    else:
        xb = tl.load(x_ptrs, mask=mask, other=0.0)
    return xb


@triton.jit
def _gated_block(x_ptrs, g_ptrs, mask, nw_ptrs, eps, inv_d, K_AXIS: tl.constexpr, HEAD_D: tl.constexpr,
                 PRECISE: tl.constexpr):
    """GATED: one block of gated_rmsnorm(x, nw, g) in the activation dtype, x * rstd * nw * sigmoid(g) in fp32 with
    rstd = rsqrt(sum(x^2) * (1/D) + eps) per head, the gated_rmsnorm kernel's formula. The block holds whole heads
    (HEAD_D divides BLOCK_K; blocks start at multiples of BLOCK_K), so each head's sum is local to the block:
    K_AXIS is the block's K axis (0: the dot kernel's [BK, BM], 1: the fma kernel's [R, BK])."""
    x = tl.load(x_ptrs, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
    nw = tl.load(nw_ptrs).to(tl.float32)
    sq = xf * xf
    if K_AXIS == 0:                                                     # [BK, BM]
        if x.shape[0] == HEAD_D:
            ss = tl.sum(sq, axis=0)[None, :]
        else:
            heads = tl.sum(tl.reshape(sq, [x.shape[0] // HEAD_D, HEAD_D, x.shape[1]]), axis=1)   # [BK / D, BM]
            ss = tl.reshape(tl.broadcast_to(heads[:, None, :], [x.shape[0] // HEAD_D, HEAD_D, x.shape[1]]),
                            [x.shape[0], x.shape[1]])
    else:                                                               # [R, BK]
        if x.shape[1] == HEAD_D:
            ss = tl.sum(sq, axis=1)[:, None]
        else:
            heads = tl.sum(tl.reshape(sq, [x.shape[0], x.shape[1] // HEAD_D, HEAD_D]), axis=2)   # [R, BK / D]
            ss = tl.reshape(tl.broadcast_to(heads[:, :, None], [x.shape[0], x.shape[1] // HEAD_D, HEAD_D]),
                            [x.shape[0], x.shape[1]])
    rstd = tl.math.rsqrt(ss * inv_d + eps)
    return (xf * rstd * nw * _sigmoid(g, PRECISE)).to(x.dtype)


@triton.jit(do_not_specialize=["M"])
def _linear_dot_kernel(x_ptr, w_ptr, y_ptr, part_ptr, count_ptr, res_ptr, nw_ptr, res_out_ptr, normed_ptr,
                       M, N, K, K_PER_SPLIT, stride_xm, stride_wn, stride_ym, stride_rm, eps,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
                       LINE: tl.constexpr, PDL: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                       WRITE_NORMED: tl.constexpr, NORM_BLOCK: tl.constexpr, GATED: tl.constexpr,
                       HEAD_D: tl.constexpr, PRECISE: tl.constexpr):
    """Program (n, s): acc[BN, BM] = W[n-tile, slice s] @ xT[slice s, all rows], BM = 16 rows always.
    NORM: xT is rmsnorm(x [+ residual]) rebuilt block by block after a prologue over all of K (_norm_rstd);
    residual_out / normed [M, K] (row stride K) are written by the programs with n == 0.
    GATED: xT is gated_rmsnorm(x, nw, gate) with heads of HEAD_D, built block by block (_gated_block); the gate
    comes in res_ptr (row stride stride_rm)."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                     # [BN]
    offs_m = tl.arange(0, BLOCK_M)                                        # [BM]
    k_start = pid_s * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    if PDL:  # weights are written by no earlier kernel: start pulling them in before the wait
        _prefetch_slice(w_ptr, offs_n, k_start, k_end, N, K, stride_wn, pid_n + pid_s * tl.num_programs(0),
                        BLOCK_K, LINE)
        pdl_wait()
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if NORM:
        rstd = _norm_rstd(x_ptr, res_ptr, offs_m, m_ok, K, stride_xm, stride_rm, eps, BLOCK_M, NORM_BLOCK,
                          HAS_RESIDUAL)
    ks = k_start + tl.arange(0, BLOCK_K)                                  # [BK]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + ks[None, :]
    x_ptrs = x_ptr + offs_m[None, :] * stride_xm + ks[:, None]            # [BK, BM]
    res_ptrs = res_ptr + offs_m[None, :] * stride_rm + ks[:, None]        # [BK, BM]
    out_offs = offs_m[None, :] * K + ks[:, None]                          # [BK, BM] in residual_out / normed
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_ok = (k0 + tl.arange(0, BLOCK_K)) < K
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)           # [BN, BK]
            x_mask = m_ok[None, :]
        else:
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x_mask = k_ok[:, None] & m_ok[None, :]
        if GATED:
            xt = _gated_block(x_ptrs, res_ptrs, x_mask, nw_ptr + (tl.arange(0, BLOCK_K) % HEAD_D)[:, None], eps,
                              1.0 / HEAD_D, 0, HEAD_D, PRECISE)          # [BK, BM]
        else:
            xt = _x_block(x_ptrs, res_ptrs, x_mask, nw_ptr + k0 + tl.arange(0, BLOCK_K)[:, None], k_ok[:, None],
                          rstd[None, :], res_out_ptr + out_offs, normed_ptr + out_offs, x_mask & (pid_n == 0),
                          NORM, HAS_RESIDUAL, WRITE_NORMED)               # [BK, BM]
        acc = tl.dot(w, xt.to(w.dtype), acc, input_precision="ieee" if IEEE else None)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        res_ptrs += BLOCK_K
        out_offs += BLOCK_K
    if PDL:
        pdl_trigger()
    out_mask = n_ok[:, None] & m_ok[None, :]                              # [BN, BM]
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]        # [BN, BM] -> y[m, n]
    part_offs = offs_m[None, :] * N + offs_n[:, None]                     # [BN, BM] in one [M, N] slice
    _finish(acc, y_ptrs, part_ptr, part_offs, count_ptr + pid_n, out_mask, pid_s, M * N, w_ptr, SPLIT_K)


@triton.jit
def _fma_block(acc, w, x_ptrs, res_ptrs, out_offs, k0, K, r_ok, n_ok, pid_n, rstd, eps, nw_ptr, res_out_ptr, normed_ptr,
               BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
               WRITE_NORMED: tl.constexpr, GATED: tl.constexpr, HEAD_D: tl.constexpr, PRECISE: tl.constexpr,
               h_held=None, HELD: tl.constexpr = False):
    """One BK block of the fma kernel: its x block (or the norm's, written out by the programs of N tile 0) times the
    [BN, BK] weight block w, added lane by lane to acc [R, BN, BK]."""
    k_ok = (k0 + tl.arange(0, BLOCK_K)) < K
    if EVEN_K:
        x_mask = r_ok[:, None]
    else:
        x_mask = r_ok[:, None] & k_ok[None, :]
    if GATED:
        xv = _gated_block(x_ptrs, res_ptrs, x_mask, nw_ptr + (tl.arange(0, BLOCK_K) % HEAD_D)[None, :], eps,
                          1.0 / HEAD_D, 1, HEAD_D, PRECISE)              # [R, BK]
    else:
        xv = _x_block(x_ptrs, res_ptrs, x_mask, nw_ptr + k0 + tl.arange(0, BLOCK_K)[None, :], k_ok[None, :],
                      rstd[:, None], res_out_ptr + out_offs, normed_ptr + out_offs, x_mask & (pid_n == 0),
                      NORM, HAS_RESIDUAL, WRITE_NORMED, h_held, HELD)     # [R, BK]
    xf = xv.to(w.dtype).to(tl.float32)
    return tl.fma(w.to(tl.float32)[None, :, :], xf[:, None, :], acc)     # per-lane sums, sequential in k


@triton.jit(do_not_specialize=["M"])
def _linear_fma_kernel(x_ptr, w_ptr, y_ptr, part_ptr, count_ptr, res_ptr, nw_ptr, res_out_ptr, normed_ptr,
                       M, N, K, K_PER_SPLIT, stride_xm, stride_wn, stride_ym, stride_rm, eps,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
                       LINE: tl.constexpr, PDL: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                       WRITE_NORMED: tl.constexpr, NORM_BLOCK: tl.constexpr, GATED: tl.constexpr,
                       HEAD_D: tl.constexpr, PRECISE: tl.constexpr, ROWS: tl.constexpr, W_BLOCKS: tl.constexpr):
    """Program (g, n, s): rows g*R..g*R+R-1. acc[R, BN, BK] += fma(W, x) lane by lane over the slice's blocks,
    then one sum over BK. Per row the same ops in the same order whatever M and the row's slot.
    W_BLOCKS > 0 (small unsplit weights, FMA_PRELOAD): the program's whole weight slice, W_BLOCKS blocks, is loaded
    into registers first, before the PDL wait, so after the wait only the activations are read. With NORM, such a
    slice covers all of K in blocks of the norm's width, so the norm prologue's h blocks are the main loop's: they
    are loaded once, all at once (_held_rstd; same bits; H200 decode -5..-20 us with the MoE GEMMs' early block
    loads, bench/results/step-ab-h200-20261201-j.json).
    NORM, GATED: as in _linear_dot_kernel, for the program's R rows (NORM: the programs with n == 0 write the
    outputs)."""
    pid_g = tl.program_id(0)                                              # fastest: a tile's groups run together
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_r = pid_g * ROWS + tl.arange(0, ROWS)                           # [R]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                     # [BN]
    k_start = pid_s * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    r_ok = offs_r < M
    n_ok = offs_n < N
    ks = k_start + tl.arange(0, BLOCK_K)                                  # [BK]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + ks[None, :]
    w_pre = ()
    for b in tl.static_range(W_BLOCKS):   # the whole weight slice into registers (weights: before any PDL wait)
        w_pre = w_pre + (tl.load(w_ptrs + b * BLOCK_K, mask=n_ok[:, None] & (ks + b * BLOCK_K < K)[None, :],
                                 other=0.0),)
    if PDL:
        if W_BLOCKS == 0:
            program = pid_g + tl.num_programs(0) * (pid_n + tl.num_programs(1) * pid_s)
            _prefetch_slice(w_ptr, offs_n, k_start, k_end, N, K, stride_wn, program, BLOCK_K, LINE)
        pdl_wait()
    HOLD_H: tl.constexpr = NORM and W_BLOCKS > 0 and SPLIT_K == 1 and NORM_BLOCK == BLOCK_K
    rstd = tl.zeros([ROWS], dtype=tl.float32)
    hs = ()
    if HOLD_H:
        rstd, hs = _held_rstd(x_ptr, res_ptr, offs_r, r_ok, K, stride_xm, stride_rm, eps, ROWS, NORM_BLOCK,
                              HAS_RESIDUAL, W_BLOCKS)
    elif NORM:
        rstd = _norm_rstd(x_ptr, res_ptr, offs_r, r_ok, K, stride_xm, stride_rm, eps, ROWS, NORM_BLOCK,
                          HAS_RESIDUAL)
    x_ptrs = x_ptr + offs_r[:, None] * stride_xm + ks[None, :]            # [R, BK]
    res_ptrs = res_ptr + offs_r[:, None] * stride_rm + ks[None, :]        # [R, BK]
    out_offs = offs_r[:, None] * K + ks[None, :]                          # [R, BK] in residual_out / normed
    acc = tl.zeros([ROWS, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for b in tl.static_range(W_BLOCKS):   # the loop below on the preloaded blocks: same values, same order
        acc = _fma_block(acc, w_pre[b], x_ptrs + b * BLOCK_K, res_ptrs + b * BLOCK_K, out_offs + b * BLOCK_K,
                         k_start + b * BLOCK_K, K, r_ok, n_ok, pid_n, rstd, eps, nw_ptr, res_out_ptr, normed_ptr,
                         BLOCK_K, EVEN_K, NORM, HAS_RESIDUAL, WRITE_NORMED, GATED, HEAD_D, PRECISE,
                         hs[b] if HOLD_H else None, HOLD_H)
    if W_BLOCKS == 0:
        for k0 in range(k_start, k_end, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)       # [BN, BK]
            else:
                w = tl.load(w_ptrs, mask=n_ok[:, None] & ((k0 + tl.arange(0, BLOCK_K)) < K)[None, :], other=0.0)
            acc = _fma_block(acc, w, x_ptrs, res_ptrs, out_offs, k0, K, r_ok, n_ok, pid_n, rstd, eps, nw_ptr,
                             res_out_ptr, normed_ptr, BLOCK_K, EVEN_K, NORM, HAS_RESIDUAL, WRITE_NORMED, GATED,
                             HEAD_D, PRECISE)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
            res_ptrs += BLOCK_K
            out_offs += BLOCK_K
    if PDL:
        pdl_trigger()
    total = tl.sum(acc, axis=2)                                           # [R, BN]
    out_mask = r_ok[:, None] & n_ok[None, :]
    y_ptrs = y_ptr + offs_r[:, None] * stride_ym + offs_n[None, :]        # [R, BN]
    part_offs = offs_r[:, None] * N + offs_n[None, :]
    _finish(total, y_ptrs, part_ptr, part_offs, count_ptr + pid_n * BLOCK_M + pid_g, out_mask, pid_s,
            M * N, w_ptr, SPLIT_K)


def pick_config(n: int, k: int, weight_dtype: torch.dtype) -> LinearConfig:
    """The CONFIG_TABLE row for (N, K, dtype) with its split resolved; never depends on M."""
    size = torch.empty((), dtype=weight_dtype).element_size()
    rows = [cfg for elem, max_bytes, cfg in CONFIG_TABLE if elem == size and n * k * size <= max_bytes]
    cfg = rows[0] if rows else CONFIG_TABLE[-1][2]
    if cfg.split_k == 0:
        cfg = replace(cfg, split_k=_auto_split(triton.cdiv(n, cfg.block_n), triton.cdiv(k, cfg.block_k)))
    cfg = _fit_split(cfg, k)
    floats, counters = workspace_need(n, k, weight_dtype, config=cfg)
    if floats > WORKSPACE_FLOATS or counters > WORKSPACE_COUNTERS:
        cfg = replace(cfg, split_k=1)   # the default workspace is too small for this split: run unsplit
    return cfg


def _auto_split(tiles: int, blocks: int) -> int:
    """Largest power of two <= SPLIT_TARGET_PROGRAMS / tiles and <= blocks / MIN_SLICE_BLOCKS (at least 1)."""
    limit = min(SPLIT_TARGET_PROGRAMS // tiles, blocks // MIN_SLICE_BLOCKS)
    return 1 << (limit.bit_length() - 1) if limit >= 1 else 1


def _fit_split(cfg: LinearConfig, k: int) -> LinearConfig:
    """S slices of whole BK blocks: S' = cdiv(blocks, cdiv(blocks, S)) so no slice is empty."""
    blocks = max(1, triton.cdiv(k, cfg.block_k))
    per = triton.cdiv(blocks, max(1, cfg.split_k))
    return replace(cfg, split_k=triton.cdiv(blocks, per))


@dataclass(frozen=True)
class LinearWorkspace:
    """Split-K scratch: fp32 partials (>= S*M*N) and int32 tile counters (cdiv(N, BN), times 16 for kind "fma"),
    the counters zero between launches (each launch leaves them zero). One workspace serves any number of
    stream-ordered or PDL-chained launches; launches that may run concurrently need one each."""
    partials: torch.Tensor
    counters: torch.Tensor

    @staticmethod
    def allocate(device: torch.device | str, partial_floats: int, counters: int) -> "LinearWorkspace":
        return LinearWorkspace(torch.empty(partial_floats, dtype=torch.float32, device=device),
                               torch.zeros(counters, dtype=torch.int32, device=device))


@functools.lru_cache(maxsize=None)
def _device_workspace(device: torch.device) -> LinearWorkspace:
    return LinearWorkspace.allocate(device, WORKSPACE_FLOATS, WORKSPACE_COUNTERS)


def device_workspace(device: torch.device | str) -> LinearWorkspace:
    """The default workspace of a device, created on first use and kept (a captured CUDA graph keeps pointing
    at it, so it is never freed or resized). The module's only state; it holds no values between launches."""
    return _device_workspace(indexed(device))


def workspace_need(n: int, k: int, weight_dtype: torch.dtype, rows: int = MAX_ROWS,
                   config: LinearConfig | None = None) -> tuple[int, int]:
    """(partial floats, counters) a launch with these shapes needs; (0, 0) when it does not split K."""
    cfg = _fit_split(config, k) if config is not None else pick_config(n, k, weight_dtype)
    if cfg.split_k == 1:
        return 0, 0
    return cfg.split_k * rows * n, _counters(cfg, n)


def _counters(cfg: LinearConfig, n: int) -> int:
    return triton.cdiv(n, cfg.block_n) * (BLOCK_M if cfg.kind == "fma" else 1)


def _check(x: torch.Tensor, weight: torch.Tensor) -> tuple[int, int]:
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear: x has shape {list(x.shape)} and weight has shape {list(weight.shape)}; "
                         f"want x [..., K] and weight [N, K] with the same K")
    if weight.dtype not in WEIGHT_DTYPES or not x.dtype.is_floating_point:
        raise ValueError(f"linear: x is {x.dtype}, weight is {weight.dtype}; want a float x and a weight "
                         f"in {[str(d) for d in WEIGHT_DTYPES]}")
    if x.device != weight.device:
        raise ValueError(f"linear: x is on {x.device}, weight on {weight.device}")
    return weight.shape[0], weight.shape[1]


def _workspace(ws: LinearWorkspace | None, cfg: LinearConfig, rows: int, n: int,
               device: torch.device) -> LinearWorkspace:
    ws = ws if ws is not None else device_workspace(device)
    floats, counters = cfg.split_k * rows * n, _counters(cfg, n)
    if ws.partials.numel() < floats or ws.counters.numel() < counters or ws.partials.device != device:
        raise ValueError(f"linear: workspace holds {ws.partials.numel()} partials and {ws.counters.numel()} "
                         f"counters on {ws.partials.device}, want >= {floats} and >= {counters} on {device}")
    return ws


@dataclass(frozen=True)
class NormPrologue:
    """The NORM prologue of one launch: [M, K] row views of what it reads and writes (fuse_norm_linear)."""
    norm_weight: torch.Tensor                 # [K]
    eps: float
    residual: torch.Tensor | None             # [M, K], row stride free, last dim contiguous; None: rmsnorm only
    residual_out: torch.Tensor | None         # [M, K] contiguous, the new residual (with residual)
    normed: torch.Tensor | None               # [M, K] contiguous, the norm's output, when wanted


@dataclass(frozen=True)
class GatedNorm:
    """The GATED input of one launch (gated_rmsnorm_linear): x is gated_rmsnorm(x, norm_weight, gate) per head."""
    norm_weight: torch.Tensor                 # [D]
    eps: float
    gate: torch.Tensor                        # [M, K] row views, last dim contiguous; K = heads * D
    head_dim: int


def _launch(rows: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, workspace: LinearWorkspace | None,
            config: LinearConfig | None, pdl: bool, norm: NormPrologue | None = None,
            gated: GatedNorm | None = None, launched_early: bool = False) -> None:
    """One kernel launch for y [M, N] = rows [M, K] (or their norm) @ weight.T, 1 <= M <= MAX_ROWS, K >= 1."""
    m, k = rows.shape
    n = weight.shape[0]
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    w = weight if weight.stride(1) == 1 else weight.contiguous()
    cfg = _fit_split(config, k) if config is not None else pick_config(n, k, weight.dtype)
    ws = _workspace(workspace, cfg, m, n, rows.device) if cfg.split_k > 1 else None
    pdl = pdl and pdl_supported(rows.device)
    if linear_tma.eligible(rows, w, cfg, pdl, norm is not None, launched_early, gated=gated) \
            and linear_tma.launch(
            rows, w, y, ws.partials if ws else None, ws.counters if ws else None, cfg.split_k, gated=gated):
        return                              # the Hopper path: the weight slice lands before the PDL wait
    launch = {"launch_pdl": True} if pdl else {}
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.block_k), cfg.split_k) * cfg.block_k
    tiles = triton.cdiv(n, cfg.block_n)
    if cfg.kind == "fma":
        blocks = triton.cdiv(k, cfg.block_k)
        preload = FMA_PRELOAD and cfg.split_k == 1 and blocks * cfg.block_n * cfg.block_k <= FMA_PRELOAD_ELEMENTS
        kernel, grid = _linear_fma_kernel, (triton.cdiv(m, cfg.rows), tiles, cfg.split_k)
        extra = {"ROWS": cfg.rows, "W_BLOCKS": blocks if preload else 0}
    else:
        kernel, grid, extra = _linear_dot_kernel, (tiles, cfg.split_k), {}
    res = norm.residual if norm is not None and norm.residual is not None else gated.gate if gated else rows
    res = res if res.stride(-1) == 1 else res.contiguous()
    norm_weight = norm.norm_weight if norm else gated.norm_weight if gated else rows
    if gated:
        launch["enable_fp_fusion"] = False       # the gated_rmsnorm kernel's per-element arithmetic, uncontracted
    kernel[grid](
        rows, w, y, ws.partials if ws else y, ws.counters if ws else y,
        res, norm_weight,
        norm.residual_out if norm and norm.residual_out is not None else y,
        norm.normed if norm and norm.normed is not None else y,
        m, n, k, k_per_split, rows.stride(0), w.stride(0), y.stride(0), res.stride(0),
        norm.eps if norm else gated.eps if gated else 0.0,
        BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
        EVEN_K=k % cfg.block_k == 0, IEEE=weight.dtype == torch.float32,
        LINE=min(cfg.block_k, 128 // weight.element_size()), PDL=pdl,
        NORM=norm is not None, HAS_RESIDUAL=norm is not None and norm.residual is not None,
        WRITE_NORMED=norm is not None and norm.normed is not None,
        NORM_BLOCK=min(NORM_BLOCK_K, triton.next_power_of_2(k)),
        GATED=gated is not None, HEAD_D=gated.head_dim if gated else 1,
        PRECISE=gated is not None and rows.device.type == "cuda",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra, **launch)


def linear(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None, *, pdl: bool = False,
           out: torch.Tensor | None = None, workspace: LinearWorkspace | None = None,
           config: LinearConfig | None = None, launched_early: bool = False) -> torch.Tensor:
    """y [..., N] = x [..., K] @ weight [N, K].T as torch.ops.lingc.linear, in out_dtype (default x.dtype).

    M = prod(x.shape[:-1]) <= MAX_ROWS runs a Triton kernel; more rows run F.linear in the weight dtype.
    `out` (contiguous, [..., N], out_dtype) is written in place when given. `workspace` is the split-K scratch
    (default: the device's, see device_workspace); `config` overrides the table (the bench's sweep) and must
    not depend on M either. pdl is dropped where unsupported (CPU / interpreter, pre-sm90). launched_early (the pdl
    pass's hint: the launch before triggers at its entry) lets the Hopper path take up to linear_tma.EARLY_MAX_ROWS.
    """
    n, k = _check(x, weight)
    y_dtype = out_dtype if out_dtype is not None else x.dtype
    lead = x.shape[:-1]
    if out is None:
        out = torch.empty((*lead, n), dtype=y_dtype, device=x.device)
    elif out.shape != (*lead, n) or out.dtype != y_dtype or not out.is_contiguous():
        raise ValueError(f"linear: out is {list(out.shape)} {out.dtype}, want contiguous {[*lead, n]} {y_dtype}")
    rows = x.reshape(-1, k)                                               # [M, K]
    m = rows.shape[0]
    if m > MAX_ROWS:
        # Prefill: cuBLAS is near its matrix peak here; same formula as the reference's batched path.
        out.view(m, n).copy_(torch.nn.functional.linear(rows.to(weight.dtype), weight))
        return out
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    _launch(rows, weight, out.view(m, n), workspace, config, pdl, launched_early=launched_early)
    return out


def _check_norm(name: str, x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                residual: torch.Tensor | None) -> None:
    _check(x, weight)
    k = x.shape[-1]
    if k == 0 or norm_weight.shape != (k,):
        raise ValueError(f"{name}: norm_weight has shape {list(norm_weight.shape)} and x {list(x.shape)}; want "
                         f"norm_weight [K] with K = x.shape[-1] >= 1")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"{name}: residual is {list(residual.shape)} {residual.dtype}, x is {list(x.shape)} "
                         f"{x.dtype}; want the same shape and dtype")


def _norm_linear(name: str, residual: torch.Tensor | None, x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                 weight: torch.Tensor, out_dtype: torch.dtype | None, want_normed: bool, pdl: bool,
                 workspace: LinearWorkspace | None, config: LinearConfig | None) -> tuple[torch.Tensor, ...]:
    """(y, normed or an empty [0] tensor[, new residual]): one fused launch for M <= MAX_ROWS; above that the
    unfused kernels' path (the rmsnorm kernel, then F.linear), so prefill keeps the bits it had."""
    _check_norm(name, x, norm_weight, weight, residual)
    n, k = weight.shape
    lead = x.shape[:-1]
    y = torch.empty((*lead, n), dtype=out_dtype if out_dtype is not None else x.dtype, device=x.device)
    normed = torch.empty(x.shape if want_normed else (0,), dtype=x.dtype, device=x.device)
    residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    rows = x.reshape(-1, k)                                               # [M, K]
    m = rows.shape[0]
    if m > MAX_ROWS or m == 0 or n == 0:
        from lingc.kernels import rmsnorm as norm_kernels              # the unfused kernels' path
        if residual is None:
            full = norm_kernels.rmsnorm(x, norm_weight, eps, pdl=pdl, out=normed if want_normed else None)
        else:
            full, _ = norm_kernels.add_rmsnorm(residual, x, norm_weight, eps, pdl=pdl,
                                               out=normed if want_normed else None, residual_out=residual_out)
        linear(full, weight, out_dtype, out=y)
    else:
        prologue = NormPrologue(norm_weight, eps, residual.reshape(-1, k) if residual is not None else None,
                                residual_out.view(m, k) if residual_out is not None else None,
                                normed.view(m, k) if want_normed else None)
        _launch(rows, weight, y.view(m, n), workspace, config, pdl, prologue)
    return (y, normed) if residual is None else (y, normed, residual_out)


def rmsnorm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                   out_dtype: torch.dtype | None = None, want_normed: bool = False, *, pdl: bool = False,
                   workspace: LinearWorkspace | None = None,
                   config: LinearConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rmsnorm(x)), rmsnorm(x) or an empty [0] tensor) as torch.ops.lingc.rmsnorm_linear: the norm runs
    in the linear kernel's prologue (one launch). x [..., K] (the row stride is free), norm_weight [K]."""
    return _norm_linear("rmsnorm_linear", None, x, norm_weight, eps, weight, out_dtype, want_normed, pdl,
                        workspace, config)


def add_rmsnorm_linear(residual: torch.Tensor, x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       weight: torch.Tensor, out_dtype: torch.dtype | None = None, want_normed: bool = False, *,
                       pdl: bool = False, workspace: LinearWorkspace | None = None,
                       config: LinearConfig | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, normed or an empty [0] tensor, residual + x) as torch.ops.lingc.add_rmsnorm_linear, in one launch."""
    return _norm_linear("add_rmsnorm_linear", residual, x, norm_weight, eps, weight, out_dtype, want_normed, pdl,
                        workspace, config)


def gated_rmsnorm_linear(x: torch.Tensor, norm_weight: torch.Tensor, gate: torch.Tensor, eps: float,
                         weight: torch.Tensor, out_dtype: torch.dtype | None = None, *, pdl: bool = False,
                         workspace: LinearWorkspace | None = None, config: LinearConfig | None = None) -> torch.Tensor:
    """linear(gated_rmsnorm(x, norm_weight, gate, eps).flatten(-2), weight) as torch.ops.lingc.gated_rmsnorm_linear,
    in one launch: x and gate [..., H, D] (any strides the [M, H*D] row view allows), norm_weight [D], weight
    [N, H*D]; y [..., N]. The norm is built block by block in the GEMV (GATED), which needs whole heads in a block
    (D a power of two dividing the config's BLOCK_K); otherwise, and for M > MAX_ROWS, the two kernels run."""
    if x.dim() < 2 or gate.shape != x.shape or norm_weight.shape != (x.shape[-1],):
        raise ValueError(f"gated_rmsnorm_linear: x is {list(x.shape)}, gate {list(gate.shape)}, norm_weight "
                         f"{list(norm_weight.shape)}; want x and gate [..., H, D] alike and norm_weight [D]")
    d = x.shape[-1]
    flat = x.flatten(-2)
    n, k = _check(flat, weight)
    y = torch.empty((*x.shape[:-2], n), dtype=out_dtype if out_dtype is not None else x.dtype, device=x.device)
    m = flat.numel() // max(k, 1)
    cfg = (_fit_split(config, k) if config is not None else pick_config(n, k, weight.dtype)) if k else None
    whole_heads = cfg is not None and d & (d - 1) == 0 and cfg.block_k % d == 0
    if not whole_heads or m > MAX_ROWS or m == 0 or n == 0:
        from lingc.kernels.kda import gated_rmsnorm                     # the unfused kernels' path
        linear(gated_rmsnorm(x, norm_weight, gate, eps, pdl=pdl).flatten(-2), weight, out_dtype, out=y, pdl=pdl)
        return y
    _launch(flat.reshape(m, k), weight, y.view(m, n), workspace, cfg, pdl,
            gated=GatedNorm(norm_weight, eps, gate.reshape(m, k), d))
    return y


def linear_ref(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """lingc's reference linear."""
    return torch.ops.lingc.linear(x, weight, out_dtype)


def rmsnorm_linear_ref(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                       out_dtype: torch.dtype | None = None,
                       want_normed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """lingc's reference: rmsnorm then linear."""
    return torch.ops.lingc.rmsnorm_linear(x, norm_weight, eps, weight, out_dtype, want_normed)


def add_rmsnorm_linear_ref(residual: torch.Tensor, x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                           weight: torch.Tensor, out_dtype: torch.dtype | None = None,
                           want_normed: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """lingc's reference: add_rmsnorm then linear of its normed output."""
    return torch.ops.lingc.add_rmsnorm_linear(residual, x, norm_weight, eps, weight, out_dtype, want_normed)


def gated_rmsnorm_linear_ref(x: torch.Tensor, norm_weight: torch.Tensor, gate: torch.Tensor, eps: float,
                             weight: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """lingc's reference: gated_rmsnorm then linear of it, heads flattened."""
    return torch.ops.lingc.gated_rmsnorm_linear(x, norm_weight, gate, eps, weight, out_dtype)


LOWERINGS = {"linear": linear, "rmsnorm_linear": rmsnorm_linear, "add_rmsnorm_linear": add_rmsnorm_linear,
             "gated_rmsnorm_linear": gated_rmsnorm_linear}
