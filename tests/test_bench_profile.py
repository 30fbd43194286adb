"""bench/device_profile.py summarize_replays (shared with bench/device_tp.py --profile): per-replay medians of
kernel events, busy time as the union of overlapping (PDL) intervals, kernels grouped by name."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from device_profile import summarize_replays  # noqa: E402


def _replay(t0: float) -> list[dict]:
    # a [0, 4) b [3, 6) overlap (PDL), gap, a [10, 12)
    return [{"name": "a", "ts": t0, "dur": 4.0}, {"name": "b", "ts": t0 + 3, "dur": 3.0},
            {"name": "a", "ts": t0 + 10, "dur": 2.0}]


def test_summary_of_two_replays():
    s = summarize_replays(_replay(0.0) + _replay(100.0), 2)
    assert s["kernels_per_replay"] == 3 and s["span_us"] == 12.0 and s["busy_us"] == 8.0
    assert s["kernel_sum_us"] == 9.0 and s["idle_us"] == 4.0 and s["gap_us_median"] == 2.0
    assert [(r["kernel"], r["launches"], r["us"]) for r in s["by_kernel"]] == [("a", 2, 6.0), ("b", 1, 3.0)]


def test_event_count_not_a_multiple_of_the_replays_is_an_error():
    assert "error" in summarize_replays(_replay(0.0), 2) and "error" in summarize_replays([], 3)
