"""fuse_kda: a KDA layer's 3 convs -> kda_conv_qkv, decode's convs + recurrence -> kda_fused_decode, verify's convs +
recurrence -> kda_fused_verify, a layer's commits -> kda_commit_multi, bit for bit.

Op counts per graph on the partitioned test-tiny program (step, draft, verify, extend and the host-fed graphs) and
on the unsplit NEXTN program, the fused nodes' arguments, bit-exact programs in fp32 and bf16 (reference backend),
the ops against the composites they replace, hazards that must block a fusion, composition with fuse_projections
and pdl (chains, pass order), and a second run that finds nothing. The kernels are tested in
tests/kernels/test_kda.py and end to end (greedy NEXTN == plain decode under `all`) in test_lowering.py.
"""

from __future__ import annotations

import operator
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lingc.ir.text import program_text
from lingc.ops.kda import COMMIT_MULTI_PAIRS
from lingc.ops import OPS
from lingc.passes import PASSES
from lingc.passes.base import PassRecord, op_counts
from lingc.passes.fuse_kda import FuseKda
from lingc.passes.manager import PassManager, resolve
from lingc.passes.matchers import is_free
from lingc.passes.verify import compare_stages
from lingc.program import Program

KDA_LAYERS = (0, 1, 2)                                    # test-tiny: 3 KDA target layers; the MTP mixer is MLA
SPLIT_GRAPHS = ("prefill", "decode", "mtp_prefill", "mtp_decode", "step", "draft", "verify", "extend")
CONV_GRAPHS = ("prefill", "decode", "step")                # in-place convs: 9 -> 3 kda_conv_qkv
DECODE_GRAPHS = ("decode", "step")                         # ... then each with its kda_recurrent -> kda_fused_decode
# (op, count before, count after) per graph; graphs not listed have no KDA layer (MTP forwards only)
COUNTS = {"prefill": [("kda_conv", 9, 0), ("kda_conv_qkv", 0, 3), ("kda_chunk", 3, 3)]}
COUNTS |= {g: [("kda_conv", 9, 0), ("kda_recurrent", 3, 0), ("kda_conv_qkv", 0, 0), ("kda_fused_decode", 0, 3)]
           for g in DECODE_GRAPHS}
COUNTS["verify"] = [("kda_conv_staged", 9, 0), ("kda_recurrent_staged", 3, 0), ("kda_fused_verify", 0, 3),
                    ("kda_commit", 12, 0), ("kda_commit_multi", 0, 3)]
COUNTS["nextn"] = COUNTS["verify"]                         # unsplit: the verify stage's nodes


class OneLayerCommits(FuseKda):
    """fuse_kda with one layer's commits per kda_commit_multi (commit_pairs 4): the per-layer structure tests read
    one launch per layer; the default (8, two layers a launch) is test_two_layers_of_commits_per_launch."""
    commit_pairs = 4


def op_count(program: Program, graph: str, op: str) -> int:
    return op_counts(program.graphs[graph]).get(f"lingc.{op}", 0)


@pytest.fixture(scope="module")
def fused(tiny_partitioned: Program) -> tuple[Program, PassRecord]:
    return OneLayerCommits().run(tiny_partitioned)


# ---- op counts and structure -----------------------------------------------------------------------------

@pytest.mark.parametrize("graph", SPLIT_GRAPHS)
def test_op_counts(tiny_partitioned, fused, graph):
    after, _ = fused
    for op, before_n, after_n in COUNTS.get(graph, []):
        assert (op_count(tiny_partitioned, graph, op), op_count(after, graph, op)) == (before_n, after_n), op
    if graph not in COUNTS:
        assert op_counts(after.graphs[graph]) == op_counts(tiny_partitioned.graphs[graph])
    for op in ("kda_chunk", "gated_rmsnorm"):                                      # untouched
        assert op_count(after, graph, op) == op_count(tiny_partitioned, graph, op)
    if graph not in DECODE_GRAPHS:                                                  # only decode's recurrences fuse
        assert op_count(after, graph, "kda_recurrent") == op_count(tiny_partitioned, graph, "kda_recurrent")


def test_op_counts_on_the_unsplit_nextn_program(tiny_program_bf16):
    after, record = OneLayerCommits().run(tiny_program_bf16)
    for graph in ("nextn", "decode", "step"):
        for op, before_n, after_n in COUNTS[graph]:
            assert (op_count(tiny_program_bf16, graph, op), op_count(after, graph, op)) == (before_n, after_n), op
    assert record.matches == 3 * 3 + 3 + 3                 # prefill, decode, step convs; nextn's mixers, commits


def test_record(fused):
    _, record = fused
    assert record.name == "fuse_kda" and not record.changes_numerics and record.tolerance is None
    assert record.matches == 3 * 3 + 3 + 3
    assert record.details["kda_conv_qkv"] == [f"prefill:L{i}_attention_kda_conv_qkv" for i in KDA_LAYERS]
    assert record.details["kda_fused_decode"] == [f"{g}:L{i}_attention_kda_fused_decode" for g in DECODE_GRAPHS
                                                  for i in KDA_LAYERS]
    assert record.details["kda_fused_verify"] == [f"verify:L{i}_attention_kda_fused_verify" for i in KDA_LAYERS]
    assert record.details["kda_commit_multi"] == [f"verify:verify_L{i}_kda_commit_multi" for i in KDA_LAYERS]
    assert "prefill:L0_attention_q_conv1d_kda_conv" in record.nodes_rewritten         # now a getitem
    assert {"decode:L0_attention_q_conv1d_kda_conv", "decode:L0_attention_view", "decode:L0_attention_kda_recurrent",
            "step:L2_attention_v_conv1d_kda_conv"} <= set(record.nodes_removed)
    assert {"verify:L0_attention_q_conv1d_kda_conv_staged", "verify:L0_attention_kda_recurrent_staged",
            "verify:verify_kda_commit"} <= set(record.nodes_removed)
    assert record.weights_added == record.weights_removed == []


def test_conv_qkv_node(tiny_partitioned, fused):
    after, _ = fused
    before = {n.name: n for n in tiny_partitioned.graphs["prefill"].nodes}
    nodes = {n.name: n for n in after.graphs["prefill"].nodes}
    order = {n: i for i, n in enumerate(after.graphs["prefill"].nodes)}
    for i in KDA_LAYERS:
        convs = [before[f"L{i}_attention_{s}_conv1d_kda_conv"] for s in "qkv"]
        node = nodes[f"L{i}_attention_kda_conv_qkv"]
        want = [c.args[j] for j in range(3) for c in convs] + [convs[0].args[3]]     # x, weight, pool per conv; slots
        assert [str(a) for a in node.args] == [str(a) for a in want]
        assert node.meta["lingc.scope"] == f"model.layers.{i}.attention"
        for k, conv in enumerate(convs):                  # the convs became its getitems, after it, names kept
            getitem = nodes[conv.name]
            assert getitem.target is operator.getitem and getitem.args == (node, k) and order[getitem] > order[node]
            assert all(order[u] > order[getitem] for u in getitem.users)


@pytest.mark.parametrize("graph", DECODE_GRAPHS)
def test_fused_decode_node(tiny_partitioned, fused, graph):
    """The three convs' inputs, the recurrence's; the recurrence's readers; the convs, views and kda_conv_qkv gone."""
    after, _ = fused
    before = {n.name: n for n in tiny_partitioned.graphs[graph].nodes}
    nodes = {n.name: n for n in after.graphs[graph].nodes}
    for i in KDA_LAYERS:
        rec = before[f"L{i}_attention_kda_recurrent"]
        convs = [before[f"L{i}_attention_{s}_conv1d_kda_conv"] for s in "qkv"]
        node = nodes[f"L{i}_attention_kda_fused_decode"]
        want = ([c.args[0] for c in convs] + list(rec.args[3:5]) + [c.args[1] for c in convs]
                + [c.args[2] for c in convs] + list(rec.args[5:]))
        assert [str(a) for a in node.args] == [str(a) for a in want]
        assert node.meta["lingc.scope"] == f"model.layers.{i}.attention"
        assert [u.name for u in node.users] == [u.name for u in rec.users]            # the gated norm reads it
        gone = [rec.name, f"L{i}_attention_kda_conv_qkv", *(c.name for c in convs), *(a.name for a in rec.args[:3])]
        assert not set(gone) & set(nodes), graph


def test_fused_verify_and_commit_nodes(tiny_partitioned, fused):
    after, _ = fused
    before = {n.name: n for n in tiny_partitioned.graphs["verify"].nodes}
    nodes = {n.name: n for n in after.graphs["verify"].nodes}
    commits = [n for n in tiny_partitioned.graphs["verify"].nodes if n.target is OPS.kda_commit]
    for i in KDA_LAYERS:
        rec = before[f"L{i}_attention_kda_recurrent_staged"]
        convs = [before[f"L{i}_attention_{s}_conv1d_kda_conv_staged"] for s in "qkv"]
        node = nodes[f"L{i}_attention_kda_fused_verify"]
        want = ([c.args[0] for c in convs] + list(rec.args[3:5]) + [c.args[1] for c in convs]
                + [c.args[2] for c in convs] + list(rec.args[5:9]) + [c.args[4] for c in convs] + list(rec.args[9:]))
        assert [str(a) for a in node.args] == [str(a) for a in want]
        assert [u.name for u in node.users] == [u.name for u in rec.users]            # the gated norm reads it
        layer = commits[4 * i:4 * i + 4]
        multi = nodes[f"verify_L{i}_kda_commit_multi"]
        assert [str(a) for a in multi.args[:2]] == [str(layer[0].args[1]), str(layer[0].args[3])]
        assert [str(a) for a in multi.args[2]] == [str(c.args[0]) for c in layer]            # pools
        assert [str(a) for a in multi.args[3]] == [str(c.args[2]) for c in layer]            # stagings


# ---- numerics --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_programs_are_bit_exact(request, tiny_partitioned, dtype):
    """Reference backend: every output and every pool, staging and relay, bit for bit (bf16: the unsplit program)."""
    before = tiny_partitioned if dtype == "fp32" else request.getfixturevalue("tiny_program_bf16")
    after, _ = FuseKda().run(before)
    report = compare_stages(before, after, exact=True, tolerance=None)
    assert report["ok"], {g: r["problems"] for g, r in report["graphs"].items()}
    assert all(r["max_abs_delta"] == 0.0 for r in report["graphs"].values())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ops_equal_the_composites_they_replace(dtype):
    g = torch.Generator().manual_seed(5)
    B, T, H, D, W, S = 2, 3, 2, 8, 4, 4
    P = H * D
    slots = torch.tensor([2, 0], dtype=torch.int32)
    xs = [torch.randn(B, T, P, generator=g).to(dtype) for _ in range(3)]
    ws = [torch.randn(P, 1, W, generator=g) for _ in range(3)]
    pools = [torch.randn(S, P, W - 1, generator=g).to(dtype) for _ in range(3)]
    f, b = torch.randn(B, T, H, D, generator=g).to(dtype), torch.randn(B, T, H, generator=g).to(dtype)
    A_log, dt_bias = torch.randn(H, generator=g), torch.randn(P, generator=g)
    state = torch.randn(S, H, D, D, generator=g)                                       # [S, H, D, D] fp32
    got_st, want_st = ([torch.zeros(B, T, P, W - 1, dtype=dtype) for _ in range(3)] + [torch.zeros(B, T, H, D, D)]
                       for _ in range(2))
    o = OPS.kda_fused_verify(*xs, f, b, *ws, *pools, A_log, dt_bias, state, slots, *got_st, -5.0)
    qkv = [OPS.kda_conv_staged(x, w, p, slots, s).view(B, T, H, D) for x, w, p, s in zip(xs, ws, pools, want_st)]
    o_ref = OPS.kda_recurrent_staged(*qkv, f, b, A_log, dt_bias, state, slots, want_st[3], -5.0)
    assert torch.equal(_bits(o), _bits(o_ref)) and all(torch.equal(a, c) for a, c in zip(got_st, want_st))
    got_pools, want_pools = [p.clone() for p in pools], [p.clone() for p in pools]
    ys = OPS.kda_conv_qkv(*xs, *ws, *got_pools, slots)
    ys_ref = [OPS.kda_conv(x, w, p, slots) for x, w, p in zip(xs, ws, want_pools)]
    assert all(torch.equal(_bits(a), _bits(c)) for a, c in zip(ys, ys_ref))
    assert all(torch.equal(a, c) for a, c in zip(got_pools, want_pools))
    heads = (B, T, H, D)
    got_state, want_state = state.clone(), state.clone()
    o = OPS.kda_fused_decode(*xs, f, b, *ws, *got_pools, A_log, dt_bias, got_state, slots, -5.0)
    qkv = [OPS.kda_conv(x, w, p, slots).view(heads) for x, w, p in zip(xs, ws, want_pools)]
    o_ref = OPS.kda_recurrent(*qkv, f, b, A_log, dt_bias, want_state, slots, -5.0)
    assert torch.equal(_bits(o), _bits(o_ref)) and torch.equal(_bits(got_state), _bits(want_state))
    assert all(torch.equal(a, c) for a, c in zip(got_pools, want_pools))
    accept = torch.tensor([3, 1], dtype=torch.int32)
    OPS.kda_commit_multi(slots, accept, [got_pools[0], state], [got_st[0], got_st[3]])
    OPS.kda_commit(want_pools[0], slots, want_st[0], accept)
    state_ref = state.clone()
    OPS.kda_commit(state_ref, slots, want_st[3], accept)
    assert torch.equal(got_pools[0], want_pools[0]) and torch.equal(state, state_ref)


def test_fake_shapes():
    with FakeTensorMode():
        x, w, pool = torch.empty(1, 6, 32, dtype=torch.bfloat16), torch.empty(32, 1, 4), torch.empty(3, 32, 3)
        f, b = torch.empty(1, 6, 4, 8, dtype=torch.bfloat16), torch.empty(1, 6, 4)
        slots = torch.empty(1, dtype=torch.int32)
        o = OPS.kda_fused_verify(x, x, x, f, b, w, w, w, pool, pool, pool, torch.empty(4), torch.empty(32),
                                 torch.empty(3, 4, 8, 8), slots, torch.empty(1, 6, 32, 3), torch.empty(1, 6, 32, 3),
                                 torch.empty(1, 6, 32, 3), torch.empty(1, 6, 4, 8, 8), -5.0)
        ys = OPS.kda_conv_qkv(x, x, x, w, w, w, pool, pool, pool, slots)
        od = OPS.kda_fused_decode(x, x, x, f, b, w, w, w, pool, pool, pool, torch.empty(4), torch.empty(32),
                                  torch.empty(3, 4, 8, 8), slots, -5.0)
    assert o.shape == od.shape == (1, 6, 4, 8) and o.dtype == od.dtype == torch.bfloat16
    assert [tuple(y.shape) for y in ys] == [(1, 6, 32)] * 3


# ---- hazards ---------------------------------------------------------------------------------------------

def test_a_write_between_the_convs_blocks_that_layer(tiny_partitioned):
    """A kernel between layer 0's q and k convs updates the q window: delaying the q conv past it would change
    what it reads, so layer 0 keeps its three convs and its recurrence; layers 1 and 2 fuse."""
    program = tiny_partitioned.copy()
    graph = program.graphs["decode"]
    q_conv = next(n for n in graph.nodes if n.name == "L0_attention_q_conv1d_kda_conv")
    with graph.inserting_after(q_conv):
        graph.call_function(OPS.kda_conv, q_conv.args)                # another update of state_layers_0_conv_q
    after, record = FuseKda().run(program)
    assert op_count(after, "decode", "kda_conv") == 4 and op_count(after, "decode", "kda_conv_qkv") == 0
    assert op_count(after, "decode", "kda_fused_decode") == 2 and op_count(after, "decode", "kda_recurrent") == 1
    assert "decode:L0_attention_kda_fused_decode" not in record.details["kda_fused_decode"]
    report = compare_stages(program, after, exact=True, tolerance=None)
    assert report["graphs"]["decode"]["problems"] == []


def test_a_second_reader_of_a_conv_output_stops_at_conv_qkv(tiny_partitioned):
    """A kernel after layer 0's recurrence also reads its q conv output, which kda_fused_decode would not produce:
    layer 0 stops at kda_conv_qkv + kda_recurrent (recorded as the kda_conv_qkv); layers 1 and 2 fuse fully."""
    program = tiny_partitioned.copy()
    graph = program.graphs["decode"]
    nodes = {n.name: n for n in graph.nodes}
    with graph.inserting_after(nodes["L0_attention_kda_recurrent"]):
        graph.call_function(torch.ops.aten.neg.default, (nodes["L0_attention_q_conv1d_kda_conv"],))
    after, record = FuseKda().run(program)
    assert [op_count(after, "decode", op) for op in ("kda_conv_qkv", "kda_recurrent", "kda_fused_decode")] == [1, 1, 2]
    assert "decode:L0_attention_kda_conv_qkv" in record.details["kda_conv_qkv"]
    assert "decode:L0_attention_kda_fused_decode" not in record.details["kda_fused_decode"]
    report = compare_stages(program, after, exact=True, tolerance=None)
    assert report["graphs"]["decode"]["problems"] == []


def test_commits_fuse_per_layer_and_per_run(tiny_partitioned):
    """A commit of layer 1 moved between layer 0's commits splits layer 0's run in two; groups never mix layers."""
    program = tiny_partitioned.copy()
    graph = program.graphs["verify"]
    commits = [n for n in graph.nodes if n.target is OPS.kda_commit]
    commits[2].prepend(commits[7])                                    # L0 q, L0 k, L1 state, L0 v, L0 state, ...
    after, record = OneLayerCommits().run(program)
    multis = [n for n in after.graphs["verify"].nodes if n.target is OPS.kda_commit_multi]
    assert [len(n.args[2]) for n in multis] == [2, 2, 3, 4] and op_count(after, "verify", "kda_commit") == 1
    for node in multis:
        layers = {re.search(r"layers_(\d+)_", a.name).group(1) for a in node.args[2] + node.args[3]}
        assert len(layers) == 1, node.format_node()
    report = compare_stages(program, after, exact=True, tolerance=None)
    assert report["graphs"]["verify"]["problems"] == []


# ---- other passes ----------------------------------------------------------------------------------------

def test_pass_order():
    assert [p.name for p in resolve(["pdl", "fuse_kda", "fuse_projections", "partition"], PASSES)] == \
        ["partition", "fuse_projections", "fuse_kda", "pdl"]
    order = [p.name for p in resolve(["all"], PASSES)]
    assert order.index("fuse_kda") < order.index("pdl")


@pytest.fixture(scope="module")
def with_projections(tiny_partitioned: Program) -> tuple[Program, Program]:
    """(after fuse_projections, after fuse_kda and pdl on top of it)."""
    projected = PassManager(["fuse_projections"]).run(tiny_partitioned).program
    return projected, PassManager(["fuse_kda", "pdl"]).run(projected).program


def test_composes_with_fuse_projections(with_projections):
    """q, k, v reach the fused ops as getitems of one projection's split (column views; the kernels take strides)."""
    projected, after = with_projections
    for graph, op in (("prefill", OPS.kda_conv_qkv), ("decode", OPS.kda_fused_decode),
                      ("verify", OPS.kda_fused_verify)):
        nodes = [n for n in after.graphs[graph].nodes if n.target is op]
        assert len(nodes) == 3
        for node in nodes:
            splits = {a.args[0] for a in node.args[:3]}
            assert all(a.target is operator.getitem for a in node.args[:3]) and len(splits) == 1
            assert next(iter(splits)).target is torch.ops.aten.split_with_sizes.default
    report = compare_stages(projected, after, exact=True, tolerance=None)
    assert report["ok"], {g: r["problems"] for g, r in report["graphs"].items()}


def test_pdl_chains_after_the_fusion(with_projections):
    _, after = with_projections
    nodes = {g: list(after.graphs[g].nodes) for g in ("decode", "verify", "prefill")}
    for graph, ops in (("decode", ["kda_fused_decode", "gated_rmsnorm"]),
                       ("prefill", ["kda_conv_qkv", "kda_chunk", "gated_rmsnorm"]),
                       ("verify", ["kda_fused_verify", "gated_rmsnorm"])):
        chains: dict[str, list[torch.fx.Node]] = {}
        for node in nodes[graph]:
            if node.meta.get("lingc.pdl", {}).get("chain", "").startswith("kda@"):
                chains.setdefault(node.meta["lingc.pdl"]["chain"], []).append(node)
        assert sorted(chains) == [f"kda@L{i}" for i in KDA_LAYERS], graph
        for members in chains.values():
            assert [m.target.name().split("::")[1] for m in members] == ops, graph
            assert [m.meta["lingc.pdl"]["index"] for m in members] == list(range(len(ops)))
            span = nodes[graph][nodes[graph].index(members[0]):nodes[graph].index(members[-1]) + 1]
            assert all(is_free(n) or n in members for n in span), graph            # adjacent on the stream


# ---- hygiene ---------------------------------------------------------------------------------------------

def test_input_program_is_not_edited(tiny_partitioned):
    text = program_text(tiny_partitioned)
    FuseKda().run(tiny_partitioned)
    assert program_text(tiny_partitioned) == text


def test_second_run_finds_nothing(fused):
    after, _ = fused
    again, record = FuseKda().run(after)
    assert record.matches == 0 and program_text(again) == program_text(after)


def test_two_layers_of_commits_per_launch(tiny_partitioned):
    """The default FuseKda.commit_pairs = 8: verify's commits go two layers to a kda_commit_multi of 8 pairs
    (test-tiny's 3 KDA layers: 3 launches at one layer each -> 2, of 8 and 4 pairs), bit for bit."""
    assert FuseKda.commit_pairs == 8
    one, _ = OneLayerCommits().run(tiny_partitioned)
    two, record = FuseKda().run(tiny_partitioned)
    multi = [n for n in two.graphs["verify"].nodes if n.target is OPS.kda_commit_multi]
    assert [(len(n.args[2]), len(n.args[3])) for n in multi] == [(8, 8), (4, 4)]
    assert [n.name for n in multi] == ["verify_L0_kda_commit_multi", "verify_L2_kda_commit_multi"]
    assert len([n for n in one.graphs["verify"].nodes if n.target is OPS.kda_commit_multi]) == 3
    report = compare_stages(one, two, exact=True, tolerance=None)
    assert report["ok"], {g: r["problems"] for g, r in report["graphs"].items() if r["problems"]}


class AllCommits(FuseKda):
    """fuse_kda with every layer's commits in one kda_commit_multi (the widest launch the kernel takes)."""
    commit_pairs = COMMIT_MULTI_PAIRS


def test_every_layers_commits_in_one_launch(tiny_partitioned):
    """commit_pairs up to COMMIT_MULTI_PAIRS (the kernel's pairs are tuple arguments): test-tiny's 3 KDA layers'
    12 commits in one kda_commit_multi, bit for bit against one layer a launch."""
    one, _ = OneLayerCommits().run(tiny_partitioned)
    every, _ = AllCommits().run(tiny_partitioned)
    multi = [n for n in every.graphs["verify"].nodes if n.target is OPS.kda_commit_multi]
    assert [(len(n.args[2]), len(n.args[3])) for n in multi] == [(12, 12)]
    report = compare_stages(one, every, exact=True, tolerance=None)
    assert report["ok"], {g: r["problems"] for g, r in report["graphs"].items() if r["problems"]}
