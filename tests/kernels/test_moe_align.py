"""lingc.kernels.moe_align in the Triton interpreter against torch.ops.lingc.moe_align, at decode-sized pair counts.

Every output buffer the launcher allocates is poisoned first (autouse fixture), so each comparison also checks
that the kernel itself wrote every element: sentinels inside padded blocks, the -1 / NP tails and the total.
"""

from __future__ import annotations

import pytest
import torch

import lingc.kernels.moe_align as moe_align_module
from lingc.kernels.moe_align import FILL_BLOCK, LOWERINGS, MAX_PAIRS, moe_align, moe_align_ref

# [N, k] with N*k in {1, 4, 9, 24, 54, 64}: a draft step (1 x 9), a verify chain (6 x 9), the gate (8 x 8)
SHAPES = [(1, 1), (1, 4), (1, 9), (3, 8), (6, 9), (8, 8)]
EXPERTS = [16, 128]
BLOCKS = [4, 16]


POISON = -0x2152411  # an int32 no output cell can legitimately hold


@pytest.fixture(autouse=True)
def _poisoned_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher's output buffers start as POISON instead of whatever torch.empty returns."""
    monkeypatch.setattr(moe_align_module, "_new_int32",
                        lambda n, device: torch.full((n,), POISON, dtype=torch.int32, device=device))


def _ids(n: int, k: int, num_experts: int, distinct: int | None, seed: int) -> torch.Tensor:
    """Expert ids [N, k] int32 in [0, E); with `distinct`, drawn from only that many experts (heavy duplicates)."""
    g = torch.Generator().manual_seed(seed)
    if distinct is None:
        return torch.randint(0, num_experts, (n, k), generator=g, dtype=torch.int32)
    pool = torch.randperm(num_experts, generator=g)[:distinct]
    return pool[torch.randint(0, distinct, (n, k), generator=g)].to(torch.int32)


def _check_contract(ids: torch.Tensor, num_experts: int, block_m: int,
                    got: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """The contract spelled out independently of the reference: buckets, sentinels, block experts, total."""
    sorted_pairs, block_expert, total = got
    flat = ids.reshape(-1).tolist()
    num_pairs = len(flat)
    assert sorted_pairs.dtype == block_expert.dtype == total.dtype == torch.int32
    assert sorted_pairs.numel() == num_pairs + num_experts * (block_m - 1)
    assert block_expert.numel() == -(-sorted_pairs.numel() // block_m) and total.shape == (1,)
    cells, blocks, t = sorted_pairs.tolist(), block_expert.tolist(), int(total)
    pos, want_blocks = 0, []
    for e in range(num_experts):
        pairs = [p for p, x in enumerate(flat) if x == e]  # stable: ascending pair index
        padded = -(-len(pairs) // block_m) * block_m
        assert cells[pos:pos + len(pairs)] == pairs, f"expert {e}: pairs {cells[pos:pos + len(pairs)]}, want {pairs}"
        assert cells[pos + len(pairs):pos + padded] == [num_pairs] * (padded - len(pairs)), f"expert {e}: padding"
        want_blocks += [e] * (padded // block_m)
        pos += padded
    assert t == pos and t % block_m == 0
    assert all(c == num_pairs for c in cells[t:]), "tail past the total is not the sentinel"
    assert blocks == want_blocks + [-1] * (len(blocks) - len(want_blocks))


def _check(ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    got = moe_align(ids, num_experts, block_m)
    want = moe_align_ref(ids, num_experts, block_m)
    for name, g, w in zip(("sorted_pairs", "block_expert", "total"), got, want):
        assert torch.equal(g, w), f"{name}: got {g.tolist()}, want {w.tolist()}"
    _check_contract(ids, num_experts, block_m, got)


@pytest.mark.parametrize("block_m", BLOCKS)
@pytest.mark.parametrize("num_experts", EXPERTS)
@pytest.mark.parametrize("n,k", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_random_ids_match_reference(n: int, k: int, num_experts: int, block_m: int) -> None:
    _check(_ids(n, k, num_experts, None, seed=n * 1000 + k * 10 + num_experts + block_m), num_experts, block_m)


@pytest.mark.parametrize("distinct", [1, 2, 3])
@pytest.mark.parametrize("n,k", [(1, 9), (6, 9), (8, 8)], ids=["1x9", "6x9", "8x8"])
def test_duplicate_heavy_ids_match_reference(n: int, k: int, distinct: int) -> None:
    """Few distinct experts: long buckets spanning several blocks (BM=4) or one partly filled block (BM=16)."""
    for block_m in BLOCKS:
        _check(_ids(n, k, 128, distinct, seed=n * 100 + k + distinct), 128, block_m)


def test_edge_experts_and_block_one() -> None:
    """Experts 0 and E-1 (first and last segment), and BM=1 (no padding at all)."""
    ids = torch.tensor([[15, 0, 15], [0, 7, 15]], dtype=torch.int32)
    for block_m in (1, 4, 16):
        _check(ids, 16, block_m)


def test_docstring_worked_example() -> None:
    """techniques.md section 6 (SGLang's docstring): ids 1..4, so E=5 with expert 0 empty, placed first."""
    ids = torch.tensor([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]], dtype=torch.int32)
    sorted_pairs, block_expert, total = moe_align(ids, 5, 4)
    assert sorted_pairs[:16].tolist() == [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12]
    assert sorted_pairs[16:].tolist() == [12] * (12 + 5 * 3 - 16)
    assert block_expert.tolist() == [1, 2, 3, 4, -1, -1, -1]
    assert total.tolist() == [16]
    _check(ids, 5, 4)


@pytest.mark.parametrize("num_experts,block_m", [(513, 16), (129, 16), (8, 128)])
def test_every_element_written_with_multi_step_fills(num_experts: int, block_m: int) -> None:
    """Outputs longer than one fill step (513 experts: 7749 cells, 485 blocks; BM=128: 128 cells per expert)."""
    ids = _ids(6, 9, num_experts, None, seed=num_experts + block_m)
    got = moe_align(ids, num_experts, block_m)
    assert got[0].numel() > FILL_BLOCK or got[1].numel() * block_m > FILL_BLOCK
    assert all(not (t == POISON).any() for t in got), "an output cell was left unwritten"
    _check(ids, num_experts, block_m)


@pytest.mark.parametrize("n,k", [(1, 8), (3, 4), (7, 8)], ids=["1x8+1", "3x4+1", "7x8+1"])
def test_fused_shared_expert_pairs(n: int, k: int) -> None:
    """fuse_shared_expert: N*(k+1) pairs, the last of each token expert E (the last bucket, N pairs), E+1 experts;
    7 x 9 = 63 pairs is one launch."""
    routed = _ids(n, k, 128, None, seed=n * 10 + k)
    ids = torch.cat([routed, torch.full((n, 1), 128, dtype=torch.int32)], 1)       # [N, k+1]
    assert ids.numel() <= MAX_PAIRS
    for block_m in BLOCKS:
        _check(ids, 129, block_m)
    sorted_pairs, block_expert, total = moe_align(ids, 129, 4)
    shared_blocks = -(-n // 4)
    assert block_expert[int(total) // 4 - shared_blocks:int(total) // 4].tolist() == [128] * shared_blocks


def test_lowerings_export_the_launcher() -> None:
    assert LOWERINGS == {"moe_align": moe_align}


def test_int64_ids() -> None:
    """int64 ids (torch topk indices) give the same result as int32."""
    ids = _ids(6, 9, 128, None, seed=5)
    got = moe_align(ids.long(), 128, 16)
    for g, w in zip(got, moe_align_ref(ids, 128, 16)):
        assert torch.equal(g, w)


def test_above_gate_falls_back_to_reference() -> None:
    """numel > MAX_PAIRS goes to the reference op and still matches (and meets the contract)."""
    ids = _ids(10, 9, 128, None, seed=3)
    assert ids.numel() > MAX_PAIRS
    _check(ids, 128, 16)


def test_pdl_on_cpu_falls_back() -> None:
    """pdl=True on a CPU tensor (interpreter) is dropped: no GDC call runs, results equal pdl=False."""
    ids = _ids(6, 9, 16, None, seed=9)
    for g, w in zip(moe_align(ids, 16, 4, pdl=True), moe_align(ids, 16, 4)):
        assert torch.equal(g, w)


def test_float_ids_rejected() -> None:
    with pytest.raises(ValueError, match="integer"):
        moe_align(torch.zeros(2, 2), 4, 4)
