"""mla_prep's norm compiled for sm_90 without a GPU (kernels/mla.py): at Ling-3.0-tiny's decode shapes and launch
specialisation, its sum-of-squares reduction is the rmsnorm kernel's instruction sequence (same vector load, the same
FMA chain per thread, the same shuffles), and its rope products stay explicit round-to-nearest multiplies (no FMA
contraction, no flush to zero). This is what lets fuse_mla declare numerics unchanged on the GPU, where the interpreter's exact
numpy arithmetic (tests/kernels/test_mla_prep.py) cannot tell; bit-equality on the H200 is bench/kernel_mla.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kernel_support import ptx_op as _op, ptx_reduction as _reduction  # tests/kernels is on sys.path

_PROBE = """
import json
import lingc.kernels.rmsnorm as RN
import lingc.kernels.mla as K
from kernel_support import sm90_ptx as ptx

i32, f32, bf16 = "i32", "fp32", "*bf16"
# Ling-3.0-tiny decode: R = 512 (2 warps), c_kv a view of the fused q_a / kv_a / g projection (row stride 848)
norm = ptx(RN._rmsnorm_kernel, dict(x_ptr=bf16, w_ptr=bf16, out_ptr=bf16, stride_x=i32, stride_out=i32, N=i32, eps=f32,
                                    ids_ptr=bf16, x_out_ptr=bf16, stride_x_out=i32),
           dict(BLOCK_N=512, PDL=True, ENTRY_TRIGGER=False, GATHER=False),
           ["x_ptr", "w_ptr", "out_ptr", "stride_x", "stride_out", "N"], 2)
prep = ptx(K._mla_prep_kernel,
           dict(q_ptr=bf16, c_ptr=bf16, k_ptr=bf16, w_ptr=bf16, kv_ptr=bf16, locs_ptr="*i64", pos_ptr="*i64", qout_ptr=bf16,
                T=i32, NH=i32, HALF=i32, R=i32, ln_theta_hi=f32, ln_theta_lo=f32, eps=f32, stride_qb=i32, stride_qt=i32,
                stride_qh=i32, stride_c=i32, stride_k=i32, stride_row=i32, stride_locs_b=i32, stride_locs_t=i32,
                stride_pos_b=i32, stride_pos_t=i32),
           dict(BLOCK_NH=16, BLOCK_HALF=32, BLOCK_R=512, MUL_RN=True, PDL=True),
           ["q_ptr", "c_ptr", "k_ptr", "w_ptr", "kv_ptr", "locs_ptr", "pos_ptr", "qout_ptr", "NH", "HALF", "R",
            "stride_qb", "stride_qt", "stride_qh", "stride_c", "stride_k", "stride_row"], 2)
print(json.dumps({"norm": norm, "prep": prep}))
"""

def test_prep_norm_is_the_rmsnorm_kernels_reduction_and_its_rope_products_stay_rounded() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300, env=env,
                          cwd=Path(__file__).resolve().parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ptx = json.loads(proc.stdout.strip().splitlines()[-1])
    norm, prep = ptx["norm"], ptx["prep"]
    want = _reduction(norm)
    assert [l.split()[0] for l in want].count("fma.rn.f32") == 7           # 8 elements a thread, contracted
    assert _reduction(prep) == want
    ops = {name: [_op(l) for l in lines] for name, lines in ptx.items()}
    assert ops["norm"].count("ld.global.v4.b32") == ops["prep"].count("ld.global.v4.b32") == 2   # w, x: 8 a thread
    assert ops["prep"].count("fma.rn.f32") == 7                            # the norm's: no rope product contracted
    # the q rope's products: 8 pairs a thread x 4, as mul.rn.f32 (not contracted, and not libdevice's mul_rn, which
    # FTZ reflection would make mul.rn.ftz; libdevice's sin / cos use that internally, as in the rope kernel)
    assert ops["prep"].count("mul.rn.f32") >= 32
