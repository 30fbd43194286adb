"""`lingc bench`'s client: bench_serving's random workload against a streaming SGLang `/generate`, and its metrics.

The definitions follow sgl-project/sglang `python/sglang/bench_serving.py` (`sample_random_requests`,
`async_request_sglang_generate`, `calculate_metrics`) as summarised in /work/shared/docs/techniques.md §15:
TTFT per request; TPOT per request = (E2E - TTFT) / (output_len - 1), then averaged over requests; ITL
entries pooled over requests, a chunk carrying n new tokens contributing n entries of (gap / n); output
throughput = tokens / wall time from the first measured request's launch to the last one's end; peak output
throughput = the most tokens in one 1-second bin. Warm-up requests never enter the metrics. Accept length comes
from the server's `/get_server_info`, diffed or reset around the measured requests; derived step time = mean
TPOT x accept length. Times are seconds internally and milliseconds in `BenchMetrics`.

The file is past the style guide's ~400 lines because the request loop and the metrics must be read together
(each metric's definition depends on exactly what the loop records); the CLI formatting lives in bench_cli.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Callable, Optional

import httpx
import numpy as np

logger = logging.getLogger(__name__)

BACKENDS = ("sglang",)
DATASETS = ("random", "random-ids")    # both send random token ids here (bench_serving's random sends text)
WARMUP_MAX_OUTPUT = 32        # bench_serving's warm-up request decodes min(output_len, 32) tokens
PEAK_WINDOW_S = 1.0           # bench_serving's bins for max_output_tokens_per_s
# Cumulative spec counters in /get_server_info's internal state that give the measured run's exact accept
# length by difference: SGLang's scheduler attribute names, then `lingc serve`'s (runtime/server.py reports
# decode_steps and the average; accepted tokens are then average x steps).
VERIFY_STEPS_KEYS = ("spec_num_total_forward_ct", "decode_steps")
ACCEPTED_TOKENS_KEYS = ("spec_num_total_accepted_tokens", "committed")


class BenchError(Exception):
    """A user-facing problem with the options or the server (the CLI prints it without a traceback)."""


class StreamError(RuntimeError):
    """A /generate request that failed: bad status, an error chunk, a malformed or unfinished stream."""


@dataclass(frozen=True)
class BenchConfig:
    """One `lingc bench` run. Defaults are bench_serving's, except `flush_cache` (on, so the accept length
    and the prefix cache start clean after the warm-up)."""
    base_url: str = "http://127.0.0.1:30000"
    num_prompts: int = 1000
    random_input_len: int = 1024
    random_output_len: int = 1024
    random_range_ratio: float = 0.0
    max_concurrency: Optional[int] = None          # None: every request at once (request rate inf)
    seed: int = 1
    warmup: int = 1
    api_key: Optional[str] = None
    vocab_size: Optional[int] = None               # None: read `vocab_size` from /get_server_info
    backend: str = "sglang"
    dataset_name: str = "random"
    extra_request_body: dict = field(default_factory=dict)    # merged into every /generate payload
    flush_cache: bool = True
    timeout_s: float = 3600.0                      # per connect / read, not per request
    settle_s: float = 1.0                          # bench_serving sleeps 1 s between warm-up and the run

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise BenchError(f"--base-url must start with http:// or https://, got {self.base_url!r}")
        for name in ("num_prompts", "random_input_len", "random_output_len"):
            if getattr(self, name) < 1:
                raise BenchError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if not 0.0 <= self.random_range_ratio <= 1.0:
            raise BenchError(f"--random-range-ratio must be in [0, 1] (lengths are drawn from [L*ratio, L]), "
                             f"got {self.random_range_ratio}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise BenchError(f"--max-concurrency must be at least 1 (omit it for no limit), got {self.max_concurrency}")
        if self.warmup < 0:
            raise BenchError(f"--warmup must be 0 or more, got {self.warmup}")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise BenchError(f"--vocab-size must be at least 1, got {self.vocab_size}")
        if self.backend not in BACKENDS:
            raise BenchError(f"--backend {self.backend!r} is not supported; choose one of {', '.join(BACKENDS)}")
        if self.dataset_name not in DATASETS:
            raise BenchError(f"--dataset-name {self.dataset_name!r} is not supported; "
                             f"choose one of {', '.join(DATASETS)}")
        if not isinstance(self.extra_request_body, dict):
            raise BenchError("--extra-request-body must be a JSON object")
        if self.timeout_s <= 0:
            raise BenchError(f"--timeout must be positive, got {self.timeout_s}")

    def public(self) -> dict:
        """The parameters for the JSON report, with the API key redacted."""
        d = asdict(self)
        d["api_key"] = None if self.api_key is None else "***"
        return d


@dataclass(frozen=True)
class RequestSpec:
    prompt_ids: list[int]
    output_len: int


def sample_random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                           vocab_size: int, seed: int) -> list[RequestSpec]:
    """bench_serving's random workload as token ids: input and output lengths uniform in
    [max(int(L * ratio), 1), L], prompt ids uniform in [0, vocab_size). Same seed, same requests."""
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(max(int(input_len * range_ratio), 1), input_len + 1, size=num_prompts)
    out_lens = rng.integers(max(int(output_len * range_ratio), 1), output_len + 1, size=num_prompts)
    return [RequestSpec(rng.integers(0, vocab_size, size=int(n_in)).tolist(), int(n_out))
            for n_in, n_out in zip(in_lens, out_lens)]


@dataclass
class RequestResult:
    """One request's timeline, built chunk by chunk exactly as bench_serving does (`on_chunk`)."""
    input_len: int
    expected_output_len: int
    start_time: float = 0.0                        # perf_counter() just before the POST
    ttft: Optional[float] = None                   # seconds from start to the first chunk with tokens
    itl: list[float] = field(default_factory=list)  # one entry per token after the first chunk
    output_len: int = 0                            # completion_tokens of the last chunk
    first_chunk_tokens: int = 0                    # tokens the first chunk carried (ITL has no entry for them)
    latency: Optional[float] = None                # E2E seconds, start to end of stream
    error: Optional[str] = None
    _last_ts: float = 0.0

    @property
    def success(self) -> bool:
        return self.error is None and self.latency is not None

    @property
    def tpot(self) -> Optional[float]:
        """(E2E - TTFT) / (output_len - 1): time per output token excluding the first; None for 1 token."""
        if not self.success or self.output_len <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)

    def on_chunk(self, now: float, completion_tokens: int) -> None:
        """Account a streamed chunk whose cumulative token count is `completion_tokens`, received at `now`.
        A chunk with no new tokens is skipped without moving the timestamp; n new tokens after the first chunk
        add n ITL entries of (now - previous chunk) / n."""
        n_new = completion_tokens - self.output_len
        if n_new <= 0:
            return
        if self.ttft is None:
            self.ttft, self.first_chunk_tokens = now - self.start_time, n_new
        else:
            self.itl.extend([(now - self._last_ts) / n_new] * n_new)
        self._last_ts, self.output_len = now, completion_tokens

    def token_times(self) -> list[float]:
        """Each output token's arrival (perf_counter seconds): the first chunk's at start + TTFT, then
        start + TTFT + cumsum(ITL), as bench_serving rebuilds them for the peak window."""
        t = self.start_time + self.ttft
        times = [t] * self.first_chunk_tokens
        for gap in self.itl:
            t += gap
            times.append(t)
        return times

    def summary(self) -> dict:
        return {"input_len": self.input_len, "expected_output_len": self.expected_output_len,
                "output_len": self.output_len, "ttft_ms": _ms(self.ttft), "tpot_ms": _ms(self.tpot),
                "e2e_ms": _ms(self.latency), "error": self.error}


def _ms(seconds: Optional[float]) -> Optional[float]:
    return None if seconds is None else seconds * 1e3


# ---------------------------------------------------------------------------------------------- metrics

@dataclass(frozen=True)
class BenchMetrics:
    """bench_serving's result fields (same names, so its readers work), plus `failed`, `output_len_mismatches`,
    `accept_length_source` and `step_time_ms`. Latency statistics are None when nothing was measured."""
    completed: int
    failed: int
    output_len_mismatches: int       # successful requests whose output length differs from the requested one
    duration: float                  # seconds, launch of the first measured request to the end of the last
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_throughput: float
    max_output_tokens_per_s: float   # most output tokens in one 1 s bin from the earliest request start
    max_concurrent_requests: int     # most requests active in one of those bins
    concurrency: float               # sum of E2E / duration
    mean_ttft_ms: Optional[float]
    median_ttft_ms: Optional[float]
    std_ttft_ms: Optional[float]
    p99_ttft_ms: Optional[float]
    mean_tpot_ms: Optional[float]
    median_tpot_ms: Optional[float]
    std_tpot_ms: Optional[float]
    p99_tpot_ms: Optional[float]
    mean_itl_ms: Optional[float]
    median_itl_ms: Optional[float]
    std_itl_ms: Optional[float]
    p95_itl_ms: Optional[float]
    p99_itl_ms: Optional[float]
    max_itl_ms: Optional[float]
    mean_e2e_latency_ms: Optional[float]
    median_e2e_latency_ms: Optional[float]
    std_e2e_latency_ms: Optional[float]
    p90_e2e_latency_ms: Optional[float]
    p99_e2e_latency_ms: Optional[float]
    accept_length: Optional[float]
    accept_length_source: str
    step_time_ms: Optional[float]    # derived: mean TPOT x accept length


def _stats(name: str, values_s: list[float], percentiles: tuple[int, ...], with_max: bool = False) -> dict:
    """mean / median / std / pN (numpy's linear percentiles, as bench_serving) in ms; None for no values."""
    v = np.asarray(values_s, dtype=np.float64) * 1e3
    empty = v.size == 0
    out = {f"mean_{name}_ms": None if empty else float(v.mean()),
           f"median_{name}_ms": None if empty else float(np.median(v)),
           f"std_{name}_ms": None if empty else float(v.std())}
    out.update({f"p{p}_{name}_ms": None if empty else float(np.percentile(v, p)) for p in percentiles})
    if with_max:
        out[f"max_{name}_ms"] = None if empty else float(v.max())
    return out


def peak_windows(results: list[RequestResult], window_s: float = PEAK_WINDOW_S) -> tuple[float, int]:
    """(max output tokens per second, max concurrent requests) over `window_s` bins starting at the earliest
    successful request's start. A request is active in every bin from its start's to its end's."""
    ok = [r for r in results if r.success]
    if not ok:
        return 0.0, 0
    t0 = min(r.start_time for r in ok)
    tokens, active = Counter(), Counter()
    for r in ok:
        tokens.update(int((t - t0) // window_s) for t in r.token_times())
        first, last = int((r.start_time - t0) // window_s), int((r.start_time + r.latency - t0) // window_s)
        active.update(range(first, last + 1))
    return max(tokens.values(), default=0) / window_s, max(active.values())


def calculate_metrics(results: list[RequestResult], duration_s: float, accept_length: Optional[float] = None,
                      accept_length_source: str = "unavailable") -> BenchMetrics:
    """bench_serving's `calculate_metrics` over the measured requests (warm-up excluded by the caller)."""
    ok = [r for r in results if r.success]
    total_in, total_out = sum(r.input_len for r in ok), sum(r.output_len for r in ok)
    dur = max(duration_s, 1e-9)
    tpots = [r.tpot for r in ok if r.tpot is not None]
    e2e = [r.latency for r in ok]
    peak_tok_s, peak_requests = peak_windows(ok)
    stats = {**_stats("ttft", [r.ttft for r in ok], (99,)), **_stats("tpot", tpots, (99,)),
             **_stats("itl", [g for r in ok for g in r.itl], (95, 99), with_max=True),
             **_stats("e2e_latency", e2e, (90, 99))}
    step_ms = (stats["mean_tpot_ms"] * accept_length
               if accept_length is not None and stats["mean_tpot_ms"] is not None else None)
    return BenchMetrics(
        completed=len(ok), failed=len(results) - len(ok),
        output_len_mismatches=sum(r.output_len != r.expected_output_len for r in ok), duration=duration_s,
        total_input_tokens=total_in, total_output_tokens=total_out, request_throughput=len(ok) / dur,
        input_throughput=total_in / dur, output_throughput=total_out / dur,
        total_throughput=(total_in + total_out) / dur, max_output_tokens_per_s=peak_tok_s,
        max_concurrent_requests=peak_requests, concurrency=sum(e2e) / dur, **stats,
        accept_length=accept_length, accept_length_source=accept_length_source, step_time_ms=step_ms)


def _spec_state(info: Optional[dict]) -> dict:
    """The dict holding spec stats in /get_server_info: internal_states[0], decode[0] (PD mode), or the top."""
    if not isinstance(info, dict):
        return {}
    for key in ("internal_states", "decode"):
        states = info.get(key)
        if isinstance(states, list) and states and isinstance(states[0], dict):
            return states[0]
    return info


def _spec_counters(state: dict) -> Optional[tuple[float, float]]:
    """(accepted tokens, verify steps) so far, from the counters or from average x steps; None if absent."""
    def number(keys: tuple[str, ...]) -> Optional[float]:
        return next((state[k] for k in keys if isinstance(state.get(k), (int, float))), None)
    steps, accepted, avg = number(VERIFY_STEPS_KEYS), number(ACCEPTED_TOKENS_KEYS), state.get("avg_spec_accept_length")
    if steps is None:
        return None
    if accepted is None:
        accepted = avg * steps if isinstance(avg, (int, float)) else 0.0 if steps == 0 else None
    return None if accepted is None else (accepted, steps)


def accept_length_between(before: Optional[dict], after: Optional[dict], reset: bool) -> tuple[Optional[float], str]:
    """The measured run's accept length and how it was obtained.

    1. `diff`: both snapshots carry cumulative counts (accepted tokens, verify steps; see `_spec_counters`):
       the ratio of their differences covers exactly the measured requests.
    2. `reset`: the server's stats were reset (/flush_cache) after the warm-up: its running average.
    3. `cumulative`: no reset: the running average includes the warm-up and any earlier traffic.
    """
    b, a = _spec_counters(_spec_state(before)), _spec_counters(_spec_state(after))
    if a is not None and b is not None and a[1] > b[1]:
        return (a[0] - b[0]) / (a[1] - b[1]), "diff"
    avg = _spec_state(after).get("avg_spec_accept_length")
    if not isinstance(avg, (int, float)) or avg <= 0:
        return None, "unavailable"
    return float(avg), "reset" if reset else "cumulative"


# ------------------------------------------------------------------------------------------------- client

def _payload(spec: RequestSpec, extra: dict) -> dict:
    """bench_serving's sglang payload with token ids instead of text: greedy, ignore_eos, streamed. `extra` is
    merged one level deep (bench_serving merges flat), so {"sampling_params": {"temperature": 0.7}} keeps
    max_new_tokens and ignore_eos."""
    payload = {"input_ids": spec.prompt_ids,
               "sampling_params": {"temperature": 0.0, "max_new_tokens": spec.output_len, "ignore_eos": True},
               "stream": True, "return_logprob": False, "logprob_start_len": -1}
    for key, value in extra.items():
        both_dicts = isinstance(value, dict) and isinstance(payload.get(key), dict)
        payload[key] = {**payload[key], **value} if both_dicts else value
    return payload


def _completion_tokens(data: dict) -> Optional[int]:
    """Cumulative tokens so far: meta_info.completion_tokens (SGLang), else len(output_ids) (cumulative)."""
    n = (data.get("meta_info") or {}).get("completion_tokens")
    if isinstance(n, int):
        return n
    ids = data.get("output_ids")
    return len(ids) if isinstance(ids, list) else None


async def _stream_generate(client: httpx.AsyncClient, spec: RequestSpec, extra: dict, r: RequestResult) -> None:
    """POST /generate and feed every `data: {json}` line into `r`; raises on protocol errors."""
    done = False
    r.start_time = time.perf_counter()
    async with client.stream("POST", "/generate", json=_payload(spec, extra)) as resp:
        if resp.status_code != 200:
            body = (await resp.aread()).decode(errors="replace")[:200]
            raise StreamError(f"HTTP {resp.status_code}: {body or resp.reason_phrase}")
        async for line in resp.aiter_lines():
            line = line.strip()
            if not line.startswith("data:"):
                continue                      # blank separators, SSE comments, event: lines
            chunk = line[len("data:"):].strip()
            if chunk == "[DONE]":
                done = True
                break
            data = json.loads(chunk)
            if data.get("error"):
                raise StreamError(f"server error: {data['error']}")
            n = _completion_tokens(data)
            if n is None:
                raise StreamError("a chunk has neither meta_info.completion_tokens nor output_ids")
            r.on_chunk(time.perf_counter(), n)
    r.latency = time.perf_counter() - r.start_time
    if not done:
        raise StreamError(f"stream closed before data: [DONE] ({r.output_len} tokens)")
    if r.output_len == 0:
        raise StreamError("stream finished without tokens")


async def request_generate(client: httpx.AsyncClient, spec: RequestSpec, extra: dict) -> RequestResult:
    """One streamed request. Never raises (but for cancellation): a failure is recorded in `error`, so one bad
    request, or a dead server, is counted instead of ending the run."""
    r = RequestResult(input_len=len(spec.prompt_ids), expected_output_len=spec.output_len)
    try:
        await _stream_generate(client, spec, extra, r)
    except Exception as e:            # any failure is a counted error, by design (see the docstring)
        message = str(e) if isinstance(e, StreamError) else f"{type(e).__name__}: {e}"
        r.error = (message.splitlines() or [""])[0][:300]
        r.latency = None
    return r


class _Limiter:
    """The --max-concurrency semaphore, which also records the most requests in flight at once."""

    def __init__(self, limit: Optional[int]) -> None:
        self.sem = asyncio.Semaphore(limit) if limit else None
        self.in_flight = self.max_in_flight = 0

    async def run(self, client: httpx.AsyncClient, spec: RequestSpec, extra: dict,
                  on_done: Optional[Callable[[RequestResult], None]] = None) -> RequestResult:
        if self.sem is not None:
            await self.sem.acquire()
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            result = await request_generate(client, spec, extra)
        finally:
            self.in_flight -= 1
            if self.sem is not None:
                self.sem.release()
        if on_done is not None:
            on_done(result)
        return result


async def fetch_server_info(client: httpx.AsyncClient) -> dict:
    """GET /get_server_info (newer SGLang also serves /server_info); raises BenchError when neither answers."""
    problems = []
    for path in ("/get_server_info", "/server_info"):
        try:
            resp = await client.get(path)
        except httpx.HTTPError as e:
            raise BenchError(f"cannot reach {client.base_url}{path}: {type(e).__name__}: {e}") from e
        if resp.status_code == 200:
            try:
                return resp.json()
            except ValueError as e:
                raise BenchError(f"{client.base_url}{path} did not return JSON") from e
        problems.append(f"{path}: HTTP {resp.status_code}")
    raise BenchError(f"the server at {client.base_url} has no server info ({'; '.join(problems)})")


def vocab_size_of(info: dict) -> Optional[int]:
    """`vocab_size` at the top of the server info, or in internal_states[0]."""
    for d in (info, _spec_state(info)):
        v = d.get("vocab_size") if isinstance(d, dict) else None
        if isinstance(v, int) and v > 0:
            return v
    return None


async def _flush(client: httpx.AsyncClient) -> bool:
    try:
        return (await client.post("/flush_cache")).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class BenchReport:
    config: BenchConfig
    metrics: BenchMetrics
    server_info: dict                # after the run (or {"error": ...} when it could not be read)
    results: list[RequestResult]     # the measured requests, in prompt order
    warmup_results: list[RequestResult]
    flushed: bool
    max_in_flight: int               # client-side: most measured + warm-up requests in flight at once
    timestamp: str

    def error_counts(self, top: int = 5) -> dict[str, int]:
        return dict(Counter(r.error for r in self.results if r.error).most_common(top))

    def to_json(self, command: str) -> dict:
        return {"command": command, "timestamp": self.timestamp, "parameters": self.config.public(),
                "server_info": self.server_info, "metrics": asdict(self.metrics),
                "errors": self.error_counts(), "max_in_flight": self.max_in_flight,
                "warmup": {"requests": len(self.warmup_results),
                           "failed": sum(not r.success for r in self.warmup_results), "flushed": self.flushed},
                "requests": [r.summary() for r in self.results]}


async def run_benchmark_async(config: BenchConfig,
                              on_done: Optional[Callable[[RequestResult], None]] = None) -> BenchReport:
    """Warm up, reset the server's stats, run the measured requests under the concurrency limit, compute metrics."""
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    # No pool limit (bench_serving's aiohttp has none either: a pooled wait would count as TTFT); no proxies
    # from the environment, which would sit between the client and the server it measures.
    async with httpx.AsyncClient(base_url=config.base_url.rstrip("/"), headers=headers, trust_env=False,
                                 timeout=httpx.Timeout(config.timeout_s, pool=None),
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=None)) as client:
        try:
            info = await fetch_server_info(client)
        except BenchError as e:
            if config.vocab_size is None:
                raise BenchError(f"{e}; pass --vocab-size to run without it") from e
            info = {"error": str(e)}
        vocab = config.vocab_size or vocab_size_of(info)
        if vocab is None:
            raise BenchError(f"{config.base_url}/get_server_info reports no vocab_size; pass --vocab-size")
        specs = sample_random_requests(config.num_prompts, config.random_input_len, config.random_output_len,
                                       config.random_range_ratio, vocab, config.seed)
        limiter, extra = _Limiter(config.max_concurrency), config.extra_request_body
        warm = [RequestSpec(specs[i % len(specs)].prompt_ids, min(specs[i % len(specs)].output_len, WARMUP_MAX_OUTPUT))
                for i in range(config.warmup)]
        warmup_results = list(await asyncio.gather(*(limiter.run(client, s, extra) for s in warm)))
        flushed = config.flush_cache and await _flush(client)
        if warm or flushed:
            await asyncio.sleep(config.settle_s)
        before = await _info_or_none(client)
        t_start = time.perf_counter()
        results = list(await asyncio.gather(*(limiter.run(client, s, extra, on_done) for s in specs)))
        duration = time.perf_counter() - t_start
        after = await _info_or_none(client)
    accept, source = accept_length_between(before, after, flushed)
    metrics = calculate_metrics(results, duration, accept, source)
    return BenchReport(config, metrics, after if after is not None else info, results, warmup_results, flushed,
                       limiter.max_in_flight, datetime.now(timezone.utc).isoformat(timespec="seconds"))


async def _info_or_none(client: httpx.AsyncClient) -> Optional[dict]:
    try:
        return await fetch_server_info(client)
    except BenchError as e:
        logger.warning("%s", e)
        return None


def run_benchmark(config: BenchConfig, on_done: Optional[Callable[[RequestResult], None]] = None) -> BenchReport:
    """The synchronous entry point (`lingc bench` calls this)."""
    return asyncio.run(run_benchmark_async(config, on_done))
