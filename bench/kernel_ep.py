"""GPU check and timing of lingc.kernels.ep (ep_align, ep_combine) at Ling-3.0-tiny's TP2 decode shapes, against the
torch reference ops (lingc/ops/dist.py), which is what the TP2 step ran before these kernels (docs/tp.md).

Shapes: E=128 routed experts, top-8, plus the fused shared expert as pair 9 (fuse_shared_expert, as `--passes all`
compiles it), tp=2: expert_map [129], El = 65 local experts on each rank, block_m=16; h=1536 bf16; N in {1, 6}
(decode, verify chain). Both ranks' maps (rank 0 owns the shared expert, rank 1 does not). ep_combine also without
the fused shared expert (k=8, shared_out [N, h]). Each timed graph holds CALLS calls over distinct routings.

Each row: correctness vs the reference op on the device (ep_align: all four outputs bit for bit; ep_combine:
max_abs_err and bit_exact with the device's default order, plus which order reproduces the reference's bits:
sequential_bit_exact / interleave4_bit_exact), pdl=True == pdl=False bit for bit, and graph-replay times
(bench/timing.py) of the kernel and of the reference. Extra rows "router+ep_align" time router_topk's kernel
followed by ep_align's (the TP2 program's routing per MoE layer) against router_align's single kernel (TP1's).
`ok` allows the bf16 kernel tolerance of tests/kernels/conftest.py (rtol 2^-7, atol 1e-2); bit_exact is the claim.
On CPU (`--device cpu`: the Triton interpreter, with the kernel tests' round-to-nearest-even bf16 shim as
bench/cpu_tp_kernels.py installs it) only the checks run (times are None): a smoke test.
    python3 bench/kernel_ep.py                 # JSON lines, GPU
    python3 bench/kernel_ep.py --device cpu    # the checks in the interpreter
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import graph_time_or_none, kernel_row, nbytes  # noqa: E402

E, TOP_K, TP, BLOCK_M, H = 128, 8, 2, 16, 1536
N_GROUP, TOPK_GROUP, SCALE = 8, 4, 2.5
CALLS = 16                      # distinct inputs per timed graph


def _time(fn: Callable, copies: list, device: torch.device) -> float | None:
    """Median graph-replay time of fn over the input copies (None on CPU, or if it cannot be captured)."""
    if device.type != "cuda":
        return None
    return graph_time_or_none([lambda c=c: fn(*c) for c in copies])


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _routings(n: int, g: torch.Generator, dev: torch.device) -> list[torch.Tensor]:
    """CALLS expert-id tensors [N, 9] int32: 8 distinct routed experts per token, then the shared expert E."""
    out = []
    for _ in range(CALLS):
        ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(n)]).to(torch.int32)
        out.append(torch.cat([ids, torch.full((n, 1), E, dtype=torch.int32)], 1).to(dev))
    return out


def _align_rows(dev: torch.device) -> list[dict]:
    from lingc.kernels.ep import ep_align, ep_align_ref
    from lingc.passes.tp import expert_map
    rows = []
    g = torch.Generator().manual_seed(0)
    num_local = E // TP + 1
    for n in (1, 6):
        routings = _routings(n, g, dev)
        for rank in range(TP):
            emap = expert_map(E, rank, TP, shared_owner=0).to(dev)
            copies = [(ids, emap) for ids in routings]
            got = ep_align(routings[0], emap, num_local, BLOCK_M)
            exact = _equal(got, ep_align_ref(routings[0], emap, num_local, BLOCK_M))
            pdl_eq = _equal(got, ep_align(routings[0], emap, num_local, BLOCK_M, pdl=True))
            rows.append(kernel_row(
                "ep_align", f"N={n} k={TOP_K}+1 E={E}+1 tp={TP} rank={rank} El={num_local} BM={BLOCK_M}", exact,
                0.0 if exact else float("inf"), exact, pdl_eq,
                _time(lambda i, m: ep_align(i, m, num_local, BLOCK_M), copies, dev),
                _time(lambda i, m: ep_align_ref(i, m, num_local, BLOCK_M), copies, dev),
                nbytes(routings[0], emap, *got)))
    return rows


def _routing_rows(dev: torch.device) -> list[dict]:
    """router_topk + ep_align (TP2's routing of a MoE layer) against router_align (TP1's), both on the kernels."""
    from lingc.kernels.ep import ep_align
    from lingc.kernels.router import router_align, router_topk
    from lingc.passes.tp import expert_map
    rows = []
    g = torch.Generator(device=dev).manual_seed(1)
    emap = expert_map(E, 0, TP, shared_owner=0).to(dev)
    args = (N_GROUP, TOPK_GROUP, TOP_K, SCALE)
    for n in (1, 6):
        copies = [(torch.randn(n, E, device=dev, generator=g) * 2, 0.05 * torch.randn(E, device=dev, generator=g))
                  for _ in range(CALLS)]

        def tp2(logits, bias, pdl=False):
            weights, ids = router_topk(logits, bias, *args, 1, pdl=pdl)
            return (weights, *ep_align(ids, emap, E // TP + 1, BLOCK_M, pdl=pdl))
        got = tp2(*copies[0])
        pdl_eq = _equal(got, tp2(*copies[0], pdl=True))
        same = torch.equal(got[0], router_align(*copies[0], *args, E + 1, BLOCK_M, 1)[0])     # the same weights
        rows.append(kernel_row("router+ep_align", f"N={n} E={E} k={TOP_K}+1 tp={TP} vs router_align (TP1)", same,
                               0.0 if same else float("inf"), same, pdl_eq,
                               _time(lambda a, b: tp2(a, b, True), copies, dev),
                               _time(lambda a, b: router_align(a, b, *args, E + 1, BLOCK_M, 1, pdl=True), copies, dev),
                               nbytes(*copies[0], *got), ref_is="router_align kernel (TP1), not a reference op"))
    return rows


def _combine_rows(dev: torch.device) -> list[dict]:
    from lingc.kernels.ep import ep_combine, ep_combine_ref
    from lingc.kernels.moe import INTERLEAVE4, SEQUENTIAL
    rows = []
    g = torch.Generator(device=dev).manual_seed(2)
    for n in (1, 6):
        for fused in (True, False):
            k = TOP_K + 1 if fused else TOP_K
            copies = []
            for _ in range(CALLS):
                local = torch.where(torch.rand(n, k, device=dev, generator=g) < 0.5, 0, -1).to(torch.int32)
                if fused:
                    local[:, -1] = E // TP                     # rank 0 owns this layer's shared expert
                expert_out = torch.randn(n * k, H, device=dev, generator=g).to(torch.bfloat16)
                expert_out.view(n, k, H)[local < 0] = float("nan")   # other ranks' rows: never written
                weights = torch.rand(n, k, device=dev, generator=g)
                if fused:
                    weights[:, -1] = 1.0
                shared = None if fused else torch.randn(n, H, device=dev, generator=g).to(torch.bfloat16)
                copies.append((expert_out, weights, local, shared))
            got, want = ep_combine(*copies[0]), ep_combine_ref(*copies[0])
            err = (got.float() - want.float()).abs().max().item()
            orders = {name: torch.equal(ep_combine(*copies[0], order=o), want)
                      for name, o in (("sequential_bit_exact", SEQUENTIAL), ("interleave4_bit_exact", INTERLEAVE4))}
            local_rows = int((copies[0][2] >= 0).sum())
            rows.append(kernel_row(
                "ep_combine", f"N={n} k={k} h={H} bf16 {'fused shared' if fused else 'shared_out'}",
                torch.allclose(got.float(), want.float(), rtol=2.0**-7, atol=1e-2), err,
                torch.equal(got, want), torch.equal(got, ep_combine(*copies[0], pdl=True)),
                _time(ep_combine, copies, dev), _time(ep_combine_ref, copies, dev),
                local_rows * H * 2 + n * H * 2 * (1 if fused else 2) + n * k * 8, **orders))
    return rows


def run(device: torch.device) -> list[dict]:
    import lingc  # noqa: F401  (registers the reference ops)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return _align_rows(device) + _routing_rows(device) + _combine_rows(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for the interpreter smoke test")
    args = ap.parse_args()
    if args.device == "cpu":
        from cpu_tp_kernels import _interpreter_shims
        _interpreter_shims()
    for row in run(torch.device(args.device)):
        print(json.dumps(row))


if __name__ == "__main__":
    if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"          # before any lingc.kernels import decorates a kernel
    main()
