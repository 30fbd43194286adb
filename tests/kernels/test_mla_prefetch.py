"""The MLA split kernel compiled for sm_90 without a GPU. The pre-wait L2 prefetch (kernels/mla.py PREFETCH): the
prefetches come before `griddepcontrol.wait`; without PREFETCH none exists. The row addressing: with the page size a
constexpr, the only integer division left is the program's tile split (tile // cdiv(T, QPP)), none per cache row.
Compiled at QPP = 4 (four queries a program, 8 warps). In the
interpreter (PDL off) the split is unchanged, which tests/kernels/test_mla.py checks."""

from __future__ import annotations

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
import lingc.kernels.mla as K
prefetch = sys.argv[1] == "1"
sig = dict(qlat_ptr="*bf16", qrope_ptr="*bf16", kv_ptr="*bf16", pages_ptr="*i32", pos_ptr="*i32", part_o_ptr="*fp32",
           part_ml_ptr="*fp32", T="i32", S="i32", CAP="i32", qk_scale="fp32", stride_rb="i32",
           stride_rt="i32", stride_rh="i32", stride_page="i32", stride_row="i32", stride_pages_b="i32",
           stride_pos_b="i32", stride_pos_t="i32")
const = dict(PS=16, H=16, R=512, RR=64, BLOCK_H=16, BLOCK_R=512, BLOCK_E=64, SPLIT=64, BLOCK_N=32, IEEE=False, PDL=True,
             PREFETCH=prefetch, NUM_PAGES=1024, L_LINES=16, CHUNKS=K._split_chunks(512), EARLY_POS=True, QPP=4)
sig.update({k: "constexpr" for k in const})
ptx = triton.compile(ASTSource(fn=K._split_kernel, signature=sig, constexprs=const),
                     target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 2}).asm["ptx"]
lines = [l.strip().split(" ", 1)[-1] if l.strip().startswith("@") else l.strip() for l in ptx.splitlines()]
find = lambda s: [i for i, l in enumerate(lines) if l.startswith(s)]
print(find("griddepcontrol.wait"), find("prefetch.global.L2"), find("div.s") + find("rem.s"), sep="|")
"""


def _probe(prefetch: bool) -> tuple[list[int], list[int], list[int]]:
    """PTX line numbers of (the wait, the L2 prefetches, the integer divisions / remainders)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _PROBE, "1" if prefetch else "0"], capture_output=True, text=True,
                          timeout=300, env=env, cwd=Path(__file__).resolve().parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return tuple(eval(part) for part in proc.stdout.strip().splitlines()[-1].split("|"))


def test_row_addressing_has_no_runtime_division() -> None:
    assert len(_probe(False)[2]) == 1        # tile // tiles_t (its remainder is formed from it); none per row


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no-prefetch"])
def test_prefetch_precedes_the_wait(prefetch: bool) -> None:
    waits, prefetches, _ = _probe(prefetch)
    assert len(waits) == 1, waits
    if prefetch:
        assert prefetches and max(prefetches) < waits[0], (prefetches, waits)
    else:
        assert not prefetches
