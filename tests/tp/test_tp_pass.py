"""The tp pass: collective counts per graph and per layer, per-rank weight and state shapes, weights that
reassemble to the originals, TP-N == TP-1 numerics by running the N rank programs in lockstep in one
process (run_lockstep: all_reduce = fp32 sum of the ranks' partials, as on gloo), bad --tp values, and
the pass's place (not in `all`; only via --tp N, last)."""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch
from typer.testing import CliRunner

from lingc.cli import app
from lingc.passes import EXPLICIT_PASSES, PASSES
from lingc.passes.base import op_counts
from lingc.passes.manager import PassManager, PassOrderError, resolve
from lingc.passes.tp import (TensorParallel, TPError, check_tp, gather_state, rank_programs, run_lockstep,
                             shard_inputs, verify_tp)
from lingc.passes.verify import random_inputs
from lingc.presets import preset
from lingc.program import Program
from tp_support import compiled, with_tp   # tests/tp is on sys.path

LAYERS, K = 6, 5                          # test-tiny: 6 target layers (+1 MTP); NEXTN 5/6 -> 4 draft forwards


@pytest.fixture(scope="module")
def unfused_fp32(tiny_ckpt):
    """test-tiny, fp32, every program, no passes."""
    return compiled(tiny_ckpt, torch.float32, [])


@pytest.fixture(scope="module")
def tp2(all_fp32):
    result, ranks = with_tp(all_fp32, 2)
    return result, rank_programs(result.program, ranks)


def test_collectives_per_graph_and_two_all_reduces_per_layer(tp2):
    result, _ = tp2
    record, fuse = result.records[-2:]
    assert record.name == "tp" and record.changes_numerics and result.stages[-2].name == "tp"
    # test-tiny's norms after an all_reduce all run in a small GEMM (fuse_norm_linear): nothing for the next stage
    assert fuse.name == result.stages[-1].name == "fuse_all_reduce_norm" and fuse.matches == 0
    want = {  # graph: (all_reduce, all_gather, ep_align) -- 2 per layer forward, 1 lm_head each, 1 per MoE forward
        "prefill": (2 * LAYERS, 1, LAYERS - 1), "decode": (2 * LAYERS, 1, LAYERS - 1), "step": (2 * LAYERS, 1, LAYERS - 1),
        "verify": (2 * LAYERS, 1, LAYERS - 1), "mtp_prefill": (2, 1, 1), "mtp_decode": (2, 1, 1), "extend": (2, 1, 1),
        "draft": (2 * (K - 1), K - 1, K - 1)}
    for graph, (ar, ag, ep) in want.items():
        counts = op_counts(result.program.graphs[graph])
        assert (counts.get("lingc.all_reduce"), counts.get("lingc.all_gather"), counts.get("lingc.ep_align"),
                counts.get("lingc.ep_combine")) == (ar, ag, ep, ep), graph
        for gone in ("lingc.moe_combine", "lingc.moe_align", "lingc.router_align"):
            assert gone not in counts, (graph, gone)
    assert record.details["all_reduce"]["decode"] == 2 * LAYERS
    per_layer = Counter(re.match(r"model\.layers\.(\d+)", n.meta["lingc.scope"]).group(1)
                        for n in result.program.graphs["decode"].nodes if n.op == "call_function"
                        and n.target is torch.ops.lingc.all_reduce.default)
    assert per_layer == {str(i): 2 for i in range(LAYERS)}
    text = result.stages[-2].text
    # ready to fuse later (after fuse_norm_linear the norm that reads the all_reduce also runs the gate_up GEMV)
    assert "lingc.add_rmsnorm_linear(model_embedding, L0_attention_o_proj_linear_all_reduce," in text
    assert re.search(r"lm_head_linear_all_gather = lingc\.all_gather\(lm_head_linear, -1, 2\)  # f32\[1,1,512\]", text)


@pytest.mark.parametrize("tp", [2, 4])
def test_per_rank_weight_and_state_shapes(all_fp32, tp):
    result, ranks = with_tp(all_fp32, tp)
    full = all_fp32.program.weights
    want = {  # name: per-rank shape (test-tiny: h 128, 4 heads of 32, q_lora 48, latent 64 + 16, 16 experts, V 512)
        "model.layers.0.attention.fused_qkvfbg.weight": (644 // tp, 128),         # q, k, v, f, b, g by head
        "model.layers.0.attention.o_proj.weight": (128, 128 // tp),
        "model.layers.0.attention.q_conv1d.weight": (128 // tp, 1, 4),
        "model.layers.0.attention.A_log": (4 // tp,),
        "model.layers.3.attention.fused_q_a_kv_a_g.weight": (48 + 80 + 4 // tp, 128),   # q_a, kv_a whole; g by head
        "model.layers.3.attention.q_b_proj.weight": (192 // tp, 48),
        "model.layers.3.attention.kv_b_proj.weight": (256 // tp, 64),
        "model.layers.3.attention.dense.weight": (128, 128 // tp),
        "model.layers.0.mlp.gate_up_proj.weight": (512 // tp, 128),
        "model.layers.0.mlp.down_proj.weight": (128, 256 // tp),
        "model.layers.3.mlp.shared_experts.gate_up_proj.weight": (128 // tp, 128),   # layer 3: shared expert kept
        "model.layers.3.mlp.experts.w13_interleaved": (16 // tp, 128, 128),
        "model.layers.3.mlp.experts.w2": (16 // tp, 128, 64),
        "model.layers.3.mlp.experts.expert_map": (16,),
        "model.layers.1.mlp.experts.w13_interleaved_with_shared": (16 // tp + 1, 128, 128),   # fuse_shared_expert
        "model.layers.1.mlp.experts.w2_with_shared": (16 // tp + 1, 128, 64),
        "model.layers.1.mlp.experts.expert_map": (17,),
        "model.layers.1.mlp.gate.weight": (16, 128),
        "lm_head.weight": (512 // tp, 128),
        "model.word_embeddings.weight": (512, 128),
    }
    for r, ws in enumerate(ranks):
        assert ws.keys() == result.program.weights.keys()
        for name, shape in want.items():
            assert tuple(ws[name].shape) == shape, (r, name)
        local = 16 // tp
        assert ws["model.layers.3.mlp.experts.expert_map"].tolist() == [e - r * local if e // local == r else -1
                                                                        for e in range(16)]
        # a fused layer's shared expert (id 16) is local to rank layer % tp only
        assert ws["model.layers.1.mlp.experts.expert_map"].tolist()[16] == (local if r == 1 % tp else -1)
    # the pieces reassemble to the original weights
    cat = lambda name, dim: torch.cat([ws[name] for ws in ranks], dim)   # noqa: E731
    assert torch.equal(cat("lm_head.weight", 0), full["lm_head.weight"])
    assert torch.equal(cat("model.layers.0.attention.o_proj.weight", 1), full["model.layers.0.attention.o_proj.weight"])
    assert torch.equal(cat("model.layers.3.mlp.experts.w2", 0), full["model.layers.3.mlp.experts.w2"])
    gu = [ws["model.layers.0.mlp.gate_up_proj.weight"].chunk(2) for ws in ranks]
    assert torch.equal(torch.cat([g for g, _ in gu] + [u for _, u in gu]), full["model.layers.0.mlp.gate_up_proj.weight"])
    fused = [ws["model.layers.0.attention.fused_qkvfbg.weight"].split([128 // tp] * 4 + [4 // tp, 128 // tp]) for ws in ranks]
    parts = [torch.cat([f[i] for f in fused]) for i in range(6)]
    assert torch.equal(torch.cat(parts), full["model.layers.0.attention.fused_qkvfbg.weight"])
    assert result.program.weight_info["model.layers.0.attention.fused_qkvfbg.weight"]["tp"]["rule"] == "fused"
    shapes = {n.name: n.meta["lingc.tensor"].shape for n in result.program.inputs("verify")}
    assert shapes["state_layers_0_conv_q"] == (2, 128 // tp, 3)
    assert shapes["state_layers_0_recurrent"] == (2, 4 // tp, 32, 32)
    assert shapes["staging_layers_0_recurrent"] == (1, 6, 4 // tp, 32, 32)
    full_shapes = {n.name: n.meta["lingc.tensor"].shape for n in all_fp32.program.inputs("verify")}
    assert shapes["state_layers_3_kv_pages"] == full_shapes["state_layers_3_kv_pages"]    # the latent: whole


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_ranks_in_lockstep_match_tp1_on_every_graph(all_fp32, all_bf16, dtype, tp):
    """TP-N == TP-1 on every graph of --passes all: seeded random inputs (a half-full cache, random KDA state),
    the N rank programs run in lockstep; logits within the pass tolerance 0.05 x (1 + |logit|) (measured: <= 2e-3
    with fp32 activations, the lm_head being bf16 after bf16_router; <= 1.6e-2 in bf16, TP4 prefill), greedy
    parity, integer outputs (draft and accepted tokens) equal, and every rank's outputs identical."""
    before = all_fp32 if dtype == "fp32" else all_bf16
    result, ranks = with_tp(before, tp)
    report = verify_tp(before.program, rank_programs(result.program, ranks), TensorParallel.tolerance)
    assert report["ok"], {g: r["problems"] for g, r in report["graphs"].items() if r["problems"]}
    assert set(report["graphs"]) == set(before.program.graphs)


@pytest.mark.parametrize("tp", [2, 4])
def test_fp32_tp_logits_and_kda_state_within_1e4_of_tp1(unfused_fp32, tp):
    """No passes, fp32 (the lm_head in fp32 too): TP-N logits within 1e-4 of TP-1 (measured <= 4e-7), the same
    argmax, and the state gathered back from the ranks' shards equal to TP-1's within 1e-4. This program also
    covers the unfused forms: moe_align + moe_up + silu_and_mul, separate projections, nextn unsplit."""
    before = unfused_fp32
    result, ranks = with_tp(before, tp)
    programs = rank_programs(result.program, ranks)
    assert op_counts(result.program.graphs["nextn"])["lingc.all_reduce"] == 2 * LAYERS + 2 * K   # verify, draft, extend
    for graph in ("prefill", "decode", "mtp_decode", "nextn"):
        inputs = random_inputs(before.program, graph)
        ref_state = {k: v.clone() for k, v in inputs.items()}
        want = before.program.run(graph, ref_state)
        rank_in = [shard_inputs(inputs, result.program, graph, r, tp) for r in range(tp)]
        got = run_lockstep(programs, graph, rank_in)
        if graph != "nextn":
            assert all(torch.equal(got[0][0], g[0]) for g in got)                 # every rank has the same logits
            assert (got[0][0] - want[0]).abs().max() < 1e-4, graph
            assert torch.equal(got[0][0].argmax(-1), want[0].argmax(-1))
        state = gather_state(rank_in, result.program, graph)                        # state rebuilt from the shards
        for k in state:
            if k.startswith("state_") or k in ("relay_out_tokens", "relay_seq_len"):
                assert (state[k].double() - ref_state[k].double()).abs().max() < 1e-4, (graph, k)


@pytest.mark.parametrize("overrides, tp, dim", [
    ({}, 3, "num_attention_heads = 4"),
    ({"num_attention_heads": 8, "num_key_value_heads": 8, "num_experts": 12}, 8, "num_experts = 12"),
    ({"vocab_size": 510, "eos_token_id": 509, "pad_token_id": 508}, 4, "vocab_size = 510"),
    ({"intermediate_size": 250}, 4, "intermediate_size = 250"),
    ({"moe_shared_expert_intermediate_size": 66}, 4, "moe_shared_expert_intermediate_size x num_shared_experts = 66"),
    ({"num_kv_heads_for_linear_attn": 2}, 4, "KDA heads"),
])
def test_a_tp_that_does_not_divide_a_dimension_names_it(overrides, tp, dim):
    config = preset("test-tiny", **overrides)
    with pytest.raises(TPError, match=re.escape(f"--tp {tp} does not divide {dim}")):
        check_tp(config, tp)


@pytest.mark.parametrize("tp", [0, -2, True, 1.5])
def test_tp_must_be_a_positive_integer(tp):
    with pytest.raises(TPError, match="--tp must be a positive integer"):
        check_tp(preset("test-tiny"), tp)


def test_compile_with_a_bad_tp_fails_before_loading_and_names_the_dimension(tiny_ckpt, tmp_path):
    runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"})
    out = tmp_path / "art"
    result = runner.invoke(app, ["compile", str(tiny_ckpt), "--passes", "all", "-o", str(out), "--tp", "3"])
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert "--tp 3 does not divide num_attention_heads = 4" in text
    assert not out.exists()


def test_tp_runs_only_via_tp_n_and_never_in_all():
    assert "tp" not in PASSES and EXPLICIT_PASSES["tp"] is TensorParallel
    assert "tp" not in [p.name for p in resolve(["all"], PASSES)]
    with pytest.raises(PassOrderError, match=r"unknown pass\(es\) \['tp'\]"):
        PassManager(["tp"])
    with pytest.raises(TPError, match="needs a degree"):
        TensorParallel().run(Program(preset("test-tiny"), {}, {}))


def test_tp_stage_keeps_everything_on_the_weights_device(all_fp32):
    """Weights on another device than the CPU (here `meta`; cuda on the GPU): the pass's shape walk puts the graph
    inputs there too, and the per-rank expert maps live with the experts (on the H200 the walk failed on a cat of
    a cuda and a cpu tensor)."""
    from lingc.compile import CompileResult
    from lingc.passes.tp import run_tp_stage
    program = all_fp32.program.copy()
    program.weights = {k: v.to("meta") for k, v in all_fp32.program.weights.items()}
    ranks = run_tp_stage(CompileResult(program, list(all_fp32.stages)), 2)
    assert {str(w.device) for rank in ranks for w in rank.values()} == {"meta"}
    assert all(str(w.device) == "cpu" for w in all_fp32.program.weights.values())     # the original is untouched


def test_tp_shards_fuse_router_into_moe_layers(tiny_ckpt):
    """With the opt-in fuse_router_into_moe the tp pass turns each routed layer back into router_align + the aligned
    GEMMs before sharding it (passes/fuse_router_into_moe.py `unfuse`): no routed op is left, and TP-2 matches TP-1."""
    before = compiled(tiny_ckpt, torch.float32, ["all", "fuse_router_into_moe"])
    assert op_counts(before.program.graphs["decode"]).get("lingc.moe_down_routed")
    result, ranks = with_tp(before, 2)
    counts = [op_counts(g) for g in result.program.graphs.values()]
    assert not any(c.get(op) for c in counts for op in ("lingc.moe_up_act_routed", "lingc.moe_down_routed"))
    report = verify_tp(before.program, rank_programs(result.program, ranks), TensorParallel.tolerance)
    assert report["ok"], {g: r["problems"] for g, r in report["graphs"].items() if r["problems"]}
