"""GPU check and timing of lingc.kernels.router (router_topk, router_align) and lingc.kernels.sample (greedy_sample,
chain_accept, sample_tokens) at the Ling-3.0-tiny decode shapes, against the torch reference ops.

Shapes: router E=128, k=8, n_group=8, topk_group=4, scale 2.5, BM=16, N in {1, 2, 6} (decode, verify chains);
greedy_sample V=157184, T in {1, 7}; chain_accept B=1, K=6, V=157184 (greedy: the decode hot path; sampled:
temperature 1 after filtered_probs); sample_tokens V=157184, T in {1, 7}; vocab_expand N=32768 -> V=157184, T in
{1, 5} (`python3 bench/kernel_router.py vocab_expand` runs only those). (`uniform` moved to kernel_meta.py.)

router_align is timed per kernel variant (kernels/router.py): `router_align[rows]`, `router_align[pairs]` and
`router_align[split]` (the default "auto" takes split from SPLIT_FROM tokens up while N * (k + S) <= 64, pairs at 1),
side by side, at N in {1, 2, 6}, without (S=0) and with the fused shared expert (S=1, num_experts 129: what the step
runs after fuse_shared_expert), and `router_align[split-wW]`: split at num_warps W in SPLIT_WARPS_SWEEP (its
H200 sweep: 4 warps, `_split_warps`). Each of those rows also carries `variants_equal` (every
variant == pairs where the outputs are defined), `equals_pairs` (this row's outputs == pairs', all five, every cell
bit for bit), `unfused_kernels_time_us` (router_topk kernel + moe_align kernel, the pair the fusion replaces) and
`ref_time_us` (the torch reference op); the split rows carry `counter_zero` (the ticket counter is zero after the
checks, timing included).

Each row: correctness vs the reference op on the GPU (router: per-row id sets and the weight of each id, the
reference's order being unspecified; alignment and token ids exact), pdl=True output == pdl=False output bit for
bit, and graph-replay times (bench/timing.py, over `cold_copies` distinct input copies) of the kernel and of the
reference op. `ok` for the sampled rows allows the documented inverse-CDF boundary case (kernels/sample.py): it
requires every token to have positive mass and the accept lengths to be equal.
    python3 bench/kernel_router.py            # JSON lines
    python3 bench/device_kernels.py --families router --json $OUT/router.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import cold_copies, graph_time_or_none, kernel_row, nbytes  # noqa: E402

E, TOP_K, N_GROUP, TOPK_GROUP, SCALE, BLOCK_M = 128, 8, 8, 4, 2.5, 16
V, K = 157184, 6
ALIGN_VARIANTS = ("rows", "pairs", "split")
SPLIT_WARPS_SWEEP = (1, 2, 4)   # router_align "split" num_warps swept (router_align's split_warps)


def _time(fn: Callable, copies: list) -> float | None:
    """Median graph-replay time of fn over the input copies, or None if it cannot be captured (host sync)."""
    return graph_time_or_none([lambda c=c: fn(*c) for c in copies])


_row = kernel_row


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _align_equal(a: tuple, b: tuple, block_m: int) -> bool:
    """(sorted_pairs, block_expert, total) equal where they are defined: the kernels leave the tail past `total`
    unwritten (its consumers exit before reading it), the reference fills it with sentinels."""
    if not torch.equal(a[2], b[2]):
        return False
    n = int(a[2].item())
    return torch.equal(a[0][:n], b[0][:n]) and torch.equal(a[1][:n // block_m], b[1][:n // block_m])


def _routing_diff(got: tuple, want: tuple) -> tuple[bool, float, bool]:
    """(same id sets, max |weight diff| per id, weights bit-equal per id)."""
    ids, order = got[1].long().sort(dim=-1)
    ids_ref, order_ref = want[1].long().sort(dim=-1)
    if not torch.equal(ids, ids_ref):
        return False, float("inf"), False
    w, w_ref = got[0].gather(1, order), want[0].gather(1, order_ref)
    return True, (w - w_ref).abs().max().item(), torch.equal(w, w_ref)


def _router_rows(dev: torch.device) -> list[dict]:
    from lingc.kernels.router import router_topk, router_topk_ref

    rows = []
    g = torch.Generator(device=dev).manual_seed(0)
    for N in (1, 2, 6):
        per_copy = N * E * 4 + E * 4
        copies = [(torch.randn(N, E, device=dev, generator=g) * 2, 0.05 * torch.randn(E, device=dev, generator=g))
                  for _ in range(cold_copies(per_copy))]
        x, bias = copies[0]
        args = (N_GROUP, TOPK_GROUP, TOP_K, SCALE)
        # router_topk
        got, want = router_topk(x, bias, *args), router_topk_ref(x, bias, *args)
        same, err, exact = _routing_diff(got, want)
        pdl_eq = _equal(got, router_topk(x, bias, *args, pdl=True))
        t = _time(lambda a, b: router_topk(a, b, *args), copies)
        t_pdl = _time(lambda a, b: router_topk(a, b, *args, pdl=True), copies)
        t_ref = _time(lambda a, b: router_topk_ref(a, b, *args), copies)
        rows.append(_row("router_topk", f"N={N} E={E} k={TOP_K} g={N_GROUP}/{TOPK_GROUP}", same and err < 1e-5,
                         err, same and exact, pdl_eq, t, t_ref, per_copy + N * TOP_K * 8, pdl_time_us=t_pdl))
        for shared in (0, 1):
            rows += _router_align_rows(x, bias, copies, N, shared, per_copy)
    return rows


def _router_align_rows(x: torch.Tensor, bias: torch.Tensor, copies: list, N: int, shared: int,
                       per_copy: int) -> list[dict]:
    """router_align[rows], [pairs], [split] and the split num_warps sweep at one (N, fused_shared): checks, PDL,
    times, side by side."""
    from lingc.kernels.moe_align import moe_align as moe_align_kernel
    from lingc.kernels.router import align_counters, router_align, router_align_ref, router_topk

    experts = E + shared
    args = (N_GROUP, TOPK_GROUP, TOP_K, SCALE, experts, BLOCK_M, shared)
    want = router_align_ref(x, bias, *args)
    configs = {v: dict(variant=v) for v in ALIGN_VARIANTS}
    configs.update({f"split-w{w}": dict(variant="split", split_warps=w) for w in SPLIT_WARPS_SWEEP})
    outs = {name: router_align(x, bias, *args, **kw) for name, kw in configs.items()}
    pairs = outs["pairs"]
    variants_equal = all(_equal(got[:2], pairs[:2]) and _align_equal(got[2:], pairs[2:], BLOCK_M)
                         for got in outs.values())
    t_ref = _time(lambda a, b: router_align_ref(a, b, *args), copies)
    t_two = _time(lambda a, b: moe_align_kernel(router_topk(a, b, *args[:4], shared)[1], experts, BLOCK_M), copies)
    rows = []
    for name, got in outs.items():
        kw = configs[name]
        same, err, exact = _routing_diff(got[:2], want[:2])
        align_exact = (_align_equal(got[2:], torch.ops.lingc.moe_align(got[1], experts, BLOCK_M), BLOCK_M)
                       and torch.equal(got[4], want[4]))
        equals_pairs = _equal(got, pairs)                     # every cell: all three kernels write every cell
        again = router_align(x, bias, *args, pdl=True, **kw)
        pdl_eq = _equal(got[:2], again[:2]) and _align_equal(got[2:], again[2:], BLOCK_M)
        t = _time(lambda a, b, kw=kw: router_align(a, b, *args, **kw), copies)
        t_pdl = _time(lambda a, b, kw=kw: router_align(a, b, *args, pdl=True, **kw), copies)
        extra = {}
        if kw["variant"] == "split":
            torch.cuda.synchronize()
            extra["counter_zero"] = not bool(align_counters(x.device).any())
        ok = same and err < 1e-5 and align_exact and variants_equal and equals_pairs and extra.get("counter_zero", True)
        rows.append(_row(f"router_align[{name}]",
                         f"N={N} E={E}+{shared} k={TOP_K} g={N_GROUP}/{TOPK_GROUP} BM={BLOCK_M}",
                         ok, err, same and exact and align_exact, pdl_eq, t, t_ref, per_copy + nbytes(*got),
                         pdl_time_us=t_pdl, unfused_kernels_time_us=t_two, align_exact=align_exact,
                         variants_equal=variants_equal, equals_pairs=equals_pairs, **extra))
    return rows


def _sample_rows(dev: torch.device) -> list[dict]:
    from lingc.kernels.sample import (chain_accept, chain_accept_ref, greedy_sample, greedy_sample_ref,
                                      sample_tokens, sample_tokens_ref)

    rows = []
    g = torch.Generator(device=dev).manual_seed(1)
    for T in (1, 7):                                                          # greedy_sample
        copies = [(torch.randn(1, T, V, device=dev, generator=g),) for _ in range(cold_copies(T * V * 4))]
        (x,) = copies[0]
        got, want = greedy_sample(x), greedy_sample_ref(x)
        exact = torch.equal(got, want)
        rows.append(_row("greedy_sample", f"B=1 T={T} V={V} fp32", exact, 0.0 if exact else float("inf"), exact,
                         torch.equal(got, greedy_sample(x, pdl=True)),
                         _time(greedy_sample, copies), _time(greedy_sample_ref, copies), T * V * 4 + T * 8,
                         pdl_time_us=_time(lambda a: greedy_sample(a, pdl=True), copies)))
    for temp in (0.0, 1.0):                                                   # chain_accept
        def draw() -> tuple:
            target_logits = 3 * torch.randn(1, K + 1, V, device=dev, generator=g)
            temperature = torch.full((1,), temp, device=dev)
            top_k, top_p = torch.zeros(1, dtype=torch.long, device=dev), torch.ones(1, device=dev)
            target_probs = torch.ops.lingc.filtered_probs(target_logits, temperature, top_k, top_p)
            draft_logits = target_logits[:, :K] + torch.randn(1, K, V, device=dev, generator=g)
            draft_probs = torch.ops.lingc.filtered_probs(draft_logits, temperature, top_k, top_p)
            draft_ids = target_logits[:, :K].argmax(-1) if temp <= 0 else draft_logits.argmax(-1)
            draft_ids[:, 4:] = (draft_ids[:, 4:] + 1) % V                     # greedy: accept 4 of 6
            u = torch.rand(1, K + 1, device=dev, generator=g)
            return draft_ids, draft_probs, target_probs, target_logits, temperature, u
        per_copy = 3 * (K + 1) * V * 4
        copies = [draw() for _ in range(cold_copies(per_copy))]
        got, want = chain_accept(*copies[0]), chain_accept_ref(*copies[0])
        exact = _equal(got, want)
        p_stop = copies[0][2][0, got[0].long() - 1].gather(-1, got[1][:, got[0].long() - 1].view(1, 1))
        ok = exact or (torch.equal(got[0], want[0]) and bool((p_stop > 0).all()))
        moved = (K + 1) * V * 4 if temp <= 0 else (2 * K + 1) * V * 4
        rows.append(_row("chain_accept", f"B=1 K={K} V={V} temperature={temp}", ok, 0.0 if exact else float("inf"),
                         exact, _equal(got, chain_accept(*copies[0], pdl=True)),
                         _time(chain_accept, copies), _time(chain_accept_ref, copies), moved,
                         pdl_time_us=_time(lambda *a: chain_accept(*a, pdl=True), copies),
                         accept_len=int(got[0][0])))
    for T in (1, 7):                                                          # sample_tokens
        def draw_probs() -> tuple:
            probs = torch.softmax(2 * torch.randn(1, T, V, device=dev, generator=g), dim=-1)
            return probs, torch.rand(1, T, device=dev, generator=g)
        copies = [draw_probs() for _ in range(cold_copies(T * V * 4))]
        got, want = sample_tokens(*copies[0]), sample_tokens_ref(*copies[0])
        exact = torch.equal(got, want)
        positive = bool((copies[0][0].gather(-1, got.unsqueeze(-1)) > 0).all())
        rows.append(_row("sample_tokens", f"B=1 T={T} V={V}", exact or positive, 0.0 if exact else float("inf"),
                         exact, torch.equal(got, sample_tokens(*copies[0], pdl=True)),
                         _time(sample_tokens, copies), _time(sample_tokens_ref, copies), T * V * 4,
                         pdl_time_us=_time(lambda *a: sample_tokens(*a, pdl=True), copies)))
    return rows + _vocab_expand_rows(dev)


def _vocab_expand_rows(dev: torch.device) -> list[dict]:
    """vocab_expand (draft_vocab's sampled draft): a distribution over N = 32768 evenly spaced ids widened to V."""
    from lingc.kernels.sample import vocab_expand, vocab_expand_ref

    rows, N = [], 32768
    g = torch.Generator(device=dev).manual_seed(2)
    inverse = torch.full((V,), -1, dtype=torch.int32, device=dev)
    inverse[torch.arange(0, V, V // N, device=dev)[:N]] = torch.arange(N, dtype=torch.int32, device=dev)
    for T in (1, 5):
        copies = [(torch.softmax(torch.randn(1, T, N, device=dev, generator=g), dim=-1), inverse)
                  for _ in range(cold_copies(T * V * 4))]
        got, want = vocab_expand(*copies[0]), vocab_expand_ref(*copies[0])
        exact = torch.equal(got, want)
        rows.append(_row("vocab_expand", f"B=1 T={T} N={N} V={V}", exact, 0.0 if exact else float("inf"), exact,
                         torch.equal(got, vocab_expand(*copies[0], pdl=True)),
                         _time(vocab_expand, copies), _time(vocab_expand_ref, copies), T * (N + V) * 4 + V * 4,
                         pdl_time_us=_time(lambda *a: vocab_expand(*a, pdl=True), copies)))
    return rows


GLUON_SHAPES = ((128, 8, 4, 8), (64, 4, 2, 6), (256, 8, 4, 8), (32, 2, 1, 4))   # (E, n_group, topk_group, k)
GLUON_SEEDS = 24


def _gluon_rows(dev: torch.device) -> list[dict]:
    """kernels/router_gluon.py against router.py's Triton kernels on the GPU, bit for bit: router_align at one row
    (every cell of the five outputs against "rows") and router_topk at 1, 2 and 6 rows, over GLUON_SEEDS random
    inputs and as many tie-heavy ones (logits from {-1, 0, 1}, a bias from a few values) per shape, with and
    without the fused shared expert; PDL on == off; then graph-replay times at Ling-3.0-tiny's shape (PDL on)."""
    from lingc.kernels import router_gluon as RG
    from lingc.kernels.router import router_align, router_topk

    def triton_only(fn, *a, **kw):
        enabled, RG.ENABLED = RG.ENABLED, False
        try:
            return fn(*a, **kw)
        finally:
            RG.ENABLED = enabled

    g = torch.Generator(device=dev).manual_seed(3)
    rows = []
    for e, ng, tg, k in GLUON_SHAPES:
        if not RG.eligible(dev, e, ng, tg, k):
            rows.append(_row("router_gluon", f"E={e} g={ng}/{tg} k={k}", False, None, None, None, None, None, 0,
                             note="not eligible here", failed=list(RG.FAILED)))
            continue
        align_eq = topk_eq = pdl_eq = True
        cases = 0
        for shared in (0, 1):
            for seed in range(2 * GLUON_SEEDS):
                ties = seed % 2 == 1
                for N in (1, 2, 6):
                    if ties:
                        x = torch.randint(-1, 2, (N, e), device=dev, generator=g).float()
                        bias = 0.25 * torch.randint(0, 3, (e,), device=dev, generator=g).float()
                    else:
                        x = 2 * torch.randn(N, e, device=dev, generator=g)
                        bias = 0.05 * torch.randn(e, device=dev, generator=g)
                    args = (x, bias, ng, tg, k, SCALE)
                    got = router_topk(*args, shared)
                    topk_eq &= _equal(got, triton_only(router_topk, *args, shared))
                    pdl_eq &= _equal(got, router_topk(*args, shared, pdl=True))
                    if N == 1:
                        a_args = (*args, e + shared, BLOCK_M, shared)
                        got = router_align(*a_args, variant="gluon")
                        align_eq &= _equal(got, triton_only(router_align, *a_args, variant="rows"))
                        pdl_eq &= _equal(got, router_align(*a_args, variant="gluon", pdl=True))
                    cases += 1
        ok = align_eq and topk_eq and pdl_eq and not RG.FAILED
        rows.append(_row("router_gluon", f"E={e} g={ng}/{tg} k={k} S=0,1 N=1,2,6", ok, 0.0 if ok else None, ok,
                         pdl_eq, None, None, 0, cases=cases, align_equals_rows=bool(align_eq),
                         topk_equals_triton=bool(topk_eq), failed=list(RG.FAILED)))
    # times at the step's shape (E = 128 + the fused shared expert), PDL on
    for N in (1, 6):
        copies = [(torch.randn(N, E, device=dev, generator=g) * 2, 0.05 * torch.randn(E, device=dev, generator=g))
                  for _ in range(cold_copies(N * E * 4 + E * 4))]
        args = (N_GROUP, TOPK_GROUP, TOP_K, SCALE)
        t_g = _time(lambda a, b: router_topk(a, b, *args, 1, pdl=True), copies)
        t_t = _time(lambda a, b: triton_only(router_topk, a, b, *args, 1, pdl=True), copies)
        row = dict(kernel="router_gluon_time", shape=f"N={N} E={E}+1 k={TOP_K}", topk_gluon_us=t_g,
                   topk_triton_us=t_t)
        if N == 1:
            a_args = (*args, E + 1, BLOCK_M, 1)
            row["align_gluon_us"] = _time(lambda a, b: router_align(a, b, *a_args, variant="gluon", pdl=True), copies)
            row["align_rows_us"] = _time(lambda a, b: triton_only(router_align, a, b, *a_args, variant="rows",
                                                                  pdl=True), copies)
        rows.append(row)
    return rows


def run(device: torch.device, only: str = "") -> list[dict]:
    import lingc  # noqa: F401  (registers the reference ops)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if only == "vocab_expand":
        return _vocab_expand_rows(device)
    if only == "gluon":
        return _gluon_rows(device)
    return _router_rows(device) + _sample_rows(device)


if __name__ == "__main__":          # python3 bench/kernel_router.py [vocab_expand | gluon]   (JSON lines)
    for row in run(torch.device("cuda", torch.cuda.current_device()), *sys.argv[1:2]):
        print(json.dumps(row))
