"""GPU check and timing of lingc.kernels.moe (moe_up, silu_and_mul, moe_up_act, moe_down, moe_combine) and
lingc.kernels.moe_align at the Ling-3.0-tiny decode shapes, against the torch reference ops.

Shapes: h=1536, I=512, E=128, top-8, block_m=16 (lingc.modules.MOE_BLOCK_M), bf16 weights w13 [E, 2I, h] and
w2 [E, h, I] (3 MB per expert each); T=1 (decode: 8 pairs on 8 experts) and T=6 (verify: 48 pairs). Routing is
random with 8 distinct experts per token; each timed call uses its own routing (16 of them), and at T=1 the 16
routings partition the 128 experts, so no expert repeats within one pass.

Each row: correctness vs the reference op on the GPU (max_abs_err, bit_exact), pdl=True == pdl=False bit for
bit, and graph-replay times (bench/timing.py):
    time_us           calls alternating over `cold_copies` = 2 weight copies (400 MB per stack) with different routings:
                      cold weights, the number that matters
    time_one_copy_us  one weight copy, different routings (the experts read still change from call to call)
    ref_time_us       the reference op (torch.ops.lingc.*) over the same calls as time_us
bytes = distinct experts read x expert bytes (+ activations), averaged over the calls; gbps = bytes / time_us.
Extra keys: fused_eq_unfused (moe_up_act == silu_and_mul(moe_up) bit for bit, for limit 0 on the plain inputs
and limit 7 on 20x inputs that bind the clamp), row_invariant (moe_chain: token 0 alone == token 0 inside the
T-token call, bit for bit), unfused_time_us (moe_up + silu_and_mul), and for moe_combine whether each summation
order (sequential_bit_exact, interleave4_bit_exact) reproduces the reference's bits.
Rows "moe_chain" time align -> up_act -> down -> combine with PDL (fused) against align -> up -> silu_and_mul ->
down -> combine (unfused) and the reference ops. Rows "tune:*" time other tilings of moe_up_act / moe_down
(same_bits: equal to the default tiling's output).
    python3 bench/kernel_moe.py            # JSON lines
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import cold_copies, graph_time_or_none, kernel_row, nbytes  # noqa: E402

H, INTER, E, TOP_K, BLOCK_M = 1536, 512, 128, 8, 16
CALLS = 16                      # distinct routings per timed graph
COPIES = cold_copies(E * 2 * INTER * H * 2)   # weight copies alternated for cold timings: 2 x 400 MB
LIMIT_CLAMP = 7.0
TUNE = [(16, 128, 4, 4), (32, 64, 4, 4), (32, 256, 4, 3), (64, 128, 4, 4), (64, 64, 4, 5), (32, 128, 2, 4),
        (128, 64, 4, 4)]        # (block_n, block_k, num_warps, num_stages)
# the up-GEMM's swap-AB tilings (GemmConfig.swap_ab: the weight tile as the MMA's M operand; bit-identical on the H200)
TUNE_UP_SWAP = [(64, 128, 4, 4, True), (64, 128, 4, 3, True), (64, 128, 4, 6, True), (128, 128, 4, 4, True),
                (128, 128, 8, 4, True), (64, 64, 4, 6, True)]


def _time(calls: list[Callable]) -> float | None:
    """Median graph-replay time per call, or None if the calls cannot be captured."""
    return graph_time_or_none(calls)


_row = kernel_row


def _err(got: torch.Tensor, want: torch.Tensor) -> tuple[float, bool, bool]:
    """(max |diff|, bit-exact, close: within 1/64 relative or 1e-3 of the output's scale; bf16 GEMMs differ
    from the reference's summation order by an ulp or two)."""
    diff = (got.float() - want.float()).abs()
    scale = want.float().abs().max().item()
    close = bool(torch.allclose(got.float(), want.float(), rtol=1 / 64, atol=1e-3 * scale)) and not got.isnan().any()
    return diff.max().item(), torch.equal(got, want), close


class Problem:
    """Weights (COPIES copies of each stack), CALLS routings aligned by the kernel, and activations for T tokens."""

    def __init__(self, T: int, dev: torch.device, g: torch.Generator, stacks: dict):
        from lingc.kernels.moe_align import moe_align
        self.T, self.NP = T, T * TOP_K
        self.w13, self.w13i, self.w2 = stacks["w13"], stacks["w13i"], stacks["w2"]
        perm = torch.randperm(E, device=dev, generator=g)
        self.ids = []
        for c in range(CALLS):
            if T == 1:                                            # the 16 decode routings partition the experts
                self.ids.append(perm[c * TOP_K % E:][:TOP_K].view(1, TOP_K).to(torch.int32))
            else:
                self.ids.append(torch.stack([torch.randperm(E, device=dev, generator=g)[:TOP_K]
                                             for _ in range(T)]).to(torch.int32))
        self.align = [moe_align(i, E, BLOCK_M) for i in self.ids]
        self.x = [torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16) for _ in range(CALLS)]
        self.act = [torch.randn(self.NP, INTER, device=dev, generator=g).mul(0.3).to(torch.bfloat16)
                    for _ in range(CALLS)]
        self.down = [torch.randn(self.NP, H, device=dev, generator=g).mul(0.1).to(torch.bfloat16)
                     for _ in range(CALLS)]
        self.weights = [torch.rand(T, TOP_K, device=dev, generator=g) for _ in range(CALLS)]
        self.shared = [torch.randn(T, H, device=dev, generator=g).mul(0.1).to(torch.bfloat16) for _ in range(CALLS)]
        self.distinct = sum(int(torch.unique(i).numel()) for i in self.ids) / CALLS

    @property
    def shape(self) -> str:
        return f"T={self.T} h={H} I={INTER} E={E} k={TOP_K} bm={BLOCK_M}"

    def expert_bytes(self, stack: torch.Tensor) -> int:
        return int(self.distinct * stack[0][0].numel() * stack[0].element_size())

    def token0(self) -> Problem:
        """Token 0 of call 0 alone (its routing and inputs): the decode step inside this verify call."""
        q = Problem.__new__(Problem)
        q.__dict__.update(self.__dict__)
        q.T, q.NP = 1, TOP_K
        q.ids, q.x, q.weights, q.shared = ([a[0][:1]] for a in (self.ids, self.x, self.weights, self.shared))
        return q

    def calls(self, fn: Callable, one_copy: bool = False) -> list[Callable]:
        """One closure per routing c: fn(c, weight copy), the copy alternating unless one_copy."""
        return [lambda c=c: fn(c, 0 if one_copy else c % COPIES) for c in range(CALLS)]


def _stacks(dev: torch.device, g: torch.Generator) -> dict:
    from lingc.kernels.moe import interleave_w13
    w13 = [torch.randn(E, 2 * INTER, H, device=dev, generator=g).mul(0.02).to(torch.bfloat16) for _ in range(COPIES)]
    w2 = [torch.randn(E, H, INTER, device=dev, generator=g).mul(0.02).to(torch.bfloat16) for _ in range(COPIES)]
    return {"w13": w13, "w13i": [interleave_w13(w) for w in w13], "w2": w2}


def _gemm_rows(p: Problem) -> list[dict]:
    from lingc.kernels.moe import (moe_down, moe_down_ref, moe_up, moe_up_act, moe_up_act_ref, moe_up_ref,
                                   silu_and_mul, silu_and_mul_ref)
    rows = []
    al, x, act = p.align[0], p.x[0], p.act[0]
    up_bytes = p.expert_bytes(p.w13) + nbytes(x) + p.NP * 2 * INTER * 2
    act_bytes = p.expert_bytes(p.w13) + nbytes(x) + p.NP * INTER * 2
    down_bytes = p.expert_bytes(p.w2) + nbytes(act) + p.NP * H * 2

    got = moe_up(x, p.w13[0], *al, TOP_K, BLOCK_M)
    err, exact, close = _err(got, moe_up_ref(x, p.w13[0], *al, TOP_K, BLOCK_M))
    pdl_eq = torch.equal(got, moe_up(x, p.w13[0], *al, TOP_K, BLOCK_M, pdl=True))
    rows.append(_row("moe_up", p.shape, close, err, exact, pdl_eq,
                     _time(p.calls(lambda c, w: moe_up(p.x[c], p.w13[w], *p.align[c], TOP_K, BLOCK_M, pdl=True))),
                     _time(p.calls(lambda c, w: moe_up_ref(p.x[c], p.w13[w], *p.align[c], TOP_K, BLOCK_M))),
                     up_bytes, distinct_experts=p.distinct,
                     time_one_copy_us=_time(p.calls(lambda c, w: moe_up(p.x[c], p.w13[w], *p.align[c], TOP_K,
                                                                        BLOCK_M, pdl=True), one_copy=True))))

    h_up = got
    for limit in (0.0, LIMIT_CLAMP):
        got_act = silu_and_mul(h_up * (20 if limit else 1), limit)
        err, exact, close = _err(got_act, silu_and_mul_ref(h_up * (20 if limit else 1), limit))
        rows.append(_row("silu_and_mul", f"{p.shape} limit={limit}", close, err, exact,
                         torch.equal(got_act, silu_and_mul(h_up * (20 if limit else 1), limit, pdl=True)),
                         _time([lambda c=c: silu_and_mul(h_up, limit, pdl=True) for c in range(CALLS)]),
                         _time([lambda c=c: silu_and_mul_ref(h_up, limit) for c in range(CALLS)]),
                         p.NP * 3 * INTER * 2))

    # fused vs unfused bits: plain inputs, limit 0; 20x inputs, limit 7 (the clamp binds on both factors)
    fused_eq, bound = True, False
    for scale, limit in ((1, 0.0), (20, LIMIT_CLAMP)):
        xs = (x.float() * scale).to(torch.bfloat16)
        up = moe_up(xs, p.w13[0], *al, TOP_K, BLOCK_M)
        fused = moe_up_act(xs, p.w13i[0], *al, TOP_K, BLOCK_M, limit)
        fused_eq &= torch.equal(fused, silu_and_mul(up, limit))
        if limit:
            bound = bool((up[:, INTER:].float().abs() > limit).any())
    got = moe_up_act(x, p.w13i[0], *al, TOP_K, BLOCK_M, 0.0)
    err, exact, close = _err(got, moe_up_act_ref(x, p.w13i[0], *al, TOP_K, BLOCK_M, 0.0))
    pdl_eq = torch.equal(got, moe_up_act(x, p.w13i[0], *al, TOP_K, BLOCK_M, 0.0, pdl=True))

    def unfused(c: int, w: int) -> torch.Tensor:
        return silu_and_mul(moe_up(p.x[c], p.w13[w], *p.align[c], TOP_K, BLOCK_M, pdl=True), 0.0, pdl=True)

    rows.append(_row("moe_up_act", p.shape, close and fused_eq, err, exact, pdl_eq,
                     _time(p.calls(lambda c, w: moe_up_act(p.x[c], p.w13i[w], *p.align[c], TOP_K, BLOCK_M, 0.0,
                                                           pdl=True))),
                     _time(p.calls(lambda c, w: moe_up_act_ref(p.x[c], p.w13i[w], *p.align[c], TOP_K, BLOCK_M,
                                                               0.0))),
                     act_bytes, distinct_experts=p.distinct, fused_eq_unfused=fused_eq, clamp_binds=bound,
                     unfused_time_us=_time(p.calls(unfused)),
                     time_one_copy_us=_time(p.calls(lambda c, w: moe_up_act(p.x[c], p.w13i[w], *p.align[c], TOP_K,
                                                                            BLOCK_M, 0.0, pdl=True), one_copy=True))))

    got = moe_down(act, p.w2[0], *al, BLOCK_M)
    err, exact, close = _err(got, moe_down_ref(act, p.w2[0], *al, BLOCK_M))
    pdl_eq = torch.equal(got, moe_down(act, p.w2[0], *al, BLOCK_M, pdl=True))
    rows.append(_row("moe_down", p.shape, close, err, exact, pdl_eq,
                     _time(p.calls(lambda c, w: moe_down(p.act[c], p.w2[w], *p.align[c], BLOCK_M, pdl=True))),
                     _time(p.calls(lambda c, w: moe_down_ref(p.act[c], p.w2[w], *p.align[c], BLOCK_M))),
                     down_bytes, distinct_experts=p.distinct,
                     time_one_copy_us=_time(p.calls(lambda c, w: moe_down(p.act[c], p.w2[w], *p.align[c], BLOCK_M,
                                                                          pdl=True), one_copy=True))))
    return rows


def _combine_align_rows(p: Problem) -> list[dict]:
    from lingc.kernels.moe import INTERLEAVE4, SEQUENTIAL, moe_combine, moe_combine_ref
    from lingc.kernels.moe_align import moe_align, moe_align_ref
    rows = []
    args = (p.down[0], p.weights[0], p.shared[0])
    got, want = moe_combine(*args), moe_combine_ref(*args)
    err, exact, close = _err(got, want)
    bits = {name: torch.equal(moe_combine(*args, order=o), want)
            for name, o in (("sequential_bit_exact", SEQUENTIAL), ("interleave4_bit_exact", INTERLEAVE4))}
    rows.append(_row("moe_combine", p.shape, close, err, exact, torch.equal(got, moe_combine(*args, pdl=True)),
                     _time([lambda c=c: moe_combine(p.down[c], p.weights[c], p.shared[c], pdl=True)
                            for c in range(CALLS)]),
                     _time([lambda c=c: moe_combine_ref(p.down[c], p.weights[c], p.shared[c]) for c in range(CALLS)]),
                     nbytes(p.down[0], p.weights[0], p.shared[0]) + nbytes(p.shared[0]), **bits))
    got, want = moe_align(p.ids[0], E, BLOCK_M), moe_align_ref(p.ids[0], E, BLOCK_M)
    exact = all(torch.equal(a, b) for a, b in zip(got, want))
    pdl_eq = all(torch.equal(a, b) for a, b in zip(got, moe_align(p.ids[0], E, BLOCK_M, pdl=True)))
    rows.append(_row("moe_align", p.shape, exact, 0.0 if exact else float("inf"), exact, pdl_eq,
                     _time([lambda c=c: moe_align(p.ids[c], E, BLOCK_M, pdl=True) for c in range(CALLS)]),
                     _time([lambda c=c: moe_align_ref(p.ids[c], E, BLOCK_M) for c in range(CALLS)]),
                     nbytes(p.ids[0], *got)))
    return rows


def _combine_norm_rows(p: Problem) -> list[dict]:
    """combine_add_rmsnorm (fuse_combine_norm) vs moe_combine then add_rmsnorm (the kernels it replaces), without
    shared_out (fuse_shared_expert's form): bit for bit, PDL on == off, time of the pair vs the one launch."""
    from lingc.kernels.moe import combine_add_rmsnorm, moe_combine
    from lingc.kernels.rmsnorm import add_rmsnorm
    g = torch.Generator(device=p.down[0].device).manual_seed(5)
    residual = [torch.randn(1, p.T, H, device=p.down[0].device, generator=g).to(torch.bfloat16) for _ in range(CALLS)]
    norm_weight = (1 + 0.1 * torch.randn(H, device=p.down[0].device, generator=g)).to(torch.bfloat16)

    def fused(c: int, pdl: bool = True) -> tuple:
        return combine_add_rmsnorm(residual[c], p.down[c], p.weights[c], norm_weight, 1e-6, pdl=pdl)

    def pair(c: int) -> tuple:
        x = moe_combine(p.down[c], p.weights[c], pdl=True).view(residual[c].shape)
        return add_rmsnorm(residual[c], x, norm_weight, 1e-6, pdl=True)

    got, want = fused(0), pair(0)
    exact = all(torch.equal(a, b) for a, b in zip(got, want))
    ref = torch.ops.lingc.combine_add_rmsnorm(residual[0], p.down[0], p.weights[0], norm_weight, 1e-6)
    err, _, close = _err(got[0], ref[0])
    pdl_eq = all(torch.equal(a, b) for a, b in zip(got, fused(0, pdl=False)))
    return [_row("combine_add_rmsnorm", p.shape, exact and pdl_eq, err, exact, pdl_eq,
                 _time([lambda c=c: fused(c) for c in range(CALLS)]), None,
                 nbytes(p.down[0], p.weights[0], residual[0]) + 2 * nbytes(residual[0]),
                 bit_exact_vs_two_kernels=exact, close_to_reference=close,
                 two_kernels_time_us=_time([lambda c=c: pair(c) for c in range(CALLS)]))]


def _chain_rows(p: Problem) -> list[dict]:
    """align -> up_act -> down -> combine (PDL) vs the unfused chain vs the reference ops, cold weights."""
    from lingc.kernels.moe import (moe_combine, moe_combine_ref, moe_down, moe_down_ref, moe_up, moe_up_act,
                                   moe_up_act_ref, silu_and_mul)
    from lingc.kernels.moe_align import moe_align, moe_align_ref

    def fused(q: Problem, c: int, w: int) -> torch.Tensor:
        al = moe_align(q.ids[c], E, BLOCK_M, pdl=True)
        act = moe_up_act(q.x[c], q.w13i[w], *al, TOP_K, BLOCK_M, 0.0, pdl=True)
        return moe_combine(moe_down(act, q.w2[w], *al, BLOCK_M, pdl=True), q.weights[c], q.shared[c], pdl=True)

    def unfused(q: Problem, c: int, w: int) -> torch.Tensor:
        al = moe_align(q.ids[c], E, BLOCK_M, pdl=True)
        act = silu_and_mul(moe_up(q.x[c], q.w13[w], *al, TOP_K, BLOCK_M, pdl=True), 0.0, pdl=True)
        return moe_combine(moe_down(act, q.w2[w], *al, BLOCK_M, pdl=True), q.weights[c], q.shared[c], pdl=True)

    def reference(q: Problem, c: int, w: int) -> torch.Tensor:
        al = moe_align_ref(q.ids[c], E, BLOCK_M)
        act = moe_up_act_ref(q.x[c], q.w13i[w], *al, TOP_K, BLOCK_M, 0.0)
        return moe_combine_ref(moe_down_ref(act, q.w2[w], *al, BLOCK_M), q.weights[c], q.shared[c])

    got, want = fused(p, 0, 0), reference(p, 0, 0)
    err, exact, close = _err(got, want)
    eq_unfused = torch.equal(got, unfused(p, 0, 0))
    row_inv = torch.equal(got[:1], fused(p.token0(), 0, 0))   # a decode step == token 0 of the verify call
    bytes_ = p.expert_bytes(p.w13) + p.expert_bytes(p.w2)
    return [_row("moe_chain", p.shape, close and eq_unfused and row_inv, err, exact, True,
                 _time(p.calls(lambda c, w: fused(p, c, w))), _time(p.calls(lambda c, w: reference(p, c, w))),
                 bytes_, distinct_experts=p.distinct, fused_eq_unfused=eq_unfused, row_invariant=row_inv,
                 unfused_time_us=_time(p.calls(lambda c, w: unfused(p, c, w))))]


def _fused_rows(p: Problem) -> list[dict]:
    """kernels/moe_fused.py: align -> moe_fused (one persistent launch) vs align -> up_act -> down -> combine (PDL),
    both cold; bit-equality, row invariance (token 0 alone), and the same with the grid forced to 1 program."""
    from lingc.kernels.moe import moe_combine, moe_down, moe_up_act
    from lingc.kernels.moe_align import moe_align
    from lingc.kernels.moe_fused import device_counters, moe_fused

    def one(q: Problem, c: int, w: int, **kw) -> torch.Tensor:
        al = moe_align(q.ids[c], E, BLOCK_M, pdl=True)
        return moe_fused(q.x[c], q.w13i[w], q.w2[w], q.weights[c], *al, TOP_K, BLOCK_M, 0.0, q.shared[c], pdl=True,
                         **kw)

    def chain(q: Problem, c: int, w: int) -> torch.Tensor:
        al = moe_align(q.ids[c], E, BLOCK_M, pdl=True)
        act = moe_up_act(q.x[c], q.w13i[w], *al, TOP_K, BLOCK_M, 0.0, pdl=True)
        return moe_combine(moe_down(act, q.w2[w], *al, BLOCK_M, pdl=True), q.weights[c], q.shared[c], pdl=True)

    got, want = one(p, 0, 0), chain(p, 0, 0)
    equal = torch.equal(got, want)
    single = torch.equal(one(p, 0, 0, programs=1), want)
    row_inv = torch.equal(got[:1], one(p.token0(), 0, 0))
    again = all(torch.equal(one(p, 0, 0), want) for _ in range(20))          # the counters reset every launch
    zeroed = not bool(device_counters(got.device).any())
    err, exact, close = _err(got, want)
    bytes_ = p.expert_bytes(p.w13) + p.expert_bytes(p.w2)
    per_sm_us = {n: _time(p.calls(lambda c, w, n=n: one(p, c, w, per_sm=n))) for n in (1, 2, 4, 8, 16)}
    return [_row("moe_fused", p.shape, equal and single and row_inv and again and zeroed, err, exact, True,
                 _time(p.calls(lambda c, w: one(p, c, w))), None, bytes_, distinct_experts=p.distinct,
                 equal_to_chain=equal, one_program_equal=single, row_invariant=row_inv, repeat_equal=again,
                 counters_zero=zeroed, chain_time_us=_time(p.calls(lambda c, w: chain(p, c, w))),
                 time_us_by_programs_per_sm=per_sm_us)]


def _shared_early_rows(p: Problem) -> list[dict]:
    """moe_up_act's shared_last (SHARED_EARLY: the fused shared expert's tile before the PDL wait) against the usual
    launch, on a stack with a shared expert appended (expert E, every token's last pair): bits (the hint must change
    nothing) and time, cold. The chain as the step runs it: x written by a copy two launches back, the align (T = 1)
    or a stand-in for the router (T > 1: moe_align of the ids, whose outputs the pair grid ignores) just before."""
    from lingc.kernels.moe import moe_up_act, moe_up_act_pairs
    from lingc.kernels.moe_align import moe_align
    dev = p.x[0].device
    g = torch.Generator(device=dev).manual_seed(17)
    extra = torch.randn(1, 2 * INTER, H, device=dev, generator=g).mul(0.02).to(torch.bfloat16)
    stacks = [torch.cat([w, extra]) for w in p.w13i]
    ids = [torch.cat([i, torch.full((i.shape[0], 1), E, dtype=torch.int32, device=dev)], 1) for i in p.ids]
    x_src = [x.clone() for x in p.x]
    x = [torch.empty_like(v) for v in p.x]

    def chain(c: int, w: int, hint: bool) -> torch.Tensor:
        x[c].copy_(x_src[c])
        al = moe_align(ids[c], E + 1, BLOCK_M, pdl=True)
        if p.T == 1:
            return moe_up_act(x[c], stacks[w], *al, TOP_K + 1, BLOCK_M, 0.0, pdl=True, shared_last=hint)
        return moe_up_act_pairs(x[c], stacks[w], ids[c], 0.0, pdl=True, shared_last=hint)

    want = [chain(c, 0, False).clone() for c in range(CALLS)]
    same = all(torch.equal(chain(c, 0, True), want[c]) for c in range(CALLS))
    t_hint = _time(p.calls(lambda c, w: chain(c, w, True)))
    t_plain = _time(p.calls(lambda c, w: chain(c, w, False)))
    del stacks
    return [_row("moe_up_act:shared_early", p.shape + " S=1", same, 0.0, same, True, t_hint, None,
                 p.expert_bytes(p.w13), same_bits=same, without_hint_time_us=t_plain,
                 note="time_us: x copy + align + up-GEMM with shared_last; without_hint_time_us: the same chain "
                      "without it")]


def tune_configs(up: bool) -> list:
    """The tilings `_tune_rows` times after the default: TUNE, and for the up-GEMM also TUNE_UP_SWAP."""
    from lingc.kernels.moe import GemmConfig
    return [GemmConfig(*t) for t in TUNE + (TUNE_UP_SWAP if up else [])]


def _tune_rows(p: Problem) -> list[dict]:
    """Other tilings of moe_up_act and moe_down, cold; same_bits: output equal to the default tiling's."""
    from lingc.kernels.moe import DOWN_CONFIG, UP_CONFIG, moe_down, moe_up_act
    rows = []
    al = p.align[0]
    base_up = moe_up_act(p.x[0], p.w13i[0], *al, TOP_K, BLOCK_M, 0.0)
    base_down = moe_down(p.act[0], p.w2[0], *al, BLOCK_M)
    for cfg in [UP_CONFIG, *tune_configs(up=True)]:
        label = f"bn{cfg.block_n}-bk{cfg.block_k}-w{cfg.num_warps}-s{cfg.num_stages}" + ("-swap" * cfg.swap_ab)
        try:
            same = torch.equal(moe_up_act(p.x[0], p.w13i[0], *al, TOP_K, BLOCK_M, 0.0, config=cfg), base_up)
            t = _time(p.calls(lambda c, w: moe_up_act(p.x[c], p.w13i[w], *p.align[c], TOP_K, BLOCK_M, 0.0,
                                                      pdl=True, config=cfg)))
            rows.append(_row(f"tune:moe_up_act:{label}", p.shape, True, 0.0, same, True, t, None,
                             p.expert_bytes(p.w13), same_bits=same))
        except Exception as err:  # noqa: BLE001  (a tiling that does not compile is a result, not a crash)
            rows.append({"kernel": f"tune:moe_up_act:{label}", "shape": p.shape, "ok": False, "error": repr(err)})
    for cfg in [DOWN_CONFIG, *tune_configs(up=False)]:
        label = f"bn{cfg.block_n}-bk{cfg.block_k}-w{cfg.num_warps}-s{cfg.num_stages}"
        try:
            same = torch.equal(moe_down(p.act[0], p.w2[0], *al, BLOCK_M, config=cfg), base_down)
            t = _time(p.calls(lambda c, w: moe_down(p.act[c], p.w2[w], *p.align[c], BLOCK_M, pdl=True,
                                                    config=cfg)))
            rows.append(_row(f"tune:moe_down:{label}", p.shape, True, 0.0, same, True, t, None,
                             p.expert_bytes(p.w2), same_bits=same))
        except Exception as err:  # noqa: BLE001
            rows.append({"kernel": f"tune:moe_down:{label}", "shape": p.shape, "ok": False, "error": repr(err)})
    return rows


def _pairs_rows(p: Problem) -> list[dict]:
    """fuse_align_into_moe: router_topk -> moe_up_act_pairs -> moe_down_pairs -> combine_add_rmsnorm (the pair grid,
    no align) against router_align -> moe_up_act -> moe_down -> combine_add_rmsnorm, PDL on, cold weights, the
    shared expert fused (k + 1 pairs a token, E + 1 experts) as in lingc's step; the outputs bit for bit."""
    from lingc.kernels.moe import (combine_add_rmsnorm, interleave_w13, moe_down, moe_down_pairs, moe_up_act,
                                   moe_up_act_pairs)
    from lingc.kernels.router import router_align, router_topk
    dev = p.x[0].device
    g = torch.Generator(device=dev).manual_seed(1)
    w13i = [interleave_w13(torch.randn(E + 1, 2 * INTER, H, device=dev, generator=g).mul(0.02).to(torch.bfloat16))
            for _ in range(COPIES)]
    w2 = [torch.randn(E + 1, H, INTER, device=dev, generator=g).mul(0.02).to(torch.bfloat16) for _ in range(COPIES)]
    logits = [torch.randn(p.T, E, device=dev, generator=g) for _ in range(CALLS)]
    bias = torch.randn(E, device=dev, generator=g).mul(0.1)
    norm_w = torch.rand(H, device=dev, generator=g).add(0.5).to(torch.bfloat16)
    route = (8, 4, TOP_K, 2.5)

    def aligned(c: int, w: int):
        weights, _, *al = router_align(logits[c], bias, *route, E + 1, BLOCK_M, 1, pdl=True)
        act = moe_up_act(p.x[c], w13i[w], *al, TOP_K + 1, BLOCK_M, 0.0, pdl=True)
        return combine_add_rmsnorm(p.x[c], moe_down(act, w2[w], *al, BLOCK_M, pdl=True), weights, norm_w, 1e-6,
                                   pdl=True)

    def pairs(c: int, w: int):
        weights, ids = router_topk(logits[c], bias, *route, 1, pdl=True)
        act = moe_up_act_pairs(p.x[c], w13i[w], ids, 0.0, pdl=True)
        return combine_add_rmsnorm(p.x[c], moe_down_pairs(act, w2[w], ids, pdl=True), weights, norm_w, 1e-6,
                                   pdl=True)

    same = all(torch.equal(a, b) for c in range(CALLS) for a, b in zip(aligned(c, c % COPIES), pairs(c, c % COPIES)))
    rows = []
    t_al = _time(p.calls(aligned))
    t_pairs = _time(p.calls(pairs))
    t_al2 = _time(p.calls(aligned))
    t_pairs2 = _time(p.calls(pairs))
    rows.append({"kernel": "moe_pairs_chain", "shape": p.shape + " shared=1", "ok": same, "bit_exact_vs_align": same,
                 "time_us": [t_pairs, t_pairs2], "align_chain_time_us": [t_al, t_al2]})
    return rows


def run(device: torch.device, sections: tuple[str, ...] = ()) -> list[dict]:
    """Every section at T = 1 and 6, or only the named ones (e.g. ("_combine_norm_rows",))."""
    import lingc  # noqa: F401  (registers the reference ops)
    from lingc.modules import MOE_BLOCK_M
    assert MOE_BLOCK_M == BLOCK_M, f"lingc.modules.MOE_BLOCK_M is {MOE_BLOCK_M}, the bench assumes {BLOCK_M}"
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
    g = torch.Generator(device=device).manual_seed(0)
    stacks = _stacks(device, g)
    rows: list[dict] = []
    for T in (1, 6):
        p = Problem(T, device, g, stacks)
        for section in (_gemm_rows, _combine_align_rows, _combine_norm_rows, _chain_rows, _fused_rows, _tune_rows,
                        _pairs_rows, _shared_early_rows):
            if sections and section.__name__ not in sections:
                continue
            try:
                rows += section(p)
            except Exception:  # noqa: BLE001  (one section's failure must not lose the others)
                rows.append({"kernel": section.__name__, "shape": p.shape, "ok": False,
                             "error": traceback.format_exc()[-2000:]})
    return rows


if __name__ == "__main__":
    for row in run(torch.device("cuda"), tuple(sys.argv[1:])):
        print(json.dumps(row))
