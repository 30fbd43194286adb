"""kda_fused_decode / kda_fused_verify's GPU path: the same fused kernel written with explicit layouts (Gluon).

Why: kernels/kda.py's Triton kernel spends its T-position chain on CTA barriers. Its layouts are the compiler's: the
[D, BV] = [128, 16] state slice puts its 4 warps on the K axis, so every K reduction (S.k, S.q and both l2 norms)
crosses warps through shared memory, and each [D] input of a step arrives in yet another layout (8 conversions a
position). sm_90 SASS of the T = 6 verify kernel: 24 BAR.SYNC and 582 instructions in the loop body; on the H200
~1.5 us a position (11.8 us at T = 6, 4.3 at T = 1 in the step, bench/results/launches-entry-h200-20261203.json).
Here the layouts are chosen (WARPS = 4, D = 128, BLOCK_V = 16):

    LS   [D, BV]  the state slice: a thread holds 4 K rows x 4 V columns, the 32 lanes span K, the 4 warps V, so a
                  K reduction is 4 in-thread adds and 5 lane shuffles, never a barrier
    LT1  [TP, D]  one channel a thread, every position in its registers (TP = T rounded up to a power of two): the
                  q / k convs and the gates (no transcendental work done twice in a program), stacked by position,
                  and the l2 norms (one cross-warp sum a kind for all positions)

then every position's qn, kn, decay and v go to shared memory once (one barrier), and the chain is a runtime loop
(`.pragma "nounroll"`: unrolled, the straight-line code stalls on instruction fetch) that reads position t's rows
in LS's slice layouts and has no barrier of its own.

The state leaves by TMA (TMA_STAGE for verify's per-position staging, TMA_POOL for decode's write-back): in LS a
thread's 4 x 4 slice is 4 rows of 16 B at a 512 B stride, so plain stores cost a warp 128 partial-sector writes a
position (ncu, 2026-12-04: L2 at ~half its peak with DRAM at 2%, and the loop's back edge waiting on the stores'
registers). Instead each position's [D, BV] slice goes to its own shared-memory buffer, a fence and a CTA barrier
(plus the one the compiler adds before the buffer's write: it cannot tell the runtime-indexed buffers apart), and
one thread's TMA store writes it as 128 whole 64 B row segments; the stores drain asynchronously and the kernel waits
for them once before it exits. Same bits (the same fp32 values land in the same places); verify T = 6 alone 9.4 ->
7.0 us, decode 3.9 -> 3.8 (bench/results/kernels-kda-tma-h200-20261204.json); in the step greedy verify 2.217 ->
2.154 ms (step-ab-h200-20261204-c.json) and greedy decode 1.137 -> 1.132 (-d.json).

The Triton kernel's math: fp32 inside, no fp contraction (the launch's enable_fp_fusion=False), the taps summed
j = 0..W-1, the conv outputs rounded to the activation dtype, the l2 norm as x * rsqrt(sum x^2 + eps) (* scale), the
step as _delta_step, but other reduction trees (fp32 summation order) and, with FAST_MATH (the default), ex2.approx
and div.full for the convs' silu and the gates instead of libdevice expf and IEEE division (~2 ulp fp32 before the
bf16 rounding; 9.8e-4 max on the fp32 state against the Triton kernel at T = 6). So the bits are not the Triton
kernel's, nor torch's conv bits: a numerics change for kda_fused_* on the GPU (tolerances in bench/kernel_kda.py).
Row invariance holds by construction: the step's layouts do not depend on T, a norm sums its row over the same
threads in the same order whatever TP is, and the convs and gates are elementwise, so position t of a verify chain
has the bits of a decode step from the same state, and staged + commit(a) == a decode steps, as long as decode and
verify both run this kernel (`eligible` does not look at T). PDL placement, the staging writes and kda_fused_decode's
per-head ticket are the Triton kernel's (kernels/kda.py `_kda_fused_kernel`, `_update_windows`): weights, the slot,
the state slice and the pool windows before the wait (.cg); the projection's outputs after it; the window update
after every window read.

Measured on the H200 (bench/results/kernels-kda-gluon-h200-20261203.json, step-ab-h200-20261203-k/-l/-m.json): alone,
verify T = 6 9.3 us against the Triton kernel's 10.3 (10.4-10.5 with precise math: the chain was not the bound, the
per-position convs and gates are), decode 4.0-4.3 against 3.9. In the step, greedy verify 2.281-2.282 ms against
2.310, NEXTN 3.235-3.253 against 3.280, but decode 1.19-1.20 against 1.176 (the T = 1 path pays the stacking and the
cross-warp norms without a chain to win back). More tiles or warps were slower (every V tile recomputes its head's
convs and gates): (8, 4), (16, 8), (8, 8) took 17-31 us at T = 6.

Where it runs (`eligible`): CUDA sm_90+ (PDL and the validated target), Gluon importable, LINGC_KDA_GLUON not 0,
D = 128, W = 4, BLOCK_V 16 at 4 warps, T <= 16. Elsewhere, and under the interpreter (Gluon has none), the Triton
kernel runs; CPU tests compile this one for sm_90 offline (tests/kernels/test_kda_gluon.py). A compile failure (a
Triton whose Gluon differs from 3.6's) warns once and falls back, as kernels/linear_tma.py does.
"""

from __future__ import annotations

import torch
import triton

from lingc.knobs import env_flag
from lingc.kernels.pdl import TRIGGER
from lingc.kernels.gluon_launch import guarded, major as _major
from lingc.kernels.workspace import indexed

try:  # Gluon ships with Triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.extra import libdevice
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from lingc.kernels.pdl import gluon_gdc_launch_dependents, gluon_gdc_wait
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the Triton build
    HAVE_GLUON = False

ENABLED = env_flag("LINGC_KDA_GLUON", True)   # LINGC_KDA_GLUON=0: the Triton kernel everywhere
FAILED: list[str] = []   # the first compile failure's message; once set, every launch runs the Triton kernel
D = 128                  # head dim: 4 rows x 32 lanes
BLOCK_V = 16             # state columns a program: 4 columns x 4 warps (kernels/kda.py BLOCK_V)
WARPS = 4
WIDTH = 4                # conv taps (spelled out)
MAX_T = 16
# ex2.approx / div.full in the convs and gates (LINGC_KDA_GLUON_FAST=0: libdevice expf and IEEE division, the Triton
# kernel's PRECISE). H200 step (step-ab-h200-20261203-m.json): greedy verify 2.282 / 2.281 ms against 2.299 / 2.299
FAST_MATH = env_flag("LINGC_KDA_GLUON_FAST", True)
# decode: take the head's ticket (release) right after the window reads and read it at the end, so its round trip
# overlaps the work. Off: the H200 step measured it slower (greedy decode 1.206 vs 1.192 ms with the ticket read
# at once)
LATE_TICKET = env_flag("LINGC_KDA_GLUON_LATE_TICKET", False)
# the step's output from the decayed state before its update, o = S'^T q + (k.q) err, so S'.k and S'.q reduce together
# (two shuffle trees interleaved) instead of S'.k, the update, then S.q one after the other; a numerics change (other
# fp32 rounding of o; the state's bits are unchanged). Off: 7.0 -> 6.65 us alone at T = 6 but level in the H200 step
# (greedy verify 2.154 / 2.156 ms with it, 2.145 without; step-ab-h200-20261204-c.json). LINGC_KDA_GLUON_PARALLEL_O=1
PARALLEL_O = env_flag("LINGC_KDA_GLUON_PARALLEL_O", False)
# verify's staged state through shared memory and one TMA store a position ([D, BLOCK_V] box: whole 64 B row segments)
# instead of 4 plain 16 B stores a thread at a 512 B stride (ncu: the loop's back edge waited on their registers, and
# the kernel's L2 traffic was ~half its peak with DRAM at 2%); one CTA barrier a position. Same bits.
# LINGC_KDA_GLUON_TMA_STAGE=0: the plain stores
TMA_STAGE = env_flag("LINGC_KDA_GLUON_TMA_STAGE", True)
# decode's state write-back to the pool the same way (one TMA store of the [D, BV] slice); greedy decode 1.137 -> 1.132
# ms (step-ab-h200-20261204-d.json). LINGC_KDA_GLUON_TMA_POOL=0: the plain stores
TMA_POOL = env_flag("LINGC_KDA_GLUON_TMA_POOL", True)
L2NORM_EPS = gl.constexpr(1e-6) if HAVE_GLUON else 1e-6   # kernels/kda.py L2NORM_EPS


def eligible(device: torch.device, head_dim: int, width: int, T: int) -> bool:
    """Whether kda_fused_* runs here rather than on kernels/kda.py's Triton kernel (module docstring). T does not
    decide where it is in range (row invariance: decode and verify must run the same kernel)."""
    if not (ENABLED and HAVE_GLUON and not FAILED and device.type == "cuda" and not triton.knobs.runtime.interpret):
        return False
    if (head_dim, width) != (D, WIDTH) or not 1 <= T <= MAX_T or BLOCK_V % WARPS or D % BLOCK_V:
        return False
    return _major(indexed(device)) >= 9


if HAVE_GLUON:
    @gluon.jit
    def _fence_acq_rel():
        gl.inline_asm_elementwise("fence.acq_rel.gpu; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _store_qk_windows(cq_row, ck_row, win_q, win_k, count_ptr, T: gl.constexpr, W: gl.constexpr):
        """The ticket's last tile: the head's q/k windows after the T positions, then the counter back to zero."""
        for c in gl.static_range(W - 1):
            gl.store(cq_row + c, win_q[T + c].to(cq_row.dtype.element_ty))
            gl.store(ck_row + c, win_k[T + c].to(ck_row.dtype.element_ty))
        gl.store(count_ptr, 0)

    @gluon.jit
    def _tma_store_state(smem, desc, row, col, S):
        """S ([D, BV] slice, the state's layout) -> its shared-memory buffer -> one thread's TMA store at (row, col) of
        desc (module docstring); the caller waits for the store (tma.store_wait) before the buffer is reused or the
        kernel exits."""
        smem.store(S)
        fence_async_shared()
        gl.thread_barrier()                 # every warp's columns are in the buffer before the one thread's TMA
        tma.async_copy_shared_to_global(desc, [row, col], smem)

    @gluon.jit
    def _no_unroll():
        """`.pragma "nounroll"` in the enclosing loop's (single-block) body, which is its header: ptxas would unroll a
        short constant-trip loop."""
        gl.inline_asm_elementwise('.pragma "nounroll";\n\tmov.u32 $0, 0;', "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)

    @gluon.jit
    def _exp(x, FAST: gl.constexpr):
        """expf: libdevice's (kernels/kda.py PRECISE), or FAST ex2.approx of x * log2(e)."""
        if FAST:
            y = gl.exp(x)
        else:
            y = libdevice.exp(x)
        return y

    @gluon.jit
    def _div(x, y, FAST: gl.constexpr):
        """x / y: IEEE round-to-nearest (div_rn), or FAST div.full.f32 (full range, ~2 ulp)."""
        if FAST:
            z = gl.fdiv(x, y)
        else:
            z = gl.div_rn(x, y)
        return z

    @gluon.jit
    def _sigmoid(x, one, FAST: gl.constexpr):
        """one / (1 + exp(-x)) (kernels/kda.py `_sigmoid`); one is 1.0 in x's shape and layout (a scalar has none)."""
        return _div(one, 1.0 + _exp(-x, FAST), FAST)

    @gluon.jit
    def _conv(win, t: gl.constexpr, w0, w1, w2, w3, FAST: gl.constexpr):
        """silu(sum_j w_j * win[t + j]) in fp32, taps one by one (kernels/kda.py `_conv_window`, W = 4)."""
        y = win[t].to(gl.float32) * w0
        y = y + win[t + 1].to(gl.float32) * w1
        y = y + win[t + 2].to(gl.float32) * w2
        y = y + win[t + 3].to(gl.float32) * w3
        return _div(y, 1.0 + _exp(-y, FAST), FAST)

    @gluon.jit
    def _pick(values, t, T: gl.constexpr):
        """values[t] for a runtime t < T (a tuple of T scalars): a chain of selects, exact."""
        x = values[0]
        for i in gl.static_range(1, T):
            x = gl.where(t == i, values[i], x)
        return x

    @gluon.jit
    def _kda_gluon_kernel(qx_ptr, kx_ptr, vx_ptr, f_ptr, b_ptr, wq_ptr, wk_ptr, wv_ptr, cq_ptr, ck_ptr, cv_ptr,
                          a_log_ptr, dt_bias_ptr, pool_ptr, slots_ptr, sq_ptr, sk_ptr, sv_ptr, staging_ptr,
                          count_ptr, o_ptr, H, s_xb, s_xt, s_fb, s_ft, s_fh, s_bb, s_bt, s_bh, s_cpool, s_cstb,
                          s_cstt, s_stb, s_stt, scale, lower_bound, st_desc,
                          T: gl.constexpr, TP: gl.constexpr, D: gl.constexpr, BV: gl.constexpr,
                          STAGED: gl.constexpr, PDL: gl.constexpr, EARLY_TRIGGER: gl.constexpr, NW: gl.constexpr,
                          FAST: gl.constexpr, LATE_TICKET: gl.constexpr, PARALLEL_O: gl.constexpr,
                          TMA_STATE: gl.constexpr):
        """Program (b*H + h, V tile): kernels/kda.py `_kda_fused_kernel` (STAGED: verify, else decode) with the
        module docstring's layouts."""
        W: gl.constexpr = 4
        gl.static_assert(D == 128)
        gl.static_assert(BV % NW == 0)
        LS: gl.constexpr = gl.BlockedLayout([4, BV // NW], [32, 1], [1, NW], [1, 0])  # [D, BV]
        LK: gl.constexpr = gl.SliceLayout(1, LS)
        LV: gl.constexpr = gl.SliceLayout(0, LS)
        LT1: gl.constexpr = gl.BlockedLayout([TP, 1], [1, 32], [1, NW], [1, 0])      # [TP, D], a channel a thread
        L1: gl.constexpr = gl.SliceLayout(0, LT1)
        LTV1: gl.constexpr = gl.BlockedLayout([TP, 1], [1, 32], [1, NW], [1, 0])     # [TP, BV]
        LV1: gl.constexpr = gl.SliceLayout(0, LTV1)
        pid = gl.program_id(0)
        vt = gl.program_id(1)
        b = (pid // H).to(gl.int64)
        h = pid % H
        rk1 = gl.arange(0, D, layout=L1)
        rv1 = vt * BV + gl.arange(0, BV, layout=LV1)
        ck = h * D + rk1                                                              # q/k channels of head h
        cv = h * D + rv1                                                              # v channels of this tile
        wq0 = gl.load(wq_ptr + ck * W)
        wq1 = gl.load(wq_ptr + ck * W + 1)
        wq2 = gl.load(wq_ptr + ck * W + 2)
        wq3 = gl.load(wq_ptr + ck * W + 3)
        wk0 = gl.load(wk_ptr + ck * W)
        wk1 = gl.load(wk_ptr + ck * W + 1)
        wk2 = gl.load(wk_ptr + ck * W + 2)
        wk3 = gl.load(wk_ptr + ck * W + 3)
        wv0 = gl.load(wv_ptr + cv * W)
        wv1 = gl.load(wv_ptr + cv * W + 1)
        wv2 = gl.load(wv_ptr + cv * W + 2)
        wv3 = gl.load(wv_ptr + cv * W + 3)
        a = _exp(gl.load(a_log_ptr + h).to(gl.float32), FAST)
        dtb = gl.load(dt_bias_ptr + ck).to(gl.float32)
        # before the wait: the slot, the state slice and the pool windows (kernels/kda.py `_kda_fused_kernel` step 0)
        slot = gl.load(slots_ptr + b, cache_modifier=".cg").to(gl.int64)
        rkS = gl.arange(0, D, layout=LK)
        rvS = vt * BV + gl.arange(0, BV, layout=LV)
        tile = h * D * D + rkS[:, None] * D + rvS[None, :]
        S = gl.load(pool_ptr + slot * H * D * D + tile, cache_modifier=".cg")
        cq_row = cq_ptr + slot * s_cpool + ck * (W - 1)
        ck_row = ck_ptr + slot * s_cpool + ck * (W - 1)
        cv_row = cv_ptr + slot * s_cpool + cv * (W - 1)
        xty = qx_ptr.dtype.element_ty
        win_q = ()
        win_k = ()
        win_v = ()
        for i in gl.static_range(W - 1):
            win_q = win_q + (gl.load(cq_row + i, cache_modifier=".cg").to(xty),)
            win_k = win_k + (gl.load(ck_row + i, cache_modifier=".cg").to(xty),)
            win_v = win_v + (gl.load(cv_row + i, cache_modifier=".cg").to(xty),)
        if PDL:
            gluon_gdc_wait()
            if EARLY_TRIGGER:
                gluon_gdc_launch_dependents()
        # every load of the projection's outputs, all positions at once
        fs = ()
        bs = ()
        for t in gl.static_range(T):
            win_q = win_q + (gl.load(qx_ptr + b * s_xb + t * s_xt + ck),)
            win_k = win_k + (gl.load(kx_ptr + b * s_xb + t * s_xt + ck),)
            win_v = win_v + (gl.load(vx_ptr + b * s_xb + t * s_xt + cv),)
            fs = fs + (gl.load(f_ptr + b * s_fb + t * s_ft + h * s_fh + rk1),)
            bs = bs + (gl.load(b_ptr + b * s_bb + t * s_bt + h * s_bh),)
        if not STAGED:   # every window read: kernels/kda.py `_update_windows`, from the registers
            gl.thread_barrier()     # every thread's window loads come before the ticket and the v window stores
            if LATE_TICKET:         # take it now (release), read it at the end: its round trip overlaps the work
                lane = gl.arange(0, 32 * NW, layout=gl.BlockedLayout([1], [32], [NW], [0]))
                tk = gl.atomic_add(count_ptr + pid + lane * 0, lane * 0 + 1, mask=lane == 0, sem="release",
                                   scope="gpu")
            else:
                ticket = gl.atomic_add(count_ptr + pid, 1, sem="acq_rel", scope="gpu")
                if ticket == gl.num_programs(1) - 1:
                    _store_qk_windows(cq_row, ck_row, win_q, win_k, count_ptr + pid, T, W)
            for c in gl.static_range(W - 1):        # this tile's own v channels: read by no other program
                gl.store(cv_row + c, win_v[T + c].to(cv_ptr.dtype.element_ty))
        if PDL:
            if not EARLY_TRIGGER:
                gluon_gdc_launch_dependents()
        # the convs and gates of every position, stacked by position
        tq = gl.arange(0, TP, layout=gl.SliceLayout(1, LT1))
        tv = gl.arange(0, TP, layout=gl.SliceLayout(1, LTV1))
        Q = gl.zeros([TP, D], gl.float32, LT1)
        K = gl.zeros([TP, D], gl.float32, LT1)
        G = gl.zeros([TP, D], gl.float32, LT1)
        V = gl.zeros([TP, BV], gl.float32, LTV1)
        own = (rk1 >= vt * BV) & (rk1 < vt * BV + BV)     # the q/k channels whose staged windows this tile writes
        betas = ()
        for t in gl.static_range(T):
            yq = _conv(win_q, t, wq0, wq1, wq2, wq3, FAST).to(xty).to(gl.float32)
            yk = _conv(win_k, t, wk0, wk1, wk2, wk3, FAST).to(xty).to(gl.float32)
            yv = _conv(win_v, t, wv0, wv1, wv2, wv3, FAST).to(xty).to(gl.float32)
            g = lower_bound * _sigmoid(a * (fs[t].to(gl.float32) + dtb), gl.full([D], 1.0, gl.float32, L1), FAST)
            Q = gl.where((tq == t)[:, None], yq[None, :], Q)
            K = gl.where((tq == t)[:, None], yk[None, :], K)
            G = gl.where((tq == t)[:, None], _exp(g, FAST)[None, :], G)
            V = gl.where((tv == t)[:, None], yv[None, :], V)
            betas = betas + (_sigmoid(bs[t].to(gl.float32), gl.to_tensor(1.0), FAST),)
            if STAGED:
                cst = b * s_cstb + t * s_cstt
                for c in gl.static_range(W - 1):
                    gl.store(sq_ptr + cst + ck * (W - 1) + c, win_q[t + 1 + c].to(sq_ptr.dtype.element_ty),
                             mask=own)
                    gl.store(sk_ptr + cst + ck * (W - 1) + c, win_k[t + 1 + c].to(sk_ptr.dtype.element_ty),
                             mask=own)
                    gl.store(sv_ptr + cst + cv * (W - 1) + c, win_v[t + 1 + c].to(sv_ptr.dtype.element_ty))
        # the l2 norms (each row reduced over the 128 threads in one order whatever TP is), then every position's
        # step inputs into shared memory, read back a row a step in the state's layouts
        QN = Q * gl.rsqrt(gl.sum(Q * Q, axis=1) + L2NORM_EPS)[:, None] * scale
        KN = K * gl.rsqrt(gl.sum(K * K, axis=1) + L2NORM_EPS)[:, None]
        rows2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])   # no swizzle: row-major [TP, N]
        rows1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])      # the same bytes as TP rows (`index`)
        qn_s = gl.allocate_shared_memory(gl.float32, [TP, D], rows2, QN)._reinterpret(gl.float32, [TP, D], rows1)
        kn_s = gl.allocate_shared_memory(gl.float32, [TP, D], rows2, KN)._reinterpret(gl.float32, [TP, D], rows1)
        g_s = gl.allocate_shared_memory(gl.float32, [TP, D], rows2, G)._reinterpret(gl.float32, [TP, D], rows1)
        v_s = gl.allocate_shared_memory(gl.float32, [TP, BV], rows2, V)._reinterpret(gl.float32, [TP, BV], rows1)
        if STAGED and TMA_STATE:   # a [D, BV] buffer a position, each stored by one TMA (module docstring)
            st_smem = gl.allocate_shared_memory(gl.float32, [T, D, BV], st_desc.layout)
            st_row = ((b * s_stb) // D + h * D).to(gl.int32)
        gl.thread_barrier()
        # the chain: S and the step's K reductions stay inside each warp, no barrier (but TMA_STATE's, one a position)
        for t in range(T):
            _no_unroll()
            kn = kn_s.index(t).load(LK)
            qn = qn_s.index(t).load(LK)
            decay = g_s.index(t).load(LK)
            v = v_s.index(t).load(LV)
            S = S * decay[:, None]
            if PARALLEL_O:   # o = S'^T q + (k.q) err: both K reductions read S' together (module docstring)
                kq = gl.sum(kn * qn, axis=0)
                sk = gl.sum(S * kn[:, None], axis=0)
                sq = gl.sum(S * qn[:, None], axis=0)
                err = _pick(betas, t, T) * (v - sk)
                S = S + kn[:, None] * err[None, :]
                o = sq + kq * err
            else:
                err = _pick(betas, t, T) * (v - gl.sum(S * kn[:, None], axis=0))
                S = S + kn[:, None] * err[None, :]
                o = gl.sum(S * qn[:, None], axis=0)
            gl.store(o_ptr + ((b * T + t) * H + h) * D + rvS, o.to(o_ptr.dtype.element_ty))
            if STAGED:
                if TMA_STATE:
                    _tma_store_state(st_smem.index(t), st_desc, st_row + t * (s_stt // D), vt * BV, S)
                else:
                    gl.store(staging_ptr + b * s_stb + t * s_stt + tile, S)
        if STAGED and TMA_STATE:
            tma.store_wait(0)               # the buffers outlive the stores that read them
        if not STAGED:
            if TMA_STATE:   # decode: st_desc is the pool's ([slots*H*D, D] rows)
                pool_smem = gl.allocate_shared_memory(gl.float32, [D, BV], st_desc.layout)
                _tma_store_state(pool_smem, st_desc, ((slot * H + h) * D).to(gl.int32), vt * BV, S)
                tma.store_wait(0)
            else:
                gl.store(pool_ptr + slot * H * D * D + tile, S)
            if LATE_TICKET:
                if gl.max(gl.where(lane == 0, tk, -1), axis=0) == gl.num_programs(1) - 1:
                    _fence_acq_rel()            # the acquire half of the ticket, before the window stores
                    _store_qk_windows(cq_row, ck_row, win_q, win_k, count_ptr + pid, T, W)


STATE_POOL_ARG, STAGING_STATE_ARG = 13, 18   # their places among `launch`'s args (kernels/kda.py `_fused`)


def _state_descriptor(state: torch.Tensor, on: bool):
    """The state staging [B, T, H, D, D] (verify) or the state pool [slots, H, D, D] (decode), fp32, as rows of D,
    [D, BLOCK_V] boxes (a program's slice of one state); None where `on` (TMA_STAGE / TMA_POOL) is off or the tensor
    is not one contiguous block (the kernel then stores the state with plain stores)."""
    if not on or not state.is_contiguous() or state.dtype != torch.float32 or state.data_ptr() % 16:
        return None
    layout = gl.NVMMASharedLayout.get_default_for([D, BLOCK_V], gl.float32)
    return TensorDescriptor.from_tensor(state.view(-1, D), [D, BLOCK_V], layout)


def launch(args: tuple, B: int, H: int, T: int, staged: bool, pdl: bool) -> bool:
    """Run the kernel on kernels/kda.py `_kda_fused_kernel`'s positional arguments (the caller checked `eligible`).
    False, with one warning, where it does not compile: the caller then runs the Triton kernel."""
    desc = _state_descriptor(args[STAGING_STATE_ARG], TMA_STAGE) if staged else \
        _state_descriptor(args[STATE_POOL_ARG], TMA_POOL)
    return guarded(lambda: _kda_gluon_kernel[(B * H, D // BLOCK_V)](
        *args, desc, T=T, TP=triton.next_power_of_2(T), D=D, BV=BLOCK_V, STAGED=staged, PDL=pdl,
        EARLY_TRIGGER=TRIGGER == "early", NW=WARPS, FAST=FAST_MATH, LATE_TICKET=LATE_TICKET,
        PARALLEL_O=PARALLEL_O, TMA_STATE=desc is not None,
        num_warps=WARPS, enable_fp_fusion=False, **({"launch_pdl": True} if pdl else {})),
        FAILED, "the Gluon KDA kernel (kernels/kda_gluon.py)", "the Triton kernel", "LINGC_KDA_GLUON")
