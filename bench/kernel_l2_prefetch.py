"""Does an L2 prefetch issued before an HBM-idle gap shorten the skinny linear that follows it? (kernels/l2_prefetch.py)

Per call, in one CUDA graph over cold weight copies:  [l2_prefetch(W_i) on a side stream, as the runtime launches
it] || sleep(gap) -> linear(x, W_i), against the same without the prefetch and the sleep alone. Reports the linear's
share (time - sleep alone) per gap for bulk (cp.async.bulk.prefetch) and per-line (prefetch.global.L2) prefetches of
the whole weight and of its first half, and the linear on a warm (L2-resident) weight for scale.

    python3 bench/kernel_l2_prefetch.py --json bench/results/kernel-l2-prefetch-h200-DATE.json
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

from lingc.kernels.l2_prefetch import l2_prefetch  # noqa: E402
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    side = torch.cuda.Stream(dev)
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        copies = cold_copies(n * k * 2)
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        out = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
        warm = graph_time_us([lambda w=ws[0]: linear(x, w, out=out)] * 8)
        cold = graph_time_us([lambda w=w: linear(x, w, out=out) for w in ws])
        print(f"{name} [{n}, {k}] {n * k * 2 / 1e6:.1f} MB: linear cold {cold:.2f} us, warm {warm:.2f} us")
        for gap in GAPS_US:
            cycles = int(gap * 1e3 * CLOCK_GHZ)

            def sleep():
                if cycles:
                    torch.cuda._sleep(cycles)
            t_sleep = graph_time_us([sleep for _ in ws]) if cycles else 0.0
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": commit(),
                       "command": "python3 bench/kernel_l2_prefetch.py " + " ".join(sys.argv[1:]), "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
