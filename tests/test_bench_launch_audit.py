"""bench/launch_audit.py: every op of the TP1 step graphs lowers to one of lingc's kernels (the draft's chain cats too,
since fuse_relay_cat), so a new op without a Triton launcher shows up here before it shows up as torch kernels in a
CUDA graph."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import launch_audit  # noqa: E402
from lingc.presets import preset  # noqa: E402


def test_step_graphs_launch_only_lingc_kernels():
    (program,) = launch_audit.programs([1], preset("test-tiny")).values()
    rows = launch_audit.audit(program)
    assert set(rows) == set(launch_audit.GRAPHS)
    for name, row in rows.items():
        assert not row["other"], (name, row["other"])
        assert row["triton"] > 0 and row["views"] > 0
