"""The MoE GEMMs of one token with the router inside them: no router_align launch at decode (fuse_router_moe).

At one token the router_align launch between the router GEMV and the up-GEMM is pure chain latency (H200 decode
step, PDL on: 3.0 us a MoE layer, 23 layers; bench/results/launches-pdl-h200-20261201.json), and at one token the
align has nothing to sort: pair j of the row is its j-th pick (k routed experts by descending biased score, then the
S shared ones), one pair per expert. So every program routes the row itself, from the logits (E fp32 values, L2):

    moe_up_act_routed(x [1, h], w13_interleaved [E+S, 2I, h], logits [1, E], expert_bias [E], n_group, topk_group,
                      top_k, routed_scaling_factor, num_experts, block_m, fused_shared, limit)
        -> (act [k+S, I], weights fp32 [1, k+S], ids int32 [1, k+S])
    moe_down_routed(act [k+S, I], w2 [E+S, h, I], logits, expert_bias, n_group, topk_group, top_k,
                    routed_scaling_factor, num_experts, block_m, fused_shared) -> [k+S, h]

== router_align(...) then moe_up_act / moe_down on its outputs, bit for bit (lingc/ops/moe.py composes them so):
  * the routing is router_align's "rows" kernel's (kernels/router.py `_row_picks`, the variant that routes one row at
    decode), and router.py's contract makes every variant agree bit for bit whatever the tile, warps or other rows;
  * the GEMM tile is kernels/moe.py's `_gemm_rows` with the same configs (UP_CONFIG / DOWN_CONFIG), TILE_M = 16 and
    the pair's row alone valid, as an align block of BM rows holding one pair gives it (a row's bits do not depend on
    its place in a block).
num_experts and block_m only feed the reference (its align); the kernels do not align.

Grid (cdiv(N, BLOCK_N), k + S): program (n, j) owns N-tile n of pair j. The up-GEMM's programs route after the PDL
wait (the logits are the launch before's output) and program (0, 0) stores the row's weights and ids (the combine
reads the weights). The down-GEMM's programs route BEFORE their wait, through L2 (.cg), and load their whole weight
tile into registers there (moe.py's PRELOAD at decode's pair counts): the logits' writer, the router GEMV, is two
launches back (GEMV -> up -> down; a launch's programs start only after the launch before has passed its wait, so
the GEMV has completed, kernels/pdl.py). The pdl pass launches a moe_down_routed without PDL where the launch just
before it wrote its logits (passes/pdl.py PREWAIT_INPUTS). With PDL off everything is stream-ordered anyway.

Cost: every program repeats the routing on its critical path, in place of the align launch and the up-GEMM's read
of the align's outputs. It runs in the "rows" tile [L, R, G, C] with the R axis filled by replicas of the token,
R = num_warps * 32 / L, so that each warp routes a replica alone: the group ranking and the k picks are in-register
maxima and lane shuffles, never a CTA barrier (a first version routed in _route_rows' [1, G, GS] tile, whose maxima
cross the 4 warps through shared memory: the H200 decode step measured no gain, 1.229-1.237 ms with it against
1.231-1.237 without, bench/results/step-ab-h200-20261201-e.json).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lingc.kernels.moe import (DOWN_CONFIG, DOWN_PRELOAD, FP_OPTIONS, MIN_TILE_M, UP_CONFIG, _float_dtype, _gemm_rows,
                               _interpreting, _out, _preload_expert_tile, preload_chunks)
from lingc.kernels.pdl import pdl_supported, pdl_trigger, pdl_wait
from lingc.kernels.router import _NO_ID, ROW_LANES, _check, _check_shared, _row_picks
import lingc.ops  # noqa: F401  (registers torch.ops.lingc.*, used by the references)


@triton.jit
def _route_pair(logits_ptr, bias_ptr, pair, GS: tl.constexpr, n_group, topk_group, scale, R_BLOCK: tl.constexpr,
                G_BLOCK: tl.constexpr, C_BLOCK: tl.constexpr, L_BLOCK: tl.constexpr, TOP_K: tl.constexpr,
                SHARED: tl.constexpr, K_BLOCK: tl.constexpr, NO_ID: tl.constexpr, CACHE: tl.constexpr):
    """(weights [K, R, 1, 1], ids [K, R, 1, 1], expert of pair `pair` as int64) of the one-token row, routed as
    router_align's "rows" kernel routes (kernels/router.py `_row_picks`: same keys, same order, same bits) in its
    [L, R, G, C] tile, whose R axis the warps split: every row of the tile is a replica of the token, so each warp
    routes it alone (warp shuffles, no CTA barrier) and only the pair's expert crosses warps (one sum)."""
    l = tl.arange(0, L_BLOCK)[:, None, None, None]                                # [L, 1, 1, 1]
    r = tl.arange(0, R_BLOCK)[None, :, None, None]                                # [1, R, 1, 1] replicas
    g = tl.arange(0, G_BLOCK)[None, None, :, None]                                # [1, 1, G, 1]
    c = tl.arange(0, C_BLOCK)[None, None, None, :]                                # [1, 1, 1, C]
    kk = tl.arange(0, K_BLOCK)[:, None, None, None]                               # [K, 1, 1, 1]
    j = c * L_BLOCK + l
    valid = (r < R_BLOCK) & (g < n_group) & (j < GS)                              # [L, R, G, C]
    eid = g * GS + j
    cell = tl.where(valid, eid, 0)              # (a select: no axis looks contiguous, kernels/router.py "rows")
    bias = tl.load(bias_ptr + cell, mask=valid, other=0.0).to(tl.float32)
    x = tl.load(logits_ptr + cell, mask=valid, other=0.0, cache_modifier=CACHE).to(tl.float32)
    eid = tl.where(valid, eid, NO_ID)
    score = tl.sigmoid(x)
    biased = tl.where(valid, score + bias, float("-inf"))
    scores, total, ids, picks = _row_picks(score, biased, eid, valid, g, n_group, topk_group, R_BLOCK, G_BLOCK,
                                           C_BLOCK, L_BLOCK, TOP_K, K_BLOCK, NO_ID)
    weights = scores / (total + 1e-20) * scale
    shared = (kk >= TOP_K) & (kk < TOP_K + SHARED)                                # [K, 1, 1, 1]
    weights = tl.where(shared, 1.0, weights)
    ids = tl.where(shared, GS * n_group + kk - TOP_K, ids)                        # [K, R, 1, 1]
    mine = (kk == pair) & (r == 0)
    expert = tl.sum(tl.sum(tl.sum(tl.sum(tl.where(mine, ids, 0), axis=3), axis=2), axis=1), axis=0)
    return weights, ids, expert.to(tl.int64)


@triton.jit
def _moe_routed_kernel(a_ptr, w_ptr, out_ptr, logits_ptr, bias_ptr, rw_ptr, rid_ptr,
                       num_pairs, N, K, stride_am, stride_we, stride_wn, stride_om, limit,
                       n_group, topk_group, scale, GS: tl.constexpr, R_BLOCK: tl.constexpr,
                       G_BLOCK: tl.constexpr, C_BLOCK: tl.constexpr, L_BLOCK: tl.constexpr, TOP_K: tl.constexpr,
                       SHARED: tl.constexpr, K_BLOCK: tl.constexpr, NO_ID: tl.constexpr, A_TOPK: tl.constexpr,
                       TILE_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SWIGLU: tl.constexpr,
                       HAS_LIMIT: tl.constexpr, IEEE_DOT: tl.constexpr, LIBDEVICE_EXP: tl.constexpr,
                       PDL: tl.constexpr, DOWN: tl.constexpr, K_CHUNKS: tl.constexpr):
    pid_n = tl.program_id(0)
    pair = tl.program_id(1)
    ws = ()
    if DOWN:      # the logits are two launches back (module docstring): route and fill the weight tile first
        weights, ids, expert = _route_pair(logits_ptr, bias_ptr, pair, GS, n_group, topk_group, scale, R_BLOCK,
                                           G_BLOCK, C_BLOCK, L_BLOCK, TOP_K, SHARED, K_BLOCK, NO_ID, ".cg")
        if K_CHUNKS > 0:
            ws = _preload_expert_tile(w_ptr, expert, pid_n, N, K, stride_we, stride_wn, BLOCK_N, BLOCK_K, K_CHUNKS)
    if PDL:
        pdl_wait()
    if not DOWN:
        weights, ids, expert = _route_pair(logits_ptr, bias_ptr, pair, GS, n_group, topk_group, scale, R_BLOCK,
                                           G_BLOCK, C_BLOCK, L_BLOCK, TOP_K, SHARED, K_BLOCK, NO_ID, "")
        if (pid_n == 0) & (pair == 0):
            kk = tl.arange(0, K_BLOCK)[:, None, None, None]
            first = (kk < TOP_K + SHARED) & (tl.arange(0, R_BLOCK)[None, :, None, None] == 0)
            tl.store(rw_ptr + kk + 0 * ids, weights, mask=first)
            tl.store(rid_ptr + kk + 0 * ids, ids, mask=first)
    offs_m = tl.arange(0, TILE_M)
    pairs = tl.where(offs_m == 0, pair, num_pairs)                   # one valid row: the pair's own
    _gemm_rows(a_ptr, w_ptr, out_ptr, expert, pairs, pid_n, num_pairs, N, K, stride_am, stride_we, stride_wn,
               stride_om, limit, A_TOPK, TILE_M, BLOCK_N, BLOCK_K, EVEN_K, SWIGLU, HAS_LIMIT, IEEE_DOT,
               LIBDEVICE_EXP, False, ws, K_CHUNKS)
    if PDL:
        pdl_trigger()


def _route_tile(n_group: int, group_size: int, top_k: int, fused_shared: int, warps: int) -> dict:
    """Constexprs of the replicated "rows" tile: L experts of a group per lane chunk, 32 / L rows a warp, so
    R = warps * 32 / L replicas put one replica set per warp (kernels/router.py `_rows_launch`)."""
    gs_block = triton.next_power_of_2(group_size)
    lanes = min(ROW_LANES, gs_block)
    return dict(GS=group_size, R_BLOCK=warps * max(1, 32 // lanes), G_BLOCK=triton.next_power_of_2(n_group),
                C_BLOCK=gs_block // lanes, L_BLOCK=lanes, TOP_K=top_k, SHARED=fused_shared, NO_ID=_NO_ID,
                K_BLOCK=max(lanes, triton.next_power_of_2(top_k + fused_shared)))


def _check_route(op: str, logits: torch.Tensor, expert_bias: torch.Tensor, n_group: int, topk_group: int,
                 top_k: int, num_experts: int, block_m: int, fused_shared: int, stack: torch.Tensor) -> tuple:
    """Validate the routing arguments for one token; returns (logits, group size)."""
    logits, group_size = _check(logits, expert_bias, n_group, topk_group, top_k)
    _check_shared(fused_shared)
    E = logits.shape[1]
    if logits.shape[0] != 1:
        raise ValueError(f"{op}: routes one token, got logits {list(logits.shape)} (use router_align + the grouped "
                         "GEMMs for more rows)")
    if num_experts != E + fused_shared or block_m < 1:
        raise ValueError(f"{op}: want num_experts == E + fused_shared ({E} + {fused_shared}) and block_m >= 1, "
                         f"got {num_experts}, {block_m}")
    if stack.dim() != 3 or stack.shape[0] != num_experts:
        raise ValueError(f"{op}: expert weights are {list(stack.shape)}, want [{num_experts}, N, K]")
    return logits, group_size


def _launch(op: str, a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, logits: torch.Tensor,
            expert_bias: torch.Tensor, group_size: int, n_group: int, topk_group: int, top_k: int, scale: float,
            fused_shared: int, rw: torch.Tensor, rid: torch.Tensor, limit: float, down: bool, pdl: bool,
            preload: bool = False) -> None:
    if a.shape[1] != w.shape[2] or w.dtype != a.dtype or w.stride(2) != 1:
        raise ValueError(f"{op}: activations {list(a.shape)} {a.dtype} and weights {list(w.shape)} {w.dtype} "
                         "(contiguous along K): want [R, K] and [E, N, K] of one dtype")
    n, k = w.shape[1], w.shape[2]
    num_pairs = top_k + fused_shared
    config = DOWN_CONFIG if down else UP_CONFIG
    pdl = pdl and pdl_supported(a.device)
    interpret = _interpreting()
    a = a if a.stride(1) == 1 else a.contiguous()
    _moe_routed_kernel[(triton.cdiv(n, config.block_n), num_pairs)](
        a, w, out, logits, expert_bias, rw, rid, num_pairs, n, k, a.stride(0), w.stride(0), w.stride(1),
        out.stride(0), float(limit), n_group, topk_group, float(scale),
        **_route_tile(n_group, group_size, top_k, fused_shared, config.num_warps), A_TOPK=1 if down else num_pairs,
        TILE_M=MIN_TILE_M,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, EVEN_K=k % config.block_k == 0, SWIGLU=not down,
        HAS_LIMIT=limit > 0, IEEE_DOT=interpret or a.dtype == torch.float32, LIBDEVICE_EXP=a.is_cuda and not interpret,
        PDL=pdl, DOWN=down, K_CHUNKS=preload_chunks(down and preload, k, config.block_k, num_pairs),
        num_warps=config.num_warps, num_stages=config.num_stages, **FP_OPTIONS,
        **({"launch_pdl": True} if pdl else {}))


def moe_up_act_routed(x: torch.Tensor, w13_interleaved: torch.Tensor, logits: torch.Tensor, expert_bias: torch.Tensor,
                      n_group: int, topk_group: int, top_k: int, routed_scaling_factor: float, num_experts: int,
                      block_m: int, fused_shared: int, limit: float, *, pdl: bool = False,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(act [k+S, I], weights fp32 [1, k+S], ids int32 [1, k+S]) for one token: router_align's weights and ids and
    moe_up_act of its pairs, in one launch (module docstring)."""
    op = "moe_up_act_routed"
    logits, group_size = _check_route(op, logits, expert_bias, n_group, topk_group, top_k, num_experts, block_m,
                                      fused_shared, w13_interleaved)
    _float_dtype(x, op, "x")
    if x.dim() != 2 or x.shape[0] != 1 or w13_interleaved.shape[1] % 2:
        raise ValueError(f"{op}: x is {list(x.shape)} and w13 {list(w13_interleaved.shape)}: want one token [1, h] "
                         "and an even number of interleaved gate/up rows")
    width = top_k + fused_shared
    act = _out(op, None, (width, w13_interleaved.shape[1] // 2), x)
    weights = torch.empty((1, width), dtype=torch.float32, device=x.device)
    ids = torch.empty((1, width), dtype=torch.int32, device=x.device)
    _launch(op, x, w13_interleaved, act, logits, expert_bias, group_size, n_group, topk_group, top_k,
            routed_scaling_factor, fused_shared, weights, ids, limit, False, pdl)
    return act, weights, ids


def moe_down_routed(act: torch.Tensor, w2: torch.Tensor, logits: torch.Tensor, expert_bias: torch.Tensor,
                    n_group: int, topk_group: int, top_k: int, routed_scaling_factor: float, num_experts: int,
                    block_m: int, fused_shared: int, *, pdl: bool = False, preload: bool | None = None) -> torch.Tensor:
    """moe_down of the one token's k+S pairs, unweighted: act [k+S, I] -> [k+S, h], routed again from the logits.
    preload (default: moe.py's DOWN_PRELOAD, PDL launches only): the weight tile into registers before the wait;
    the same chunks and dots either way (tests force it on the interpreter)."""
    op = "moe_down_routed"
    logits, group_size = _check_route(op, logits, expert_bias, n_group, topk_group, top_k, num_experts, block_m,
                                      fused_shared, w2)
    _float_dtype(act, op, "act")
    if act.dim() != 2 or act.shape[0] != top_k + fused_shared:
        raise ValueError(f"{op}: act is {list(act.shape)}, want [{top_k + fused_shared}, I] (one token's pairs)")
    out = _out(op, None, (act.shape[0], w2.shape[1]), act)
    _launch(op, act, w2, out, logits, expert_bias, group_size, n_group, topk_group, top_k, routed_scaling_factor,
            fused_shared, out, out, 0.0, True, pdl,      # rw / rid: never stored by the down-GEMM
            preload=DOWN_PRELOAD and pdl if preload is None else preload)
    return out


LOWERINGS = {"moe_up_act_routed": moe_up_act_routed, "moe_down_routed": moe_down_routed}
