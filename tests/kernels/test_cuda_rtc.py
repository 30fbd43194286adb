"""kernels/cuda_rtc.py's launch structs match cuda.h, its library search fails with a message naming what it tried, and
the cluster probe's value model (bench/kernel_cluster_chain.py) is the kernel's arithmetic."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import pytest

from lingc.kernels import cuda_rtc

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import kernel_cluster_chain  # noqa: E402


def test_launch_structs_have_cuda_h_layout():
    # CUlaunchAttribute: id (4 B) + pad (4 B) + a 64-byte value union; CUlaunchConfig: 7 uints, the stream pointer
    # aligned at 32, the attribute pointer at 40, their count at 48, 56 bytes in all (x86-64)
    assert ctypes.sizeof(cuda_rtc._Attr) == 72 and cuda_rtc._Attr.value.offset == 8
    assert ctypes.sizeof(cuda_rtc._Config) == 56
    assert (cuda_rtc._Config.stream.offset, cuda_rtc._Config.attrs.offset, cuda_rtc._Config.num_attrs.offset) == \
        (32, 40, 48)


def test_config_sets_cluster_and_pdl_attributes():
    cfg, _keep = cuda_rtc.Kernel._config((8,), (128,), 4, True, 0, None)
    assert (list(cfg.grid), list(cfg.block), cfg.num_attrs) == ([8, 1, 1], [128, 1, 1], 2)
    assert cfg.attrs[0].id == cuda_rtc.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION and list(cfg.attrs[0].value.dims) == [4, 1, 1]
    assert cfg.attrs[1].id == cuda_rtc.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert cfg.attrs[1].value.flag == 1
    plain, _keep = cuda_rtc.Kernel._config((8,), (128,), 1, False, 0, None)
    assert plain.num_attrs == 0


def test_missing_nvrtc_names_what_was_tried(monkeypatch):
    monkeypatch.setattr(cuda_rtc, "nvrtc_candidates", lambda: ["/nonexistent/libnvrtc.so.13"])
    with pytest.raises(RuntimeError, match=r"LINGC_NVRTC.*/nonexistent/libnvrtc\.so\.13"):
        cuda_rtc.nvrtc()


def test_env_nvrtc_is_tried_first(monkeypatch):
    monkeypatch.setenv("LINGC_NVRTC", "/opt/x/libnvrtc.so.13")
    assert cuda_rtc.nvrtc_candidates()[0] == "/opt/x/libnvrtc.so.13"


def test_cluster_chain_model():
    # one stage of allgather over 4 ranks from 0: sum(r + 1) = 10; barrier: acc * 3 + 1
    assert kernel_cluster_chain.expected("allgather", 1, 4) == 10
    assert kernel_cluster_chain.expected("gather", 2, 4) == 4 * (10 * 3) + 10
    assert kernel_cluster_chain.expected("barrier", 3, 16) == 13
    assert kernel_cluster_chain.expected("global", 600, 16) < 2 ** 32
