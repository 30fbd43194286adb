"""fuse_add_norm: add + the rmsnorm of its result -> add_rmsnorm (normed, new residual), bit for bit.

Op counts per graph on the partitioned test-tiny program, the fused node's arguments, readers left untouched
(the add and norm nodes become getitems under their old names), bit-exact programs in fp32 and bf16, an
op-level bit comparison over a wide range, the artifact round trip, and the `lingc passes` listing.
"""

from __future__ import annotations

import operator
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from typer.testing import CliRunner

from lingc.artifact import load_artifact, write_artifact
from lingc.cli import app
from lingc.ir.text import program_text
from lingc.ops import OPS
from lingc.passes.base import PassRecord, op_counts
from lingc.passes.fuse_add_norm import FuseAddNorm
from lingc.passes.manager import PassManager
from lingc.passes.verify import compare_stages
from lingc.program import Program

SPLIT_GRAPHS = ("prefill", "decode", "mtp_prefill", "mtp_decode", "step", "draft", "verify", "extend")
# per forward: target 2 adds x 6 layers (12); MTP layer 2 (its input is eh_proj, not an add); draft runs the MTP 4x
ADDS = {"prefill": 12, "decode": 12, "mtp_prefill": 2, "mtp_decode": 2, "step": 12, "draft": 8, "verify": 12, "extend": 2}
# rmsnorms no add feeds: target L0 input norm + q_a and kv_a norms of 3 MLA layers (7); MTP enorm, hnorm, q_a, kv_a
UNFUSED_NORMS = {"prefill": 7, "decode": 7, "mtp_prefill": 5, "mtp_decode": 5, "step": 7, "draft": 20, "verify": 7,
                 "extend": 5}
FORWARDS = {"prefill": 1, "decode": 1, "mtp_prefill": 1, "mtp_decode": 1, "step": 1, "draft": 4, "verify": 1, "extend": 1}


def op_count(program: Program, graph: str, op: str) -> int:
    return op_counts(program.graphs[graph]).get(f"lingc.{op}", 0)


@pytest.fixture(scope="module")
def fused(tiny_partitioned: Program) -> tuple[Program, PassRecord]:
    return FuseAddNorm().run(tiny_partitioned)


# ---- op counts and structure -----------------------------------------------------------------------------

@pytest.mark.parametrize("graph", SPLIT_GRAPHS)
def test_op_counts(tiny_partitioned, fused, graph):
    after, _ = fused
    adds = op_count(tiny_partitioned, graph, "add")
    assert adds == ADDS[graph]
    assert op_count(tiny_partitioned, graph, "rmsnorm") == adds + UNFUSED_NORMS[graph]
    assert op_count(after, graph, "add") == 0
    assert op_count(after, graph, "add_rmsnorm") == adds
    assert op_count(after, graph, "rmsnorm") == UNFUSED_NORMS[graph]


def test_record(fused):
    after, record = fused
    assert record.name == "fuse_add_norm" and not record.changes_numerics and record.tolerance is None
    assert record.matches == sum(ADDS.values()) == 62
    # only the add before each forward's final norm disappears; every other add and norm became a getitem
    assert len(record.nodes_removed) == sum(FORWARDS.values()) == 11
    assert len(record.nodes_added) == 62 and record.weights_added == record.weights_removed == []
    assert "decode:L1_post_attention_layernorm_add_rmsnorm" in record.nodes_added
    assert "decode:L1_post_attention_layernorm_rmsnorm" in record.nodes_rewritten
    assert record.op_counts_before["decode"]["lingc.add"] == 12
    assert record.op_counts_after["decode"]["lingc.add_rmsnorm"] == 12


@pytest.mark.parametrize("graph", ["decode", "verify", "draft"])
def test_fused_node_takes_the_add_and_norm_arguments(tiny_partitioned, fused, graph):
    after, _ = fused
    before = {n.name: n for n in tiny_partitioned.graphs[graph].nodes}
    for node in after.graphs[graph].nodes:
        if node.target is not OPS.add_rmsnorm:
            continue
        normed = next(u for u in node.users if u.args[1] == 0)
        norm = before[normed.name]                                # the norm's name now holds the normed getitem
        add = norm.args[0]
        assert norm.target is OPS.rmsnorm and add.target is OPS.add
        assert [a.name for a in node.args[:3]] == [add.args[0].name, add.args[1].name, norm.args[1].name]
        assert node.args[3] == norm.args[2]                                               # eps
        assert node.meta["lingc.scope"] == norm.meta["lingc.scope"]
        assert node.meta["lingc.tensor"] == [norm.meta["lingc.tensor"], add.meta["lingc.tensor"]]
        residual = [u for u in node.users if u.args[1] == 1]
        if len(add.users) > 1:                   # read by more than its norm: the add's name is now the residual
            assert [u.name for u in residual] == [add.name]
        else:
            assert residual == [] and add.name not in {n.name for n in after.graphs[graph].nodes}


def test_readers_are_untouched(tiny_partitioned, fused):
    """Outside the fused ops and their getitems, every node reads what it read before (names kept)."""
    after, _ = fused
    for graph in SPLIT_GRAPHS:
        before = {n.name: n for n in tiny_partitioned.graphs[graph].nodes}
        for node in after.graphs[graph].nodes:
            if node.target in (OPS.add_rmsnorm, operator.getitem) or node.op == "output":
                continue
            old = before[node.name]
            assert [str(a) for a in node.args] == [str(a) for a in old.args], node.name


def test_first_of_two_norms_fuses_the_other_reads_the_new_residual(tiny_program):
    """An add read by two rmsnorms: the first (graph order) fuses, the second reads the new-residual getitem."""
    program = tiny_program.copy()
    graph = program.graphs["decode"]
    final_norm = next(n for n in graph.nodes if n.name == "norm_rmsnorm")
    last_add = final_norm.args[0]
    with graph.inserting_after(final_norm):
        extra = graph.call_function(OPS.rmsnorm, (last_add, final_norm.args[1], 1e-5))
    output = next(n for n in graph.nodes if n.op == "output")
    output.args = ([*output.args[0], extra],)
    after, record = FuseAddNorm().run(program)
    nodes = {n.name: n for n in after.graphs["decode"].nodes}
    extra_after = next(n for n in after.graphs["decode"].nodes if n.target is OPS.rmsnorm and n.args[2] == 1e-5)
    assert nodes["norm_rmsnorm"].target is operator.getitem
    assert extra_after.args[0].name == last_add.name and extra_after.args[0].args[1] == 1      # new residual
    report = compare_stages(program, after, exact=True, tolerance=None)
    assert report["graphs"]["decode"]["problems"] == []


# ---- numerics --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_programs_are_bit_exact(request, tiny_partitioned, dtype):
    """fp32 on the partitioned program; bf16 on the traced one (its nextn graph is not split yet)."""
    before = tiny_partitioned if dtype == "fp32" else request.getfixturevalue("tiny_program_bf16")
    after, record = FuseAddNorm().run(before)
    assert record.matches == (62 if dtype == "fp32" else 3 * 12 + 2 * 2 + (4 * 2 + 12 + 2))
    report = compare_stages(before, after, exact=True, tolerance=None)
    assert report["ok"], {g: r["problems"] for g, r in report["graphs"].items()}
    assert all(r["max_abs_delta"] == 0.0 for r in report["graphs"].values())


SHAPES = [(1, 128), (6, 128), (37, 33), (5, 2560)]
SCALES = [1e-3, 1.0, 1e2]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "N{}-h{}".format(*s))
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rmsnorm_matches_add_then_rmsnorm_bitwise(dtype, shape):
    N, h = shape
    g = torch.Generator().manual_seed(N * 1000 + h)
    weight = (torch.randn(h, generator=g) * 0.5 + 1).to(DTYPES[dtype])
    for scale in SCALES:
        residual = (torch.randn(1, N, h, generator=g) * scale).to(DTYPES[dtype])
        x = (torch.randn(1, N, h, generator=g) * scale).to(DTYPES[dtype])
        want_residual = OPS.add(residual, x)
        want = OPS.rmsnorm(want_residual, weight, 1e-6)
        got, got_residual = OPS.add_rmsnorm(residual, x, weight, 1e-6)
        assert got.shape == want.shape and got.dtype == want.dtype and got_residual.dtype == want_residual.dtype
        assert torch.equal(bits(got), bits(want)) and torch.equal(bits(got_residual), bits(want_residual)), scale


def test_add_rmsnorm_fake_shapes():
    with FakeTensorMode():
        x = torch.empty(1, 6, 128, dtype=torch.bfloat16)
        out, res = OPS.add_rmsnorm(x, x, torch.empty(128, dtype=torch.bfloat16), 1e-6)
    assert out.shape == res.shape == (1, 6, 128) and out.dtype == res.dtype == torch.bfloat16


# ---- artifact, CLI, hygiene ------------------------------------------------------------------------------

def test_artifact_round_trip(tiny_program, tmp_path):
    result = PassManager(["partition", "fuse_add_norm"]).run(tiny_program)
    loaded = load_artifact(write_artifact(result, tmp_path / "art")).program
    assert program_text(loaded) == program_text(result.program)
    assert op_count(loaded, "verify", "add_rmsnorm") == 12
    report = compare_stages(result.program, loaded, exact=True, tolerance=None)      # outputs and every state
    assert report["ok"] and set(report["graphs"]) == set(SPLIT_GRAPHS), report


def test_listed_by_the_cli():
    result = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"}).invoke(app, ["passes"])
    assert result.exit_code == 0, result.output
    assert re.search(r"fuse_add_norm\s+│ residual add .* │ unchanged\s+│ partition", result.output)


def test_input_program_is_not_edited(tiny_partitioned):
    text = program_text(tiny_partitioned)
    FuseAddNorm().run(tiny_partitioned)
    assert program_text(tiny_partitioned) == text


def test_second_run_finds_nothing(fused):
    after, _ = fused
    again, record = FuseAddNorm().run(after)
    assert record.matches == 0 and program_text(again) == program_text(after)
