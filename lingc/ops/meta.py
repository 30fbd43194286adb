"""Metadata and relay ops: per-request index math and persistent buffers read and written by request slot.

Every step derives what it needs on the device from buffers indexed by request slot (the FutureMap
idea, techniques.md section 1): the host only says which slots run. `gather_rows` / `scatter_rows`
are the relay reads and writes; `cache_locs` and `step_positions` are the metadata refill.
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
def pick_position(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[b, index[b]] for each request, keeping the T axis: x [B, T, ...], index [B] -> [B, 1, ...]."""
    B = x.shape[0]
    return x[torch.arange(B, device=x.device), index.long()].unsqueeze(1).clone()


@pick_position.register_fake
def _(x, index):
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
