"""fuse_embed_norm: an embedding and the rmsnorm / rmsnorm_cat reading it -> one embedding_rmsnorm[_cat], bit for bit.

Op and launch counts per graph on the partitioned test-tiny program (alone, where every embedding's norm is a plain
rmsnorm, and after fuse_cat_norm, where the MTP's is an rmsnorm_cat), the fused nodes (the old nodes as its getitems,
the residual readers kept), what must not match, bit-exact programs in fp32 and bf16 on the reference backend, and a
second run that finds nothing. The kernels (and the fused graphs on them, in the interpreter) are checked in
tests/kernels/test_embedding_rmsnorm.py and test_embedding_rmsnorm_sm90.py.
"""

from __future__ import annotations

import operator

import pytest

from lingc.ops import OPS
from lingc.passes.fuse_embed_norm import FuseEmbedNorm, _norm_reader
from lingc.passes.manager import PassManager
from lingc.passes.verify import compare_stages
from lingc.program import Program
from pass_support import count, launches  # noqa: E402  (tests/passes is on sys.path)

# embeddings per graph: one token gather per forward (the draft's 4 MTP forwards each embed the token before)
FORWARDS = {"prefill": 1, "decode": 1, "mtp_prefill": 1, "mtp_decode": 1, "step": 1, "draft": 4, "verify": 1,
            "extend": 1}
MTP = {"mtp_prefill", "mtp_decode", "draft", "extend"}


@pytest.fixture(scope="module")
def alone(tiny_partitioned: Program):
    return FuseEmbedNorm().run(tiny_partitioned)


@pytest.fixture(scope="module")
def after_cat(tiny_partitioned: Program):
    before = PassManager(["fuse_cat_norm"]).run(tiny_partitioned).program
    return before, *FuseEmbedNorm().run(before)


@pytest.mark.parametrize("graph", list(FORWARDS))
def test_op_and_launch_counts(tiny_partitioned, alone, after_cat, graph):
    k = FORWARDS[graph]
    after, record = alone
    assert count(tiny_partitioned, graph, "embedding") == k and count(after, graph, "embedding") == 0
    assert count(after, graph, "embedding_rmsnorm") == k
    assert count(tiny_partitioned, graph, "rmsnorm") - count(after, graph, "rmsnorm") == k
    assert launches(tiny_partitioned, graph) - launches(after, graph) == k
    cat_before, cat_after, _ = after_cat
    assert count(cat_after, graph, "embedding_rmsnorm_cat") == (k if graph in MTP else 0)
    assert count(cat_after, graph, "embedding_rmsnorm") == (0 if graph in MTP else k)
    assert launches(cat_before, graph) - launches(cat_after, graph) == k


def test_fused_nodes(tiny_partitioned, alone, after_cat):
    after, record = alone
    assert record.name == "fuse_embed_norm" and not record.changes_numerics
    assert record.matches == sum(FORWARDS.values())
    nodes = {n.name: n for n in after.graphs["decode"].nodes}
    fused = nodes["model_embedding_rmsnorm"]
    assert fused.target is OPS.embedding_rmsnorm
    norm, emb = nodes["L0_input_layernorm_rmsnorm"], nodes["model_embedding"]     # the old names, now its getitems
    assert (norm.target, norm.args) == (operator.getitem, (fused, 0))
    assert (emb.target, emb.args) == (operator.getitem, (fused, 1))
    assert any(u.target is OPS.add for u in emb.users)                            # the residual still reads the row
    assert FuseEmbedNorm().run(after)[1].matches == 0                             # nothing left to fuse
    _, cat_after, cat_record = after_cat
    for node in cat_after.graphs["draft"].nodes:
        if node.target is OPS.embedding_rmsnorm_cat:
            assert [u.target for u in node.users] == [OPS.linear] and "eh_proj" in next(iter(node.users)).name
    assert FuseEmbedNorm().run(cat_after)[1].matches == 0


def test_embedding_without_a_norm_input_is_left_alone(tiny_partitioned):
    program = tiny_partitioned.copy()
    graph = program.graphs["mtp_decode"]
    emb = next(n for n in graph.nodes if n.target is OPS.embedding)
    assert _norm_reader(emb) is not None
    norm = next(iter(emb.users))
    with graph.inserting_after(emb):                                              # a second norm of the same row
        graph.call_function(OPS.rmsnorm, norm.args)
    assert _norm_reader(emb) is None
    program = tiny_partitioned.copy()
    graph = program.graphs["decode"]
    emb = next(n for n in graph.nodes if n.target is OPS.embedding)
    norm = next(u for u in emb.users if u.target is OPS.rmsnorm)
    emb.meta["lingc.stage"] = "verify"                                            # the norm in another stage
    assert norm.meta.get("lingc.stage") != "verify" and _norm_reader(emb) is None


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_programs_are_bit_exact(request, dtype):
    before = request.getfixturevalue("tiny_partitioned" if dtype == "fp32" else "tiny_program_bf16")
    if dtype == "bf16":
        before = PassManager(["partition"]).run(before).program
    before = PassManager(["fuse_cat_norm"]).run(before).program
    after, record = FuseEmbedNorm().run(before)
    assert record.matches == sum(FORWARDS.values())
    report = compare_stages(before, after, exact=True, tolerance=None)
    assert report["ok"], {g: r["problems"] for g, r in report["graphs"].items() if r["problems"]}

