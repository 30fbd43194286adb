"""The tp pass on fuse_norm_linear's ops (test-tiny, --passes all, fp32): each fused op's linear weight is split by
the rule of the plain linear it replaced, its norm weight is replicated, its y has the per-rank width, the lm_head's
all_gather reads its y; and TP2 greedy-decodes the same tokens as TP1 (ranks in lockstep in one process, as
verify_tp runs them, fed back their own argmax for several steps). The multi-process TP2 session on the same
program (tests/tp/test_tp_runtime.py, the `tp_artifacts` built from `all_fp32`) runs these ops too."""

from __future__ import annotations

import pytest
import torch

from lingc.ops import OPS
from lingc.ops.norm_linear import WEIGHT_ARG
from lingc.passes.tp import TensorParallel, TPError, rank_programs, run_lockstep, shard_inputs
from lingc.passes.verify import random_inputs
from tp_support import with_tp   # tests/tp is on sys.path

GREEDY_STEPS = 8
# decode: fused op -> the tp rule of its linear weight (and y's width per rank at TP2)
WANT_RULES = {"L0_input_layernorm_rmsnorm_linear": ("fused", 322),                 # KDA q/k/v/f/b/g by head
              "L0_post_attention_layernorm_add_rmsnorm_linear": ("gate_up", 256),  # dense MLP
              "L1_post_attention_layernorm_add_rmsnorm_linear": ("replicate", 16),  # router gate
              "L3_input_layernorm_add_rmsnorm_linear": ("fused", 130),             # MLA q_a + kv_a whole, g by head
              "L3_attention_q_a_layernorm_rmsnorm_linear": ("rows", 96),           # q_b by head
              "norm_add_rmsnorm_linear": ("rows", 256)}                            # lm_head by vocab


@pytest.fixture(scope="module")
def tp2(all_fp32):
    return with_tp(all_fp32, 2)


def test_fused_ops_shard_like_their_linears(all_fp32, tp2):
    result, ranks = tp2
    program = result.program
    nodes = {n.name: n for n in program.graphs["decode"].nodes}
    fused = [n for n in nodes.values() if n.target in (OPS.rmsnorm_linear, OPS.add_rmsnorm_linear)]
    assert len(fused) == 16
    for node in fused:
        op = node.target._schema.name.split("::")[1]
        norm_weight, weight = node.args[WEIGHT_ARG[op] - 2].target, node.args[WEIGHT_ARG[op]].target
        assert program.weight_info[norm_weight]["tp"]["rule"] == "replicate"
        assert all(torch.equal(r[norm_weight], all_fp32.program.weights[norm_weight]) for r in ranks)
        if node.name in WANT_RULES:
            rule, width = WANT_RULES[node.name]
            assert program.weight_info[weight]["tp"]["rule"] == rule, node.name
            assert node.meta["lingc.tensor"][0].shape[-1] == width, node.name
        # normed (or the empty [0] when not wanted) and the new residual: whole rows on every rank
        assert all(m.shape in ((0,), (1, 1, 128)) for m in node.meta["lingc.tensor"][1:]), node.name
    gather = nodes["lm_head_linear_all_gather"]
    assert gather.target is OPS.all_gather and gather.args[0] is nodes["lm_head_linear"]
    assert nodes["lm_head_linear"].args == (nodes["norm_add_rmsnorm_linear"], 0)


def test_tp2_greedy_tokens_equal_tp1(all_fp32, tp2):
    """Decode from a half-full cache with random KDA state (verify's seeded inputs), each step's argmax fed back:
    TP2 (every rank) picks TP1's token at every step."""
    result, ranks = tp2
    programs = rank_programs(result.program, ranks)
    inputs = random_inputs(all_fp32.program, "decode")
    tp1 = {k: v.clone() for k, v in inputs.items()}
    tp2 = [shard_inputs(inputs, result.program, "decode", r, 2) for r in range(2)]
    tokens: dict[str, list[int]] = {"tp1": [], "tp2": []}
    for _ in range(GREEDY_STEPS):
        want = run_lockstep([all_fp32.program], "decode", [tp1])[0][0].argmax(-1)      # [1, 1]
        got = [out[0].argmax(-1) for out in run_lockstep(programs, "decode", tp2)]
        assert torch.equal(got[0], got[1])
        tokens["tp1"].append(int(want)), tokens["tp2"].append(int(got[0]))
        for feed in (tp1, *tp2):
            feed["input_ids"].copy_(want)
            feed["positions"].add_(1)
    assert tokens["tp2"] == tokens["tp1"] and len(set(tokens["tp1"])) > 1


def test_a_norm_in_front_of_a_row_parallel_weight_is_refused(all_fp32):
    """Each rank would norm a shard of the row: the pass names the op and the weight instead of sharding it."""
    program = all_fp32.program.copy()
    program.graphs = {"decode": program.graphs["decode"]}
    graph = program.graphs["decode"]
    nodes = {n.name: n for n in graph.nodes}
    fused = nodes["L0_input_layernorm_rmsnorm_linear"]
    fused.args = (*fused.args[:3], nodes["w_L0_attention_o_proj_weight"], *fused.args[4:])   # [h, h]: cols
    with pytest.raises(TPError, match=r"L0_input_layernorm_rmsnorm_linear runs a norm in front of the "
                                      r"row-parallel model\.layers\.0\.attention\.o_proj\.weight"):
        TensorParallel(2).run(program)
