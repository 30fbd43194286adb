"""The whole routed MoE of a layer in ONE persistent launch: moe_up_act -> moe_down -> moe_combine, same bits.

Why: at batch 1 a MoE layer's three launches (Ling-3.0-tiny decode on the H200: 9.4 + 6.3 + 1.3 us for 42 MB of
expert weights, a 10 us floor) each pay a ramp, a tail and a launch; the down-GEMM cannot start streaming its
weights until the last up tile is done, and the combine waits for the last down tile. One launch lets a program
go on to down tiles as soon as the block it needs is ready, so the weight stream does not stop between the two
GEMMs, and the combine of a column strip runs on the program that finishes its last down tile.

    moe_fused(x [N, h], w13_interleaved [E, 2I, h], w2 [E, h, I], topk_weights [N, k], sorted_pairs, block_expert,
              total, top_k, block_m, limit, shared_out [N, h] | None) -> [N, h]
    == moe_combine(moe_down(moe_up_act(x, w13_interleaved, ..., limit), w2, ...), topk_weights, shared_out)

Schedule: a persistent grid of P programs (P = SMs x CTAS_PER_SM, capped by the occupancy of the compiled kernel,
so every program is resident at once: programs wait on each other). Tiles are dealt round-robin (t = pid, pid + P,
...), block-major so the first blocks finish first:
  1. up tiles (block b, N-tile j of 2I): kernels/moe.py's `_gemm_tile` with the SwiGLU epilogue, stored in the
     act workspace [NP, I]; then a CTA barrier and a release increment of up_count[b].
  2. down tiles (block b, N-tile j of h): spin until up_count[b] (acquire) says all of b's up tiles are stored,
     then `_gemm_tile` on act (loaded .cg: other programs wrote it) into the down workspace [NP, h]; a CTA
     barrier and an acq_rel ticket on down_count[j]. The program drawing the last ticket (every in-use block has
     stored strip j) runs moe_combine's row code (`_combine_row`, expert rows loaded .cg) for every token on
     strip j's columns.
  3. a final acq_rel ticket on `done`: the last program out zeroes the counters for the next launch (or graph
     replay). The counters live in a per-device workspace, zeroed once (like kernels/linear.py's split-K).
DOWN_PRELOAD (LINGC_MOE_FUSED_PRELOAD, on by default; where K = I fits PRELOAD_MAX_K and there are at most
PRELOAD_MAX_PAIRS pairs, as for moe.py's down-GEMM): a down tile's weights depend
only on its block's expert, known after the kernel's wait, so the program loads the whole [I, 32] weight tile into
registers (moe.py's `_preload_tile`: the same chunks, the same order of dots, the same bits) BEFORE it spins on its
block's up tiles, and the down tiles are dealt from the last program backwards (tile t to program P - 1 - t mod P).
At decode (9 blocks: 288 up tiles, 432 down tiles, P = 4 programs per SM = 528) the 240 programs that have no up
tile then stream their down tiles while the up tiles stream, instead of after them. Without it the down weights
(14 MB of the layer's 42) streamed only once the up tiles were done. H200, one call (bench/results/
step-ab-h200-20261201-c.json, call 61): the decode step with fuse_moe 1.293 -> 1.277 ms, but verify (54 pairs)
2.782 -> 2.800, hence the pair limit; the three kernels (fuse_moe off, the default) ran 1.233 / 2.582 in that call,
so fuse_moe stays opt-in. Same bits as the three kernels with and without the preload, at 1 and 6 tokens.
Every tile runs the unfused kernels' tile code with their tile shapes (UP_CONFIG / DOWN_CONFIG, the same warps),
and the combine is elementwise per column, so the output has the unfused chain's bits (tests: interpreter; the
bench: the H200). Under the Triton interpreter programs run one after another, so P = 1 there (one program does
every tile in order, and each wait is already met).

Deadlock freedom: a program waits only for up tiles, and every program does all of its up tiles before its first
wait, so waits end as long as all P programs run at once, which P's occupancy cap guarantees (the launch of the
next kernel under PDL cannot take their slots: it is triggered only after every program has passed its wait).
A spin has no bound: if a program faulted, the launch would hang rather than return wrong numbers.

PDL: nothing is loaded before `pdl_wait()` (the experts come from block_expert); the late trigger is at the end.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from lingc.knobs import env_flag
from lingc.kernels.moe import (COMBINE_ORDER, DOWN_CONFIG, FP_OPTIONS, MIN_TILE_M, SEQUENTIAL, UP_CONFIG, _check_align,
                               _combine_row, _float_dtype, _gemm_tile, _interpreting, _out, _preload_tile,
                               preload_chunks)
from lingc.kernels import workspace
from lingc.kernels.pdl import pdl_supported, pdl_trigger, pdl_wait

CTAS_PER_SM = 4               # programs per SM at most (the weight stream wants several tiles in flight per SM)
DOWN_PRELOAD = env_flag("LINGC_MOE_FUSED_PRELOAD", True)   # module docstring; 0 for the A/B
WORKSPACE_COUNTERS = 1 << 14  # int32 counters per device: up_count[blocks] + down_count[h strips] + done


@triton.jit
def _moe_fused_kernel(x_ptr, w13_ptr, w2_ptr, act_ptr, down_ptr, out_ptr, tw_ptr, s_ptr,
                      sorted_ptr, block_expert_ptr, total_ptr, up_count_ptr, down_count_ptr, done_ptr,
                      num_pairs, N_TOKENS, N13, H, K_UP, K_DOWN, stride_xm, stride_w13e, stride_w13n,
                      stride_w2e, stride_w2n, stride_act, stride_down, stride_tw, stride_s, stride_o, limit,
                      TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, TILE_M: tl.constexpr,
                      UP_BN: tl.constexpr, UP_BK: tl.constexpr, DOWN_BN: tl.constexpr, DOWN_BK: tl.constexpr,
                      EVEN_UP: tl.constexpr, EVEN_DOWN: tl.constexpr, HAS_LIMIT: tl.constexpr,
                      IEEE_DOT: tl.constexpr, LIBDEVICE_EXP: tl.constexpr, ORDER: tl.constexpr,
                      HAS_SHARED: tl.constexpr, PDL: tl.constexpr, DOWN_CHUNKS: tl.constexpr = 0):
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    if PDL:
        pdl_wait()
    blocks = tl.load(total_ptr) // BLOCK_M                    # blocks in use (total is padded to BM)
    up_strips = tl.cdiv(N13, UP_BN)
    down_strips = tl.cdiv(H, DOWN_BN)
    for t in range(pid, blocks * up_strips, progs):
        b = t // up_strips
        _gemm_tile(x_ptr, w13_ptr, act_ptr, sorted_ptr, block_expert_ptr, b, t % up_strips, num_pairs, N13, K_UP,
                   stride_xm, stride_w13e, stride_w13n, stride_act, limit, TOP_K, BLOCK_M, TILE_M, UP_BN, UP_BK,
                   EVEN_UP, True, HAS_LIMIT, IEEE_DOT, LIBDEVICE_EXP, False, (), 0)
        tl.debug_barrier()                                    # every thread's act stores precede the release
        tl.atomic_add(up_count_ptr + b, 1, sem="release", scope="gpu")
    first_down = pid if DOWN_CHUNKS == 0 else progs - 1 - pid     # DOWN_PRELOAD: dealt from the last program back
    for t in range(first_down, blocks * down_strips, progs):
        b = t // down_strips
        j = t % down_strips
        ws = ()
        if DOWN_CHUNKS > 0:   # the weight tile needs only the block's expert: load it before waiting on the up tiles
            ws = _preload_tile(w2_ptr, block_expert_ptr, b, j, H, K_DOWN, stride_w2e, stride_w2n, DOWN_BN, DOWN_BK,
                               DOWN_CHUNKS)
        while tl.atomic_add(up_count_ptr + b, 0, sem="acquire", scope="gpu") < up_strips:
            pass
        _gemm_tile(act_ptr, w2_ptr, down_ptr, sorted_ptr, block_expert_ptr, b, j, num_pairs, H, K_DOWN,
                   stride_act, stride_w2e, stride_w2n, stride_down, 0.0, 1, BLOCK_M, TILE_M, DOWN_BN, DOWN_BK,
                   EVEN_DOWN, False, False, IEEE_DOT, LIBDEVICE_EXP, True, ws, DOWN_CHUNKS)
        tl.debug_barrier()
        ticket = tl.atomic_add(down_count_ptr + j, 1, sem="acq_rel", scope="gpu")
        if ticket == blocks - 1:                              # strip j of every block is stored: combine it
            cols = j * DOWN_BN + tl.arange(0, DOWN_BN)
            for n in range(0, N_TOKENS):
                _combine_row(down_ptr, tw_ptr, tw_ptr, s_ptr, out_ptr, n, cols, cols < H,
                             stride_down, stride_tw, 0, stride_s, stride_o, TOP_K, ORDER, HAS_SHARED, False,
                             True, False)
    tl.debug_barrier()
    if tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu") == progs - 1:   # last out: reset for the next launch
        for i in range(0, blocks):
            tl.store(up_count_ptr + i, 0)
        for i in range(0, down_strips):
            tl.store(down_count_ptr + i, 0)
        tl.store(done_ptr, 0)
    if PDL:
        pdl_trigger()


def device_counters(device: torch.device | str) -> torch.Tensor:
    """The device's zeroed counter workspace (kernels/workspace.py), created on first use and kept (captured graphs
    point at it). Every launch leaves it zero; launches that may run concurrently on one device would need one each."""
    return workspace.counters(device, "moe_fused", WORKSPACE_COUNTERS)


@functools.lru_cache(maxsize=None)
def _resident_programs(device: torch.device, n_regs: int, shared: int, num_warps: int, per_sm: int) -> int:
    """Programs that are surely resident at once: SMs x min(per_sm, what registers / shared memory / warps allow)."""
    props = torch.cuda.get_device_properties(device)
    regs_per_cta = -(-max(n_regs, 1) * 32 // 256) * 256 * num_warps           # allocated per warp in 256s
    smem_per_sm = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    regs_per_sm = getattr(props, "regs_per_multiprocessor", 65536)
    warps_per_sm = getattr(props, "max_threads_per_multi_processor", 2048) // 32
    fits = min(per_sm, regs_per_sm // regs_per_cta, warps_per_sm // num_warps,
               smem_per_sm // (shared + 1024) if shared else per_sm)
    if fits < 1:
        raise RuntimeError(f"moe_fused: one program ({n_regs} registers x {num_warps} warps, {shared} B shared) "
                           f"does not fit an SM of {props.name}")
    return props.multi_processor_count * fits


def moe_fused(x: torch.Tensor, w13_interleaved: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              sorted_pairs: torch.Tensor, block_expert: torch.Tensor, total: torch.Tensor, top_k: int, block_m: int,
              limit: float, shared_out: torch.Tensor | None = None, *, pdl: bool = False,
              programs: int | None = None, per_sm: int = CTAS_PER_SM, preload: bool | None = None) -> torch.Tensor:
    """moe_up_act -> moe_down -> moe_combine in one persistent launch, bit-identical to the three (module doc).

    `preload` (default DOWN_PRELOAD): the down tiles' weights into registers before their wait, at <= PRELOAD_MAX_PAIRS
    pairs (module doc).
    `programs` overrides the persistent grid size (tests; on the GPU it must not exceed what is resident at once);
    `per_sm` caps the programs per SM (bench sweeps; the occupancy of the compiled kernel caps it too).
    """
    op = "moe_fused"
    _float_dtype(x, op, "x")
    if x.dim() != 2 or w13_interleaved.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"{op}: x {list(x.shape)}, w13 {list(w13_interleaved.shape)}, w2 {list(w2.shape)}: "
                         "want [N, h], [E, 2I, h], [E, h, I]")
    n_tokens, h = x.shape
    num_experts, n13, k_up = w13_interleaved.shape
    if (k_up != h or w2.shape[0] != num_experts or w2.shape[1] != h or w2.shape[2] * 2 != n13
            or {w13_interleaved.dtype, w2.dtype} != {x.dtype}):
        raise ValueError(f"{op}: x {list(x.shape)} {x.dtype}, w13 {list(w13_interleaved.shape)} "
                         f"{w13_interleaved.dtype}, w2 {list(w2.shape)} {w2.dtype}: want [N, h], [E, 2I, h], "
                         "[E, h, I] of one dtype")
    if topk_weights.shape != (n_tokens, top_k) or topk_weights.dtype != torch.float32:
        raise ValueError(f"{op}: topk_weights is {list(topk_weights.shape)} {topk_weights.dtype}, "
                         f"want [{n_tokens}, {top_k}] float32")
    if shared_out is not None and (shared_out.shape != (n_tokens, h) or shared_out.dtype != x.dtype):
        raise ValueError(f"{op}: shared_out is {list(shared_out.shape)} {shared_out.dtype}, want [{n_tokens}, {h}] "
                         f"{x.dtype}")
    num_pairs = n_tokens * top_k
    _check_align(op, sorted_pairs, block_expert, total, num_pairs, num_experts, block_m)
    out = _out(op, None, (n_tokens, h), x)
    if num_pairs == 0 or h == 0:
        return out
    inter = n13 // 2
    x = x if x.stride(1) == 1 else x.contiguous()
    tw = topk_weights if topk_weights.stride(1) == 1 else topk_weights.contiguous()
    shared = out if shared_out is None else (shared_out if shared_out.stride(1) == 1 else shared_out.contiguous())
    for name, w in (("w13_interleaved", w13_interleaved), ("w2", w2)):
        if w.stride(2) != 1:
            raise ValueError(f"{op}: {name} must be contiguous along K (stride {w.stride()})")
    up, down = UP_CONFIG, DOWN_CONFIG
    preload = DOWN_PRELOAD if preload is None else preload
    if up.num_warps != down.num_warps:
        raise ValueError(f"{op}: UP_CONFIG and DOWN_CONFIG must share num_warps to run in one kernel")
    act = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    down_out = torch.empty((num_pairs, h), dtype=x.dtype, device=x.device)
    n_blocks = block_expert.numel()
    strips = triton.cdiv(h, down.block_n)
    counters = device_counters(x.device)
    if n_blocks + strips + 1 > counters.numel():
        raise ValueError(f"{op}: {n_blocks} blocks + {strips} strips need more than {counters.numel()} counters")
    up_count, down_count, done = counters[:n_blocks], counters[n_blocks:n_blocks + strips], counters[-1:]
    interpret = _interpreting()
    pdl = pdl and pdl_supported(x.device)
    args = (x, w13_interleaved, w2, act, down_out, out, tw, shared, sorted_pairs, block_expert, total,
            up_count, down_count, done, num_pairs, n_tokens, n13, h, k_up, inter, x.stride(0),
            w13_interleaved.stride(0), w13_interleaved.stride(1), w2.stride(0), w2.stride(1), act.stride(0),
            down_out.stride(0), tw.stride(0), shared.stride(0), out.stride(0), float(limit))
    meta = dict(TOP_K=top_k, BLOCK_M=block_m, TILE_M=max(MIN_TILE_M, triton.next_power_of_2(block_m)),
                UP_BN=up.block_n, UP_BK=up.block_k, DOWN_BN=down.block_n, DOWN_BK=down.block_k,
                EVEN_UP=k_up % up.block_k == 0, EVEN_DOWN=inter % down.block_k == 0, HAS_LIMIT=limit > 0,
                IEEE_DOT=interpret or x.dtype == torch.float32, LIBDEVICE_EXP=x.is_cuda and not interpret,
                ORDER=COMBINE_ORDER.get(x.device.type, SEQUENTIAL), HAS_SHARED=shared_out is not None, PDL=pdl,
                DOWN_CHUNKS=preload_chunks(preload, inter, down.block_k, num_pairs),
                num_warps=up.num_warps, num_stages=up.num_stages, **FP_OPTIONS)
    launch = {"launch_pdl": True} if pdl else {}
    if programs is None:
        if interpret or not x.is_cuda:
            programs = 1
        else:
            compiled = _moe_fused_kernel.warmup(*args, grid=(1,), **meta, **launch)
            compiled._init_handles()                                  # loads the binary: n_regs is known then
            programs = _resident_programs(x.device, compiled.n_regs, compiled.metadata.shared, up.num_warps, per_sm)
    _moe_fused_kernel[(programs,)](*args, **meta, **launch)
    return out


def moe_fused_ref(x, w13_interleaved, w2, topk_weights, sorted_pairs, block_expert, total, top_k, block_m, limit,
                  shared_out=None):
    """lingc's reference: the composite of the three reference ops."""
    return torch.ops.lingc.moe_fused(x, w13_interleaved, w2, topk_weights, sorted_pairs, block_expert, total, top_k,
                                     block_m, limit, shared_out)


LOWERINGS = {"moe_fused": moe_fused}
