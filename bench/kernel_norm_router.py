"""GPU check and timing of add_rmsnorm_router's fused kernel (kernels/norm_router.py) against the two kernels it
replaces (add_rmsnorm_linear's GEMV into fp32 logits, then router_align / router_topk), at Ling-3.0-tiny's router
shapes: h = 1536, E = 128 routed experts in 8 groups (4 kept), top 8, one fused shared expert, bf16 activations and
gate (bf16_router), block_m 16; rows 1 (decode, the router_align form) and 6 (verify, the router_topk form).

Checks per row count (random inputs, several seeds):
    new_residual bit-equal to the two kernels' (one fp32 add either way); normed within one bf16 ulp of theirs
    (`normed_max_abs_err`, `normed_bit_equal`); the routing: the same expert id sets and weights within 1e-5
    (`same_ids`, `weights_max_abs_err`) or the seeds where a near-tie picks another expert (`id_mismatch_rows`:
    the logits are another fp32 sum); the align outputs consistent with moe_align of the fused kernel's own ids
    (`align_consistent`); row invariance (each row alone == all rows, bit for bit); two launches equal
    (deterministic); PDL on == off.
Timing: CUDA-graph replay medians (bench/timing.py graph_time_us) of the fused launch and of the two kernels, PDL on,
over copies of the inputs (the gate weight is 0.4 MB: the copies keep it cold, bench/timing.py cold_copies).

    python3 bench/kernel_norm_router.py --json $OUT/norm-router.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import cold_copies, graph_time_us  # noqa: E402

H, E, N_GROUP, TOPK_GROUP, TOP_K, SCALE, SHARED, BLOCK_M, EPS = 1536, 128, 8, 4, 8, 2.5, 1, 16, 1e-6
SEEDS = 4


def _inputs(rows: int, seed: int, dev: torch.device) -> tuple:
    g = torch.Generator(device=dev).manual_seed(seed)
    bf = dict(device=dev, dtype=torch.bfloat16)
    res = torch.randn(1, rows, H, generator=g, **bf)
    x = torch.randn(1, rows, H, generator=g, **bf)
    nw = 1 + 0.1 * torch.randn(H, generator=g, **bf)
    gate = 0.05 * torch.randn(E, H, generator=g, **bf)
    bias = 0.05 * torch.randn(E, generator=g, device=dev)
    return res, x, nw, gate, bias


def _args(inputs: tuple, rows: int) -> tuple:
    res, x, nw, gate, bias = inputs
    align = (E + SHARED, BLOCK_M) if rows == 1 else (0, 0)
    return (res, x, nw, EPS, gate, bias, N_GROUP, TOPK_GROUP, TOP_K, SCALE, *align, SHARED)


def compare(row: dict, got: tuple, want: tuple) -> torch.Tensor:
    """Fold one seed's add_rmsnorm_router outputs (normed, new_residual, weights, ids, ...) against the two kernels'
    into row's residual_bit_equal, normed_max_abs_err, id_mismatch_rows and weights_max_abs_err (rows whose id sets
    agree); returns which rows' id sets agree."""
    row["residual_bit_equal"] &= torch.equal(got[1], want[1])
    row["normed_max_abs_err"] = max(row["normed_max_abs_err"], (got[0].float() - want[0].float()).abs().max().item())
    ids, order = got[3].long().sort(-1)
    ids_ref, order_ref = want[3].long().sort(-1)
    same = (ids == ids_ref).all(-1)
    row["id_mismatch_rows"] += int((~same).sum())
    if same.any():
        w, w_ref = got[2].gather(1, order)[same], want[2].gather(1, order_ref)[same]
        row["weights_max_abs_err"] = max(row["weights_max_abs_err"], (w - w_ref).abs().max().item())
    return same


def check(rows: int, dev: torch.device) -> dict:
    from lingc.kernels import norm_router as NR
    from lingc.kernels.moe_align import moe_align

    row = {"rows": rows, "form": "router_align" if rows == 1 else "router_topk", "fused_runs": None, "seeds": SEEDS,
           "id_mismatch_rows": 0, "weights_max_abs_err": 0.0, "normed_max_abs_err": 0.0, "normed_bit_equal": True,
           "residual_bit_equal": True, "row_invariant": True, "deterministic": True, "pdl_equal": True,
           "align_consistent": True}
    for seed in range(SEEDS):
        args = _args(_inputs(rows, seed, dev), rows)
        row["fused_runs"] = NR.eligible(args[1], args[4], N_GROUP, TOPK_GROUP, TOP_K)
        got = NR.add_rmsnorm_router(*args, pdl=True)
        enabled, NR.ENABLED = NR.ENABLED, False
        try:
            want = NR.add_rmsnorm_router(*args, pdl=True)                         # the two kernels
        finally:
            NR.ENABLED = enabled
        compare(row, got, want)
        row["normed_bit_equal"] &= torch.equal(got[0], want[0])
        again = NR.add_rmsnorm_router(*args, pdl=True)
        row["deterministic"] &= all(torch.equal(a, b) for a, b in zip(got, again))
        row["pdl_equal"] &= all(torch.equal(a, b) for a, b in zip(got, NR.add_rmsnorm_router(*args)))
        if rows == 1:
            sp, be, tot = moe_align(got[3], E + SHARED, BLOCK_M)
            n = int(tot.item())
            row["align_consistent"] &= torch.equal(tot, got[6]) and torch.equal(sp[:n], got[4][:n]) \
                and torch.equal(be[:n // BLOCK_M], got[5][:n // BLOCK_M])
        else:
            res, x = args[0], args[1]
            for r in range(rows):
                one = NR.add_rmsnorm_router(res[:, r:r + 1], x[:, r:r + 1], *args[2:], pdl=True)
                row["row_invariant"] &= torch.equal(one[0][0, 0], got[0][0, r]) and torch.equal(one[2][0], got[2][r]) \
                    and torch.equal(one[3][0], got[3][r])
    row["ok"] = bool(row["residual_bit_equal"] and row["normed_max_abs_err"] <= 0.0625 and row["deterministic"]
                     and row["pdl_equal"] and row["row_invariant"] and row["align_consistent"]
                     and row["weights_max_abs_err"] <= 1e-5 and row["id_mismatch_rows"] <= rows * SEEDS // 4)
    return row


def time_rows(rows: int, dev: torch.device) -> dict:
    from lingc.kernels import norm_router as NR

    per_copy = E * H * 2 + 2 * rows * H * 2
    copies = [_args(_inputs(rows, 100 + c, dev), rows) for c in range(cold_copies(per_copy, maximum=64))]
    fused = graph_time_us([lambda a=a: NR.add_rmsnorm_router(*a, pdl=True) for a in copies])
    enabled, NR.ENABLED = NR.ENABLED, False
    try:
        two = graph_time_us([lambda a=a: NR.add_rmsnorm_router(*a, pdl=True) for a in copies])
    finally:
        NR.ENABLED = enabled
    return {"fused_time_us": fused, "two_kernels_time_us": two, "copies": len(copies)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="norm-router.json")
    args = ap.parse_args()
    import lingc  # noqa: F401
    import triton
    dev = torch.device("cuda")
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(), "commit": os.environ.get("LINGC_COMMIT", "unknown"),
              "command": " ".join(sys.argv), "rows": []}
    for rows in (1, 6):
        row = check(rows, dev)
        row.update(time_rows(rows, dev))
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    for r in result["rows"]:
        print(f"rows {r['rows']} {r['form']:12} fused {r['fused_time_us']:6.2f} us vs two kernels "
              f"{r['two_kernels_time_us']:6.2f} | ids mismatch {r['id_mismatch_rows']} w err "
              f"{r['weights_max_abs_err']:.2g} normed err {r['normed_max_abs_err']:.2g} "
              f"{'ok' if r['ok'] else 'FAIL'} (fused ran: {r['fused_runs']})")


if __name__ == "__main__":
    main()
