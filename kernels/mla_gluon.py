"""mla_attention's split kernel on Hopper (Gluon): four queries' heads as one wgmma tile, the split's cache rows in
shared memory before the PDL wait.

kernels/mla.py's Triton split gives each query its own program ([16 heads, R] x [R, 64] mma.sync steps): a 6-query
verify runs 384 programs that each re-read their split's 147 KB of cache rows, and a program's time is the latency
of its dependent MMA chain after the wait (H200 ncu at 6 queries: 23 us, 11% occupancy; launches-entry: 33 us a
verify layer for the four kernels). Here one program takes QPP = 64 / H consecutive queries of a request (all heads:
64 MMA rows, the wgmma M) and one split of SPLIT = 128 cache rows:

    before the wait   the tile's positions, the split's page-table rows, and its 128 cache rows [128, R + Rr] by
                      cp.async into shared memory (zero where a row is past the tile's last visible row), UNIT = 32
                      rows a copy, every unit whose rows all precede the request's first query of this step: those
                      rows, the positions and the table were written by earlier steps or at the step's head, long
                      complete. q_absorb, the launch before, triggers at its entry (kernels/mla.py QA_ENTRY), so
                      this kernel may start while mla_prep, two launches back, still writes this step's rows
    after the wait    the units holding a row of this step's tokens (one at decode; mla_prep has completed), then
                      q_lat [64, R] and q_rope [64, Rr] (cp.async; rows of queries past the chain's end load
                      nothing), then
                      S = Q K^T       [64, 128]: 4 latent chunks of 128 columns, then the rope chunk, on one
                                      accumulator (wgmma, the 2 warpgroups side by side on N)
                      m = max over the row's visible columns, p = 2^(S * scale - m), l = sum p (fp32)
                      P -> shared memory (bf16, over the query tile's first chunk: Q is dead by then)
                      O = P V         [64, R]: 4 accumulators of 128 latent columns, issued together, one wait
                      the unnormalised partial (m, l, O) of every live query in kernels/mla.py's layout, O in bf16
                      (PARTIAL_BF16) and a row a warp (the combine and v_absorb are that module's)

No online softmax: a split is one 128-row block. Shared memory (one allocation a chunk, so no barrier separates the
copies): the cache rows 144 KB + the query tile 72 KB at Ling-3.0-tiny's R = 512, Rr = 64 (1 CTA an SM, 8 warps,
154 registers); a 6-query verify runs 2 x S programs, decode S (S = 73 at the bench's capacity; a split past every
query's position exits at once).

Row invariance: a query's row in the tile gets the same instructions whatever T is and whichever slot it sits in
(a wgmma row depends only on its own operands; the row reductions run the same shuffle tree on every row); a T = 1
call fills slot 0 and stores nothing from the other slots. So a verify chain's query has the bits of a decode step
as long as both run this kernel (`eligible` does not look at T; checked on the H200). Numerics against the Triton
split: one 128-row softmax block instead of two 64-row online steps, wgmma instead of mma.sync (other fp32 summation
order): a numerics change for mla_attention on sm_90 (max |diff| 3.9e-3 on bf16 outputs; bench/kernel_mla.py
--gluon checks both against the reference's tolerance).

Measured on the H200 (bench/results/kernels-mla-gluon-h200-20261203.json, step-ab-h200-20261203-q.json): mla_attention
25.7 against 34.6 us at 6 queries, 15.4 against 16.3 at one (context 8192, cold caches, PDL on); in the step greedy
decode 1.146 against 1.165 ms, verify 2.218 against 2.265, NEXTN 3.154 against 3.230. At a short context (1024: 16
live programs) 6 queries took 21.9 against 20.7 us: there one program's dependent steps decide. 2026-12-04: with bf16
partials and q_absorb's entry trigger 13.8 us at one query and 22.8 at six (19.6 against the Triton split's 22.0 at
1024; kernels-mla-gluon-entry-h200-20261204.json). Where a program's time goes (the split alone, cold, PDL off,
parts compiled out; probe-mla-split-h200-20261204.json): ~3.5 us of cache-row copies, then 3.1 us of the two MMA
chains (a T = 1 call computes 48 dead rows of the 64), then the partial stores (1.8 / 4.3 us at 1 / 6 queries with
fp32 partials), on top of ~3 us of launch and position / page-table round trips.

The swapped form (SWAP, off; `_mla_split_swap_kernel`): a decode step fills one query slot of the 64-row tile, so 48
of the tile's 64 MMA rows are dead in both chains. Swapped, each query's S^T = K Q^T [128 cache rows, 16 heads] and
O^T = V^T P^T [128 latent columns, 16 heads] a chunk run as m64n16k16 chains with the two warpgroups stacked on M; the
softmax reduces over M (across the warpgroups), P goes over the query tile's first chunk as the B operand, and the
partials keep the default kernel's layout. A program takes up to 4 queries (one at decode), each with its own chains,
so a query's bits do not depend on T. Built and compiled offline for sm_90 (tests/kernels/test_mla_gluon.py); not yet
run on a GPU (bench/device_swap_ab.sh).

Where it runs (`eligible`): CUDA sm_90 (wgmma is Hopper's), Gluon importable, LINGC_MLA_GLUON not 0, a bf16 cache
and H = 16 (the code takes any 2-byte dtype and any H dividing 64, but only Ling-3.0-tiny's bf16 and 16 heads have
run on the GPU), R a multiple of 128 and Rr = 64 with the rows and the tile fitting shared memory, SPLIT_ROWS = 128,
rows 16-byte aligned. Elsewhere kernels/mla.py's Triton split runs; CPU tests compile this one for sm_90 offline
(tests/kernels/test_mla_gluon.py). A compile failure warns once and falls back (kernels/gluon_launch.py).
"""

from __future__ import annotations

import torch
import triton

from lingc.knobs import env_flag
from lingc.kernels.gluon_launch import guarded, major as _major
from lingc.kernels.workspace import indexed

try:  # Gluon ships with Triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait
    from lingc.kernels.pdl import gluon_gdc_launch_dependents, gluon_gdc_wait
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the Triton build
    HAVE_GLUON = False

ENABLED = env_flag("LINGC_MLA_GLUON", True)   # LINGC_MLA_GLUON=0: kernels/mla.py's Triton split
FAILED: list[str] = []   # the first compile failure's message; once set, every launch runs the Triton split
TILE_ROWS = 64           # the wgmma M: QPP = TILE_ROWS // H queries a program
SPLIT = 128              # cache rows a program (kernels/mla.py SPLIT_ROWS must equal it)
CHUNK = 128              # latent columns a shared-memory chunk (and an O accumulator)
UNIT = 32                # cache rows a copy: the rows of this step's tokens wait for the PDL wait a unit at a time
WARPS = 8                # two warpgroups, side by side on the MMAs' N
HOPPER = 9
SMEM_LIMIT = 220 * 1024  # of the H200's 227 KB a block may take
# The split's unnormalised partial O in bf16 rather than fp32 (kernels/mla.py allocates part_o in this dtype where this
# kernel runs; m and l stay fp32; FlashInfer's split-KV decode keeps its partial outputs
# in the output dtype too), stored
# a row a warp: half the bytes the split writes and the combine reads (2 MB -> 1 MB a query at 8192 rows). A numerics
# change (the partials rounded to bf16 before the fp32 combine): max |diff| 7.8e-3 against fp32 partials on bf16
# outputs of |out| ~ 1 (one bf16 ulp at 1-2), within the reference tolerance, row invariant, PDL on == off
# (bench/results/kernels-mla-gluon-bf16-h200-20261204.json). H200 step, one process (step-ab-h200-20261204-a.json):
# greedy verify 2.210 / 2.213 ms against 2.221 with fp32 partials, greedy NEXTN 3.146 / 3.147 against 3.172, greedy
# decode level (1.149 / 1.150 against 1.150). Isolated (the split alone, cold, PDL off): 6 queries 11.9 against 13.7 us,
# 1 query level (10.2 against 9.9-10.1); stored in the accumulator's layout bf16 was slower (16.3 us at 6 queries).
# LINGC_MLA_PARTIAL_BF16=0 keeps fp32 partials (the Triton split's)
PARTIAL_BF16 = env_flag("LINGC_MLA_PARTIAL_BF16", True)
# SWAP (LINGC_MLA_GLUON_SWAP=1; off until measured): _mla_split_swap_kernel, the split with its MMAs' operands swapped.
# The default kernel's tile puts (query, head) pairs on the wgmma's M = 64, so a decode step computes 48 dead rows of
# 64 in both MMA chains (~2.4 of its 3.1 us of MMA). Swapped, a query's S^T = K Q^T [128 rows, 16 heads] and each
# O^T chunk = V^T P^T [128 latent, 16 heads] are m64n16k16 chains (two warpgroups stacked on M, N = the heads), the
# softmax reduces over M (across the warpgroups), and P^T goes over the query tile's dead rows as the B operand.
# QPP = SWAP_QPP_MAX queries a program at most, fewer where the step has fewer (swap_queries): every query runs its
# own instructions, the same whatever QPP is or which slot it fills, so decode (QPP 1) and verify (QPP 4) give a
# query the same bits by construction (row invariance). A numerics change against the default kernel (other MMA
# shapes: other fp32 summation inside the tensor core); same partials layout, so the combine is unchanged.
SWAP = env_flag("LINGC_MLA_GLUON_SWAP", False)
SWAP_QPP_MAX = 4


def swap_queries(T: int) -> int:
    """Queries a program of the swapped split takes at T queries a request: the power of two covering T, at most
    SWAP_QPP_MAX (the query tile and P then fit beside the cache rows)."""
    return min(SWAP_QPP_MAX, triton.next_power_of_2(max(T, 1)))


def smem_bytes(r: int, rr: int) -> int:
    """Shared memory of a program: the split's cache rows and the query tile (P reuses the tile), 2-byte values."""
    return (SPLIT + TILE_ROWS) * (r + rr) * 2


def eligible(kv_pages: torch.Tensor, q_rope: torch.Tensor, H: int, R: int, Rr: int, split_rows: int) -> bool:
    """Whether mla_attention's split runs here rather than on kernels/mla.py's Triton kernel (module docstring). T
    does not decide (row invariance: decode and verify must run the same kernel)."""
    if not (ENABLED and HAVE_GLUON and not FAILED and kv_pages.device.type == "cuda"
            and not triton.knobs.runtime.interpret):
        return False
    if kv_pages.dtype != torch.bfloat16 or H != 16 or split_rows != SPLIT:
        return False
    if R % CHUNK or Rr != 64 or smem_bytes(R, Rr) > SMEM_LIMIT:
        return False
    if kv_pages.stride(-1) != 1 or (kv_pages.stride(1) * 2) % 16 or (kv_pages.stride(0) * 2) % 16 \
            or kv_pages.data_ptr() % 16:
        return False
    if q_rope.stride(-1) != 1 or any((st * 2) % 16 for st in q_rope.stride()[:3]) or q_rope.data_ptr() % 16:
        return False                        # cp.async moves 16 B a thread
    return _major(indexed(kv_pages.device)) == HOPPER


if HAVE_GLUON:
    @gluon.jit
    def _tile_last_pos(pos_b, stride_pos_t, t0, T, QPP: gl.constexpr):
        """The largest position of the tile's live queries t0 .. min(t0 + QPP, T) - 1 (scalar loads)."""
        last = gl.load(pos_b + t0 * stride_pos_t, cache_modifier=".cg").to(gl.int32)
        for i in gl.static_range(1, QPP):
            ti = gl.minimum(t0 + i, T - 1)
            last = gl.maximum(last, gl.load(pos_b + ti * stride_pos_t, cache_modifier=".cg").to(gl.int32))
        return last

    @gluon.jit
    def _rows_base(pages_ptr, b, stride_pages_b, stride_page, stride_row, start, end, n: gl.constexpr,
                   PS: gl.constexpr, layout: gl.constexpr):
        """The flat element offsets of cache rows start .. start + n - 1 (page table lookups) and which are < end."""
        rows = start + gl.arange(0, n, layout=layout)
        valid = rows < end
        page = gl.load(pages_ptr + b.to(gl.int64) * stride_pages_b + rows // PS, mask=valid, other=0,
                       cache_modifier=".cg")
        return page.to(gl.int64) * stride_page + (rows % PS) * stride_row, valid

    @gluon.jit
    def _copy_units(kv_lat, kv_rope, kv_ptr, pages_ptr, b, stride_pages_b, stride_page, stride_row, start, end, pos_new,
                    cols, cols_r, R: gl.constexpr, RC: gl.constexpr, CW: gl.constexpr, UNIT: gl.constexpr,
                    SPLIT_N: gl.constexpr, PS: gl.constexpr, LW: gl.constexpr, LR: gl.constexpr, OLD: gl.constexpr):
        """cp.async of the split's UNIT-row units into the same rows of its shared-memory chunks (zeros past `end`):
        OLD, the units whose rows all precede pos_new (written by earlier steps); else the others."""
        for u in gl.static_range(SPLIT_N // UNIT):
            if (start + (u + 1) * UNIT <= pos_new) == OLD:
                first = start + u * UNIT
                base, valid = _rows_base(pages_ptr, b, stride_pages_b, stride_page, stride_row, first, end, UNIT, PS,
                                         gl.SliceLayout(1, LW))
                for c in gl.static_range(RC):
                    async_copy.async_copy_global_to_shared(kv_lat[c].slice(u * UNIT, UNIT),
                                                           kv_ptr + base[:, None] + (c * CW + cols)[None, :],
                                                           mask=valid[:, None])
                base_r, valid_r = _rows_base(pages_ptr, b, stride_pages_b, stride_page, stride_row, first, end, UNIT,
                                             PS, gl.SliceLayout(1, LR))
                async_copy.async_copy_global_to_shared(kv_rope.slice(u * UNIT, UNIT),
                                                       kv_ptr + base_r[:, None] + (R + cols_r)[None, :],
                                                       mask=valid_r[:, None])

    @gluon.jit
    def _split_program(pos_ptr, T, CAP, stride_pos_b, stride_pos_t, QPP: gl.constexpr, SPLIT_N: gl.constexpr):
        """A split program's request b, its first query t0, the request's positions pos_b and its cache rows start ..
        end - 1 (empty past the tile's last visible row). The positions are written at the step's start (many launches
        back): safe before the wait."""
        tile = gl.program_id(0)
        s = gl.program_id(1)
        tiles_t = (T + QPP - 1) // QPP
        b = tile // tiles_t
        t0 = (tile % tiles_t) * QPP
        pos_b = pos_ptr + b.to(gl.int64) * stride_pos_b
        last = _tile_last_pos(pos_b, stride_pos_t, t0, T, QPP)
        start = s * SPLIT_N
        end = gl.minimum(gl.minimum(start + SPLIT_N, last + 1), CAP)
        return b, t0, s, pos_b, start, end

    @gluon.jit
    def _split_smem(dt: gl.constexpr, BM: gl.constexpr, SPLIT_N: gl.constexpr, CW: gl.constexpr, RR: gl.constexpr,
                    RC: gl.constexpr):
        """A split program's shared memory: the cache rows' RC latent chunks and rope part, the query tile's; one
        allocation a chunk (no barrier between the copies into them)."""
        kv_lat = ()
        q_lat = ()
        for c in gl.static_range(RC):
            kv_lat = kv_lat + (gl.allocate_shared_memory(
                dt, [SPLIT_N, CW], gl.NVMMASharedLayout.get_default_for([SPLIT_N, CW], dt)),)
            q_lat = q_lat + (gl.allocate_shared_memory(
                dt, [BM, CW], gl.NVMMASharedLayout.get_default_for([BM, CW], dt)),)
        kv_rope = gl.allocate_shared_memory(dt, [SPLIT_N, RR], gl.NVMMASharedLayout.get_default_for([SPLIT_N, RR], dt))
        q_rope = gl.allocate_shared_memory(dt, [BM, RR], gl.NVMMASharedLayout.get_default_for([BM, RR], dt))
        return kv_lat, q_lat, kv_rope, q_rope

    @gluon.jit
    def _copy_old_units(kv_lat, kv_rope, kv_ptr, pages_ptr, pos_b, b, stride_pages_b, stride_page, stride_row, start,
                        end, R: gl.constexpr, RC: gl.constexpr, CW: gl.constexpr, RR: gl.constexpr,
                        UNIT: gl.constexpr, SPLIT_N: gl.constexpr, PS: gl.constexpr, LW: gl.constexpr,
                        LR: gl.constexpr):
        """Before the wait (module docstring): the split's cache rows that earlier steps wrote (rows past `end` land as
        zeros), UNIT rows a copy, as one commit group; a unit holding a row of this step's tokens (position >= the
        request's first query's, pos_new) is left for _copy_units after the wait, when mla_prep's write of it is
        complete. Returns (cols, cols_r, pos_new) for that call."""
        cols = gl.arange(0, CW, layout=gl.SliceLayout(0, LW))
        cols_r = gl.arange(0, RR, layout=gl.SliceLayout(0, LR))
        pos_new = gl.load(pos_b, cache_modifier=".cg").to(gl.int32)
        _copy_units(kv_lat, kv_rope, kv_ptr, pages_ptr, b, stride_pages_b, stride_page, stride_row, start, end,
                    pos_new, cols, cols_r, R, RC, CW, UNIT, SPLIT_N, PS, LW, LR, True)
        async_copy.commit_group()
        return cols, cols_r, pos_new

    @gluon.jit
    def _copy_query_tile(q_lat, q_rope, qlat_ptr, qrope_ptr, b, t0, T, stride_rb, stride_rt, stride_rh, cols, cols_r,
                         H: gl.constexpr, R: gl.constexpr, RC: gl.constexpr, CW: gl.constexpr, BM: gl.constexpr,
                         LW: gl.constexpr, LR: gl.constexpr, PDL: gl.constexpr):
        """The query tile into shared memory (after the wait: q_absorb's output), every copy landed, then the PDL
        trigger. Row r is query t0 + r // H, head r % H; rows past the chain's end load nothing (their results are
        not stored, and a row's or query's MMA results do not depend on the others)."""
        qr = gl.arange(0, BM, layout=gl.SliceLayout(1, LW))
        live_q = t0 + qr // H < T
        qrow = ((b * T + gl.minimum(t0 + qr // H, T - 1)) * H + qr % H).to(gl.int64) * R
        for c in gl.static_range(RC):
            async_copy.async_copy_global_to_shared(q_lat[c], qlat_ptr + qrow[:, None] + (c * CW + cols)[None, :],
                                                   mask=live_q[:, None])
        qr2 = gl.arange(0, BM, layout=gl.SliceLayout(1, LR))
        rrow = (b.to(gl.int64) * stride_rb + gl.minimum(t0 + qr2 // H, T - 1) * stride_rt + (qr2 % H) * stride_rh)
        async_copy.async_copy_global_to_shared(q_rope, qrope_ptr + rrow[:, None] + cols_r[None, :],
                                               mask=(t0 + qr2 // H < T)[:, None])
        async_copy.commit_group()
        async_copy.wait_group(0)
        fence_async_shared()
        gl.thread_barrier()
        if PDL:
            gluon_gdc_launch_dependents()      # after the last read of the previous kernel's output

    @gluon.jit
    def _mla_split_gluon_kernel(qlat_ptr, qrope_ptr, kv_ptr, pages_ptr, pos_ptr, part_o_ptr, part_ml_ptr,
                                T, S, CAP, qk_scale,
                                stride_rb, stride_rt, stride_rh, stride_page, stride_row, stride_pages_b,
                                stride_pos_b, stride_pos_t,
                                UNIT: gl.constexpr, PS: gl.constexpr, H: gl.constexpr, R: gl.constexpr,
                                RR: gl.constexpr,
                                SPLIT_N: gl.constexpr, CW: gl.constexpr, QPP: gl.constexpr, PDL: gl.constexpr,
                                NW: gl.constexpr):
        """Unnormalised softmax partials (m, l, O) of QPP consecutive queries of one request over split s of
        SPLIT_N cache rows (module docstring); program (request x query tile, split)."""
        BM: gl.constexpr = QPP * H                 # MMA rows: (query, head) pairs
        RC: gl.constexpr = R // CW                 # latent chunks
        WN: gl.constexpr = NW // 4                 # warpgroups, side by side on N
        dt: gl.constexpr = kv_ptr.dtype.element_ty
        b, t0, s, pos_b, start, end = _split_program(pos_ptr, T, CAP, stride_pos_b, stride_pos_t, QPP, SPLIT_N)
        if start < end:
            LW: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NW, 1], [1, 0])    # [*, CW]: 16 B a thread
            LR: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])     # [*, RR]
            a_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WN],
                                                          instr_shape=[16, CW // WN, 16])   # S and O: [BM, CW]
            kv_lat, q_lat, kv_rope, q_rope = _split_smem(dt, BM, SPLIT_N, CW, RR, RC)
            cols, cols_r, pos_new = _copy_old_units(kv_lat, kv_rope, kv_ptr, pages_ptr, pos_b, b, stride_pages_b,
                                                    stride_page, stride_row, start, end, R, RC, CW, RR, UNIT, SPLIT_N,
                                                    PS, LW, LR)
            sr = gl.arange(0, BM, layout=gl.SliceLayout(1, a_l))
            ts = gl.minimum(t0 + sr // H, T - 1)
            end_q = gl.minimum(gl.minimum(start + SPLIT_N, gl.load(pos_b + ts * stride_pos_t, cache_modifier=".cg")
                                          .to(gl.int32) + 1), CAP)             # [BM] a row's visible end
            keep = (t0 + sr // H < T) & (end_q > start)                        # rows whose partial is stored
            if PDL:
                gluon_gdc_wait()
            _copy_units(kv_lat, kv_rope, kv_ptr, pages_ptr, b, stride_pages_b, stride_page, stride_row, start, end,
                        pos_new, cols, cols_r, R, RC, CW, UNIT, SPLIT_N, PS, LW, LR, False)
            _copy_query_tile(q_lat, q_rope, qlat_ptr, qrope_ptr, b, t0, T, stride_rb, stride_rt, stride_rh, cols, cols_r,
                             H, R, RC, CW, BM, LW, LR, PDL)
            # S = Q K^T [BM, SPLIT_N]: one chain in the columns' order (latent 0 .. R-1, then the rope part)
            s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WN],
                                                          instr_shape=[16, SPLIT_N // WN, 16])
            acc = gl.zeros([BM, SPLIT_N], gl.float32, s_l)
            for c in gl.static_range(RC):
                acc = warpgroup_mma(q_lat[c], kv_lat[c].permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma(q_rope, kv_rope.permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[acc])
            n_s = start + gl.arange(0, SPLIT_N, layout=gl.SliceLayout(0, s_l))
            end_s = gl.convert_layout(end_q, gl.SliceLayout(1, s_l))
            x = gl.where(n_s[None, :] < end_s[:, None], acc * qk_scale, float("-inf"))
            m_i = gl.max(x, axis=1)
            m_i = gl.where(m_i == float("-inf"), 0.0, m_i)     # a row that sees none of the split: not stored
            p = gl.exp2(x - m_i[:, None])
            l_i = gl.sum(p, axis=1)
            # P over the query tile's first chunk (both warpgroups' S MMAs have completed: the wait, the barrier)
            gl.thread_barrier()
            q_lat[0].store(p.to(dt))
            fence_async_shared()
            gl.thread_barrier()
            # O = P V [BM, R]: every chunk's MMAs issued, then one wait
            o = ()
            for c in gl.static_range(RC):
                o = o + (warpgroup_mma(q_lat[0], kv_lat[c], gl.zeros([BM, CW], gl.float32, a_l), is_async=True),)
            o = warpgroup_mma_wait(0, deps=o)
            # O in part_o's dtype (bf16 on the launcher's default path), a row's 128 columns by one warp, 4 values a
            # thread: whole rows per store, not the accumulator layout's 8-row strips
            LO: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [NW, 1], [1, 0])                # [BM, CW]
            po = part_o_ptr.dtype.element_ty
            orow = gl.arange(0, BM, layout=gl.SliceLayout(1, LO))
            ocol = gl.arange(0, CW, layout=gl.SliceLayout(0, LO))
            prow_o = ((b * T + gl.minimum(t0 + orow // H, T - 1)) * S + s).to(gl.int64) * H + orow % H
            keep_o = gl.convert_layout(keep, gl.SliceLayout(1, LO))
            for c in gl.static_range(RC):
                gl.store(part_o_ptr + prow_o[:, None] * R + (c * CW + ocol)[None, :],
                         gl.convert_layout(o[c].to(po), LO), mask=keep_o[:, None])
            prow = ((b * T + ts) * S + s).to(gl.int64) * H + sr % H                # partial rows
            m_k = gl.convert_layout(m_i, gl.SliceLayout(1, a_l))
            l_k = gl.convert_layout(l_i, gl.SliceLayout(1, a_l))
            gl.store(part_ml_ptr + prow * 2, m_k, mask=keep)
            gl.store(part_ml_ptr + prow * 2 + 1, l_k, mask=keep)

    @gluon.jit
    def _mla_split_swap_kernel(qlat_ptr, qrope_ptr, kv_ptr, pages_ptr, pos_ptr, part_o_ptr, part_ml_ptr,
                               T, S, CAP, qk_scale,
                               stride_rb, stride_rt, stride_rh, stride_page, stride_row, stride_pages_b,
                               stride_pos_b, stride_pos_t,
                               UNIT: gl.constexpr, PS: gl.constexpr, H: gl.constexpr, R: gl.constexpr,
                               RR: gl.constexpr, SPLIT_N: gl.constexpr, CW: gl.constexpr, QPP: gl.constexpr,
                               PDL: gl.constexpr, NW: gl.constexpr):
        """The split with the operands swapped (SWAP, module docstring): per query, S^T = K Q^T [SPLIT_N, H] and
        O^T = V^T P^T [R, H] as wgmma tiles whose M is the cache rows / latent columns (two warpgroups stacked on M)
        and whose N is the query's H heads, so a decode step computes no dead rows. The same (m, l, O) partials as
        _mla_split_gluon_kernel in the same layout; QPP queries a program, each with its own instructions."""
        BM: gl.constexpr = QPP * H                 # query tile rows: (query, head) pairs
        RC: gl.constexpr = R // CW                 # latent chunks
        dt: gl.constexpr = kv_ptr.dtype.element_ty
        b, t0, s, pos_b, start, end = _split_program(pos_ptr, T, CAP, stride_pos_b, stride_pos_t, QPP, SPLIT_N)
        if start < end:
            LW: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NW, 1], [1, 0])    # [*, CW]: 16 B a thread
            LR: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])     # [*, RR]
            # S^T [SPLIT_N, H] and each O^T chunk [CW, H]: the warpgroups stacked on M, N = the H heads
            t_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                          instr_shape=[16, H, 16])
            kv_lat, q_lat, kv_rope, q_rope = _split_smem(dt, BM, SPLIT_N, CW, RR, RC)
            cols, cols_r, pos_new = _copy_old_units(kv_lat, kv_rope, kv_ptr, pages_ptr, pos_b, b, stride_pages_b,
                                                    stride_page, stride_row, start, end, R, RC, CW, RR, UNIT, SPLIT_N,
                                                    PS, LW, LR)
            if PDL:
                gluon_gdc_wait()
            _copy_units(kv_lat, kv_rope, kv_ptr, pages_ptr, b, stride_pages_b, stride_page, stride_row, start, end,
                        pos_new, cols, cols_r, R, RC, CW, UNIT, SPLIT_N, PS, LW, LR, False)
            _copy_query_tile(q_lat, q_rope, qlat_ptr, qrope_ptr, b, t0, T, stride_rb, stride_rt, stride_rh, cols, cols_r,
                             H, R, RC, CW, BM, LW, LR, PDL)
            # S^T of each query: one chain in the columns' order (latent 0 .. R-1, then the rope part)
            st = ()
            for j in gl.static_range(QPP):
                acc = gl.zeros([SPLIT_N, H], gl.float32, t_l)
                for c in gl.static_range(RC):
                    acc = warpgroup_mma(kv_lat[c], q_lat[c].slice(j * H, H).permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma(kv_rope, q_rope.slice(j * H, H).permute((1, 0)), acc, is_async=True)
                st = st + (acc,)
            st = warpgroup_mma_wait(0, deps=st)
            if QPP == 1:
                st = (st,)
            n_s = start + gl.arange(0, SPLIT_N, layout=gl.SliceLayout(1, t_l))
            hs = gl.arange(0, H, layout=gl.SliceLayout(0, t_l))
            gl.thread_barrier()                    # every warpgroup's MMAs have read the query tile
            ms = ()
            ls = ()
            keeps = ()
            for j in gl.static_range(QPP):
                tj = gl.minimum(t0 + j, T - 1)
                end_j = gl.minimum(gl.minimum(start + SPLIT_N, gl.load(pos_b + tj * stride_pos_t,
                                                                       cache_modifier=".cg").to(gl.int32) + 1), CAP)
                keeps = keeps + ((t0 + j < T) & (end_j > start),)               # whether its partial is stored
                x = gl.where((n_s < end_j)[:, None], st[j] * qk_scale, float("-inf"))
                m_j = gl.max(x, axis=0)
                m_j = gl.where(m_j == float("-inf"), 0.0, m_j)   # a query that sees none of the split: not stored
                p = gl.exp2(x - m_j[None, :])
                ls = ls + (gl.sum(p, axis=0),)
                ms = ms + (m_j,)
                q_lat[0].slice(j * H, H).store(gl.permute(p.to(dt), (1, 0)))     # P [H, SPLIT_N] over dead Q
            fence_async_shared()
            gl.thread_barrier()
            # O^T = V^T P^T: every query's chunks issued, then one wait
            o = ()
            for j in gl.static_range(QPP):
                for c in gl.static_range(RC):
                    o = o + (warpgroup_mma(kv_lat[c].permute((1, 0)), q_lat[0].slice(j * H, H).permute((1, 0)),
                                           gl.zeros([CW, H], gl.float32, t_l), is_async=True),)
            o = warpgroup_mma_wait(0, deps=o)
            # stores: O^T [CW, H] a chunk, the latent columns contiguous (4 a thread, a warp 128 of one head)
            LO: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, NW], [0, 1])               # [CW, H]
            po = part_o_ptr.dtype.element_ty
            ocol = gl.arange(0, CW, layout=gl.SliceLayout(1, LO))
            oh = gl.arange(0, H, layout=gl.SliceLayout(0, LO))
            for j in gl.static_range(QPP):
                tj = gl.minimum(t0 + j, T - 1)
                keep_j = keeps[j]
                prow_o = ((b * T + tj) * S + s).to(gl.int64) * H + oh                  # [H] partial rows
                for c in gl.static_range(RC):
                    gl.store(part_o_ptr + prow_o[None, :] * R + (c * CW + ocol)[:, None],
                             gl.convert_layout(o[j * RC + c].to(po), LO), mask=keep_j)
                prow = ((b * T + tj) * S + s).to(gl.int64) * H + hs
                gl.store(part_ml_ptr + prow * 2, ms[j], mask=keep_j)
                gl.store(part_ml_ptr + prow * 2 + 1, ls[j], mask=keep_j)


def launch(q_lat: torch.Tensor, q_rope: torch.Tensor, kv_pages: torch.Tensor, page_rows: torch.Tensor,
           positions: torch.Tensor, part_o: torch.Tensor, part_ml: torch.Tensor, B: int, T: int, S: int,
           capacity: int, qk_scale: float, pdl: bool) -> bool:
    """kernels/mla.py's split on this path (the caller checked `eligible`; q_lat [M, H, R] and the partials are that
    module's buffers). False, with one warning, where the kernel does not compile: the caller runs the Triton split."""
    H, R = q_lat.shape[1], q_lat.shape[2]
    kernel, qpp = (_mla_split_swap_kernel, swap_queries(T)) if SWAP else (_mla_split_gluon_kernel, TILE_ROWS // H)
    grid = (B * triton.cdiv(T, qpp), S)
    return guarded(lambda: kernel[grid](
        q_lat, q_rope, kv_pages, page_rows, positions, part_o, part_ml, T, S, capacity, qk_scale,
        q_rope.stride(0), q_rope.stride(1), q_rope.stride(2), kv_pages.stride(0), kv_pages.stride(1),
        page_rows.stride(0), positions.stride(0), positions.stride(1),
        UNIT=UNIT, PS=kv_pages.shape[1], H=H, R=R, RR=q_rope.shape[3], SPLIT_N=SPLIT, CW=CHUNK, QPP=qpp, PDL=pdl,
        NW=WARPS,
        num_warps=WARPS, **({"launch_pdl": True} if pdl else {})),
        FAILED, "the Gluon MLA split (kernels/mla_gluon.py)", "the Triton split", "LINGC_MLA_GLUON")
