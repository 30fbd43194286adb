"""fuse_align_into_moe: router_align / moe_align + moe_up_act + moe_down -> router_topk + the pair-grid GEMMs.

Op counts per graph (prefill graphs left alone), the rewritten nodes' arguments, bit-exact programs in fp32 and
bf16, the ops against the aligned ops (bits, with forced shared pairs and every expert repeated across tokens),
what the pass leaves alone (fuse_moe's moe_fused), the PDL chain and its pre-wait safety, and `all` end to end.
"""

from __future__ import annotations

import operator

import pytest
import torch

from lingc.modules import MOE_BLOCK_M
from lingc.ops import OPS
from lingc.passes.fuse_align_into_moe import FuseAlignIntoMoe
from lingc.passes.manager import PassManager
from lingc.passes.verify import compare_stages
from lingc.program import Program
from pass_support import count

BEFORE = ["fuse_swiglu", "fuse_moe_align", "fuse_shared_expert"]
PAIRED = ("verify", "extend")               # 6 tokens a call; the rest run 1 (MIN_TOKENS) or are prefill
ROUTERS = {"prefill": 5, "decode": 5, "mtp_prefill": 1, "mtp_decode": 1, "step": 5, "draft": 4, "verify": 5, "extend": 1}


def _run(program: Program, passes: list[str]) -> Program:
    return PassManager(passes).run(program).program


@pytest.fixture(scope="module")
def aligned(tiny_partitioned: Program) -> Program:
    return _run(tiny_partitioned, BEFORE)


@pytest.fixture(scope="module")
def paired(aligned: Program):
    return FuseAlignIntoMoe().run(aligned)


@pytest.mark.parametrize("graph", list(ROUTERS))
def test_op_counts(aligned, paired, graph):
    after, _ = paired
    n = ROUTERS[graph]
    assert count(aligned, graph, "router_align") == count(aligned, graph, "moe_up_act") == n
    if graph in PAIRED:
        assert count(after, graph, "router_topk") == count(after, graph, "moe_up_act_pairs") == n
        assert count(after, graph, "moe_down_pairs") == n
        for op in ("router_align", "moe_align", "moe_up_act", "moe_down"):
            assert count(after, graph, op) == 0, op
    else:                                           # one-token layers and prefill chunks keep the aligned GEMMs
        assert count(after, graph, "router_align") == count(after, graph, "moe_down") == n
        assert count(after, graph, "moe_up_act_pairs") == 0


def test_record(paired):
    _, record = paired
    assert record.name == "fuse_align_into_moe" and not record.changes_numerics
    assert record.matches == sum(ROUTERS[g] for g in PAIRED) == 6
    one_token = [r for r in record.details["skipped"] if "1 token(s) a call, below MIN_TOKENS = 2" in r]
    assert len(one_token) == len(record.details["skipped"]) == sum(ROUTERS[g] for g in ("decode", "mtp_decode",
                                                                                       "step", "draft")) == 15


@pytest.mark.parametrize("graph", ["verify", "extend"])
def test_rewritten_nodes(aligned, paired, graph):
    after, _ = paired
    before = {n.name: n for n in aligned.graphs[graph].nodes}
    for up in [n for n in after.graphs[graph].nodes if n.target is OPS.moe_up_act_pairs]:
        old_up = before[up.name]                                     # names kept
        assert old_up.target is OPS.moe_up_act
        ids = up.args[2]
        router = ids.args[0]
        assert ids.target is operator.getitem and ids.args[1] == 1 and router.target is OPS.router_topk
        old_router = old_up.args[2].args[0]
        assert old_router.target is OPS.router_align
        # router_align(logits, bias, g, kg, k, scale, E, BM, S) -> router_topk(logits, bias, g, kg, k, scale, S)
        assert [str(a) for a in router.args] == [str(a) for a in (*old_router.args[:6], *old_router.args[8:])]
        assert [str(a) for a in (up.args[0], up.args[1], up.args[3])] == \
            [str(a) for a in (old_up.args[0], old_up.args[1], old_up.args[7])]
        down = next(u for u in up.users if u.target is OPS.moe_down_pairs)
        assert down.args[0] is up and down.args[2] is ids
        assert down.meta.get("lingc.tensor") == before[down.name].meta.get("lingc.tensor")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_programs_are_bit_exact(request, aligned, dtype):
    before = aligned if dtype == "fp32" else _run(request.getfixturevalue("tiny_program_bf16_partitioned"), BEFORE)
    after, record = FuseAlignIntoMoe().run(before)
    assert record.matches == 6
    report = compare_stages(before, after, exact=True, tolerance=None)
    assert report["ok"], {g: r["problems"] for g, r in report["graphs"].items()}
    assert all(r["max_abs_delta"] == 0.0 for r in report["graphs"].values())


@pytest.fixture(scope="module")
def tiny_program_bf16_partitioned(tiny_program_bf16: Program) -> Program:
    from lingc.passes.partition import Partition
    return Partition().run(tiny_program_bf16)[0]


# (tokens, experts, picks, shared): decode, a verify chain, 16 tokens (the pair grid's limit), 20 (past it)
SHAPES = [(1, 16, 4, 1), (6, 16, 4, 1), (6, 16, 4, 0), (16, 8, 4, 1), (20, 16, 4, 1)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "N{}-E{}-k{}-S{}".format(*s))
def test_pair_ops_equal_the_aligned_ops(shape):
    N, E, k, S = shape
    g = torch.Generator().manual_seed(N * 31 + E)
    h, inter = 32, 16
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)]).to(torch.int32)
    if S:
        ids = torch.cat([ids, torch.full((N, S), E, dtype=torch.int32)], 1)
    w13 = torch.randn(E + S, 2 * inter, h, generator=g).to(torch.bfloat16)
    w2 = torch.randn(E + S, h, inter, generator=g).to(torch.bfloat16)
    x = torch.randn(N, h, generator=g).to(torch.bfloat16)
    for limit in (0.0, 0.5):
        sp, be, tot = OPS.moe_align(ids, E + S, MOE_BLOCK_M)
        want = OPS.moe_up_act(x, w13, sp, be, tot, k + S, MOE_BLOCK_M, limit)
        got = OPS.moe_up_act_pairs(x, w13, ids, limit)
        assert torch.equal(got, want)
        assert torch.equal(OPS.moe_down_pairs(got, w2, ids), OPS.moe_down(want, w2, sp, be, tot, MOE_BLOCK_M))


def test_moe_fused_layers_are_left_alone(tiny_partitioned):
    before = _run(tiny_partitioned, [*BEFORE, "fuse_moe"])
    after, record = FuseAlignIntoMoe().run(before)
    assert record.matches == 0 and count(after, "verify", "moe_fused") == 5
    assert any("moe_fused" in reason for reason in record.details["skipped"])


def test_pdl_chain_and_prewait(aligned):
    after = _run(aligned, ["fuse_align_into_moe", "pdl"])
    down = next(n for n in after.graphs["verify"].nodes if n.target is OPS.moe_down_pairs)
    up = down.args[0]
    assert up.meta["lingc.pdl"]["chain"] == down.meta["lingc.pdl"]["chain"]          # one MoE chain
    assert (up.meta["lingc.pdl"]["index"], down.meta["lingc.pdl"]["index"]) == (0, 1)
    router = down.args[2].args[0]
    assert router.meta["lingc.pdl"]["chain"].startswith("router@")                    # the router chain's end
    assert down.meta["lingc.pdl"]["early_launch"]          # its pre-wait preload reads the ids two launches back


def test_in_all_and_after_the_moe_passes():
    from lingc.passes import PASSES
    from lingc.passes.manager import resolve
    order = [p.name for p in resolve(["all"], PASSES)]
    assert "fuse_align_into_moe" in order
    for earlier in ("fuse_moe_align", "fuse_shared_expert", "fuse_swiglu"):
        assert order.index(earlier) < order.index("fuse_align_into_moe")
    assert order.index("fuse_align_into_moe") < order.index("pdl")


def test_min_tokens_one_pairs_the_decode_layers_too(aligned, monkeypatch):
    import lingc.passes.fuse_align_into_moe as pass_module
    monkeypatch.setattr(pass_module, "MIN_TOKENS", 1)
    after, record = FuseAlignIntoMoe().run(aligned)
    assert record.matches == 21 and record.details["skipped"] == []
    assert count(after, "decode", "moe_up_act_pairs") == 5 and count(after, "decode", "router_align") == 0
    report = compare_stages(aligned, after, exact=True, tolerance=None)
    assert report["ok"], {g: r["problems"] for g, r in report["graphs"].items()}


def test_layers_past_the_pair_grid_stay_aligned(aligned, monkeypatch):
    """A layer with more tokens a call than the pair grid's row slots would be aligned twice by the launchers."""
    import lingc.passes.fuse_align_into_moe as pass_module
    monkeypatch.setattr(pass_module, "PAIR_GRID_TOKENS", 5)          # verify's and extend's 6 tokens are past it
    after, record = FuseAlignIntoMoe().run(aligned)
    assert record.matches == 0 and count(after, "verify", "router_align") == 5
    assert sum("6 tokens a call, past PAIR_GRID_TOKENS = 5" in r for r in record.details["skipped"]) == 6
