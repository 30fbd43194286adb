"""add_rmsnorm_router (fuse_norm_router): the residual add + RMSNorm, the gate GEMV and the router in ONE launch.

Unfused, a MoE layer's router front is two dependent launches: add_rmsnorm_linear (kernels/linear.py: the norm in
the gate GEMV's prologue, fp32 logits) and router_align / router_topk (kernels/router_gluon.py on sm_90). In the H200
decode step they take 2.59 + 2.09 us a layer for 0.4 MB of gate weight (verify: 2.87 + 2.41;
bench/results/launches-kda-tma-h200-20261204.json), 23 times a step: each pays a launch, a PDL wait and a
dependent round trip through L2 for a few KB of data. Here (Gluon, sm_90) one grid (G, N) does it:

    program (g, r), row r, experts [g * EPP, (g + 1) * EPP) of E:
        before the PDL wait: its [EPP, h] slice of the gate weight and the norm weight into registers, the bias
        after it: residual and x rows, new_residual = residual + x, normed = rmsnorm(new_residual) * w (every
        program computes the row's norm; program g = 0 stores normed and new_residual), its EPP fp32 logits
        = gate rows . normed, stored to a [N, E] scratch row; program (0, 0) of an align stores the sentinels
        ticket: CTA barrier, then an acq_rel gpu-scope atomic add on row r's int32 counter; the program drawing
        ticket G - 1 reloads the row's E logits through L2 (.cg), routes the row with router_gluon's `_route`
        (the same code as the Gluon router kernel, so the same bits from the same logits) and stores 0 back to the
        counter for the next launch (kernels/linear.py `_finish`, router.py "split" use the pattern)

No program waits for another. Row r's bits depend only on row r (each row has its own programs and counter), so a
verify chain's rows get decode's bits: row invariance, hence greedy NEXTN == plain decoding.

Numerics: possibly other bits than the two kernels it replaces. The logits are a different fp32 sum over h (the
gate rows' products in this kernel's layout, vs the FMA GEMV's tiles) before their rounding to the gate's dtype, and
the norm's sum of squares likewise. So normed (new_residual is exact either way: one fp32 add rounded once) and the
routing may differ from the unfused kernels where a sum lands on the other side of a rounding boundary (none did in
the H200 check below). The pass that makes the op says so (changes_numerics). Where the Gluon kernel does not run
(the interpreter, other GPUs, more than MAX_ROWS rows, a shape `eligible` rejects, a compile failure) the launcher
runs the two kernels it replaces (kernels/linear.py's and kernels/router.py's own bits).

Register budget: a program holds EPP x next_pow2(h) gate values (bf16: EPP = WEIGHT_ELEMENTS // next_pow2(h), so
4 rows of 2048 at Ling-3.0-tiny's h = 1536, 32 programs a row: 32 registers a thread at E / 32 = 4 warps, the
router's warp count). The logits follow lingc.linear: x cast to the gate's dtype, the fp32 sum rounded to the gate's
dtype, then widened to fp32 (what add_rmsnorm_linear with out_dtype fp32 returns).

LINGC_NORM_ROUTER_GLUON=0 keeps the two kernels (the launcher's fallback) wherever the pass has fused the op.
LINGC_NORM_ROUTER_CLUSTER=1 runs kernels/norm_router_cluster.py's CUDA C++ kernel first where it is eligible: the same
op on one thread-block cluster a row, the logits handed on through distributed shared memory instead of the ticket.

Measured on the H200 (2026-12-05, bench/kernel_norm_router.py, kernels-norm-router-h200-20261205-b.json): over 4
seeds the same ids, weights, normed and new_residual bits as the two kernels, row invariant, deterministic, PDL on ==
off; alone, PDL on, 3.87 vs 3.82 us at one row and 4.46 vs 4.26 at six. In the step (fuse_norm_router on,
step-ab-h200-20261205-b.json) greedy decode level, greedy verify +4 us: the ticket's atomic round trip and the last
program's reload of the logits through L2 cost about what the kernel boundary did. Hence the pass stays opt-in.
(The first version kept fp32 logits unrounded and 8 gate rows a program: 4.14 vs 3.79 us, other weights; -a.json.)
"""

from __future__ import annotations

import torch
import triton

from lingc.knobs import env_flag
from lingc.kernels import norm_router_cluster, router as router_kernels, router_gluon
from lingc.kernels import linear as linear_kernels
from lingc.kernels.gluon_launch import guarded
from lingc.kernels.pdl import TRIGGER, pdl_supported
from lingc.kernels.workspace import counters as _counters
from lingc.ops.moe import align_sizes
from lingc.ops.norm_router import MAX_ROWS, no_align

try:  # Gluon ships with Triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from lingc.kernels.pdl import gluon_gdc_launch_dependents, gluon_gdc_wait
    from lingc.kernels.router_gluon import _fill_sentinels, _load_row, _route
    HAVE_GLUON = router_gluon.HAVE_GLUON
except ImportError:  # pragma: no cover - depends on the Triton build
    HAVE_GLUON = False

ENABLED = env_flag("LINGC_NORM_ROUTER_GLUON", True)
FAILED: list[str] = []       # the first compile failure's message; once set, every launch runs the two kernels
MAX_HIDDEN = 8192            # next_pow2(h) a program's registers hold (with one gate row at least)
WEIGHT_ELEMENTS = 8192       # gate values a program holds (EPP x next_pow2(h); 2-byte weights, half that for fp32)
VEC = 8                      # contiguous h elements a thread loads (16 B of bf16)
COUNTERS = "norm_router"     # kernels/workspace.py owner of the per-row ticket counters


def experts_per_program(num_routed: int, hidden: int, weight_bytes: int) -> int:
    """EPP: the gate rows a program holds (a power of two dividing E, at least the warps so no warp idles)."""
    budget = WEIGHT_ELEMENTS * 2 // weight_bytes // triton.next_power_of_2(hidden)
    epp = 1
    while epp * 2 <= budget and num_routed % (epp * 2) == 0:
        epp *= 2
    return epp


def eligible(x: torch.Tensor, gate_weight: torch.Tensor, n_group: int, topk_group: int, top_k: int) -> bool:
    """Whether the fused Gluon kernel runs (module docstring); the arguments are the op's, already checked."""
    if not (ENABLED and HAVE_GLUON and not FAILED):
        return False
    num_routed, hidden = gate_weight.shape
    rows = x.numel() // hidden if hidden else 0
    if not 1 <= rows <= MAX_ROWS or triton.next_power_of_2(hidden) > MAX_HIDDEN:
        return False
    return router_gluon.eligible(x.device, num_routed, n_group, topk_group, top_k) \
        and experts_per_program(num_routed, hidden, gate_weight.element_size()) >= num_routed // 32   # sm_90+, warps


if HAVE_GLUON:
    @gluon.jit
    def _norm_router_kernel(res_ptr, x_ptr, nw_ptr, gw_ptr, bias_ptr, normed_ptr, res_out_ptr, logits_ptr, count_ptr,
                            w_ptr, ids_ptr, sorted_ptr, block_expert_ptr, total_ptr,
                            stride_res, stride_x, K, eps, scale, max_padded, n_blocks,
                            EPP: gl.constexpr, K_BLOCK: gl.constexpr, VEC: gl.constexpr,
                            E: gl.constexpr, GS: gl.constexpr, TOPK_GROUP: gl.constexpr, TOP_K: gl.constexpr,
                            KR: gl.constexpr, SHARED: gl.constexpr, SP: gl.constexpr, BM: gl.constexpr,
                            ALIGN: gl.constexpr, PDL: gl.constexpr, EARLY_TRIGGER: gl.constexpr, NW: gl.constexpr):
        LW: gl.constexpr = gl.BlockedLayout([1, VEC], [1, 32], [NW, 1], [1, 0])    # [EPP, K_BLOCK]: lanes along h
        LK: gl.constexpr = gl.SliceLayout(0, LW)                                    # [K_BLOCK], in every warp
        LE: gl.constexpr = gl.SliceLayout(1, LW)                                    # [EPP]
        g = gl.program_id(0)
        r = gl.program_id(1)
        k = gl.arange(0, K_BLOCK, layout=LK)
        kmask = k < K
        e = g * EPP + gl.arange(0, EPP, layout=LE)
        # weights (written by no kernel): before the wait
        gate = gl.load(gw_ptr + e[:, None].to(gl.int64) * K + k[None, :], mask=kmask[None, :], other=0.0)
        nw = gl.load(nw_ptr + k, mask=kmask, other=0.0).to(gl.float32)
        bias_g, bias_e = _load_row(bias_ptr, E, GS, NW, "")
        if PDL:
            gluon_gdc_wait()
            if EARLY_TRIGGER:
                gluon_gdc_launch_dependents()
        row = r.to(gl.int64)
        res = gl.load(res_ptr + row * stride_res + k, mask=kmask, other=0.0)
        x = gl.load(x_ptr + row * stride_x + k, mask=kmask, other=0.0)
        if PDL:
            if not EARLY_TRIGGER:
                gluon_gdc_launch_dependents()
        new_res = (res.to(gl.float32) + x.to(gl.float32)).to(res.dtype)             # one fp32 add, rounded once
        hf = new_res.to(gl.float32)
        rstd = gl.rsqrt(gl.sum(hf * hf, axis=0) / K + eps)
        normed = (nw * (hf * rstd).to(res.dtype).to(gl.float32)).to(res.dtype)
        first = g == 0
        gl.store(res_out_ptr + row * K + k, new_res, mask=kmask & first)
        gl.store(normed_ptr + row * K + k, normed, mask=kmask & first)
        wdt: gl.constexpr = gw_ptr.dtype.element_ty
        xw = normed.to(wdt).to(gl.float32)                                           # lingc.linear: x in w's dtype
        logits = gl.sum(gate.to(gl.float32) * xw[None, :], axis=1).to(wdt).to(gl.float32)   # y in w's dtype, fp32
        gl.store(logits_ptr + row * E + e, logits)
        if ALIGN:
            if g == 0:   # ordered before the routing's scatters by the ticket chain (release here, acquire there)
                _fill_sentinels(sorted_ptr, block_expert_ptr, max_padded, n_blocks, TOP_K + SHARED, BM, NW)
        gl.thread_barrier()             # every thread's stores come before the ticket (release) is taken
        ticket = gl.atomic_add(count_ptr + r, 1, sem="acq_rel", scope="gpu")
        if ticket == gl.num_programs(0) - 1:   # the row's other programs have stored their logits
            x_g, x_e = _load_row(logits_ptr + row * E, E, GS, NW, ".cg")
            _route(x_g, x_e, bias_g, bias_e, r, scale, w_ptr, ids_ptr, sorted_ptr, block_expert_ptr, total_ptr,
                   E, GS, TOPK_GROUP, TOP_K, KR, SHARED, SP, BM, ALIGN, NW)
            gl.store(count_ptr + r, 0)  # ready for the next launch


def _fused(residual, x, norm_weight, eps, gate_weight, expert_bias, n_group, topk_group, top_k, scale, num_experts,
           block_m, fused_shared, pdl) -> tuple | None:
    """The Gluon launch into fresh outputs, or None where it does not compile (the caller runs the two kernels)."""
    num_routed, hidden = gate_weight.shape
    rows = x.numel() // hidden
    dev = x.device
    res2, x2 = residual.reshape(rows, hidden), x.reshape(rows, hidden)
    if res2.stride(-1) != 1 or x2.stride(-1) != 1:
        res2, x2 = res2.contiguous(), x2.contiguous()
    normed = torch.empty(x.shape, dtype=x.dtype, device=dev)
    new_residual = torch.empty(residual.shape, dtype=residual.dtype, device=dev)
    logits = torch.empty((rows, num_routed), dtype=torch.float32, device=dev)
    width = top_k + fused_shared
    weights = torch.empty((rows, width), dtype=torch.float32, device=dev)
    ids = torch.empty((rows, width), dtype=torch.int32, device=dev)
    align = block_m > 0
    if align:
        max_padded, n_blocks = align_sizes(rows * width, num_experts, block_m)
        aligned = (torch.empty((max_padded,), dtype=torch.int32, device=dev),
                   torch.empty((n_blocks,), dtype=torch.int32, device=dev), torch.empty((1,), dtype=torch.int32,
                                                                                        device=dev))
    else:
        max_padded, n_blocks, aligned = 0, 0, no_align(logits)
    epp = experts_per_program(num_routed, hidden, gate_weight.element_size())
    consts = dict(router_gluon._constexprs(num_routed, n_group, topk_group, top_k, fused_shared),
                  BM=max(block_m, 1), ALIGN=align, EPP=epp, K_BLOCK=triton.next_power_of_2(hidden), VEC=VEC)
    scratch = aligned if align else (ids, ids, ids)
    args = (res2, x2, norm_weight, gate_weight.contiguous(), expert_bias, normed, new_residual, logits,
            _counters(dev, COUNTERS, MAX_ROWS), weights, ids, *scratch, res2.stride(0), x2.stride(0), hidden,
            float(eps), float(scale), max_padded, n_blocks)
    ok = guarded(lambda: _norm_router_kernel[(num_routed // epp, rows)](
        *args, **consts, PDL=pdl, EARLY_TRIGGER=TRIGGER == "early", num_warps=consts["NW"],
        **({"launch_pdl": True} if pdl else {})),
        FAILED, "the fused norm + gate + router (kernels/norm_router.py)", "the two kernels it fuses",
        "LINGC_NORM_ROUTER_GLUON")
    return (normed, new_residual, weights, ids, *aligned) if ok else None


def add_rmsnorm_router(residual: torch.Tensor, x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       gate_weight: torch.Tensor, expert_bias: torch.Tensor, n_group: int, topk_group: int,
                       top_k: int, routed_scaling_factor: float, num_experts: int, block_m: int, fused_shared: int,
                       *, pdl: bool = False) -> tuple[torch.Tensor, ...]:
    """torch.ops.lingc.add_rmsnorm_router's outputs: the cluster kernel (kernels/norm_router_cluster.py, opt-in) or the
    fused Gluon kernel where eligible, else add_rmsnorm_linear's kernel (fp32 logits) then router_align's (block_m > 0)
    or router_topk's."""
    if residual.shape != x.shape or gate_weight.dim() != 2 or gate_weight.shape[1] != x.shape[-1] \
            or norm_weight.shape != (x.shape[-1],):
        raise ValueError(f"add_rmsnorm_router: want residual and x [..., h] of one shape, norm_weight [h] and "
                         f"gate_weight [E, h], got {list(residual.shape)}, {list(x.shape)}, "
                         f"{list(norm_weight.shape)}, {list(gate_weight.shape)}")
    if block_m < 0:
        raise ValueError(f"add_rmsnorm_router: block_m must be >= 0 (0: the router_topk form), got {block_m}")
    pdl = pdl and pdl_supported(x.device)
    if norm_router_cluster.eligible(x, gate_weight, n_group, topk_group, top_k, fused_shared):
        out = norm_router_cluster.add_rmsnorm_router(residual, x, norm_weight, eps, gate_weight, expert_bias, n_group,
                                                     topk_group, top_k, routed_scaling_factor, num_experts, block_m,
                                                     fused_shared, pdl)
        if out is not None:
            return out
    if eligible(x, gate_weight, n_group, topk_group, top_k):
        out = _fused(residual, x, norm_weight, eps, gate_weight, expert_bias, n_group, topk_group, top_k,
                     routed_scaling_factor, num_experts, block_m, fused_shared, pdl)
        if out is not None:
            return out
    logits, normed, new_residual = linear_kernels.add_rmsnorm_linear(residual, x, norm_weight, eps, gate_weight,
                                                                     torch.float32, True, pdl=pdl)
    logits = logits.reshape(-1, gate_weight.shape[0])
    route = (logits, expert_bias, n_group, topk_group, top_k, routed_scaling_factor)
    if block_m > 0:
        routed = router_kernels.router_align(*route, num_experts, block_m, fused_shared, pdl=pdl)
    else:
        routed = (*router_kernels.router_topk(*route, fused_shared, pdl=pdl), *no_align(logits))
    return (normed, new_residual, *routed)


def add_rmsnorm_router_ref(*args) -> tuple[torch.Tensor, ...]:
    """lingc's reference: the composition (lingc/ops/norm_router.py)."""
    return torch.ops.lingc.add_rmsnorm_router(*args)


LOWERINGS = {"add_rmsnorm_router": add_rmsnorm_router}
