"""The aligned up-GEMM's Hopper TMA path (kernels/moe_tma.py): which launches take it, and its sm_90 code compiled
offline. Gluon has no interpreter, so CPU runs check the selection rule and the PTX: the block's expert and pairs
load after `griddepcontrol.wait`, every weight box is issued after it (the expert is known only then), the early
trigger right after the wait, 8 wgmma m64n16k16 a 128-wide K block in K order, the SwiGLU epilogue's round-to-nearest
divisions, and two CTAs' worth of shared memory. Its bits against the Triton kernel are checked on the GPU
(bench/moe_up_tma_check.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lingc.kernels import moe, moe_tma as T
from lingc.kernels.moe_align import moe_align

_PROBE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
import lingc.kernels.moe_tma as T
early = sys.argv[1] == "1"
lay = T.gl.NVMMASharedLayout.get_default_for([T.BLOCK_N, T.BLOCK_K], T.gl.bfloat16)
sig = {"w_desc": f"tensordesc<bf16[{T.BLOCK_N}, {T.BLOCK_K}],{lay!r}>", "x_ptr": "*bf16", "out_ptr": "*bf16",
       "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "total_ptr": "*i32", "num_pairs": "i32", "N": "i32",
       "stride_xm": "i32", "stride_om": "i32"}
const = dict(K=1536, TOP_K=9, BLOCK_M=16, BN=T.BLOCK_N, BK=T.BLOCK_K, BM=T.TILE_M, RING=T.RING, EARLY_TRIGGER=early)
sig.update({k: "constexpr" for k in const})
src = GluonASTSource(T._moe_up_tma_kernel, sig, const,
                     attrs={(i,): [["tt.divisibility", 16]] for i in (1, 2, 3, 4, 5, 8, 9)})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": T.WARPS, "enable_fp_fusion": False, "enable_reflect_ftz": False})
lines = [l.strip().split(" ", 1)[-1] if l.strip().startswith("@") else l.strip() for l in k.asm["ptx"].splitlines()]
find = lambda s: [i for i, l in enumerate(lines) if l.startswith(s)]
print(find("griddepcontrol.wait"), find("cp.async.bulk.tensor"), find("st.global"), find("wgmma.mma_async"),
      find("griddepcontrol.launch_dependents"), k.metadata.shared, find("ld.global"), find("div.rn.f32"), sep="|")
"""


def _compile(early: bool) -> tuple:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _PROBE, "1" if early else "0"], capture_output=True, text=True,
                          timeout=300, env=env, cwd=Path(__file__).resolve().parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tuple(eval(p) for p in proc.stdout.strip().splitlines()[-1].split("|"))


@pytest.mark.skipif(not T.HAVE_GLUON, reason="this Triton has no Gluon")
@pytest.mark.parametrize("early", [True, False], ids=["early-trigger", "late-trigger"])
def test_ptx_order(early: bool) -> None:
    waits, tma, stores, wgmma, triggers, shared, loads, divs = _compile(early)
    blocks = 1536 // T.BLOCK_K
    assert len(waits) == 1 and len(tma) == blocks, (waits, tma)
    assert min(loads) > waits[0], "nothing is read before the PDL wait (the router is the launch before)"
    assert min(tma) > waits[0] and min(tma) > min(loads), "the weight boxes follow the expert id's load"
    assert len([i for i in tma if i < min(wgmma)]) == T.RING, "the ring's first fill before the first wgmma"
    assert len(wgmma) == blocks * T.BLOCK_K // 16                       # m64n16k16, K order
    assert stores and min(stores) > max(wgmma) and len(divs) >= 1
    assert len(triggers) == 1 and triggers[0] > waits[0]
    assert (triggers[0] < min(loads)) == early                          # early: right after the wait
    assert shared <= T.SMEM_2_CTAS


def test_shape_rule() -> None:
    assert T.fits(1024, 1536, 16)                                       # Ling-3.0-tiny's w13 (2I, h)
    assert not T.fits(1000, 1536, 16)                                   # N not whole tiles
    assert not T.fits(1024, 1500, 16)                                   # K not whole blocks
    assert not T.fits(1024, 1536, 32)                                   # blocks of more pairs than the tile's slots
    assert not T.fits(1024, 1536, 16, ring=13)                          # a ring longer than the slice
    assert not T.fits(1024, 8192, 16)                                   # x slice + ring past 2 CTAs an SM


def test_off_by_default_and_never_on_cpu(monkeypatch) -> None:
    """Opt-in (LINGC_MOE_UP_TMA=1); with the knob on, a CPU launch still runs the Triton kernel (no Gluon run, no
    PDL), with the same values."""
    assert T.MOE_UP_TMA == (os.environ.get("LINGC_MOE_UP_TMA", "0") == "1")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 64, generator=g).to(torch.bfloat16)
    w13 = torch.randn(5, 128, 64, generator=g).mul(0.1).to(torch.bfloat16)
    ids = torch.tensor([[0, 3, 4], [1, 3, 4]], dtype=torch.int32)
    layout = moe_align(ids, 5, 16)
    want = moe.moe_up_act(x, w13, *layout, 3, 16, 0.0)
    monkeypatch.setattr(T, "MOE_UP_TMA", True)
    assert not T.eligible(x, w13, 16, 0.0, pdl=True, variants=False)
    assert torch.equal(moe.moe_up_act(x, w13, *layout, 3, 16, 0.0, pdl=True), want)


def test_what_keeps_the_triton_kernel(monkeypatch) -> None:
    """The rule's non-device conditions, with the device check stubbed to a Hopper: the knob, PDL, the Triton
    kernel's pre-wait variants, a clamp, fp32 weights, and a failed compile each keep the Triton kernel."""
    monkeypatch.setattr(T, "MOE_UP_TMA", True)
    monkeypatch.setattr(T, "_major", lambda device: T.HOPPER)

    class FakeCuda(torch.Tensor):
        is_cuda = True

    x = torch.zeros(1, 1536, dtype=torch.bfloat16).as_subclass(FakeCuda)
    w = torch.zeros(3, 1024, 1536, dtype=torch.bfloat16)
    if not T.HAVE_GLUON:
        assert not T.eligible(x, w, 16, 0.0, True, False)
        return
    assert T.eligible(x, w, 16, 0.0, True, False)
    assert not T.eligible(x, w, 16, 0.0, False, False)                 # no PDL
    assert not T.eligible(x, w, 16, 0.0, True, True)                   # SHARED_EARLY / preload / prefetch asked for
    assert not T.eligible(x, w, 16, 7.0, True, False)                  # a SwiGLU clamp
    assert not T.eligible(x, w.float(), 16, 0.0, True, False)          # fp32 weights
    monkeypatch.setattr(T, "FAILED", ["CompilationError: ..."])
    assert not T.eligible(x, w, 16, 0.0, True, False)
    monkeypatch.setattr(T, "FAILED", [])
    monkeypatch.setattr(T, "MOE_UP_TMA", False)
    assert not T.eligible(x, w, 16, 0.0, True, False)
