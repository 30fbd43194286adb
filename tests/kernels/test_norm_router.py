"""kernels/norm_router.py without a GPU: the launcher's two-kernel path against the reference op and against the two
kernels launched by hand (bit for bit), its input checks, where the fused Gluon kernel would run (`eligible`, the
program split), and that kernel compiled for sm_90 offline: the gate slice loaded before the one PDL wait, one
acq_rel ticket, no serial pick chain. Its numbers are checked on the H200 (bench/kernel_norm_router.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lingc.kernels import norm_router as NR
from lingc.kernels.linear import add_rmsnorm_linear
from lingc.kernels.router import router_align, router_topk
from kernel_support import pretend_sm90  # noqa: E402  (tests/kernels is on sys.path)

H, E, GROUPS, KEPT, TOP_K, SCALE = 64, 32, 4, 2, 4, 2.5


def _inputs(rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    res, x = torch.randn(1, rows, H, generator=g), torch.randn(1, rows, H, generator=g)
    return res, x, 1 + 0.1 * torch.randn(H, generator=g), 0.2 * torch.randn(E, H, generator=g), \
        0.05 * torch.randn(E, generator=g)


@pytest.mark.parametrize("rows, block_m", [(1, 16), (3, 0)], ids=["router_align", "router_topk"])
def test_two_kernel_path_is_the_two_kernels(rows, block_m):
    res, x, nw, gate, bias = _inputs(rows)
    experts = E + 1 if block_m else 0
    got = NR.add_rmsnorm_router(res, x, nw, 1e-6, gate, bias, GROUPS, KEPT, TOP_K, SCALE, experts, block_m, 1)
    logits, normed, new_res = add_rmsnorm_linear(res, x, nw, 1e-6, gate, torch.float32, True)
    route = (logits.reshape(rows, E), bias, GROUPS, KEPT, TOP_K, SCALE)
    routed = router_align(*route, experts, block_m, 1) if block_m else router_topk(*route, 1)
    for a, b in zip(got, (normed, new_res, *routed)):
        assert torch.equal(a, b)
    if not block_m:
        assert all(t.numel() == 0 and t.dtype == torch.int32 for t in got[4:])
    ref = NR.add_rmsnorm_router_ref(res, x, nw, 1e-6, gate, bias, GROUPS, KEPT, TOP_K, SCALE, experts, block_m, 1)
    assert torch.equal(got[1], ref[1]) and torch.allclose(got[0], ref[0], atol=1e-5)
    assert torch.equal(got[3].sort(-1).values, ref[3].sort(-1).values)          # the same experts (order free)


def test_bad_input_is_named():
    res, x, nw, gate, bias = _inputs(2)
    with pytest.raises(ValueError, match=r"add_rmsnorm_router: want residual and x \[\.\.\., h\] of one shape"):
        NR.add_rmsnorm_router(res, x[..., :32], nw, 1e-6, gate, bias, GROUPS, KEPT, TOP_K, SCALE, 0, 0, 1)
    with pytest.raises(ValueError, match="block_m must be >= 0"):
        NR.add_rmsnorm_router(res, x, nw, 1e-6, gate, bias, GROUPS, KEPT, TOP_K, SCALE, 0, -1, 1)


@pytest.mark.skipif(not NR.HAVE_GLUON, reason="this Triton has no Gluon")
def test_eligible_rules(monkeypatch):
    from lingc.kernels import router_gluon as RG

    pretend_sm90(monkeypatch, RG)                # the fused kernel asks router_gluon's eligible for the device
    cuda = torch.device("cuda")

    class Rows:   # x's numel and device: all `eligible` reads of it
        def __init__(self, rows, h=1536):
            self.n, self.device = rows * h, cuda

        def numel(self):
            return self.n

    x = Rows
    gate = lambda e=128, h=1536, dtype=torch.bfloat16: torch.empty(e, h, dtype=dtype)  # noqa: E731
    assert NR.eligible(x(1), gate(), 8, 4, 8) and NR.eligible(x(16), gate(), 8, 4, 8)
    assert not NR.eligible(x(17), gate(), 8, 4, 8)                         # MAX_ROWS
    assert not NR.eligible(x(1, 16384), gate(h=16384), 8, 4, 8)            # a row past MAX_HIDDEN
    assert not NR.eligible(x(1), gate(e=512), 8, 4, 8)                     # Ling-3.0-flash: router.py's kernels
    monkeypatch.setattr(NR, "ENABLED", False)                              # LINGC_NORM_ROUTER_GLUON=0
    assert not NR.eligible(x(1), gate(), 8, 4, 8)


def test_program_split():
    """Ling-3.0-tiny (E = 128, h = 1536, bf16 gate): 4 gate rows a program (32 programs a row), no fewer than the
    router's 4 warps; an fp32 gate gets half as many rows."""
    assert NR.experts_per_program(128, 1536, 2) == 4
    assert NR.experts_per_program(128, 1536, 4) == 2
    assert NR.experts_per_program(128, 512, 2) == 16
    assert NR.experts_per_program(96, 1536, 2) == 4


_PROBE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
import lingc.kernels.norm_router as NR
import lingc.kernels.router_gluon as RG
align = sys.argv[1] == "1"
fn = NR._norm_router_kernel
const = dict(RG._constexprs(128, 8, 4, 8, 1), BM=16, ALIGN=align, PDL=True, EARLY_TRIGGER=False,
             EPP=NR.experts_per_program(128, 1536, 2), K_BLOCK=2048, VEC=NR.VEC)
sig = {}
for n in fn.arg_names:
    if n in const: sig[n] = "constexpr"
    elif n in ("res_ptr", "x_ptr", "nw_ptr", "gw_ptr", "normed_ptr", "res_out_ptr"): sig[n] = "*bf16"
    elif n in ("bias_ptr", "logits_ptr", "w_ptr"): sig[n] = "*fp32"
    elif n.endswith("_ptr"): sig[n] = "*i32"
    elif n in ("scale", "eps"): sig[n] = "fp32"
    else: sig[n] = "i32"
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)   # as the JIT specialises h = 1536
         if n.endswith("_ptr") or n in ("K", "stride_res", "stride_x")}
k = triton.compile(GluonASTSource(fn, sig, const, attrs=attrs), target=GPUTarget("cuda", 90, 64),
                   options={"num_warps": const["NW"]})
sys.stdout.write(k.asm["ptx"])
"""


@pytest.mark.skipif(not NR.HAVE_GLUON, reason="this Triton has no Gluon")
@pytest.mark.parametrize("align", [True, False], ids=["router_align", "router_topk"])
def test_sm90_code(align: bool) -> None:
    """Ling-3.0-tiny's shapes for sm_90: the gate slice's vector loads before the one griddepcontrol.wait, the
    trigger after it, one acq_rel gpu-scope ticket, and a handful of CTA barriers (the router's, the ticket's)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _PROBE, "1" if align else "0"], capture_output=True, text=True,
                          timeout=300, env=env, cwd=Path(__file__).resolve().parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [re.sub(r"^@!?%p\d+\s+", "", line.split("//")[0].strip()) for line in proc.stdout.splitlines()]
    find = lambda prefix: [i for i, line in enumerate(lines) if line.startswith(prefix)]  # noqa: E731
    waits, triggers = find("griddepcontrol.wait"), find("griddepcontrol.launch_dependents")
    assert len(waits) == 1 and len(triggers) == 1 and waits[0] < triggers[0]
    early_vectors = [i for i in find("ld.global.v4") if i < waits[0]]
    assert len(early_vectors) >= 4, "the gate slice is loaded before the wait"
    assert len(find("atom.global.gpu.acq_rel.add")) == 1
    assert len(find("bar.sync")) <= 8
