"""Where a step's GPU time goes: kernel by kernel inside the captured CUDA graphs (torch profiler / CUPTI).

Builds Ling-3.0-tiny + 1 MTP layer on the GPU exactly as bench/device_step.py does, compiles it with the given
passes, lowers to the Triton kernels, captures the step and NEXTN graphs, and profiles a few replays of each.
For every graph it reports: graph replay time (CUDA events), kernels per replay, the sum of kernel durations,
the union of kernel intervals (busy time; PDL makes kernels overlap), the idle time inside the replay
(span - busy: launch latency and dependency waits), and the kernels grouped by name with their share. The
profiler's own overhead is calibrated by comparing the profiled span with the un-profiled replay time.

    python3 bench/device_profile.py --json $OUT/profile.json [--passes all] [--trace $OUT/trace.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from device_step import (CONTEXT, DRAFT_TOKENS, NEXTN_GRAPHS, fill_context, launches_pdl, reset_request,  # noqa: E402
                         time_graphs)


def kernel_events(trace_path: str) -> list[dict]:
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    return sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])


def busy_us(kernels: list[dict]) -> float:
    """Length of the union of the kernels' [ts, ts + dur) intervals."""
    total, end = 0.0, float("-inf")
    for k in kernels:
        s, e = k["ts"], k["ts"] + k["dur"]
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def profile_graph(graphs, exe, name: str, replays: int, trace_out: str | None) -> dict:
    from torch.profiler import ProfilerActivity, profile
    reset_request(exe)
    for _ in range(3):
        graphs.run(name)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(replays):
            graphs.run(name)
            torch.cuda.synchronize()
    path = trace_out or os.path.join(tempfile.mkdtemp(), f"{name}.json")
    prof.export_chrome_trace(path)
    return summarize_replays(kernel_events(path), replays)


def summarize_replays(kernels: list[dict], replays: int) -> dict:
    """Kernel events of `replays` identical graph replays -> per-replay medians: kernels per replay, span, busy
    (union of intervals), kernel sum, idle, median gap, and the kernels grouped by name (also bench/device_tp.py)."""
    if not kernels or len(kernels) % replays:
        return {"error": f"{len(kernels)} kernel events for {replays} replays"}
    per = len(kernels) // replays
    reps = [kernels[i * per:(i + 1) * per] for i in range(replays)]
    spans = [r[-1]["ts"] + r[-1]["dur"] - r[0]["ts"] for r in reps]
    busy = [busy_us(r) for r in reps]
    sums = [sum(k["dur"] for k in r) for r in reps]
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    count: collections.Counter = collections.Counter()
    for r in reps:
        acc: dict[str, float] = collections.defaultdict(float)
        for k in r:
            acc[k["name"]] += k["dur"]
        for n, v in acc.items():
            by_name[n].append(v)
    for k in reps[0]:
        count[k["name"]] += 1
    total = statistics.median(sums)
    table = sorted(({"kernel": n[:90], "launches": count[n], "us": statistics.median(v),
                     "share": statistics.median(v) / total} for n, v in by_name.items()), key=lambda r: -r["us"])
    gaps = [max(0.0, b["ts"] - (a["ts"] + a["dur"])) for a, b in zip(reps[-1], reps[-1][1:])]
    return {"kernels_per_replay": per, "span_us": statistics.median(spans), "busy_us": statistics.median(busy),
            "kernel_sum_us": total, "idle_us": statistics.median(s - b for s, b in zip(spans, busy)),
            "gap_us_median": statistics.median(gaps) if gaps else 0.0, "by_kernel": table}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="profile.json")
    ap.add_argument("--passes", default="all", help="comma-separated passes (default all)")
    ap.add_argument("--replays", type=int, default=5)
    ap.add_argument("--trace", default=None, help="also write the step graph's chrome trace here")
    ap.add_argument("--layers", type=int, default=0, help="override num_hidden_layers (debugging)")
    args = ap.parse_args()
    import lingc  # noqa: F401
    from lingc.init import random_model
    from lingc.passes.manager import PassManager
    from lingc.presets import preset
    from lingc.runtime.executor import Executor
    from lingc.runtime.graphs import CudaGraphs
    from lingc.trace import TraceOptions, trace

    over = {"num_nextn_predict_layers": 1} | ({"num_hidden_layers": args.layers} if args.layers else {})
    config = preset("ling-3.0-tiny", **over)
    model = random_model(config, seed=0, dtype=torch.bfloat16, device="cuda")
    options = TraceOptions(batch=1, prefill_tokens=64, max_len=CONTEXT + 1024 + 128, page_size=16, request_slots=1,
                           draft_tokens=DRAFT_TOKENS)
    passes = args.passes.split(",")
    program = PassManager(passes).run(trace(model, ["step", "nextn"], options)).program
    exe = Executor(program, "cuda", "triton", pdl=launches_pdl(passes))
    fill_context(exe, config)
    graphs = CudaGraphs(exe)
    names = ("step",) + NEXTN_GRAPHS
    graphs.capture(names)
    fill_context(exe, config)
    result: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "python": platform.python_version(), "commit": os.environ.get("LINGC_COMMIT", "unknown"),
                    "command": " ".join(sys.argv), "passes": passes, "context": CONTEXT, "graphs": {}}
    replay_ms = time_graphs(graphs, ("step",)) | time_graphs(graphs, NEXTN_GRAPHS)
    for name in names:
        reset_request(exe)
        row = profile_graph(graphs, exe, name, args.replays, args.trace if name == "step" else None)
        row["replay_us"] = replay_ms[name] * 1e3
        row["launches"] = sum(1 for x in exe.lowered[name].launches if not x.label.startswith(("getitem", "aten.view")))
        result["graphs"][name] = row
        if "error" in row:
            print(name, row["error"], flush=True)
            continue
        print(f"\n{name}: replay {row['replay_us']:.1f} us, profiled span {row['span_us']:.1f} us, "
              f"{row['kernels_per_replay']} kernels, kernel sum {row['kernel_sum_us']:.1f} us, "
              f"busy {row['busy_us']:.1f} us, idle {row['idle_us']:.1f} us, median gap {row['gap_us_median']:.2f} us")
        for r in row["by_kernel"][:18]:
            print(f"  {r['us']:8.1f} us {100 * r['share']:5.1f}% x{r['launches']:<4d} {r['kernel']}")
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
