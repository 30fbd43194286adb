"""The engine's sampling copies (passes/specialize_sampling.py): a sampled request with top-k off runs the nucleus
copies (top-p on) or the plain copies (top-p off too), where the artifact has them, and gets the general graphs'
tokens and accept lengths for the same seed; a request with top-k on, or an artifact without the copies, runs the
general graphs."""

from __future__ import annotations

import pytest

from lingc.runtime.engine import Engine, Request, SamplingParams
from rt_support import PROMPTS

COMBO = "all-exact"                      # every numerics-preserving pass, specialize_sampling and partition among them
TOKENS = 24
STAGES = ("draft", "verify", "extend")


@pytest.mark.parametrize("top_k,top_p,graph_set", [(0, 1.0, "plain"), (0, 0.9, "nucleus"), (512, 0.9, "nucleus"),
                                                   (5, 1.0, "general")])
def test_sampled_request_runs_the_copy_that_fits_with_the_same_tokens(rt_programs, top_k, top_p, graph_set):
    """top_k >= V (test-tiny's 512) is off, as top_k = 0 is."""
    program = rt_programs(COMBO)
    req = Request(PROMPTS["long37"], TOKENS, SamplingParams(0.8, top_k, top_p, 11), ignore_eos=True)
    engine = Engine(program, spec="nextn")
    assert set(engine.graph_sets) == {"general", "greedy", "plain", "nucleus"}
    fast = engine.generate(req)
    general = Engine(program, spec="nextn", greedy_graphs=False).generate(req)
    suffix = "" if graph_set == "general" else "_" + graph_set
    assert fast.graphs == tuple(s + suffix for s in STAGES) and general.graphs == STAGES
    assert fast.tokens == general.tokens and len(fast.tokens) == TOKENS
    assert fast.accept_lens == general.accept_lens


def test_plain_decode_runs_the_step_copy(rt_programs):
    req = Request(PROMPTS["short3"], 6, SamplingParams(0.7, 0, 1.0, 3), ignore_eos=True)
    fast = Engine(rt_programs(COMBO), spec="none").generate(req)
    general = Engine(rt_programs(COMBO), spec="none", greedy_graphs=False).generate(req)
    assert fast.graphs == ("step_plain",) and general.graphs == ("step",)
    assert fast.tokens == general.tokens


def test_without_the_pass_sampled_requests_run_the_general_graphs(rt_programs):
    engine = Engine(rt_programs("partition"), spec="nextn")
    assert set(engine.graph_sets) == {"general"}
    req = Request(PROMPTS["short3"], 4, SamplingParams(0.8, 0, 1.0, 1), ignore_eos=True)
    assert engine.generate(req).graphs == STAGES
