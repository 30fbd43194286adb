"""capture_metadata: the refill ops move to each graph's head as one capture group, identical refills merge, the
draft's paged_refills over column slices of one positions tensor (one per MTP call) become one paged_refill of the
whole tensor whose cache rows its readers take as column slices, and a paged_refill of step_positions' output
becomes one step_refill, bit for bit; a write to the page table between two refills keeps them apart."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

from lingc.ir.shapes import TensorMeta
from lingc.ops import OPS
from lingc.passes.capture_metadata import CaptureMetadata, _merge_sliced_refills
from lingc.passes.manager import PassManager
from lingc.passes.verify import compare_stages
from lingc.program import Program
from pass_support import count, launches, only   # tests/passes is on sys.path


@pytest.fixture(scope="module")
def indexed(tiny_program: Program) -> Program:
    return PassManager(["partition", "fuse_index_chains"]).run(tiny_program).program


@pytest.fixture(scope="module")
def captured(indexed: Program):
    return CaptureMetadata().run(indexed)


def test_the_drafts_sliced_refills_become_one_with_their_positions(indexed, captured):
    """The draft's K refills of one column each -> one refill of every position, which then takes in the
    step_positions it reads: one step_refill for K + 1 launches; each MTP call's cache row a column of its output,
    every call the same page rows, and the positions under their old name as its first output."""
    after, record = captured
    calls = count(indexed, "draft", "paged_refill")
    assert calls >= 2 and count(after, "draft", "paged_refill") == 0 and count(after, "draft", "step_refill") == 1
    assert count(indexed, "draft", "step_positions") == 1 and count(after, "draft", "step_positions") == 0
    assert launches(indexed, "draft") - launches(after, "draft") == calls
    assert record.details["merged_slices"] == ["draft:draft_paged_refill"]
    graph = after.graphs["draft"]
    step = next(n for n in graph.nodes if n.target is OPS.step_refill)
    assert step.name == "draft_step_refill" and step.meta["lingc.capture"] == "metadata"
    positions, rows, locs = (next(u for u in step.users if u.args[1] == i) for i in range(3))
    assert positions.name == "draft_step_positions" and positions.target is operator.getitem
    parts = sorted(locs.users, key=lambda n: n.args[2])
    assert all(p.target is torch.ops.aten.slice.Tensor and p.users for p in parts)
    assert [p.args[1:] for p in parts] == [(1, i, i + 1) for i in range(calls)]     # call i: position i's cache row
    assert [p.name for p in parts] == ["draft_paged_refill_locs"] + [f"draft_paged_refill_{i}_locs"
                                                                     for i in range(1, calls)]
    attns = [n for n in graph.nodes if n.target is OPS.mla_attention]
    assert len(attns) == calls and all(a.args[4] is rows for a in attns)   # one page-table row for every call


def test_each_steps_positions_join_its_refill(indexed, captured):
    """step and verify: step_positions + paged_refill -> one step_refill (its getitems keep the old names); extend's
    refill reads relayed positions, so it stays."""
    after, record = captured
    assert record.details["step_refill"] == ["step:step_refill", "draft:draft_step_refill",
                                             "verify:verify_step_refill"]
    for g in ("step", "verify"):
        assert (count(indexed, g, "paged_refill"), count(indexed, g, "step_positions")) == (1, 1)
        assert (count(after, g, "paged_refill"), count(after, g, "step_positions"), count(after, g, "step_refill")) \
            == (0, 0, 1)
        assert launches(indexed, g) - launches(after, g) == 1
    assert count(after, "extend", "paged_refill") == count(indexed, "extend", "paged_refill") == 1


def test_bit_exact(indexed, captured):
    graphs = ("draft", "step", "verify", "extend")
    report = compare_stages(only(indexed, graphs), only(captured[0], graphs), exact=True, tolerance=None)
    assert report["ok"], {g: r["problems"] for g, r in report["graphs"].items() if r["problems"]}


def _two_refills(write_between: bool) -> fx.Graph:
    """positions [1, 2] -> two paged_refills of its column slices, optionally a page-table write between them."""
    g = fx.Graph()
    pt, slots, pos, vals = (g.placeholder(n) for n in ("page_table", "slots", "positions", "vals"))
    pos.meta["lingc.tensor"] = TensorMeta((1, 2), torch.int64)
    outs = []
    for i in range(2):
        s = g.call_function(torch.ops.aten.slice.Tensor, (pos, 1, i, i + 1))
        r = g.call_function(OPS.paged_refill, (pt, slots, s, 16))
        outs += [g.call_function(operator.getitem, (r, 0)), g.call_function(operator.getitem, (r, 1))]
        if write_between and i == 0:
            g.call_function(OPS.scatter_rows, (pt, slots, vals))
    g.output(tuple(outs))
    return g


def test_a_page_table_write_between_keeps_them_apart():
    g = _two_refills(write_between=False)
    assert len(_merge_sliced_refills(g)) == 1
    assert sum(n.target is OPS.paged_refill for n in g.nodes) == 1
    g = _two_refills(write_between=True)
    assert _merge_sliced_refills(g) == []
    assert sum(n.target is OPS.paged_refill for n in g.nodes) == 2


def test_second_run_finds_nothing(captured):
    again, record = CaptureMetadata().run(captured[0])
    assert record.details["merged_slices"] == record.details["step_refill"] == [] and record.details["merged"] == 0


def test_merge_refills_off_keeps_them(indexed, monkeypatch):
    """MERGE_REFILLS = False (the A/B knob): the draft keeps a paged_refill per MTP call and step_positions."""
    import lingc.passes.capture_metadata as cm
    monkeypatch.setattr(cm, "MERGE_REFILLS", False)
    after, record = CaptureMetadata().run(indexed)
    assert record.details["merged_slices"] == record.details["step_refill"] == []
    for g in ("draft", "step", "verify"):
        assert count(after, g, "paged_refill") == count(indexed, g, "paged_refill")
        assert count(after, g, "step_refill") == 0
