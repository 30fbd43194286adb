"""The grouped sigmoid router on the GPU by ranks, with explicit layouts (Gluon): one expert a thread, no serial picks.

kernels/router.py's kernels pick the k experts one after another: k dependent max reductions over the routing tile
in one warp (~1500 instructions at one token, ~3 us a launch in the H200 decode step, 4 us with the MoE GEMM's early
weight stream beside it). Here a program of E / 32 warps routes one token row with expert e on thread e:

    1. group scores: the two best biased scores of each group (a top-2 tree over the group's lanes: in-warp
       shuffles), best + second (router.py's m1 + m2: the same exact maxima, one add), into shared memory with the
       biased scores' order-preserving int32 bits o, then one barrier
    2. every thread ranks the G groups (a [G, G] compare in registers) and keeps the TOPK_GROUP best (ties to the
       lower group id); its rank among the candidates is a count over the kept groups' rows of o read back from
       shared memory (TOPK_GROUP x GS compares in registers, no communication):
           rank_i = #{j in a kept group : o_j > o_i, or o_j == o_i and j < i}
       which is the order of router.py's picks (descending biased score, ties to the lower id)
    3. the k picks in order: one [E, k] one-hot reduction over the threads (pick p = the candidate of rank p) gives
       every thread the k scores and ids; the weights are router.py's arithmetic: the k scores summed one by one in
       pick order, then score / (total + 1e-20) * scale
    4. router_align at one row (ALIGN): k + S pairs name k + S distinct experts, so each expert's segment is one pair
       padded to BM rows: pair p at row BM * (number of pairs with a lower expert id), its expert at that block;
       every other cell the sentinel (NP = k + S in sorted_pairs, -1 in block_expert); total = (k + S) * BM.
       All stores disjoint.

Bits: the same as router.py's kernels by construction (every reduction is an exact max, min or integer count; the
sigmoid is tl.sigmoid's 1 / (1 + exp(-x)), the biased score one add, the total and the weights the same fp32 ops in
the same order); checked on the H200 against the "rows" kernel and router_topk (bench/kernel_router.py). Gluon has no
interpreter: on CPU (and where `eligible` says no) router.py's Triton kernels run, and CPU tests compile this one for
sm_90 offline (tests/kernels/test_router_gluon.py).

PDL (shared/docs/kernels.md section 1.5): the expert bias (a weight) is loaded before the wait, the logits after it;
the trigger as kernels/pdl.py's mode says (early: right after the wait; late: after the logits loads).

Where it runs (`eligible`): CUDA sm_90+, Gluon importable, LINGC_ROUTER_GLUON not 0, E = 32 x warps routed experts
(32 .. 256: one a thread), groups of a power of two <= 32 experts (a group inside a warp), top_k <= 32. Elsewhere
(Ling-3.0-flash's E = 512 among them) router.py's kernels. A compile failure warns once and falls back.
"""

from __future__ import annotations

import torch
import triton

from lingc.knobs import env_flag
from lingc.kernels.pdl import TRIGGER, late_trigger
from lingc.kernels.gluon_launch import guarded, major as _major
from lingc.kernels.workspace import indexed

try:  # Gluon ships with Triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from lingc.kernels.pdl import gluon_gdc_launch_dependents, gluon_gdc_wait
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the Triton build
    HAVE_GLUON = False

ENABLED = env_flag("LINGC_ROUTER_GLUON", True)   # LINGC_ROUTER_GLUON=0: router.py's kernels everywhere
ALIGN = env_flag("LINGC_ROUTER_GLUON_ALIGN", True)   # router_align at one row too (0: router_topk only)
FAILED: list[str] = []       # the first compile failure's message; once set, router.py's kernels run
MAX_WARPS = 8                # E = 32 x warps, one expert a thread
FILL = gl.constexpr(16) if HAVE_GLUON else 16   # sentinel cells a thread per loop step (router_align)


def eligible(device: torch.device, num_routed: int, n_group: int, topk_group: int, top_k: int) -> bool:
    """Whether the router runs here rather than on router.py's kernels (module docstring). The arguments are
    router.py's, already validated there."""
    if not (ENABLED and HAVE_GLUON and not FAILED and device.type == "cuda" and not triton.knobs.runtime.interpret):
        return False
    warps, rest = divmod(num_routed, 32)
    gs = num_routed // n_group
    if rest or warps not in (1, 2, 4, 8) or gs > 32 or gs & (gs - 1) or top_k > 32:
        return False
    return _major(indexed(device)) >= 9


def routes(device: torch.device, num_routed: int) -> bool:
    """Whether the Gluon router (and, at one row, its router_align) would route num_routed experts on this device in
    groups of at most 32 (Ling's 16): kernels/moe.py's SHARED_EARLY "auto" asks, from the expert stack alone."""
    return ALIGN and num_routed > 0 and eligible(device, num_routed, max(1, num_routed // 16), 1, 1)


if HAVE_GLUON:
    @gluon.jit
    def _sigmoid(x):
        """tl.sigmoid's arithmetic (1 / (1 + exp(-x)): the same exp and division lowering)."""
        return 1 / (1 + gl.exp(-x))

    @gluon.jit
    def _ordered(x):
        """int32 whose signed order is x's fp32 order (router.py's key, high half)."""
        bits = x.to(gl.int32, bitcast=True)
        return gl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)

    @gluon.jit
    def _top2(a1, a2, b1, b2):
        """Merge two (best, second best) pairs of a multiset: exact maxima; a tied best counts twice."""
        return gl.maximum(a1, b1), gl.maximum(gl.minimum(a1, b1), gl.maximum(a2, b2))

    @gluon.jit
    def _pick(s1, i1, s2, i2):
        """One-hot reduction of (score, id) pairs: every column has one live cell (-inf, -1 elsewhere)."""
        return gl.maximum(s1, s2), gl.maximum(i1, i2)

    @gluon.jit
    def _load_row(row_ptr, E: gl.constexpr, GS: gl.constexpr, NW: gl.constexpr, CACHE: gl.constexpr):
        """One row of E values (the logits, or the expert bias) in `_route`'s two layouts, [G, GS] and [E] (CACHE
        ".cg": through L2, for logits other CTAs wrote)."""
        G: gl.constexpr = E // GS
        LG: gl.constexpr = gl.BlockedLayout([1, 1], [32 // GS, GS], [NW, 1], [1, 0])
        L2: gl.constexpr = gl.BlockedLayout([1, GS], [32, 1], [NW, 1], [1, 0])
        g = gl.arange(0, G, layout=gl.SliceLayout(1, LG))
        j = gl.arange(0, GS, layout=gl.SliceLayout(0, LG))
        i2 = gl.arange(0, E, layout=gl.SliceLayout(1, L2))
        return (gl.load(row_ptr + g[:, None] * GS + j[None, :], cache_modifier=CACHE).to(gl.float32),
                gl.load(row_ptr + i2, cache_modifier=CACHE).to(gl.float32))

    @gluon.jit
    def _fill_sentinels(sorted_ptr, block_expert_ptr, max_padded, n_blocks, W: gl.constexpr, BM: gl.constexpr,
                        NW: gl.constexpr):
        """router_align's sentinels: every cell but the W segment heads (NP = W in sorted_pairs, -1 in
        block_expert); a warp stores 32 consecutive cells."""
        LF: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        for start in range(0, max_padded, FILL * 32 * NW):
            c = start + gl.arange(0, FILL * 32 * NW, layout=LF)
            head = (c % BM == 0) & (c < W * BM)
            gl.store(sorted_ptr + c, W + 0 * c, mask=(c < max_padded) & ~head)
        for start in range(W, n_blocks, 32 * NW):
            c = start + gl.arange(0, 32 * NW, layout=LF)
            gl.store(block_expert_ptr + c, -1 + 0 * c, mask=c < n_blocks)

    @gluon.jit
    def _route(x_g, x_e, bias_g, bias_e, r, scale, w_ptr, ids_ptr, sorted_ptr, block_expert_ptr, total_ptr,
               E: gl.constexpr, GS: gl.constexpr, TOPK_GROUP: gl.constexpr, TOP_K: gl.constexpr, KR: gl.constexpr,
               SHARED: gl.constexpr, SP: gl.constexpr, BM: gl.constexpr, ALIGN: gl.constexpr, NW: gl.constexpr):
        """Steps 1-4 of the module docstring for row r, from its logits and bias in `_load_row`'s layouts.
        With ALIGN the caller has stored (or ordered before this) the sentinels: `_fill_sentinels`."""
        G: gl.constexpr = E // GS
        W: gl.constexpr = TOP_K + SHARED
        LG: gl.constexpr = gl.BlockedLayout([1, 1], [32 // GS, GS], [NW, 1], [1, 0])    # [G, GS], expert a thread
        L2: gl.constexpr = gl.BlockedLayout([1, GS], [32, 1], [NW, 1], [1, 0])         # [E, GS]: a row a thread
        RGG: gl.constexpr = gl.BlockedLayout([G, G], [1, 32], [1, NW], [1, 0])         # [G, G] in every thread
        LEK: gl.constexpr = gl.BlockedLayout([1, KR], [32, 1], [NW, 1], [1, 0])        # [E, KR]: a row a thread
        LI: gl.constexpr = gl.SliceLayout(1, LEK)                                        # [E]: expert a thread
        RK: gl.constexpr = gl.SliceLayout(0, LEK)                                        # [KR] in every thread
        i = gl.arange(0, E, layout=LI)
        i2 = gl.convert_layout(i, gl.SliceLayout(1, L2), assert_trivial=True)
        # 1. group scores and the order bits, into shared memory
        biased = _sigmoid(x_g) + bias_g
        m1, m2 = gl.reduce((biased, gl.full([G, GS], float("-inf"), gl.float32, LG)), 1, _top2)
        flat1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        flat2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        gscore_s = gl.allocate_shared_memory(gl.float32, [G], flat1, m1 + m2)
        o_s = gl.allocate_shared_memory(gl.int32, [G, GS], flat2, _ordered(biased))._reinterpret(gl.int32, [G, GS],
                                                                                             flat1)  # rows: `index`
        score = _sigmoid(x_e)
        o = _ordered(score + bias_e)                                                     # [E] (L2's rows)
        gl.thread_barrier()
        # 2. the kept groups (every thread ranks all G), then this expert's rank among their members
        gs_i = gscore_s.load(gl.SliceLayout(1, RGG))
        gs_j = gscore_s.load(gl.SliceLayout(0, RGG))
        gi = gl.arange(0, G, layout=gl.SliceLayout(1, RGG))
        gj = gl.arange(0, G, layout=gl.SliceLayout(0, RGG))
        beats = (gs_j[None, :] > gs_i[:, None]) | ((gs_j[None, :] == gs_i[:, None]) & (gj[None, :] < gi[:, None]))
        grank = gl.sum(beats.to(gl.int32), axis=1)                                       # [G]: a permutation
        jj = gl.arange(0, GS, layout=gl.SliceLayout(0, L2))
        rank = gl.zeros([E], gl.int32, gl.SliceLayout(1, L2))
        cand = rank != 0
        for q in gl.static_range(TOPK_GROUP):
            kg = gl.sum(gl.where(grank == q, gi, 0), axis=0)                              # the group of rank q
            row = o_s.index(kg).load(gl.SliceLayout(0, L2))                               # [GS], every thread
            ej = kg * GS + jj
            wins = (row[None, :] > o[:, None]) | ((row[None, :] == o[:, None]) & (ej[None, :] < i2[:, None]))
            rank += gl.sum(wins.to(gl.int32), axis=1)
            cand = cand | (i2 // GS == kg)
        selected = gl.convert_layout(cand & (rank < TOP_K), LI, assert_trivial=True)
        rank = gl.convert_layout(rank, LI, assert_trivial=True)
        score = gl.convert_layout(score, LI, assert_trivial=True)
        # 3. the picks in order, in every thread
        kk = gl.arange(0, KR, layout=RK)
        hit = selected[:, None] & (rank[:, None] == kk[None, :])                           # [E, KR]
        picked, ids = gl.reduce((gl.where(hit, score[:, None], float("-inf")), gl.where(hit, i[:, None], -1)), 0,
                                _pick)
        total = gl.sum(gl.where(kk == 0, picked, 0.0), axis=0)                           # one by one, pick order
        for p in gl.static_range(1, TOP_K):
            total = total + gl.sum(gl.where(kk == p, picked, 0.0), axis=0)
        weights = picked / (total + 1e-20) * scale
        out = r * W + kk
        gl.store(w_ptr + out, weights, mask=kk < TOP_K)
        gl.store(ids_ptr + out, ids, mask=kk < TOP_K)
        if SHARED > 0:   # the fused shared experts: ids E .. E+S-1, weight 1.0, after the k picks
            LS1: gl.constexpr = gl.BlockedLayout([SP], [32], [NW], [0])
            s = gl.arange(0, SP, layout=LS1)
            gl.store(w_ptr + r * W + TOP_K + s, 1.0 + 0.0 * s.to(gl.float32), mask=s < SHARED)
            gl.store(ids_ptr + r * W + TOP_K + s, E + s, mask=s < SHARED)
            if ALIGN:
                gl.store(sorted_ptr + (TOP_K + s) * BM, TOP_K + s, mask=s < SHARED)
                gl.store(block_expert_ptr + TOP_K + s, E + s, mask=s < SHARED)
        if ALIGN:   # 4. one pair a segment, segments in expert id order
            seg = gl.sum(((kk < TOP_K)[None, :] & (ids[None, :] < i[:, None])).to(gl.int32), axis=1)
            gl.store(sorted_ptr + seg * BM, rank, mask=selected)
            gl.store(block_expert_ptr + seg, i, mask=selected)
            gl.store(total_ptr + i * 0, W * BM + i * 0, mask=i == 0)

    @gluon.jit
    def _router_gluon_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, sorted_ptr, block_expert_ptr, total_ptr,
                             stride_row, scale, max_padded, n_blocks,
                             E: gl.constexpr, GS: gl.constexpr, TOPK_GROUP: gl.constexpr, TOP_K: gl.constexpr,
                             KR: gl.constexpr, SHARED: gl.constexpr, SP: gl.constexpr, BM: gl.constexpr,
                             ALIGN: gl.constexpr, PDL: gl.constexpr, EARLY_TRIGGER: gl.constexpr,
                             NW: gl.constexpr):
        r = gl.program_id(0)
        bias_g, bias_e = _load_row(bias_ptr, E, GS, NW, "")                              # a weight: before the wait
        if PDL:
            gluon_gdc_wait()
            if EARLY_TRIGGER:
                gluon_gdc_launch_dependents()
        x_g, x_e = _load_row(logits_ptr + r.to(gl.int64) * stride_row, E, GS, NW, "")
        if PDL:
            if not EARLY_TRIGGER:
                gluon_gdc_launch_dependents()
        if ALIGN:   # sentinels first (their stores overlap the routing): every cell but the W segment heads
            _fill_sentinels(sorted_ptr, block_expert_ptr, max_padded, n_blocks, TOP_K + SHARED, BM, NW)
        _route(x_g, x_e, bias_g, bias_e, r, scale, w_ptr, ids_ptr, sorted_ptr, block_expert_ptr, total_ptr,
               E, GS, TOPK_GROUP, TOP_K, KR, SHARED, SP, BM, ALIGN, NW)


def _constexprs(num_routed: int, n_group: int, topk_group: int, top_k: int, shared: int) -> dict:
    return dict(E=num_routed, GS=num_routed // n_group, TOPK_GROUP=topk_group, TOP_K=top_k,
                KR=max(2, triton.next_power_of_2(top_k)), SHARED=shared, SP=max(2, triton.next_power_of_2(shared)),
                NW=num_routed // 32)


def _launch(grid: int, args: tuple, consts: dict, pdl: bool, op: str) -> bool:
    """One launch of grid programs (a row each); a late trigger (kernels/pdl.py LATE_TRIGGER_ROWS[op]) fires after
    the logits' load, where the late trigger mode puts it."""
    early = TRIGGER == "early" and not late_trigger(op, pdl, grid)
    return guarded(lambda: _router_gluon_kernel[(grid,)](
        *args, **consts, PDL=pdl, EARLY_TRIGGER=early, num_warps=consts["NW"],
        **({"launch_pdl": True} if pdl else {})),
        FAILED, "the Gluon router (kernels/router_gluon.py)", "router.py's kernels", "LINGC_ROUTER_GLUON")


def router_topk(logits: torch.Tensor, bias: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, n_group: int,
                topk_group: int, top_k: int, scale: float, shared: int, pdl: bool) -> bool:
    """router.py's router_topk into weights / ids [N, k + S] (the caller checked `eligible`); False where the
    kernel does not compile (the caller then runs router.py's kernel)."""
    N, E = logits.shape
    consts = _constexprs(E, n_group, topk_group, top_k, shared)
    return _launch(N, (logits, bias, weights, ids, ids, ids, ids, logits.stride(0), float(scale), 0, 0),
                   dict(consts, BM=1, ALIGN=False), pdl, "router_topk")


def router_align(logits: torch.Tensor, bias: torch.Tensor, outputs: tuple, n_group: int, topk_group: int,
                 top_k: int, scale: float, shared: int, block_m: int, max_padded: int, n_blocks: int,
                 pdl: bool) -> bool:
    """router.py's router_align of ONE row into outputs = (weights, ids, sorted_pairs, block_expert, total); False
    where the kernel does not compile."""
    E = logits.shape[1]
    consts = _constexprs(E, n_group, topk_group, top_k, shared)
    return _launch(1, (logits, bias, *outputs, logits.stride(0), float(scale), max_padded, n_blocks),
                   dict(consts, BM=block_m, ALIGN=True), pdl, "router_align")
