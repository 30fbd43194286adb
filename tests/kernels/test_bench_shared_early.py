"""bench/kernel_moe.py's shared_last section (the H200 check of SHARED_EARLY: bits with and without the hint, then
times) runs in the interpreter at a small size and finds the same bits, aligned at one token and on the pair grid at
six; its timings are GPU-only."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import kernel_moe  # noqa: E402


def test_shared_early_rows_on_cpu(monkeypatch) -> None:
    for name, value in (("H", 32), ("INTER", 16), ("E", 8), ("TOP_K", 3), ("CALLS", 2), ("COPIES", 1)):
        monkeypatch.setattr(kernel_moe, name, value)
    monkeypatch.setattr(kernel_moe, "_time", lambda calls: None)
    dev = torch.device("cpu")
    g = torch.Generator(device=dev).manual_seed(0)
    stacks = kernel_moe._stacks(dev, g)
    for T in (1, 6):
        rows = kernel_moe._shared_early_rows(kernel_moe.Problem(T, dev, g, stacks))
        assert [r["same_bits"] for r in rows] == [True], rows
