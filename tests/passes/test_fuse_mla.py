"""fuse_mla: an MLA layer's ropes, kv_a norm, cat and cache write -> one mla_prep; sigmoid_gate -> mla_attention's gate.

On test-tiny (fp32) after every other pass of `all` but pdl (3 MLA layers; the MTP layer in the MTP graphs and
draft / extend): op counts in every graph, the fused nodes' arguments and names, the reference backend bit-exact,
greedy NEXTN == plain decoding == the unfused program's tokens with pdl on top, pass order and idempotence, and
the conservative matcher: a second reader of an intermediate or a cache write in between leaves that layer alone.
The kernels: tests/kernels/test_mla_prep.py and test_mla.py; TP: tests/tp/test_tp_fuse_mla.py.
"""

from __future__ import annotations

import pytest
import torch

from lingc.ops import OPS
from lingc.passes import PASSES
from lingc.passes.fuse_mla import FuseMla
from lingc.passes.manager import PassManager, resolve
from lingc.passes.pdl import Pdl
from lingc.passes.verify import compare_stages
from lingc.program import Program
from lingc.runtime.engine import Engine, Request
from pass_support import assert_reference_exact, count, only   # tests/passes is on sys.path

OTHERS = [n for n, p in PASSES.items() if p.in_all and n not in ("fuse_mla", "pdl")]
GRAPHS = ["decode", "step", "prefill", "verify", "draft", "extend", "mtp_decode", "mtp_prefill"]
GONE = ("rope", "mla_cache_write", "sigmoid_gate")
NUMERICS_GRAPHS = ("decode", "step", "verify", "draft", "extend")


@pytest.fixture(scope="module")
def fused(tiny_program: Program) -> tuple[Program, Program, object]:
    before = PassManager(OTHERS).run(tiny_program).program
    return (before, *FuseMla().run(before))


def _cat(program: Program, graph: str) -> int:
    return sum(n.target is torch.ops.aten.cat.default for n in program.graphs[graph].nodes)


@pytest.mark.parametrize("graph", GRAPHS)
def test_op_counts(fused, graph):
    before, after, _ = fused
    layers = count(before, graph, "mla_attention")                  # one per MLA layer run by the graph
    assert layers == {"draft": 4, "extend": 1, "mtp_decode": 1, "mtp_prefill": 1}.get(graph, 3)
    assert count(after, graph, "mla_prep") == layers and count(after, graph, "mla_attention") == layers
    assert [count(after, graph, op) for op in GONE] == [0, 0, 0]
    assert count(after, graph, "rmsnorm") == count(before, graph, "rmsnorm") - layers    # the MTP's enorm / hnorm stay
    assert _cat(after, graph) == _cat(before, graph) - layers
    if graph in ("decode", "step"):
        assert count(after, graph, "rmsnorm") == 0 and _cat(after, graph) == 0


def test_nodes_and_record(fused):
    before, after, record = fused
    assert record.name == "fuse_mla" and not record.changes_numerics and record.tolerance is None
    assert record.matches == sum(2 * count(before, g, "mla_attention") for g in before.graphs)
    nodes = {n.name: n for n in after.graphs["decode"].nodes}
    prep, attention = nodes["L3_attention_mla_prep"], nodes["L3_attention_mla_attention"]
    q_pe, c_kv, k_pe, weight, kv_pages, cache_locs, positions, theta, eps = prep.args
    assert weight.target == "model.layers.3.attention.kv_a_layernorm.weight" and (theta, eps) == (10000.0, 1e-6)
    assert kv_pages.meta["lingc.input"] == "state:layers.3.kv_pages" and positions.meta["lingc.input"] == "positions"
    assert [tuple(a.meta["lingc.tensor"].shape) for a in (q_pe, c_kv, k_pe)] == [(1, 1, 4, 16), (1, 1, 64), (1, 1, 16)]
    assert attention.args[1] is prep and attention.args[2] is kv_pages and len(attention.args) == 8
    assert attention.args[7].meta["lingc.tensor"].shape == (1, 1, 4)                       # the gate logits
    order = list(after.graphs["decode"].nodes)
    assert order.index(prep) < order.index(attention)
    assert "decode:L3_attention_mla_prep" in record.details["mla_prep"]
    assert "decode:L3_attention_mla_attention" in record.details["gated_attention"]


def test_reference_backend_is_bit_exact(fused):
    before, after, _ = fused
    assert_reference_exact(before, after, NUMERICS_GRAPHS)


def test_greedy_nextn_equals_plain_and_the_unfused_program(fused):
    before, after, _ = fused
    prompt = Request([11, 22, 33], 10, ignore_eos=True)
    want = Engine(before, "cpu", "none").generate(prompt).tokens
    with_pdl = Pdl().run(after)[0]                                   # the `all` program
    got = {spec: Engine(with_pdl, "cpu", spec).generate(prompt).tokens for spec in ("nextn", "none")}
    assert len(want) == 10 and got["nextn"] == got["none"] == want


def test_order_idempotence_and_input_untouched(fused):
    before, after, _ = fused
    order = [p.name for p in resolve(["all"], PASSES)]
    assert order.index("partition") < order.index("fuse_mla") < order.index("pdl")
    assert [p.name for p in resolve(["pdl", "fuse_mla"], PASSES)] == ["fuse_mla", "pdl"]
    assert FuseMla().run(after)[1].matches == 0
    assert count(before, "decode", "mla_prep") == 0 and count(before, "decode", "sigmoid_gate") == 3


# ---- what it leaves alone ---------------------------------------------------------------------------------

def test_a_second_reader_of_an_intermediate_leaves_that_layer(fused):
    """L3's kv_a norm and L4's q rope get another reader: those layers keep their five launches (the gate still folds:
    nothing else reads the attention); L5 fuses."""
    before = fused[0].copy()
    graph = before.graphs["decode"]
    nodes = {n.name: n for n in graph.nodes}
    for name in ("L3_attention_kv_a_layernorm_rmsnorm", "L4_attention_rope"):
        with graph.inserting_after(nodes[name]):
            graph.call_function(torch.ops.aten.neg.default, (nodes[name],))
    after, record = FuseMla().run(before)
    assert [n for n in record.details["mla_prep"] if n.startswith("decode:")] == ["decode:L5_attention_mla_prep"]
    assert [count(after, "decode", op) for op in ("rope", "rmsnorm", "mla_cache_write")] == [4, 2, 2]
    assert count(after, "decode", "sigmoid_gate") == 0
    report = compare_stages(only(before, ("decode",)), only(after, ("decode",)), exact=True, tolerance=None)
    assert report["graphs"]["decode"]["problems"] == []


def test_a_cache_write_between_attention_and_gate_keeps_the_gate(fused):
    """Another write of L3's cache between its attention and its gate: the attention cannot move to the gate, so the
    gate stays a launch of its own (the prep still fuses: the write comes after its place)."""
    before = fused[0].copy()
    graph = before.graphs["decode"]
    nodes = {n.name: n for n in graph.nodes}
    kv_pages, _, cache_locs = nodes["L3_attention_mla_cache_write"].args
    with graph.inserting_before(nodes["L3_attention_sigmoid_gate"]):
        latent = graph.call_function(torch.ops.aten.full.default, ([1, 1, 80], 0.5))
        graph.call_function(OPS.mla_cache_write, (kv_pages, latent, cache_locs))
    after, record = FuseMla().run(before)
    assert count(after, "decode", "sigmoid_gate") == 1 and count(after, "decode", "mla_prep") == 3
    assert "decode:L3_attention_mla_attention" not in record.details["gated_attention"]
    report = compare_stages(only(before, ("decode",)), only(after, ("decode",)), exact=True, tolerance=None)
    assert report["graphs"]["decode"]["problems"] == []
