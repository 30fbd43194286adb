"""fuse_relay: a graph's relay gathers by one slots tensor -> gather_rows_multi, its relay scatters ->
scatter_rows_multi with the integer adds that only feed them folded in, bit for bit.

Op and launch counts per graph on test-tiny after partition + fuse_index_chains + capture_metadata (the passes that
run before it in `all`), the fused nodes (tables in graph order, old names kept as getitems, adds), bit-exact programs
in fp32 and bf16 (reference backend), hazards that must keep a node out of a group (a table read between two scatters,
a gather after a write of its table, an add with a second reader, the value written between an add and the scatter),
the order with other passes (pdl after it sees the list writes), the TP shards, the JSON IR round trip, and a second
run that finds nothing. The kernels are tested in tests/kernels/test_meta.py and, on the whole NEXTN step in the
interpreter, in tests/kernels/test_lowering.py.
"""

from __future__ import annotations

import operator

import pytest
import torch

from lingc.ir.serialize import graph_from_json, graph_to_json
from lingc.ir.shapes import propagate
from lingc.ops import OPS
from lingc.passes import PASSES
from lingc.passes.base import PassRecord, op_counts
from lingc.passes.fuse_relay import FuseRelay
from lingc.passes.manager import PassManager, resolve
from lingc.passes.matchers import is_free, written_inputs
from lingc.passes.pdl import Pdl
from lingc.passes.tp import gather_state, run_lockstep, shard_inputs, shard_program
from lingc.passes.verify import compare_stages, random_inputs
from lingc.program import Program
from pass_support import count, only   # tests/passes is on sys.path

BEFORE = ["partition", "fuse_index_chains", "capture_metadata"]
STEP_GRAPHS = ("step", "draft", "verify", "extend")
# graph: (gather_rows, gather_rows_multi, scatter_rows, scatter_rows_multi, aten adds + subs) before -> after, and the
# kernel launches removed. draft has 10 relay reads (8 + 2: the root joined them when the draft's cat began to carry
# it), verify 9 (8 + 1), extend 9; the adds that go: the step's
# seq_len + 1 and rng_counter + 1, extend's rng_counter + 10 + 3 (one add of 13). (The draft has no adds: its
# positions and uniforms come one launch each for all its forwards; verify and extend pass their constant offsets to
# uniform and pick_position as op arguments, lingc/steps.py.)
COUNTS = {"step": ((7, 0, 3, 0, 2), (0, 1, 0, 1, 0), 10),
          "draft": ((10, 0, 3, 0, 0), (0, 2, 0, 1, 0), 10),
          "verify": ((9, 0, 6, 0, 1), (1, 1, 0, 1, 1), 12),
          "extend": ((9, 0, 4, 0, 2), (1, 1, 0, 1, 0), 12)}


def _counts(program: Program, graph: str) -> tuple[int, ...]:
    ops = op_counts(program.graphs[graph])
    return (count(program, graph, "gather_rows"), count(program, graph, "gather_rows_multi"),
            count(program, graph, "scatter_rows"), count(program, graph, "scatter_rows_multi"),
            ops.get("aten.add.Tensor", 0) + ops.get("aten.sub.Tensor", 0))


def _launches(program: Program, graph: str) -> int:
    return sum(1 for n in program.graphs[graph].nodes if n.op == "call_function" and not is_free(n))


def _node(program: Program, graph: str, name: str) -> torch.fx.Node:
    return next(n for n in program.graphs[graph].nodes if n.name == name)


def _exact(before: Program, after: Program, graphs: tuple[str, ...] = STEP_GRAPHS) -> None:
    report = compare_stages(only(before, graphs), only(after, graphs), exact=True, tolerance=None)
    assert report["ok"], {g: r["problems"] for g, r in report["graphs"].items() if r["problems"]}


@pytest.fixture(scope="module")
def prepared(tiny_program: Program) -> Program:
    return PassManager(BEFORE).run(tiny_program).program


@pytest.fixture(scope="module")
def fused(prepared: Program) -> tuple[Program, PassRecord]:
    return FuseRelay().run(prepared)


# ---- op counts and structure -----------------------------------------------------------------------------

@pytest.mark.parametrize("graph", [*STEP_GRAPHS, "decode", "prefill", "mtp_decode", "mtp_prefill"])
def test_op_counts_and_launches(prepared, fused, graph):
    after, _ = fused
    if graph not in COUNTS:                                # host-fed graphs: no relay, nothing to do
        assert op_counts(after.graphs[graph]) == op_counts(prepared.graphs[graph])
        return
    want_before, want_after, removed = COUNTS[graph]
    assert (_counts(prepared, graph), _counts(after, graph)) == (want_before, want_after)
    assert _launches(prepared, graph) - _launches(after, graph) == removed


def test_step_nodes(prepared, fused):
    """The step's 7 gathers -> one op where the first ran, each old node a getitem of it under its own name; the 3
    scatters -> one op where the last ran, with the seq_len and rng_counter + 1 folded."""
    after, _ = fused
    gathers = [n for n in prepared.graphs["step"].nodes if n.target is OPS.gather_rows]
    multi = _node(after, "step", "gather_rows_multi")
    assert [a.name for a in multi.args[0]] == [g.args[0].name for g in gathers] and multi.args[1].name == "slots"
    assert multi.meta["lingc.capture"] == "metadata"
    for i, g in enumerate(gathers):
        item = _node(after, "step", g.name)
        assert item.target is operator.getitem and item.args == (multi, i) and "lingc.capture" not in item.meta
    nodes = list(after.graphs["step"].nodes)
    assert nodes.index(multi) < min(nodes.index(_node(after, "step", g.name)) for g in gathers)
    scatter = _node(after, "step", "scatter_rows_multi")
    tables, slots, values, adds = scatter.args
    assert [t.name for t in tables] == ["relay_root", "relay_seq_len", "relay_rng_counter"] and slots.name == "slots"
    assert [v.name for v in values] == ["view_36", "gather_rows", "gather_rows_13"] and adds == [0, 1, 1]
    assert nodes[-2] is scatter                            # the graph's last effect, before the output


def test_extend_folds_a_chain_of_adds(fused):
    after, _ = fused
    scatter = _node(after, "extend", "extend_scatter_rows_multi")
    assert [t.name for t in scatter.args[0]][-1] == "relay_rng_counter"
    assert scatter.args[2][-1].name == "extend_gather_rows_5" and scatter.args[3] == [0, 0, 0, 13]


def test_record(fused):
    _, record = fused
    assert record.name == "fuse_relay" and not record.changes_numerics and record.tolerance is None
    assert record.matches == 5 + 4
    assert record.details["gather_rows_multi"] == ["step:gather_rows_multi", "draft:draft_gather_rows_multi",
                                                   "draft:draft_gather_rows_multi_1", "verify:verify_gather_rows_multi",
                                                   "extend:extend_gather_rows_multi"]
    assert record.details["adds_folded"] == ["step:add_14", "step:add_15", "extend:extend_add_1", "extend:extend_add"]


# ---- numerics --------------------------------------------------------------------------------------------

def test_programs_are_bit_exact_fp32(prepared, fused):
    """Reference backend: every output and every pool, relay and counter, bit for bit."""
    _exact(prepared, fused[0])


def test_programs_are_bit_exact_bf16_after_every_other_pass(tiny_program_bf16):
    """In `all`'s place (after fuse_combine_norm, before pdl) on the bf16 program."""
    names = [n for n in resolve(["all"], PASSES) if n.name not in ("pdl", "fuse_relay")]
    before = PassManager([p.name for p in names]).run(tiny_program_bf16).program
    after, record = FuseRelay().run(before)
    assert record.matches == 9 + 8                  # + specialize_greedy's copies (no probs relay: one fewer)
    _exact(before, after)


# ---- hazards ---------------------------------------------------------------------------------------------

def _step_with(prepared: Program, edit) -> Program:
    """A copy of `prepared` whose step graph `edit(graph, nodes by name)` changed, shapes re-inferred."""
    program = prepared.copy()
    edit(program.graphs["step"], {n.name: n for n in program.graphs["step"].nodes})
    propagate(program)
    return program


def test_a_table_read_between_two_scatters_keeps_the_earlier_one(prepared):
    """relay_root is read again after its scatter (and that value scattered into relay_top_k): the root scatter may
    not move past the read, and the read may not join the head's gathers (it must see the write)."""
    def edit(graph, nodes):
        with graph.inserting_after(nodes["scatter_rows"]):
            again = graph.call_function(OPS.gather_rows, (nodes["relay_root"], nodes["slots"]))
        with graph.inserting_after(again):
            graph.call_function(OPS.scatter_rows, (nodes["relay_top_k"], nodes["slots"], again))
    program = _step_with(prepared, edit)
    after, _ = FuseRelay().run(program)
    assert _counts(after, "step") == (1, 1, 1, 1, 0)
    kept = next(n for n in after.graphs["step"].nodes if n.target is OPS.scatter_rows)
    assert kept.args[0].name == "relay_root"
    multi = next(n for n in after.graphs["step"].nodes if n.target is OPS.scatter_rows_multi)
    assert [t.name for t in multi.args[0]] == ["relay_top_k", "relay_seq_len", "relay_rng_counter"]
    _exact(program, after, ("step",))


def test_an_add_with_another_reader_stays(prepared):
    """seq_len + 1 is also written to relay_top_k: the add stays and both scatters read it; rng_counter + 1 folds."""
    def edit(graph, nodes):
        with graph.inserting_after(nodes["scatter_rows_4"]):
            graph.call_function(OPS.scatter_rows, (nodes["relay_top_k"], nodes["slots"], nodes["add_14"]))
    program = _step_with(prepared, edit)
    after, record = FuseRelay().run(program)
    assert _counts(after, "step") == (0, 1, 0, 1, 1) and [a for a in record.details["adds_folded"] if a.startswith("step:")] == ["step:add_15"]
    multi = next(n for n in after.graphs["step"].nodes if n.target is OPS.scatter_rows_multi)
    assert [v.name for v in multi.args[2]] == ["view_36", "add_14", "gather_rows_13", "add_14"]
    assert multi.args[3] == [0, 0, 1, 0]
    _exact(program, after, ("step",))


def test_a_write_of_the_added_value_blocks_the_fold(prepared):
    """The counter the rng_counter + 1 reads is overwritten after the add: folding would write the new value + 1,
    so that add stays (its scatter still joins, unfolded); seq_len + 1 folds."""
    def edit(graph, nodes):
        with graph.inserting_after(nodes["add_15"]):
            graph.call_function(OPS.scatter_rows, (nodes["gather_rows_13"], nodes["slots"], nodes["gather_rows_12"]))
    program = _step_with(prepared, edit)
    after, record = FuseRelay().run(program)
    assert [a for a in record.details["adds_folded"] if a.startswith("step:")] == ["step:add_14"]
    multi = next(n for n in after.graphs["step"].nodes if n.target is OPS.scatter_rows_multi)
    assert [v.name for v in multi.args[2]] == ["view_36", "gather_rows", "add_15"] and multi.args[3] == [0, 1, 0]
    _exact(program, after, ("step",))


def test_a_gather_after_a_write_of_its_table_stays_behind_it(prepared):
    """draft: relay_seed is written between the head's gathers, just before the seed gather: that gather may not move
    up to the first group (it must see the write), so it starts a second group where it ran, after the write; the
    first group fills with 8 (rng_counter joins it) and the ninth, the draft_first distribution, joins the second."""
    program = prepared.copy()
    graph = program.graphs["draft"]
    nodes = {n.name: n for n in graph.nodes}
    with graph.inserting_before(nodes["draft_gather_rows_7"]):
        graph.call_function(OPS.scatter_rows, (nodes["relay_seed"], nodes["slots"], nodes["draft_gather_rows_5"]))
    propagate(program)
    after, _ = FuseRelay().run(program)
    assert _counts(after, "draft")[:2] == (0, 2)
    nodes = list(after.graphs["draft"].nodes)
    first, second = [n for n in nodes if n.target is OPS.gather_rows_multi]
    assert [t.name for t in first.args[0]] == ["relay_seq_len", "relay_root", "relay_draft_first", "relay_mtp_hidden",
                                               "relay_temperature", "relay_top_k", "relay_top_p", "relay_rng_counter"]
    assert [t.name for t in second.args[0]] == ["relay_seed", "relay_draft_first_probs"]
    write = next(n for n in nodes if n.target is OPS.scatter_rows and n.args[0].name == "relay_seed")
    assert nodes.index(first) < nodes.index(write) < nodes.index(second)
    _exact(program, after, ("draft",))


# ---- other passes, TP, IR --------------------------------------------------------------------------------

def test_pass_order():
    registry = {**PASSES, "fuse_relay": FuseRelay}
    assert [p.name for p in resolve(["pdl", "fuse_relay", "capture_metadata", "fuse_index_chains", "partition"],
                                    registry)] == ["partition", "fuse_index_chains", "capture_metadata", "fuse_relay",
                                                   "pdl"]
    order = [p.name for p in resolve(["all", "fuse_relay"], registry)]
    assert order.index("fuse_relay") < order.index("pdl")


def test_pdl_after_it_annotates_the_fused_ops_and_sees_their_writes(fused):
    after, _ = fused
    annotated, _ = Pdl().run(after)
    for graph in STEP_GRAPHS:
        for node in annotated.graphs[graph].nodes:
            if node.target in (OPS.gather_rows_multi, OPS.scatter_rows_multi):
                assert node.meta["lingc.pdl"]["chain"] == "solo", node.name
    scatter = _node(after, "step", "scatter_rows_multi")
    assert written_inputs(scatter) == set(scatter.args[0])


def test_tp_shards_the_fused_program_bit_for_bit(prepared, fused):
    """The fused ops are replicated metadata: the tp pass shards around them, and the ranks in lockstep give the
    unfused ranks' outputs and state bit for bit."""
    old_ranks, new_ranks = shard_program(prepared, 2), shard_program(fused[0], 2)
    for graph in STEP_GRAPHS:
        inputs = random_inputs(prepared, [graph])
        results = []
        for ranks in (old_ranks, new_ranks):
            rank_in = [shard_inputs(inputs, ranks[0], graph, r, 2) for r in range(2)]
            run_lockstep(ranks, graph, rank_in)
            results.append(gather_state(rank_in, ranks[0], graph))
        assert results[0].keys() == results[1].keys()
        assert all(torch.equal(results[0][k], results[1][k]) for k in results[0]), graph


def test_json_round_trip_keeps_the_getitem_names(fused):
    """Regression: a getitem under an old gather's name before a node literally named 'getitem' made the loader
    refuse the graph ('duplicate node name')."""
    after, _ = fused
    for graph in STEP_GRAPHS:
        loaded = graph_from_json(graph_to_json(after.graphs[graph]), graph)
        assert [n.name for n in loaded.nodes] == [n.name for n in after.graphs[graph].nodes]


def test_input_program_is_not_edited(prepared, fused):
    assert _counts(prepared, "step") == COUNTS["step"][0]


def test_second_run_finds_nothing(fused):
    again, record = FuseRelay().run(fused[0])
    assert record.matches == 0 and record.nodes_added == record.nodes_removed == []
