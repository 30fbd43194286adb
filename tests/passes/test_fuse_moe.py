"""fuse_moe: moe_up_act + moe_down + moe_combine -> one moe_fused, bit for bit.

Op counts per graph on the partitioned test-tiny program after fuse_swiglu (+ fuse_moe_align, fuse_shared_expert),
the fused node's arguments and name, a bit-exact program comparison on the reference ops (fp32 and bf16), the
pdl chain, the tp pass splitting it back, the manager order, idempotence and the artifact round trip. The kernel
against the three kernels: tests/kernels/test_moe_fused.py.
"""

from __future__ import annotations

import pytest
import torch

from lingc.artifact import load_artifact, write_artifact
from lingc.compile import CompileResult
from lingc.ir.text import program_text
from lingc.ops import OPS
from lingc.passes import PASSES
from lingc.passes.fuse_moe import FuseMoe, unfuse
from lingc.passes.manager import PassManager, resolve
from lingc.passes.verify import compare_stages
from lingc.program import Program
from pass_support import count, only  # noqa: E402  (tests/passes is on sys.path)

GRAPHS = ("prefill", "decode", "mtp_prefill", "mtp_decode", "step", "draft", "verify", "extend")
MOES = {"prefill": 5, "decode": 5, "mtp_prefill": 1, "mtp_decode": 1, "step": 5, "draft": 4, "verify": 5, "extend": 1}
BEFORE = ["partition", "fuse_swiglu", "fuse_moe_align", "fuse_shared_expert"]


@pytest.fixture(scope="module")
def forms(tiny_program: Program):
    before = PassManager(BEFORE).run(tiny_program).program
    after, record = FuseMoe().run(before)
    return before, after, record


@pytest.mark.parametrize("graph", GRAPHS)
def test_op_counts(forms, graph):
    before, after, _ = forms
    assert count(before, graph, "moe_up_act") == count(before, graph, "moe_down") == MOES[graph]
    assert count(before, graph, "moe_combine") == MOES[graph]
    for op in ("moe_up_act", "moe_down", "moe_combine"):
        assert count(after, graph, op) == 0, op
    assert count(after, graph, "moe_fused") == MOES[graph]


def test_record_and_node(forms):
    before, after, record = forms
    assert record.name == "fuse_moe" and not record.changes_numerics and record.matches == sum(MOES.values())
    fused = next(n for n in after.graphs["decode"].nodes if n.target is OPS.moe_fused)
    assert fused.name == "L1_mlp_moe_fused" and fused.meta["lingc.scope"] == "model.layers.1.mlp"
    x, w13, w2, weights, sp, be, total, k, bm, limit, *shared = fused.args
    assert w13.target.endswith("w13_interleaved_with_shared") or w13.target.endswith("w13_interleaved")
    assert w2.target.startswith("model.layers.1.mlp") and isinstance(k, int) and isinstance(bm, int)
    assert weights.args[1] == 0 and sp.args[1] == 2 and be.args[1] == 3 and total.args[1] == 4
    with_shared = [n for g in after.graphs.values() for n in g.nodes if n.target is OPS.moe_fused and len(n.args) == 11]
    assert with_shared, "layers whose shared expert did not fuse keep shared_out as the 11th argument"


def test_fp32_programs_are_bit_identical(forms):
    before, after, _ = forms
    report = compare_stages(before, after, exact=True, tolerance=None)
    assert report["ok"], {g: r["problems"] for g, r in report["graphs"].items()}


def test_bf16_programs_are_bit_identical(tiny_program_bf16):
    before = PassManager(BEFORE).run(only(tiny_program_bf16, ("decode", "step"))).program
    after, record = FuseMoe().run(before)
    assert record.matches == 10
    report = compare_stages(before, after, exact=True, tolerance=None)
    assert report["ok"], {g: r["problems"] for g, r in report["graphs"].items()}


def test_pdl_launches_the_fused_op(forms, tiny_program):
    """After fuse_moe_align the router chain ends at router_align, so the MoE chain is moe_fused alone: a "solo"
    PDL kernel; without fuse_moe_align the chain is moe_align -> moe_fused."""
    _, after, _ = forms
    scheduled = PassManager(["pdl"]).run(after).program
    fused = [n for n in scheduled.graphs["decode"].nodes if n.target is OPS.moe_fused]
    assert fused and all(n.meta["lingc.pdl"]["chain"] == "solo" for n in fused)
    plain = PassManager(["partition", "fuse_swiglu", "fuse_moe", "pdl"]).run(only(tiny_program, ("decode",))).program
    chains = {}
    for node in plain.graphs["decode"].nodes:
        label = node.meta.get("lingc.pdl", {}).get("chain", "")
        if label.startswith("moe@"):
            chains.setdefault(label, []).append(node.target)
    assert chains and all(ops == [OPS.moe_align, OPS.moe_fused] for ops in chains.values()), chains


def test_unfuse_restores_the_three_ops(forms):
    before, after, _ = forms
    program = after.copy()
    graph = program.graphs["decode"]
    for node in [n for n in graph.nodes if n.target is OPS.moe_fused]:
        unfuse(graph, node)
    graph.lint()
    for op in ("moe_up_act", "moe_down", "moe_combine"):
        assert count(program, "decode", op) == MOES["decode"]
    restored = {n.name: n.meta for n in graph.nodes if n.target in (OPS.moe_up_act, OPS.moe_down, OPS.moe_combine)}
    original = {n.name: n.meta for n in before.graphs["decode"].nodes if n.name in restored}
    assert restored.keys() == original.keys()                          # the names the three ops had
    assert all(restored[k]["lingc.tensor"] == original[k]["lingc.tensor"] for k in restored)
    report = compare_stages(only(before, ("decode",)), only(program, ("decode",)), exact=True, tolerance=None)
    assert report["ok"], report


def test_tp_splits_it_back(tiny_program):
    from lingc.passes.tp import TensorParallel
    program = PassManager(BEFORE + ["fuse_moe"]).run(only(tiny_program, ("decode",))).program
    sharded, _ = TensorParallel(2).run(program)
    assert count(sharded, "decode", "moe_fused") == 0 and count(sharded, "decode", "ep_combine") == MOES["decode"]


def test_opt_in_and_its_order():
    """Not in `all` (slower on the H200); named next to it, it runs after the MoE fusions and before pdl."""
    assert "fuse_moe" not in [p.name for p in resolve(["all"], PASSES)]
    order = [p.name for p in resolve(["all", "fuse_moe"], PASSES)]
    assert order.index("fuse_moe") > max(order.index(p) for p in ("fuse_swiglu", "fuse_moe_align", "fuse_shared_expert"))
    assert order.index("fuse_moe") < order.index("pdl")


def test_second_run_finds_nothing_and_input_is_untouched(forms):
    before, after, _ = forms
    text = program_text(before)
    again, record = FuseMoe().run(after)
    assert record.matches == 0 and program_text(again) == program_text(after)
    assert program_text(before) == text


def test_without_fuse_swiglu_nothing_fuses(tiny_partitioned):
    _, record = FuseMoe().run(tiny_partitioned)
    assert record.matches == 0


def test_artifact_round_trip(forms, tmp_path):
    _, after, _ = forms
    loaded = load_artifact(write_artifact(CompileResult(after), tmp_path / "art")).program
    assert program_text(loaded) == program_text(after)
