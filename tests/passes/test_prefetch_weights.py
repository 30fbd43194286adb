"""prefetch_weights: l2_prefetch hints after each streaming launch, ahead of the big projection that follows.

On test-tiny after partition and every pass of `all` plus this opt-in one (it runs last, after pdl), with the pass's
byte thresholds scaled down to test-tiny's KB weights (at Ling-3.0-tiny's sizes the defaults pick the KDA / MLA
projections, o_proj, the MLA dense and the lm_head): where each hint sits and what it names (no PDL annotation),
launch counts, the reference backend bit-exact and greedy NEXTN == plain decoding with the hints, the IR lint and
fx's dead-code elimination keeping the result-less op, the JSON round trip, the tp pass sharding around it, the
ENABLED switch, ANCHOR_SKIP, and the executor lowering the hint as a side-stream launch; then the same for the
experts' hints (EXPERTS / EXPERT_W2: right after each up-GEMM's router ids, none in prefill, dropped by tp) and
for the MLA cache's (MLA_CACHE: before each mla_attention of up to 16 queries, after a streaming launch, none in
prefill)."""

from __future__ import annotations

import operator

import pytest
import torch

import lingc.passes.prefetch_weights as PW
from lingc.ir.serialize import graph_from_json, graph_to_json
from lingc.ops import OPS
from lingc.ops.prefetch import clip
from lingc.passes.manager import CompileResult, PassManager
from lingc.passes.matchers import calls, is_free
from lingc.passes.tp import run_tp_stage
from lingc.program import Program
from pass_support import assert_reference_exact, count, greedy_tokens, launches, only   # tests/passes is on sys.path

GRAPHS = ("decode", "verify", "draft", "extend")
SMALL = {"TARGET_MIN_BYTES": 16 << 10, "WINDOW_MIN_BYTES": 8 << 10, "MAX_BYTES": 32 << 10}


@pytest.fixture(scope="module")
def programs(tiny_partitioned: Program):
    before = PassManager(["all"]).run(tiny_partitioned).program
    with pytest.MonkeyPatch.context() as mp:
        for key, value in SMALL.items():
            mp.setattr(PW, key, value)
        result = PassManager(["all", "prefetch_weights"]).run(tiny_partitioned)
    record = next(r for r in result.records if r.name == "prefetch_weights")
    return before, result.program, record


@pytest.fixture
def small(monkeypatch):
    """The scaled-down thresholds for the checks that call the pass's helpers."""
    for key, value in SMALL.items():
        monkeypatch.setattr(PW, key, value)


def _launches_before(node):
    prev = node.prev
    while prev.op != "root" and (prev.op != "call_function" or is_free(prev)):
        prev = prev.prev
    return prev


def test_opt_in_and_default_thresholds(tiny_partitioned, programs):
    """Not in `all`; named, at the Ling-sized defaults it has no target in test-tiny's KB weights."""
    before, _, _ = programs
    assert not PW.PrefetchWeights.in_all and all(count(before, g, "l2_prefetch") == 0 for g in before.graphs)
    result = PassManager(["all", "prefetch_weights"]).run(only(tiny_partitioned, ("decode",)))
    assert count(result.program, "decode", "l2_prefetch") == 0


@pytest.mark.parametrize("graph", GRAPHS)
def test_hints_sit_after_a_stream_before_their_target(programs, graph, small):
    before, after, record = programs
    hints = calls(after.graphs[graph], "l2_prefetch")
    rows = [r for r in record.details["prefetches"] if r["graph"] == graph]
    assert hints and len(hints) == len(rows)
    assert launches(after, graph) == launches(before, graph) + len(hints)
    names = {n.name: n for n in after.graphs[graph].nodes}
    for hint, row in zip(hints, rows):
        weight, start, nbytes = hint.args
        assert weight.op == "get_attr" and weight.target == row["weight"] and start == 0
        size = PW._bytes(weight)
        assert size >= SMALL["TARGET_MIN_BYTES"]
        assert nbytes == (-1 if size <= SMALL["MAX_BYTES"] else SMALL["MAX_BYTES"])
        stream = _launches_before(hint)
        assert stream.name == row["after"] and PW._streams(stream)
        target = names[row["before"]]
        assert PW._weight(target) is weight
        between = []               # the launches from the hint to its target: none streams, at least one runs
        node = hint.next
        while node is not target:
            if node.op == "call_function" and not is_free(node) and node.target is not OPS.l2_prefetch:
                between.append(node)
            node = node.next
        assert between and not any(PW._streams(n) for n in between)
        assert "lingc.pdl" not in hint.meta          # the runtime launches it off the chain (a side stream)
        assert hint.meta.get("lingc.scope") == target.meta.get("lingc.scope")


def test_record(programs):
    _, after, record = programs
    assert not record.changes_numerics and record.details["enabled"]
    assert record.matches == len(record.details["prefetches"]) == sum(
        count(after, g, "l2_prefetch") for g in after.graphs)


@pytest.mark.parametrize("fixture", ["programs", "expert_programs", "cache_programs"],
                         ids=["weights", "experts", "mla-cache"])
def test_reference_exact_and_greedy_parity(request, fixture):
    """With either family of hints: the reference backend's values bit for bit, greedy NEXTN == plain decoding."""
    before, after, _ = request.getfixturevalue(fixture)
    assert_reference_exact(before, after, ("decode", "verify", "draft"))
    assert greedy_tokens(after, "nextn") == greedy_tokens(before, "nextn") == greedy_tokens(after, "none")


def test_kept_by_dead_code_elimination_and_json(programs):
    _, after, _ = programs
    graph = after.copy().graphs["decode"]
    n = len(calls(graph, "l2_prefetch"))
    graph.eliminate_dead_code()
    assert len(calls(graph, "l2_prefetch")) == n > 0
    loaded = graph_from_json(graph_to_json(after.graphs["decode"]), "decode")
    assert [(x.name, x.target) for x in loaded.nodes] == [(x.name, x.target) for x in after.graphs["decode"].nodes]


def test_tp_shards_around_the_hints(programs):
    _, after, _ = programs
    result = CompileResult(only(after, ("decode",)))
    run_tp_stage(result, 2)
    hints = calls(result.program.graphs["decode"], "l2_prefetch")
    assert len(hints) == count(after, "decode", "l2_prefetch")
    for hint in hints:                 # each still names a weight of the (sharded) program
        assert hint.args[0].target in result.program.weights


def test_disabled_inserts_nothing(tiny_partitioned, small, monkeypatch):
    monkeypatch.setattr(PW, "ENABLED", False)
    result = PassManager(["all", "prefetch_weights"]).run(only(tiny_partitioned, ("decode",)))
    record = next(r for r in result.records if r.name == "prefetch_weights")
    assert record.matches == 0 and count(result.program, "decode", "l2_prefetch") == 0


def _stream_launches_between(first, last):
    """The streaming launches strictly between two nodes of a graph (hints not counted)."""
    found, node = [], first.next
    while node is not last:
        launch = node.op == "call_function" and not is_free(node) and node.target is not OPS.l2_prefetch
        if launch and PW._streams(node):
            found.append(node)
        node = node.next
    return found


def test_anchor_skip_moves_each_hint_one_stream_earlier(tiny_partitioned, small, monkeypatch):
    """ANCHOR_SKIP 2: every hint follows the second-nearest streaming launch before its target, so exactly one
    streaming launch (the default's anchor) runs between the hint and the target; a target with a single stream
    before it gets none. Values unchanged."""
    program = only(tiny_partitioned, ("decode",))
    nearest = PassManager(["all", "prefetch_weights"]).run(program)
    monkeypatch.setattr(PW, "ANCHOR_SKIP", 2)
    earlier = PassManager(["all", "prefetch_weights"]).run(program)
    rows = {r["before"]: r for r in next(r for r in earlier.records if r.name == "prefetch_weights").details[
        "prefetches"]}
    base = {r["before"]: r for r in next(r for r in nearest.records if r.name == "prefetch_weights").details[
        "prefetches"]}
    assert rows and set(rows) <= set(base) and all(r["after"] != base[t]["after"] for t, r in rows.items())
    graph = earlier.program.graphs["decode"]
    names = {n.name: n for n in graph.nodes}
    for target, row in rows.items():
        hint = names[row["node"]]
        assert _launches_before(hint).name == row["after"]
        assert [n.name for n in _stream_launches_between(hint, names[target])] == [base[target]["after"]]
    assert_reference_exact(nearest.program, earlier.program, ("decode",))


def test_anchor_skip_below_one_is_an_error(tiny_partitioned, small, monkeypatch):
    monkeypatch.setattr(PW, "ANCHOR_SKIP", 0)
    with pytest.raises(ValueError, match=r"ANCHOR_SKIP \(LINGC_PREFETCH_ANCHOR_SKIP\) must be an integer of at least "
                                         r"1, got 0"):
        PassManager(["all", "prefetch_weights"]).run(only(tiny_partitioned, ("decode",)))


@pytest.mark.parametrize("total, start, nbytes, want", [
    (1000, 0, -1, (0, 1000)), (1000, 100, 200, (100, 200)), (1000, 900, 500, (900, 100)),
    (1000, 2000, 10, (1000, 0)), (1000, -5, -1, (0, 1000)),
])
def test_clip(total, start, nbytes, want):
    """The op's range is clipped to the tensor (a tp shard is smaller than the weight the pass saw)."""
    assert clip(total, start, nbytes) == want


def test_lowered_as_a_side_launch_without_pdl(programs):
    """The triton backend lowers the hint to a side-stream launch (runtime/executor.py), never PDL-launched; on CPU
    the executor runs it inline (a no-op there)."""
    from lingc.runtime.executor import lower

    _, after, _ = programs
    low = lower(after, "decode", backend="triton", pdl=True)
    hints = [x for x in low.launches if x.label == "triton:l2_prefetch"]
    assert hints and all(x.side and "pdl" not in x.kwargs for x in hints)
    assert not any(x.side for x in low.launches if x.label != "triton:l2_prefetch")


def test_reference_op_is_a_no_op():
    w = torch.randn(4, 8)
    assert OPS.l2_prefetch(w, 0, -1) is None


# ---- the routed experts' hints (EXPERTS / EXPERT_W2, bench A/B knobs; off by default) ------------------------------

UPS = ("moe_up", "moe_up_act", "moe_up_act_pairs")


@pytest.fixture(scope="module")
def expert_programs(tiny_partitioned: Program, programs):
    """`all` + prefetch_weights with only the experts' hints (w13 and w2); `before` is `all` alone. Both without
    fuse_router_into_moe: its one-token layers have no router ids to hint from (they live inside the GEMMs)."""
    from lingc.passes.fuse_router_into_moe import FuseRouterIntoMoe
    return _with_hints(tiny_partitioned, [(PW, "WEIGHTS", False), (PW, "EXPERTS", True), (PW, "EXPERT_W2", True)],
                       both=[(FuseRouterIntoMoe, "in_all", False)])


def _with_hints(program: Program, knobs, both=()):
    """(`all`, `all` + prefetch_weights, its record) of `program`, each (owner, attribute, value) of `both` set for
    the two compiles and each of `knobs` for the second only."""
    with pytest.MonkeyPatch.context() as mp:
        for owner, key, value in both:
            mp.setattr(owner, key, value)
        before = PassManager(["all"]).run(program).program
        for owner, key, value in knobs:
            mp.setattr(owner, key, value)
        result = PassManager(["all", "prefetch_weights"]).run(program)
    record = next(r for r in result.records if r.name == "prefetch_weights")
    return before, result.program, record


def _ups(graph):
    return [n for n in graph.nodes if n.op == "call_function" and any(n.target is OPS[u] for u in UPS)]


def _between(first, last):
    node, found = first.next, []
    while node is not last:
        found.append(node)
        node = node.next
    return found


def test_expert_hints_off_by_default(programs):
    _, after, record = programs
    assert not PW.EXPERTS and not record.details["experts"] and not record.details["expert_prefetches"]
    assert all(count(after, g, "l2_prefetch_experts") == 0 for g in after.graphs)


@pytest.mark.parametrize("graph", GRAPHS)
def test_expert_hints_sit_right_before_each_up_gemm(expert_programs, graph):
    """w13's then w2's hint right after every up-GEMM's router launch (before launches pdl moved in between, e.g.
    test-tiny's unfused shared experts); each names its up-GEMM's and down-GEMM's weights and the router's ids (the
    pair grid's own ids argument, else router_align's output 1)."""
    before, after, record = expert_programs
    g = after.graphs[graph]
    ups = _ups(g)
    hints = calls(g, "l2_prefetch_experts")
    assert ups and len(hints) == 2 * len(ups) and count(after, graph, "l2_prefetch") == 0
    assert launches(after, graph) == launches(before, graph) + len(hints)
    rows = [r for r in record.details["expert_prefetches"] if r["graph"] == graph]
    assert len(rows) == len(hints)
    names = {n.name: n for n in g.nodes}
    for up in ups:
        w13_hint, w2_hint = (names[r["node"]] for r in rows if r["before"] == up.name)
        router = _launches_before(w13_hint)
        assert _launches_before(w2_hint) is w13_hint and not any(n in _ups(g) for n in _between(w2_hint, up))
        assert w13_hint.target is w2_hint.target is OPS.l2_prefetch_experts
        assert w13_hint.args[0] is up.args[1] and w13_hint.args[2] == w2_hint.args[2] == -1
        down = next(u for u in up.users if u.target in (OPS.moe_down, OPS.moe_down_pairs))
        assert w2_hint.args[0] is down.args[1] and w13_hint.args[1] is w2_hint.args[1]
        ids = w13_hint.args[1]
        if up.target is OPS.moe_up_act_pairs:
            assert ids is up.args[2] and router.target is OPS.router_topk
        else:
            assert router.target is OPS.router_align
            assert ids.target is operator.getitem and ids.args == (router, 1) and up.args[2].args == (router, 2)
        assert "lingc.pdl" not in w13_hint.meta and w13_hint.meta.get("lingc.scope") == up.meta.get("lingc.scope")


def test_expert_hints_skip_prefill(tiny_program):
    """Prefill's up-GEMMs (32 tokens here) get no experts' hint: their picks cover most experts."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(PW, "EXPERTS", True)
        result = PassManager(["all", "prefetch_weights"]).run(only(tiny_program, ("prefill", "decode")))
    assert _ups(result.program.graphs["prefill"]) and count(result.program, "prefill", "l2_prefetch_experts") == 0
    assert count(result.program, "decode", "l2_prefetch_experts") == len(_ups(result.program.graphs["decode"])) > 0


def _lint_dce_json(after: Program, op: str) -> None:
    """The IR lint passes; dead-code elimination keeps verify's result-less `op` hints; decode's JSON round trip keeps
    every node, the hints among them."""
    from lingc.ir.lint import lint

    lint(after)
    graph = after.copy().graphs["verify"]
    n = len(calls(graph, op))
    graph.eliminate_dead_code()
    assert len(calls(graph, op)) == n > 0
    loaded = graph_from_json(graph_to_json(after.graphs["decode"]), "decode")
    assert [x for x in loaded.nodes if x.target is OPS[op]] != []
    assert [(x.name, x.target) for x in loaded.nodes] == [(x.name, x.target) for x in after.graphs["decode"].nodes]


def test_expert_hints_lint_dce_json(expert_programs):
    _lint_dce_json(expert_programs[1], "l2_prefetch_experts")


def test_tp_drops_the_expert_hints(expert_programs):
    """A rank holds a slice of the experts and the ids are global: the tp pass removes the hints and says so."""
    _, after, _ = expert_programs
    result = CompileResult(only(after, ("decode",)))
    run_tp_stage(result, 2)
    assert count(result.program, "decode", "l2_prefetch_experts") == 0
    tp = next(r for r in result.records if r.name == "tp")
    assert tp.details["dropped_expert_hints"] == count(after, "decode", "l2_prefetch_experts") > 0


def test_expert_hints_lowered_as_side_launches(expert_programs):
    from lingc.runtime.executor import lower

    _, after, _ = expert_programs
    low = lower(after, "verify", backend="triton", pdl=True)
    hints = [x for x in low.launches if x.label == "triton:l2_prefetch_experts"]
    assert hints and all(x.side and "pdl" not in x.kwargs for x in hints)


# ---- the MLA cache's hints (MLA_CACHE, CACHE_ANCHOR_SKIP; a bench A/B knob, off by default) ------------------------

@pytest.fixture(scope="module")
def cache_programs(tiny_partitioned: Program):
    """`all` + prefetch_weights with only the cache hints, at the scaled-down stream threshold; `before` is `all`."""
    knobs = [(PW, key, value) for key, value in SMALL.items()] + [(PW, "WEIGHTS", False), (PW, "MLA_CACHE", True)]
    return _with_hints(tiny_partitioned, knobs)


def test_cache_hints_off_by_default(programs):
    _, after, record = programs
    assert not PW.MLA_CACHE and not record.details["mla_cache"] and not record.details["cache_prefetches"]
    assert all(count(after, g, "l2_prefetch_pages") == 0 for g in after.graphs)


@pytest.mark.parametrize("graph", GRAPHS)
def test_cache_hints_sit_after_a_stream_before_each_mla_attention(cache_programs, graph, small):
    """One hint a mla_attention (the draft's four MTP steps too), naming its cache, page table and positions, right
    after the nearest streaming launch before it (no stream between), no PDL annotation, its scope."""
    before, after, record = cache_programs
    g = after.graphs[graph]
    targets = calls(g, "mla_attention")
    hints = calls(g, "l2_prefetch_pages")
    assert targets and len(hints) == len(targets) and count(after, graph, "l2_prefetch") == 0
    assert launches(after, graph) == launches(before, graph) + len(hints)
    rows = {r["before"]: r for r in record.details["cache_prefetches"] if r["graph"] == graph}
    names = {n.name: n for n in g.nodes}
    for target in targets:
        hint = names[rows[target.name]["node"]]
        assert hint.args == (target.args[2], target.args[4], target.args[5])
        stream = _launches_before(hint)
        assert stream.name == rows[target.name]["after"] and PW._streams(stream)
        assert not _stream_launches_between(hint, target)
        assert "lingc.pdl" not in hint.meta and hint.meta.get("lingc.scope") == target.meta.get("lingc.scope")


def test_cache_hints_skip_prefill_and_anchor_skip(tiny_program, small, monkeypatch):
    """Prefill's mla_attention (32 queries) gets none; CACHE_ANCHOR_SKIP 2 puts one more stream between hint and
    target; below 1 is an error naming the variable."""
    monkeypatch.setattr(PW, "MLA_CACHE", True)
    monkeypatch.setattr(PW, "WEIGHTS", False)
    program = only(tiny_program, ("prefill", "decode"))
    result = PassManager(["all", "prefetch_weights"]).run(program)
    assert calls(result.program.graphs["prefill"], "mla_attention")
    assert count(result.program, "prefill", "l2_prefetch_pages") == 0
    assert count(result.program, "decode", "l2_prefetch_pages") == len(calls(result.program.graphs["decode"],
                                                                               "mla_attention")) > 0
    monkeypatch.setattr(PW, "CACHE_ANCHOR_SKIP", 2)
    earlier = PassManager(["all", "prefetch_weights"]).run(program).program.graphs["decode"]
    names = {n.name: n for n in earlier.nodes}
    for hint in calls(earlier, "l2_prefetch_pages"):
        target = names[hint.name.removesuffix("_l2_prefetch_pages")]
        assert len(_stream_launches_between(hint, target)) == 1
    monkeypatch.setattr(PW, "CACHE_ANCHOR_SKIP", 0)
    with pytest.raises(ValueError, match=r"CACHE_ANCHOR_SKIP \(LINGC_PREFETCH_CACHE_ANCHOR_SKIP\) must be at least 1"):
        PassManager(["all", "prefetch_weights"]).run(program)


def test_cache_hints_lint_dce_json_tp_and_lowering(cache_programs):
    """The IR lint passes, dead-code elimination keeps the result-less hint, JSON round-trips it, the tp pass keeps
    it (every rank holds the whole latent cache), and the triton backend lowers it as a side launch without PDL."""
    from lingc.runtime.executor import lower

    _, after, _ = cache_programs
    _lint_dce_json(after, "l2_prefetch_pages")
    result = CompileResult(only(after, ("decode",)))
    run_tp_stage(result, 2)
    assert count(result.program, "decode", "l2_prefetch_pages") == count(after, "decode", "l2_prefetch_pages")
    low = lower(after, "verify", backend="triton", pdl=True)
    hints = [x for x in low.launches if x.label == "triton:l2_prefetch_pages"]
    assert hints and all(x.side and "pdl" not in x.kwargs for x in hints)
