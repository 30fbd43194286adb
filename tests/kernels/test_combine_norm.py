"""combine_add_rmsnorm (kernels/moe.py): a MoE combine and the next add + RMSNorm in one program per token, bit for
bit the moe_combine kernel then the add_rmsnorm kernel, in both combine orders, at 1 and 6 tokens, h not a power
of two; close to the reference op; bad shapes are named."""

from __future__ import annotations

import pytest
import torch

from kernel_support import poisoned_empty  # tests/kernels is on sys.path
from lingc.kernels.moe import INTERLEAVE4, SEQUENTIAL, combine_add_rmsnorm, moe_combine
from lingc.kernels.rmsnorm import add_rmsnorm

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
EPS = 1e-6


def _inputs(n: int, h: int, k: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    expert_out = torch.randn(n * k, h, generator=g).to(dtype)
    weights = torch.rand(n, k, generator=g)                         # fp32 router weights
    weights[:, -1] = 1.0                                            # the fused shared expert's pair
    residual = (4 * torch.randn(1, n, h, generator=g)).to(dtype)
    norm_weight = (1 + 0.1 * torch.randn(h, generator=g)).to(dtype)
    return residual, expert_out, weights, norm_weight


@pytest.mark.parametrize("order", [SEQUENTIAL, INTERLEAVE4], ids=["sequential", "interleave4"])
@pytest.mark.parametrize("n", [1, 6])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_bit_identical_to_the_two_kernels(order: int, n: int, dtype: torch.dtype, assert_kernel_close) -> None:
    residual, expert_out, weights, norm_weight = _inputs(n, 96, 9, dtype, seed=n)
    with poisoned_empty():
        normed, new_residual = combine_add_rmsnorm(residual, expert_out, weights, norm_weight, EPS, order=order)
        combined = moe_combine(expert_out, weights, order=order).view(residual.shape)
        want_normed, want_residual = add_rmsnorm(residual, combined, norm_weight, EPS)
    assert torch.equal(normed, want_normed) and torch.equal(new_residual, want_residual)
    ref_normed, ref_residual = torch.ops.lingc.combine_add_rmsnorm(residual, expert_out, weights, norm_weight, EPS)
    assert_kernel_close(new_residual, ref_residual)
    assert_kernel_close(normed, ref_normed)


def test_bad_shapes_are_named() -> None:
    residual, expert_out, weights, norm_weight = _inputs(2, 32, 3, torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match=r"combine_add_rmsnorm: residual \[1, 2, 32\] torch.bfloat16, expert_out "
                                         r"\[5, 32\]"):
        combine_add_rmsnorm(residual, expert_out[:5], weights, norm_weight, EPS)
    with pytest.raises(ValueError, match=r"weight \[31\]"):
        combine_add_rmsnorm(residual, expert_out, weights, norm_weight[:31], EPS)
