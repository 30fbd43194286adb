"""One token's MoE GEMMs with the router inside: every program routes the token itself, so no router launch.

    moe_up_act_routed(x [1, h], w13_interleaved [E+S, 2I, h], logits [1, E] fp32, expert_bias [E], n_group,
                      topk_group, top_k, routed_scaling_factor, fused_shared, limit)         -> act [k+S, I]
        == moe_up_act_pairs(x, w13_interleaved, router_topk(logits, expert_bias, ..., fused_shared)[1], limit)
    moe_down_routed(act [k+S, I], w2 [E+S, h, I], logits, expert_bias, n_group, topk_group, top_k,
                    routed_scaling_factor, fused_shared)                  -> (out [k+S, h], weights [1, k+S] fp32)
        == (moe_down_pairs(act, w2, ids), weights) of that router_topk(...)

Why: at one token (decode, the draft's MTP forwards) a MoE layer ran gate GEMV -> router_align -> up-GEMM ->
down-GEMM -> combine, and router_align is a latency-bound launch (2.1 us a layer exposed in the H200 and H100 greedy
decode steps, bench/results/launches-kda-tma-h200-20261204.json, launches-h100-20261206-b.json) between two
launches that must wait for it. Here the up-GEMM's program (n, m) (N-tile n, pair m: the token's pick m for m < k,
the fused shared expert E + m - k after them) loads the E logits after its PDL wait, as router_align did, and finds
pick m itself; the down-GEMM does the same before its wait (the logits are two launches back, as the align's
outputs were for moe_down's PRELOAD) and program (0, 0) also stores the combine's weights. One launch and one
dependent round trip fewer a layer, for each program's own routing (a few hundred instructions; the aligned
GEMMs' expert-id load goes with it).

Routing by ranks, not picks (kernels/router_gluon.py's idea in Triton): group scores as router.py's `_route_rows`
(the best biased score of each group plus the best of the others, exact maxima, one add), the topk_group best groups
kept (ties to the lower group id), then every expert's rank among the kept groups' experts: its order key
(router.py's `_order_key`: biased score descending, ties to the lower id) against each kept group's GS keys in turn,
the group's row reloaded once its id is known. Pick m is the candidate of rank m. Every step is an exact comparison, max or integer count, and the scores are the same `tl.sigmoid` of the
same logits plus the same bias, so the picks are router_topk's. The weights (program (0, 0) of the down-GEMM): the k
picked unbiased scores summed one by one in pick order, score / (total + 1e-20) * scale, then 1.0 for the S shared
pairs: router.py's fp32 operations in router.py's order, so router_topk's bits. The GEMM tiles are kernels/moe.py's
`_gemm_tile_rows` with decode's aligned tilings (UP_CONFIG / DOWN_CONFIG, the down-GEMM's register PRELOAD), pair m
alone in its row tile: the bits of decode's aligned moe_up_act / moe_down for the same picks (a pair row's dot does
not depend on its block). Checked in the interpreter against router_topk + the pair grid, bit for bit; on the GPU by
the step's greedy parity (NEXTN == plain decoding: verify runs router_topk + the pair grid).

Measured slower, so the pass is opt-in (H100, one token, Ling-3.0-tiny's shapes, bench/moe_routed_check.py: cold
weights, CUDA-graph replay of 16 calls, PDL; the same bits as both other paths over 16 routings each time). The
whole layer (router_align -> up -> down against up -> down, routed): 20.6 against 29.2 us with one [E, E] count of
int64 keys a program (238 / 207 registers a thread: half the occupancy; `kernels-moe-routed-h100-20261206.json`),
20.6 against 25.4 us counting one kept group at a time (this form, 96 / 126 registers; `-b.json`, `-d.json`), 20.8
against 30.1 us with every load issued first and all G groups counted (`-c.json`, not kept). Alone (`-d.json`):
router_align 2.16 us, the aligned up-GEMM 12.78, the routed one 15.40; the aligned down-GEMM 7.29, the routed one
13.43. So routing one row in a Triton program costs ~2.6 us on the up-GEMM's path (its reductions and layout changes:
30-38 CTA barriers and 53-557 shuffles in the sm_90 PTX, against the Gluon router's whole launch of 2.16), more than
the launch it removes; the step agreed: greedy decode 1.520 / 1.518 ms against 1.306 with the first form
(`step-ab-h100-20261206-router-into-moe.json`, greedy parity held). What would make it pay: routing code with
chosen layouts (kernels/router_gluon.py's `_route` inside a Gluon GEMM), under ~0.5 us.

Where it runs: one token (x with one row), E <= MAX_EXPERTS routed experts (each program ranks all E: at
Ling-3.0-flash's 512 that is 4 experts a thread at 4 warps, untried, so the pass leaves such layers aligned). Any other call runs router_topk + the pair-grid kernels (two more launches, the same values).

PDL (shared/docs/kernels.md section 1.5): the up-GEMM loads nothing before its wait (the logits and x are the gate
GEMV's outputs, the launch just before). The down-GEMM loads the expert bias and the logits (.cg, through L2) before
its wait, routes, and preloads its weight tile into registers; after the wait only the act rows (the up-GEMM's) and
then its stores. The pdl pass launches it without PDL where the launch just before it produces the logits
(passes/pdl.py PREWAIT_INPUTS; never in lingc's graphs, where the up-GEMM sits between).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lingc.kernels.moe import (DOWN_CONFIG, DOWN_PRELOAD, FP_OPTIONS, MIN_TILE_M, UP_CONFIG, _check_gemm,
                               _gemm_tile_rows, _ieee_dot, _launch_setup, _out, _preload_expert_tile, moe_down_pairs,
                               moe_up_act_pairs, preload_chunks)
from lingc.kernels.pdl import pdl_trigger, pdl_wait
from lingc.kernels.router import _NO_ID, _check, _check_shared, _order_key, router_topk
import lingc.ops  # noqa: F401  (registers torch.ops.lingc.*)
from lingc.ops.moe import ROUTED_MAX_EXPERTS as MAX_EXPERTS   # experts a program ranks; past it: unfused


@triton.jit
def _route_ranks(logits_ptr, bias_ptr, GS, n_group, TOPK_GROUP: tl.constexpr, G_BLOCK: tl.constexpr,
                 GS_BLOCK: tl.constexpr, E_BLOCK: tl.constexpr, NO_ID: tl.constexpr, CG: tl.constexpr):
    """router_topk's selection of one row by ranks: (e, rank, score), each [E_BLOCK]: expert ids, the rank among the
    kept groups' experts (E_BLOCK for the others; the picks are ranks 0, 1, ...), the unbiased score. CG: the logits
    through L2 (.cg), for loads before the PDL wait."""
    g = tl.arange(0, G_BLOCK)
    j = tl.arange(0, GS_BLOCK)
    gvalid = g < n_group
    valid2 = gvalid[:, None] & (j < GS)[None, :]
    eid2 = tl.where(valid2, g[:, None] * GS + j[None, :], NO_ID)                      # [G_BLOCK, GS_BLOCK]
    if CG:
        x2 = tl.load(logits_ptr + eid2, mask=valid2, other=0.0, cache_modifier=".cg").to(tl.float32)
    else:
        x2 = tl.load(logits_ptr + eid2, mask=valid2, other=0.0).to(tl.float32)
    b2 = tl.load(bias_ptr + eid2, mask=valid2, other=0.0).to(tl.float32)
    biased2 = tl.where(valid2, tl.sigmoid(x2) + b2, float("-inf"))
    key2 = tl.where(valid2, _order_key(biased2, eid2, NO_ID), -(2**63))
    # group score: the best biased score plus the best of the others (the best's lane, lowest id first, excluded)
    m1 = tl.max(biased2, axis=1)
    first = NO_ID - (tl.max(key2, axis=1) & 0xFFFFFFFF).to(tl.int32)
    m2 = tl.max(tl.where(eid2 == first[:, None], float("-inf"), biased2), axis=1)
    gscore = tl.where(gvalid, m1 + m2, float("-inf"))                                 # [G_BLOCK]
    # group i's rank: how many groups beat it (higher score, or equal score and lower id); the TOPK_GROUP best stay
    beats = (gscore[None, :] > gscore[:, None]) | ((gscore[None, :] == gscore[:, None]) & (g[None, :] < g[:, None]))
    # every expert's rank among the kept groups' experts: counted one kept group at a time (TOPK_GROUP x GS
    # compares an expert; the [E, E] count at once held 238 registers a thread on sm_90 and halved the occupancy)
    e = tl.arange(0, E_BLOCK)
    evalid = e < GS * n_group
    if CG:
        x = tl.load(logits_ptr + e, mask=evalid, other=0.0, cache_modifier=".cg").to(tl.float32)
    else:
        x = tl.load(logits_ptr + e, mask=evalid, other=0.0).to(tl.float32)
    score = tl.sigmoid(x)
    biased = score + tl.load(bias_ptr + e, mask=evalid, other=0.0).to(tl.float32)
    key = _order_key(biased, e, NO_ID)                                                # [E_BLOCK]
    grank = tl.sum(beats.to(tl.int32), axis=1)                                        # [G_BLOCK], a permutation
    rank = tl.zeros([E_BLOCK], dtype=tl.int32)
    cand = e < 0
    for q in tl.static_range(TOPK_GROUP):
        kg = tl.sum(tl.where(gvalid & (grank == q), g, 0), axis=0)                    # the group of rank q
        jj = kg * GS + j
        jvalid = j < GS
        if CG:
            xj = tl.load(logits_ptr + jj, mask=jvalid, other=0.0, cache_modifier=".cg").to(tl.float32)
        else:
            xj = tl.load(logits_ptr + jj, mask=jvalid, other=0.0).to(tl.float32)
        bj = tl.sigmoid(xj) + tl.load(bias_ptr + jj, mask=jvalid, other=0.0).to(tl.float32)
        kj = tl.where(jvalid, _order_key(bj, jj, NO_ID), -(2**63))                    # [GS_BLOCK]
        rank += tl.sum((kj[None, :] > key[:, None]).to(tl.int32), axis=1)
        cand = cand | (evalid & (e // GS == kg))
    return e, tl.where(cand, rank, E_BLOCK), score


@triton.jit
def _route_weights(rank, score, scale, TOP_K: tl.constexpr, SHARED: tl.constexpr, K_BLOCK: tl.constexpr):
    """The combine's [K_BLOCK] weights from _route_ranks: router.py's arithmetic (module docstring)."""
    kk = tl.arange(0, K_BLOCK)
    hit = rank[:, None] == kk[None, :]                                                # one expert a pick column
    picked = tl.max(tl.where(hit, score[:, None], float("-inf")), axis=0)             # [K_BLOCK], exact
    total = tl.sum(tl.where(kk == 0, picked, 0.0), axis=0)
    for p in tl.static_range(1, TOP_K):                                               # one by one, pick order
        total = total + tl.sum(tl.where(kk == p, picked, 0.0), axis=0)
    weights = picked / (total + 1e-20) * scale
    return tl.where((kk >= TOP_K) & (kk < TOP_K + SHARED), 1.0, weights)


@triton.jit
def _route_pair(logits_ptr, bias_ptr, m, first, num_routed, GS, n_group, scale, TOPK_GROUP: tl.constexpr,
                TOP_K: tl.constexpr, SHARED: tl.constexpr, G_BLOCK: tl.constexpr, GS_BLOCK: tl.constexpr,
                E_BLOCK: tl.constexpr, K_BLOCK: tl.constexpr, NO_ID: tl.constexpr, WEIGHTS: tl.constexpr,
                CG: tl.constexpr):
    """(pair m's expert, the combine's [K_BLOCK] weights where WEIGHTS and `first`, else zeros) from one routing:
    pick m for m < TOP_K, else fused shared expert num_routed + m - TOP_K (no routing)."""
    expert = num_routed + m - TOP_K
    wts = tl.zeros([K_BLOCK], dtype=tl.float32)
    if m < TOP_K:
        e, rank, score = _route_ranks(logits_ptr, bias_ptr, GS, n_group, TOPK_GROUP, G_BLOCK, GS_BLOCK, E_BLOCK,
                                      NO_ID, CG)
        expert = tl.max(tl.where(rank == m, e, -1), axis=0)
        if WEIGHTS:
            if first:
                wts = _route_weights(rank, score, scale, TOP_K, SHARED, K_BLOCK)
    return expert.to(tl.int64), wts


@triton.jit
def _moe_routed_kernel(a_ptr, w_ptr, out_ptr, logits_ptr, bias_ptr, weights_ptr,
                       num_routed, N, K, stride_am, stride_we, stride_wn, stride_om, GS, n_group, scale, limit,
                       TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr, SHARED: tl.constexpr, A_PAIRS: tl.constexpr,
                       G_BLOCK: tl.constexpr, GS_BLOCK: tl.constexpr, E_BLOCK: tl.constexpr, K_BLOCK: tl.constexpr,
                       NO_ID: tl.constexpr, TILE_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       EVEN_K: tl.constexpr, SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr,
                       IEEE_DOT: tl.constexpr, LIBDEVICE_EXP: tl.constexpr, PDL: tl.constexpr,
                       PREWAIT: tl.constexpr, K_CHUNKS: tl.constexpr, WEIGHTS: tl.constexpr):
    """Program (n, m): N-tile n of pair m (module docstring). A_PAIRS: pairs per A row (k + S for the up-GEMM's x
    row, 1 for the down-GEMM's act rows). PREWAIT (the down-GEMM): route, and preload K_CHUNKS weight chunks, before
    the PDL wait. WEIGHTS: program (0, 0) stores the combine's weights after its wait."""
    pid_n = tl.program_id(0)
    m = tl.program_id(1)
    num_pairs = TOP_K + SHARED
    ws = ()
    first = (pid_n == 0) & (m == 0)
    if PREWAIT:
        expert, wts = _route_pair(logits_ptr, bias_ptr, m, first, num_routed, GS, n_group, scale, TOPK_GROUP, TOP_K,
                                  SHARED, G_BLOCK, GS_BLOCK, E_BLOCK, K_BLOCK, NO_ID, WEIGHTS, True)
        if K_CHUNKS > 0:
            ws = _preload_expert_tile(w_ptr, expert, pid_n, N, K, stride_we, stride_wn, BLOCK_N, BLOCK_K, K_CHUNKS)
        if PDL:
            pdl_wait()
    else:
        if PDL:
            pdl_wait()
        expert, wts = _route_pair(logits_ptr, bias_ptr, m, first, num_routed, GS, n_group, scale, TOPK_GROUP, TOP_K,
                                  SHARED, G_BLOCK, GS_BLOCK, E_BLOCK, K_BLOCK, NO_ID, WEIGHTS, False)
    r = tl.arange(0, TILE_M)
    pairs = tl.where(r == 0, m, num_pairs)                                            # pair m alone in its tile
    _gemm_tile_rows(a_ptr, w_ptr, out_ptr, expert, pairs, pid_n, num_pairs, N, K, stride_am, stride_we, stride_wn,
                    stride_om, limit, A_PAIRS, TILE_M, BLOCK_N, BLOCK_K, EVEN_K, SWIGLU, HAS_LIMIT, IEEE_DOT,
                    LIBDEVICE_EXP, False, ws, K_CHUNKS)
    if WEIGHTS:
        if first:
            kk = tl.arange(0, K_BLOCK)
            tl.store(weights_ptr + kk, wts, mask=kk < num_pairs)
    if PDL:
        pdl_trigger()


def routes(x_rows: int, num_routed: int) -> bool:
    """Whether a call with x_rows tokens and num_routed routed experts runs the routed kernel (else router_topk + the
    pair grid: the same values)."""
    return x_rows == 1 and 2 <= num_routed <= MAX_EXPERTS


def _launch(op: str, a: torch.Tensor, w: torch.Tensor, logits: torch.Tensor, expert_bias: torch.Tensor,
            n_group: int, topk_group: int, top_k: int, scale: float, fused_shared: int, limit: float, swiglu: bool,
            pdl: bool, out: torch.Tensor | None, weights: torch.Tensor | None) -> torch.Tensor:
    config = UP_CONFIG if swiglu else DOWN_CONFIG
    num_experts, n, k = _check_gemm(op, a, w, swiglu, config)
    num_routed = logits.shape[1]
    pairs = top_k + fused_shared
    if num_experts != num_routed + fused_shared:
        raise ValueError(f"{op}: the weight stack has {num_experts} experts, want {num_routed} routed + "
                         f"{fused_shared} shared (logits {list(logits.shape)})")
    if a.shape[0] * (pairs if swiglu else 1) != pairs:
        raise ValueError(f"{op}: activations {list(a.shape)}: want {'one token' if swiglu else f'{pairs} pair rows'}")
    out = _out(op, out, (pairs, n // 2 if swiglu else n), a)
    if n == 0:
        return out
    a, pdl, launch, interpret = _launch_setup(op, a, w, k, pdl)
    chunks = 0 if swiglu else preload_chunks(DOWN_PRELOAD and pdl, k, config.block_k, pairs)
    gs = num_routed // n_group
    _moe_routed_kernel[(triton.cdiv(n, config.block_n), pairs)](
        a, w, out, logits, expert_bias, weights if weights is not None else logits,
        num_routed, n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0), gs, n_group, float(scale),
        float(limit), TOPK_GROUP=topk_group, TOP_K=top_k, SHARED=fused_shared, A_PAIRS=pairs if swiglu else 1,
        G_BLOCK=triton.next_power_of_2(n_group), GS_BLOCK=triton.next_power_of_2(gs),
        E_BLOCK=triton.next_power_of_2(num_routed), K_BLOCK=max(2, triton.next_power_of_2(pairs)), NO_ID=_NO_ID,
        TILE_M=MIN_TILE_M, BLOCK_N=config.block_n, BLOCK_K=config.block_k, EVEN_K=k % config.block_k == 0,
        SWIGLU=swiglu, HAS_LIMIT=limit > 0, IEEE_DOT=_ieee_dot(a), LIBDEVICE_EXP=a.is_cuda and not interpret,
        PDL=pdl, PREWAIT=not swiglu, K_CHUNKS=chunks, WEIGHTS=weights is not None,
        num_warps=config.num_warps, num_stages=config.num_stages, **FP_OPTIONS, **launch)
    return out


def _router_args(op: str, logits: torch.Tensor, expert_bias: torch.Tensor, n_group: int, topk_group: int,
                 top_k: int, fused_shared: int) -> torch.Tensor:
    """The router arguments as router.py checks them (errors name the op); logits with a unit last stride."""
    try:
        logits, _ = _check(logits, expert_bias, n_group, topk_group, top_k)
        _check_shared(fused_shared)
    except ValueError as err:
        raise ValueError(f"{op}: {err}") from None
    if logits.dtype != torch.float32:
        raise ValueError(f"{op}: logits must be float32 (the gate's fp32 output), got {logits.dtype}")
    return logits


def moe_up_act_routed(x: torch.Tensor, w13_interleaved: torch.Tensor, logits: torch.Tensor,
                      expert_bias: torch.Tensor, n_group: int, topk_group: int, top_k: int,
                      routed_scaling_factor: float, fused_shared: int, limit: float, *, pdl: bool = False,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """moe_up_act_pairs over router_topk's ids, the routing inside the GEMM (module docstring): x [N, h] -> [N*(k+S), I]."""
    op = "moe_up_act_routed"
    logits = _router_args(op, logits, expert_bias, n_group, topk_group, top_k, fused_shared)
    if logits.shape[0] != x.shape[0]:
        raise ValueError(f"{op}: logits {list(logits.shape)} and x {list(x.shape)}: want one row each per token")
    if not routes(x.shape[0], logits.shape[1]):
        _, ids = router_topk(logits, expert_bias, n_group, topk_group, top_k, routed_scaling_factor, fused_shared,
                             pdl=pdl)
        return moe_up_act_pairs(x, w13_interleaved, ids, limit, pdl=pdl, out=out)
    return _launch(op, x, w13_interleaved, logits, expert_bias, n_group, topk_group, top_k, routed_scaling_factor,
                   fused_shared, limit, True, pdl, out, None)


def moe_down_routed(act: torch.Tensor, w2: torch.Tensor, logits: torch.Tensor, expert_bias: torch.Tensor,
                    n_group: int, topk_group: int, top_k: int, routed_scaling_factor: float, fused_shared: int, *,
                    pdl: bool = False, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(moe_down_pairs(act, w2, ids), weights) of router_topk, the routing inside the GEMM (module docstring):
    act [N*(k+S), I] -> ([N*(k+S), h], [N, k+S] fp32)."""
    op = "moe_down_routed"
    logits = _router_args(op, logits, expert_bias, n_group, topk_group, top_k, fused_shared)
    if not routes(logits.shape[0], logits.shape[1]):
        weights, ids = router_topk(logits, expert_bias, n_group, topk_group, top_k, routed_scaling_factor,
                                   fused_shared, pdl=pdl)
        return moe_down_pairs(act, w2, ids, pdl=pdl, out=out), weights
    weights = torch.empty((1, top_k + fused_shared), dtype=torch.float32, device=logits.device)
    return _launch(op, act, w2, logits, expert_bias, n_group, topk_group, top_k, routed_scaling_factor, fused_shared,
                   0.0, False, pdl, out, weights), weights


LOWERINGS = {
    "moe_up_act_routed": moe_up_act_routed,
    "moe_down_routed": moe_down_routed,
}
