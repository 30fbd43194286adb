"""lingc.kernels.sample in the Triton interpreter against torch.ops.lingc.greedy_sample / chain_accept / sample_tokens.

Every comparison is exact (token ids are integers). Vocabularies are small and odd (several chunks of CHUNK ids
plus a ragged last chunk); one test shrinks CHUNK to get many chunks. Sampled tokens can differ from the
reference only when u * total falls within a few fp32 ulps of a CDF boundary (kernels/sample.py), which the
fixed seeds here do not hit.
"""

from __future__ import annotations


import pytest
import torch

import lingc.kernels.sample as sample
from lingc.kernels.sample import (chain_accept, chain_accept_ref, greedy_accept, greedy_accept_ref, greedy_sample,
                                  greedy_sample_ref, sample_tokens, sample_tokens_ref)
from kernel_support import poisoned_empty  # noqa: E402  (tests/kernels is on sys.path)

V = 4999                        # 3 chunks of 2048, the last one ragged
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}




def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("B,T", [(1, 1), (1, 7), (2, 3)], ids=["1x1", "1x7", "2x3"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_greedy_matches_reference(B: int, T: int, dtype: torch.dtype) -> None:
    logits = torch.randn(B, T, V, generator=_gen(B * 10 + T)).to(dtype)
    with poisoned_empty():
        got = greedy_sample(logits)
    assert got.dtype == torch.int64 and torch.equal(got, greedy_sample_ref(logits))


def test_greedy_ties_nan_and_inf() -> None:
    """Ties inside and across chunks go to the lowest id; the first NaN wins (as torch); an all -inf row gives 0."""
    logits = torch.randn(1, 6, V, generator=_gen(1))
    logits[0, 0, [3000, 100, 4998]] = 9.0                  # tie across chunks: 100
    logits[0, 1, [2100, 2050]] = 9.0                       # tie inside a chunk: 2050
    logits[0, 2, [4500, 300]] = float("nan")               # NaNs: 300
    logits[0, 2, 7] = float("inf")
    logits[0, 3] = -torch.inf                              # all -inf: 0
    logits[0, 4, 4998] = float("inf")                      # max at the last id
    logits[0, 5, 0] = 9.0                                  # max at id 0
    got = greedy_sample(logits)
    assert got.tolist() == [[100, 2050, 300, 0, 4998, 0]]
    assert torch.equal(got, greedy_sample_ref(logits))


def test_greedy_many_chunks_single_chunk_and_views(monkeypatch: pytest.MonkeyPatch) -> None:
    """CHUNK=64 (79 chunks, a 128-lane merge), V < CHUNK (one chunk), a [B, 1, V] slice of [B, T, V] read in place."""
    logits = torch.randn(2, 3, V, generator=_gen(2))
    monkeypatch.setattr(sample, "CHUNK", 64)
    assert torch.equal(greedy_sample(logits), greedy_sample_ref(logits))
    monkeypatch.undo()
    small = torch.randn(2, 2, 37, generator=_gen(3))
    assert torch.equal(greedy_sample(small), greedy_sample_ref(small))
    last = logits[:, -1:]                                  # what model.generate passes
    assert torch.equal(greedy_sample(last), greedy_sample_ref(last))


def test_greedy_row_invariance() -> None:
    logits = torch.randn(2, 7, V, generator=_gen(4))
    full = greedy_sample(logits)
    for b in range(2):
        for t in range(7):
            assert torch.equal(greedy_sample(logits[b:b + 1, t:t + 1]), full[b:b + 1, t:t + 1])


# ---------------------------------------------------------------------------------------------------- chain accept


def _chain_inputs(B: int, K: int, temperature: list[float], reject_at: list[int], seed: int,
                  logits_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """Realistic verify inputs: filtered target / draft distributions (top-k 50 on odd rows, so most mass is 0),
    draft ids that match the target argmax (greedy rows) or are sampled from the drafter (sampled rows), and
    uniforms that accept up to reject_at[b] (K: accept all) on sampled rows."""
    g = _gen(seed)
    temp = torch.tensor(temperature)
    top_k = torch.tensor([50 if b % 2 else 0 for b in range(B)])
    top_p = torch.tensor([0.9 if b % 3 == 2 else 1.0 for b in range(B)])
    target_logits = (3 * torch.randn(B, K + 1, V, generator=g)).to(logits_dtype)
    draft_logits = target_logits[:, :K].float() + torch.randn(B, K, V, generator=g)
    target_probs = torch.ops.lingc.filtered_probs(target_logits, temp, top_k, top_p)
    draft_probs = torch.ops.lingc.filtered_probs(draft_logits, temp, top_k, top_p)
    u = torch.rand(B, K + 1, generator=g)
    sampled = torch.ops.lingc.sample_tokens(draft_probs, torch.rand(B, K, generator=g))
    draft_ids = torch.where((temp <= 0).view(B, 1), target_logits.argmax(-1)[:, :K], sampled)
    for b in range(B):
        r = reject_at[b]
        if temp[b] <= 0 and r < K:
            draft_ids[b, r] = (draft_ids[b, r] + 1) % V    # not the argmax
        if temp[b] > 0:
            u[b, :r] = 1e-6                                # accepted (p_t > 0 at a drafted id, almost surely)
            if r < K:
                u[b, r] = 1 - 2**-24                       # rejected unless p_t >= p_d
    return draft_ids, draft_probs, target_probs, target_logits, temp, u


def _check_chain(*inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with poisoned_empty():
        got = chain_accept(*inputs)
    want = chain_accept_ref(*inputs)
    assert got[0].dtype == torch.int32 and got[1].dtype == torch.int64
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"got {got}, want {want}"
    return got


@pytest.mark.parametrize("K", [1, 3, 6])
def test_chain_accept_greedy_matches_reference(K: int) -> None:
    """temperature 0 on every row (the decode hot path), reject at 0, mid-chain, or accept all K."""
    reject = [0, K // 2, K, K]
    _check_chain(*_chain_inputs(4, K, [0.0, 0.0, -1.0, 0.0], reject, seed=K))


def test_chain_accept_greedy_bf16_logits() -> None:
    _check_chain(*_chain_inputs(2, 6, [0.0, 0.0], [3, 6], seed=8, logits_dtype=torch.bfloat16))


@pytest.mark.parametrize("K", [3, 6])
def test_chain_accept_sampled_and_mixed_match_reference(K: int) -> None:
    """Sampled rows (temperature > 0, some with top-k / top-p) next to greedy rows; every stop position."""
    B = K + 2
    temperature = [0.0 if b % 4 == 3 else 0.6 + 0.1 * b for b in range(B)]
    reject = [b % (K + 1) for b in range(B)]
    accept_len, _ = _check_chain(*_chain_inputs(B, K, temperature, reject, seed=100 + K))
    assert len(set(accept_len.tolist())) >= 3                 # the test reaches several stop positions


def test_chain_accept_zero_residual_falls_back_to_target() -> None:
    """A rejection where p_t <= p_d everywhere (unnormalised target): the stop token is drawn from p_t."""
    draft_ids, draft_probs, target_probs, target_logits, temp, u = _chain_inputs(2, 3, [0.8, 1.0], [1, 2], seed=9)
    target_probs[0, 1] = 0.5 * draft_probs[0, 1]
    target_probs[1, 2] = draft_probs[1, 2]                  # equal: u < 1 accepts unless u*p_d rounds up to p_t
    u[1, 2] = 1.0
    accept_len, _ = _check_chain(draft_ids, draft_probs, target_probs, target_logits, temp, u)
    assert accept_len.tolist() == [2, 3]


def test_chain_accept_row_invariance() -> None:
    inputs = _chain_inputs(4, 6, [0.0, 0.7, 0.0, 1.0], [2, 1, 6, 6], seed=12)
    accept_len, tokens = chain_accept(*inputs)
    for b in range(4):
        one = chain_accept(*(t[b:b + 1] for t in inputs))
        assert torch.equal(one[0], accept_len[b:b + 1]) and torch.equal(one[1], tokens[b:b + 1])


# ---------------------------------------------------------------------------------------------------- greedy accept


@pytest.mark.parametrize("K", [1, 3, 5])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_greedy_accept_matches_reference_and_chain_accept(K: int, dtype: torch.dtype) -> None:
    """greedy_accept (the op specialize_greedy puts in chain_accept's place) against its reference, and both against
    chain_accept on all-greedy rows: the same accept lengths and tokens, every stop position, ties and a NaN row."""
    B = K + 2
    reject = [b % (K + 1) for b in range(B)]
    draft_ids, draft_probs, target_probs, target_logits, temp, u = _chain_inputs(B, K, [0.0] * B, reject, seed=40 + K,
                                                                                logits_dtype=dtype)
    target_logits[0, 0, [7, 4000]] = target_logits[0, 0].max() + 1    # a tie across chunks: id 7 wins
    draft_ids[0, 0] = 7
    target_logits[1, -1, 2100] = float("nan")                          # a NaN is the maximum, as in torch
    with poisoned_empty():
        got = greedy_accept(draft_ids, target_logits)
    want = greedy_accept_ref(draft_ids, target_logits)
    chain = chain_accept_ref(draft_ids, draft_probs, target_probs, target_logits, temp, u)
    assert got[0].dtype == torch.int32 and got[1].dtype == torch.int64
    for a, b, c in zip(got, want, chain):
        assert torch.equal(a, b) and torch.equal(b, c), (got, want, chain)
    assert len(set(got[0].tolist())) >= min(3, K + 1)                  # several stop positions reached


def test_greedy_accept_bad_inputs() -> None:
    with pytest.raises(ValueError, match="target_logits must be a float \\[1, 4, V\\]"):
        greedy_accept(torch.zeros(1, 3, dtype=torch.int64), torch.zeros(1, 3, 10))
    with pytest.raises(ValueError, match="draft_ids must be an integer"):
        greedy_accept(torch.zeros(1, 3), torch.zeros(1, 4, 10))


# ---------------------------------------------------------------------------------------------------- sampling


def test_sample_tokens_matches_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Filtered distributions (plain, top-k, top-p, greedy one-hot), u at 0, mid and 1 - 2^-24; CHUNK 2048 and 64."""
    B, T = 4, 3
    g = _gen(13)
    logits = 3 * torch.randn(B, T, V, generator=g)
    probs = torch.ops.lingc.filtered_probs(logits, torch.tensor([1.0, 0.7, 0.0, 1.3]), torch.tensor([0, 40, 0, 0]),
                                           torch.tensor([1.0, 1.0, 1.0, 0.8]))
    u = torch.rand(B, T, generator=g)
    u[0, 0], u[1, 1], u[3, 2] = 0.0, 1 - 2**-24, 1 - 2**-24
    for chunk in (2048, 64):
        monkeypatch.setattr(sample, "CHUNK", chunk)
        with poisoned_empty():
            got = sample_tokens(probs, u)
        assert torch.equal(got, sample_tokens_ref(probs, u)), f"CHUNK {chunk}"
        assert bool((probs.gather(-1, got.unsqueeze(-1)) > 0).all())


def test_sample_tokens_row_invariance_and_u_at_one() -> None:
    """Each row alone equals its row among all; u = 1 (u * total == total) gives V - 1, as the reference's clamp."""
    probs = torch.softmax(2 * torch.randn(2, 3, V, generator=_gen(14)), dim=-1)
    u = torch.rand(2, 3, generator=_gen(15))
    full = sample_tokens(probs, u)
    for b in range(2):
        for t in range(3):
            assert torch.equal(sample_tokens(probs[b:b + 1, t:t + 1], u[b:b + 1, t:t + 1]), full[b:b + 1, t:t + 1])
    ones = torch.ones(2, 3)
    assert torch.equal(sample_tokens(probs, ones), sample_tokens_ref(probs, ones))


def test_pdl_on_cpu_falls_back() -> None:
    logits = torch.randn(1, 2, V, generator=_gen(16))
    assert torch.equal(greedy_sample(logits, pdl=True), greedy_sample(logits))
    inputs = _chain_inputs(2, 3, [0.0, 0.9], [1, 2], seed=17)
    for a, b in zip(chain_accept(*inputs, pdl=True), chain_accept(*inputs)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", ["greedy 2-d", "greedy int", "chain probs shape", "chain float ids", "u shape"])
def test_bad_arguments_rejected(case: str) -> None:
    inputs = list(_chain_inputs(1, 2, [0.0], [2], seed=18))
    with pytest.raises(ValueError):
        if case == "greedy 2-d":
            greedy_sample(torch.zeros(3, V))
        elif case == "greedy int":
            greedy_sample(torch.zeros(1, 1, V, dtype=torch.int32))
        elif case == "chain probs shape":
            inputs[1] = inputs[1][:, :1]
            chain_accept(*inputs)
        elif case == "chain float ids":
            inputs[0] = inputs[0].float()
            chain_accept(*inputs)
        else:
            sample_tokens(torch.ones(1, 2, V) / V, torch.rand(1, 3))


@pytest.mark.parametrize("n", [1, 6, 7, 33])
def test_uniform_has_the_reference_bits(n: int) -> None:
    """Seeds and counters over the whole int64 range (negative ones too: the hash works on their bits)."""
    g = torch.Generator().manual_seed(n)
    seed = torch.randint(-2**63, 2**63 - 1, (3,), generator=g, dtype=torch.int64)
    counter = torch.tensor([0, 2**40 + 5, 123], dtype=torch.int64)
    with poisoned_empty():
        got = sample.uniform(seed, counter, n)
    want = torch.ops.lingc.uniform(seed, counter, n)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    with poisoned_empty():      # value i of an offset call is the one value of uniform(seed, counter + offset + i, 1)
        shifted = sample.uniform(seed, counter, n, 11)
    assert torch.equal(shifted, torch.ops.lingc.uniform(seed, counter + 11, n))
    assert torch.equal(shifted[:, -1:], sample.uniform(seed, counter + 10 + n, 1))
    assert sample.LOWERINGS["uniform"] is sample.uniform


def test_simulate_accept_has_the_reference_integers() -> None:
    """Means off (0), whole, fractional and past max_accept; u on both sides of the fraction, a strided u."""
    mean = torch.tensor([0.0, 3.0, 3.2, 3.2, 9.5, 0.5, 1.999], dtype=torch.float32)
    u_wide = torch.tensor([[0.5, 0.0, 0.1, 0.0, 0.9, 0.3, 0.99],
                           [0.1, 0.9, 0.25, 0.1, 0.4, 0.7, 0.998]], dtype=torch.float32).t()   # [7, 2]
    accept = torch.tensor([2, 5, 1, 6, 3, 4, 2], dtype=torch.int32)
    for col in range(2):
        u = u_wide[:, col]                                                                      # stride 2
        with poisoned_empty():
            got = sample.simulate_accept(accept, mean, u, 6)
        want = torch.ops.lingc.simulate_accept(accept, mean, u, 6)
        assert got.dtype == torch.int32 and torch.equal(got, want), (got, want)
    assert sample.LOWERINGS["simulate_accept"] is sample.simulate_accept


# ---------------------------------------------------------------------------------------------------- vocab_expand

@pytest.mark.parametrize("lead, N, Vx, idx", [((1, 1), 7, 4999, torch.int32), ((2, 3), 300, 4999, torch.int64),
                                              ((5,), 1, 33, torch.int32)], ids=["1x1", "2x3-int64", "N=1"])
def test_vocab_expand_has_the_reference_values(lead: tuple, N: int, Vx: int, idx: torch.dtype) -> None:
    """A random map of N ids out of Vx (3 programs of EXPAND_BLOCK a row at Vx = 4999, the last ragged), fp32 and
    bf16 probabilities: every cell written (poisoned outputs), the gathered values exact, zeros off the map."""
    g = _gen(N)
    hot = torch.randperm(Vx, generator=g)[:N]
    inverse = torch.full((Vx,), -1, dtype=idx)
    inverse[hot] = torch.arange(N, dtype=idx)
    for dtype in DTYPES.values():
        probs = torch.rand(*lead, N, generator=g).to(dtype)
        with poisoned_empty():
            got = sample.vocab_expand(probs, inverse)
        want = torch.ops.lingc.vocab_expand(probs, inverse)
        assert got.dtype == torch.float32 and got.shape == (*lead, Vx) and torch.equal(got, want)
        assert torch.equal(got[..., hot], probs.float()) and int((got != 0).sum()) <= probs.numel()
    assert sample.LOWERINGS["vocab_expand"] is sample.vocab_expand


def test_vocab_expand_bad_arguments_rejected() -> None:
    with pytest.raises(ValueError, match="inverse_map \\[V\\] int32/int64"):
        sample.vocab_expand(torch.rand(1, 4), torch.zeros(4))
    with pytest.raises(ValueError, match="inverse_map \\[V\\] int32/int64"):
        sample.vocab_expand(torch.rand(1, 4), torch.zeros(2, 4, dtype=torch.int32))
