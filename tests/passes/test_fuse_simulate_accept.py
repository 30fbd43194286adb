"""fuse_simulate_accept: verify's greedy_accept / chain_accept + simulate_accept (+ the greedy copy's uniform) -> one
op, bit for bit.

On test-tiny after specialize_greedy, partition and fuse_relay (without it, the near miss it reports): op and launch
counts in both verify graphs and no match elsewhere, the old nodes kept as getitems under their names (the knob's
output, the tokens), the uniform's offset carried into the greedy op, bit-exact programs (reference backend), the CPU
engine's tokens and accept lengths unchanged with the knob on (greedy and sampled requests) and off, what must not
match, and a second run that finds nothing. The kernels are tested in tests/kernels/test_accept_simulated.py.
"""

from __future__ import annotations

import operator

import pytest

from lingc.ops import OPS
from lingc.passes.fuse_simulate_accept import FuseSimulateAccept, _match
from lingc.passes.manager import PassManager
from lingc.program import Program
from lingc.runtime.engine import Engine, Request, SamplingParams
from pass_support import assert_reference_exact, count, launches  # noqa: E402  (tests/passes is on sys.path)

BEFORE = ["specialize_greedy", "partition", "fuse_relay"]


@pytest.fixture(scope="module")
def prepared(tiny_program: Program) -> Program:
    return PassManager(BEFORE).run(tiny_program).program


@pytest.fixture(scope="module")
def fused(prepared: Program):
    return FuseSimulateAccept().run(prepared)


def test_counts(prepared, fused):
    after, record = fused
    assert record.matches == 2 and not record.changes_numerics
    assert count(after, "verify", "simulate_accept") == 0 and count(after, "verify", "chain_accept_simulated") == 1
    assert count(after, "verify", "uniform") == count(prepared, "verify", "uniform") == 1   # chain_accept reads it
    assert launches(prepared, "verify") - launches(after, "verify") == 1
    assert count(after, "verify_greedy", "greedy_accept_simulated") == 1
    assert count(after, "verify_greedy", "uniform") == count(after, "verify_greedy", "simulate_accept") == 0
    assert launches(prepared, "verify_greedy") - launches(after, "verify_greedy") == 2
    for graph in set(prepared.graphs) - {"verify", "verify_greedy"}:
        assert launches(prepared, graph) == launches(after, graph), graph
    assert FuseSimulateAccept().run(after)[1].matches == 0


def test_fused_nodes(prepared, fused):
    after, _ = fused
    before = {n.name: n for n in prepared.graphs["verify_greedy"].nodes}
    nodes = {n.name: n for n in after.graphs["verify_greedy"].nodes}
    op = nodes["verify_greedy_accept_simulated"]
    uniform, select = before["verify_uniform"], before["verify_select"]
    seed, counter, _, offset = uniform.args
    assert [str(a) for a in op.args] == [str(a) for a in (*before["verify_greedy_accept"].args,
                                                          before["verify_simulate_accept"].args[1], seed, counter)] \
        + [str(offset + select.args[2]), str(before["verify_simulate_accept"].args[3])]
    sim, tokens = nodes["verify_simulate_accept"], nodes["verify_getitem_1"]
    assert (sim.target, sim.args, tokens.target, tokens.args) == (operator.getitem, (op, 0), operator.getitem, (op, 1))
    order = list(after.graphs["verify_greedy"].nodes)
    assert order.index(op) < order.index(tokens) < min(order.index(u) for u in tokens.users)
    general = {n.name: n for n in after.graphs["verify"].nodes}["verify_chain_accept_simulated"]
    assert general.args[-2].target is operator.getitem or general.args[-2].name == "verify_select"


def test_programs_are_bit_exact(prepared, fused):
    assert_reference_exact(prepared, fused[0], ("verify", "verify_greedy"))


@pytest.mark.parametrize("simulate", [0.0, 3.2])
def test_engine_tokens_and_accept_lengths_unchanged(prepared, fused, simulate):
    """The knob on (a mean accept length of 3.2) and off: greedy requests (the greedy copies) and a sampled one."""
    for params in (None, SamplingParams(0.8, seed=7)):
        runs = []
        for program in (prepared, fused[0]):
            request = Request([11, 22, 33], 12, params, ignore_eos=True) if params else \
                Request([11, 22, 33], 12, ignore_eos=True)
            runs.append(Engine(program, "cpu", "nextn", simulate_accept_len=simulate).generate(request))
        assert runs[0].tokens == runs[1].tokens and runs[0].accept_lens == runs[1].accept_lens
        if simulate:
            assert max(runs[1].accept_lens) > 1                    # the knob acted


def test_without_fuse_relay_the_relay_write_keeps_the_knob(tiny_program):
    program = PassManager(["specialize_greedy", "partition"]).run(tiny_program).program
    record = FuseSimulateAccept().run(program)[1]
    assert record.matches == 0 and len(record.details["skipped"]) == 2
    assert all("fuse_relay" in reason for reason in record.details["skipped"])


def test_tokens_read_before_the_knob_are_left_alone(prepared):
    program = prepared.copy()
    graph = program.graphs["verify_greedy"]
    sim = next(n for n in graph.nodes if n.target is OPS.simulate_accept)
    assert _match(sim) is not None
    tokens = next(n for n in graph.nodes if n.name == "verify_getitem_1")
    with graph.inserting_before(sim):                                 # a reader of the tokens before the knob
        graph.call_function(OPS.pick_position, (tokens, sim.args[0], -1))
    assert _match(sim) is None
    program = prepared.copy()
    graph = program.graphs["verify_greedy"]
    sim = next(n for n in graph.nodes if n.target is OPS.simulate_accept)
    uniform = next(n for n in graph.nodes if n.target is OPS.uniform)
    with graph.inserting_after(uniform):                              # the greedy uniform read by something else
        graph.call_function(operator.getitem, (uniform, 0))
    assert _match(sim) is None
