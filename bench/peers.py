"""Peers for the step benchmark, each in its own process (memory isolation, a hard time limit):

    torch_compile_decode / torch_compile_nextn (reported together as torch_compile)
                   lingc's reference model running its own decode_step / nextn_step (lingc/steps.py, the functions
                   lingc traces) under torch.compile(mode="max-autotune"), which captures CUDA graphs
    torch_compile_reduce_overhead
                   both steps under torch.compile(mode="reduce-overhead") (CUDA graphs, no autotuning): a second
                   torch.compile point that compiles in far less time than max-autotune
    transformers   transformers' BailingHybridForCausalLM, eager, decode with its cache. transformers 5.23 has no
                   q-LoRA and no MTP (shared/docs/architecture.md), so this peer runs Ling-3.0-tiny with a single
                   q_proj (q_lora_rank None: 9.4 MB more per MLA layer) and times the plain decode step only

All use the same context as bench/device_step.py (8192 tokens). Run by device_step.py --peers, or alone:
    python3 bench/peers.py torch_compile_decode --json out.json
Several peer processes may share one GPU: each compiles on its own, but times its steps only while holding
an exclusive lock (TIMING_LOCK), so no two peers time at once. A peer that runs past PEER_DUMP_S seconds
(environment) prints every thread's stack to stderr, which says where a slow compile spends its time.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import fcntl
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import events_ms  # noqa: E402

DRAFT_TOKENS = 6
TIMING_LOCK = os.path.join(tempfile.gettempdir(), "lingc-peer-timing.lock")


@contextlib.contextmanager
def timing_lock():
    """Exclusive use of the GPU for timing, among peer processes that share it."""
    with open(TIMING_LOCK, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _cheap_operator_str() -> None:
    """torch 2.11's inductor formats every implicit fallback's arguments for a log line it does not print
    (`log.info(..., error.operator_str(target, args, kwargs))`; torch 2.13 passes a LazyString). Each argument's
    text is the whole IR feeding it, so with lingc's ~600 custom ops per 24-layer step the formatting alone ran
    past 500 s on the H200 (a stack dump showed it). Only log and error text change: the target alone."""
    from torch._inductor import exc
    exc.OperatorIssue.operator_str = staticmethod(lambda target, args, kwargs: f"  target: {target}")


def torch_compile_peer(context: int, steps: tuple[str, ...] = ("decode_step", "nextn_step"),
                       mode: str = "max-autotune") -> dict:
    from lingc.init import random_model
    from lingc.presets import preset
    from lingc.state import ModelState
    from lingc.steps import decode_step, nextn_step
    from lingc.trace import TraceOptions, example_inputs, state_key

    config = preset("ling-3.0-tiny", num_nextn_predict_layers=1)
    model = random_model(config, seed=0, dtype=torch.bfloat16, device="cuda")
    options = TraceOptions(batch=1, prefill_tokens=64, max_len=context + 1024 + 128, page_size=16, request_slots=1,
                           draft_tokens=DRAFT_TOKENS)
    inputs = example_inputs(model, "nextn", options)
    g = torch.Generator(device="cuda").manual_seed(0)
    for k, t in inputs.items():
        if k.endswith("kv_pages"):
            t.copy_(torch.randn(t.shape, generator=g, device="cuda").to(t.dtype))
        elif k.endswith("recurrent"):
            t.copy_(0.02 * torch.randn(t.shape, generator=g, device="cuda"))

    class Step(torch.nn.Module):
        """The step with every state tensor a buffer, so the compiled graph sees static addresses."""

        def __init__(self, nextn: bool):
            super().__init__()
            self.model, self.nextn = model, nextn
            self.keys = list(inputs)
            for i, k in enumerate(self.keys):
                self.register_buffer(f"b{i}", inputs[k], persistent=False)

        def forward(self) -> None:
            named = {k: getattr(self, f"b{i}") for i, k in enumerate(self.keys)}
            state = ModelState({state_key(k): t for k, t in named.items() if k.startswith("state_")},
                               named["slots"], named["page_table"], options.page_size,
                               {state_key("state_" + k[len("staging_"):]): t for k, t in named.items()
                                if k.startswith("staging_")} if self.nextn else {})
            relay = {k[len("relay_"):]: v for k, v in named.items() if k.startswith("relay_")}
            if self.nextn:
                nextn_step(self.model, named["slots"], relay, state, DRAFT_TOKENS)
            else:
                decode_step(self.model, named["slots"], relay, state)

    def reset() -> None:
        inputs["relay_seq_len"][0] = context

    _cheap_operator_str()
    out: dict = {"mode": mode}
    for key, nextn in (("decode_step", False), ("nextn_step", True)):
        if key not in steps:
            continue
        print(f"compiling {key} ({mode})", flush=True)
        reset()
        step = torch.compile(Step(nextn), mode=mode)
        t0 = time.perf_counter()
        with torch.no_grad():
            step()
            torch.cuda.synchronize()
            out[key + "_compile_s"] = time.perf_counter() - t0
            print(f"{key} compiled in {out[key + '_compile_s']:.0f} s", flush=True)

            def run() -> None:
                reset()
                step()
            for _ in range(3):          # cudagraph trees record on the first calls after compiling
                run()
            torch.cuda.synchronize()
            with timing_lock():
                out[key + "_ms"] = events_ms(run)
                out[key + "_ms_repeat"] = events_ms(run)
            print(f"{key}: {out[key + '_ms']:.3f} ms", flush=True)
    from torch._dynamo.utils import counters
    out["cudagraph_skips"] = dict(counters["inductor"]).get("cudagraph_skips", 0)
    return out


def transformers_peer(context: int) -> dict:
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    from lingc.presets import preset

    config = preset("ling-3.0-tiny", q_lora_rank=None, num_nextn_predict_layers=0)
    tmp = tempfile.mkdtemp()
    config.to_json(os.path.join(tmp, "config.json"))
    hf_config = AutoConfig.from_pretrained(tmp)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16, attn_implementation="eager")
    model.eval()
    ids = torch.randint(0, config.vocab_size, (1, context), device="cuda")
    out: dict = {"transformers": transformers.__version__, "config": "ling-3.0-tiny with q_lora_rank None, no MTP"}
    with torch.no_grad():
        t0 = time.perf_counter()
        res = model(ids[:, :-1], use_cache=True)
        torch.cuda.synchronize()
        out["prefill_s"] = time.perf_counter() - t0
        cache = res.past_key_values
        tok = ids[:, -1:]
        times = []
        for _ in range(12):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            res = model(tok, past_key_values=cache, use_cache=True)
            tok = res.logits[:, -1:].argmax(-1)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
    out["decode_step_ms"] = statistics.median(times[2:])
    return out


def _timed_transformers(context: int) -> dict:
    with timing_lock():
        return transformers_peer(context)


PEERS = {"torch_compile_decode": lambda context: torch_compile_peer(context, ("decode_step",)),
         "torch_compile_nextn": lambda context: torch_compile_peer(context, ("nextn_step",)),
         "torch_compile_reduce_overhead": lambda context: torch_compile_peer(context, mode="reduce-overhead"),
         "torch_compile_reduce_overhead_decode": lambda context: torch_compile_peer(context, ("decode_step",),
                                                                                    mode="reduce-overhead"),
         "torch_compile_reduce_overhead_nextn": lambda context: torch_compile_peer(context, ("nextn_step",),
                                                                                   mode="reduce-overhead"),
         "transformers": _timed_transformers}


def run_peers(model, options, context: int, timeout_s: int = 420) -> dict:
    """Each peer in a subprocess (frees lingc's GPU memory first is the caller's job); errors are recorded."""
    results: dict = {}
    for name in ("torch_compile_decode", "torch_compile_nextn", "torch_compile_reduce_overhead", "transformers"):
        out = os.path.join(tempfile.mkdtemp(), f"{name}.json")
        cmd = [sys.executable, os.path.abspath(__file__), name, "--json", out, "--context", str(context)]
        env = dict(os.environ)
        extra = os.environ.get("PEER_TRANSFORMERS_PATH")       # where transformers 5.23 was unpacked
        if name == "transformers" and extra:
            env["PYTHONPATH"] = extra + os.pathsep + env.get("PYTHONPATH", "")
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
            if proc.returncode == 0:
                with open(out) as f:
                    results[name] = json.load(f)
            else:
                results[name] = {"error": proc.stderr[-2000:]}
        except subprocess.TimeoutExpired:
            results[name] = {"error": f"timed out after {timeout_s} s"}
        print(name, json.dumps(results[name])[:600], flush=True)
    compiled = {(k if k.startswith(("decode_step", "nextn_step")) else f"{name}_{k}"): v
                for name in ("torch_compile_decode", "torch_compile_nextn") for k, v in results.pop(name).items()}
    results["torch_compile"] = compiled      # decode_step_ms and nextn_step_ms, each compiled in its own process
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("peer", choices=sorted(PEERS))
    ap.add_argument("--json", required=True)
    ap.add_argument("--context", type=int, default=8192)
    args = ap.parse_args()
    if os.environ.get("PEER_DUMP_S"):
        faulthandler.dump_traceback_later(float(os.environ["PEER_DUMP_S"]), repeat=True)
    t0 = time.perf_counter()
    result = PEERS[args.peer](args.context)
    result["peer_wall_s"] = time.perf_counter() - t0
    with open(args.json, "w") as f:
        json.dump(result, f, default=str)


if __name__ == "__main__":
    main()
