"""pdl: find the maximal kernel chains that programmatic dependent launch can overlap, and annotate them.

Chains (techniques.md section 5), per layer:
    router  [add_]rmsnorm -> linear (gate) -> router_topk | router_align
            (after fuse_norm_linear: [add_]rmsnorm_linear (norm + gate) -> router_topk | router_align)
    moe     [moe_align ->] moe_up[_act] [-> silu_and_mul] -> moe_down -> moe_combine [-> all_reduce]
            (after fuse_combine_norm: ... -> moe_down -> combine_add_rmsnorm)
            (after fuse_moe: [moe_align ->] moe_fused [-> all_reduce])
            (after fuse_moe_align the align is inside router_align, which ends the router chain)
    kda     kda_conv[_staged] (q, k, v) -> kda_recurrent[_staged] | kda_chunk -> gated_rmsnorm
            (after fuse_kda: kda_fused_decode -> gated_rmsnorm in decode, kda_fused_verify -> gated_rmsnorm
            in verify, kda_conv_qkv -> kda_chunk -> gated_rmsnorm in prefill)
A chain only overlaps if its kernels are adjacent on the stream, so kernels that sit between two chain
members but need nothing from the chain (KDA's k/v/f/b/g projections, the shared expert) move to just
before the chain's first kernel. A kernel that needs a chain member ends the chain there.
Each member gets node.meta['lingc.pdl'] = {chain, index, length, early_launch}; early_launch is false
for the first member (its predecessor does not trigger it). Labels are unique per graph: a layer that a
graph runs again (the draft chain's MTP forwards) labels its chains moe@L6, moe@L6#2, ...
Every other kernel (projections, o_proj, norms, the MLA kernels, lm_head, sampling, metadata: about half of a
Ling-3.0-tiny step's launches) is annotated too, as chain "solo" ({"chain": "solo", "index": 0, "length": 1,
"early_launch": true}): the runtime launches every annotated Triton kernel with PDL, so each may start while its
predecessor runs (its pre-wait prologue: weights into registers, the linear's L2 prefetch of its weight slice)
and pays no full launch gap. Safe for the same reason as inside a chain: every lingc Triton kernel waits
(`gdc_wait`) before touching what an earlier kernel wrote, and ops without a Triton kernel launch without PDL,
so they are stream-ordered as before. SOLO = False restores chain-only annotation (bench A/B).
Entry triggers (`mark_entry_triggers`, after the rest): a norm or MLA attention whose next launch is a linear that
reads only weights before its wait gets the launch hint entry_trigger (it triggers at its entry, so the linear's
weight read overlaps the kernel before the norm) and the linear launched_early (kernels/linear_tma.py); row limits
from the H200 A/Bs (ENTRY_TRIGGER_MAX_ROWS, ENTRY_TRIGGER_ROWS; ENTRY_TRIGGER_SMALL_ROWS for small weights, off).
PREP_ENTRY_TRIGGER (off, an A/B knob): mla_prep before mla_attention triggers at its entry too, so q_absorb and,
at q_absorb's entry, the split launch one kernel sooner and the split's early cache copies overlap mla_prep as well.
Scheduling only: numerics unchanged.

Before:  L1_attention_q_conv1d_kda_conv, L1_attention_k_proj_linear, L1_attention_k_conv1d_kda_conv, ...
After:   L1_attention_k_proj_linear, ..., L1_attention_q_conv1d_kda_conv  # pdl=kda@L1 1/5
         L1_attention_k_conv1d_kda_conv  # pdl=kda@L1 2/5 early ...
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Any

import torch.fx as fx

from lingc.knobs import env_flag
from lingc.ops import OPS
from lingc.program import Program
from lingc.passes.base import Pass
from lingc.passes.matchers import base_buffer, calls, consumers, is_free, producer, written_buffers, written_inputs


SOLO = True      # annotate the kernels outside chains as single-kernel "solo" links (module docstring)
SOLO_META = {"chain": "solo", "index": 0, "length": 1, "early_launch": True}


def _only(nodes: list[fx.Node], target: object) -> fx.Node | None:
    found = [n for n in nodes if n.target is target]
    return found[0] if len(found) == 1 else None


def _router_chain(topk: fx.Node) -> list[fx.Node]:
    gate = producer(topk.args[0])
    if gate.target in (OPS.rmsnorm_linear, OPS.add_rmsnorm_linear):
        return [gate, topk]                                      # fuse_norm_linear: the norm runs in the gate
    if gate.target is not OPS.linear:
        return [topk]
    norm = producer(gate.args[0])
    return ([norm] if norm.target in (OPS.rmsnorm, OPS.add_rmsnorm) else []) + [gate, topk]


def _moe_chain(align: fx.Node) -> list[fx.Node]:
    """The MoE chain from its align (moe_align, or router_align: that one ends the router chain), or from
    fuse_align_into_moe's moe_up_act_pairs (the router_topk before it ends the router chain), or from
    fuse_router_into_moe's moe_up_act_routed (no router launch before it)."""
    starts = (OPS.moe_up_act_pairs, OPS.moe_up_act_routed)      # a pair or routed chain starts at its up-GEMM
    chain = [align] if align.target in (OPS.moe_align, *starts) else []
    steps = ((OPS.moe_up, OPS.moe_up_act, OPS.moe_fused), (OPS.silu_and_mul,),
             (OPS.moe_down, OPS.moe_down_pairs, OPS.moe_down_routed), (OPS.moe_combine, OPS.combine_add_rmsnorm))
    node = align
    for wanted in steps[2:] if align.target in starts else steps:
        nxt = next((c for c in consumers(node) if c.target in wanted), None)
        if nxt is None:
            if wanted == (OPS.silu_and_mul,):
                continue          # fused into moe_up_act
            break
        chain.append(nxt)
        node = nxt
        if nxt.target is OPS.moe_fused:
            break                 # fuse_moe: the whole chain in one op
    tail = next((c for c in consumers(node) if getattr(OPS, "all_reduce", None) is c.target), None) \
        if "all_reduce" in OPS else None
    return chain + ([tail] if tail is not None else [])


def _kda_chain(rec: fx.Node) -> list[fx.Node]:
    convs = [producer(a) for a in rec.args[:3]]
    convs = list(dict.fromkeys(c for c in convs if c.target in (OPS.kda_conv, OPS.kda_conv_staged, OPS.kda_conv_qkv)))
    norm = _only(list(consumers(rec)), OPS.gated_rmsnorm)
    return convs + [rec] + ([norm] if norm is not None else [])


def _layer_tag(node: fx.Node) -> str:
    m = re.match(r"model\.layers\.(\d+)", node.meta.get("lingc.scope", ""))
    return f"L{m.group(1)}" if m else "top"


def _mutated(node: fx.Node) -> set[fx.Node]:
    """Inputs an op updates in place (schema arguments marked as written, lists included)."""
    return written_inputs(node)


def _safe_to_hoist(node: fx.Node, members: set[fx.Node]) -> bool:
    """A kernel may move before the chain unless it writes state or reads state a chain member writes."""
    if _mutated(node):
        return False
    written_by_chain = set().union(*(_mutated(m) for m in members))
    return not (set(node.all_input_nodes) & written_by_chain)


# Kernels whose PDL path loads some inputs BEFORE gdc_wait: kernels/kda.py _kda_fused_kernel (the conv pools, the
# state pool, the slots), kernels/moe.py's down-GEMM preload (sorted_pairs, block_expert, total: the align's
# outputs) and up-GEMM shared-expert tile (x: moe_up_act's SHARED_EARLY), kernels/mla.py's q_absorb (q_nope). Safe
# when the launch just before them neither writes nor produces any of those buffers, since a PDL kernel's programs
# start only after the kernel two back has completed (kernels/pdl.py). Indices are the op's positional arguments.
PREWAIT_INPUTS = {"kda_fused_decode": (8, 9, 10, 13, 14), "kda_fused_verify": (8, 9, 10, 13, 14),
                  "moe_down": (2, 3, 4), "moe_down_pairs": (2,), "mla_attention": (0,), "moe_up_act": (0,),
                  "moe_up_act_pairs": (0,), "moe_down_routed": (2,)}
SHARED_LAST_PREWAIT = ("moe_up_act", "moe_up_act_pairs")   # x early only with fuse_shared_expert's shared_last hint


def _prewait_safe(node: fx.Node, short: str) -> bool:
    """False if the launch before `node` writes or produces a buffer `node` may read before its PDL wait."""
    prev = node.prev
    while prev.op != "root" and (prev.op != "call_function" or is_free(prev)):
        prev = prev.prev
    if prev.op == "root":
        return True
    if short in SHARED_LAST_PREWAIT and not node.meta.get("lingc.launch", {}).get("shared_last"):
        return True         # without the hint the up-GEMM reads nothing before its wait
    early = [node.args[i] for i in PREWAIT_INPUTS[short]]
    if written_buffers(prev) & {base_buffer(a) for a in early}:
        return False
    return all(not isinstance(a, fx.Node) or producer(a) is not prev for a in early)


def drop_unsafe_prewait(graph: fx.Graph) -> list[str]:
    """After every annotation (chains and solo): remove `lingc.pdl` from each PREWAIT_INPUTS kernel whose
    predecessor writes or produces its early inputs, so it launches without PDL (stream-ordered loads). Returns
    the names of the nodes it un-annotated."""
    dropped = []
    for short in PREWAIT_INPUTS:
        for node in calls(graph, short):
            if "lingc.pdl" in node.meta and not _prewait_safe(node, short):
                del node.meta["lingc.pdl"]
                dropped.append(node.name)
    return dropped


# Entry triggers (kernels/pdl.py): a short kernel of ENTRY_TRIGGER_OPS whose next launch is one of WEIGHTS_ONLY_PREWAIT
# (kernels/linear.py: before its PDL wait it reads its weight slice and nothing else: the Gluon TMA ring, the register
# preload) over at most its row limit gets the launch hint entry_trigger, so that linear's programs start, and read
# their weights, while the kernel before the norm still runs. Only the linear's own start moves; what it reads early
# is a weight. The default row limit, ENTRY_TRIGGER_MAX_ROWS, is kernels/linear_tma.py's MAX_ROWS (1): where the
# linear reads nothing early its programs only hold SM slots sooner. H200, one process
# (bench/results/step-ab-h200-20261203-h.json): greedy decode 1.164 / 1.164 ms against 1.182 / 1.198 without entry
# triggers; marking every op before verify's 6-row launches too made greedy verify 2.347 against 2.323 (the combine
# before the 31.5 MB KDA projection, a Triton linear that reads nothing early). The ops of ENTRY_TRIGGER_ROWS have
# their own, higher limit (below).
ENTRY_TRIGGER = True
ENTRY_TRIGGER_OPS = ("rmsnorm", "add_rmsnorm", "gated_rmsnorm", "combine_add_rmsnorm", "mla_attention",
                     "embedding_rmsnorm")
WEIGHTS_ONLY_PREWAIT = ("linear", "rmsnorm_linear", "add_rmsnorm_linear", "gated_rmsnorm_linear")
ENTRY_TRIGGER_MAX_ROWS = 1
# Per-op row limits over ENTRY_TRIGGER_MAX_ROWS: the KDA o_norm and MLA attention precede o_proj / the MLA dense,
# whose slices the Gluon path holds at verify's 6 rows too once launched early (kernels/linear_tma.py EARLY_MAX_ROWS):
# greedy verify 2.309 / 2.308 ms against 2.327 / 2.325 with one-row marks only, and 2.327 with these marks but the
# Triton linear (step-ab-h200-20261203-i.json); decode unchanged.
ENTRY_TRIGGER_ROWS: dict[str, int] = {"gated_rmsnorm": 16, "mla_attention": 16}
# A plain linear whose weight is at most ENTRY_TRIGGER_SMALL_WEIGHT_BYTES gets the row limit ENTRY_TRIGGER_SMALL_ROWS
# whatever op comes before it: its slice fits the Gluon TMA ring, which it then holds at verify's rows too (at
# Ling-3.0-tiny's size the MLA q_a / kv_a / gate projection after the combine: 6 layers of verify on the Triton dot,
# 3.65 us a launch against 2.62 for the one-row TMA launch in decode; launches-kda-tma-h200-20261204.json), while the
# 31.5 MB KDA projection, the loss measured above, stays past it. A shape rule in bytes, so the pass needs no device
# facts. At most kernels/linear_tma.py EARLY_MAX_ROWS (16): past it the linear stays on the Triton kernel, which
# reads nothing early (the case that measured slower). 0 (off): at 16 the H200 step measured greedy verify 2.1245 vs
# 2.1248 / 2.1267 ms (step-ab-h200-20261205.json, --variant 'small:lingc.passes.pdl.ENTRY_TRIGGER_SMALL_ROWS=16')
ENTRY_TRIGGER_SMALL_ROWS = 0
ENTRY_TRIGGER_SMALL_WEIGHT_BYTES = 8 << 20
# mla_prep -> mla_attention (PREP_ENTRY_TRIGGER, LINGC_PDL_PREP_ENTRY=1; off): mla_prep triggers at its entry. What
# runs early then: q_absorb's pre-wait part (kv_b, a weight) and, since q_absorb triggers at its entry
# (kernels/mla.py QA_ENTRY), the split's (positions and page rows, written at the step's head, and cache rows older
# than this step's first position; never the row mla_prep writes, which the split copies after its wait). Every
# kernel still waits before its exit, so the split's wait (q_absorb complete) still implies mla_prep's completion;
# what the extra entry trigger gives up is only "the launch two back has completed" at the split's pre-wait code, and
# nothing the split reads there comes from mla_prep. q_absorb's pre-wait code, though, runs EARLY by default: it loads
# q_nope, which the q_b projection two launches back writes, relying on mla_prep's trigger following mla_prep's wait;
# so the pass gives that mla_attention the launch hint late_q (q_absorb loads q after its wait). Up to
# PREP_ENTRY_MAX_ROWS tokens (decode, verify, the draft)
PREP_ENTRY_TRIGGER = env_flag("LINGC_PDL_PREP_ENTRY", False)
PREP_ENTRY_MAX_ROWS = 16
# the ops that may carry the entry_trigger hint (runtime/executor.py LAUNCH_HINTS lists the same)
ENTRY_TRIGGER_HINT_OPS = ENTRY_TRIGGER_OPS + ("mla_prep",)


def _rows(node: fx.Node) -> int | None:
    """Rows of a node's output (the product of its leading dims), or None without shape meta."""
    meta = node.meta.get("lingc.tensor")
    if meta is None or not getattr(meta, "shape", None):
        return None
    rows = 1
    for d in meta.shape[:-1]:
        rows *= int(d)
    return rows


def _weight_bytes(linear: fx.Node) -> float:
    """Bytes of a linear's weight (its second argument) from its shape meta; infinite without one."""
    meta = getattr(linear.args[1], "meta", {}).get("lingc.tensor") if len(linear.args) > 1 else None
    if meta is None or not getattr(meta, "shape", None):
        return float("inf")
    return math.prod(int(d) for d in meta.shape) * meta.dtype.itemsize


def _next_launch(node: fx.Node) -> fx.Node | None:
    """The next node after `node` that launches a kernel (views and getitems launch none), or None."""
    nxt = node.next
    while nxt.op != "root" and (nxt.op != "call_function" or is_free(nxt)):
        nxt = nxt.next
    return None if nxt.op == "root" else nxt


def mark_entry_triggers(graph: fx.Graph) -> list[str]:
    """After every annotation: give each PDL-launched ENTRY_TRIGGER_OPS node whose next launch is a PDL-launched
    WEIGHTS_ONLY_PREWAIT op of 1 to its row limit rows (ENTRY_TRIGGER_ROWS, else ENTRY_TRIGGER_MAX_ROWS) the launch
    hint entry_trigger, and that linear launched_early. Returns the names of the nodes it marked."""
    marked = []
    weights_only = {getattr(OPS, op) for op in WEIGHTS_ONLY_PREWAIT if op in OPS}
    for short in ENTRY_TRIGGER_OPS:
        for node in calls(graph, short):
            nxt = _next_launch(node)
            if nxt is None or nxt.target not in weights_only or "lingc.pdl" not in node.meta \
                    or "lingc.pdl" not in nxt.meta:
                continue
            rows = _rows(nxt)
            limit = ENTRY_TRIGGER_ROWS.get(short, ENTRY_TRIGGER_MAX_ROWS)
            if ENTRY_TRIGGER_SMALL_ROWS and nxt.target is OPS.linear \
                    and _weight_bytes(nxt) <= ENTRY_TRIGGER_SMALL_WEIGHT_BYTES:
                limit = max(limit, ENTRY_TRIGGER_SMALL_ROWS)
            if rows is not None and 1 <= rows <= limit:
                node.meta["lingc.launch"] = {**node.meta.get("lingc.launch", {}), "entry_trigger": True}
                if nxt.target is OPS.linear:     # its launcher may then take the Gluon path at more rows
                    nxt.meta["lingc.launch"] = {**nxt.meta.get("lingc.launch", {}), "launched_early": True}
                marked.append(node.name)
    if PREP_ENTRY_TRIGGER:
        for node in calls(graph, "mla_prep"):
            nxt = _next_launch(node)
            q_pe = node.args[0].meta.get("lingc.tensor") if isinstance(node.args[0], fx.Node) else None
            tokens = int(q_pe.shape[0]) * int(q_pe.shape[1]) if q_pe is not None and len(q_pe.shape) == 4 else None
            if nxt is not None and nxt.target is OPS.mla_attention and "lingc.pdl" in node.meta \
                    and "lingc.pdl" in nxt.meta and tokens is not None and 1 <= tokens <= PREP_ENTRY_MAX_ROWS:
                node.meta["lingc.launch"] = {**node.meta.get("lingc.launch", {}), "entry_trigger": True}
                nxt.meta["lingc.launch"] = {**nxt.meta.get("lingc.launch", {}), "late_q": True}
                marked.append(node.name)
    return marked


def _make_adjacent(graph: fx.Graph, chain: list[fx.Node]) -> tuple[list[list[fx.Node]], list[str]]:
    """Move independent kernels out from between chain members; split where a kernel depends on the chain."""
    order: dict[fx.Node, float] = {n: float(i) for i, n in enumerate(graph.nodes)}
    chain = sorted(set(chain), key=order.__getitem__)
    members, moved = set(chain), []
    between = [n for n in graph.nodes if order[chain[0]] < order[n] < order[chain[-1]]]
    pieces, current = [], [chain[0]]
    for node in between:
        if node in members:
            current.append(node)
        elif is_free(node) or not current:
            continue
        elif all(order[i] < order[current[0]] for i in node.all_input_nodes) and _safe_to_hoist(node, members):
            current[0].prepend(node)                 # independent of the chain: run it before the chain
            order[node] = order[current[0]] - 0.5
            moved.append(node.name)
        else:
            pieces.append(current)                   # needs a chain member: the chain ends here
            current = []
    if len(chain) > 1:
        current.append(chain[-1])
    pieces.append(current)
    return [p for p in pieces if len(p) > 1], moved


class Pdl(Pass):
    name = "pdl"
    summary = ("annotate PDL chains (router, MoE, KDA), the other kernels solo: every kernel PDL-launched; a norm "
               "before a linear that reads its weights early triggers at entry")
    after = ("fuse_swiglu", "fuse_moe_align", "fuse_projections", "fuse_add_norm", "bf16_router", "partition", "tp",
             "fuse_index_chains", "capture_metadata", "fuse_kda", "fuse_shared_expert", "fuse_norm_linear", "fuse_moe",
             "fuse_combine_norm", "fuse_relay", "fuse_mla", "fuse_cat_norm", "draft_vocab", "fuse_align_into_moe",
             "fuse_norm_router", "fuse_embed_norm", "fuse_simulate_accept", "fuse_relay_cat", "fuse_router_into_moe")
    changes_numerics = False

    def apply(self, program: Program) -> dict[str, Any]:
        chains: list[dict[str, Any]] = []
        moved_all: list[str] = []
        solo: dict[str, int] = {}
        unsafe: list[str] = []
        entry: list[str] = []
        for gname, graph in program.graphs.items():
            found: list[tuple[str, list[fx.Node]]] = []
            found += [("router", _router_chain(n)) for op in ("router_topk", "router_align") for n in calls(graph, op)]
            found += [("moe", _moe_chain(n)) for op in ("moe_align", "router_align", "moe_up_act_pairs",
                                                         "moe_up_act_routed")
                      for n in calls(graph, op)]
            found += [("moe", _moe_chain(n)) for n in calls(graph, "add_rmsnorm_router") if n.args[11]]   # aligned
            found += [("kda", _kda_chain(n))
                      for op in ("kda_recurrent", "kda_chunk", "kda_recurrent_staged", "kda_fused_verify",
                                 "kda_fused_decode")
                      for n in calls(graph, op)]
            seen: Counter[str] = Counter()    # the draft graph runs the MTP layer several times
            for kind, chain in found:
                if not chain:
                    continue
                pieces, moved = _make_adjacent(graph, chain)
                moved_all += [f"{gname}:{m}" for m in moved]
                if not pieces:
                    continue
                tag = f"{kind}@{_layer_tag(pieces[0][0])}"
                seen[tag] += 1
                tag += f"#{seen[tag]}" if seen[tag] > 1 else ""      # labels stay unique within a graph
                for k, piece in enumerate(pieces):
                    label = tag + (f".{k}" if len(pieces) > 1 else "")
                    for i, node in enumerate(piece):
                        node.meta["lingc.pdl"] = {"chain": label, "index": i, "length": len(piece),
                                                  "early_launch": i > 0}
                    chains.append({"graph": gname, "chain": label, "nodes": [n.name for n in piece]})
            if SOLO:
                for node in graph.nodes:
                    if node.op == "call_function" and not is_free(node) and "lingc.pdl" not in node.meta:
                        node.meta["lingc.pdl"] = dict(SOLO_META)
                        solo[gname] = solo.get(gname, 0) + 1
            unsafe += [f"{gname}:{name}" for name in drop_unsafe_prewait(graph)]
            if ENTRY_TRIGGER:
                entry += [f"{gname}:{name}" for name in mark_entry_triggers(graph)]
        return {"matches": len(chains), "chains": chains, "moved": moved_all, "solo": solo, "no_pdl": unsafe,
                "entry_trigger": entry}
