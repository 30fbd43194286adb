"""fuse_norm_router: add_rmsnorm_linear (gate) + router_align / router_topk -> one add_rmsnorm_router.

On test-tiny after partition and every pass of `all` (the pass is opt-in): op and launch counts, the fused node's
arguments (router_align form in decode, router_topk form in verify), the getitems re-pointed, prefill untouched
(more rows than the kernel's MAX_ROWS), the reference backend bit-exact, greedy NEXTN == plain decoding, pdl keeping
the up-GEMM PDL-launched with shared_last dropped, `unfuse` restoring the unfused graph, and the tp pass splitting it
back before its expert-parallel rewrite."""

from __future__ import annotations

import operator

import pytest
import torch

from lingc.ops import OPS
from lingc.passes.fuse_norm_router import FuseNormRouter, unfuse
from lingc.passes.manager import CompileResult, PassManager
from lingc.passes.matchers import calls
from lingc.passes.tp import run_tp_stage
from lingc.passes.verify import compare_stages
from lingc.program import Program
from pass_support import (  # tests/passes is on sys.path
    assert_greedy_nextn_equals_plain, assert_reference_exact, count, launches, only)

NUMERICS_GRAPHS = ("decode", "verify", "draft")


@pytest.fixture(scope="module")
def programs(tiny_partitioned: Program) -> tuple[Program, Program, object]:
    before = PassManager(["all"]).run(tiny_partitioned).program
    result = PassManager(["all", "fuse_norm_router"]).run(tiny_partitioned)
    record = next(r for r in result.records if r.name == "fuse_norm_router")
    return before, result.program, record


def _routers(program: Program, graph: str) -> int:
    return count(program, graph, "router_align") + count(program, graph, "router_topk")


@pytest.mark.parametrize("graph", ["decode", "step", "verify", "draft", "prefill"])
def test_op_and_launch_counts(programs, graph):
    before, after, _ = programs
    n = count(after, graph, "add_rmsnorm_router")
    if graph == "prefill":      # 32-token chunks: more rows than kernels/norm_router.py MAX_ROWS
        assert n == 0 and launches(after, graph) == launches(before, graph)
        return
    assert n >= 1 and n == _routers(before, graph) and _routers(after, graph) == 0
    assert count(after, graph, "add_rmsnorm_linear") == count(before, graph, "add_rmsnorm_linear") - n
    assert launches(after, graph) == launches(before, graph) - n


def test_opt_in_and_record(programs):
    _, _, record = programs
    assert not FuseNormRouter.in_all and record.changes_numerics
    assert record.matches == len(record.details["fused"]) > 0


@pytest.mark.parametrize("graph, block_m", [("decode", 16), ("verify", 0)])
def test_fused_node(programs, graph, block_m):
    _, after, _ = programs
    node = calls(after.graphs[graph], "add_rmsnorm_router")[0]
    residual, x, norm_weight, eps, gate_weight, bias, n_group, topk_group, top_k, scale, experts, bm, shared = node.args
    assert "add_rmsnorm_router" in node.name and bm == block_m and (experts > 0) == (block_m > 0)
    assert norm_weight.target.endswith("post_attention_layernorm.weight") and gate_weight.target.endswith("gate.weight")
    assert bias.target.endswith("expert_bias") and eps == 1e-6 and shared == 1
    indices = sorted({u.args[1] for u in node.users if u.target is operator.getitem})
    assert indices[:3] == [0, 1, 2] and max(indices) <= (6 if block_m else 3)
    up = next(u for u in after.graphs[graph].nodes if u.op == "call_function"
              and u.target in (OPS.moe_up_act, OPS.moe_up_act_pairs))
    assert "shared_last" not in up.meta.get("lingc.launch", {})          # x is now written by the launch before
    assert "lingc.pdl" in up.meta                                         # ... and the up-GEMM stays PDL-launched


def test_reference_backend_is_bit_exact(programs):
    before, after, _ = programs
    assert_reference_exact(before, after, NUMERICS_GRAPHS)


def test_greedy_nextn_equals_plain(programs):
    _, after, _ = programs
    assert_greedy_nextn_equals_plain(after)


def test_unfuse_restores_the_graph(programs):
    before, after, _ = programs
    restored = only(after, ("decode", "verify")).copy()
    for graph in restored.graphs.values():
        for node in calls(graph, "add_rmsnorm_router"):
            unfuse(graph, node)
        graph.lint()
    for g in ("decode", "verify"):
        for op in ("add_rmsnorm_linear", "router_align", "router_topk", "add_rmsnorm_router"):
            assert count(restored, g, op) == count(before, g, op), (g, op)
    report = compare_stages(only(before, ("decode", "verify")), restored, exact=True, tolerance=None)
    assert report["ok"], {g: r["problems"] for g, r in report["graphs"].items()}


def test_tp_splits_it_back(programs):
    _, after, _ = programs
    result = CompileResult(only(after, ("decode",)))
    run_tp_stage(result, 2)
    program = result.program
    assert count(program, "decode", "add_rmsnorm_router") == 0
    assert count(program, "decode", "router_topk") == count(after, "decode", "add_rmsnorm_router")


def test_fuses_nothing_without_a_gate_norm(tiny_partitioned):
    """Before fuse_norm_linear the gate is a plain linear: nothing matches, the program is unchanged."""
    program, record = FuseNormRouter().run(only(tiny_partitioned, ("decode",)))
    assert record.matches == 0 and count(program, "decode", "add_rmsnorm_router") == 0
    assert torch.equal(torch.tensor(launches(program, "decode")), torch.tensor(launches(tiny_partitioned, "decode")))
