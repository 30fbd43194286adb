"""RMSNorm and fused residual-add + RMSNorm Triton kernels (one program per row), launchers and references.

Numerics match `torch.ops.lingc.rmsnorm` (lingc/ops/norm.py) and `torch.ops.lingc.add` (lingc/ops/linear.py):
fp32 math x * rsqrt(mean(x^2) + eps), cast to the activation dtype, times the weight (in fp32, which is exact
for two bf16 factors), cast again. The fused kernel first forms new_residual = residual + x (added in fp32 and
rounded once to the activation dtype, bit-identical to torch's `residual + x`) and normalises that.

Bytes per row of N elements, activation size s, weight size w:
    rmsnorm      reads N*s (x) + N*w (weight, L2-resident after the first row), writes N*s (out)
    rmsnorm_cat  two rmsnorm rows (x1 with weight1, x2 with weight2) into the halves of one [2N] row, one launch
    embedding_rmsnorm[_cat]  the same kernels reading x (x1) from the embedding table at row ids[row] (GATHER);
                 embedding_rmsnorm also writes the gathered row (N*s): the embedding launch they replace
    add_rmsnorm  reads 2*N*s (residual, x) + N*w, writes 2*N*s (new residual, out)

PDL placement (shared/docs/kernels.md section 1.5): with the constexpr PDL on, the weight (written by no
earlier kernel) is loaded before `gdc_wait()`; everything an earlier kernel may have written (x, residual)
is loaded after it, and `gdc_launch_dependents()` follows the last such load, not kernel entry. With PDL
off no GDC call is emitted at all: the Triton interpreter cannot run them (kernels.md section 1.2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lingc.kernels.pdl import pdl_launch_next, pdl_supported, pdl_trigger, pdl_wait
import lingc.ops  # noqa: F401  (registers torch.ops.lingc.*, used by the references)

# Tunables. One program holds a whole row, so the row must fit one block.
MAX_BLOCK_N = 65536
# (largest BLOCK_N, num_warps), first match wins; larger blocks get NUM_WARPS_MAX. A batch-1 row is one program on
# one SM, so its loads and its sum are latency: 16 warps for 2048 / 4096-wide blocks (were 4; 8192: were 8) measured
# in one process each on the H200 (Ling-3.0-tiny, h = 1536: rmsnorm, add_rmsnorm, combine_add_rmsnorm) decode
# 1.224 / 1.236 ms against 1.233 / 1.233 and 1.249 / 1.240, verify 2.499 / 2.503 against 2.509-2.516
# (bench/results/step-ab-h200-20261201-h.json, -i.json). A numerics change: the row's sum of squares reduces over
# 16 warps in another order.
NUM_WARPS_BY_BLOCK_N = ((256, 1), (1024, 2), (4096, 16), (8192, 16))
NUM_WARPS_MAX = 16


@triton.jit
def _rmsnorm_row(x, w, N, eps):
    """One row's norm from loaded [BLOCK_N] x and w (masked lanes 0): w * normed in fp32, for the caller to round to
    x's dtype. Shared with mla_prep (kernels/mla.py), which so runs this kernel's arithmetic; its bits also depend on
    the reduction layout (BLOCK_N, num_warps, the load's vector width) and on fp fusion (on: the sum of squares
    contracts into FMAs), which mla_prep takes from this kernel's launch."""
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    normed = (xf * rstd).to(x.dtype)
    return w.to(tl.float32) * normed.to(tl.float32)


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, N, eps, ids_ptr, x_out_ptr, stride_x_out,
                    BLOCK_N: tl.constexpr, PDL: tl.constexpr, ENTRY_TRIGGER: tl.constexpr, GATHER: tl.constexpr):
    """Program row: out[row] = rmsnorm(x[row]). GATHER (embedding_rmsnorm): x is the embedding table and the row read
    is table[ids[row]], also copied to x_out[row] (the residual stream's start); the same loads, layout and
    arithmetic, so the same bits as the embedding's exact copy followed by this kernel."""
    if PDL:
        if ENTRY_TRIGGER:   # the next launch reads only weights before its wait (kernels/pdl.py)
            pdl_launch_next()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    if PDL:
        pdl_wait()
    x_row = tl.load(ids_ptr + row).to(tl.int64) if GATHER else row
    x = tl.load(x_ptr + x_row * stride_x + cols, mask=mask, other=0.0)
    if PDL:
        pdl_trigger()
    if GATHER:
        tl.store(x_out_ptr + row * stride_x_out + cols, x, mask=mask)
    out = _rmsnorm_row(x, w, N, eps).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


@triton.jit
def _rmsnorm_cat_kernel(x1_ptr, x2_ptr, w1_ptr, w2_ptr, out_ptr, stride_x1, stride_x2, stride_out, N, eps, ids_ptr,
                        BLOCK_N: tl.constexpr, PDL: tl.constexpr, GATHER: tl.constexpr):
    """Program (row, j): the rmsnorm kernel's code on row `row` of x_j with w_j, stored in half j of the output
    row. Both halves' loads are issued with a mask that keeps only half j's (the other moves no bytes), and
    tl.where picks half j's values exactly, so each half has the rmsnorm kernel's layout and bits.
    GATHER (embedding_rmsnorm_cat): x1 is the embedding table and half 0 reads its row ids[row]."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    w = tl.where(j == 0, tl.load(w1_ptr + cols, mask=mask & (j == 0), other=0.0),
                 tl.load(w2_ptr + cols, mask=mask & (j == 1), other=0.0))
    if PDL:
        pdl_wait()
    x1_row = tl.load(ids_ptr + row, mask=j == 0, other=0).to(tl.int64) if GATHER else row
    x = tl.where(j == 0, tl.load(x1_ptr + x1_row * stride_x1 + cols, mask=mask & (j == 0), other=0.0),
                 tl.load(x2_ptr + row * stride_x2 + cols, mask=mask & (j == 1), other=0.0))
    if PDL:
        pdl_trigger()
    out = _rmsnorm_row(x, w, N, eps).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + j * N + cols, out, mask=mask)


@triton.jit
def _add_rmsnorm_row(res, x, w, out_row_ptr, res_out_row_ptr, cols, mask, N, eps):
    """One row's add + norm from loaded [BLOCK_N] res, x, w; stores new residual and normed output. Shared with the
    fused one-shot all-reduce + add + norm (kernels/allreduce.py), which so matches this kernel bit for bit."""
    # fp32 add rounded once: bit-identical to torch's bf16/fp32 `residual + x` (fp32 has > 2*8+2 bits).
    new_res = (res.to(tl.float32) + x.to(tl.float32)).to(res.dtype)
    tl.store(res_out_row_ptr + cols, new_res, mask=mask)
    hf = new_res.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(hf * hf, axis=0) / N + eps)
    normed = (hf * rstd).to(res.dtype)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(out_row_ptr.dtype.element_ty)
    tl.store(out_row_ptr + cols, out, mask=mask)


@triton.jit
def _add_rmsnorm_kernel(res_ptr, x_ptr, w_ptr, out_ptr, res_out_ptr,
                        stride_res, stride_x, stride_out, stride_res_out, N, eps,
                        BLOCK_N: tl.constexpr, PDL: tl.constexpr, ENTRY_TRIGGER: tl.constexpr):
    if PDL:
        if ENTRY_TRIGGER:   # the next launch reads only weights before its wait (kernels/pdl.py)
            pdl_launch_next()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    if PDL:
        pdl_wait()
    res = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if PDL:
        pdl_trigger()
    _add_rmsnorm_row(res, x, w, out_ptr + row * stride_out, res_out_ptr + row * stride_res_out, cols, mask, N, eps)


def _num_warps(block_n: int) -> int:
    for limit, warps in NUM_WARPS_BY_BLOCK_N:
        if block_n <= limit:
            return warps
    return NUM_WARPS_MAX



def _rows(t: torch.Tensor, name: str, n: int) -> torch.Tensor:
    """t [..., N] as a 2-D [R, N] view (copying only if the last dim is strided)."""
    if t.shape[-1] != n:
        raise ValueError(f"rmsnorm: {name} has shape {list(t.shape)}, want last dim {n}")
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _check(x: torch.Tensor, weight: torch.Tensor) -> int:
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"rmsnorm: weight has shape {list(weight.shape)}, want [{n}] (x is {list(x.shape)})")
    if triton.next_power_of_2(n) > MAX_BLOCK_N:
        raise ValueError(f"rmsnorm: row length {n} exceeds one block (MAX_BLOCK_N={MAX_BLOCK_N})")
    return n


def _out(out: torch.Tensor | None, like: torch.Tensor, name: str) -> torch.Tensor:
    if out is None:
        return torch.empty_like(like, memory_format=torch.contiguous_format)
    if out.shape != like.shape or out.dtype != like.dtype or not out.is_contiguous():
        raise ValueError(f"rmsnorm: {name} is {list(out.shape)} {out.dtype}, "
                         f"want contiguous {list(like.shape)} {like.dtype}")
    return out


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool = False,
            out: torch.Tensor | None = None, entry_trigger: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., N] with weight [N]; pdl is dropped where unsupported. entry_trigger (a
    launch hint, PDL only): let the next kernel launch at entry (kernels/pdl.py)."""
    n = _check(x, weight)
    out = _out(out, x, "out")
    x2 = _rows(x, "x", n)  # [R, N]
    out2 = out.view(-1, n)  # [R, N]
    if x2.shape[0] == 0:
        return out
    pdl = pdl and pdl_supported(x.device)
    block_n = triton.next_power_of_2(n)
    launch = {"launch_pdl": True} if pdl else {}
    _rmsnorm_kernel[(x2.shape[0],)](x2, weight, out2, x2.stride(0), out2.stride(0), n, eps, out2, out2, 0,
                                     BLOCK_N=block_n, PDL=pdl, ENTRY_TRIGGER=pdl and entry_trigger, GATHER=False,
                                     num_warps=_num_warps(block_n), **launch)
    return out


def _gather_ids(input_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor | None:
    """input_ids [B, T] flattened to a unit-stride [B*T] vector for the GATHER kernels, or None where they do not
    apply (then the launcher runs the op's reference: the embedding, then the norm)."""
    if input_ids.dim() != 2 or input_ids.is_floating_point() or input_ids.dtype == torch.bool \
            or table.dim() != 2 or table.stride(1) != 1:
        return None
    ids = input_ids.reshape(-1)
    return ids if ids.stride(0) == 1 else ids.contiguous()


def embedding_rmsnorm(input_ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float,
                      pdl: bool = False, entry_trigger: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(table[input_ids]), table[input_ids]) in one launch (lingc.embedding_rmsnorm): the rmsnorm kernel
    reading row input_ids[b, t] of the table and copying it out, bit for bit the embedding + rmsnorm pair. Ids are
    not range-checked on the device (as the embedding kernel's)."""
    ids = _gather_ids(input_ids, table)
    if ids is None:
        return torch.ops.lingc.embedding_rmsnorm(input_ids, table, weight, eps)
    n = _check(table, weight)
    x = torch.empty((*input_ids.shape, n), dtype=table.dtype, device=table.device)
    out = torch.empty_like(x)
    if ids.numel() == 0:
        return out, x
    out2, x2 = out.view(-1, n), x.view(-1, n)
    pdl = pdl and pdl_supported(table.device)
    block_n = triton.next_power_of_2(n)
    launch = {"launch_pdl": True} if pdl else {}
    _rmsnorm_kernel[(ids.numel(),)](table, weight, out2, table.stride(0), out2.stride(0), n, eps, ids, x2,
                                    x2.stride(0), BLOCK_N=block_n, PDL=pdl, ENTRY_TRIGGER=pdl and entry_trigger,
                                    GATHER=True, num_warps=_num_warps(block_n), **launch)
    return out, x


def rmsnorm_cat(x1: torch.Tensor, weight1: torch.Tensor, x2: torch.Tensor, weight2: torch.Tensor, eps: float,
                pdl: bool = False) -> torch.Tensor:
    """cat([rmsnorm(x1, weight1), rmsnorm(x2, weight2)], -1) in one launch, each half bit for bit the rmsnorm
    kernel's (lingc.rmsnorm_cat); x1, x2 [..., N] of one shape and dtype."""
    if x1.shape != x2.shape or x1.dtype != x2.dtype:
        raise ValueError(f"rmsnorm_cat: x1 is {list(x1.shape)} {x1.dtype}, x2 is {list(x2.shape)} {x2.dtype}; "
                         "want the same shape and dtype")
    n = _check(x1, weight1)
    _check(x2, weight2)
    out = torch.empty((*x1.shape[:-1], 2 * n), dtype=x1.dtype, device=x1.device)
    a, b = _rows(x1, "x1", n), _rows(x2, "x2", n)  # [R, N]
    out2 = out.view(-1, 2 * n)                     # [R, 2N]
    if a.shape[0] == 0:
        return out
    pdl = pdl and pdl_supported(x1.device)
    block_n = triton.next_power_of_2(n)
    launch = {"launch_pdl": True} if pdl else {}
    _rmsnorm_cat_kernel[(a.shape[0], 2)](a, b, weight1, weight2, out2, a.stride(0), b.stride(0), out2.stride(0), n,
                                         eps, out2, BLOCK_N=block_n, PDL=pdl, GATHER=False,
                                         num_warps=_num_warps(block_n), **launch)
    return out


def embedding_rmsnorm_cat(input_ids: torch.Tensor, table: torch.Tensor, weight1: torch.Tensor, x2: torch.Tensor,
                          weight2: torch.Tensor, eps: float, pdl: bool = False) -> torch.Tensor:
    """rmsnorm_cat(table[input_ids], weight1, x2, weight2) in one launch (lingc.embedding_rmsnorm_cat): half 0 of
    each row reads the table row its id names, with the rmsnorm kernel's code, bit for bit the embedding +
    rmsnorm_cat pair. x2 [B, T, N]."""
    ids = _gather_ids(input_ids, table)
    n = table.shape[-1] if table.dim() == 2 else -1
    if ids is None or tuple(x2.shape) != (*input_ids.shape, n) or x2.dtype != table.dtype:
        return torch.ops.lingc.embedding_rmsnorm_cat(input_ids, table, weight1, x2, weight2, eps)
    _check(table, weight1)
    _check(x2, weight2)
    out = torch.empty((*x2.shape[:-1], 2 * n), dtype=x2.dtype, device=x2.device)
    b = _rows(x2, "x2", n)                         # [R, N]
    out2 = out.view(-1, 2 * n)                     # [R, 2N]
    if b.shape[0] == 0:
        return out
    pdl = pdl and pdl_supported(x2.device)
    block_n = triton.next_power_of_2(n)
    launch = {"launch_pdl": True} if pdl else {}
    _rmsnorm_cat_kernel[(b.shape[0], 2)](table, b, weight1, weight2, out2, table.stride(0), b.stride(0),
                                         out2.stride(0), n, eps, ids, BLOCK_N=block_n, PDL=pdl, GATHER=True,
                                         num_warps=_num_warps(block_n), **launch)
    return out


def add_rmsnorm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool = False,
                out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
                entry_trigger: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(residual + x), residual + x) for residual, x [..., N] of one dtype; pdl dropped where unsupported.
    entry_trigger (a launch hint, PDL only): let the next kernel launch at entry (kernels/pdl.py)."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"add_rmsnorm: residual is {list(residual.shape)} {residual.dtype}, "
                         f"x is {list(x.shape)} {x.dtype}; want the same shape and dtype")
    n = _check(x, weight)
    out = _out(out, x, "out")
    residual_out = _out(residual_out, x, "residual_out")
    res2, x2 = _rows(residual, "residual", n), _rows(x, "x", n)  # [R, N]
    out2, res_out2 = out.view(-1, n), residual_out.view(-1, n)  # [R, N]
    if x2.shape[0] == 0:
        return out, residual_out
    pdl = pdl and pdl_supported(x.device)
    block_n = triton.next_power_of_2(n)
    launch = {"launch_pdl": True} if pdl else {}
    _add_rmsnorm_kernel[(x2.shape[0],)](
        res2, x2, weight, out2, res_out2,
        res2.stride(0), x2.stride(0), out2.stride(0), res_out2.stride(0), n, eps,
        BLOCK_N=block_n, PDL=pdl, ENTRY_TRIGGER=pdl and entry_trigger, num_warps=_num_warps(block_n), **launch)
    return out, residual_out


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """lingc's reference RMSNorm."""
    return torch.ops.lingc.rmsnorm(x, weight, eps)


def add_rmsnorm_ref(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """lingc's reference add then RMSNorm: (rmsnorm(residual + x), residual + x)."""
    new_residual = torch.ops.lingc.add(residual, x)
    return torch.ops.lingc.rmsnorm(new_residual, weight, eps), new_residual


def rmsnorm_cat_ref(x1: torch.Tensor, weight1: torch.Tensor, x2: torch.Tensor, weight2: torch.Tensor,
                    eps: float) -> torch.Tensor:
    """lingc's reference: the two norms, then the cat."""
    return torch.ops.lingc.rmsnorm_cat(x1, weight1, x2, weight2, eps)


def embedding_rmsnorm_ref(input_ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """lingc's reference: the embedding, then the norm."""
    return torch.ops.lingc.embedding_rmsnorm(input_ids, table, weight, eps)


def embedding_rmsnorm_cat_ref(input_ids: torch.Tensor, table: torch.Tensor, weight1: torch.Tensor, x2: torch.Tensor,
                              weight2: torch.Tensor, eps: float) -> torch.Tensor:
    """lingc's reference: the embedding, then rmsnorm_cat."""
    return torch.ops.lingc.embedding_rmsnorm_cat(input_ids, table, weight1, x2, weight2, eps)


LOWERINGS = {"rmsnorm": rmsnorm, "add_rmsnorm": add_rmsnorm, "rmsnorm_cat": rmsnorm_cat,
             "embedding_rmsnorm": embedding_rmsnorm, "embedding_rmsnorm_cat": embedding_rmsnorm_cat}
