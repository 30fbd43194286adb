"""lingc/ops/dist.py: the collectives at world size 1 and without a process group, and the expert-parallel
align / combine against moe_align / moe_combine."""

from __future__ import annotations

import pytest
import torch

from lingc.ops import OPS as ops
from lingc.ops.dist import fold_sum
from lingc.passes.tp import expert_map

N, K, E, BM, H, I = 3, 4, 16, 4, 8, 6


def _ids(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)]).to(torch.int32)


def test_collectives_are_the_identity_for_one_rank_and_keep_shapes():
    x = torch.randn(2, 3, 5, dtype=torch.bfloat16)
    for y in (ops.all_reduce(x, 1), ops.all_gather(x, -1, 1)):
        assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        f = torch.empty(2, 3, 5)
        assert ops.all_reduce(f, 4).shape == (2, 3, 5)
        assert ops.all_gather(f, -1, 4).shape == (2, 3, 20)


def test_collectives_refuse_to_run_a_sharded_graph_without_its_ranks():
    with pytest.raises(RuntimeError, match=r"compiled for 2 tensor-parallel ranks.*open_tp_session"):
        ops.all_reduce(torch.ones(4), 2)
    with pytest.raises(RuntimeError, match=r"compiled for 4 tensor-parallel ranks"):
        ops.all_gather(torch.ones(4), -1, 4)


def test_fold_sum_is_an_fp32_sum_in_rank_order_rounded_once():
    parts = [torch.tensor([1.0], dtype=torch.bfloat16), torch.tensor([2.0 ** -8], dtype=torch.bfloat16),
             torch.tensor([2.0 ** -8], dtype=torch.bfloat16)]
    assert (parts[0] + parts[1] + parts[2]).item() == 1.0          # bf16 adds: each 1 + 2^-8 ties to 1
    assert fold_sum(parts, torch.bfloat16).item() == 1.0 + 2.0 ** -7   # fp32 sum, one rounding


def test_ep_align_with_every_expert_local_is_moe_align():
    ids = _ids()
    local, sp, be, tot = ops.ep_align(ids, torch.arange(E, dtype=torch.int32), E, BM)
    want = ops.moe_align(ids, E, BM)
    assert torch.equal(local, ids)
    for a, b in zip((sp, be, tot), want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("tp", [2, 4])
def test_expert_parallel_moe_sums_to_the_whole_layer(tp):
    """Each rank computes only its experts' pairs; the ranks' ep_combine outputs sum to moe_combine's."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, H, generator=g)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    weights, ids = torch.rand(N, K, generator=g), _ids(1)
    shared = torch.randn(N, H, generator=g)

    def layer(w13_, w2_, sp, be, tot):
        up = ops.moe_up(x, w13_, sp, be, tot, K, BM)
        return ops.moe_down(ops.silu_and_mul(up, 0.0), w2_, sp, be, tot, BM)

    full = ops.moe_combine(layer(w13, w2, *ops.moe_align(ids, E, BM)), weights, shared)
    seen = torch.zeros(N * K, dtype=torch.int64)
    partials = []
    for r in range(tp):
        local, sp, be, tot = ops.ep_align(ids, expert_map(E, r, tp), E // tp, BM)
        valid = sp[sp < N * K].long()
        seen[valid] += 1
        assert torch.equal(local >= 0, (ids.long() // (E // tp)) == r)
        down = layer(w13.chunk(tp)[r], w2.chunk(tp)[r], sp, be, tot)
        partials.append(ops.ep_combine(down, weights, local, shared / tp))
    assert seen.tolist() == [1] * (N * K)                 # every pair on exactly one rank
    torch.testing.assert_close(fold_sum(partials, torch.float32), full, rtol=1e-5, atol=1e-5)


def test_ep_combine_selects_other_ranks_rows_away_even_when_they_are_garbage():
    weights, shared = torch.rand(N, K), torch.zeros(N, H)
    local = torch.tensor([[0, -1, 1, -1]] * N, dtype=torch.int32)
    out = torch.randn(N * K, H)
    out.view(N, K, H)[:, 1] = float("nan")                # never written by a kernel: anything may be there
    out.view(N, K, H)[:, 3] = float("inf")
    got = ops.ep_combine(out, weights, local, shared)
    want = (out.view(N, K, H)[:, [0, 2]] * weights[:, [0, 2], None]).sum(1)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want)
    every = torch.zeros(N, K, dtype=torch.int32)
    assert torch.equal(ops.ep_combine(out.nan_to_num(), weights, every, shared),
                       ops.moe_combine(out.nan_to_num(), weights, shared))
