"""fuse_emit: a verify graph's emit_tokens + pick_position(tokens, accept_len, -1) + seq + accept_len -> one
emit_accepted, bit for bit.

On test-tiny after partition (+ specialize_greedy for the greedy copy): op and launch counts before and after in
both verify graphs and no match elsewhere, the old nodes kept as getitems under their names, bit-exact programs
(reference backend), greedy NEXTN == plain decoding through the fused graphs, the hazards that keep the emit in
place, and a second run that finds nothing. The kernel is tested in tests/kernels/test_meta.py.
"""

from __future__ import annotations

import operator

import pytest
import torch

from lingc.ops import OPS
from lingc.passes.base import PassRecord, op_counts
from lingc.passes.fuse_emit import FuseEmit
from lingc.passes.manager import PassManager
from lingc.program import Program
from pass_support import assert_greedy_nextn_equals_plain, assert_reference_exact, count, launches

BEFORE = ["specialize_greedy", "partition"]
VERIFY_GRAPHS = ("verify", "verify_greedy")


@pytest.fixture(scope="module")
def prepared(tiny_program: Program) -> Program:
    return PassManager(BEFORE).run(tiny_program).program


@pytest.fixture(scope="module")
def fused(prepared: Program) -> tuple[Program, PassRecord]:
    return FuseEmit().run(prepared)


def _node(program: Program, graph: str, name: str) -> torch.fx.Node:
    return next(n for n in program.graphs[graph].nodes if n.name == name)


@pytest.mark.parametrize("graph", VERIFY_GRAPHS)
def test_three_launches_become_one(prepared, fused, graph):
    after, record = fused
    assert record.matches == 2
    before_ops, after_ops = op_counts(prepared.graphs[graph]), op_counts(after.graphs[graph])
    assert (count(prepared, graph, "emit_tokens"), count(prepared, graph, "pick_position"),
            before_ops.get("aten.add.Tensor", 0)) == (1, 1, 1)
    assert (count(after, graph, "emit_tokens"), count(after, graph, "pick_position"),
            after_ops.get("aten.add.Tensor", 0), count(after, graph, "emit_accepted")) == (0, 0, 0, 1)
    assert launches(prepared, graph) - launches(after, graph) == 2


def test_other_graphs_untouched(prepared, fused):
    after, _ = fused
    for graph in set(prepared.graphs) - set(VERIFY_GRAPHS):
        assert op_counts(after.graphs[graph]) == op_counts(prepared.graphs[graph]), graph


def test_old_nodes_are_getitems_of_the_fused_op(fused):
    after, _ = fused
    emit = next(n for n in after.graphs["verify"].nodes if n.target is OPS.emit_accepted)
    assert emit.name == "verify_emit_accepted"
    pick, add = _node(after, "verify", "verify_pick_position"), _node(after, "verify", "verify_add")
    assert (pick.target, pick.args) == (operator.getitem, (emit, 0))
    assert (add.target, add.args) == (operator.getitem, (emit, 1))
    out_tokens, out_len, slots, tokens, accept, seq = emit.args
    assert (out_tokens.name, out_len.name, slots.name) == ("relay_out_tokens", "relay_out_len", "slots")
    assert accept.name == "verify_simulate_accept" and seq.meta["lingc.tensor"].dtype == torch.int64


def test_bit_exact_and_greedy_parity(prepared, fused):
    after, _ = fused
    assert_reference_exact(prepared, after, VERIFY_GRAPHS)
    assert_greedy_nextn_equals_plain(after)


def test_second_run_finds_nothing(fused):
    after, _ = fused
    assert FuseEmit().run(after)[1].matches == 0


def test_a_read_of_out_tokens_between_keeps_the_emit(prepared):
    """The add moved before the emit and a read of out_tokens between them: the fused op would run at the add, moving
    the emit's writes before that read, so nothing fuses."""
    program = prepared.copy()
    graph = program.graphs["verify"]
    add = _node(program, "verify", "verify_add")
    out_tokens = next(n for n in graph.nodes if n.name == "relay_out_tokens")
    emit = next(n for n in graph.nodes if n.target is OPS.emit_tokens)
    with graph.inserting_before(emit):
        early_add = graph.call_function(torch.ops.aten.add.Tensor, tuple(add.args))
    early_add.meta = dict(add.meta)
    add.replace_all_uses_with(early_add)
    graph.erase_node(add)
    with graph.inserting_before(emit):       # the add now runs first; a read of out_tokens sits before the emit
        graph.call_function(OPS.gather_rows, (out_tokens, next(n for n in graph.nodes if n.name == "slots")))
    from lingc.ir.shapes import propagate
    propagate(program)
    new, record = FuseEmit().run(only_verify(program))
    assert record.matches == 0 and count(new, "verify", "emit_tokens") == 1


def only_verify(program: Program) -> Program:
    new = program.copy()
    new.graphs = {"verify": new.graphs["verify"]}
    return new
