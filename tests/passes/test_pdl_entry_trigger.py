"""pdl: a short kernel whose next launch is a linear gets the launch hint entry_trigger (passes/pdl.py
`mark_entry_triggers`, kernels/pdl.py), and only there: the linear reads nothing but weights before its wait."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

import lingc.passes.pdl as pdl_pass
from lingc.ops import OPS
from lingc.passes.pdl import SOLO_META, Pdl, mark_entry_triggers
from lingc.ir.shapes import TensorMeta
from lingc.program import Program
from lingc.runtime.executor import launch_hints


def _graph(after: str, rows: int = 1, norm_op: str = "gated_rmsnorm",
           weight: tuple[int, int] | None = None) -> tuple[fx.Graph, fx.Node]:
    """kda output -> gated_rmsnorm (or rmsnorm) -> (a view) -> `after` (linear over `rows` rows, or router_align),
    every call PDL-annotated; `weight`: the linear weight's shape meta (bf16)."""
    g = fx.Graph()
    x, w, gate, wo, bias = (g.placeholder(n) for n in ("x", "w", "gate", "wo", "bias"))
    if weight is not None:
        wo.meta["lingc.tensor"] = TensorMeta(weight, torch.bfloat16)
    if norm_op == "gated_rmsnorm":
        norm = g.call_function(OPS.gated_rmsnorm, (x, w, gate, 1e-6))
    else:
        norm = g.call_function(OPS.rmsnorm, (x, w, 1e-6))
    view = g.call_function(operator.getitem, (norm, 0))           # free: launches nothing
    if after == "linear":
        nxt = g.call_function(OPS.linear, (view, wo))
        nxt.meta["lingc.tensor"] = TensorMeta((1, rows, 64), torch.bfloat16)
    else:
        nxt = g.call_function(OPS.router_align, (view, bias, 4, 2, 4, 2.5, 17, 16))
    g.output(nxt)
    for n in g.nodes:
        if n.op == "call_function":
            n.meta["lingc.pdl"] = dict(SOLO_META)
    return g, norm


def test_a_norm_before_a_linear_triggers_at_entry():
    g, norm = _graph("linear")
    assert mark_entry_triggers(g) == [norm.name]
    assert norm.meta["lingc.launch"] == {"entry_trigger": True}
    assert launch_hints(norm) == {"entry_trigger": True}       # the executor accepts it for this op
    lin = next(n for n in g.nodes if n.target is OPS.linear)
    assert launch_hints(lin) == {"launched_early": True}       # the linear is told (kernels/linear_tma.py)


def test_row_limits(monkeypatch):
    """By default only one-row linears follow an entry trigger (kernels/linear_tma.py MAX_ROWS); the KDA o_norm and MLA
    attention also before verify's six rows (ENTRY_TRIGGER_ROWS: o_proj / the dense then take the Gluon path, which
    measured faster), the other norms not (the combine before verify's KDA projection measured slower)."""
    g, norm = _graph("linear", rows=6)
    assert mark_entry_triggers(g) == [norm.name]
    g, norm = _graph("linear", rows=6, norm_op="rmsnorm")
    assert mark_entry_triggers(g) == []
    g, norm = _graph("linear", rows=1, norm_op="rmsnorm")
    assert mark_entry_triggers(g) == [norm.name]
    monkeypatch.setattr(pdl_pass, "ENTRY_TRIGGER_ROWS", {})
    g, norm = _graph("linear", rows=6)
    assert mark_entry_triggers(g) == []
    g, norm = _graph("linear")
    next(n for n in g.nodes if n.target is OPS.linear).meta.pop("lingc.tensor")
    assert mark_entry_triggers(g) == []                        # no shape meta: not marked


def test_small_weights_take_the_higher_row_limit(monkeypatch):
    """ENTRY_TRIGGER_SMALL_ROWS (off by default): a plain linear of at most ENTRY_TRIGGER_SMALL_WEIGHT_BYTES after any
    entry op is marked up to that row limit (the MLA q_a / kv_a / gate projection after the combine at verify's six
    rows); a larger weight (the 31.5 MB KDA projection) or one without shape meta keeps the op's own limit."""
    small, large = (848, 1536), (10256, 1536)
    g, norm = _graph("linear", rows=6, norm_op="rmsnorm", weight=small)
    assert mark_entry_triggers(g) == []                                       # off by default
    monkeypatch.setattr(pdl_pass, "ENTRY_TRIGGER_SMALL_ROWS", 16)
    g, norm = _graph("linear", rows=6, norm_op="rmsnorm", weight=small)
    assert mark_entry_triggers(g) == [norm.name]
    assert launch_hints(next(n for n in g.nodes if n.target is OPS.linear)) == {"launched_early": True}
    for weight in (large, None):
        g, norm = _graph("linear", rows=6, norm_op="rmsnorm", weight=weight)
        assert mark_entry_triggers(g) == [], weight
    g, norm = _graph("linear", rows=17, norm_op="rmsnorm", weight=small)
    assert mark_entry_triggers(g) == []


def test_no_hint_before_a_kernel_that_reads_activations_early():
    g, norm = _graph("router_align")
    assert mark_entry_triggers(g) == []
    assert "lingc.launch" not in norm.meta


def test_no_hint_without_pdl_on_either_side():
    for drop in ("gated_rmsnorm", "linear"):
        g, norm = _graph("linear")
        next(n for n in g.nodes if n.target is getattr(OPS, drop)).meta.pop("lingc.pdl")
        assert mark_entry_triggers(g) == [], drop


def test_the_executor_rejects_the_hint_on_other_ops():
    g, norm = _graph("linear")
    lin = next(n for n in g.nodes if n.target is OPS.linear)
    lin.meta["lingc.launch"] = {"entry_trigger": True}
    with pytest.raises(ValueError, match="entry_trigger"):
        launch_hints(lin)


def test_lingc_graphs_mark_the_kda_norm_and_mla(tiny_partitioned: Program, monkeypatch):
    """test-tiny: the KDA layers' gated_rmsnorm (o_proj next) and MLA attention (dense next) are marked in every step
    graph, verify's included; never in prefill (its linears run cuBLAS); with ENTRY_TRIGGER off nothing is."""
    scheduled, record = Pdl().run(tiny_partitioned)
    marked = record.details["entry_trigger"]
    assert marked
    for graph in scheduled.graphs.values():
        for n in graph.nodes:
            if n.meta.get("lingc.launch", {}).get("entry_trigger"):
                assert n.target in (OPS.gated_rmsnorm, OPS.mla_attention, OPS.rmsnorm, OPS.add_rmsnorm,
                                    OPS.combine_add_rmsnorm)
                assert pdl_pass._next_launch(n).target in (OPS.linear, OPS.rmsnorm_linear, OPS.add_rmsnorm_linear)
                rows = pdl_pass._rows(pdl_pass._next_launch(n))
                assert rows == 1 or (rows <= 16 and n.target in (OPS.gated_rmsnorm, OPS.mla_attention))
    kinds = {n.target for g in scheduled.graphs.values() for n in g.nodes
             if n.meta.get("lingc.launch", {}).get("entry_trigger")}
    assert {OPS.gated_rmsnorm, OPS.mla_attention} <= kinds
    assert {m.split(":")[0] for m in marked} >= {"decode", "step", "draft", "verify"}
    assert not [m for m in marked if m.startswith("prefill")]
    monkeypatch.setattr(pdl_pass, "ENTRY_TRIGGER", False)
    _, off = Pdl().run(tiny_partitioned)
    assert off.details["entry_trigger"] == []


def test_prep_entry_trigger_marks_mla_prep_before_mla_attention(tiny_partitioned: Program, monkeypatch):
    """PREP_ENTRY_TRIGGER (an A/B knob, off): after `all`, every mla_prep of up to PREP_ENTRY_MAX_ROWS tokens whose next
    launch is its mla_attention carries entry_trigger (decode, verify, the draft), prefill's 32-token one does not, the
    executor accepts the hint, and the Triton lowering passes it to the launcher, with late_q on that mla_attention
    (q_absorb then loads q after its wait: q_nope's writer may still run); off, nothing is marked."""
    from lingc.passes.matchers import calls
    from lingc.passes.manager import PassManager
    from lingc.runtime.executor import lower

    off = PassManager(["all"]).run(tiny_partitioned).program
    assert not any(n.meta.get("lingc.launch", {}).get("entry_trigger")
                   for g in off.graphs.values() for n in calls(g, "mla_prep"))
    assert not any(n.meta.get("lingc.launch", {}).get("late_q") for g in off.graphs.values()
                   for n in calls(g, "mla_attention"))
    monkeypatch.setattr(pdl_pass, "PREP_ENTRY_TRIGGER", True)
    result = PassManager(["all"]).run(tiny_partitioned)
    marked = {m for m in next(r for r in result.records if r.name == "pdl").details["entry_trigger"]}
    seen = set()
    for gname, graph in result.program.graphs.items():
        for node in calls(graph, "mla_prep"):
            tokens = int(node.args[0].meta["lingc.tensor"].shape[1])
            hinted = node.meta.get("lingc.launch", {}).get("entry_trigger", False)
            assert hinted == (tokens <= pdl_pass.PREP_ENTRY_MAX_ROWS), (gname, node.name)
            if hinted:   # and its mla_attention's q_absorb loads q after its wait: q_nope's writer may still run
                attention = pdl_pass._next_launch(node)
                assert attention.target is OPS.mla_attention and launch_hints(attention)["late_q"] is True
                assert launch_hints(node) == {"entry_trigger": True} and f"{gname}:{node.name}" in marked
                seen.add(gname)
    assert seen >= {"decode", "verify", "draft", "step"} and "prefill" not in seen
    low = lower(result.program, "verify", backend="triton", pdl=True)
    preps = [x for x in low.launches if x.label == "triton:mla_prep"]
    assert preps and all(x.kwargs.get("entry_trigger") is True for x in preps)
    attention = [x for x in low.launches if x.label == "triton:mla_attention"]
    assert len(attention) == len(preps) and all(x.kwargs.get("late_q") is True for x in attention)
