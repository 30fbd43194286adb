"""The aligned up-GEMM + SwiGLU (moe_up_act) on Hopper, the expert's weight tile landed by TMA (Gluon; opt-in).

Why it was tried: at decode the up-GEMM streams 9 experts' w13 (28.3 MB at Ling-3.0-tiny) at about 1.8 TB/s on an
H100 against the dense skinny GEMM's 2.8 over the same bytes (bench/results/launches-h100-20261206.json: 15.5 us a
layer, 6 over its floor); bench/kernel_moe_scaling.py puts the difference in a per-launch constant (4.6 us against
the dense GEMV's 2.6). The Triton kernel (kernels/moe.py, unswapped 32-wide tiles, 4 cp.async stages: 24 KB in
flight a program) starts its weight stream only once the expert id is in (after the PDL wait, the router being the
launch before), and keeps few bytes in flight. Here each program, once it has its block's expert, issues TMA loads
of RING [BN, BK] blocks of that expert's weight tile at once (64 KB in flight at RING 4, refilled as each wgmma
frees a slot), as kernels/linear_tma.py's partial ring does for the dense projections:

    program (n, b): block b of moe_align's layout (BLOCK_M <= 16 pairs of one expert), n-tile of BN = 64 w13 rows
        gdc_wait (the router / align is the launch before); the early trigger
        total, block_expert[b], sorted_pairs[b] (one L2 round trip); blocks past total exit
        TMA: the first RING [BN, BK] blocks of w13[expert, n-tile]            <- as soon as the expert is known
        x rows of the block's pairs (pair // top_k) -> shared memory [KB, 16, BK] (rows of no pair are zero)
        per K block: wait its box, acc[BN, 16] += W[BN, BK] @ x^T[BK, 16] (wgmma m64n16k16), refill the slot
        h = acc rounded to the activation dtype; gate = h's even rows, up = its odd rows (w13 interleaved)
        act = silu(gate) * up in fp32 (kernels/moe.py _swiglu's operations), rounded, stored to the pairs' rows

Bits: the same tiles of K in the same order on the same instruction as the pair grid's swap-AB tiles (kernels/moe.py
UP_PAIRS_CONFIG: wgmma m64n16k16 over 128-wide K blocks), which give the aligned Triton kernel's bits on the H200
(measured, not by construction); the epilogue is _swiglu's operations (libdevice expf, a round-to-nearest division,
fp contraction off). Checked on the GPU by bench/moe_up_tma_check.py (bits against the Triton kernel, then time).

Measured (H100, 2026-12-06; the hypothesis did not hold): bit for bit the Triton kernel at 1, 2, 6 and 16 tokens (8
routings each, bench/moe_up_tma_check.py, results/kernels-moe-up-tma-h100-20261206.json), but slower: alone, cold
weights, 15.9 against 12.8 us at one token and 50.0 against 49.1 at six; in the step greedy decode 1.3606 / 1.3620 ms
against 1.3158 / 1.3162 (results/step-ab-h100-20261206-moe-up-tma.json). Half the programs of the Triton kernel's
32-wide tiles (144 against 288 at decode), each streaming its 196 KB behind a synchronous wgmma per block, do not
keep the HBM as busy as twice as many cp.async pipelines: the per-launch constant is not the bytes in flight. Kept
(opt-in) as the bit-exact TMA tile the next try builds on (a persistent kernel whose ring runs across tiles).

Where it runs (`eligible`): MOE_UP_TMA on (LINGC_MOE_UP_TMA=1; off by default: slower, above), CUDA
sm_90, a PDL launch, Gluon importable, bf16 x and w13 (no fp32 IEEE dots), no SwiGLU clamp (limit 0: Ling-3.0-tiny),
N a multiple of BN, K a multiple of BK with the x slice and the ring fitting 2 CTAs an SM, BLOCK_M <= 16, and none of
the Triton kernel's pre-wait variants asked for (SHARED_EARLY's early shared tile, the register preload, the L2
prefetches). Gluon has no interpreter: CPU tests compile it for sm_90 offline and check its PTX order
(tests/kernels/test_moe_tma.py). A compile failure warns once and the Triton kernel runs (kernels/gluon_launch.py).
"""

from __future__ import annotations

import torch

from lingc.knobs import env_flag, env_int
from lingc.kernels.pdl import TRIGGER
from lingc.kernels.gluon_launch import guarded, major as _major

try:  # Gluon ships with Triton >= 3.5; without it (or its Hopper modules) the Triton kernel runs everywhere
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.extra import libdevice
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from lingc.kernels.linear_tma import ring_mma   # the wgmma chain over the weight ring, kernels/linear_tma.py's
    from lingc.kernels.pdl import gluon_gdc_launch_dependents, gluon_gdc_wait
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the Triton build
    HAVE_GLUON = False

MOE_UP_TMA = env_flag("LINGC_MOE_UP_TMA", False)
FAILED: list[str] = []   # the first compile failure's message; once set, every launch runs the Triton kernel
BLOCK_N = 64             # w13 rows a program (the wgmma M): 32 gate + 32 up, interleaved
BLOCK_K = 128
TILE_M = 16              # the block's pair slots (the wgmma N)
RING = env_int("LINGC_MOE_UP_TMA_RING", 4)   # weight blocks in flight a program
WARPS = 4                # one warpgroup
HOPPER = 9
SMEM_2_CTAS = 113 * 1024  # the most shared memory a CTA may take for two to share an SM (228 KB, 1 KB reserved each)


def smem_bytes(k: int, ring: int = RING) -> int:
    """Shared memory of one program: the weight ring and the x slice, bf16, plus the ring's mbarriers."""
    return ring * BLOCK_N * BLOCK_K * 2 + (k // BLOCK_K) * TILE_M * BLOCK_K * 2 + 8 * ring


def fits(n: int, k: int, block_m: int, ring: int = RING) -> bool:
    """The shape rule: whole BN tiles, whole BK blocks, a ring no longer than the slice, 2 CTAs an SM."""
    return (n % BLOCK_N == 0 and k % BLOCK_K == 0 and 1 <= ring <= k // BLOCK_K and block_m <= TILE_M
            and smem_bytes(k, ring) <= SMEM_2_CTAS)


def eligible(x: torch.Tensor, w13: torch.Tensor, block_m: int, limit: float, pdl: bool, variants: bool) -> bool:
    """Whether a moe_up_act launch takes this path (module docstring); `variants`: the launch asks for one of the
    Triton kernel's pre-wait variants (SHARED_EARLY, preload, prefetch), which this kernel does not have."""
    if not (MOE_UP_TMA and HAVE_GLUON and not FAILED and pdl and not variants and limit <= 0):
        return False
    if not (x.is_cuda and _major(x.device) == HOPPER):
        return False
    if x.dtype != torch.bfloat16 or w13.dtype != torch.bfloat16 or x.stride(-1) != 1 or not w13.is_contiguous():
        return False
    if w13.data_ptr() % 16 or (w13.shape[-1] * 2) % 16:
        return False
    return fits(w13.shape[1], w13.shape[2], block_m)


if HAVE_GLUON:
    @gluon.jit
    def _moe_up_tma_kernel(w_desc, x_ptr, out_ptr, sorted_ptr, block_expert_ptr, total_ptr, num_pairs, N, stride_xm,
                           stride_om, K: gl.constexpr, TOP_K: gl.constexpr, BLOCK_M: gl.constexpr,
                           BN: gl.constexpr, BK: gl.constexpr, BM: gl.constexpr, RING: gl.constexpr,
                           EARLY_TRIGGER: gl.constexpr):
        """Program (n, b): act rows of block b's pairs, columns n * BN / 2 .. (module docstring). Launched with PDL."""
        KB: gl.constexpr = K // BK
        pid_n = gl.program_id(0)
        pid_b = gl.program_id(1)
        xl: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        offs_m = gl.arange(0, BM, layout=gl.SliceLayout(1, xl))
        offs_k = gl.arange(0, BK, layout=gl.SliceLayout(0, xl))
        gluon_gdc_wait()                    # the router / align wrote everything this kernel reads but the weights
        if EARLY_TRIGGER:
            gluon_gdc_launch_dependents()
        total = gl.load(total_ptr)
        expert = gl.load(block_expert_ptr + pid_b)
        pairs = gl.load(sorted_ptr + pid_b * BLOCK_M + offs_m, mask=offs_m < BLOCK_M, other=num_pairs)   # [BM]
        if pid_b * BLOCK_M < total:
            row0 = expert * N + pid_n * BN            # the tile's first row in w13 viewed as [E * N, K]
            w_smem = gl.allocate_shared_memory(w_desc.dtype, [RING, BN, BK], w_desc.layout)
            bars = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
            for s in gl.static_range(RING):
                mbarrier.init(bars.index(s), count=1)
            for s in gl.static_range(RING):
                mbarrier.expect(bars.index(s), w_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(w_desc, [row0, s * BK], bars.index(s), w_smem.index(s))
            valid = pairs < num_pairs
            rows = gl.where(valid, pairs // TOP_K, 0).to(gl.int64)
            x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BK], w_desc.dtype)
            x_smem = gl.allocate_shared_memory(w_desc.dtype, [KB, BM, BK], x_layout)
            for b in gl.static_range(KB):     # x rows [pairs, K], K-major: the wgmma B operand, permuted
                xv = gl.load(x_ptr + rows[:, None] * stride_xm + (b * BK + offs_k)[None, :], mask=valid[:, None],
                             other=0.0)
                x_smem.index(b).store(xv)
            fence_async_shared()
            acc = ring_mma(w_desc, w_smem, bars, x_smem, bars, row0, 0, KB, RING, BN, BM, BK, False)
            for s in gl.static_range(RING):
                mbarrier.invalidate(bars.index(s))
            if not EARLY_TRIGGER:
                gluon_gdc_launch_dependents()
            # epilogue: h [BN, BM] in the activation dtype, even rows gate, odd rows up (w13 interleaved)
            el: gl.constexpr = gl.BlockedLayout([2, 1], [8, 4], [4, 1], [0, 1])
            h = gl.convert_layout(acc.to(out_ptr.dtype.element_ty), el)
            gate, up = gl.split(gl.permute(gl.reshape(h, [BN // 2, 2, BM]), [0, 2, 1]))    # [BN / 2, BM] each
            g = gate.to(gl.float32)
            u = up.to(gl.float32)
            act = (gl.div_rn(g, 1.0 + libdevice.exp(-g)) * u).to(out_ptr.dtype.element_ty)
            ol: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [4, 1], [0, 1])
            act = gl.convert_layout(act, ol)
            oi = pid_n * (BN // 2) + gl.arange(0, BN // 2, layout=gl.SliceLayout(1, ol))
            op = gl.convert_layout(pairs, gl.SliceLayout(0, ol))
            mask = (op < num_pairs)[None, :] & (oi < N // 2)[:, None]
            gl.store(out_ptr + op.to(gl.int64)[None, :] * stride_om + oi[:, None], act, mask=mask)


def _descriptor(w13: torch.Tensor):
    """The [BN, BK]-box TMA descriptor of w13 viewed as [E * N, K] (made per launch, as kernels/linear_tma.py's)."""
    w2 = w13.view(-1, w13.shape[-1])
    layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.bfloat16)
    return TensorDescriptor.from_tensor(w2, [BLOCK_N, BLOCK_K], layout)


def launch(x: torch.Tensor, w13: torch.Tensor, out: torch.Tensor, sorted_pairs: torch.Tensor,
           block_expert: torch.Tensor, total: torch.Tensor, top_k: int, block_m: int) -> bool:
    """out [pairs, N / 2] = moe_up_act on this path (the caller checked `eligible`), PDL-launched; False, with one
    warning, where the kernel does not compile (the caller then runs the Triton kernel)."""
    num_pairs = x.shape[0] * top_k
    n, k = w13.shape[1], w13.shape[2]
    grid = (n // BLOCK_N, min(block_expert.numel(), num_pairs))
    return guarded(lambda: _moe_up_tma_kernel[grid](
        _descriptor(w13), x, out, sorted_pairs, block_expert, total, num_pairs, n, x.stride(0), out.stride(0),
        K=k, TOP_K=top_k, BLOCK_M=block_m, BN=BLOCK_N, BK=BLOCK_K, BM=TILE_M, RING=RING,
        EARLY_TRIGGER=TRIGGER == "early", num_warps=WARPS, enable_fp_fusion=False, enable_reflect_ftz=False,
        launch_pdl=True),
        FAILED, "the TMA up-GEMM (kernels/moe_tma.py)", "the Triton kernel", "LINGC_MOE_UP_TMA")
