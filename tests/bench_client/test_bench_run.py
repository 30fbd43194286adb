"""lingc.bench_client against the fake SGLang server: counts, exact output lengths, warm-up excluded, accept
length diffed around the run, failures counted (never raised), the concurrency limit, the payload."""

from __future__ import annotations

import pytest

from lingc.bench_client import BenchConfig, BenchError, run_benchmark

FAST = {"settle_s": 0.0, "timeout_s": 30.0}


def config(url: str, **kwargs) -> BenchConfig:
    base = {"num_prompts": 6, "random_input_len": 12, "random_output_len": 16, "random_range_ratio": 1.0,
            "max_concurrency": 2, "warmup": 1, **FAST}
    return BenchConfig(base_url=url, **{**base, **kwargs})


def test_run_counts_exact_lengths_and_warmup_excluded(fake):
    fake.reset(tokens_per_chunk=3, ttft_s=0.02, chunk_delay_s=0.004)
    report = run_benchmark(config(fake.url))
    m = report.metrics
    assert (m.completed, m.failed, m.output_len_mismatches) == (6, 0, 0)
    assert [r.output_len for r in report.results] == [16] * 6                  # ignore_eos: exact lengths
    assert m.total_output_tokens == 96 and m.total_input_tokens == 72
    # the warm-up request reached the server (output min(16, 32)) but not the metrics
    assert len(fake.payloads) == 7 and len(report.warmup_results) == 1 and report.warmup_results[0].success
    assert fake.flushes == 1 and report.flushed
    # 15 tokens after the first in 5 chunks of 3: ITL splits each chunk's gap over its 3 tokens
    assert all(len(r.itl) == 15 and r.itl[0] == r.itl[1] == r.itl[2] for r in report.results)
    assert (m.accept_length, m.accept_length_source) == (3.0, "diff")
    assert m.step_time_ms == pytest.approx(m.mean_tpot_ms * 3.0)
    assert m.mean_ttft_ms >= 20.0 and m.mean_tpot_ms > 0 and m.mean_e2e_latency_ms > m.mean_ttft_ms
    assert m.output_throughput > 0 and m.max_output_tokens_per_s > 0
    if m.duration < 1.0:             # one 1 s bin holds every token (peak < mean on a sub-second run)
        assert m.max_output_tokens_per_s == 96 and m.max_concurrent_requests == 6
    assert report.server_info["vocab_size"] == 1000


def test_payload_is_sglang_generate_with_ids(fake):
    run_benchmark(config(fake.url, num_prompts=2, warmup=0, extra_request_body={"rid_prefix": "bench"}))
    p = fake.payloads[0]
    assert len(p["input_ids"]) == 12 and all(0 <= t < 1000 for t in p["input_ids"])
    assert p["sampling_params"] == {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
    assert p["stream"] is True and p["rid_prefix"] == "bench"
    # --extra-request-body merges into sampling_params instead of replacing it (lengths stay exact)
    report = run_benchmark(config(fake.url, num_prompts=1, warmup=0,
                                  extra_request_body={"sampling_params": {"temperature": 0.7, "top_p": 0.9}}))
    assert fake.payloads[-1]["sampling_params"] == {"temperature": 0.7, "max_new_tokens": 16, "ignore_eos": True,
                                                   "top_p": 0.9}
    assert report.results[0].output_len == 16


def test_concurrency_limit_is_respected(fake):
    fake.reset(ttft_s=0.05, chunk_delay_s=0.002)
    report = run_benchmark(config(fake.url, num_prompts=8, max_concurrency=3, random_output_len=4))
    assert report.metrics.completed == 8
    assert fake.max_active == 3 and report.max_in_flight == 3           # reached, never exceeded
    fake.reset(ttft_s=0.1, chunk_delay_s=0.002)
    report = run_benchmark(config(fake.url, num_prompts=6, max_concurrency=None, random_output_len=4, warmup=0))
    assert report.max_in_flight == 6 and fake.max_active >= 4           # no hidden limit without the option


@pytest.mark.parametrize("failure", ["http", "stream_error", "truncate"])
def test_failures_are_counted_not_raised(fake, failure):
    fake.reset(fail_every=2, failure=failure)
    report = run_benchmark(config(fake.url, warmup=0, max_concurrency=1))
    m = report.metrics
    assert (m.completed, m.failed) == (3, 3)
    assert m.total_output_tokens == 3 * 16 and m.output_len_mismatches == 0
    needle = {"http": "HTTP 500", "stream_error": "injected mid-stream failure", "truncate": "[DONE]"}[failure]
    assert all(needle in message for message in report.error_counts())


def test_dead_server_is_counted_with_vocab_size_and_an_error_without(closed_port_url):
    report = run_benchmark(config(closed_port_url, num_prompts=3, vocab_size=100))
    assert report.metrics.completed == 0 and report.metrics.failed == 3
    assert report.metrics.accept_length is None and "error" in report.server_info
    with pytest.raises(BenchError, match="pass --vocab-size"):
        run_benchmark(config(closed_port_url))


def test_missing_vocab_size_is_a_clear_error(fake):
    fake.reset(vocab_size=None)
    with pytest.raises(BenchError, match="no vocab_size; pass --vocab-size"):
        run_benchmark(config(fake.url))
    report = run_benchmark(config(fake.url, vocab_size=50, num_prompts=2))
    assert report.metrics.completed == 2 and all(t < 50 for p in fake.payloads for t in p["input_ids"])


def test_server_without_text_or_server_info(fake):
    """No tokenizer (empty text) still counts tokens; no /get_server_info with --vocab-size: no accept length."""
    fake.reset(send_text=False, server_info=False)
    report = run_benchmark(config(fake.url, vocab_size=100, num_prompts=2, warmup=0))
    assert report.metrics.completed == 2 and report.metrics.total_output_tokens == 32
    assert report.metrics.accept_length is None and report.metrics.step_time_ms is None


def test_api_key_is_sent(fake):
    fake.reset(api_key="k1")
    assert run_benchmark(config(fake.url, num_prompts=2, warmup=0, api_key="k1")).metrics.completed == 2
    wrong = run_benchmark(config(fake.url, num_prompts=2, warmup=0, api_key="k2"))
    assert wrong.metrics.failed == 2 and "HTTP 401" in next(iter(wrong.error_counts()))
