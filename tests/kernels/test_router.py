"""lingc.kernels.router in the Triton interpreter against torch.ops.lingc.router_topk / moe_align.

The reference's id order is unspecified, so rows are compared as sets of ids with the weight of each id (fp32
tolerance); the kernel's own order (descending biased score, lower id on ties) is checked separately. Inputs
are redrawn until every decision has a margin (group cut, expert cut) far above fp32 rounding of the sigmoid.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from lingc.kernels.router import MAX_PAIRS, router_align, router_align_ref, router_topk, router_topk_ref
from lingc.ops.moe import moe_align
from kernel_support import poisoned_empty  # noqa: E402  (tests/kernels is on sys.path)

SCALE = 2.5
MARGIN = 1e-5
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# (N, E, n_group, topk_group, top_k): Ling-3.0-tiny decode and verify, test-tiny, odd group sizes (12, 6),
# one group, every group kept, 512 experts (Ling-3.0-flash)
ROUTERS = [(1, 128, 8, 4, 8), (6, 128, 8, 4, 8), (3, 16, 4, 2, 4), (5, 96, 8, 3, 9), (4, 24, 1, 1, 3),
           (2, 48, 8, 8, 7), (2, 512, 8, 4, 8)]


def _margins_ok(x: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, top_k: int) -> bool:
    """Every row's group cut and expert cut have a float64 margin above MARGIN."""
    N, E = x.shape
    biased = torch.sigmoid(x.double()) + bias.double()
    groups = biased.view(N, n_group, -1).topk(2, dim=-1).values.sum(-1).sort(dim=-1, descending=True).values
    if topk_group < n_group and (groups[:, topk_group - 1] - groups[:, topk_group]).min() < MARGIN:
        return False
    keep = biased.view(N, n_group, -1).topk(2, dim=-1).values.sum(-1).topk(topk_group, dim=-1).indices
    mask = torch.zeros(N, n_group, dtype=torch.bool).scatter_(1, keep, True).repeat_interleave(E // n_group, 1)
    eligible = biased.masked_fill(~mask, -torch.inf).sort(dim=-1, descending=True).values
    return top_k == E or bool((eligible[:, top_k - 1] - eligible[:, top_k]).min() > MARGIN)


def _inputs(N: int, E: int, n_group: int, topk_group: int, top_k: int, dtype: torch.dtype, seed: int,
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [N, E], expert_bias [E]) in dtype, redrawn until the decisions have margins."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(200):
        x = (2 * torch.randn(N, E, generator=g)).to(dtype)
        bias = (0.05 * torch.randn(E, generator=g)).to(dtype)
        if _margins_ok(x, bias, n_group, topk_group, top_k):
            return x, bias
    raise AssertionError("could not draw router inputs with margins")




def _assert_same_routing(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor],
                         assert_close: Callable) -> None:
    """Same set of ids per row, and the same weight for each id (rows sorted by id on both sides)."""
    (w, ids), (w_ref, ids_ref) = got, want
    assert w.dtype == torch.float32 and ids.dtype == torch.int32 and w.shape == w_ref.shape == ids.shape
    ids_sorted, order = ids.long().sort(dim=-1)
    ids_ref_sorted, order_ref = ids_ref.long().sort(dim=-1)
    assert torch.equal(ids_sorted, ids_ref_sorted), f"ids {ids.tolist()} vs reference {ids_ref.tolist()}"
    assert_close(w.gather(1, order), w_ref.gather(1, order_ref))


def _assert_kernel_order(x: torch.Tensor, bias: torch.Tensor, ids: torch.Tensor) -> None:
    """Descending biased score along each row (ties, within fp32 rounding, to the lower id)."""
    biased = (torch.sigmoid(x.double()) + bias.double()).gather(1, ids.long())
    assert bool((biased[:, :-1] >= biased[:, 1:] - 1e-6).all()), f"ids {ids.tolist()} not in descending score"


routers = pytest.mark.parametrize("N,E,n_group,topk_group,top_k", ROUTERS,
                                  ids=[f"{n}x{e}-g{g}-tg{tg}-k{k}" for n, e, g, tg, k in ROUTERS])
dtypes = pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())


@routers
@dtypes
def test_router_topk_matches_reference(N: int, E: int, n_group: int, topk_group: int, top_k: int,
                                       dtype: torch.dtype, assert_kernel_close: Callable) -> None:
    x, bias = _inputs(N, E, n_group, topk_group, top_k, dtype, seed=N * 7919 + E + top_k)
    with poisoned_empty():
        got = router_topk(x, bias, n_group, topk_group, top_k, SCALE)
    _assert_same_routing(got, router_topk_ref(x, bias, n_group, topk_group, top_k, SCALE), assert_kernel_close)
    _assert_kernel_order(x, bias, got[1])


def test_router_topk_row_invariance_and_strided_rows() -> None:
    """Each row alone gives the bits it gets among 6 rows; rows of a wider tensor (row stride 2E) are read in place."""
    x, bias = _inputs(6, 128, 8, 4, 8, torch.float32, seed=11)
    wide = torch.cat([x, torch.randn_like(x)], dim=1)[:, :128]                  # [6, 128], row stride 256
    w, ids = router_topk(wide, bias, 8, 4, 8, SCALE)
    for n in range(6):
        w1, ids1 = router_topk(x[n:n + 1], bias, 8, 4, 8, SCALE)
        assert torch.equal(w1, w[n:n + 1]) and torch.equal(ids1, ids[n:n + 1])


def test_router_ties_go_to_the_lower_id() -> None:
    """Equal logits: the k lowest ids of the kept groups (groups tie too: the lower groups are kept), in id order."""
    x, bias = torch.zeros(2, 32), torch.zeros(32)
    w, ids = router_topk(x, bias, 4, 2, 5, SCALE)
    assert ids.tolist() == [[0, 1, 2, 3, 4]] * 2
    assert torch.allclose(w, torch.full((2, 5), SCALE / 5))


ALIGNS = [(1, 128, 8, 4, 8, 16), (6, 128, 8, 4, 8, 16), (8, 128, 8, 4, 8, 4), (3, 48, 4, 2, 5, 1),
          (2, 512, 8, 4, 8, 64), (7, 16, 4, 2, 4, 16)]


@pytest.mark.parametrize("N,E,n_group,topk_group,top_k,block_m", ALIGNS,
                         ids=[f"{n}x{e}-k{k}-bm{bm}" for n, e, _, _, k, bm in ALIGNS])
@pytest.mark.parametrize("repeat_rows", [False, True], ids=["distinct", "same-experts"])
def test_router_align_matches_reference(N: int, E: int, n_group: int, topk_group: int, top_k: int, block_m: int,
                                        repeat_rows: bool, assert_kernel_close: Callable) -> None:
    """Fused ("auto": "split" from 2 rows up where the pairs fit, else "rows" or "pairs"): routing as router_topk's
    bits, alignment exactly moe_align of those ids.

    same-experts repeats one row N times, so every expert's bucket holds N pairs (segments over several blocks).
    """
    x, bias = _inputs(1 if repeat_rows else N, E, n_group, topk_group, top_k, torch.float32, seed=N * 31 + block_m)
    x = x.expand(N, E).contiguous() if repeat_rows else x
    assert N * top_k <= MAX_PAIRS
    with poisoned_empty():
        got = router_align(x, bias, n_group, topk_group, top_k, SCALE, E, block_m)
    w, ids = router_topk(x, bias, n_group, topk_group, top_k, SCALE)
    assert torch.equal(got[0], w) and torch.equal(got[1], ids), "fused routing differs from router_topk"
    for name, g, r in zip(("sorted_pairs", "block_expert", "total"), got[2:], moe_align(ids, E, block_m)):
        assert g.dtype == r.dtype and torch.equal(g, r), f"{name}: {g.tolist()} vs reference {r.tolist()}"
    want = router_align_ref(x, bias, n_group, topk_group, top_k, SCALE, E, block_m)
    _assert_same_routing(got[:2], want[:2], assert_kernel_close)
    assert torch.equal(got[4], want[4]), "total differs from the reference's"


def test_router_align_above_gate_and_row_invariance() -> None:
    """variant="pairs" with N*k > 64 takes router_topk + moe_align; every row's routing equals that row routed
    alone (fused)."""
    x, bias = _inputs(9, 128, 8, 4, 8, torch.float32, seed=5)
    assert 9 * 8 > MAX_PAIRS
    w, ids, sorted_pairs, block_expert, total = router_align(x, bias, 8, 4, 8, SCALE, 128, 16, variant="pairs")
    for g, r in zip((sorted_pairs, block_expert, total), moe_align(ids, 128, 16)):
        assert torch.equal(g, r)
    for n in range(9):
        w1, ids1, *_ = router_align(x[n:n + 1], bias, 8, 4, 8, SCALE, 128, 16)
        assert torch.equal(w1, w[n:n + 1]) and torch.equal(ids1, ids[n:n + 1])


def test_pdl_on_cpu_falls_back() -> None:
    x, bias = _inputs(3, 128, 8, 4, 8, torch.float32, seed=2)
    args = (x, bias, 8, 4, 8, SCALE, 128, 16)
    for g, r in zip(router_align(*args, pdl=True), router_align(*args)):
        assert torch.equal(g, r)
    for g, r in zip(router_topk(x, bias, 8, 4, 8, SCALE, pdl=True), router_topk(x, bias, 8, 4, 8, SCALE)):
        assert torch.equal(g, r)


@pytest.mark.parametrize("case", ["1-d logits", "groups do not divide E", "top_k too large", "bias shape",
                                  "num_experts mismatch"])
def test_bad_arguments_rejected(case: str) -> None:
    x, bias = torch.zeros(2, 32), torch.zeros(32)
    with pytest.raises(ValueError):
        if case == "1-d logits":
            router_topk(x[0], bias, 4, 2, 4, SCALE)
        elif case == "groups do not divide E":
            router_topk(x, bias, 5, 2, 4, SCALE)
        elif case == "top_k too large":
            router_topk(x, bias, 4, 1, 9, SCALE)
        elif case == "bias shape":
            router_topk(x, bias[:16], 4, 2, 4, SCALE)
        else:
            router_align(x, bias, 4, 2, 4, SCALE, 64, 16)


# ---- fuse_shared_expert: k routed picks + the shared expert E (weight 1.0) -----------------------------------

SHARED_ROUTERS = [(1, 128, 8, 4, 8), (3, 16, 4, 2, 4), (6, 16, 4, 2, 4), (7, 128, 8, 4, 8)]   # 7 x 9 = 63 pairs


@pytest.mark.parametrize("N,E,n_group,topk_group,top_k", SHARED_ROUTERS,
                         ids=[f"{n}x{e}-k{k}+1" for n, e, _, _, k in SHARED_ROUTERS])
def test_fused_shared_appends_expert_e_with_weight_one(N: int, E: int, n_group: int, topk_group: int, top_k: int,
                                                       assert_kernel_close: Callable) -> None:
    """router_topk and router_align (fused, "auto") with fused_shared=1: the k routed columns are the bits
    of fused_shared=0, column k is expert E with weight exactly 1.0; the alignment is moe_align over E+1 experts."""
    x, bias = _inputs(N, E, n_group, topk_group, top_k, torch.float32, seed=N * 13 + E)
    plain_w, plain_ids = router_topk(x, bias, n_group, topk_group, top_k, SCALE)
    with poisoned_empty():
        w, ids = router_topk(x, bias, n_group, topk_group, top_k, SCALE, 1)
        fused = router_align(x, bias, n_group, topk_group, top_k, SCALE, E + 1, 16, 1)
    assert w.shape == ids.shape == (N, top_k + 1)
    assert torch.equal(w[:, :top_k], plain_w) and torch.equal(ids[:, :top_k], plain_ids)
    assert torch.equal(w[:, top_k], torch.ones(N)) and torch.equal(ids[:, top_k], torch.full((N,), E, dtype=torch.int32))
    _assert_same_routing((w, ids), router_topk_ref(x, bias, n_group, topk_group, top_k, SCALE, 1), assert_kernel_close)
    assert N * (top_k + 1) <= MAX_PAIRS
    assert torch.equal(fused[0], w) and torch.equal(fused[1], ids)
    for name, g, r in zip(("sorted_pairs", "block_expert", "total"), fused[2:], moe_align(ids, E + 1, 16)):
        assert torch.equal(g, r), f"{name}: {g.tolist()} vs reference {r.tolist()}"
    want = router_align_ref(x, bias, n_group, topk_group, top_k, SCALE, E + 1, 16, 1)
    assert torch.equal(fused[4], want[4]) and torch.equal(fused[3], want[3])


def test_fused_shared_above_the_gate_and_bad_counts() -> None:
    """variant="pairs" with N*(k+1) > 64 takes router_topk + moe_align (8 x 9 = 72 pairs); num_experts must count
    the shared expert."""
    x, bias = _inputs(8, 128, 8, 4, 8, torch.float32, seed=3)
    w, ids, sorted_pairs, block_expert, total = router_align(x, bias, 8, 4, 8, SCALE, 129, 16, 1, variant="pairs")
    assert ids.shape == (8, 9) and bool((ids[:, 8] == 128).all()) and bool((w[:, 8] == 1.0).all())
    for g, r in zip((sorted_pairs, block_expert, total), moe_align(ids, 129, 16)):
        assert torch.equal(g, r)
    with pytest.raises(ValueError, match="E \\+ fused_shared"):
        router_align(x, bias, 8, 4, 8, SCALE, 128, 16, 1)
    with pytest.raises(ValueError, match="fused_shared"):
        router_topk(x, bias, 8, 4, 8, SCALE, -1)
