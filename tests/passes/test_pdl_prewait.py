"""pdl: a fused KDA kernel loads its pools and slots before its PDL wait, so the pass launches it without PDL
where the launch just before it writes one of those buffers (passes/pdl.py `_prewait_safe`)."""

from __future__ import annotations

import torch.fx as fx

from lingc.ops import OPS
from lingc.passes.fuse_kda import FuseKda
from lingc.passes.pdl import PREWAIT_INPUTS, Pdl, _prewait_safe
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


def test_prewait_indices_name_the_pools_and_slots():
    names = [a.name for a in OPS.kda_fused_decode._schema.arguments]
    for short, idx in PREWAIT_INPUTS.items():
        args = [a.name for a in getattr(OPS, short)._schema.arguments]
        assert [args[i] for i in idx] == ["conv_q_pool", "conv_k_pool", "conv_v_pool", "state_pool", "slots"]
    assert "state_pool" in names


def test_a_pool_writer_just_before_makes_it_unsafe():
    g, node = _verify_graph(between=False)
    assert not _prewait_safe(g, node, "kda_fused_verify")
    g, node = _verify_graph(between=True)
    assert _prewait_safe(g, node, "kda_fused_verify")


def test_pdl_keeps_every_fused_kda_kernel_in_lingc_graphs(tiny_partitioned: Program):
    fused, _ = FuseKda().run(tiny_partitioned)
    scheduled, record = Pdl().run(fused)
    assert record.details["no_pdl"] == []
    kda = [n for g in scheduled.graphs.values() for n in g.nodes
           if n.target in (OPS.kda_fused_decode, OPS.kda_fused_verify)]
    assert kda and all("lingc.pdl" in n.meta for n in kda)
