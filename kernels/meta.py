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
    step_refill(seq_lens [B], T, page_table, slots, PS)  -> (step_positions, *paged_refill of them)   (capture_metadata)
    pick_position(x [B, T, ...], index [B], offset)      -> x[b, index[b] + offset]    [B, 1, ...]
    embedding(ids [B, T], table [V, h])                  -> table[ids]                 [B, T, h]
    emit_tokens(out_tokens [S, W], out_len [S], slots, tokens [B, n], count [B]?)
                                                         : out_tokens[slot, :n] = tokens[b], out_len[slot] = count or n
    emit_accepted(out_tokens, out_len, slots, tokens [B, n], count [B], seq [B])
                                                         : emit_tokens, then -> (tokens[b, count[b] - 1] [B, 1],
                                                           seq + count [B])                      (fuse_emit)
    gather_rows_multi(tables [S, ...] x N, slots [B])    -> [t[slots] for t in tables]  (fuse_relay)
    scatter_rows_multi(tables x N, slots, values x N, adds x N)
                                                         : t[slots] = v + a             (fuse_relay; a: int)

The two multi ops take up to RELAY_MULTI_MAX tables of any dtypes and row widths in one launch: a fixed set of
(pointer, row size, stride, block end) arguments per table with a constexpr count N (the sets past N are dummies
no program dereferences), the grid's second axis the tables' row blocks end to end, so a program copies one block
of one table's row. A scatter's add is a constexpr (one compile per folded constant: +1, +13, ...).

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
from lingc.ops.meta import RELAY_MULTI_MAX, check_relay_multi

BLOCK = 1024        # elements per program of a row copy
WARPS = 4


@triton.jit
def _take_rows_kernel(src_ptr, index_ptr, out_ptr, R, s_b, s_index, offset, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out[b] = the row at src + b * s_b + (index[b] + offset) * s_index: gather_rows and embedding (s_b = 0,
    offset 0) and pick_position."""
    b = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < R
    if PDL:
        pdl_wait()
    i = tl.load(index_ptr + b).to(tl.int64) + offset
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
def _paged_refill_kernel(pt_ptr, slots_ptr, pos_ptr, rows_ptr, locs_ptr, pos_out_ptr, MP, T, s_pt, s_pos_b, s_pos_t,
                         PS, BLOCK: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr,
                         FROM_SEQ: tl.constexpr = False):
    """FROM_SEQ (step_refill): pos_ptr is seq_lens [B]; the positions seq_lens[b] + t are computed (as
    _step_positions_kernel does) and stored to pos_out at rows of T (s_pos_b is then unused)."""
    b = tl.program_id(0).to(tl.int64)
    if PDL:
        pdl_wait()
    slot = tl.load(slots_ptr + b).to(tl.int64)
    row = pt_ptr + slot * s_pt
    t = tl.arange(0, BLOCK_T)
    tmask = t < T
    if FROM_SEQ:
        pos = tl.load(pos_ptr + b).to(tl.int64) + t
        tl.store(pos_out_ptr + b * T + t, pos, mask=tmask)
    else:
        pos = tl.load(pos_ptr + b * s_pos_b + t * s_pos_t, mask=tmask, other=0).to(tl.int64)
    page = tl.load(row + tl.minimum(pos // PS, MP - 1), mask=tmask, other=0).to(tl.int64)
    tl.store(locs_ptr + b * T + t, page * PS + pos % PS, mask=tmask)
    for start in range(0, MP, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < MP
        tl.store(rows_ptr + b * MP + offs, tl.load(row + offs, mask=mask), mask=mask)
    if PDL:
        pdl_trigger()


@triton.jit
def _gather_part(src_ptr, out_ptr, b, slot, blk, lo, hi, R, s_src, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One table's share of gather_rows_multi: the programs blk in [lo, hi) copy row `slot` block by block."""
    if (blk >= lo) & (blk < hi):
        offs = (blk - lo) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < R
        x = tl.load(src_ptr + slot * s_src + offs, mask=mask)
        if PDL:
            pdl_trigger()
        tl.store(out_ptr + b * R + offs, x, mask=mask)


@triton.jit
def _gather_rows_multi_kernel(slots_ptr,
                              src0, out0, R0, s0, E0, src1, out1, R1, s1, E1,
                              src2, out2, R2, s2, E2, src3, out3, R3, s3, E3,
                              src4, out4, R4, s4, E4, src5, out5, R5, s5, E5,
                              src6, out6, R6, s6, E6, src7, out7, R7, s7, E7,
                              N: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out_i[b] = src_i[slots[b]] for the N tables (N <= RELAY_MULTI_MAX; the argument sets past N are dummies).
    Grid (B, E_{N-1}): table i owns the row blocks [E_{i-1}, E_i), so each program copies one block of one row."""
    b = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    if PDL:
        pdl_wait()
    slot = tl.load(slots_ptr + b).to(tl.int64)
    _gather_part(src0, out0, b, slot, blk, 0, E0, R0, s0, BLOCK, PDL)
    if N > 1:
        _gather_part(src1, out1, b, slot, blk, E0, E1, R1, s1, BLOCK, PDL)
    if N > 2:
        _gather_part(src2, out2, b, slot, blk, E1, E2, R2, s2, BLOCK, PDL)
    if N > 3:
        _gather_part(src3, out3, b, slot, blk, E2, E3, R3, s3, BLOCK, PDL)
    if N > 4:
        _gather_part(src4, out4, b, slot, blk, E3, E4, R4, s4, BLOCK, PDL)
    if N > 5:
        _gather_part(src5, out5, b, slot, blk, E4, E5, R5, s5, BLOCK, PDL)
    if N > 6:
        _gather_part(src6, out6, b, slot, blk, E5, E6, R6, s6, BLOCK, PDL)
    if N > 7:
        _gather_part(src7, out7, b, slot, blk, E6, E7, R7, s7, BLOCK, PDL)


@triton.jit
def _scatter_part(buf_ptr, value_ptr, b, slot, blk, lo, hi, R, s_buf, s_value, ADD: tl.constexpr,
                  BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One table's share of scatter_rows_multi: buf[slot] = value[b] + ADD in the value's dtype, cast to buf's."""
    if (blk >= lo) & (blk < hi):
        offs = (blk - lo) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < R
        x = tl.load(value_ptr + b * s_value + offs, mask=mask)
        if PDL:
            pdl_trigger()
        if ADD != 0:
            x = x + ADD          # an integer constant fitting the value's dtype: the add stays in that dtype
        tl.store(buf_ptr + slot * s_buf + offs, x.to(buf_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scatter_rows_multi_kernel(slots_ptr,
                               buf0, val0, R0, sb0, sv0, E0, buf1, val1, R1, sb1, sv1, E1,
                               buf2, val2, R2, sb2, sv2, E2, buf3, val3, R3, sb3, sv3, E3,
                               buf4, val4, R4, sb4, sv4, E4, buf5, val5, R5, sb5, sv5, E5,
                               buf6, val6, R6, sb6, sv6, E6, buf7, val7, R7, sb7, sv7, E7,
                               A0: tl.constexpr, A1: tl.constexpr, A2: tl.constexpr, A3: tl.constexpr,
                               A4: tl.constexpr, A5: tl.constexpr, A6: tl.constexpr, A7: tl.constexpr,
                               N: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """buf_i[slots[b]] = val_i[b] + A_i for the N tables; the grid as in _gather_rows_multi_kernel."""
    b = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    if PDL:
        pdl_wait()
    slot = tl.load(slots_ptr + b).to(tl.int64)
    _scatter_part(buf0, val0, b, slot, blk, 0, E0, R0, sb0, sv0, A0, BLOCK, PDL)
    if N > 1:
        _scatter_part(buf1, val1, b, slot, blk, E0, E1, R1, sb1, sv1, A1, BLOCK, PDL)
    if N > 2:
        _scatter_part(buf2, val2, b, slot, blk, E1, E2, R2, sb2, sv2, A2, BLOCK, PDL)
    if N > 3:
        _scatter_part(buf3, val3, b, slot, blk, E2, E3, R3, sb3, sv3, A3, BLOCK, PDL)
    if N > 4:
        _scatter_part(buf4, val4, b, slot, blk, E3, E4, R4, sb4, sv4, A4, BLOCK, PDL)
    if N > 5:
        _scatter_part(buf5, val5, b, slot, blk, E4, E5, R5, sb5, sv5, A5, BLOCK, PDL)
    if N > 6:
        _scatter_part(buf6, val6, b, slot, blk, E5, E6, R6, sb6, sv6, A6, BLOCK, PDL)
    if N > 7:
        _scatter_part(buf7, val7, b, slot, blk, E6, E7, R7, sb7, sv7, A7, BLOCK, PDL)


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
    _take_rows_kernel[(B, nblk)](buf, slots, out, R, 0, buf.stride(0), 0, BLOCK=block, PDL=pdl, **opts)
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
    _paged_refill_kernel[(B,)](page_table, slots, positions, rows, locs, locs, MP, T, page_table.stride(0),
                               positions.stride(0), positions.stride(1), page_size,
                               BLOCK=min(BLOCK, triton.next_power_of_2(max(MP, 1))),
                               BLOCK_T=triton.next_power_of_2(max(T, 1)), PDL=pdl, **opts)
    return rows, locs


def step_refill(seq_lens: torch.Tensor, tokens: int, page_table: torch.Tensor, slots: torch.Tensor, page_size: int,
                *, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(step_positions(seq_lens, tokens), *paged_refill(page_table, slots, those positions, page_size))
    (lingc.step_refill): one launch, _paged_refill_kernel computing the positions itself (FROM_SEQ)."""
    B = slots.shape[0]
    if page_table.dim() != 2 or page_table.stride(1) != 1 or seq_lens.dim() != 1 or seq_lens.shape[0] != B:
        return torch.ops.lingc.step_refill(seq_lens, tokens, page_table, slots, page_size)   # the reference op
    MP = page_table.shape[1]
    positions = torch.empty((B, tokens), dtype=torch.int64, device=page_table.device)
    if B == 0 or tokens == 0:
        return positions, *paged_refill(page_table, slots, positions, page_size, pdl=pdl)
    rows = torch.empty((B, MP), dtype=page_table.dtype, device=page_table.device)
    locs = torch.empty((B, tokens), dtype=torch.int64, device=page_table.device)
    pdl, opts = _opts(pdl, page_table.device)
    _paged_refill_kernel[(B,)](page_table, slots, seq_lens, rows, locs, positions, MP, tokens, page_table.stride(0),
                               0, 0, page_size, BLOCK=min(BLOCK, triton.next_power_of_2(max(MP, 1))),
                               BLOCK_T=triton.next_power_of_2(tokens), PDL=pdl, FROM_SEQ=True, **opts)
    return positions, rows, locs


def pick_position(x: torch.Tensor, index: torch.Tensor, offset: int = 0, *, pdl: bool = False) -> torch.Tensor:
    """x[b, index[b] + offset] keeping a unit T axis (lingc.pick_position): one launch."""
    if x.dim() < 2 or not _rows_contiguous(x, 2) or index.dim() != 1:
        return torch.ops.lingc.pick_position(x, index, offset)
    B = x.shape[0]
    out = torch.empty((B, 1, *x.shape[2:]), dtype=x.dtype, device=x.device)
    R = _row_size(x, 2)
    if B == 0 or R == 0:
        return out
    pdl, opts = _opts(pdl, x.device)
    block, nblk = _grid_block(R)
    _take_rows_kernel[(B, nblk)](x, index, out, R, x.stride(0), x.stride(1), int(offset), BLOCK=block, PDL=pdl, **opts)
    return out


def _multi_blocks(rows: list[int]) -> tuple[int, list[int]]:
    """(BLOCK, block ends E_i): one BLOCK for every table (the widest row's, at most BLOCK), table i's blocks
    [E_{i-1}, E_i); the unused argument sets get the total, so their range is empty."""
    block = min(BLOCK, triton.next_power_of_2(max(max(rows), 1)))
    ends, total = [], 0
    for r in rows:
        total += triton.cdiv(r, block)
        ends.append(total)
    return block, ends + [total] * (RELAY_MULTI_MAX - len(rows))


def _chunks(n: int) -> list[range]:
    return [range(i, min(i + RELAY_MULTI_MAX, n)) for i in range(0, n, RELAY_MULTI_MAX)]


def gather_rows_multi(tables: list[torch.Tensor], slots: torch.Tensor, *, pdl: bool = False) -> list[torch.Tensor]:
    """[t[slots] for t in tables] (lingc.gather_rows_multi): one launch per RELAY_MULTI_MAX tables, one program
    per (request, block of one table's row); tables of any dtypes and row widths."""
    check_relay_multi("gather_rows_multi", tables, slots)
    if not all(_rows_contiguous(t, 1) for t in tables):
        return torch.ops.lingc.gather_rows_multi(tables, slots)
    B = slots.shape[0]
    outs = [torch.empty((B, *t.shape[1:]), dtype=t.dtype, device=t.device) for t in tables]
    pdl, opts = _opts(pdl, slots.device)
    for part in _chunks(len(tables)):
        rows = [_row_size(tables[i], 1) for i in part]
        block, ends = _multi_blocks(rows)
        if B == 0 or ends[-1] == 0:
            continue
        args = []
        for k in range(RELAY_MULTI_MAX):
            if k < len(part):
                t = tables[part[k]]
                args += [t, outs[part[k]], rows[k], t.stride(0), ends[k]]
            else:                                   # dummies: never dereferenced (N is a constexpr)
                args += [slots, slots, 0, 0, ends[k]]
        _gather_rows_multi_kernel[(B, ends[-1])](slots, *args, N=len(part), BLOCK=block, PDL=pdl, **opts)
    return outs


def _foldable_add(value: torch.Tensor, add: int) -> bool:
    """The kernel adds an integer constant in the value's dtype: int32 / int64 values, a constant that fits them."""
    if add == 0:
        return True
    if value.dtype not in (torch.int32, torch.int64):
        return False
    info = torch.iinfo(value.dtype)
    return info.min <= add <= info.max


def _disjoint(tables: list[torch.Tensor]) -> bool:
    """No element of one table is an element of another. Tables in distinct storages are; tables sharing one (the
    column slices fuse_relay_cat writes) must have the same row stride and dtype and start in the same row, and
    their rows' element spans (at their offsets within that row) must stay inside the row and not overlap.
    Anything else counts as overlapping."""
    by_storage: dict[int, list[torch.Tensor]] = {}
    for t in tables:
        by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    for group in by_storage.values():
        if len(group) == 1:
            continue
        s0, dtype = group[0].stride(0), group[0].dtype
        if s0 <= 0 or any(t.stride(0) != s0 or t.dtype != dtype or min(t.stride()) < 0 for t in group):
            return False
        spans = []
        for t in group:
            row, col = divmod(t.storage_offset(), s0)
            end = col + 1 + sum(max(size - 1, 0) * stride for size, stride in zip(t.shape[1:], t.stride()[1:]))
            if row != group[0].storage_offset() // s0 or end > s0:
                return False
            spans.append((col, end))
        spans.sort()
        if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
            return False
    return True


def scatter_rows_multi(tables: list[torch.Tensor], slots: torch.Tensor, values: list[torch.Tensor], adds: list[int],
                       *, pdl: bool = False) -> None:
    """table[slots] = value + add for each table (lingc.scatter_rows_multi): one launch per RELAY_MULTI_MAX tables.
    Tables that overlap (one launch would write them in no order; column slices of one table do not, `_disjoint`),
    rows that are not contiguous and adds the kernel does not fold run the torch reference (no host reads either
    way)."""
    check_relay_multi("scatter_rows_multi", tables, slots, values, adds)
    B = slots.shape[0]
    if (not _disjoint(tables)
            or not all(_rows_contiguous(t, 1) and _rows_contiguous(v, 1) and _foldable_add(v, a)
                       for t, v, a in zip(tables, values, adds))):
        torch.ops.lingc.scatter_rows_multi(tables, slots, values, adds)
        return
    pdl, opts = _opts(pdl, slots.device)
    for part in _chunks(len(tables)):
        rows = [_row_size(tables[i], 1) for i in part]
        block, ends = _multi_blocks(rows)
        if B == 0 or ends[-1] == 0:
            continue
        args, consts = [], {}
        for k in range(RELAY_MULTI_MAX):
            if k < len(part):
                t, v = tables[part[k]], values[part[k]]
                args += [t, v, rows[k], t.stride(0), v.stride(0), ends[k]]
                consts[f"A{k}"] = int(adds[part[k]])
            else:                                   # dummies: never dereferenced (N is a constexpr)
                args += [slots, slots, 0, 0, 0, ends[k]]
                consts[f"A{k}"] = 0
        _scatter_rows_multi_kernel[(B, ends[-1])](slots, *args, **consts, N=len(part), BLOCK=block, PDL=pdl, **opts)


@triton.jit
def _emit_tokens_kernel(out_tokens_ptr, out_len_ptr, slots_ptr, tokens_ptr, count_ptr, n, s_out, s_tokens,
                        HAS_COUNT: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """out_tokens[slots[b], :n] = tokens[b, :n]; out_len[slots[b]] = count[b] (or n)."""
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_N)
    if PDL:
        pdl_wait()
    slot = tl.load(slots_ptr + b).to(tl.int64)
    tok = tl.load(tokens_ptr + b * s_tokens + i, mask=i < n)
    if HAS_COUNT:
        count = tl.load(count_ptr + b)
    else:
        count = n
    if PDL:
        pdl_trigger()
    tl.store(out_tokens_ptr + slot * s_out + i, tok.to(out_tokens_ptr.dtype.element_ty), mask=i < n)
    tl.store(out_len_ptr + slot, count.to(out_len_ptr.dtype.element_ty))


@triton.jit
def _emit_accepted_kernel(out_tokens_ptr, out_len_ptr, slots_ptr, tokens_ptr, count_ptr, seq_ptr, last_ptr, next_ptr,
                          n, s_out, s_tokens, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """_emit_tokens_kernel with a count, then last[b] = tokens[b, count[b] - 1] (a negative index wraps, as torch's
    indexing) and next[b] = seq[b] + count[b] in next's dtype (torch's promotion of the add)."""
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_N)
    if PDL:
        pdl_wait()
    slot = tl.load(slots_ptr + b).to(tl.int64)
    tok = tl.load(tokens_ptr + b * s_tokens + i, mask=i < n, other=0)
    count = tl.load(count_ptr + b)
    seq = tl.load(seq_ptr + b)
    if PDL:
        pdl_trigger()
    tl.store(out_tokens_ptr + slot * s_out + i, tok.to(out_tokens_ptr.dtype.element_ty), mask=i < n)
    tl.store(out_len_ptr + slot, count.to(out_len_ptr.dtype.element_ty))
    pick = count.to(tl.int64) - 1
    pick = tl.where(pick < 0, pick + n, pick)
    tl.store(last_ptr + b, tl.sum(tl.where(i == pick, tok, 0), axis=0).to(last_ptr.dtype.element_ty))
    ty = next_ptr.dtype.element_ty
    tl.store(next_ptr + b, seq.to(ty) + count.to(ty))


def embedding(input_ids: torch.Tensor, table: torch.Tensor, *, pdl: bool = False) -> torch.Tensor:
    """table[input_ids] [B, T, h] (lingc.embedding): one launch, one program per (token, block of the row), the
    gather_rows kernel with the ids as the index (an exact copy). Ids are not range-checked on the device (the
    engine checks prompt ids on the host; sampled ids are < V)."""
    if input_ids.dim() != 2 or table.dim() != 2 or table.stride(1) != 1 or input_ids.is_floating_point():
        return torch.ops.lingc.embedding(input_ids, table)
    B, T = input_ids.shape
    h = table.shape[1]
    out = torch.empty((B, T, h), dtype=table.dtype, device=table.device)
    if B * T == 0 or h == 0:
        return out
    ids = input_ids.reshape(-1)
    ids = ids if ids.stride(0) == 1 else ids.contiguous()      # the kernel reads ids[b] at index_ptr + b
    pdl, opts = _opts(pdl, table.device)
    block, nblk = _grid_block(h)
    _take_rows_kernel[(B * T, nblk)](table, ids, out, h, 0, table.stride(0), 0, BLOCK=block, PDL=pdl, **opts)
    return out


def emit_tokens(out_tokens: torch.Tensor, out_len: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor,
                count: torch.Tensor | None = None, *, pdl: bool = False) -> None:
    """Publish a step's tokens (lingc.emit_tokens): out_tokens[slot, :n] = tokens[b], out_len[slot] = count[b] or
    n, one launch (the reference is an index_put and an index_fill / index_put)."""
    if (out_tokens.dim() != 2 or out_tokens.stride(1) != 1 or tokens.dim() != 2 or tokens.stride(1) != 1
            or slots.dim() != 1 or out_len.dim() != 1 or tokens.shape[1] > out_tokens.shape[1]):
        torch.ops.lingc.emit_tokens(out_tokens, out_len, slots, tokens, count)
        return
    B, n = tokens.shape
    if B == 0 or n == 0:
        torch.ops.lingc.emit_tokens(out_tokens, out_len, slots, tokens, count)
        return
    pdl, opts = _opts(pdl, tokens.device)
    _emit_tokens_kernel[(B,)](out_tokens, out_len, slots, tokens, count if count is not None else slots, n,
                              out_tokens.stride(0), tokens.stride(0), HAS_COUNT=count is not None,
                              BLOCK_N=triton.next_power_of_2(n), PDL=pdl, **opts)


def emit_accepted(out_tokens: torch.Tensor, out_len: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor,
                  count: torch.Tensor, seq: torch.Tensor, *, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """emit_tokens + pick_position(tokens, count, -1) + seq + count (lingc.emit_accepted) in one launch: one
    program per request. Integer copies and one integer add: the reference's values exactly."""
    B = tokens.shape[0] if tokens.dim() == 2 else 0
    if (out_tokens.dim() != 2 or out_tokens.stride(1) != 1 or tokens.dim() != 2 or tokens.stride(1) != 1
            or tokens.shape[1] > out_tokens.shape[1] or tokens.shape[1] == 0 or slots.dim() != 1 or out_len.dim() != 1
            or any(t.shape != (B,) or t.is_floating_point() for t in (slots, count, seq)) or B == 0):
        return torch.ops.lingc.emit_accepted(out_tokens, out_len, slots, tokens, count, seq)
    n = tokens.shape[1]
    last = torch.empty((B, 1), dtype=tokens.dtype, device=tokens.device)
    nxt = torch.empty((B,), dtype=torch.promote_types(seq.dtype, count.dtype), device=seq.device)
    pdl, opts = _opts(pdl, tokens.device)
    _emit_accepted_kernel[(B,)](out_tokens, out_len, slots, tokens, count, seq, last, nxt, n, out_tokens.stride(0),
                                tokens.stride(0), BLOCK_N=triton.next_power_of_2(n), PDL=pdl, **opts)
    return last, nxt


LOWERINGS: dict[str, Callable] = {
    "embedding": embedding,
    "emit_tokens": emit_tokens,
    "emit_accepted": emit_accepted,
    "gather_rows": gather_rows,
    "scatter_rows": scatter_rows,
    "step_positions": step_positions,
    "paged_refill": paged_refill,
    "step_refill": step_refill,
    "pick_position": pick_position,
    "gather_rows_multi": gather_rows_multi,
    "scatter_rows_multi": scatter_rows_multi,
}
