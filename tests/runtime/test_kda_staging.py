"""Gate 4 (techniques.md section 10): staging a T = 6 verify chain and committing accept length a equals
running the first a tokens one by one, bit for bit, and leaves every other slot's pools untouched.

Op level, random inputs at the engine's batch (1 request per step): kda_conv_staged / kda_recurrent_staged
over the chain, then kda_commit, against kda_conv / kda_recurrent fed one token at a time from the same
initial pools. The request sits on slot 2 of a 4-slot pool. Head counts 4 (test-tiny) and 8: CPU
elementwise kernels round differently in their vectorised body and scalar tail, so a chain of T tokens
reproduces T = 1's bits only if the ops take care (lingc.linear, router_topk, kda `_prepare`'s beta).
"""

from __future__ import annotations

import pytest
import torch

from lingc.ops import OPS as ops

S, T, D, W = 4, 6, 32, 4                 # slots, chain length, head dim (test-tiny), conv width
SLOT = 2
SLOTS = torch.tensor([SLOT], dtype=torch.int32)
OTHERS = [0, 1, 3]
LOWER_BOUND = -5.0
CASES = pytest.mark.parametrize("heads,dtype", [(4, torch.float32), (4, torch.bfloat16), (8, torch.float32),
                                                (8, torch.bfloat16)], ids=["h4-fp32", "h4-bf16", "h8-fp32", "h8-bf16"])


def _same(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


def _check(out, pool, pool0, ref_outs, ref_pool, a):
    for t, ref_t in enumerate(ref_outs):
        assert _same(out[:, t:t + 1], ref_t), f"chain output at position {t} differs from decode's"
    assert _same(pool[SLOT], ref_pool[SLOT]), f"committed state after {a} tokens differs from decode's"
    for s in OTHERS:
        assert _same(pool[s], pool0[s]), f"slot {s} was touched"


@CASES
@pytest.mark.parametrize("a", range(1, T + 1))
def test_conv_stage_then_commit_equals_one_by_one(a, heads, dtype):
    P = heads * D
    g = torch.Generator().manual_seed(100 + a)
    x = torch.randn(1, T, P, generator=g).to(dtype)
    weight = torch.randn(P, 1, W, generator=g)                             # fp32, as in the model
    pool0 = torch.randn(S, P, W - 1, generator=g).to(dtype)                # windows in the activation dtype

    pool = pool0.clone()
    staging = torch.full((1, T, P, W - 1), float("nan")).to(dtype)
    y = ops.kda_conv_staged(x, weight, pool, SLOTS, staging)
    assert _same(pool, pool0), "staging must leave the pools alone"
    ops.kda_commit(pool, SLOTS, staging, torch.tensor([a], dtype=torch.int32))

    ref_pool = pool0.clone()
    ref = [ops.kda_conv(x[:, t:t + 1], weight, ref_pool, SLOTS) for t in range(a)]
    _check(y, pool, pool0, ref, ref_pool, a)


@CASES
@pytest.mark.parametrize("a", range(1, T + 1))
def test_recurrent_stage_then_commit_equals_one_by_one(a, heads, dtype):
    g = torch.Generator().manual_seed(200 + a)
    q, k, v, f = (torch.randn(1, T, heads, D, generator=g).to(dtype) for _ in range(4))
    b = torch.randn(1, T, heads, generator=g).to(dtype)
    A_log = torch.randn(heads, generator=g) * 0.5
    dt_bias = torch.randn(heads * D, generator=g) * 0.5
    pool0 = torch.randn(S, heads, D, D, generator=g) * 0.1                 # fp32 states

    pool = pool0.clone()
    staging = torch.full((1, T, heads, D, D), float("nan"))
    o = ops.kda_recurrent_staged(q, k, v, f, b, A_log, dt_bias, pool, SLOTS, staging, LOWER_BOUND)
    assert _same(pool, pool0), "staging must leave the pools alone"
    ops.kda_commit(pool, SLOTS, staging, torch.tensor([a], dtype=torch.int32))

    ref_pool = pool0.clone()
    ref = [ops.kda_recurrent(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], f[:, t:t + 1], b[:, t:t + 1], A_log,
                             dt_bias, ref_pool, SLOTS, LOWER_BOUND) for t in range(a)]
    _check(o, pool, pool0, ref, ref_pool, a)


def test_commit_picks_each_rows_position():
    """kda_commit reads staging[b, accept_len[b] - 1] into pool[slots[b]] and writes nothing else."""
    staging = torch.arange(2 * T * 3, dtype=torch.float32).view(2, T, 3)
    pool = torch.full((S, 3), -1.0)
    ops.kda_commit(pool, torch.tensor([2, 0], dtype=torch.int32), staging, torch.tensor([6, 1], dtype=torch.int32))
    assert pool[2].tolist() == staging[0, 5].tolist() and pool[0].tolist() == staging[1, 0].tolist()
    assert (pool[[1, 3]] == -1).all()
