"""The lowering table: lingc op short name -> Triton launcher, gathered from each kernel family's LOWERINGS.

A launcher takes the op's positional arguments plus keyword `pdl`, mutates what the op mutates and returns what
it returns, without reading device values on the host (so the runtime can capture it in a CUDA graph). Ops with
no entry run their torch reference (views, metadata and sampling glue that is not on the byte path).
"""

from __future__ import annotations

import importlib
import os
from functools import lru_cache
from typing import Callable

# every kernel family module of lingc.kernels that exports LOWERINGS
FAMILIES = ("rmsnorm", "moe_align", "linear", "router", "sample", "filtered_probs", "moe", "moe_fused", "moe_routed",
            "kda", "mla", "meta", "ep", "allreduce", "norm_router", "l2_prefetch")

# ops that run their torch reference even under the triton backend: LINGC_REFERENCE_OPS=embedding,emit_tokens
# (comma-separated short names) to bisect a kernel, or an A/B (bench/device_step.py --variant sets it); read at
# lowering time
REFERENCE_OPS: tuple[str, ...] = tuple(filter(None, (x.strip() for x in
                                                     os.environ.get("LINGC_REFERENCE_OPS", "").split(","))))


def reference_ops() -> tuple[str, ...]:
    """REFERENCE_OPS, checked against the kernel table: a name no kernel lowers (a typo) is an error naming it,
    where it would otherwise keep every kernel on and bisect nothing. Called for every node lowered, so the usual
    empty setting returns before the check."""
    if not REFERENCE_OPS:
        return ()
    unknown = sorted(set(REFERENCE_OPS) - set(kernel_table()))
    if unknown:
        raise ValueError(f"LINGC_REFERENCE_OPS names {', '.join(unknown)}: no lingc kernel lowers that op "
                         f"(short names, e.g. embedding,emit_tokens; known: {', '.join(sorted(kernel_table()))})")
    return REFERENCE_OPS


@lru_cache(maxsize=None)
def kernel_table() -> dict[str, Callable]:
    table: dict[str, Callable] = {}
    for family in FAMILIES:
        module = importlib.import_module(f"lingc.kernels.{family}")
        for op, launcher in getattr(module, "LOWERINGS", {}).items():
            if op in table:
                raise RuntimeError(f"lingc op {op!r} is lowered by two kernel families ({family} and another)")
            table[op] = launcher
    return table
