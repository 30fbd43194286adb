"""router_align "split"'s warp-local routing (`_route_row_replicas`: the row on REPLICAS copies, warps on the copies)
in the Triton interpreter.

Bit for bit against "pairs" and against router_topk + torch's moe_align (`_check_split`, every output cell poisoned
first, the ticket counter zero afterwards), at N in {1, 2, 6, 7}, with and without the fused shared expert, at the
test-tiny (E = 16 in 4 groups of 4, topk_group 2, k = 4) and Ling-3.0-tiny (E = 128 in 8 groups of 16, topk_group 4,
k = 8) group shapes, on logits that mix continuous rows with rows on a coarse grid (tied scores, tied group scores,
tied runner-ups). Also: the gate (`_split_tile`: replicas where the tile holds <= SPLIT_REPLICA_CELLS per thread,
router_topk's one-row tile at E = 512, whose bits are checked too), and num_warps 1 / 2 / 8 (2 / 4 / 16 copies)
giving the default's bits. The sm_90 layout and barrier count are checked in test_router_split.py's PTX probe.
"""

from __future__ import annotations

import pytest
import torch

import lingc.kernels.router as router_mod
from lingc.kernels.router import SPLIT_REPLICA_CELLS, _split_tile, router_align
from test_router import SCALE, _inputs  # noqa: E402  (tests/kernels is on sys.path)
from test_router_rows import OUTPUTS  # noqa: E402
from test_router_split import _check_split  # noqa: E402

# (E, n_group, topk_group, top_k): test-tiny and Ling-3.0-tiny (lingc/presets.py)
SHAPES = {"test-tiny": (16, 4, 2, 4), "ling-3.0-tiny": (128, 8, 4, 8)}
WARP_CASES = [(shape, N, shared) for shape in SHAPES for N in (1, 2, 6, 7) for shared in (0, 1)]


def _mixed_inputs(N: int, E: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Even rows continuous (2 * randn), odd rows and row 0 of a one-row call on the grid {-1, -1/2, .., 1} (equal
    scores, so tied group scores and ties at the k-th pick); the bias from {0, 1/4} (ties survive it)."""
    g = torch.Generator().manual_seed(seed)
    x = 2 * torch.randn(N, E, generator=g)
    grid = torch.randint(-2, 3, (N, E), generator=g).float() / 2
    tied = (torch.arange(N) % 2 == 1) | (N == 1)
    x = torch.where(tied[:, None], grid, x)
    bias = 0.25 * torch.randint(0, 2, (E,), generator=g).float()
    return x, bias


@pytest.mark.parametrize("shape,N,shared", WARP_CASES, ids=[f"{s}-N{n}+{sh}" for s, n, sh in WARP_CASES])
def test_warp_split_matches_pairs_and_topk_align(shape: str, N: int, shared: int) -> None:
    E, n_group, topk_group, top_k = SHAPES[shape]
    assert _split_tile(n_group, E // n_group, top_k, shared, 4)["REPLICAS"] > 0, "case misses the replicated path"
    x, bias = _mixed_inputs(N, E, seed=1000 * N + E + shared)
    _check_split(x, bias, n_group, topk_group, top_k, 16 if E == 128 else 4, shared)


def test_warp_split_gate_and_one_row_tile_at_512() -> None:
    """REPLICAS = warps * 32 / L while G x C <= SPLIT_REPLICA_CELLS; Ling-3.0-flash (E = 512: 8 x 2 cells per
    thread) keeps router_topk's one-row tile (REPLICAS = 0), with the same bits as "pairs"."""
    assert SPLIT_REPLICA_CELLS == 8
    assert {k: _split_tile(8, 16, 8, 1, 4)[k] for k in ("REPLICAS", "L_BLOCK", "C_BLOCK", "K_BLOCK")} == \
        dict(REPLICAS=8, L_BLOCK=16, C_BLOCK=1, K_BLOCK=16)
    assert _split_tile(4, 4, 4, 1, 4)["REPLICAS"] == 32 and _split_tile(8, 32, 8, 1, 1)["REPLICAS"] == 1
    assert _split_tile(8, 64, 8, 1, 4)["REPLICAS"] == 0                            # E = 512
    x, bias = _inputs(2, 512, 8, 4, 8, torch.float32, seed=17)
    _check_split(x, bias, 8, 4, 8, 16, 1)


def test_warp_split_num_warps_keep_bits() -> None:
    """num_warps 1, 2 and 8 (2, 4 and 16 copies of the row) give the default's bits."""
    x, bias = _mixed_inputs(3, 128, seed=5)
    args = (x, bias, 8, 4, 8, SCALE, 129, 16, 1)
    want = router_align(*args, variant="split")
    assert router_mod._split_warps(128) == 4
    for warps in (1, 2, 8):
        got = router_align(*args, variant="split", split_warps=warps)
        for name, g, w in zip(OUTPUTS, got, want):
            assert torch.equal(g, w), f"{name}: split at {warps} warps vs 4"
