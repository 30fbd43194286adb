"""Metadata and relay kernels: one launch each for the per-slot index ops of lingc/ops/meta.py.

At batch 1 these ops move a few bytes, but their torch references cost two to seven kernels each (an index
cast, the gather, a clone, the integer math of a cache location), about 2 us apiece: the profiled draft graph
spent ~130 us in them (bench/device_profile.py). Each launcher here is one program per request row:

    gather_rows(buf [S, ...], slots [B])                 -> buf[slots]                [B, ...]
    scatter_rows(buf [S, ...], slots [B], value [B, ...]) : buf[slots] = value         (cast to buf's dtype)
    step_positions(seq_lens [B], T)                      -> seq_lens[:, None] + arange(T)   int64 [B, T]
    paged_refill(page_table [S, MP], slots [B], positions [B, T], PS)
                                                         -> (page_table[slots] [B, MP],
                                                             page_rows[b, min(pos // PS, MP - 1)] * PS + pos % PS)
    pick_position(x [B, T, ...], index [B])              -> x[b, index[b]]             [B, 1, ...]

Exact: they copy values or do integer arithmetic, so outputs equal the references bit for bit (positions and
slots are non-negative, where C-style and floor division agree). The rows past the batch dim must be
contiguous (the relay buffers, page tables and activations lingc allocates are); a launcher given anything
else runs the torch reference instead, which is still capturable (no host reads). No launch reads a device
value on the host. PDL: none of these load weights, so with the constexpr PDL on they wait at the top and
trigger after their last load; the `pdl` pass does not put them in chains today.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from lingc.kernels.pdl import pdl_supported, pdl_trigger, pdl_wait
import lingc.ops  # noqa: F401  (registers torch.ops.lingc.*, used by the fallbacks and references)

BLOCK = 1024        # elements per program of a row copy
WARPS = 4


@triton.jit
def _take_rows_kernel(src_ptr, index_ptr, out_ptr, R, s_b, s_index, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out[b] = the row at src + b * s_b + index[b] * s_index: gather_rows (s_b = 0) and pick_position."""
    b = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < R
    if PDL:
        pdl_wait()
    i = tl.load(index_ptr + b).to(tl.int64)
    x = tl.load(src_ptr + b * s_b + i * s_index + offs, mask=mask)
    if PDL:
        pdl_trigger()
    tl.store(out_ptr + b * R + offs, x, mask=mask)


@triton.jit
def _scatter_rows_kernel(buf_ptr, slots_ptr, value_ptr, R, s_buf, s_value, BLOCK: tl.constexpr, PDL: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < R
    if PDL:
        pdl_wait()
    slot = tl.load(slots_ptr + b).to(tl.int64)
    x = tl.load(value_ptr + b * s_value + offs, mask=mask)
    if PDL:
        pdl_trigger()
    tl.store(buf_ptr + slot * s_buf + offs, x.to(buf_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _step_positions_kernel(seq_ptr, out_ptr, T, BLOCK_T: tl.constexpr, PDL: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, BLOCK_T)
    if PDL:
        pdl_wait()
    base = tl.load(seq_ptr + b).to(tl.int64)
    if PDL:
        pdl_trigger()
    tl.store(out_ptr + b * T + t, base + t, mask=t < T)


@triton.jit
def _paged_refill_kernel(pt_ptr, slots_ptr, pos_ptr, rows_ptr, locs_ptr, MP, T, s_pt, s_pos_b, s_pos_t, PS,
                         BLOCK: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    if PDL:
        pdl_wait()
    slot = tl.load(slots_ptr + b).to(tl.int64)
    row = pt_ptr + slot * s_pt
    t = tl.arange(0, BLOCK_T)
    tmask = t < T
    pos = tl.load(pos_ptr + b * s_pos_b + t * s_pos_t, mask=tmask, other=0).to(tl.int64)
    page = tl.load(row + tl.minimum(pos // PS, MP - 1), mask=tmask, other=0).to(tl.int64)
    tl.store(locs_ptr + b * T + t, page * PS + pos % PS, mask=tmask)
    for start in range(0, MP, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < MP
        tl.store(rows_ptr + b * MP + offs, tl.load(row + offs, mask=mask), mask=mask)
    if PDL:
        pdl_trigger()


def _rows_contiguous(t: torch.Tensor, lead: int) -> bool:
    """The dims after the first `lead` form one contiguous run of elements (any lead strides)."""
    expected = 1
    for size, stride in zip(reversed(t.shape[lead:]), reversed(t.stride()[lead:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _row_size(t: torch.Tensor, lead: int) -> int:
    n = 1
    for s in t.shape[lead:]:
        n *= s
    return n


def _opts(pdl: bool, device: torch.device) -> tuple[bool, dict]:
    pdl = pdl and pdl_supported(device)
    return pdl, ({"launch_pdl": True} if pdl else {}) | {"num_warps": WARPS}


def _grid_block(R: int) -> tuple[int, int]:
    block = min(BLOCK, triton.next_power_of_2(max(R, 1)))
    return block, triton.cdiv(R, block)


def gather_rows(buf: torch.Tensor, slots: torch.Tensor, *, pdl: bool = False) -> torch.Tensor:
    """buf[slots] (lingc.gather_rows): one launch, one program per (request, block of the row)."""
    B = slots.shape[0]
    if not _rows_contiguous(buf, 1) or slots.dim() != 1:
        return torch.ops.lingc.gather_rows(buf, slots)
    out = torch.empty((B, *buf.shape[1:]), dtype=buf.dtype, device=buf.device)
    R = _row_size(buf, 1)
    if B == 0 or R == 0:
        return out
    pdl, opts = _opts(pdl, buf.device)
    block, nblk = _grid_block(R)
    _take_rows_kernel[(B, nblk)](buf, slots, out, R, 0, buf.stride(0), BLOCK=block, PDL=pdl, **opts)
    return out


def scatter_rows(buf: torch.Tensor, slots: torch.Tensor, value: torch.Tensor, *, pdl: bool = False) -> None:
    """buf[slots] = value (lingc.scatter_rows): one launch."""
    B = slots.shape[0]
    R = _row_size(buf, 1)
    if (not _rows_contiguous(buf, 1) or slots.dim() != 1 or value.shape[0] != B or value.numel() != B * R
            or not _rows_contiguous(value, 1)):
        torch.ops.lingc.scatter_rows(buf, slots, value)
        return
    if B == 0 or R == 0:
        return
    pdl, opts = _opts(pdl, buf.device)
    block, nblk = _grid_block(R)
    _scatter_rows_kernel[(B, nblk)](buf, slots, value, R, buf.stride(0), value.stride(0), BLOCK=block, PDL=pdl, **opts)


def step_positions(seq_lens: torch.Tensor, tokens: int, *, pdl: bool = False) -> torch.Tensor:
    """seq_lens[:, None] + arange(tokens), int64 (lingc.step_positions): one launch."""
    B = seq_lens.shape[0]
    out = torch.empty((B, tokens), dtype=torch.int64, device=seq_lens.device)
    if B == 0 or tokens == 0:
        return out
    if seq_lens.dim() != 1:
        return torch.ops.lingc.step_positions(seq_lens, tokens)
    pdl, opts = _opts(pdl, seq_lens.device)
    _step_positions_kernel[(B,)](seq_lens, out, tokens, BLOCK_T=triton.next_power_of_2(tokens), PDL=pdl, **opts)
    return out


def paged_refill(page_table: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, page_size: int, *,
                 pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(page_table[slots], flat cache row of each position) (lingc.paged_refill): one launch."""
    B, MP = slots.shape[0], page_table.shape[1]
    if page_table.dim() != 2 or page_table.stride(1) != 1 or positions.dim() != 2 or positions.shape[0] != B:
        return torch.ops.lingc.paged_refill(page_table, slots, positions, page_size)
    T = positions.shape[1]
    rows = torch.empty((B, MP), dtype=page_table.dtype, device=page_table.device)
    locs = torch.empty((B, T), dtype=torch.int64, device=page_table.device)
    if B == 0:
        return rows, locs
    pdl, opts = _opts(pdl, page_table.device)
    _paged_refill_kernel[(B,)](page_table, slots, positions, rows, locs, MP, T, page_table.stride(0),
                               positions.stride(0), positions.stride(1), page_size,
                               BLOCK=min(BLOCK, triton.next_power_of_2(max(MP, 1))),
                               BLOCK_T=triton.next_power_of_2(max(T, 1)), PDL=pdl, **opts)
    return rows, locs


def pick_position(x: torch.Tensor, index: torch.Tensor, *, pdl: bool = False) -> torch.Tensor:
    """x[b, index[b]] keeping a unit T axis (lingc.pick_position): one launch."""
    if x.dim() < 2 or not _rows_contiguous(x, 2) or index.dim() != 1:
        return torch.ops.lingc.pick_position(x, index)
    B = x.shape[0]
    out = torch.empty((B, 1, *x.shape[2:]), dtype=x.dtype, device=x.device)
    R = _row_size(x, 2)
    if B == 0 or R == 0:
        return out
    pdl, opts = _opts(pdl, x.device)
    block, nblk = _grid_block(R)
    _take_rows_kernel[(B, nblk)](x, index, out, R, x.stride(0), x.stride(1), BLOCK=block, PDL=pdl, **opts)
    return out


LOWERINGS: dict[str, Callable] = {
    "gather_rows": gather_rows,
    "scatter_rows": scatter_rows,
    "step_positions": step_positions,
    "paged_refill": paged_refill,
    "pick_position": pick_position,
}
