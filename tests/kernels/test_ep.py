"""lingc.kernels.ep (ep_align, ep_combine) in the Triton interpreter against torch.ops.lingc.ep_align / ep_combine,
and test-tiny's TP2 rank programs run in lockstep with the two ops on their kernels against the reference ops.

Every output the launchers allocate is poisoned first (ints POISON, floats NaN), so each comparison also checks that
the kernel wrote every cell itself. Integer outputs are compared bit for bit; ep_combine bit for bit against the
formula in both summation orders, and against the reference op wherever torch's CPU sum is sequential (h a
multiple of 128, as kernels/moe.py's moe_combine test), else within conftest's tolerance.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import lingc.kernels.ep as ep_module
from lingc.kernels.ep import (FILL_BLOCK, LOWERINGS, MAX_PAIRS, ep_align, ep_align_ref, ep_combine, ep_combine_ref)
from lingc.kernels.moe import INTERLEAVE4, SEQUENTIAL
from lingc.ops import OPS
from lingc.passes.tp import expert_map

POISON = -0x2152411  # an int32 no output cell can legitimately hold
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
dtypes = pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
# (routed experts E, tp, top_k, fused shared expert): test-tiny-like E=16 over 2 ranks (8 local) and 4 ranks,
# Ling-3.0-tiny's 128 experts top-8 over 2 ranks with the shared expert as pair k (65 local on its owner, 64 else)
LAYOUTS = [(16, 2, 8, False), (16, 4, 4, False), (16, 2, 4, True), (128, 2, 8, True)]


@pytest.fixture(autouse=True)
def _poisoned_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    def new(shape, dtype, device):
        fill = float("nan") if dtype.is_floating_point else POISON
        return torch.full(shape, fill, dtype=dtype, device=device)
    monkeypatch.setattr(ep_module, "_new", new)


def _routing(n: int, k: int, num_experts: int, shared: bool, seed: int) -> torch.Tensor:
    """Global expert ids [N, k (+1)] int32: k distinct routed experts per token, then expert E when `shared`."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(n)]).to(torch.int32)
    return torch.cat([ids, torch.full((n, 1), num_experts, dtype=torch.int32)], 1) if shared else ids


def _map(num_experts: int, rank: int, tp: int, shared: bool, owner: int = 1) -> tuple[torch.Tensor, int]:
    """(expert_map, num_local) as the tp pass builds them: with a fused shared expert, El = E/tp + 1 on every rank."""
    return expert_map(num_experts, rank, tp, owner % tp if shared else None), num_experts // tp + shared


def _check_contract(ids: torch.Tensor, emap: torch.Tensor, num_local: int, block_m: int, got: tuple) -> None:
    """ep_align's contract spelled out without the reference: moe_align over the rank's pairs, local ids."""
    local_ids, sorted_pairs, block_expert, total = got
    local = [int(emap[i]) for i in ids.reshape(-1).tolist()]
    num_pairs = len(local)
    assert local_ids.dtype == sorted_pairs.dtype == block_expert.dtype == total.dtype == torch.int32
    assert local_ids.reshape(-1).tolist() == local
    assert sorted_pairs.numel() == num_pairs + num_local * (block_m - 1)
    assert block_expert.numel() == -(-sorted_pairs.numel() // block_m) and total.shape == (1,)
    cells, blocks, t = sorted_pairs.tolist(), block_expert.tolist(), int(total)
    pos, want_blocks = 0, []
    for e in range(num_local):
        pairs = [p for p, x in enumerate(local) if x == e]
        padded = -(-len(pairs) // block_m) * block_m
        assert cells[pos:pos + len(pairs)] == pairs, f"local expert {e}"
        assert cells[pos + len(pairs):pos + padded] == [num_pairs] * (padded - len(pairs)), f"local expert {e}: padding"
        want_blocks += [e] * (padded // block_m)
        pos += padded
    assert t == pos and all(c == num_pairs for c in cells[t:]), "tail past the total"
    assert blocks == want_blocks + [-1] * (len(blocks) - len(want_blocks))


def _check_align(ids: torch.Tensor, emap: torch.Tensor, num_local: int, block_m: int) -> tuple:
    got = ep_align(ids, emap, num_local, block_m)
    want = ep_align_ref(ids, emap, num_local, block_m)
    for name, g, w in zip(("local_ids", "sorted_pairs", "block_expert", "total"), got, want):
        assert torch.equal(g, w), f"{name}: got {g.tolist()}, want {w.tolist()}"
    _check_contract(ids, emap, num_local, block_m, got)
    return got


@pytest.mark.parametrize("block_m", [4, 16])
@pytest.mark.parametrize("n", [1, 6])
@pytest.mark.parametrize("num_experts,tp,top_k,shared", LAYOUTS, ids=[f"E{e}-tp{t}-k{k}{'+1' if s else ''}"
                                                                      for e, t, k, s in LAYOUTS])
def test_ep_align_matches_reference_on_every_rank(num_experts: int, tp: int, top_k: int, shared: bool, n: int,
                                                  block_m: int) -> None:
    ids = _routing(n, top_k, num_experts, shared, seed=num_experts + tp + n * 10 + block_m)
    for rank in range(tp):
        emap, num_local = _map(num_experts, rank, tp, shared)
        local_ids = _check_align(ids, emap, num_local, block_m)[0]
        assert torch.equal(local_ids >= 0, emap.long()[ids.long()] >= 0)


def test_ep_align_with_no_local_pair_and_with_every_pair_local() -> None:
    """No pair on this rank: total 0, sentinels and -1 everywhere. Every pair local: exactly moe_align."""
    ids = torch.tensor([[8, 9, 15], [12, 9, 10]], dtype=torch.int32)
    local_ids, sorted_pairs, block_expert, total = _check_align(ids, expert_map(16, 0, 2), 8, 4)
    assert int(total) == 0 and (sorted_pairs == 6).all() and (block_expert == -1).all() and (local_ids == -1).all()
    got = _check_align(ids, torch.arange(16, dtype=torch.int32), 16, 4)
    for g, w in zip(got[1:], OPS.moe_align(ids, 16, 4)):
        assert torch.equal(g, w)


def test_ep_align_duplicate_heavy_and_block_one() -> None:
    """Repeated local experts (segments over several BM=4 blocks), first and last local expert, and BM=1."""
    ids = torch.tensor([[3, 3, 9, 0, 7], [3, 0, 3, 7, 11], [3, 12, 3, 3, 7]], dtype=torch.int32)
    for block_m in (1, 4, 16):
        for rank in range(2):
            _check_align(ids, expert_map(16, rank, 2), 8, block_m)


def test_ep_align_multi_step_fills() -> None:
    """Outputs longer than one fill step: 257 local experts x (BM-1) cells and > NP_BLOCK blocks."""
    ids = _routing(6, 9, 514, False, seed=3)
    emap, num_local = _map(514, 1, 2, False)
    got = _check_align(ids, emap, num_local, 16)
    assert got[1].numel() > FILL_BLOCK and got[2].numel() > 64


def test_ep_align_above_the_gate_int64_ids_and_pdl_on_cpu() -> None:
    """NP > MAX_PAIRS runs the reference (same contract); int64 ids equal int32; pdl=True is dropped on CPU."""
    big = _routing(10, 8, 128, True, seed=4)
    assert big.numel() > MAX_PAIRS
    emap, num_local = _map(128, 0, 2, True)
    _check_align(big, emap, num_local, 16)
    ids = _routing(6, 8, 128, True, seed=5)
    want = ep_align_ref(ids, emap, num_local, 16)
    for got in (ep_align(ids.long(), emap, num_local, 16), ep_align(ids, emap, num_local, 16, pdl=True)):
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_ep_align_rejects_bad_arguments() -> None:
    emap = expert_map(16, 0, 2)
    with pytest.raises(ValueError, match="integer"):
        ep_align(torch.zeros(1, 4), emap, 8, 4)
    with pytest.raises(ValueError, match="int32"):
        ep_align(torch.zeros(1, 4, dtype=torch.int32), emap.long(), 8, 4)
    with pytest.raises(ValueError, match="num_local"):
        ep_align(torch.zeros(1, 4, dtype=torch.int32), emap, 0, 4)


# ---- ep_combine ---------------------------------------------------------------------------------------------
def _combine_inputs(n: int, k: int, h: int, dtype: torch.dtype, seed: int, shared: bool):
    """(expert_out [NP, h] with other ranks' rows NaN (never written), weights [N, k], local_ids, shared_out)."""
    g = torch.Generator().manual_seed(seed)
    local = torch.where(torch.rand(n, k, generator=g) < 0.5, torch.randint(0, 8, (n, k), generator=g), -1)
    local[0, 0] = 3                                                     # at least one local pair
    rows = torch.randn(n * k, h, generator=g) * 10.0 ** (4 * torch.rand(n * k, 1, generator=g) - 2)
    rows.view(n, k, h)[local < 0] = float("nan")
    shared_out = torch.randn(n, h, generator=g).to(dtype) if shared else None
    return rows.to(dtype), torch.rand(n, k, generator=g), local.to(torch.int32), shared_out


def _combine_formula(expert_out, weights, local, shared_out, order: int) -> torch.Tensor:
    """ep_combine as single fp32 operations in the given order over k (other ranks' terms exactly +0.0)."""
    n, k = weights.shape
    prods = expert_out.view(n, k, -1).float() * weights.unsqueeze(-1)
    prods = torch.where((local >= 0).unsqueeze(-1), prods, torch.zeros(()))
    acc = [torch.zeros_like(prods[:, 0]) for _ in range(4)]
    for j in range(k):
        slot = 0 if order == SEQUENTIAL else j % 4
        acc[slot] = acc[slot] + prods[:, j]
    routed = (((acc[0] + acc[1]) + acc[2]) + acc[3] if order == INTERLEAVE4 else acc[0]).to(expert_out.dtype)
    return routed if shared_out is None else (routed.float() + shared_out.float()).to(shared_out.dtype)


@pytest.mark.parametrize("shared", [False, True], ids=["no-shared", "shared"])
@pytest.mark.parametrize("n,k,h", [(1, 9, 128), (6, 9, 128), (6, 8, 256), (3, 5, 37), (2, 3, 1030)])
@dtypes
def test_ep_combine(n: int, k: int, h: int, dtype: torch.dtype, shared: bool, assert_kernel_close: Callable) -> None:
    expert_out, weights, local, shared_out = _combine_inputs(n, k, h, dtype, seed=n + k + h, shared=shared)
    for order in (SEQUENTIAL, INTERLEAVE4):
        got = ep_combine(expert_out, weights, local, shared_out, order=order)
        assert torch.equal(got, _combine_formula(expert_out, weights, local, shared_out, order)), f"order {order}"
    got = ep_combine(expert_out, weights, local, shared_out)
    want = ep_combine_ref(expert_out, weights, local, shared_out)
    assert not got.isnan().any(), "another rank's (NaN) row leaked, or a cell was left unwritten"
    if h % 128 == 0:
        assert torch.equal(got, want)
    elif dtype == torch.float32:                   # another order than torch's: ulps of the largest term
        largest = (expert_out.float().nan_to_num().abs().max() * weights.abs().max()).item()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=k * 2.0**-23 * largest)
    else:
        assert_kernel_close(got, want)


def test_ep_combine_rows_are_invariant_and_every_pair_local_is_moe_combine() -> None:
    """Token 0 alone == token 0 inside a 6-token call (bit for bit); all local: moe_combine's bits; pdl dropped."""
    expert_out, weights, local, shared_out = _combine_inputs(6, 9, 128, torch.bfloat16, seed=7, shared=True)
    full = ep_combine(expert_out, weights, local, shared_out)
    alone = ep_combine(expert_out[:9], weights[:1], local[:1], shared_out[:1])
    assert torch.equal(alone, full[:1])
    assert torch.equal(ep_combine(expert_out, weights, local, shared_out, pdl=True), full)
    dense = expert_out.nan_to_num()
    every = torch.zeros_like(local)
    assert torch.equal(ep_combine(dense, weights, every, shared_out), OPS.moe_combine(dense, weights, shared_out))


def test_ep_combine_rejects_bad_arguments() -> None:
    expert_out, weights, local, _ = _combine_inputs(2, 4, 16, torch.float32, seed=1, shared=False)
    with pytest.raises(ValueError, match="local_ids"):
        ep_combine(expert_out, weights, local[:, :3], None)
    with pytest.raises(ValueError, match="want \\[N\\*k, h\\]"):
        ep_combine(expert_out[:7], weights, local, None)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        ep_combine(expert_out.to(torch.int32), weights, local, None)


def test_lowerings_export_the_launchers() -> None:
    from lingc.kernels.lowering import kernel_table
    assert LOWERINGS == {"ep_align": ep_align, "ep_combine": ep_combine}
    assert kernel_table()["ep_align"] is ep_align and kernel_table()["ep_combine"] is ep_combine


# ---- in the TP2 program -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tp2_ranks(tiny_model_bf16, tiny_options):
    """(program before the tp pass, TP2 rank programs): test-tiny bf16 (the serving dtype), the engine's step and
    NEXTN programs only (the tp test budget: ~15 s of tracing and passes), every pass (fused shared expert)."""
    from lingc.passes.manager import CompileResult, PassManager
    from lingc.passes.tp import rank_programs, run_tp_stage
    from lingc.trace import trace
    result = PassManager(["all"]).run(trace(tiny_model_bf16, ["step", "nextn"], tiny_options))
    staged = CompileResult(result.program, list(result.stages))
    rank_weights = run_tp_stage(staged, 2)
    return result.program, rank_programs(staged.program, rank_weights)


@pytest.mark.parametrize("graph", ["step", "draft", "verify", "extend"])
def test_tp2_graphs_with_ep_kernels_equal_the_reference_bit_for_bit(tp2_ranks, graph: str) -> None:
    """Both ranks in lockstep (passes.tp.run_lockstep) on seeded random inputs (a half-full cache): ep_align and
    ep_combine on their kernels, every other op on its reference, against all reference ops: every output (logits,
    tokens, relays) and every state the graph writes are identical, on each rank."""
    from lingc.passes.tp import run_lockstep, shard_inputs
    from lingc.passes.verify import random_inputs
    before, ranks = tp2_ranks
    kernels = {OPS.ep_align: ep_align, OPS.ep_combine: ep_combine}
    assert any(n.target in kernels for n in ranks[0].graphs[graph].nodes)
    inputs = random_inputs(before, [graph])
    runs = []
    for call in (None, lambda target: kernels.get(target, target)):
        rank_in = [shard_inputs({k: v.clone() for k, v in inputs.items()}, ranks[0], graph, r, 2) for r in range(2)]
        outs = run_lockstep(ranks, graph, rank_in, call=call)
        runs.append([[o for o in (out if isinstance(out, (tuple, list)) else [out]) if o is not None]
                     + list(ri.values()) for out, ri in zip(outs, rank_in)])
    for r in range(2):
        for want, got in zip(*(run[r] for run in runs)):
            assert torch.equal(got, want), f"rank {r}: {graph} differs with the ep kernels"
