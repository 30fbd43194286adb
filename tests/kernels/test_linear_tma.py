"""The skinny GEMM's Hopper path (kernels/linear_tma.py): which launches take it, and its sm_90 code compiled offline.

Gluon has no interpreter, so CPU runs check the selection rule and the compiled PTX: every weight block's TMA load
is issued before `griddepcontrol.wait`, every store after it, one wgmma m64n16k16 per 16 of K. Its bits against the
Triton "dot" kernel are checked on the H200 (bench/gluon_linear_probe.py, bench/device_step.py's greedy parity)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lingc.kernels import linear as L
from lingc.kernels import linear_tma as T
from lingc.presets import preset
from kernel_support import BrokenGluonKernel  # noqa: E402  (tests/kernels is on sys.path)


def _tiny_shapes() -> dict[str, tuple[int, int]]:
    c = preset("ling-3.0-tiny")
    h, heads = c.hidden_size, c.num_attention_heads
    return {"kda_o_proj": (h, heads * c.head_dim), "mla_dense": (h, heads * c.v_head_dim),
            "mla_q_a_kv_a_g": (c.q_lora_rank + c.kv_lora_rank + c.qk_rope_head_dim + heads, h),
            "kda_projection": (5 * heads * c.head_dim + heads, h), "lm_head": (c.vocab_size, h),
            "dense_gate_up": (2 * c.intermediate_size, h)}


def test_which_ling_tiny_linears_take_the_tma_path():
    """The module docstring's list: the 3-4-block slices do, and (PARTIAL_RING, on by default) the one-wave KDA
    projection and the dense layer's gate_up on a partial ring; the multi-wave lm_head stays on the Triton kernel.
    264 programs: one wave at 2 CTAs an SM on 132 SMs (H100, H200)."""
    want = {"kda_o_proj": True, "mla_dense": True, "mla_q_a_kv_a_g": True, "kda_projection": T.PARTIAL_RING,
            "lm_head": False, "dense_gate_up": T.PARTIAL_RING}
    got = {}
    for name, (n, k) in _tiny_shapes().items():
        cfg = L.pick_config(n, k, torch.bfloat16)
        got[name] = T.fits(n, k, cfg.split_k, cfg.block_n, cfg.block_k, 2, 264)
    assert got == want


@pytest.mark.parametrize("case,want", [
    ((1536, 2048, 4, 64, 128, 2), True),
    ((1536, 2048, 4, 64, 128, 4), False),      # fp32 weights: the fma kernels
    ((1536, 2048, 4, 32, 128, 2), False),      # another tiling than the kernel's
    ((1536, 2000, 4, 64, 128, 2), False),      # K not whole blocks per slice
    ((1536, 2048, 2, 64, 128, 2), False),      # 8 blocks a slice: more than the ring
    ((1536, 2048, 1, 64, 128, 2), False),
])
def test_shape_rule(case, want, monkeypatch):
    """The whole-slice rule (PARTIAL_RING off; the ring's own rule: test_partial_ring_rule)."""
    monkeypatch.setattr(T, "PARTIAL_RING", False)
    assert T.fits(*case) is want


def test_never_on_cpu_without_pdl_or_past_its_rows():
    """On by default (LINGC_LINEAR_TMA) for one-row launches (MAX_ROWS); a CPU launch (no PDL, no Gluon run), a
    launch without PDL, one with a norm prologue or more rows runs the Triton kernel, and linear() on CPU is as
    before."""
    assert T.ENABLED == (os.environ.get("LINGC_LINEAR_TMA", "1") == "1")
    assert T.MAX_ROWS == int(os.environ.get("LINGC_LINEAR_TMA_MAX_ROWS", "1"))
    w = torch.randn(1536, 2048, dtype=torch.bfloat16)
    cfg = L.pick_config(1536, 2048, torch.bfloat16)
    for m in (1, 2):
        x = torch.randn(m, 2048, dtype=torch.bfloat16)
        for pdl, prologue in ((True, False), (False, False), (True, True)):
            assert not T.eligible(x, w, cfg, pdl=pdl, prologue=prologue)
        assert torch.equal(L.linear(x, w, pdl=True), L.linear(x, w))


@pytest.mark.skipif(not T.HAVE_GLUON, reason="this Triton has no Gluon")
def test_a_kernel_that_does_not_compile_falls_back_once(monkeypatch):
    """Another Triton's Gluon: `launch` reports False with one warning naming the module and the knob, and every
    later launch skips the path (FAILED)."""
    monkeypatch.setattr(T, "FAILED", [])


    monkeypatch.setattr(T, "_linear_tma_kernel", BrokenGluonKernel("warpgroup_mma"))
    monkeypatch.setattr(T, "_descriptor", lambda *a: None)
    w = torch.zeros(1536, 2048, dtype=torch.bfloat16)
    x, y = torch.zeros(1, 2048, dtype=torch.bfloat16), torch.zeros(1, 1536, dtype=torch.bfloat16)
    with pytest.warns(RuntimeWarning, match=r"kernels/linear_tma.py.*warpgroup_mma.*LINGC_LINEAR_TMA=0"):
        assert T.launch(x, w, y, None, None, 4) is False
    assert T.FAILED and not T.eligible(x, w, L.pick_config(1536, 2048, torch.bfloat16), pdl=True, prologue=False)


@pytest.mark.skipif(not T.HAVE_GLUON, reason="this Triton has no Gluon")
def test_a_gated_launch_that_does_not_compile_turns_off_only_the_gated_path(monkeypatch):
    """A GATED compile failure warns naming LINGC_LINEAR_TMA_GATED and lands in GATED_FAILED: later gated launches
    skip the path, plain ones still take it (FAILED stays empty)."""
    monkeypatch.setattr(T, "FAILED", [])
    monkeypatch.setattr(T, "GATED_FAILED", [])
    monkeypatch.setattr(T, "_linear_tma_kernel", BrokenGluonKernel("gl.rsqrt"))
    monkeypatch.setattr(T, "_descriptor", lambda *a: None)
    w = torch.zeros(1536, 2048, dtype=torch.bfloat16)
    x, y = torch.zeros(1, 2048, dtype=torch.bfloat16), torch.zeros(1, 1536, dtype=torch.bfloat16)
    gated = L.GatedNorm(torch.ones(T.BLOCK_K), 1e-6, x, T.BLOCK_K)
    with pytest.warns(RuntimeWarning, match=r"GATED path.*LINGC_LINEAR_TMA_GATED=0"):
        assert T.launch(x, w, y, None, None, 4, gated=gated) is False
    assert T.GATED_FAILED and not T.FAILED


_PROBE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
import lingc.kernels.linear_tma as T
split, kps, early, gated = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1"
ring = int(sys.argv[5]) if len(sys.argv) > 5 and sys.argv[5] != "-" else kps // T.BLOCK_K
x_tma = len(sys.argv) > 6 and sys.argv[6] == "1"
lay = T.gl.NVMMASharedLayout.get_default_for([T.BLOCK_N, T.BLOCK_K], T.gl.bfloat16)
xlay = T.gl.NVMMASharedLayout.get_default_for([T.BLOCK_M, T.BLOCK_K], T.gl.bfloat16)
sig = {"w_desc": f"tensordesc<bf16[{T.BLOCK_N}, {T.BLOCK_K}],{lay!r}>",
       "x_desc": f"tensordesc<bf16[{T.BLOCK_M}, {T.BLOCK_K}],{xlay!r}>", "x_ptr": "*bf16", "y_ptr": "*bf16",
       "part_ptr": "*fp32", "count_ptr": "*i32", "g_ptr": "*bf16", "nw_ptr": "*bf16", "M": "i32", "N": "i32",
       "stride_xm": "i32", "stride_ym": "i32", "stride_gm": "i32", "eps": "fp32", "inv_d": "fp32"}
const = dict(K_PER_SPLIT=kps, BN=T.BLOCK_N, BK=T.BLOCK_K, BM=T.BLOCK_M, SPLIT_K=split, EARLY_TRIGGER=early, RING=ring,
             GATED=gated, X_TMA=x_tma)
sig.update({k: "constexpr" for k in const})
src = GluonASTSource(T._linear_tma_kernel, sig, const,
                     attrs={(i,): [["tt.divisibility", 16]] for i in (2, 3, 4, 5, 6, 7)})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": T.WARPS, "enable_fp_fusion": not gated})   # as `launch` compiles it
lines = [l.strip().split(" ", 1)[-1] if l.strip().startswith("@") else l.strip() for l in k.asm["ptx"].splitlines()]
find = lambda s: [i for i, l in enumerate(lines) if l.startswith(s)]
print(find("griddepcontrol.wait"), find("cp.async.bulk.tensor"), find("st.global"), find("wgmma.mma_async"),
      find("griddepcontrol.launch_dependents"), k.metadata.shared, find("ld.global"), find("bar.sync"),
      find("rsqrt.approx"), find("shfl.sync"), sep="|")
"""


def _compile(split: int, kps: int, early: bool, ring: int | None = None, gated: bool = False,
             x_tma: bool = False) -> tuple:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = [str(split), str(kps), "1" if early else "0", "1" if gated else "0"]
    args += [str(ring) if ring is not None else "-", "1" if x_tma else "0"]
    proc = subprocess.run([sys.executable, "-c", _PROBE, *args],
                          capture_output=True, text=True, timeout=300, env=env, cwd=Path(__file__).resolve().parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tuple(eval(p) for p in proc.stdout.strip().splitlines()[-1].split("|"))


@pytest.mark.skipif(not T.HAVE_GLUON, reason="this Triton has no Gluon")
@pytest.mark.parametrize("split,kps,early", [(4, 512, True), (4, 384, False), (1, 512, True)],
                         ids=["o_proj-early", "q_a-late", "unsplit"])
def test_weight_blocks_are_issued_before_the_wait(split: int, kps: int, early: bool) -> None:
    waits, tma, stores, wgmma, triggers, shared, *_ = _compile(split, kps, early)
    blocks = kps // T.BLOCK_K
    assert len(waits) == 1 and len(tma) == blocks, (waits, tma)
    assert max(tma) < waits[0], "every weight block is requested before the PDL wait"
    assert stores and min(stores) > waits[0]
    assert len(wgmma) == blocks * T.BLOCK_K // 16                        # m64n16k16, K order
    assert len(triggers) == 1 and triggers[0] > waits[0]
    assert (triggers[0] < min(wgmma)) == early                           # early: right after the wait
    assert shared <= T.SMEM_2_CTAS


@pytest.mark.skipif(not T.HAVE_GLUON, reason="this Triton has no Gluon")
@pytest.mark.parametrize("split,kps,ring", [(4, 512, None), (1, 1536, 3)], ids=["o_proj", "kda_projection-ring"])
def test_x_lands_by_tma_after_the_wait(split: int, kps: int, ring: int | None) -> None:
    """X_TMA: one more TMA box a block (x's), all after the PDL wait, instead of the register path's x loads; the
    weight boxes before the wait as before, the same wgmma in K order, no more shared memory than the register
    path's (the x boxes land in the same tiles). Gluon 3.6 brackets each one-thread mbarrier op and TMA issue with a
    CTA barrier (as for the weights' boxes), so a block's box costs up to 3 more bar.sync (expect, issue, inval)."""
    plain = _compile(split, kps, True, ring=ring)
    waits, tma, stores, wgmma, triggers, shared, loads, bars, *_ = _compile(split, kps, True, ring=ring, x_tma=True)
    blocks = kps // T.BLOCK_K
    early = ring if ring is not None else blocks
    assert len(waits) == 1 and len(tma) == len(plain[1]) + blocks, (tma, plain[1])
    assert len([i for i in tma if i < waits[0]]) == early                # the weight ring's first fill only
    assert len(loads) < len(plain[6])                                    # x no longer through registers
    assert len(wgmma) == len(plain[3]) and len(bars) <= len(plain[7]) + 3 * blocks
    assert stores and min(stores) > waits[0] and shared <= T.SMEM_2_CTAS


def test_x_tma_rule(monkeypatch):
    """x by TMA only where a descriptor may describe it: x in the weight's dtype, unit-stride rows, 16 B aligned base
    and row stride; the knob turns it off."""
    w = torch.zeros(1536, 2048, dtype=torch.bfloat16)
    x = torch.zeros(6, 2048, dtype=torch.bfloat16)
    monkeypatch.setattr(T, "X_TMA", True)
    assert T.x_tma(x, w) and T.x_tma(x[:1], w)
    assert not T.x_tma(x.float(), w)
    assert not T.x_tma(torch.zeros(6, 4096, dtype=torch.bfloat16)[:, ::2], w)       # strided columns
    assert not T.x_tma(torch.zeros(6 * 2048 + 1, dtype=torch.bfloat16)[1:].view(6, 2048), w)   # base off 16 B
    assert not T.x_tma(torch.zeros(6, 2052, dtype=torch.bfloat16)[:, :2048], w)      # 4104 B rows
    monkeypatch.setattr(T, "X_TMA", False)
    assert not T.x_tma(x, w)


def test_partial_ring_rule(monkeypatch):
    """PARTIAL_RING (on by default since 2026-12-06): a slice longer than MAX_BLOCKS gets a ring of the most blocks
    (>= 2) that keep 2 CTAs an SM, where the grid is one wave; the KDA projection (12 blocks, 161 programs) takes 3,
    the lm_head (2456 programs) none; off (LINGC_LINEAR_TMA_PARTIAL=0), no ring: the Triton kernel."""
    shapes = _tiny_shapes()
    n, k = shapes["kda_projection"]
    monkeypatch.setattr(T, "PARTIAL_RING", False)
    assert T.ring_blocks(n, k, 1, 64, 128, 2, 264) == 0
    monkeypatch.setattr(T, "PARTIAL_RING", True)
    assert T.ring_blocks(n, k, 1, 64, 128, 2, 264) == 3
    assert T.smem_bytes(k, 2, 3) <= T.SMEM_2_CTAS < T.smem_bytes(k, 2, 4)
    n, k = shapes["lm_head"]
    assert T.ring_blocks(n, k, 1, 64, 128, 2, 264) == 0
    assert T.ring_blocks(1536, 2048, 4, 64, 128, 2, 264) == 4        # a whole slice: as before


@pytest.mark.skipif(not T.HAVE_GLUON, reason="this Triton has no Gluon")
def test_partial_ring_refills_after_the_wait() -> None:
    """The KDA projection's slice (12 blocks) on a 3-block ring: 3 TMA loads before the PDL wait, the other 9 after
    it, one per consumed block, and the same 96 wgmma in K order as the whole-slice kernel."""
    waits, tma, stores, wgmma, triggers, shared, *_ = _compile(1, 1536, True, ring=3)
    assert len(waits) == 1 and len(tma) == 12, (waits, tma)
    assert len([i for i in tma if i < waits[0]]) == 3
    assert len(wgmma) == 12 * T.BLOCK_K // 16
    assert stores and min(stores) > waits[0]
    assert shared <= T.SMEM_2_CTAS


@pytest.mark.skipif(not T.HAVE_GLUON, reason="this Triton has no Gluon")
def test_gated_norm_is_built_after_the_wait_from_a_norm_weight_read_before_it() -> None:
    """GATED (gated_rmsnorm_linear, o_proj's split-4 shape): the weight ring and the norm weight (its only load of
    another kind) are requested before the PDL wait, x and the gate after it; each of the 4 heads' row sums is a
    lane reduction (shuffles, rsqrt), with no CTA barrier more than the plain kernel has, and the same wgmma."""
    plain = _compile(4, 512, True)
    waits, tma, stores, wgmma, triggers, shared, loads, bars, rsqrt, shfl = _compile(4, 512, True, gated=True)
    assert len(waits) == 1 and len(tma) == 4 and max(tma) < waits[0]
    early_loads = [i for i in loads if i < waits[0]]
    assert len(early_loads) == 1, early_loads                           # the norm weight (a v4 load)
    assert len(loads) - 1 > len(plain[6])                               # x as before, then the gate
    assert len(bars) == len(plain[7]) and len(wgmma) == len(plain[3])
    assert len(rsqrt) >= 4 and len(shfl) > len(plain[9])
    assert stores and min(stores) > waits[0] and shared <= T.SMEM_2_CTAS


def test_gated_launches_take_the_path_only_with_heads_of_a_block(monkeypatch):
    """The rule for gated_rmsnorm_linear's launches (`gated_fits`): heads of BLOCK_K (KDA's 128), a unit-stride gate
    row, the knob, no GATED compile failure; and never on CPU."""
    w = torch.zeros(2048, 2048, dtype=torch.bfloat16)
    cfg = L.pick_config(2048, 2048, torch.bfloat16)
    x = torch.zeros(6, 2048, dtype=torch.bfloat16)
    wide = torch.zeros(6, 2 * 2048, dtype=torch.bfloat16)
    monkeypatch.setattr(T, "GATED_TMA", True)
    monkeypatch.setattr(T, "GATED_FAILED", [])
    assert T.gated_fits(L.GatedNorm(torch.ones(T.BLOCK_K), 1e-6, wide[:, 2048:], T.BLOCK_K))    # a column slice
    assert not T.gated_fits(L.GatedNorm(torch.ones(64), 1e-6, x, 64))
    assert not T.gated_fits(L.GatedNorm(torch.ones(T.BLOCK_K), 1e-6, wide[:, ::2], T.BLOCK_K))  # strided rows
    gated = L.GatedNorm(torch.ones(T.BLOCK_K), 1e-6, x, T.BLOCK_K)
    assert not T.eligible(x, w, cfg, pdl=True, prologue=False, gated=gated)                  # CPU tensors
    monkeypatch.setattr(T, "GATED_FAILED", ["CompilationError"])
    assert not T.gated_fits(gated)
    monkeypatch.setattr(T, "GATED_FAILED", [])
    monkeypatch.setattr(T, "GATED_TMA", False)
    assert not T.gated_fits(gated)
    assert T.GATED_MAX_ROWS == 16
