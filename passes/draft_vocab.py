"""draft_vocab (opt-in): the MTP draft proposes from a hot subset of the vocabulary (`lingc compile --draft-vocab
FILE`, a JSON list of token ids, `lingc draft-vocab` counts one from a corpus; SGLang's --speculative-token-map,
FR-Spec).

Why: every MTP forward ends in the full lm_head GEMV. At Ling-3.0-tiny's 157184 x 1536 that is 483 MB a forward,
4 in the draft and 1 in extend: ~555 us of a 3.4 ms NEXTN step on the H200, a sixth of its bytes. A map of N hot
tokens reads N / V of it.

The rewrite, in the MTP stages only (draft, extend and specialize_greedy's draft_greedy, extend_greedy; it runs after
partition): an lm_head GEMV (a `linear`, or output 0 of fuse_norm_linear's `rmsnorm_linear` / `add_rmsnorm_linear`)
reads `draft_vocab.lm_head.weight` [N, h] (lm_head's rows of the map, gathered at compile time) where its logits
reach nothing but
  * greedy_sample (the greedy copies; directly or through pick_position): each index i becomes the token map[i]
    (`embedding(i, draft_vocab.token_map [N, 1])`, one launch):
        lm_head_linear = lingc.linear(x, w_lm_head_weight, torch.float32)                     # [1, 1, V]
        draft_greedy_sample = lingc.greedy_sample(lm_head_linear)                             # [1, 1]
      ->
        lm_head_linear = lingc.linear(x, w_draft_vocab_lm_head_weight, torch.float32)         # [1, 1, N]
        draft_greedy_sample_hot = lingc.greedy_sample(lm_head_linear)                         # index into the map
        draft_greedy_sample_map = lingc.embedding(draft_greedy_sample_hot, w_draft_vocab_token_map)   # [1, 1, 1]
        draft_greedy_sample = aten.view(draft_greedy_sample_map, [1, 1])                     # the token
    The map is sorted at compile time, so argmax ties go to the lowest token id as in the full argmax.
  * filtered_probs (the general graphs, any sampling; directly or through pick_position): the request's
    temperature / top-k / top-p distribution q over the N hot tokens is widened to V, zero off the map
    (`vocab_expand(q, draft_vocab.inverse_map [V])`, one launch), and everything that read the distribution (the
    draft's sample_tokens, the relay that carries it to verify's chain_accept) reads the widened one:
        draft_filtered_probs = lingc.filtered_probs(lm_head_linear, T, k, p)                  # [1, 1, N]
        draft_filtered_probs_full = lingc.vocab_expand(draft_filtered_probs, w_draft_vocab_inverse_map)  # [1, 1, V]

Lossless either way: verify still checks each proposal against the target. Greedy rows accept while the proposal
is the target's argmax, so a greedy request gets plain decoding's tokens (tests/passes/test_draft_vocab.py); sampled
rows accept with min(1, p / q) and resample from norm(max(0, p - q)) with q the widened draft distribution, which is
the speculative-sampling rule for any draft distribution (Leviathan et al. 2023), so the emitted tokens follow the
target's. Only the proposals change (the best or a sampled hot token), and with them the accept lengths. How much
acceptance a map costs depends on the model and the map (FR-Spec reports small drops for the most frequent tokens
of a corpus); with random weights it cannot be measured here. Untouched: the target, the host-fed MTP prefill that
proposes a request's first d1. Not with `--tp` (the map is not sharded).
"""

from __future__ import annotations

import operator
from collections import Counter
from typing import Any

import torch
import torch.fx as fx

from lingc.ops import OPS
from lingc.program import Program
from lingc.passes.base import Pass
from lingc.passes.matchers import carried_meta, get_weight_node
from lingc.steps import COPY_SUFFIXES

GRAPHS = tuple(stage + sfx for sfx in ("",) + COPY_SUFFIXES for stage in ("draft", "extend"))   # the MTP stages
LM_HEAD = "lm_head.weight"
HOT_WEIGHT, TOKEN_MAP = "draft_vocab.lm_head.weight", "draft_vocab.token_map"
INVERSE_MAP = "draft_vocab.inverse_map"      # [V] int32: a token's index in the map, -1 off it (vocab_expand)
OPTION = "draft_vocab"                       # Program.options key: the token ids (compile --draft-vocab)


class DraftVocabError(ValueError):
    """A bad or missing token map; the message names the problem."""


def check_token_map(ids: Any, vocab_size: int, source: str = "the token map") -> list[int]:
    """The map as sorted unique ints in [0, vocab_size); raises DraftVocabError naming what is wrong."""
    if not isinstance(ids, (list, tuple)) or not ids:
        raise DraftVocabError(f"{source}: want a non-empty JSON list of token ids, got {type(ids).__name__}")
    bad = [x for x in ids if isinstance(x, bool) or not isinstance(x, int)]
    if bad:
        raise DraftVocabError(f"{source}: token ids must be integers, got {bad[:5]}")
    out = [x for x in ids if not 0 <= x < vocab_size]
    if out:
        raise DraftVocabError(f"{source}: token ids {out[:5]} are outside the vocabulary [0, {vocab_size})")
    dup = sorted(x for x, n in Counter(ids).items() if n > 1)
    if dup:
        raise DraftVocabError(f"{source}: token ids repeat, e.g. {dup[:5]}")
    return sorted(ids)


def _is_lm_head(a: Any) -> bool:
    return isinstance(a, fx.Node) and a.op == "get_attr" and a.target == LM_HEAD


def _reads_lm_head(node: fx.Node) -> bool:
    return any(_is_lm_head(a) for a in node.args)


def _logits(node: fx.Node) -> fx.Node | None:
    """The logits value of an lm_head GEMV: a `linear` itself, or output 0 (a getitem) of a fused norm + linear
    (rmsnorm_linear / add_rmsnorm_linear, which fuse_norm_linear builds where lm_head is small, e.g. test-tiny)."""
    if node.target is OPS.linear:
        return node
    if node.target in (OPS.rmsnorm_linear, OPS.add_rmsnorm_linear):
        firsts = [u for u in node.users if u.target is operator.getitem and u.args[1] == 0]
        return firsts[0] if len(firsts) == 1 else None
    return None


def _readers(logits: fx.Node, op) -> list[fx.Node] | None:
    """The `op` nodes (greedy_sample or filtered_probs) the logits reach, directly or through pick_position, or None
    if anything else reads them."""
    out = []
    for user in logits.users:
        if user.target is op and user.args[0] is logits:
            out.append(user)
        elif user.target is OPS.pick_position and user.args[0] is logits and \
                all(u.target is op and u.args[0] is user for u in user.users):
            out += list(user.users)
        else:
            return None
    return out or None


class DraftVocab(Pass):
    name = "draft_vocab"
    summary = ("MTP draft over a hot token subset (--draft-vocab FILE): lm_head rows of the map; a greedy index mapped "
               "back to its token, a sampled distribution widened to the vocabulary; lossless (verify checks every "
               "proposal)")
    after = ("specialize_greedy", "specialize_sampling", "partition", "fuse_norm_linear", "fuse_projections",
             "bf16_router")
    requires = ("partition",)                 # the greedy copies are rewritten where specialize_greedy made them
    # declared as a change: the draft's proposals (relays) differ, though a greedy request's tokens do not; no graph
    # output changes (the step graphs have none), so --verify's gate is the tokens' equality it reports
    changes_numerics = True
    tolerance = 0.0
    in_all = False

    def apply(self, program: Program) -> dict[str, Any]:
        ids = program.options.get(OPTION)
        if isinstance(ids, dict):                                          # already applied (a second run)
            return {"matches": 0, "rewritten": [], "skipped": {}}
        if ids is None:
            raise DraftVocabError("the draft_vocab pass needs a token map: lingc compile --draft-vocab FILE (a JSON "
                                  "list of token ids)")
        ids = check_token_map(ids, program.config.vocab_size)
        if LM_HEAD not in program.weights:
            raise DraftVocabError(f"draft_vocab: the program has no {LM_HEAD!r} weight")
        rewritten: list[str] = []
        skipped: dict[str, str] = {}
        for gname in GRAPHS:
            graph = program.graphs.get(gname)
            if graph is None:
                skipped[gname] = ("no such graph (draft / extend come from partition, their _greedy copies from "
                                  "specialize_greedy)")
                continue
            for lin in [n for n in graph.nodes if n.op == "call_function" and _reads_lm_head(n)]:
                logits = _logits(lin)
                samples = _readers(logits, OPS.greedy_sample) if logits is not None else None
                dists = _readers(logits, OPS.filtered_probs) if logits is not None and samples is None else None
                if samples is None and dists is None:
                    skipped[f"{gname}:{lin.name}"] = "its logits reach more than greedy_sample or filtered_probs"
                    continue
                hot = get_weight_node(graph, HOT_WEIGHT, lin)
                lin.args = tuple(hot if _is_lm_head(a) else a for a in lin.args)
                if samples is not None:
                    table = get_weight_node(graph, TOKEN_MAP, lin)
                    for sample in samples:
                        self._map_back(graph, sample, table)
                else:
                    inverse = get_weight_node(graph, INVERSE_MAP, lin)
                    for dist in dists:
                        self._widen(graph, dist, inverse)
                rewritten.append(f"{gname}:{lin.name}")
        if rewritten:
            index = torch.tensor(ids, dtype=torch.long)
            lm_head = program.weights[LM_HEAD]
            program.weights[HOT_WEIGHT] = lm_head.index_select(0, index.to(lm_head.device)).contiguous()
            program.weights[TOKEN_MAP] = index.view(-1, 1).contiguous()
            inverse = torch.full((lm_head.shape[0],), -1, dtype=torch.int32)
            inverse[index] = torch.arange(len(ids), dtype=torch.int32)
            program.weights[INVERSE_MAP] = inverse
            program.weight_info[HOT_WEIGHT] = {"draft_vocab_rows_of": LM_HEAD}
            for name in (TOKEN_MAP, INVERSE_MAP):         # only the graphs that read them keep a get_attr of them
                if not any(n.op == "get_attr" and n.target == name for g in program.graphs.values() for n in g.nodes):
                    del program.weights[name]
        for graph in program.graphs.values():
            for n in [n for n in graph.nodes if n.op == "get_attr" and not n.users]:
                graph.erase_node(n)
        program.options[OPTION] = {"size": len(ids), "first": ids[:8]}
        return {"matches": len(rewritten), "rewritten": rewritten, "skipped": skipped, "hot_tokens": len(ids)}

    @staticmethod
    def _map_back(graph: fx.Graph, sample: fx.Node, table: fx.Node) -> None:
        """sample (an index into the map) -> the token: embedding(index, map [N, 1]) viewed as sample's shape."""
        users = list(sample.users)
        name = sample.name
        sample._rename(name + "_hot")
        with graph.inserting_after(sample):
            token = graph.call_function(OPS.embedding, (sample, table))
        with graph.inserting_after(token):
            view = graph.call_function(torch.ops.aten.view.default, (token, list(sample.meta["lingc.tensor"].shape)))
        for node, tag in ((token, "_map"), (view, "")):
            node.meta = carried_meta(sample)
            node._rename(name + tag)
        for user in users:
            user.replace_input_with(sample, view)

    @staticmethod
    def _widen(graph: fx.Graph, dist: fx.Node, inverse: fx.Node) -> None:
        """dist (filtered_probs over the map) -> vocab_expand(dist, inverse_map) for every reader of dist."""
        users = list(dist.users)
        with graph.inserting_after(dist):
            full = graph.call_function(OPS.vocab_expand, (dist, inverse))
        full.meta = carried_meta(dist)
        full._rename(dist.name + "_full")
        for user in users:
            user.replace_input_with(dist, full)
