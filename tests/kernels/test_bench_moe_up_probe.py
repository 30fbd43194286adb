"""bench/moe_up_probe.py (bench/kernel_moe_scaling.py --probe) in the interpreter: the probe kernel computes what
moe_up_act_pairs computes, so its GPU times are of a kernel doing the production tile's work."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))


@pytest.mark.parametrize("T,d,swiglu", [(1, 3, True), (2, 3, True), (3, 2, False)])
def test_up_probe_computes_the_pair_grids_values(T: int, d: int, swiglu: bool) -> None:
    """bench/moe_up_probe.py in the interpreter: row j * T + t is token t through expert j of the set, with the id
    loaded or from base + j, the same bits as moe_up_act_pairs on those picks (IEEE dots: both run UP_CONFIG's tile);
    without the epilogue, the interleaved gate / up columns whose SwiGLU is moe_up_act_pairs's output."""
    from moe_up_probe import up_probe
    from lingc.kernels.moe import interleave_w13, moe_up_act_pairs, silu_and_mul
    g = torch.Generator().manual_seed(T * 10 + d)
    E, h, inter, base = 8, 64, 32, 2
    w13 = interleave_w13(torch.randn(E, 2 * inter, h, generator=g) * 0.1)
    x = torch.randn(T, h, generator=g)
    experts = torch.arange(base, base + d, dtype=torch.int32)
    want = moe_up_act_pairs(x, w13, experts.expand(T, d).contiguous(), 0.0)        # row t * d + j
    want = want.view(T, d, inter).transpose(0, 1).reshape(d * T, inter)            # row j * T + t
    for ids in (True, False):
        got = up_probe(x, w13, experts, base, ids=ids, swiglu=swiglu)
        if not swiglu:                 # interleaved [gate, up] pairs -> [gate | up] halves -> SwiGLU
            halves = torch.cat([got[:, 0::2], got[:, 1::2]], dim=1)
            torch.testing.assert_close(silu_and_mul(halves, 0.0), want, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(got, want), (ids, (got - want).abs().max())


_SM90 = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
sys.path.insert(0, sys.argv[1])
import moe_up_probe as P
sig = dict(x_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", experts_ptr="*i32", base="i32", T="i32", N="i32", K="i32",
           stride_am="i32", stride_we="i32", stride_wn="i32", stride_om="i32")
const = dict(TILE_M=16, BLOCK_N=64, BLOCK_K=128, EVEN_K=True, SWIGLU=sys.argv[3] == "1", IEEE_DOT=False,
             LIBDEVICE_EXP=True, PDL=True, SWAP_AB=True, IDS=sys.argv[2] == "1")
sig.update({k: "constexpr" for k in const})
ptx = triton.compile(ASTSource(fn=P._up_probe_kernel, signature=sig, constexprs=const),
                     target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3}).asm["ptx"]
lines = [l.strip().split(" ", 1)[-1] if l.strip().startswith("@") else l.strip() for l in ptx.splitlines()]
find = lambda s: [i for i, l in enumerate(lines) if l.startswith(s)]
print(find("griddepcontrol.wait"), find("ld.global") + find("cp.async.ca") + find("cp.async.cg"),
      find("griddepcontrol.launch_dependents"), find("wgmma"), sep="|")
"""


@pytest.mark.parametrize("ids,swiglu", [(True, True), (False, True), (False, False)])
def test_up_probe_compiles_for_sm90_with_every_load_after_the_wait(ids: bool, swiglu: bool) -> None:
    """The probe as the GPU runs it (bf16, swap-AB wgmma tile, PDL), compiled offline: it builds, and no global load
    (the id, the weights, x) comes before griddepcontrol.wait, as in the production up-GEMM."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    bench = str(Path(__file__).resolve().parents[2] / "bench")
    proc = subprocess.run([sys.executable, "-c", _SM90, bench, "1" if ids else "0", "1" if swiglu else "0"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    wait, loads, trigger, mma = (ast.literal_eval(part) for part in proc.stdout.strip().splitlines()[-1].split("|"))
    assert len(wait) == 1 and loads and min(loads) > wait[0], (wait, loads)
    assert trigger and mma
