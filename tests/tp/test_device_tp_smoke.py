"""bench/device_tp.py end to end on CPU under gloo (test-tiny, 2 spawned ranks, reference ops, no CUDA graphs): both
ranks finish and leave the group, the weights agree across ranks, the launch counts are the tp pass's (docs/tp.md),
every all_reduce was swapped for the no-op run, and TP2's greedy tokens equal TP1's (plain and NEXTN) or part at a
near-tie. The times mean nothing here (the GPU run measures)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COUNTS = {"step": (12, 1), "draft": (8, 4), "verify": (12, 1), "extend": (2, 1)}     # (all_reduce, all_gather)


@pytest.mark.slow
def test_device_tp_runs_on_cpu_under_gloo(tmp_path: Path):
    out = tmp_path / "tp.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "device_tp.py"), "--preset", "test-tiny",
                           "--device", "cpu", "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["exit_codes"] == {"0": 0, "1": 0} and not r.get("errors")
    r0 = r["ranks"]["0"]
    assert r0["backend"] == "gloo" and r0["weights_identical_across_ranks"]
    assert all(rank["teardown"]["group_destroyed"] for rank in r["ranks"].values())
    for graph, (all_reduce, all_gather) in COUNTS.items():
        assert (r["summary"][graph]["all_reduce"], r["summary"][graph]["all_gather"]) == (all_reduce, all_gather)
        assert r["summary"][graph]["tp2_ms"] > 0 and r["summary"][graph]["tp2_no_all_reduce_ms"] > 0
    assert r["summary"]["nextn_total"]["all_reduce"] == 22
    assert r0["tp"]["all_reduce_swapped"] >= 12 + 22
    iso = r0["isolated_all_reduce"]
    assert iso["shape"] == [1, 128] and iso["lingc_all_reduce_us"] > 0
    for spec in ("none", "nextn"):
        p = r0["parity"][spec]
        assert len(p["tp1"]) == r["config"]["parity_tokens"]
        assert p["equal"] or p["near_tie"], p
