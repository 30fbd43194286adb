"""fuse_embed_norm: a token embedding and the norm that reads it -> one launch that gathers the row and normalises it.

At batch 1 the embedding is a ~1 us launch that copies one table row per token, which the next launch, a norm, reads
back: layer 0's input norm in the decode step, verify and prefill, the MTP layer's [enorm; hnorm] in every MTP
forward (4 in the draft, 1 in extend). The fused ops run the norm kernels on the table row the token id names
(kernels/rmsnorm.py GATHER).

Before (the decode step; h hidden):
    model_embedding = lingc.embedding(getitem, w_model_word_embeddings_weight)                     # [B, T, h]
    L0_input_layernorm_rmsnorm = lingc.rmsnorm(model_embedding, w_L0_input_layernorm_weight, 1e-06)
    ... L0_post_attention_layernorm_add_rmsnorm = lingc.add_rmsnorm(model_embedding, ...)       # the residual
After:
    model_embedding_rmsnorm = lingc.embedding_rmsnorm(getitem, w_model_word_embeddings_weight,
                                                      w_L0_input_layernorm_weight, 1e-06)       # (normed, x)
    L0_input_layernorm_rmsnorm = getitem(model_embedding_rmsnorm, 0)
    model_embedding = getitem(model_embedding_rmsnorm, 1)
Before / after (an MTP forward, after fuse_cat_norm):
    draft_embedding = lingc.embedding(draft_view_1, w_model_word_embeddings_weight)
    L6_cat = lingc.rmsnorm_cat(draft_embedding, w_L6_enorm_weight, draft_view_2, w_L6_hnorm_weight, 1e-06)
    ->
    L6_cat = lingc.embedding_rmsnorm_cat(draft_view_1, w_model_word_embeddings_weight, w_L6_enorm_weight,
                                         draft_view_2, w_L6_hnorm_weight, 1e-06)
Matched: an embedding read by exactly one rmsnorm as its input (other readers, the residual adds, read the fused
op's second output), or read only by an rmsnorm_cat as its first input, in the same NEXTN stage. An embedding whose
norm fuse_norm_linear folded into a linear (rmsnorm_linear: test-tiny's layer 0, whose projection is small) is left
alone; so are the draft_vocab pass's token-map lookups (no norm reads them). Order: after fuse_norm_linear and
fuse_cat_norm, whose outputs it matches; before pdl.

Numerics unchanged: the ops' references are the compositions (lingc/ops/norm.py), and the kernels are the norm
kernels with only the row's address changed, the embedding being an exact copy (tests/kernels/test_rmsnorm.py:
bit for bit against embedding + norm). Saved: one launch and the row's round trip per match (Ling-3.0-tiny: 1 in
the decode step, verify and prefill, 4 in the draft, 1 in extend).
"""

from __future__ import annotations

import operator
from typing import Any

import torch.fx as fx

from lingc.ops import OPS
from lingc.program import Program
from lingc.passes.base import Pass
from lingc.passes.matchers import KEEP_META_CAPTURE, carried_meta


def _same_stage(a: fx.Node, b: fx.Node) -> bool:
    return a.meta.get("lingc.stage") == b.meta.get("lingc.stage")


def _norm_reader(emb: fx.Node) -> fx.Node | None:
    """The one rmsnorm reading `emb` as its input (its other readers may be anything), or the rmsnorm_cat that is
    its only reader with `emb` as x1; None otherwise."""
    users = list(emb.users)
    if len(users) == 1 and users[0].target is OPS.rmsnorm_cat and users[0].args[0] is emb \
            and users[0].args[2] is not emb and _same_stage(emb, users[0]):
        return users[0]
    norms = [u for u in users if u.target is OPS.rmsnorm]
    if len(norms) != 1 or norms[0].args[0] is not emb or not _same_stage(emb, norms[0]):
        return None
    return norms[0]


def _fuse_norm(graph: fx.Graph, emb: fx.Node, norm: fx.Node) -> fx.Node:
    """embedding_rmsnorm in the embedding's place (every reader of either comes after it); the norm and the
    embedding become its getitems 0 and 1 under their own names."""
    ids, table = emb.args
    _, weight, eps = norm.args
    if weight.op == "get_attr" and _comes_after(graph, weight, emb):
        emb.prepend(weight)                            # a weight read is free to move up; the fused op needs it here
    with graph.inserting_before(emb):
        fused = graph.call_function(OPS.embedding_rmsnorm, (ids, table, weight, eps))
    fused.meta = carried_meta(emb)
    fused._rename(f"{emb.name}_rmsnorm")
    norm.target, norm.args, norm.kwargs = operator.getitem, (fused, 0), {}
    emb.target, emb.args, emb.kwargs = operator.getitem, (fused, 1), {}
    if not emb.users:                                  # nothing but the norm read the row (not in Ling-3's graphs)
        graph.erase_node(emb)
    return fused


def _comes_after(graph: fx.Graph, node: fx.Node, ref: fx.Node) -> bool:
    """Whether `node` comes after `ref` in graph order (a weight read there must move up to be read at ref's place)."""
    for n in graph.nodes:
        if n is node:
            return False
        if n is ref:
            return True
    return False


class FuseEmbedNorm(Pass):
    name = "fuse_embed_norm"
    summary = "embedding + the rmsnorm / rmsnorm_cat reading it -> one embedding_rmsnorm[_cat] (the norm on the row)"
    after = ("fuse_norm_linear", "fuse_cat_norm", "partition", "draft_vocab")
    changes_numerics = False

    def apply(self, program: Program) -> dict[str, Any]:
        fused: list[str] = []
        for gname, graph in program.graphs.items():
            for emb in [n for n in graph.nodes if n.op == "call_function" and n.target is OPS.embedding]:
                norm = _norm_reader(emb)
                if norm is None:
                    continue
                if norm.target is OPS.rmsnorm_cat:
                    ids, table = emb.args
                    _, w1, x2, w2, eps = norm.args
                    norm.target, norm.args = OPS.embedding_rmsnorm_cat, (ids, table, w1, x2, w2, eps)
                    norm.meta = carried_meta(norm, KEEP_META_CAPTURE)
                    graph.erase_node(emb)
                    fused.append(f"{gname}:{norm.name}")
                else:
                    fused.append(f"{gname}:{_fuse_norm(graph, emb, norm).name}")
        return {"matches": len(fused), "fused": fused}
