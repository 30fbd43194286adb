"""pdl: a fused KDA kernel loads its pools and slots before its PDL wait, so the pass launches it without PDL
where the launch just before it writes one of those buffers (passes/pdl.py `_prewait_safe`)."""

from __future__ import annotations

import torch.fx as fx

from lingc.ops import OPS
from lingc.passes.fuse_kda import FuseKda
from lingc.passes.pdl import PREWAIT_INPUTS, SOLO_META, Pdl, _prewait_safe, drop_unsafe_prewait
from lingc.program import Program


def _verify_graph(between: bool) -> tuple[fx.Graph, fx.Node]:
    """commit(state_pool) [-> linear] -> kda_fused_verify(..., state_pool, ...)."""
    g = fx.Graph()
    ph = {n: g.placeholder(n) for n in ("q", "k", "v", "f", "b", "wq", "wk", "wv", "pq", "pk", "pv", "a", "dt",
                                        "pool", "slots", "sq", "sk", "sv", "sst", "stg", "acc", "x", "w")}
    g.call_function(OPS.kda_commit, (ph["pool"], ph["slots"], ph["stg"], ph["acc"]))
    if between:
        g.call_function(OPS.linear, (ph["x"], ph["w"]))
    args = tuple(ph[n] for n in ("q", "k", "v", "f", "b", "wq", "wk", "wv", "pq", "pk", "pv", "a", "dt", "pool",
                                 "slots", "sq", "sk", "sv", "sst")) + (-5.0,)
    node = g.call_function(OPS.kda_fused_verify, args)
    g.output(node)
    return g, node


def test_prewait_indices_name_the_early_inputs():
    names = [a.name for a in OPS.kda_fused_decode._schema.arguments]
    want = {"kda_fused_decode": ["conv_q_pool", "conv_k_pool", "conv_v_pool", "state_pool", "slots"],
            "moe_down": ["sorted_pairs", "block_expert", "total"], "moe_down_pairs": ["topk_ids"],
            "mla_attention": ["q_nope"], "moe_up_act": ["x"], "moe_up_act_pairs": ["x"],
            "moe_down_routed": ["logits"]}
    want["kda_fused_verify"] = want["kda_fused_decode"]
    for short, idx in PREWAIT_INPUTS.items():
        args = [a.name for a in getattr(OPS, short)._schema.arguments]
        assert [args[i] for i in idx] == want[short]
    assert "state_pool" in names


def test_a_pool_writer_just_before_makes_it_unsafe():
    g, node = _verify_graph(between=False)
    assert not _prewait_safe(node, "kda_fused_verify")
    g, node = _verify_graph(between=True)
    assert _prewait_safe(node, "kda_fused_verify")


def test_pdl_keeps_every_early_loading_kernel_in_lingc_graphs(tiny_partitioned: Program):
    fused, _ = FuseKda().run(tiny_partitioned)
    scheduled, record = Pdl().run(fused)
    assert record.details["no_pdl"] == []
    early = [n for g in scheduled.graphs.values() for n in g.nodes
             if n.target in (OPS.kda_fused_decode, OPS.kda_fused_verify, OPS.moe_down, OPS.moe_down_pairs,
                             OPS.mla_attention)]
    assert early and all("lingc.pdl" in n.meta for n in early)


def test_moe_down_right_after_its_align_is_unsafe():
    """moe_down preloads the align's outputs before its wait: the align must not be the launch just before it."""
    g = fx.Graph()
    ids, x, act, w2 = (g.placeholder(n) for n in ("ids", "x", "act", "w2"))
    align = g.call_function(OPS.moe_align, (ids, 8, 16))
    parts = [g.call_function(__import__("operator").getitem, (align, i)) for i in range(3)]
    down = g.call_function(OPS.moe_down, (act, w2, *parts, 16))
    g.output(down)
    assert not _prewait_safe(down, "moe_down")
    with g.inserting_before(down):
        g.call_function(OPS.linear, (x, w2))
    assert _prewait_safe(down, "moe_down")


def test_an_unsafe_kernel_loses_its_annotation_for_good():
    """The drop runs after the solo annotation (which would otherwise re-annotate it) and removes only that node."""
    g, node = _verify_graph(between=False)
    for n in g.nodes:
        if n.op == "call_function":
            n.meta["lingc.pdl"] = dict(SOLO_META)
    assert drop_unsafe_prewait(g) == [node.name]
    assert "lingc.pdl" not in node.meta
    assert all("lingc.pdl" in n.meta for n in g.nodes if n.op == "call_function" and n is not node)
    g, node = _verify_graph(between=True)
    node.meta["lingc.pdl"] = dict(SOLO_META)
    assert drop_unsafe_prewait(g) == [] and "lingc.pdl" in node.meta
