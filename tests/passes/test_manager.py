"""PassManager: pass order from declared constraints, stages with provenance headers, lint and --verify gates.

Dummy passes defined here exercise what the real ones never do: a constraint cycle, a pass that pulls in
another, one that perturbs a weight while declaring numerics unchanged, one that leaves a dead node.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch

from lingc.ir.lint import LintError
from lingc.ir.text import program_text
from lingc.ops import OPS
from lingc.passes import PASSES
from lingc.passes.base import Pass
from lingc.passes.manager import PassManager, PassOrderError, VerifyError, resolve
from lingc.program import Program


def names(passes: list[type[Pass]]) -> list[str]:
    return [p.name for p in passes]


class _Noop(Pass):
    def apply(self, program: Program) -> dict[str, Any]:
        return {"matches": 0}


class CycleA(_Noop):
    name = "cycle_a"
    after = ("cycle_b",)


class CycleB(_Noop):
    name = "cycle_b"
    after = ("cycle_a",)


class NeedsSwiglu(_Noop):
    name = "needs_swiglu"
    requires = ("fuse_swiglu",)


class NeedsMissing(_Noop):
    name = "needs_missing"
    requires = ("no_such_pass",)


class PerturbNorm(Pass):
    """Broken on purpose: scales the final norm weight by 1.001 yet declares numerics unchanged."""

    name = "perturb_norm"
    changes_numerics = False

    def apply(self, program: Program) -> dict[str, Any]:
        program.weights["model.norm.weight"] = program.weights["model.norm.weight"] * 1.001   # copy on write
        return {"matches": 1}


class LeaveDeadNode(Pass):
    """Broken on purpose: adds a silu_and_mul that nobody reads to the decode graph."""

    name = "leave_dead"

    def apply(self, program: Program) -> dict[str, Any]:
        graph = program.graphs["decode"]
        up = next(n for n in graph.nodes if n.name == "L1_mlp_moe_up")
        with graph.inserting_after(up):
            graph.call_function(OPS.silu_and_mul, (up, 0.0))
        return {"matches": 1}


# ---- order -----------------------------------------------------------------------------------------------

ORDERS = [
    (["pdl", "fuse_swiglu"], ["fuse_swiglu", "pdl"]),
    (["fuse_swiglu", "pdl"], ["fuse_swiglu", "pdl"]),
    (["pdl", "bf16_router", "fuse_swiglu"], ["bf16_router", "fuse_swiglu", "pdl"]),   # ties keep the user's order
    (["pdl", "fuse_swiglu", "bf16_router"], ["fuse_swiglu", "bf16_router", "pdl"]),
    (["bf16_router", "fuse_swiglu"], ["bf16_router", "fuse_swiglu"]),
    ([" pdl ", "", "pdl"], ["pdl"]),                                               # blanks and repeats
    (["pdl", "partition"], ["partition", "pdl"]),
    (["fuse_swiglu", "pdl", "partition"], ["fuse_swiglu", "partition", "pdl"]),
]


@pytest.mark.parametrize("requested, expected", ORDERS, ids=[",".join(x.strip() or "_" for x in r) for r, _ in ORDERS])
def test_order_respects_after_regardless_of_user_order(requested, expected):
    assert names(resolve(requested, PASSES)) == expected


def test_all_expands_to_every_registered_pass():
    """Every pass but the opt-in ones (in_all = False: fuse_moe, draft_vocab, fuse_norm_router, fuse_router_into_moe,
    prefetch_weights, specialize_sampling), which run only when named."""
    order = names(resolve(["all"], PASSES))
    opt_in = {n for n, p in PASSES.items() if not p.in_all}
    assert opt_in == {"fuse_moe", "draft_vocab", "fuse_norm_router", "fuse_router_into_moe", "prefetch_weights",
                      "specialize_sampling"}
    assert set(order) == set(PASSES) - opt_in and len(order) == len(PASSES) - len(opt_in)
    with_opt_in = names(resolve(["all", "fuse_moe", "draft_vocab", "fuse_norm_router", "fuse_router_into_moe",
                                 "prefetch_weights", "specialize_sampling"], PASSES))
    # the L2 hints go around the scheduled launches: after pdl; the sampling copies before partition splits them
    assert set(with_opt_in) == set(PASSES) and with_opt_in[-2:] == ["pdl", "prefetch_weights"]
    assert with_opt_in.index("specialize_sampling") < with_opt_in.index("partition")
    assert {"partition", "fuse_swiglu", "bf16_router", "pdl"} <= set(PASSES)
    assert order[:2] == ["specialize_greedy", "partition"] and order[-1] == "pdl"   # copy, split, ..., schedule last
    for i, name in enumerate(order):                                # every declared constraint holds
        assert all(order.index(a) < i for a in (*PASSES[name].after, *PASSES[name].requires) if a in order), name
    assert names(resolve(["pdl", "all"], PASSES)) == order


def test_unknown_pass_lists_the_known_ones():
    known = ", ".join(sorted(PASSES))
    assert known.startswith("bf16_router, capture_metadata, ") and "partition, pdl" in known
    with pytest.raises(PassOrderError, match=re.escape(f"unknown pass(es) ['fuse_swigl']; known passes: {known}, all")):
        resolve(["pdl", "fuse_swigl"], PASSES)
    with pytest.raises(PassOrderError, match="unknown pass"):
        PassManager(["nope"])                                                # checked before any heavy work


def test_cycle_is_named():
    registry = {"cycle_a": CycleA, "cycle_b": CycleB, **PASSES}
    with pytest.raises(PassOrderError, match="constraints form a cycle: (cycle_a -> cycle_b|cycle_b -> cycle_a)"):
        resolve(["cycle_a", "cycle_b"], registry)
    assert names(resolve(["cycle_a"], registry)) == ["cycle_a"]               # an absent partner binds nothing


def test_requires_pulls_in_a_missing_pass():
    registry = {**PASSES, "needs_swiglu": NeedsSwiglu, "needs_missing": NeedsMissing}
    assert names(resolve(["needs_swiglu"], registry)) == ["fuse_swiglu", "needs_swiglu"]
    assert names(resolve(["needs_swiglu", "pdl"], registry)) == ["fuse_swiglu", "needs_swiglu", "pdl"]
    with pytest.raises(PassOrderError, match="pass 'needs_missing' requires 'no_such_pass', which is not a known pass"):
        resolve(["needs_missing"], registry)


# ---- stages and records ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compiled(tiny_program):
    return PassManager(["pdl", "fuse_swiglu"]).run(tiny_program)


def test_stages_have_provenance_headers(tiny_program, compiled):
    assert [(s.index, s.name) for s in compiled.stages] == [(0, "traced"), (1, "fuse_swiglu"), (2, "pdl")]
    assert compiled.stages[0].record is None
    assert compiled.stages[0].text == program_text(tiny_program, "# stage 00: traced")
    header = re.compile(r"# stage (\d\d): (\w+) \(v[0-9a-f]{12}, \d+\.\d ms, \+(\d+) -(\d+) ~(\d+) nodes, "
                        r"numerics (changed|unchanged)\)")
    for stage in compiled.stages[1:]:
        m = header.fullmatch(stage.text.splitlines()[0])
        assert m, stage.text.splitlines()[0]
        r = stage.record
        assert int(m[1]) == stage.index and m[2] == stage.name == r.name
        assert m.groups()[2:5] == tuple(str(len(x)) for x in (r.nodes_added, r.nodes_removed, r.nodes_rewritten))
        assert m[6] == "unchanged" and f"v{r.version}" in stage.text.splitlines()[0]
    # 27 moe_up -> moe_up_act (+27 -27, -27 silu_and_mul, ~27 moe_down) and each graph's 23 w13 reads swapped:
    # prefill, decode, step 5 each, mtp_prefill, mtp_decode 1 each, nextn 6 (layers 1-5 and the MTP layer)
    assert compiled.stages[1].text.splitlines()[0].endswith("+50 -77 ~27 nodes, numerics unchanged)")
    assert compiled.stages[-1].text == program_text(compiled.program, compiled.stages[-1].text.splitlines()[0])


def test_records_hold_op_counts(tiny_program, compiled):
    fuse, pdl = compiled.records
    before, after = fuse.op_counts_before["decode"], fuse.op_counts_after["decode"]
    assert before["lingc.moe_up"] == 5 and "lingc.moe_up_act" not in before
    assert after["lingc.moe_up_act"] == 5 and "lingc.moe_up" not in after
    assert after["lingc.silu_and_mul"] == before["lingc.silu_and_mul"] - 5
    assert pdl.op_counts_before == pdl.op_counts_after == fuse.op_counts_after
    assert set(fuse.op_counts_before) == set(tiny_program.graphs)
    json.dumps([r.to_json() for r in compiled.records])                       # records are plain data
    assert fuse.version == PASSES["fuse_swiglu"].version() and re.fullmatch(r"[0-9a-f]{12}", fuse.version)


def test_manager_never_edits_its_input(tiny_program):
    text, weights = program_text(tiny_program), dict(tiny_program.weights)
    result = PassManager(["all"]).run(tiny_program)
    assert program_text(tiny_program) == text and result.stages[0].text.endswith(text)
    assert tiny_program.weights.keys() == weights.keys()
    assert all(tiny_program.weights[k] is w and w.dtype == weights[k].dtype for k, w in tiny_program.weights.items())
    assert result.program is not tiny_program


# ---- gates -----------------------------------------------------------------------------------------------

def test_verify_passes_for_the_real_passes(tiny_program):
    result = PassManager(["all"], verify=True).run(tiny_program)
    assert [r.name for r in result.records] == names(resolve(["all"], PASSES))
    for r in result.records:
        assert r.verify["ok"] and r.verify["exact"] == (not r.changes_numerics), r.name
    greedy, partition = result.records[:2]                          # copies against sources, split against parts
    assert greedy.name == "specialize_greedy"
    assert {"step_greedy vs step", "nextn_greedy vs nextn"} <= set(greedy.verify["graphs"])
    assert partition.name == "partition" and "draft+verify+extend" in partition.verify["graphs"]
    assert "draft_greedy+verify_greedy+extend_greedy" in partition.verify["graphs"]
    for r in (greedy, partition):
        assert all(g["max_abs_delta"] == 0.0 for g in r.verify["graphs"].values())
    assert set(result.program.graphs) == {"prefill", "decode", "mtp_prefill", "mtp_decode", "step", "step_greedy",
                                          "draft", "verify", "extend", "draft_greedy", "verify_greedy", "extend_greedy"}


def test_verify_catches_a_pass_that_changes_numerics_undeclared(tiny_program):
    norm = tiny_program.weights["model.norm.weight"].clone()
    manager = PassManager(["perturb_norm"], registry={"perturb_norm": PerturbNorm}, verify=True)
    with pytest.raises(VerifyError, match=r"--verify failed after pass 'perturb_norm': .*'decode': "
                                          r"\['output\[0\]: not bit-identical"):
        manager.run(tiny_program)
    assert torch.equal(tiny_program.weights["model.norm.weight"], norm)        # the shared weight is untouched
    result = PassManager(["perturb_norm"], registry={"perturb_norm": PerturbNorm}).run(tiny_program)
    assert result.records[0].weights_changed == ["model.norm.weight"]           # without --verify it goes through


def test_lint_after_each_pass_names_the_pass(tiny_program):
    manager = PassManager(["leave_dead"], registry={"leave_dead": LeaveDeadNode})
    with pytest.raises(LintError, match=r"after pass 'leave_dead': graph 'decode', node '\w+': result unused and "
                                        r"the op has no side effects \(dead code\)"):
        manager.run(tiny_program)


def test_the_input_is_linted_too(tiny_program):
    broken = tiny_program.copy()
    del broken.inputs("nextn")[0].meta["lingc.input"]
    with pytest.raises(LintError, match="graph 'nextn', node 'slots': input has no 'lingc.input' role"):
        PassManager(["pdl"]).run(broken)
