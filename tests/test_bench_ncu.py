"""bench/device_ncu.py's summary of Nsight Compute CSVs: the last launch of each kernel name per target, except the
filtered_probs targets, whose last call's seven launches (stats, five rounds, write) stay apart in order; and the
SASS stall samples' summary (where the samples sit, the instructions with the most, their largest stall reasons)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from device_ncu import FP_LAUNCHES, TARGETS, sass_summary, summarise  # noqa: E402

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


SASS_HEAD = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
             '"Instructions Executed","stall_barrier","stall_long_sb","stall_wait","stall_barrier (Not Issued)"\n')


def _sass(samples: list[tuple[int, int, int]]) -> str:
    """An `ncu --page source --csv --print-source sass` dump: one row an instruction, (all, barrier, long_sb)."""
    rows = [f'"0x{i:x}","INSTR{i} R{i}","{a}","0","616","{b}","{lsb}","0","{b}"\n' for i, (a, b, lsb) in enumerate(samples)]
    return '"Kernel Name","_round_kernel",\n' + SASS_HEAD + "".join(rows)


def test_sass_summary_places_the_samples(tmp_path: Path) -> None:
    samples = [(0, 0, 0)] * 250
    samples[3] = (30, 0, 30)        # entry: waiting on a load
    samples[120] = (50, 45, 5)      # mid-kernel: a barrier
    samples[240] = (20, 0, 20)
    (tmp_path / "fp_k50p1_sass.txt").write_text(_sass(samples))
    s = sass_summary(tmp_path / "fp_k50p1_sass.txt")
    assert s["samples"] == 100 and s["instructions"] == 250
    assert s["by_instructions"] == {"0-99": 0.3, "100-199": 0.5, "200-299": 0.2}   # zero buckets left out
    assert [t["index"] for t in s["top"]] == [120, 3, 240]                          # instructions with samples only
    assert s["top"][0]["share"] == 0.5 and s["top"][0]["sass"] == "INSTR120 R120"
    assert s["top"][0]["stalls"] == {"barrier": 45.0, "long_sb": 5.0}              # "Not Issued" columns ignored
    (tmp_path / "fp_k50p1.csv").write_text(_csv(1))
    summarise(str(tmp_path), str(tmp_path / "out.json"))
    table = json.loads((tmp_path / "out.json").read_text())
    assert table["fp_k50p1"]["sass"] == s and "0:_stats_kernel" in table["fp_k50p1"]


def test_sass_summary_without_samples_says_so(tmp_path: Path) -> None:
    (tmp_path / "x_sass.txt").write_text("==ERROR== no kernels profiled\n")
    assert "error" in sass_summary(tmp_path / "x_sass.txt")
