"""kernels/router_gluon.py without a GPU: where the Gluon router runs, the fallback when it does not compile, and its
sm_90 code compiled offline (a fresh process without TRITON_INTERPRET): the bias is loaded before the PDL wait and
the logits after it, and the whole routing takes a handful of CTA barriers (no serial pick chain). Its bits are
checked on the H200 against router.py's kernels (bench/kernel_router.py gluon: every cell of router_align's five
outputs against "rows", router_topk against the Triton kernel, random and tie-heavy inputs)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from lingc.kernels import router as R
from lingc.kernels import router_gluon as RG
from lingc.ops.moe import moe_align
from kernel_support import BrokenGluonKernel, pretend_sm90  # noqa: E402  (tests/kernels is on sys.path)


@pytest.mark.skipif(not RG.HAVE_GLUON, reason="this Triton has no Gluon")
def test_eligible_rules(monkeypatch) -> None:
    cuda = torch.device("cuda")
    assert not RG.eligible(torch.device("cpu"), 128, 8, 4, 8)       # the interpreter never runs Gluon
    pretend_sm90(monkeypatch, RG)
    assert RG.eligible(cuda, 128, 8, 4, 8) and RG.eligible(cuda, 32, 2, 1, 4) and RG.eligible(cuda, 256, 8, 4, 8)
    assert not RG.eligible(cuda, 512, 8, 4, 8)                       # Ling-3.0-flash: more experts than threads
    assert not RG.eligible(cuda, 96, 8, 3, 9)                        # E a multiple of 32 that is not 32 x 2^n
    assert not RG.eligible(cuda, 128, 2, 1, 8)                       # groups of 64: wider than a warp
    assert not RG.eligible(cuda, 120, 8, 4, 8)                       # E not a multiple of 32
    monkeypatch.setattr(RG, "_major", lambda device: 8)
    assert not RG.eligible(cuda, 128, 8, 4, 8)
    monkeypatch.setattr(RG, "_major", lambda device: 9)
    monkeypatch.setattr(RG, "ENABLED", False)                        # LINGC_ROUTER_GLUON=0
    assert not RG.eligible(cuda, 128, 8, 4, 8)


def test_gluon_variant_needs_one_row_on_a_gpu() -> None:
    x, bias = torch.randn(1, 128), torch.randn(128)
    with pytest.raises(ValueError, match="variant 'gluon' needs one row on a GPU"):
        R.router_align(x, bias, 8, 4, 8, 2.5, 129, 16, 1, variant="gluon")


@pytest.mark.skipif(not RG.HAVE_GLUON, reason="this Triton has no Gluon")
def test_a_kernel_that_does_not_compile_falls_back_to_triton(monkeypatch) -> None:
    """Another Triton's Gluon: router_topk and router_align warn once (naming the module and the knob), run
    router.py's kernels with the same result, and later launches skip the path."""
    g = torch.Generator().manual_seed(11)
    x, bias = torch.randn(3, 128, generator=g), 0.1 * torch.randn(128, generator=g)
    want = R.router_topk(x, bias, 8, 4, 8, 2.5, 1)
    want_align = R.router_align(x[:1], bias, 8, 4, 8, 2.5, 129, 16, 1)

    monkeypatch.setattr(RG, "FAILED", [])
    monkeypatch.setattr(RG, "_router_gluon_kernel", BrokenGluonKernel("allocate_shared_memory"))
    monkeypatch.setattr(RG, "eligible", lambda *args: not RG.FAILED)
    with pytest.warns(RuntimeWarning, match=r"kernels/router_gluon.py.*allocate_shared_memory.*LINGC_ROUTER_GLUON=0"):
        got = R.router_topk(x, bias, 8, 4, 8, 2.5, 1)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert RG.FAILED and not RG.eligible()
    got_align = R.router_align(x[:1], bias, 8, 4, 8, 2.5, 129, 16, 1)   # "auto" skips the failed path
    assert all(torch.equal(a, b) for a, b in zip(got_align, want_align))
    assert all(torch.equal(a, b) for a, b in zip(got_align[2:], moe_align(got_align[1], 129, 16)))


_PROBE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
import lingc.kernels.router_gluon as RG
align = sys.argv[1] == "1"
fn = RG._router_gluon_kernel
const = dict(RG._constexprs(128, 8, 4, 8, 1), BM=16, ALIGN=align, PDL=True, EARLY_TRIGGER=True)
sig = {}
for n in fn.arg_names:
    if n in const: sig[n] = "constexpr"
    elif n in ("logits_ptr", "bias_ptr", "w_ptr"): sig[n] = "*fp32"
    elif n.endswith("_ptr"): sig[n] = "*i32"
    elif n == "scale": sig[n] = "fp32"
    else: sig[n] = "i32"
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n.endswith("_ptr")}
k = triton.compile(GluonASTSource(fn, sig, const, attrs=attrs), target=GPUTarget("cuda", 90, 64),
                   options={"num_warps": const["NW"]})
sys.stdout.write(k.asm["ptx"])
"""


def _ptx(align: bool) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _PROBE, "1" if align else "0"], capture_output=True, text=True,
                          timeout=300, env=env, cwd=Path(__file__).resolve().parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    code = [line.split("//")[0].strip() for line in proc.stdout.splitlines()]
    return [re.sub(r"^@!?%p\d+\s+", "", line) for line in code]


@pytest.mark.skipif(not RG.HAVE_GLUON, reason="this Triton has no Gluon")
@pytest.mark.parametrize("align", [True, False], ids=["router_align", "router_topk"])
def test_sm90_code(align: bool) -> None:
    """Ling-3.0-tiny's router (E = 128 + 1 shared, 4 warps) for sm_90: one griddepcontrol.wait, global loads on both
    sides of it (the bias before, the logits after), the early trigger right after it, and 4 CTA barriers in all
    (the group scores' shared memory, the one-hot pick reduction), where router.py's pick chain has k serial
    reductions."""
    lines = _ptx(align)
    find = lambda prefix: [i for i, line in enumerate(lines) if line.startswith(prefix)]  # noqa: E731
    waits, triggers = find("griddepcontrol.wait"), find("griddepcontrol.launch_dependents")
    loads = find("ld.global")
    assert len(waits) == 1 and len(triggers) == 1 and waits[0] < triggers[0], (waits, triggers)
    assert any(i < waits[0] for i in loads) and any(i > waits[0] for i in loads)
    assert len(find("bar.sync")) <= 4, find("bar.sync")


def test_shared_early_auto_follows_the_router(monkeypatch) -> None:
    """kernels/moe.py's SHARED_EARLY "auto": the up-GEMM's early shared tile runs behind router.py's kernels (it paid
    there) and not where the Gluon router routes the layer (it cost there: the H200 A/B in moe.py); "1" / "0" force
    it; never without the shared_last hint."""
    from lingc.kernels import moe as M

    cpu = torch.device("cpu")
    assert M._shared_early(True, 9, 0, cpu, 129)["SHARED_EARLY"]           # CPU: router.py's kernels route
    monkeypatch.setattr(RG, "eligible", lambda device, e, *rest: e == 128)
    assert RG.routes(cpu, 128) and not RG.routes(cpu, 512)
    assert not M._shared_early(True, 9, 0, cpu, 129)["SHARED_EARLY"]       # the Gluon router routes 128 experts
    assert M._shared_early(True, 9, 0, cpu, 513)["SHARED_EARLY"]           # 512 (Ling-3.0-flash): router.py's
    monkeypatch.setattr(M, "SHARED_EARLY", "1")
    assert M._shared_early(True, 9, 0, cpu, 129)["SHARED_EARLY"]
    monkeypatch.setattr(M, "SHARED_EARLY", "0")
    assert not M._shared_early(True, 9, 0, cpu, 513)["SHARED_EARLY"]
    monkeypatch.setattr(M, "SHARED_EARLY", "auto")
    assert not M._shared_early(False, 9, 0, cpu, 513)["SHARED_EARLY"]
    monkeypatch.setattr(RG, "ALIGN", False)                                # LINGC_ROUTER_GLUON_ALIGN=0
    assert M._shared_early(True, 9, 0, cpu, 129)["SHARED_EARLY"]
