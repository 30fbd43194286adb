"""bench/device_serve.py end to end on CPU (test-tiny, reference ops, no CUDA graphs): the direct runs and both HTTP
runs (the `lingc bench` client in its own process and in a thread) complete every request at its exact length, with
the same simulated acceptance, and the JSON carries the overhead. The times mean nothing here (the GPU run measures)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_device_serve_runs_on_cpu(tmp_path: Path):
    out = tmp_path / "serve.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "device_serve.py"), "--preset", "test-tiny",
                           "--device", "cpu", "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    n = r["workload"]["requests"]
    assert (r["direct"]["completed"], r["http"]["completed"], r["http_in_process"]["completed"]) == (2 * n, n, n)
    for run in ("direct", "http", "http_in_process"):
        assert r[run]["failed"] == 0 and r[run]["output_len_mismatches"] == 0, r[run]
        assert r[run]["mean_tpot_ms"] > 0 and r[run]["mean_ttft_ms"] > 0
    # seed 0 on every route: the simulated acceptance draws the same lengths in every run
    accept = {r["http"]["accept_length"], r["http_in_process"]["accept_length"]}
    assert set(r["direct"]["mean_accept_len"]) == accept and len(accept) == 1
    for run in ("http", "http_in_process"):
        o = r["overhead"][run]
        assert o["mean_tpot_ms"] == pytest.approx(r[run]["mean_tpot_ms"] - r["direct"]["mean_tpot_ms"])
        assert o["mean_tpot_pct"] == pytest.approx(100 * o["mean_tpot_ms"] / r["direct"]["mean_tpot_ms"])
    assert {"gpu", "torch", "commit", "command"} <= r.keys()
