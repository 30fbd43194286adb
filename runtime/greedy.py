"""Greedy generation from an artifact's `prefill` and `decode` programs, run eagerly (CPU or GPU).

The prompt goes through whole prefill chunks, then the decode program token by token. This is the
plain, non-speculative path; its tokens must equal the reference model's greedy tokens.
"""

from __future__ import annotations

import torch

from lingc.program import Program
from lingc.state import ModelState
from lingc.trace import state_input_name


def new_state(program: Program, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Zero state tensors for every target-layer state input the decode program reads."""
    c = program.config
    dtype = getattr(torch, program.options.get("dtype", "bfloat16"))
    state = ModelState.new(c, program.options.get("batch", 1), program.options["max_len"], dtype, device,
                           range(c.num_hidden_layers))
    return {state_input_name(k): v for k, v in state.tensors.items()}


def generate_greedy(program: Program, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens after `prompt` (batch 1)."""
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    max_len = program.options["max_len"]
    if len(prompt) + max_new_tokens > max_len:
        raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) exceeds the artifact's "
                         f"max_len {max_len}; recompile with a larger --max-len")
    state = new_state(program)
    chunk = program.options["prefill_tokens"] if "prefill" in program.graphs else 0
    ids = torch.tensor([prompt])
    pos = 0
    logits = None
    while chunk and len(prompt) - pos >= chunk:
        inputs = {"input_ids": ids[:, pos:pos + chunk], "positions": torch.arange(pos, pos + chunk)[None], **state}
        logits = program.run("prefill", inputs)[0]
        pos += chunk
    while pos < len(prompt):
        inputs = {"input_ids": ids[:, pos:pos + 1], "positions": torch.tensor([[pos]]), **state}
        logits = program.run("decode", inputs)[0]
        pos += 1
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = int(logits[0, -1].argmax())
        out.append(token)
        if len(out) == max_new_tokens:
            break
        inputs = {"input_ids": torch.tensor([[token]]), "positions": torch.tensor([[pos]]), **state}
        logits = program.run("decode", inputs)[0]
        pos += 1
    return out
