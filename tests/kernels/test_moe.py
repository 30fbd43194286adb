"""lingc.kernels.moe in the Triton interpreter against torch.ops.lingc.{moe_up, moe_up_act, silu_and_mul, moe_down,
moe_combine}: small odd shapes, NaN-poisoned outputs, fused == unfused bit for bit, row invariance."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from lingc.kernels.moe import (INTERLEAVE4, LOWERINGS, SEQUENTIAL, GemmConfig, _grouped_gemm, interleave_w13,
                               moe_combine, moe_combine_ref,
                               moe_down, moe_down_ref, moe_up, moe_up_act, moe_up_act_ref, moe_up_ref,
                               silu_and_mul, silu_and_mul_ref)
from lingc.kernels.moe_align import moe_align_ref

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
dtypes = pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
# fp32 GEMMs: the reference sums the K products of a pair in another order than the kernel's fp32 dot, an error
# of a few ulp of the largest partial sum (K <= 128 here), not of the result (which may cancel); SwiGLU then
# multiplies two such outputs. So fp32 compares with rtol 1e-5 and an atol of 1e-5 x the output's largest
# magnitude. bf16 outputs are rounded to 8 bits, which conftest's bf16 tolerance covers.
GEMM_FP32_RTOL = GEMM_FP32_ATOL_SCALE = 1e-5


def _nan(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An output buffer poisoned with NaN, so an unwritten element fails the comparison."""
    return torch.full(shape, float("nan"), dtype=dtype)


def _routing(n: int, k: int, num_experts: int, g: torch.Generator, pool: int | None = None) -> torch.Tensor:
    """Expert ids [N, k] int32, k distinct experts per token, drawn from the first `pool` of a permutation."""
    experts = torch.randperm(num_experts, generator=g)[: pool or num_experts]
    return torch.stack([experts[torch.randperm(len(experts), generator=g)[:k]] for _ in range(n)]).to(torch.int32)


class Moe:
    """Random MoE inputs and their moe_align; up-GEMM outputs and act span several decades (a clamp binds)."""

    def __init__(self, n: int, k: int, num_experts: int, h: int, inter: int, dtype: torch.dtype, block_m: int,
                 seed: int, pool: int | None = None):
        g = torch.Generator().manual_seed(seed)
        self.n, self.k, self.num_experts, self.block_m, self.dtype = n, k, num_experts, block_m, dtype
        scale = 10.0 ** (torch.rand(n, 1, generator=g) - 0.5)                            # [N, 1]: 0.3 .. 3
        self.x = (torch.randn(n, h, generator=g) * scale).to(dtype)                      # [N, h]
        row_scale = 10.0 ** (4 * torch.rand(num_experts, 2 * inter, 1, generator=g) - 2)  # 0.01 .. 100 per row
        self.w13 = (torch.randn(num_experts, 2 * inter, h, generator=g) * row_scale / h**0.5).to(dtype)
        self.w2 = (torch.randn(num_experts, h, inter, generator=g) / inter**0.5).to(dtype)
        self.act = (torch.randn(n * k, inter, generator=g) * scale.repeat_interleave(k, 0)).to(dtype)
        self.weights = torch.rand(n, k, generator=g)                                     # [N, k] fp32
        self.shared = torch.randn(n, h, generator=g).to(dtype)
        self.ids = _routing(n, k, num_experts, g, pool)
        self.align = moe_align_ref(self.ids, num_experts, block_m)

    def token(self, t: int) -> Moe:
        """The same MoE restricted to token t (its routing re-aligned alone: a decode step)."""
        one = object.__new__(Moe)
        one.__dict__.update(self.__dict__)
        one.n = 1
        one.x, one.ids, one.weights, one.shared = (a[t:t + 1] for a in (self.x, self.ids, self.weights, self.shared))
        one.act = self.act[t * self.k:(t + 1) * self.k]
        one.align = moe_align_ref(one.ids, self.num_experts, self.block_m)
        return one


# (N, k, E, h, I, block_m): decode (1 token), a verify chain (6 tokens), odd sizes (masked K and N tails),
# K = 128 (no K mask), block_m 4 (padded to the 16-row tile) and 32 (two tiles' worth of rows).
CASES = [(1, 8, 16, 48, 24, 16), (6, 8, 16, 48, 24, 16), (3, 5, 13, 40, 20, 4), (2, 4, 8, 128, 64, 32)]
cases = pytest.mark.parametrize("n,k,num_experts,h,inter,block_m", CASES,
                                ids=[f"N{c[0]}k{c[1]}E{c[2]}h{c[3]}I{c[4]}bm{c[5]}" for c in CASES])


def _close_gemm(got: torch.Tensor, want: torch.Tensor, assert_kernel_close: Callable) -> None:
    if want.dtype == torch.float32:
        assert not got.isnan().any(), "kernel left unwritten (NaN-poisoned) elements"
        atol = GEMM_FP32_ATOL_SCALE * want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=GEMM_FP32_RTOL, atol=atol)
    else:
        assert_kernel_close(got, want)


@cases
@dtypes
def test_moe_up_and_down_match_reference(n, k, num_experts, h, inter, block_m, dtype, assert_kernel_close) -> None:
    m = Moe(n, k, num_experts, h, inter, dtype, block_m, seed=n * 100 + h)
    up = moe_up(m.x, m.w13, *m.align, k, block_m, out=_nan((n * k, 2 * inter), dtype))
    _close_gemm(up, moe_up_ref(m.x, m.w13, *m.align, k, block_m), assert_kernel_close)
    down = moe_down(m.act, m.w2, *m.align, block_m, out=_nan((n * k, h), dtype))
    _close_gemm(down, moe_down_ref(m.act, m.w2, *m.align, block_m), assert_kernel_close)


@pytest.mark.parametrize("limit", [0.0, 4.0])
@cases
@dtypes
def test_fused_up_act_is_bit_identical_to_unfused(n, k, num_experts, h, inter, block_m, limit, dtype,
                                                  assert_kernel_close) -> None:
    """moe_up_act(interleaved w13) == silu_and_mul(moe_up(w13)) bit for bit, and close to the reference."""
    m = Moe(n, k, num_experts, h, inter, dtype, block_m, seed=n * 10 + k + int(limit * 10))
    up = moe_up(m.x, m.w13, *m.align, k, block_m)
    unfused = silu_and_mul(up, limit, out=_nan((n * k, inter), dtype))
    w13i = interleave_w13(m.w13)
    fused = moe_up_act(m.x, w13i, *m.align, k, block_m, limit, out=_nan((n * k, inter), dtype))
    assert torch.equal(fused, unfused), f"fused differs from unfused in {(fused != unfused).sum()} elements"
    gate, upper = up[:, :inter].float(), up[:, inter:].float()
    if limit > 0:  # the inputs reach the clamp on both factors
        assert (torch.nn.functional.silu(gate) > limit).any() and (upper.abs() > limit).any()
    assert (gate < -4).any() and (gate.abs() < 0.1).any()
    _close_gemm(fused, moe_up_act_ref(m.x, w13i, *m.align, k, block_m, limit), assert_kernel_close)


@pytest.mark.parametrize("limit", [0.0, 7.0])
@dtypes
def test_silu_and_mul_matches_reference_over_the_range(limit: float, dtype: torch.dtype,
                                                       assert_kernel_close: Callable) -> None:
    """[B, T, 2I] rows with values from 1e-6 to 1e3 of both signs (silu saturates, underflows, clamps)."""
    g = torch.Generator().manual_seed(int(limit) + 3)
    mag = 10.0 ** (9 * torch.rand(2, 3, 2 * 37, generator=g) - 6)
    h = (mag * torch.randn(2, 3, 2 * 37, generator=g).sign()).to(dtype)
    h[0, 0, :4] = torch.tensor([-100.0, 100.0, 88.0, -89.0]).to(dtype)   # exp overflow / underflow edges
    got = silu_and_mul(h, limit, out=_nan((2, 3, 37), dtype))
    assert_kernel_close(got, silu_and_mul_ref(h, limit))


def _combine_formula(m: Moe, expert_out: torch.Tensor, order: int) -> torch.Tensor:
    """The combine written out as single fp32 operations in the given order over k."""
    prods = expert_out.view(m.n, m.k, -1).float() * m.weights.unsqueeze(-1)          # [N, k, h]
    acc = [torch.zeros_like(prods[:, 0]) for _ in range(4)]
    for j in range(m.k):
        slot = 0 if order == SEQUENTIAL else j % 4
        acc[slot] = acc[slot] + prods[:, j]
    routed = ((acc[0] + acc[1]) + acc[2]) + acc[3] if order == INTERLEAVE4 else acc[0]
    return (routed.to(m.dtype).float() + m.shared.float()).to(m.dtype)


def _expert_rows(n: int, h: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """[n, h] expert outputs with row scales from 1e-2 to 1e2 (a wide range: summation order shows), seeded."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, h, generator=g) * 10.0 ** (4 * torch.rand(n, 1, generator=g) - 2)).to(dtype)


def _assert_combine_close(got: torch.Tensor, want: torch.Tensor, expert_out: torch.Tensor, weights: torch.Tensor,
                          assert_kernel_close: Callable) -> None:
    """Another fp32 summation order than torch's moves a sum of k terms by a few ulps of its largest term (up
    to ~1e2 here), not of the result: fp32 gets an absolute bound from the terms; bf16 the kernel tolerance."""
    if want.dtype != torch.float32:
        assert_kernel_close(got, want)
        return
    largest = (expert_out.float().abs().max() * weights.float().abs().max()).item()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=weights.shape[1] * 2.0**-23 * largest)


@pytest.mark.parametrize("n,k,h", [(1, 8, 128), (6, 8, 128), (3, 9, 37), (2, 3, 1030)])
@dtypes
def test_moe_combine(n: int, k: int, h: int, dtype: torch.dtype, assert_kernel_close: Callable) -> None:
    """Bit-exact vs the formula in both orders; vs the reference op: exact on CPU where torch's CPU sum is
    sequential (h a multiple of its 32-column vector chunk), else within tolerance."""
    m = Moe(n, k, 8, h, 8, dtype, 16, seed=n + k + h)
    expert_out = _expert_rows(n * k, h, n + k + h, dtype)
    for order in (SEQUENTIAL, INTERLEAVE4):
        got = moe_combine(expert_out, m.weights, m.shared, out=_nan((n, h), dtype), order=order)
        assert torch.equal(got, _combine_formula(m, expert_out, order)), f"order {order}"
    got = moe_combine(expert_out, m.weights, m.shared, out=_nan((n, h), dtype))       # CPU default: sequential
    want = moe_combine_ref(expert_out, m.weights, m.shared)
    if h % 128 == 0:
        assert torch.equal(got, want)
    _assert_combine_close(got, want, expert_out, m.weights, assert_kernel_close)


@pytest.mark.parametrize("n,k,h", [(1, 9, 128), (6, 5, 37)])
@dtypes
def test_moe_combine_without_shared_out(n: int, k: int, h: int, dtype: torch.dtype,
                                        assert_kernel_close: Callable) -> None:
    """fuse_shared_expert's combine: the shared expert is pair k-1 with weight 1.0; the fp32 sum (both orders) is
    cast once. Sequential order, fp32: exactly the 3-argument combine of the k-1 routed pairs + the shared rows."""
    m = Moe(n, k, 8, h, 8, dtype, 16, seed=n + 3 * k + h)
    m.weights[:, -1] = 1.0
    expert_out = _expert_rows(n * k, h, n + 3 * k + h, dtype)
    for order in (SEQUENTIAL, INTERLEAVE4):
        got = moe_combine(expert_out, m.weights, out=_nan((n, h), dtype), order=order)
        m.shared = torch.zeros(n, h, dtype=dtype)            # _combine_formula's + shared becomes + 0: the cast alone
        assert torch.equal(got, _combine_formula(m, expert_out, order)), f"order {order}"
    want = moe_combine_ref(expert_out, m.weights)
    assert want.dtype == dtype
    _assert_combine_close(moe_combine(expert_out, m.weights), want, expert_out, m.weights, assert_kernel_close)
    if h % 128 == 0:                                        # torch's CPU sum over k is sequential (test_moe_combine)
        assert torch.equal(moe_combine(expert_out, m.weights), want)
    if dtype == torch.float32 and h % 128 == 0:
        rows = expert_out.view(n, k, h)
        routed = rows[:, :-1].reshape(-1, h).contiguous()
        assert torch.equal(want, moe_combine_ref(routed, m.weights[:, :-1].contiguous(), rows[:, -1].contiguous()))


@pytest.mark.parametrize("block_m,pool", [(16, None), (4, 10)], ids=["bm16-spread", "bm4-shared-experts"])
@dtypes
def test_row_invariance_decode_vs_verify(block_m: int, pool: int | None, dtype: torch.dtype) -> None:
    """A token's pair rows (and combined row) alone == inside a batch of 6, bit for bit. With 10 experts for
    6 x 8 pairs, experts are shared by up to 6 pairs, and with block_m 4 they span several blocks."""
    m = Moe(6, 8, 16, 48, 24, dtype, block_m, seed=block_m, pool=pool)
    w13i, limit = interleave_w13(m.w13), 1.5

    def chain(mm: Moe) -> tuple[torch.Tensor, ...]:
        up = moe_up(mm.x, m.w13, *mm.align, mm.k, block_m)
        act = moe_up_act(mm.x, w13i, *mm.align, mm.k, block_m, limit)
        down = moe_down(mm.act, m.w2, *mm.align, block_m)
        return up, act, down, moe_combine(down, mm.weights, mm.shared)

    batch = chain(m)
    for t in (0, 3, 5):  # three of the six tokens: the interpreter is slow
        alone = chain(m.token(t))
        rows = slice(t * m.k, (t + 1) * m.k)
        for name, a, b in zip(("moe_up", "moe_up_act", "moe_down"), alone[:3], batch[:3]):
            assert torch.equal(a, b[rows]), f"{name}: token {t} alone differs from its rows in the batch"
        # combine of the same expert rows: the batch's own down rows for this token
        assert torch.equal(moe_combine(batch[2][rows], m.weights[t:t + 1], m.shared[t:t + 1]), batch[3][t:t + 1])


def test_no_pairs() -> None:
    """Zero tokens: empty outputs, nothing launched."""
    m = Moe(1, 4, 8, 48, 24, torch.float32, 16, seed=1)
    empty = moe_align_ref(torch.zeros(0, 4, dtype=torch.int32), 8, 16)
    assert moe_up(m.x[:0], m.w13, *empty, 4, 16).shape == (0, 48)
    assert moe_down(m.act[:0], m.w2, *empty, 16).shape == (0, 48)


def test_pdl_on_cpu_falls_back() -> None:
    """pdl=True on CPU tensors (interpreter) is dropped: no GDC call runs, results equal pdl=False."""
    m = Moe(2, 4, 8, 48, 24, torch.bfloat16, 16, seed=2)
    w13i = interleave_w13(m.w13)
    assert torch.equal(moe_up(m.x, m.w13, *m.align, 4, 16, pdl=True), moe_up(m.x, m.w13, *m.align, 4, 16))
    assert torch.equal(moe_up_act(m.x, w13i, *m.align, 4, 16, 2.0, pdl=True),
                       moe_up_act(m.x, w13i, *m.align, 4, 16, 2.0))
    assert torch.equal(moe_down(m.act, m.w2, *m.align, 16, pdl=True), moe_down(m.act, m.w2, *m.align, 16))
    h = torch.randn(3, 48).to(torch.bfloat16)
    assert torch.equal(silu_and_mul(h, 0.0, pdl=True), silu_and_mul(h, 0.0))
    e = torch.randn(8, 48).to(torch.bfloat16)
    assert torch.equal(moe_combine(e, m.weights, m.shared, pdl=True), moe_combine(e, m.weights, m.shared))


def test_bad_inputs_raise_value_error() -> None:
    m = Moe(2, 4, 8, 48, 24, torch.bfloat16, 16, seed=3)
    sorted_pairs, block_expert, total = m.align
    with pytest.raises(ValueError, match="sorted_pairs"):
        moe_up(m.x, m.w13, sorted_pairs[:-1], block_expert, total, 4, 16)          # wrong moe_align size
    with pytest.raises(ValueError, match="block_expert"):
        moe_up(m.x, m.w13, sorted_pairs, block_expert.long(), total, 4, 16)        # wrong dtype
    with pytest.raises(ValueError, match="sorted_pairs"):
        moe_down(m.act, m.w2, *m.align, 8)                                         # block_m the align did not use
    with pytest.raises(ValueError, match="one dtype"):
        moe_up(m.x, m.w13.float(), *m.align, 4, 16)
    with pytest.raises(ValueError, match="even number"):
        moe_up_act(m.x, m.w13[:, :47], *m.align, 4, 16, 0.0)
    with pytest.raises(ValueError, match=r"want contiguous \[8, 48\]"):
        moe_up(m.x, m.w13, *m.align, 4, 16, out=torch.empty(8, 47, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"want \[N\*k, h\]"):
        moe_combine(torch.randn(7, 48), m.weights, m.shared.float())
    with pytest.raises(ValueError, match=r"want \[\.\.\., 2I\]"):
        silu_and_mul(torch.randn(3, 5), 0.0)


def test_lowerings_cover_the_reference_ops() -> None:
    assert set(LOWERINGS) == {"moe_up", "moe_up_act", "silu_and_mul", "moe_down", "moe_combine", "combine_add_rmsnorm",
                              "moe_up_act_pairs", "moe_down_pairs"}
    for name in LOWERINGS:
        assert hasattr(torch.ops.lingc, name)


@cases
@dtypes
def test_down_preload_is_bit_identical_to_the_loop(n, k, num_experts, h, inter, block_m, dtype) -> None:
    """The down-GEMM's register preload of its weight tile (LINGC_MOE_DOWN_PRELOAD) runs the loop's dots on the
    same chunks in the same order: 16-wide K chunks give 2 (masked tail) to 4 of them here."""
    m = Moe(n, k, num_experts, h, inter, dtype, block_m, seed=n * 100 + h + 7)
    cfg = GemmConfig(block_n=32, block_k=16, num_warps=4, num_stages=3)
    args = ("moe_down", m.act, m.w2, *m.align, 1, block_m, 0.0, False, False, None, cfg)
    looped = _grouped_gemm(*args)
    preloaded = _grouped_gemm(*args, preload=True)
    assert torch.equal(looped, preloaded)
