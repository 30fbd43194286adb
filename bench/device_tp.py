"""TP2 on the two-H200 machine: the decode step and NEXTN graphs over 2 GPUs, their all-reduce share, greedy parity.

Two ranks, one process per GPU, spawned by this script (torch.multiprocessing, spawn) and joined over NCCL with the
runtime's own set-up (runtime/tp.py `_init_group`: torch.cuda.set_device, device_id); NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 are set in every process. Each rank draws the same
random Ling-3.0-tiny + 1 MTP layer on its GPU (lingc.init.random_model, seed 0; checked bit-identical across ranks),
traces the six programs, runs every pass, then the tp pass (passes/tp.py `run_tp_stage`, what `lingc compile --tp 2`
runs) and keeps its own weights. Then, every rank in lockstep, in this order (the TP2 numbers first):

  1. TP2: Triton kernels, PDL, CUDA graphs (NCCL warmed up by an eager collective before any capture; capture on a
     side stream by runtime/graphs.py), the context filled as bench/device_step.py does (8192 tokens), each graph's
     replay timed with CUDA events, the same fixed count on every rank (median of 30, twice): the decode step and
     NEXTN's draft, verify and extend; the all_reduce / all_gather launches counted per graph
  2. the same graphs with every lingc.all_reduce launch swapped for a no-op (a launch-list edit of this bench only):
     all-reduce share = 1 - t_without / t_with (the no-op run also skips the wait for the slower rank)
  2b. with the one-shot all-reduce on (kernels/allreduce.py; runtime/tp.py enables it on NCCL): the same graphs
     captured again with the reference op (NCCL), `times_nccl`, an A/B in the same run
  3. the one-shot kernel eagerly against the reference sum of the gathered partials, bit for bit (1, 6, 16 tokens,
     bf16 / fp32); one lingc.all_reduce of a [1, hidden] bf16 tensor, 50 per CUDA graph, median per call, the one-shot
     kernel alone, and NCCL's bf16 all_reduce after a copy, as shared/docs/kernels.md 7b measured it
  4. TP1 on each GPU alone (the program before the tp pass): the same graph times, greedy tokens (plain and NEXTN)
  5. greedy parity: TP2 tokens (runtime/tp.py's TPEngine on rank 0 driving its worker loop `_serve` on rank 1 over
     the store, in-memory programs) == TP1 tokens, plain decode and NEXTN; a divergence is reported, with TP1's logit
     gap between the two tokens there (a near-tie: within the tp pass's tolerance), not failed

The parent only spawns, waits (bounded by --timeout, killing the ranks after it) and merges the ranks' JSON files,
which each rank rewrites after every phase; a rank ends with os._exit after a bounded process-group teardown
(kernels.md 7b: teardown can hang). On CPU (`--preset test-tiny --device cpu`): gloo, reference ops, no CUDA graphs,
small sizes: a smoke test (tests/tp/test_device_tp_smoke.py); the times mean nothing there.

    python3 bench/device_tp.py --json $OUT/tp.json
    python3 bench/device_tp.py --preset test-tiny --device cpu --json /tmp/tp.json

(Over the ~400-line guide: one self-contained device script whose phases read in run order; its timing helpers are
device_step.py's, made to run on CPU too.)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from lingc.runtime.tp import NCCL_ENV

DRAFT_TOKENS = 6
GRAPH_SETS = {"step": ("step",), "nextn": ("draft", "verify", "extend")}
ALL_REDUCE = ("lingc.all_reduce", "triton:all_reduce",          # launch labels (reference op, or its kernel),
              "lingc.all_reduce_add_rmsnorm", "triton:all_reduce_add_rmsnorm")   # fused with the add + norm too
ALL_GATHER = ("lingc.all_gather", "triton:all_gather")
PROMPT_TOKENS = 40
ISOLATED_CALLS = 50
# per device: (context, repeats, parity tokens, prefill chunk)
DEFAULTS = {"cuda": (8192, 30, 32, 64), "cpu": (48, 2, 8, 16)}


# ---- timing helpers (device_step.py's, for CUDA and CPU) ----------------------------------------------------
def fill_context(exe, context: int, seed: int = 0) -> None:
    """Slot 0 holds a request with `context` tokens: random latent cache rows and KDA state, pages in order."""
    g = torch.Generator(device=exe.device).manual_seed(seed)
    bufs = exe.buffers.tensors
    for key, t in bufs.items():
        if not key.startswith("state_"):
            continue
        noise = torch.randn(t.shape, generator=g, device=exe.device)
        scale = 1.0 if key.endswith("kv_pages") else 0.02 if key.endswith("recurrent") else 0.1
        t.copy_((scale * noise).to(t.dtype))
    pt = bufs["page_table"]
    pt.copy_(torch.arange(pt.numel(), device=exe.device, dtype=pt.dtype).view(pt.shape))
    bufs["slots"].zero_()
    reset_request(exe, context)


def reset_request(exe, context: int) -> None:
    r = {k[len("relay_"):]: v for k, v in exe.buffers.tensors.items() if k.startswith("relay_")}
    r["seq_len"][0] = context
    r["temperature"][0], r["top_k"][0], r["top_p"][0] = 0.0, 0, 1.0
    r["simulate_accept"][0] = 0.0
    r["root"][0], r["draft_first"][0] = 11, 12


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_graphs(run, names: tuple[str, ...], repeats: int, device: torch.device) -> dict[str, float]:
    """Median ms of each named graph and of the sequence, back to back: CUDA events on the GPU, wall time on CPU.
    Every rank runs the same fixed count (a collective-holding graph must pair up across ranks; kernels.md 7b)."""
    per: dict[str, list[float]] = {n: [] for n in names}
    whole = []
    for _ in range(3 if device.type == "cuda" else 1):
        for n in names:
            run(n)
    _sync(device)
    for _ in range(repeats):
        if device.type == "cuda":
            evs = [torch.cuda.Event(enable_timing=True) for _ in range(len(names) + 1)]
            evs[0].record()
            for i, n in enumerate(names):
                run(n)
                evs[i + 1].record()
            evs[-1].synchronize()
            marks = [evs[0].elapsed_time(e) for e in evs]
        else:
            t0 = time.perf_counter()
            marks = [0.0]
            for n in names:
                run(n)
                marks.append((time.perf_counter() - t0) * 1e3)
        for i, n in enumerate(names):
            per[n].append(marks[i + 1] - marks[i])
        whole.append(marks[-1])
    out = {n: statistics.median(v) for n, v in per.items()}
    out["total"] = statistics.median(whole)
    return out


def time_program(exe, context: int, repeats: int, profile: bool = False) -> dict:
    """The step and NEXTN graphs of an executor, captured as CUDA graphs on the GPU, each set timed twice; with
    `profile` (CUDA), also a kernel-by-kernel breakdown of each graph (`profile_graphs`)."""
    from lingc.runtime.graphs import CudaGraphs
    names = [g for gs in GRAPH_SETS.values() for g in gs]
    graphs = None
    if exe.device.type == "cuda":
        graphs = CudaGraphs(exe)
        graphs.capture(names)                     # warm-up runs on a side stream, then capture; zeroes the buffers
    run = graphs.run if graphs is not None else exe.run
    fill_context(exe, context)
    out = {}
    for key, gs in GRAPH_SETS.items():
        series = []
        for _ in range(2):
            reset_request(exe, context)
            series.append(time_graphs(run, gs, repeats, exe.device))
        out[key] = {"ms": series[0], "ms_repeat": series[1]}
    if profile and graphs is not None:
        reset_request(exe, context)
        out["profile"] = profile_graphs(run, [g for gs in GRAPH_SETS.values() for g in gs], exe.device)
    del graphs
    gc.collect()
    if exe.device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def profile_graphs(run, names: list[str], device: torch.device, replays: int = 5) -> dict:
    """Per graph: kernels per replay, busy / idle time and the kernels grouped by name (torch profiler, CUPTI), as
    bench/device_profile.py reports them. Every rank replays the same count (the graphs hold collectives)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from device_profile import kernel_events, summarize_replays
    out = {}
    for name in names:
        for _ in range(3):
            run(name)
        _sync(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                run(name)
                _sync(device)
        path = os.path.join(tempfile.mkdtemp(), f"{name}.json")
        prof.export_chrome_trace(path)
        summary = summarize_replays(kernel_events(path), replays)
        if "by_kernel" in summary:
            summary["by_kernel"] = summary["by_kernel"][:40]
        out[name] = summary
    return out


def launch_counts(exe) -> dict[str, dict[str, int]]:
    out = {}
    for key, gs in GRAPH_SETS.items():
        for g in gs:
            labels = [launch.label for launch in exe.lowered[g].launches]
            out[g] = {"launches": len(labels), "all_reduce": sum(lb in ALL_REDUCE for lb in labels),
                      "all_gather": sum(lb in ALL_GATHER for lb in labels)}
    return out


def _no_all_reduce(x: torch.Tensor, world_size: int, **_) -> torch.Tensor:
    return x                                      # the partial sum stands in for the sum (timing only)


def _add_rmsnorm_only(fused_label: str):
    """The fused all_reduce + add + norm without its all_reduce: the add_rmsnorm of the partial (timing only)."""
    from lingc.ops import OPS
    from lingc.runtime.executor import kernel_for
    norm = kernel_for(OPS.add_rmsnorm, "triton" if fused_label.startswith("triton:") else "reference")[0]
    return lambda residual, x, weight, eps, world_size, **_: norm(residual, x, weight, eps)


def skip_all_reduce(exe) -> int:
    """Swap every all_reduce launch of every graph for a no-op (a fused one for its add_rmsnorm alone); returns how
    many (this bench's rewrite)."""
    n = 0
    for low in exe.lowered.values():
        for launch in low.launches:
            if launch.label in ALL_REDUCE:
                launch.fn = _add_rmsnorm_only(launch.label) if "add_rmsnorm" in launch.label else _no_all_reduce
                n += 1
    return n


def isolated_all_reduce(device: torch.device, tp: int, hidden: int, repeats: int) -> dict[str, float]:
    """Microseconds per call, ISOLATED_CALLS calls per CUDA graph, median over `repeats` replays (wall time on CPU)."""
    import torch.distributed as dist

    from lingc.kernels import allreduce
    from lingc.ops import OPS
    x = torch.randn(1, hidden, device=device).to(torch.bfloat16)
    y = torch.empty_like(x)

    def lingc_op() -> None:
        for _ in range(ISOLATED_CALLS):
            OPS.all_reduce(x, tp)

    def nccl_after_copy() -> None:
        for _ in range(ISOLATED_CALLS):
            y.copy_(x)
            dist.all_reduce(y)

    def copy_only() -> None:
        for _ in range(ISOLATED_CALLS):
            y.copy_(x)

    def one_shot() -> None:
        for _ in range(ISOLATED_CALLS):
            allreduce.launch(x, ws)
    bodies = [("lingc_all_reduce_us", lingc_op), ("nccl_bf16_all_reduce_after_copy_us", nccl_after_copy),
              ("copy_only_us", copy_only)]
    ws = allreduce.active()
    out: dict = {"one_shot_checks": one_shot_checks(device, tp, hidden) if ws else None}
    if ws:
        bodies.append(("one_shot_all_reduce_us", one_shot))
    for name, body in bodies:
        out[name] = _per_call_us(body, device, repeats)
    if ws:
        out["one_shot_timeouts"] = allreduce.timeouts()
    return out


def one_shot_checks(device: torch.device, tp: int, hidden: int) -> dict[str, bool]:
    """The one-shot kernel eagerly against the reference sum of the gathered partials (fold_sum: fp32 in rank order,
    one rounding), bit for bit, per (tokens, dtype); each rank draws its own partials."""
    import torch.distributed as dist

    from lingc.kernels import allreduce
    from lingc.ops.dist import fold_sum
    g = torch.Generator(device=device).manual_seed(1000 + dist.get_rank())
    out = {}
    for tokens in (1, 6, 16):
        for dtype in (torch.bfloat16, torch.float32):
            for _ in range(3):                                       # both regions, the call counter moving on
                x = (torch.randn(tokens, hidden, device=device, generator=g) * 4).to(dtype)
                got = allreduce.all_reduce(x, tp)
                parts = [torch.empty_like(x) for _ in range(tp)]
                dist.all_gather(parts, x)
                key = f"{tokens}x{hidden}_{str(dtype).split('.')[-1]}"
                out[key] = out.get(key, True) and torch.equal(got, fold_sum(parts, dtype))
    _sync(device)
    return out


def _per_call_us(body, device: torch.device, repeats: int) -> float:
    if device.type != "cuda":
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            body()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:]) / ISOLATED_CALLS * 1e6
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        body()
        body()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize(device)
    ms = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        ms.append(a.elapsed_time(b))
    del graph
    return statistics.median(ms) / ISOLATED_CALLS * 1e3


# ---- greedy parity ---------------------------------------------------------------------------------------
def prefix_logits(engine, ids: list[int]) -> torch.Tensor:
    """fp32 [V]: the engine's logits after prefilling `ids` (engine internals: a bench-only probe, slot 0)."""
    from lingc.runtime.engine import Request
    engine._open(0, Request(list(ids), 1))
    engine.pages.ensure(0, len(ids) + 2 * engine.opt["draft_tokens"])
    try:
        logits, _ = engine._prefill(0, list(ids))
    finally:
        engine.pages.release(0)
    return logits.reshape(-1).float().cpu()


def divergence(tp1: list[int], tp2: list[int], engine, prompt: list[int], tolerance: float) -> dict:
    """Where TP2's tokens part from TP1's, and TP1's logits there: the gap between the two tokens."""
    i = next((k for k, (a, b) in enumerate(zip(tp1, tp2)) if a != b), None)
    out = {"equal": tp1 == tp2, "first_divergence": i, "tp1": tp1, "tp2": tp2}
    if i is None:
        return out
    logits = prefix_logits(engine, prompt + tp1[:i])
    top = logits.topk(2).values
    gap = float(logits[tp1[i]] - logits[tp2[i]])
    out.update({"tp1_logit_gap_there": gap, "tp1_top2_margin_there": float(top[0] - top[1]),
                "near_tie": gap <= tolerance * (1 + abs(float(top[0])))})
    return out


def tp_tokens(program, rank: int, tp: int, dev: str, spec: str, backend: str, store, prompt: list[int], n: int,
              timeout_s: float) -> list[int] | None:
    """Greedy tokens of the TP program through runtime/tp.py: TPEngine on rank 0, `_serve` on the others (rank 0's
    host actions replayed from the store), in-memory programs. Rank 0 returns the tokens, the others None."""
    import torch.distributed as dist

    from lingc.runtime.engine import Engine, Request
    from lingc.runtime.tp import TPEngine, TPRuntime, _Control, _serve
    channel = dist.PrefixStore(f"parity_{spec}/", store)          # a fresh key space per run
    if rank != 0:
        engine = Engine(program, dev, spec, backend=backend)
        _serve(engine, _Control(channel))
        return None
    rt = TPRuntime(tp, dev, timeout_s)
    rt.store, rt.ctl = store, _Control(channel)
    engine = TPEngine(program, dev, spec, rt, backend=backend)
    try:
        return engine.generate(Request(prompt, n, ignore_eos=True)).tokens
    finally:
        rt.ctl.send(rt.pending + [["shutdown"]])
        rt.pending = []


# ---- one rank --------------------------------------------------------------------------------------------
def _signature(model) -> torch.Tensor:
    """int64 [P]: each parameter's bits summed as integers (equal across ranks iff the draws agree, in practice)."""
    sums = []
    for p in model.parameters():
        bits = p.detach().view(torch.int16 if p.element_size() == 2 else torch.int32)
        sums.append(bits.sum(dtype=torch.int64))
    return torch.stack(sums)


def _same_on_all_ranks(t: torch.Tensor, tp: int) -> bool:
    import torch.distributed as dist
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.contiguous())
    return all(torch.equal(parts[0], p) for p in parts[1:])


def _barrier(device: torch.device) -> None:
    """One eager all_reduce: the ranks meet (NCCL: the communicator is up before any CUDA-graph capture)."""
    import torch.distributed as dist
    t = torch.ones(1, device=device)
    dist.all_reduce(t)
    _sync(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def build(rank: int, cfg: dict, device: torch.device, out: dict) -> tuple:
    """This rank's random model -> six traced programs -> every pass (the TP1 program) -> the tp pass, keeping this
    rank's weights (the TP2 program). Returns (config, TP1 program, TP2 program)."""
    from lingc.init import random_model
    from lingc.passes.manager import CompileResult, PassManager
    from lingc.passes.tp import rank_programs, run_tp_stage
    from lingc.presets import preset
    from lingc.trace import PROGRAMS, TraceOptions, trace

    dtype = torch.bfloat16 if cfg["dtype"] == "bf16" else torch.float32
    over = {"num_hidden_layers": cfg["layers"]} if cfg.get("layers") else {}
    over |= {"vocab_size": cfg["vocab"]} if cfg.get("vocab") else {}
    config = preset(cfg["preset"], num_nextn_predict_layers=1, **over)
    model = random_model(config, seed=0, dtype=dtype, device=device)
    out["weights_identical_across_ranks"] = _same_on_all_ranks(_signature(model), cfg["tp"])
    options = TraceOptions(batch=1, prefill_tokens=cfg["prefill_tokens"], max_len=cfg["max_len"], page_size=16,
                           request_slots=1, draft_tokens=DRAFT_TOKENS)
    result = PassManager(cfg["passes"].split(",")).run(trace(model, list(PROGRAMS), options))
    staged = CompileResult(result.program, list(result.stages))        # the tp pass copies; result.program stays
    rank_weights = run_tp_stage(staged, cfg["tp"])
    return config, result.program, rank_programs(staged.program, [rank_weights[rank]])[0]


def measure_tp(program, device: torch.device, cfg: dict, hidden: int, out: dict, phase) -> None:
    """Phases 2-4: TP2 graph times, launch counts, times without all_reduce, one all_reduce in isolation."""
    from lingc.kernels import allreduce
    from lingc.runtime.executor import Executor
    backend = cfg["backend"]
    exe = Executor(program, device, backend, pdl=backend == "triton" and device.type == "cuda")
    out["counts"] = launch_counts(exe)
    out["tp"] = {"all_reduce_impl": "one-shot" if allreduce.active() else "reference (NCCL / gloo)",
                 "times": time_program(exe, cfg["context"], cfg["repeats"], cfg.get("profile", False))}
    phase("tp_times")
    if allreduce.active():                       # A/B: the same graphs captured with the reference op (NCCL)
        del exe
        _free(device)
        ws = allreduce.disable()
        exe = Executor(program, device, backend, pdl=backend == "triton" and device.type == "cuda")
        out["tp"]["times_nccl"] = time_program(exe, cfg["context"], cfg["repeats"])
        allreduce.use(ws)
        phase("tp_times_nccl")
    out["tp"]["all_reduce_swapped"] = skip_all_reduce(exe)
    out["tp"]["times_without_all_reduce"] = time_program(exe, cfg["context"], cfg["repeats"])
    del exe
    _free(device)
    phase("tp_times_without_all_reduce")
    _barrier(device)
    out["isolated_all_reduce"] = {"shape": [1, hidden], "dtype": "bf16", "calls_per_graph": ISOLATED_CALLS,
                                  **isolated_all_reduce(device, cfg["tp"], hidden, cfg["repeats"])}
    phase("isolated_all_reduce")


def measure_tp1(tp1, device: torch.device, cfg: dict, prompt: list[int], out: dict) -> object:
    """Phase 1 (run after the TP2 phases, which matter most): the TP1 program alone on this GPU, graph times and
    greedy tokens (plain and NEXTN). Returns the plain TP1 engine (it probes logits at a divergence)."""
    from lingc.runtime.engine import Engine, Request
    from lingc.runtime.executor import Executor
    backend = cfg["backend"]
    exe = Executor(tp1, device, backend, pdl=backend == "triton" and device.type == "cuda")
    out["tp1"] = {"times": None if cfg.get("parity_only") else time_program(exe, cfg["context"], cfg["repeats"]),
                  "tokens": {}}
    del exe
    _free(device)
    keep = None
    for spec in ("none", "nextn"):
        engine = Engine(tp1, str(device), spec, backend=backend)
        out["tp1"]["tokens"][spec] = engine.generate(Request(prompt, cfg["parity_tokens"], ignore_eos=True)).tokens
        if spec == "none":
            keep = engine
        del engine
    _free(device)
    return keep


def run_rank(rank: int, cfg: dict, out: dict, save) -> None:
    import torch.distributed as dist

    from lingc.passes.tp import TensorParallel
    from lingc.runtime.tp import _init_group

    dev = f"cuda:{rank}" if cfg["device"] == "cuda" else "cpu"
    device = torch.device(dev)
    if device.type == "cpu":
        torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", cfg["port"], None, is_master=False,
                          timeout=datetime.timedelta(seconds=cfg["timeout"]))
    _init_group(store, rank, cfg["tp"], dev, cfg["pg_timeout"])
    _barrier(device)
    out.update({"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "backend": dist.get_backend(), "env": {k: os.environ.get(k) for k in NCCL_ENV}, "phases_s": {}})
    clock = [time.perf_counter()]

    def phase(name: str) -> None:
        now = time.perf_counter()
        out["phases_s"][name], clock[0] = now - clock[0], now
        save()

    config, tp1, program = build(rank, cfg, device, out)
    _free(device)
    phase("build_trace_passes_tp_pass")
    _barrier(device)
    if not cfg.get("parity_only"):
        measure_tp(program, device, cfg, config.hidden_size, out, phase)
    prompt = [(7 * i + 3) % config.vocab_size for i in range(PROMPT_TOKENS)]
    probe = measure_tp1(tp1, device, cfg, prompt, out)
    phase("tp1")
    _barrier(device)
    parity = {}
    for spec in ("none", "nextn"):
        tokens = tp_tokens(program, rank, cfg["tp"], dev, spec, cfg["backend"], store, prompt, cfg["parity_tokens"],
                           cfg["pg_timeout"])
        _free(device)
        if rank == 0:
            parity[spec] = divergence(out["tp1"]["tokens"][spec], tokens, probe, prompt, TensorParallel.tolerance)
    out["parity"] = parity if rank == 0 else "rank 0 reports"
    phase("parity")
    _barrier(device)


def _exit_with_parent() -> None:
    """End this rank when the parent goes (e.g. killed by a `timeout`): an orphaned rank would hold its GPU."""
    import threading
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(3)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def rank_main(rank: int, cfg: dict) -> None:
    """A spawned rank: run, write rank<r>.json after every phase, leave the group (bounded), exit the process."""
    os.environ.update(NCCL_ENV)
    _exit_with_parent()
    path = Path(cfg["out_dir"]) / f"rank{rank}.json"
    out: dict = {"rank": rank}

    def save() -> None:
        path.write_text(json.dumps(out, indent=1, default=str))
    code = 0
    try:
        run_rank(rank, cfg, out, save)
    except BaseException as e:  # noqa: BLE001  recorded for the parent
        code = 1
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()[-4000:]
        print(f"rank {rank}: {out['traceback']}", file=sys.stderr, flush=True)
    finally:
        save()
        import torch.distributed as dist

        from lingc.runtime.tp import _leave_group
        t0 = time.perf_counter()
        _leave_group(timeout_s=5.0)                # destroy_process_group on a thread, given up after 5 s
        out["teardown"] = {"s": time.perf_counter() - t0, "group_destroyed": not dist.is_initialized()}
        save()
        os._exit(code)


# ---- the parent ------------------------------------------------------------------------------------------
def summarize(result: dict) -> dict:
    """Rank 0's table per graph (and NEXTN's sum): TP2 ms (mean of the two medians), without all_reduce, the share,
    launch counts, TP1 ms and the speedup over it."""
    r0 = result["ranks"].get("0", {})
    times, without = r0.get("tp", {}).get("times"), r0.get("tp", {}).get("times_without_all_reduce")
    nccl = r0.get("tp", {}).get("times_nccl")
    tp1, counts = r0.get("tp1", {}).get("times"), r0.get("counts", {})
    if not times:
        return {}

    def mean2(t: dict | None, key: str, g: str) -> float | None:
        return None if not t else (t[key]["ms"][g] + t[key]["ms_repeat"][g]) / 2
    rows = [(g, key, g, (g,)) for key, gs in GRAPH_SETS.items() for g in gs]
    rows.append(("nextn_total", "nextn", "total", GRAPH_SETS["nextn"]))
    table = {}
    for name, key, g, members in rows:
        row = {"tp2_ms": mean2(times, key, g), "tp2_no_all_reduce_ms": mean2(without, key, g),
               "tp1_ms": mean2(tp1, key, g), "tp2_nccl_ms": mean2(nccl, key, g)}
        if row["tp2_no_all_reduce_ms"] is not None:
            row["all_reduce_share"] = 1 - row["tp2_no_all_reduce_ms"] / row["tp2_ms"]
        if row["tp1_ms"] is not None:
            row["speedup_vs_tp1"] = row["tp1_ms"] / row["tp2_ms"]
        for k in ("all_reduce", "all_gather", "launches"):
            row[k] = sum(counts[m][k] for m in members if m in counts)
        table[name] = row
    return table


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="tp.json")
    ap.add_argument("--preset", default="ling-3.0-tiny")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--context", type=int, default=None, help="tokens in the cache (default: 8192 cuda, 48 cpu)")
    ap.add_argument("--repeats", type=int, default=None, help="timed replays per series (default: 30 cuda, 2 cpu)")
    ap.add_argument("--parity-tokens", type=int, default=None, help="greedy tokens compared (default: 32 cuda, 8 cpu)")
    ap.add_argument("--prefill-tokens", type=int, default=None, help="prefill chunk (default: 64 cuda, 16 cpu)")
    ap.add_argument("--passes", default="all", help="comma-separated passes before the tp pass (needs partition)")
    ap.add_argument("--backend", default=None, choices=("triton", "reference"),
                    help="default: triton on cuda, reference on cpu")
    ap.add_argument("--timeout", type=float, default=540.0, help="seconds before the ranks are killed")
    ap.add_argument("--parity-only", action="store_true", help="skip the timings: greedy parity only (e.g. on CPU "
                    "with --backend triton under TRITON_INTERPRET=1)")
    ap.add_argument("--layers", type=int, default=0, help="override num_hidden_layers (debugging, e.g. on CPU)")
    ap.add_argument("--vocab", type=int, default=0, help="override vocab_size (debugging, e.g. on CPU)")
    ap.add_argument("--profile", action="store_true", help="also profile each TP graph kernel by kernel (CUDA)")
    ap.add_argument("--pg-timeout", type=float, default=300.0, help="process-group (collective) timeout, seconds")
    args = ap.parse_args(argv)
    os.environ.update(NCCL_ENV)                   # inherited by the spawned ranks (and set again there)
    for name, value in zip(("context", "repeats", "parity_tokens", "prefill_tokens"), DEFAULTS[args.device]):
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.backend = args.backend or ("triton" if args.device == "cuda" else "reference")
    room = max(args.context + DRAFT_TOKENS * (3 + args.repeats), PROMPT_TOKENS + args.parity_tokens)
    cfg = {**vars(args), "max_len": -(-(room + 2 * DRAFT_TOKENS + 16) // 16) * 16}
    result: dict = {"torch": torch.__version__, "python": platform.python_version(),
                    "commit": os.environ.get("LINGC_COMMIT", "unknown"), "command": " ".join(sys.argv),
                    "config": {k: v for k, v in cfg.items() if k != "json"}, "ranks": {}}
    t0 = time.perf_counter()
    if args.device == "cuda" and torch.cuda.device_count() < args.tp:
        result["error"] = f"--tp {args.tp} needs {args.tp} GPUs; torch sees {torch.cuda.device_count()}"
    else:
        run_ranks(cfg, result)
    result["total_s"] = time.perf_counter() - t0
    result["gpu"] = result["ranks"].get("0", {}).get("device", args.device)
    result["summary"] = summarize(result)
    for r, rank in sorted(result["ranks"].items()):
        if "error" in rank:
            result.setdefault("errors", {})[r] = rank["error"]
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(json.dumps({"summary": result["summary"], "parity": result["ranks"].get("0", {}).get("parity"),
                      "isolated_all_reduce": result["ranks"].get("0", {}).get("isolated_all_reduce"),
                      "errors": result.get("errors"), "error": result.get("error")}, indent=1, default=str), flush=True)
    if result.get("errors") or result.get("error"):
        raise SystemExit(1)


def run_ranks(cfg: dict, result: dict) -> None:
    """Host the rendezvous store, spawn one process per rank, wait (bounded), read their JSON files."""
    import tempfile

    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=cfg["timeout"]))
    ctx = torch.multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as out_dir:
        cfg = {**cfg, "port": store.port, "out_dir": out_dir}
        procs = [ctx.Process(target=rank_main, args=(r, cfg), name=f"lingc-tp-bench-rank{r}") for r in range(cfg["tp"])]
        for p in procs:
            p.start()
        deadline = time.monotonic() + cfg["timeout"]
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for r, p in enumerate(procs):
            if p.exitcode is None:
                p.kill()
                p.join(5)
                result.setdefault("killed_after_timeout", []).append(r)
            result.setdefault("exit_codes", {})[str(r)] = p.exitcode
        for r in range(cfg["tp"]):
            path = Path(out_dir) / f"rank{r}.json"
            result["ranks"][str(r)] = json.loads(path.read_text()) if path.exists() else {"error": "no output"}
            if r in result.get("killed_after_timeout", []):
                result["ranks"][str(r)].setdefault("error", f"killed after --timeout {cfg['timeout']:g} s")
    del store


if __name__ == "__main__":
    main()
