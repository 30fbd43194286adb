"""GPU check of the Triton kernels written so far (RMSNorm family, moe_align): correctness vs the reference op, PDL on/off
bit-identity, and a first timing (CUDA events, median of many launches; norms read ~KB, so this is the
launch-bound regime, not a bandwidth benchmark).
    python3 bench/device_kernels.py --json $OUT/kernels.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys

import torch


def _time_us(fn, iters: int = 200) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", default="kernels.json")
    args = ap.parse_args()
    import lingc  # noqa: F401  (registers the reference ops)
    from lingc.kernels.rmsnorm import add_rmsnorm, add_rmsnorm_ref, pdl_supported, rmsnorm, rmsnorm_ref

    dev = torch.device("cuda")
    rows = []
    for (M, N) in ((1, 1536), (6, 1536), (1, 2560), (6, 2560), (1, 128)):
        x = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
        r = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
        w = (1 + 0.1 * torch.randn(N, device=dev)).to(torch.bfloat16)
        ref = rmsnorm_ref(x, w, 1e-6)
        out, out_pdl = rmsnorm(x, w, 1e-6), rmsnorm(x, w, 1e-6, pdl=True)
        res_ref, norm_ref = add_rmsnorm_ref(r, x, w, 1e-6)
        res, norm = add_rmsnorm(r, x, w, 1e-6)
        rows.append({
            "shape": [M, N],
            "rmsnorm_max_abs_err": (out.float() - ref.float()).abs().max().item(),
            "rmsnorm_bit_exact_vs_ref": bool(torch.equal(out, ref)),
            "pdl_on_equals_off": bool(torch.equal(out, out_pdl)),
            "add_rmsnorm_residual_bit_exact": bool(torch.equal(res, res_ref)),
            "add_rmsnorm_max_abs_err": (norm.float() - norm_ref.float()).abs().max().item(),
            "rmsnorm_triton_us": _time_us(lambda: rmsnorm(x, w, 1e-6)),
            "rmsnorm_reference_us": _time_us(lambda: rmsnorm_ref(x, w, 1e-6)),
            "add_rmsnorm_triton_us": _time_us(lambda: add_rmsnorm(r, x, w, 1e-6)),
            "add_rmsnorm_reference_us": _time_us(lambda: add_rmsnorm_ref(r, x, w, 1e-6)),
        })
    from lingc.kernels.moe_align import moe_align, moe_align_ref
    align_rows = []
    g = torch.Generator(device=dev).manual_seed(0)
    for (N, k, E, bm) in ((1, 8, 128, 16), (6, 9, 129, 16), (1, 9, 513, 16), (6, 9, 513, 16), (8, 8, 128, 4)):
        ids = torch.randint(0, E, (N, k), device=dev, generator=g, dtype=torch.int32)
        want = moe_align_ref(ids, E, bm)
        got, got_pdl = moe_align(ids, E, bm), moe_align(ids, E, bm, pdl=True)
        align_rows.append({"pairs": N * k, "experts": E, "block_m": bm,
                           "exact_vs_ref": all(torch.equal(a, b) for a, b in zip(got, want)),
                           "pdl_on_equals_off": all(torch.equal(a, b) for a, b in zip(got, got_pdl)),
                           "triton_us": _time_us(lambda: moe_align(ids, E, bm)),
                           "reference_us": _time_us(lambda: moe_align_ref(ids, E, bm))})
        print(json.dumps(align_rows[-1]))
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
              "pdl_supported": pdl_supported(dev), "commit": os.environ.get("LINGC_COMMIT", "unknown"),
              "command": " ".join(sys.argv), "rows": rows, "moe_align": align_rows,
              "note": "per-launch times without CUDA graphs (host launch overhead included); not the step benchmark"}
    for row in rows:
        print(json.dumps(row))
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
