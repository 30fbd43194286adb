"""The `lingc bench` command: parse options, run `lingc.bench_client.run_benchmark`, print tables, write JSON.

Registered in lingc/cli.py as `app.command("bench")(bench)`. It keeps its own consoles, so importing it does not
import lingc.cli (no cycle), and imports the client (httpx) only when the command runs.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:      # the client imports httpx (the `serve` extra): only when the command runs
    from lingc.bench_client import BenchConfig, BenchReport

console = Console()
err = Console(stderr=True)


def _fail(message: str, code: int = 2) -> None:
    err.print(f"[bold red]error:[/bold red] {escape(message)}")
    raise typer.Exit(code)


def bench(base_url: str = typer.Option("http://127.0.0.1:30000", help="server root: `lingc serve` or any "
                                       "SGLang-compatible streaming /generate"),
          num_prompts: int = typer.Option(1000, help="measured requests (warm-up not included)"),
          random_input_len: int = typer.Option(1024, help="prompt tokens L: drawn uniformly in [L*ratio, L]"),
          random_output_len: int = typer.Option(1024, help="output tokens O: drawn uniformly in [O*ratio, O]; "
                                                "exact (ignore_eos)"),
          random_range_ratio: float = typer.Option(0.0, help="lower end of the length ranges as a fraction "
                                                   "(1.0 = exact lengths)"),
          max_concurrency: Optional[int] = typer.Option(None, help="requests in flight at most (default: all "
                                                        "at once)"),
          seed: int = typer.Option(1, help="workload seed (same seed, same lengths and prompt ids)"),
          warmup: int = typer.Option(1, help="warm-up requests (output min(O, 32)), excluded from the metrics"),
          api_key: Optional[str] = typer.Option(None, help="sent as 'Authorization: Bearer KEY' (redacted in "
                                                "the JSON)"),
          vocab_size: Optional[int] = typer.Option(None, help="prompt ids are drawn from [0, V) (default: "
                                                   "vocab_size from /get_server_info)"),
          backend: str = typer.Option("sglang", help="request format: sglang (streaming POST /generate)"),
          dataset_name: str = typer.Option("random", help="random or random-ids: both send random token ids "
                                           "(no tokenizer needed)"),
          extra_request_body: str = typer.Option("", help="JSON object merged into every /generate payload, "
                                                 "e.g. '{\"sampling_params\": {...}}'"),
          flush_cache: bool = typer.Option(True, "--flush-cache/--no-flush-cache",
                                           help="POST /flush_cache after the warm-up (resets the server's "
                                                "accept-length stats and prefix cache)"),
          timeout: float = typer.Option(3600.0, help="seconds allowed per connect / read"),
          json_out: Optional[Path] = typer.Option(None, "--json", help="write the full report (command, "
                                                  "parameters, server info, metrics, per-request rows) here")) -> None:
    """Benchmark a serving endpoint with bench_serving's random workload: TTFT, TPOT, ITL, E2E, throughput
    (mean and peak 1 s window), accept length and derived step time."""
    try:
        from lingc.bench_client import BenchConfig, BenchError, run_benchmark
    except ImportError as e:
        _fail(f"lingc bench needs httpx (pip install 'lingc[serve]'): {e}")
    from lingc.progress import progress_bar
    try:
        extra = json.loads(extra_request_body) if extra_request_body.strip() else {}
    except json.JSONDecodeError as e:
        _fail(f"--extra-request-body is not valid JSON: {e}")
    try:
        config = BenchConfig(base_url=base_url, num_prompts=num_prompts, random_input_len=random_input_len,
                             random_output_len=random_output_len, random_range_ratio=random_range_ratio,
                             max_concurrency=max_concurrency, seed=seed, warmup=warmup, api_key=api_key,
                             vocab_size=vocab_size, backend=backend, dataset_name=dataset_name,
                             extra_request_body=extra,
                             flush_cache=flush_cache, timeout_s=timeout)
    except BenchError as e:
        _fail(str(e))
    try:
        with progress_bar(f"bench {base_url}", num_prompts, enabled=sys.stderr.isatty()) as advance:
            report = run_benchmark(config, on_done=lambda _: advance(1))
    except BenchError as e:
        _fail(str(e))
    print_report(report)
    if json_out is not None:
        try:
            json_out.write_text(json.dumps(report.to_json(command_line(config, json_out)), indent=2)
                                + "\n")
        except OSError as e:
            _fail(f"cannot write the report to {json_out}: {e}")
        console.print(f"wrote [bold]{escape(str(json_out))}[/bold]")
    if report.metrics.completed == 0:
        _fail(f"no request succeeded ({report.metrics.failed} failed)", code=1)


def command_line(config: BenchConfig, json_out: Optional[Path] = None) -> str:
    """An equivalent `lingc bench` command line for the JSON report (the API key shown as ***)."""
    d = config.public()
    args = ["lingc", "bench", "--base-url", config.base_url, "--backend", config.backend,
            "--dataset-name", config.dataset_name]
    for name in ("num_prompts", "random_input_len", "random_output_len", "random_range_ratio",
                 "max_concurrency", "seed", "warmup", "vocab_size", "api_key"):
        if d[name] is not None:
            args += [f"--{name.replace('_', '-')}", str(d[name])]
    if config.extra_request_body:
        args += ["--extra-request-body", json.dumps(config.extra_request_body)]
    if not config.flush_cache:
        args.append("--no-flush-cache")
    if json_out is not None:
        args += ["--json", str(json_out)]
    return shlex.join(args)


def _f(value: Optional[float], digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_report(report: BenchReport) -> None:
    """Two rich tables (the run, latency statistics) and the most common errors."""
    m = report.metrics
    c = report.config
    conc = str(c.max_concurrency) if c.max_concurrency is not None else "unlimited"
    run = Table(title=f"lingc bench {escape(c.base_url)}")
    run.add_column("run")
    run.add_column("value", justify="right")
    rows = [("backend / max concurrency", f"{c.backend} / {conc}"), ("successful requests", str(m.completed)),
            ("failed requests", str(m.failed)),
            ("warm-up requests (excluded)", f"{len(report.warmup_results)}"
             + (f" ({sum(not r.success for r in report.warmup_results)} failed)"
                if any(not r.success for r in report.warmup_results) else "")),
            ("duration (s)", _f(m.duration)), ("input tokens", str(m.total_input_tokens)),
            ("output tokens", str(m.total_output_tokens)), ("request throughput (req/s)", _f(m.request_throughput)),
            ("output throughput (tok/s)", _f(m.output_throughput)),
            ("peak output throughput, 1 s window (tok/s)", _f(m.max_output_tokens_per_s)),
            ("peak concurrent requests, 1 s window", str(m.max_concurrent_requests)),
            ("concurrency (sum E2E / duration)", _f(m.concurrency)),
            ("accept length", f"{_f(m.accept_length)} ({m.accept_length_source})"),
            ("derived step time = mean TPOT x accept (ms)", _f(m.step_time_ms, 3))]
    if m.output_len_mismatches:
        rows.append(("[yellow]outputs not of the requested length[/yellow]", str(m.output_len_mismatches)))
    for row in rows:
        run.add_row(*row)
    console.print(run)
    lat = Table(title="latency (ms)")
    for col in ("metric", "mean", "median", "p99", "other"):
        lat.add_column(col, justify="left" if col in ("metric", "other") else "right")
    lat.add_row("TTFT", _f(m.mean_ttft_ms), _f(m.median_ttft_ms), _f(m.p99_ttft_ms), f"std {_f(m.std_ttft_ms)}")
    lat.add_row("TPOT (excl. 1st token)", _f(m.mean_tpot_ms, 3), _f(m.median_tpot_ms, 3), _f(m.p99_tpot_ms, 3),
                f"std {_f(m.std_tpot_ms, 3)}")
    lat.add_row("ITL", _f(m.mean_itl_ms, 3), _f(m.median_itl_ms, 3), _f(m.p99_itl_ms, 3),
                f"p95 {_f(m.p95_itl_ms, 3)}, max {_f(m.max_itl_ms, 3)}")
    lat.add_row("E2E latency", _f(m.mean_e2e_latency_ms), _f(m.median_e2e_latency_ms), _f(m.p99_e2e_latency_ms),
                f"p90 {_f(m.p90_e2e_latency_ms)}")
    console.print(lat)
    for message, count in report.error_counts().items():
        err.print(f"[yellow]{count} request(s) failed:[/yellow] {escape(message)}")
