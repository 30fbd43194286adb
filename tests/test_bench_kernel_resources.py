"""bench/kernel_resources.py: lingc's kernels compiled offline for sm_90 (no GPU), their resources read from the cubin.

What it pins down: the MoE pair grid's swap-AB tiles (and the skinny GEMM's) compile to Hopper wgmma and decode's
aligned MoE tiles to mma.sync (the instruction difference behind the pair grid's H200 gain; the two gave the same bits
there), nothing spills, and the CTAs-an-SM arithmetic (the MLA split's 2 CTAs an SM, which kernels/mla.py's
comments rely on)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def rows() -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "kernel_resources.py")], capture_output=True,
                          text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {r["kernel"]: r for r in map(json.loads, proc.stdout.strip().splitlines())}


def test_pair_grid_tiles_are_wgmma(rows: dict[str, dict]) -> None:
    for name in ("moe_up_act_pairs (verify)", "moe_down_pairs (verify)"):
        assert rows[name]["wgmma"] > 0 and rows[name]["mma_sync"] == 0, rows[name]
    for name in ("moe_up_act (decode, aligned)", "moe_down (decode, preload)"):
        assert rows[name]["mma_sync"] > 0 and rows[name]["wgmma"] == 0, rows[name]
    assert rows["linear dot (bf16, unsplit)"]["wgmma"] > 0          # swap-AB since the start (kernels/linear.py)


def test_packed_mla_split_is_wgmma(rows: dict[str, dict]) -> None:
    """SPLIT_TILE_ROWS = 64 (4 queries of a chain a program): 64 MMA rows make Hopper wgmma; the default 16 rows
    stay mma.sync."""
    packed = rows["mla_attention split (tile 64)"]
    assert packed["wgmma"] > 0 and packed["mma_sync"] == 0 and packed["num_warps"] == 8, packed
    assert rows["mla_attention split"]["mma_sync"] > 0, rows["mla_attention split"]


def test_no_spills_and_the_split_occupancy(rows: dict[str, dict]) -> None:
    assert all(r["local_bytes"] == 0 for r in rows.values()), rows
    assert rows["mla_attention split"]["ctas_per_sm"] == 2


def test_ctas_per_sm() -> None:
    from kernel_resources import ctas_per_sm
    assert ctas_per_sm(212, 94208, 4) == 2          # registers and shared memory both allow 2
    assert ctas_per_sm(141, 56320, 4) == 3          # registers: 3 x 4 warps x 4608
    assert ctas_per_sm(40, 36864, 4) == 6           # shared memory: 228 KB / 37 KB
    assert ctas_per_sm(32, 0, 32) == 2              # threads: 2048 / 1024
    assert ctas_per_sm(32, 240 * 1024, 4) == 0      # more than a block may have


def test_filtered_probs_binning_step_keeps_its_tokens_on_their_threads(rows: dict[str, dict]) -> None:
    """kernels/filtered_probs.py bins on a [bins, tokens] tile, so a token is loaded, exponentiated and searched by
    few threads: a binning step (its round kernel's first loop) is 147 sm_90 SASS instructions at 32 bins (64 tokens)
    and 167 at 256 (8 tokens). With the bins on the threads' axis, as before 2026-12-06, every bin column's threads
    repeated every token's work: 652 and 487, and the H100 round took 57.6 / 129.7 us instead of ~30 / ~25."""
    for name in ("filtered_probs round (32 bins, first)", "filtered_probs round (256 bins)"):
        assert rows[name]["sass_loops"][0] <= 250, rows[name]
        assert rows[name]["local_bytes"] == 0, rows[name]
