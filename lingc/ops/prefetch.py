"""l2_prefetch: a scheduling hint op, asking L2 for a byte range of a weight ahead of the kernel that reads it.

    l2_prefetch(weight, start, nbytes) -> None

Reads nothing, writes nothing, returns nothing: the reference (and every backend without a kernel for it) does
nothing, so a graph computes the same values with or without it. The prefetch_weights pass places it; the GPU kernel
is kernels/l2_prefetch.py. `start` / `nbytes` are bytes of weight's storage; the range is clipped to the tensor
(nbytes -1: to its end), so a later pass that shards the weight (tp) leaves a valid hint.
"""

from __future__ import annotations

import torch

from lingc.ops.registry import register


@torch.library.custom_op("lingc::l2_prefetch", mutates_args=())
def l2_prefetch(weight: torch.Tensor, start: int, nbytes: int) -> None:
    """A hint: nothing to compute (module docstring)."""
    return None


@l2_prefetch.register_fake
def _(weight, start, nbytes):
    return None


register("l2_prefetch", hint=True)   # kept though nothing reads it


def clip(total: int, start: int, nbytes: int) -> tuple[int, int]:
    """The op's byte range within a weight of `total` bytes: (start, nbytes) clipped, nbytes -1 meaning to the end."""
    start = min(max(start, 0), total)
    end = total if nbytes < 0 else min(total, start + nbytes)
    return start, end - start
