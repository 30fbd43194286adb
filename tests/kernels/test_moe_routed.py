"""kernels/moe_routed.py: one token's MoE GEMMs with the router inside, against router_topk + the pair-grid GEMMs.

In the interpreter (fresh random inputs, poisoned outputs): the act, the expert rows and the combine's weights equal
router_topk + moe_up_act_pairs + moe_down_pairs bit for bit (test-tiny's router and Ling-3.0-tiny's 128 experts in 8
groups, with and without the fused shared expert, ties across groups included), and the picks are the torch
reference's set; more than one token or past MAX_EXPERTS falls back to those launches; bad arguments are errors
naming the op. Compiled offline for sm_90: the up-GEMM loads nothing before its PDL wait, the down-GEMM loads the
logits (through L2), the bias and its weight tile before it and the act rows after it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernel_support import poison_float_empty  # noqa: E402  (tests/kernels is on sys.path)
from lingc.kernels import moe_routed
from lingc.kernels.moe import moe_down_pairs, moe_up_act_pairs
from lingc.kernels.router import router_topk
from lingc.ops import OPS

# (routed experts, n_group, topk_group, top_k, shared, h, I, dtype): test-tiny's router, Ling-3.0-tiny's (smaller h, I)
SHAPES = [(16, 4, 2, 4, 1, 64, 32, torch.float32), (16, 4, 2, 4, 0, 64, 32, torch.bfloat16),
          (128, 8, 4, 8, 1, 128, 64, torch.bfloat16)]


def _inputs(shape, seed: int, ties: bool = False):
    E, n_group, topk_group, top_k, shared, h, inter, dtype = shape
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, E, generator=g) * 2
    if ties:
        logits[0, ::3] = logits[0, 1]                  # equal scores in every group: ties go to the lower id
    bias = torch.randn(E, generator=g) * 0.1
    x = torch.randn(1, h, generator=g).to(dtype)
    w13 = (torch.randn(E + shared, 2 * inter, h, generator=g) * 0.05).to(dtype)
    w2 = (torch.randn(E + shared, h, inter, generator=g) * 0.05).to(dtype)
    return x, w13, w2, logits, bias, (n_group, topk_group, top_k, 2.5, shared)


@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"E{s[0]}-k{s[3]}-S{s[4]}-{str(s[7])[6:]}")
def test_routed_equals_router_topk_and_the_pair_grid(shape, ties, monkeypatch):
    poison_float_empty(monkeypatch)
    for seed in range(2):
        x, w13, w2, logits, bias, route = _inputs(shape, seed, ties)
        act = moe_routed.moe_up_act_routed(x, w13, logits, bias, *route, 0.0)
        out, weights = moe_routed.moe_down_routed(act, w2, logits, bias, *route)
        want_w, ids = router_topk(logits, bias, *route)
        want_act = moe_up_act_pairs(x, w13, ids, 0.0)
        assert torch.equal(act, want_act)
        assert torch.equal(out, moe_down_pairs(want_act, w2, ids))
        assert torch.equal(weights, want_w)
        ref_w, ref_ids = OPS.router_topk(logits, bias, *route)              # the torch reference: same picks
        assert sorted(ids[0].tolist()) == sorted(ref_ids[0].tolist())
        torch.testing.assert_close(weights[0, ids[0].argsort()], ref_w[0, ref_ids[0].argsort()])


def test_clamped_swiglu_and_the_reference_op():
    x, w13, w2, logits, bias, route = _inputs(SHAPES[0], 7)
    act = moe_routed.moe_up_act_routed(x, w13, logits, bias, *route, 0.5)
    assert torch.equal(act, moe_up_act_pairs(x, w13, router_topk(logits, bias, *route)[1], 0.5))
    ref = OPS.moe_up_act_routed(x, w13, logits, bias, *route, 0.5)              # lingc/ops/moe.py's composition
    ids, ref_ids = router_topk(logits, bias, *route)[1][0], OPS.router_topk(logits, bias, *route)[1][0]
    torch.testing.assert_close(act[ids.argsort()], ref[ref_ids.argsort()], rtol=1e-5, atol=1e-5)  # its own pick order
    out, weights = OPS.moe_down_routed(ref, w2, logits, bias, *route)
    assert out.shape == (route[2] + route[4], x.shape[1]) and weights.shape == (1, route[2] + route[4])


def test_more_tokens_fall_back_to_the_unfused_launches():
    x, w13, w2, logits, bias, route = _inputs(SHAPES[0], 3)
    x2 = torch.cat([x, -x]).contiguous()
    logits2 = torch.cat([logits, logits.flip(1)]).contiguous()
    act = moe_routed.moe_up_act_routed(x2, w13, logits2, bias, *route, 0.0)
    want_w, ids = router_topk(logits2, bias, *route)
    assert torch.equal(act, moe_up_act_pairs(x2, w13, ids, 0.0))
    out, weights = moe_routed.moe_down_routed(act, w2, logits2, bias, *route)
    assert torch.equal(out, moe_down_pairs(act, w2, ids)) and torch.equal(weights, want_w)
    assert not moe_routed.routes(1, moe_routed.MAX_EXPERTS * 2) and moe_routed.routes(1, 128)


def test_bad_arguments_name_the_op():
    x, w13, w2, logits, bias, route = _inputs(SHAPES[0], 5)
    with pytest.raises(ValueError, match="moe_up_act_routed: logits must be float32"):
        moe_routed.moe_up_act_routed(x, w13, logits.double(), bias, *route, 0.0)
    with pytest.raises(ValueError, match="moe_up_act_routed: the weight stack has 16 experts, want 16 routed \\+ 1"):
        moe_routed.moe_up_act_routed(x, w13[:16], logits, bias, *route, 0.0)
    with pytest.raises(ValueError, match="moe_down_routed: router: want E <="):
        moe_routed.moe_down_routed(x, w2, logits, bias, 5, *route[1:])
    with pytest.raises(ValueError, match="moe_up_act_routed: logits \\[2, 16\\] and x \\[1, 64\\]"):
        moe_routed.moe_up_act_routed(x, w13, torch.cat([logits, logits]), bias, *route, 0.0)


_PROBE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import lingc.kernels.moe_routed as K
down = sys.argv[1] == "down"
sig = dict(a_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", logits_ptr="*fp32", bias_ptr="*fp32", weights_ptr="*fp32",
           num_routed="i32", N="i32", K="i32", stride_am="i32", stride_we="i32", stride_wn="i32", stride_om="i32",
           GS="i32", n_group="i32", scale="fp32", limit="fp32")
const = dict(TOPK_GROUP=4, TOP_K=8, SHARED=1, A_PAIRS=1 if down else 9, G_BLOCK=8, GS_BLOCK=16, E_BLOCK=128, K_BLOCK=16,
             NO_ID=1 << 30, TILE_M=16, BLOCK_N=32, BLOCK_K=128, EVEN_K=True, SWIGLU=not down, HAS_LIMIT=False,
             IEEE_DOT=False, LIBDEVICE_EXP=True, PDL=True, PREWAIT=down, K_CHUNKS=4 if down else 0, WEIGHTS=down)
sig.update({k: "constexpr" for k in const})
ptx = triton.compile(ASTSource(fn=K._moe_routed_kernel, signature=sig, constexprs=const),
                     target=GPUTarget("cuda", 90, 32),
                     options={"num_warps": 4, "num_stages": 3 if down else 4, "enable_fp_fusion": False}).asm["ptx"]
lines = [l.strip().split(" ", 1)[-1] if l.strip().startswith("@") else l.strip() for l in ptx.splitlines()]
find = lambda s: [i for i, l in enumerate(lines) if l.startswith(s)]
print(find("griddepcontrol.wait"), find("ld.global.cg"), find("ld.global"), find("st.global"), sep="|")
"""


def _probe(which: str) -> tuple[list[int], ...]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _PROBE, which], capture_output=True, text=True, timeout=300, env=env,
                          cwd=Path(__file__).resolve().parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return tuple(eval(part) for part in proc.stdout.strip().splitlines()[-1].split("|"))


def test_sm90_up_gemm_loads_nothing_before_its_wait():
    waits, _, loads, stores = _probe("up")
    assert len(waits) == 1 and loads and min(loads) > waits[0] and min(stores) > waits[0]


def test_sm90_down_gemm_routes_and_preloads_before_its_wait():
    waits, cg_loads, loads, stores = _probe("down")
    assert len(waits) == 1 and min(stores) > waits[0]
    early = [i for i in loads if i < waits[0]]
    assert [i for i in cg_loads if i < waits[0]], "the logits are read through L2 before the wait"
    assert len(early) >= 4 + 2                                     # the 4 weight chunks, the logits and the bias
    assert [i for i in loads if i > waits[0]], "the act rows after the wait"
