"""bench/kernel_meta.py on the CPU (the Triton interpreter, tiny shapes, untimed): every row of its GPU check passes,
so the device call that times them runs a script whose checks already hold: the relay / metadata kernels bit for
bit against their references, PDL on == off, and kda_commit_multi of every layer's pairs in one launch equal to
launches of 8 pairs."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import kernel_meta  # noqa: E402


def test_every_row_passes_in_the_interpreter() -> None:
    rows = kernel_meta.run(torch.device("cpu"))
    failed = [r for r in rows if not r.get("ok")]
    assert not failed, failed
    names = [r["kernel"] for r in rows]
    layers = kernel_meta.CPU_SMOKE.kda_layers
    assert "kda_commit_multi" in names and f"kda_commit_multi[{4 * layers}]" in names
    assert all(r["time_us"] is None for r in rows)                      # untimed on the CPU
