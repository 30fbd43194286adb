"""l2_prefetch, l2_prefetch_experts, l2_prefetch_pages: scheduling hint ops, asking L2 for bytes ahead of their reader.

    l2_prefetch(weight, start, nbytes) -> None
    l2_prefetch_experts(weight [E, ...], ids int [...], nbytes) -> None   the first nbytes of weight[e], e in ids
    l2_prefetch_pages(kv_pages [NP, PS, L], page_rows [B, MP], positions [B, T]) -> None
        every page a request's queries see: page_rows[b, j] for j <= max_t positions[b, t] // PS (MLA's latent cache)

Reads nothing, writes nothing, returns nothing: the reference (and every backend without a kernel for it) does
nothing, so a graph computes the same values with or without it. The prefetch_weights pass places it; the GPU kernel
is kernels/l2_prefetch.py. `start` / `nbytes` are bytes of weight's storage; the range is clipped to the tensor
(nbytes -1: to its end), so a later pass that shards the weight (tp) leaves a valid hint. l2_prefetch_experts reads
its expert ids on the device (the router's picks); the tp pass drops it (a rank's experts are a slice of the ids).
l2_prefetch_pages reads the page table and positions on the device too (they change every step; the cache rows were
written by earlier steps, and the one this step writes is coherent in L2 whichever lands first).
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


@torch.library.custom_op("lingc::l2_prefetch_experts", mutates_args=())
def l2_prefetch_experts(weight: torch.Tensor, ids: torch.Tensor, nbytes: int) -> None:
    """A hint: ask L2 for the first nbytes (-1: all) of weight[e] for every expert id e in ids (a router's picks,
    known only on the device); ids outside [0, weight.shape[0]) are skipped. Nothing to compute here."""
    return None


@l2_prefetch_experts.register_fake
def _(weight, ids, nbytes):
    return None


register("l2_prefetch_experts", hint=True)


@torch.library.custom_op("lingc::l2_prefetch_pages", mutates_args=())
def l2_prefetch_pages(kv_pages: torch.Tensor, page_rows: torch.Tensor, positions: torch.Tensor) -> None:
    """A hint: ask L2 for every cache page request b's queries see (page_rows[b, j], j <= max_t positions[b, t] // PS;
    pages outside [0, NP) and requests with no position >= 0 are skipped). Nothing to compute here."""
    return None


@l2_prefetch_pages.register_fake
def _(kv_pages, page_rows, positions):
    return None


register("l2_prefetch_pages", hint=True)
