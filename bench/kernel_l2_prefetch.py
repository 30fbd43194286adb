"""Does an L2 prefetch issued before an HBM-idle gap shorten the skinny linear that follows it? (kernels/l2_prefetch.py)

Per call, in one CUDA graph over cold weight copies:  [l2_prefetch(W_i) on a side stream, as the runtime launches
it] || sleep(gap) -> linear(x, W_i), against the same without the prefetch and the sleep alone. Reports the linear's
share (time - sleep alone) per gap for bulk (cp.async.bulk.prefetch) and per-line (prefetch.global.L2) prefetches of
the whole weight and of its first half, and the linear on a warm (L2-resident) weight for scale.

--moe: the same question for the routed experts (l2_prefetch_experts, prefetch_weights' EXPERTS knob): the decode
up-GEMM (moe_up_act, 8 picks of 128 experts, h 1536, I 512, block_m 16; 16 routings that partition the experts, over
two weight stacks) after [l2_prefetch_experts(w13, ids) on a side stream] || sleep(gap), forked right after the align
as the runtime forks after the router, and with the GEMM's own post-wait tile prefetch (kernels/moe.py
UP_TILE_PREFETCH), against neither; gap 0 is the step's case (the hint starts with the GEMM).

    python3 bench/kernel_l2_prefetch.py --json bench/results/kernel-l2-prefetch-h200-DATE.json
    python3 bench/kernel_l2_prefetch.py --moe --json bench/results/kernel-l2-prefetch-experts-h200-DATE.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from timing import cold_copies, graph_time_us  # noqa: E402

from lingc.kernels.l2_prefetch import l2_prefetch, l2_prefetch_experts  # noqa: E402
from lingc.kernels.linear import linear  # noqa: E402

SHAPES = {"kda_qkvfbg": (10256, 1536), "o_proj": (1536, 2048), "mla_q_a_kv_a_g": (848, 1536)}
GAPS_US = (0.0, 2.0, 4.0, 8.0)
CLOCK_GHZ = 1.98     # torch.cuda._sleep counts SM cycles


def commit() -> str:
    env = os.environ.get("LINGC_COMMIT")
    if env:
        return env
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def sleeper(gap_us: float, calls: int):
    """(a call that keeps the SMs' stream busy for gap_us with torch.cuda._sleep, its time a call in a graph of
    `calls` of them: the HBM-idle gap the hint may fill)."""
    cycles = int(gap_us * 1e3 * CLOCK_GHZ)

    def sleep() -> None:
        if cycles:
            torch.cuda._sleep(cycles)
    return sleep, (graph_time_us([sleep] * calls) if cycles else 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--moe", action="store_true", help="the routed experts' prefetch before the decode up-GEMM")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    side = torch.cuda.Stream(dev)
    for name in ([] if args.moe else args.shapes.split(",")):
        n, k = SHAPES[name]
        copies = cold_copies(n * k * 2)
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        out = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
        warm = graph_time_us([lambda w=ws[0]: linear(x, w, out=out)] * 8)
        cold = graph_time_us([lambda w=w: linear(x, w, out=out) for w in ws])
        print(f"{name} [{n}, {k}] {n * k * 2 / 1e6:.1f} MB: linear cold {cold:.2f} us, warm {warm:.2f} us")
        for gap in GAPS_US:
            sleep, t_sleep = sleeper(gap, len(ws))
            row = {"shape": name, "n": n, "k": k, "gap_us": gap, "sleep_us": t_sleep, "linear_cold_us": cold,
                   "linear_warm_us": warm}
            variants = {"none": None, "bulk": dict(bulk=True), "line": dict(bulk=False),
                        "bulk_half": dict(bulk=True, nbytes=n * k)}
            for label, kw in variants.items():
                def call(w, kw=kw):
                    if kw is not None:         # as the runtime launches a hint: a side stream, forked here
                        main = torch.cuda.current_stream()
                        side.wait_stream(main)
                        with torch.cuda.stream(side):
                            l2_prefetch(w, **kw)
                    sleep()
                    linear(x, w, out=out)
                    if kw is not None:
                        torch.cuda.current_stream().wait_stream(side)
                t = graph_time_us([lambda w=w: call(w) for w in ws])
                row[f"{label}_us"] = t
                row[f"{label}_linear_share_us"] = t - t_sleep
            print(f"  gap {gap:4.1f} us (sleep {t_sleep:5.2f}): linear share none {row['none_linear_share_us']:5.2f}"
                  f"  bulk {row['bulk_linear_share_us']:5.2f}  line {row['line_linear_share_us']:5.2f}"
                  f"  bulk_half {row['bulk_half_linear_share_us']:5.2f}")
            rows.append(row)
        del ws
        torch.cuda.empty_cache()
    if args.moe:
        rows += experts_rows(dev, side)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": commit(),
                       "command": "python3 bench/kernel_l2_prefetch.py " + " ".join(sys.argv[1:]), "rows": rows},
                      f, indent=1)


def experts_rows(dev: torch.device, side: torch.cuda.Stream) -> list[dict]:
    """The --moe rows (module docstring): moe_up_act's share of each call per gap, with and without the hint."""
    import lingc.kernels.moe as moe
    from lingc.kernels.moe import moe_up_act
    from lingc.kernels.moe_align import moe_align

    h, inter, experts, top_k, block_m, calls = 1536, 512, 128, 8, 16, 16
    g = torch.Generator(device=dev).manual_seed(0)
    stacks = [torch.randn(experts, 2 * inter, h, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
              for _ in range(2)]
    perm = torch.randperm(experts, device=dev, generator=g).to(torch.int32)
    ids = [perm[c * top_k:(c + 1) * top_k].reshape(1, top_k).contiguous() for c in range(calls)]
    align = [moe_align(i, experts, block_m) for i in ids]
    x = torch.randn(1, h, device=dev, dtype=torch.bfloat16, generator=g)
    out = torch.empty(top_k, inter, device=dev, dtype=torch.bfloat16)
    work = [(stacks[c % 2], ids[c], align[c]) for c in range(calls)]
    warm = graph_time_us([lambda: moe_up_act(x, stacks[0], *align[0], top_k, block_m, 0.0, pdl=True, out=out)] * 8)
    cold = graph_time_us([lambda w=w, a=a: moe_up_act(x, w, *a, top_k, block_m, 0.0, pdl=True, out=out)
                          for w, _, a in work])
    mb = top_k * 2 * inter * h * 2 / 1e6
    print(f"moe_up_act decode ({top_k} experts, {mb:.1f} MB): cold {cold:.2f} us, warm {warm:.2f} us")
    rows = []
    for gap in GAPS_US:
        sleep, t_sleep = sleeper(gap, len(work))
        row = {"shape": "moe_up_act_decode", "experts": top_k, "mb": mb, "gap_us": gap, "sleep_us": t_sleep,
               "up_cold_us": cold, "up_warm_us": warm}
        for label, hint, tile in (("none", False, False), ("experts", True, False), ("tile", False, True)):
            moe.UP_TILE_PREFETCH = tile        # the GEMM's own post-wait tile prefetch (kernels/moe.py)

            def call(w, i, a, hint=hint):
                if hint:                       # as the runtime launches it: a side stream forked after the router
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        l2_prefetch_experts(w, i)
                sleep()
                moe_up_act(x, w, *a, top_k, block_m, 0.0, pdl=True, out=out)
                if hint:
                    torch.cuda.current_stream().wait_stream(side)
            t = graph_time_us([lambda w=w, i=i, a=a: call(w, i, a) for w, i, a in work])
            moe.UP_TILE_PREFETCH = False
            row[f"{label}_us"] = t
            row[f"{label}_up_share_us"] = t - t_sleep
        print(f"  gap {gap:4.1f} us (sleep {t_sleep:5.2f}): up share none {row['none_up_share_us']:5.2f}"
              f"  experts {row['experts_up_share_us']:5.2f}  tile {row['tile_up_share_us']:5.2f}")
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
