"""gated_rmsnorm_linear (kernels/linear.py GATED): KDA's o_norm built block by block inside the o_proj GEMV.

Against the reference op (gated_rmsnorm then linear): the normed input may differ from the gated_rmsnorm kernel's
by a rounding (another summation order of the per-head sum of squares), so y is checked within the linear's bound
plus a few activation ulps through |W|; row 0 alone equals row 0 of six, bit for bit; the gate may be a strided
column view (it is a slice of fuse_projections' wide output); heads that do not fit a block, and more than
MAX_ROWS rows, run the two unfused kernels bit for bit."""

from __future__ import annotations

import pytest
import torch

from kernel_support import poisoned_empty  # tests/kernels is on sys.path
from lingc.kernels.kda import gated_rmsnorm
from lingc.kernels.linear import MAX_ROWS, LinearConfig, gated_rmsnorm_linear, gated_rmsnorm_linear_ref, linear

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7}
EPS = 1e-6
NORMED_ULPS = 4
H, D, N = 4, 32, 40
DOT_ONE_HEAD = LinearConfig(block_n=16, block_k=32, split_k=2, num_warps=4, num_stages=2)       # BK == D
DOT_TWO_HEADS = LinearConfig(block_n=16, block_k=64, split_k=2, num_warps=4, num_stages=2)      # BK == 2 D
FMA_FOUR_HEADS = LinearConfig(block_n=16, block_k=128, split_k=1, num_warps=4, num_stages=2, kind="fma")
FMA_SPLIT = LinearConfig(block_n=8, block_k=32, split_k=4, num_warps=4, num_stages=2, kind="fma")
CONFIGS = {"dot-BK=D": DOT_ONE_HEAD, "dot-BK=2D": DOT_TWO_HEADS, "fma-BK=4D": FMA_FOUR_HEADS, "fma-split4": FMA_SPLIT}


def _inputs(lead: tuple[int, ...], dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, H, D, generator=g).to(dtype)
    wide = torch.randn(*lead, 3 * H * D, generator=g).to(dtype)           # the gate is a column slice of it
    gate = wide[..., H * D:2 * H * D].unflatten(-1, (H, D))
    norm_weight = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype)
    weight = (torch.randn(N, H * D, generator=g) / (H * D) ** 0.5).to(dtype)
    return x, norm_weight, gate, weight


def _y_ok(y: torch.Tensor, x, norm_weight, gate, weight) -> None:
    """|y - reference| within the linear's rounding plus NORMED_ULPS activation ulps of the normed input, via |W|."""
    assert not y.isnan().any(), "unwritten (NaN-poisoned) elements"
    normed = torch.ops.lingc.gated_rmsnorm(x, norm_weight, gate, EPS).flatten(-2)
    want = gated_rmsnorm_linear_ref(x, norm_weight, gate, EPS, weight)
    assert y.shape == want.shape and y.dtype == want.dtype
    mag = normed.double().abs() @ weight.double().abs().T
    k = normed.shape[-1]
    bound = (2 * k * 2.0**-24 + 2 * ULP[y.dtype]) * mag + NORMED_ULPS * ULP[x.dtype] * mag + 1e-30
    worst = ((y.double() - want.double()).abs() / bound).max().item()
    assert worst <= 1.0, f"max |y - ref| / bound = {worst:.3g}"


@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_reference_and_is_row_invariant(cfg: LinearConfig, dtype: torch.dtype) -> None:
    x, norm_weight, gate, weight = _inputs((1, 6), dtype, seed=7)
    with poisoned_empty():
        six = gated_rmsnorm_linear(x, norm_weight, gate, EPS, weight, config=cfg)
        one = gated_rmsnorm_linear(x[:, :1], norm_weight, gate[:, :1], EPS, weight, config=cfg)
    _y_ok(six, x, norm_weight, gate, weight)
    assert torch.equal(one[:, 0], six[:, 0]), "row 0 alone differs from row 0 of six"


def test_table_config_and_out_dtype() -> None:
    x, norm_weight, gate, weight = _inputs((3,), torch.bfloat16, seed=11)
    y = gated_rmsnorm_linear(x, norm_weight, gate, EPS, weight, torch.float32)
    assert y.dtype == torch.float32
    want = gated_rmsnorm_linear_ref(x, norm_weight, gate, EPS, weight, torch.float32)
    assert (y - want).abs().max().item() < 0.05


def test_heads_wider_than_a_block_and_prefill_run_the_two_kernels() -> None:
    """BK = 16 < D = 32: no block holds a whole head; M = 17 > MAX_ROWS: prefill. Both: the unfused kernels."""
    narrow = LinearConfig(block_n=16, block_k=16, split_k=1, num_warps=4, num_stages=2)
    for lead, cfg in (((2,), narrow), ((MAX_ROWS + 1,), None)):
        x, norm_weight, gate, weight = _inputs(lead, torch.bfloat16, seed=13)
        got = gated_rmsnorm_linear(x, norm_weight, gate, EPS, weight, config=cfg)
        want = linear(gated_rmsnorm(x, norm_weight, gate, EPS).flatten(-2), weight, config=cfg)
        assert torch.equal(got, want)


def test_bad_shapes_are_named() -> None:
    x, norm_weight, gate, weight = _inputs((2,), torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match=r"gated_rmsnorm_linear: x is \[2, 4, 32\], gate \[2, 4, 31\]"):
        gated_rmsnorm_linear(x, norm_weight, gate[..., :31], EPS, weight)
    with pytest.raises(ValueError, match=r"x has shape \[2, 128\] and weight has shape \[40, 96\]"):
        gated_rmsnorm_linear(x, norm_weight, gate, EPS, weight[:, :96])
