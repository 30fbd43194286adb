"""fuse_router_into_moe: one token's router_align + moe_up_act + moe_down -> moe_up_act_routed + moe_down_routed.

Op counts per graph (one-token graphs rewritten, verify / extend / prefill left alone), the rewritten nodes'
arguments and names, bit-exact programs in fp32 and bf16, the skip reasons (more than one token, the ids read, too
many routed experts), the PDL chain and pre-wait rule, the tp pass's unfuse (bit-exact back to the aligned form), and
its place in the pass order (opt-in).
"""

from __future__ import annotations

import operator

import pytest

from lingc.ops import OPS
from lingc.passes.fuse_router_into_moe import FuseRouterIntoMoe, unfuse
from lingc.passes.manager import PassManager
from lingc.passes.verify import compare_stages
from lingc.program import Program
from pass_support import count

BEFORE = ["fuse_swiglu", "fuse_moe_align", "fuse_shared_expert", "fuse_combine_norm", "fuse_align_into_moe"]
ONE_TOKEN = {"decode": 5, "mtp_decode": 1, "step": 5, "draft": 4}     # MoE layers a call on one token
LEFT = ("prefill", "mtp_prefill", "verify", "extend")


def _run(program: Program, passes: list[str]) -> Program:
    return PassManager(passes).run(program).program


@pytest.fixture(scope="module")
def before(tiny_partitioned: Program) -> Program:
    return _run(tiny_partitioned, BEFORE)


@pytest.fixture(scope="module")
def routed(before: Program):
    return FuseRouterIntoMoe().run(before)


@pytest.mark.parametrize("graph", [*ONE_TOKEN, *LEFT])
def test_op_counts(before, routed, graph):
    after, _ = routed
    if graph in ONE_TOKEN:
        n = ONE_TOKEN[graph]
        assert count(before, graph, "router_align") == count(before, graph, "moe_up_act") == n
        assert count(after, graph, "moe_up_act_routed") == count(after, graph, "moe_down_routed") == n
        for op in ("router_align", "router_topk", "moe_up_act", "moe_down"):
            assert count(after, graph, op) == 0, op
    else:
        assert count(after, graph, "moe_up_act_routed") == 0
        for op in ("router_align", "router_topk", "moe_up_act", "moe_down", "moe_up_act_pairs"):
            assert count(after, graph, op) == count(before, graph, op), op


def test_record(routed):
    _, record = routed
    assert record.name == "fuse_router_into_moe" and not record.changes_numerics
    assert record.matches == sum(ONE_TOKEN.values()) == 15
    assert all("pair rows a call, not one token's" in r for r in record.details["skipped"])
    assert len(record.details["skipped"]) == 6            # prefill's 5 layers and mtp_prefill's one


@pytest.mark.parametrize("graph", list(ONE_TOKEN))
def test_rewritten_nodes(before, routed, graph):
    after, _ = routed
    old = {n.name: n for n in before.graphs[graph].nodes}
    for up in [n for n in after.graphs[graph].nodes if n.target is OPS.moe_up_act_routed]:
        old_up = old[up.name]                                                    # names kept
        old_router = old_up.args[2].args[0]
        assert old_up.target is OPS.moe_up_act and old_router.target is OPS.router_align
        # router_align(logits, bias, g, kg, k, scale, E, BM, S) -> (logits, bias, g, kg, k, scale, S)
        shared = old_router.args[8] if len(old_router.args) > 8 else 0
        route = [str(a) for a in (*old_router.args[:6], shared)]
        assert [str(a) for a in up.args] == [str(old_up.args[0]), str(old_up.args[1]), *route, str(old_up.args[7])]
        down = next(u for u in up.users if u.target is OPS.moe_down_routed)
        assert old[down.name].target is OPS.moe_down and [str(a) for a in down.args[2:]] == route
        items = {u.args[1]: u for u in down.users}
        assert set(items) == {0, 1} and all(u.target is operator.getitem for u in items.values())
        assert items[0].name == f"{down.name}_out" and items[1].name == f"{down.name}_weights"
        combine = next(iter(items[0].users))
        assert combine.target in (OPS.moe_combine, OPS.combine_add_rmsnorm) and items[1] in combine.args
        assert "lingc.launch" not in up.meta                # the aligned kernel's shared_last hint is gone


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_programs_are_bit_exact(request, before, dtype):
    if dtype == "bf16":
        from lingc.passes.partition import Partition
        before = _run(Partition().run(request.getfixturevalue("tiny_program_bf16"))[0], BEFORE)
    after, record = FuseRouterIntoMoe().run(before)
    assert record.matches == 15
    report = compare_stages(before, after, exact=True, tolerance=None)
    assert report["ok"], {g: r["problems"] for g, r in report["graphs"].items()}
    assert all(r["max_abs_delta"] == 0.0 for r in report["graphs"].values())


def test_read_ids_and_large_routers_are_left_alone(before, monkeypatch):
    import lingc.passes.fuse_router_into_moe as pass_module
    monkeypatch.setattr(pass_module, "ROUTED_MAX_EXPERTS", 8)                 # test-tiny routes 16
    after, record = FuseRouterIntoMoe().run(before)
    assert record.matches == 0 and count(after, "decode", "router_align") == 5
    assert sum("16 routed experts, past ROUTED_MAX_EXPERTS = 8" in r for r in record.details["skipped"]) == 15
    monkeypatch.undo()
    graph = before.graphs["decode"]
    router = next(n for n in graph.nodes if n.target is OPS.router_align)
    order = {n: i for i, n in enumerate(graph.nodes)}
    assert isinstance(pass_module._layer(router, order), tuple)
    with graph.inserting_after(router):
        ids = graph.call_function(operator.getitem, (router, 1))
    try:
        assert "its expert ids are read" in pass_module._layer(router, order)
    finally:
        graph.erase_node(ids)


def test_pdl_chain_and_prewait(before):
    after = _run(before, ["fuse_router_into_moe", "pdl"])
    down = next(n for n in after.graphs["decode"].nodes if n.target is OPS.moe_down_routed)
    up = down.args[0]
    assert up.meta["lingc.pdl"]["chain"] == down.meta["lingc.pdl"]["chain"]          # one MoE chain
    assert (up.meta["lingc.pdl"]["index"], down.meta["lingc.pdl"]["index"]) == (0, 1)
    assert down.meta["lingc.pdl"]["early_launch"]            # it routes before its wait from logits two launches back


def test_unfuse_restores_the_aligned_layer_bit_exact(before):
    undone, _ = FuseRouterIntoMoe().run(before)                              # a fresh copy to undo
    for graph in undone.graphs.values():
        for down in [n for n in graph.nodes if n.target is OPS.moe_down_routed]:
            stack = undone.weights[down.args[1].target]
            assert unfuse(graph, down, int(stack.shape[0])).target is OPS.moe_down
        graph.lint()
    for g in ONE_TOKEN:
        assert count(undone, g, "router_align") == count(undone, g, "moe_down") == ONE_TOKEN[g]
        assert count(undone, g, "moe_up_act_routed") == count(undone, g, "moe_down_routed") == 0
    report = compare_stages(before, undone, exact=True, tolerance=None)
    assert report["ok"], {g: r["problems"] for g, r in report["graphs"].items()}


def test_opt_in_and_after_the_moe_passes():
    """Opt-in (measured slower on an H100, the pass's docstring): `all` leaves it out; named, it runs after the MoE
    passes and before pdl."""
    from lingc.passes import PASSES
    from lingc.passes.manager import resolve
    assert "fuse_router_into_moe" not in [p.name for p in resolve(["all"], PASSES)]
    order = [p.name for p in resolve(["all", "fuse_router_into_moe"], PASSES)]
    for earlier in ("fuse_moe_align", "fuse_shared_expert", "fuse_swiglu", "fuse_align_into_moe", "fuse_combine_norm"):
        assert order.index(earlier) < order.index("fuse_router_into_moe")
    assert order.index("fuse_router_into_moe") < order.index("pdl")
