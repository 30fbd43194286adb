"""kernels/moe_tma.py on the GPU: its bits against the Triton up-GEMM, then both timed alone (decode's aligned layout).

For tokens T in (1, 2, 6, 16) and random routings (top-8 of 128 routed experts plus the fused shared expert, moe_align's
layout at block_m 16), moe_up_act with LINGC_MOE_UP_TMA off (kernels/moe.py's Triton kernel) and on
(kernels/moe_tma.py) must agree bit for bit, PDL-launched as in the step, over SEEDS routings each. Then each path is
timed at T = 1 (decode) and T = 6: a CUDA graph of CALLS calls, each on its own weight copy (cold: COPIES copies of
the stack), PDL-launched, replay medians (bench/timing.py). Ling-3.0-tiny's shapes: h 1536, I 512.

    python3 bench/moe_up_tma_check.py [--json OUT]       # a GPU with Gluon (sm_90); about half a minute
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import check_main, cold_copies, graph_time_or_none  # noqa: E402

H, INTER, E, TOP_K, BLOCK_M = 1536, 512, 128, 8, 16
SEEDS = 8
CALLS = 16
COPIES = cold_copies((E + 1) * 2 * INTER * H * 2)


def routing(T: int, g: torch.Generator, dev: torch.device) -> torch.Tensor:
    """[T, 9] ids: 8 distinct routed experts a token, then the shared expert E (fuse_shared_expert's layout)."""
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(T)])
    return torch.cat([ids, torch.full((T, 1), E)], dim=1).to(torch.int32).to(dev)


def run(dev: torch.device) -> dict:
    from lingc.kernels import moe, moe_tma
    from lingc.kernels.moe_align import moe_align
    g = torch.Generator(device="cpu").manual_seed(0)
    gd = torch.Generator(device=dev).manual_seed(0)
    w13 = [moe.interleave_w13(torch.randn(E + 1, 2 * INTER, H, device=dev, generator=gd).mul(0.02)
                              .to(torch.bfloat16)) for _ in range(COPIES)]

    def up(x, layout, c, tma: bool):
        moe_tma.MOE_UP_TMA = tma
        try:
            return moe.moe_up_act(x, w13[c % COPIES], *layout, TOP_K + 1, BLOCK_M, 0.0, pdl=True)
        finally:
            moe_tma.MOE_UP_TMA = False

    out = {"checks": [], "times": []}
    for T in (1, 2, 6, 16):
        equal, worst = True, 0.0
        for s in range(SEEDS):
            x = torch.randn(T, H, device=dev, generator=gd).mul(4).to(torch.bfloat16)
            layout = moe_align(routing(T, g, dev), E + 1, BLOCK_M)
            a, b = up(x, layout, s, False), up(x, layout, s, True)
            torch.cuda.synchronize()
            equal &= torch.equal(a.view(torch.int16), b.view(torch.int16))
            worst = max(worst, (a.float() - b.float()).abs().max().item())
        row = {"tokens": T, "bit_equal": bool(equal), "max_abs_diff": worst, "failed": list(moe_tma.FAILED)}
        out["checks"].append(row)
        print(json.dumps(row), flush=True)
    for T in (1, 6):
        xs = [torch.randn(T, H, device=dev, generator=gd).to(torch.bfloat16) for _ in range(CALLS)]
        layouts = [moe_align(routing(T, g, dev), E + 1, BLOCK_M) for _ in range(CALLS)]
        row = {"tokens": T}
        for name, tma in (("triton_us", False), ("tma_us", True), ("triton2_us", False), ("tma2_us", True)):
            moe_tma.MOE_UP_TMA = tma
            try:
                row[name] = graph_time_or_none([
                    lambda c=c: moe.moe_up_act(xs[c], w13[c % COPIES], *layouts[c], TOP_K + 1, BLOCK_M, 0.0, pdl=True)
                    for c in range(CALLS)])
            finally:
                moe_tma.MOE_UP_TMA = False
        out["times"].append(row)
        print(json.dumps(row), flush=True)
    return out


def main() -> None:
    check_main("moe_up_tma_check.py", __doc__, run)


if __name__ == "__main__":
    main()
