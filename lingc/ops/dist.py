"""Tensor-parallel ops: the collectives the `tp` pass inserts, and the expert-parallel MoE align / combine.

Letters: N tokens, k experts per token, NP = N * k pairs, E experts, El = E / world experts per rank,
BM rows per expert block, h hidden, W = world_size (the TP degree the graph was compiled for).

`all_reduce` is the only place a rank's partial sums meet (after every row-parallel projection and every
MoE layer's combine), so it is one op, swappable in one place: a later pass may replace
`all_reduce -> add_rmsnorm` by a one-shot peer-memory all-reduce fused with the residual add and RMSNorm
(shared/docs/kernels.md section 7b), and the GPU lowering table may map it to such a kernel.

Numerics (the reference): the sum of the W partials is taken in fp32 in rank order (0, 1, ..., W-1) and
rounded once to the input dtype, on every rank alike. On CPU (gloo) that is done literally (all_gather,
then a left fold), so every rank gets the same bits and the in-process simulation (`passes/tp.py`,
`run_lockstep`) reproduces a gloo run bit for bit. On CUDA (NCCL) the partials are widened to fp32 and
summed by NCCL (its order), then rounded once.

Process group: the op uses `set_group(group)` if one was registered (runtime/tp.py does), else the
default torch.distributed group. World size 1 is the identity and needs no process group; a graph
compiled for W > 1 ranks refuses to run without a process group of W ranks (running one rank's shard
alone would silently compute partial sums).
"""

from __future__ import annotations

from typing import Any

import torch

from lingc.ops.registry import register

_GROUP: Any = None          # torch.distributed ProcessGroup registered by the TP runtime (None: the default)


def set_group(group: Any) -> None:
    """Make the TP collectives use `group` (None: torch.distributed's default group)."""
    global _GROUP
    _GROUP = group


def _check_group(op: str, world_size: int) -> Any:
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"lingc.{op}: this graph was compiled for {world_size} tensor-parallel ranks, but no "
                           "torch.distributed process group is running; run TP artifacts with "
                           "lingc.runtime.tp.open_tp_session (lingc generate does this itself)")
    got = dist.get_world_size(_GROUP)
    if got != world_size:
        raise RuntimeError(f"lingc.{op}: this graph was compiled for {world_size} tensor-parallel ranks, but the "
                           f"process group has {got}")
    return _GROUP


def fold_sum(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """sum(parts) in fp32, added in list (rank) order, rounded once to dtype: the reference all-reduce."""
    acc = parts[0].float().clone()
    for p in parts[1:]:
        acc += p.float()
    return acc.to(dtype)


def _gather(x: torch.Tensor, world_size: int, group: Any) -> list[torch.Tensor]:
    """Every rank's x, in rank order. CUDA: one all_gather_into_tensor into a [W, ...] buffer (a single NCCL call
    with one output, which CUDA-graph capture takes as is; the list form copies out of a flat buffer)."""
    import torch.distributed as dist
    x = x.contiguous()
    if x.is_cuda:
        out = x.new_empty((world_size, *x.shape))
        dist.all_gather_into_tensor(out, x, group=group)
        return list(out.unbind(0))
    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x, group=group)
    return parts


@torch.library.custom_op("lingc::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """Sum of x over the `world_size` TP ranks (fp32 sum, one rounding to x.dtype); identity for one rank.

    x [...] holds this rank's partial result (a row-parallel projection's output or a MoE layer's local
    combine); every rank gets the same sum.
    """
    if world_size == 1:
        return x.clone()
    group = _check_group("all_reduce", world_size)
    if x.is_cuda:
        import torch.distributed as dist
        acc = x.to(torch.float32, memory_format=torch.contiguous_format, copy=True)   # never reduce into x itself
        dist.all_reduce(acc, group=group)
        return acc.to(x.dtype)
    return fold_sum(_gather(x, world_size, group), x.dtype)


@all_reduce.register_fake
def _(x, world_size):
    return x.new_empty(x.shape)


register("all_reduce")


@torch.library.custom_op("lingc::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, dim: int, world_size: int) -> torch.Tensor:
    """The ranks' pieces concatenated along `dim` in rank order: x [..., n, ...] -> [..., W*n, ...].

    The vocab-parallel lm_head's logits ([B, T, V/W] per rank -> [B, T, V]); every rank gets all of them.
    """
    if world_size == 1:
        return x.clone()
    group = _check_group("all_gather", world_size)
    return torch.cat(_gather(x, world_size, group), dim=dim)


@all_gather.register_fake
def _(x, dim, world_size):
    shape = list(x.shape)
    shape[dim] *= world_size
    return x.new_empty(shape)


register("all_gather")


@torch.library.custom_op("lingc::all_reduce_add_rmsnorm", mutates_args=())
def all_reduce_add_rmsnorm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                           world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rmsnorm(residual, all_reduce(x, world_size), weight, eps) as one op (passes/fuse_all_reduce_norm.py):
    (rmsnorm(residual + sum), residual + sum), where sum is the all_reduce of this rank's partial x.

    residual, x [..., h] of one dtype (residual whole on every rank, x this rank's partial), weight [h]. The same
    arithmetic as the two ops, so both outputs are bit-identical to the pair's; the GPU lowering runs the
    one-shot all-reduce and the add + norm in one launch (kernels/allreduce.py).
    """
    from lingc.ops.norm import add_rmsnorm
    return add_rmsnorm(residual, all_reduce(x, world_size), weight, eps)


@all_reduce_add_rmsnorm.register_fake
def _(residual, x, weight, eps, world_size):
    return x.new_empty(x.shape), x.new_empty(x.shape)


register("all_reduce_add_rmsnorm")


def ep_sizes(num_pairs: int, num_local: int, block_m: int) -> tuple[int, int]:
    """(max padded rows, blocks) of ep_align's outputs: moe_align's sizes for NP pairs over El experts."""
    max_padded = num_pairs + num_local * (block_m - 1)
    return max_padded, -(-max_padded // block_m)


@torch.library.custom_op("lingc::ep_align", mutates_args=())
def ep_align(expert_ids: torch.Tensor, expert_map: torch.Tensor, num_local: int,
             block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe_align restricted to this rank's experts (expert parallelism).

    expert_ids [N, k] int32 global ids (the router's), expert_map [E] int32: the local index of each
    global expert on this rank, -1 where another rank holds it. Returns
      local_ids    int32 [N, k]: expert_map[expert_ids] (-1: not this rank's pair)
      sorted_pairs int32 [NP + El*(BM-1)], block_expert int32 [blocks], total int32 [1]:
                   exactly moe_align's outputs over the local pairs only (El experts, local indices);
                   the other pairs appear nowhere, so the grouped GEMMs never compute them.
    Free of host reads (scatter_add / sort / searchsorted), like moe_align.
    """
    local = expert_map.long()[expert_ids.long()]
    flat = local.reshape(-1)
    num_pairs, dev = flat.numel(), flat.device
    max_padded, blocks = ep_sizes(num_pairs, num_local, block_m)
    bucket = torch.where(flat >= 0, flat, num_local)                  # other ranks' pairs: one last bucket
    counts = torch.zeros(num_local + 1, dtype=torch.long, device=dev).scatter_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts[:num_local] + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = torch.cat([ends - padded, torch.full((1,), max_padded, dtype=torch.long, device=dev)])
    order = torch.sort(bucket, stable=True).indices                                   # pairs by expert
    b_sorted = bucket[order]
    rank = torch.arange(num_pairs, device=dev) - (torch.cumsum(counts, 0) - counts)[b_sorted]
    dest = torch.where(b_sorted < num_local, starts[b_sorted] + rank, max_padded)     # dropped: a spare slot
    sorted_pairs = torch.full((max_padded + 1,), num_pairs, dtype=torch.int32, device=dev)
    sorted_pairs[dest] = order.to(torch.int32)
    sorted_pairs = sorted_pairs[:max_padded].clone()                                 # the spare slot goes
    block_start = torch.arange(blocks, device=dev) * block_m
    block_expert = torch.searchsorted(ends, block_start, right=True)
    block_expert = torch.where(block_start < ends[-1], block_expert, -1).to(torch.int32)
    total = padded.sum().view(1).to(torch.int32)
    return local.to(torch.int32).view(expert_ids.shape), sorted_pairs, block_expert, total


@ep_align.register_fake
def _(expert_ids, expert_map, num_local, block_m):
    max_padded, blocks = ep_sizes(expert_ids.numel(), num_local, block_m)
    new = lambda n: expert_ids.new_empty((n,), dtype=torch.int32)  # noqa: E731
    return expert_ids.new_empty(expert_ids.shape, dtype=torch.int32), new(max_padded), new(blocks), new(1)


register("ep_align")


@torch.library.custom_op("lingc::ep_combine", mutates_args=())
def ep_combine(expert_out: torch.Tensor, topk_weights: torch.Tensor, local_ids: torch.Tensor,
               shared_out: torch.Tensor | None = None) -> torch.Tensor:
    """moe_combine over this rank's pairs: sum_j [local_ids[n, j] >= 0] w[n, j] * expert_out[n*k + j] in fp32,
    cast to the activation dtype, plus shared_out (this rank's partial of the shared expert; None after
    fuse_shared_expert, where the shared expert is a pair, local to one rank).

    expert_out [NP, h] (rows of other ranks' pairs are never written by the grouped GEMMs: they are
    selected away, not multiplied by 0, so garbage there cannot leak), topk_weights [N, k] fp32,
    local_ids [N, k] int32 from ep_align, shared_out [N, h] -> [N, h], this rank's partial; the all_reduce
    after it sums the ranks. With every pair local it is moe_combine, bit for bit.
    """
    N, k = topk_weights.shape
    prod = expert_out.view(N, k, -1).float() * topk_weights.float().unsqueeze(-1)
    prod = torch.where((local_ids >= 0).view(N, k, 1), prod, torch.zeros((), dtype=prod.dtype, device=prod.device))
    if shared_out is None:
        return prod.sum(1).to(expert_out.dtype)
    return prod.sum(1).to(shared_out.dtype) + shared_out


@ep_combine.register_fake
def _(expert_out, topk_weights, local_ids, shared_out=None):
    return expert_out.new_empty((topk_weights.shape[0], expert_out.shape[1]))


register("ep_combine")
