"""Gate 7: bad requests and artifacts raise EngineError with a message that says what to change, before any
work is done, and leave the engine usable."""

from __future__ import annotations

import math

import pytest

from lingc.runtime.engine import Engine, EngineError, Request, SamplingParams
from rt_support import FULL, OPTIONS, PROMPTS

V = 512                                                          # test-tiny vocabulary
ROOM = OPTIONS.max_len - 2 * OPTIONS.draft_tokens                 # 320 - 12 = 308 tokens per request

BAD_REQUESTS = {
    "empty prompt": (Request([], 8), "prompt is empty"),
    "token = vocab size": (Request([1, V], 8), r"prompt token ids \[512\] are outside the vocabulary \[0, 512\)"),
    "negative token": (Request([-1, 2], 8), r"\[-1\] are outside the vocabulary"),
    "non-integer token": (Request([1, 2.5], 8), r"prompt token ids must be integers, got \[2.5\]"),
    "max_new_tokens 0": (Request([1], 0), "max_new_tokens must be >= 1 and an integer, got 0"),
    "max_new_tokens -3": (Request([1], -3), "max_new_tokens must be >= 1 and an integer, got -3"),
    "max_new_tokens 2.5": (Request([1], 2.5), "max_new_tokens must be >= 1 and an integer, got 2.5"),
    "beyond context": (Request([1] * 9, ROOM - 8), rf"prompt \(9\) \+ max_new_tokens \({ROOM - 8}\) exceeds the "
                                                   rf"artifact's context {ROOM} .*--max-len"),
    "temperature < 0": (Request([1], 4, SamplingParams(temperature=-0.5)), "temperature must be >= 0"),
    "temperature nan": (Request([1], 4, SamplingParams(temperature=math.nan)), "temperature must be >= 0"),
    "top_k < 0": (Request([1], 4, SamplingParams(top_k=-1)), "top_k must be >= 0 and an integer, got -1"),
    "top_k 2.5": (Request([1], 4, SamplingParams(top_k=2.5)), "top_k must be >= 0 and an integer, got 2.5"),
    "seed 1.5": (Request([1], 4, SamplingParams(seed=1.5)), "seed must be an integer, got 1.5"),
    "top_p 0": (Request([1], 4, SamplingParams(top_p=0.0)), r"top_p must be in \(0, 1\]"),
    "top_p > 1": (Request([1], 4, SamplingParams(top_p=1.5)), r"top_p must be in \(0, 1\]"),
    "top_p nan": (Request([1], 4, SamplingParams(top_p=math.nan)), r"top_p must be in \(0, 1\]"),
}


@pytest.mark.parametrize("spec", ["nextn", "none"])
@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request(rt_engine, spec, case):
    engine = rt_engine(spec)
    req, message = BAD_REQUESTS[case]
    free = list(engine.free_slots)
    with pytest.raises(EngineError, match=message):
        engine.generate(req)
    assert engine.free_slots == free, "a rejected request must not hold a slot"


def test_the_engine_still_works_after_errors(rt_engine):
    engine = rt_engine("nextn")
    for req, _ in BAD_REQUESTS.values():
        with pytest.raises(EngineError):
            engine.generate(req)
    assert len(engine.generate(Request(PROMPTS["short3"], 3, ignore_eos=True)).tokens) == 3


def test_context_limit_is_inclusive(rt_engine):
    """prompt + max_new_tokens == the context is accepted (checked without running it)."""
    rt_engine("nextn")._check(Request([1] * 8, ROOM - 8))


def test_nextn_needs_the_partition_pass(rt_programs):
    with pytest.raises(EngineError, match=r"lacks program\(s\) \['draft', 'verify', 'extend'\] needed for "
                                          r"--spec nextn \(compile with the partition pass"):
        Engine(rt_programs("traced"), spec="nextn")
    Engine(rt_programs("traced"), spec="none")                   # plain decoding needs no partition


def test_unknown_spec(rt_programs):
    with pytest.raises(EngineError, match="spec must be 'nextn' or 'none', got 'eagle'"):
        Engine(rt_programs(FULL), spec="eagle")


@pytest.mark.parametrize("value", [0.5, -1.0, OPTIONS.draft_tokens + 0.01, 100.0, math.nan])
def test_simulate_accept_len_out_of_range(rt_programs, value):
    with pytest.raises(EngineError, match=r"--simulate-accept-len needs --spec nextn and a value in "
                                          r"\[1, draft_tokens\]"):
        Engine(rt_programs(FULL), spec="nextn", simulate_accept_len=value)


def test_simulate_accept_len_needs_nextn(rt_programs):
    with pytest.raises(EngineError, match="needs --spec nextn"):
        Engine(rt_programs(FULL), spec="none", simulate_accept_len=2.0)


@pytest.mark.parametrize("value", [1.0, 3.2, float(OPTIONS.draft_tokens)])
def test_simulate_accept_len_in_range(rt_programs, value):
    assert Engine(rt_programs(FULL), spec="nextn", simulate_accept_len=value).simulate == value
