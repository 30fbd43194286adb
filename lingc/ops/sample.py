"""Token selection ops used inside step programs (the draft chain picks its next token on the device)."""

from __future__ import annotations

import torch

from lingc.ops.registry import register


@torch.library.custom_op("lingc::greedy_sample", mutates_args=())
def greedy_sample(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the vocabulary: logits [B, T, V] -> token ids int64 [B, T] (lowest id wins ties)."""
    return logits.argmax(dim=-1)


@greedy_sample.register_fake
def _(logits):
    return logits.new_empty(logits.shape[:-1], dtype=torch.int64)


register("greedy_sample")
