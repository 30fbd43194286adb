"""fuse_all_reduce_norm, the stage after tp: which all_reduces it fuses (op counts before / after, the view case),
that the fused programs compute the same bits as the unfused ones (the N ranks in lockstep, `--verify`), and that
TP2 with it still matches TP1 (logits within the tp pass's tolerance, the same greedy tokens).

test-tiny with every pass folds each norm after an all_reduce into a small GEMM (fuse_norm_linear), so there the
stage matches nothing (tests/tp/test_tp_pass.py); these tests compile without fuse_norm_linear, as Ling-3.0-tiny
ends up for its large projections (the KDA fused projection after a MoE layer)."""

from __future__ import annotations

import pytest
import torch

from lingc.passes import PASSES
from lingc.passes.tp import TensorParallel, rank_programs, run_lockstep, shard_inputs
from lingc.passes.verify import random_inputs
from tp_support import compiled   # tests/tp is on sys.path

LAYERS, K = 6, 5


@pytest.fixture(scope="module")
def no_norm_linear(tiny_ckpt):
    return compiled(tiny_ckpt, torch.float32, [n for n, p in PASSES.items() if p.in_all and n != "fuse_norm_linear"])


@pytest.fixture(scope="module")
def fused_tp2(no_norm_linear):
    from lingc.passes.manager import CompileResult
    from lingc.passes.tp import run_tp_stage
    copy = CompileResult(no_norm_linear.program, list(no_norm_linear.stages))
    ranks = run_tp_stage(copy, 2, verify=True)            # --verify: lockstep before / after, bit for bit
    return copy, ranks


def test_every_all_reduce_before_an_add_rmsnorm_is_fused(fused_tp2):
    result, _ = fused_tp2
    tp, fuse = result.records[-2:]
    assert (tp.name, fuse.name) == ("tp", "fuse_all_reduce_norm") and not fuse.changes_numerics
    assert fuse.verify["ok"] and fuse.verify["exact"]
    want = {"decode": 2 * LAYERS, "verify": 2 * LAYERS, "step": 2 * LAYERS, "extend": 2, "draft": 2 * (K - 1)}
    for graph, n in want.items():
        before, after = fuse.op_counts_before[graph], fuse.op_counts_after[graph]
        assert before["lingc.all_reduce"] == n and "lingc.all_reduce" not in after, graph
        assert after["lingc.all_reduce_add_rmsnorm"] == n
        assert after.get("lingc.add_rmsnorm", 0) == before["lingc.add_rmsnorm"] - n, graph
    assert [s.name for s in result.stages][-2:] == ["tp", "fuse_all_reduce_norm"]     # both stages kept for diff
    text = result.stages[-1].text
    # a MoE layer's output: the view moves onto the partial, the fused op reads it
    assert "lingc.all_reduce_add_rmsnorm(" in text and "lingc.all_reduce(" not in text


def test_fused_tp2_matches_tp1_in_lockstep(no_norm_linear, fused_tp2):
    """The decode graph on seeded random inputs: TP2 (fused, 2 ranks in lockstep) against TP1, logits within the tp
    pass's tolerance and the same argmax."""
    result, ranks = fused_tp2
    programs = rank_programs(result.program, ranks)
    inputs = random_inputs(no_norm_linear.program, ["decode"])
    want = no_norm_linear.program.run("decode", {k: v.clone() for k, v in inputs.items()})
    got = run_lockstep(programs, "decode", [shard_inputs(inputs, programs[0], "decode", r, 2) for r in range(2)])
    logits_want, logits_got = want[0], got[0][0]
    tol = TensorParallel.tolerance * (1 + logits_want.abs())
    assert ((logits_got - logits_want).abs() <= tol).all()
    assert torch.equal(logits_got.argmax(-1), logits_want.argmax(-1))
    assert torch.equal(got[0][0], got[1][0])                                   # every rank alike
