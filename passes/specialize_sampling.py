"""specialize_sampling (opt-in): add copies of the engine step graphs for sampled requests whose filters are off.

A step graph must serve any request, so each filtered_probs launches its kernel's whole schedule (stats, two top-k
rounds, three top-p rounds, write: 7 launches on Ling-3.0-tiny) whatever the row's top_k / top_p; the rounds of a
filter the request does not use find nothing to do and exit, but each still costs a launch. The OpenAI API's
defaults leave top-k off and top-p at 1. The copies, for the engine's choice (runtime/engine.py):
    step_plain, nextn_plain         temperature > 0, top_k off, top_p >= 1: filters = 0 (stats + write, 2 launches)
    step_nucleus, nextn_nucleus     temperature > 0, top_k off, top_p < 1:  filters = 2 (no top-k rounds, 5)
partition then splits nextn_plain / nextn_nucleus into draft / verify / extend copies as it does nextn_greedy.
Before / after (test-tiny, `step`):
    filtered_probs = lingc.filtered_probs(lm_head_linear, temperature, top_k, top_p)       # [1, 1, V]
  ->
    filtered_probs = lingc.filtered_probs(lm_head_linear, temperature, top_k, top_p, 0)    # step_plain
Nothing else changes: sample_tokens, chain_accept, every relay and the RNG counter are as in the general graph.

Numerics: unchanged. The op's reference reads a cleared filter as off (top_k 0, top_p 1), and for a request whose
filters are off that is what the general graph computes; the kernel (kernels/filtered_probs.py) skips the rounds,
which for such rows exit without writing anything, so the probs, tokens and accept lengths are the general graphs'
bit for bit (tests/passes/test_specialize_sampling.py runs both). Greedy requests keep specialize_greedy's copies.
Cost: two more copies of each step graph in the artifact and two more CUDA-graph sets captured by the engine.
Measured (H100, 2026-12-06, `bench/device_step.py --only all,all+specialize_sampling --no-parity`, one process,
bench/results/step-sampling-copies-ab-h100-20261206.json; the sampled NEXTN step, ms, run / repeat): the plain copies
3.920 / 3.907 against the general graphs' 3.937 / 3.934 for the same request (-17 to -27 us, 0.5 %), the nucleus
copies 4.054 / 4.071 against 4.048 / 4.051 (level: skipping the top-k rounds, whose early exits are cheap behind
the top-p rounds, buys nothing). Hence opt-in: the plain copies' half percent does not pay for two more graph sets.
"""

from __future__ import annotations

from typing import Any

from lingc.program import Program
from lingc.passes.base import Pass
from lingc.passes.matchers import calls
from lingc.passes.specialize_greedy import SOURCES, _copy
from lingc.steps import SAMPLING_COPIES

FILTERS_ARG = 4          # filtered_probs(logits, temperature, top_k, top_p, filters)


def specialize(graph, filters: int) -> int:
    """Give every filtered_probs of `graph` (a copy) the static mask `filters`; returns how many."""
    nodes = calls(graph, "filtered_probs")
    for node in nodes:
        node.args = tuple(node.args[:FILTERS_ARG]) + (filters,)
    return len(nodes)


class SpecializeSampling(Pass):
    name = "specialize_sampling"
    summary = ("add copies of the step graphs for sampled requests with top-k off (step_nucleus, nextn_nucleus) and "
               "with top-k and top-p off (step_plain, nextn_plain): the off filters' rounds are not launched")
    changes_numerics = False
    in_all = False
    # --verify: each copy against its source with the request's filters off, every output compared
    variants = {source + suffix: (source, {"relay:temperature": 0.7, "relay:top_k": 0,
                                           **({"relay:top_p": 1.0} if filters == 0 else {"relay:top_p": 0.9})}, ())
                for source in SOURCES for suffix, filters in SAMPLING_COPIES.items()}

    def apply(self, program: Program) -> dict[str, Any]:
        added: dict[str, int] = {}
        for source in SOURCES:
            for suffix, filters in SAMPLING_COPIES.items():
                if source not in program.graphs or source + suffix in program.graphs:
                    continue
                graph = _copy(program.graphs[source])
                n = specialize(graph, filters)
                if n:
                    program.graphs[source + suffix] = graph
                    added[source + suffix] = n
        return {"matches": len(added), "added": added}
