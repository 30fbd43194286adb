"""lingc.kernels.rmsnorm in the Triton interpreter against torch.ops.lingc.rmsnorm / add, at small odd shapes."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from lingc.kernels.rmsnorm import add_rmsnorm, add_rmsnorm_ref, rmsnorm, rmsnorm_ref

EPS = 1e-6
ROWS = [1, 3, 7]
NS = [16, 48, 130]  # 48 and 130 are not powers of two: masked tails
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _inputs(rows: int, n: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g).to(dtype)  # [R, N]
    residual = torch.randn(rows, n, generator=g).mul(4).to(dtype)  # [R, N]
    weight = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)  # [N]
    return residual, x, weight


def _nan_like(t: torch.Tensor) -> torch.Tensor:
    """An output buffer poisoned with NaN, so an unwritten element fails the comparison."""
    return torch.full_like(t, float("nan"))


shapes = pytest.mark.parametrize("rows,n", [(r, n) for r in ROWS for n in NS],
                                 ids=[f"rows{r}-n{n}" for r in ROWS for n in NS])
dtypes = pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())


@shapes
@dtypes
def test_rmsnorm_matches_reference(rows: int, n: int, dtype: torch.dtype, assert_kernel_close: Callable) -> None:
    _, x, weight = _inputs(rows, n, dtype, seed=rows * 1000 + n)
    out = rmsnorm(x, weight, EPS, out=_nan_like(x))
    assert_kernel_close(out, rmsnorm_ref(x, weight, EPS))


@shapes
@dtypes
def test_add_rmsnorm_matches_reference(rows: int, n: int, dtype: torch.dtype, assert_kernel_close: Callable) -> None:
    residual, x, weight = _inputs(rows, n, dtype, seed=rows * 1000 + n + 1)
    out, new_residual = add_rmsnorm(residual, x, weight, EPS, out=_nan_like(x), residual_out=_nan_like(x))
    want_out, want_residual = add_rmsnorm_ref(residual, x, weight, EPS)
    assert torch.equal(new_residual, residual + x), "new residual is not bit-identical to residual + x"
    assert torch.equal(new_residual, want_residual)
    assert_kernel_close(out, want_out)


@dtypes
def test_leading_dims_and_strided_rows(dtype: torch.dtype, assert_kernel_close: Callable) -> None:
    """[B, T, N] inputs come back as [B, T, N]; rows with a stride of 2N (a narrowed view) are read in place."""
    residual, x, weight = _inputs(2 * 3, 2 * 48, dtype, seed=7)
    x3 = x.view(2, 3, 96)[..., :48]  # [B=2, T=3, N=48], row stride 96
    res3 = residual.view(2, 3, 96)[..., 48:]  # [B, T, N], row stride 96
    weight = weight[:48]
    out = rmsnorm(x3, weight, EPS)
    assert out.shape == x3.shape
    assert_kernel_close(out, rmsnorm_ref(x3, weight, EPS))
    out, new_residual = add_rmsnorm(res3, x3, weight, EPS)
    assert out.shape == new_residual.shape == x3.shape
    assert torch.equal(new_residual, res3 + x3)
    assert_kernel_close(out, add_rmsnorm_ref(res3, x3, weight, EPS)[0])


def test_pdl_on_cpu_falls_back() -> None:
    """pdl=True on a CPU tensor (interpreter) is dropped: no GDC call runs, results equal pdl=False."""
    residual, x, weight = _inputs(3, 48, torch.float32, seed=11)
    assert torch.equal(rmsnorm(x, weight, EPS, pdl=True), rmsnorm(x, weight, EPS))
    got, got_res = add_rmsnorm(residual, x, weight, EPS, pdl=True)
    want, want_res = add_rmsnorm(residual, x, weight, EPS)
    assert torch.equal(got, want) and torch.equal(got_res, want_res)


def test_bad_weight_shape_names_shapes() -> None:
    _, x, weight = _inputs(3, 16, torch.float32, seed=0)
    with pytest.raises(ValueError, match=r"weight has shape \[15\], want \[16\]"):
        rmsnorm(x, weight[:15], EPS)
