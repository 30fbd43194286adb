"""The serving scheduler: one thread owns the Engine and runs one request at a time from a bounded FIFO queue.

Batch 1 is the product, so there is no batching: `Scheduler.submit` puts a `Job` in the queue (or raises
`QueueFull` when `max_queue` jobs already wait), the thread pops jobs in order and calls
`engine.generate(request, on_tokens)`. Every event of a job goes to its `sink` (called on the scheduler
thread; the HTTP server forwards it to the event loop): `("tokens", [ids])` per step, then exactly one of
`("done", Result)` or `("error", exception)`. `Job.cancel` removes a waiting job from the queue, or makes the
running job's next `on_tokens` return False, which aborts it inside the engine (its slot and pages are freed
before the next job starts). `ServerStats` keeps the Prometheus metrics and the accept-length window that
`/get_server_info` reports.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from lingc.runtime.engine import EngineError, Request, Result

log = logging.getLogger(__name__)

Event = tuple[str, Any]          # ("tokens", list[int]) | ("done", Result) | ("error", Exception)


class QueueFull(Exception):
    """The wait queue holds `max_queue` jobs; `retry_after_s` is an estimate of when a place frees up."""

    def __init__(self, max_queue: int, retry_after_s: int):
        super().__init__(f"the server is busy: {max_queue} request(s) already wait (--max-queue {max_queue}); "
                         f"retry in about {retry_after_s} s")
        self.retry_after_s = retry_after_s


class ShuttingDown(Exception):
    """The scheduler stopped before the job ran."""


@dataclass(eq=False)
class Job:
    request: Request
    sink: Callable[[Event], None]
    route: str = ""
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None
    first_token: float | None = None
    cancel_reason: str | None = None          # "disconnect", "stop" (a stop string matched), "shutdown"

    def cancel(self, reason: str = "disconnect") -> None:
        """Abort at the engine's next step (set from any thread; the scheduler only reads it)."""
        if self.cancel_reason is None:
            self.cancel_reason = reason


class Histogram:
    """A Prometheus histogram with fixed upper bounds (cumulative buckets, sum, count)."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds, self.counts, self.sum, self.count = bounds, [0] * len(bounds), 0.0, 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, b in enumerate(self.bounds):
            if value <= b:
                self.counts[i] += 1

    def render(self, name: str, help_: str) -> list[str]:
        lines = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
        lines += [f'{name}_bucket{{le="{b:g}"}} {c}' for b, c in zip(self.bounds, self.counts)]
        return lines + [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.9g}",
                        f"{name}_count {self.count}"]


_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_STEP_SECONDS = (0.0005, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class ServerStats:
    """Counters and histograms for /metrics (monotonic since start) plus a resettable accept-length window
    for /get_server_info (SGLang's `avg_spec_accept_length`: committed tokens / decode steps, pooled)."""

    def __init__(self, draft_tokens: int):
        self.lock = threading.Lock()
        self.http: dict[tuple[str, int], int] = {}                 # (route, status) -> count
        self.finished: dict[tuple[str, str], int] = {}             # (route, finish reason) -> count
        self.prompt_tokens = self.generation_tokens = 0
        self.ttft, self.e2e, self.queue = Histogram(_SECONDS), Histogram(_SECONDS), Histogram(_SECONDS)
        self.tpot, self.step = Histogram(_STEP_SECONDS + (2.5,)), Histogram(_STEP_SECONDS)
        self.accept = Histogram(tuple(float(i) for i in range(1, draft_tokens + 1)))
        self.started = time.time()
        self.reset_window()

    def reset_window(self) -> None:
        with self.lock:
            self.window = {"since": time.time(), "requests": 0, "steps": 0, "committed": 0, "completion_tokens": 0}

    def count_http(self, route: str, status: int) -> None:
        with self.lock:
            self.http[route, status] = self.http.get((route, status), 0) + 1

    def record(self, job: Job, result: Result, finish: str, now: float) -> None:
        with self.lock:
            key = (job.route, finish)
            self.finished[key] = self.finished.get(key, 0) + 1
            self.prompt_tokens += len(job.request.prompt)
            self.generation_tokens += len(result.tokens)
            self.queue.observe(job.started - job.submitted)
            self.e2e.observe(now - job.submitted)
            if job.first_token is not None:
                self.ttft.observe(job.first_token - job.submitted)
            if len(result.tokens) > 1:
                self.tpot.observe(result.tpot_s)
            for n in result.accept_lens:
                self.accept.observe(n)
            w = self.window
            w["requests"] += 1
            w["steps"] += len(result.accept_lens)
            w["committed"] += sum(result.accept_lens)
            w["completion_tokens"] += len(result.tokens)

    def record_error(self, job: Job) -> None:
        with self.lock:
            key = (job.route, "error")
            self.finished[key] = self.finished.get(key, 0) + 1

    def observe_step(self, seconds: float) -> None:
        with self.lock:
            self.step.observe(seconds)

    def window_summary(self) -> dict[str, Any]:
        with self.lock:
            w = dict(self.window)
        w["avg_spec_accept_length"] = w["committed"] / w["steps"] if w["steps"] else None
        return w

    def render(self, queue_depth: int, running: int) -> str:
        """The Prometheus text exposition (format 0.0.4)."""
        with self.lock:
            lines = ["# HELP lingc_http_requests_total HTTP requests by route and status code.",
                     "# TYPE lingc_http_requests_total counter"]
            lines += [f'lingc_http_requests_total{{route="{r}",status="{s}"}} {n}'
                      for (r, s), n in sorted(self.http.items())]
            lines += ["# HELP lingc_requests_finished_total Engine runs by finish reason (stop, length, abort, error).",
                      "# TYPE lingc_requests_finished_total counter"]
            lines += [f'lingc_requests_finished_total{{route="{r}",finish_reason="{f}"}} {n}'
                      for (r, f), n in sorted(self.finished.items())]
            for name, value, help_ in (("prompt_tokens", self.prompt_tokens, "Prompt tokens prefilled."),
                                       ("generation_tokens", self.generation_tokens, "Tokens generated.")):
                lines += [f"# HELP lingc_{name}_total {help_}", f"# TYPE lingc_{name}_total counter",
                          f"lingc_{name}_total {value}"]
            for name, value, help_ in (("queue_depth", queue_depth, "Requests waiting for the engine."),
                                       ("running_requests", running, "Requests decoding now (0 or 1)."),
                                       ("start_time_seconds", self.started, "Server start, Unix time.")):
                lines += [f"# HELP lingc_{name} {help_}", f"# TYPE lingc_{name} gauge", f"lingc_{name} {value}"]
            for hist, name, help_ in (
                    (self.ttft, "time_to_first_token_seconds", "Arrival to first token (queueing included)."),
                    (self.tpot, "time_per_output_token_seconds", "Per request: (latency - TTFT) / (tokens - 1)."),
                    (self.e2e, "e2e_request_latency_seconds", "Arrival to the last token."),
                    (self.queue, "queue_wait_seconds", "Arrival to the engine starting the request."),
                    (self.step, "step_seconds", "Host time between consecutive decode steps' tokens."),
                    (self.accept, "spec_accept_length", "Tokens committed per decode step (bonus included).")):
                lines += hist.render(f"lingc_{name}", help_)
        return "\n".join(lines) + "\n"


def _bind_device(engine: Any) -> None:
    """Make the engine's GPU this thread's current CUDA device: a new thread starts on cuda:0, and Triton launches on
    the current device (a TP rank's engine on cuda:1 would otherwise launch its kernels on the wrong GPU)."""
    device = getattr(getattr(engine, "exe", None), "device", None)
    if getattr(device, "type", None) == "cuda" and device.index is not None:     # Executor always names the index
        import torch
        torch.cuda.set_device(device)


class Scheduler:
    """Owns `engine` on one thread; see the module docstring."""

    def __init__(self, engine: Any, max_queue: int = 64, stats: ServerStats | None = None):
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.engine, self.max_queue = engine, max_queue
        self.stats = stats or ServerStats(getattr(engine, "opt", {}).get("draft_tokens", 1))
        self.waiting: deque[Job] = deque()
        self.cond = threading.Condition()
        self.running: Job | None = None
        self.stopping = False
        self.mean_request_s = 1.0                    # for Retry-After: a running mean of engine time per request
        self.on_fatal: Callable[[BaseException], None] | None = None   # called once the engine can run nothing more
        self.thread = threading.Thread(target=self._loop, name="lingc-scheduler", daemon=True)

    def start(self, warmup: Request | None = None) -> None:
        """Start the thread; a warm-up request (first-call initialisation) runs first, outside the stats."""
        if warmup is not None:
            _bind_device(self.engine)
            self.engine.generate(warmup)
        self.thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Abort the running job, fail the waiting ones with ShuttingDown, and join the thread."""
        with self.cond:
            self.stopping = True
            waiting, self.waiting = list(self.waiting), deque()
            if self.running is not None:
                self.running.cancel("shutdown")
            self.cond.notify_all()
        for job in waiting:
            self._emit(job, ("error", ShuttingDown("the server is shutting down")))
        if self.thread.is_alive():
            self.thread.join(timeout_s)

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    def submit(self, request: Request, sink: Callable[[Event], None], route: str = "") -> Job:
        job = Job(request, sink, route)
        with self.cond:
            if self.stopping:
                raise ShuttingDown("the server is shutting down")
            ahead = len(self.waiting) + (self.running is not None)
            if ahead > self.max_queue:                # max_queue wait, one runs
                raise QueueFull(self.max_queue, max(1, math.ceil(ahead * self.mean_request_s)))
            self.waiting.append(job)
            self.cond.notify()
        return job

    def cancel(self, job: Job, reason: str = "disconnect") -> None:
        """Drop a waiting job (no event follows), or abort the running one at its next step."""
        with self.cond:
            job.cancel(reason)
            try:
                self.waiting.remove(job)
            except ValueError:
                pass

    # ---- the scheduler thread ---------------------------------------------------------------
    def _loop(self) -> None:
        _bind_device(self.engine)
        while True:
            with self.cond:
                while not self.waiting and not self.stopping:
                    self.cond.wait()
                if self.stopping:
                    return
                job = self.running = self.waiting.popleft()
            try:
                self._run(job)
            finally:
                with self.cond:
                    self.running = None

    def _run(self, job: Job) -> None:
        job.started = last = time.perf_counter()

        def on_tokens(tokens: list[int]) -> bool:
            nonlocal last
            now = time.perf_counter()
            if job.first_token is None:
                job.first_token = now
            else:
                self.stats.observe_step(now - last)
            last = now
            if job.cancel_reason is None:
                self._emit(job, ("tokens", tokens))
            return job.cancel_reason is None

        try:
            result = self.engine.generate(job.request, on_tokens)
        except Exception as e:                        # never let one request kill the thread
            if not isinstance(e, EngineError):        # (the server checks requests first; EngineError is a backstop)
                log.exception("request failed in the engine")
            self.stats.record_error(job)
            self._emit(job, ("error", e))
            if getattr(e, "fatal", False) and self.on_fatal is not None:
                self.on_fatal(e)                      # e.g. a dead TP rank: the server stops rather than serve errors
            return
        now = time.perf_counter()
        self.mean_request_s = 0.8 * self.mean_request_s + 0.2 * (now - job.started)
        finish = "stop" if job.cancel_reason == "stop" else result.finish_reason
        self.stats.record(job, result, finish, now)
        self._emit(job, ("done", result))

    def _emit(self, job: Job, event: Event) -> None:
        try:
            job.sink(event)
        except Exception:                             # the listener is gone (e.g. its event loop closed)
            job.cancel("disconnect")
