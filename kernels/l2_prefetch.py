"""L2 prefetch of a weight ahead of the kernel that reads it: a hint kernel that uses HBM while the step's chain idles.

At batch 1 a layer's chain alternates between weight streams (the projections, the MoE GEMMs) and kernels that read
almost nothing from HBM (the router, the MoE down-GEMM's post-wait part, the norms, the KDA recurrence). A weight
stream's kernel can only start reading after its PDL wait, so each pays its ramp (the first bytes ~1 us after the
wait) on the critical path, and the HBM idles through the small kernels before it. `l2_prefetch` asks L2 for a byte
range of a weight (written by no kernel: no ordering question) from a launch placed earlier in the chain, so that the
weight's later reader finds part of it in L2.

Kernel: grid (P,), THREADS threads a program, one contiguous CHUNK-byte piece a thread:
    BULK:     cp.async.bulk.prefetch.L2.global [addr], size      (sm_90's TMA unit; one instruction a piece)
    not BULK: prefetch.global.L2 [addr + j * 128] for each 128 B line of the piece
It is a hint: nothing waits for it and nothing reads its result, so a prefetch that L2 drops costs only bandwidth.

l2_prefetch_experts (a router's picks, read on the device): the same grid over the ids' NP x PIECES pieces, piece i
the bytes [p * CHUNK, min((p + 1) * CHUNK, nbytes)) of expert ids[i // PIECES] (p = i % PIECES), CHUNK about one
16 B-rounded piece a thread, so a piece never spans two experts; one bulk prefetch a thread a step, never PDL.

l2_prefetch_pages (MLA's paged latent cache, read on the device: the page table and the positions): grid (P, B); a
request's pieces are its MP pages x PIECES, CHUNK sized for the capacity as the experts kernel sizes it, and the
pieces past its visible pages (0 .. max_t positions[b, t] // PS) prefetch nothing. The split reads those rows ~5 us
later (prefetch_weights' MLA_CACHE places the hint), when only 64 CTAs (a split each) stream them at 8192 rows; on an
H100 it then ran ~1 us a layer faster, but the kernels beside the prefetch slower: level or worse in the step, off
(passes/prefetch_weights.py).

How it runs in a step: the runtime launches it on a side stream that forks after the launches before it and joins at
the graph's end (runtime/executor.py), never PDL-launched: a grid that issued prefetches stays alive until they land
(on the H200 its time was the prefetch's transfer time), so on the chain's stream it would hold up the next launch's
wait. PDL (a launcher option, for probes): trigger at entry, prefetch, then gdc_wait, so that the grid's completion
still implies its predecessor's. The interpreter and CPU tensors run nothing (a hint has no CPU meaning).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lingc.knobs import env_flag
from lingc.kernels.pdl import pdl_launch_next, pdl_supported
from lingc.ops.prefetch import clip

THREADS = 128      # threads a program (4 warps), one piece each
PROGRAMS = 132     # programs (one an SM on the H200)
LINE = 128         # L2 line bytes (the non-bulk path's step)
ALIGN = 16         # cp.async.bulk.prefetch wants 16 B aligned addresses and sizes
# the prefetched lines' L2 eviction priority: False normal (default), True evict_last (createpolicy + .L2::cache_hint;
# prefetch.global.L2::evict_last on the per-line path), so the lines outlive the weight streams between the hint and
# the weight's reader. A bench A/B knob (LINGC_PREFETCH_EVICT_LAST=1); measured slower than normal priority on an
# H100 (greedy decode 1.3934 vs 1.3664 ms with the hints, bench/results/step-ab-prefetch-h100-20261205.json)
EVICT_LAST = env_flag("LINGC_PREFETCH_EVICT_LAST", False)
# l2_prefetch_experts skips an id that an earlier slot holds too (a verify chain's tokens share experts, and every
# token holds the fused shared expert) where the ids are at most this many: a [THREADS, 64] compare a step
DEDUPE_MAX_PAIRS = 64


@triton.jit
def _bulk_prefetch(addr, size, EVICT_LAST: tl.constexpr):
    """One cp.async.bulk.prefetch.L2 of `size` bytes at addr where size > 0 (EVICT_LAST: with an evict_last policy)."""
    if EVICT_LAST:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b64 pol; setp.gt.s32 p, $2, 0; "
            "createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
            "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; mov.u32 $0, 0; }",
            "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _l2_prefetch_kernel(ptr, nbytes, CHUNK: tl.constexpr, THREADS: tl.constexpr, BULK: tl.constexpr,
                        PDL: tl.constexpr, EVICT_LAST: tl.constexpr = False):
    if PDL:
        pdl_launch_next()
    piece = (tl.program_id(0) * THREADS + tl.arange(0, THREADS)).to(tl.int64) * CHUNK       # [THREADS] byte offsets
    size = tl.minimum(nbytes - piece, CHUNK).to(tl.int32)                                     # <= 0 past the end
    addr = ptr + piece
    if BULK:
        _bulk_prefetch(addr, size, EVICT_LAST)
    else:
        for j in tl.static_range(0, CHUNK, 128):
            if EVICT_LAST:
                tl.inline_asm_elementwise(
                    "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
                    "=r,l,r", [addr + j, size - j], dtype=tl.int32, is_pure=False, pack=1)
            else:
                tl.inline_asm_elementwise(
                    "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                    "=r,l,r", [addr + j, size - j], dtype=tl.int32, is_pure=False, pack=1)
    if PDL:
        tl.extra.cuda.gdc_wait()       # not pdl_wait: the dependents were let launch at entry already


def chunk_bytes(nbytes: int, programs: int = PROGRAMS, threads: int = THREADS) -> int:
    """Bytes a thread prefetches: the range over programs * threads pieces, rounded up to ALIGN."""
    per = -(-nbytes // (programs * threads))
    return -(-per // ALIGN) * ALIGN


def l2_prefetch(weight: torch.Tensor, start: int = 0, nbytes: int = -1, *, pdl: bool = False,
                bulk: bool = True, programs: int = PROGRAMS, evict_last: bool | None = None) -> None:
    """Ask L2 for bytes [start, start + nbytes) of weight's storage (contiguous), clipped to it (nbytes -1: to the
    end; lingc/ops/prefetch.py `clip`). evict_last None: the module's EVICT_LAST. A no-op off CUDA and under the
    interpreter."""
    if weight.device.type != "cuda" or triton.knobs.runtime.interpret:
        return
    if not weight.is_contiguous():
        raise ValueError(f"l2_prefetch: weight {list(weight.shape)} is not contiguous")
    start, nbytes = clip(weight.numel() * weight.element_size(), start, nbytes)
    start -= start % ALIGN                              # whole 16 B pieces (a hint may round outward)
    if nbytes <= 0:
        return
    raw = weight.reshape(-1).view(torch.uint8)[start:]
    chunk = chunk_bytes(nbytes, programs)
    grid = (min(programs, -(-nbytes // (chunk * THREADS))),)
    launch = {"launch_pdl": True} if pdl and pdl_supported(weight.device) else {}
    _l2_prefetch_kernel[grid](raw, nbytes, CHUNK=chunk, THREADS=THREADS, BULK=bulk and raw.data_ptr() % ALIGN == 0,
                              PDL=bool(launch), EVICT_LAST=EVICT_LAST if evict_last is None else evict_last,
                              num_warps=THREADS // 32, **launch)


@triton.jit
def _item_piece(base_ptr, rec, ok, item_offset, off, item_bytes, CHUNK: tl.constexpr, EVICT_LAST: tl.constexpr,
                RECORD: tl.constexpr):
    """One piece a thread of the item-wise kernels (an expert, a cache page): bytes [off, min(off + CHUNK, item_bytes))
    of the item at byte item_offset from base_ptr, nothing where not ok; RECORD: its (offset, size) stored at rec
    (int64 pairs) instead of prefetched."""
    size = tl.where(ok, tl.minimum(item_bytes - off, CHUNK), 0).to(tl.int32)
    rel = tl.where(ok, item_offset + off, 0)
    if RECORD:
        tl.store(rec, rel)
        tl.store(rec + 1, size.to(tl.int64))
    else:
        _bulk_prefetch(base_ptr + rel, size, EVICT_LAST)


@triton.jit
def _l2_prefetch_experts_kernel(w_ptr, ids_ptr, rec_ptr, NP, E, expert_bytes, nbytes, CHUNK: tl.constexpr,
                                PIECES: tl.constexpr, THREADS: tl.constexpr, ITERS: tl.constexpr,
                                EVICT_LAST: tl.constexpr = False, DEDUPE: tl.constexpr = False,
                                NP_POW2: tl.constexpr = 1, RECORD: tl.constexpr = False):
    """Piece i of the NP * PIECES: id j = i // PIECES, bytes [p * CHUNK, min((p + 1) * CHUNK, nbytes)) of expert
    ids[j] (p = i % PIECES), one cp.async.bulk.prefetch.L2 a thread a step; an id outside [0, E) prefetches nothing,
    nor (DEDUPE: NP <= NP_POW2, a [THREADS, NP_POW2] compare) an id that an earlier j holds too. RECORD (tests, the
    interpreter): store each thread's (byte offset from w_ptr, size) at rec_ptr (int64) instead of prefetching; the
    launcher passes ids_ptr there, never written."""
    first = (tl.program_id(0) * THREADS + tl.arange(0, THREADS)).to(tl.int64)
    if DEDUPE:
        every = tl.arange(0, NP_POW2)
        all_ids = tl.load(ids_ptr + every, mask=every < NP, other=-1).to(tl.int64)
    for it in tl.static_range(ITERS):
        i = first + it * tl.num_programs(0) * THREADS
        live = i < NP * PIECES
        j = i // PIECES
        e = tl.load(ids_ptr + j, mask=live, other=-1).to(tl.int64)
        off = (i % PIECES) * CHUNK
        ok = live & (e >= 0) & (e < E)
        if DEDUPE:
            seen = (all_ids[None, :] == e[:, None]) & (every[None, :] < j[:, None])          # [THREADS, NP_POW2]
            ok = ok & (tl.sum(seen.to(tl.int32), axis=1) == 0)
        _item_piece(w_ptr, rec_ptr + i * 2, ok, e * expert_bytes, off, nbytes, CHUNK, EVICT_LAST, RECORD)


def expert_pieces(pairs: int, nbytes: int, programs: int = PROGRAMS, threads: int = THREADS) -> tuple[int, int]:
    """(CHUNK, PIECES) for `pairs` ids of `nbytes` each: about one ALIGN-rounded piece a thread, PIECES * CHUNK >=
    nbytes (a piece never spans two experts)."""
    chunk = chunk_bytes(pairs * nbytes, programs, threads)
    return chunk, -(-nbytes // chunk)


def l2_prefetch_experts(weight: torch.Tensor, ids: torch.Tensor, nbytes: int = -1, *,
                        programs: int = PROGRAMS, evict_last: bool | None = None) -> None:
    """Ask L2 for the first nbytes (-1: all) of weight[e] for each id e in ids (int, on weight's device; ids outside
    [0, E) are skipped, and so is a repeated id where there are at most DEDUPE_MAX_PAIRS). A no-op off CUDA, under the
    interpreter, and where weight's storage or expert stride is not 16 B aligned (cp.async.bulk.prefetch's rule; a
    hint may do nothing)."""
    if weight.device.type != "cuda" or triton.knobs.runtime.interpret or ids.numel() == 0:
        return
    if not weight.is_contiguous() or ids.device != weight.device or ids.is_floating_point():
        raise ValueError(f"l2_prefetch_experts: want a contiguous weight and integer ids on its device, got "
                         f"{list(weight.shape)} contiguous={weight.is_contiguous()}, ids {ids.dtype} on {ids.device}")
    expert_bytes = weight.stride(0) * weight.element_size()
    _, nbytes = clip(expert_bytes, 0, nbytes)
    nbytes -= nbytes % ALIGN
    if nbytes <= 0 or expert_bytes % ALIGN or weight.data_ptr() % ALIGN:
        return
    pairs = ids.numel()
    chunk, pieces = expert_pieces(pairs, nbytes, programs)
    grid = (min(programs, -(-pairs * pieces // THREADS)),)
    flat = ids.reshape(-1)
    _l2_prefetch_experts_kernel[grid](
        weight.reshape(-1).view(torch.uint8), flat, flat, pairs, weight.shape[0], expert_bytes, nbytes,
        CHUNK=chunk, PIECES=pieces, THREADS=THREADS, ITERS=-(-pairs * pieces // (grid[0] * THREADS)),
        EVICT_LAST=EVICT_LAST if evict_last is None else evict_last, DEDUPE=pairs <= DEDUPE_MAX_PAIRS,
        NP_POW2=triton.next_power_of_2(pairs) if pairs <= DEDUPE_MAX_PAIRS else 1, num_warps=THREADS // 32)


@triton.jit
def _l2_prefetch_pages_kernel(pages_ptr, rows_ptr, pos_ptr, rec_ptr, T, MP, PS, NUM_PAGES, page_bytes, stride_page,
                              stride_rb, stride_pb, CHUNK: tl.constexpr, PIECES: tl.constexpr, THREADS: tl.constexpr,
                              ITERS: tl.constexpr, T_POW2: tl.constexpr, EVICT_LAST: tl.constexpr = False,
                              RECORD: tl.constexpr = False):
    """Request b = program_id(1): its visible pages j = 0 .. max_t positions[b, t] // PS (none where no position is
    >= 0), piece i of the MP * PIECES the bytes [p * CHUNK, min((p + 1) * CHUNK, page_bytes)) of page page_rows[b, i //
    PIECES] (p = i % PIECES), one cp.async.bulk.prefetch.L2 a thread a step; a page id outside [0, NUM_PAGES)
    prefetches nothing. RECORD (tests, the interpreter): each thread's (byte offset from pages_ptr, size) stored at
    rec_ptr [B, ITERS * P * THREADS, 2] instead."""
    b = tl.program_id(1)
    offs_t = tl.arange(0, T_POW2)
    pos = tl.max(tl.load(pos_ptr + b * stride_pb + offs_t, mask=offs_t < T, other=-1), axis=0).to(tl.int64)
    visible = tl.where(pos >= 0, tl.minimum(pos // PS + 1, MP), 0)
    first = (tl.program_id(0) * THREADS + tl.arange(0, THREADS)).to(tl.int64)
    for it in tl.static_range(ITERS):
        i = first + it * tl.num_programs(0) * THREADS
        j = i // PIECES
        live = j < visible
        page = tl.load(rows_ptr + b * stride_rb + j, mask=live, other=-1).to(tl.int64)
        ok = live & (page >= 0) & (page < NUM_PAGES)
        off = (i % PIECES) * CHUNK
        slot = (b * ITERS * tl.num_programs(0) * THREADS + i) * 2
        _item_piece(pages_ptr, rec_ptr + slot, ok, page * stride_page, off, page_bytes, CHUNK, EVICT_LAST, RECORD)


def page_pieces(pages: int, page_bytes: int, programs: int = PROGRAMS, threads: int = THREADS) -> tuple[int, int]:
    """(CHUNK, PIECES) for up to `pages` pages of page_bytes: as expert_pieces (a piece never spans two pages)."""
    return expert_pieces(pages, page_bytes, programs, threads)


def l2_prefetch_pages(kv_pages: torch.Tensor, page_rows: torch.Tensor, positions: torch.Tensor, *,
                      programs: int = PROGRAMS, evict_last: bool | None = None) -> None:
    """Ask L2 for every page request b's queries see: page_rows[b, j] for j <= max_t positions[b, t] // PS (the
    page table and positions read on the device). A no-op off CUDA, under the interpreter, and where a page is not a
    whole number of 16 B pieces at a 16 B aligned address (cp.async.bulk.prefetch's rule; a hint may do nothing)."""
    if kv_pages.dim() < 2 or page_rows.dim() != 2 or positions.dim() != 2 or positions.shape[0] != page_rows.shape[0] \
            or page_rows.is_floating_point() or positions.is_floating_point():
        raise ValueError(f"l2_prefetch_pages: want kv_pages [NP, PS, ...], integer page_rows [B, MP] and positions "
                         f"[B, T], got {list(kv_pages.shape)}, {list(page_rows.shape)} {page_rows.dtype}, "
                         f"{list(positions.shape)} {positions.dtype}")
    if kv_pages.device.type != "cuda" or triton.knobs.runtime.interpret or page_rows.numel() == 0:
        return
    elem = kv_pages.element_size()
    page_bytes = kv_pages[0].numel() * elem
    stride_page = kv_pages.stride(0) * elem
    if not kv_pages.is_contiguous() or page_bytes % ALIGN or kv_pages.data_ptr() % ALIGN:
        return
    B, MP = page_rows.shape
    T = positions.shape[1]
    chunk, pieces = page_pieces(MP, page_bytes, programs)
    grid = (min(programs, -(-MP * pieces // THREADS)), B)
    _l2_prefetch_pages_kernel[grid](
        kv_pages.view(-1).view(torch.uint8), page_rows, positions, page_rows,
        T, MP, kv_pages.shape[1], kv_pages.shape[0], page_bytes, stride_page, page_rows.stride(0), positions.stride(0),
        CHUNK=chunk, PIECES=pieces, THREADS=THREADS, ITERS=-(-MP * pieces // (grid[0] * THREADS)),
        T_POW2=triton.next_power_of_2(max(T, 1)), EVICT_LAST=EVICT_LAST if evict_last is None else evict_last,
        num_warps=THREADS // 32)


def _lower(weight: torch.Tensor, start: int, nbytes: int, *, pdl: bool = False) -> None:
    l2_prefetch(weight, start, nbytes, pdl=pdl)


def _lower_experts(weight: torch.Tensor, ids: torch.Tensor, nbytes: int, *, pdl: bool = False) -> None:
    l2_prefetch_experts(weight, ids, nbytes)            # a side-stream hint: never PDL-launched


def _lower_pages(kv_pages: torch.Tensor, page_rows: torch.Tensor, positions: torch.Tensor, *,
                 pdl: bool = False) -> None:
    l2_prefetch_pages(kv_pages, page_rows, positions)   # a side-stream hint: never PDL-launched


LOWERINGS = {"l2_prefetch": _lower, "l2_prefetch_experts": _lower_experts, "l2_prefetch_pages": _lower_pages}
