"""Per-device scratch the kernels keep for the life of the process: created on first use, never freed or resized,
because a captured CUDA graph keeps pointing at it.

`counters(device, owner, n)` is a zeroed int32 tensor of n ticket / arrival counters for one kernel family (kda's
in-place decode mixer, router_align's "split", moe_fused); every launch that uses it leaves it zero again, so one set
serves any number of stream-ordered or PDL-chained launches (launches that may run concurrently on one device need
one each).
`indexed(device)` names the device's index ("cuda" -> "cuda:<current>"), so one device gets one cache entry.
"""

from __future__ import annotations

import functools

import torch


def indexed(device: torch.device | str) -> torch.device:
    """`device` with its index: "cuda" becomes "cuda:<current device>"; other devices unchanged."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


@functools.lru_cache(maxsize=None)
def _counters(device: torch.device, owner: str, n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int32, device=device)


def counters(device: torch.device | str, owner: str, n: int) -> torch.Tensor:
    """The zeroed int32 [n] counters `owner` keeps on `device` (one tensor per (device, owner, n))."""
    return _counters(indexed(device), owner, n)
