"""kernels/moe_routed.py on the GPU: its bits against the launches it replaces, then both timed (one token).

For SEEDS random one-token routings at Ling-3.0-tiny's shapes (h 1536, I 512, 128 routed experts in 8 groups, top 4
groups, top-8, the fused shared expert), three paths, PDL-launched as in the step:
    aligned   router_align -> moe_up_act -> moe_down            (decode before fuse_router_into_moe)
    routed    moe_up_act_routed -> moe_down_routed              (decode after it)
    pairs     router_topk -> moe_up_act_pairs -> moe_down_pairs (verify's path: greedy parity needs its bits)
must give the same act, expert rows and weights bit for bit. Then aligned and routed are timed: a CUDA graph of
CALLS calls, each on its own weight copy (cold: COPIES copies of the stacks), replay medians (bench/timing.py), each
path twice, then each of the five launches alone (`alone_us`: a graph of CALLS of it, PDL between them).

    python3 bench/moe_routed_check.py [--json OUT]       # a GPU; about half a minute
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import check_main, cold_copies, graph_time_or_none  # noqa: E402

H, INTER, E, N_GROUP, TOPK_GROUP, TOP_K, SCALE, BLOCK_M = 1536, 512, 128, 8, 4, 8, 2.5, 16
SEEDS = 16
CALLS = 16
COPIES = cold_copies((E + 1) * 3 * INTER * H * 2)


def paths(x, w13, w2, logits, bias):
    """{path: (act, expert rows, weights)} for one token."""
    from lingc.kernels import moe, moe_routed, router
    r = (N_GROUP, TOPK_GROUP, TOP_K, SCALE)
    wa, _, sp, be, tot = router.router_align(logits, bias, *r, E + 1, BLOCK_M, 1, pdl=True)
    act = moe.moe_up_act(x, w13, sp, be, tot, TOP_K + 1, BLOCK_M, 0.0, pdl=True)
    aligned = (act, moe.moe_down(act, w2, sp, be, tot, BLOCK_M, pdl=True), wa)
    act = moe_routed.moe_up_act_routed(x, w13, logits, bias, *r, 1, 0.0, pdl=True)
    routed = (act, *moe_routed.moe_down_routed(act, w2, logits, bias, *r, 1, pdl=True))
    wp, ids = router.router_topk(logits, bias, *r, 1, pdl=True)
    act = moe.moe_up_act_pairs(x, w13, ids, 0.0, pdl=True)
    pairs = (act, moe.moe_down_pairs(act, w2, ids, pdl=True), wp)
    return {"aligned": aligned, "routed": routed, "pairs": pairs}


def _same(a: tuple, b: tuple) -> bool:
    return all(torch.equal(s.contiguous().view(torch.uint8), t.contiguous().view(torch.uint8)) for s, t in zip(a, b))


def run(dev: torch.device) -> dict:
    from lingc.kernels import moe, moe_routed, router
    gd = torch.Generator(device=dev).manual_seed(0)
    w13 = [moe.interleave_w13(torch.randn(E + 1, 2 * INTER, H, device=dev, generator=gd).mul(0.02)
                              .to(torch.bfloat16)) for _ in range(COPIES)]
    w2 = [torch.randn(E + 1, H, INTER, device=dev, generator=gd).mul(0.02).to(torch.bfloat16) for _ in range(COPIES)]
    bias = torch.randn(E, device=dev, generator=gd).mul(0.01)
    out = {"checks": {"routings": SEEDS, "routed_eq_aligned": True, "routed_eq_pairs": True}, "times": {}}
    for s in range(SEEDS):
        x = torch.randn(1, H, device=dev, generator=gd).to(torch.bfloat16)
        logits = torch.randn(1, E, device=dev, generator=gd)
        if s % 4 == 3:
            logits[0, ::5] = logits[0, 0]                     # ties across groups
        got = paths(x, w13[s % COPIES], w2[s % COPIES], logits, bias)
        torch.cuda.synchronize()
        out["checks"]["routed_eq_aligned"] &= _same(got["routed"], got["aligned"])
        out["checks"]["routed_eq_pairs"] &= _same(got["routed"], got["pairs"])
    print(json.dumps(out["checks"]), flush=True)
    xs = [torch.randn(1, H, device=dev, generator=gd).to(torch.bfloat16) for _ in range(CALLS)]
    lg = [torch.randn(1, E, device=dev, generator=gd) for _ in range(CALLS)]
    r = (N_GROUP, TOPK_GROUP, TOP_K, SCALE)

    def aligned(c):
        wa, _, sp, be, tot = router.router_align(lg[c], bias, *r, E + 1, BLOCK_M, 1, pdl=True)
        act = moe.moe_up_act(xs[c], w13[c % COPIES], sp, be, tot, TOP_K + 1, BLOCK_M, 0.0, pdl=True)
        return moe.moe_down(act, w2[c % COPIES], sp, be, tot, BLOCK_M, pdl=True), wa

    def routed(c):
        act = moe_routed.moe_up_act_routed(xs[c], w13[c % COPIES], lg[c], bias, *r, 1, 0.0, pdl=True)
        return moe_routed.moe_down_routed(act, w2[c % COPIES], lg[c], bias, *r, 1, pdl=True)

    for name, fn in (("aligned_us", aligned), ("routed_us", routed), ("aligned2_us", aligned),
                     ("routed2_us", routed)):
        t = graph_time_or_none([lambda c=c: fn(c) for c in range(CALLS)])
        out["times"][name] = t                       # per call (graph_time_us divides by the calls)
    print(json.dumps(out["times"]), flush=True)
    # each launch alone (a graph of CALLS of it, PDL between them): where a difference sits
    align = [router.router_align(lg[c], bias, *r, E + 1, BLOCK_M, 1, pdl=True) for c in range(CALLS)]
    acts = [moe.moe_up_act(xs[c], w13[c % COPIES], *align[c][2:], TOP_K + 1, BLOCK_M, 0.0, pdl=True)
            for c in range(CALLS)]
    alone = {
        "router_align": lambda c: router.router_align(lg[c], bias, *r, E + 1, BLOCK_M, 1, pdl=True),
        "moe_up_act": lambda c: moe.moe_up_act(xs[c], w13[c % COPIES], *align[c][2:], TOP_K + 1, BLOCK_M, 0.0,
                                               pdl=True),
        "moe_down": lambda c: moe.moe_down(acts[c], w2[c % COPIES], *align[c][2:], BLOCK_M, pdl=True),
        "moe_up_act_routed": lambda c: moe_routed.moe_up_act_routed(xs[c], w13[c % COPIES], lg[c], bias, *r, 1, 0.0,
                                                                    pdl=True),
        "moe_down_routed": lambda c: moe_routed.moe_down_routed(acts[c], w2[c % COPIES], lg[c], bias, *r, 1,
                                                                pdl=True),
    }
    out["alone_us"] = {name: graph_time_or_none([lambda c=c, f=f: f(c) for c in range(CALLS)])
                       for name, f in alone.items()}
    print(json.dumps(out["alone_us"]), flush=True)
    return out


def main() -> None:
    check_main("moe_routed_check.py", __doc__, run)


if __name__ == "__main__":
    main()
