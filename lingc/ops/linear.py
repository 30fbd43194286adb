"""Dense ops: linear (no bias, any leading dims), embedding, and the residual add.

`linear` computes in the weight's dtype (fp32 router / lm_head in the reference, bf16 after the
`bf16_router` pass) and casts the result to `out_dtype` (default: the input's dtype).
"""

from __future__ import annotations

from typing import Optional

import torch

from lingc.ops.registry import register

ROW_INVARIANT_ROWS = 16     # decode (1) and verify (draft_tokens) sizes; prefill chunks are larger


@torch.library.custom_op("lingc::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """y = x @ weight.T; x [..., K] cast to weight.dtype, weight [N, K] -> y [..., N] in out_dtype or x.dtype.

    Up to ROW_INVARIANT_ROWS rows are computed one row at a time: CPU BLAS picks different kernels
    (and rounding) by row count, and a verify chain must reproduce a decode step's bits per row.
    """
    rows = x.to(weight.dtype).reshape(-1, x.shape[-1])
    if rows.shape[0] <= ROW_INVARIANT_ROWS:
        y = torch.cat([torch.nn.functional.linear(rows[i:i + 1], weight) for i in range(rows.shape[0])])
    else:
        y = torch.nn.functional.linear(rows, weight)
    return y.view(*x.shape[:-1], weight.shape[0]).to(out_dtype if out_dtype is not None else x.dtype)


@linear.register_fake
def _(x, weight, out_dtype=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=out_dtype if out_dtype is not None else x.dtype)


register("linear")


@torch.library.custom_op("lingc::embedding", mutates_args=())
def embedding(input_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """table [V, h] rows for input_ids [B, T] -> [B, T, h]."""
    return torch.nn.functional.embedding(input_ids, table)


@embedding.register_fake
def _(input_ids, table):
    return table.new_empty((*input_ids.shape, table.shape[1]))


register("embedding")


@torch.library.custom_op("lingc::add", mutates_args=())
def add(residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The residual add, residual + x, as its own op so `fuse_add_norm` can find it."""
    return residual + x


@add.register_fake
def _(residual, x):
    return residual.new_empty(residual.shape)


register("add")
