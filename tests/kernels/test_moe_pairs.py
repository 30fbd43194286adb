"""lingc.kernels.moe's pair-grid GEMMs (moe_up_act_pairs, moe_down_pairs; fuse_align_into_moe) in the Triton
interpreter: bit for bit the aligned GEMMs over moe_align of the same ids (and so the reference ops within the
aligned kernels' tolerance), every output row written (poisoned buffers), experts picked by several tokens, a
shared pair per token, 16 tokens (one per row slot), the moe_align fallback past 16, PDL on == off, bad ids, and the
pair grid's swap-AB tiling (GemmConfig.swap_ab)."""

from __future__ import annotations

import pytest
import torch

from kernel_support import poisoned_empty
import lingc.kernels.moe as moe_kernels
from lingc.kernels.moe import (DOWN_CONFIG, DOWN_PAIRS_CONFIG, LOWERINGS, UP_CONFIG, UP_PAIRS_CONFIG, GemmConfig,
                               interleave_w13, moe_down, moe_down_pairs, moe_up_act, moe_up_act_pairs)
from lingc.kernels.moe_align import moe_align

BLOCK_M = 16


def _case(n: int, num_experts: int, k: int, shared: int, seed: int, pool: int | None = None):
    g = torch.Generator().manual_seed(seed)
    experts = torch.randperm(num_experts, generator=g)[: pool or num_experts]
    ids = torch.stack([experts[torch.randperm(len(experts), generator=g)[:k]] for _ in range(n)]).to(torch.int32)
    if shared:
        ids = torch.cat([ids, torch.full((n, shared), num_experts, dtype=torch.int32)], 1)
    h, inter = 48, 24
    w13 = interleave_w13((torch.randn(num_experts + shared, 2 * inter, h, generator=g) / h**0.5).to(torch.bfloat16))
    w2 = (torch.randn(num_experts + shared, h, inter, generator=g) / inter**0.5).to(torch.bfloat16)
    x = torch.randn(n, h, generator=g).to(torch.bfloat16)
    return ids, w13, w2, x


# (tokens, experts, picks, shared, pool): decode; a verify chain; every token from a pool of 5 (each expert picked
# by most tokens); no shared expert; 16 tokens; 20 tokens (past the pair grid: the launcher aligns)
CASES = [(1, 16, 4, 1, None), (6, 16, 4, 1, None), (6, 16, 4, 1, 5), (6, 16, 4, 0, None), (16, 12, 3, 1, 6),
         (20, 16, 4, 1, None)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "N{}-E{}-k{}-S{}-pool{}".format(*c))
def test_pairs_equal_the_aligned_gemms(case):
    n, num_experts, k, shared, pool = case
    ids, w13, w2, x = _case(n, num_experts, k, shared, seed=n * 13 + k, pool=pool)
    aligned = moe_align(ids, num_experts + shared, BLOCK_M)
    with poisoned_empty():
        act = moe_up_act_pairs(x, w13, ids, 0.0)
        down = moe_down_pairs(act, w2, ids)
    want_act = moe_up_act(x, w13, *aligned, k + shared, BLOCK_M, 0.0)
    assert torch.equal(act, want_act)
    assert torch.equal(down, moe_down(want_act, w2, *aligned, BLOCK_M))
    ref = torch.ops.lingc.moe_up_act_pairs(x, w13, ids, 0.0)
    torch.testing.assert_close(act.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_many_pairs_stay_on_the_pair_grid(monkeypatch):
    """16 tokens x 9 pairs (144 pairs): within the pair grid's limits (16 tokens, 32 pairs a token), so no moe_align;
    the bits of the aligned GEMMs."""
    import lingc.kernels.moe_align as align_module
    ids, w13, w2, x = _case(16, 32, 8, 1, seed=5)
    want = moe_up_act(x, w13, *moe_align(ids, 33, BLOCK_M), 9, BLOCK_M, 0.0)
    monkeypatch.setattr(align_module, "moe_align", lambda *a, **k: pytest.fail("the pair grid aligned the ids"))
    got = moe_up_act_pairs(x, w13, ids, 0.0)
    assert torch.equal(got, want)


def test_pdl_flag_keeps_the_bits():
    ids, w13, w2, x = _case(6, 16, 4, 1, seed=3)
    act = moe_up_act_pairs(x, w13, ids, 0.0)
    assert torch.equal(moe_up_act_pairs(x, w13, ids, 0.0, pdl=True), act)      # no GDC on CPU: the same kernel
    assert torch.equal(moe_down_pairs(act, w2, ids, pdl=True), moe_down_pairs(act, w2, ids))


def test_bad_ids_name_the_op():
    ids, w13, w2, x = _case(2, 16, 4, 1, seed=4)
    with pytest.raises(ValueError, match="moe_up_act_pairs: topk_ids .* want \\[N, k\\] int32"):
        moe_up_act_pairs(x, w13, ids.long(), 0.0)
    with pytest.raises(ValueError, match="moe_down_pairs: 5 activation rows x 1 != 10 pairs"):
        moe_down_pairs(torch.zeros(5, 24, dtype=torch.bfloat16), w2, ids)


def test_lowered():
    assert LOWERINGS["moe_up_act_pairs"] is moe_up_act_pairs and LOWERINGS["moe_down_pairs"] is moe_down_pairs


SWAP = GemmConfig(block_n=32, block_k=32, num_warps=4, num_stages=2, swap_ab=True)   # K = 48: a masked last block


def test_swap_ab_tiling():
    """swap_ab (W [BN, BK] @ A^T as the dot): the pair grid equals the aligned launch under it bit for bit, and it is
    within fp32 rounding of the unswapped tiles (the interpreter's IEEE dot sums in another order)."""
    ids, w13, w2, x = _case(6, 16, 4, 1, seed=9)
    x, w13, w2 = x.float(), w13.float(), w2.float()
    aligned = moe_align(ids, 17, BLOCK_M)
    with poisoned_empty():
        act = moe_up_act_pairs(x, w13, ids, 0.3, config=SWAP)
        down = moe_down_pairs(act, w2, ids, config=SWAP)
    assert torch.equal(act, moe_up_act(x, w13, *aligned, 5, BLOCK_M, 0.3, config=SWAP))
    assert torch.equal(down, moe_down(act, w2, *aligned, BLOCK_M, config=SWAP))
    torch.testing.assert_close(act, moe_up_act_pairs(x, w13, ids, 0.3, config=UP_CONFIG), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(down, moe_down_pairs(act, w2, ids, config=DOWN_CONFIG), rtol=1e-5, atol=1e-6)


def test_pair_grid_tiling_choice(monkeypatch):
    """The pair grid runs UP_PAIRS_CONFIG / DOWN_PAIRS_CONFIG on tensor cores only; IEEE dots (fp32, the interpreter)
    keep the aligned launches' tilings, so the pair grid keeps their bits there."""
    ids, w13, w2, x = _case(6, 16, 4, 1, seed=10)
    act = moe_up_act_pairs(x, w13, ids, 0.0)
    assert torch.equal(act, moe_up_act_pairs(x, w13, ids, 0.0, config=UP_CONFIG))
    assert torch.equal(moe_down_pairs(act, w2, ids), moe_down_pairs(act, w2, ids, config=DOWN_CONFIG))
    assert moe_kernels._pairs_config(UP_PAIRS_CONFIG, UP_CONFIG, x) == UP_CONFIG          # interpreting
    monkeypatch.setattr(moe_kernels, "_interpreting", lambda: False)
    assert moe_kernels._pairs_config(UP_PAIRS_CONFIG, UP_CONFIG, x) == UP_PAIRS_CONFIG    # bf16 on the GPU
    assert moe_kernels._pairs_config(DOWN_PAIRS_CONFIG, DOWN_CONFIG, x.float()) == DOWN_CONFIG
    assert UP_PAIRS_CONFIG.swap_ab and DOWN_PAIRS_CONFIG.swap_ab


def test_bad_swap_tiling():
    ids, w13, w2, x = _case(2, 16, 4, 1, seed=11)
    with pytest.raises(ValueError, match="moe_up_act_pairs: bad tiling"):
        moe_up_act_pairs(x, w13, ids, 0.0, config=GemmConfig(8, 32, 4, 2, swap_ab=True))


@pytest.mark.parametrize("n", [1, 6, 16])
def test_shared_last_keeps_the_bits(n):
    """shared_last (fuse_shared_expert's launch hint; kernels/moe.py SHARED_EARLY): the shared expert's tile taken
    without the router's ids or the align is the same tile. The interpreter runs the early path with PDL off, so the
    rows it writes (every token's last pair) must equal the usual launch's, on poisoned buffers, aligned at one
    token and on the pair grid at any count."""
    ids, w13, _, x = _case(n, 16, 4, 1, seed=70 + n)
    with poisoned_empty():
        pairs_hint = moe_up_act_pairs(x, w13, ids, 0.0, shared_last=True)
    assert torch.equal(pairs_hint, moe_up_act_pairs(x, w13, ids, 0.0))
    aligned = moe_align(ids, 17, BLOCK_M)
    with poisoned_empty():
        got = moe_up_act(x, w13, *aligned, 5, BLOCK_M, 0.0, shared_last=True)
    assert torch.equal(got, moe_up_act(x, w13, *aligned, 5, BLOCK_M, 0.0))
    assert torch.equal(got, pairs_hint)


def test_shared_early_is_taken_only_where_its_layout_holds(monkeypatch):
    """The aligned launcher takes SHARED_EARLY at one token only (past it the shared expert's block depends on the
    routing), never under LINGC_MOE_SHARED_EARLY=0 (SHARED_EARLY False) or without the hint."""
    seen = []
    real = moe_kernels._moe_gemm_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(kwargs["SHARED_EARLY"])
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(moe_kernels, "_moe_gemm_kernel", Spy())
    for n, hint in ((1, True), (1, False), (2, True)):
        ids, w13, _, x = _case(n, 16, 4, 1, seed=90 + n)
        moe_up_act(x, w13, *moe_align(ids, 17, BLOCK_M), 5, BLOCK_M, 0.0, shared_last=hint)
    monkeypatch.setattr(moe_kernels, "SHARED_EARLY", False)
    ids, w13, _, x = _case(1, 16, 4, 1, seed=91)
    moe_up_act(x, w13, *moe_align(ids, 17, BLOCK_M), 5, BLOCK_M, 0.0, shared_last=True)
    moe_up_act_pairs(x, w13, ids, 0.0, shared_last=True)
    assert seen == [True, False, False, False, False]
