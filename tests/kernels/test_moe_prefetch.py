"""The down-GEMM's pre-wait L2 prefetch (kernels/moe.py PREFETCH) and register preload (K_CHUNKS), compiled for sm_90
without a GPU: the prefetches / the weight tile's loads come before `griddepcontrol.wait` and every load of the
activations after it; without either (the up-GEMM) no prefetch exists and nothing is loaded before the wait. In the interpreter (PDL off) the GEMMs are unchanged, which
the other moe tests check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_PROBE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import lingc.kernels.moe as K
prefetch = sys.argv[1] == "1"
chunks = int(sys.argv[2])
sig = dict(a_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", sorted_ptr="*i32", block_expert_ptr="*i32",
           total_ptr="*i32", num_pairs="i32", num_experts="i32", N="i32", K="i32", stride_am="i32", stride_we="i32",
           stride_wn="i32", stride_om="i32", limit="fp32")
const = dict(TOP_K=1, BLOCK_M=16, TILE_M=16, BLOCK_N=32, BLOCK_K=128, EVEN_K=True, SWIGLU=False, HAS_LIMIT=False,
             IEEE_DOT=False, LIBDEVICE_EXP=True, PDL=True, PREFETCH=prefetch, K_LINES=8, LINE=64, K_CHUNKS=chunks)
sig.update({k: "constexpr" for k in const})
ptx = triton.compile(ASTSource(fn=K._moe_gemm_kernel, signature=sig, constexprs=const),
                     target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 4}).asm["ptx"]
lines = [l.strip().split(" ", 1)[-1] if l.strip().startswith("@") else l.strip() for l in ptx.splitlines()]
find = lambda s: [i for i, l in enumerate(lines) if l.startswith(s)]
print(find("griddepcontrol.wait"), find("prefetch.global.L2"), find("ld.global"), sep="|")
"""


def _probe(prefetch: bool, chunks: int = 0) -> tuple[list[int], list[int], list[int]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _PROBE, "1" if prefetch else "0", str(chunks)], capture_output=True,
                          text=True,
                          timeout=300, env=env, cwd=Path(__file__).resolve().parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return tuple(eval(part) for part in proc.stdout.strip().splitlines()[-1].split("|"))


@pytest.mark.parametrize("prefetch", [True, False], ids=["down-prefetch", "up-no-prefetch"])
def test_prefetch_precedes_the_wait(prefetch: bool) -> None:
    waits, prefetches, loads = _probe(prefetch)
    assert len(waits) == 1, waits
    if prefetch:
        assert prefetches and max(prefetches) < waits[0], (prefetches, waits)
        # before the wait only total and the block's expert (through L2) are read
        assert 1 <= len([i for i in loads if i < waits[0]]) <= 2
    else:
        assert not prefetches and not [i for i in loads if i < waits[0]]


def test_preload_loads_the_weight_tile_before_the_wait() -> None:
    """PRELOAD (K_CHUNKS = 4, the down-GEMM at decode): total, the block's expert and the 4 weight chunks before the
    wait; the act rows (and nothing else) after it."""
    waits, prefetches, loads = _probe(False, 4)
    assert len(waits) == 1 and not prefetches
    before, after = [i for i in loads if i < waits[0]], [i for i in loads if i > waits[0]]
    assert len(before) >= 6, (before, waits)      # total, expert, then the chunks' (vectorised) loads
    assert after, "the act rows load after the wait"


_SHARED_PROBE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import lingc.kernels.moe as K
sig = dict(a_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", sorted_ptr="*i32", block_expert_ptr="*i32",
           total_ptr="*i32", num_pairs="i32", num_experts="i32", N="i32", K="i32", stride_am="i32", stride_we="i32",
           stride_wn="i32", stride_om="i32", limit="fp32")
const = dict(TOP_K=9, BLOCK_M=16, TILE_M=16, BLOCK_N=32, BLOCK_K=128, EVEN_K=True, SWIGLU=True, HAS_LIMIT=False,
             IEEE_DOT=False, LIBDEVICE_EXP=True, PDL=True, PREFETCH=False, K_LINES=8, LINE=64, K_CHUNKS=0,
             SHARED_EARLY=True)
sig.update({k: "constexpr" for k in const})
ptx = triton.compile(ASTSource(fn=K._moe_gemm_kernel, signature=sig, constexprs=const),
                     target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 4}).asm["ptx"]
lines = [l.strip().split(" ", 1)[-1] if l.strip().startswith("@") else l.strip() for l in ptx.splitlines()]
find = lambda s: [i for i, l in enumerate(lines) if l.startswith(s)]
print(find("griddepcontrol.wait"), find("cp.async") + find("ld.global"), find("st.global"), find("griddepcontrol.launch"), sep="|")
"""


def test_shared_early_tile_streams_before_its_wait() -> None:
    """SHARED_EARLY (moe_up_act's shared_last): two waits, the shared tile's and the routed tiles'. The shared tile's
    loads (x and the weight stream) come before its wait and its stores after it; every store follows a wait, and
    so does every trigger (the early trigger sits inside pdl_wait)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _SHARED_PROBE], capture_output=True, text=True,
                          timeout=300, env=env, cwd=Path(__file__).resolve().parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    waits, copies, stores, triggers = (eval(p) for p in proc.stdout.strip().splitlines()[-1].split("|"))
    assert len(waits) == 2 and len(triggers) == 2, (waits, triggers)
    assert copies and min(copies) < min(waits), (copies, waits)
    assert stores and min(stores) > min(waits), (stores, waits)
    assert min(triggers) > min(waits), (triggers, waits)


_TILE_PROBE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import lingc.kernels.moe as K
out = {}
for by_ids in (False, True):
    for tile in (False, True):
        sig = dict(a_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", sorted_ptr="*i32", block_expert_ptr="*i32",
                   total_ptr="*i32", num_pairs="i32", num_experts="i32", N="i32", K="i32", stride_am="i32",
                   stride_we="i32", stride_wn="i32", stride_om="i32", limit="fp32")
        const = dict(TOP_K=9, BLOCK_M=16, TILE_M=16, BLOCK_N=32, BLOCK_K=128, EVEN_K=True, SWIGLU=True,
                     HAS_LIMIT=False, IEEE_DOT=False, LIBDEVICE_EXP=True, PDL=True, PREFETCH=False, K_LINES=32, LINE=64,
                     K_CHUNKS=0, BY_IDS=by_ids, PAIR_ROWS=9, PR_BLOCK=16, TILE_PREFETCH=tile)
        sig.update({k: "constexpr" for k in const})
        ptx = triton.compile(ASTSource(fn=K._moe_gemm_kernel, signature=sig, constexprs=const),
                             target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 4}).asm["ptx"]
        lines = [l.strip().split(" ", 1)[-1] if l.strip().startswith("@") else l.strip() for l in ptx.splitlines()]
        find = lambda s: [i for i, l in enumerate(lines) if l.startswith(s)]
        weights = sorted(find("cp.async") + find("ld.global.L1::evict_first"))    # the K loop's weight loads
        out[f"{int(by_ids)}{int(tile)}"] = [find("griddepcontrol.wait"), find("prefetch.global.L2"), weights]
print(json.dumps(out))
"""


def test_tile_prefetch_asks_for_the_whole_tile_after_the_wait() -> None:
    """TILE_PREFETCH (UP_TILE_PREFETCH / DOWN_TILE_PREFETCH, off by default), aligned and on the pair grid: after the
    wait (the expert is known only then), BLOCK_N x K_LINES = 32 x 32 line prefetches over 128 threads (8 a thread),
    ahead of the K loop's first weight load (evict_first; cp.async where the strides are known aligned); without it
    no prefetch."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _TILE_PROBE], capture_output=True, text=True, timeout=600, env=env,
                          cwd=Path(__file__).resolve().parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    for path in ("0", "1"):                      # aligned, pair grid
        waits, prefetches, copies = found[path + "0"]
        assert len(waits) == 1 and not prefetches and copies
        waits, prefetches, copies = found[path + "1"]
        assert len(waits) == 1 and len(prefetches) == 32 * 32 // 128, (path, prefetches)
        assert min(prefetches) > waits[0] and max(prefetches) < min(copies), (path, waits, prefetches, copies[:3])
