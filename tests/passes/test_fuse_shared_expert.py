"""fuse_shared_expert: each MoE layer's shared expert becomes routed expert E (weight 1.0); -3 launches per layer.

On the partitioned test-tiny program layers 1 and 2 fuse and layers 3-6 keep their shared expert (test-tiny's
shared and routed SwiGLU clamps differ there). Both router forms (router_topk + moe_align with plain w13, and
router_align with interleaved w13) are rewritten and checked: op counts per graph, the new weights' rows and
the old ones dropped, skip reasons, fp32 numerics against the unfused program (test-tiny: bit-exact), the
artifact round trip, idempotence, pass ordering, and the tp pass on fused layers (lockstep TP2 == TP1).
"""

from __future__ import annotations

import pytest
import torch

from lingc.artifact import load_artifact, write_artifact
from lingc.ir.text import program_text
from lingc.ops import OPS
from lingc.passes import PASSES
from lingc.passes.base import PassRecord
from lingc.passes.fuse_moe_align import FuseMoeAlign
from lingc.passes.fuse_shared_expert import FuseSharedExpert
from lingc.passes.fuse_swiglu import interleave_w13
from lingc.passes.manager import CompileResult, PassManager, resolve
from lingc.passes.tp import TensorParallel, rank_programs, verify_tp
from lingc.passes.verify import compare_stages
from lingc.program import Program
from pass_support import count, only   # tests/passes is on sys.path

E, K = 16, 4                                                  # test-tiny: experts, experts per token
FUSED_LAYERS, KEPT_LAYERS = (1, 2), (3, 4, 5, 6)             # 6: the MTP layer
# MoE layers of test-tiny each graph runs (fused ones in brackets): target graphs 5 (2), MTP graphs 1 (0)
FUSED_PER_GRAPH = {"prefill": 2, "decode": 2, "step": 2, "verify": 2, "mtp_prefill": 0, "mtp_decode": 0,
                   "draft": 0, "extend": 0}
NUMERICS_GRAPHS = ("decode", "verify")


@pytest.fixture(scope="module")
def plain(tiny_partitioned: Program) -> tuple[Program, Program, PassRecord]:
    """router_topk + moe_align, moe_up + silu_and_mul on plain w13: (before, after, record)."""
    return (tiny_partitioned, *FuseSharedExpert().run(tiny_partitioned))


@pytest.fixture(scope="module")
def fused_forms(tiny_partitioned: Program) -> tuple[Program, Program, PassRecord]:
    """router_align, moe_up_act on interleaved w13 (after fuse_swiglu and fuse_moe_align)."""
    before = PassManager(["fuse_swiglu", "fuse_moe_align"]).run(tiny_partitioned).program
    return (before, *FuseSharedExpert().run(before))


@pytest.fixture(params=["plain", "fused_forms"])
def stages(request) -> tuple[Program, Program, PassRecord]:
    return request.getfixturevalue(request.param)


# ---- op counts and structure -----------------------------------------------------------------------------

def test_op_counts_three_launches_fewer_per_fused_layer(stages):
    before, after, record = stages
    for graph, fused in FUSED_PER_GRAPH.items():
        assert count(after, graph, "linear") == count(before, graph, "linear") - 2 * fused, graph
        assert count(after, graph, "silu_and_mul") == count(before, graph, "silu_and_mul") - fused, graph
        for op in ("moe_down", "moe_combine", "moe_up", "moe_up_act", "router_topk", "router_align", "moe_align"):
            assert count(after, graph, op) == count(before, graph, op), (graph, op)
    assert record.matches == sum(FUSED_PER_GRAPH.values()) == 8
    assert record.details["launches_removed"] == 24 and record.changes_numerics and record.tolerance


def test_rewritten_nodes(stages):
    _, after, _ = stages
    graph = after.graphs["decode"]
    combines = [n for n in graph.nodes if n.target is OPS.moe_combine]
    assert [len(c.args) for c in combines] == [2, 2, 3, 3, 3]                   # layers 1, 2 fused; 3-5 kept
    for combine in combines[:2]:
        weights = combine.args[1]
        router = weights.args[0]
        assert weights.meta["lingc.tensor"].shape == (1, K + 1)
        if router.target is OPS.router_topk:
            assert router.args[6:] == (1,)
            align = next(u for u in router.users if u.args[1] == 1).users
            assert [a.args[1] for a in align] == [E + 1]
        else:
            assert router.args[6:] == (E + 1, 16, 1)
        down = combine.args[0]
        up = down.args[0] if down.args[0].target is OPS.moe_up_act else down.args[0].args[0]
        assert up.args[5] == K + 1 and up.args[1].target.endswith("_with_shared")
        assert down.args[1].target.endswith("w2_with_shared")
        # the launch hint (kernels/moe.py SHARED_EARLY) on the interleaved form's moe_up_act only
        want = {"shared_last": True} if up.target is OPS.moe_up_act else None
        assert up.meta.get("lingc.launch") == want
    assert not [n for n in graph.nodes if "L1_mlp_shared_experts" in n.name or "L2_mlp_shared_experts" in n.name]
    assert [n for n in graph.nodes if "L3_mlp_shared_experts" in n.name]


def test_weights_built_and_old_ones_dropped(stages):
    before, after, record = stages
    for layer in FUSED_LAYERS:
        prefix = f"model.layers.{layer}.mlp."
        routed13 = next(w for w in before.weights if w.startswith(prefix + "experts.w13"))
        interleaved = routed13.endswith("_interleaved")
        w13, w2 = after.weights[routed13 + "_with_shared"], after.weights[prefix + "experts.w2_with_shared"]
        gate_up = before.weights[prefix + "shared_experts.gate_up_proj.weight"]
        assert w13.shape == (E + 1, *before.weights[routed13].shape[1:]) and w2.shape[0] == E + 1
        assert torch.equal(w13[:E], before.weights[routed13])
        assert torch.equal(w13[E], interleave_w13(gate_up[None])[0] if interleaved else gate_up)
        assert torch.equal(w2[:E], before.weights[prefix + "experts.w2"])
        assert torch.equal(w2[E], before.weights[prefix + "shared_experts.down_proj.weight"])
        assert after.weight_info[routed13 + "_with_shared"]["shared_expert"] == E
        for old in (routed13, prefix + "experts.w2", prefix + "shared_experts.gate_up_proj.weight",
                    prefix + "shared_experts.down_proj.weight"):
            assert old not in after.weights and old in record.weights_removed
    assert len(record.weights_added) == 4 and len(record.weights_removed) == 8
    assert "model.layers.3.mlp.shared_experts.gate_up_proj.weight" in after.weights


def test_kept_layers_say_why(plain):
    _, _, record = plain
    skipped = record.details["skipped"]
    assert sorted(skipped) == [f"model.layers.{i}.mlp" for i in KEPT_LAYERS]
    assert "config.shared_limit(3)" in skipped["model.layers.3.mlp"]
    assert "config.expert_limit(6)" in skipped["model.layers.6.mlp"]
    assert record.details["layers"] == [f"model.layers.{i}.mlp" for i in FUSED_LAYERS]


def test_a_shared_expert_of_another_width_is_left_alone(tiny_partitioned):
    """moe_shared_expert_intermediate_size x num_shared_experts != moe_intermediate_size: layer 1 keeps it."""
    narrow = tiny_partitioned.copy()
    prefix = "model.layers.1.mlp.shared_experts."
    narrow.weights[prefix + "gate_up_proj.weight"] = narrow.weights[prefix + "gate_up_proj.weight"][:64].clone()
    narrow.weights[prefix + "down_proj.weight"] = narrow.weights[prefix + "down_proj.weight"][:, :32].clone()
    _, record = FuseSharedExpert().run(narrow)
    assert "moe_shared_expert_intermediate_size" in record.details["skipped"]["model.layers.1.mlp"]
    assert record.details["layers"] == ["model.layers.2.mlp"] and record.matches == 4


# ---- numerics --------------------------------------------------------------------------------------------

def test_fp32_numerics_within_tolerance(stages):
    """The reference backend in fp32: every output within the tolerance (test-tiny on CPU: bit-exact)."""
    before, after, _ = stages
    report = compare_stages(only(before, NUMERICS_GRAPHS), only(after, NUMERICS_GRAPHS), exact=False,
                            tolerance=FuseSharedExpert.tolerance)
    assert report["ok"], {g: r["problems"] for g, r in report["graphs"].items()}
    assert all(r["max_abs_delta"] <= 1e-5 for r in report["graphs"].values()), report


def test_bf16_numerics_within_tolerance(tiny_program_bf16):
    """bf16 (the serving dtype): logits within the declared tolerance and greedy parity (measured <= 5e-3)."""
    before = only(tiny_program_bf16, ("decode", "step"))
    after, record = FuseSharedExpert().run(before)
    assert record.matches == 4
    report = compare_stages(before, after, exact=False, tolerance=FuseSharedExpert.tolerance)
    assert report["ok"], {g: r["problems"] for g, r in report["graphs"].items()}


def test_ref_ops_route_the_shared_expert_as_expert_e():
    """router_topk(..., 1) == router_topk + a column of expert E with weight 1.0; the combine without shared_out
    sums it (fp32, sequential: the 3-argument combine of the routed pairs + that row, bit for bit)."""
    g = torch.Generator().manual_seed(0)
    logits, bias = torch.randn(3, E, generator=g), torch.randn(E, generator=g) * 0.1
    w, ids = OPS.router_topk(logits, bias, 4, 2, K, 2.5)
    w1, ids1 = OPS.router_topk(logits, bias, 4, 2, K, 2.5, 1)
    assert torch.equal(w1[:, :K], w) and torch.equal(ids1[:, :K], ids)
    assert torch.equal(w1[:, K], torch.ones(3)) and ids1[:, K].tolist() == [E] * 3
    assert all(torch.equal(a, b) for a, b in zip(OPS.router_align(logits, bias, 4, 2, K, 2.5, E + 1, 16, 1),
                                                 (w1, ids1, *OPS.moe_align(ids1, E + 1, 16))))
    rows = torch.randn(3, K + 1, 128, generator=g)
    want = OPS.moe_combine(rows[:, :K].reshape(-1, 128), w, rows[:, K].contiguous())
    assert torch.equal(OPS.moe_combine(rows.reshape(-1, 128), w1), want)


# ---- manager, artifact, idempotence, tp ------------------------------------------------------------------

def test_in_all_after_the_moe_fusions_and_before_pdl():
    order = [p.name for p in resolve(["pdl", "fuse_shared_expert", "fuse_moe_align", "fuse_swiglu"], PASSES)]
    assert order.index("fuse_shared_expert") > max(order.index("fuse_swiglu"), order.index("fuse_moe_align"))
    assert order.index("fuse_shared_expert") < order.index("pdl")
    assert "fuse_shared_expert" in [p.name for p in resolve(["all"], PASSES)]


def test_fuse_moe_align_run_later_keeps_fused_shared(plain):
    """Run by hand in the other order, fuse_moe_align moves router_topk's fused_shared to router_align's 9th slot."""
    _, after, _ = plain
    aligned, record = FuseMoeAlign().run(only(after, ("decode",)))
    routers = [n for n in aligned.graphs["decode"].nodes if n.target is OPS.router_align]
    assert [n.args[6:] for n in routers] == [(E + 1, 16, 1)] * 2 + [(E, 16)] * 3
    report = compare_stages(only(after, ("decode",)), aligned, exact=True, tolerance=None)
    assert report["ok"], report


def test_second_run_finds_nothing_and_input_is_untouched(fused_forms):
    before, after, _ = fused_forms
    text = program_text(before)
    again, record = FuseSharedExpert().run(after)
    assert record.matches == 0 and program_text(again) == program_text(after) and again.weights.keys() == after.weights.keys()
    assert program_text(before) == text


def test_artifact_round_trip(tiny_partitioned, fused_forms, tmp_path):
    _, after, record = fused_forms
    result = CompileResult(after)
    loaded = load_artifact(write_artifact(result, tmp_path / "art")).program
    assert program_text(loaded) == program_text(after)
    assert count(loaded, "decode", "moe_combine") == 5 and count(loaded, "decode", "silu_and_mul") == 4


def test_tp2_on_fused_layers_matches_tp1(fused_forms):
    """Each rank holds its 8 routed experts + the shared one; layer l's shared pair is local to rank l % 2 only."""
    _, after, _ = fused_forms
    program = only(after, ("decode",))
    tp = TensorParallel(2)
    sharded, _ = tp.run(program)
    for rank, weights in enumerate(tp.rank_weights):
        assert weights["model.layers.1.mlp.experts.w2_with_shared"].shape[0] == E // 2 + 1
        for layer in FUSED_LAYERS:
            shared_slot = weights[f"model.layers.{layer}.mlp.experts.expert_map"][E].item()
            assert shared_slot == (E // 2 if rank == layer % 2 else -1)
    combines = [n for n in sharded.graphs["decode"].nodes if n.target is OPS.ep_combine]
    assert [len(c.args) for c in combines] == [3, 3, 4, 4, 4]
    # a rank's stack and pairs follow ep_align: the shared_last hint is gone
    assert not [n.name for n in sharded.graphs["decode"].nodes if "lingc.launch" in n.meta]
    report = verify_tp(program, rank_programs(sharded, tp.rank_weights), TensorParallel.tolerance)
    assert report["ok"], report
