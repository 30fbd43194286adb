"""bench/device_step.py's launches_pdl: the step benchmark launches with PDL exactly when the pdl pass runs, also
when it comes in through `all` (the bug it replaced tested `"pdl" in passes`, so every `all` row ran without PDL)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from device_step import launches_pdl  # noqa: E402


def test_pdl_through_all_and_by_name():
    assert launches_pdl(["all"]) and launches_pdl(["all", "fuse_moe"]) and launches_pdl(["partition", "pdl"])
    assert not launches_pdl([]) and not launches_pdl(["partition", "fuse_swiglu", "capture_metadata"])
