"""pdl: the router, MoE and KDA kernel chains of every layer are found, annotated and made adjacent (techniques.md 5).

Per MoE layer:  router  rmsnorm -> linear (gate) -> router_topk
                moe     moe_align -> moe_up[_act] [-> silu_and_mul] -> moe_down -> moe_combine
Per KDA layer:  kda     kda_conv x3 -> kda_recurrent | kda_chunk -> gated_rmsnorm
                        (verify: kda_conv_staged x3 -> kda_recurrent_staged -> gated_rmsnorm)
Kernels between chain members that need nothing from the chain (KDA's k/v/f/b/g projections, the shared
expert) move before the chain; scheduling only, so every output stays bit-exact. Checked on the traced
program after `partition` (prefill, decode, mtp_prefill, mtp_decode, step, draft, verify, extend).
"""

from __future__ import annotations

import re

import pytest
import torch.fx as fx

from lingc.ir.text import program_text
from lingc.ops import OPS
from lingc.passes.base import PassRecord
from lingc.passes.manager import PassManager
from lingc.passes.matchers import is_free
from lingc.passes.pdl import SOLO_META, Pdl
from lingc.passes.verify import compare_stages
from lingc.program import Program

KDA_LAYERS, MOE_LAYERS = (0, 1, 2), (1, 2, 3, 4, 5)      # test-tiny target layers; layer 6 is the MTP layer
KDA_MOVED = ("k_proj", "v_proj", "f_proj", "b_proj", "g_proj")
SHARED_MOVED = ("gate_up_proj_linear", "silu_and_mul", "down_proj_linear")
TARGET_GRAPHS = ("prefill", "decode", "step", "verify")      # the target model: 3 KDA + 5 MoE layers
MTP_GRAPHS = ("mtp_prefill", "mtp_decode", "extend")          # one MTP forward
GRAPHS = TARGET_GRAPHS + MTP_GRAPHS + ("draft",)              # draft: 4 MTP forwards


def chain_ops(chain: list[fx.Node]) -> list[str]:
    return [n.target.name().split("::")[1] for n in chain]


def chains_of(graph: fx.Graph) -> dict[str, list[fx.Node]]:
    """Chain label -> members in index order, read back from node.meta['lingc.pdl'] (labels unique per graph;
    the "solo" kernels outside chains are left out)."""
    out: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        if "lingc.pdl" in node.meta and node.meta["lingc.pdl"] != SOLO_META:
            out.setdefault(node.meta["lingc.pdl"]["chain"], []).append(node)
    for members in out.values():
        members.sort(key=lambda n: n.meta["lingc.pdl"]["index"])
    return out


def expected_chains(graph: str) -> dict[str, list[str]]:
    """Chain label -> op names of its members, for the target graphs of test-tiny (unfused MoE)."""
    recurrence = "kda_chunk" if graph == "prefill" else "kda_recurrent"      # chunked for T > 16
    conv, staged = ("kda_conv_staged", "_staged") if graph == "verify" else ("kda_conv", "")   # verify stages KDA
    chains = {f"router@L{i}": ["rmsnorm", "linear", "router_topk"] for i in MOE_LAYERS}
    chains |= {f"moe@L{i}": ["moe_align", "moe_up", "silu_and_mul", "moe_down", "moe_combine"] for i in MOE_LAYERS}
    chains |= {f"kda@L{i}": [conv] * 3 + [recurrence + staged, "gated_rmsnorm"] for i in KDA_LAYERS}
    return chains


def base_name(name: str) -> str:
    """A node name without the _<n> suffix fx adds to repeats (the extend graph's MTP forward is the 5th in nextn)."""
    return re.sub(r"_\d+$", "", name)


@pytest.fixture(scope="module")
def scheduled(tiny_partitioned: Program) -> tuple[Program, PassRecord]:
    return Pdl().run(tiny_partitioned)


# ---- chains ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("graph", TARGET_GRAPHS)
def test_chains_per_layer(scheduled, graph):
    after, record = scheduled
    chains = chains_of(after.graphs[graph])
    assert {label: chain_ops(members) for label, members in chains.items()} == expected_chains(graph)
    recorded = {c["chain"]: c["nodes"] for c in record.details["chains"] if c["graph"] == graph}
    assert recorded == {label: [n.name for n in members] for label, members in chains.items()}
    assert recorded["router@L1"] == ["L1_post_attention_layernorm_rmsnorm", "L1_mlp_gate_linear", "L1_mlp_router_topk"]
    suffix = "_staged" if graph == "verify" else ""
    assert recorded["kda@L0"][:3] == [f"L0_attention_{s}_conv1d_kda_conv{suffix}" for s in "qkv"]


def test_chains_in_the_mtp_graphs(scheduled):
    after, record = scheduled
    for graph in MTP_GRAPHS:
        chains = chains_of(after.graphs[graph])
        assert {label: chain_ops(m) for label, m in chains.items()} == {
            "router@L6": ["rmsnorm", "linear", "router_topk"],
            "moe@L6": ["moe_align", "moe_up", "silu_and_mul", "moe_down", "moe_combine"]}, graph
    draft = chains_of(after.graphs["draft"])                                # one router + moe chain per MTP forward
    assert sorted(draft) == sorted(f"{kind}@L6{n}" for kind in ("router", "moe") for n in ("", "#2", "#3", "#4"))
    assert all(chain_ops(draft[f"moe@L6{s}"])[1] == "moe_up" and len(draft[f"moe@L6{s}"]) == 5
               for s in ("", "#2", "#3", "#4"))
    per_target = 2 * len(MOE_LAYERS) + len(KDA_LAYERS)
    assert record.matches == len(TARGET_GRAPHS) * per_target + len(MTP_GRAPHS) * 2 + 8 == 66


def test_chain_labels_are_unique_per_graph(scheduled):
    """Regression: the draft graph runs the MTP layer 4 times and all 4 MoE chains were labelled moe@L6 (each
    with indices 0-4), so the label did not identify a chain and 'pdl=moe@L6 2/5' was ambiguous."""
    _, record = scheduled
    for graph in GRAPHS:
        labels = [c["chain"] for c in record.details["chains"] if c["graph"] == graph]
        assert len(labels) == len(set(labels)), graph


@pytest.mark.parametrize("graph", GRAPHS)
def test_annotations(scheduled, graph):
    after, record = scheduled
    members = set()
    for c in (c for c in record.details["chains"] if c["graph"] == graph):
        nodes = {n.name: n for n in after.graphs[graph].nodes}
        for i, name in enumerate(c["nodes"]):
            pdl = nodes[name].meta["lingc.pdl"]
            assert pdl == {"chain": c["chain"], "index": i, "length": len(c["nodes"]), "early_launch": i > 0}
            members.add(name)
    annotated = {n.name for n in after.graphs[graph].nodes if "lingc.pdl" in n.meta}
    solo = {n.name for n in after.graphs[graph].nodes if n.meta.get("lingc.pdl") == SOLO_META}
    assert annotated == members | solo and not members & solo
    kernels = {n.name for n in after.graphs[graph].nodes if n.op == "call_function" and not is_free(n)}
    assert annotated == kernels                                    # every kernel: in a chain, or solo
    assert record.details["solo"][graph] == len(solo)


@pytest.mark.parametrize("graph", GRAPHS)
def test_chain_members_are_adjacent(scheduled, graph):
    """No kernel outside a chain sits between two of its members; only views, getitems and weights may."""
    after, record = scheduled
    order = {n.name: i for i, n in enumerate(after.graphs[graph].nodes)}
    nodes = list(after.graphs[graph].nodes)
    for c in (c for c in record.details["chains"] if c["graph"] == graph):
        positions = [order[name] for name in c["nodes"]]
        assert positions == sorted(positions), f"{c['chain']}: members out of order"
        between = [n for n in nodes[positions[0]:positions[-1] + 1] if n.name not in c["nodes"]]
        kernels = [n.name for n in between if not is_free(n)]
        assert not kernels, f"{graph} {c['chain']}: kernels inside the chain: {kernels}"


@pytest.mark.parametrize("graph, conv", [("decode", "kda_conv"), ("verify", "kda_conv_staged")])
def test_chains_were_not_adjacent_before(tiny_partitioned, graph, conv):
    """The traced order interleaves KDA projections with the convs and the shared expert with the MoE chain."""
    names = [n.name for n in tiny_partitioned.graphs[graph].nodes]
    between = names[names.index(f"L1_attention_q_conv1d_{conv}"):names.index("L1_attention_gated_rmsnorm")]
    assert "L1_attention_k_proj_linear" in between and "L1_attention_g_proj_linear" in between
    between = names[names.index("L1_mlp_moe_align"):names.index("L1_mlp_moe_combine")]
    assert "L1_mlp_shared_experts_silu_and_mul" in between


def test_moved_nodes(scheduled):
    after, record = scheduled
    moved = {g: {m.split(":", 1)[1] for m in record.details["moved"] if m.startswith(g + ":")} for g in GRAPHS}
    want = {f"L{i}_attention_{p}_linear" for i in KDA_LAYERS for p in KDA_MOVED}
    want |= {f"L{i}_mlp_shared_experts_{s}" for i in MOE_LAYERS for s in SHARED_MOVED}
    for graph in TARGET_GRAPHS:
        assert moved[graph] == want, graph
    names = [n.name for n in after.graphs["decode"].nodes]
    assert names.index("L1_attention_g_proj_linear") < names.index("L1_attention_q_conv1d_kda_conv")
    assert names.index("L1_mlp_shared_experts_down_proj_linear") < names.index("L1_mlp_moe_align")
    names = [n.name for n in after.graphs["verify"].nodes]
    assert names.index("L1_attention_g_proj_linear") < names.index("L1_attention_q_conv1d_kda_conv_staged")
    assert record.nodes_added == record.nodes_removed == []
    shared = {f"L6_mlp_shared_experts_{s}" for s in SHARED_MOVED}
    for graph in MTP_GRAPHS:
        assert {base_name(m) for m in moved[graph]} == shared and len(moved[graph]) == 3, graph
    assert {base_name(m) for m in moved["draft"]} == shared and len(moved["draft"]) == 4 * 3


def test_verify_still_commits_after_acceptance(scheduled):
    """pdl never hoists a kernel that writes state: the KDA commits stay after chain_accept and after the
    staged chains they read, and every relay write stays after the value it publishes."""
    after, _ = scheduled
    nodes = list(after.graphs["verify"].nodes)
    order = {n: i for i, n in enumerate(nodes)}
    accept = next(n for n in nodes if n.target is OPS.chain_accept)
    staged = [n for n in nodes if n.target in (OPS.kda_conv_staged, OPS.kda_recurrent_staged)]
    commits = [n for n in nodes if n.target is OPS.kda_commit]
    assert len(commits) == 12 and all(order[c] > order[accept] > max(map(order.get, staged)) for c in commits)
    for graph in ("draft", "verify", "extend"):
        order = {n: i for i, n in enumerate(after.graphs[graph].nodes)}
        for w in (n for n in after.graphs[graph].nodes if n.target is OPS.scatter_rows):
            assert all(order[i] < order[w] for i in w.all_input_nodes), f"{graph}: {w.name}"


# ---- numerics and composition ----------------------------------------------------------------------------

def test_outputs_are_bit_exact(tiny_partitioned, scheduled):
    after, _ = scheduled
    report = compare_stages(tiny_partitioned, after, exact=True, tolerance=None)
    assert report["ok"], {g: r["problems"] for g, r in report["graphs"].items()}
    assert set(report["graphs"]) == set(GRAPHS)


def test_after_fuse_swiglu_the_moe_chain_has_moe_up_act(tiny_partitioned):
    result = PassManager(["pdl", "fuse_swiglu"]).run(tiny_partitioned)      # the manager runs fuse_swiglu first
    assert [s.name for s in result.stages] == ["traced", "fuse_swiglu", "pdl"]
    for graph in GRAPHS:
        for label, members in chains_of(result.program.graphs[graph]).items():
            if label.startswith("moe@"):
                assert chain_ops(members) == ["moe_align", "moe_up_act", "moe_down", "moe_combine"]
    assert not any(n.target is OPS.silu_and_mul and n.meta["lingc.pdl"]["chain"].startswith("moe@")
                   for g in result.program.graphs.values() for n in g.nodes if "lingc.pdl" in n.meta)


def test_input_program_is_not_edited(tiny_partitioned):
    text = program_text(tiny_partitioned)
    Pdl().run(tiny_partitioned)
    assert program_text(tiny_partitioned) == text
    assert not any("lingc.pdl" in n.meta for g in tiny_partitioned.graphs.values() for n in g.nodes)
