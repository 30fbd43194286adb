"""fuse_relay_cat: the draft's relay write of its cats -> the pieces scattered into column slices of the relay tables,
bit for bit.

On test-tiny after specialize_greedy, partition and fuse_relay: the cats gone from both drafts (two in the general
graph, the chain and the draft distributions; one in the greedy copy) and no other graph changed, the scatter's
tables as column slices in the cats' order, bit-exact programs (reference backend), the CPU engine's tokens and
accept lengths unchanged (greedy and sampled requests), what must not match, and a second run that finds nothing.
The column-slice scatter kernel is tested in tests/kernels/test_meta.py (test_scatter_rows_multi_into_column_slices).
"""

from __future__ import annotations

import pytest
import torch

from lingc.ops import OPS
from lingc.passes.fuse_relay_cat import FuseRelayCat
from lingc.passes.manager import PassManager
from lingc.program import Program
from lingc.runtime.engine import Engine, Request, SamplingParams
from pass_support import assert_reference_exact, launches  # noqa: E402  (tests/passes is on sys.path)

BEFORE = ["specialize_greedy", "partition", "fuse_relay"]
CAT = torch.ops.aten.cat.default
K = 5                                                              # test-tiny's draft tokens per NEXTN round


def _cats(program: Program, graph: str) -> list:
    return [n for n in program.graphs[graph].nodes if n.op == "call_function" and n.target is CAT]


def _scatter(program: Program, graph: str):
    return next(n for n in program.graphs[graph].nodes if n.target is OPS.scatter_rows_multi)


@pytest.fixture(scope="module")
def prepared(tiny_program: Program) -> Program:
    return PassManager(BEFORE).run(tiny_program).program


@pytest.fixture(scope="module")
def fused(prepared: Program):
    return FuseRelayCat().run(prepared)


def test_counts(prepared, fused):
    after, record = fused
    assert record.matches == 3 and not record.changes_numerics
    assert sorted(record.details["cats_removed"]) == ["draft:draft_cat", "draft:draft_cat_1", "draft_greedy:draft_cat"]
    for graph, removed in (("draft", 2), ("draft_greedy", 1)):
        assert len(_cats(prepared, graph)) - len(_cats(after, graph)) == removed
        assert launches(prepared, graph) - launches(after, graph) == removed
    for graph in set(prepared.graphs) - {"draft", "draft_greedy"}:
        assert [n.name for n in prepared.graphs[graph].nodes] == [n.name for n in after.graphs[graph].nodes], graph
    assert FuseRelayCat().run(after)[1].matches == 0


def test_scatter_writes_the_pieces_into_column_slices(prepared, fused):
    after, _ = fused
    for graph in ("draft", "draft_greedy"):
        old, new = _scatter(prepared, graph), _scatter(after, graph)
        old_tables, _, old_values, _ = old.args
        tables, slots, values, adds = new.args
        assert slots is not None and adds == [0] * len(tables)
        want_tables, want_values = [], []
        for table, value in zip(old_tables, old_values):
            if value.target is CAT:
                pieces = value.args[0]
                want_tables += [(table.name, 1, i, i + 1) for i in range(len(pieces))]   # one column a piece
                want_values += [p.name for p in pieces]
            else:
                want_tables.append(table.name)
                want_values.append(value.name)
        got_tables = [t.name if t.op == "placeholder" else (t.args[0].name, *t.args[1:]) for t in tables]
        assert got_tables == want_tables and [v.name for v in values] == want_values
        chain = [t for t in tables if t.op != "placeholder" and t.args[0].name == "relay_x_draft_cat"]
        assert len(chain) == K + 1                                 # the root and the K drafts


def test_programs_are_bit_exact(prepared, fused):
    assert_reference_exact(prepared, fused[0], ("draft", "draft_greedy"))


def test_engine_tokens_and_accept_lengths_unchanged(prepared, fused):
    for params in (None, SamplingParams(0.8, seed=7)):
        runs = []
        for program in (prepared, fused[0]):
            request = Request([11, 22, 33], 12, params, ignore_eos=True) if params else \
                Request([11, 22, 33], 12, ignore_eos=True)
            runs.append(Engine(program, "cpu", "nextn", simulate_accept_len=3.2).generate(request))
        assert runs[0].tokens == runs[1].tokens and runs[0].accept_lens == runs[1].accept_lens
        assert max(runs[1].accept_lens) > 1


def test_a_cat_with_another_reader_or_a_piece_written_after_it_is_left_alone(prepared):
    program = prepared.copy()
    graph = program.graphs["draft_greedy"]
    cat = _cats(program, "draft_greedy")[-1]
    with graph.inserting_after(cat):                               # a second reader of the chain
        graph.call_function(torch.ops.aten.clone.default, (cat,))
    assert not any(r.startswith("draft_greedy:") for r in FuseRelayCat().run(program)[1].details["cats_removed"])
    program = prepared.copy()
    graph = program.graphs["draft_greedy"]
    cat = _cats(program, "draft_greedy")[-1]
    piece, slots = cat.args[0][2], _scatter(program, "draft_greedy").args[1]
    with graph.inserting_after(cat):                               # a piece's buffer changes between cat and scatter
        graph.call_function(OPS.scatter_rows, (piece, slots, piece))
    assert not any(r.startswith("draft_greedy:") for r in FuseRelayCat().run(program)[1].details["cats_removed"])


def test_in_all_before_pdl(tiny_program):
    names = [p.name for p in PassManager(["all"]).passes]
    assert names.index("fuse_relay") < names.index("fuse_relay_cat") < names.index("pdl")
