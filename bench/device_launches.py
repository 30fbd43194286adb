"""Launch by launch: each op of a step against its own byte floor, inside the captured CUDA graph.

Builds Ling-3.0-tiny + 1 MTP layer as bench/device_step.py does, compiles it with the given passes and captures
the graphs with PDL launches off (so a kernel's duration is its own, not time spent waiting on its predecessor).
Two profiles per graph (torch profiler / CUPTI):
  eager   one eager run, with a profiler marker after every launch: which kernels each launch issued, and its bytes
          (bench/floor.py's count for that launch, from its actual arguments)
  graph   a few replays of the captured graph: the kernels' durations inside the graph
The graph's kernel sequence must equal the eager run's (same launches, same order); each graph kernel then inherits
its launch. The table groups launches by op and weight (layer index replaced by *) and reports, per group: launches,
MB moved, kernel time in the graph, GB/s, its floor (bytes / HBM bandwidth) and the excess (time - floor); the
launch gaps (graph replay time - busy time) come last. This says where a step's time over its floor goes.

--pdl captures the graphs with PDL launches on, as the step runs. Kernels then overlap (a kernel's programs start,
and load what they may, while its predecessor runs), so a kernel's duration is no longer its cost; each kernel is
charged its exposed time instead, end_i - end_(i-1) (the first kernel its duration): how much later the chain ends
because of it. The exposed times sum to the busy span, so the table shows where the PDL step's time goes.

--sampled runs every graph for device_step.py's sampled request (SAMPLED: temperature 0.8, top-p 0.95) instead of a
greedy one: the general graphs' sampling kernels (filtered_probs' threshold rounds, sample_tokens, chain_accept's
sampled branch) then do their work instead of exiting at once, so the table says where a sampled NEXTN step's time
over a greedy one goes (use the general graphs: draft, verify, extend; the *_greedy copies are greedy-only).

Hint kernels (prefetch_weights' l2_prefetch / l2_prefetch_experts, HINT_KERNELS) run on a side stream beside the
chain: they are taken out of both kernel sequences before the match and reported apart (`side_stream`: kernels a
replay and their summed duration), so the table stays the chain's.

Each graph's row also splits its groups by kind (`by_kind`): latency-bound groups (floor under LATENCY_SHARE of their
time and under LATENCY_FLOOR_US a launch: the norms, the router, the KDA recurrence, ...) against weight streams, with
kernels, time, floor and time (excess) a kernel of each. `--split FILE ...` prints that split for stored results
(no GPU).

    python3 bench/device_launches.py --json $OUT/launches.json [--passes all] [--graphs step,verify] [--pdl] [--sampled]
    python3 bench/device_launches.py --split bench/results/launches-h100-20261206-b.json
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import platform
import re
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from device_profile import busy_us  # noqa: E402
from device_step import (CONTEXT, DRAFT_TOKENS, GREEDY_SUFFIX, NEXTN_GRAPHS, SAMPLED, fill_context,  # noqa: E402
                         reset_request, time_graphs)
from floor import launch_bytes  # noqa: E402
from timing import hbm_bandwidth_gbps  # noqa: E402

LAYER = re.compile(r"layers\.\d+\.")
HINT_KERNELS = ("_l2_prefetch_kernel", "_l2_prefetch_experts_kernel", "_l2_prefetch_pages_kernel")   # side-stream hints (kernels/l2_prefetch.py)
SAMPLING: dict | None = None     # --sampled: device_step.SAMPLED, the request every run and replay is reset to
LATENCY_SHARE = 0.5       # by_kind: a group is latency-bound where its floor is under this share of its time
LATENCY_FLOOR_US = 1.0    # ... and under this many us a launch


def _is_hint(kernel: dict) -> bool:
    return any(h in kernel["name"] for h in HINT_KERNELS)


def _trace(prof) -> list[dict]:
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        return json.load(f)["traceEvents"]


def group_name(label: str, args: tuple, weight_ids: dict[int, str]) -> str:
    """op + its largest weight's name with layer numbers as *: 'linear model.layers.*.attention.o_proj.weight'."""
    op = label.split(":")[-1].removeprefix("lingc.")
    weights = [(a.numel() * a.element_size(), weight_ids[id(a)]) for a in args
               if isinstance(a, torch.Tensor) and id(a) in weight_ids]
    name = max(weights)[1] if weights else ""
    return f"{op} {LAYER.sub('layers.*.', name)}".strip()


def eager_launches(exe, config, name: str) -> tuple[list[dict], list[str], list[int]]:
    """Graph `name` run eagerly twice from the same state: once counting each launch's group and bytes (the count
    itself launches kernels: torch.unique, .item()), once under the profiler with a marker after every launch,
    which gives the ordered kernel names and the index of the launch that issued each."""
    from torch.profiler import ProfilerActivity, profile, record_function
    weight_ids = {id(w): n for n, w in exe.weights.items()}
    launches: list[dict] = []

    def count(launch, args, kwargs, result) -> None:
        launches.append({"label": launch.label, "group": group_name(launch.label, args, weight_ids),
                         "bytes": dict(launch_bytes(launch, args, weight_ids))})

    marks_seen = [0]

    def mark(launch, args, kwargs, result) -> None:
        with record_function(f"lingc-launch-{marks_seen[0]}"):
            pass
        marks_seen[0] += 1

    _prepare(exe, config, name)
    exe.run(name, observe=count)
    _prepare(exe, config, name)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        exe.run(name, observe=mark)
        torch.cuda.synchronize()
    events = _trace(prof)
    marks = sorted((e["ts"], int(e["name"].rsplit("-", 1)[1])) for e in events
                   if e.get("cat") == "user_annotation" and e.get("name", "").startswith("lingc-launch-"))
    mark_ts = [t for t, _ in marks]
    runtime = {e["args"]["correlation"]: e["ts"] for e in events
               if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    kernels = sorted((e for e in events if e.get("cat") == "kernel" and not _is_hint(e)), key=lambda e: e["ts"])
    owner = []
    for k in kernels:
        ts = runtime.get(k["args"].get("correlation"))
        i = bisect.bisect_left(mark_ts, ts) if ts is not None else len(marks)
        owner.append(marks[i][1] if i < len(marks) else -1)
    return launches, [k["name"] for k in kernels], owner


def _prepare(exe, config, name: str) -> None:
    """The state graph `name` runs from in the benchmark: the filled context (and, for verify / extend, the
    NEXTN graphs before it)."""
    fill_context(exe, config)
    reset_request(exe, sampling=SAMPLING)
    if name in NEXTN_GRAPHS:
        for g in NEXTN_GRAPHS[:NEXTN_GRAPHS.index(name)]:
            exe.run(g)
    reset_request(exe, sampling=SAMPLING)


def _first_difference(a: list[str], b: list[str]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def graph_kernels(graphs, exe, name: str, replays: int) -> tuple[list[list[dict]], list[list[dict]]]:
    """The chain's kernels of each replay, in start order, and the side stream's hint kernels of each replay."""
    from torch.profiler import ProfilerActivity, profile
    reset_request(exe, sampling=SAMPLING)
    for _ in range(3):
        graphs.run(name)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graphs.run(name)
            torch.cuda.synchronize()
    return split_replays([e for e in _trace(prof) if e.get("cat") == "kernel"], replays)


def split_replays(kernels: list[dict], replays: int) -> tuple[list[list[dict]], list[list[dict]]]:
    """Kernel events of `replays` back-to-back replays -> (each replay's chain kernels, each replay's hint kernels),
    both in start order."""
    kernels = sorted(kernels, key=lambda e: e["ts"])
    per = len(kernels) // replays
    reps = [kernels[i * per:(i + 1) * per] for i in range(replays)]
    return [[k for k in r if not _is_hint(k)] for r in reps], [[k for k in r if _is_hint(k)] for r in reps]


def exposed_us(kernels: list[dict]) -> list[float]:
    """Each kernel's exposed time in one replay, in start order: end_i - max(end_j, j < i) (the first kernel: its
    duration). A kernel ending before the chain's end so far (it overlapped entirely) is charged 0."""
    out, chain_end = [], None
    for k in kernels:
        end = k["ts"] + k["dur"]
        out.append(k["dur"] if chain_end is None else max(0.0, end - chain_end))
        chain_end = end if chain_end is None else max(chain_end, end)
    return out


def attribute(launches, eager_names, owner, reps, bandwidth_gbps: float, replay_us: float,
              exposed: bool = False) -> dict:
    """Per-group table: launches, MB, graph kernel time (median over replays; `exposed`: each kernel's exposed time,
    see exposed_us), GB/s, floor, excess."""
    graph_names = [k["name"] for k in reps[0]] if reps else []
    if graph_names != eager_names:
        i = _first_difference(graph_names, eager_names)
        return {"error": f"the graph's {len(graph_names)} kernels differ from the eager run's {len(eager_names)} "
                         f"from kernel {i} on: cannot attribute",
                "graph_kernel": graph_names[i] if i < len(graph_names) else None,
                "eager_kernel": eager_names[i] if i < len(eager_names) else None}
    times = [exposed_us(r) if exposed else [k["dur"] for k in r] for r in reps]
    durations = [statistics.median(t[i] for t in times) for i in range(len(eager_names))]
    per_launch: dict[int, float] = collections.defaultdict(float)
    kernels_of: collections.Counter = collections.Counter(owner)
    kernel_us: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for i, d in enumerate(durations):
        per_launch[owner[i]] += d
        kernel_us[owner[i]][eager_names[i]] += d
    groups: dict[str, dict] = {}
    for i, launch in enumerate(launches):
        if not kernels_of[i] and not sum(launch["bytes"].values()):
            continue                                         # views, getitems: no kernel, no bytes
        g = groups.setdefault(launch["group"], {"group": launch["group"], "launches": 0, "kernels": 0,
                                                "bytes": 0, "us": 0.0, "by_kernel": collections.Counter()})
        g["launches"] += 1
        g["kernels"] += kernels_of[i]
        g["bytes"] += sum(launch["bytes"].values())
        g["us"] += per_launch.get(i, 0.0)
        g["by_kernel"].update(kernel_us.get(i, {}))
    for g in groups.values():
        g["by_kernel"] = {k: v / g["launches"] for k, v in g["by_kernel"].most_common()}   # us a launch, per kernel
        g["floor_us"] = g["bytes"] / bandwidth_gbps / 1e3
        g["excess_us"] = g["us"] - g["floor_us"]
        g["gbps"] = g["bytes"] / g["us"] / 1e3 if g["us"] else 0.0
        g["us_per_launch"] = g["us"] / g["launches"]
    busy = statistics.median(busy_us(r) for r in reps)
    table = sorted(groups.values(), key=lambda g: -g["excess_us"])
    return {"time_basis": "exposed" if exposed else "duration", "replay_us": replay_us,
            "kernel_sum_us": sum(durations), "busy_us": busy,
            "gaps_us": replay_us - busy, "floor_us": sum(g["floor_us"] for g in table),
            "kernels": len(durations), "unattributed_us": per_launch.get(-1, 0.0), "by_kind": by_kind(table),
            "groups": table}


def by_kind(groups: list[dict]) -> dict:
    """The groups split into latency-bound ones and weight streams (module docstring): per kind the groups, kernels,
    time and floor (us), time a kernel and time over the floor a kernel."""
    out = {kind: {"groups": 0, "kernels": 0, "us": 0.0, "floor_us": 0.0} for kind in ("latency_bound", "streams")}
    for g in groups:
        latency = g["floor_us"] < LATENCY_SHARE * g["us"] and g["floor_us"] / max(g["launches"], 1) < LATENCY_FLOOR_US
        o = out["latency_bound" if latency else "streams"]
        o["groups"] += 1
        o["kernels"] += g["kernels"]
        o["us"] += g["us"]
        o["floor_us"] += g["floor_us"]
    for o in out.values():
        o["us_per_kernel"] = o["us"] / o["kernels"] if o["kernels"] else 0.0
        o["excess_us_per_kernel"] = (o["us"] - o["floor_us"]) / o["kernels"] if o["kernels"] else 0.0
    return out


def kind_line(name: str, split: dict) -> str:
    """One printed line of by_kind."""
    lat, st = split["latency_bound"], split["streams"]
    return (f"{name}: {lat['kernels']} latency-bound kernels {lat['us']:.0f} us ({lat['us_per_kernel']:.2f} a kernel), "
            f"{st['kernels']} streams {st['us']:.0f} us over a {st['floor_us']:.0f} us floor "
            f"({st['excess_us_per_kernel']:.2f} over a kernel)")


def print_split(paths: list[str]) -> None:
    """--split: by_kind of every graph of stored results."""
    for path in paths:
        d = json.loads(Path(path).read_text())
        print(f"{path} ({d.get('gpu')}, {d.get('commit')}, {d.get('hbm_bandwidth_gbps', 0):.0f} GB/s)")
        for name, row in d.get("graphs", {}).items():
            if "groups" in row:
                print("  " + kind_line(name, by_kind(row["groups"])) + f"; replay {row['replay_us']:.0f} us, floor "
                      f"{row['floor_us']:.0f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="launches.json")
    ap.add_argument("--passes", default="all", help="comma-separated passes (default all)")
    ap.add_argument("--graphs", default="step,verify", help="graphs to attribute (step, draft, verify, extend; with "
                    "specialize_greedy also step_greedy, draft_greedy, verify_greedy, extend_greedy)")
    ap.add_argument("--replays", type=int, default=5)
    ap.add_argument("--layers", type=int, default=0, help="override num_hidden_layers (debugging)")
    ap.add_argument("--pdl", action="store_true",
                    help="capture with PDL launches on and charge each kernel its exposed time (module docstring)")
    ap.add_argument("--sampled", action="store_true",
                    help="a sampled request (device_step.SAMPLED) instead of a greedy one (module docstring)")
    ap.add_argument("--split", nargs="+", metavar="FILE",
                    help="print the latency-bound / stream split of stored results and exit (no GPU)")
    args = ap.parse_args()
    if args.split:
        print_split(args.split)
        return
    global SAMPLING
    SAMPLING = SAMPLED if args.sampled else None
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
    bandwidth = hbm_bandwidth_gbps()
    options = TraceOptions(batch=1, prefill_tokens=64, max_len=CONTEXT + 1024 + 128, page_size=16, request_slots=1,
                           draft_tokens=DRAFT_TOKENS)
    passes = args.passes.split(",")
    program = PassManager(passes).run(trace(model, ["step", "nextn"], options)).program
    exe = Executor(program, "cuda", "triton", pdl=args.pdl)  # PDL off (default): each kernel's duration is its own
    fill_context(exe, config)
    wanted = args.graphs.split(",")
    # the general step graphs and, with specialize_greedy, its copies (step_greedy, draft_greedy, ...)
    sets = [names for names in (("step",), NEXTN_GRAPHS) + tuple(tuple(g + GREEDY_SUFFIX for g in names)
                                                                  for names in (("step",), NEXTN_GRAPHS))
            if all(g in program.graphs for g in names)]
    missing = [g for g in wanted if not any(g in names for names in sets)]
    if missing:
        raise SystemExit(f"--graphs {missing}: not step graphs of this pass set; have {[g for n in sets for g in n]}")
    for name in (g for names in sets for g in names):        # warm-up: Triton compiles, workspaces allocated
        exe.run(name)
    eager = {name: eager_launches(exe, config, name) for name in wanted}
    graphs = CudaGraphs(exe)
    graphs.capture([g for names in sets for g in names])
    fill_context(exe, config)
    replay = {}
    for names in sets:
        reset_request(exe, sampling=SAMPLING)
        replay |= time_graphs(graphs, names)
    result: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "python": platform.python_version(), "commit": os.environ.get("LINGC_COMMIT", "unknown"),
                    "command": " ".join(sys.argv), "passes": passes, "context": CONTEXT, "pdl_launches": args.pdl,
                    "request": SAMPLING or "greedy",
                    "hbm_bandwidth_gbps": bandwidth, "graphs": {}}
    for name in wanted:
        launches, names, owner = eager[name]
        reps, side = graph_kernels(graphs, exe, name, args.replays)
        row = attribute(launches, names, owner, reps, bandwidth, replay[name] * 1e3, exposed=args.pdl)
        if side and side[0]:
            row["side_stream"] = {"kernels": len(side[0]),
                                  "us": statistics.median(sum(k["dur"] for k in r) for r in side)}
        result["graphs"][name] = row
        if "error" in row:
            print(name, row["error"], flush=True)
            continue
        print(f"\n{name}: unattributed {row['unattributed_us']:.1f} us")
        if "side_stream" in row:
            print(f"{name}: side stream {row['side_stream']['kernels']} hint kernels, {row['side_stream']['us']:.1f} us")
        print(f"{name}: replay {row['replay_us']:.1f} us, {row['kernels']} kernels, kernel sum "
              f"{row['kernel_sum_us']:.1f} us, busy {row['busy_us']:.1f}, gaps {row['gaps_us']:.1f}, "
              f"floor {row['floor_us']:.1f} us")
        print(kind_line(name, row["by_kind"]))
        print(f"  {'excess':>8} {'time':>8} {'floor':>7} {'GB/s':>6} {'n':>4} {'us/n':>6}  group")
        for g in row["groups"][:40]:
            print(f"  {g['excess_us']:8.1f} {g['us']:8.1f} {g['floor_us']:7.1f} {g['gbps']:6.0f} {g['launches']:4d} "
                  f"{g['us_per_launch']:6.2f}  {g['group'][:80]}")
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
