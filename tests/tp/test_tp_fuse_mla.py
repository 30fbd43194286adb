"""The tp pass on fuse_mla's ops (test-tiny, --passes all, fp32): mla_prep's q_rope and mla_attention's gate carry the
rank's heads (H / N, like q_pe and g), the latent row and the cache stay whole (kv_a and its norm replicated); in
lockstep every rank writes the same cache rows as every other, and the decode logits match TP1's (test_tp_pass.py's
lockstep test runs every graph of the same `all` program, fuse_mla included)."""

from __future__ import annotations

import pytest
import torch

from lingc.ops import OPS
from lingc.passes.tp import TensorParallel, rank_programs, run_lockstep, shard_inputs
from lingc.passes.verify import random_inputs
from tp_support import with_tp   # tests/tp is on sys.path


@pytest.fixture(scope="module")
def tp2(all_fp32):
    return with_tp(all_fp32, 2)


@pytest.mark.parametrize("graph", ["decode", "verify"])
def test_prep_and_gate_shard_with_the_heads(all_fp32, tp2, graph):
    result, ranks = tp2
    c = all_fp32.program.config
    heads, full = c.num_attention_heads // 2, {n.name: n for n in all_fp32.program.graphs[graph].nodes}
    preps = [n for n in result.program.graphs[graph].nodes if n.target is OPS.mla_prep]
    attentions = [n for n in result.program.graphs[graph].nodes if n.target is OPS.mla_attention]
    assert len(preps) == len(attentions) == 3
    for prep in preps:
        q_pe, c_kv, k_pe, weight, kv_pages = prep.args[:5]
        assert prep.meta["lingc.tensor"].shape[2:] == q_pe.meta["lingc.tensor"].shape[2:] == (heads, c.qk_rope_head_dim)
        assert c_kv.meta["lingc.tensor"].shape[-1] == c.kv_lora_rank
        assert k_pe.meta["lingc.tensor"].shape[-1] == c.qk_rope_head_dim
        assert kv_pages.meta["lingc.tensor"] == full[kv_pages.name].meta["lingc.tensor"]         # the cache: whole
        assert result.program.weight_info[weight.target]["tp"]["rule"] == "replicate"
        assert all(torch.equal(r[weight.target], all_fp32.program.weights[weight.target]) for r in ranks)
    for attention in attentions:
        assert attention.args[7].meta["lingc.tensor"].shape[2] == heads                          # the gate logits
        assert attention.meta["lingc.tensor"].shape[2] == heads


def test_ranks_write_the_same_cache_and_match_tp1(all_fp32, tp2):
    result, ranks = tp2
    inputs = random_inputs(all_fp32.program, "decode")
    tp1 = {k: v.clone() for k, v in inputs.items()}
    shards = [shard_inputs(inputs, result.program, "decode", r, 2) for r in range(2)]
    want = run_lockstep([all_fp32.program], "decode", [tp1])[0][0]
    got = run_lockstep(rank_programs(result.program, ranks), "decode", shards)
    caches = [k for k in tp1 if k.endswith("kv_pages")]
    assert len(caches) == 3
    for key in caches:
        assert torch.equal(shards[0][key], shards[1][key]), key
        assert not torch.equal(shards[0][key], inputs[key]), key                             # the step wrote a row
        torch.testing.assert_close(shards[0][key], tp1[key], rtol=1e-3, atol=1e-3)
    assert torch.equal(got[0][0], got[1][0])
    assert ((got[0][0] - want).abs() <= TensorParallel.tolerance * (1 + want.abs())).all()
    assert torch.equal(got[0][0].argmax(-1), want.argmax(-1))
