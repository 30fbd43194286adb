"""What mla_attention's split reads, and when (2026-12-04): the combine takes bf16 partials (the Gluon split's
PARTIAL_BF16) as the fp32 values they hold, and q_absorb's entry trigger (QA_ENTRY) puts `launch_dependents` ahead
of its wait and of every load, compiled for sm_90 without a GPU, in both q_absorb forms (QA_TILE); v_absorb in both
forms (VA_TILE) reads only its weight before its wait (2026-12-06). The Gluon split's side (its cache-row units before
and after the wait) is tests/kernels/test_mla_gluon.py's PTX check."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

import lingc.kernels.mla as mla

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def _combine(part_o: torch.Tensor, part_ml: torch.Tensor, positions: torch.Tensor, split: int) -> torch.Tensor:
    M, S, H, R = part_o.shape
    o_lat = torch.full((M, H, R), float("nan"))
    mla._combine_kernel[(M * H, triton.cdiv(R, 16))](
        part_o, part_ml, positions, o_lat, positions.shape[1], S, positions.stride(0), positions.stride(1),
        H=H, R=R, SPLIT=split, S_POW2=16, BLOCK_S=16, BLOCK_R=16, PDL=False)
    return o_lat


def test_the_combine_reads_bf16_partials_as_their_values() -> None:
    g = torch.Generator().manual_seed(3)
    B, T, S, H, R, split = 1, 3, 5, 2, 32, 8
    part = (torch.randn(B * T, S, H, R, generator=g) * 4).to(torch.bfloat16)       # values a bf16 store leaves
    ml = torch.stack([torch.randn(B * T, S, H, generator=g), torch.rand(B * T, S, H, generator=g) * 8 + 1], -1)
    positions = torch.tensor([[17, 26, 39]])                                         # 3, 4 and 5 visible splits
    got = _combine(part, ml.contiguous(), positions, split)
    want = _combine(part.float(), ml.contiguous(), positions, split)
    assert torch.equal(got, want)
    assert not got.isnan().any()


_PROBE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import lingc.kernels.mla as K
sig = dict(q_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", M="i32", T="i32", stride_qb="i32", stride_qt="i32",
           stride_qh="i32", stride_w="i32")
const = dict(H=16, N=128, R=512, HEAD_ROWS=256, BLOCK_NOPE=128, BLOCK_R=K.QA_BLOCK_R, PDL=True, EARLY=True,
             ENTRY=True, TILE_M=int(sys.argv[1]), IEEE=False)
sig.update({k: "constexpr" for k in const})
ptx = triton.compile(ASTSource(fn=K._q_absorb_kernel, signature=sig, constexprs=const),
                     target=GPUTarget("cuda", 90, 32), options={"num_warps": K.GEMV_WARPS}).asm["ptx"]
lines = [l.strip().split(" ", 1)[-1] if l.strip().startswith("@") else l.strip() for l in ptx.splitlines()]
find = lambda s: [i for i, l in enumerate(lines) if l.startswith(s)]
print(find("griddepcontrol.wait"), find("griddepcontrol.launch_dependents"), find("ld.global"),
      sum(l.startswith("mma.sync") for l in lines), sep="|")
"""


@pytest.mark.parametrize("tile_m", [0, 16], ids=["per-query", "tile"])
def test_q_absorb_entry_trigger_comes_first(tile_m: int) -> None:
    """Both forms of q_absorb (QA_TILE): the trigger first, then the loads, and the tile form's dot on tensor cores
    (before the wait: EARLY) where the per-query form has none."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _PROBE, str(tile_m)], capture_output=True, text=True, timeout=300,
                          env=env, cwd=Path(__file__).resolve().parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    waits, triggers, loads, mmas = (eval(part) for part in proc.stdout.strip().splitlines()[-1].split("|"))
    assert len(waits) == 1 and triggers and loads, (waits, triggers, loads)
    assert triggers[0] < min(loads) and triggers[0] < waits[0]     # at entry: before the weight and q loads
    assert (mmas > 0) == (tile_m > 0), mmas


_VA_PROBE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import lingc.kernels.mla as K
tile = int(sys.argv[1])
sig = dict(olat_ptr="*bf16" if tile else "*fp32", w_ptr="*bf16", out_ptr="*bf16", g_ptr="*bf16", M="i32", T="i32",
           stride_w="i32", stride_gb="i32", stride_gt="i32", stride_gh="i32")
const = dict(H=16, N=128, R=512, VD=128, HEAD_ROWS=256, BLOCK_V=K.VA_BLOCK_V, BLOCK_R=512, GATE=True, PDL=True,
             ENTRY_TRIGGER=False, TILE_M=tile, IEEE=False)
sig.update({k: "constexpr" for k in const})
ptx = triton.compile(ASTSource(fn=K._v_absorb_kernel, signature=sig, constexprs=const),
                     target=GPUTarget("cuda", 90, 32), options={"num_warps": K.GEMV_WARPS}).asm["ptx"]
lines = [l.strip().split(" ", 1)[-1] if l.strip().startswith("@") else l.strip() for l in ptx.splitlines()]
find = lambda s: [i for i, l in enumerate(lines) if l.startswith(s)]
print(find("griddepcontrol.wait"), find("ld.global"), find("mma.sync"), sep="|")
"""


def _va_probe(tile_m: int) -> tuple[list[int], list[int], list[int]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _VA_PROBE, str(tile_m)], capture_output=True, text=True, timeout=300,
                          env=env, cwd=Path(__file__).resolve().parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return tuple(eval(part) for part in proc.stdout.strip().splitlines()[-1].split("|"))


def test_v_absorb_reads_o_lat_only_after_the_wait() -> None:
    """Both forms of v_absorb (VA_TILE), compiled for sm_90: before the PDL wait each loads its weight slice and
    nothing else (the same loads in both forms: the same [VA_BLOCK_V, R] tile), o_lat and the gate logits (the
    combine's and an earlier launch's outputs) only after it; the tile form's dot runs on tensor cores, after the
    wait."""
    counts = {}
    for tile_m in (0, 16):
        waits, loads, mmas = _va_probe(tile_m)
        assert len(waits) == 1, waits
        before, after = [i for i in loads if i < waits[0]], [i for i in loads if i > waits[0]]
        assert before and after, (tile_m, before, after)
        assert all(i > waits[0] for i in mmas) and (len(mmas) > 0) == (tile_m > 0), (tile_m, mmas)
        counts[tile_m] = len(before)
    assert counts[0] == counts[16], counts
