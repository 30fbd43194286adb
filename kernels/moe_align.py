"""moe_align as one single-program Triton kernel over the pair axis (numel <= 64), launcher and reference.

Output contract of `torch.ops.lingc.moe_align` (lingc/ops/moe.py; shared/docs/techniques.md section 6), for NP
(token, expert) pairs, E experts and GEMM block BM:
    sorted_pairs  int32 [NP + E*(BM-1)]   pair indices grouped by expert in id order (expert 0 first), stable
                                          by pair index inside an expert, each expert's segment padded to a
                                          multiple of BM; every other cell (padding and tail) holds NP
    block_expert  int32 [cdiv(NP + E*(BM-1), BM)]   the expert of each BM-row block, -1 past the total
    total         int32 [1]               sum over experts of ceil(count_e / BM) * BM

After fuse_shared_expert the ids are [N, k+1] (column k is the shared expert E - 1 of E = experts + 1): nothing
changes here but the counts, and the shared expert's bucket (the last) holds N pairs.

Pair-axis algorithm (techniques.md section 6, "pair-axis variant"): one program loads the NP expert ids into
registers, padded to NP_BLOCK (a power of two) with the out-of-range id E, and compares them pairwise
([NP_BLOCK, NP_BLOCK], row i against column j):
    rank_i   = #{j < i : e_j == e_i}          stable rank inside the bucket
    count_i  = #{j : e_j == e_i}              bucket population, padded_i = ceil(count_i / BM) * BM
    offset_i = sum of padded_j over the rank-0 representatives j with e_j < e_i   (each bucket counted once)
    total    = sum of padded_j over all representatives
then stores sorted_pairs[offset_i + rank_i] = i, block_expert[offset_i / BM + b] = e_i for the
padded_i / BM blocks of each representative, and total. Every pair's expert owns at most ceil(count/BM) <= count
blocks, so the blocks in use fit in NP_BLOCK and one [NP_BLOCK, NP_BLOCK] masked store writes them all.
The padding lanes carry id E, larger than every real id, so they never enter a real offset, and are masked off.

The kernel writes every output element itself, so no torch op sits between it and the router in a PDL
chain: it first fills all of sorted_pairs with NP and all of block_expert with -1 (FILL_BLOCK cells per
step), then a CTA barrier (`tl.debug_barrier`, bar.sync: the fills of every warp are visible before any
later store), then scatters the pairs and the blocks' experts over the fills and stores the total.

Registers grow as NP^2 (techniques.md: about 4 us at NP = 64 on the GPU, spilling badly by NP = 256), so the
single program is used for numel <= MAX_PAIRS only; larger inputs go to the reference op. A generic
multi-kernel version (count / scan / scatter) for numel > MAX_PAIRS is future work.

PDL placement (shared/docs/kernels.md section 1.5): with the constexpr PDL on, `gdc_wait()` is the first
statement (the expert ids come from the router kernel, and even the sentinel fills must not start while an
earlier kernel may still use the memory), and `gdc_launch_dependents()` follows the load of the expert ids,
the last dependent load. With PDL off no GDC call is emitted at all: the Triton interpreter cannot run them
(kernels.md section 1.2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lingc.kernels.pdl import pdl_supported, pdl_trigger, pdl_wait
import lingc.ops  # noqa: F401  (registers torch.ops.lingc.*, used by the reference)
from lingc.ops.moe import align_sizes

# Tunables. The single program holds [NP_BLOCK, NP_BLOCK] int32 tiles, so it is gated on the pair count.
MAX_PAIRS = 64          # numel above this goes to the reference op (dispatch gate of techniques.md section 6)
MIN_NP_BLOCK = 16       # smallest pair block (tl.arange wants a power of two; keeps tiny tiles warp-sized)
FILL_BLOCK = 1024       # sentinel cells written per step (E=128, BM=16: 2 steps for sorted_pairs)
NUM_WARPS = 4


@triton.jit
def _moe_align_pairs_kernel(ids_ptr, sorted_ptr, block_expert_ptr, total_ptr, NP, E, BM, MAX_PADDED, BLOCKS,
                            NP_BLOCK: tl.constexpr, FILL: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        pdl_wait()
    offs = tl.arange(0, NP_BLOCK)
    valid = offs < NP
    e = tl.load(ids_ptr + offs, mask=valid, other=E).to(tl.int32)        # [NP_BLOCK], padding lanes = E
    if PDL:
        pdl_trigger()
    # sentinels everywhere first (padding inside each expert's last block, the tail past the total)
    fill = tl.arange(0, FILL)
    for start in range(0, MAX_PADDED, FILL):
        tl.store(sorted_ptr + start + fill, tl.full((FILL,), 0, tl.int32) + NP, mask=start + fill < MAX_PADDED)
    for start in range(0, BLOCKS, FILL):
        tl.store(block_expert_ptr + start + fill, tl.full((FILL,), -1, tl.int32), mask=start + fill < BLOCKS)
    tl.debug_barrier()  # every warp's fills land before the scatters below overwrite some of them
    e_i = e[:, None]                                                     # [NP_BLOCK, 1] row pair i
    e_j = e[None, :]                                                     # [1, NP_BLOCK] column pair j
    valid_j = valid[None, :]
    same = (e_i == e_j) & valid_j                                        # [NP_BLOCK, NP_BLOCK]
    rank = tl.sum((same & (offs[None, :] < offs[:, None])).to(tl.int32), axis=1)  # [NP_BLOCK]
    count = tl.sum(same.to(tl.int32), axis=1)                            # [NP_BLOCK]
    padded = (count + BM - 1) // BM * BM                                 # [NP_BLOCK]
    rep = valid & (rank == 0)                                            # one representative per bucket
    rep_padded = tl.where(rep, padded, 0)                                # [NP_BLOCK]
    smaller = (e_j < e_i).to(tl.int32)                                   # [NP_BLOCK, NP_BLOCK]
    offset = tl.sum(smaller * rep_padded[None, :], axis=1)               # [NP_BLOCK] exclusive offsets
    total = tl.sum(rep_padded, axis=0)
    tl.store(sorted_ptr + offset + rank, offs, mask=valid)
    # block_expert: representative i owns blocks offset_i/BM + b for b < padded_i/BM (b < NP_BLOCK always)
    b = offs[None, :]                                                    # [1, NP_BLOCK]
    own = rep[:, None] & (b < (padded // BM)[:, None])                   # [NP_BLOCK, NP_BLOCK]
    tl.store(block_expert_ptr + (offset // BM)[:, None] + b, e_i + 0 * b, mask=own)
    tl.store(total_ptr, total)


def _new_int32(n: int, device: torch.device) -> torch.Tensor:
    """An uninitialised int32 output (the kernel writes every element; tests poison it here)."""
    return torch.empty((n,), dtype=torch.int32, device=device)


def moe_align(expert_ids: torch.Tensor, num_experts: int, block_m: int, pdl: bool = False,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_pairs, block_expert, total) as torch.ops.lingc.moe_align, for expert ids [N, k] in [0, E).

    numel <= MAX_PAIRS runs the single-program kernel; larger (or empty) inputs use the reference op
    (a generic multi-kernel version is future work). pdl is dropped where unsupported.
    """
    if expert_ids.dtype.is_floating_point or expert_ids.dtype.is_complex or expert_ids.dtype == torch.bool:
        raise ValueError(f"moe_align: expert_ids must be integer, got {expert_ids.dtype}")
    if num_experts < 1 or block_m < 1:
        raise ValueError(f"moe_align: want num_experts >= 1 and block_m >= 1, got {num_experts}, {block_m}")
    num_pairs = expert_ids.numel()
    if num_pairs == 0 or num_pairs > MAX_PAIRS:
        return moe_align_ref(expert_ids, num_experts, block_m)
    flat = expert_ids.reshape(-1).contiguous()  # [NP]
    max_padded, blocks = align_sizes(num_pairs, num_experts, block_m)
    sorted_pairs = _new_int32(max_padded, flat.device)
    block_expert = _new_int32(blocks, flat.device)
    total = _new_int32(1, flat.device)
    pdl = pdl and pdl_supported(flat.device)
    launch = {"launch_pdl": True} if pdl else {}
    np_block = max(MIN_NP_BLOCK, triton.next_power_of_2(num_pairs))
    _moe_align_pairs_kernel[(1,)](flat, sorted_pairs, block_expert, total, num_pairs, num_experts, block_m,
                                  max_padded, blocks, NP_BLOCK=np_block, FILL=FILL_BLOCK, PDL=pdl,
                                  num_warps=NUM_WARPS, **launch)
    return sorted_pairs, block_expert, total


def moe_align_ref(expert_ids: torch.Tensor, num_experts: int, block_m: int,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """lingc's reference moe_align."""
    return torch.ops.lingc.moe_align(expert_ids, num_experts, block_m)


LOWERINGS = {"moe_align": moe_align}
