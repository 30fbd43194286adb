"""The byte floor of a step: the bytes a graph must move from HBM, counted on a real run of it.

One eager run of the graph with an observer (`Executor.run(observe=...)`) sees every launch with its actual
arguments, and counts what each must read or write at least once:
    weights    every program weight a launch reads (a fused weight counts once, as it is read once; a
               fuse_norm_linear op's norm weight and linear weight both, as the two launches it replaces read them);
               expert stacks count only the experts the router actually chose (distinct blocks of moe_align);
               the embedding table only the rows looked up
    kda_state  the recurrent state read (and written back, or staged per chain position), conv windows
    mla_cache  the latent rows each MLA attention reads (positions <= the query's), once per call
Activations (KB at batch 1) are left out, and so are hint ops (l2_prefetch: its weight counts where it is read).
floor_ms = bytes / measured HBM bandwidth.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from lingc.ops.registry import HINTS
from lingc.runtime.executor import Executor, Launch

MOE_OPS = ("moe_up", "moe_up_act", "moe_down")


def _op(launch: Launch) -> str:
    return launch.label.split(":")[-1].removeprefix("lingc.")


def _size(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _distinct_experts(block_expert: torch.Tensor, total: torch.Tensor, block_m: int) -> int:
    """Experts the router chose in this call: the distinct block experts of moe_align's in-use blocks."""
    used = block_expert[: int(total.item()) // int(block_m)]
    return int(torch.unique(used[used >= 0]).numel())


def launch_bytes(launch: Launch, args: tuple, weight_ids: dict[int, str]) -> Counter:
    """Bytes by category that one launch must move, from its actual arguments (see the module docstring)."""
    counts: Counter = Counter()
    op = _op(launch)
    if op in HINTS:                      # l2_prefetch: a hint; its weight is counted where the weight is read
        return counts
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if op == "moe_fused":                                                   # w13 and w2 of the chosen experts
        w13, w2, block_expert, total, block_m = args[1], args[2], args[5], args[6], args[8]
        counts["experts"] += _distinct_experts(block_expert, total, block_m) * (_size(w13[0]) + _size(w2[0]))
        return counts
    if op in ("moe_up_act_pairs", "moe_down_pairs"):                        # (a, stack, topk_ids, ...)
        counts["experts"] += int(torch.unique(args[2]).numel()) * _size(args[1][0])
        return counts
    if op in ("moe_up_act_routed", "moe_down_routed"):   # (a, stack, logits, bias, router args): routes inside
        _, ids = torch.ops.lingc.router_topk(*args[2:9])
        counts["experts"] += int(torch.unique(ids).numel()) * _size(args[1][0])
        if op == "moe_up_act_routed":                                      # the bias, once a layer, as the router's
            counts["weights"] += _size(args[3])
        return counts
    if op in MOE_OPS:
        stack = next(a for a in tensors if id(a) in weight_ids)
        block_expert, total = tensors[-2], tensors[-1]                # (..., sorted_pairs, block_expert, total)
        block_m = args[-1] if op == "moe_down" else args[-2] if op == "moe_up" else args[-3]
        counts["experts"] += _distinct_experts(block_expert, total, block_m) * _size(stack[0])
        return counts
    if op in ("embedding", "embedding_rmsnorm", "embedding_rmsnorm_cat"):   # the rows looked up, the norms' weights
        ids, table = args[:2]
        counts["weights"] += ids.numel() * table.shape[1] * table.element_size()
        counts["weights"] += sum(_size(a) for a in tensors[2:] if id(a) in weight_ids)
        return counts
    for a in tensors:
        if id(a) in weight_ids:
            counts["weights"] += _size(a)
    if op == "kda_fused_verify":                                           # 3 staged convs + staged recurrence
        slots = args[14]
        counts["kda_state"] += sum(2 * _size(pool[0]) * slots.numel() for pool in args[8:11])
        counts["kda_state"] += _size(args[13][0]) * slots.numel() + _size(args[18])
    elif op == "kda_fused_decode":                                         # 3 in-place convs + recurrence
        slots = args[14]
        counts["kda_state"] += sum(2 * _size(pool[0]) * slots.numel() for pool in args[8:11])
        counts["kda_state"] += 2 * _size(args[13][0]) * slots.numel()       # state read + written back
    elif op == "kda_conv_qkv":                                             # 3 in-place convs
        counts["kda_state"] += sum(2 * _size(pool[0]) * args[9].numel() for pool in args[6:9])
    elif op == "kda_commit_multi":
        counts["kda_state"] += sum(2 * _size(pool[0]) * args[0].numel() for pool in args[2])
    elif op.startswith("kda_recurrent"):
        pool, slots = args[7], args[8]
        state = _size(pool[0]) * slots.numel()
        counts["kda_state"] += state                                       # read
        counts["kda_state"] += _size(args[9]) if op.endswith("staged") else state   # staged writes / write back
    elif op == "kda_commit":
        counts["kda_state"] += 2 * _size(args[0][0]) * args[1].numel()
    elif op.startswith("kda_conv"):
        counts["kda_state"] += 2 * _size(args[2][0]) * args[3].numel()
    elif op == "mla_attention":
        kv_pages, positions = args[2], args[5]
        rows = int(positions.max().item()) + 1                             # the latest query's visible rows
        counts["mla_cache"] += rows * kv_pages.shape[-1] * kv_pages.element_size() * positions.shape[0]
    return counts


def step_bytes(exe: Executor, graph: str) -> dict[str, int]:
    """Bytes by category for one run of `graph` (runs it: the state advances as in a real step)."""
    weight_ids = {id(w): name for name, w in exe.weights.items()}
    counts: Counter = Counter()

    def observe(launch: Launch, args: tuple, kwargs: dict, result: Any) -> None:
        counts.update(launch_bytes(launch, args, weight_ids))

    exe.run(graph, observe=observe)
    return dict(counts)
