"""bench/tp_threads.py on CPU: test-tiny's TP2 rank programs as threads over one device (collectives swapped for an
in-process exchange, the fused all_reduce + add + norm included) give TP1's greedy tokens in fp32, and the router
record lines up call for call (no different expert choice anywhere)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_threads_tp2_equals_tp1_with_the_fused_op(tmp_path: Path) -> None:
    sys.path.insert(0, str(BENCH))
    try:
        import tp_threads
    finally:
        sys.path.remove(str(BENCH))
    out = tmp_path / "t.json"
    # without fuse_norm_linear every all_reduce fuses with its add_rmsnorm: the exchange's fused path runs
    tp_threads.main(["--preset", "test-tiny", "--device", "cpu", "--dtype", "fp32", "--tokens", "4", "--specs", "none",
                     "--passes", "partition,fuse_swiglu,fuse_add_norm,fuse_projections", "--json", str(out)])
    run = json.loads(out.read_text())["runs"]["reference/none"]
    assert run["equal"] and len(run["tp1"]) == 4 and run["router_calls"] > 0
    assert run["first_router_difference"] is None
    assert run["collectives_swapped"].get("all_reduce_add_rmsnorm", 0) > 0 and "all_reduce" not in run["collectives_swapped"]
