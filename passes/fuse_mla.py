"""fuse_mla: an MLA layer's rope / norm / cat / cache-write kernels -> one mla_prep; its head gate -> mla_attention.

At batch 1 an MLA layer's small kernels cost mostly launches (about 1.2-1.9 us each on the H200). Two rewrites, in
every graph that has the pattern (decode, step, prefill, draft / verify / extend, the MTP programs); B batch, T tokens,
H heads, Rr rope dim, R kv_lora_rank, Vd value dim (test-tiny: H 4, Rr 16, R 64, Vd 32).

1. rope(q_pe) + [rmsnorm(c_kv) | rope(k_pe)] written by mla_cache_write -> mla_prep (5 launches -> 1).
Before (test-tiny decode, layer 3, after every other pass of `all`):
    L3_attention_getitem_1 = getitem(L3_attention_split_with_sizes, 1)                    # q_pe [B, T, H, Rr]
    L3_attention_rope = lingc.rope(L3_attention_getitem_1, positions, 10000.0)           # [B, T, H, Rr]
    L3_attention_getitem_2 = getitem(L3_attention_split_with_sizes_1, 0)                  # c_kv [B, T, R]
    L3_attention_getitem_3 = getitem(L3_attention_split_with_sizes_1, 1)                  # k_pe [B, T, Rr]
    L3_attention_unsqueeze = aten.unsqueeze(L3_attention_getitem_3, 2)
    L3_attention_rope_1 = lingc.rope(L3_attention_unsqueeze, positions, 10000.0)         # [B, T, 1, Rr]
    L3_attention_squeeze = aten.squeeze.dim(L3_attention_rope_1, 2)
    L3_attention_kv_a_layernorm_rmsnorm = lingc.rmsnorm(L3_attention_getitem_2, w_L3_attention_kv_a_layernorm_weight,
                                                        1e-06)                            # [B, T, R]
    L3_attention_cat = aten.cat([L3_attention_kv_a_layernorm_rmsnorm, L3_attention_squeeze], -1)   # [B, T, R + Rr]
    L3_attention_mla_cache_write = lingc.mla_cache_write(state_layers_3_kv_pages, L3_attention_cat, getitem_1)
    L3_attention_mla_attention = lingc.mla_attention(L3_attention_getitem, L3_attention_rope, state_layers_3_kv_pages,
        w_L3_attention_kv_b_proj_weight, getitem, positions, 0.144...)                   # [B, T, H, Vd]
After:
    L3_attention_mla_prep = lingc.mla_prep(L3_attention_getitem_1, L3_attention_getitem_2, L3_attention_getitem_3,
        w_L3_attention_kv_a_layernorm_weight, state_layers_3_kv_pages, getitem_1, positions, 10000.0, 1e-06)
    L3_attention_mla_attention = lingc.mla_attention(L3_attention_getitem, L3_attention_mla_prep, ...)
mla_prep runs where the cache write ran (every input exists by then, and the attention that reads the cache and
q_rope comes after it); the ropes, the norm and the cat move down to it, so nothing between may write what they
read. It matches only the traced shape: the attention reading this cache next takes the q rope as its q_rope, both
ropes have one positions node and theta, and no intermediate (the k rope, its views, the norm, the cat, the q rope)
has another reader. Anything else is left as it is.

2. sigmoid_gate(mla_attention(...), g) -> mla_attention(..., g) when the gate is the attention's only reader
(-1 launch: v_absorb applies the gate in its epilogue).
Before:
    L3_attention_mla_attention = lingc.mla_attention(L3_attention_getitem, L3_attention_mla_prep, ..., 0.144...)
    L3_attention_g_proj_linear = getitem(L3_attention_fused_q_a_kv_a_g_split, 2)          # g [B, T, H]
    L3_attention_sigmoid_gate = lingc.sigmoid_gate(L3_attention_mla_attention, L3_attention_g_proj_linear)
    L3_attention_view_1 = aten.view(L3_attention_sigmoid_gate, [1, 1, -1])
After:
    L3_attention_g_proj_linear = getitem(L3_attention_fused_q_a_kv_a_g_split, 2)
    L3_attention_mla_attention = lingc.mla_attention(L3_attention_getitem, L3_attention_mla_prep, ..., 0.144...,
                                                     L3_attention_g_proj_linear)          # [B, T, H, Vd], gated
    L3_attention_view_1 = aten.view(L3_attention_mla_attention, [1, 1, -1])
The gated attention runs where the gate ran (g may be made after the attention: its projection is traced later).

-5 launches per MLA layer (6 -> 1). Test-tiny decode and step (3 MLA layers): rope 6 -> 0, rmsnorm 3 -> 0, cat 3 -> 0,
mla_cache_write 3 -> 0, sigmoid_gate 3 -> 0, mla_prep 3. Prefill runs mla_attention too, so both rewrites apply there;
in the MTP graphs the MTP layer's enorm / hnorm and their cat stay.

Numerics unchanged. The ops' references are the compositions they replace (lingc/ops/mla.py), so the reference
backend gives the same bits. The kernels run the replaced kernels' arithmetic (kernels/mla.py): the norm is
kernels/rmsnorm.py's row code at that kernel's block shape, warps and fp fusion (the same PTX reduction sequence for
sm_90 at Ling-3.0-tiny's shapes: tests/kernels/test_mla_prep_sm90.py), the ropes the rope kernel's code with its
products as explicit mul.rn (so the norm's fp fusion cannot contract them; the float SASS instructions match the
fusion-off rope kernel's), the gate the sigmoid_gate kernel's code on v_absorb's rounded output. Bit-equal on the
H200 at 1 and 6 tokens, PDL on and off (bench/kernel_mla.py's mla_prep and mla_attention+gate rows); the
interpreter (tests/kernels/test_mla_prep.py, test_mla.py) is bit-exact.

TP: mla_prep's q_rope and the gate carry the heads, so after the tp pass they have the rank's H / N heads like
q_pe and g; the latent row and the cache stay whole (kv_a and its norm are replicated, every rank writes the same
row). tests/tp/test_tp_fuse_mla.py.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from lingc.ops import OPS
from lingc.program import Program
from lingc.passes.base import Pass
from lingc.passes.matchers import base_buffer as _base, calls, carried_meta, written_buffers as _writes

aten = torch.ops.aten


def _can_delay(order: dict[fx.Node, int], nodes: list[fx.Node], members: list[fx.Node], to: fx.Node) -> bool:
    """Running each (pure) member just before `to` gives the same values: nothing in between writes what it reads."""
    for member in members:
        reads = {_base(i) for i in member.all_input_nodes}
        if any(_writes(other) & reads for other in nodes[order[member] + 1:order[to]]):
            return False
    return True


def _only_reader(node: fx.Node, reader: fx.Node) -> bool:
    return set(node.users) == {reader}


def _renamed(node: fx.Node, old: str, new: str) -> str:
    return node.name.replace(old, new) if old in node.name else f"{node.name}_{new}"


# ---- 1. rope / rmsnorm / cat / cache write -> mla_prep ----------------------------------------------------

def _prep_members(graph: fx.Graph, write: fx.Node) -> dict[str, Any] | None:
    """The nodes rewrite 1 replaces, keyed by role, when `write` (an mla_cache_write) has exactly the traced shape."""
    if write.kwargs or len(write.args) != 3 or write.users:
        return None
    kv_pages, cat, cache_locs = write.args
    if not isinstance(cat, fx.Node) or cat.target is not aten.cat.default or not _only_reader(cat, write) \
            or len(cat.args) != 2 or cat.args[1] not in (-1, 2) or len(cat.args[0]) != 2:
        return None
    norm, k_sq = cat.args[0]
    if norm.target is not OPS.rmsnorm or norm.kwargs or not _only_reader(norm, cat) \
            or k_sq.target is not aten.squeeze.dim or k_sq.args[1:] != (2,) or not _only_reader(k_sq, cat):
        return None
    rope_k = k_sq.args[0]
    if rope_k.target is not OPS.rope or rope_k.kwargs or not _only_reader(rope_k, k_sq):
        return None
    k_unsq, positions, theta = rope_k.args
    if k_unsq.target is not aten.unsqueeze.default or k_unsq.args[1:] != (2,) or not _only_reader(k_unsq, rope_k):
        return None
    attention = next((n for n in list(graph.nodes)[list(graph.nodes).index(write) + 1:]
                      if _base(kv_pages) in {_base(i) for i in n.all_input_nodes}), None)
    if attention is None or attention.target is not OPS.mla_attention or attention.args[2] is not kv_pages:
        return None                                   # the next reader of this cache is not its attention
    rope_q = attention.args[1]
    if not isinstance(rope_q, fx.Node) or rope_q.target is not OPS.rope or rope_q.kwargs \
            or rope_q.args[1:] != (positions, theta) or not _only_reader(rope_q, attention):
        return None
    c_kv, k_pe = norm.args[0], k_unsq.args[0]
    if c_kv.meta["lingc.tensor"].dtype != k_pe.meta["lingc.tensor"].dtype:
        return None                                   # the cat would promote; the kernel rounds to one dtype
    return {"write": write, "cat": cat, "norm": norm, "k_sq": k_sq, "rope_k": rope_k, "k_unsq": k_unsq,
            "rope_q": rope_q, "args": (rope_q.args[0], c_kv, k_pe, norm.args[1], kv_pages, cache_locs, positions,
                                       theta, norm.args[2])}


def _fuse_prep(graph: fx.Graph, write: fx.Node) -> fx.Node | None:
    """mla_prep in place of `write` and the rope / norm / cat nodes only it (and the attention) read, or None."""
    found = _prep_members(graph, write)
    if found is None:
        return None
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    moved = [found[k] for k in ("rope_q", "norm", "rope_k")]
    inputs = [a for a in found["args"] if isinstance(a, fx.Node)]
    if any(order[i] >= order[write] for i in inputs) or not _can_delay(order, nodes, moved, write):
        return None                                   # an input made after the write, or one written in between
    with graph.inserting_before(write):
        fused = graph.call_function(OPS.mla_prep, found["args"])
    fused.meta = carried_meta(write)
    found["rope_q"].replace_all_uses_with(fused)
    for role in ("write", "cat", "norm", "k_sq", "rope_k", "k_unsq", "rope_q"):
        graph.erase_node(found[role])
    fused._rename(_renamed(write, "mla_cache_write", "mla_prep"))
    return fused


# ---- 2. sigmoid_gate(mla_attention) -> mla_attention(..., gate) -------------------------------------------

def _fuse_gate(graph: fx.Graph, gate: fx.Node) -> fx.Node | None:
    """The gated mla_attention in place of `gate` (a sigmoid_gate reading an ungated attention only it reads)."""
    if gate.kwargs or len(gate.args) != 2:
        return None
    attention, logits = gate.args
    if not isinstance(attention, fx.Node) or attention.target is not OPS.mla_attention or attention.kwargs \
            or len(attention.args) != 7 or not _only_reader(attention, gate):
        return None
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    if not _can_delay(order, nodes, [attention], gate):
        return None                                   # something between writes the cache (or another input)
    gate.prepend(attention)                           # the attention node itself moves (its name stays)
    attention.args = (*attention.args, logits)
    attention.meta.pop("lingc.pdl", None)
    gate.replace_all_uses_with(attention)
    graph.erase_node(gate)
    return attention


class FuseMla(Pass):
    name = "fuse_mla"
    summary = ("an MLA layer's q/k rope, kv_a norm, cat and cache write -> mla_prep; sigmoid_gate -> "
               "mla_attention's epilogue")
    after = ("partition",)
    changes_numerics = False

    def apply(self, program: Program) -> dict[str, Any]:
        fused: dict[str, list[str]] = {"mla_prep": [], "gated_attention": []}
        for gname, graph in program.graphs.items():
            for write in calls(graph, "mla_cache_write"):
                node = _fuse_prep(graph, write)
                if node is not None:
                    fused["mla_prep"].append(f"{gname}:{node.name}")
            for gate in calls(graph, "sigmoid_gate"):
                node = _fuse_gate(graph, gate)
                if node is not None:
                    fused["gated_attention"].append(f"{gname}:{node.name}")
        return {"matches": sum(map(len, fused.values())), **fused}
