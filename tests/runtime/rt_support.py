"""Constants and helpers shared by the runtime tests (conftest.py holds the fixtures)."""

from __future__ import annotations

import torch

from lingc.passes import PASSES
from lingc.runtime.engine import Request
from lingc.trace import TraceOptions

OPTIONS = TraceOptions(max_len=320, prefill_tokens=16)         # request_slots 2, draft_tokens 6, pages of 16
NEW_TOKENS = 256                                               # the blog's byte-exact greedy gate
_g = torch.Generator().manual_seed(1234)
PROMPTS: dict[str, list[int]] = {                              # shorter than, equal to and longer than a chunk
    "short3": [11, 22, 33],
    "chunk16": torch.randint(0, 510, (16,), generator=_g).tolist(),
    "long37": torch.randint(0, 510, (37,), generator=_g).tolist(),       # 2 prefill chunks + a 5-token tail
}
# every pass combination that declares numerics unchanged: the four named in the gate, plus all such
# passes registered today (so new exact passes are gated as soon as they are registered)
COMBOS: dict[str, tuple[str, ...]] = {
    "partition": ("partition",),
    "partition+fuse_swiglu": ("partition", "fuse_swiglu"),
    "partition+pdl": ("partition", "pdl"),
    "partition+fuse_swiglu+pdl": ("partition", "fuse_swiglu", "pdl"),
    "all-exact": tuple(name for name, cls in PASSES.items() if not cls.changes_numerics),
}
FULL = "partition+fuse_swiglu+pdl"                             # the program most other gates run on


def greedy(prompt: list[int], n: int = NEW_TOKENS) -> Request:
    return Request(list(prompt), n, ignore_eos=True)


def first_difference(a: list[int], b: list[int]) -> str:
    """A readable note on where two token lists part (for assertion messages)."""
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"lengths {len(a)} vs {len(b)}; first difference at index {i}: {a[i:i + 4]} vs {b[i:i + 4]}"
