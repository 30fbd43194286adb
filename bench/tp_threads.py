"""Why TP2 and TP1 part: the TP ranks run as threads on ONE device, eagerly, and every router call is compared.

bench/device_tp.py found TP2's greedy tokens leaving TP1's after 2 tokens on the H200s, in bf16 and in fp32.
This script separates the candidate causes on one device, without NCCL, CUDA graphs or PDL:

  - every rank's Engine (the tp pass's rank programs) runs in its own thread, with CUDA graphs and PDL off;
    the collectives are replaced (a launch-list edit of this script only) by an in-process exchange that sums
    the partials in fp32 in rank order, i.e. exactly the reference all_reduce (lingc.ops.dist.fold_sum), the
    bits a gloo run gets. All ranks share one stream, so the exchange reads finished partials;
  - TP1 runs the program before the tp pass, eagerly too;
  - both record every router call (router_topk / router_align: its fp32 logits, the expert ids it chose) in
    launch order, so the first call where TP2 picks other experts than TP1 is found, with how far its router
    logits had moved and TP1's selection margins there (the k-th minus the (k+1)-th biased expert score within the
    eligible groups, and the same between the topk_group-th and the next group score).

If the tokens still part here, it is the TP arithmetic (row-parallel sums rounded per rank, a router near-tie
flipped), not NCCL / graphs / PDL / the runtime protocol; `--backend reference` tells the Triton kernels from
the torch reference ops at the sharded shapes.

    python3 bench/tp_threads.py --dtype fp32 --json $OUT/tp_threads_fp32.json        # one H200
    python3 bench/tp_threads.py --preset test-tiny --device cpu --tokens 6            # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

import torch

ROUTERS = ("router_topk", "router_align")
PROMPT_TOKENS = 40


class Exchange:
    """The collectives of N rank threads: each rank posts its operand, all meet, each computes the result."""

    def __init__(self, n: int, timeout_s: float):
        self.parts: list = [None] * n
        self.meet = threading.Barrier(n, timeout=timeout_s)

    def _swap(self, rank: int, x: torch.Tensor, combine) -> torch.Tensor:
        self.parts[rank] = x
        self.meet.wait()
        out = combine(list(self.parts))
        self.meet.wait()                        # nobody posts the next operand before everyone has combined
        return out

    def all_reduce(self, rank: int, x: torch.Tensor, world_size: int, **_) -> torch.Tensor:
        from lingc.ops.dist import fold_sum
        return self._swap(rank, x, lambda parts: fold_sum(parts, x.dtype))

    def all_gather(self, rank: int, x: torch.Tensor, dim: int, world_size: int, **_) -> torch.Tensor:
        return self._swap(rank, x, lambda parts: torch.cat(parts, dim=dim))

    def fused(self, norm):
        """all_reduce_add_rmsnorm for a rank: the exchange's sum, then `norm` (the backend's add_rmsnorm)."""
        def run(rank: int, residual, x, weight, eps, world_size, **_):
            return norm(residual, self.all_reduce(rank, x, world_size), weight, eps)
        return run


def _op(label: str) -> str:
    return label.split(":", 1)[-1].rsplit(".", 1)[-1]


def instrument(engine, rank: int | None, exchange: Exchange | None, record: list) -> dict[str, int]:
    """Swap the engine's collectives for the exchange; record every router call. Returns the launches swapped, by op."""
    from lingc.ops import OPS
    from lingc.runtime.executor import kernel_for
    swapped: dict[str, int] = {}
    norm = kernel_for(OPS.add_rmsnorm, engine.exe.backend)[0]          # the fused op's add + norm, this backend
    for graph, low in engine.exe.lowered.items():
        for launch in low.launches:
            op = _op(launch.label)
            if op in ("all_reduce", "all_gather") and exchange is not None:
                launch.fn = partial(getattr(exchange, op), rank)
                swapped[op] = swapped.get(op, 0) + 1
            elif op == "all_reduce_add_rmsnorm" and exchange is not None:
                launch.fn = partial(exchange.fused(norm), rank)
                swapped[op] = swapped.get(op, 0) + 1
            elif op in ROUTERS:
                launch.fn = _recording(launch.fn, graph, record)
    return swapped


def _recording(fn, graph: str, record: list):
    def run(*args, **kwargs):
        out = fn(*args, **kwargs)
        logits, bias, top_k = args[0], args[1], args[4]
        record.append({"graph": graph, "logits": logits.float().cpu().clone(), "bias": bias.float().cpu(),
                       "ids": out[1][:, :top_k].cpu().clone(), "n_group": args[2], "topk_group": args[3],
                       "top_k": top_k})
        return out
    return run


def margins(rec: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, TP1's two selection margins: the k-th minus the (k+1)-th biased score among the experts of the
    eligible groups, and the topk_group-th minus the next group score (a group's score: its two best biased
    scores). A flip needs a perturbation of about the smaller one."""
    x = rec["logits"]
    N, E = x.shape
    biased = torch.sigmoid(x) + rec["bias"]
    group_scores = biased.view(N, rec["n_group"], -1).topk(2, dim=-1).values.sum(-1)
    ranked = group_scores.sort(dim=-1, descending=True).values
    group_margin = (ranked[:, rec["topk_group"] - 1] - ranked[:, rec["topk_group"]]
                    if rec["topk_group"] < rec["n_group"] else torch.full((N,), float("inf")))
    keep = group_scores.topk(rec["topk_group"], dim=-1).indices
    mask = torch.zeros(N, rec["n_group"]).scatter_(1, keep, 1.0).repeat_interleave(E // rec["n_group"], dim=1)
    top = biased.masked_fill(mask == 0, float("-inf")).topk(rec["top_k"] + 1, dim=-1).values
    return top[:, -2] - top[:, -1], group_margin


def first_router_difference(tp1: list, tp2: list) -> dict | None:
    """The first router call where TP2 chose other experts than TP1 (same call order while the tokens agree)."""
    for i, (a, b) in enumerate(zip(tp1, tp2)):
        if a["logits"].shape != b["logits"].shape:
            return {"call": i, "note": "the runs took different graphs here (tokens already parted)"}
        same = torch.equal(a["ids"].sort(-1).values, b["ids"].sort(-1).values)
        if not same:
            rows = (a["ids"].sort(-1).values != b["ids"].sort(-1).values).any(-1).nonzero().flatten().tolist()
            m, gm = margins(a)
            every = [margins(r) for r in tp1[:i + 1]]
            return {"call": i, "graph": a["graph"], "rows": rows,
                    "router_logits_max_abs_delta": float((a["logits"] - b["logits"]).abs().max()),
                    "router_logits_max_abs": float(a["logits"].abs().max()),
                    "tp1_expert_margin_at_rows": [float(m[r]) for r in rows],
                    "tp1_group_margin_at_rows": [float(gm[r]) for r in rows],
                    "tp1_median_expert_margin_all_calls": float(torch.cat([e for e, _ in every]).median()),
                    "tp1_median_group_margin_all_calls": float(torch.cat([g for _, g in every]).median()),
                    "calls_before_with_same_ids": i}
    return None


def drift(tp1: list, tp2: list, upto: int) -> list[float]:
    """Max |delta| of the router logits, call by call, over the first `upto` calls (where the ids still agree)."""
    return [float((a["logits"] - b["logits"]).abs().max()) for a, b in list(zip(tp1, tp2))[:upto]
            if a["logits"].shape == b["logits"].shape]


def build(args, device: torch.device):
    from lingc.init import random_model
    from lingc.passes.manager import CompileResult, PassManager
    from lingc.passes.tp import rank_programs, run_tp_stage
    from lingc.presets import preset
    from lingc.trace import PROGRAMS, TraceOptions, trace

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    over = {"num_hidden_layers": args.layers} if args.layers else {}
    config = preset(args.preset, num_nextn_predict_layers=1, **over)
    model = random_model(config, seed=0, dtype=dtype, device=device)
    options = TraceOptions(batch=1, prefill_tokens=64, max_len=-(-(PROMPT_TOKENS + 4 * args.tokens + 64) // 64) * 64, page_size=16,
                           request_slots=1, draft_tokens=6)
    result = PassManager(args.passes.split(",")).run(trace(model, list(PROGRAMS), options))
    del model
    staged = CompileResult(result.program, list(result.stages))
    rank_weights = run_tp_stage(staged, args.tp)
    return config, result.program, rank_programs(staged.program, rank_weights)


def run_tp1(program, device, spec, backend, prompt, n) -> tuple[list[int], list]:
    from lingc.runtime.engine import Engine, Request
    record: list = []
    engine = Engine(program, str(device), spec, backend=backend, cuda_graphs=False, pdl=False)
    instrument(engine, None, None, record)
    tokens = engine.generate(Request(prompt, n, ignore_eos=True)).tokens
    return tokens, record


def run_threads(programs, device, spec, backend, prompt, n, timeout_s) -> tuple[list[int], list, dict]:
    """Every rank's Engine in its own thread over one device; rank 0's tokens, router record and swapped launches."""
    from lingc.runtime.engine import Engine, Request
    exchange = Exchange(len(programs), timeout_s)
    results: list = [None] * len(programs)
    records: list = [[] for _ in programs]
    swapped: list = [{} for _ in programs]
    errors: list = []

    def rank(r: int) -> None:
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            engine = Engine(programs[r], str(device), spec, backend=backend, cuda_graphs=False, pdl=False)
            swapped[r] = instrument(engine, r, exchange, records[r])
            results[r] = engine.generate(Request(prompt, n, ignore_eos=True)).tokens
        except BaseException as e:            # noqa: BLE001 -- reported below; the barrier is broken for the others
            errors.append(f"rank {r}: {type(e).__name__}: {e}")
            exchange.meet.abort()

    threads = [threading.Thread(target=rank, args=(r,), name=f"rank{r}") for r in range(len(programs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError("; ".join(errors))
    if any(res != results[0] for res in results[1:]):
        raise RuntimeError(f"the rank threads disagree on the tokens: {results}")
    return results[0], records[0], swapped[0]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="ling-3.0-tiny")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--passes", default="all")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--backends", default=None, help="comma list (default: triton on cuda, reference on cpu)")
    ap.add_argument("--specs", default="none,nextn")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a rank waits for the others")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)        # set_device (also in the rank threads) wants an index
        torch.cuda.set_device(device)
    backends = (args.backends or ("triton" if device.type == "cuda" else "reference")).split(",")
    t0 = time.perf_counter()
    config, tp1, ranks = build(args, device)
    prompt = [(7 * i + 3) % config.vocab_size for i in range(PROMPT_TOKENS)]
    out = {"command": " ".join(["bench/tp_threads.py"] + (argv if argv is not None else sys.argv[1:])),
           "commit": _commit(), "torch": torch.__version__, "python": platform.python_version(),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "config": vars(args), "build_s": time.perf_counter() - t0, "runs": {}}
    for backend in backends:
        for spec in args.specs.split(","):
            t1 = time.perf_counter()
            a, rec1 = run_tp1(tp1, device, spec, backend, prompt, args.tokens)
            b, rec2, swapped = run_threads(ranks, device, spec, backend, prompt, args.tokens, args.timeout)
            i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
            first = first_router_difference(rec1, rec2)
            upto = first["call"] if first else len(rec1)
            d = drift(rec1, rec2, upto)
            run = {"tp1": a, "tp2_threads": b, "equal": a == b, "first_token_divergence": i,
                   "router_calls": len(rec1), "first_router_difference": first, "collectives_swapped": swapped,
                   "router_logit_drift_before_it": {"max": max(d, default=0.0),
                                                    "median": sorted(d)[len(d) // 2] if d else 0.0},
                   "seconds": time.perf_counter() - t1}
            out["runs"][f"{backend}/{spec}"] = run
            print(f"{backend}/{spec}: equal={a == b} first token divergence={i} "
                  f"first router difference={json.dumps(first)}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


def _commit() -> str:
    import os
    if os.environ.get("LINGC_COMMIT"):
        return os.environ["LINGC_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
