"""embedding_rmsnorm[_cat]'s kernels compiled for sm_90 without a GPU (kernels/rmsnorm.py GATHER): at Ling-3.0-tiny's
width (h = 1536: BLOCK_N 2048, 16 warps) and the launch's specialisation, the row gathered from the table is loaded
with the same vector width and normalised with the same reduction instructions as the rmsnorm / rmsnorm_cat kernel
on the embedding's output, every load of what an earlier kernel wrote (the id, then the row) follows the PDL wait,
and the gathered row's copy is the only extra store. What lets fuse_embed_norm declare numerics unchanged on the GPU,
where the interpreter's numpy arithmetic (tests/kernels/test_embedding_rmsnorm.py) cannot tell."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kernel_support import ptx_op, ptx_reduction  # tests/kernels is on sys.path

_PROBE = """
import json
import lingc.kernels.rmsnorm as RN
from kernel_support import sm90_ptx as ptx

i32, f32, bf16 = "i32", "fp32", "*bf16"
out = {}
for gather in (False, True):
    out[f"norm{int(gather)}"] = ptx(
        RN._rmsnorm_kernel, dict(x_ptr=bf16, w_ptr=bf16, out_ptr=bf16, stride_x=i32, stride_out=i32, N=i32, eps=f32,
                                 ids_ptr="*i64" if gather else bf16, x_out_ptr=bf16, stride_x_out=i32),
        dict(BLOCK_N=2048, PDL=True, ENTRY_TRIGGER=True, GATHER=gather),
        ["x_ptr", "w_ptr", "out_ptr", "stride_x", "stride_out", "N", "ids_ptr", "x_out_ptr", "stride_x_out"], 16)
    out[f"cat{int(gather)}"] = ptx(
        RN._rmsnorm_cat_kernel, dict(x1_ptr=bf16, x2_ptr=bf16, w1_ptr=bf16, w2_ptr=bf16, out_ptr=bf16, stride_x1=i32,
                                     stride_x2=i32, stride_out=i32, N=i32, eps=f32,
                                     ids_ptr="*i64" if gather else bf16),
        dict(BLOCK_N=2048, PDL=True, GATHER=gather),
        ["x1_ptr", "x2_ptr", "w1_ptr", "w2_ptr", "out_ptr", "stride_x1", "stride_x2", "stride_out", "N", "ids_ptr"],
        16)
print(json.dumps(out))
"""


def _ptx() -> dict[str, list[str]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300, env=env,
                          cwd=Path(__file__).resolve().parent)                     # kernel_support importable
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_gathered_rows_are_normalised_as_the_norm_kernels_do() -> None:
    ptx = _ptx()
    ops = {name: [ptx_op(line).rstrip(";") for line in lines] for name, lines in ptx.items()}
    for kernel in ("norm", "cat"):
        plain, gathered = ptx[f"{kernel}0"], ptx[f"{kernel}1"]
        assert ptx_reduction(gathered) == ptx_reduction(plain), kernel
        for load in ("ld.global.v4.b32", "ld.global.v2.b32", "ld.global.b32", "ld.global.b16"):
            assert ops[f"{kernel}0"].count(load) == ops[f"{kernel}1"].count(load), (kernel, load)
        ids = [i for i, op in enumerate(ops[f"{kernel}1"]) if op == "ld.global.b64"]      # the token id
        wait = ops[f"{kernel}1"].index("griddepcontrol.wait")
        assert len(ids) == 1 and ids[0] > wait, (kernel, ids, wait)
        assert "ld.global.b64" not in ops[f"{kernel}0"]
    stores = {name: sum(op.startswith("st.global") for op in lines) for name, lines in ops.items()}
    assert stores["norm1"] == 2 * stores["norm0"] and stores["cat1"] == stores["cat0"]   # + the gathered row's copy
