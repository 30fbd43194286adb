"""fuse_swiglu: moe_up + silu_and_mul -> moe_up_act on gate/up-interleaved w13, bit for bit (techniques.md section 7).

Op counts before/after per graph, the weight rename and its typed layout, the interleave itself, the
clamp limit carried over, bit-exact programs in fp32 and bf16, and an op-level bit comparison over a
wide input range (tolerance tests miss a double rounding; only comparing the bits catches it).
"""

from __future__ import annotations

import pytest
import torch

from lingc.ir.text import program_text
from lingc.ops import OPS
from lingc.passes.base import PassRecord, op_counts
from lingc.passes.fuse_swiglu import LAYOUT, FuseSwiglu, interleave_w13
from lingc.passes.matchers import producer
from lingc.passes.verify import compare_stages
from lingc.program import Program
from lingc.trace import PROGRAMS

MOE_LAYERS = (1, 2, 3, 4, 5, 6)                 # test-tiny: layer 0 is dense, 6 is the MTP layer
ROUTED_PER_GRAPH = {"prefill": 5, "decode": 5, "mtp_prefill": 1, "mtp_decode": 1, "step": 5,
                    "nextn": 4 + 5 + 1}                       # nextn: 4 draft MTP forwards, verify, extend
EXPERT_LIMIT = {1: 0.0, 2: 0.0, 3: 0.0, 4: 0.1, 5: 0.1, 6: 0.1}                       # expert_swiglu_limit_list


def op_count(program: Program, graph: str, op: str) -> int:
    return op_counts(program.graphs[graph]).get(f"lingc.{op}", 0)


def layer_of(node) -> int:
    return int(node.meta["lingc.scope"].split(".")[2])        # model.layers.<i>.mlp


@pytest.fixture(scope="module")
def fused(tiny_program: Program) -> tuple[Program, PassRecord]:
    return FuseSwiglu().run(tiny_program)


# ---- op counts and structure -----------------------------------------------------------------------------

@pytest.mark.parametrize("graph", PROGRAMS)
def test_op_counts(tiny_program, fused, graph):
    after, _ = fused
    n = op_count(tiny_program, graph, "moe_up")
    assert n == ROUTED_PER_GRAPH[graph]
    routed_acts = [a for a in tiny_program.graphs[graph].nodes
                   if a.target is OPS.silu_and_mul and producer(a.args[0]).target is OPS.moe_up]
    assert len(routed_acts) == n
    silu_before = op_count(tiny_program, graph, "silu_and_mul")

    assert op_count(after, graph, "moe_up") == 0
    assert op_count(after, graph, "moe_up_act") == n
    assert op_count(after, graph, "silu_and_mul") == silu_before - n
    remaining = [a for a in after.graphs[graph].nodes if a.target is OPS.silu_and_mul]
    assert all(producer(a.args[0]).target is OPS.linear for a in remaining)   # shared experts and the dense MLP
    assert all("shared_experts" in a.name or a.name.startswith("L0_mlp") for a in remaining)


def test_record(tiny_program, fused):
    after, record = fused
    assert record.name == "fuse_swiglu" and not record.changes_numerics
    assert record.matches == sum(ROUTED_PER_GRAPH.values()) == 27
    assert "decode:L1_mlp_moe_up_act" in record.nodes_added and "decode:L1_mlp_moe_up" in record.nodes_removed
    assert "decode:L1_mlp_silu_and_mul" in record.nodes_removed
    assert record.op_counts_before["decode"]["lingc.moe_up"] == 5
    assert record.op_counts_after["decode"]["lingc.moe_up_act"] == 5
    assert record.details["fused"][:2] == ["prefill:L1_mlp_moe_up_act", "prefill:L2_mlp_moe_up_act"]


def test_fused_node_reads_the_same_inputs(tiny_program, fused):
    after, _ = fused
    before_nodes = {n.name: n for n in tiny_program.graphs["decode"].nodes}
    for node in after.graphs["decode"].nodes:
        if node.target is not OPS.moe_up_act:
            continue
        up = before_nodes[node.name.replace("moe_up_act", "moe_up")]
        assert node.meta["lingc.layout"] == LAYOUT and node.meta["lingc.scope"] == up.meta["lingc.scope"]
        assert [a.name for a in node.args[2:5]] == [a.name for a in up.args[2:5]]   # sorted_pairs, block_expert, total
        assert node.args[0].name == up.args[0].name and node.args[5:7] == up.args[5:7]   # x, top_k, block_m
        assert node.args[1].target == up.args[1].target + "_interleaved"
        assert node.meta["lingc.tensor"].shape == (4, 64)                               # [NP, I]


def test_clamp_limit_is_carried_over(tiny_program, fused):
    after, _ = fused
    for graph in PROGRAMS:
        limits_before = {layer_of(a): a.args[1] for a in tiny_program.graphs[graph].nodes
                         if a.target is OPS.silu_and_mul and producer(a.args[0]).target is OPS.moe_up}
        limits_after = {layer_of(n): n.args[7] for n in after.graphs[graph].nodes if n.target is OPS.moe_up_act}
        assert limits_after == limits_before
        assert all(limits_after[i] == EXPERT_LIMIT[i] for i in limits_after)
    assert {layer_of(n): n.args[7] for n in after.graphs["mtp_decode"].nodes if n.target is OPS.moe_up_act} == {6: 0.1}


# ---- weights ---------------------------------------------------------------------------------------------

def test_w13_renamed_with_typed_layout(tiny_program, fused):
    after, record = fused
    added, removed = [], []
    for i in MOE_LAYERS:
        old, new = f"model.layers.{i}.mlp.experts.w13", f"model.layers.{i}.mlp.experts.w13_interleaved"
        assert old in tiny_program.weights and old not in after.weights and old not in after.weight_info
        assert after.weights[new].shape == tiny_program.weights[old].shape
        assert after.weight_info[new] == {"layout": "gu_interleaved"}
        w2 = f"model.layers.{i}.mlp.experts.w2"
        assert after.weights[w2] is tiny_program.weights[w2]                           # untouched, shared
        added.append(new)
        removed.append(old)
    assert record.weights_added == sorted(added) and record.weights_removed == sorted(removed)
    assert record.weights_changed == []
    assert not any(n.op == "get_attr" and n.target.endswith(".w13") for g in after.graphs.values() for n in g.nodes)


def test_interleave_rows(tiny_program, fused):
    """Row 2j of each expert is gate row j, row 2j + 1 is up row j."""
    after, _ = fused
    inter = tiny_program.config.moe_intermediate_size
    for i in MOE_LAYERS:
        old = tiny_program.weights[f"model.layers.{i}.mlp.experts.w13"]             # [E, 2I, h]: gate | up
        new = after.weights[f"model.layers.{i}.mlp.experts.w13_interleaved"]
        assert torch.equal(new[:, 0::2], old[:, :inter]) and torch.equal(new[:, 1::2], old[:, inter:])
    small = torch.arange(2 * 6 * 3).view(2, 6, 3)                                   # E 2, I 3, h 3
    got = interleave_w13(small)
    assert [int(r[0]) // 3 for r in got[1]] == [6, 9, 7, 10, 8, 11]                  # rows g0 u0 g1 u1 g2 u2


# ---- numerics --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_programs_are_bit_exact(request, dtype):
    before = request.getfixturevalue("tiny_program" if dtype == "fp32" else "tiny_program_bf16")
    after, record = FuseSwiglu().run(before)
    assert record.matches == 27
    report = compare_stages(before, after, exact=True, tolerance=None)
    assert report["ok"], {g: r["problems"] for g, r in report["graphs"].items()}
    assert set(report["graphs"]) == set(PROGRAMS)
    assert all(r["max_abs_delta"] == 0.0 for r in report["graphs"].values())


def test_input_program_is_not_edited(tiny_program):
    text, weights = program_text(tiny_program), dict(tiny_program.weights)
    FuseSwiglu().run(tiny_program)
    assert program_text(tiny_program) == text
    assert tiny_program.weights.keys() == weights.keys()
    assert all(tiny_program.weights[k] is v for k, v in weights.items())


def test_second_run_finds_nothing(fused):
    after, _ = fused
    again, record = FuseSwiglu().run(after)
    assert record.matches == 0 and program_text(again) == program_text(after)


# ---- op-level bit parity ---------------------------------------------------------------------------------

# (N tokens, h, E experts, I, k): the model's shape, plus odd h and small I. I stays even: on CPU, MKL's fp32
# GEMM accumulates a 2-column N tail (N = 2I = 2 mod 4) differently from full tiles, so with odd I even a
# plain column permutation changes bits there; the GPU kernel has no such tail.
SHAPES = [(1, 128, 16, 64, 4), (6, 128, 16, 64, 4), (37, 33, 8, 12, 3), (5, 96, 6, 40, 2)]
SCALES = [1e-3, 1e-1, 1.0, 1e1, 1e2]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "N{}-h{}-E{}-I{}-k{}".format(*s))
@pytest.mark.parametrize("limit", [0.0, 0.1, 7.0], ids=lambda v: f"limit{v}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_up_act_matches_moe_up_then_silu_and_mul_bitwise(dtype, limit, shape):
    N, h, E, inter, k = shape
    g = torch.Generator().manual_seed(N * 1000 + h)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)]).to(torch.int32)   # [N, k]
    sorted_pairs, block_expert, total = OPS.moe_align(ids, E, 16)
    w13 = (torch.randn(E, 2 * inter, h, generator=g) * 0.05).to(DTYPES[dtype])
    w13_interleaved = interleave_w13(w13)
    for scale in SCALES:
        x = (torch.randn(N, h, generator=g) * scale).to(DTYPES[dtype])
        want = OPS.silu_and_mul(OPS.moe_up(x, w13, sorted_pairs, block_expert, total, k, 16), limit)
        got = OPS.moe_up_act(x, w13_interleaved, sorted_pairs, block_expert, total, k, 16, limit)
        assert got.shape == want.shape == (N * k, inter) and got.dtype == want.dtype
        differ = int((bits(got) != bits(want)).sum())
        assert differ == 0, f"scale {scale}: {differ} of {want.numel()} values differ in their bits"


def test_nextn_stage_is_kept(tiny_partitioned):
    """After partition every moe_up carries its NEXTN stage (draft / verify / extend); moe_up_act keeps it (until
    2026-12-01 it dropped it, and stage-matching passes had to skip the fused node)."""
    after, _ = FuseSwiglu().run(tiny_partitioned)
    for gname in ("draft", "verify", "extend"):
        ups = [n for n in tiny_partitioned.graphs[gname].nodes if n.target is OPS.moe_up]
        acts = [n for n in after.graphs[gname].nodes if n.target is OPS.moe_up_act]
        assert len(acts) == len(ups) > 0
        assert [a.meta.get("lingc.stage") for a in acts] == [u.meta.get("lingc.stage") for u in ups]
        assert all(a.meta.get("lingc.stage") == gname for a in acts)
