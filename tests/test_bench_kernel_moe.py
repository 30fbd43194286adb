"""bench/kernel_moe.py's tiling sweep (GPU-only timings) builds its configs on CPU: every tuple is a GemmConfig the
launchers accept, the swap-AB tilings only for the up-GEMM (a 4-tuple failed GemmConfig._make once swap_ab existed)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import kernel_moe  # noqa: E402

from lingc.kernels.moe import _check_gemm  # noqa: E402


def test_tune_configs() -> None:
    up, down = kernel_moe.tune_configs(up=True), kernel_moe.tune_configs(up=False)
    assert len(up) == len(kernel_moe.TUNE) + len(kernel_moe.TUNE_UP_SWAP) and len(down) == len(kernel_moe.TUNE)
    assert not any(c.swap_ab for c in down) and sum(c.swap_ab for c in up) == len(kernel_moe.TUNE_UP_SWAP)
    a, w = torch.zeros(2, 256, dtype=torch.bfloat16), torch.zeros(3, 128, 256, dtype=torch.bfloat16)
    for cfg in up + down:
        assert _check_gemm("moe_up_act", a, w, True, cfg) == (3, 128, 256)

