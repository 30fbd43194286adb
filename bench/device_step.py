"""The batch-1 step benchmark on one GPU: lingc's decode and NEXTN steps vs the byte floor and peers.

Model: Ling-3.0-tiny at full depth (24 layers, 128 experts) + one MTP layer, random weights drawn on the GPU with
lingc.init's generator (the bytes `lingc init --device cuda` would write), bf16, batch 1, an 8192-token context
(random latent cache and KDA state, seq_len = 8192). For each pass set of the ablation the step programs are
compiled, lowered to the Triton kernels, captured as CUDA graphs and replayed; a step's time is the median of
CUDA-event timings of graph replays (weights are 2+ GB a step, so L2 is cold by construction), measured twice.
The byte floor of each graph comes from one observed run of it (bench/floor.py) and the HBM bandwidth measured in
the same process. Peers run in the same process on the same model: the reference model's own step functions
under torch.compile(mode="max-autotune") and transformers' BailingHybridForCausalLM eager. The request is greedy;
where the pass set has specialize_greedy (`all`), a row also times its copies (step_greedy; draft_greedy ->
verify_greedy -> extend_greedy), which the engine runs for a temperature-0 request: the summary's *_greedy keys.
The general NEXTN graphs are also replayed for a sampled request (SAMPLED: temperature 0.8, top-p 0.95), whose
filtered_probs rows run the top-p search that greedy rows skip: the summary's *_sampled keys (floor: the general's).

    python3 bench/device_step.py --json $OUT/step.json [--peers] [--e2e] [--only all]
        [--variant 'NAME:lingc.kernels.moe.UP_CONFIG={"block_n": 16}' ...] [--no-parity]
    python3 bench/device_step.py --rows $OUT/ab.json      # no GPU: each row's greedy decode / verify / NEXTN ms

A `--variant` re-runs the "all" row in the same process (weights, trace and compiled kernels shared, ~10-20 s a
row once compiled) with tunables overridden, then restores them; its row is named "all@NAME". Assignments are
joined by ";", each `module.ATTR[i][j]...=VALUE` or `module.Class.ATTR=VALUE` (a pass's `in_all`), VALUE a Python
literal (ast.literal_eval, never eval); a dict literal replaces fields of a dataclass / NamedTuple value. Only
tunables read at launch or compile time take effect (not default arguments bound at import). "NAME:" alone is a
baseline row.

`--budget-s S` (the table call, bench/device_step_1gpu.sh): every row but the cumulative "+pass" ones ("none",
"partition", "all", the variants and any A/B row asked for) runs first, then the parity and the end-to-end run, then
the "+pass" rows while one still fits in S seconds from the start (`row_cost_guess`); a row left out is listed in
`skipped_rows` with the reason, and the JSON keeps the ablation's order. On a cold machine every row compiles its
kernels afresh (20-50 s a row), which ran a 450 s call out of time during the end-to-end run (2026-12-04); so
`--warm-only --shard I/N` (with `--layers 4`) compiles and captures the rows I, I+N, ... and, on some shards, the
parity's and end-to-end run's engines, timing nothing, and the table call runs N of them in parallel first, so that
its budgeted run finds Triton's on-disk cache warm. The two A/B rows after "all" ("all:pdl-chains", "all+fuse_moe")
run only with `--ab-rows` or when `--only` names them.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import gc
import importlib
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from floor import step_bytes  # noqa: E402
from lingc.steps import COPY_SUFFIXES, GREEDY_SUFFIX, NUCLEUS_SUFFIX, PLAIN_SUFFIX  # noqa: E402
from timing import hbm_bandwidth_gbps  # noqa: E402

CONTEXT = 8192
DRAFT_TOKENS = 6
NEXTN_GRAPHS = ("draft", "verify", "extend")
# the measured steps: the general graphs (any request) and, where the program has them, specialize_greedy's copies
# (what the engine runs for a temperature-0 request, as here)
# "nextn_sampled": the general NEXTN graphs replayed for a sampled request (SAMPLED: temperature 0.8, top-p 0.95),
# whose filtered_probs rows run the top-p threshold search; the other rows' relays are greedy (those rows exit at once)
SAMPLED_SUFFIX = "_sampled"
# with specialize_sampling's copies (the A/B row "all+specialize_sampling"): "nextn_nucleus", the nucleus copies for
# SAMPLED (top-k off, top-p 0.95), against "nextn_sampled"; "nextn_plain", the plain copies for PLAIN (top-k and top-p
# off), against "nextn_sampled_plain", the general graphs for PLAIN
PLAIN_REQUEST_SUFFIX = "_sampled_plain"
STEP_KEYS = ("step", "nextn", "step" + GREEDY_SUFFIX, "nextn" + GREEDY_SUFFIX, "nextn" + SAMPLED_SUFFIX,
             "nextn" + NUCLEUS_SUFFIX, "nextn" + PLAIN_SUFFIX, "nextn" + PLAIN_REQUEST_SUFFIX)
ABLATION = ("fuse_projections", "fuse_add_norm", "fuse_swiglu", "fuse_moe_align", "bf16_router",
            "capture_metadata", "pdl", "fuse_kda", "fuse_shared_expert", "fuse_norm_linear", "fuse_combine_norm",
            "fuse_mla", "fuse_relay", "fuse_cat_norm", "fuse_align_into_moe", "fuse_embed_norm",
            "fuse_simulate_accept", "fuse_relay_cat")
# "all" adds fuse_index_chains; then two A/B rows (with --ab-rows): "all:pdl-chains" (the pdl pass annotating its
# chains only, as before 2026-11-30's second session) and "all+fuse_moe" (the opt-in pass)
AB_ROWS = ("all:pdl-chains", "all+fuse_moe", "all+specialize_sampling")


def _sync() -> None:
    torch.cuda.synchronize()


def fill_context(exe, config, seed: int = 0) -> None:
    """Slot 0 holds a request with CONTEXT tokens: random latent cache rows and KDA state, pages in order."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    bufs = exe.buffers.tensors
    for key, t in bufs.items():
        if not key.startswith("state_"):
            continue
        if key.endswith("kv_pages"):
            t.copy_(torch.randn(t.shape, generator=g, device="cuda").to(t.dtype))
        elif key.endswith("recurrent"):
            t.copy_(0.02 * torch.randn(t.shape, generator=g, device="cuda"))
        else:
            t.copy_((0.1 * torch.randn(t.shape, generator=g, device="cuda")).to(t.dtype))
    pt = bufs["page_table"]
    pt.copy_(torch.arange(pt.numel(), device="cuda", dtype=pt.dtype).view(pt.shape))
    bufs["slots"].zero_()
    reset_request(exe)


def reset_request(exe, simulate: float = 0.0, sampling: dict | None = None) -> None:
    """Slot 0's request relays back to the benchmark's start: greedy, or `sampling` (SAMPLED's keys)."""
    r = {k[len("relay_"):]: v for k, v in exe.buffers.tensors.items() if k.startswith("relay_")}
    r["seq_len"][0] = CONTEXT
    r["temperature"][0], r["top_k"][0], r["top_p"][0] = 0.0, 0, 1.0
    if sampling:
        r["temperature"][0], r["top_p"][0] = sampling["temperature"], sampling["top_p"]
        r["seed"][0], r["rng_counter"][0] = sampling["seed"], 0
    r["simulate_accept"][0] = simulate
    r["root"][0], r["draft_first"][0] = 11, 12


def time_graphs(graphs, names, repeats: int = 30) -> dict[str, float]:
    """Median ms of each named graph's replay and of the whole sequence, CUDA events, back to back."""
    per: dict[str, list[float]] = {n: [] for n in names}
    whole = []
    for _ in range(3):
        for n in names:
            graphs.run(n)
    _sync()
    for _ in range(repeats):
        evs = [torch.cuda.Event(enable_timing=True) for _ in range(len(names) + 1)]
        evs[0].record()
        for i, n in enumerate(names):
            graphs.run(n)
            evs[i + 1].record()
        evs[-1].synchronize()
        for i, n in enumerate(names):
            per[n].append(evs[i].elapsed_time(evs[i + 1]))
        whole.append(evs[0].elapsed_time(evs[-1]))
    out = {n: statistics.median(v) for n, v in per.items()}
    out["total"] = statistics.median(whole)
    return out


def host_lead(graphs, names, steps: int = 20) -> dict[str, float]:
    """Host enqueue time per step vs GPU time per step, and the GPU idle gap between consecutive steps."""
    _sync()
    evs = []
    t0 = time.perf_counter()
    for _ in range(steps):
        a = torch.cuda.Event(enable_timing=True)
        a.record()
        for n in names:
            graphs.run(n)
        b = torch.cuda.Event(enable_timing=True)
        b.record()
        evs.append((a, b))
    host = (time.perf_counter() - t0) / steps * 1e3
    _sync()
    gaps = [evs[i][1].elapsed_time(evs[i + 1][0]) for i in range(steps - 1)]
    gpu = statistics.median(a.elapsed_time(b) for a, b in evs)
    return {"host_enqueue_ms_per_step": host, "gpu_ms_per_step": gpu, "gpu_idle_gap_ms_median": statistics.median(gaps)}


def _floor_bytes(exe, graphs) -> dict:
    out = {}
    for g in graphs:
        reset_request(exe)
        out[g] = step_bytes(exe, g)
    return out


def launches_pdl(passes: list[str]) -> bool:
    """Whether the pdl pass runs, so the executor launches its annotated kernels with PDL, as the Engine does. Until
    2026-11-30 this tested `"pdl" in passes`, so the `all` rows ran without PDL launches (their JSON says
    pdl_launches: false); the cumulative rows from +pdl on had them."""
    from lingc.passes import PASSES
    from lingc.passes.manager import resolve
    return bool(passes) and any(cls.name == "pdl" for cls in resolve(passes, PASSES))


def measure_config(model, traced, passes: list[str], bandwidth: float, with_floor: bool,
                   floor_first: bool = False, warm_only: bool = False) -> dict:
    """One ablation row. The floor bytes are counted after timing on a fresh executor, or (floor_first, the order
    before 2026-11-30's second session) on the timed executor before capture. warm_only: compile and capture (every
    kernel the row launches lands in Triton's on-disk cache), then stop."""
    from lingc.passes.manager import PassManager
    from lingc.runtime.executor import Executor
    from lingc.runtime.graphs import CudaGraphs

    t0 = time.perf_counter()
    program = PassManager(passes).run(traced).program if passes else traced
    pdl = launches_pdl(passes)
    exe = Executor(program, "cuda", "triton", pdl=pdl)
    fill_context(exe, model.config)
    row: dict = {"passes": passes or ["(none)"], "pdl_launches": pdl}
    from lingc.passes import PASSES
    from lingc.passes.manager import resolve
    partitioned = any(cls.name == "partition" for cls in resolve(passes, PASSES)) if passes else False
    step_names = {"step": ("step",), "nextn": NEXTN_GRAPHS if partitioned else ()}
    if "step" + GREEDY_SUFFIX in program.graphs:        # specialize_greedy's copies: what a greedy request runs
        step_names["step" + GREEDY_SUFFIX] = ("step" + GREEDY_SUFFIX,)
    if partitioned and all(g + GREEDY_SUFFIX in program.graphs for g in NEXTN_GRAPHS):
        step_names["nextn" + GREEDY_SUFFIX] = tuple(g + GREEDY_SUFFIX for g in NEXTN_GRAPHS)
    if partitioned:
        step_names["nextn" + SAMPLED_SUFFIX] = NEXTN_GRAPHS          # the same graphs as "nextn", sampled relays
    for suffix in (NUCLEUS_SUFFIX, PLAIN_SUFFIX):                    # specialize_sampling's copies, where compiled
        if partitioned and all(g + suffix in program.graphs for g in NEXTN_GRAPHS):
            step_names["nextn" + suffix] = tuple(g + suffix for g in NEXTN_GRAPHS)
            if suffix == PLAIN_SUFFIX:
                step_names["nextn" + PLAIN_REQUEST_SUFFIX] = NEXTN_GRAPHS   # their baseline: the general graphs
    floor_graphs = step_names["step"] + step_names["nextn"]          # a greedy copy's floor is its source's
    if with_floor and floor_first:
        row["bytes"] = _floor_bytes(exe, floor_graphs)
    graphs = CudaGraphs(exe)
    graphs.capture(list(dict.fromkeys(g for names in step_names.values() for g in names)))
    row["compile_capture_s"] = time.perf_counter() - t0
    if warm_only:
        del graphs, exe, program
        gc.collect()
        torch.cuda.empty_cache()
        return row
    fill_context(exe, model.config)
    row["launches"] = {g: len(exe.lowered[g].launches) for names in step_names.values() for g in names}
    row["triton_launches"] = {g: sum(1 for x in exe.lowered[g].launches if x.label.startswith("triton:"))
                              for names in step_names.values() for g in names}
    for key, names in step_names.items():
        if not names:
            continue
        sampling = request_for(key)
        reset_request(exe, sampling=sampling)
        first = time_graphs(graphs, names)
        reset_request(exe, sampling=sampling)
        second = time_graphs(graphs, names)
        reset_request(exe, sampling=sampling)
        row[key] = {"ms": first, "ms_repeat": second, "host": host_lead(graphs, names)}
        reset_request(exe)
    if with_floor and not floor_first:     # counted after timing, on a fresh executor: the timed one never ran eagerly
        floor_exe = Executor(program, "cuda", "triton", pdl=pdl)
        fill_context(floor_exe, model.config)
        row["bytes"] = _floor_bytes(floor_exe, floor_graphs)
        del floor_exe
    if with_floor:
        set_floors(row, step_names, bandwidth)
    del graphs, exe, program
    gc.collect()
    torch.cuda.empty_cache()
    return row


def request_for(key: str) -> dict | None:
    """The sampled request a measured step's key replays (None: greedy)."""
    if key.endswith(PLAIN_SUFFIX) or key.endswith(PLAIN_REQUEST_SUFFIX):
        return PLAIN
    return SAMPLED if key.endswith(SAMPLED_SUFFIX) or key.endswith(NUCLEUS_SUFFIX) else None


def source_graph(name: str) -> str:
    """A specialised copy's source graph (verify_greedy -> verify), whose floor the copy shares."""
    for suffix in COPY_SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


def set_floors(row: dict, step_names: dict[str, tuple[str, ...]], bandwidth: float) -> None:
    """floor_ms and floor_ratio of every measured step from the row's bytes. A greedy copy (step_greedy, ...) gets
    its general graph's floor: for the same request it moves the same weights, KDA state and MLA cache (it drops only
    the sampling distributions, activations the floor leaves out), whereas an observed run of it would route other
    tokens (those the general graphs' runs left in the relays) and so count other experts."""
    for key, names in step_names.items():
        if not names:
            continue
        by_graph = {g: sum(row["bytes"][source_graph(g)].values()) for g in names}
        floors = {g: b / bandwidth / 1e6 for g, b in by_graph.items()}
        floors["total"] = sum(floors.values())
        row[key]["floor_ms"] = floors
        row[key]["floor_ratio"] = {g: row[key]["ms"][g] / floors[g] for g in floors}


def _replace_value(old, value):
    """VALUE for an attribute, or, with a dict VALUE, old with those fields replaced (dataclass / NamedTuple)."""
    if isinstance(value, dict) and dataclasses.is_dataclass(old):
        return dataclasses.replace(old, **value)
    if isinstance(value, dict) and hasattr(old, "_replace"):
        return old._replace(**value)
    return value


def _set_path(old, path: list[int], value):
    """old with old[path[0]][path[1]]... replaced (tuples rebuilt, lists copied)."""
    if not path:
        return _replace_value(old, value)
    items = list(old)
    items[path[0]] = _set_path(items[path[0]], path[1:], value)
    return type(old)(items) if not hasattr(old, "_replace") else type(old)(*items)


def _owner(dotted: str):
    """The module named `dotted`, or an attribute path inside the longest importable prefix of it; None if neither."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name, None)
        return obj
    return None


def parse_variant(spec: str) -> tuple[str, list[tuple[object, str, object]]]:
    """'NAME:mod.ATTR[i]=VALUE;...' -> (NAME, [(module, ATTR, new value)]), checked against the live modules."""
    name, _, body = spec.partition(":")
    sets = []
    for item in filter(None, (x.strip() for x in body.split(";"))):
        target, _, literal = item.partition("=")
        m = re.fullmatch(r"([\w.]+)\.(\w+)((?:\[\d+\])*)", target.strip())
        if not m or not literal:
            raise SystemExit(f"--variant {spec!r}: expected module.ATTR[i]...=VALUE, got {item!r}")
        module = _owner(m.group(1))           # a module, or a class in one (module.Class.ATTR)
        if module is None or not hasattr(module, m.group(2)):
            raise SystemExit(f"--variant {spec!r}: {m.group(1)} has no attribute {m.group(2)}")
        path = [int(i) for i in re.findall(r"\[(\d+)\]", m.group(3))]
        # a second item on the same attribute edits the first one's result, not the live value
        earlier = [i for i, (mod, attr, _) in enumerate(sets) if mod is module and attr == m.group(2)]
        base = sets[earlier[-1]][2] if earlier else getattr(module, m.group(2))
        new = _set_path(base, path, ast.literal_eval(literal.strip()))
        if earlier:
            sets[earlier[-1]] = (module, m.group(2), new)
        else:
            sets.append((module, m.group(2), new))
    return name, sets


def greedy_parity(model, traced, passes: list[str], tokens: int = 48) -> dict:
    """Greedy NEXTN == plain decode == reference (the same artifact, Triton kernels, CUDA graphs), and == the same
    passes without `pdl` (PDL on == off over the whole step)."""
    from lingc.passes.manager import PassManager
    from lingc.runtime.engine import Engine, Request
    program = PassManager(passes).run(traced).program
    prompt = list(range(1000, 1040))
    out, graphs = {}, {}
    for spec in ("nextn", "none"):
        for greedy_graphs in (True, False):                   # specialize_greedy's copies, then the general graphs
            eng = Engine(program, "cuda", spec, greedy_graphs=greedy_graphs)
            r = eng.generate(Request(prompt, tokens, ignore_eos=True))
            out[spec, greedy_graphs], graphs[spec, greedy_graphs] = r.tokens, r.graphs
            del eng
    # the same passes without `pdl` (every launch stream-ordered): PDL must not change a bit (kernels read before
    # their wait only what earlier launches completed)
    no_pdl = PassManager([p.name for p in PassManager(passes).passes if p.name != "pdl"]).run(traced).program
    for spec in ("nextn", "none"):
        eng = Engine(no_pdl, "cuda", spec, greedy_graphs=True)
        out[spec, "no-pdl"] = eng.generate(Request(prompt, tokens, ignore_eos=True)).tokens
        del eng
    del no_pdl
    ref = model.generate(torch.tensor([prompt], device="cuda"), tokens)[0].tolist()
    gc.collect()
    torch.cuda.empty_cache()
    plain = out["none", True]
    return {"nextn_equals_plain": out["nextn", True] == plain,
            "pdl_off_equals_on": all(out[s, "no-pdl"] == out[s, True] for s in ("nextn", "none")),
            "general_nextn_equals_plain": out["nextn", False] == out["none", False],
            "greedy_graphs_equal_general": all(out[s, True] == out[s, False] for s in ("nextn", "none")),
            "graphs": {f"{s}{'' if g else ' (general)'}": list(v) for (s, g), v in graphs.items()},
            "plain_equals_reference": plain == ref,
            "first_divergence_vs_reference": next((i for i, (a, b) in enumerate(zip(plain, ref)) if a != b), None)}


SAMPLED = {"temperature": 0.8, "top_p": 0.95, "seed": 1}      # the sampled end-to-end request (--draft-vocab)
PLAIN = {"temperature": 0.8, "top_p": 1.0, "seed": 1}         # sampled, no filter (the OpenAI API's defaults)


def end_to_end(program, prompt_len: int, new_tokens: int = 1024, accept: float = 3.2, greedy_graphs: bool = True,
               sampling: dict | None = None) -> dict:
    """What `lingc generate --simulate-accept-len 3.2 --max-new-tokens 1024 --ignore-eos` does, on the in-memory
    program (the artifact's weights would be the same tensors): TTFT, TPOT, tok/s, derived step time. A greedy
    request, so the engine runs specialize_greedy's copies unless greedy_graphs is False (--no-greedy-graphs), or,
    with `sampling` (SamplingParams fields), a sampled one on the general graphs."""
    from lingc.runtime.engine import Engine, Request, SamplingParams
    t0 = time.perf_counter()
    eng = Engine(program, "cuda", "nextn", simulate_accept_len=accept, greedy_graphs=greedy_graphs)
    startup = time.perf_counter() - t0
    prompt = [(7 * i + 3) % 150000 for i in range(prompt_len)]
    eng.generate(Request(prompt[:64], 16, ignore_eos=True))                          # warm-up
    r = eng.generate(Request(prompt, new_tokens, SamplingParams(**(sampling or {})), ignore_eos=True))
    decode_s = r.total_s - r.ttft_s
    out = {"prompt_tokens": prompt_len, "new_tokens": len(r.tokens), "engine_startup_s": startup,
           "ttft_ms": r.ttft_s * 1e3, "tpot_ms": r.tpot_s * 1e3, "tok_per_s": len(r.tokens) / r.total_s,
           "decode_tok_per_s": (len(r.tokens) - 1) / decode_s, "steps": r.steps,
           "mean_accept_len": r.mean_accept_len, "step_ms": decode_s / max(r.steps, 1) * 1e3, "graphs": list(r.graphs)}
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    return out


def print_rows(path: str) -> None:
    """One line per ablation row of a stored result: greedy decode, verify and NEXTN step ms (nan where not run)."""
    with open(path) as f:
        result = json.load(f)
    nan = float("nan")
    for row in result.get("ablation", []):
        step, nextn = row.get("step_greedy", {}).get("ms", {}), row.get("nextn_greedy", {}).get("ms", {})
        print(f"{row['name']:28s} greedy decode {step.get('step_greedy', nan):.4f}  verify "
              f"{nextn.get('verify_greedy', nan):.4f}  NEXTN {nextn.get('total', nan):.4f} ms")
    parity = {k: v for k, v in result.get("greedy_parity", {}).items() if k != "graphs"}
    if parity:
        print("parity", parity)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="step.json")
    ap.add_argument("--only", default="", help="comma-separated ablation rows to run: none,<pass>...,all")
    ap.add_argument("--peers", action="store_true", help="also time torch.compile and transformers peers")
    ap.add_argument("--e2e", action="store_true", help="also run the engine end to end (1024 tokens)")
    ap.add_argument("--layers", type=int, default=0, help="override num_hidden_layers (debugging)")
    ap.add_argument("--floor-first", action="store_true",
                    help="count the floor bytes with an eager run of the timed executor before capture (old order)")
    ap.add_argument("--pdl-scope", choices=("all", "chains"), default="all",
                    help="A/B: 'chains' makes the pdl pass annotate its chains only (passes/pdl.py SOLO = False)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:mod.ATTR=VALUE[;...]",
                    help="also run the 'all' row with these tunables overridden (module docstring); repeatable")
    ap.add_argument("--no-parity", action="store_true", help="skip the greedy parity run (A/B calls)")
    ap.add_argument("--parity-passes", default="all", metavar="P[,P...]",
                    help="the passes the greedy parity compiles (default all; e.g. all,fuse_norm_router: an opt-in "
                         "pass's parity)")
    ap.add_argument("--e2e-prompt", type=int, default=1024, help="prompt tokens of the end-to-end run")
    ap.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                    help="also run a row 'all+draft_vocab' (the opt-in pass) with a synthetic map of N evenly spaced "
                    "token ids (random weights: the map's choice moves no time; acceptance is not measured)")
    ap.add_argument("--budget-s", type=float, default=0.0, metavar="S",
                    help="the table call's time budget: the rows the table needs, the parity and --e2e first, then "
                    "the other ablation rows while one still fits in S seconds from the start (module docstring)")
    ap.add_argument("--warm-only", action="store_true",
                    help="compile and capture the rows (and, with --e2e, the parity's and end-to-end run's engines on "
                    "short requests) without timing anything: fills Triton's on-disk cache for a later run (module "
                    "docstring); use with --layers 4 and --shard")
    ap.add_argument("--shard", default="0/1", metavar="I/N",
                    help="--warm-only: the rows I, I+N, I+2N, ... of the plan; the last shard also warms the parity's "
                    "engines and, with --e2e, shard N-2 (or the only one) the end-to-end run's")
    ap.add_argument("--ab-rows", action="store_true",
                    help=f"also run the A/B rows after 'all' ({', '.join(AB_ROWS)})")
    ap.add_argument("--rows", default=None, metavar="FILE",
                    help="no GPU work: print each ablation row's greedy decode / verify / NEXTN ms of a stored result")
    ap.add_argument("--merge-peers", nargs="*", default=None, metavar="NAME=FILE",
                    help="no GPU work: add peer results (bench/peers.py JSON) to the --json file and re-summarize")
    args = ap.parse_args()
    started = time.perf_counter()
    if args.rows is not None:
        print_rows(args.rows)
        return
    if args.merge_peers is not None:
        with open(args.json) as f:
            result = json.load(f)
        for item in args.merge_peers:
            name, path = item.split("=", 1)
            peer = result.setdefault("peers", {}).setdefault(name, {})   # several files may name one peer
            if not os.path.exists(path):
                peer[f"{Path(path).stem}_error"] = "no result (the peer failed or ran past its time limit)"
                continue
            with open(path) as f:
                peer.update(json.load(f))
        summarize(result)
        _save(result, args.json)
        return
    import lingc  # noqa: F401
    import lingc.passes.pdl
    variants = [parse_variant(spec) for spec in args.variant]   # bad specs fail before any GPU work
    from lingc.init import random_model
    lingc.passes.pdl.SOLO = args.pdl_scope == "all"
    from lingc.presets import preset
    from lingc.trace import TraceOptions, trace

    result: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "python": platform.python_version(), "commit": os.environ.get("LINGC_COMMIT", "unknown"),
                    "command": " ".join(sys.argv), "context": CONTEXT, "draft_tokens": DRAFT_TOKENS,
                    "pdl_scope": args.pdl_scope} | ({"budget_s": args.budget_s} if args.budget_s else {})
    over = {"num_nextn_predict_layers": 1} | ({"num_hidden_layers": args.layers} if args.layers else {})
    config = preset("ling-3.0-tiny", **over)
    t0 = time.perf_counter()
    model = random_model(config, seed=0, dtype=torch.bfloat16, device="cuda")
    _sync()
    result["random_weights_s"] = time.perf_counter() - t0
    bandwidth = 0.0 if args.warm_only else hbm_bandwidth_gbps()       # a warm-up times nothing
    result["hbm_bandwidth_gbps"] = bandwidth
    print(f"weights {result['random_weights_s']:.1f} s, HBM {bandwidth:.0f} GB/s", flush=True)
    options = TraceOptions(batch=1, prefill_tokens=64, max_len=CONTEXT + 1024 + 128, page_size=16, request_slots=1,
                           draft_tokens=DRAFT_TOKENS)
    t0 = time.perf_counter()
    traced = trace(model, ["step", "nextn"], options)
    result["trace_s"] = time.perf_counter() - t0

    sets = ablation_sets(args, variants)
    if args.warm_only:
        shard, shards = parse_shard(args.shard)
        first, later = sets[shard::shards], []
    else:
        first, later = split_by_budget(sets, args.only) if args.budget_s else (sets, [])
    result["ablation"] = rows = []                 # written out after every row
    order = {name: i for i, (name, _, _) in enumerate(sets)}

    def run_row(name: str, passes: list[str], assignments: list) -> float:
        t_row = time.perf_counter()
        lingc.passes.pdl.SOLO = args.pdl_scope == "all" and name != "all:pdl-chains"
        saved = [(module, attr, getattr(module, attr)) for module, attr, _ in assignments]
        try:
            for module, attr, value in assignments:
                setattr(module, attr, value)
            source = traced
            if "draft_vocab" in passes:                # the synthetic map rides in the program's options
                from lingc.passes.draft_vocab import OPTION
                V = config.vocab_size
                source = traced.copy()
                source.options[OPTION] = list(range(0, V, V // args.draft_vocab))[:args.draft_vocab]
            row = measure_config(model, source, passes, bandwidth, with_floor=name in ("none", "partition", "all"),
                                 floor_first=args.floor_first, warm_only=args.warm_only)
        except Exception as e:  # noqa: BLE001  (one failing config must not lose the others)
            import traceback
            row = {"passes": passes, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2500:]}
            gc.collect()
            torch.cuda.empty_cache()
        finally:
            for module, attr, value in saved:
                setattr(module, attr, value)
        if assignments:
            row["variant"] = {f"{getattr(m, '__module__', '')}.{m.__name__}.{a}".lstrip("."): repr(v)
                              for m, a, v in assignments}
        row["name"] = name
        row["row_s"] = time.perf_counter() - t_row
        rows.append(row)
        rows.sort(key=lambda r: order[r["name"]])      # the ablation's order whatever ran first
        ms = {key: row.get(key, {}).get("ms") for key in STEP_KEYS if key in row or key in ("step", "nextn")}
        print(json.dumps({"name": name, "ms": ms, "error": row.get("error"),
                          "compile_capture_s": row.get("compile_capture_s"), "row_s": row["row_s"]},
                         default=str)[:600], flush=True)
        _save(result, args.json)            # after every row: a call that runs out of time keeps what it measured
        return row["row_s"]

    for item in first:
        run_row(*item)
    if args.warm_only:
        warm_engines(model, options, result, args, shard, shards)
        _save(result, args.json)
        return

    from lingc.passes.manager import PassManager
    t0 = time.perf_counter()
    full = trace(model, ["prefill", "decode", "mtp_prefill", "mtp_decode", "step", "nextn"], options)
    result["trace_all_programs_s"] = time.perf_counter() - t0
    try:
        if args.no_parity:
            raise RuntimeError("skipped (--no-parity)")
        result["greedy_parity"] = greedy_parity(model, full, args.parity_passes.split(","))
    except Exception as e:  # noqa: BLE001
        result["greedy_parity"] = {"error": f"{type(e).__name__}: {e}"}
    print("greedy parity", result["greedy_parity"], flush=True)
    _save(result, args.json)                # a call that runs out of time in the end-to-end run keeps the parity
    if args.e2e:
        try:
            program = PassManager(["all"]).run(full).program
            result["end_to_end"] = end_to_end(program, args.e2e_prompt)
            result["end_to_end_general_graphs"] = end_to_end(program, args.e2e_prompt, greedy_graphs=False)
            if args.draft_vocab:
                from lingc.passes.draft_vocab import OPTION
                from lingc.runtime.engine import Engine, Request
                hot = full.copy()
                V = config.vocab_size
                hot.options[OPTION] = list(range(0, V, V // args.draft_vocab))[:args.draft_vocab]
                hot = PassManager(["all", "draft_vocab"]).run(hot).program
                result["end_to_end_draft_vocab"] = end_to_end(hot, args.e2e_prompt)
                # a sampled request runs the general graphs, which draft_vocab now rewrites too (vocab_expand)
                result["end_to_end_sampled"] = end_to_end(program, args.e2e_prompt, sampling=SAMPLED)
                result["end_to_end_draft_vocab_sampled"] = end_to_end(hot, args.e2e_prompt, sampling=SAMPLED)
                prompt = list(range(1000, 1040))           # lossless: the same greedy tokens as plain decoding
                toks = [Engine(p, "cuda", spec).generate(Request(prompt, 48, ignore_eos=True)).tokens
                        for p, spec in ((hot, "nextn"), (program, "none"))]
                result["draft_vocab_nextn_equals_plain"] = toks[0] == toks[1]
                print("draft_vocab", result["end_to_end_draft_vocab"], "nextn == plain", toks[0] == toks[1],
                      "\nsampled", result["end_to_end_sampled"], "\ndraft_vocab sampled",
                      result["end_to_end_draft_vocab_sampled"], flush=True)
                del hot
            del program
        except Exception as e:  # noqa: BLE001
            result["end_to_end"] = {"error": f"{type(e).__name__}: {e}"}
        print("end to end", result["end_to_end"], "\ngeneral graphs", result.get("end_to_end_general_graphs"),
              flush=True)
        _save(result, args.json)
    del full

    costs: list[float] = []
    for name, passes, assignments in later:    # only under --budget-s: the rest of the ablation while it fits
        elapsed = time.perf_counter() - started
        guess = row_cost_guess(costs)
        if elapsed + guess > args.budget_s:
            result.setdefault("skipped_rows", {})[name] = (
                f"time budget: {elapsed:.0f} s spent, a row guessed at {guess:.0f} s, budget {args.budget_s:.0f} s")
            print("skipped", name, result["skipped_rows"][name], flush=True)
            continue
        costs.append(run_row(name, passes, assignments))
    _save(result, args.json)

    if args.peers:
        from peers import run_peers
        result["peers"] = run_peers(model, options, CONTEXT)
    summarize(result)
    _save(result, args.json)


def parse_shard(spec: str) -> tuple[int, int]:
    """--shard "I/N" -> (I, N), 0 <= I < N; ValueError naming the flag otherwise."""
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise ValueError(f"--shard {spec!r}: want I/N, e.g. 0/4") from None
    if not 0 <= i < n:
        raise ValueError(f"--shard {spec!r}: want 0 <= I < N")
    return i, n


def warm_engines(model, options, result: dict, args, shard: int, shards: int) -> None:
    """--warm-only's engines: the last shard runs the greedy parity on a 4-token request (every engine it builds,
    the no-pdl program's among them), and with --e2e shard N-2 (or the only one) the end-to-end run's engines on a
    64-token prompt and 8 new tokens (greedy copies and general graphs): their prefill and MTP programs compile
    what the step rows do not. Errors are recorded, not raised: a warm-up only saves the real run time."""
    from lingc.passes.manager import PassManager
    from lingc.trace import trace
    jobs = []
    if shard == shards - 1:
        jobs.append(("parity", lambda full: greedy_parity(model, full, ["all"], tokens=4)))
    if args.e2e and shard == max(shards - 2, 0):
        def e2e(full):
            program = PassManager(["all"]).run(full).program
            end_to_end(program, 64, new_tokens=8)
            end_to_end(program, 64, new_tokens=8, greedy_graphs=False)
        jobs.append(("end_to_end", e2e))
    if not jobs:
        return
    full = trace(model, ["prefill", "decode", "mtp_prefill", "mtp_decode", "step", "nextn"], options)
    for name, job in jobs:
        t0 = time.perf_counter()
        try:
            job(full)
            result.setdefault("warm", {})[name] = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001
            result.setdefault("warm", {})[name] = f"error: {type(e).__name__}: {e}"
        print("warm", name, result["warm"][name], flush=True)


def ablation_sets(args, variants: list) -> list[tuple[str, list[str], list]]:
    """(name, passes, assignments) of every row the arguments ask for, in the ablation's order: no passes,
    partition, each pass added in turn, all, the A/B rows (--ab-rows), all+draft_vocab (--draft-vocab), then the
    variants. --only keeps the rows it names (the A/B rows among them, without --ab-rows)."""
    sets = [("none", [])]
    acc = ["partition"]
    sets.append(("partition", list(acc)))
    for p in ABLATION:
        acc.append(p)
        sets.append(("+" + p, list(acc)))
    sets.append(("all", ["all"]))
    sets += [("all:pdl-chains", ["all"]), ("all+fuse_moe", ["all", "fuse_moe"]),
             ("all+specialize_sampling", ["all", "specialize_sampling"])]
    if args.draft_vocab:
        sets.append(("all+draft_vocab", ["all", "draft_vocab"]))
    only = set(filter(None, args.only.split(",")))
    sets = [(name, passes, []) for name, passes in sets
            if name in only or (args.ab_rows and name in AB_ROWS) or (not only and name not in AB_ROWS)]
    return sets + [(f"all@{vname}", ["all"], assignments) for vname, assignments in variants]


def split_by_budget(sets: list, only: str = "") -> tuple[list, list]:
    """(first, later) under --budget-s: every row but the cumulative "+pass" ones (the rows the table and the
    summary need, the variants, A/B and draft_vocab rows: what a call was made for), and the "+pass" rows --only
    names, first, in order; the other "+pass" rows after the parity and the end-to-end run."""
    named = set(filter(None, only.split(",")))
    later = [s for s in sets if s[0].startswith("+") and s[0] not in named]
    return [s for s in sets if s not in later], later


def row_cost_guess(costs: list[float], default: float = 45.0) -> float:
    """A later row's guessed wall time: the dearest of the later rows so far, or `default` before any ran (a row
    that compiles its kernels cold takes 20-50 s: 2026-12-04's +pdl row took 48)."""
    return max(costs, default=default)


def _save(result: dict, path: str) -> None:
    """The run's JSON so far (rewritten whole each time)."""
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)


def summarize(result: dict) -> None:
    """Floor ratios and peer speedups at the top level, and a short table on stdout."""
    rows = {r["name"]: r for r in result["ablation"] if "error" not in r}
    best = rows.get("all")
    table = []
    for name, r in rows.items():
        for sfx in ("", GREEDY_SUFFIX, SAMPLED_SUFFIX, NUCLEUS_SUFFIX, PLAIN_REQUEST_SUFFIX, PLAIN_SUFFIX):
            ms = (r.get("step" + sfx, {}).get("ms", {}), r.get("nextn" + sfx, {}).get("ms", {}))
            if sfx and not any(ms):
                continue
            verify_key = "verify" + (sfx if sfx in COPY_SUFFIXES else "")     # the sampled rows run the general graphs
            step, nextn, verify = ms[0].get("total"), ms[1].get("total"), ms[1].get(verify_key)
            table.append(f"{name + sfx:25s} step {step or 0:8.3f} ms   nextn {nextn or 0:8.3f} ms   "
                         f"verify {verify or 0:8.3f} ms")
    if best:
        summary = {}
        for key, graph in (("decode_step", ("step", "total")), ("nextn_step", ("nextn", "total")),
                           ("nextn_verify", ("nextn", "verify")),
                           ("decode_step" + GREEDY_SUFFIX, ("step" + GREEDY_SUFFIX, "total")),
                           ("nextn_step" + GREEDY_SUFFIX, ("nextn" + GREEDY_SUFFIX, "total")),
                           ("nextn_verify" + GREEDY_SUFFIX, ("nextn" + GREEDY_SUFFIX, "verify" + GREEDY_SUFFIX)),
                           ("nextn_step" + SAMPLED_SUFFIX, ("nextn" + SAMPLED_SUFFIX, "total")),
                           ("nextn_verify" + SAMPLED_SUFFIX, ("nextn" + SAMPLED_SUFFIX, "verify")),
                           ("nextn_step" + NUCLEUS_SUFFIX, ("nextn" + NUCLEUS_SUFFIX, "total")),
                           ("nextn_step" + PLAIN_REQUEST_SUFFIX, ("nextn" + PLAIN_REQUEST_SUFFIX, "total")),
                           ("nextn_step" + PLAIN_SUFFIX, ("nextn" + PLAIN_SUFFIX, "total"))):
            sec, g = graph
            if sec in best and "floor_ms" in best[sec]:
                summary[key] = {"time_ms": best[sec]["ms"][g], "floor_ms": best[sec]["floor_ms"][g],
                                "floor_ratio": best[sec]["floor_ratio"][g]}
        for peer, times in (result.get("peers") or {}).items():
            if not isinstance(times, dict):
                continue
            for key in ("decode_step", "nextn_step"):
                for ours in (key, key + GREEDY_SUFFIX):
                    if ours in summary and times.get(key + "_ms"):
                        summary[ours][f"speedup_vs_{peer}"] = times[key + "_ms"] / summary[ours]["time_ms"]
        result["summary"] = summary
        table.append(json.dumps(summary, indent=1))
    print("\n".join(table), flush=True)


if __name__ == "__main__":
    main()
