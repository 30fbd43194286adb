"""Expert-parallel MoE align and combine (the tp pass's ep_align / ep_combine) as one Triton launch each.

Reference ops: `torch.ops.lingc.ep_align` / `lingc.ep_combine` (lingc/ops/dist.py). Letters: N tokens, k pairs per
token (k + 1 after fuse_shared_expert), NP = N * k pairs, E' global experts (expert_map's length), El = num_local
experts this rank holds, BM = block_m, h hidden. Under the triton backend their torch references cost ~40 (align)
and ~7 (combine) small CUDA kernels each, once per MoE layer (23 per Ling-3.0-tiny step; docs/tp.md has the audit).

ep_align(expert_ids [N, k], expert_map int32 [E'], El, BM) -> (local_ids, sorted_pairs, block_expert, total)
    local_ids     int32 [N, k]             expert_map[expert_ids]: the local expert index, -1 for another rank's pair
    sorted_pairs  int32 [NP + El*(BM-1)]   moe_align's contract over this rank's pairs only, local expert ids:
                                           grouped by local expert (0 first), stable by pair index, each expert's
                                           segment padded to a multiple of BM with the sentinel NP; the tail past
                                           the total is NP; other ranks' pairs appear nowhere
    block_expert  int32 [cdiv(NP + El*(BM-1), BM)]   the local expert of each BM-row block, -1 past the total
    total         int32 [1]                sum over local experts of ceil(count / BM) * BM
  One program, the pair-axis algorithm of kernels/moe_align.py (router_align's variant in kernels/router.py, with
  disjoint stores and so no CTA barrier): the NP ids are loaded into registers (padded to NP_BLOCK, a power of two),
  each is mapped through expert_map (a gather of NP int32), and local_ids is stored. A pair is *mine* when it is a
  real pair with a local index >= 0; every other lane (other ranks' pairs, padding) gets bucket El, above every
  local expert, and is masked out of the comparisons. Over [NP_BLOCK, NP_BLOCK] tiles (pair i against pair j):
      rank_i   = #{mine j < i : e_j == e_i}         count_i = #{mine j : e_j == e_i}
      padded_i = ceil(count_i / BM) * BM            rep_i = mine_i and rank_i == 0 (one per non-empty expert)
      offset_i = sum of padded_j over reps j with e_j < e_i,  total = sum of padded_j over reps
  Stores (disjoint cell sets, so their order does not matter): pair slots sorted_pairs[offset_i + rank_i] = i, each
  segment's padding [offset + count, offset + padded) = NP, the tail [total, NP + El*(BM-1)) = NP; block q <
  total / BM belongs to the rep with the largest e_j whose segment starts at or before q * BM (segments are in expert
  order and each is >= BM rows long), blocks from total / BM on get -1 (total / BM <= mine pairs <= NP_BLOCK, so the
  owned blocks fit one [NP_BLOCK, NP_BLOCK] tile); then total. Integer arithmetic only: bit-exact vs the reference.
  Registers grow as NP^2 (as moe_align), so NP <= MAX_PAIRS (64: verify's 6 tokens x 9 pairs is 54) runs the
  kernel and larger calls (prefill) the reference op, which is host-read free too.

ep_combine(expert_out [NP, h], topk_weights fp32 [N, k], local_ids int32 [N, k], shared_out [N, h] | None) -> [N, h]
    sum_j [local_ids[n, j] >= 0] * w[n, j] * float(expert_out[n*k + j]) in fp32, cast to the activation dtype, then
    + shared_out in fp32 rounded once (None after fuse_shared_expert: the cast sum is the output)
  kernels/moe.py's moe_combine kernel itself (HAS_LOCAL), one program per (token, BLOCK_H columns): the product
  w * float(e) is rounded in fp32 (fp fusion off), another rank's pair contributes exactly +0.0 (the reference's
  torch.where: its expert_out row is never written by the grouped GEMMs and is not even loaded here, so garbage there
  cannot leak), and the k
  terms are summed in the order of the device's torch reduction (kernels/moe.py COMBINE_ORDER: sequential on CPU,
  4 interleaved accumulators on CUDA), which makes it bit-exact vs the reference where moe_combine is.

Bytes at decode (Ling-3.0-tiny, TP2, k = 9 with the fused shared expert, El = 65, BM = 16): ep_align reads 36 B of
ids + 36 B of map and writes 36 B + 984 x 4 B sorted_pairs + 62 x 4 B block_expert (~4.3 KB); ep_combine reads at
most the rank's local pair rows (<= 9 x 1536 x 2 B = 27.6 KB) + weights and ids (72 B) and writes 3 KB. Both are
launch-bound (one small program / 3 programs per token), the point is one launch instead of tens.

PDL placement (shared/docs/kernels.md section 1.5): with the constexpr PDL on, `gdc_wait()` comes first in both
kernels: ep_align's first load is the router's ids (and the map is only gathered through them; even its sentinel
stores must not start while an earlier kernel may still use the memory), ep_combine's are the down-GEMM's rows.
`gdc_launch_dependents()` follows the last dependent load (ep_align: the mapped ids; ep_combine: after the k-loop
and the shared row). With PDL off no GDC call is emitted (the Triton interpreter cannot run them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lingc.kernels.moe import COMBINE_ORDER, FP_OPTIONS, SEQUENTIAL, _moe_combine_kernel
from lingc.kernels.pdl import pdl_supported, pdl_trigger, pdl_wait
import lingc.ops  # noqa: F401  (registers torch.ops.lingc.*, used by the references)
from lingc.ops.dist import ep_sizes

# Tunables. ep_align's single program holds [NP_BLOCK, NP_BLOCK] int32 tiles, so it is gated on the pair count
# (as kernels/moe_align.py); none of these changes an output bit.
MAX_PAIRS = 64          # NP above this goes to the reference op
MIN_NP_BLOCK = 16       # smallest pair block (tl.arange wants a power of two; keeps tiny tiles warp-sized)
FILL_BLOCK = 1024       # sentinel cells per store of the tails (El=65, BM=16: one step for sorted_pairs' 984)
ALIGN_NUM_WARPS = 4
COMBINE_BLOCK_H = 512   # ep_combine: hidden columns per program (h=1536: 3 programs per token)
COMBINE_NUM_WARPS = 4


@triton.jit
def _ep_align_kernel(ids_ptr, map_ptr, local_ptr, sorted_ptr, block_expert_ptr, total_ptr,
                     NP, EL, BM, MAX_PADDED, BLOCKS,
                     NP_BLOCK: tl.constexpr, BM_BLOCK: tl.constexpr, FILL: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        pdl_wait()
    offs = tl.arange(0, NP_BLOCK)
    valid = offs < NP
    gid = tl.load(ids_ptr + offs, mask=valid, other=0)                            # [NP_BLOCK] global expert ids
    local = tl.load(map_ptr + gid, mask=valid, other=-1).to(tl.int32)             # this rank's index, -1 elsewhere
    if PDL:
        pdl_trigger()
    tl.store(local_ptr + offs, local, mask=valid)
    mine = valid & (local >= 0)
    e = tl.where(mine, local, EL)                                                 # others: bucket El, masked below
    e_i = e[:, None]                                                              # [NP_BLOCK, 1] pair i
    e_j = e[None, :]                                                              # [1, NP_BLOCK] pair j
    same = (e_i == e_j) & mine[None, :]                                           # [NP_BLOCK, NP_BLOCK]
    rank = tl.sum((same & (offs[None, :] < offs[:, None])).to(tl.int32), axis=1)  # [NP_BLOCK]
    count = tl.sum(same.to(tl.int32), axis=1)
    padded = (count + BM - 1) // BM * BM
    rep = mine & (rank == 0)                                                      # one per non-empty local expert
    rep_padded = tl.where(rep, padded, 0)
    offset = tl.sum((e_j < e_i).to(tl.int32) * rep_padded[None, :], axis=1)     # exclusive segment starts
    total = tl.sum(rep_padded, axis=0)
    # sorted_pairs: pair slots, each segment's padding, the tail past the total (disjoint cell sets)
    tl.store(sorted_ptr + offset + rank, offs, mask=mine)
    t = tl.arange(0, BM_BLOCK)[None, :]                                           # [1, BM_BLOCK]
    pad = rep[:, None] & (t < (padded - count)[:, None])
    tl.store(sorted_ptr + (offset + count)[:, None] + t, NP + 0 * t, mask=pad)
    for start in range(0, MAX_PADDED, FILL):
        cells = start + tl.arange(0, FILL)
        tl.store(sorted_ptr + cells, NP + 0 * cells, mask=(cells >= total) & (cells < MAX_PADDED))
    # block_expert: block q < total / BM is the last segment starting at or before row q * BM; -1 from total / BM on
    q = offs[:, None]                                                             # [NP_BLOCK, 1] block
    owner = tl.max(tl.where(rep[None, :] & (offset[None, :] <= q * BM), e_j, -1), axis=1)
    tl.store(block_expert_ptr + offs, tl.where(offs < total // BM, owner, -1), mask=offs < BLOCKS)
    for start in range(NP_BLOCK, BLOCKS, FILL):
        blocks = start + tl.arange(0, FILL)
        tl.store(block_expert_ptr + blocks, -1 + 0 * blocks, mask=blocks < BLOCKS)
    tl.store(total_ptr, total)


def _is_int(t: torch.Tensor) -> bool:
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


def _new(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised output (the kernels write every element; tests poison it here)."""
    return torch.empty(shape, dtype=dtype, device=device)


def ep_align(expert_ids: torch.Tensor, expert_map: torch.Tensor, num_local: int, block_m: int, *,
             pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(local_ids, sorted_pairs, block_expert, total) as torch.ops.lingc.ep_align: moe_align over this rank's pairs.

    expert_ids [N, k] integer global ids, expert_map int32 [E'] (local index, -1 on other ranks). NP <= MAX_PAIRS runs
    one single-program launch; larger (or empty) inputs use the reference op. pdl is dropped where unsupported.
    """
    if not _is_int(expert_ids):
        raise ValueError(f"ep_align: expert_ids must be integer, got {expert_ids.dtype}")
    if expert_map.dim() != 1 or expert_map.dtype != torch.int32:
        raise ValueError(f"ep_align: expert_map must be an int32 [E] vector, got {list(expert_map.shape)} "
                         f"{expert_map.dtype}")
    if num_local < 1 or block_m < 1:
        raise ValueError(f"ep_align: want num_local >= 1 and block_m >= 1, got {num_local}, {block_m}")
    num_pairs = expert_ids.numel()
    if num_pairs == 0 or num_pairs > MAX_PAIRS:
        return ep_align_ref(expert_ids, expert_map, num_local, block_m)
    dev = expert_ids.device
    flat = expert_ids.reshape(-1).contiguous()                                     # [NP]
    max_padded, blocks = ep_sizes(num_pairs, num_local, block_m)
    local_ids = _new(tuple(expert_ids.shape), torch.int32, dev)
    sorted_pairs = _new((max_padded,), torch.int32, dev)
    block_expert = _new((blocks,), torch.int32, dev)
    total = _new((1,), torch.int32, dev)
    pdl = pdl and pdl_supported(dev)
    launch = {"launch_pdl": True} if pdl else {}
    _ep_align_kernel[(1,)](flat, expert_map.contiguous(), local_ids, sorted_pairs, block_expert, total,
                           num_pairs, num_local, block_m, max_padded, blocks,
                           NP_BLOCK=max(MIN_NP_BLOCK, triton.next_power_of_2(num_pairs)),
                           BM_BLOCK=max(2, triton.next_power_of_2(block_m)), FILL=FILL_BLOCK, PDL=pdl,
                           num_warps=ALIGN_NUM_WARPS, **launch)
    return local_ids, sorted_pairs, block_expert, total


def _check_combine(expert_out: torch.Tensor, topk_weights: torch.Tensor, local_ids: torch.Tensor,
                   shared_out: torch.Tensor | None) -> torch.Tensor:
    """Validate ep_combine's arguments; returns the tensor whose dtype and h the output takes."""
    shared = expert_out if shared_out is None else shared_out
    for name, t in (("expert_out", expert_out), ("shared_out", shared)):
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"ep_combine: {name} must be float32, bfloat16 or float16, got {t.dtype}")
    if topk_weights.dim() != 2 or shared.dim() != 2 or expert_out.dim() != 2:
        raise ValueError(f"ep_combine: want expert_out [NP, h], topk_weights [N, k], shared_out [N, h]; got "
                         f"{list(expert_out.shape)}, {list(topk_weights.shape)}, {list(shared.shape)}")
    n, k = topk_weights.shape
    h = shared.shape[1]
    if (shared_out is not None and shared_out.shape[0] != n) or expert_out.shape != (n * k, h):
        raise ValueError(f"ep_combine: expert_out {list(expert_out.shape)}, topk_weights {list(topk_weights.shape)}"
                         f", shared_out {list(shared.shape) if shared_out is not None else None}: want [N*k, h], "
                         "[N, k], [N, h] or None")
    if local_ids.shape != (n, k) or not _is_int(local_ids):
        raise ValueError(f"ep_combine: local_ids is {list(local_ids.shape)} {local_ids.dtype}, want integer [{n}, {k}]")
    return shared


def ep_combine(expert_out: torch.Tensor, topk_weights: torch.Tensor, local_ids: torch.Tensor,
               shared_out: torch.Tensor | None = None, *, pdl: bool = False, out: torch.Tensor | None = None,
               order: int | None = None) -> torch.Tensor:
    """sum over this rank's pairs (local_ids >= 0) of w * expert_out rows (fp32), cast, + shared_out: [N, h].

    `order` overrides kernels/moe.py COMBINE_ORDER[device type] (SEQUENTIAL or INTERLEAVE4; for the GPU check).
    """
    shared = _check_combine(expert_out, topk_weights, local_ids, shared_out)
    n, k = topk_weights.shape
    h = shared.shape[1]
    if out is None:
        out = _new((n, h), shared.dtype, shared.device)
    elif out.shape != (n, h) or out.dtype != shared.dtype or not out.is_contiguous():
        raise ValueError(f"ep_combine: out is {list(out.shape)} {out.dtype}, want contiguous [{n}, {h}] {shared.dtype}")
    if n == 0 or h == 0:
        return out
    e2, s2, w2, l2 = (t if t.stride(-1) == 1 else t.contiguous()
                      for t in (expert_out, shared, topk_weights, local_ids))
    order = COMBINE_ORDER.get(shared.device.type, SEQUENTIAL) if order is None else order
    pdl = pdl and pdl_supported(shared.device)
    launch = {"launch_pdl": True} if pdl else {}
    block = min(COMBINE_BLOCK_H, triton.next_power_of_2(h))
    _moe_combine_kernel[(n, triton.cdiv(h, block))](                 # moe_combine's kernel, other ranks' pairs masked
        e2, w2, l2, s2, out, h, e2.stride(0), w2.stride(0), l2.stride(0), s2.stride(0), out.stride(0),
        TOP_K=k, BLOCK_H=block, ORDER=order, HAS_SHARED=shared_out is not None, PDL=pdl, HAS_LOCAL=True,
        num_warps=COMBINE_NUM_WARPS, **FP_OPTIONS, **launch)
    return out


def ep_align_ref(expert_ids: torch.Tensor, expert_map: torch.Tensor, num_local: int, block_m: int,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """lingc's reference ep_align."""
    return torch.ops.lingc.ep_align(expert_ids, expert_map, num_local, block_m)


def ep_combine_ref(expert_out: torch.Tensor, topk_weights: torch.Tensor, local_ids: torch.Tensor,
                   shared_out: torch.Tensor | None = None) -> torch.Tensor:
    """lingc's reference ep_combine."""
    return torch.ops.lingc.ep_combine(expert_out, topk_weights, local_ids, shared_out)


LOWERINGS = {"ep_align": ep_align, "ep_combine": ep_combine}
