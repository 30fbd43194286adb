"""GPU check of every Triton kernel family: correctness vs the reference op, PDL on == off bit for bit, and time.

The RMSNorm family and moe_align are checked here (per-launch times: launch-bound, KB of data); every other
family has a bench/kernel_<family>.py whose run(device) checks it at Ling-3.0-tiny's decode shapes and times it
in CUDA graphs with cold weights (bench/timing.py). The families are found by that file name: ep, filtered_probs,
kda, linear, meta (meta.py's index kernels, uniform, kda_conv_qkv / kda_commit_multi), mla, moe, router (router
and sampling kernels; router_align's "rows", "pairs" and "split" variants side by side). One table and one JSON for all:
    python3 bench/device_kernels.py --json $OUT/kernels.json [--families linear,moe]
    python3 bench/device_kernels.py --json $OUT/kernels.json --families meta,router
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import events_ms  # noqa: E402


def _time_us(fn, iters: int = 200) -> float:
    return events_ms(fn, repeats=iters, warmup=10) * 1e3


def _embedding_norm_row(M: int, N: int, x: torch.Tensor, w: torch.Tensor, dev: torch.device) -> dict:
    """fuse_embed_norm's kernels on the GPU: embedding_rmsnorm / embedding_rmsnorm_cat against the embedding + norm
    kernels they replace, bit for bit (PDL on and off), and the times of the one launch and the two."""
    from lingc.kernels.meta import embedding
    from lingc.kernels.rmsnorm import embedding_rmsnorm, embedding_rmsnorm_cat, rmsnorm, rmsnorm_cat
    table = torch.randn(4096, N, device=dev, dtype=torch.bfloat16)
    ids = torch.randint(0, 4096, (1, M), device=dev)
    rows = embedding(ids, table)
    out, row = embedding_rmsnorm(ids, table, w, 1e-6)
    out_pdl, _ = embedding_rmsnorm(ids, table, w, 1e-6, pdl=True)
    hidden = x.view(1, M, N)
    cat = embedding_rmsnorm_cat(ids, table, w, hidden, w, 1e-6)
    return {"embedding_rmsnorm_bit_exact_vs_pair": bool(torch.equal(out, rmsnorm(rows, w, 1e-6))
                                                       and torch.equal(row, rows)),
            "embedding_rmsnorm_pdl_on_equals_off": bool(torch.equal(out, out_pdl)),
            "embedding_rmsnorm_cat_bit_exact_vs_pair": bool(torch.equal(
                cat, rmsnorm_cat(rows, w, hidden, w, 1e-6))),
            "embedding_rmsnorm_us": _time_us(lambda: embedding_rmsnorm(ids, table, w, 1e-6)),
            "embedding_then_rmsnorm_us": _time_us(lambda: rmsnorm(embedding(ids, table), w, 1e-6))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", default="kernels.json")
    ap.add_argument("--families", default="",
                    help="comma-separated bench/kernel_<family>.py to run (default all; none: only the rows above them)")
    ap.add_argument("--family-timeout", type=int, default=0, help="seconds per family before it is cut off (0: none)")
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
            **_embedding_norm_row(M, N, x, w, dev),
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
    result["families"] = run_families(args.families, args.family_timeout)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)


class _Timeout(Exception):
    pass


def run_families(only: str, timeout_s: int = 0) -> dict:
    """Each bench/kernel_<family>.py's run(device) rows, or its error; prints one line per row.
    With timeout_s, a family still running after that many seconds is cut off (SIGALRM) and recorded as such."""
    import importlib
    import signal

    def alarm(signum, frame):
        raise _Timeout()
    signal.signal(signal.SIGALRM, alarm)
    import traceback
    from pathlib import Path
    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here))
    if only == "none":
        return {}
    wanted = set(filter(None, only.split(",")))
    known = {path.stem[len("kernel_"):] for path in here.glob("kernel_*.py")}
    if wanted - known:
        raise SystemExit(f"device_kernels: unknown families {sorted(wanted - known)}; known: {sorted(known)}")
    out: dict = {}
    for path in sorted(here.glob("kernel_*.py")):
        family = path.stem[len("kernel_"):]
        if wanted and family not in wanted:
            continue
        try:
            signal.alarm(timeout_s)
            rows = importlib.import_module(path.stem).run(torch.device("cuda", torch.cuda.current_device()))
        except _Timeout:
            out[family] = {"error": f"cut off after {timeout_s} s"}
            print(f"{family}: cut off after {timeout_s} s", flush=True)
            torch.cuda.synchronize()
            continue
        except Exception:  # noqa: BLE001  (one family's failure must not lose the others)
            out[family] = {"error": traceback.format_exc()[-3000:]}
            print(f"{family}: ERROR {out[family]['error'][-600:]}", flush=True)
            continue
        finally:
            signal.alarm(0)
        out[family] = rows
        for r in rows:
            print(f"{family:15s} {str(r.get('kernel')):22s} {str(r.get('shape')):28s} ok={r.get('ok')} "
                  f"bit={r.get('bit_exact')} pdl={r.get('pdl_equal')} err={r.get('max_abs_err')} "
                  f"t={r.get('time_us')} ref={r.get('ref_time_us')} GB/s={r.get('gbps')}", flush=True)
    return out


if __name__ == "__main__":
    main()
