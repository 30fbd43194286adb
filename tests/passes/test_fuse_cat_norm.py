"""fuse_cat_norm: the MTP's cat([enorm(e), hnorm(h)], -1) -> one rmsnorm_cat, bit for bit.

Op and launch counts per graph on the partitioned test-tiny program, the fused node (the cat's name and place, the
norms' arguments), what must not match (a norm with another reader, a cat along another dim), bit-exact programs in
fp32 and bf16 (the reference backend and, in the interpreter, the Triton kernels), and a second run that finds
nothing. The kernel's own checks are in tests/kernels/test_rmsnorm_cat.py.
"""

from __future__ import annotations

import pytest
import torch

from lingc.ops import OPS
from lingc.passes.base import PassRecord, op_counts
from lingc.passes.fuse_cat_norm import FuseCatNorm, _norms
from lingc.passes.manager import PassManager
from lingc.passes.verify import compare_stages
from lingc.program import Program
from pass_support import count, launches  # noqa: E402  (tests/passes is on sys.path)

# MTP forwards per graph: the draft runs the MTP 4 times, extend and the two host-fed MTP programs once
MTP_FORWARDS = {"prefill": 0, "decode": 0, "mtp_prefill": 1, "mtp_decode": 1, "step": 0, "draft": 4, "verify": 0,
                "extend": 1}


@pytest.fixture(scope="module")
def fused(tiny_partitioned: Program) -> tuple[Program, PassRecord]:
    return FuseCatNorm().run(tiny_partitioned)


@pytest.mark.parametrize("graph", list(MTP_FORWARDS))
def test_op_and_launch_counts(tiny_partitioned, fused, graph):
    after, _ = fused
    k = MTP_FORWARDS[graph]
    assert count(after, graph, "rmsnorm_cat") == k
    cats = [op_counts(p.graphs[graph]).get("aten.cat", 0) for p in (tiny_partitioned, after)]
    assert cats[0] - cats[1] == k
    assert count(tiny_partitioned, graph, "rmsnorm") - count(after, graph, "rmsnorm") == 2 * k
    assert launches(tiny_partitioned, graph) - launches(after, graph) == 2 * k


def test_fused_node(tiny_partitioned, fused):
    after, record = fused
    assert record.name == "fuse_cat_norm" and not record.changes_numerics and record.matches == sum(MTP_FORWARDS.values())
    before = {n.name: n for n in tiny_partitioned.graphs["draft"].nodes}
    for node in after.graphs["draft"].nodes:
        if node.target is not OPS.rmsnorm_cat:
            continue
        old = before[node.name]                              # the cat's name and place
        assert old.target is torch.ops.aten.cat.default
        enorm, hnorm = old.args[0]
        assert "enorm" in enorm.name and "hnorm" in hnorm.name
        assert [str(a) for a in node.args] == [str(a) for a in (*enorm.args[:2], *hnorm.args)]
        assert [u.target for u in node.users] == [OPS.linear] and "eh_proj" in next(iter(node.users)).name
    assert FuseCatNorm().run(after)[1].matches == 0          # nothing left to fuse


def test_norm_with_another_reader_or_other_dim_is_left_alone(tiny_partitioned):
    program = tiny_partitioned.copy()
    graph = program.graphs["mtp_decode"]
    cat = next(n for n in graph.nodes if n.target is torch.ops.aten.cat.default and n.args[0][0].target is OPS.rmsnorm)
    output = next(n for n in graph.nodes if n.op == "output")
    output.args = ([*output.args[0], cat.args[0][0]],)      # the enorm is read by the output too
    assert not any(f.startswith("mtp_decode:") for f in FuseCatNorm().run(program)[1].details["fused"])
    program = tiny_partitioned.copy()
    graph = program.graphs["mtp_decode"]
    cat = next(n for n in graph.nodes if n.target is torch.ops.aten.cat.default and n.args[0][0].target is OPS.rmsnorm)
    assert _norms(cat) is not None
    cat.args = (cat.args[0], 0)                              # along the batch dim: not two rows' halves
    assert _norms(cat) is None


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_programs_are_bit_exact(request, dtype):
    before = request.getfixturevalue("tiny_partitioned" if dtype == "fp32" else "tiny_program_bf16")
    if dtype == "bf16":
        before = PassManager(["partition"]).run(before).program
    after, record = FuseCatNorm().run(before)
    assert record.matches == sum(MTP_FORWARDS.values())
    report = compare_stages(before, after, exact=True, tolerance=None)
    assert report["ok"], {g: r["problems"] for g, r in report["graphs"].items() if r["problems"]}
