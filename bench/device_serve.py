"""The HTTP server's overhead on TPOT: one Engine timed directly and behind `lingc serve`'s app, on one GPU.

Model: Ling-3.0-tiny + 1 MTP layer, random weights drawn on the GPU (lingc.init.random_model, as bench/device_step.py),
bf16, traced (prefill, decode, mtp_prefill, mtp_decode, step, nextn), every pass, one Engine (CUDA default: Triton
kernels, CUDA graphs, PDL) with NEXTN and simulated acceptance (`--simulate-accept-len 3.2`). Workload: bench_serving's
random requests at exact lengths (lingc.bench_client.sample_random_requests; 1024-token prompts, 256 new tokens,
greedy, ignore_eos, seed 0 so that the simulated acceptance is the same), the same prompts in every run:

    direct            Engine.generate on the main thread; token arrival times taken in `on_tokens` (what the
                      server streams), run before and after the server (pooled)
    http              the same Engine behind runtime.server's app (`ServerThread`: create_app + uvicorn on 127.0.0.1,
                      a free port, in a thread of this process), driven at concurrency 1 by `lingc bench`'s client
                      (lingc.bench_client.run_benchmark) from a separate process
    http_in_process   the same, the client on this process's main thread (it then shares the GIL with the server)

Every run is measured with lingc.bench_client's definitions (TTFT; TPOT = (E2E - TTFT) / (tokens - 1) per request,
averaged; ITL with an n-token chunk split in n entries). overhead = HTTP mean TPOT - direct mean TPOT, ms and %.

Needs fastapi, uvicorn (and pydantic, starlette, ...) and httpx, which the GPU image lacks: carry the wheels listed in
bench/README.md. Runs on CPU too (smoke test, tests/server/test_device_serve_smoke.py: test-tiny, reference ops,
no CUDA graphs, smaller defaults; the times mean nothing there):

    python3 bench/device_serve.py --json $OUT/serve.json
    python3 bench/device_serve.py --preset test-tiny --device cpu --json /tmp/serve.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import torch

DRAFT_TOKENS = 6
SERVE_DEPS = ("fastapi", "uvicorn", "pydantic", "starlette", "httpx")
# the defaults per device: (prompt tokens, new tokens, measured requests, prefill chunk)
DEFAULTS = {"cuda": (1024, 256, 3, 64), "cpu": (32, 12, 2, 16)}
REPORTED = ("completed", "failed", "output_len_mismatches", "mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms",
            "median_tpot_ms", "std_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "max_itl_ms",
            "mean_e2e_latency_ms", "output_throughput")
_CLIENT = """
import json, sys
from lingc.bench_client import BenchConfig, run_benchmark
from lingc.bench_cli import command_line
config = BenchConfig(**json.loads(sys.argv[1]))
report = run_benchmark(config)
print(json.dumps(report.to_json(command_line(config))))
"""


def check_serve_deps() -> None:
    missing = []
    for name in SERVE_DEPS:
        try:
            __import__(name)
        except ImportError as e:
            missing.append(f"{name} ({e})")
    if missing:
        raise SystemExit(f"device_serve.py needs {', '.join(missing)}: install the wheels listed in bench/README.md "
                         "(pip install --no-deps --target DIR ...; PYTHONPATH=DIR)")


def build_engine(args: argparse.Namespace, max_len: int, prefill: int) -> tuple[object, dict]:
    """Random model -> traced programs -> every pass -> Engine (NEXTN, simulated acceptance); setup times."""
    from lingc.init import random_model
    from lingc.passes.manager import PassManager
    from lingc.presets import preset
    from lingc.runtime.engine import Engine
    from lingc.trace import PROGRAMS, TraceOptions, trace

    times = {}
    t0 = time.perf_counter()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = random_model(preset(args.preset, num_nextn_predict_layers=1), seed=0, dtype=dtype, device=args.device)
    times["random_weights_s"] = time.perf_counter() - t0
    options = TraceOptions(batch=1, prefill_tokens=prefill, max_len=max_len, page_size=16, request_slots=1,
                           draft_tokens=DRAFT_TOKENS)
    t0 = time.perf_counter()
    traced = trace(model, list(PROGRAMS), options)
    times["trace_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    program = PassManager(args.passes.split(",")).run(traced).program
    times["passes_s"] = time.perf_counter() - t0
    del traced, model
    gc.collect()
    t0 = time.perf_counter()
    engine = Engine(program, args.device, "nextn", simulate_accept_len=args.simulate_accept_len)
    times["engine_startup_s"] = time.perf_counter() - t0
    return engine, times


def run_direct(engine, specs: list, warmup: bool) -> tuple[list, dict]:
    """Engine.generate for each spec, timed as the bench client times a stream (RequestResult.on_chunk)."""
    from lingc.bench_client import RequestResult
    from lingc.runtime.engine import Request
    if warmup:
        s = specs[0]
        engine.generate(Request(s.prompt_ids[:64], min(s.output_len, 32), ignore_eos=True))
    results, engine_side = [], {"ttft_ms": [], "tpot_ms": [], "mean_accept_len": [], "steps": []}
    for s in specs:
        r = RequestResult(input_len=len(s.prompt_ids), expected_output_len=s.output_len)
        count = [0]

        def on_tokens(tokens: list[int], r=r, count=count) -> bool:
            count[0] += len(tokens)
            r.on_chunk(time.perf_counter(), count[0])
            return True
        r.start_time = time.perf_counter()
        out = engine.generate(Request(list(s.prompt_ids), s.output_len, ignore_eos=True), on_tokens)
        r.latency = time.perf_counter() - r.start_time
        results.append(r)
        engine_side["ttft_ms"].append(out.ttft_s * 1e3)
        engine_side["tpot_ms"].append(out.tpot_s * 1e3)
        engine_side["mean_accept_len"].append(out.mean_accept_len)
        engine_side["steps"].append(out.steps)
    return results, engine_side


def run_client(config_kwargs: dict, separate_process: bool, timeout_s: float) -> dict:
    """`lingc bench`'s client (run_benchmark) against the server; its JSON report."""
    if separate_process:
        proc = subprocess.run([sys.executable, "-c", _CLIENT, json.dumps(config_kwargs)], capture_output=True,
                              text=True, timeout=timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(f"the client process failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])
    from lingc.bench_cli import command_line
    from lingc.bench_client import BenchConfig, run_benchmark
    config = BenchConfig(**config_kwargs)
    return run_benchmark(config).to_json(command_line(config))


def pick(metrics: dict) -> dict:
    return {k: metrics.get(k) for k in REPORTED}


def overhead(http: dict, direct: dict) -> dict:
    """HTTP minus direct for the latency means (ms), and the TPOT difference in % of the direct TPOT."""
    out = {}
    for key in ("mean_tpot_ms", "median_tpot_ms", "mean_ttft_ms", "mean_itl_ms", "median_itl_ms"):
        if http.get(key) is not None and direct.get(key) is not None:
            out[key] = http[key] - direct[key]
    if "mean_tpot_ms" in out and direct["mean_tpot_ms"]:
        out["mean_tpot_pct"] = 100.0 * out["mean_tpot_ms"] / direct["mean_tpot_ms"]
    return out


def measure(args: argparse.Namespace, result: dict) -> None:
    from lingc.bench_client import calculate_metrics, sample_random_requests
    from lingc.runtime.server import ServerConfig, ServerThread
    from lingc.runtime.session import Session

    prompt, new, requests, prefill = args.prompt_tokens, args.new_tokens, args.requests, args.prefill_tokens
    max_len = -(-(prompt + new + 2 * DRAFT_TOKENS + 16) // 16) * 16
    engine, result["setup"] = build_engine(args, max_len, prefill)
    vocab = engine.program.config.vocab_size
    specs = sample_random_requests(requests, prompt, new, 1.0, vocab, args.seed)
    result["workload"] = {"requests": requests, "prompt_tokens": prompt, "new_tokens": new, "max_len": max_len,
                          "prefill_tokens": prefill, "seed": args.seed, "vocab_size": vocab, "concurrency": 1}
    direct_a, side_a = run_direct(engine, specs, warmup=True)
    print("direct", pick(asdict(calculate_metrics(direct_a, sum(r.latency for r in direct_a)))), flush=True)
    client = {"base_url": None, "num_prompts": requests, "random_input_len": prompt, "random_output_len": new,
              "random_range_ratio": 1.0, "max_concurrency": 1, "seed": args.seed, "warmup": 1, "settle_s": 0.2,
              "timeout_s": 600.0, "extra_request_body": {"sampling_params": {"seed": 0}}}   # direct's seed: the
    # simulated acceptance draws from the request's seed, so every run accepts the same lengths (the server's
    # default seed is a random one)
    with tempfile.TemporaryDirectory() as root:
        session = Session(Path(root), engine, None)            # no artifact: the program is in memory
        t0 = time.perf_counter()
        server = ServerThread(session, ServerConfig("bench", device=args.device, max_queue=4))
        result["setup"]["server_start_s"] = time.perf_counter() - t0
        client["base_url"] = server.url
        try:
            for name, separate in (("http", True), ("http_in_process", False)):
                try:
                    report = run_client(client, separate, timeout_s=args.timeout)
                    result[name] = {"client": "separate process" if separate else "thread of the server's process",
                                    **pick(report["metrics"]), "accept_length": report["metrics"]["accept_length"],
                                    "errors": report["errors"]}
                except Exception as e:  # noqa: BLE001  one failing variant must not lose the other
                    result[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
                print(name, result[name], flush=True)
        finally:
            server.stop()
    direct_b, side_b = run_direct(engine, specs, warmup=False)
    direct = direct_a + direct_b
    metrics = pick(asdict(calculate_metrics(direct, sum(r.latency for r in direct))))
    result["direct"] = {**metrics, "runs": 2, "engine_ttft_ms": side_a["ttft_ms"] + side_b["ttft_ms"],
                        "engine_tpot_ms": side_a["tpot_ms"] + side_b["tpot_ms"],
                        "mean_accept_len": side_a["mean_accept_len"] + side_b["mean_accept_len"],
                        "mean_tpot_ms_first_run": pick(asdict(calculate_metrics(direct_a, 1.0)))["mean_tpot_ms"],
                        "mean_tpot_ms_second_run": pick(asdict(calculate_metrics(direct_b, 1.0)))["mean_tpot_ms"]}
    print("direct (both runs)", result["direct"], flush=True)
    result["overhead"] = {name: overhead(result[name], metrics) for name in ("http", "http_in_process")
                          if "error" not in result.get(name, {"error": 1})}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="serve.json")
    ap.add_argument("--preset", default="ling-3.0-tiny")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--dtype", default=None, choices=("bf16", "fp32"), help="default: bf16 on cuda, fp32 on cpu")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="default: 1024 on cuda, 32 on cpu")
    ap.add_argument("--new-tokens", type=int, default=None, help="default: 256 on cuda, 12 on cpu")
    ap.add_argument("--requests", type=int, default=None, help="measured requests per run (default: 3 cuda, 2 cpu)")
    ap.add_argument("--prefill-tokens", type=int, default=None, help="prefill chunk (default: 64 cuda, 16 cpu)")
    ap.add_argument("--simulate-accept-len", type=float, default=3.2)
    ap.add_argument("--passes", default="all", help="comma-separated passes (needs partition for NEXTN)")
    ap.add_argument("--seed", type=int, default=1, help="workload seed (bench_serving's default)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds allowed for one client run")
    args = ap.parse_args(argv)
    defaults = DEFAULTS[args.device]
    for name, value in zip(("prompt_tokens", "new_tokens", "requests", "prefill_tokens"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    check_serve_deps()
    if args.device == "cpu":
        torch.set_num_threads(1)           # tiny tensors: a second thread only adds spin-waits on a busy machine
    result: dict = {"gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                    "torch": torch.__version__, "python": platform.python_version(),
                    "commit": os.environ.get("LINGC_COMMIT", "unknown"), "command": " ".join(sys.argv),
                    "preset": args.preset, "device": args.device, "dtype": args.dtype, "spec": "nextn",
                    "passes": args.passes,
                    "simulate_accept_len": args.simulate_accept_len}
    t0 = time.perf_counter()
    try:
        measure(args, result)
    except Exception as e:  # noqa: BLE001  the JSON says what failed
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-3000:]
        print(result["traceback"], file=sys.stderr, flush=True)
    result["total_s"] = time.perf_counter() - t0
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(json.dumps({"overhead": result.get("overhead"), "error": result.get("error")}, indent=1), flush=True)
    if "error" in result:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
