"""The skinny GEMM's Hopper path: the weight slice lands in shared memory (TMA) BEFORE the PDL wait (Gluon).

kernels/linear.py's "dot" kernel can only start its weight stream after `gdc_wait`: Triton's pipeliner issues a
loop's cp.async prologue after everything that precedes the loop, and the two earlier reads Triton does allow (an
L2 prefetch, a register preload) lost in the step. Gluon (triton.experimental.gluon, Triton 3.6) exposes TMA,
mbarriers and wgmma, so this kernel computes the same thing with the weight read moved ahead of the wait:

    program (n, s), n-tile of BN = 64 weight rows, K slice s (its KB blocks of BK):
        issue a TMA load of every [BN, BK] weight block of the slice (one mbarrier each)    <- before the wait
        gdc_wait (and, under the early trigger, let the next kernel launch)
        x rows [16, slice] -> shared memory (rows >= M are zero)
        per block: wait its mbarrier, acc[BN, 16] += W[BN, BK] @ x^T[BK, 16]                 (wgmma m64n16k16)
        S = 1: store acc rounded to the weight dtype, then to y's; S > 1: lingc's split-K ticket (kernels/linear.py
        `_finish`: partial to the workspace, acq_rel ticket, the last program sums partials 0..S-1 in order)

Same tiles, same K order, same instruction as the "dot" kernel at BLOCK_N 64 / BLOCK_K 128 (its ptxas output has the
same 8 wgmma a block), so the same bits; on the H200 every probe shape matched bit for bit at 1 and 6 rows
(bench/results/gluon-linear-probe-h200-20261203.json).

Where it runs (`eligible`): CUDA on sm_90 (its wgmma is Hopper's), a PDL launch (the gain is the pre-wait read;
without PDL the Triton kernel runs), Gluon importable, a 2-byte weight, the "dot" config at BN 64 / BK 128, no NORM
prologue (a GATED one, gated_rmsnorm_linear's, with heads of BK: each x block is one head, its norm built after the
wait; GATED_MAX_ROWS below), K a multiple of S * BK, the whole slice fitting the ring (at most MAX_BLOCKS blocks
and, with the x slice, 2 CTAs an SM's shared memory), and at most MAX_ROWS rows (1: decode and the draft), or
EARLY_MAX_ROWS (16) where the pdl pass launches it early (`launched_early`: the norm or MLA attention before it
triggers at entry, so the ring fills while the kernel before that runs: verify's o_proj and MLA dense). Choosing by
rows keeps row invariance because the two paths give the same bits. In Ling-3.0-tiny: o_proj, the MLA dense and the
MLA q_a / kv_a / gate projection (split 4, 3-4 blocks a slice); the 31.5 MB KDA projection and the lm_head (12
blocks a program) stay on the Triton kernel, except that with PARTIAL_RING (on) a one-wave grid with a longer slice
runs here on a ring of its first blocks (the one-row KDA projection and the dense layer's gate_up: 3 of 12 before the
wait, the rest refilled as the MMAs free slots); same bits, greedy decode -8 to -13 us on the H200 and an H100
(2026-12-06; level on 2026-12-03). Where the kernel does not compile (another Triton's Gluon), `launch` warns once
and the Triton kernel runs.

Measured on the H200 (2026-12-03). Alone, behind a short PDL producer (bench/gluon_linear_probe.py): o_proj 4.34 ->
4.01 us at 1 row and 4.34 -> 3.70 at 6, q_a/kv_a/g 3.45 -> 2.88 at 1. Per launch in the step (launches-tma-h200-
20261203.json): in decode q_a/kv_a/g 3.56 -> 2.70 us, o_proj 4.43 -> 4.30, dense 4.25 -> 4.02, but in verify o_proj
4.74 -> 5.19 and the dense 4.66 -> 5.08: at 6 rows its post-wait path (the whole x slice loaded, stored to shared
memory and fenced before the first wgmma) costs more than the early read saves behind a short kernel; hence
MAX_ROWS = 1. The step with it at one row (step-ab-h200-20261203-d.json, one process, off / on / off / on): greedy
decode 1.196 / 1.201 -> 1.186 / 1.191 ms, general decode 1.208 / 1.211 -> 1.192 / 1.201, greedy NEXTN 3.310 / 3.314 ->
3.305 / 3.299 (the draft's one-row MTP forwards), verify unchanged. At every row count
(step-ab-h200-20261203-c.json) it was level. Next: land x by TMA as well (or per block) and reduce split-K through a
cluster's distributed shared memory instead of the L2 ticket, then try it at 6 rows again.
LINGC_LINEAR_TMA=0 turns it off, LINGC_LINEAR_TMA_MAX_ROWS=N moves the row limit. The interpreter never runs it
(Gluon has no interpreter): CPU tests compile it for sm_90 offline and check the order of its PTX
(tests/kernels/test_linear_tma.py).
"""

from __future__ import annotations

import functools

import torch

from lingc.knobs import env_flag, env_int
from lingc.kernels.pdl import TRIGGER
from lingc.kernels.gluon_launch import guarded, major as _major
from lingc.kernels.workspace import indexed

try:  # Gluon ships with Triton >= 3.5; without it (or its Hopper modules) the Triton kernel runs everywhere
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.extra import libdevice
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from lingc.kernels.pdl import gluon_gdc_launch_dependents, gluon_gdc_wait
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the Triton build
    HAVE_GLUON = False

ENABLED = env_flag("LINGC_LINEAR_TMA", True)   # LINGC_LINEAR_TMA=0 turns it off
FAILED: list[str] = []   # the first compile failure's message (`launch`); once set, every launch runs the Triton kernel
BLOCK_M = 16             # rows (the wgmma N); must equal kernels/linear.py BLOCK_M (the workspace layout)
BLOCK_N = 64             # weight rows a program (the wgmma M)
BLOCK_K = 128
MAX_BLOCKS = 4           # the slice's blocks, all in flight before the wait
PARTIAL_RING = env_flag("LINGC_LINEAR_TMA_PARTIAL", True)   # longer slices: a ring of up to MAX_BLOCKS
                         # blocks, its first fill before the wait (one-wave grids only; `ring_blocks`). On by default
                         # since 2026-12-06: the one-row KDA projection (3 of 12 blocks early) took the greedy decode
                         # step from 1.135 / 1.132 to 1.122 ms and general decode from 1.144 / 1.146 to 1.137 on the
                         # H200 (step-ab-h200-20261206-ring.json), and on an H100 greedy decode 1.327 / 1.317 -> 1.311 /
                         # 1.310 (step-ab-h100-20261206-ring.json); verify and NEXTN level; greedy parity held
                         # (step-parity-ring-h100-20261206.json). 2026-12-03 had measured it within noise
                         # (step-ab-h200-20261203-j.json). Same bits as the Triton kernel at 1-16 rows
                         # (gluon-linear-check-h200-20261203-b.json). LINGC_LINEAR_TMA_PARTIAL=0 turns it off
# x lands by TMA too (one [BM, BK] box a block, rows past M zero-filled by the copy engine, one mbarrier a block), so
# block b's wgmma waits only for its own x and weight boxes, instead of the whole x slice going through registers
# (masked loads, shared-memory stores, a fence) before the first wgmma. Same values in the same shared-memory tiles:
# the same bits (greedy parity and PDL on == off held with it on, an H100, 2026-12-06). Not for GATED (its x is normed
# on the way) or an x whose rows are not 16 B aligned. Off: slower in the step, greedy decode 1.341 / 1.338 ms against
# 1.322 without it, general 1.368 / 1.369 against 1.348, verify level (H100, one process,
# bench/results/step-ab-h100-20261206-xtma.json). Not profiled; a likely cause: Gluon 3.6 brackets each one-thread TMA
# issue and mbarrier op with a CTA barrier (sm_90 PTX: 11 more bar.sync for a 4-block slice), ~36 for the KDA
# projection's 12 blocks, on the path after the wait.
# LINGC_LINEAR_TMA_X=1 turns it on
X_TMA = env_flag("LINGC_LINEAR_TMA_X", False)
SMEM_2_CTAS = 110 * 1024  # x slice + weight ring, so that 2 CTAs share an SM as the Triton kernel's 80 KB do
WARPS = 4                # one warpgroup
HOPPER = 9               # the compute capability whose wgmma the kernel uses
MAX_ROWS = env_int("LINGC_LINEAR_TMA_MAX_ROWS", 1)   # launches of more rows run the Triton kernel
# the row limit of a partial-ring launch (PARTIAL_RING: the KDA projection, the dense gate_up) where it is higher than
# MAX_ROWS / EARLY_MAX_ROWS: verify's 6-row KDA projection on the ring without the early launch that lost at verify
# (the combine's entry trigger, 2026-12-03). 1 (as MAX_ROWS): at 16 the H100 step measured greedy verify 2.614 ms
# against 2.595 / 2.596, with X_TMA too 2.608, decode unchanged (bench/results/step-ab-h100-20261206-ring-rows.json):
# the Triton kernel stays faster at verify's rows. Why (launch attribution with PDL, H100, 2026-12-06, one call:
# bench/results/launches-verify-h100-20261206-base.json / -ring16.json): the ring does make the projection itself
# faster, 13.86 -> 12.85 us a layer, but its 7.7 MB pre-wait burst lands on the combine_add_rmsnorm before it (1.83 ->
# 2.82 us: the combine's row loads queue behind it) and kda_fused_verify after it exposes more (6.76 -> 7.28 us).
# Triggering the combine after its loads (kernels/pdl.py LATE_TRIGGER_ROWS) does not rescue it: ring at 16
# rows with it, verify 2.6030 / 2.5983 ms against 2.5864 / 2.5760 (step-ab-h100-20261206-combine-late.json).
# LINGC_LINEAR_TMA_RING_MAX_ROWS=N
RING_MAX_ROWS = env_int("LINGC_LINEAR_TMA_RING_MAX_ROWS", 1)
EARLY_MAX_ROWS = 16      # the row limit of a launch whose predecessor triggers at entry (linear's launched_early):
                         # its weight read then overlaps the kernel before that one (verify's o_proj: kda's 11 us);
                         # H200 greedy verify 2.309 / 2.308 vs 2.327 / 2.325 ms (step-ab-h200-20261203-i.json)
# gated_rmsnorm_linear (KDA's o_norm + o_proj, the opt-in LINGC_NORM_LINEAR_GATED=1 of passes/fuse_norm_linear.py):
# the norm built per x block (GATED, heads of BLOCK_K) after the wait, the weight ring filled before it, so the
# gated_rmsnorm launch goes without moving o_proj's weight read after the wait as the Triton GATED GEMV did (10.5 vs
# 6.8 us for the pair). Up to GATED_MAX_ROWS rows (decode, verify and the draft alike: row invariance). On the H200
# (2026-12-05, bench/kernel_linear.py --gated, kernel-linear-gated-tma-h200-20261205.json) its checks pass but it is
# still slower than the pair: 6.52 vs 5.18 us at one row, 8.18 vs 5.45 at six (PDL on); the step with the opt-in on,
# greedy decode +25 us, verify +55 (step-ab-h200-20261205.json). LINGC_LINEAR_TMA_GATED=0 leaves gated launches on
# the Triton kernels
GATED_TMA = env_flag("LINGC_LINEAR_TMA_GATED", True)
GATED_MAX_ROWS = 16
GATED_FAILED: list[str] = []   # a GATED compile failure turns off the GATED launches only, not the plain ones


def smem_bytes(k_per_split: int, elem: int = 2, ring: int | None = None) -> int:
    """Shared memory of one program: the x slice [16, K/S] and the weight ring (every block of the slice, or `ring`
    blocks)."""
    blocks = k_per_split // BLOCK_K if ring is None else ring
    return BLOCK_M * k_per_split * elem + blocks * BLOCK_N * BLOCK_K * elem


def ring_blocks(n: int, k: int, split_k: int, block_n: int, block_k: int, elem: int,
                max_programs: int | None = None) -> int:
    """The weight ring's blocks for this shape: the whole slice where it has at most MAX_BLOCKS blocks; with
    PARTIAL_RING, the most (>= 2) that fit 2 CTAs an SM where the grid is one wave (at most max_programs: a later
    wave's programs start after the wait anyway); 0 where the kernel does not apply (no device facts)."""
    if elem != 2 or block_n != BLOCK_N or block_k != BLOCK_K or n < 1 or split_k < 1:
        return 0
    if k % (split_k * BLOCK_K):
        return 0
    per = k // split_k
    blocks = per // BLOCK_K
    if blocks <= MAX_BLOCKS:
        return blocks if smem_bytes(per, elem) <= SMEM_2_CTAS else 0
    if not PARTIAL_RING or (max_programs is not None and -(-n // BLOCK_N) * split_k > max_programs):
        return 0
    ring = MAX_BLOCKS
    while ring >= 2 and smem_bytes(per, elem, ring) > SMEM_2_CTAS:
        ring -= 1
    return ring if ring >= 2 else 0


def fits(n: int, k: int, split_k: int, block_n: int, block_k: int, elem: int,
         max_programs: int | None = None) -> bool:
    """The shape rule of `eligible` (no device facts): whole BK blocks in equal slices, the "dot" tiling this kernel
    reproduces, and 2 CTAs an SM: `ring_blocks` > 0."""
    return ring_blocks(n, k, split_k, block_n, block_k, elem, max_programs) > 0


@functools.lru_cache(maxsize=None)
def _one_wave(device: torch.device) -> int:
    """Programs of one wave at 2 CTAs an SM."""
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def gated_fits(gated) -> bool:
    """The GATED rule of `eligible` (no device facts): the knob, no GATED compile failure, heads of BLOCK_K (each x
    block one head) and a gate whose rows are unit-stride (the kernel reads them so)."""
    return GATED_TMA and not GATED_FAILED and gated.head_dim == BLOCK_K and gated.gate.stride(-1) == 1


def eligible(rows: torch.Tensor, weight: torch.Tensor, cfg, pdl: bool, prologue: bool,
             launched_early: bool = False, gated=None) -> bool:
    """Whether this launch runs here rather than on kernels/linear.py's Triton kernels (module docstring). `pdl`: the
    launch is PDL-launched, already checked against the device (linear.py's launcher: pdl_supported). The row count
    may decide (MAX_ROWS, or EARLY_MAX_ROWS where the launch before triggers at its entry): both paths give the same
    bits, so a row's result does not depend on it. `prologue`: a norm prologue (never here); `gated` (a GatedNorm):
    gated_rmsnorm_linear's, here (GATED) where its heads are BLOCK_K wide, at up to GATED_MAX_ROWS rows whatever
    launched_early says: its bits are not the Triton GATED kernel's, so decode's and verify's rows must both run
    here."""
    if gated is not None:
        if not gated_fits(gated):
            return False
        limit = GATED_MAX_ROWS
    else:
        limit = max(MAX_ROWS, EARLY_MAX_ROWS) if launched_early else MAX_ROWS
        n, k = weight.shape
        if RING_MAX_ROWS > limit and ring_blocks(n, k, cfg.split_k, cfg.block_n, cfg.block_k, weight.element_size(),
                                                 None) < k // max(cfg.split_k, 1) // BLOCK_K:
            limit = RING_MAX_ROWS           # a partial ring (a slice longer than the ring): its own row limit
    if not (ENABLED and HAVE_GLUON and not FAILED and pdl and not prologue and cfg.kind == "dot"
            and rows.shape[0] <= limit and weight.dtype in (torch.bfloat16, torch.float16)):
        return False
    if weight.device.type != "cuda" or _major(indexed(weight.device)) != HOPPER:
        return False                        # wgmma is sm_90's; Blackwell has other MMA instructions
    n, k = weight.shape
    if weight.stride(1) != 1 or weight.data_ptr() % 16 or (weight.stride(0) * 2) % 16:
        return False
    return fits(n, k, cfg.split_k, cfg.block_n, cfg.block_k, weight.element_size(), _one_wave(indexed(weight.device)))


if HAVE_GLUON:
    @gluon.jit
    def ring_mma(w_desc, w_smem, bars, x_smem, x_bars, row0, k0, KB: gl.constexpr, RING: gl.constexpr,
                 BN: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, X_TMA: gl.constexpr):
        """acc [BN, BM] (fp32, wgmma's layout) = sum over b < KB, in order, of W[row0:+BN, k0 + b BK:+BK] @ x_smem[b]^T:
        block b waits for its weight box in slot b % RING (and, X_TMA, its x box), one synchronous wgmma m64n16k16
        chain, then, while blocks remain past the ring, that slot is refilled with block b + RING. The caller issued
        the ring's first RING boxes (slot s: block s) and fenced x_smem. Shared by kernels/moe_tma.py."""
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BM, 16])
        acc = gl.zeros([BN, BM], gl.float32, acc_layout)
        for b in gl.static_range(KB):
            mbarrier.wait(bars.index(b % RING), (b // RING) % 2)
            if X_TMA:
                mbarrier.wait(x_bars.index(b), 0)
            acc = warpgroup_mma(w_smem.index(b % RING), x_smem.index(b).permute((1, 0)), acc)   # waits for the MMA
            if b + RING < KB:               # the partial ring: refill the slot this block's MMA has finished with
                mbarrier.expect(bars.index(b % RING), w_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(w_desc, [row0, k0 + (b + RING) * BK], bars.index(b % RING),
                                                w_smem.index(b % RING))
        return acc

    @gluon.jit
    def _linear_tma_kernel(w_desc, x_desc, x_ptr, y_ptr, part_ptr, count_ptr, g_ptr, nw_ptr, M, N, stride_xm,
                           stride_ym, stride_gm, eps, inv_d,
                           K_PER_SPLIT: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, BM: gl.constexpr,
                           SPLIT_K: gl.constexpr, EARLY_TRIGGER: gl.constexpr, RING: gl.constexpr,
                           GATED: gl.constexpr = False, X_TMA: gl.constexpr = False):
        """Program (n, s): y[:, n-tile] (S = 1) or its slice-s partial (module docstring). Launched with PDL only.
        RING < KB (the partial ring): blocks 0..RING-1 land before the wait, block b + RING refills block b's slot
        once its wgmma has completed (same blocks, same order, same instruction: the same bits).
        GATED (gated_rmsnorm_linear, heads of BK): each x block is one head, built as gated_rmsnorm does it,
        x * rstd * nw * sigmoid(g) in fp32 with rstd = rsqrt(sum(x^2) * (1/BK) + eps), rounded to x's dtype; the
        norm weight (a weight) is read before the wait, x and the gate after it.
        X_TMA (not with GATED): x_desc's [BM, BK] boxes after the wait, one mbarrier a block, rows past M zero-filled
        by the copy engine as the register path's masked loads fill them; block b's wgmma waits for its own box."""
        KB: gl.constexpr = K_PER_SPLIT // BK
        pid_n = gl.program_id(0)
        pid_s = gl.program_id(1)
        n0 = pid_n * BN
        k0 = pid_s * K_PER_SPLIT
        w_smem = gl.allocate_shared_memory(w_desc.dtype, [RING, BN, BK], w_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
        for b in gl.static_range(RING):
            mbarrier.init(bars.index(b), count=1)
        for b in gl.static_range(RING):     # weights: written by no kernel, so before the wait
            mbarrier.expect(bars.index(b), w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(w_desc, [n0, k0 + b * BK], bars.index(b), w_smem.index(b))
        xl: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        offs_m = gl.arange(0, BM, layout=gl.SliceLayout(1, xl))
        offs_k = gl.arange(0, BK, layout=gl.SliceLayout(0, xl))
        if GATED:                           # the norm weight (one head's BK values, every block's): a weight
            nw = gl.load(nw_ptr + offs_k).to(gl.float32)
        gluon_gdc_wait()
        if EARLY_TRIGGER:
            gluon_gdc_launch_dependents()
        x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BK], w_desc.dtype)
        x_smem = gl.allocate_shared_memory(w_desc.dtype, [KB, BM, BK], x_layout)
        if X_TMA:                           # x [rows, slice] by TMA, a box a block (written by the previous kernel)
            x_bars = gl.allocate_shared_memory(gl.int64, [KB, 1], mbarrier.MBarrierLayout())
            for b in gl.static_range(KB):
                mbarrier.init(x_bars.index(b), count=1)
            for b in gl.static_range(KB):
                mbarrier.expect(x_bars.index(b), x_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(x_desc, [0, k0 + b * BK], x_bars.index(b), x_smem.index(b))
        else:
            for b in gl.static_range(KB):   # x [rows, slice], K-major: the wgmma B operand, permuted
                row_ok = (offs_m < M)[:, None]
                xv = gl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + b * BK + offs_k)[None, :], mask=row_ok,
                             other=0.0)
                if GATED:                       # one head: a row's sum is its 16 lanes' (shuffles, no barrier)
                    gv = gl.load(g_ptr + offs_m[:, None] * stride_gm + (k0 + b * BK + offs_k)[None, :], mask=row_ok,
                                 other=0.0).to(gl.float32)
                    xf = xv.to(gl.float32)
                    rstd = gl.rsqrt(gl.sum(xf * xf, axis=1) * inv_d + eps)
                    one = gl.full([BM, BK], 1.0, gl.float32, xl)
                    gate = gl.div_rn(one, 1.0 + libdevice.exp(-gv))     # kernels/kda.py _sigmoid, PRECISE
                    xv = (xf * rstd[:, None] * nw[None, :] * gate).to(x_ptr.dtype.element_ty)
                x_smem.index(b).store(xv.to(w_desc.dtype))
            fence_async_shared()
        acc = ring_mma(w_desc, w_smem, bars, x_smem, x_bars if X_TMA else bars, n0, k0, KB, RING, BN, BM, BK, X_TMA)
        for b in gl.static_range(RING):
            mbarrier.invalidate(bars.index(b))
        if X_TMA:
            for b in gl.static_range(KB):
                mbarrier.invalidate(x_bars.index(b))
        if not EARLY_TRIGGER:
            gluon_gdc_launch_dependents()  # the late trigger: after the last read of the previous kernel's output
        ol: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [4, 1], [0, 1])
        out = gl.convert_layout(acc, ol)                                       # [BN, BM]
        on = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, ol))
        om = gl.arange(0, BM, layout=gl.SliceLayout(0, ol))
        mask = (on < N)[:, None] & (om < M)[None, :]
        y_ptrs = y_ptr + om[None, :] * stride_ym + on[:, None]
        if SPLIT_K == 1:
            gl.store(y_ptrs, out.to(w_desc.dtype).to(y_ptr.dtype.element_ty), mask=mask)
        else:
            part_offs = om[None, :] * N + on[:, None]                          # [BN, BM] in one [M, N] slice
            gl.store(part_ptr + pid_s * M * N + part_offs, out, mask=mask)
            gl.thread_barrier()             # every thread's partial is written before the ticket (release) is taken
            ticket = gl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if ticket == SPLIT_K - 1:
                total = gl.zeros([BN, BM], gl.float32, ol)
                for sp in gl.static_range(SPLIT_K):                           # fixed order 0..S-1
                    total += gl.load(part_ptr + sp * M * N + part_offs, mask=mask, other=0.0, cache_modifier=".cg")
                gl.store(y_ptrs, total.to(w_desc.dtype).to(y_ptr.dtype.element_ty), mask=mask)
                gl.store(count_ptr + pid_n, 0)                                 # ready for the next launch


def _descriptor(t: torch.Tensor, box_rows: int = BLOCK_N):
    """A [box_rows, BK]-box TMA descriptor of a 2-D tensor: the weight's ([BN, BK] boxes) or, for X_TMA, the rows'
    ([BM, BK] boxes; rows past M read as zeros). Made per launch, not cached: a cache would keep every tensor it saw
    alive; Triton encodes the descriptor into the launch's arguments, so a captured graph keeps its own."""
    layout = gl.NVMMASharedLayout.get_default_for([box_rows, BLOCK_K], _GL_DTYPES[t.dtype])
    return TensorDescriptor.from_tensor(t, [box_rows, BLOCK_K], layout)


def x_tma(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a plain launch lands x by TMA (X_TMA): the knob, x in the weight's dtype, unit-stride rows whose base
    and row stride are 16 B aligned (a TMA descriptor's rules)."""
    return (X_TMA and rows.dtype == weight.dtype and rows.dim() == 2 and rows.stride(1) == 1
            and rows.data_ptr() % 16 == 0 and (rows.stride(0) * rows.element_size()) % 16 == 0)


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16} if HAVE_GLUON else {}


def launch(rows: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, partials: torch.Tensor | None,
           counters: torch.Tensor | None, split_k: int, gated=None) -> bool:
    """y [M, N] = rows [M, K] @ weight.T on this path (the caller checked `eligible`), PDL-launched; with `gated`
    (kernels/linear.py GatedNorm, heads of BLOCK_K) y = gated_rmsnorm(rows) @ weight.T. False, with one warning,
    where the kernel does not compile (a Triton whose Gluon API differs from 3.6's): compilation comes before any GPU
    work, so the caller runs the Triton kernel instead, and later launches do not try again."""
    m, k = rows.shape
    n = weight.shape[0]
    grid = (-(-n // BLOCK_N), split_k)
    ring = ring_blocks(n, k, split_k, BLOCK_N, BLOCK_K, weight.element_size())
    if gated is None:
        g, nw, eps, extra = rows, rows, 0.0, {"X_TMA": x_tma(rows, weight)}   # rows: never-read stand-ins
        failed, what, knob = FAILED, "the TMA linear (kernels/linear_tma.py)", "LINGC_LINEAR_TMA"
    else:                                                        # the norm's mul + add apart, as gated_rmsnorm's
        g, nw, eps, extra = gated.gate, gated.norm_weight, gated.eps, {"GATED": True, "enable_fp_fusion": False}
        failed, knob = GATED_FAILED, "LINGC_LINEAR_TMA_GATED"
        what = "the TMA linear's GATED path (kernels/linear_tma.py)"
    w_desc = _descriptor(weight)
    x_desc = _descriptor(rows, BLOCK_M) if extra.get("X_TMA") else w_desc   # w_desc: a never-read stand-in
    return guarded(lambda: _linear_tma_kernel[grid](
        w_desc, x_desc, rows, y, partials if partials is not None else y, counters if counters is not None else y,
        g, nw, m, n, rows.stride(0), y.stride(0), g.stride(0), eps, 1.0 / BLOCK_K,
        K_PER_SPLIT=k // split_k, BN=BLOCK_N, BK=BLOCK_K, BM=BLOCK_M, SPLIT_K=split_k,
        EARLY_TRIGGER=TRIGGER == "early", RING=ring,
        num_warps=WARPS, launch_pdl=True, **extra),
        failed, what, "the Triton kernel", knob)
