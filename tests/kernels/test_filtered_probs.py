"""lingc.kernels.filtered_probs in the Triton interpreter against torch.ops.lingc.filtered_probs, at small vocabularies.

Greedy rows must be bit-identical to the reference; plain rows within fp32 tolerance; filtered rows must keep
exactly the reference's tokens (same nonzero positions) with values within tolerance. Logits are tie-free
(fp32 randn; bf16 drawn without replacement from 1280 distinct bf16 values), so the kept set is unambiguous.
Most tests use SMALL: chunks of 128 tokens, so V = 300 / 1000 spread over 3 / 8 programs per row and the
cross-program combination is exercised, and brackets of <= 32 tokens are finished exactly (larger ones go
through binned rounds first); BINNED resolves by bins alone; one test runs the shipped default configuration.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from lingc.kernels.filtered_probs import FilteredProbsConfig, filtered_probs, filtered_probs_ref

SMALL = FilteredProbsConfig(chunk=128, bins_k=(16, 64, 64), bins_p=(16, 64, 64), cell=1024, exact=32)
BINNED = FilteredProbsConfig(chunk=128, bins_k=(16, 64, 64), bins_p=(16, 64, 64), cell=1024, exact=2)
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the interpreter's int(ndarray) in loops
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
VOCABS = [37, 300, 1000]
# every (top_k, top_p) of the task, one request each; (0, 1.0) is the unfiltered row
COMBOS = [(k, p) for k in (0, 1, 5) for p in (1.0, 0.9, 0.3)]


def _distinct_bf16(n: int, g: torch.Generator) -> torch.Tensor:
    """n distinct bf16 values +-2^e * (1 + m/128), e in -2..2 (1280 values), in random order, as fp32."""
    e = torch.arange(-2, 3).repeat_interleave(128)
    m = torch.arange(128).repeat(5)
    pool = torch.cat([(2.0 ** e) * (1 + m / 128), -(2.0 ** e) * (1 + m / 128)])        # exact in bf16
    return pool[torch.randperm(pool.numel(), generator=g)[:n]]


def _logits(b: int, t: int, v: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bfloat16:
        rows = [_distinct_bf16(v, g) for _ in range(b * t)]
        return torch.stack(rows).view(b, t, v).to(dtype)                               # [B, T, V]
    return (torch.randn(b, t, v, generator=g) * 2).to(dtype)                           # [B, T, V]


def _params(temps: list[float], ks: list[int], ps: list[float]) -> tuple[torch.Tensor, ...]:
    return torch.tensor(temps), torch.tensor(ks, dtype=torch.int64), torch.tensor(ps)


def _check(got: torch.Tensor, logits: torch.Tensor, temp: torch.Tensor, k: torch.Tensor, p: torch.Tensor,
           assert_close: Callable) -> None:
    want = filtered_probs_ref(logits, temp, k, p)
    assert got.shape == want.shape and got.dtype == torch.float32
    greedy = (temp <= 0).view(-1, 1, 1).expand_as(want)
    assert torch.equal(got[greedy], want[greedy]), "greedy rows are not bit-identical"
    for b in range(want.shape[0]):
        if temp[b] <= 0 or not (0 < k[b] < want.shape[-1] or p[b] < 1):
            continue  # plain rows: values only (the reference's fp32 cumsum may reach 1.0 and drop tiny tails)
        for t in range(want.shape[1]):
            kept, want_kept = got[b, t] > 0, want[b, t] > 0
            assert torch.equal(kept, want_kept), (
                f"row ({b}, {t}) T={temp[b].item()} k={k[b].item()} p={p[b].item()}: kept "
                f"{kept.sum().item()} tokens, reference {want_kept.sum().item()}, differing at "
                f"{(kept ^ want_kept).nonzero().flatten().tolist()[:8]}")
    assert_close(got, want)


@pytest.mark.parametrize("v", VOCABS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_greedy_rows_bit_identical(v: int, dtype: torch.dtype) -> None:
    logits = _logits(3, 2, v, dtype, seed=v)
    logits[1, 1, v // 3] = logits[1, 1, v - 1] = logits[1, 1].max() + 1                 # tie: lowest id wins
    temp, k, p = _params([0.0, 0.0, -1.0], [0, 5, 1], [1.0, 0.3, 0.9])
    got = filtered_probs(logits, temp, k, p, config=SMALL)
    assert torch.equal(got, filtered_probs_ref(logits, temp, k, p))
    assert got[1, 1, v // 3] == 1.0


@pytest.mark.parametrize("v", VOCABS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_every_filter_combination(v: int, dtype: torch.dtype, assert_kernel_close: Callable) -> None:
    """One request per (top_k, top_p) in {0, 1, 5} x {1.0, 0.9, 0.3} (plain included), T = 1."""
    temps = [0.7 + 0.2 * i for i in range(len(COMBOS))]
    temp, k, p = _params(temps, [c[0] for c in COMBOS], [c[1] for c in COMBOS])
    logits = _logits(len(COMBOS), 1, v, dtype, seed=v + 7)
    got = filtered_probs(logits, temp, k, p, config=SMALL)
    _check(got, logits, temp, k, p, assert_kernel_close)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_mixed_rows_one_call(dtype: torch.dtype, assert_kernel_close: Callable) -> None:
    """Request 0 greedy, 1 top-p, 2 top-k, T = 4 (a verify chain): each row follows its own parameters."""
    temp, k, p = _params([0.0, 0.9, 1.1], [0, 0, 5], [1.0, 0.9, 1.0])
    logits = _logits(3, 4, 1000 if dtype == torch.float32 else 300, dtype, seed=3)
    got = filtered_probs(logits, temp, k, p, config=SMALL)
    _check(got, logits, temp, k, p, assert_kernel_close)
    assert torch.allclose(got.sum(-1), torch.ones(3, 4), atol=1e-5)


def test_binned_rounds_without_exact_finish(assert_kernel_close: Callable) -> None:
    """exact = 2: every threshold is isolated by the value bins alone (a bin holding one token)."""
    temp, k, p = _params([0.9, 1.1, 0.7], [0, 5, 60], [0.9, 1.0, 0.8])
    logits = _logits(3, 1, 300, torch.float32, seed=29)
    _check(filtered_probs(logits, temp, k, p, config=BINNED), logits, temp, k, p, assert_kernel_close)


def test_row_invariance() -> None:
    """Each (b, t) row alone gives the same bits as inside the full [3, 2, V] call."""
    temp, k, p = _params([0.0, 0.8, 1.3], [0, 7, 0], [1.0, 0.5, 0.9])
    logits = _logits(3, 2, 300, torch.float32, seed=5)
    full = filtered_probs(logits, temp, k, p, config=SMALL)
    for b in range(3):
        for t in range(2):
            alone = filtered_probs(logits[b:b + 1, t:t + 1], temp[b:b + 1], k[b:b + 1], p[b:b + 1], config=SMALL)
            assert torch.equal(alone[0, 0], full[b, t]), f"row ({b}, {t}) changed bits alone"


def test_default_config(assert_kernel_close: Callable) -> None:
    """The shipped tunables (chunk 1024, bins 32/256 and 32/64/256): V = 5000 spans 5 programs per row."""
    temp, k, p = _params([0.0, 0.9, 1.1, 0.6], [0, 0, 5, 40], [1.0, 0.9, 1.0, 0.8])
    logits = _logits(4, 1, 5000, torch.float32, seed=11)
    _check(filtered_probs(logits, temp, k, p), logits, temp, k, p, assert_kernel_close)


def test_strided_logits_and_int32_top_k(assert_kernel_close: Callable) -> None:
    """A [B, 1, V] view of position 2 of [B, 4, V] logits (row stride 4V), top_k given as int32."""
    base = _logits(2, 4, 300, torch.float32, seed=13)
    logits = base[:, 2:3]
    temp, k, p = _params([1.0, 0.8], [5, 0], [1.0, 0.3])
    got = filtered_probs(logits, temp, k.to(torch.int32), p, config=SMALL)
    _check(got, logits, temp, k, p, assert_kernel_close)


def test_ties_at_the_threshold_are_kept() -> None:
    """Documented tie rule: top_k = 2 with three tokens tied for second keeps all four."""
    logits = torch.tensor([[[0.0, 3.0, 1.0, 2.0, 2.0, -1.0, 2.0]]])
    got = filtered_probs(logits, torch.tensor([1.0]), torch.tensor([2]), torch.tensor([1.0]), config=SMALL)
    assert (got[0, 0] > 0).tolist() == [False, True, False, True, True, False, True]
    assert torch.allclose(got.sum(), torch.tensor(1.0))


def test_edge_parameters(assert_kernel_close: Callable) -> None:
    """top_k >= V and top_k < 0 are off; top_p <= 0 keeps the top token (the reference divides 0 by 0);
    -inf logits get probability 0 and do not disturb the filters."""
    logits = _logits(4, 1, 300, torch.float32, seed=17)
    logits[:, :, :10] = float("-inf")
    temp, k, p = _params([1.0, 1.0, 0.5, 1.0], [300, -3, 0, 4], [0.9, 0.9, 0.0, 0.9])
    got = filtered_probs(logits, temp, k, p, config=SMALL)
    want = filtered_probs_ref(logits, temp, k, p)
    for b in (0, 1, 3):
        assert torch.equal(got[b] > 0, want[b] > 0)
        assert_kernel_close(got[b], want[b])
    assert torch.equal(got[2, 0], torch.zeros(300).index_fill_(0, logits[2, 0].argmax().view(1), 1.0))


def test_unresolved_bracket_keeps_a_superset() -> None:
    """With a single 2-bin top-p round the threshold is not isolated: the kernel keeps a superset."""
    coarse = FilteredProbsConfig(chunk=128, bins_k=(2,), bins_p=(2,), cell=256, exact=2)
    temp, k, p = _params([1.0], [0], [0.5])
    logits = _logits(1, 1, 300, torch.float32, seed=19)
    got, want = filtered_probs(logits, temp, k, p, config=coarse), filtered_probs_ref(logits, temp, k, p)
    assert ((want > 0) & ~(got > 0)).sum() == 0 and (got > 0).sum() > (want > 0).sum()
    assert torch.allclose(got.sum(), torch.tensor(1.0))


def test_pdl_on_cpu_falls_back() -> None:
    temp, k, p = _params([0.0, 1.0], [0, 5], [1.0, 0.9])
    logits = _logits(2, 1, 37, torch.float32, seed=23)
    assert torch.equal(filtered_probs(logits, temp, k, p, pdl=True, config=SMALL),
                       filtered_probs(logits, temp, k, p, config=SMALL))


def test_bad_shapes_and_dtypes() -> None:
    logits = _logits(2, 1, 37, torch.float32, seed=0)
    temp, k, p = _params([1.0, 1.0], [0, 0], [1.0, 1.0])
    with pytest.raises(ValueError, match=r"temperature has shape \[3\], want \[2\]"):
        filtered_probs(logits, torch.ones(3), k, p)
    with pytest.raises(ValueError, match=r"want \[B, T, V\]"):
        filtered_probs(logits[:, 0], temp, k, p)
    with pytest.raises(ValueError, match="top_k is torch.float32"):
        filtered_probs(logits, temp, k.float(), p)
    with pytest.raises(ValueError, match="powers of two"):
        filtered_probs(logits, temp, k, p, config=FilteredProbsConfig(chunk=100))


def test_exact_finish_waits_for_a_short_gather(assert_kernel_close: Callable) -> None:
    """scan_max: a first round's bin of few tokens (top-k 50 near the max) is binned again rather than gathered
    from every slice's whole chunk; the kept set is the same as finishing it at once (scan_max unbounded), the
    values within rounding (the normaliser is summed per bin instead of per gathered token)."""
    from dataclasses import replace
    temp, k, p = _params([0.8, 0.8, 1.0], [50, 0, 0], [0.99, 0.9, 0.9])
    logits = _logits(3, 1, 5000, torch.float32, seed=23)
    logits[:2] *= 1.5                                                                  # peaked rows
    gated = filtered_probs(logits, temp, k, p)
    assert 1 < (gated[0] > 0).sum() <= 50                                              # top-k 50 decides row 0
    at_once = filtered_probs(logits, temp, k, p, config=replace(FilteredProbsConfig(), scan_max=1 << 30))
    assert torch.equal(gated > 0, at_once > 0)
    torch.testing.assert_close(gated, at_once, rtol=1e-5, atol=1e-7)
    _check(gated, logits, temp, k, p, assert_kernel_close)


def test_without_the_exact_finish_the_kept_set_is_a_superset() -> None:
    """finish=False, one round a phase (the coarse distribution a draft may sample from): each filter keeps its last
    round's whole crossing bin, so the kept set contains the exact one; greedy and plain rows are unchanged, every
    row sums to 1, and kept values are the softmax renormalised over the kept set."""
    coarse = FilteredProbsConfig(bins_k=(32,), bins_p=(32,), finish=False)
    temp, k, p = _params([0.0, 0.8, 1.0, 0.8, 1.2], [0, 0, 0, 50, 7], [1.0, 1.0, 0.9, 0.9, 0.6])
    logits = _logits(5, 2, 5000, torch.float32, seed=31)
    got = filtered_probs(logits, temp, k, p, config=coarse)
    exact = filtered_probs(logits, temp, k, p)
    assert torch.equal(got[:2], exact[:2])                                             # greedy, plain
    assert ((exact > 0) <= (got > 0)).all() and ((got > 0).sum() > (exact > 0).sum())  # a strict superset here
    torch.testing.assert_close(got.sum(-1), torch.ones(5, 2), rtol=0, atol=1e-5)
    x = logits[2:] / temp[2:].view(-1, 1, 1)
    want = torch.softmax(x.masked_fill(got[2:] == 0, -torch.inf), dim=-1)
    torch.testing.assert_close(got[2:], want, rtol=1e-5, atol=1e-7)


def test_filters_mask_skips_the_off_rounds_with_the_same_bits() -> None:
    """filters (passes/specialize_sampling.py's copies): with top-k's bit clear the top-k rounds are not launched,
    with both clear no round is; rows whose filters are off anyway get the bits of the full call (greedy, plain and
    top-p-only rows side by side), and a row whose cleared filter was on reads it as off, as the reference does."""
    temp, k, p = _params([0.0, 0.8, 1.3, 0.7], [0, 0, 0, 0], [1.0, 1.0, 0.9, 0.5])
    logits = _logits(4, 2, 300, torch.float32, seed=21)
    full = filtered_probs(logits, temp, k, p, config=SMALL)
    nucleus = filtered_probs(logits, temp, k, p, 2, config=SMALL)
    assert torch.equal(nucleus, full)
    plain_rows = slice(0, 2)
    plain = filtered_probs(logits[plain_rows], temp[plain_rows], k[plain_rows], p[plain_rows], 0, config=SMALL)
    assert torch.equal(plain, full[plain_rows])
    k_on = torch.tensor([5, 0, 3, 0])
    assert torch.equal(filtered_probs(logits, temp, k_on, p, 2, config=SMALL), full)     # top-k read as off
    assert torch.equal(filtered_probs(logits, temp, k_on, p, 0, config=SMALL),
                       filtered_probs(logits, temp, torch.zeros(4, dtype=torch.int64), torch.ones(4), config=SMALL))
    ref = torch.ops.lingc.filtered_probs
    assert torch.equal(ref(logits, temp, k_on, p, 2), ref(logits, temp, k, p))
    with pytest.raises(ValueError, match="filters is a mask"):
        filtered_probs(logits, temp, k, p, 4, config=SMALL)
