"""draft_vocab (opt-in): the greedy MTP draft proposes from a hot subset of the vocabulary (`lingc compile
--draft-vocab FILE`, a JSON list of token ids; SGLang's --speculative-token-map, FR-Spec).

Why: every MTP forward ends in the full lm_head GEMV. At Ling-3.0-tiny's 157184 x 1536 that is 483 MB a forward,
4 in the draft and 1 in extend: ~555 us of a 3.4 ms NEXTN step on the H200, a sixth of its bytes. A map of N hot
tokens reads N / V of it.

The rewrite, in the greedy copies of the MTP stages only (draft_greedy, extend_greedy: specialize_greedy's, so it
runs after partition): an lm_head `linear` whose logits reach nothing but greedy_sample (directly or through
pick_position) reads `draft_vocab.lm_head.weight` [N, h] (lm_head's rows of the map, gathered at compile time),
and each greedy_sample's index i becomes the token map[i] (`embedding(i, draft_vocab.token_map [N, 1])`, one launch):
    lm_head_linear = lingc.linear(x, w_lm_head_weight, torch.float32)                     # [1, 1, V]
    draft_greedy_sample = lingc.greedy_sample(lm_head_linear)                             # [1, 1]
  ->
    lm_head_linear = lingc.linear(x, w_draft_vocab_lm_head_weight, torch.float32)         # [1, 1, N]
    draft_greedy_sample_hot = lingc.greedy_sample(lm_head_linear)                         # index into the map
    draft_greedy_sample_map = lingc.embedding(draft_greedy_sample_hot, w_draft_vocab_token_map)   # [1, 1, 1]
    draft_greedy_sample = aten.view(draft_greedy_sample_map, [1, 1])                     # the token
The map is sorted at compile time, so argmax ties go to the lowest token id as in the full argmax.

Lossless: verify still checks each proposal against the target's own argmax, so a greedy request gets plain
decoding's tokens with or without the pass (tests/passes/test_draft_vocab.py); only the proposals change (the best
hot token), and with them the accept lengths. How much acceptance a map costs depends on the model and the map
(FR-Spec reports small drops for the most frequent tokens of a corpus); with random weights it cannot be measured
here. Untouched: the target, the general graphs (sampled requests draft over the full vocabulary), the host-fed MTP
prefill that proposes a request's first d1. Not with `--tp` (the map is not sharded).
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
from lingc.passes.matchers import get_weight_node
from lingc.steps import GREEDY_SUFFIX

GRAPHS = ("draft" + GREEDY_SUFFIX, "extend" + GREEDY_SUFFIX)      # the MTP stages a greedy request runs
LM_HEAD = "lm_head.weight"
HOT_WEIGHT, TOKEN_MAP = "draft_vocab.lm_head.weight", "draft_vocab.token_map"
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


def _greedy_readers(logits: fx.Node) -> list[fx.Node] | None:
    """The greedy_sample nodes the logits reach (directly or through pick_position), or None if anything else reads
    them."""
    out = []
    for user in logits.users:
        if user.target is OPS.greedy_sample:
            out.append(user)
        elif user.target is OPS.pick_position and user.args[0] is logits and \
                all(u.target is OPS.greedy_sample for u in user.users):
            out += list(user.users)
        else:
            return None
    return out or None


class DraftVocab(Pass):
    name = "draft_vocab"
    summary = ("greedy MTP draft over a hot token subset (--draft-vocab FILE): lm_head rows of the map, argmax "
               "index mapped back to its token; lossless (verify checks every proposal)")
    after = ("specialize_greedy", "partition", "fuse_norm_linear", "fuse_projections", "bf16_router")
    requires = ("specialize_greedy", "partition")
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
                skipped[gname] = "no such graph (draft_vocab runs on specialize_greedy's copies, after partition)"
                continue
            for lin in [n for n in graph.nodes if n.op == "call_function" and _reads_lm_head(n)]:
                logits = _logits(lin)
                samples = _greedy_readers(logits) if logits is not None else None
                if samples is None:
                    skipped[f"{gname}:{lin.name}"] = "its logits reach more than greedy_sample"
                    continue
                hot = get_weight_node(graph, HOT_WEIGHT, lin)
                lin.args = tuple(hot if _is_lm_head(a) else a for a in lin.args)
                table = get_weight_node(graph, TOKEN_MAP, lin)
                for sample in samples:
                    self._map_back(graph, sample, table)
                rewritten.append(f"{gname}:{lin.name}")
        if rewritten:
            index = torch.tensor(ids, dtype=torch.long)
            lm_head = program.weights[LM_HEAD]
            program.weights[HOT_WEIGHT] = lm_head.index_select(0, index.to(lm_head.device)).contiguous()
            program.weights[TOKEN_MAP] = index.view(-1, 1).contiguous()
            program.weight_info[HOT_WEIGHT] = {"draft_vocab_rows_of": LM_HEAD}
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
            node.meta = {k: sample.meta[k] for k in ("lingc.scope", "lingc.stage") if k in sample.meta}
            node._rename(name + tag)
        for user in users:
            user.replace_input_with(sample, view)
