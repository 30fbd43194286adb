"""bench/device_ncu.py's summary of Nsight Compute CSVs: the last launch of each kernel name per target, except the
filtered_probs targets, whose last call's seven launches (stats, five rounds, write) stay apart in order."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from device_ncu import FP_LAUNCHES, TARGETS, summarise  # noqa: E402

HEADER = '"ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"\n'
NAMES = ["_stats_kernel"] + ["_round_kernel"] * 5 + ["_write_kernel"]


def _csv(calls: int) -> str:
    rows = [f'"{c * len(NAMES) + j}","{n}(int, int)","SOL","Duration","us","{c * len(NAMES) + j + 0.5}"\n'
            for c in range(calls) for j, n in enumerate(NAMES)]
    return "==PROF== Connected\n" + HEADER + "".join(rows)


def test_filtered_probs_launches_stay_apart(tmp_path: Path) -> None:
    assert {"fp_peaked1", "fp_flat1", "fp_flat6", "fp_k50p1"} <= set(TARGETS) and FP_LAUNCHES == len(NAMES)
    (tmp_path / "fp_flat1.csv").write_text(_csv(3))
    (tmp_path / "mla1.csv").write_text(_csv(3))
    summarise(str(tmp_path), str(tmp_path / "out.json"))
    table = json.loads((tmp_path / "out.json").read_text())
    assert list(table["fp_flat1"]) == [f"{i}:{n}" for i, n in enumerate(NAMES)]
    assert [m["Duration"] for m in table["fp_flat1"].values()] == [14 + i + 0.5 for i in range(7)]   # the last call
    assert table["mla1"]["_round_kernel"]["Duration"] == 19.5 and len(table["mla1"]) == 3          # last of each name
