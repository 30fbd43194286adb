"""--verify: run two stages of a Program on the same random inputs (CPU) and compare every output and state.

Bit-exact where the pass declares numerics unchanged. Otherwise the gate is on logits, the way the seed
gates rounding changes on tokens and not bits: |delta logits| <= tol * (1 + |logit|), plus greedy parity: every logits output picks the same token, except at
near-ties whose old margin is within the tolerance; token outputs (draft ids) must be equal. Hidden
states and caches are reported (max |delta|) but not gated: a router tie that flips one expert moves
them legitimately.
"""

from __future__ import annotations

from typing import Any

import torch

from lingc.program import Program

VERIFY_SEED = 1234


def random_inputs(program: Program, graph: str, seed: int = VERIFY_SEED) -> dict[str, torch.Tensor]:
    """Deterministic inputs for every placeholder: ids, positions after a filled cache, random state."""
    g = torch.Generator().manual_seed(seed)
    vocab = program.config.vocab_size
    max_len = int(program.options.get("max_len", 64))
    inputs: dict[str, torch.Tensor] = {}
    for node in program.inputs(graph):
        meta, role = node.meta["lingc.tensor"], node.meta["lingc.input"]
        shape, dtype = meta.shape, meta.dtype
        if role in ("input_ids", "next_ids"):
            inputs[node.name] = torch.randint(0, vocab, shape, generator=g)
        elif role == "positions":
            B, T = shape
            start = 0 if graph == "prefill" else max_len // 2   # decode-like steps see a half-full cache
            inputs[node.name] = (torch.arange(T) + start).expand(B, T).contiguous()
        elif role.endswith("recurrent"):
            inputs[node.name] = (torch.randn(shape, generator=g) * 0.1).to(dtype)
        else:   # hidden states, conv windows, latent cache
            inputs[node.name] = torch.randn(shape, generator=g).to(dtype)
    return inputs


def _outputs(program: Program, graph: str, seed: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    inputs = random_inputs(program, graph, seed)
    outs = program.run(graph, inputs)
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    states = {k: v for k, v in inputs.items() if k.startswith("state_")}
    return outs, states


def _greedy_flips(x: torch.Tensor, y: torch.Tensor, tolerance: float) -> int:
    """Positions where the new argmax is worse than the old one by more than `tolerance` under the old logits.

    A near-tie (both tokens within the tolerance) may legitimately flip when rounding changes.
    """
    old, new = x.argmax(-1, keepdim=True), y.argmax(-1, keepdim=True)
    margin = x.gather(-1, old) - x.gather(-1, new)
    return int((margin > tolerance).sum())


def compare_stages(before: Program, after: Program, exact: bool, tolerance: float | None) -> dict[str, Any]:
    """Compare every graph of `after` with the same graph of `before`; returns a report, raises nothing."""
    report: dict[str, Any] = {"exact": exact, "tolerance": tolerance, "graphs": {}, "ok": True}
    for graph in sorted(after.graphs):
        if graph not in before.graphs:
            continue
        a_out, a_state = _outputs(before, graph, VERIFY_SEED)
        b_out, b_state = _outputs(after, graph, VERIFY_SEED)
        pairs = [(f"output[{i}]", x, y) for i, (x, y) in enumerate(zip(a_out, b_out))]
        pairs += [(k, a_state[k], b_state[k]) for k in sorted(a_state)]
        worst, problems = 0.0, []
        for label, x, y in pairs:
            if x.shape != y.shape or x.dtype != y.dtype:
                problems.append(f"{label}: {list(x.shape)} {x.dtype} became {list(y.shape)} {y.dtype}")
                continue
            is_logits = label.startswith("output") and x.shape[-1] == before.config.vocab_size
            if x.is_floating_point():
                diff = (x.double() - y.double()).abs().max().item() if x.numel() else 0.0
                worst = max(worst, diff)
                if exact and not torch.equal(x, y):
                    problems.append(f"{label}: not bit-identical (max |delta| {diff:.3g})")
                elif not exact and is_logits and \
                        ((x.double() - y.double()).abs() > (tolerance or 0.0) * (1 + x.double().abs())).any():
                    problems.append(f"{label}: |delta| {diff:.3g} above tolerance {tolerance} x (1 + |value|)")
                if not exact and is_logits:
                    flips = _greedy_flips(x, y, tolerance or 0.0)
                    if flips:
                        problems.append(f"{label}: greedy token changed at {flips} position(s) with a margin "
                                        f"above the tolerance")
            elif not torch.equal(x, y):
                problems.append(f"{label}: integer values differ")
        report["graphs"][graph] = {"max_abs_delta": worst, "problems": problems}
        report["ok"] &= not problems
    return report
