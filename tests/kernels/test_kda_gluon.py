"""kernels/kda_gluon.py without a GPU: where the Gluon KDA kernel runs, the fallback when it does not compile, and its
sm_90 code compiled offline (a fresh process without TRITON_INTERPRET): the chain loop has no CTA barrier but the TMA
state stores' (one bulk tensor store a position, no plain 16 B state stores), the state slice is loaded before the PDL
wait, decode takes the head's ticket after it, writes its state back by one TMA store and waits for it, and verify
takes no ticket. Its values are checked on the H200 (bench/kernel_kda.py --gluon: close to the Triton kernel and the
reference, row invariant)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from lingc.kernels import kda as K
from lingc.kernels import kda_gluon as G
from kernel_support import BrokenGluonKernel, pretend_sm90  # noqa: E402  (tests/kernels is on sys.path)

LOWER_BOUND = -5.0


@pytest.mark.skipif(not G.HAVE_GLUON, reason="this Triton has no Gluon")
def test_eligible_rules(monkeypatch) -> None:
    cuda = torch.device("cuda")
    assert not G.eligible(torch.device("cpu"), 128, 4, 1)             # the interpreter never runs Gluon
    pretend_sm90(monkeypatch, G)
    assert G.eligible(cuda, 128, 4, 1) and G.eligible(cuda, 128, 4, 6) and G.eligible(cuda, 128, 4, G.MAX_T)
    assert not G.eligible(cuda, 64, 4, 1)                              # the layouts are D = 128's
    assert not G.eligible(cuda, 128, 3, 1)                             # the taps are spelled out for W = 4
    assert not G.eligible(cuda, 128, 4, G.MAX_T + 1)
    monkeypatch.setattr(G, "_major", lambda device: 8)
    assert not G.eligible(cuda, 128, 4, 1)
    monkeypatch.setattr(G, "_major", lambda device: 9)
    monkeypatch.setattr(G, "ENABLED", False)                           # LINGC_KDA_GLUON=0
    assert not G.eligible(cuda, 128, 4, 1)


@pytest.mark.skipif(not G.HAVE_GLUON, reason="this Triton has no Gluon")
def test_a_kernel_that_does_not_compile_falls_back_to_triton(monkeypatch) -> None:
    """Another Triton's Gluon: kda_fused_verify warns once (naming the module and the knob), runs the Triton kernel
    with the same result, and later launches skip the path."""
    g = torch.Generator().manual_seed(7)
    B, T, H, D, W, P = 1, 2, 2, 16, 4, 32
    raw = [torch.randn(B, T, P, generator=g) for _ in range(3)]
    f, b = torch.randn(B, T, H, D, generator=g), torch.randn(B, T, H, generator=g)
    ws = [torch.randn(P, 1, W, generator=g) * 0.5 for _ in range(3)]
    pools = [torch.randn(2, P, W - 1, generator=g) for _ in range(3)]
    A_log, dt_bias, state = torch.randn(H, generator=g), torch.randn(P, generator=g), torch.randn(2, H, D, D) * 0.3
    slots = torch.tensor([1], dtype=torch.int32)

    def run():
        st = [torch.zeros(B, T, P, W - 1) for _ in range(3)] + [torch.zeros(B, T, H, D, D)]
        return K.kda_fused_verify(*raw, f, b, *ws, *pools, A_log, dt_bias, state, slots, *st, LOWER_BOUND), st

    want, want_st = run()

    monkeypatch.setattr(G, "FAILED", [])
    monkeypatch.setattr(G, "_kda_gluon_kernel", BrokenGluonKernel("allocate_shared_memory"))
    monkeypatch.setattr(G, "eligible", lambda *args: not G.FAILED)
    with pytest.warns(RuntimeWarning, match=r"kernels/kda_gluon.py.*allocate_shared_memory.*LINGC_KDA_GLUON=0"):
        got, got_st = run()
    assert torch.equal(got, want) and all(torch.equal(a, c) for a, c in zip(got_st, want_st))
    assert G.FAILED and not G.eligible()


_PROBE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
import lingc.kernels.kda_gluon as G
T, staged = int(sys.argv[1]), sys.argv[2] == "1"
fn = G._kda_gluon_kernel
const = dict(T=T, TP=triton.next_power_of_2(T), D=G.D, BV=G.BLOCK_V, STAGED=staged, PDL=True, EARLY_TRIGGER=True,
             NW=G.WARPS, FAST=G.FAST_MATH, LATE_TICKET=G.LATE_TICKET, PARALLEL_O=G.PARALLEL_O,
             TMA_STATE=G.TMA_STAGE if staged else G.TMA_POOL)
fp32 = ("wq_ptr", "wk_ptr", "wv_ptr", "a_log_ptr", "dt_bias_ptr", "pool_ptr", "staging_ptr")
sig = {}
lay = G.gl.NVMMASharedLayout.get_default_for([G.D, G.BLOCK_V], G.gl.float32)
if not const["TMA_STATE"]:
    const["st_desc"] = None
for n in fn.arg_names:
    if n in const: sig[n] = "constexpr"
    elif n == "st_desc": sig[n] = f"tensordesc<fp32[{G.D}, {G.BLOCK_V}],{lay!r}>"
    elif n in ("slots_ptr", "count_ptr"): sig[n] = "*i32"
    elif n.endswith("_ptr"): sig[n] = "*fp32" if n in fp32 else "*bf16"
    elif n in ("scale", "lower_bound"): sig[n] = "fp32"
    else: sig[n] = "i32"
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
         if n.endswith("_ptr") or n.startswith("s_") or n == "H"}
k = triton.compile(GluonASTSource(fn, sig, const, attrs=attrs), target=GPUTarget("cuda", 90, 64),
                   options={"num_warps": G.WARPS, "enable_fp_fusion": False})
sys.stdout.write(k.asm["ptx"])
"""


def _ptx(T: int, staged: bool) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _PROBE, str(T), "1" if staged else "0"], capture_output=True,
                          text=True, timeout=300, env=env, cwd=Path(__file__).resolve().parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    code = [line.split("//")[0].strip() if not line.strip().startswith(".pragma") else line.strip()
            for line in proc.stdout.splitlines()]
    return [re.sub(r"^@!?%p\d+\s+", "", line) for line in code]


def _find(lines: list[str], prefix: str) -> list[int]:
    return [i for i, line in enumerate(lines) if line.startswith(prefix)]


@pytest.mark.skipif(not G.HAVE_GLUON, reason="this Triton has no Gluon")
@pytest.mark.parametrize("T,staged", [(6, True), (1, False)], ids=["verify-T6", "decode-T1"])
def test_sm90_chain_has_no_barrier_and_pdl_order(T: int, staged: bool) -> None:
    lines = _ptx(T, staged)
    waits = _find(lines, "griddepcontrol.wait")
    assert len(waits) == 1
    state_loads = _find(lines, "ld.global.cg.v4")                 # the state slice: 4 fp32 a row and thread
    assert state_loads and max(state_loads) < waits[0], "the state slice is read before the PDL wait"
    atomics = _find(lines, "atom.global")
    if staged:
        assert not atomics                                        # verify leaves the pools alone: no ticket
    else:
        assert len(atomics) == 1 and atomics[0] > waits[0]        # decode's head ticket, after the wait
    if T > 1:                                                     # the chain: one loop, no CTA barrier in it
        labels = {line[:-1]: i for i, line in enumerate(lines) if re.fullmatch(r"\$L__BB\d+_\d+:", line)}
        loops = [(labels[m.group(1)], i) for i, line in enumerate(lines)
                 for m in [re.match(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line)] if m and labels[m.group(1)] < i]
        assert loops, "the chain is a loop"
        start, end = max(loops, key=lambda lo: lo[1] - lo[0])
        body = lines[start:end]
        assert '.pragma "nounroll";' in body
        barriers = [line for line in body if line.startswith("bar.sync")]
        if staged and G.TMA_STAGE:      # the staged state: shared memory, then one TMA store a position
            assert len(barriers) <= 2, barriers
            assert len([line for line in body if line.startswith("cp.async.bulk.tensor")]) == 1
            assert not [line for line in body if line.startswith("st.global.v4")]
        else:
            assert not barriers
        assert [line for line in body if line.startswith("shfl.sync")]
    tma_stores = _find(lines, "cp.async.bulk.tensor")
    if not staged and G.TMA_POOL:       # decode: the state back to the pool by one TMA store, waited for before exit
        assert len(tma_stores) == 1 and tma_stores[0] > waits[0]
        assert _find(lines, "cp.async.bulk.wait_group.read") > tma_stores
        assert not _find(lines, "st.global.v4")


@pytest.mark.skipif(not G.HAVE_GLUON, reason="this Triton has no Gluon")
def test_state_descriptor_boxes_a_programs_slice_or_declines(monkeypatch) -> None:
    """The TMA state stores' descriptor: rows of D, a [D, BLOCK_V] box (one program's slice of one state); None, so
    the kernel keeps its plain stores, for a strided state, another dtype, or the knob off."""
    H, D = 2, G.D
    staging = torch.zeros(1, 6, H, D, D)
    desc = G._state_descriptor(staging, True)
    assert list(desc.shape) == [6 * H * D, D] and list(desc.block_shape) == [D, G.BLOCK_V]
    assert G._state_descriptor(staging, False) is None
    assert G._state_descriptor(torch.zeros(1, 6, H, D, 2 * D)[..., :D], True) is None      # not one block
    assert G._state_descriptor(staging.to(torch.bfloat16), True) is None

