"""lingc.bench_client's arithmetic on synthetic timelines: ITL split over multi-token chunks, TPOT excluding
TTFT and averaged per request, the 1 s peak window, throughput, accept length (diff / reset / cumulative),
the random workload and option checks. Timestamps are multiples of 1/8 s, exact in binary floating point."""

from __future__ import annotations

import numpy as np
import pytest

from lingc.bench_client import (BenchConfig, BenchError, RequestResult, accept_length_between, calculate_metrics,
                                peak_windows, sample_random_requests)


def timeline(start: float, chunks: list[tuple[float, int]], end: float | None = None,
             expected: int | None = None, error: str | None = None) -> RequestResult:
    """A request fed (time since start, cumulative completion_tokens) chunks, ending at `end` (default: the last)."""
    r = RequestResult(input_len=4, expected_output_len=expected if expected is not None else chunks[-1][1],
                      start_time=start)
    for t, n in chunks:
        r.on_chunk(start + t, n)
    r.latency = (end if end is not None else chunks[-1][0])
    if error:
        r.error, r.latency = error, None
    return r


def test_itl_splits_multi_token_chunks_evenly():
    r = timeline(10.0, [(0.25, 1), (0.375, 2), (1.125, 5), (1.125, 5), (1.5, 6)])
    assert r.ttft == 0.25 and r.first_chunk_tokens == 1 and r.output_len == 6
    # 3 tokens in the chunk at 1.125 share its 0.75 s gap; the repeated chunk (no new tokens) is skipped
    # without moving the timestamp, so the last gap is 1.5 - 1.125
    assert r.itl == [0.125, 0.25, 0.25, 0.25, 0.375]
    assert len(r.itl) == r.output_len - r.first_chunk_tokens


def test_a_first_chunk_with_several_tokens_has_no_itl_entries():
    r = timeline(0.0, [(0.5, 3), (0.75, 4)])
    assert (r.ttft, r.first_chunk_tokens, r.itl) == (0.5, 3, [0.25])
    assert r.token_times() == [0.5, 0.5, 0.5, 0.75]


def test_tpot_excludes_ttft_and_is_averaged_per_request():
    slow_start = timeline(0.0, [(10.0, 1), (10.25, 2), (10.5, 5), (11.25, 6)])     # TTFT 10 s
    assert slow_start.tpot == pytest.approx(1.25 / 5)                             # (E2E - TTFT) / (6 - 1)
    short = timeline(0.0, [(0.25, 1), (1.0, 2)])
    assert short.tpot == 0.75
    single = timeline(0.0, [(0.25, 1)])
    assert single.tpot is None                                                     # 1 token: no TPOT
    m = calculate_metrics([slow_start, short, single], duration_s=12.0)
    # mean of the per-request values (0.25 and 0.75), not pooled ((1.25 + 0.75) / 6 = 0.333 s)
    assert m.mean_tpot_ms == pytest.approx(500.0)
    assert m.median_tpot_ms == pytest.approx(500.0)
    assert m.mean_ttft_ms == pytest.approx((10.0 + 0.25 + 0.25) / 3 * 1e3)


def test_itl_is_pooled_over_requests():
    a = timeline(0.0, [(0.25, 1), (1.0, 4)])                 # three entries of 0.25
    b = timeline(0.0, [(0.25, 1), (0.375, 2)])               # one entry of 0.125
    m = calculate_metrics([a, b], duration_s=1.0)
    itl = np.array([0.25, 0.25, 0.25, 0.125]) * 1e3
    assert m.mean_itl_ms == pytest.approx(itl.mean())
    assert m.median_itl_ms == pytest.approx(np.median(itl))
    assert m.p95_itl_ms == pytest.approx(np.percentile(itl, 95))
    assert m.p99_itl_ms == pytest.approx(np.percentile(itl, 99))
    assert m.max_itl_ms == pytest.approx(250.0)


def test_peak_window_counts_tokens_per_one_second_bin():
    # r1: tokens at 0.25, 0.5, ..., 2.0 -> bins [0,1): 3, [1,2): 4, [2,3): 1
    r1 = timeline(0.0, [(0.25 * (i + 1), i + 1) for i in range(8)])
    # r2 starts at 0.5: tokens at 0.75, 0.875, 1.0, 1.125, 1.25 -> bin 0: 2, bin 1: 3
    r2 = timeline(0.5, [(0.25 + 0.125 * i, i + 1) for i in range(5)])
    assert r2.token_times() == [0.75, 0.875, 1.0, 1.125, 1.25]
    peak, concurrent = peak_windows([r1, r2])
    assert peak == 7.0                        # bin [1, 2): 4 + 3
    assert concurrent == 2                    # both active in bins 0 and 1
    m = calculate_metrics([r1, r2], duration_s=2.5)
    assert m.max_output_tokens_per_s == 7.0
    assert m.output_throughput == pytest.approx(13 / 2.5)   # mean throughput over the wall time
    assert m.max_output_tokens_per_s > m.output_throughput


def test_peak_window_bins_start_at_the_earliest_request():
    # Token times are rebuilt from ITL, so the chunk at 1.125 with 2 tokens puts them at 0.9375 and 1.125:
    # bins from the request start (100.0) hold 2 + 1 tokens; bins from the first token would hold all 3.
    late = timeline(100.0, [(0.75, 1), (1.125, 3)])
    assert late.token_times() == [100.75, 100.9375, 101.125]
    assert peak_windows([late]) == (2.0, 1)


def test_throughput_concurrency_and_failures():
    ok1 = timeline(0.0, [(0.25, 1), (0.5, 2), (1.0, 4)], expected=4)
    ok2 = timeline(0.5, [(0.25, 1), (1.5, 3)], expected=4)               # one token short
    bad = timeline(0.0, [(0.25, 1)], error="HTTP 500")
    m = calculate_metrics([ok1, ok2, bad], duration_s=2.0, accept_length=3.0, accept_length_source="diff")
    assert (m.completed, m.failed, m.output_len_mismatches) == (2, 1, 1)
    assert m.total_input_tokens == 8 and m.total_output_tokens == 7
    assert m.output_throughput == 3.5 and m.request_throughput == 1.0
    assert m.total_throughput == pytest.approx(15 / 2.0)
    assert m.concurrency == pytest.approx((1.0 + 1.5) / 2.0)
    assert m.mean_e2e_latency_ms == pytest.approx(1250.0)
    tpots = [(1.0 - 0.25) / 3, (1.5 - 0.25) / 2]
    assert m.mean_tpot_ms == pytest.approx(np.mean(tpots) * 1e3)
    assert m.step_time_ms == pytest.approx(m.mean_tpot_ms * 3.0)       # derived step time
    assert m.accept_length_source == "diff"


def test_no_successful_request_gives_empty_statistics():
    m = calculate_metrics([timeline(0.0, [(0.25, 1)], error="boom")], duration_s=1.0, accept_length=2.0)
    assert m.completed == 0 and m.failed == 1 and m.output_throughput == 0.0
    assert m.mean_ttft_ms is None and m.p99_itl_ms is None and m.step_time_ms is None
    assert m.max_output_tokens_per_s == 0.0


def test_accept_length_diff_reset_cumulative():
    def info(acc: int, steps: int, avg: float) -> dict:
        return {"internal_states": [{"spec_num_total_accepted_tokens": acc, "spec_num_total_forward_ct": steps,
                                     "avg_spec_accept_length": avg}]}
    # counters: only the measured run's 300 tokens over 100 steps count, whatever the running average says
    assert accept_length_between(info(50, 50, 1.0), info(350, 150, 2.33), reset=False) == (3.0, "diff")
    # lingc serve's form: decode_steps and the window's average (accepted = average x steps)
    lingc = {"internal_states": [{"avg_spec_accept_length": 2.0, "decode_steps": 10}]}
    lingc_after = {"internal_states": [{"avg_spec_accept_length": 2.8, "decode_steps": 40}]}
    assert accept_length_between(lingc, lingc_after, reset=False) == (pytest.approx((112 - 20) / 30), "diff")
    fresh = {"internal_states": [{"avg_spec_accept_length": None, "decode_steps": 0}]}
    assert accept_length_between(fresh, lingc_after, reset=False) == (pytest.approx(2.8), "diff")
    # counters that went backwards (stats reset mid-run) are not diffed
    assert accept_length_between(lingc_after, lingc, reset=False) == (2.0, "cumulative")
    avg_only = {"internal_states": [{"avg_spec_accept_length": 2.5}]}
    assert accept_length_between({}, avg_only, reset=True) == (2.5, "reset")
    assert accept_length_between(None, avg_only, reset=False) == (2.5, "cumulative")
    assert accept_length_between(None, {"decode": [{"avg_spec_accept_length": 4.0}]}, reset=True) == (4.0, "reset")
    assert accept_length_between(None, {"avg_spec_accept_length": 1.5}, reset=True) == (1.5, "reset")  # old SGLang
    assert accept_length_between(None, {"internal_states": [{}]}, reset=True) == (None, "unavailable")
    assert accept_length_between(None, None, reset=True) == (None, "unavailable")


def test_random_workload_lengths_and_ids():
    exact = sample_random_requests(20, 64, 16, 1.0, vocab_size=50, seed=3)
    assert all(len(s.prompt_ids) == 64 and s.output_len == 16 for s in exact)
    assert all(0 <= t < 50 for s in exact for t in s.prompt_ids)
    ranged = sample_random_requests(200, 100, 40, 0.5, vocab_size=1000, seed=3)
    in_lens, out_lens = [len(s.prompt_ids) for s in ranged], [s.output_len for s in ranged]
    assert min(in_lens) >= 50 and max(in_lens) <= 100 and len(set(in_lens)) > 10
    assert min(out_lens) >= 20 and max(out_lens) <= 40
    assert sample_random_requests(200, 100, 40, 0.5, 1000, seed=3) == ranged          # same seed, same requests
    assert sample_random_requests(200, 100, 40, 0.5, 1000, seed=4) != ranged
    assert min(s.output_len for s in sample_random_requests(100, 8, 8, 0.0, 10, seed=0)) >= 1   # never empty


@pytest.mark.parametrize("kwargs, needle", [
    ({"num_prompts": 0}, "--num-prompts"), ({"random_input_len": 0}, "--random-input-len"),
    ({"random_output_len": -1}, "--random-output-len"), ({"random_range_ratio": 1.5}, "--random-range-ratio"),
    ({"random_range_ratio": -0.1}, "--random-range-ratio"), ({"max_concurrency": 0}, "--max-concurrency"),
    ({"warmup": -1}, "--warmup"), ({"vocab_size": 0}, "--vocab-size"), ({"backend": "vllm"}, "--backend"),
    ({"dataset_name": "sharegpt"}, "--dataset-name"), ({"base_url": "127.0.0.1:30000"}, "--base-url"),
    ({"timeout_s": 0}, "--timeout"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_options_name_the_option(kwargs, needle):
    with pytest.raises(BenchError, match=needle):
        BenchConfig(**kwargs)


def test_parameters_redact_the_api_key():
    assert BenchConfig(api_key="secret").public()["api_key"] == "***"
    assert BenchConfig().public()["api_key"] is None
