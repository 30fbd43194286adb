"""How the pair grid's MoE GEMMs grow with the experts they read: what a launch costs beyond streaming its weights.

verify's MoE layers run moe_up_act_pairs and moe_down_pairs (kernels/moe.py's pair grid) on 6 tokens; in the H200 step
they stream at ~3.7 TB/s against a 4.2 TB/s copy (bench/results/launches-kda-tma-h200-20261204.json), the largest
share of verify's time over its floor. Is that a lower streaming rate, or a fixed cost a launch pays (the wait, the
ids' round trip, the pipeline's fill, the last wave's tail)? This times both kernels at Ling-3.0-tiny's shapes (h 1536,
I 512, 128 experts, top-8, bf16) for routings with exactly d distinct experts (token t's pick j is expert
S[(8t + j) % d] of a random set S of d: 8 distinct picks a token for d >= 8, every expert of S read), d from 8 to 48
at 6 tokens and 64 to 128 at 16 (the pair grid's largest), and fits time = a + bytes / bw by least squares over the
points (bytes: d experts' weights). `a` is the fixed cost, `bw` the streaming rate; the HBM copy bandwidth is
measured in the same process (bench/timing.py). Cold weights: COPIES copies of each stack alternate over the calls,
each call with its own set S; times are CUDA-graph replay medians of the calls, PDL-launched as in the step.

`--linear` adds the dense skinny GEMM (kernels/linear.py, lingc.linear) over the same bytes, the first d experts' w13
rows as one [d * 2I, h] weight at 6 rows: the same streaming without the pair grid's ids prologue, its fixed cost the
yardstick for the MoE's. `--exits` times instead 8 experts at 1-16 tokens: the same bytes on a grid of 16 x (8 x
tokens) programs, of which all but the 128 whose pair is its expert's first exit after the ids prologue; time growing
with the tokens is what the exiting programs cost. `--up-configs` adds the up-GEMM's series under other tilings
(block_n, block_k, warps, stages, swap_ab; the default is kernels/moe.py's UP_PAIRS_CONFIG), each with its own fit:
which part of a launch a tiling moves. Timing only (a tiling with another block_k sums in another order). `--probe`
adds bench/moe_up_probe.py's three series (the production tile on working programs only: with the expert id loaded,
without it, and without the SwiGLU epilogue), each with its own fit: which part of the launch the ~2 us over the
dense GEMV is.

    python3 bench/kernel_moe_scaling.py [--json OUT] [--linear] [--probe] [--exits]
                                        [--up-configs 64,128,4,4,1;128,128,8,3,1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import cold_copies, graph_time_or_none, hbm_bandwidth_gbps  # noqa: E402

H, INTER, E, TOP_K = 1536, 512, 128, 8
CALLS = 16
COPIES = cold_copies(E * 2 * INTER * H * 2)
POINTS = [(6, d) for d in (8, 12, 16, 24, 32, 40, 48)] + [(16, d) for d in (64, 96, 128)]
EXIT_POINTS = [(t, TOP_K) for t in (1, 2, 4, 6, 8, 12, 16)]     # --exits: 8 experts, more and more pair rows


def routing(T: int, d: int, g: torch.Generator, dev: torch.device) -> torch.Tensor:
    """int32 [T, TOP_K] ids whose union is exactly d experts (d >= TOP_K, d <= T * TOP_K)."""
    chosen = torch.randperm(E, generator=g)[:d]
    slots = torch.arange(T * TOP_K).view(T, TOP_K) % d
    return chosen[slots].to(torch.int32).to(dev)


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys on xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - slope * mx, slope


def parse_configs(spec: str) -> list[tuple[int, int, int, int, bool]]:
    """'64,128,4,4,1;128,128,8,3,1' -> [(block_n, block_k, num_warps, num_stages, swap_ab), ...]."""
    out = []
    for item in filter(None, (x.strip() for x in spec.split(";"))):
        bn, bk, w, st, swap = (int(v) for v in item.split(","))
        out.append((bn, bk, w, st, bool(swap)))
    return out


def run(dev: torch.device, up_configs: list[tuple[int, int, int, int, bool]] = (), dense: bool = False,
        points: list[tuple[int, int]] = POINTS, probe: bool = False) -> dict:
    from lingc.kernels.linear import linear
    from lingc.kernels.moe import GemmConfig, interleave_w13, moe_down_pairs, moe_up_act_pairs
    g = torch.Generator(device="cpu").manual_seed(0)
    gd = torch.Generator(device=dev).manual_seed(0)
    w13 = [interleave_w13(torch.randn(E, 2 * INTER, H, device=dev, generator=gd).mul(0.02).to(torch.bfloat16))
           for _ in range(COPIES)]
    w2 = [torch.randn(E, H, INTER, device=dev, generator=gd).mul(0.02).to(torch.bfloat16) for _ in range(COPIES)]
    up_bytes, down_bytes = 2 * INTER * H * 2, H * INTER * 2
    rows = []
    for T, d in points:
        ids = [routing(T, d, g, dev) for _ in range(CALLS)]
        x = [torch.randn(T, H, device=dev, generator=gd).to(torch.bfloat16) for _ in range(CALLS)]
        act = [moe_up_act_pairs(x[c], w13[c % COPIES], ids[c], 0.0, pdl=True) for c in range(CALLS)]
        up = graph_time_or_none([lambda c=c: moe_up_act_pairs(x[c], w13[c % COPIES], ids[c], 0.0, pdl=True)
                                 for c in range(CALLS)])
        down = graph_time_or_none([lambda c=c: moe_down_pairs(act[c], w2[c % COPIES], ids[c], pdl=True)
                                   for c in range(CALLS)])
        row = {"tokens": T, "experts": d, "up_us": up, "up_mb": d * up_bytes / 1e6, "down_us": down,
               "down_mb": d * down_bytes / 1e6}
        if dense:                 # the same bytes through the dense GEMV: w13 rows of experts 0 .. d-1, 6 rows of x
            row["linear_us"] = graph_time_or_none([
                lambda c=c: linear(x[c][:6], w13[c % COPIES].view(E * 2 * INTER, H)[:d * 2 * INTER], pdl=True)
                for c in range(CALLS)])
            row["linear_mb"] = row["up_mb"]
        if probe:                 # the production tile on working programs only (bench/moe_up_probe.py)
            row.update(probe_series(x, w13, d, g, dev, row["up_mb"]))
        for cfg in up_configs:
            key = "up_" + "_".join(str(int(v)) for v in cfg)
            config = GemmConfig(*cfg)
            row[f"{key}_us"] = graph_time_or_none([
                lambda c=c: moe_up_act_pairs(x[c], w13[c % COPIES], ids[c], 0.0, pdl=True, config=config)
                for c in range(CALLS)])
            row[f"{key}_mb"] = row["up_mb"]
        for k in [key[:-3] for key in row if key.endswith("_us")]:
            if row[f"{k}_us"]:
                row[f"{k}_gbps"] = row[f"{k}_mb"] * 1e3 / row[f"{k}_us"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    fits = {}
    if len({r["experts"] for r in rows}) < 3:      # --exits: one byte count, no line to fit
        return {"rows": rows, "fits": fits}
    for k in [key[:-3] for key in rows[0] if key.endswith("_us")]:
        pts = [(r[f"{k}_mb"], r[f"{k}_us"]) for r in rows if r[f"{k}_us"]]
        if len(pts) >= 3:
            a, slope = fit([p[0] for p in pts], [p[1] for p in pts])
            worst = max(abs(y - (a + slope * x)) for x, y in pts)
            fits[k] = {"fixed_us": a, "stream_gbps": 1e3 / slope, "max_residual_us": worst}
    return {"rows": rows, "fits": fits}


def probe_series(x: list[torch.Tensor], w13: list[torch.Tensor], d: int, g: torch.Generator, dev: torch.device,
                 mb: float) -> dict:
    """probe_ids / probe / probe_plain times for d experts: a contiguous set base .. base + d - 1 a call (base drawn
    per call), the copies rotated as for the production series."""
    from moe_up_probe import up_probe
    bases = [int(torch.randint(0, E - d + 1, (1,), generator=g)) for _ in range(CALLS)]
    experts = [torch.arange(b, b + d, dtype=torch.int32, device=dev) for b in bases]
    out = {}
    for key, ids, swiglu in (("probe_ids", True, True), ("probe", False, True), ("probe_plain", False, False)):
        out[f"{key}_us"] = graph_time_or_none([
            lambda c=c: up_probe(x[c], w13[c % COPIES], experts[c], bases[c], ids=ids, swiglu=swiglu, pdl=True)
            for c in range(CALLS)])
        out[f"{key}_mb"] = mb
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--up-configs", default="", help="other up-GEMM tilings: bn,bk,warps,stages,swap;...")
    ap.add_argument("--linear", action="store_true", help="also the dense skinny GEMM over the same bytes")
    ap.add_argument("--exits", action="store_true",
                    help="8 experts at 1-16 tokens instead (what exiting programs cost)")
    ap.add_argument("--probe", action="store_true",
                    help="also the production tile without the ids prologue / the id load / the SwiGLU epilogue")
    args = ap.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    result = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
              "commit": os.environ.get("LINGC_COMMIT") or subprocess.run(
                  ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or None,
              "command": "python3 bench/kernel_moe_scaling.py " + " ".join(sys.argv[1:]),
              "hbm_bandwidth_gbps": hbm_bandwidth_gbps(), **run(dev, parse_configs(args.up_configs), args.linear,
                                                        EXIT_POINTS if args.exits else POINTS, args.probe)}
    print(json.dumps({"fits": result["fits"], "hbm_bandwidth_gbps": result["hbm_bandwidth_gbps"]}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
