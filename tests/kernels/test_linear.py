"""lingc.kernels.linear in the Triton interpreter against torch.ops.lingc.linear and a float64 bound, at odd shapes.

Tolerance: the kernel and the reference both accumulate exact products in fp32 but in different orders, so
before the final rounding they differ by at most ~2 * K * 2^-24 * sum_k |x_k w_k| (the fp32 sum error bound,
doubled for two summations). Each side then rounds to the weight dtype and to out_dtype, at most one ulp of
the coarser dtype per side, so two in all. `_bound` is exactly that sum; no per-test guesses.

The Triton 3.6 interpreter runs a bf16 `tl.dot` as np.matmul on the raw uint16 bit patterns (bf16 is stored
as uint16 there), i.e. garbage. `_bf16_dot_as_fp32` widens bf16 operands to fp32 first (exact), which is what
the GPU's bf16 MMA multiplies (exact products, fp32 accumulation).

The NORM prologue (fuse_norm_linear's rmsnorm_linear / add_rmsnorm_linear) is checked against the reference
composition with that bound widened by NORMED_ULPS roundings of each normed element (its rstd sums in another
order); the new residual bit for bit, rows alone == rows among six, both kinds, split and unsplit, fp32 and bf16.
"""

from __future__ import annotations

import pytest
import torch

import lingc.kernels.linear as linear_module
from kernel_support import poisoned_empty  # tests/kernels is on sys.path
from lingc.kernels.linear import (LOWERINGS, MAX_ROWS, LinearConfig, LinearWorkspace, add_rmsnorm_linear,
                                  add_rmsnorm_linear_ref, device_workspace, gated_rmsnorm_linear, linear, linear_ref,
                                  pick_config,
                                  rmsnorm_linear, rmsnorm_linear_ref, workspace_need)
from lingc.kernels.rmsnorm import add_rmsnorm

# The 3.6 interpreter converts a 1-element array to a loop bound (`int(self.handle.data)`): numpy deprecation noise.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
# Small blocks so that the interpreter's test shapes span several tiles and K slices.
SPLIT = LinearConfig(block_n=16, block_k=32, split_k=4, num_warps=4, num_stages=2)
FMA_SPLIT = LinearConfig(block_n=16, block_k=32, split_k=4, num_warps=4, num_stages=2, kind="fma")
FMA = LinearConfig(block_n=16, block_k=64, split_k=1, num_warps=4, num_stages=2, kind="fma")
NO_SPLIT = LinearConfig(block_n=32, block_k=64, split_k=1, num_warps=4, num_stages=2)
CONFIGS = {"dot-split4": SPLIT, "dot-nosplit": NO_SPLIT, "fma-split4": FMA_SPLIT, "fma-nosplit": FMA}
# (N, K): N and K not multiples of the blocks (tails), and multiples (the unmasked EVEN_K path)
SHAPES = [(40, 100), (17, 257)]


def _inputs(lead: tuple[int, ...], n: int, k: int, x_dtype: torch.dtype, w_dtype: torch.dtype,
            seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, k, generator=g).to(x_dtype)                   # [..., K]
    weight = (torch.randn(n, k, generator=g) / k**0.5).to(w_dtype)       # [N, K]
    return x, weight


def _bound(x: torch.Tensor, weight: torch.Tensor, y_dtype: torch.dtype) -> torch.Tensor:
    """Per-element |kernel - reference| allowance (module docstring)."""
    xw = x.to(weight.dtype).double().reshape(-1, x.shape[-1])             # [M, K]
    mag = xw.abs() @ weight.double().abs().T                              # [M, N] sum_k |x_k w_k|
    exact = (xw @ weight.double().T).abs()
    step = max(ULP[weight.dtype], ULP[y_dtype])
    bound = 2 * x.shape[-1] * 2.0**-24 * mag + step * 2 * (exact + 2 * x.shape[-1] * 2.0**-24 * mag)
    return bound.view(*x.shape[:-1], weight.shape[0]) + 1e-30


def _check(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None) -> None:
    want = linear_ref(x, weight, out_dtype)
    assert got.dtype == want.dtype and got.shape == want.shape, f"{got.dtype} {list(got.shape)} vs {want.dtype}"
    assert not got.isnan().any(), "unwritten (NaN-poisoned) elements"
    err = (got.double() - want.double()).abs()
    bound = _bound(x, weight, want.dtype)
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"max |got - ref| / bound = {worst:.3g} (max abs err {err.max().item():.3g})"


def _poisoned(lead: tuple[int, ...], n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((*lead, n), float("nan"), dtype=dtype)


@pytest.mark.parametrize("cfg", [SPLIT, FMA_SPLIT], ids=["dot-split4", "fma-split4"])
@pytest.mark.parametrize("n,k", SHAPES, ids=[f"N{n}-K{k}" for n, k in SHAPES])
@pytest.mark.parametrize("lead", [(1,), (3,), (1, 6), (16,)], ids=["M1", "M3", "1x6", "M16"])
@pytest.mark.parametrize("w_dtype", DTYPES.values(), ids=[f"w{d}" for d in DTYPES])
def test_matches_reference(w_dtype: torch.dtype, lead: tuple[int, ...], n: int, k: int,
                           cfg: LinearConfig) -> None:
    x, weight = _inputs(lead, n, k, torch.bfloat16, w_dtype, seed=n * 1000 + k + len(lead) * 7 + lead[-1])
    y_dtype = torch.float32 if w_dtype == torch.float32 else torch.bfloat16
    got = linear(x, weight, y_dtype, out=_poisoned(lead, n, y_dtype), config=cfg)
    _check(got, x, weight, y_dtype)


@pytest.mark.parametrize("cfg", [NO_SPLIT, FMA], ids=["dot-nosplit", "fma4-nosplit"])
@pytest.mark.parametrize("n,k", [(40, 100), (64, 128)], ids=["N40-K100", "N64-K128"])
@pytest.mark.parametrize("w_dtype", DTYPES.values(), ids=[f"w{d}" for d in DTYPES])
def test_unsplit_configs_match_reference(w_dtype: torch.dtype, n: int, k: int, cfg: LinearConfig) -> None:
    """One K slice: the direct store path; the fma config takes rows in groups of 4 (6 rows: one group half full)."""
    x, weight = _inputs((1, 6), n, k, torch.bfloat16, w_dtype, seed=n + k)
    got = linear(x, weight, out=_poisoned((1, 6), n, torch.bfloat16), config=cfg)
    _check(got, x, weight, None)


def test_table_configs_match_reference() -> None:
    """No config given: the table (here fma for a small bf16 weight, auto split for a dot) and the device
    workspace, whose counters every launch leaves at zero."""
    x, weight = _inputs((1, 6), 24, 1500, torch.bfloat16, torch.bfloat16, seed=29)
    _check(linear(x, weight), x, weight, None)
    x, weight = _inputs((3,), 24, 600, torch.bfloat16, torch.float32, seed=31)
    assert pick_config(24, 600, torch.float32).split_k > 1
    _check(linear(x, weight, torch.float32), x, weight, torch.float32)
    assert not device_workspace("cpu").counters.any()
    assert LOWERINGS == {"linear": linear, "rmsnorm_linear": rmsnorm_linear, "add_rmsnorm_linear": add_rmsnorm_linear,
                         "gated_rmsnorm_linear": gated_rmsnorm_linear}


@pytest.mark.parametrize("x_dtype,w_dtype,out_dtype", [
    (torch.bfloat16, torch.bfloat16, None),            # projections: bf16 in, bf16 out
    (torch.bfloat16, torch.bfloat16, torch.float32),   # bf16 router / lm_head after bf16_router: bf16 GEMM, fp32 out
    (torch.bfloat16, torch.float32, torch.float32),    # fp32 router / lm_head in the reference
    (torch.float32, torch.bfloat16, None),             # fp32 activations are cast to bf16 first
    (torch.float32, torch.float32, torch.bfloat16),
], ids=["bf16-bf16-dflt", "bf16-bf16-fp32", "bf16-fp32-fp32", "fp32-bf16-dflt", "fp32-fp32-bf16"])
def test_dtypes(x_dtype: torch.dtype, w_dtype: torch.dtype, out_dtype: torch.dtype | None) -> None:
    x, weight = _inputs((1, 6), 40, 100, x_dtype, w_dtype, seed=3)
    for cfg in CONFIGS.values():
        got = linear(x, weight, out_dtype, config=cfg)
        assert got.dtype == (out_dtype or x_dtype)
        _check(got, x, weight, out_dtype)


@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("w_dtype", DTYPES.values(), ids=[f"w{d}" for d in DTYPES])
def test_row_invariance(w_dtype: torch.dtype, cfg: LinearConfig) -> None:
    """Each row computed alone equals the same row among 16 (and among 6), bit for bit."""
    x, weight = _inputs((MAX_ROWS,), 20, 64, torch.bfloat16, w_dtype, seed=5)  # K = 2 x 32: EVEN_K split
    together = linear(x, weight, config=cfg)
    chain = linear(x[:6].view(1, 6, -1), weight, config=cfg).view(6, -1)
    for i in range(MAX_ROWS):
        alone = linear(x[i:i + 1], weight, config=cfg)
        assert torch.equal(alone[0], together[i]), f"row {i} alone differs from row {i} of 16"
        if i < 6:
            assert torch.equal(alone[0], chain[i]), f"row {i} alone differs from row {i} of a [1, 6] chain"


def test_split_k_is_deterministic_and_reuses_its_workspace() -> None:
    """Two runs are equal; one workspace serves several launches (the last program resets the counters)."""
    x, weight = _inputs((6,), 40, 257, torch.bfloat16, torch.bfloat16, seed=9)
    floats, tiles = workspace_need(40, 257, torch.bfloat16, config=SPLIT)
    assert floats == 3 * MAX_ROWS * 40 and tiles == 3  # 9 blocks of 32 in 3 slices of 3 (split 4 fitted to 3)
    ws = LinearWorkspace.allocate("cpu", floats, tiles)
    first = linear(x, weight, workspace=ws, config=SPLIT)
    assert not ws.counters.any(), f"counters not reset: {ws.counters.tolist()}"
    second = linear(x, weight, workspace=ws, config=SPLIT)
    assert torch.equal(first, second)
    _check(first, x, weight, None)


def test_split_k_never_leaves_an_empty_slice() -> None:
    """K = 40 has two 32-blocks: a requested split of 4 runs as 2 (no slice without a block)."""
    assert pick_config(16, 40, torch.bfloat16).split_k <= 2
    x, weight = _inputs((3,), 24, 40, torch.bfloat16, torch.bfloat16, seed=13)
    _check(linear(x, weight, config=SPLIT), x, weight, None)


@pytest.mark.parametrize("w_dtype", DTYPES.values(), ids=[f"w{d}" for d in DTYPES])
def test_more_rows_fall_back_to_f_linear(w_dtype: torch.dtype) -> None:
    """M = 17 (> MAX_ROWS) runs F.linear in the weight dtype: the reference's own batched path, bit for bit."""
    x, weight = _inputs((1, MAX_ROWS + 1), 40, 100, torch.bfloat16, w_dtype, seed=17)
    got = linear(x, weight)
    assert torch.equal(got, linear_ref(x, weight))
    assert got.shape == (1, MAX_ROWS + 1, 40)


def test_strided_rows_and_leading_dims() -> None:
    """x as a narrowed view (row stride 2K) with leading dims [2, 3] comes back as [2, 3, N]."""
    x, weight = _inputs((2, 3), 40, 200, torch.bfloat16, torch.bfloat16, seed=19)
    x = x[..., :100]                                                      # [2, 3, K=100], row stride 200
    weight = weight[:, 100:].contiguous()
    got = linear(x, weight, config=SPLIT)
    assert got.shape == (2, 3, 40)
    _check(got, x, weight, None)


def test_pdl_on_cpu_falls_back() -> None:
    x, weight = _inputs((3,), 40, 100, torch.bfloat16, torch.bfloat16, seed=23)
    assert torch.equal(linear(x, weight, pdl=True, config=SPLIT), linear(x, weight, config=SPLIT))


def test_bad_shapes_name_both_shapes() -> None:
    x, weight = _inputs((3,), 40, 100, torch.bfloat16, torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match=r"x has shape \[3, 99\] and weight has shape \[40, 100\]"):
        linear(x[:, :99], weight)
    with pytest.raises(ValueError, match=r"x has shape \[3, 100\] and weight has shape \[4000\]"):
        linear(x, weight.reshape(-1))


def test_workspace_too_small_is_refused() -> None:
    x, weight = _inputs((3,), 40, 100, torch.bfloat16, torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match=r"workspace holds 8 partials"):
        linear(x, weight, workspace=LinearWorkspace.allocate("cpu", 8, 8), config=SPLIT)


def test_config_never_depends_on_rows() -> None:
    """pick_config takes no row count; every decode shape of Ling-3.0-tiny gets a valid config, no empty slice."""
    for n, k in [(2048, 1536), (16, 1536), (256, 1536), (576, 1536), (3072, 1536), (9216, 1536), (1024, 1536),
                 (157184, 1536), (1536, 2048), (1536, 4608), (1536, 512), (5 * 2048 + 16, 1536)]:
        for dtype in (torch.bfloat16, torch.float32):
            cfg = pick_config(n, k, dtype)
            assert cfg.block_n >= (16 if cfg.kind == "dot" else 1) and cfg.block_k >= 16 and cfg.split_k >= 1
            blocks = -(-k // cfg.block_k)
            assert (cfg.split_k - 1) * -(-blocks // cfg.split_k) < blocks, f"{n}x{k}: empty slice in {cfg}"


# ---- the NORM prologue: rmsnorm_linear / add_rmsnorm_linear (fuse_norm_linear) -------------------------------
# The kernel's rstd sums a row's squares in another order than the reference, so rstd may differ by a couple of
# fp32 ulps and each normed element by up to NORMED_ULPS ulps of the activation dtype (a flipped rounding in
# bf16); y's allowance is the linear bound plus that perturbation carried through |W|.
NORMED_ULPS = 4
EPS = 1e-6
NORM_DTYPES = {"fp32": (torch.float32, torch.float32, None), "bf16": (torch.bfloat16, torch.bfloat16, None),
               "bf16-fp32router": (torch.bfloat16, torch.float32, torch.float32)}   # (activation, weight, out_dtype)


def _norm_inputs(lead: tuple[int, ...], n: int, k: int, act: torch.dtype, w_dtype: torch.dtype,
                 seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    residual = (4 * torch.randn(*lead, k, generator=g)).to(act)             # [..., K]
    x = torch.randn(*lead, k, generator=g).to(act)                           # [..., K]
    norm_weight = (1 + 0.1 * torch.randn(k, generator=g)).to(act)           # [K]
    weight = (torch.randn(n, k, generator=g) / k**0.5).to(w_dtype)          # [N, K]
    return residual, x, norm_weight, weight


def _check_norm_outputs(got: tuple, want: tuple, want_normed: bool, assert_kernel_close) -> None:
    """normed close to the reference's (or the empty [0] tensor), the new residual bit-exact, y's shape and dtype."""
    assert got[0].dtype == want[0].dtype and got[0].shape == want[0].shape
    if want_normed:
        assert_kernel_close(got[1], want[1])
    else:
        assert got[1].shape == (0,)
    if len(got) == 3:
        assert torch.equal(got[2], want[2]), "new residual is not bit-identical to residual + x"


def _y_bound_ok(y: torch.Tensor, normed: torch.Tensor, weight: torch.Tensor, want_y: torch.Tensor) -> None:
    """|y - reference y| within the linear's bound on the reference's normed, plus NORMED_ULPS of it through |W|."""
    assert not y.isnan().any(), "unwritten (NaN-poisoned) elements"
    act_ulp = ULP[normed.dtype]
    mag = normed.to(weight.dtype).double().reshape(-1, normed.shape[-1]).abs() @ weight.double().abs().T
    bound = _bound(normed, weight, want_y.dtype) + NORMED_ULPS * act_ulp * mag.view_as(want_y)
    err = (y.double() - want_y.double()).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"max |y - ref| / bound = {worst:.3g} (max abs err {err.max().item():.3g})"


@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("dtypes", ["fp32", "bf16"])
def test_norm_linear_matches_reference_and_is_row_invariant(cfg: LinearConfig, dtypes: str, assert_kernel_close,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """add_rmsnorm_linear (want_normed) at M = 6 and M = 1 (row 0 alone == row 0 of six, every output bit for bit),
    rmsnorm_linear without normed at M = 6; outputs start NaN-poisoned. A 32-wide prologue block makes K = 100 four
    prologue steps with a tail, as Ling-3.0-tiny's K = 1536 is three of the default 512."""
    monkeypatch.setattr(linear_module, "NORM_BLOCK_K", 32)
    act, w_dtype, out_dtype = NORM_DTYPES[dtypes]
    residual, x, norm_weight, weight = _norm_inputs((1, 6), 40, 100, act, w_dtype, seed=41)
    want = add_rmsnorm_linear_ref(residual, x, norm_weight, EPS, weight, out_dtype, True)
    with poisoned_empty():
        six = add_rmsnorm_linear(residual, x, norm_weight, EPS, weight, out_dtype, True, config=cfg)
        one = add_rmsnorm_linear(residual[:, :1], x[:, :1], norm_weight, EPS, weight, out_dtype, True, config=cfg)
        plain = rmsnorm_linear(x, norm_weight, EPS, weight, out_dtype, False, config=cfg)
    _check_norm_outputs(six, want, True, assert_kernel_close)
    _y_bound_ok(six[0], want[1], weight, want[0])
    for got, full in zip(one, six):
        assert torch.equal(got[:, 0], full[:, 0]), "row 0 alone differs from row 0 of six"
    want_plain = rmsnorm_linear_ref(x, norm_weight, EPS, weight, out_dtype, True)
    _check_norm_outputs(plain, want_plain, False, assert_kernel_close)
    _y_bound_ok(plain[0], want_plain[1], weight, want_plain[0])


@pytest.mark.parametrize("cfg", [SPLIT, FMA_SPLIT], ids=["dot-split4", "fma-split4"])
def test_norm_linear_other_flag_combinations(cfg: LinearConfig, assert_kernel_close) -> None:
    """The residual without normed, normed without the residual; bf16 activations with the fp32 router weight."""
    act, w_dtype, out_dtype = NORM_DTYPES["bf16-fp32router"]
    residual, x, norm_weight, weight = _norm_inputs((3,), 17, 257, act, w_dtype, seed=43)
    with poisoned_empty():
        y, normed, new_residual = add_rmsnorm_linear(residual, x, norm_weight, EPS, weight, out_dtype, False,
                                                     config=cfg)
        y2, normed2 = rmsnorm_linear(x, norm_weight, EPS, weight, out_dtype, True, config=cfg)
    want = add_rmsnorm_linear_ref(residual, x, norm_weight, EPS, weight, out_dtype, True)
    _check_norm_outputs((y, normed, new_residual), want, False, assert_kernel_close)
    _y_bound_ok(y, want[1], weight, want[0])
    want2 = rmsnorm_linear_ref(x, norm_weight, EPS, weight, out_dtype, True)
    _check_norm_outputs((y2, normed2), want2, True, assert_kernel_close)
    _y_bound_ok(y2, want2[1], weight, want2[0])


def test_norm_linear_table_config_strided_input_and_prefill_fallback(assert_kernel_close) -> None:
    """No config: the table's. x as a column slice of a wider output (MLA's q_a -> q_b reads a split view).
    M = 17 > MAX_ROWS runs the unfused kernels (rmsnorm kernel, then F.linear), bit for bit."""
    residual, x, norm_weight, weight = _norm_inputs((3,), 24, 96, torch.bfloat16, torch.bfloat16, seed=47)
    wide = torch.cat([x, x[:, :32]], dim=-1)[:, :96]                         # [3, 96], row stride 128
    got = rmsnorm_linear(wide, norm_weight, EPS, weight, None, True)
    want = rmsnorm_linear_ref(x, norm_weight, EPS, weight, None, True)
    assert_kernel_close(got[1], want[1])
    _y_bound_ok(got[0], want[1], weight, want[0])
    residual, x, norm_weight, weight = _norm_inputs((1, MAX_ROWS + 1), 24, 40, torch.bfloat16, torch.bfloat16,
                                                    seed=53)
    y, normed, new_residual = add_rmsnorm_linear(residual, x, norm_weight, EPS, weight, torch.float32, True)
    unfused_normed, unfused_residual = add_rmsnorm(residual, x, norm_weight, EPS)
    assert torch.equal(normed, unfused_normed) and torch.equal(new_residual, unfused_residual)
    assert torch.equal(y, linear(unfused_normed, weight, torch.float32))


def test_norm_linear_bad_shapes_are_named() -> None:
    residual, x, norm_weight, weight = _norm_inputs((3,), 24, 40, torch.bfloat16, torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match=r"norm_weight has shape \[39\] and x \[3, 40\]"):
        rmsnorm_linear(x, norm_weight[:39], EPS, weight)
    with pytest.raises(ValueError, match=r"residual is \[3, 40\] torch.float32, x is \[3, 40\] torch.bfloat16"):
        add_rmsnorm_linear(residual.float(), x, norm_weight, EPS, weight)


@pytest.mark.parametrize("norm_block", [32, 64], ids=["norm32", "norm64-held"])
@pytest.mark.parametrize("n,k", SHAPES, ids=[f"N{n}-K{k}" for n, k in SHAPES])
def test_fma_preload_gives_the_loop_bits(n: int, k: int, norm_block: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """FMA_PRELOAD (an unsplit fma program's weight slice in registers before the wait, the bf16 router's GEMV) runs
    the loop's blocks in the same order on the same values: linear and add_rmsnorm_linear, every output bit for bit
    with it off, including the K tails (EVEN_K off). norm64: the norm's block is the GEMV's (64), so the preloaded
    program keeps the prologue's h blocks for its main loop (_held_rstd) instead of loading them again."""
    monkeypatch.setattr(linear_module, "NORM_BLOCK_K", norm_block)
    act, w_dtype, out_dtype = NORM_DTYPES["bf16"]
    residual, x, norm_weight, weight = _norm_inputs((1, 6), n, k, act, w_dtype, seed=n + k)
    outs = {}
    for preload in (True, False):
        monkeypatch.setattr(linear_module, "FMA_PRELOAD", preload)
        outs[preload] = (linear(x, weight, config=FMA),
                         *add_rmsnorm_linear(residual, x, norm_weight, EPS, weight, out_dtype, True, config=FMA))
    for got, want in zip(outs[True], outs[False]):
        assert torch.equal(got, want)
