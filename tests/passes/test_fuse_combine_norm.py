"""fuse_combine_norm: moe_combine (no shared_out) + the add_rmsnorm reading it -> one combine_add_rmsnorm.

On test-tiny after partition, fuse_add_norm, fuse_swiglu, fuse_moe_align and fuse_shared_expert (without
fuse_norm_linear, which would fold test-tiny's small input norms into the projections first): op counts, the fused
node's arguments and name, combines that stay (shared_out, other readers), the reference backend bit-exact, greedy
NEXTN == plain decoding, pass order, idempotence, and the tp pass splitting it back (unfuse) before sharding."""

from __future__ import annotations

import pytest
import torch

from lingc.ops import OPS
from lingc.passes import PASSES
from lingc.passes.fuse_combine_norm import FuseCombineNorm
from lingc.passes.manager import CompileResult, PassManager, resolve
from lingc.passes.tp import run_tp_stage
from lingc.program import Program
from pass_support import (  # tests/passes is on sys.path
    assert_greedy_nextn_equals_plain, assert_reference_exact, count, only)

BEFORE = ["fuse_add_norm", "fuse_swiglu", "fuse_moe_align", "fuse_shared_expert"]
NUMERICS_GRAPHS = ("decode", "verify", "draft")


def _fusable(program: Program, graph: str) -> int:
    """moe_combine nodes without shared_out whose only reader (maybe through one view) is an add_rmsnorm."""
    n = 0
    for node in program.graphs[graph].nodes:
        if node.target is not OPS.moe_combine or (len(node.args) > 2 and node.args[2] is not None):
            continue
        users = list(node.users)
        if len(users) == 1 and users[0].target is torch.ops.aten.view.default:
            users = list(users[0].users)
        n += len(users) == 1 and users[0].target is OPS.add_rmsnorm
    return n


@pytest.fixture(scope="module")
def fused(tiny_partitioned: Program) -> tuple[Program, Program, object]:
    before = PassManager(BEFORE).run(tiny_partitioned).program
    return (before, *FuseCombineNorm().run(before))


@pytest.mark.parametrize("graph", ["decode", "step", "verify", "draft", "prefill"])
def test_op_counts(fused, graph):
    before, after, _ = fused
    n = _fusable(before, graph)
    assert n >= 1 if graph in ("decode", "step", "verify", "prefill") else True
    assert count(after, graph, "combine_add_rmsnorm") == n
    assert count(after, graph, "moe_combine") == count(before, graph, "moe_combine") - n
    assert count(after, graph, "add_rmsnorm") == count(before, graph, "add_rmsnorm") - n


def test_record_and_node(fused):
    before, after, record = fused
    assert record.name == "fuse_combine_norm" and not record.changes_numerics
    assert record.matches == sum(_fusable(before, g) for g in before.graphs)
    name = record.details["fused"][0].split(":", 1)[1]
    graph = record.details["fused"][0].split(":", 1)[0]
    node = {n.name: n for n in after.graphs[graph].nodes}[name]
    assert node.target is OPS.combine_add_rmsnorm and "combine_add_rmsnorm" in name
    residual, expert_out, weights, norm_weight, eps = node.args
    assert expert_out.target is OPS.moe_down and norm_weight.op == "get_attr" and eps == 1e-6
    assert {u.args[1] for u in node.users} <= {0, 1}                    # the norm's getitems, same order


def test_reference_backend_is_bit_exact(fused):
    before, after, _ = fused
    assert_reference_exact(before, after, NUMERICS_GRAPHS)


def test_greedy_nextn_equals_plain(fused):
    _, after, _ = fused
    assert_greedy_nextn_equals_plain(after)


def test_order_idempotence_and_input_untouched(fused):
    before, after, _ = fused
    order = [p.name for p in resolve(["all"], PASSES)]
    for earlier in FuseCombineNorm.after:
        if earlier in order:
            assert order.index(earlier) < order.index("fuse_combine_norm")
    assert order.index("fuse_combine_norm") < order.index("pdl")
    again, record = FuseCombineNorm().run(after)
    assert record.matches == 0
    assert count(before, "decode", "combine_add_rmsnorm") == 0


def test_tp_splits_it_back(fused):
    _, after, _ = fused
    result = CompileResult(only(after, ("decode",)))
    run_tp_stage(result, 2)
    program = result.program
    assert count(program, "decode", "combine_add_rmsnorm") == 0 and count(program, "decode", "moe_combine") == 0
    assert count(program, "decode", "ep_combine") == count(after, "decode", "combine_add_rmsnorm") + \
        count(after, "decode", "moe_combine")
