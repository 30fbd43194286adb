"""Check and time kernels/norm_router_cluster.py: the MoE router front (residual add + RMSNorm, the gate GEMV and the
router) in one thread-block cluster a row, the logits handed to one CTA through distributed shared memory.

kernels/norm_router.py (fuse_norm_router, opt-in) already does the three in one launch, but its programs hand the
logits on through L2 with a ticket: on the H200 3.87 us against 3.82 for the two kernels it replaces, level in the
step (docs/measurements.md). The cluster kernel's layout and numerics are in its module docstring; this script runs
it at each --cluster size (CTAs a row: E / CLUSTER gate rows each).

Checked against kernels/norm_router.py's two-kernel path (the step's kernels: add_rmsnorm_linear's GEMV into fp32
logits, then router_align / router_topk) as bench/kernel_norm_router.py checks its own fused kernel: new_residual
bit-equal, normed within a bf16 ulp, the same expert ids with weights within 1e-5 (other fp32 sums may move a
near-tie: counted), the align outputs equal where the ids are. Timed the same way (CUDA-graph medians over cold
copies, PDL on) against the two kernels and the ticket kernel.

    python3 bench/kernel_cluster_router.py [--cluster 16] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_norm_router import E, H, SEEDS, _args, _inputs, compare  # noqa: E402
from timing import cold_copies, graph_time_us  # noqa: E402


class ClusterRouter:
    """kernels/norm_router_cluster.py's launch at a given cluster size (its CLUSTER knob, set for each call)."""

    def __init__(self, cluster: int) -> None:
        self.cluster = cluster

    def __call__(self, *args, pdl: bool = True):
        from lingc.kernels import norm_router_cluster as NC
        saved, NC.CLUSTER = NC.CLUSTER, self.cluster
        try:
            out = NC.add_rmsnorm_router(*args, pdl)
        finally:
            NC.CLUSTER = saved
        if out is None:
            raise RuntimeError(NC.FAILED[0] if NC.FAILED else "the cluster kernel did not run")
        return out


def check(router: ClusterRouter, rows: int, dev: torch.device) -> dict:
    from lingc.kernels import norm_router as NR
    row = {"rows": rows, "form": "router_align" if rows == 1 else "router_topk", "seeds": SEEDS,
           "id_mismatch_rows": 0, "weights_max_abs_err": 0.0, "normed_max_abs_err": 0.0, "residual_bit_equal": True,
           "align_equal": True, "deterministic": True, "row_invariant": True}
    for seed in range(SEEDS):
        args = _args(_inputs(rows, seed, dev), rows)
        got = router(*args)
        enabled, NR.ENABLED = NR.ENABLED, False
        try:
            want = NR.add_rmsnorm_router(*args, pdl=True)                    # the step's two kernels
        finally:
            NR.ENABLED = enabled
        same = compare(row, got, want)
        if rows == 1 and bool(same.all()):
            row["align_equal"] &= all(torch.equal(a, b) for a, b in zip(got[4:], want[4:]))
        again = router(*args)
        row["deterministic"] &= all(torch.equal(a, b) for a, b in zip(got, again))
        if rows > 1:
            res, x = args[0], args[1]
            for r in range(rows):
                one = router(res[:, r:r + 1].contiguous(), x[:, r:r + 1].contiguous(), *args[2:])
                row["row_invariant"] &= torch.equal(one[0][0, 0], got[0][0, r]) and \
                    torch.equal(one[2][0], got[2][r]) and torch.equal(one[3][0], got[3][r])
    row["ok"] = bool(row["residual_bit_equal"] and row["normed_max_abs_err"] <= 0.0625 and row["deterministic"]
                     and row["row_invariant"] and row["align_equal"] and row["weights_max_abs_err"] <= 1e-5
                     and row["id_mismatch_rows"] <= rows * SEEDS // 4)
    return row


def time_rows(router: ClusterRouter, rows: int, dev: torch.device) -> dict:
    from lingc.kernels import norm_router as NR
    per_copy = E * H * 2 + 2 * rows * H * 2
    copies = [_args(_inputs(rows, 100 + c, dev), rows) for c in range(cold_copies(per_copy, maximum=64))]
    out = {"copies": len(copies)}
    out["cluster_time_us"] = graph_time_us([lambda a=a: router(*a) for a in copies])
    out["ticket_time_us"] = graph_time_us([lambda a=a: NR.add_rmsnorm_router(*a, pdl=True) for a in copies])
    enabled, NR.ENABLED = NR.ENABLED, False
    try:
        out["two_kernels_time_us"] = graph_time_us([lambda a=a: NR.add_rmsnorm_router(*a, pdl=True) for a in copies])
    finally:
        NR.ENABLED = enabled
    out["cluster_time_us_repeat"] = graph_time_us([lambda a=a: router(*a) for a in copies])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cluster", default="16,8", help="CTAs a row's cluster (E / CLUSTER gate rows each)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import lingc  # noqa: F401  (registers torch.ops.lingc.*)
    dev = torch.device("cuda")
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
              "commit": os.environ.get("LINGC_COMMIT", "unknown"),
              "command": "python3 bench/kernel_cluster_router.py " + " ".join(sys.argv[1:]), "rows": []}
    for cluster in (int(c) for c in args.cluster.split(",")):
        for rows in (1, 6):
            try:
                router = ClusterRouter(cluster)
                row = {"cluster": cluster, **check(router, rows, dev)}
                row.update(time_rows(router, rows, dev))
            except RuntimeError as err:      # a compile or launch failure: say so and go on with the next size
                result["rows"].append({"cluster": cluster, "rows": rows, "ok": False, "error": str(err)})
                print(f"cluster {cluster:2d} rows {rows}: {err}", flush=True)
                continue
            result["rows"].append(row)
            print(f"cluster {cluster:2d} rows {rows} {row['form']:12} cluster {row['cluster_time_us']:6.2f} / "
                  f"{row['cluster_time_us_repeat']:6.2f} us, ticket {row['ticket_time_us']:6.2f}, two kernels "
                  f"{row['two_kernels_time_us']:6.2f} | ids mismatch {row['id_mismatch_rows']} w err "
                  f"{row['weights_max_abs_err']:.2g} normed err {row['normed_max_abs_err']:.2g} "
                  f"{'ok' if row['ok'] else 'FAIL ' + json.dumps(row)}", flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
