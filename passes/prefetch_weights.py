"""prefetch_weights: ask L2 for a big projection's weight while the HBM idles in the kernels before it.

At batch 1 the HBM is busy only while a kernel streams a weight; through the router, the MoE down-GEMM's post-wait
part, the norms, the KDA recurrence and the MLA attention it mostly idles, and each weight stream starts only after
its own PDL wait (its ramp, ~1 us, on the critical path). For every linear-family launch L whose weight is at least
TARGET_MIN_BYTES, this pass finds the nearest earlier launch D that streams a weight itself (a linear-family launch
over WINDOW_MIN_BYTES of weight, or a MoE GEMM) and inserts right after D

    lingc.l2_prefetch(w_L, 0, nbytes)          # nbytes -1: all of it; the first MAX_BYTES of a larger one

so the weight streams into L2 from D's end on, over the kernels between D and L, and L finds it there. The runtime
launches a hint's kernel (kernels/l2_prefetch.py) on a side stream that forks right after D (it starts once every
launch before it is done) and joins at the graph's end (runtime/executor.py): no launch waits for it, so the ~7 us a
31.5 MB prefetch takes to land never holds up the chain, and the chain's PDL edges are the same as without it. Runs
after pdl (which reorders), on the final launch order; the hint itself carries no PDL annotation.

Before:
    L1_mlp_experts_moe_down = lingc.moe_down(...)
    L2_input_layernorm_combine_add_rmsnorm = lingc.combine_add_rmsnorm(...)
    L2_attention_fused_qkvfbg_linear = lingc.linear(..., w_L2_attention_fused_qkvfbg_weight)
After:
    L1_mlp_experts_moe_down = lingc.moe_down(...)
    L2_attention_fused_qkvfbg_l2_prefetch = lingc.l2_prefetch(w_L2_attention_fused_qkvfbg_weight, 0, -1)
    L2_input_layernorm_combine_add_rmsnorm = ...

A scheduling hint: numerics unchanged (the op computes nothing). Opt-in: `--passes all,prefetch_weights` or
LINGC_PREFETCH_WEIGHTS=1.

Measured on the H200 (2026-12-05), only in a first form where the hint was PDL-chained on the step's stream (trigger
at entry, prefetch, wait): greedy decode 1.1767 / 1.1756 ms with the hints against 1.1275 / 1.1357 without, greedy
verify 2.1784 / 2.1794 against 2.1256 / 2.1275 (bench/results/step-ab-prefetch-pdl-h200-20261205.json). The probe
(kernel-l2-prefetch-serial-h200-20261205.json) says why: a grid that issued prefetches lives until they land (its time
is about the transfer's), so the next launch's wait waited for it; after it the 31.5 MB KDA projection ran warm (7.6
against 10.6 us cold). Hence the side stream. Measured (2026-12-05, an H100 80GB HBM3, one process, A/B/A/B;
bench/results/step-ab-prefetch-h100-20261205.json; greedy decode / verify ms): base 1.3371 / 2.6375 and 1.3347 /
2.6326; the hints 1.3664 / 2.6349 and 1.3656 / 2.6366; ANCHOR_SKIP 2 1.3462 / 2.6823 and 1.3480 / 2.6804; EVICT_LAST
1.3934 / 2.6752: slower, so the pass stays opt-in. The probe (kernel-l2-prefetch-h100-20261205.json) says why: with a
4-8 us lead the KDA projection ran 11.1 instead of 13.05 us (8.1 warm), but beside it (no lead) 16.3, and in the step
the prefetches compete with the streams around them.

Knobs for that A/B: ANCHOR_SKIP (the hint follows the ANCHOR_SKIP-th nearest streaming launch: 2 moves the KDA
projection's hint from after the previous layer's down-GEMM to after its up-GEMM, more idle time to fill but the
down-GEMM's stream between) and kernels/l2_prefetch.py's EVICT_LAST (the prefetched lines at evict_last priority).

The routed experts (EXPERTS, EXPERT_W2; off): their weights are known only once the router has run, so their hint
reads the router's ids on the device and goes right after them, where the side stream forks as the up-GEMM starts:

    ids = router_align(...)[1]                                   # a getitem made if nothing read it
    lingc.l2_prefetch_experts(w13, ids, -1)                      # EXPERT_W2: then (w2, ids, -1)
    up = lingc.moe_up_act(x, w13, sorted_pairs, ...)

It gains nothing from idle time before the GEMM; the bet was that 132 programs asking for all the picked experts'
bytes at once fill the HBM's queue faster than the GEMM's pipelined loads do (the decode up-GEMM streams 28 MB at
2.4 TB/s, 11.9 us against 6.7 at the floor). Measured (same call): it loses. The decode up-GEMM alone took 13.28 us
with the hint beside it against 11.58 without (kernel-l2-prefetch-experts-h100-20261205.json; 9.8 us only with a 4-8
us lead, which the ids do not allow), and in the step greedy decode / verify went to 1.3519 / 3.0048 ms (w13), 1.3662
/ 3.1196 (w13 and w2), 1.3984 / 3.0037 (with the projections' hints) against 1.3371 / 2.6375.

MLA's latent cache (MLA_CACHE; off): the Gluon split of each mla_attention reads its layer's visible cache rows (9.4 MB
at 8192 rows) into shared memory from only 64 CTAs (one a 128-row split), so the hint

    L3_attention_q_b_proj_rmsnorm_linear = lingc.rmsnorm_linear(...)                 # the anchor (CACHE_ANCHOR_SKIP 1)
    L3_attention_mla_attention_l2_prefetch_pages = lingc.l2_prefetch_pages(state_layers_3_kv_pages, page_rows,
                                                                          positions)
    ... mla_prep, then L3_attention_mla_attention = lingc.mla_attention(...)

asks L2 for them over the mla_prep and q_absorb launches, whose HBM idles (the page table and positions read on the
device; kernels/l2_prefetch.py). Measured (2026-12-06, an H100, one process; bench/device_cache_prefetch_ab.sh,
bench/results/step-ab-h100-20261206-mla-cache-prefetch.json; greedy decode / verify ms): base 1.3242 / 2.6216,
1.3204 / 2.6215, 1.3216 / 2.6230; after the 1st / 2nd / 3rd streaming launch 1.3240 / 2.6246, 1.3182 / 2.6289,
1.3219 / 2.6345: decode level, verify slower. The split did run faster from L2 (7.96 / 8.89 us a layer at decode /
verify against 9.29 / 9.72), but q_absorb (1.74 / 4.71 against 1.02 / 3.01) and the q_b projection (3.72 against 3.35)
slowed beside the prefetch (launches-h100-20261206-mla-cache-prefetch.json against launches-h100-20261206-b.json):
most of the split's time is its MMA chain and round trips (kernels/mla_gluon.py), not the cache read."""

from __future__ import annotations

import math
import operator
import os
from typing import Any

import torch.fx as fx

from lingc.knobs import env_flag, env_int
from lingc.ops import OPS
from lingc.passes.base import Pass
from lingc.passes.matchers import KEEP_META, carried_meta, is_free, output_getitem
from lingc.program import Program

ENABLED = True                 # False: the pass inserts nothing (a bench A/B switch)
TARGET_MIN_BYTES = 2 << 20     # prefetch weights of at least this size (KDA / MLA projections, o_proj, dense, lm_head)
WINDOW_MIN_BYTES = 1 << 20     # a linear-family launch over this much weight opens a window (it streams)
MAX_BYTES = 32 << 20           # at most this much of one weight (the lm_head's first rows: its first wave's tiles)
# which earlier streaming launch the hint follows: 1 the nearest (default), 2 the one before it (the KDA projection's
# hint then follows the previous layer's up-GEMM and lands over its down-GEMM and combine), ... A bench A/B knob:
# an earlier hint overlaps more idle time but its lines must survive the streams in between in the 50 MB L2
ANCHOR_SKIP: Any = os.environ.get("LINGC_PREFETCH_ANCHOR_SKIP", "1")
ANCHOR_SKIP = int(ANCHOR_SKIP) if ANCHOR_SKIP.strip().isdigit() else ANCHOR_SKIP    # else apply() names the bad value
# the projections' hints above (False, LINGC_PREFETCH_WEIGHT_HINTS=0: only the others, for A/Bs)
WEIGHTS = env_flag("LINGC_PREFETCH_WEIGHT_HINTS", True)
# the routed experts' hints: right after each up-GEMM's router (its launch done), l2_prefetch_experts(w13, ids, -1)
# asks L2 for the picked experts' w13 from 132 programs at once, beside the up-GEMM's own pipelined loads; EXPERT_W2
# adds their w2 (the down-GEMM's) after it on the side stream. Bench A/B knobs, off: measured slower (verify +370 /
# +485 us on an H100, module docstring; LINGC_PREFETCH_EXPERTS=1, LINGC_PREFETCH_EXPERT_W2=1 turn them on)
EXPERTS = env_flag("LINGC_PREFETCH_EXPERTS", False)
EXPERT_W2 = env_flag("LINGC_PREFETCH_EXPERT_W2", False)
EXPERT_MAX_TOKENS = 16        # no experts' hint above this many tokens (prefill's picks cover most experts: no gain)
# MLA's latent cache (MLA_CACHE; off): before each mla_attention of at most CACHE_MAX_TOKENS queries,
# l2_prefetch_pages(kv_pages, page_rows, positions) right after the CACHE_ANCHOR_SKIP-th streaming launch before it
# (1: the q_b projection, 2: the q_a / kv_a / gate one, 3: the previous layer's down-GEMM), so the split's 64 CTAs
# (one a 128-row split at 8192 rows) read the 9.4 MB from L2. Bench A/B knobs (LINGC_PREFETCH_MLA_CACHE=1,
# LINGC_PREFETCH_CACHE_ANCHOR_SKIP=N)
MLA_CACHE = env_flag("LINGC_PREFETCH_MLA_CACHE", False)
CACHE_ANCHOR_SKIP = env_int("LINGC_PREFETCH_CACHE_ANCHOR_SKIP", 1)
CACHE_MAX_TOKENS = 16
UP_GEMMS = ("moe_up", "moe_up_act", "moe_up_act_pairs")
DOWN_GEMMS = ("moe_down", "moe_down_pairs")
# linear-family ops and the positional index of their weight
WEIGHT_ARG = {"linear": 1, "rmsnorm_linear": 3, "add_rmsnorm_linear": 4, "gated_rmsnorm_linear": 4}
STREAMS = ("moe_up", "moe_up_act", "moe_up_act_pairs", "moe_down", "moe_down_pairs", "moe_fused")


def _short(node: fx.Node) -> str | None:
    for short in (*WEIGHT_ARG, *STREAMS):
        if short in OPS and node.target is OPS[short]:
            return short
    return None


def _bytes(node: Any) -> float:
    meta = getattr(node, "meta", {}).get("lingc.tensor") if isinstance(node, fx.Node) else None
    if meta is None or not getattr(meta, "shape", None):
        return 0.0
    return math.prod(int(d) for d in meta.shape) * meta.dtype.itemsize


def _weight(node: fx.Node) -> fx.Node | None:
    short = _short(node)
    if short not in WEIGHT_ARG or len(node.args) <= WEIGHT_ARG[short]:
        return None
    w = node.args[WEIGHT_ARG[short]]
    return w if isinstance(w, fx.Node) and w.op == "get_attr" else None


def _streams(node: fx.Node) -> bool:
    """Whether a launch streams a weight from HBM (opens a prefetch window when its stream ends)."""
    short = _short(node)
    if short in STREAMS:
        return True
    w = _weight(node)
    return w is not None and _bytes(w) >= WINDOW_MIN_BYTES


def _window_start(node: fx.Node, skip: int = 1) -> fx.Node | None:
    """The skip-th nearest launch before `node` that streams a weight (skip 1: the nearest), with at least one launch
    between the nearest and `node`; None where there is no such launch."""
    prev, between, seen = node.prev, 0, 0
    while prev.op != "root":
        if prev.op == "call_function" and not is_free(prev):
            if _streams(prev):
                if not between:
                    return None
                seen += 1
                if seen == skip:
                    return prev
            between += 1
        prev = prev.prev
    return None


def insert_prefetches(graph: fx.Graph) -> list[dict[str, Any]]:
    """Insert the hints into one graph; returns what it inserted (target, after, bytes)."""
    plans = []
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        w = _weight(node)
        if w is None or _bytes(w) < TARGET_MIN_BYTES:
            continue
        start = _window_start(node, ANCHOR_SKIP)
        if start is None:
            continue
        plans.append((node, w, start))
    added = []
    for node, w, start in plans:
        nbytes = -1 if _bytes(w) <= MAX_BYTES else MAX_BYTES
        with graph.inserting_after(start):
            hint = graph.call_function(OPS.l2_prefetch, (w, 0, nbytes))
        hint.name = graph._graph_namespace.create_name(f"{node.name}_l2_prefetch", None)
        hint.meta.update(carried_meta(node))
        added.append({"node": hint.name, "weight": w.target, "after": start.name, "before": node.name,
                      "bytes": int(_bytes(w)) if nbytes < 0 else nbytes})
    return added


def _expert_ids(graph: fx.Graph, up: fx.Node) -> fx.Node | None:
    """The router's expert ids [N, k] an up-GEMM's pairs come from: moe_up_act_pairs' own argument; for the aligned
    GEMMs the ids that moe_align read, or output 1 of router_align (3 of add_rmsnorm_router), the getitem made here
    if nothing read it yet. None for another source (fuse_router_into_moe's moe_up_act_routed, not an UP_GEMMS op,
    never gets here: its ids exist only inside the GEMMs, so its layers get no experts' hint)."""
    if up.target is OPS.moe_up_act_pairs:
        return up.args[2]
    pairs = up.args[2]
    if not isinstance(pairs, fx.Node) or pairs.target is not operator.getitem:
        return None
    src, index = pairs.args
    if src.target is OPS.moe_align:
        return src.args[0]
    if src.target not in (OPS.router_align, OPS.add_rmsnorm_router):
        return None
    return output_getitem(graph, src, index - 1, f"{src.name}_ids", KEEP_META)


def _down_of(up: fx.Node) -> fx.Node | None:
    """The down-GEMM reading an up-GEMM's activation (moe_up's through its silu_and_mul)."""
    act = up
    if up.target is OPS.moe_up:
        act = next((u for u in up.users if u.target is OPS.silu_and_mul), None)
        if act is None:
            return None
    return next((u for u in act.users if any(u.target is OPS[d] for d in DOWN_GEMMS) and u.args[0] is act), None)


def insert_expert_prefetches(graph: fx.Graph) -> list[dict[str, Any]]:
    """Insert l2_prefetch_experts(w13, ids, -1) for each up-GEMM of at most EXPERT_MAX_TOKENS tokens right after the
    node holding its router's ids (and, with EXPERT_W2, the down-GEMM's w2 after it); returns what it inserted."""
    added = []
    for up in [n for n in graph.nodes if n.op == "call_function" and any(n.target is OPS[u] for u in UP_GEMMS)]:
        w13 = up.args[1]
        x = up.args[0].meta.get("lingc.tensor") if isinstance(up.args[0], fx.Node) else None
        if x is None or not x.shape or int(x.shape[0]) > EXPERT_MAX_TOKENS:
            continue
        ids = _expert_ids(graph, up)
        if ids is None or not isinstance(w13, fx.Node) or w13.op != "get_attr":
            continue
        down = _down_of(up) if EXPERT_W2 else None
        weights = [w13] + ([down.args[1]] if down is not None and isinstance(down.args[1], fx.Node) else [])
        anchor = ids               # right after the router's ids: before the launches pdl moved in (a shared expert)
        for w in weights:
            with graph.inserting_after(anchor):
                hint = graph.call_function(OPS.l2_prefetch_experts, (w, ids, -1))
            hint.name = graph._graph_namespace.create_name(f"{up.name}_{w.target.rsplit('.', 1)[-1]}_l2_prefetch",
                                                           None)
            hint.meta.update(carried_meta(up))
            added.append({"node": hint.name, "weight": w.target, "ids": ids.name, "before": up.name})
            anchor = hint
    return added


def insert_cache_prefetches(graph: fx.Graph) -> list[dict[str, Any]]:
    """Insert l2_prefetch_pages(kv_pages, page_rows, positions) for each mla_attention of at most CACHE_MAX_TOKENS
    queries after the CACHE_ANCHOR_SKIP-th streaming launch before it; returns what it inserted."""
    plans = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not OPS.mla_attention:
            continue
        q = node.args[0].meta.get("lingc.tensor") if isinstance(node.args[0], fx.Node) else None
        if q is None or len(q.shape) != 4 or int(q.shape[0]) * int(q.shape[1]) > CACHE_MAX_TOKENS:
            continue
        start = _window_start(node, CACHE_ANCHOR_SKIP)
        if start is not None:
            plans.append((node, start))
    added = []
    for node, start in plans:
        kv_pages, page_rows, positions = node.args[2], node.args[4], node.args[5]
        with graph.inserting_after(start):
            hint = graph.call_function(OPS.l2_prefetch_pages, (kv_pages, page_rows, positions))
        hint.name = graph._graph_namespace.create_name(f"{node.name}_l2_prefetch_pages", None)
        hint.meta.update(carried_meta(node))
        added.append({"node": hint.name, "cache": getattr(kv_pages, "name", str(kv_pages)), "after": start.name,
                      "before": node.name})
    return added


class PrefetchWeights(Pass):
    name = "prefetch_weights"
    summary = "l2_prefetch hints: a big projection's weight streams into L2 while the kernels before it idle the HBM"
    after = ("partition", "specialize_greedy", "fuse_swiglu", "fuse_index_chains", "capture_metadata", "bf16_router",
             "fuse_projections", "fuse_add_norm", "fuse_moe_align", "fuse_shared_expert", "fuse_moe", "fuse_kda",
             "fuse_norm_linear", "fuse_combine_norm", "fuse_mla", "fuse_relay", "fuse_cat_norm", "fuse_align_into_moe",
             "draft_vocab", "fuse_norm_router", "fuse_embed_norm", "fuse_simulate_accept", "fuse_relay_cat",
             "fuse_router_into_moe", "pdl")
    changes_numerics = False
    # opt-in (`--passes all,prefetch_weights` or LINGC_PREFETCH_WEIGHTS=1): every form measured slower (docstring)
    in_all = env_flag("LINGC_PREFETCH_WEIGHTS", False)

    def apply(self, program: Program) -> dict[str, Any]:
        inserted: list[dict[str, Any]] = []
        if not isinstance(ANCHOR_SKIP, int) or ANCHOR_SKIP < 1:
            raise ValueError(f"prefetch_weights: ANCHOR_SKIP (LINGC_PREFETCH_ANCHOR_SKIP) must be an integer of at "
                             f"least 1, got {ANCHOR_SKIP!r}")
        if CACHE_ANCHOR_SKIP < 1:
            raise ValueError(f"prefetch_weights: CACHE_ANCHOR_SKIP (LINGC_PREFETCH_CACHE_ANCHOR_SKIP) must be at least "
                             f"1, got {CACHE_ANCHOR_SKIP!r}")
        experts: list[dict[str, Any]] = []
        caches: list[dict[str, Any]] = []
        if ENABLED:
            for gname, graph in program.graphs.items():
                if WEIGHTS:
                    inserted += [{"graph": gname, **row} for row in insert_prefetches(graph)]
                if EXPERTS:
                    experts += [{"graph": gname, **row} for row in insert_expert_prefetches(graph)]
                if MLA_CACHE:
                    caches += [{"graph": gname, **row} for row in insert_cache_prefetches(graph)]
        return {"matches": len(inserted) + len(experts) + len(caches), "enabled": ENABLED, "anchor_skip": ANCHOR_SKIP,
                "weights": WEIGHTS, "experts": EXPERTS, "expert_w2": EXPERT_W2, "mla_cache": MLA_CACHE,
                "cache_anchor_skip": CACHE_ANCHOR_SKIP, "prefetches": inserted, "expert_prefetches": experts,
                "cache_prefetches": caches}
