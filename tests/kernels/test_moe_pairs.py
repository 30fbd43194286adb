"""lingc.kernels.moe's pair-grid GEMMs (moe_up_act_pairs, moe_down_pairs; fuse_align_into_moe) in the Triton
interpreter: bit for bit the aligned GEMMs over moe_align of the same ids (and so the reference ops within the
aligned kernels' tolerance), every output row written (poisoned buffers), experts picked by several tokens, a
shared pair per token, 16 tokens (one per row slot), the moe_align fallback past 16, PDL on == off, bad ids."""

from __future__ import annotations

import pytest
import torch

from kernel_support import poisoned_empty
from lingc.kernels.moe import (LOWERINGS, interleave_w13, moe_down, moe_down_pairs, moe_up_act, moe_up_act_pairs)
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
