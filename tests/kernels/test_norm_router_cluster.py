"""kernels/norm_router_cluster.py without a GPU: which shapes and devices it takes, that kernels/norm_router.py's
launcher falls back to its own paths where it does not run, and its CUDA C++ compiled by NVRTC for sm_90a offline
(the libnvrtc scripts/setup.sh unpacks into .venv/nvrtc): weights loaded before the one PDL wait, the rows after it
with coherent loads, the logits handed on by mapa + st.shared::cluster after the cluster has started and before one
cluster barrier. Its numbers are
checked on the GPU (bench/kernel_cluster_router.py)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from lingc.kernels import cuda_rtc
from lingc.kernels import norm_router as NR
from lingc.kernels import norm_router_cluster as NC

LING_TINY = dict(hidden=1536, num_routed=128, n_group=8, top_k=8, fused_shared=1)
NVRTC = Path(sys.prefix) / "nvrtc" / "nvidia" / "cuda_nvrtc" / "lib" / "libnvrtc.so.12"


@pytest.mark.parametrize("cluster", [1, 2, 4, 8, 16])
def test_ling_tiny_router_shapes_are_taken(cluster):
    assert NC.shape_ok(**LING_TINY, cluster=cluster)


@pytest.mark.parametrize("change, why", [
    (dict(hidden=128), "h / 8 threads must be whole warps"),
    (dict(hidden=16384), "more than 1024 threads"),
    (dict(num_routed=512, hidden=2048), "an expert a thread: E <= h / 8"),
    (dict(n_group=4), "groups of 32 experts fill a warp: fine"),
    (dict(n_group=2), "groups of 64 experts span two warps"),
    (dict(num_routed=96, n_group=8), "groups of 12: not a power of two"),
    (dict(top_k=33), "top_k over 32"),
])
def test_shape_rules(change, why):
    ok = NC.shape_ok(**{**LING_TINY, **change}, cluster=16)
    assert ok == (why.endswith("fine")), why


def test_cluster_must_divide_the_experts():
    assert not NC.shape_ok(**LING_TINY, cluster=3)
    assert not NC.shape_ok(**{**LING_TINY, "num_routed": 32, "n_group": 2}, cluster=64)


def test_not_eligible_on_cpu_off_or_fp32(monkeypatch):
    x = torch.zeros(1, 1, 1536, dtype=torch.bfloat16)
    gate = torch.zeros(128, 1536, dtype=torch.bfloat16)
    monkeypatch.setattr(NC, "ENABLED", True)
    assert not NC.eligible(x, gate, 8, 4, 8, 1)                           # a CPU tensor
    monkeypatch.setattr(NC, "ENABLED", False)
    assert not NC.eligible(x, gate, 8, 4, 8, 1)


def test_launcher_falls_back_where_the_cluster_kernel_does_not_run(monkeypatch):
    """ENABLED on a CPU: kernels/norm_router.py's two-kernel path, the same outputs as with it off."""
    g = torch.Generator().manual_seed(0)
    h, e = 64, 32
    args = (torch.randn(1, 2, h, generator=g), torch.randn(1, 2, h, generator=g), 1 + 0.1 * torch.randn(h, generator=g),
            1e-6, 0.2 * torch.randn(e, h, generator=g), 0.05 * torch.randn(e, generator=g), 4, 2, 4, 2.5, 0, 0, 1)
    off = NR.add_rmsnorm_router(*args)
    monkeypatch.setattr(NC, "ENABLED", True)
    on = NR.add_rmsnorm_router(*args)
    assert all(torch.equal(a, b) for a, b in zip(off, on))


@pytest.fixture
def nvrtc(monkeypatch):
    if not NVRTC.exists():
        pytest.skip(f"no libnvrtc at {NVRTC} (scripts/setup.sh unpacks one)")
    monkeypatch.setenv("LINGC_NVRTC", str(NVRTC))
    cuda_rtc.nvrtc_available.cache_clear()


def _ptx(cluster: int) -> str:
    opts = NC.defines(1536, 128, 8, 4, 8, 1, cluster)
    return cuda_rtc.compile_cuda(NC.SOURCE, "norm_router_cluster", "sm_90a", opts, ptx=True).rstrip(b"\0").decode()


@pytest.mark.parametrize("cluster", [16, 8])
def test_sm90a_code(nvrtc, cluster):
    ptx = _ptx(cluster)
    body = ptx[ptx.index(".entry norm_router_cluster"):]
    wait = body.index("griddepcontrol.wait")
    trigger = body.index("griddepcontrol.launch_dependents")
    assert body.count("griddepcontrol.wait") == 1 and wait < trigger
    # the E / CLUSTER gate rows (16 B a thread each) and the norm weight: read-only loads, all before the wait
    weights = [m.start() for m in re.finditer(r"ld\.global\.nc\.v4\.u32", body)]
    assert len(weights) == 128 // cluster + 1 and max(weights) < wait
    # the residual and x rows, written by the launch before: two coherent 16-byte loads, after the wait
    rows = [m.start() for m in re.finditer(r"ld\.global\.v4\.u32", body)]
    assert len(rows) == 2 and min(rows) > trigger
    # the logits go to rank 0's shared memory, then one cluster barrier (release / acquire) before the routing
    # after a relaxed arrive at entry and its wait (the cluster has started: DSMEM stores are legal)
    mapa, store = body.index("mapa.shared::cluster"), body.index("st.shared::cluster.u32")
    started, started_wait = body.index("barrier.cluster.arrive.relaxed"), body.index("barrier.cluster.wait.aligned")
    arrive, wait_c = body.index("barrier.cluster.arrive.release"), body.index("barrier.cluster.wait.acquire")
    assert started < min(weights) and min(rows) < started_wait < store
    assert min(rows) < mapa < store < arrive < wait_c
    assert body.count("barrier.cluster.arrive") == 2 and body.count("barrier.cluster.wait") == 2


def test_sm90a_cubin_builds(nvrtc):
    assert len(cuda_rtc.compile_cuda(NC.SOURCE, "norm_router_cluster", "sm_90a",
                                     NC.defines(1536, 128, 8, 4, 8, 1, 16))) > 1000


def test_compile_error_names_the_file(nvrtc):
    with pytest.raises(RuntimeError, match=r"broken\.cu: NVRTC compile for sm_90a failed"):
        cuda_rtc.compile_cuda("extern \"C\" __global__ void k() { undefined_thing(); }", "broken", "sm_90a")
