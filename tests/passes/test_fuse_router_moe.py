"""fuse_router_moe: at one token the MoE up/down GEMMs route for themselves and router_align goes (kernels/
moe_routed.py). Op counts per graph (one-token graphs fuse, multi-token graphs keep router_align), the rewritten
nodes' arguments and names, bit-exact reference programs, the pdl annotation of the routed down-GEMM, and `all`. The Triton kernels on a
one-token graph: tests/kernels/test_moe_routed.py."""

from __future__ import annotations

import operator

import pytest
import torch

from lingc.ops import OPS
from lingc.passes.base import op_counts
from lingc.passes.fuse_router_moe import FuseRouterMoe
from lingc.passes.manager import PassManager, resolve
from lingc.passes import PASSES
from lingc.passes.verify import compare_stages
from lingc.program import Program

BEFORE = ["partition", "fuse_swiglu", "fuse_moe_align", "fuse_shared_expert"]
ONE_TOKEN = ("decode", "mtp_decode", "step", "draft")          # test-tiny's one-token graphs (batch 1)
MANY_TOKENS = ("prefill", "mtp_prefill", "verify")


def count(program: Program, graph: str, op: str) -> int:
    return op_counts(program.graphs[graph]).get(f"lingc.{op}", 0)


@pytest.fixture(scope="module")
def before(tiny_program: Program) -> Program:
    return PassManager(BEFORE).run(tiny_program).program


@pytest.fixture(scope="module")
def fused(before: Program):
    return FuseRouterMoe().run(before)


@pytest.mark.parametrize("graph", ONE_TOKEN)
def test_one_token_graphs_lose_router_align(before, fused, graph):
    after, _ = fused
    routers = count(before, graph, "router_align")
    assert routers > 0
    assert count(after, graph, "router_align") == 0
    assert count(after, graph, "moe_up_act_routed") == count(after, graph, "moe_down_routed") == routers
    assert count(after, graph, "moe_up_act") == count(after, graph, "moe_down") == 0


@pytest.mark.parametrize("graph", MANY_TOKENS)
def test_multi_token_graphs_keep_router_align(before, fused, graph):
    after, _ = fused
    assert count(after, graph, "router_align") == count(before, graph, "router_align") > 0
    assert count(after, graph, "moe_up_act_routed") == 0


def test_record_and_arguments(before, fused):
    after, record = fused
    assert record.matches == sum(count(before, g, "router_align") for g in ONE_TOKEN
                                 ) + sum(count(before, g, "router_align") for g in after.graphs
                                         if g not in ONE_TOKEN + MANY_TOKENS and count(after, g, "router_align") == 0)
    assert not record.changes_numerics
    graph = after.graphs["decode"]
    up = next(n for n in graph.nodes if n.target is OPS.moe_up_act_routed)
    down = next(n for n in graph.nodes if n.target is OPS.moe_down_routed)
    assert down.args[0].target is operator.getitem and down.args[0].args == (up, 0)
    assert down.args[2:] == up.args[2:11]                      # the same logits, bias and routing constants
    assert up.args[10] == 1                                    # the fused shared expert rides along
    weights = [u for u in up.users if u.args[1] == 1]
    assert weights and all(w.users for w in weights)           # the combine reads the routed weights
    assert up.name.endswith("_routed") and "moe_down_routed" in down.name
    order = {n: i for i, n in enumerate(graph.nodes)}
    assert all(order[u] > order[up] for u in up.users)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_reference_programs_are_bit_exact(request, before, dtype):
    prog = before if dtype == "fp32" else PassManager(BEFORE).run(request.getfixturevalue("tiny_program_bf16")).program
    after, _ = FuseRouterMoe().run(prog)
    report = compare_stages(prog, after, exact=True, tolerance=None)
    assert report["ok"], {g: r["problems"] for g, r in report["graphs"].items()}
    assert all(r["max_abs_delta"] == 0.0 for r in report["graphs"].values())


def test_pdl_launches_the_routed_down_gemm_after_the_up_gemm(before, fused):
    """Its logits come two launches back (router GEMV -> up -> down), so it keeps PDL; in `all` too."""
    program = PassManager(BEFORE + ["fuse_router_moe", "pdl"]).run(before).program
    downs = [n for n in program.graphs["decode"].nodes if n.target is OPS.moe_down_routed]
    assert downs and all("lingc.pdl" in n.meta for n in downs)
    assert "fuse_router_moe" in [cls.name for cls in resolve(["all"], PASSES)]


def test_second_run_finds_nothing(fused):
    after, _ = fused
    assert FuseRouterMoe().run(after)[1].matches == 0
