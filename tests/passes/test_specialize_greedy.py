"""specialize_greedy: greedy-only copies of the step graphs (step_greedy, nextn_greedy -> draft_greedy / verify_greedy /
extend_greedy after partition), with argmaxes in place of the sampling distributions.

Op counts of each copy against its source on test-tiny (K = 5 draft tokens), the general graphs left as they were,
--verify's variant check (a copy run against its source with every request greedy: all outputs, relays and state
bit for bit) and that it catches a broken copy, partition's split of the copy (its relays are the general set's,
minus the distributions), what makes a graph unspecialisable, and a second run that adds nothing. The engine's
choice between the sets and token parity are in tests/runtime/test_greedy_graphs.py.
"""

from __future__ import annotations

import pytest
import torch

from lingc.ir.text import program_text
from lingc.ops import OPS
from lingc.passes.base import PassRecord
from lingc.passes.manager import PassManager
from lingc.passes.matchers import calls
from lingc.passes.specialize_greedy import SpecializeGreedy, _copy, specialize
from lingc.passes.verify import compare_stages
from lingc.program import Program
from pass_support import count, launches  # noqa: E402  (tests/passes is on sys.path)

K = 5                                           # tiny_options: draft_tokens 6


@pytest.fixture(scope="module")
def specialized(tiny_program: Program) -> tuple[Program, PassRecord]:
    return SpecializeGreedy().run(tiny_program)


def test_record_and_general_graphs_untouched(tiny_program, specialized):
    after, record = specialized
    assert record.name == "specialize_greedy" and not record.changes_numerics and record.matches == 2
    assert record.details["added"] == {
        "step_greedy": {"greedy_sample": 1, "greedy_accept": 0, "relay_writes_dropped": 0},
        "nextn_greedy": {"greedy_sample": K, "greedy_accept": 1, "relay_writes_dropped": 1}}
    assert record.details["skipped"] == {}
    assert set(after.graphs) == set(tiny_program.graphs) | {"step_greedy", "nextn_greedy"}
    before = Program(tiny_program.config, dict(tiny_program.graphs), tiny_program.weights)
    kept = Program(after.config, {g: after.graphs[g] for g in tiny_program.graphs}, after.weights)
    assert program_text(kept) == program_text(before)
    assert not record.weights_added and not record.weights_changed


@pytest.mark.parametrize("source", ["step", "nextn"])
def test_op_counts(tiny_program, specialized, source):
    after, _ = specialized
    greedy = source + "_greedy"
    samples = 1 if source == "step" else K                 # step: 1; nextn: K - 1 draft forwards + extend
    for op in ("filtered_probs", "sample_tokens", "chain_accept"):
        assert count(after, greedy, op) == 0
    assert count(tiny_program, source, "filtered_probs") == samples + (source == "nextn")   # + verify's
    assert count(after, greedy, "greedy_sample") == count(tiny_program, source, "sample_tokens") == samples
    assert count(after, greedy, "greedy_accept") == count(tiny_program, source, "chain_accept")
    # uniforms: step and the draft / extend draws need none; verify keeps simulate_accept's
    assert count(after, greedy, "uniform") == (0 if source == "step" else 1)
    # the sampling-parameter gathers go (temperature / top_k / top_p and, in nextn, the d1 distribution)
    reads = {n.args[0].target for n in calls(after.graphs[greedy], "gather_rows")}
    assert not reads & {"relay_temperature", "relay_top_k", "relay_top_p", "relay_draft_first_probs"}
    # every relay / state write of the source is still made, but the d1 distribution's
    def writes(p: Program, g: str) -> list[str]:
        return sorted(n.args[0].target for n in p.graphs[g].nodes if n.target is OPS.scatter_rows)
    dropped = ["relay_draft_first_probs"] if source == "nextn" else []
    assert writes(after, greedy) == sorted(set(writes(tiny_program, source)) - set(dropped))
    assert count(after, greedy, "emit_tokens") == count(tiny_program, source, "emit_tokens") == 1
    assert count(after, greedy, "kda_commit") == count(tiny_program, source, "kda_commit")
    # at least every filtered_probs node goes (each is 7 kernels on the GPU), and the sample_tokens -> greedy_sample
    # swap is one node for one
    assert launches(tiny_program, source) - launches(after, greedy) >= count(tiny_program, source, "filtered_probs")


def test_verify_runs_each_copy_against_its_source(tiny_program, specialized):
    after, _ = specialized
    report = compare_stages(tiny_program, after, exact=True, tolerance=None, variants=SpecializeGreedy.variants)
    assert report["ok"], {g: r["problems"] for g, r in report["graphs"].items() if r["problems"]}
    assert {"step_greedy vs step", "nextn_greedy vs nextn"} <= set(report["graphs"])


def test_verify_catches_a_broken_copy(tiny_program, specialized):
    after, _ = specialized
    broken = after.copy()
    graph = broken.graphs["step_greedy"]
    sample = calls(graph, "greedy_sample")[0]
    with graph.inserting_after(sample):
        wrong = graph.call_function(torch.ops.aten.add.Tensor, (sample, 1))
    sample.replace_all_uses_with(wrong, delete_user_cb=lambda n: n is not wrong)
    report = compare_stages(tiny_program, broken, exact=True, tolerance=None, variants=SpecializeGreedy.variants)
    assert not report["ok"]
    problems = report["graphs"]["step_greedy vs step"]["problems"]
    assert any("relay_root" in p or "relay_out_tokens" in p for p in problems)


def test_partition_splits_the_copy(tiny_program):
    program = PassManager(["partition", "specialize_greedy"]).run(tiny_program).program   # ordered: specialize first
    stages = ("draft", "verify", "extend")
    assert {s + "_greedy" for s in stages} <= set(program.graphs) and "nextn_greedy" not in program.graphs
    relays = lambda names: {n.target: n.meta["lingc.tensor"] for g in names for n in program.inputs(g)   # noqa: E731
                            if n.target.startswith("relay_x_")}
    general, greedy = relays(stages), relays([s + "_greedy" for s in stages])
    assert set(greedy) < set(general)                      # the same buffers (shared by name), fewer of them
    assert all(greedy[k] == general[k] for k in greedy)
    dropped = [general[k] for k in set(general) - set(greedy)]
    assert dropped and all(m.dtype == torch.float32 and m.shape[-1] == program.config.vocab_size for m in dropped)
    for g in ("draft_greedy", "verify_greedy", "extend_greedy"):
        for node in program.inputs(g):
            if "lingc.relay" in node.meta:
                assert node.meta["lingc.relay"]["from"].endswith("_greedy")


def test_a_graph_with_another_reader_is_skipped(tiny_program):
    graph = _copy(tiny_program.graphs["step"])
    fp = calls(graph, "filtered_probs")[0]
    root = next(n for n in graph.nodes if n.op == "placeholder" and n.target == "relay_root")
    with graph.inserting_after(fp):
        view = graph.call_function(torch.ops.aten.view.default, (fp, [-1]))
    with graph.inserting_after(view):
        graph.call_function(OPS.scatter_rows, (root, fp.args[1], view))      # nonsense, but another reader
    _, reason = specialize(graph)
    assert reason is not None and reason.startswith(fp.name) and "view" in reason


def test_second_run_adds_nothing(specialized):
    after, _ = specialized
    again, record = SpecializeGreedy().run(after)
    assert record.matches == 0 and program_text(again) == program_text(after)
