"""lingc.kernels.kda in the Triton interpreter: against the lingc reference ops (tolerance), and bit for bit
against itself across chain lengths (verify chain position t == decode step t; staged + commit == decode)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from lingc.kernels import kda as K
from kernel_support import poison_float_empty  # noqa: E402  (tests/kernels is on sys.path)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
dtypes = pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
LOWER_BOUND = -5.0
EPS = 1e-6
S_SLOTS = 5
# the recurrence reference sums with einsum (another order): fp32 outputs and states agree to ~1e-7
STATE_TOL = dict(rtol=1e-5, atol=1e-5)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _slots(B: int, g: torch.Generator) -> torch.Tensor:
    return torch.randperm(S_SLOTS, generator=g)[:B].to(torch.int32)


def _conv_inputs(B, T, P, W, dtype, seed):
    g = _gen(seed)
    x = torch.randn(B, T, P, generator=g).to(dtype)                              # [B, T, P]
    weight = torch.randn(P, 1, W, generator=g) * 0.5                             # [P, 1, W] fp32
    pool = torch.randn(S_SLOTS, P, W - 1, generator=g).to(dtype)                 # [S, P, W-1]
    return x, weight, pool, _slots(B, g)


def _rec_inputs(B, T, H, D, dtype, seed):
    g = _gen(seed)
    q, k, v, f = (torch.randn(B, T, H, D, generator=g).to(dtype) for _ in range(4))   # [B, T, H, D]
    b = torch.randn(B, T, H, generator=g).to(dtype)                                   # [B, T, H]
    A_log = torch.randn(H, generator=g) * 0.5                                          # [H] fp32
    dt_bias = torch.randn(H * D, generator=g)                                          # [P] fp32
    pool = torch.randn(S_SLOTS, H, D, D, generator=g) * 0.3                            # [S, H, D, D] fp32
    return q, k, v, f, b, A_log, dt_bias, pool, _slots(B, g)


def _nan(*shape, dtype=torch.float32) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype)


def _rows(t: torch.Tensor, b: int, t0: int, t1: int) -> torch.Tensor:
    return t[b:b + 1, t0:t1]


# ---------------------------------------------------------------------------------------------- conv

@dtypes
@pytest.mark.parametrize("B,T,P,W", [(2, 1, 48, 4), (1, 5, 33, 4), (2, 3, 20, 3)])
def test_conv_matches_reference(B, T, P, W, dtype, assert_kernel_close: Callable) -> None:
    x, weight, pool, slots = _conv_inputs(B, T, P, W, dtype, seed=B * 100 + T * 10 + W)
    got_pool, want_pool = pool.clone(), pool.clone()
    y = K.kda_conv(x, weight, got_pool, slots)
    assert_kernel_close(y, K.kda_conv_ref(x, weight, want_pool, slots))
    assert torch.equal(got_pool, want_pool), "conv window update differs"


@dtypes
@pytest.mark.parametrize("B,T,P,W", [(2, 4, 48, 4), (1, 2, 33, 3)])
def test_conv_staged_matches_reference(B, T, P, W, dtype, assert_kernel_close: Callable) -> None:
    x, weight, pool, slots = _conv_inputs(B, T, P, W, dtype, seed=7 + T)
    before = pool.clone()
    got_st, want_st = _nan(B, T + 1, P, W - 1, dtype=dtype), _nan(B, T + 1, P, W - 1, dtype=dtype)
    y = K.kda_conv_staged(x, weight, pool, slots, got_st)
    assert_kernel_close(y, K.kda_conv_staged_ref(x, weight, pool, slots, want_st))
    assert torch.equal(pool, before), "staged conv wrote its pool"
    assert torch.equal(got_st[:, :T], want_st[:, :T])
    assert got_st[:, T:].isnan().all(), "staged conv wrote past position T-1"


# ---------------------------------------------------------------------------------------------- recurrence

@dtypes
@pytest.mark.parametrize("B,T,H,D", [(2, 1, 3, 16), (1, 4, 2, 24)])   # D = 24: masked K and V tails
def test_recurrent_matches_reference(B, T, H, D, dtype, assert_kernel_close: Callable) -> None:
    q, k, v, f, b, A_log, dt_bias, pool, slots = _rec_inputs(B, T, H, D, dtype, seed=T * 10 + D)
    got_pool, want_pool = pool.clone(), pool.clone()
    o = K.kda_recurrent(q, k, v, f, b, A_log, dt_bias, got_pool, slots, LOWER_BOUND, block_v=8)
    want = K.kda_recurrent_ref(q, k, v, f, b, A_log, dt_bias, want_pool, slots, LOWER_BOUND)
    if dtype == torch.float32:
        torch.testing.assert_close(o, want, **STATE_TOL)
    else:
        assert_kernel_close(o, want)
    torch.testing.assert_close(got_pool, want_pool, **STATE_TOL)


@dtypes
def test_recurrent_staged_matches_reference(dtype, assert_kernel_close: Callable) -> None:
    B, T, H, D = 2, 3, 2, 16
    q, k, v, f, b, A_log, dt_bias, pool, slots = _rec_inputs(B, T, H, D, dtype, seed=5)
    before = pool.clone()
    got_st, want_st = _nan(B, T + 2, H, D, D), _nan(B, T + 2, H, D, D)
    o = K.kda_recurrent_staged(q, k, v, f, b, A_log, dt_bias, pool, slots, got_st, LOWER_BOUND)
    want = K.kda_recurrent_staged_ref(q, k, v, f, b, A_log, dt_bias, pool, slots, want_st, LOWER_BOUND)
    if dtype == torch.float32:
        torch.testing.assert_close(o, want, **STATE_TOL)
    else:
        assert_kernel_close(o, want)
    assert torch.equal(pool, before), "staged recurrence wrote its pool"
    torch.testing.assert_close(got_st[:, :T], want_st[:, :T], **STATE_TOL)
    assert got_st[:, T:].isnan().all(), "staged recurrence wrote past position T-1"


# ---------------------------------------------------------------------------------------------- row invariance

@dtypes
def test_chain_positions_equal_decode_steps(dtype) -> None:
    """Verify chain (staged conv + staged recurrence) position t == decode step t from the pools, bit for bit:
    outputs, and each staged conv window / state == the pool after that decode step. Two batch rows."""
    B, T, H, D, W = 2, 4, 2, 16, 4
    P = H * D
    x, weight, conv_pool, slots = _conv_inputs(B, T, P, W, dtype, seed=21)
    q, k, v, f, b, A_log, dt_bias, pool, _ = _rec_inputs(B, T, H, D, dtype, seed=22)
    conv_st, rec_st = _nan(B, T, P, W - 1, dtype=dtype), _nan(B, T, H, D, D)
    y_chain = K.kda_conv_staged(x, weight, conv_pool, slots, conv_st)
    o_chain = K.kda_recurrent_staged(q, k, v, f, b, A_log, dt_bias, pool, slots, rec_st, LOWER_BOUND)
    for t in range(T):                                  # replay token by token through the decode kernels
        y_t = K.kda_conv(x[:, t:t + 1], weight, conv_pool, slots)
        o_t = K.kda_recurrent(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], f[:, t:t + 1], b[:, t:t + 1],
                              A_log, dt_bias, pool, slots, LOWER_BOUND)
        assert torch.equal(y_t, y_chain[:, t:t + 1]), f"conv output of position {t} differs from decode"
        assert torch.equal(o_t, o_chain[:, t:t + 1]), f"recurrence output of position {t} differs from decode"
        assert torch.equal(conv_st[:, t], conv_pool[slots.long()]), f"staged conv window {t} != decode pool"
        assert torch.equal(rec_st[:, t], pool[slots.long()]), f"staged state {t} != decode pool"


@dtypes
def test_staged_commit_equals_decode(dtype) -> None:
    """staged chain + commit(accept_len) == decode of accept_len tokens, per batch row, bit for bit."""
    B, T, H, D, W = 2, 4, 2, 16, 4
    P = H * D
    x, weight, conv_pool, slots = _conv_inputs(B, T, P, W, dtype, seed=31)
    q, k, v, f, b, A_log, dt_bias, pool, _ = _rec_inputs(B, T, H, D, dtype, seed=32)
    accept = torch.tensor([2, 4], dtype=torch.int32)
    conv_st, rec_st = _nan(B, T, P, W - 1, dtype=dtype), _nan(B, T, H, D, D)
    spec_conv, spec_pool = conv_pool.clone(), pool.clone()
    K.kda_conv_staged(x, weight, spec_conv, slots, conv_st)
    K.kda_recurrent_staged(q, k, v, f, b, A_log, dt_bias, spec_pool, slots, rec_st, LOWER_BOUND)
    K.kda_commit(spec_conv, slots, conv_st, accept)
    K.kda_commit(spec_pool, slots, rec_st, accept)
    for row in range(B):                                # decode row alone, accept[row] tokens
        a, s = int(accept[row]), slots[row:row + 1]
        K.kda_conv(_rows(x, row, 0, a), weight, conv_pool, s)
        K.kda_recurrent(*(_rows(t, row, 0, a) for t in (q, k, v, f, b)), A_log, dt_bias, pool, s, LOWER_BOUND)
    assert torch.equal(spec_conv, conv_pool)
    assert torch.equal(spec_pool, pool)


def test_recurrent_batch_rows_independent() -> None:
    """A batch row's bits do not depend on the other rows (B = 3 at once == each row alone)."""
    B, T, H, D = 3, 2, 2, 16
    q, k, v, f, b, A_log, dt_bias, pool, slots = _rec_inputs(B, T, H, D, torch.bfloat16, seed=41)
    together = pool.clone()
    o_all = K.kda_recurrent(q, k, v, f, b, A_log, dt_bias, together, slots, LOWER_BOUND)
    for row in range(B):
        o = K.kda_recurrent(*(_rows(t, row, 0, T) for t in (q, k, v, f, b)), A_log, dt_bias, pool,
                            slots[row:row + 1], LOWER_BOUND)
        assert torch.equal(o, o_all[row:row + 1])
    assert torch.equal(pool, together)


# ---------------------------------------------------------------------------------------------- commit

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_commit_matches_reference(dtype) -> None:
    g = _gen(51)
    B, TS, shape = 3, 4, (5, 7)                                       # odd trailing shape: masked tail
    pool = torch.randn(S_SLOTS, *shape, generator=g).to(dtype)
    staging = torch.randn(B, TS, *shape, generator=g).to(dtype)
    slots = torch.tensor([4, 0, 2], dtype=torch.int32)
    accept = torch.tensor([1, 4, 9], dtype=torch.int64)              # 9 > TS: clamped to the last position
    got, want = pool.clone(), pool.clone()
    K.kda_commit(got, slots, staging, accept)
    K.kda_commit_ref(want, slots, staging, accept)
    assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------- gated rmsnorm

@dtypes
@pytest.mark.parametrize("shape", [(1, 1, 3, 16), (2, 3, 3, 24)])
def test_gated_rmsnorm_matches_reference(shape, dtype, assert_kernel_close: Callable) -> None:
    g = _gen(sum(shape))
    x = torch.randn(*shape, generator=g).to(dtype)
    gate = torch.randn(*shape, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype)
    out = K.gated_rmsnorm(x, weight, gate, EPS)
    assert_kernel_close(out, K.gated_rmsnorm_ref(x, weight, gate, EPS))
    for t in range(shape[1]):                                          # each position alone == all at once
        assert torch.equal(K.gated_rmsnorm(x[:, t:t + 1], weight, gate[:, t:t + 1], EPS), out[:, t:t + 1])


# ---------------------------------------------------------------------------------------------- fused

def _fused_inputs(B, T, H, D, W, dtype, seed):
    g = _gen(seed)
    P = H * D
    raw = [torch.randn(B, T, P, generator=g).to(dtype) for _ in range(3)]            # q, k, v projections
    f = torch.randn(B, T, H, D, generator=g).to(dtype)
    b = torch.randn(B, T, H, generator=g).to(dtype)
    ws = [torch.randn(P, 1, W, generator=g) * 0.5 for _ in range(3)]
    pools = [torch.randn(S_SLOTS, P, W - 1, generator=g).to(dtype) for _ in range(3)]
    A_log, dt_bias = torch.randn(H, generator=g) * 0.5, torch.randn(P, generator=g)
    state = torch.randn(S_SLOTS, H, D, D, generator=g) * 0.3
    return raw, f, b, ws, pools, A_log, dt_bias, state, _slots(B, g)


@dtypes
def test_fused_verify_equals_separate_kernels(dtype, assert_kernel_close: Callable) -> None:
    B, T, H, D, W = 2, 3, 2, 16, 4
    raw, f, b, ws, pools, A_log, dt_bias, state, slots = _fused_inputs(B, T, H, D, W, dtype, seed=61)
    P = H * D
    st = [_nan(B, T, P, W - 1, dtype=dtype) for _ in range(3)] + [_nan(B, T, H, D, D)]
    o = K.kda_fused_verify(*raw, f, b, *ws, *pools, A_log, dt_bias, state, slots, *st, LOWER_BOUND, block_v=8)
    sep = [_nan(B, T, P, W - 1, dtype=dtype) for _ in range(3)] + [_nan(B, T, H, D, D)]
    qkv = [K.kda_conv_staged(x, w, p, slots, s).view(B, T, H, D) for x, w, p, s in zip(raw, ws, pools, sep)]
    o_sep = K.kda_recurrent_staged(*qkv, f, b, A_log, dt_bias, state, slots, sep[3], LOWER_BOUND, block_v=8)
    assert torch.equal(o, o_sep)
    for got, want in zip(st, sep):
        assert torch.equal(got, want)
    ref = [_nan(B, T, P, W - 1, dtype=dtype) for _ in range(3)] + [_nan(B, T, H, D, D)]
    want = K.kda_fused_verify_ref(*raw, f, b, *ws, *pools, A_log, dt_bias, state, slots, *ref, LOWER_BOUND)
    if dtype == torch.float32:
        torch.testing.assert_close(o, want, **STATE_TOL)
    else:
        assert_kernel_close(o, want)


def test_fused_verify_reads_fused_projection_views() -> None:
    """q/k/v/f/b as column views of one projection [B, T, 5P + H] (fuse_projections) give the bits of copies."""
    B, T, H, D, W = 1, 2, 2, 16, 4
    P = H * D
    raw, f, b, ws, pools, A_log, dt_bias, state, slots = _fused_inputs(B, T, H, D, W, torch.bfloat16, seed=62)
    fused = torch.cat([*raw, f.view(B, T, P), b], dim=-1)                             # [B, T, 4P + H]
    q_raw, k_raw, v_raw, f_cols, b_cols = fused.split([P, P, P, P, H], dim=-1)
    outs = []
    for args in ((q_raw, k_raw, v_raw, f_cols.view(B, T, H, D), b_cols), (*raw, f, b)):
        st = [_nan(B, T, P, W - 1, dtype=torch.bfloat16) for _ in range(3)] + [_nan(B, T, H, D, D)]
        outs.append((K.kda_fused_verify(*args, *ws, *pools, A_log, dt_bias, state, slots, *st, LOWER_BOUND), st))
    (o1, st1), (o2, st2) = outs
    assert torch.equal(o1, o2) and all(torch.equal(a, c) for a, c in zip(st1, st2))


# ---------------------------------------------------------------------------------------------- fused decode

def _two_launches(raw, f, b, ws, pools, A_log, dt_bias, state, slots, block_v=None):
    """What kda_fused_decode replaces: kda_conv_qkv, then kda_recurrent on its outputs viewed as f's heads."""
    qkv = [y.view(f.shape) for y in K.kda_conv_qkv(*raw, *ws, *pools, slots)]
    return K.kda_recurrent(*qkv, f, b, A_log, dt_bias, state, slots, LOWER_BOUND, block_v=block_v)


def _clones(pools, state):
    return [p.clone() for p in pools], state.clone()


@dtypes
@pytest.mark.parametrize("B,T,H,D,block_v", [(2, 1, 2, 16, 8), (1, 1, 3, 24, 8), (2, 3, 2, 16, 16)])
def test_fused_decode_equals_two_launches(B, T, H, D, block_v, dtype, nan_empty,
                                          assert_kernel_close: Callable) -> None:
    """kda_fused_decode == kda_conv_qkv + kda_recurrent: the output, the three conv pools and the state pool, bit
    for bit (D = 24: masked K and V tails, 3 V tiles a head; block_v = D: one tile, its own last ticket; T = 3:
    in place works for any T); against the reference op within tolerance (the conv windows exactly)."""
    W = 4
    raw, f, b, ws, pools, A_log, dt_bias, state, slots = _fused_inputs(B, T, H, D, W, dtype, seed=B * 100 + T * 10 + D)
    got_pools, got_state = _clones(pools, state)
    o = K.kda_fused_decode(*raw, f, b, *ws, *got_pools, A_log, dt_bias, got_state, slots, LOWER_BOUND,
                           block_v=block_v)
    sep_pools, sep_state = _clones(pools, state)
    o_sep = _two_launches(raw, f, b, ws, sep_pools, A_log, dt_bias, sep_state, slots, block_v)
    assert not o.isnan().any(), "unwritten output elements"
    assert torch.equal(o, o_sep), "output differs from kda_conv_qkv + kda_recurrent"
    for name, got, want, before in zip("qkv", got_pools, sep_pools, pools):
        assert torch.equal(got, want), f"{name} window update differs from kda_conv_qkv"
        assert not torch.equal(got, before), f"{name} windows not updated"
    assert torch.equal(got_state, sep_state), "state update differs from kda_recurrent"
    ref_pools, ref_state = _clones(pools, state)
    want = K.kda_fused_decode_ref(*raw, f, b, *ws, *ref_pools, A_log, dt_bias, ref_state, slots, LOWER_BOUND)
    if dtype == torch.float32:
        torch.testing.assert_close(o, want, **STATE_TOL)
    else:
        assert_kernel_close(o, want)
    assert all(torch.equal(a, c) for a, c in zip(got_pools, ref_pools)), "windows differ from the reference op"
    torch.testing.assert_close(got_state, ref_state, **STATE_TOL)


def test_fused_decode_repeated_launches_leave_counters_zero(nan_empty) -> None:
    """Four decode steps from one set of pools, fresh projections each: the two-launch path's bits after every step,
    and after every launch its B*H head counters are back at zero (the next launch or CUDA-graph replay starts
    from zero) and the counters past them untouched; the default per-device counters likewise."""
    B, H, D, W = 2, 2, 16, 4
    _, _, _, ws, pools, A_log, dt_bias, state, slots = _fused_inputs(B, 1, H, D, W, torch.bfloat16, seed=63)
    counters = torch.full((B * H + 3,), 7, dtype=torch.int32)
    counters[:B * H] = 0
    got_pools, got_state = _clones(pools, state)
    sep_pools, sep_state = _clones(pools, state)
    for step in range(4):
        raw, f, b, *_ = _fused_inputs(B, 1, H, D, W, torch.bfloat16, seed=64 + step)
        o = K.kda_fused_decode(*raw, f, b, *ws, *got_pools, A_log, dt_bias, got_state, slots, LOWER_BOUND,
                               workspace=counters, block_v=8)
        o_sep = _two_launches(raw, f, b, ws, sep_pools, A_log, dt_bias, sep_state, slots, block_v=8)
        assert torch.equal(o, o_sep), f"step {step}: output differs from the two launches"
        assert all(torch.equal(a, c) for a, c in zip(got_pools, sep_pools)), f"step {step}: windows differ"
        assert torch.equal(got_state, sep_state), f"step {step}: state differs"
        assert counters[:B * H].eq(0).all(), f"step {step}: counters left at {counters[:B * H].tolist()}"
        assert counters[B * H:].eq(7).all(), f"step {step}: a counter past B*H was touched"
    default = K.device_counters("cpu")
    assert default is K.device_counters(torch.device("cpu")) and default.dtype == torch.int32
    for _ in range(2):
        o = K.kda_fused_decode(*raw, f, b, *ws, *got_pools, A_log, dt_bias, got_state, slots, LOWER_BOUND)
        o_sep = _two_launches(raw, f, b, ws, sep_pools, A_log, dt_bias, sep_state, slots)
        assert torch.equal(o, o_sep) and torch.equal(got_state, sep_state)
        assert default.eq(0).all(), "the default counters were left non-zero"


def test_fused_decode_reads_fused_projection_views() -> None:
    """q/k/v/f/b as column views of one projection [B, T, 4P + H] (fuse_projections) give the bits of copies."""
    B, T, H, D, W = 1, 1, 2, 16, 4
    P = H * D
    raw, f, b, ws, pools, A_log, dt_bias, state, slots = _fused_inputs(B, T, H, D, W, torch.bfloat16, seed=66)
    fused = torch.cat([*raw, f.view(B, T, P), b], dim=-1)                             # [B, T, 4P + H]
    q_raw, k_raw, v_raw, f_cols, b_cols = fused.split([P, P, P, P, H], dim=-1)
    outs = []
    for args in ((q_raw, k_raw, v_raw, f_cols.view(B, T, H, D), b_cols), (*raw, f, b)):
        p, s = _clones(pools, state)
        outs.append((K.kda_fused_decode(*args, *ws, *p, A_log, dt_bias, s, slots, LOWER_BOUND), p, s))
    (o1, p1, s1), (o2, p2, s2) = outs
    assert torch.equal(o1, o2) and torch.equal(s1, s2) and all(torch.equal(a, c) for a, c in zip(p1, p2))


def test_fused_decode_bad_inputs_raise() -> None:
    """A workspace too small (or not int32) and mismatched projections are refused before anything is written."""
    B, H = 2, 2
    raw, f, b, ws, pools, A_log, dt_bias, state, slots = _fused_inputs(B, 1, H, 16, 4, torch.float32, seed=67)
    before = [p.clone() for p in (*pools, state)]
    args = (f, b, *ws, *pools, A_log, dt_bias, state, slots, LOWER_BOUND)
    with pytest.raises(ValueError, match=r"kda_fused_decode: workspace holds 3 torch.int32 counters .* want a "
                                         r"contiguous int32 one with >= 4 \(batch rows x heads\)"):
        K.kda_fused_decode(*raw, *args, workspace=torch.zeros(B * H - 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="kda_fused_decode: workspace holds 8 torch.int64 counters"):
        K.kda_fused_decode(*raw, *args, workspace=torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"kda_fused_decode: v_raw is \[2, 1, 16\]"):
        K.kda_fused_decode(raw[0], raw[1], raw[2][..., :16], *args)
    assert all(torch.equal(a, c) for a, c in zip((*pools, state), before)), "a refused call wrote a pool"


# ---------------------------------------------------------------------------------------------- one launch for many

@pytest.fixture
def nan_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """Launcher-allocated float outputs start as NaN, so an element the kernel never writes shows."""
    poison_float_empty(monkeypatch)


@dtypes
@pytest.mark.parametrize("B,T,P,W", [(2, 1, 300, 4), (1, 3, 33, 3)])     # P = 300: two channel blocks
def test_conv_qkv_equals_three_convs(B, T, P, W, dtype, nan_empty) -> None:
    """kda_conv_qkv == kda_conv(q), kda_conv(k), kda_conv(v): outputs and updated windows, bit for bit; the three
    inputs are column views of one projection (fuse_projections) with different strides than the outputs."""
    g = _gen(B * 1000 + T * 10 + P)
    fused = torch.randn(B, T, 3 * P + 5, generator=g).to(dtype)
    xs = fused[..., :3 * P].split(P, dim=-1)                                           # 3 x [B, T, P] views
    ws = [torch.randn(P, 1, W, generator=g) * 0.5 for _ in range(3)]
    pools = [torch.randn(S_SLOTS, P, W - 1, generator=g).to(dtype) for _ in range(3)]
    slots = _slots(B, g)
    got_pools, want_pools = [p.clone() for p in pools], [p.clone() for p in pools]
    got = K.kda_conv_qkv(*xs, *ws, *got_pools, slots)
    want = [K.kda_conv(x, w, p, slots) for x, w, p in zip(xs, ws, want_pools)]
    for name, y, y_ref, p, p_ref in zip("qkv", got, want, got_pools, want_pools):
        assert not y.isnan().any(), f"{name}: unwritten output elements"
        assert torch.equal(y, y_ref), f"{name} output differs from kda_conv"
        assert torch.equal(p, p_ref), f"{name} window update differs from kda_conv"
    ref_pools = [p.clone() for p in pools]
    ref = K.kda_conv_qkv_ref(*xs, *ws, *ref_pools, slots)                             # the lingc op: 3 kda_conv
    assert all(torch.equal(a, c) for a, c in zip(ref, torch.ops.lingc.kda_conv_qkv(*xs, *ws, *pools, slots)))


@dtypes
@pytest.mark.parametrize("pairs", [4, 2, 8, 7, 21])
def test_commit_multi_equals_separate_commits(dtype, pairs) -> None:
    """One launch for one layer's commits or several layers' (conv windows in the activation dtype [S, P, W-1], the
    fp32 recurrent state [S, H, D, D]; 21 pairs: five layers and a conv window) == one kda_commit per pair, bit for
    bit; small blocks so each pair spans several programs."""
    g = _gen(71 + pairs)
    B, TS, P, W, H, D = 2, 4, 40, 4, 2, 12
    layer = [((P, W - 1), dtype)] * 3 + [((H, D, D), torch.float32)]
    shapes = layer[:pairs - 1] + layer[-1:] if pairs <= 4 else (layer * 6)[:pairs - 1] + layer[-1:]
    pools = [torch.randn(S_SLOTS, *shape, generator=g).to(dt) for shape, dt in shapes]
    stagings = [torch.randn(B, TS, *shape, generator=g).to(dt) for shape, dt in shapes]
    slots = torch.tensor([3, 0], dtype=torch.int32)
    accept = torch.tensor([2, 9], dtype=torch.int64)                                  # 9 > TS: clamped
    got, want, ref = ([p.clone() for p in pools] for _ in range(3))
    K.kda_commit_multi(slots, accept, got, stagings, block=64)
    for p, st in zip(want, stagings):
        K.kda_commit(p, slots, st, accept)
    K.kda_commit_multi_ref(slots, accept, ref, stagings)
    for i, (a, c, r) in enumerate(zip(got, want, ref)):
        assert torch.equal(a, c) and torch.equal(r, c), f"pair {i} differs from kda_commit"


def test_one_launch_ops_pdl_on_cpu_falls_back() -> None:
    x, weight, pool, slots = _conv_inputs(1, 1, 20, 4, torch.float32, seed=82)
    p1, p2 = [pool.clone() for _ in range(3)], [pool.clone() for _ in range(3)]
    y1 = K.kda_conv_qkv(x, x, x, weight, weight, weight, *p1, slots, pdl=True)
    y2 = K.kda_conv_qkv(x, x, x, weight, weight, weight, *p2, slots)
    assert all(torch.equal(a, c) for a, c in zip(y1 + tuple(p1), y2 + tuple(p2)))
    staging, accept = torch.randn(1, 2, 20, 3), torch.ones(1, dtype=torch.int32)
    K.kda_commit_multi(slots, accept, [p1[0]], [staging], pdl=True)
    K.kda_commit_multi(slots, accept, [p2[0]], [staging])
    assert torch.equal(p1[0], p2[0])
    raw, f, b, ws, pools, A_log, dt_bias, state, slots = _fused_inputs(1, 1, 2, 16, 4, torch.float32, seed=83)
    (p1, s1), (p2, s2) = _clones(pools, state), _clones(pools, state)
    o1 = K.kda_fused_decode(*raw, f, b, *ws, *p1, A_log, dt_bias, s1, slots, LOWER_BOUND, pdl=True)
    o2 = K.kda_fused_decode(*raw, f, b, *ws, *p2, A_log, dt_bias, s2, slots, LOWER_BOUND)
    assert torch.equal(o1, o2) and torch.equal(s1, s2) and all(torch.equal(a, c) for a, c in zip(p1, p2))


# ---------------------------------------------------------------------------------------------- strided views

def test_fused_projection_views() -> None:
    """q/k/v/f/b/g as slices of one fused projection [B, T, 5P + H] (fuse_projections): strided views give the
    bits of contiguous copies, and the gate's rows are read in place (no copy)."""
    B, T, H, D, W = 2, 3, 2, 16, 4
    P = H * D
    g = _gen(101)
    fused = torch.randn(B, T, 5 * P + H, generator=g).to(torch.bfloat16)
    q_raw, k_raw, v_raw, f, b, gate = fused.split([P, P, P, P, H, P], dim=-1)
    heads = (B, T, H, D)
    _, weight, conv_pool, slots = _conv_inputs(B, T, P, W, torch.bfloat16, seed=102)
    _, _, _, _, _, A_log, dt_bias, pool, _ = _rec_inputs(B, T, H, D, torch.bfloat16, seed=103)
    p1, p2 = conv_pool.clone(), conv_pool.clone()
    assert torch.equal(K.kda_conv(q_raw, weight, p1, slots), K.kda_conv(q_raw.contiguous(), weight, p2, slots))
    s1, s2 = pool.clone(), pool.clone()
    views = (q_raw.view(heads), k_raw.view(heads), v_raw.view(heads), f.view(heads), b)
    o1 = K.kda_recurrent(*views, A_log, dt_bias, s1, slots, LOWER_BOUND)
    o2 = K.kda_recurrent(*(t.contiguous() for t in views), A_log, dt_bias, s2, slots, LOWER_BOUND)
    assert torch.equal(o1, o2) and torch.equal(s1, s2)
    weight_n = (1 + 0.1 * torch.randn(D, generator=g)).to(torch.bfloat16)
    assert K._rows3(gate.view(heads), D).data_ptr() == gate.data_ptr()
    assert torch.equal(K.gated_rmsnorm(o1, weight_n, gate.view(heads), EPS),
                       K.gated_rmsnorm(o1, weight_n, gate.contiguous().view(heads), EPS))


# ---------------------------------------------------------------------------------------------- misc

def test_pdl_on_cpu_falls_back() -> None:
    q, k, v, f, b, A_log, dt_bias, pool, slots = _rec_inputs(1, 2, 2, 16, torch.float32, seed=81)
    p1, p2 = pool.clone(), pool.clone()
    o1 = K.kda_recurrent(q, k, v, f, b, A_log, dt_bias, p1, slots, LOWER_BOUND, pdl=True)
    o2 = K.kda_recurrent(q, k, v, f, b, A_log, dt_bias, p2, slots, LOWER_BOUND)
    assert torch.equal(o1, o2) and torch.equal(p1, p2)


def test_lowerings_name_reference_ops() -> None:
    assert set(K.LOWERINGS) == {"kda_conv", "kda_conv_staged", "kda_recurrent", "kda_recurrent_staged",
                                "kda_commit", "gated_rmsnorm", "kda_conv_qkv", "kda_fused_verify", "kda_fused_decode",
                                "kda_commit_multi"}
    for name in K.LOWERINGS:
        assert hasattr(torch.ops.lingc, name)


def test_bad_shapes_raise() -> None:
    q, k, v, f, b, A_log, dt_bias, pool, slots = _rec_inputs(1, 2, 2, 16, torch.float32, seed=91)
    with pytest.raises(ValueError, match=r"kda_recurrent: k is \[1, 2, 2, 8\]"):
        K.kda_recurrent(q, k[..., :8], v, f, b, A_log, dt_bias, pool, slots, LOWER_BOUND)
    with pytest.raises(ValueError, match="state_pool is .* want contiguous"):
        K.kda_recurrent(q, k, v, f, b, A_log, dt_bias, pool.double(), slots, LOWER_BOUND)
    with pytest.raises(ValueError, match="kda_recurrent_staged: staging is"):
        K.kda_recurrent_staged(q, k, v, f, b, A_log, dt_bias, pool, slots, torch.zeros(1, 1, 2, 16, 16), LOWER_BOUND)
    x, weight, conv_pool, cslots = _conv_inputs(1, 2, 20, 4, torch.float32, seed=92)
    with pytest.raises(ValueError, match="kda_conv: conv_pool is"):
        K.kda_conv(x, weight, conv_pool[..., :2], cslots)
    with pytest.raises(ValueError, match="kda_commit: accept_len"):
        K.kda_commit(conv_pool, cslots, torch.zeros(1, 2, 20, 3), torch.ones(2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"kda_conv_qkv: the three convs have \[B, T, P, W\]"):
        K.kda_conv_qkv(x, x, x[:, :1], weight, weight, weight, conv_pool, conv_pool, conv_pool, cslots)
    accept = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="kda_commit_multi: want 1 to 80"):
        K.kda_commit_multi(cslots, accept, [conv_pool] * 81, [torch.zeros(1, 2, 20, 3)] * 81)
    with pytest.raises(ValueError, match="kda_commit_multi: want 1 to 80"):
        K.kda_commit_multi(cslots, accept, [], [])
    with pytest.raises(ValueError, match="kda_commit_multi: every pool needs its staging"):
        K.kda_commit_multi(cslots, accept, [conv_pool, conv_pool], [torch.zeros(1, 2, 20, 3)])
    with pytest.raises(ValueError, match=r"kda_commit_multi: pair 1: staging is \[1, 2, 20, 2\]"):
        K.kda_commit_multi(cslots, accept, [conv_pool, conv_pool], [torch.zeros(1, 2, 20, 3), torch.zeros(1, 2, 20, 2)])
    with pytest.raises(ValueError, match="lingc.kda_commit_multi: want 1 to 80 pools and as many stagings"):
        torch.ops.lingc.kda_commit_multi(cslots, accept, [conv_pool], [])
