"""fuse_moe_align: router_topk + moe_align of its ids -> router_align, bit for bit (techniques.md section 6).

Op counts per graph on the partitioned test-tiny program, the fused node's arguments, the getitems re-pointed
under their old names, bit-exact programs in fp32 and bf16, an op-level comparison including forced score
ties, the interplay with bf16_router and pdl, the artifact round trip, and the `lingc passes` listing.
"""

from __future__ import annotations

import operator
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from typer.testing import CliRunner

from lingc.artifact import load_artifact, write_artifact
from lingc.cli import app
from lingc.ir.text import program_text
from lingc.modules import MOE_BLOCK_M
from lingc.ops import OPS
from lingc.passes import PASSES
from lingc.passes.base import PassRecord, op_counts
from lingc.passes.bf16_router import Bf16Router
from lingc.passes.fuse_moe_align import FuseMoeAlign
from lingc.passes.manager import PassManager, resolve
from lingc.passes.matchers import is_free
from lingc.passes.pdl import Pdl
from lingc.passes.verify import compare_stages
from lingc.program import Program

SPLIT_GRAPHS = ("prefill", "decode", "mtp_prefill", "mtp_decode", "step", "draft", "verify", "extend")
ROUTERS = {"prefill": 5, "decode": 5, "mtp_prefill": 1, "mtp_decode": 1, "step": 5, "draft": 4, "verify": 5, "extend": 1}
NUM_EXPERTS = 16                                  # test-tiny


def op_count(program: Program, graph: str, op: str) -> int:
    return op_counts(program.graphs[graph]).get(f"lingc.{op}", 0)


@pytest.fixture(scope="module")
def fused(tiny_partitioned: Program) -> tuple[Program, PassRecord]:
    return FuseMoeAlign().run(tiny_partitioned)


# ---- op counts and structure -----------------------------------------------------------------------------

@pytest.mark.parametrize("graph", SPLIT_GRAPHS)
def test_op_counts(tiny_partitioned, fused, graph):
    after, _ = fused
    n = op_count(tiny_partitioned, graph, "router_topk")
    assert n == op_count(tiny_partitioned, graph, "moe_align") == ROUTERS[graph]
    assert op_count(after, graph, "router_topk") == op_count(after, graph, "moe_align") == 0
    assert op_count(after, graph, "router_align") == n


def test_record(fused):
    _, record = fused
    assert record.name == "fuse_moe_align" and not record.changes_numerics
    assert record.matches == sum(ROUTERS.values()) == 27
    # removed per match: router_topk, moe_align and the ids getitem only moe_align read
    assert len(record.nodes_removed) == 3 * 27 and len(record.nodes_added) == 27
    assert {"decode:L1_mlp_router_topk", "decode:L1_mlp_moe_align", "decode:L1_mlp_getitem_1"} <= set(record.nodes_removed)
    assert record.nodes_added[0].endswith("_router_align") and record.weights_added == record.weights_removed == []
    assert record.op_counts_after["decode"]["lingc.router_align"] == 5


@pytest.mark.parametrize("graph", ["decode", "verify", "draft"])
def test_fused_node_and_its_getitems(tiny_partitioned, fused, graph):
    after, _ = fused
    before = {n.name: n for n in tiny_partitioned.graphs[graph].nodes}
    aligns = [n for n in tiny_partitioned.graphs[graph].nodes if n.target is OPS.moe_align]
    fused_nodes = [n for n in after.graphs[graph].nodes if n.target is OPS.router_align]
    assert len(fused_nodes) == len(aligns)
    for node, align in zip(fused_nodes, aligns):
        ids = align.args[0]
        topk = ids.args[0]
        assert topk.target is OPS.router_topk and ids.args[1] == 1
        assert [str(a) for a in node.args] == [str(a) for a in (*topk.args, NUM_EXPERTS, MOE_BLOCK_M)]
        assert node.meta["lingc.scope"] == topk.meta["lingc.scope"]
        reads = {u.name: u.args[1] for u in node.users}
        want = {u.name: u.args[1] for u in topk.users if u is not ids}
        want |= {u.name: u.args[1] + 2 for u in align.users}                 # sorted_pairs, block_expert, total
        assert reads == want and all(before[name].target is operator.getitem for name in reads)
        metas = node.meta["lingc.tensor"]
        assert [m.dtype for m in metas] == [torch.float32] + [torch.int32] * 4
        assert metas[2:] == align.meta["lingc.tensor"] and metas[:2] == topk.meta["lingc.tensor"]


def test_readers_are_untouched(tiny_partitioned, fused):
    after, _ = fused
    for graph in SPLIT_GRAPHS:
        before = {n.name: n for n in tiny_partitioned.graphs[graph].nodes}
        for node in after.graphs[graph].nodes:
            if node.target not in (OPS.router_align, operator.getitem) and node.op != "output":
                assert [str(a) for a in node.args] == [str(a) for a in before[node.name].args], node.name


# ---- numerics --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_programs_are_bit_exact(request, tiny_partitioned, dtype):
    before = tiny_partitioned if dtype == "fp32" else request.getfixturevalue("tiny_program_bf16")
    after, record = FuseMoeAlign().run(before)
    assert record.matches == 27
    report = compare_stages(before, after, exact=True, tolerance=None)
    assert report["ok"], {g: r["problems"] for g, r in report["graphs"].items()}
    assert all(r["max_abs_delta"] == 0.0 for r in report["graphs"].values())


# (N tokens, E experts, groups, groups kept, k): test-tiny, a verify chain, the Flash layout at small N, odd N
ROUTINGS = [(1, 16, 4, 2, 4), (6, 16, 4, 2, 4), (6, 512, 8, 4, 8), (37, 64, 8, 4, 6)]


@pytest.mark.parametrize("routing", ROUTINGS, ids=lambda r: "N{}-E{}-g{}-kg{}-k{}".format(*r))
@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
def test_router_align_matches_router_topk_then_moe_align(routing, ties):
    N, E, n_group, topk_group, k = routing
    g = torch.Generator().manual_seed(N * 7 + E)
    logits = torch.randn(N, E, generator=g)
    if ties:                                      # coarse logits and a zero bias: many exactly equal scores
        logits = (logits * 2).round() / 2
    bias = torch.zeros(E) if ties else torch.randn(E, generator=g) * 0.1
    for block_m in (16, 64):
        weights, ids = OPS.router_topk(logits, bias, n_group, topk_group, k, 2.5)
        want = (weights, ids, *OPS.moe_align(ids, E, block_m))
        got = OPS.router_align(logits, bias, n_group, topk_group, k, 2.5, E, block_m)
        assert len(got) == 5
        for name, a, b in zip(("weights", "ids", "sorted_pairs", "block_expert", "total"), got, want):
            assert a.dtype == b.dtype and torch.equal(a, b), f"{name} differs (block_m {block_m})"


def test_router_align_fake_shapes():
    with FakeTensorMode():
        out = OPS.router_align(torch.empty(6, 512), torch.empty(512), 8, 4, 8, 2.5, 512, 16)
    NP = 6 * 8
    padded = NP + 512 * 15
    assert [tuple(t.shape) for t in out] == [(6, 8), (6, 8), (padded,), (-(-padded // 16),), (1,)]
    assert [t.dtype for t in out] == [torch.float32] + [torch.int32] * 4


# ---- other passes ----------------------------------------------------------------------------------------

def test_runs_after_bf16_router_and_bf16_router_still_finds_the_gate(tiny_partitioned):
    assert [p.name for p in resolve(["fuse_moe_align", "bf16_router"], PASSES)] == ["bf16_router", "fuse_moe_align"]
    fused_first, _ = FuseMoeAlign().run(tiny_partitioned)             # the other order, run by hand
    lowered, record = Bf16Router().run(fused_first)
    assert record.details["weights_lowered"] == Bf16Router().run(tiny_partitioned)[1].details["weights_lowered"]
    gates = [n for n in lowered.graphs["decode"].nodes if n.name.endswith("_mlp_gate_linear")]
    assert len(gates) == 5 and all(n.meta.get("lingc.dtype") == "bf16" for n in gates)


def test_pdl_chains_after_the_fusion(fused):
    """router: [add_]rmsnorm -> gate linear -> router_align; moe: moe_up -> silu_and_mul -> moe_down -> moe_combine."""
    after, _ = fused
    scheduled, record = Pdl().run(after)
    chains = {c["chain"]: c["nodes"] for c in record.details["chains"] if c["graph"] == "decode"}
    assert chains["router@L1"] == ["L1_post_attention_layernorm_rmsnorm", "L1_mlp_gate_linear", "L1_mlp_router_align"]
    assert chains["moe@L1"] == ["L1_mlp_moe_up", "L1_mlp_silu_and_mul", "L1_mlp_moe_down", "L1_mlp_moe_combine"]
    assert record.matches == 66                                          # as many chains as without the fusion
    order = {n.name: i for i, n in enumerate(scheduled.graphs["decode"].nodes)}
    nodes = list(scheduled.graphs["decode"].nodes)
    for members in chains.values():                                       # still adjacent
        span = nodes[order[members[0]]:order[members[-1]] + 1]
        assert all(is_free(n) or n.name in members for n in span), members


def test_pdl_router_chain_starts_at_add_rmsnorm(tiny_partitioned):
    result = PassManager(["fuse_add_norm", "fuse_moe_align", "pdl"]).run(tiny_partitioned)
    chains = {c["chain"]: c["nodes"] for c in result.records[-1].details["chains"] if c["graph"] == "verify"}
    assert chains["router@L2"] == ["L2_post_attention_layernorm_add_rmsnorm", "L2_mlp_gate_linear",
                                   "L2_mlp_router_align"]


# ---- artifact, CLI, hygiene ------------------------------------------------------------------------------

def test_artifact_round_trip(tiny_program, tmp_path):
    result = PassManager(["partition", "fuse_moe_align"]).run(tiny_program)
    loaded = load_artifact(write_artifact(result, tmp_path / "art")).program
    assert program_text(loaded) == program_text(result.program)
    assert op_count(loaded, "verify", "router_align") == 5
    report = compare_stages(result.program, loaded, exact=True, tolerance=None)
    assert report["ok"] and set(report["graphs"]) == set(SPLIT_GRAPHS), report


def test_listed_by_the_cli():
    result = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"}).invoke(app, ["passes"])
    assert result.exit_code == 0, result.output
    assert re.search(r"fuse_moe_align\s+│ router_topk \+ moe_align .* │ unchanged\s+│ partition, bf16_router",
                     result.output)


def test_input_program_is_not_edited(tiny_partitioned):
    text = program_text(tiny_partitioned)
    FuseMoeAlign().run(tiny_partitioned)
    assert program_text(tiny_partitioned) == text


def test_second_run_finds_nothing(fused):
    after, _ = fused
    again, record = FuseMoeAlign().run(after)
    assert record.matches == 0 and program_text(again) == program_text(after)
