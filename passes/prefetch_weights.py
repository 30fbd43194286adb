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
against 10.6 us cold). Hence the side stream, which is not measured yet (no GPU was lent for it):
bench/device_prefetch_ab.sh runs the probe, the A/B/A/B of the `all` row with and without the hints (and with the two
knobs below), and the greedy parity with them, in one device call.

Knobs for that A/B: ANCHOR_SKIP (the hint follows the ANCHOR_SKIP-th nearest streaming launch: 2 moves the KDA
projection's hint from after the previous layer's down-GEMM to after its up-GEMM, more idle time to fill but the
down-GEMM's stream between) and kernels/l2_prefetch.py's EVICT_LAST (the prefetched lines at evict_last priority).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch.fx as fx

from lingc.ops import OPS
from lingc.passes.base import Pass
from lingc.passes.matchers import is_free
from lingc.program import Program

ENABLED = True                 # False: the pass inserts nothing (a bench A/B switch)
TARGET_MIN_BYTES = 2 << 20     # prefetch weights of at least this size (KDA / MLA projections, o_proj, dense, lm_head)
WINDOW_MIN_BYTES = 1 << 20     # a linear-family launch over this much weight opens a window (it streams)
MAX_BYTES = 32 << 20           # at most this much of one weight (the lm_head's first rows: its first wave's tiles)
# which earlier streaming launch the hint follows: 1 the nearest (default), 2 the one before it (the KDA projection's
# hint then follows the previous layer's up-GEMM and lands over its down-GEMM and combine), ... A bench A/B knob:
# an earlier hint overlaps more idle time but its lines must survive the streams in between in the 50 MB L2
ANCHOR_SKIP = 1
# linear-family ops and the positional index of their weight
WEIGHT_ARG = {"linear": 1, "rmsnorm_linear": 3, "add_rmsnorm_linear": 4, "gated_rmsnorm_linear": 4}
STREAMS = ("moe_up", "moe_up_act", "moe_up_act_pairs", "moe_down", "moe_down_pairs", "moe_fused")
KEEP_META = ("lingc.scope", "lingc.stage")


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
        hint.meta.update({k: node.meta[k] for k in KEEP_META if k in node.meta})
        added.append({"node": hint.name, "weight": w.target, "after": start.name, "before": node.name,
                      "bytes": int(_bytes(w)) if nbytes < 0 else nbytes})
    return added


class PrefetchWeights(Pass):
    name = "prefetch_weights"
    summary = "l2_prefetch hints: a big projection's weight streams into L2 while the kernels before it idle the HBM"
    after = ("partition", "specialize_greedy", "fuse_swiglu", "fuse_index_chains", "capture_metadata", "bf16_router",
             "fuse_projections", "fuse_add_norm", "fuse_moe_align", "fuse_shared_expert", "fuse_moe", "fuse_kda",
             "fuse_norm_linear", "fuse_combine_norm", "fuse_mla", "fuse_relay", "fuse_cat_norm", "fuse_align_into_moe",
             "draft_vocab", "fuse_norm_router", "pdl")
    changes_numerics = False
    # opt-in (`--passes all,prefetch_weights` or LINGC_PREFETCH_WEIGHTS=1) until the side-stream form is measured on
    # the H200: the PDL-chained form measured slower (module docstring)
    in_all = os.environ.get("LINGC_PREFETCH_WEIGHTS", "0") == "1"

    def apply(self, program: Program) -> dict[str, Any]:
        inserted: list[dict[str, Any]] = []
        if not isinstance(ANCHOR_SKIP, int) or ANCHOR_SKIP < 1:
            raise ValueError(f"prefetch_weights: ANCHOR_SKIP must be an integer of at least 1, got {ANCHOR_SKIP!r}")
        if ENABLED:
            for gname, graph in program.graphs.items():
                inserted += [{"graph": gname, **row} for row in insert_prefetches(graph)]
        return {"matches": len(inserted), "enabled": ENABLED, "anchor_skip": ANCHOR_SKIP, "prefetches": inserted}
