"""router_align's "split" kernel (one program per row, the last ticket aligns) in the Triton interpreter.

Bit for bit against the "pairs" kernel (all five outputs) and against the router_topk kernel followed by torch's
moe_align (kernels/router.py's row contract: same ids in the same order, same weight bits; moe_align's contract for
the rest), every output cell poisoned first. Covers N in {2, 3, 6, 7, 8} with 0 and 1 fused shared experts,
block_m 4 and 16, E = 128 and E = 40 (odd groups of 5), tied scores, the ticket counter left at zero (the
device's default one and a caller's `workspace`), bad workspaces, the "auto" dispatch (split from SPLIT_FROM rows up
while N * (k + S) <= MAX_PAIRS), and, compiled for sm_90 without a GPU, that the PDL build carries the wait, the
acq_rel ticket and the L2 (.cg) reload of the ids in that order.
The interpreter runs the programs one after another in id order, so there program N - 1 always draws the last
ticket; which program comes last on the GPU changes nothing the align reads (all ids are stored by then).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lingc.kernels.router as router_mod
from lingc.kernels.router import MAX_PAIRS, SPLIT_FROM, align_counters, router_align, router_topk
from lingc.ops.moe import moe_align
from kernel_support import poisoned_empty  # noqa: E402  (tests/kernels is on sys.path)
from test_router import SCALE, _inputs  # noqa: E402
from test_router_rows import OUTPUTS, _Spy, _tie_inputs  # noqa: E402

# (N, E, n_group, topk_group, top_k, block_m, fused_shared): Ling-3.0-tiny verify (N = 6, shared expert fused) and
# its neighbours, 7 x 9 = 63 and 8 x 8 = 64 pairs (the MAX_PAIRS edge, NP_BLOCK = 64), groups of 5 experts
CASES = [(2, 128, 8, 4, 8, 16, 0), (2, 128, 8, 4, 8, 4, 1), (3, 40, 8, 3, 5, 4, 1), (6, 128, 8, 4, 8, 16, 1),
         (6, 128, 8, 4, 8, 4, 0), (7, 128, 8, 4, 8, 16, 1), (8, 128, 8, 4, 8, 4, 0), (8, 40, 8, 3, 5, 16, 1)]
TIES = [(2, 1, 0.25), (6, 0, 0.0), (6, 1, 0.25)]                                  # (N, fused_shared, bias scale)


def _case_id(case: tuple) -> str:
    n, e, g, tg, k, bm, s = case
    return f"{n}x{e}-g{g}/{tg}-k{k}+{s}-bm{bm}"


def _check_split(x: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, top_k: int, block_m: int,
                 shared: int, workspace: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """The "split" kernel's five outputs, bit for bit against "pairs" and router_topk + moe_align; the counter it
    used is zero afterwards."""
    N, E = x.shape
    assert N * (top_k + shared) <= MAX_PAIRS, "case does not reach the split kernel"
    args = (x, bias, n_group, topk_group, top_k, SCALE, E + shared, block_m, shared)
    with poisoned_empty():
        got = router_align(*args, variant="split", workspace=workspace)
        pairs = router_align(*args, variant="pairs")
    counter = workspace if workspace is not None else align_counters(x.device)
    assert not counter.any(), f"ticket counter left at {counter.tolist()}"
    for name, g, p in zip(OUTPUTS, got, pairs):
        assert g.dtype == p.dtype and torch.equal(g, p), f"{name}: split {g.tolist()} vs pairs {p.tolist()}"
    weights, ids = router_topk(x, bias, n_group, topk_group, top_k, SCALE, shared)
    for name, g, w in zip(OUTPUTS, got, (weights, ids, *moe_align(ids, E + shared, block_m))):
        assert torch.equal(g, w), f"{name}: split {g.tolist()} vs router_topk + moe_align {w.tolist()}"
    return got


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_split_matches_pairs_and_topk_align(case: tuple) -> None:
    N, E, n_group, topk_group, top_k, block_m, shared = case
    x, bias = _inputs(N, E, n_group, topk_group, top_k, torch.float32, seed=N * 37 + E + 5 * shared + block_m)
    _check_split(x, bias, n_group, topk_group, top_k, block_m, shared)


@pytest.mark.parametrize("N,shared,bias_scale", TIES, ids=[f"{n}x128+{s}-bias{b}" for n, s, b in TIES])
def test_split_ties(N: int, shared: int, bias_scale: float) -> None:
    """Tied scores and group scores resolve as router_topk resolves them; all-equal rows pick ids 0..7 each, so
    every routed expert's bucket holds all N rows (segments over one block, pairs in row order)."""
    x, bias = _tie_inputs(N, 128, seed=3 * N + shared, bias_scale=bias_scale)
    _check_split(x, bias, 8, 4, 8, 16, shared)
    _, ids, *_ = _check_split(torch.zeros(N, 128), torch.zeros(128), 8, 4, 8, 4, shared)
    assert ids[:, :8].tolist() == [list(range(8))] * N


def test_split_workspace_and_repeat_launches() -> None:
    """A caller's counters (more than one is fine) serve back-to-back launches and stay zero; one row (a grid of
    one: ticket 0 is the last) works too; the default counter is one int32 per device, zero."""
    ws = torch.zeros(3, dtype=torch.int32)
    for seed, N in ((1, 6), (2, 6), (3, 1)):
        x, bias = _inputs(N, 128, 8, 4, 8, torch.float32, seed=seed)
        _check_split(x, bias, 8, 4, 8, 16, 1, workspace=ws)
    default = align_counters("cpu")
    assert default.dtype == torch.int32 and default.numel() == router_mod.ALIGN_COUNTERS and not default.any()


@pytest.mark.parametrize("bad", ["float", "empty", "strided", "device", "not a tensor"])
def test_split_bad_workspace_rejected(bad: str) -> None:
    x, bias = _inputs(2, 16, 4, 2, 4, torch.float32, seed=4)
    ws = {"float": torch.zeros(1), "empty": torch.zeros(0, dtype=torch.int32),
          "strided": torch.zeros(4, dtype=torch.int32)[::2], "device": torch.zeros(1, dtype=torch.int32, device="meta"),
          "not a tensor": [0]}[bad]
    with pytest.raises(ValueError, match="router_align: workspace holds .* want a contiguous int32 tensor"):
        router_align(x, bias, 4, 2, 4, SCALE, 17, 16, 1, variant="split", workspace=ws)


def test_split_fallbacks_and_pdl_on_cpu() -> None:
    """variant="split" above MAX_PAIRS runs router_topk + moe_align (same bits); pdl=True on the CPU is PDL off."""
    x, bias = _inputs(8, 16, 4, 2, 8, torch.float32, seed=6)
    assert 8 * 9 > MAX_PAIRS
    got = router_align(x, bias, 4, 2, 8, SCALE, 17, 16, 1, variant="split")
    weights, ids = router_topk(x, bias, 4, 2, 8, SCALE, 1)
    assert all(torch.equal(g, w) for g, w in zip(got, (weights, ids, *moe_align(ids, 17, 16))))
    args = (x[:3], bias, 4, 2, 4, SCALE, 17, 4, 1)
    assert all(torch.equal(g, w) for g, w in zip(router_align(*args, variant="split", pdl=True),
                                                 router_align(*args, variant="split")))
    with pytest.raises(ValueError, match="split_warps"):
        router_align(*args, variant="split", split_warps=3)


# (N, E, n_group, topk_group, top_k, shared, kernel "auto" launches)
AUTO = [(1, 128, 8, 4, 8, 1, "_router_align_rows_kernel"), (SPLIT_FROM, 128, 8, 4, 8, 1, "_router_align_split_kernel"),
        (6, 128, 8, 4, 8, 1, "_router_align_split_kernel"), (8, 16, 4, 2, 8, 1, "_router_align_rows_kernel")]


@pytest.mark.parametrize("N,E,n_group,topk_group,top_k,shared,kernel", AUTO,
                         ids=[f"{n}x{e}-k{k}+{s}" for n, e, _, _, k, s, _ in AUTO])
def test_auto_picks_split_from_split_from(N: int, E: int, n_group: int, topk_group: int, top_k: int, shared: int,
                                          kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """"auto" launches "split" from SPLIT_FROM rows up while N * (k + S) <= MAX_PAIRS ("rows" above it and at one
    row, ROWS_FROM = 1), with the bits of the explicit variants."""
    x, bias = _inputs(N, E, n_group, topk_group, top_k, torch.float32, seed=N + E)
    args = (x, bias, n_group, topk_group, top_k, SCALE, E + shared, 16, shared)
    launched = []
    for name in ("_router_align_kernel", "_router_align_rows_kernel", "_router_align_split_kernel"):
        monkeypatch.setattr(router_mod, name, _Spy(getattr(router_mod, name), name, launched))
    got = router_align(*args)
    assert launched == [kernel]
    for variant in ("split", "pairs", "rows"):
        for name, g, w in zip(OUTPUTS, got, router_align(*args, variant=variant)):
            assert torch.equal(g, w), f"{name}: auto vs {variant}"


_PTX_PROBE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import lingc.kernels.router as R
pdl = sys.argv[1] == "1"
tile = R._tile(8, 16, 8, 1)                                    # Ling-3.0-tiny verify: N = 6, E = 128 + 1, 54 pairs
const = dict(tile, NP_BLOCK=64, BM=16, BM_BLOCK=16, FILL=R.FILL_BLOCK, PDL=pdl)
sig = {n: "constexpr" if n in const else "fp32" if n == "scale" else
          ("*fp32" if n in ("logits_ptr", "bias_ptr", "w_ptr") else "*i32") if n.endswith("_ptr") else "i32"
       for n in R._router_align_split_kernel.arg_names}
ptx = triton.compile(ASTSource(fn=R._router_align_split_kernel, signature=sig, constexprs=const),
                     target=GPUTarget("cuda", 90, 32),
                     options={"num_warps": R._split_warps(tile["G_BLOCK"] * tile["GS_BLOCK"])}).asm["ptx"]
lines = [l.strip().split(" ", 1)[-1] if l.strip().startswith("@") else l.strip() for l in ptx.splitlines()]
find = lambda s: [i for i, l in enumerate(lines) if l.startswith(s)]
print(find("griddepcontrol.wait"), find("griddepcontrol.launch_dependents"), find("atom.global.gpu.acq_rel.add"),
      find("ld.global.cg"), find("ld.global"), find("st.global"), find("bar.sync"), find("div.s") + find("rem.s"),
      sep="|")
"""


@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "no-pdl"])
def test_split_compiles_for_sm90(pdl: bool) -> None:
    """sm_90 PTX (a fresh process without TRITON_INTERPRET, no GPU): the bias load before griddepcontrol.wait and
    the logits after it; one acq_rel gpu-scope atomic (the ticket) after the wait, a CTA barrier right before it;
    the ids reloaded through L2 (ld.global.cg) only after the ticket; no integer division (block_m is a constexpr).
    Without PDL no griddepcontrol at all."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _PTX_PROBE, "1" if pdl else "0"], capture_output=True, text=True,
                          timeout=300, env=env, cwd=Path(__file__).resolve().parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    waits, triggers, atoms, cg_loads, loads, stores, barriers, divisions = (
        eval(part) for part in proc.stdout.strip().splitlines()[-1].split("|"))
    assert not divisions, divisions          # block_m is a constexpr: the align's block arithmetic is shifts
    assert len(atoms) == 1, atoms
    assert cg_loads and min(cg_loads) > atoms[0], (cg_loads, atoms)
    row_stores = [i for i in stores if i < atoms[0]]                              # the row's weights and ids
    assert row_stores and any(max(row_stores) < b < atoms[0] for b in barriers), "no barrier between ids and ticket"
    if not pdl:
        assert not waits and not triggers
        return
    assert len(waits) == 1 and len(triggers) == 1 and waits[0] < atoms[0], (waits, triggers, atoms)
    before = [i for i in loads if i < waits[0]]
    assert before and len(before) < len([i for i in loads if waits[0] < i < atoms[0]]), "bias before, logits after"
