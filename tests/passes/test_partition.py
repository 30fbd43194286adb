"""partition: the traced NEXTN step (`nextn`, nodes tagged lingc.stage) becomes the draft, verify and extend graphs.

A value one stage makes and a later stage uses crosses through a persistent relay buffer indexed by slot:
scatter_rows into input `relay_x_<value>` [S, ...] in the producer, gather_rows from it in the consumer, the
input tagged lingc.relay. Verify holds the staged KDA ops and commits after the acceptance. Running the three
graphs in order computes what `nextn` computes, bit for bit, on every relay, pool and staging buffer.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from lingc.ir.text import graph_text, program_text
from lingc.ops import OPS
from lingc.passes.base import PassRecord
from lingc.passes.partition import STAGES, Partition
from lingc.passes.verify import compare_stages, random_inputs
from lingc.program import Program, TensorMeta

OTHERS = ("prefill", "decode", "mtp_prefill", "mtp_decode", "step")
K = 5                                                  # draft tokens of test-tiny's trace (draft_tokens 6 = K + 1)


def calls(graph: fx.Graph, op) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and n.target is op]


@pytest.fixture(scope="module")
def partitioned(tiny_program: Program) -> tuple[Program, PassRecord]:
    return Partition().run(tiny_program)


# ---- structure -------------------------------------------------------------------------------------------

def test_nextn_becomes_three_graphs(tiny_program, partitioned):
    after, record = partitioned
    assert set(after.graphs) == set(OTHERS) | set(STAGES) and STAGES == ("draft", "verify", "extend")
    for name in OTHERS:                                                       # the other programs are untouched
        assert graph_text(name, after.graphs[name]) == graph_text(name, tiny_program.graphs[name])
    assert record.name == "partition" and not record.changes_numerics and record.matches == 1
    assert Partition.splits == {"nextn": STAGES, **{"nextn" + sfx: tuple(s + sfx for s in STAGES)
                                                    for sfx in ("_greedy", "_plain", "_nucleus")}}
    for stage in STAGES:                                                      # every kernel keeps its stage
        graph = after.graphs[stage]
        assert {n.meta.get("lingc.stage") for n in graph.nodes if n.op == "call_function"} == {stage}
        assert next(n for n in graph.nodes if n.op == "output").args[0] is None
    assert after.weights.keys() == tiny_program.weights.keys()


def test_relay_buffers(tiny_options, partitioned):
    """Each crossing value has one relay input: written once (scatter_rows by slot) in its stage, read
    (gather_rows by slot) in each later stage that uses it, and tagged lingc.relay / role relay:x.<value>."""
    after, record = partitioned
    relays = record.details["relays"]
    S = tiny_options.request_slots
    crossings = sorted((r["from"], tuple(r["to"]), tuple(r["shape"]), r["dtype"]) for r in relays)
    assert crossings == sorted([
        ("draft", ("verify",), (S,), "int64"),                     # seq_len as read before verify advances it
        ("draft", ("verify",), (S, K + 1), "int64"),               # the chain [root, d1..dK]
        ("draft", ("verify",), (S, K, 512), "float32"),            # their draft distributions
        ("verify", ("extend",), (S, K + 1), "int64"),              # the chain's tokens
        ("verify", ("extend",), (S, K + 1), "int64"),              # its positions
        ("verify", ("extend",), (S, K + 1, 128), "float32"),       # the target's hidden states
        ("verify", ("extend",), (S,), "int32"),                    # accept_len
    ])
    for r in relays:
        buf = r["buffer"]
        assert buf == f"relay_x_{r['value']}"
        for stage in (r["from"], *r["to"]):
            (node,) = [n for n in after.inputs(stage) if n.name == buf]
            assert node.meta["lingc.input"] == f"relay:x.{r['value']}"
            assert node.meta["lingc.relay"] == {"from": r["from"], "value": r["value"]}
            assert node.meta["lingc.tensor"] == TensorMeta(tuple(r["shape"]), getattr(torch, r["dtype"]))
        writes = [n for n in calls(after.graphs[r["from"]], OPS.scatter_rows) if n.args[0].name == buf]
        assert len(writes) == 1 and writes[0].args[1].name == "slots" and writes[0].meta["lingc.scope"] == "relay"
        for stage in r["to"]:
            reads = [n for n in calls(after.graphs[stage], OPS.gather_rows) if n.args[0].name == buf]
            assert len(reads) == 1 and reads[0].args[1].name == "slots" and not any(
                n.target is OPS.scatter_rows and n.args[0].name == buf for n in after.graphs[stage].nodes)
    relay_inputs = {n.name for s in STAGES for n in after.inputs(s) if "lingc.relay" in n.meta}
    assert relay_inputs == {r["buffer"] for r in relays}


def test_only_verify_stages_kda_and_commits_after_acceptance(partitioned):
    after, _ = partitioned
    verify = after.graphs["verify"]
    assert len(calls(verify, OPS.kda_conv_staged)) == 9 and len(calls(verify, OPS.kda_recurrent_staged)) == 3
    assert not calls(verify, OPS.kda_conv) and not calls(verify, OPS.kda_recurrent) and not calls(verify, OPS.kda_chunk)
    for name, graph in after.graphs.items():
        if name != "verify":
            for op in (OPS.kda_conv_staged, OPS.kda_recurrent_staged, OPS.kda_commit, OPS.chain_accept):
                assert not calls(graph, op), f"{name} calls {op}"
    order = {n: i for i, n in enumerate(verify.nodes)}
    (accept,) = calls(verify, OPS.chain_accept)
    commits = calls(verify, OPS.kda_commit)
    assert len(commits) == 12                                     # 3 KDA layers x (conv q, k, v + recurrent)
    staged_writes = calls(verify, OPS.kda_conv_staged) + calls(verify, OPS.kda_recurrent_staged)
    assert all(order[c] > order[accept] and order[c] > max(order[n] for n in staged_writes) for c in commits)
    pools = {c.args[0].meta["lingc.input"] for c in commits}
    staging = {c.args[2].meta["lingc.input"] for c in commits}
    assert {p.removeprefix("state:") for p in pools} == {s.removeprefix("staging:") for s in staging}
    assert len(pools) == 12 and all(p.startswith("state:layers.") for p in pools)
    assert all(c.args[1].name == "slots" for c in commits)


def test_stage_roles(partitioned):
    """draft runs the MTP layer only, verify the target only, extend the MTP layer once over the chain."""
    after, _ = partitioned
    pools = {s: {n.meta["lingc.input"] for n in after.inputs(s) if n.meta["lingc.input"].startswith("state:")}
             for s in STAGES}
    assert pools["draft"] == pools["extend"] == {"state:layers.6.kv_pages"}
    assert "state:layers.6.kv_pages" not in pools["verify"] and len(pools["verify"]) == 3 * 4 + 3
    assert len(calls(after.graphs["draft"], OPS.mla_attention)) == K - 1
    assert len(calls(after.graphs["extend"], OPS.mla_attention)) == 1
    (emit,) = calls(after.graphs["verify"], OPS.emit_tokens)
    assert emit.args[0].name == "relay_out_tokens"


def test_text_marks_relay_nodes(partitioned):
    after, _ = partitioned
    text = graph_text("draft", after.graphs["draft"])
    writes = [line for line in text.splitlines() if "lingc.scatter_rows(relay_x_" in line]
    assert len(writes) == 3 and all(line.endswith("relay (draft)") for line in writes)


# ---- numerics --------------------------------------------------------------------------------------------

def test_verify_report_is_bit_exact(tiny_program, partitioned):
    after, _ = partitioned
    report = compare_stages(tiny_program, after, exact=True, tolerance=None, splits=Partition.splits)
    assert report["ok"], {g: r["problems"] for g, r in report["graphs"].items()}
    assert set(report["graphs"]) == set(OTHERS) | {"draft+verify+extend"}
    assert all(r["max_abs_delta"] == 0.0 for r in report["graphs"].values())


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_three_rounds_equal_nextn_bit_for_bit(request, dtype):
    """Three NEXTN rounds on random state (slot 0 of 2; greedy or sampled by the drawn temperature): after each,
    every relay, pool and staging buffer of draft -> verify -> extend equals nextn's."""
    before = request.getfixturevalue("tiny_program" if dtype == "fp32" else "tiny_program_bf16")
    after, _ = Partition().run(before) if dtype == "bf16" else request.getfixturevalue("partitioned")
    whole = random_inputs(before, "nextn")
    parts = {k: v.clone() for k, v in whole.items()}
    parts.update({k: v for k, v in random_inputs(after, list(STAGES)).items() if k not in whole})   # relay_x_*
    seq0 = whole["relay_seq_len"].clone()
    for round_ in range(3):
        before.run("nextn", whole)
        for stage in STAGES:
            after.run(stage, {n.name: parts[n.name] for n in after.inputs(stage)})
        for key, value in whole.items():
            assert torch.equal(parts[key], value), f"round {round_}: {key} differs"
    assert (whole["relay_seq_len"] - seq0)[whole["slots"].long()].ge(3).all()      # every round emitted tokens


def test_program_without_nextn_is_left_alone(tiny_program):
    program = tiny_program.copy()
    del program.graphs["nextn"]
    after, record = Partition().run(program)
    assert record.matches == 0 and record.details["relays"] == []
    assert program_text(after) == program_text(program)


def test_input_program_is_not_edited(tiny_program):
    text = program_text(tiny_program)
    Partition().run(tiny_program)
    assert program_text(tiny_program) == text and "nextn" in tiny_program.graphs
