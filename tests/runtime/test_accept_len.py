"""Gate 2: the reported accept length is committed tokens / verify steps, recounted from the token stream.

What `Result` counts: the first token comes from prefill (TTFT) and is not a verify step. Every later
decode step commits accept_len tokens (drafts accepted + the bonus), reported in `accept_lens`; the host
then trims the last step at max_new_tokens (or a stop token), so
    sum(accept_lens) = len(tokens) - 1 + trimmed,   0 <= trimmed < accept_lens[-1].
`on_tokens` sees exactly the kept tokens: the first token alone, then one call per step.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from lingc.runtime.engine import Engine, Request, SamplingParams
from lingc.runtime.session import Session
from rt_support import FULL, OPTIONS, PROMPTS

K1 = OPTIONS.draft_tokens


def run_counted(engine: Engine, req: Request):
    chunks: list[list[int]] = []
    r = engine.generate(req, on_tokens=lambda new: chunks.append(list(new)))
    return r, chunks


def check_counts(r, chunks, max_new_tokens: int, max_accept: int) -> None:
    """The accept-length bookkeeping of one Result against the stream `on_tokens` saw."""
    assert [t for c in chunks for t in c] == r.tokens
    assert len(r.tokens) == max_new_tokens and r.finish_reason == "length"
    assert len(chunks[0]) == 1, "the first on_tokens call carries the prefill token alone"
    steps = chunks[1:]
    assert r.steps == len(r.accept_lens) == len(steps)
    assert all(1 <= a <= max_accept for a in r.accept_lens)
    assert [len(c) for c in steps[:-1]] == r.accept_lens[:-1], "each step's tokens are its accept length"
    assert 1 <= len(steps[-1]) <= r.accept_lens[-1], "only the last step may be trimmed"
    trimmed = r.accept_lens[-1] - len(steps[-1])
    assert sum(r.accept_lens) == len(r.tokens) - 1 + trimmed
    # the reported mean: committed tokens / verify steps, from the recount
    committed = sum(len(c) for c in steps) + trimmed
    assert r.mean_accept_len == pytest.approx(committed / len(steps), rel=1e-12)


def test_sampled_accept_lens_recount(rt_engine):
    """Temperature 0.8: near-uniform random-model distributions accept often, so chains longer than 1 occur."""
    n = 256
    r, chunks = run_counted(rt_engine("nextn"), Request(PROMPTS["short3"], n, SamplingParams(0.8, seed=7),
                                                        ignore_eos=True))
    check_counts(r, chunks, n, K1)
    assert max(r.accept_lens) > 1 and r.mean_accept_len > 1.5, r.accept_lens
    assert r.spec == "nextn" and r.simulated_accept_len is None


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(1.0, top_k=50, top_p=0.9, seed=3)],
                         ids=["greedy", "sampled"])
def test_plain_decode_commits_one_token_per_step(rt_engine, sampling):
    n = 24
    r, chunks = run_counted(rt_engine("none"), Request(PROMPTS["short3"], n, sampling, ignore_eos=True))
    check_counts(r, chunks, n, 1)
    assert r.accept_lens == [1] * (n - 1) and r.mean_accept_len == 1.0 and r.spec == "none"


def test_greedy_nextn_accept_lens_recount(rt_engine):
    n = 40
    r, chunks = run_counted(rt_engine("nextn"), Request(PROMPTS["long37"], n, ignore_eos=True))
    check_counts(r, chunks, n, K1)


def test_simulated_accept_len(rt_programs):
    """--simulate-accept-len 3.2: every step commits floor(3.2) = 3 or 4 tokens (4 with probability 0.2), so
    the mean of n steps has standard deviation sqrt(0.2 * 0.8 / n) = 0.4 / sqrt(n); the bound is 5 of them
    (~0.2 at n ~ 95; a correct implementation misses it with probability < 1e-6, and the draws are seeded)."""
    target, n = 3.2, 300
    engine = Engine(rt_programs(FULL), spec="nextn", simulate_accept_len=target)
    prompt = PROMPTS["short3"]
    r, chunks = run_counted(engine, Request(prompt, n, SamplingParams(0.8, seed=11), ignore_eos=True))
    check_counts(r, chunks, n, K1)
    assert set(r.accept_lens) <= {3, 4}, sorted(set(r.accept_lens))
    bound = 5 * 0.4 / math.sqrt(r.steps)
    assert abs(r.mean_accept_len - target) < bound, (r.mean_accept_len, r.steps, bound)
    assert r.simulated_accept_len == target and r.spec == "nextn"
    summary = Session(Path("artifact"), engine, None).summary(prompt, r)
    assert summary["simulated_accept_len"] == target
    assert summary["accept_lens"] == r.accept_lens and summary["steps"] == r.steps
    assert summary["mean_accept_len"] == pytest.approx(sum(r.accept_lens) / r.steps)


def test_summary_is_not_simulated_by_default(rt_engine):
    r = rt_engine("nextn").generate(Request(PROMPTS["short3"], 4, ignore_eos=True))
    assert r.simulated_accept_len is None
    summary = Session(Path("artifact"), rt_engine("nextn"), None).summary(PROMPTS["short3"], r)
    assert summary["simulated_accept_len"] is None
