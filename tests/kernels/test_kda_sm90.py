"""The KDA kernels compiled for sm_90 without a GPU (a fresh process without TRITON_INTERPRET): the fused verify kernel
runs its recurrence chain as a loop over the positions, not unrolled (one copy of the step's reductions),
gated_rmsnorm splits its rows with no integer division by a runtime value, and the widest kda_commit_multi (its pairs
as tuple arguments) compiles, its parameters inside CUDA's 4 KB. The interpreter tests (tests/kernels/test_kda.py)
check the values."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from lingc.kernels.kda import COMMIT_MULTI_MAX

_PROBE = """
import re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import lingc.kernels.kda as K
d = [["tt.divisibility", 16]]

def ptx(fn, const, fp32=(), ints=(), floats=(), num_warps=4):
    sig = {}
    for n in fn.arg_names:
        if n in const: sig[n] = "constexpr"
        elif n in ints: sig[n] = "*i32"
        elif n.endswith("_ptr"): sig[n] = "*fp32" if n in fp32 else "*bf16"
        elif n in floats: sig[n] = "fp32"
        else: sig[n] = "i32"
    attrs = {(i,): d for i, n in enumerate(fn.arg_names) if n.endswith("_ptr")}
    src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 64), options={"num_warps": num_warps}).asm["ptx"]

count = lambda text, pat: len(re.findall(pat, text, re.M))
fused = dict(D=128, DB=128, BV=K.BLOCK_V, W=4, STAGED=True, PRECISE=True, PDL=True)
out = []
for T in (1, 6):
    text = ptx(K._kda_fused_kernel, dict(fused, T=T), fp32=("a_log_ptr", "dt_bias_ptr", "pool_ptr", "staging_ptr", "o_ptr"),
               ints=("slots_ptr", "count_ptr"), floats=("scale", "lower_bound"), num_warps=K.FUSED_WARPS)
    out.append(count(text, r"^\\s*shfl\\.sync"))
norm = ptx(K._gated_rmsnorm_kernel, dict(HR=16, ROWS=K.NORM_ROWS, BLOCK_N=128, PRECISE=True, PDL=True),
           floats=("inv_n", "eps"), num_warps=K.NORM_WARPS)
out.append(count(norm, r"^\\s*(?:@!?%p\\d+\\s+)?(?:div|rem)\\.[su](?:32|64)"))
n = K.COMMIT_MULTI_MAX                      # the widest launch: pairs as tuples of pointers and int32s
sig = {"slots_ptr": "*i32", "accept_ptr": "*i32", "pools": ("*fp32",) * n, "stagings": ("*fp32",) * n,
       **{a: ("i32",) * n for a in ("Ns", "TSs", "s_ps", "s_stbs", "s_stts", "ends")},
       "PAIRS": "constexpr", "BLOCK": "constexpr", "PDL": "constexpr"}
attrs = {(0,): d, (1,): d, **{(a, i): d for a in (2, 3) for i in range(n)}}
src = ASTSource(fn=K._kda_commit_multi_kernel, signature=sig, attrs=attrs,
                constexprs=dict(PAIRS=n, BLOCK=K.COMMIT_BLOCK, PDL=True))
commit = triton.compile(src, target=GPUTarget("cuda", 90, 64), options={"num_warps": K.COMMIT_WARPS}).asm["ptx"]
out.append(count(commit, r"^\\s*(?:@!?%p\\d+\\s+)?st\\.global"))
params = re.search(r"\\.entry\\s+\\w+\\((.*?)\\)", commit, re.S).group(1)
out.append(sum(int(bits) for bits in re.findall(r"\\.param\\s+\\.[bsu](\\d+)", params)) // 8)
print(*out, sep="|")
"""


def _probe() -> list[int]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300, env=env,
                          cwd=Path(__file__).resolve().parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [int(x) for x in proc.stdout.strip().splitlines()[-1].split("|")]


def test_fused_chain_is_a_loop_and_gated_norm_has_no_division() -> None:
    shfl_t1, shfl_t6, norm_divs, commit_stores, commit_param_bytes = _probe()
    # the widest kda_commit_multi compiles for sm_90 with a store per pair, and its parameters fit the 4 KB every
    # CUDA version allows a launch (2 pointers and 6 int32 a pair, and the slots and accept_len)
    assert commit_stores >= COMMIT_MULTI_MAX, commit_stores
    assert commit_param_bytes <= 4096, commit_param_bytes
    # unrolled over 6 positions the verify kernel had ~6x the decode kernel's warp shuffles (one set of reductions
    # per position); as a loop it has about as many as T = 1 plus the unrolled phases' few
    assert shfl_t6 < 2 * shfl_t1, (shfl_t1, shfl_t6)
    assert norm_divs == 0, norm_divs
