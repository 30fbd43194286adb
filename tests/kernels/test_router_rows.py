"""router_align's "rows" kernel (tokens on warps, the align read off the routing tile) in the Triton interpreter.

Bit for bit against the "pairs" kernel where that one runs (N * (k + S) <= 64) and against the router_topk kernel
followed by torch's moe_align always (the routing contract of kernels/router.py: same ids in the same order, same
weight bits); against the torch reference up to its unspecified id order where the inputs have margins. Every
output cell is poisoned first. Covers N in {1, 2, 6, 16}, ties in scores and in group scores, a dominant bias,
n_group / topk_group limits, odd group sizes, chunked groups (GS > 32), 0 / 1 / 2 fused shared experts, row
invariance, the dispatch gates, and (compiled for sm_90 without a GPU) the layout that keeps rows inside warps.
An earlier "rows" wrote wrong block experts at N = 1 on the H200 (kernels/router.py's history; a GPU-only fault
the interpreter did not reproduce); since 253218f the H200 agrees. "auto" (the default) runs "rows" from
ROWS_FROM rows up and "pairs" below, where each is faster, unless "split" applies (test_router_split.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import lingc.kernels.router as router_mod
from lingc.kernels.router import MAX_PAIRS, MAX_ROWS, ROWS_FROM, _rows_launch, router_align, router_align_ref, router_topk
from lingc.ops.moe import moe_align
from kernel_support import poisoned_empty  # noqa: E402  (tests/kernels is on sys.path)
from test_router import SCALE, _assert_same_routing, _inputs  # noqa: E402

OUTPUTS = ("weights", "ids", "sorted_pairs", "block_expert", "total")
# (N, E, n_group, topk_group, top_k, block_m, fused_shared): Ling-3.0-tiny decode / verify with the fused shared
# expert (as in the step; test_router.py's router_align tests run this kernel without it), 2 and 16 tokens, odd
# group size 12, one group, groups of 4 experts (8 rows per warp), chunked groups (GS = 128: 4 lane chunks),
# Ling-3.0-flash (E = 512) at 2 and 16 tokens, every group kept
CASES = [(1, 128, 8, 4, 8, 16, 1), (6, 128, 8, 4, 8, 16, 1), (2, 128, 8, 4, 8, 16, 1), (16, 128, 8, 4, 8, 16, 1),
         (16, 128, 8, 4, 8, 4, 0), (6, 96, 8, 3, 9, 4, 0), (16, 24, 1, 1, 3, 1, 2), (5, 16, 4, 2, 4, 2, 0),
         (3, 1024, 8, 2, 6, 16, 1), (2, 512, 8, 4, 8, 64, 1), (16, 512, 8, 4, 8, 16, 1), (6, 48, 8, 8, 7, 16, 1)]
TIES = [(1, 1, 0.25), (2, 0, 0.0), (6, 1, 0.25), (6, 0, 0.0), (16, 1, 0.25)]      # (N, fused_shared, bias scale)

def _ids(case: tuple) -> str:
    n, e, g, tg, k, bm, s = case
    return f"{n}x{e}-g{g}/{tg}-k{k}+{s}-bm{bm}"


def _tie_inputs(N: int, E: int, seed: int, bias_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits from {-1, 0, 1} (equal scores everywhere, hence tied group scores too) and a bias from a few values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-1, 2, (N, E), generator=g).float()
    bias = bias_scale * torch.randint(0, 3, (E,), generator=g).float()
    return x, bias


def _check_rows(x: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, top_k: int, block_m: int,
                shared: int) -> tuple[torch.Tensor, ...]:
    """The "rows" kernel's five outputs, checked bit for bit against router_topk + moe_align and "pairs"."""
    N, E = x.shape
    assert _rows_launch(N, n_group, E // n_group, top_k, shared) is not None, "case does not reach the rows kernel"
    args = (x, bias, n_group, topk_group, top_k, SCALE, E + shared, block_m, shared)
    with poisoned_empty():
        got = router_align(*args, variant="rows")
    weights, ids = router_topk(x, bias, n_group, topk_group, top_k, SCALE, shared)
    want = (weights, ids, *moe_align(ids, E + shared, block_m))
    for name, g, w in zip(OUTPUTS, got, want):
        assert g.dtype == w.dtype and torch.equal(g, w), f"{name}: {g.tolist()} vs router_topk + moe_align {w.tolist()}"
    if N * (top_k + shared) <= MAX_PAIRS:
        with poisoned_empty():
            pairs = router_align(*args, variant="pairs")
        for name, g, p in zip(OUTPUTS, got, pairs):
            assert torch.equal(g, p), f"{name}: rows {g.tolist()} vs pairs {p.tolist()}"
    return got


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_rows_matches_topk_align_pairs_and_reference(case: tuple, assert_kernel_close: Callable) -> None:
    N, E, n_group, topk_group, top_k, block_m, shared = case
    x, bias = _inputs(N, E, n_group, topk_group, top_k, torch.float32, seed=N * 101 + E + shared)
    got = _check_rows(x, bias, n_group, topk_group, top_k, block_m, shared)
    want = router_align_ref(x, bias, n_group, topk_group, top_k, SCALE, E + shared, block_m, shared)
    _assert_same_routing(got[:2], want[:2], assert_kernel_close)
    assert torch.equal(got[4], want[4]) and torch.equal(got[3], want[3]), "block_expert / total differ from reference"


@pytest.mark.parametrize("N,shared,bias_scale", TIES, ids=[f"{n}x128+{s}-bias{b}" for n, s, b in TIES])
def test_rows_ties(N: int, shared: int, bias_scale: float) -> None:
    """Tied scores and tied group scores resolve as router_topk resolves them (lower group, then lower id)."""
    x, bias = _tie_inputs(N, 128, seed=N + 7 * shared, bias_scale=bias_scale)
    _check_rows(x, bias, 8, 4, 8, 16, shared)
    zeros = torch.zeros(N, 128)
    weights, ids, *_ = _check_rows(zeros, torch.zeros(128), 8, 4, 8, 16, shared)
    assert ids[:, :8].tolist() == [list(range(8))] * N                            # all equal: groups 0.., ids 0..


def test_rows_dominant_bias_and_bf16_logits() -> None:
    """A bias that decides the selection (weights stay unbiased), on bf16 logits (widened to fp32 in the kernel)."""
    g = torch.Generator().manual_seed(4)
    x = (2 * torch.randn(6, 128, generator=g)).to(torch.bfloat16)
    bias = torch.zeros(128)
    bias[torch.randperm(128, generator=g)[:20]] = 5.0
    weights, ids, *_ = _check_rows(x, bias, 8, 4, 8, 16, 1)
    assert bool((bias[ids[:, :8].long()] == 5.0).all()), "the large-bias experts (in kept groups) win"


def test_rows_row_invariance() -> None:
    """Token t routed among 16 (and among 6) gets the bits it gets alone."""
    x, bias = _inputs(16, 128, 8, 4, 8, torch.float32, seed=21)
    for n, rows in ((16, (0, 9, 15)), (6, range(6))):
        w, ids, *_ = router_align(x[:n], bias, 8, 4, 8, SCALE, 129, 16, 1)
        for t in rows:
            w1, ids1, *_ = router_align(x[t:t + 1], bias, 8, 4, 8, SCALE, 129, 16, 1)
            assert torch.equal(w1, w[t:t + 1]) and torch.equal(ids1, ids[t:t + 1]), f"row {t} of {n}"


def test_rows_gates_and_variant() -> None:
    """N > MAX_ROWS and tiles over the per-thread budget leave "rows" (same bits); an unknown variant is refused."""
    assert _rows_launch(MAX_ROWS + 1, 8, 16, 8, 1) is None and _rows_launch(1, 8, 512, 8, 1) is None
    assert _rows_launch(6, 8, 16, 8, 1)["num_warps"] == 4 and _rows_launch(1, 8, 16, 8, 1)["num_warps"] == 1
    x, bias = _inputs(MAX_ROWS + 1, 16, 4, 2, 4, torch.float32, seed=8)
    got = router_align(x, bias, 4, 2, 4, SCALE, 17, 16, 1)                         # router_topk + moe_align
    weights, ids = router_topk(x, bias, 4, 2, 4, SCALE, 1)
    assert all(torch.equal(g, w) for g, w in zip(got, (weights, ids, *moe_align(ids, 17, 16))))
    big, big_bias = _inputs(1, 4096, 8, 4, 8, torch.float32, seed=9)              # GS = 512: "pairs"
    got = router_align(big, big_bias, 8, 4, 8, SCALE, 4096, 16)
    assert all(torch.equal(g, p) for g, p in zip(got, router_align(big, big_bias, 8, 4, 8, SCALE, 4096, 16,
                                                                     variant="pairs")))
    with pytest.raises(ValueError, match="variant"):
        router_align(x[:2], bias, 4, 2, 4, SCALE, 17, 16, 1, variant="fast")


_LAYOUT_PROBE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import lingc.kernels.router as R
for n in (1, 6):
    cfg = R._rows_launch(n, 8, 16, 8, 1)
    warps = cfg.pop("num_warps")
    sig = {p: "*fp32" if p in ("logits_ptr", "bias_ptr", "w_ptr") else "*i32" for p in
           ("logits_ptr", "bias_ptr", "w_ptr", "ids_ptr", "sorted_ptr", "block_expert_ptr", "total_ptr")}
    sig.update(N="i32", stride_row="i32", n_group="i32", topk_group="i32", scale="fp32", BM="i32",
               max_padded="i32", n_blocks="i32", **{k: "constexpr" for k in cfg}, PDL="constexpr")
    k = triton.compile(ASTSource(fn=R._router_align_rows_kernel, signature=sig, constexprs=dict(cfg, PDL=True)),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    layouts = [line for line in k.asm["ttgir"].splitlines() if line.startswith("#blocked")]
    warps_per_cta = (line.split("warpsPerCTA = [")[1].split("]")[0].replace(" ", "") for line in layouts)
    print(n, warps, k.asm["ptx"].count("bar.sync"), *warps_per_cta, sep="|")
"""


def test_rows_layout_keeps_rows_inside_warps() -> None:
    """Compiled for sm_90 (no GPU needed; a fresh process without TRITON_INTERPRET, ~5 s): every 4-d layout of the
    kernel puts warps on the row axis only, so the pick chain has no CTA barrier (few bar.sync in all), at the
    decode and verify shapes of Ling-3.0-tiny. A regression here is the "pairs" slowdown coming back."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _LAYOUT_PROBE], capture_output=True, text=True, timeout=300, env=env,
                          cwd=Path(__file__).resolve().parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for line in proc.stdout.splitlines():
        n, warps, barriers, *layouts = line.split("|")
        four_d = [[int(w) for w in lay.split(",")] for lay in layouts if lay.count(",") == 3]
        assert four_d and all(w[0] == w[2] == w[3] == 1 for w in four_d), f"N={n}: warps off the row axis {layouts}"
        # N = 1: one more (the permute of the G prefix sum goes through shared memory; one warp: nearly free)
        assert int(barriers) <= (3 if n == "1" else 8), f"N={n}: {barriers} bar.sync (want <= 8)"


@pytest.mark.parametrize("N", [1, ROWS_FROM, 6])
def test_auto_variant_picks_by_rows(N: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default ("auto") launches "pairs" below ROWS_FROM rows and "rows" from there, with the same bits, where
    "split" does not apply (here: SPLIT_FROM out of reach; test_router_split.py checks the split choice)."""
    x, bias = _inputs(N, 128, 8, 4, 8, torch.float32, seed=N)
    args = (x, bias, 8, 4, 8, SCALE, 129, 16, 1)
    monkeypatch.setattr(router_mod, "SPLIT_FROM", MAX_ROWS + 1)
    launched = []
    for name in ("_router_align_rows_kernel", "_router_align_kernel"):
        kernel = getattr(router_mod, name)
        monkeypatch.setattr(router_mod, name, _Spy(kernel, name, launched))
    got = router_align(*args)
    assert launched == ["_router_align_rows_kernel" if N >= ROWS_FROM else "_router_align_kernel"]
    for variant in ("rows", "pairs"):
        for name, g, w in zip(OUTPUTS, got, router_align(*args, variant=variant)):
            assert torch.equal(g, w), f"{name}: auto vs {variant}"


class _Spy:
    """A kernel stand-in recording which kernel a launcher indexed, then launching it."""

    def __init__(self, kernel, name: str, log: list) -> None:
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        self.log.append(self.name)
        return self.kernel[grid]
