"""COMBINE_ABSORB (kernels/mla.py _combine_absorb_kernel): mla_attention's combine and v_absorb in one launch, in the
Triton interpreter.

Against the lingc reference (the tolerances of test_mla.py) and against the two-launch path (the same o_lat, then a
split sum over R: fp32 within a few ulps, bf16 within one ulp), with several latent blocks (the ticket's last
program sums R / CB_BLOCK_R partials) and one, with and without the head gate; row invariance (a chain's queries ==
their T = 1 calls, the same bits); the ticket counters left zero for the next launch; more (query, head) pairs than
counters run the two launches; and the sm_90 build: weights loaded before the PDL wait, the partials and the
positions after it, the ticket's atomic after the partial's store.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lingc.kernels.mla as mla
from lingc.kernels import workspace
from kernel_support import poison_float_empty  # noqa: E402  (tests/kernels is on sys.path)
from test_mla import ATTN_TOL, SCALE, _case, _reference, _rows  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
dtypes = pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
BLOCKS = pytest.mark.parametrize("block_r", [8, 64], ids=["4blocks", "1block"])      # R = 32 latent columns
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


@pytest.fixture(autouse=True)
def _poisoned_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    poison_float_empty(monkeypatch)


def _attend(c: dict, fused: bool, gate: torch.Tensor | None = None, **tunables) -> torch.Tensor:
    return mla._mla_attention(c["q_nope"], c["q_rope"], c["kv_pages"], c["kv_b_weight"], c["page_rows"],
                              c["positions"], SCALE, gate, combine_absorb=fused, split_rows=16, block_n=16,
                              **tunables)


def _counters() -> torch.Tensor:
    return workspace.counters("cpu", "mla_combine_absorb", mla.CA_COUNTERS)


@BLOCKS
@pytest.mark.parametrize("B,T", [(2, 1), (2, 5), (1, 6)])
@dtypes
def test_matches_the_reference_and_the_two_launches(B: int, T: int, block_r: int, dtype: torch.dtype,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mla, "VA_TILE", False)      # the two launches with an fp32 o_lat, as the fused kernel sums it
    c = _case(B, T, dtype, seed=B * 10 + T)
    fused, two = _attend(c, True, combine_block_r=block_r), _attend(c, False, combine_block_r=block_r)
    assert fused.shape == two.shape and fused.dtype == dtype and not fused.isnan().any()
    rtol, atol = ATTN_TOL[dtype]
    torch.testing.assert_close(fused, _reference(c), rtol=rtol, atol=atol)
    if dtype == torch.float32:
        torch.testing.assert_close(fused, two, rtol=1e-6, atol=1e-6)
    else:                                                   # at most one bf16 ulp apart where the sums round apart
        ulp = torch.finfo(torch.bfloat16).eps * two.float().abs().clamp_min(2 ** -10)
        assert ((fused.float() - two.float()).abs() <= ulp).all()
    assert not _counters().any()                            # every counter back to zero for the next launch


@BLOCKS
@dtypes
def test_gate_as_the_two_launches(block_r: int, dtype: torch.dtype) -> None:
    """The head gate (fuse_mla) on the summed output, with v_absorb's arithmetic: equal where the ungated outputs
    are equal (fp32 to a few ulps)."""
    c = _case(2, 3, dtype, seed=9)
    gate = torch.randn(2, 3, 2, generator=torch.Generator().manual_seed(1))
    fused, two = _attend(c, True, gate, combine_block_r=block_r), _attend(c, False, gate, combine_block_r=block_r)
    plain = _attend(c, True, combine_block_r=block_r)
    assert not fused.isnan().any()
    want = (plain.float() * torch.sigmoid(gate.double()).float()[..., None]).to(dtype)
    rtol, atol = (1e-6, 1e-6) if dtype == torch.float32 else (1e-2, 1e-2)
    torch.testing.assert_close(fused, want, rtol=rtol, atol=atol)
    torch.testing.assert_close(fused, two, rtol=rtol, atol=atol)


@BLOCKS
@dtypes
def test_row_invariance(block_r: int, dtype: torch.dtype) -> None:
    c = _case(2, 6, dtype, seed=42)
    c["positions"][0] = torch.arange(13, 19)
    chain = _attend(c, True, combine_block_r=block_r)
    for b in range(2):
        for t in range(6):
            single = _attend(_rows(c, slice(b, b + 1), slice(t, t + 1)), True, combine_block_r=block_r)
            assert torch.equal(single[0, 0], chain[b, t]), f"query ({b}, {t}) differs from its T=1 call"


def test_more_pairs_than_counters_run_the_two_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    c = _case(2, 5, torch.float32, seed=4)                  # M * H = 20 pairs
    two = _attend(c, False, combine_block_r=8)
    monkeypatch.setattr(mla, "CA_COUNTERS", 16)
    assert torch.equal(_attend(c, True, combine_block_r=8), two)


def test_off_by_default_and_the_module_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """combine_absorb None follows COMBINE_ABSORB (bench/device_step.py --variant sets it)."""
    c = _case(1, 2, torch.float32, seed=6)
    assert mla.COMBINE_ABSORB is (os.environ.get("LINGC_MLA_COMBINE_ABSORB", "0") == "1")
    fused, two = _attend(c, True, combine_block_r=8), _attend(c, False, combine_block_r=8)
    monkeypatch.setattr(mla, "COMBINE_ABSORB", True)
    assert torch.equal(_attend(c, None, combine_block_r=8), fused)
    monkeypatch.setattr(mla, "COMBINE_ABSORB", False)
    assert torch.equal(_attend(c, None, combine_block_r=8), two)


_PROBE = """
import lingc.kernels.mla as K
from kernel_support import ptx_op, sm90_ptx
sig = dict(part_o_ptr="*bf16", part_ml_ptr="*fp32", pos_ptr="*i64", w_ptr="*bf16", pv_ptr="*fp32", count_ptr="*i32",
           out_ptr="*bf16", g_ptr="*bf16", T="i32", S="i32", stride_pos_b="i32", stride_pos_t="i32", stride_w="i32",
           stride_gb="i32", stride_gt="i32", stride_gh="i32")
const = dict(H=16, N=128, R=512, VD=128, HEAD_ROWS=256, SPLIT=128, S_POW2=64, BLOCK_S=K.CB_BLOCK_S,
             BLOCK_R=K.CB_BLOCK_R, BLOCK_VD=128, GATE=True, PDL=True, ENTRY_TRIGGER=True, EARLY_POS=True,
             ONE_STEP=False)
lines = sm90_ptx(K._combine_absorb_kernel, sig, const, ["part_o_ptr", "part_ml_ptr", "w_ptr", "pv_ptr", "out_ptr",
                                                      "stride_w"], K.GEMV_WARPS)
ops = [ptx_op(l) for l in lines]
find = lambda *names: [i for i, o in enumerate(ops) if any(o.startswith(n) for n in names)]
print(find("griddepcontrol.wait"), find("griddepcontrol.launch_dependents"), find("ld.global.nc", "ld.global.v"),
      find("ld.global.cg"), find("atom.global"), find("st.global"), sep="|")
"""


def test_sm90_build_orders_the_loads_and_the_ticket() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300, env=env,
                          cwd=Path(__file__).resolve().parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    waits, triggers, loads, cg_loads, atomics, stores = (eval(p) for p in last.split("|"))
    assert len(waits) == 1 and triggers and triggers[0] < waits[0]          # the entry trigger first (kernels/pdl.py)
    assert loads and min(loads) < waits[0]                    # the W_uv slice before the wait
    assert cg_loads and len(atomics) == 1
    assert max(stores) > atomics[0] > min(stores) > waits[0]  # the partial, the ticket, then the output / reset
