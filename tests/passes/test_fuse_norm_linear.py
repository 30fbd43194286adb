"""fuse_norm_linear: rmsnorm / add_rmsnorm + the linear reading it -> one [add_]rmsnorm_linear; gated_rmsnorm + the
o_proj reading it -> gated_rmsnorm_linear.

Op counts per graph on test-tiny (after partition, fuse_projections and fuse_add_norm), the fused node's arguments
and names, which norms stay (a cat reads them), want_normed where other readers remain; the reference backend
bit-exact against the unfused program (fp32 here, bf16 after every other pass), greedy NEXTN == plain decoding
with every pass (on the kernels: tests/kernels/test_lowering.py, which also compares the fused kernels with the
unfused ones in the interpreter), the pdl
router chain, pass order, idempotence, the artifact round trip and the `lingc passes` listing.
"""

from __future__ import annotations

import operator
import re

import pytest
import torch
from typer.testing import CliRunner

from lingc.artifact import load_artifact, write_artifact
from lingc.cli import app
from lingc.ir.text import program_text
from lingc.ops import OPS
from lingc.passes import PASSES
from lingc.passes.base import PassRecord
import lingc.passes.fuse_norm_linear as fnl
from lingc.passes.fuse_norm_linear import FuseNormLinear
from lingc.passes.manager import CompileResult, PassManager, resolve
from lingc.passes.pdl import Pdl
from lingc.passes.verify import compare_stages
from lingc.program import Program
from pass_support import (  # tests/passes is on sys.path
    assert_greedy_nextn_equals_plain, assert_reference_exact, count, only)

# per graph: (rmsnorm_linear, add_rmsnorm_linear, want_normed). A target forward: L0's input norm and the q_a norms
# of 3 MLA layers (4 rmsnorm_linear), every add_rmsnorm (12: the final norm's feeds the lm_head); the kv_a norms
# stay (a cat reads them). An MTP forward: the input norm (of eh_proj) and q_a, post-attention and final; enorm /
# hnorm / kv_a stay. want_normed: the 5 MoE post-attention norms (moe_up_act reads normed) + the returned final
# hidden state; step keeps no hidden state; draft's 4 forwards: 4 post-attention + 3 final norms read by the
# next forward's hnorm
FUSED = {"prefill": (4, 12, 6), "decode": (4, 12, 6), "step": (4, 12, 5), "verify": (4, 12, 6),
         "mtp_prefill": (2, 2, 2), "mtp_decode": (2, 2, 2), "extend": (2, 2, 2), "draft": (8, 8, 7)}
# gated_rmsnorm_linear per graph: one per KDA layer of a target forward (test-tiny: 3); MTP layers have none
GATED = {"prefill": 3, "decode": 3, "step": 3, "verify": 3, "mtp_prefill": 0, "mtp_decode": 0, "extend": 0,
         "draft": 0}
NUMERICS_GRAPHS = ("decode", "verify", "draft", "mtp_decode")
EVERY_OTHER_PASS = [name for name, cls in PASSES.items() if cls.in_all and name not in ("fuse_norm_linear", "pdl")]


@pytest.fixture(scope="module", autouse=True)
def _gated_on():
    """The gated o_norm fusion is opt-in (LINGC_NORM_LINEAR_GATED, slower on the H200); these tests cover it."""
    old, fnl.GATED = fnl.GATED, True
    yield
    fnl.GATED = old


@pytest.fixture(scope="module")
def fp32(tiny_partitioned: Program) -> tuple[Program, Program, PassRecord]:
    """(before, after, record) on the fp32 program after partition, fuse_projections, fuse_add_norm."""
    before = PassManager(["fuse_projections", "fuse_add_norm"]).run(tiny_partitioned).program
    return (before, *FuseNormLinear().run(before))


@pytest.fixture(scope="module")
def bf16_all(tiny_program_bf16: Program) -> tuple[Program, Program]:
    """bf16 (the serving dtype), every other pass before it; after = fuse_norm_linear then pdl (= --passes all)."""
    before = PassManager(EVERY_OTHER_PASS).run(tiny_program_bf16).program
    return before, Pdl().run(FuseNormLinear().run(before)[0])[0]


# ---- op counts and structure -----------------------------------------------------------------------------

@pytest.mark.parametrize("graph", FUSED)
def test_op_counts(fp32, graph):
    before, after, _ = fp32
    plain, added, wanted = FUSED[graph]
    assert count(after, graph, "rmsnorm_linear") == plain and count(after, graph, "add_rmsnorm_linear") == added
    assert count(after, graph, "add_rmsnorm") == 0 and count(before, graph, "add_rmsnorm") == added
    assert count(after, graph, "rmsnorm") == count(before, graph, "rmsnorm") - plain
    assert count(after, graph, "linear") == count(before, graph, "linear") - plain - added - GATED[graph]
    assert count(after, graph, "gated_rmsnorm_linear") == GATED[graph]
    assert count(after, graph, "gated_rmsnorm") == count(before, graph, "gated_rmsnorm") - GATED[graph] == 0
    fused = [n for n in after.graphs[graph].nodes if n.target in (OPS.rmsnorm_linear, OPS.add_rmsnorm_linear)]
    assert sum(n.args[-1] for n in fused) == wanted


def test_record(fp32):
    _, _, record = fp32
    assert record.name == "fuse_norm_linear" and record.changes_numerics and record.tolerance == 0.01
    assert record.matches == sum(p + a for p, a, _ in FUSED.values()) + sum(GATED.values()) == 92 + 12
    assert record.details["norms_fused"] == {"rmsnorm": 30, "add_rmsnorm": 62, "gated_rmsnorm": 12, "want_normed": 36}
    assert "decode:L0_attention_gated_rmsnorm_linear <- L0_attention_o_proj_linear" in record.details["fused"]
    assert "decode:L1_post_attention_layernorm_add_rmsnorm_linear <- L1_mlp_gate_linear" in record.details["fused"]
    assert "decode:L3_attention_q_a_layernorm_rmsnorm_linear <- L3_attention_q_b_proj_linear" in record.details["fused"]
    assert record.weights_added == record.weights_removed == []


def test_fused_nodes_take_the_norm_and_linear_arguments(fp32):
    """Arguments, names and meta of the post-attention (MoE: normed wanted), input (not wanted) and q_a fusions."""
    before, after, _ = fp32
    old = {n.name: n for n in before.graphs["decode"].nodes}
    new = {n.name: n for n in after.graphs["decode"].nodes}
    post = new["L1_post_attention_layernorm_add_rmsnorm_linear"]
    norm, gate = old["L1_post_attention_layernorm_add_rmsnorm"], old["L1_mlp_gate_linear"]
    names = lambda args: [str(a) for a in args]  # noqa: E731  (nodes of two programs compare by name)
    assert post.target is OPS.add_rmsnorm_linear
    assert names(post.args) == names((*norm.args, gate.args[1], torch.float32, True))
    assert post.meta["lingc.scope"] == norm.meta["lingc.scope"]
    # the gate read view(normed, [1, h]): the linear node is now the same view of y; the norm's getitems moved up one
    assert new["L1_mlp_gate_linear"].target is torch.ops.aten.view.default
    assert new["L1_mlp_gate_linear"].args == (new["L1_mlp_gate_linear_y"], [1, -1])
    assert new["L1_mlp_gate_linear_y"].args == (post, 0)
    assert new["L1_post_attention_layernorm_rmsnorm"].args == (post, 1) and new["L1_add"].args == (post, 2)
    assert new["L1_mlp_moe_up"].args[0].args[0] is new["L1_post_attention_layernorm_rmsnorm"]
    # the input norm only fed the fused projection: normed not wanted, its getitem gone
    inp = new["L1_input_layernorm_add_rmsnorm_linear"]
    assert inp.args[-1] is False and "L1_input_layernorm_rmsnorm" not in new
    assert new["L1_attention_fused_qkvfbg_linear"].args == (inp, 0)
    q_a = new["L3_attention_q_a_layernorm_rmsnorm_linear"]
    assert q_a.target is OPS.rmsnorm_linear and q_a.args[0] is new["L3_attention_q_a_proj_linear"]
    assert q_a.meta["lingc.tensor"][0].shape == old["L3_attention_q_b_proj_linear"].meta["lingc.tensor"].shape
    assert new["L3_attention_kv_a_layernorm_rmsnorm"].target is OPS.rmsnorm          # read by a cat: stays


def test_a_second_linear_reader_keeps_reading_normed(fp32):
    """Layers 3-5 keep their shared expert (no fuse_shared_expert here): the gate fuses, the shared gate_up reads
    normed, which the fused op therefore writes."""
    _, after, _ = fp32
    new = {n.name: n for n in after.graphs["decode"].nodes}
    shared = new["L3_mlp_shared_experts_gate_up_proj_linear"]
    assert shared.target is OPS.linear and shared.args[0].args[0] is new["L3_post_attention_layernorm_rmsnorm"]
    assert new["L3_post_attention_layernorm_add_rmsnorm_linear"].args[-1] is True


# ---- numerics --------------------------------------------------------------------------------------------

def test_reference_backend_is_bit_exact_fp32(fp32):
    before, after, _ = fp32
    assert_reference_exact(before, after, NUMERICS_GRAPHS)


def test_reference_backend_is_bit_exact_bf16_after_every_pass(bf16_all):
    before, after = bf16_all
    assert_reference_exact(before, after, NUMERICS_GRAPHS)


def test_greedy_nextn_equals_plain_with_every_pass(bf16_all):
    _, after = bf16_all
    assert_greedy_nextn_equals_plain(after, 12)


# ---- pdl, manager, artifact, CLI -------------------------------------------------------------------------

def test_pdl_router_chain_starts_at_the_fused_norm(bf16_all):
    _, after = bf16_all
    new = {n.name: n for n in after.graphs["decode"].nodes}
    assert new["L1_post_attention_layernorm_add_rmsnorm_linear"].meta["lingc.pdl"]["chain"] == "router@L1"
    assert new["L1_mlp_router_align"].meta["lingc.pdl"] == {"chain": "router@L1", "index": 1, "length": 2,
                                                            "early_launch": True}


def test_runs_after_the_passes_it_builds_on_and_before_pdl():
    order = [p.name for p in resolve(["all"], PASSES)]
    for earlier in FuseNormLinear.after:
        assert order.index(earlier) < order.index("fuse_norm_linear")
    assert order.index("fuse_norm_linear") < order.index("pdl")
    assert [p.name for p in resolve(["pdl", "fuse_norm_linear", "fuse_add_norm"], PASSES)] == \
        ["fuse_add_norm", "fuse_norm_linear", "pdl"]


def test_second_run_finds_nothing_and_input_is_untouched(fp32):
    before, after, _ = fp32
    text = program_text(before)
    again, record = FuseNormLinear().run(after)
    assert record.matches == 0 and program_text(again) == program_text(after)
    assert program_text(before) == text


def test_artifact_round_trip(fp32, tmp_path):
    _, after, _ = fp32
    loaded = load_artifact(write_artifact(CompileResult(only(after, ("decode",))), tmp_path / "art")).program
    assert program_text(loaded) == program_text(only(after, ("decode",)))
    report = compare_stages(only(after, ("decode",)), loaded, exact=True, tolerance=None)
    assert report["ok"], report


def test_listed_by_the_cli():
    result = CliRunner(env={"COLUMNS": "260", "NO_COLOR": "1"}).invoke(app, ["passes"])
    assert result.exit_code == 0, result.output
    assert re.search(r"fuse_norm_linear\s+│ rmsnorm / add_rmsnorm .* │ changed \(tol 0\.01\)", result.output)


def test_getitem_names_are_kept(fp32):
    """Every node name of the old program that still exists reads the same value: norms and linears became
    getitems of the fused op (or a view of its y) under their old names."""
    before, after, _ = fp32
    old = {n.name for n in before.graphs["decode"].nodes}
    kinds = {n.name: n.target for n in after.graphs["decode"].nodes if n.name in old}
    assert kinds["L0_attention_fused_qkvfbg_linear"] is operator.getitem
    assert kinds["lm_head_linear"] is operator.getitem and kinds["norm_rmsnorm"] is operator.getitem
    assert kinds["L0_attention_o_proj_linear"] is torch.ops.aten.view.default       # a view of the gated op's y


def test_gated_node_takes_the_norm_and_linear_arguments(fp32):
    before, after, _ = fp32
    old = {n.name: n for n in before.graphs["decode"].nodes}
    new = {n.name: n for n in after.graphs["decode"].nodes}
    norm, lin = old["L0_attention_gated_rmsnorm"], old["L0_attention_o_proj_linear"]
    fused = new["L0_attention_gated_rmsnorm_linear"]
    assert fused.target is OPS.gated_rmsnorm_linear
    assert [a.name if hasattr(a, "name") else a for a in fused.args] == \
        [norm.args[0].name, norm.args[1].name, norm.args[2].name, norm.args[3], lin.args[1].name, None]
    want = (*norm.meta["lingc.tensor"].shape[:-2], lin.meta["lingc.tensor"].shape[-1])
    assert fused.meta["lingc.tensor"].shape == want
    assert "L0_attention_gated_rmsnorm" not in new
