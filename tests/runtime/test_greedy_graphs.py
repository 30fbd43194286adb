"""The engine's choice of step graphs: a temperature-0 request runs specialize_greedy's copies (step_greedy, or
draft_greedy -> verify_greedy -> extend_greedy) where the artifact has them, any other request the general graphs,
and the copies give the general graphs' tokens and accept lengths (also under --simulate-accept-len, whose uniforms
both sets draw from the same counters). Byte identity with the reference model over 256 tokens is gate 1
(test_greedy_parity.py, whose `all-exact` combination runs the copies).
"""

from __future__ import annotations

import pytest

from lingc.runtime.engine import Engine, EngineError, Request, SamplingParams
from rt_support import PROMPTS

COMBO = "all-exact"                      # every numerics-preserving pass, specialize_greedy and partition among them
TOKENS = 40


@pytest.mark.parametrize("spec,simulate", [("nextn", 0.0), ("nextn", 3.2), ("none", 0.0)])
def test_greedy_request_runs_the_copies_with_the_same_tokens(rt_programs, spec, simulate):
    program = rt_programs(COMBO)
    req = Request(PROMPTS["long37"], TOKENS, ignore_eos=True)
    fast = Engine(program, spec=spec, simulate_accept_len=simulate).generate(req)
    general = Engine(program, spec=spec, simulate_accept_len=simulate, greedy_graphs=False).generate(req)
    names = ("draft", "verify", "extend") if spec == "nextn" else ("step",)
    assert fast.graphs == tuple(n + "_greedy" for n in names) and general.graphs == names
    assert fast.tokens == general.tokens and len(fast.tokens) == TOKENS
    assert fast.accept_lens == general.accept_lens
    if simulate:
        assert fast.mean_accept_len > 2                      # the simulated chains are long: verify's tail ran


def test_sampled_request_runs_the_general_graphs_on_the_same_engine(rt_programs):
    """A top-k request runs the general graphs (the other sampled requests: test_sampling_graphs.py)."""
    engine = Engine(rt_programs(COMBO), spec="nextn")
    assert {"general", "greedy"} <= set(engine.graph_sets)
    sampled = engine.generate(Request(PROMPTS["short3"], 8, SamplingParams(0.8, 5, 0.9, 7), ignore_eos=True))
    greedy = engine.generate(Request(PROMPTS["short3"], 8, ignore_eos=True))
    assert sampled.graphs == ("draft", "verify", "extend")
    assert greedy.graphs == ("draft_greedy", "verify_greedy", "extend_greedy")


def test_an_artifact_without_copies_runs_the_general_graphs(rt_programs):
    engine = Engine(rt_programs("partition"), spec="nextn")
    assert set(engine.graph_sets) == {"general"}
    assert engine.generate(Request(PROMPTS["short3"], 4, ignore_eos=True)).graphs == ("draft", "verify", "extend")


def test_the_copies_alone_do_not_make_an_engine(rt_programs):
    """The general graphs stay required: a sampled request must always have something to run."""
    program = rt_programs(COMBO).copy()
    del program.graphs["verify"]
    with pytest.raises(EngineError, match=r"lacks program\(s\) \['verify'\]"):
        Engine(program, spec="nextn")
