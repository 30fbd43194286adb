"""Gate 5: with temperature > 0, speculative tokens follow the target's distribution (lossless chain accept).

Op level: a V = 8 vocabulary, target tables P0, P1[a], P2[a], P3[a] (position i's distribution given the
token before) and different draft tables Q0, Q1[a], Q2[a]; K = 3 drafts. B = 20000 rows, each with its
own seed for `uniform` (draft draws, then the verify uniforms), go through sample_tokens + chain_accept.
  - tokens[0], the first emitted token, must follow P0;
  - tokens[1] given tokens[0] = a and the first draft accepted must follow P1[a];
  - the bonus tokens[3] given all drafts accepted and tokens[2] = c must follow P3[c];
  - the first draft is accepted with probability sum_x min(P0(x), Q0(x)).
Bound: Pearson's X^2 against the expected counts is ~ chi-square with df = (cells - 1) per conditioning
value, summed; we require X^2 below the chi-square quantile at 1 - 1e-6 (Wilson-Hilferty), so a correct
sampler fails with probability < 1e-6 per check (and the seeds are fixed, so the test is deterministic).
At B = 20000 the check sees a shift of ~0.01 in a probability; reusing the rejection's own uniform for the
residual draw (the bug this gate caught) gives X^2 ~ 140 at df 7 (bound ~ 42), see the power test.
"""

from __future__ import annotations

import math

import pytest
import torch

from lingc.ops.spec import chain_accept, sample_tokens, uniform
from lingc.runtime.engine import Request, SamplingParams
from rt_support import PROMPTS, first_difference

V, K, B = 8, 3, 20000
Z_1E6 = 4.753                                  # one-sided standard normal quantile at 1 - 1e-6


def chi2_bound(df: int, z: float = Z_1E6) -> float:
    """Wilson-Hilferty: the chi-square(df) quantile at Phi(z)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def pearson(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """X^2 and degrees of freedom of observed counts [..., V] against per-row probabilities [..., V]."""
    n = counts.sum(-1, keepdim=True).double()
    expected = n * probs.double()
    keep = (n.squeeze(-1) > 0)
    x2 = ((counts.double() - expected) ** 2 / expected.clamp_min(1e-300))[keep].sum().item()
    return x2, int(keep.sum()) * (V - 1)


def tables(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    soft = lambda *shape: torch.softmax(torch.randn(*shape, V, generator=g), -1)   # noqa: E731
    return {"P0": soft(), "P1": soft(V), "P2": soft(V), "P3": soft(V), "Q0": soft(), "Q1": soft(V), "Q2": soft(V)}


def run_chain(t: dict[str, torch.Tensor], seed0: int = 10_000, old_stop_uniform: bool = False):
    """B independent chains; returns (accept_len [B], tokens [B, K+1]). old_stop_uniform emulates the bug
    this gate caught: the stop token drawn with u_i of the rejected position i (not independent of it)."""
    seed = torch.arange(B, dtype=torch.int64) + seed0
    zero = torch.zeros(B, dtype=torch.int64)
    ud = uniform(seed, zero, K)                                               # draft draws
    d0 = sample_tokens(t["Q0"].expand(B, 1, V).contiguous(), ud[:, :1])[:, 0]
    d1 = sample_tokens(t["Q1"][d0].unsqueeze(1), ud[:, 1:2])[:, 0]
    d2 = sample_tokens(t["Q2"][d1].unsqueeze(1), ud[:, 2:3])[:, 0]
    draft_ids = torch.stack([d0, d1, d2], 1)
    draft_probs = torch.stack([t["Q0"].expand(B, V), t["Q1"][d0], t["Q2"][d1]], 1)
    # target at the root (P0), then after each draft: position i+1's distribution depends on d_i
    target = torch.stack([t["P0"].expand(B, V), t["P1"][d0], t["P2"][d1], t["P3"][d2]], 1)
    u = uniform(seed, zero + K, K + 1)
    temperature = torch.full((B,), 0.8)
    accept_len, tokens = chain_accept(draft_ids, draft_probs, target, target.log(), temperature, u)
    if old_stop_uniform:                         # decisions use u[:, :K] only, so this changes just the stop draw
        u = u.clone()
        u[:, K] = u.gather(1, (accept_len.long() - 1).view(B, 1)).squeeze(1)
        accept_len, tokens = chain_accept(draft_ids, draft_probs, target, target.log(), temperature, u)
    return accept_len, tokens


def hist(x: torch.Tensor, cond: torch.Tensor | None = None) -> torch.Tensor:
    """counts [V] of x, or [V, V] of x given cond (row = conditioning token)."""
    if cond is None:
        return torch.bincount(x, minlength=V)
    return torch.bincount(cond * V + x, minlength=V * V).view(V, V)


@pytest.fixture(scope="module")
def chain():
    t = tables(0)
    assert (t["P0"] - t["Q0"]).abs().sum() > 0.3, "draft and target should differ"
    accept_len, tokens = run_chain(t)
    return t, accept_len.long(), tokens


def test_first_token_follows_the_target(chain):
    t, _, tokens = chain
    x2, df = pearson(hist(tokens[:, 0]), t["P0"])
    assert x2 < chi2_bound(df), (x2, df, chi2_bound(df))


def test_second_token_given_first_accepted_follows_the_target(chain):
    t, accept_len, tokens = chain
    ok = accept_len >= 2
    assert ok.sum() > B / 4
    x2, df = pearson(hist(tokens[ok, 1], tokens[ok, 0]), t["P1"])
    assert x2 < chi2_bound(df), (x2, df, chi2_bound(df))


def test_bonus_token_follows_the_target(chain):
    t, accept_len, tokens = chain
    full = accept_len == K + 1
    assert full.sum() > B / 20
    x2, df = pearson(hist(tokens[full, K], tokens[full, K - 1]), t["P3"])
    assert x2 < chi2_bound(df), (x2, df, chi2_bound(df))


def test_first_acceptance_rate(chain):
    """P(accept d_0) = sum_x min(P0, Q0); binomial, 5 standard deviations."""
    t, accept_len, _ = chain
    p = torch.minimum(t["P0"], t["Q0"]).sum().item()
    rate = (accept_len >= 2).double().mean().item()
    assert abs(rate - p) < 5 * math.sqrt(p * (1 - p) / B), (rate, p)


def test_chi_square_has_power_against_uniform_reuse():
    """The same checks reject the old bug: the residual draw reusing the rejected position's uniform."""
    t = tables(0)
    accept_len, tokens = run_chain(t, old_stop_uniform=True)
    x2, df = pearson(hist(tokens[:, 0]), t["P0"])
    assert x2 > 2 * chi2_bound(df), (x2, df)
    ok = accept_len >= 2
    x2, df = pearson(hist(tokens[ok, 1], tokens[ok, 0]), t["P1"])
    assert x2 > chi2_bound(df), (x2, df)


def test_chain_accept_greedy_is_the_argmax_chain():
    """temperature 0: drafts accepted while they equal the target's argmax; the stop token is the argmax."""
    logits = torch.tensor([[[0., 3, 1], [2, 0, 1], [0, 0, 5], [1, 4, 0]]])       # argmax 1, 0, 2, 1
    probs = torch.full((1, 3, 3), 1 / 3)
    u = torch.zeros(1, 4)
    for drafts, want_len, want in (([1, 0, 2], 4, [1, 0, 2, 1]), ([1, 2, 2], 2, [1, 0]), ([0, 0, 2], 1, [1])):
        n, toks = chain_accept(torch.tensor([drafts]), probs, torch.softmax(logits, -1), logits, torch.zeros(1), u)
        assert int(n) == want_len and toks[0, :want_len].tolist() == want


# ---- engine level ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["nextn", "none"])
def test_sampled_generation_is_seeded(rt_engine, spec):
    engine, prompt, n = rt_engine(spec), PROMPTS["short3"], 24
    def run(seed: int) -> list[int]:
        return engine.generate(Request(prompt, n, SamplingParams(0.8, seed=seed), ignore_eos=True)).tokens

    a, b, c = run(1), run(1), run(2)
    assert a == b, first_difference(a, b)
    assert a != c


@pytest.mark.parametrize("spec", ["nextn", "none"])
def test_filters_that_keep_one_token_are_greedy(rt_engine, spec):
    """top_k = 1 or a tiny top_p leaves only the argmax: sampling must then reproduce greedy decoding
    (the draft, verify and bonus distributions are all filtered the same way)."""
    engine, prompt, n = rt_engine(spec), PROMPTS["chunk16"], 24
    want = engine.generate(Request(prompt, n, ignore_eos=True)).tokens
    for sampling in (SamplingParams(0.9, top_k=1, seed=3), SamplingParams(1.3, top_p=1e-6, seed=4)):
        got = engine.generate(Request(prompt, n, sampling, ignore_eos=True)).tokens
        assert got == want, (sampling, first_difference(got, want))
