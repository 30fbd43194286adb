"""lingc.kernels.rmsnorm.rmsnorm_cat in the Triton interpreter: each half bit for bit the rmsnorm kernel's on its
input (so fuse_cat_norm changes no bits), within tolerance of torch.ops.lingc.rmsnorm_cat, at odd shapes, with
strided inputs; bad inputs name what is wrong."""

from __future__ import annotations

import pytest
import torch

from lingc.kernels.rmsnorm import rmsnorm, rmsnorm_cat, rmsnorm_cat_ref

EPS = 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows,n", [(1, 16), (3, 48), (6, 130)])
def test_halves_are_the_rmsnorm_kernels(rows, n, dtype):
    g = torch.Generator().manual_seed(rows * 100 + n)
    x1 = torch.randn(rows, 1, n, generator=g).to(dtype)
    x2 = (torch.randn(rows, 1, n, generator=g) * 30).to(dtype)
    w1 = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)
    w2 = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)
    out = rmsnorm_cat(x1, w1, x2, w2, EPS)
    assert out.shape == (rows, 1, 2 * n) and out.dtype == dtype
    assert torch.equal(out, torch.cat([rmsnorm(x1, w1, EPS), rmsnorm(x2, w2, EPS)], -1))
    torch.testing.assert_close(out, rmsnorm_cat_ref(x1, w1, x2, w2, EPS), rtol=1e-2 if dtype != torch.float32 else 1e-5,
                               atol=1e-2 if dtype != torch.float32 else 1e-5)


def test_strided_rows():
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(4, 80, generator=g)
    x1, x2 = wide[:, :32], wide[:, 40:72]          # row stride 80
    w1, w2 = torch.rand(32, generator=g) + 0.5, torch.rand(32, generator=g) + 0.5
    assert torch.equal(rmsnorm_cat(x1, w1, x2, w2, EPS),
                       torch.cat([rmsnorm(x1.contiguous(), w1, EPS), rmsnorm(x2.contiguous(), w2, EPS)], -1))


def test_bad_inputs_are_named():
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match="rmsnorm_cat: x1 is .* x2 is"):
        rmsnorm_cat(x, torch.ones(16), torch.randn(2, 8), torch.ones(8), EPS)
    with pytest.raises(ValueError, match="weight has shape"):
        rmsnorm_cat(x, torch.ones(16), x, torch.ones(15), EPS)
