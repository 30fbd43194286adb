"""Where the pair-grid up-GEMM's fixed cost goes: the production tile with parts of its launch taken away.

bench/kernel_moe_scaling.py fits time = fixed + bytes / rate for moe_up_act_pairs and finds ~2 us more fixed cost a
launch than the dense GEMV over the same bytes (H100, 2026-12-05: 4.8-5.3 against 2.77 us), with no tiling that
lowers it and exiting programs free. This kernel runs kernels/moe.py's own tile code (`_gemm_tile_rows`: the same
swap-AB tile, stages, evict-first weight loads, SwiGLU epilogue) on a grid of working programs only, program
(n-tile, j) = expert j's tile for all T tokens, with its expert found one of two ways:
    ids=True   one scalar load of the expert id after the wait (`experts[j]`): the one dependent round trip left of
               the production prologue (which also loads the [T, k] ids tile, finds the expert's pairs and lets every
               program but the expert's first exit)
    ids=False  no load at all: the experts are base .. base + d - 1 (base a launch argument), expert j = base + j
and its epilogue `swiglu=True` (production) or `False` (the interleaved gate / up columns stored as they are, twice
the output bytes, no exp). Differences between the fits, at the same bytes:
    moe_up_act_pairs - probe(ids)   the pair grid's ids prologue, first-pair test and exits
    probe(ids) - probe(no ids)      the expert id's round trip before the first weight load
    probe - probe(plain)            the SwiGLU epilogue
    probe(plain) - linear           what is left: the tile shape (swap-AB, 64 weight rows) and grid against the dense
                                    GEMV's (kernels/linear.py)
Timing only; on the CPU (the interpreter, tests/test_bench_moe_scaling.py) it is checked against moe_up_act_pairs's
values on the same experts, so a timing is of a kernel that computes the right thing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lingc.kernels.moe import (FP_OPTIONS, MIN_TILE_M, UP_CONFIG, UP_PAIRS_CONFIG, GemmConfig, _gemm_tile_rows,
                               _ieee_dot, _interpreting)
from lingc.kernels.pdl import pdl_supported, pdl_trigger, pdl_wait


@triton.jit
def _up_probe_kernel(x_ptr, w_ptr, out_ptr, experts_ptr, base, T, N, K, stride_am, stride_we, stride_wn, stride_om,
                     TILE_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                     SWIGLU: tl.constexpr, IEEE_DOT: tl.constexpr, LIBDEVICE_EXP: tl.constexpr, PDL: tl.constexpr,
                     SWAP_AB: tl.constexpr, IDS: tl.constexpr):
    """Program (n, j): expert j's N-tile n for tokens 0 .. T-1, stored at rows j * T + t (x is repeated per expert,
    so row p of x is token p % T's, and pair p reads row p: TOP_K = 1)."""
    pid_n = tl.program_id(0)
    j = tl.program_id(1)
    if PDL:
        pdl_wait()
    if IDS:
        expert = tl.load(experts_ptr + j).to(tl.int64)
    else:
        expert = (base + j).to(tl.int64)
    r = tl.arange(0, TILE_M)
    num_pairs = tl.num_programs(1) * T
    pairs = tl.where(r < T, j * T + r, num_pairs)
    _gemm_tile_rows(x_ptr, w_ptr, out_ptr, expert, pairs, pid_n, num_pairs, N, K, stride_am, stride_we, stride_wn,
                    stride_om, 0.0, 1, TILE_M, BLOCK_N, BLOCK_K, EVEN_K, SWIGLU, False, IEEE_DOT, LIBDEVICE_EXP,
                    False, (), 0, SWAP_AB)
    if PDL:
        pdl_trigger()


def up_probe(x: torch.Tensor, w13_interleaved: torch.Tensor, experts: torch.Tensor, base: int, *, ids: bool = True,
             swiglu: bool = True, pdl: bool = False, config: GemmConfig | None = None) -> torch.Tensor:
    """x [T, h] (T <= 16) times the interleaved w13 of d experts -> [d * T, I] (swiglu) or [d * T, 2I]: row j * T + t
    is token t through expert experts[j] (ids=True) or base + j (ids=False; the caller keeps the two the same)."""
    T, K = x.shape
    d = experts.numel()
    n = w13_interleaved.shape[1]
    if T > MIN_TILE_M:
        raise ValueError(f"up_probe: {T} tokens, at most {MIN_TILE_M}")
    if config is None:
        config = UP_CONFIG if _ieee_dot(x) else UP_PAIRS_CONFIG
    out = torch.empty((d * T, n // 2 if swiglu else n), dtype=x.dtype, device=x.device)
    xs = x.repeat(d, 1)
    pdl = pdl and pdl_supported(x.device)
    interpret = _interpreting()
    _up_probe_kernel[(triton.cdiv(n, config.block_n), d)](
        xs, w13_interleaved, out, experts, base, T, n, K, xs.stride(0), w13_interleaved.stride(0),
        w13_interleaved.stride(1), out.stride(0), TILE_M=MIN_TILE_M, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        EVEN_K=K % config.block_k == 0, SWIGLU=swiglu, IEEE_DOT=_ieee_dot(x),
        LIBDEVICE_EXP=x.is_cuda and not interpret, PDL=pdl, SWAP_AB=config.swap_ab and not _ieee_dot(x), IDS=ids,
        num_warps=config.num_warps, num_stages=config.num_stages, **FP_OPTIONS,
        **({"launch_pdl": True} if pdl else {}))
    return out
