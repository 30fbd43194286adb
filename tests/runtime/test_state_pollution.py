"""Gate 3: a greedy re-run after interleaved temperature-sampled requests and an aborted request gives the
same tokens, on the same Engine instance (KDA pools, MLA pages, relays and the RNG counter are per request).
"""

from __future__ import annotations

import pytest

from lingc.runtime.engine import Engine, Request, SamplingParams
from rt_support import FULL, NEW_TOKENS, PROMPTS, first_difference, greedy

INTERLEAVED = [   # (sampling, new tokens): a long unfiltered run (it cycles through the free pages), then top-k /
    (SamplingParams(0.8, seed=1), NEW_TOKENS),                 # top-p, whose relays the greedy run must not see
    (SamplingParams(1.0, top_k=20, top_p=0.9, seed=2), 64),    # (short: these filters accept ~1 draft per step)
]


def abort_after(calls: int):
    seen = []

    def on_tokens(new):
        seen.append(new)
        return len(seen) < calls            # False aborts the request

    return on_tokens, seen


@pytest.mark.parametrize("spec", ["nextn", "none"])
def test_greedy_rerun_after_sampled_and_aborted_requests(greedy_run, spec):
    """The first run is gate 1's (full pass combination, 37-token prompt, 256 tokens), on the same instance."""
    first = greedy_run(FULL, spec, "long37").tokens
    engine = greedy_run.engine(FULL, spec)

    for sampling, n in INTERLEAVED:
        r = engine.generate(Request(PROMPTS["chunk16"], n, sampling, ignore_eos=True))
        assert r.finish_reason == "length" and len(r.tokens) == n
    on_tokens, seen = abort_after(3)                          # aborted mid-generation, a step still in flight
    r = engine.generate(Request(PROMPTS["short3"], 200, SamplingParams(0.7, seed=5), ignore_eos=True), on_tokens)
    assert r.finish_reason == "abort" and len(seen) == 3 and len(r.tokens) < 200
    on_tokens, seen = abort_after(2)                          # and an aborted greedy request
    r = engine.generate(greedy(PROMPTS["chunk16"], 100), on_tokens)
    assert r.finish_reason == "abort" and len(seen) == 2

    again = engine.generate(greedy(PROMPTS["long37"])).tokens
    assert again == first, first_difference(again, first)


def test_same_request_on_the_other_slot(rt_programs):
    """Slot 1 after slot 0 has run sampled requests gives what slot 0 gives (relays are indexed by slot)."""
    engine = Engine(rt_programs(FULL), spec="nextn")
    prompt, n = PROMPTS["chunk16"], 24
    on_slot0 = engine.generate(greedy(prompt, n)).tokens
    engine.generate(Request(PROMPTS["short3"], 48, SamplingParams(0.9, seed=4), ignore_eos=True))
    engine.free_slots = [1, 0]
    try:
        on_slot1 = engine.generate(greedy(prompt, n)).tokens
        assert engine.free_slots[0] == 1
    finally:
        engine.free_slots = [0, 1]
    assert on_slot1 == on_slot0, first_difference(on_slot1, on_slot0)
