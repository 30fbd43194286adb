"""specialize_greedy: add greedy-only copies of the engine step graphs (`step` -> `step_greedy`, `nextn` ->
`nextn_greedy`, which partition splits into draft_greedy / verify_greedy / extend_greedy).

A step graph must serve any request, so it builds each position's sampling distribution (filtered_probs: 7
launches per call on the H200, whatever the row's parameters, since the host cannot see them) and draws from it,
even when the request is greedy. A greedy request (temperature 0) needs only argmaxes. The engine picks the
greedy copies for a request with temperature 0 (runtime/engine.py), the general graphs otherwise.

The rewrite, in a copy of the graph, with temperature known to be 0 (each filtered_probs row is then the one-hot
of its logits' argmax, lowest id on ties):
    sample_tokens(filtered_probs(x, T, k, p), u)                  -> greedy_sample(x)
    chain_accept(ids, draft_probs, filtered_probs(x, ...), x, T, u) -> greedy_accept(ids, x)
    scatter_rows(relay_draft_first_probs, slots, probs)             -> removed (read only for sampled rows)
then dead-code elimination drops the distributions, the draft's probs cat, the sampling-parameter gathers and
the uniforms nobody reads. Kept as in the general graph: every relay and state write, including rng_counter's
advance, so a request's uniforms do not depend on which copy ran. Before / after (test-tiny, `step`):
    filtered_probs = lingc.filtered_probs(lm_head_linear, temperature, top_k, top_p)   # [1, 1, V]
    uniform = lingc.uniform(seed, rng_counter, 1)
    sample_tokens = lingc.sample_tokens(filtered_probs, uniform)
  ->
    greedy_sample = lingc.greedy_sample(lm_head_linear)                                # [1, 1]
A graph with a filtered_probs read by anything else is left without a greedy copy (`skipped` in the record says
which node).

Numerics: a greedy request gets the same tokens, accept lengths and relays from the copies as from the general
graphs (the argmax both take is exact; sample_tokens on a one-hot returns its id for any u in [0, 1)), except
relay_draft_first_probs, which only sampled rows read. Nothing the general graphs compute changes.
Saved on Ling-3.0-tiny (H200): per filtered_probs 7 launches; per sample_tokens 2 launches -> 2 (argmax); the
probs cat and relay. bench/device_step.py measures both sets.
"""

from __future__ import annotations

import copy
from typing import Any

import torch.fx as fx

from lingc.ops import OPS
from lingc.program import Program
from lingc.passes.base import Pass
from lingc.passes.matchers import calls, carried_meta
from lingc.steps import GREEDY_SUFFIX

SOURCES = ("step", "nextn")                 # the engine step graphs as traced (lingc.steps)
GREEDY_ONLY_RELAYS = ("relay:draft_first_probs",)   # relays only sampled rows read


def _copy(graph: fx.Graph) -> fx.Graph:
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    new.output(new.graph_copy(graph, env))
    for old, node in env.items():
        node.meta = copy.deepcopy(old.meta)
    return new


def _replace(graph: fx.Graph, old: fx.Node, op: Any, args: tuple, name: str) -> fx.Node:
    with graph.inserting_before(old):
        new = graph.call_function(op, args)
    new.meta = carried_meta(old)
    old.replace_all_uses_with(new)
    graph.erase_node(old)
    new._rename(name)
    return new


def _derived(node: fx.Node) -> list[fx.Node]:
    """node and every node that reads it, transitively."""
    out, todo = [], [node]
    while todo:
        n = todo.pop()
        if n not in out:
            out.append(n)
            todo.extend(n.users)
    return out


def _relay_role(node: Any) -> str | None:
    return node.meta.get("lingc.input") if isinstance(node, fx.Node) and node.op == "placeholder" else None


def specialize(graph: fx.Graph) -> tuple[dict[str, int], str | None]:
    """Rewrite `graph` (a copy) for all-greedy requests, in place; returns (rewrites by kind, reason if it cannot)."""
    done = {"greedy_sample": 0, "greedy_accept": 0, "relay_writes_dropped": 0}
    for fp in calls(graph, "filtered_probs"):
        logits = fp.args[0]
        for user in list(fp.users):
            if user.target is OPS.sample_tokens and user.args[0] is fp:
                _replace(graph, user, OPS.greedy_sample, (logits,), user.name.replace("sample_tokens", "greedy_sample"))
                done["greedy_sample"] += 1
            elif user.target is OPS.chain_accept and user.args[2] is fp and user.args[3] is logits:
                _replace(graph, user, OPS.greedy_accept, (user.args[0], logits),
                         user.name.replace("chain_accept", "greedy_accept"))
                done["greedy_accept"] += 1
        for node in _derived(fp):
            if node.target is OPS.scatter_rows and _relay_role(node.args[0]) in GREEDY_ONLY_RELAYS:
                graph.erase_node(node)
                done["relay_writes_dropped"] += 1
    graph.eliminate_dead_code()
    left = calls(graph, "filtered_probs")
    if left:
        readers = ", ".join(sorted(u.name for u in left[0].users))
        return done, f"{left[0].name} is still read by {readers or 'nothing'} (only sample_tokens and chain_accept " \
                     "readers are rewritten)"
    return done, None


class SpecializeGreedy(Pass):
    name = "specialize_greedy"
    summary = ("add greedy-only copies of the step graphs (step_greedy, nextn_greedy): argmax in place of "
               "filtered_probs + sample_tokens / chain_accept; the engine runs them for temperature-0 requests")
    changes_numerics = False
    # --verify: each copy against its source with every request greedy, all outputs, relays and state compared
    # but relay_draft_first_probs (the copies do not write it)
    variants = {source + GREEDY_SUFFIX: (source, {"relay:temperature": 0.0}, ("relay_draft_first_probs",))
                for source in SOURCES}

    def apply(self, program: Program) -> dict[str, Any]:
        added: dict[str, dict[str, int]] = {}
        skipped: dict[str, str] = {}
        for source in SOURCES:
            if source not in program.graphs or source + GREEDY_SUFFIX in program.graphs:
                continue
            graph = _copy(program.graphs[source])
            done, reason = specialize(graph)
            if reason is not None:
                skipped[source] = reason
                continue
            program.graphs[source + GREEDY_SUFFIX] = graph
            added[source + GREEDY_SUFFIX] = done
        return {"matches": len(added), "added": added, "skipped": skipped}
