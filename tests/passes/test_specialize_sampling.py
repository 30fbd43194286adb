"""specialize_sampling (opt-in): copies of the step graphs for sampled requests with top-k off (step_nucleus,
nextn_nucleus: filters = 2) and with top-k and top-p off (step_plain, nextn_plain: filters = 0).

The record, the filters set on every filtered_probs of a copy and nothing else changed, the general graphs left as
they were, --verify's variant check (each copy against its source with the request's filters off: every output,
relay and state bit for bit) and that it catches a copy whose mask drops a filter the request uses, partition's
split of the copies, the pass out of `all`, and a second run that adds nothing. The engine's choice and token
parity: tests/runtime/test_sampling_graphs.py; the kernel's skipped rounds: tests/kernels/test_filtered_probs.py.
"""

from __future__ import annotations

import pytest

from lingc.ir.text import program_text
from lingc.passes.base import PassRecord
from lingc.passes import PASSES
from lingc.passes.manager import PassManager, resolve
from lingc.passes.matchers import calls
from lingc.passes.specialize_sampling import SpecializeSampling
from lingc.passes.verify import compare_stages
from lingc.program import Program
from pass_support import launches  # noqa: E402  (tests/passes is on sys.path)

COPIES = {"step_plain": 0, "nextn_plain": 0, "step_nucleus": 2, "nextn_nucleus": 2}


@pytest.fixture(scope="module")
def specialized(tiny_program: Program) -> tuple[Program, PassRecord]:
    return SpecializeSampling().run(tiny_program)


def test_record_and_general_graphs_untouched(tiny_program, specialized):
    after, record = specialized
    assert record.name == "specialize_sampling" and not record.changes_numerics and record.matches == 4
    n_step, n_nextn = (len(calls(tiny_program.graphs[g], "filtered_probs")) for g in ("step", "nextn"))
    assert record.details["added"] == {"step_plain": n_step, "step_nucleus": n_step, "nextn_plain": n_nextn,
                                       "nextn_nucleus": n_nextn}
    assert set(after.graphs) == set(tiny_program.graphs) | set(COPIES)
    before = Program(tiny_program.config, dict(tiny_program.graphs), tiny_program.weights)
    kept = Program(after.config, {g: after.graphs[g] for g in tiny_program.graphs}, after.weights)
    assert program_text(kept) == program_text(before)


@pytest.mark.parametrize("copy,filters", COPIES.items())
def test_each_copy_only_masks_its_filters(tiny_program, specialized, copy, filters):
    after, _ = specialized
    source = copy.split("_")[0]
    nodes = calls(after.graphs[copy], "filtered_probs")
    assert nodes and all(n.args[4:] == (filters,) for n in nodes)
    assert all(len(n.args) == 4 for n in calls(tiny_program.graphs[source], "filtered_probs"))
    assert launches(after, copy) == launches(tiny_program, source)     # the same launches, fewer kernel rounds
    unmasked = after.copy()
    for node in calls(unmasked.graphs[copy], "filtered_probs"):
        node.args = node.args[:4]
    assert program_text(Program(after.config, {source: unmasked.graphs[copy]}, after.weights)) == \
        program_text(Program(after.config, {source: tiny_program.graphs[source]}, after.weights))


def test_verify_runs_each_copy_against_its_source(tiny_program, specialized):
    after, _ = specialized
    report = compare_stages(tiny_program, after, exact=True, tolerance=None, variants=SpecializeSampling.variants)
    assert report["ok"], {g: r["problems"] for g, r in report["graphs"].items() if r["problems"]}
    assert {f"{c} vs {c.split('_')[0]}" for c in COPIES} <= set(report["graphs"])


def test_verify_catches_a_mask_that_drops_a_used_filter(tiny_program, specialized):
    """The nucleus copy's request keeps top-p on: masking top-p off too changes its distributions."""
    after, _ = specialized
    broken = after.copy()
    for node in calls(broken.graphs["step_nucleus"], "filtered_probs"):
        node.args = node.args[:4] + (0,)
    report = compare_stages(tiny_program, broken, exact=True, tolerance=None, variants=SpecializeSampling.variants)
    assert not report["ok"] and report["graphs"]["step_nucleus vs step"]["problems"]


def test_partition_splits_the_copies(tiny_program):
    program = PassManager(["partition", "specialize_sampling"]).run(tiny_program).program   # ordered: copies first
    for suffix in ("_plain", "_nucleus"):
        assert {s + suffix for s in ("draft", "verify", "extend")} <= set(program.graphs)
        assert "nextn" + suffix not in program.graphs


def test_opt_in_and_idempotent(tiny_program, specialized):
    assert SpecializeSampling not in resolve(["all"], PASSES)
    assert SpecializeSampling in resolve(["all", "specialize_sampling"], PASSES)
    after, _ = specialized
    _, again = SpecializeSampling().run(after)
    assert again.matches == 0 and again.details["added"] == {}
