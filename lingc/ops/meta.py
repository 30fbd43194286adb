"""Metadata and relay ops: per-request index math and persistent buffers read and written by request slot.

Every step derives what it needs on the device from buffers indexed by request slot (the FutureMap
idea, techniques.md section 1): the host only says which slots run. `gather_rows` / `scatter_rows`
are the relay reads and writes (`gather_rows_multi` / `scatter_rows_multi`: several of them by one slots tensor in
one op, built by the fuse_relay pass); `cache_locs` and `step_positions` are the metadata refill.
Letters: S request slots, B requests in the step, T tokens, MP pages per request, PS page size.
"""

from __future__ import annotations

from typing import Optional

import torch

from lingc.ops.registry import register


@torch.library.custom_op("lingc::gather_rows", mutates_args=())
def gather_rows(buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """buf[slots]: buf [S, ...], slots [B] int32 -> [B, ...] (a relay read, or a request's page-table row)."""
    return buf[slots.long()].clone()


@gather_rows.register_fake
def _(buf, slots):
    return buf.new_empty((slots.shape[0], *buf.shape[1:]))


register("gather_rows")


@torch.library.custom_op("lingc::scatter_rows", mutates_args=("buf",))
def scatter_rows(buf: torch.Tensor, slots: torch.Tensor, value: torch.Tensor) -> None:
    """buf[slots] = value: a relay write, visible to later graphs and steps. value [B, ...]."""
    buf[slots.long()] = value.to(buf.dtype)


@scatter_rows.register_fake
def _(buf, slots, value):
    return None


register("scatter_rows")


@torch.library.custom_op("lingc::step_positions", mutates_args=())
def step_positions(seq_lens: torch.Tensor, tokens: int) -> torch.Tensor:
    """Positions of a step's tokens: seq_lens [B] (tokens already cached) -> [B, T] int64."""
    return seq_lens.long().unsqueeze(-1) + torch.arange(tokens, device=seq_lens.device)


@step_positions.register_fake
def _(seq_lens, tokens):
    return seq_lens.new_empty((seq_lens.shape[0], tokens), dtype=torch.int64)


register("step_positions")


@torch.library.custom_op("lingc::cache_locs", mutates_args=())
def cache_locs(page_rows: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Flat cache row of each token: page_rows[b, pos // PS] * PS + pos % PS. page_rows [B, MP] -> [B, T] int64."""
    pos = positions.long()
    page = page_rows.long().gather(1, (pos // page_size).clamp(max=page_rows.shape[1] - 1))
    return page * page_size + pos % page_size


@cache_locs.register_fake
def _(page_rows, positions, page_size):
    return positions.new_empty(positions.shape, dtype=torch.int64)


register("cache_locs")


@torch.library.custom_op("lingc::pick_position", mutates_args=())
def pick_position(x: torch.Tensor, index: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """x[b, index[b] + offset] for each request, keeping the T axis: x [B, T, ...], index [B] -> [B, 1, ...]
    (offset: a constant the caller would otherwise add to index in a launch of its own, e.g. accept_len - 1)."""
    B = x.shape[0]
    return x[torch.arange(B, device=x.device), index.long() + offset].unsqueeze(1).clone()


@pick_position.register_fake
def _(x, index, offset=0):
    return x.new_empty((x.shape[0], 1, *x.shape[2:]))


register("pick_position")


@torch.library.custom_op("lingc::emit_tokens", mutates_args=("out_tokens", "out_len"))
def emit_tokens(out_tokens: torch.Tensor, out_len: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor,
                count: Optional[torch.Tensor] = None) -> None:
    """Publish a step's new tokens for the host: out_tokens[slot, :n] = tokens[b, :n], out_len[slot] = count[b].

    out_tokens [S, W] int64, out_len [S] int32, tokens [B, n] (n <= W), count [B] (default n). The host copies these
    one step late on a side stream; entries past count are left as they were.
    """
    idx = slots.long()
    n = tokens.shape[1]
    out_tokens[idx, :n] = tokens.to(out_tokens.dtype)
    if count is None:       # index_fill_: `out_len[idx] = n` would copy a CPU scalar (not allowed in CUDA graphs)
        out_len.index_fill_(0, idx, n)
    else:
        out_len[idx] = count.to(out_len.dtype)


@emit_tokens.register_fake
def _(out_tokens, out_len, slots, tokens, count=None):
    return None


register("emit_tokens")


@torch.library.custom_op("lingc::emit_accepted", mutates_args=("out_tokens", "out_len"))
def emit_accepted(out_tokens: torch.Tensor, out_len: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor,
                  count: torch.Tensor, seq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A verify's publish tail in one op (fuse_emit): emit_tokens(out_tokens, out_len, slots, tokens, count), then
    (pick_position(tokens, count, -1) [B, 1], seq + count [B]): the chain's last accepted token (the next root)
    and the advanced sequence length, in torch's dtypes for that index and that add."""
    emit_tokens(out_tokens, out_len, slots, tokens, count)
    return pick_position(tokens, count, -1), seq + count


@emit_accepted.register_fake
def _(out_tokens, out_len, slots, tokens, count, seq):
    return (tokens.new_empty((tokens.shape[0], 1)),
            torch.empty(torch.broadcast_shapes(seq.shape, count.shape),
                        dtype=torch.promote_types(seq.dtype, count.dtype), device=seq.device))


register("emit_accepted")


@torch.library.custom_op("lingc::paged_refill", mutates_args=())
def paged_refill(page_table: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                 page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gather_rows + cache_locs in one op (fuse_index_chains): the requests' page rows [B, MP] and the flat
    cache row of each token [B, T]. Unallocated page-table entries already hold the harmless page."""
    page_rows = page_table[slots.long()].clone()
    return page_rows, cache_locs(page_rows, positions, page_size)


@paged_refill.register_fake
def _(page_table, slots, positions, page_size):
    return (page_table.new_empty((slots.shape[0], page_table.shape[1])),
            positions.new_empty(positions.shape, dtype=torch.int64))


register("paged_refill")


@torch.library.custom_op("lingc::step_refill", mutates_args=())
def step_refill(seq_lens: torch.Tensor, tokens: int, page_table: torch.Tensor, slots: torch.Tensor,
                page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """step_positions + paged_refill of those positions in one op (capture_metadata): the positions [B, T] int64,
    the requests' page rows [B, MP] and the flat cache row of each position [B, T]."""
    positions = step_positions(seq_lens, tokens)
    return (positions, *paged_refill(page_table, slots, positions, page_size))


@step_refill.register_fake
def _(seq_lens, tokens, page_table, slots, page_size):
    B = seq_lens.shape[0]
    return (seq_lens.new_empty((B, tokens), dtype=torch.int64), page_table.new_empty((B, page_table.shape[1])),
            seq_lens.new_empty((B, tokens), dtype=torch.int64))


register("step_refill")


# ---- fuse_relay: a graph's relay reads / writes by one slots tensor in one op each ------------------------

# tables per gather_rows_multi / scatter_rows_multi launch: the Triton kernels take this many (pointer, row size,
# row stride) argument sets, with a constexpr count; fuse_relay makes several ops of at most this many
RELAY_MULTI_MAX = 8


def check_relay_multi(op: str, tables: list[torch.Tensor], slots: torch.Tensor,
                      values: Optional[list[torch.Tensor]] = None, adds: Optional[list[int]] = None) -> None:
    """Host-side argument checks shared by the multi ops' references and their Triton launchers (shapes and dtypes
    only: nothing is read from the device). Raises ValueError naming the argument."""
    if len(tables) == 0:
        raise ValueError(f"lingc.{op}: tables is empty, want at least one table")
    if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"lingc.{op}: slots must be a 1-D int32 / int64 tensor, got {list(slots.shape)} {slots.dtype}")
    for i, t in enumerate(tables):
        if t.dim() < 1:
            raise ValueError(f"lingc.{op}: tables[{i}] is 0-D, want [S, ...] (one row per request slot)")
    if values is None:
        return
    if adds is None or len(values) != len(tables) or len(adds) != len(tables):
        raise ValueError(f"lingc.{op}: tables, values and adds must have one entry per table, got {len(tables)}, "
                         f"{len(values)} and {'none' if adds is None else len(adds)}")
    B = slots.shape[0]
    for i, (t, v, a) in enumerate(zip(tables, values, adds)):
        if tuple(v.shape) != (B, *t.shape[1:]):
            raise ValueError(f"lingc.{op}: values[{i}] is {list(v.shape)}, want {[B, *t.shape[1:]]}: one "
                             f"tables[{i}] row {list(t.shape[1:])} per request (slots has {B})")
        if a != 0 and (v.dtype.is_floating_point or v.dtype == torch.bool or v.is_complex()):
            raise ValueError(f"lingc.{op}: adds[{i}] = {a} on {v.dtype} values; adds fold integer index math only")


@torch.library.custom_op("lingc::gather_rows_multi", mutates_args=())
def gather_rows_multi(tables: list[torch.Tensor], slots: torch.Tensor) -> list[torch.Tensor]:
    """[gather_rows(t, slots) for t in tables]: several relay reads by the same slots in one op (fuse_relay).
    tables [S, ...] of any dtypes and row widths -> one [B, ...] per table."""
    check_relay_multi("gather_rows_multi", tables, slots)
    return [gather_rows(t, slots) for t in tables]


@gather_rows_multi.register_fake
def _(tables, slots):
    check_relay_multi("gather_rows_multi", tables, slots)
    return [t.new_empty((slots.shape[0], *t.shape[1:])) for t in tables]


register("gather_rows_multi")


@torch.library.custom_op("lingc::scatter_rows_multi", mutates_args=("tables",))
def scatter_rows_multi(tables: list[torch.Tensor], slots: torch.Tensor, values: list[torch.Tensor],
                       adds: list[int]) -> None:
    """scatter_rows(t, slots, v + a) for each (t, v, a) (scatter_rows(t, slots, v) where a = 0): several relay
    writes by the same slots in one op, with the integer `+ a` of a counter folded in (fuse_relay). The add runs in
    the value's dtype, as aten.add(v, a) does, then scatter_rows casts to the table's dtype. The tables must not
    share an element (one launch writes them in no order): distinct buffers, or column slices of one relay table
    (fuse_relay_cat)."""
    check_relay_multi("scatter_rows_multi", tables, slots, values, adds)
    for t, v, a in zip(tables, values, adds):
        scatter_rows(t, slots, v + a if a != 0 else v)


@scatter_rows_multi.register_fake
def _(tables, slots, values, adds):
    check_relay_multi("scatter_rows_multi", tables, slots, values, adds)
    return None


register("scatter_rows_multi")
