"""The interpreter shim in conftest: fp32 -> bf16 casts inside interpreted kernels round like torch (RNE)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _cast_bf16_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    tl.store(dst_ptr + cols, tl.load(src_ptr + cols, mask=mask).to(tl.bfloat16), mask=mask)


def test_fp32_to_bf16_cast_rounds_to_nearest_even() -> None:
    # ties to even both ways, a tie carrying into the exponent, a value rounding to inf, signed zero, NaN
    specials = torch.tensor([0x3F808000, 0x3F818000, 0x3FFF8000, 0x7F7FFFFF, 0x80000000, 0x7FC00000,
                             0xBF80C001], dtype=torch.int64).to(torch.int32).view(torch.float32)
    src = torch.cat([specials, torch.randn(57, generator=torch.Generator().manual_seed(0)) * 3])
    dst = torch.empty(src.shape, dtype=torch.bfloat16)
    _cast_bf16_kernel[(1,)](src, dst, src.numel(), BLOCK=triton.next_power_of_2(src.numel()))
    want = src.to(torch.bfloat16)
    is_nan = src.isnan()  # NaN payload bits differ between torch, PTX and the shim; only NaN-ness is compared
    assert torch.equal(dst.isnan(), is_nan)
    assert torch.equal(dst[~is_nan].view(torch.int16), want[~is_nan].view(torch.int16))
