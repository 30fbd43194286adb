"""kernels/moe_routed.py on the GPU: bits and time against router_align + moe_up_act + moe_down at one token.

Ling-3.0-tiny's MoE (E = 128 routed + 1 fused shared expert, k = 8, 8 groups keeping 4, h = 1536, I = 512), bf16,
random logits and bias per case. Bits: the routed pair (PDL off and on; the down-GEMM's register preload is on under
PDL) must equal the three kernels' outputs (act, weights, ids, the down rows). Time: each path captured in a CUDA
graph as 8 back-to-back MoE calls over 8 weight copies (cold in L2), PDL launches, median of 20 replays per call.

    python3 bench/kernel_moe_routed.py --json $OUT/moe_routed.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from lingc.kernels.moe import moe_down, moe_up_act
from lingc.kernels.moe_routed import moe_down_routed, moe_up_act_routed
from lingc.kernels.router import router_align

E, S, K, GROUPS, KEEP, H, I, COPIES = 128, 1, 8, 8, 4, 1536, 512, 8


def _route(logits, bias):
    return (logits, bias, GROUPS, KEEP, K, 2.5, E + S, 16, S)


def _three(x, w13, w2, logits, bias, pdl):
    w, ids, sp, be, tot = router_align(*_route(logits, bias), pdl=pdl)
    act = moe_up_act(x, w13, sp, be, tot, K + S, 16, 0.0, pdl=pdl)
    return act, w, ids, moe_down(act, w2, sp, be, tot, 16, pdl=pdl)


def _routed(x, w13, w2, logits, bias, pdl):
    act, w, ids = moe_up_act_routed(x, w13, *_route(logits, bias), 0.0, pdl=pdl)
    return act, w, ids, moe_down_routed(act, w2, *_route(logits, bias), pdl=pdl)


def _time(fn, copies) -> float:
    """us per MoE call: a CUDA graph of len(copies) calls, median of 20 replays."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for c in copies:
            fn(*c)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in copies:
            fn(*c)
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000 / len(copies))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="moe_routed.json")
    args = ap.parse_args()
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    w13 = [(torch.randn(E + S, 2 * I, H, generator=g, device=dev) * H ** -0.5).bfloat16() for _ in range(COPIES)]
    w2 = [(torch.randn(E + S, H, I, generator=g, device=dev) * I ** -0.5).bfloat16() for _ in range(COPIES)]
    bits = []
    for case in range(8):
        x = torch.randn(1, H, generator=g, device=dev).bfloat16()
        logits = torch.randn(1, E, generator=g, device=dev)
        bias = 0.1 * torch.randn(E, generator=g, device=dev)
        for pdl in (False, True):
            want = _three(x, w13[case], w2[case], logits, bias, pdl)
            got = _routed(x, w13[case], w2[case], logits, bias, pdl)
            torch.cuda.synchronize()
            bits.append({"case": case, "pdl": pdl, "equal": [bool(torch.equal(a, b)) for a, b in zip(got, want)]})
    x = torch.randn(1, H, generator=g, device=dev).bfloat16()
    copies = [(x, w13[i], w2[i], torch.randn(1, E, generator=g, device=dev),
               0.1 * torch.randn(E, generator=g, device=dev), True) for i in range(COPIES)]
    timing = {}
    for name, fn in (("three_kernels", _three), ("routed", _routed), ("three_kernels_again", _three),
                     ("routed_again", _routed)):
        timing[name] = _time(fn, copies)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "commit": os.environ.get("LINGC_COMMIT", "unknown"), "command": "python3 bench/kernel_moe_routed.py",
              "all_equal": all(all(b["equal"]) for b in bits), "bits": bits, "us_per_call": timing}
    print(json.dumps({k: result[k] for k in ("all_equal", "us_per_call")}, indent=1))
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
