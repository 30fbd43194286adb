"""--verify: run two stages of a Program on the same random inputs (CPU) and compare every output and state.

Bit-exact where the pass declares numerics unchanged. Otherwise the gate is on logits, the way the seed
gates rounding changes on tokens and not bits: |delta logits| <= tol * (1 + |logit|), plus greedy parity:
every logits output picks the same token, except at near-ties whose old margin is within the tolerance;
token outputs must be equal. Hidden states, caches and relays are reported (max |delta|) but not
gated: a router tie that flips one expert moves them legitimately.
A pass that splits a graph (`splits = {"nextn": ("draft", "verify", "extend")}`) is checked by running
the parts in order against the whole, on the same inputs; a pass that adds a specialised copy of a graph
(`variants`, specialize_greedy) by running the copy against its source on inputs that meet its condition.
"""

from __future__ import annotations

from typing import Any

import torch

from lingc.program import Program

VERIFY_SEED = 1234


def random_inputs(program: Program, graphs: list[str] | str, seed: int = VERIFY_SEED) -> dict[str, torch.Tensor]:
    """Deterministic inputs for every placeholder of `graphs`, by role (shared names get one tensor)."""
    graphs = [graphs] if isinstance(graphs, str) else graphs
    g = torch.Generator().manual_seed(seed)
    c, opt = program.config, program.options
    max_len = int(opt.get("max_len", 64))
    K1 = int(opt.get("draft_tokens", 6))
    inputs: dict[str, torch.Tensor] = {}
    for graph in graphs:
        for node in program.inputs(graph):
            if node.name in inputs:
                continue
            meta, role = node.meta["lingc.tensor"], node.meta["lingc.input"]
            inputs[node.name] = _value(role, meta.shape, meta.dtype, graph, g, c.vocab_size, max_len, K1)
    return inputs


def _value(role: str, shape: tuple, dtype: torch.dtype, graph: str, g: torch.Generator, vocab: int,
           max_len: int, K1: int) -> torch.Tensor:
    if role in ("input_ids", "next_ids", "relay:root", "relay:draft_first"):
        return torch.randint(0, vocab, shape, generator=g)
    if role == "positions":
        B, T = shape
        start = 0 if T > 1 else max_len // 2          # decode-like steps see a half-full cache
        return (torch.arange(T) + start).expand(B, T).contiguous()
    if role == "slots":
        return torch.arange(shape[0], dtype=dtype)
    if role == "page_table":
        return torch.randperm(shape[0] * shape[1], generator=g).view(shape).to(dtype)   # pages in any order
    if role == "relay:seq_len":
        return torch.randint(max_len // 4, max_len // 2, shape, generator=g)
    if role == "relay:temperature":
        return (torch.rand(shape, generator=g) < 0.5).float() * 0.8    # greedy and sampled requests
    if role == "relay:top_p":
        return torch.full(shape, 0.9)
    if role in ("relay:seed", "relay:top_k"):
        return torch.randint(0, 100, shape, generator=g) if role == "relay:seed" else torch.zeros(shape, dtype=dtype)
    if role == "relay:draft_first_probs":
        return torch.softmax(torch.randn(shape, generator=g), dim=-1)
    if role.endswith("recurrent"):
        return (torch.randn(shape, generator=g) * 0.1).to(dtype)
    if role.startswith(("relay:", "staging:")) or not dtype.is_floating_point:
        return torch.zeros(shape, dtype=dtype)        # counters, outputs, within-step relays, scratch
    return torch.randn(shape, generator=g).to(dtype)  # hidden states, conv windows, latent pages


def _run(program: Program, graphs: list[str], inputs: dict[str, torch.Tensor]) -> tuple[list, dict]:
    outs: list[torch.Tensor] = []
    for graph in graphs:
        names = [n.name for n in program.inputs(graph)]
        result = program.run(graph, {k: inputs[k] for k in names})
        values = result if isinstance(result, (tuple, list)) else [result]
        outs.extend(v for v in values if v is not None)
    return outs, inputs


def _greedy_flips(x: torch.Tensor, y: torch.Tensor, tolerance: float) -> int:
    """Positions where the new argmax is worse than the old one by more than `tolerance` under the old logits."""
    old, new = x.argmax(-1, keepdim=True), y.argmax(-1, keepdim=True)
    margin = x.gather(-1, old) - x.gather(-1, new)
    return int((margin > tolerance).sum())


def _compare(label: str, x: torch.Tensor, y: torch.Tensor, exact: bool, tolerance: float | None,
             vocab: int) -> tuple[float, list[str]]:
    if x.shape != y.shape or x.dtype != y.dtype:
        return 0.0, [f"{label}: {list(x.shape)} {x.dtype} became {list(y.shape)} {y.dtype}"]
    gated = exact or label.startswith("output")      # numerics changed: states and relays are reported only
    if not x.is_floating_point():
        return 0.0, ([] if torch.equal(x, y) or not gated else [f"{label}: integer values differ"])
    diff = (x.double() - y.double()).abs().max().item() if x.numel() else 0.0
    is_logits = label.startswith("output") and x.shape[-1] == vocab
    problems = []
    if exact and not torch.equal(x, y):
        problems.append(f"{label}: not bit-identical (max |delta| {diff:.3g})")
    elif not exact and is_logits:
        if ((x.double() - y.double()).abs() > (tolerance or 0.0) * (1 + x.double().abs())).any():
            problems.append(f"{label}: |delta| {diff:.3g} above tolerance {tolerance} x (1 + |value|)")
        flips = _greedy_flips(x, y, tolerance or 0.0)
        if flips:
            problems.append(f"{label}: greedy token changed at {flips} position(s) with a margin above the tolerance")
    return diff, problems


def compare_stages(before: Program, after: Program, exact: bool, tolerance: float | None,
                   splits: dict[str, tuple[str, ...]] | None = None,
                   variants: dict[str, tuple[str, dict[str, float], tuple[str, ...]]] | None = None) -> dict[str, Any]:
    """Compare every graph of `after` with its counterpart in `before`; returns a report, raises nothing.
    variants: a new graph -> (the graph of `before` it must match, input roles fixed to a value for the run,
    inputs left unchecked), e.g. specialize_greedy's step_greedy against step with every temperature 0."""
    report: dict[str, Any] = {"exact": exact, "tolerance": tolerance, "graphs": {}, "ok": True}
    pairs = [(g, [g], [g], {}, ()) for g in sorted(after.graphs) if g in before.graphs]
    for whole, parts in (splits or {}).items():
        if whole in before.graphs and all(p in after.graphs for p in parts):
            pairs.append(("+".join(parts), [whole], list(parts), {}, ()))
    for new, (old, fixed, unchecked) in (variants or {}).items():
        if old in before.graphs and new in after.graphs:
            pairs.append((f"{new} vs {old}", [old], [new], fixed, unchecked))
    for key, old_graphs, new_graphs, fixed, unchecked in pairs:
        inputs = random_inputs(after, new_graphs)
        inputs.update({k: v for k, v in random_inputs(before, old_graphs).items() if k not in inputs})
        for node in (n for g in old_graphs for n in before.inputs(g)):
            if node.meta["lingc.input"] in fixed:
                inputs[node.name] = torch.full_like(inputs[node.name], fixed[node.meta["lingc.input"]])
        a_out, a_in = _run(before, old_graphs, {k: v.clone() for k, v in inputs.items()})
        b_out, b_in = _run(after, new_graphs, {k: v.clone() for k, v in inputs.items()})
        checked = [(f"output[{i}]", x, y) for i, (x, y) in enumerate(zip(a_out, b_out))]
        shared = [n.name for g in old_graphs for n in before.inputs(g)]
        checked += [(k, a_in[k], b_in[k]) for k in sorted(set(shared) - set(unchecked)) if k in b_in]  # state, relays
        worst, problems = 0.0, []
        for label, x, y in checked:
            d, p = _compare(label, x, y, exact, tolerance, before.config.vocab_size)
            worst, problems = max(worst, d), problems + p
        report["graphs"][key] = {"max_abs_delta": worst, "problems": problems}
        report["ok"] &= not problems
    return report
