"""kernels/mla_gluon.py without a GPU: where the Gluon MLA split runs, the fallback when it does not compile, and its
sm_90 code compiled offline (a fresh process without TRITON_INTERPRET) at Ling-3.0-tiny's shapes: the cache rows'
cp.async copies are issued before the PDL wait and the query tile's after it, the trigger follows the query tile's
copies, the MMAs are wgmma (68 of them: 4 latent chunks + the rope chunk for S, 4 chunks for O, in k16 steps), and
nothing spills. Its values are checked on the H200 (bench/kernel_mla.py --gluon: reference tolerance, row
invariance, PDL on == off, determinism, difference to the Triton split)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lingc.kernels.mla as mla
from lingc.kernels import mla_gluon as MG
from kernel_support import BrokenGluonKernel, pretend_sm90  # noqa: E402  (tests/kernels is on sys.path)

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


class _Cuda:
    """A stand-in for a CUDA tensor's device facts (`eligible` reads only these)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        self.device = torch.device("cuda")
        self.dtype = t.dtype

    def stride(self, *dim):
        return self.t.stride(*dim)

    def data_ptr(self) -> int:
        return 0

    @property
    def shape(self):
        return self.t.shape


def _tiny_buffers(dtype=torch.bfloat16, H=16, R=512, Rr=64):
    kv = torch.empty(4, 16, R + Rr, dtype=dtype)
    q_rope = torch.empty(1, 6, H, 128 + Rr, dtype=dtype)[..., 128:]
    return _Cuda(kv), _Cuda(q_rope)


@pytest.mark.skipif(not MG.HAVE_GLUON, reason="this Triton has no Gluon")
def test_eligible_rules(monkeypatch) -> None:
    kv, qr = _tiny_buffers()
    assert not MG.eligible(kv.t, qr.t, 16, 512, 64, 128)                  # CPU: the interpreter never runs Gluon
    pretend_sm90(monkeypatch, MG)
    assert MG.eligible(kv, qr, 16, 512, 64, 128)                          # Ling-3.0-tiny
    assert not MG.eligible(kv, qr, 32, 512, 64, 128)                      # only H = 16 has run on the GPU
    assert not MG.eligible(kv, qr, 16, 512, 64, 64)                       # the split is 128 rows
    assert not MG.eligible(kv, qr, 8, 512, 64, 128)                       # 64 / H queries a tile: H >= 16
    assert not MG.eligible(kv, qr, 16, 512, 32, 128)                      # the rope part is one 64-column chunk
    assert not MG.eligible(kv, qr, 16, 1024, 64, 128)                     # the rows and the tile overflow smem
    kv32, qr32 = _tiny_buffers(torch.float32)
    assert not MG.eligible(kv32, qr32, 16, 512, 64, 128)                  # fp32 caches: IEEE dots in Triton
    kv16, qr16 = _tiny_buffers(torch.float16)
    assert not MG.eligible(kv16, qr16, 16, 512, 64, 128)                  # only bf16 has run on the GPU
    odd = _Cuda(torch.empty(1, 6, 16, 64 + 4, dtype=torch.bfloat16)[..., 4:])
    assert not MG.eligible(kv, odd, 16, 512, 64, 128)                     # q_rope rows not 16-byte aligned
    monkeypatch.setattr(MG, "_major", lambda device: 10)
    assert not MG.eligible(kv, qr, 16, 512, 64, 128)                      # wgmma is sm_90's
    monkeypatch.setattr(MG, "_major", lambda device: 9)
    monkeypatch.setattr(MG, "ENABLED", False)                             # LINGC_MLA_GLUON=0
    assert not MG.eligible(kv, qr, 16, 512, 64, 128)


@pytest.mark.skipif(not MG.HAVE_GLUON, reason="this Triton has no Gluon")
def test_a_kernel_that_does_not_compile_falls_back_to_triton(monkeypatch) -> None:
    """Another Triton's Gluon: mla_attention warns once (naming the module and the knob), runs the Triton split with
    the same result, and later launches skip the path."""
    g = torch.Generator().manual_seed(5)
    H, N, Rr, R, Vd, PS, MP = 2, 16, 8, 32, 16, 4, 6
    q = torch.randn(1, 2, H, N + Rr, generator=g)
    kv = torch.randn(MP + 2, PS, R + Rr, generator=g)
    w = torch.randn(H * (N + Vd), R, generator=g) * R ** -0.5
    pages = torch.randperm(MP + 2, generator=g)[:MP].view(1, MP).to(torch.int32)
    pos = torch.tensor([[17, 18]])
    args = (q[..., :N], q[..., N:], kv, w, pages, pos, (N + Rr) ** -0.5)
    want = mla.mla_attention(*args)

    monkeypatch.setattr(MG, "FAILED", [])
    monkeypatch.setattr(MG, "_mla_split_gluon_kernel", BrokenGluonKernel("warpgroup_mma"))
    monkeypatch.setattr(MG, "eligible", lambda *a: not MG.FAILED)
    with pytest.warns(RuntimeWarning, match=r"kernels/mla_gluon.py.*warpgroup_mma.*LINGC_MLA_GLUON=0"):
        got = mla.mla_attention(*args)
    assert torch.equal(got, want)
    assert MG.FAILED and not MG.eligible()
    assert torch.equal(mla.mla_attention(*args), want)


_PROBE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
import lingc.kernels.mla_gluon as MG
fn = getattr(MG, sys.argv[1])
const = dict(UNIT=MG.UNIT, PS=16, H=16, R=512, RR=64, SPLIT_N=MG.SPLIT, CW=MG.CHUNK, QPP=int(sys.argv[2]), PDL=True,
             NW=MG.WARPS)
sig = {}
for n in fn.arg_names:
    if n in const: sig[n] = "constexpr"
    elif n == "part_o_ptr": sig[n] = "*bf16" if MG.PARTIAL_BF16 else "*fp32"
    elif n == "part_ml_ptr": sig[n] = "*fp32"
    elif n in ("pages_ptr", "pos_ptr"): sig[n] = "*i32"
    elif n.endswith("_ptr"): sig[n] = "*bf16"
    elif n == "qk_scale": sig[n] = "fp32"
    else: sig[n] = "i32"
aligned = {"stride_rb", "stride_rt", "stride_rh", "stride_page", "stride_row"}
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n.endswith("_ptr") or n in aligned}
k = triton.compile(GluonASTSource(fn, sig, const, attrs=attrs), target=GPUTarget("cuda", 90, 64),
                   options={"num_warps": MG.WARPS})
sys.stdout.write(str(k.metadata.shared) + "\\n" + k.asm["ptx"])
"""


def _compile_sm90(kernel: str, qpp: int) -> tuple[int, list[str]]:
    """(shared memory bytes, PTX lines without predicates and comments) of a split kernel compiled for sm_90."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _PROBE, kernel, str(qpp)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=Path(__file__).resolve().parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shared, _, ptx = proc.stdout.partition("\n")
    return int(shared), [re.sub(r"^@!?%p\d+\s+", "", line.split("//")[0].strip()) for line in ptx.splitlines()]


@pytest.mark.skipif(not MG.HAVE_GLUON, reason="this Triton has no Gluon")
def test_sm90_code() -> None:
    shared, lines = _compile_sm90("_mla_split_gluon_kernel", MG.TILE_ROWS // 16)
    assert shared <= MG.SMEM_LIMIT + 2048, shared                         # one CTA an SM fits
    find = lambda prefix: [i for i, line in enumerate(lines) if line.startswith(prefix)]  # noqa: E731
    waits, triggers = find("griddepcontrol.wait"), find("griddepcontrol.launch_dependents")
    copies = find("cp.async.cg.shared.global")
    assert len(waits) == 1 and len(triggers) == 1 and waits[0] < triggers[0], (waits, triggers)
    before = [i for i in copies if i < waits[0]]
    after = [i for i in copies if waits[0] < i < triggers[0]]
    # 144 KB of cache rows over 256 threads at 16 B, before the wait for units that earlier steps wrote, after it for
    # a unit with a row of this step's tokens (the same copies in both branches); the 72 KB query tile after it
    rows_copies, q_copies = 128 * 576 * 2 // 16 // 256, 64 * 576 * 2 // 16 // 256
    assert len(before) == rows_copies and len(after) == rows_copies + q_copies, (len(before), len(after))
    assert len(find("wgmma.mma_async")) == (512 // 16 + 64 // 16) + 4 * (128 // 16)
    assert not find("ld.local") and not find("st.local")                  # nothing spills


@pytest.mark.skipif(not MG.HAVE_GLUON, reason="this Triton has no Gluon")
@pytest.mark.parametrize("qpp", [1, 4])
def test_sm90_code_swapped(qpp: int) -> None:
    """The swapped split (SWAP): the default kernel's copies and PDL placement, and a query's own m64n16k16 chains,
    (512 + 64) / 16 steps for S^T and 4 chunks x 128 / 16 for O^T, QPP times over; one CTA an SM; no spills."""
    shared, lines = _compile_sm90("_mla_split_swap_kernel", qpp)
    assert shared <= MG.SMEM_LIMIT + 2048, shared
    find = lambda prefix: [i for i, line in enumerate(lines) if line.startswith(prefix)]  # noqa: E731
    waits, triggers = find("griddepcontrol.wait"), find("griddepcontrol.launch_dependents")
    assert len(waits) == 1 and len(triggers) == 1 and waits[0] < triggers[0], (waits, triggers)
    copies = find("cp.async.cg.shared.global")
    before = [i for i in copies if i < waits[0]]
    after = [i for i in copies if waits[0] < i < triggers[0]]
    # the query tile: each latent chunk and the rope part at least one 16 B copy a thread
    rows_copies = 128 * 576 * 2 // 16 // 256
    q_copies = 4 * -(-16 * qpp * 128 * 2 // 16 // 256) + -(-16 * qpp * 64 * 2 // 16 // 256)
    assert len(before) == rows_copies and len(after) == rows_copies + q_copies, (len(before), len(after))
    mmas = [lines[i] for i in find("wgmma.mma_async")]
    assert len(mmas) == qpp * ((512 + 64) // 16 + 4 * (128 // 16)), len(mmas)
    assert all(".m64n16k16." in m for m in mmas), set(mmas)
    assert all(i > triggers[0] for i in find("wgmma.mma_async"))
    assert not find("ld.local") and not find("st.local")


def test_swap_queries() -> None:
    """The swapped split's queries a program: the power of two covering T, at most SWAP_QPP_MAX."""
    assert [MG.swap_queries(t) for t in (1, 2, 3, 4, 6, 16)] == [1, 2, 4, 4, 4, 4]
