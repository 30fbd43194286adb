"""KDA (Kimi Delta Attention) decode / verify Triton kernels: short conv, gated delta rule, commit, gated RMSNorm.

Letters as in lingc/ops/kda.py: B batch, T chain positions (1 decode, <= 16 verify), H heads, D head dim,
P = H * D, W conv width, S pool slots, TS staging positions (>= T). Each launcher takes the positional
parameters of its `torch.ops.lingc.*` reference, then keyword-only `pdl`:

    kda_conv(x [B,T,P], weight [P,1,W] fp32, conv_pool [S,P,W-1], slots [B])    -> y [B,T,P]     (pool updated)
    kda_conv_staged(..., staging [B,TS,P,W-1])                                  -> y             (pool read only)
    kda_recurrent(q, k, v, f [B,T,H,D], b [B,T,H], A_log [H], dt_bias [P], state_pool [S,H,D,D] fp32,
                  slots [B], lower_bound)                                       -> o [B,T,H,D]   (pool updated)
    kda_recurrent_staged(..., slots, staging [B,TS,H,D,D] fp32, lower_bound)    -> o             (pool read only)
    kda_commit(pool [S,...], slots [B], staging [B,TS,...], accept_len [B])      -> None: pool[slot] = staging[b, a-1]
    gated_rmsnorm(x [...,D], weight [D], gate [...,D], eps)                     -> [...,D]

and four launch-saving composites (the fuse_kda pass puts them in the graphs; at batch 1 a KDA layer is
launch bound), each bit-identical to the launches it replaces:

    kda_conv_qkv(xq, xk, xv [B,T,P], wq, wk, wv, pool_q, pool_k, pool_v, slots) -> (q, k, v)     (pools updated)
        == three kda_conv; grid (B, cdiv(P, CONV_BLOCK_P), 3), axis 2 picks the conv and its program runs
        kda_conv's program body (`_conv_rows`) on that conv's pointers. Decode's convs in one launch.
    kda_commit_multi(slots, accept_len, pools [1..80], stagings [1..80]) -> None
        == kda_commit(pool_i, slots, staging_i, accept_len) per pair, any trailing shapes and dtypes; grid
        (B, sum_i cdiv(N_i, COMMIT_BLOCK)), a program finds its pair from the cumulative block counts (host
        shapes) and copies one block as kda_commit's program does (`_commit_rows`). The pairs come as tuple
        arguments (COMMIT_MULTI_MAX says why 80). FuseKda.commit_pairs says how many go in one launch: 8 (two
        layers) by default; 72 puts all of Ling-3.0-tiny's 18 layers in one.
    kda_fused_verify(q_raw, k_raw, v_raw [B,T,P], f [B,T,H,D], b [B,T,H], conv_q_w, conv_k_w, conv_v_w [P,1,W] fp32,
                     conv_q_pool, conv_k_pool, conv_v_pool [S,P,W-1], A_log [H], dt_bias [P],
                     state_pool [S,H,D,D] fp32, slots [B], staging_q, staging_k, staging_v [B,TS,P,W-1],
                     staging_state [B,TS,H,D,D] fp32, lower_bound)                        -> o [B,T,H,D]
        == kda_recurrent_staged(kda_conv_staged(q_raw, conv_q_w, conv_q_pool, slots, staging_q).view(B,T,H,D), ...,
                                state_pool, slots, staging_state, lower_bound)  (with k, v likewise), pools read only;
        with the same BLOCK_V / warps it has the separate kernels' bits (tests; the bench checks it on the
        GPU). Each V tile recomputes the q/k convs of its whole head (they are tiny; one program per head
        spills at D = 128) and stages its own slice of the q/k/v windows. The kernel runs in three phases: (1)
        every load an earlier kernel's output feeds, all T positions at once (each conv window is a tuple of
        W - 1 pool entries and T x rows held in registers, so an x row is loaded once, not W times), (2) the
        convs of every position, (3) the recurrence chain. The old
        per-position order put each position's loads behind the previous position's reductions (CTA barriers).
        H200 (bench/results/kernels-kda-ab-h200-20261130.json, same bits as before): T = 6 11.0 us with PDL
        against 14.3 (11.9 vs 15.1 without PDL); the verify step 2.805 ms against 2.890 ms (that run also had
        every position's l2 norms and gates computed before the chain, a variant measured no faster, 11.2 us with
        174 registers against 160, and removed).
    kda_fused_decode(q_raw, ..., state_pool, slots, lower_bound, *, workspace) -> o [B,T,H,D]  (pools updated)
        == kda_recurrent(kda_conv(q_raw, conv_q_w, conv_q_pool, slots).view(B,T,H,D), ..., state_pool, slots,
                         lower_bound)  (with k, v likewise): kda_conv_qkv + kda_recurrent, 1 launch, not 2.
        kda_fused_verify's arguments without the stagings, and its kernel with STAGED off: a V tile writes its
        state slice back to the pool and updates its own v channels' windows (loads, CTA barrier, stores, as
        kda_conv). The head's q/k windows are read by every V tile of the head, so none may update them before
        all have read (no ordering between the CTAs of one launch, and no waiting: that could deadlock). Each
        tile, done reading (after the last position's convs, before its recurrence step), takes a ticket from
        the head's int32 counter (a CTA barrier, then an acq_rel atomic); the tile that draws the last one
        (cdiv(D, BLOCK_V) - 1) updates the head's q/k windows and stores 0 back, so the next launch (or
        CUDA-graph replay) starts from zero (`_update_windows`). Ordering: a tile's window loads precede its
        barrier, the barrier precedes its release; the last ticket's acquire reads the whole chain of
        increments, so every tile's loads happen before the last tile's stores and none can see an updated
        window. No float atomics, the same bits whoever comes last. The counters (`workspace`, >= B*H int32)
        default to one set per device (`device_counters`: zeroed on first use, never resized). H200, B = 1,
        Ling-3.0-tiny shapes (bench/kernel_kda.py, CUDA graph, cold state): 4.4 us with PDL vs 3.9 us for
        kda_conv_qkv + kda_recurrent with PDL (5.2 vs 5.4 without): the ticket's round trip (~0.8 us; 3.6 us
        without it) is on every program's path, so the saved launch does not pay for it there. With the
        three-phase kernel (the ticket right after phase 1's loads): 4.1 us with PDL, 5.1 without.

Recurrence tiling: grid (B*H, cdiv(D, BLOCK_V)); a program keeps its [D, BLOCK_V] fp32 slice of the head's state
(K rows, V columns) in registers across the T positions. Per position it loads the whole q_t, k_t, f_t of its
head (the L2 norms, the K-axis gate and the K-axis dot products need all D) and its BLOCK_V slice of v_t, then
    g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias)), beta = sigmoid(b),
    q = q * rsqrt(sum q^2 + 1e-6) * D^-0.5, k = k * rsqrt(sum k^2 + 1e-6),
    S = exp(g)[:, None] * S;  S = S + k[:, None] * (beta * (v - sum_k(S * k[:, None])))[None, :];
    o = sum_k(S * q[:, None]).
kda_recurrent loads the next position's inputs before the current position is computed (software prefetch), and
the fused kernels load every position's inputs before the chain starts, so the chain pays one input latency, not
T. Decode writes S back to the pool at the end; verify writes each position's S to staging[b, t] and leaves the
pool alone. The conv kernel (grid (B, cdiv(P, CONV_BLOCK_P)))
and the fused kernel take T as a constexpr and unroll the positions' loads and convs (at most 16 variants), so every
position's loads can be issued up front; the fused kernel's recurrence chain is a runtime loop over T (one copy of
its code: unrolled at T = 6 it was 4096 SASS instructions and stalled on instruction fetch), picking position t's
conv outputs from the unrolled phases' registers with exact selects.

Numerics: fp32 inside, outputs rounded once to the activation dtype. Every launch turns fp contraction off
(`enable_fp_fusion=False`) and, on the GPU, uses libdevice expf and IEEE division (PRECISE), as torch's CUDA
elementwise kernels do: the conv (taps summed in the reference's order, j = 0..W-1) is then bit-exact against
the torch reference on the GPU, and the recurrence differs from the einsum reference only through summation
order. The interpreter (no libdevice) uses tl.exp and numpy division instead.

Row invariance: a position's arithmetic does not depend on T or on other positions (in the recurrence T is a
runtime loop bound; Triton's T == 1 specialisation unrolls it but keeps the layouts, checked in the TTGIR; the
conv is elementwise; BLOCK_V / warps are module constants, not functions of T), so position t of a verify
chain has the bits of a decode step from the same state, and staged + commit(a) == a decode steps, bit for
bit. Tunables that change a layout (BLOCK_V, REC_WARPS, NORM_ROWS) must stay the same for T = 1 and T > 1 for
this to hold on the GPU.

Bytes per call (H = 16, D = 128, P = 2048, B = 1, bf16 activations):
    kda_recurrent          state read + write 2 * H*D*D*4 = 2 MiB (1 MiB each way), inputs ~ 4*T*P*2 + weights
    kda_recurrent_staged   state read 1 MiB + staging write T MiB
    kda_commit             read + write H*D*D*4 = 1 MiB each (recurrent), 2*P*(W-1)*2 (a conv window)
    kda_conv(_staged)      x T*P*2, y T*P*2, weight P*W*4, pool/staging windows P*(W-1)*2 (per position staged)
    gated_rmsnorm          x, gate, out T*P*2 each
    kda_conv_qkv, kda_commit_multi, kda_fused_verify, kda_fused_decode: the sums of what they replace (one
                           launch each; kda_fused_decode adds an L2-resident int32 counter per head)

PDL placement (shared/docs/kernels.md section 1.5): with the constexpr PDL on, weights (conv weights, A_log,
dt_bias, norm weight) are loaded before `gdc_wait()`; slots, pools, staging and activations after it;
`gdc_launch_dependents()` follows the last load of data an earlier kernel wrote: after the position loop (each
position's inputs are loaded inside it), and after the in-place conv window update (its loads and stores are
split by a CTA barrier). With PDL off no GDC call is emitted. The composites wait and trigger as the kernels
they replace do (kda_conv_qkv and kda_commit_multi run those kernels' program bodies); kda_fused_decode touches
its counters only after the wait and triggers after the window updates (the last tile loads the q/k windows
after its ticket), before the state write-back, as kda_recurrent.

GPU path: on sm_90+ `kda_fused_decode` and `kda_fused_verify` (default tile and warps) run kernels/kda_gluon.py's
Gluon kernel instead of `_kda_fused_kernel`: the same program with chosen layouts and fast math in the convs and
gates, other bits (a numerics change there, row invariant by construction; that module's docstring). Everything
above describes the Triton kernel, which the interpreter, other GPUs and LINGC_KDA_GLUON=0 run.

One file for the family, past the usual ~400 lines: the composites call the separate kernels' device helpers,
and sharing them is what keeps the composites bit-identical to the kernels they replace.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from lingc.kernels import kda_gluon, workspace
from lingc.kernels.pdl import pdl_launch_next, pdl_supported, pdl_trigger, pdl_wait
import lingc.ops  # noqa: F401  (registers torch.ops.lingc.*, used by the references)
from lingc.ops.kda import COMMIT_MULTI_PAIRS

# Tunables. Recurrence: V columns of S per program and its warps (the same for decode and verify: they set
# the K-axis reduction layout, hence the bits). B*H*cdiv(D, BLOCK_V) programs: 128 at Ling-3.0-tiny B = 1.
BLOCK_V = 16
REC_WARPS = 4
FUSED_WARPS = 4         # kda_fused_verify / kda_fused_decode (same BLOCK_V as the recurrence)
FUSED_COUNTERS = 1 << 12  # kda_fused_decode's per-device ticket counters, one per (batch row, head): 16 KiB
CONV_BLOCK_P = 256      # channels per conv program
MAX_CONV_WIDTH = 4      # the conv taps are spelled out (w0..w3); Ling uses W = 4
CONV_WARPS = 4
COMMIT_BLOCK = 2048     # elements per commit program (1 MiB recurrent state -> 128 programs)
COMMIT_WARPS = 4
# (pool, staging) pairs of one kda_commit_multi launch, passed as tuples: 40 bytes of kernel parameters a pair (two
# pointers, six int32), so 80 pairs (20 KDA layers: Ling-3.0-tiny's 18 in one launch) stay inside the 4 KB that
# every CUDA version allows a launch's parameters. Until 2026-12-05 the kernel had 8 explicit argument sets (two
# layers) and the verify step 9 commit launches; how many go in one launch is fuse_kda's FuseKda.commit_pairs. The
# op's own limit (lingc/ops/kda.py) is this number
COMMIT_MULTI_MAX = COMMIT_MULTI_PAIRS
NORM_ROWS = 4           # gated RMSNorm rows per program (sets the layout: constant, never a function of T)
NORM_WARPS = 4
L2NORM_EPS = tl.constexpr(1e-6)  # fla's l2norm: eps inside the root (lingc.ops.norm.l2norm)


# ---------------------------------------------------------------------------------------------- device helpers

@triton.jit
def _exp(x, PRECISE: tl.constexpr):
    """expf as torch's CUDA kernels compute it (libdevice) on the GPU; tl.exp in the interpreter."""
    if PRECISE:
        y = libdevice.exp(x)
    else:
        y = tl.exp(x)
    return y


@triton.jit
def _sigmoid(x, PRECISE: tl.constexpr):
    """1 / (1 + exp(-x)) with an IEEE division, as torch.sigmoid / F.silu on CUDA."""
    return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + _exp(-x, PRECISE))


@triton.jit
def _in_range(r, n, ALL: tl.constexpr):
    """r < n; a constant all-true mask when ALL (lets the compiler vectorise the masked loads and stores)."""
    if ALL:
        m = tl.full(r.shape, 1, tl.int1)
    else:
        m = r < n
    return m


@triton.jit
def _tap_weight(w_ptr, ch, mask, j: tl.constexpr, W: tl.constexpr):
    """Conv weight column j (fp32 [channels]) of weight [P, 1, W]; zeros for j >= W (unused taps)."""
    if j < W:
        w = tl.load(w_ptr + ch * W + j, mask=mask, other=0.0)
    else:
        w = tl.zeros(ch.shape, tl.float32)
    return w


@triton.jit
def _window_value(pool_row, x_row, s_xt, i, mask, W: tl.constexpr):
    """Element i of the conv window (pool[0 .. W-2], then x[0], x[1], ...) for a vector of channels, x's dtype."""
    in_pool = i < W - 1
    pv = tl.load(pool_row + i, mask=mask & in_pool, other=0.0)
    xv = tl.load(x_row + (i - (W - 1)) * s_xt, mask=mask & (i >= W - 1), other=0.0)
    return tl.where(in_pool, pv.to(xv.dtype), xv)


@triton.jit
def _conv_at(pool_row, x_row, s_xt, t: tl.constexpr, mask, w0, w1, w2, w3, W: tl.constexpr, PRECISE: tl.constexpr):
    """silu(sum_j w_j * window[t + j]) in fp32: _conv_window on the W window values _window_value loads."""
    win = ()
    for j in tl.static_range(W):
        win = win + (_window_value(pool_row, x_row, s_xt, t + j, mask, W),)
    return _conv_window(win, 0, w0, w1, w2, w3, W, PRECISE)


@triton.jit
def _store_window(dst_row, pool_row, x_row, s_xt, start: tl.constexpr, mask, W: tl.constexpr, IN_PLACE: tl.constexpr):
    """dst_row[c] = window[start + c] for c < W-1. All loads come first; IN_PLACE (dst is the pool being read)
    adds a CTA barrier between them and the stores, since a channel may be held by more than one thread."""
    win = ()
    for c in tl.static_range(W - 1):
        win = win + (_window_value(pool_row, x_row, s_xt, start + c, mask, W),)
    if IN_PLACE:
        tl.debug_barrier()
    _put_window(dst_row, win, 0, mask, W)


@triton.jit
def _sum_sq(x, S):
    """sum(x^2) of a [DB] vector as a scalar, summed as a [DB, BV] tile.

    A 1-D sum's order follows the vector's layout, and the compiler lays the 1-D loads of q and k out
    differently in different specialisations (it may rematerialise them in the state's slice layout), so decode
    and verify could round differently. The broadcast tile gets the default blocked layout of its shape and warp
    count instead (checked in the TTGIR: identical for decode, T == 1, and verify), whose K split is the same for
    every column: the columns are equal and their max is the sum exactly."""
    x2 = tl.broadcast_to(x[:, None], S.shape)
    return tl.max(tl.sum(x2 * x2, axis=0), axis=0)


@triton.jit
def _delta_step(S, q, k, v, f, bt, a, dtb, lower_bound, scale, kmask, PRECISE: tl.constexpr):
    """One position of the gated delta rule on a [DB, BV] state slice; returns (S', o [BV] fp32).

    q, k, f [DB] (the whole head), v [BV], bt the scalar b, a = exp(A_log[h]), dtb [DB] fp32 dt_bias."""
    qf = q.to(tl.float32)
    kf = k.to(tl.float32)
    qn = qf * tl.math.rsqrt(_sum_sq(qf, S) + L2NORM_EPS) * scale
    kn = kf * tl.math.rsqrt(_sum_sq(kf, S) + L2NORM_EPS)
    g = lower_bound * _sigmoid(a * (f.to(tl.float32) + dtb), PRECISE)
    decay = tl.where(kmask, _exp(g, PRECISE), 0.0)
    beta = _sigmoid(bt.to(tl.float32), PRECISE)
    S = S * decay[:, None]
    err = beta * (v.to(tl.float32) - tl.sum(S * kn[:, None], axis=0))
    S = S + kn[:, None] * err[None, :]
    o = tl.sum(S * qn[:, None], axis=0)
    return S, o


@triton.jit
def _pick(values, t, T: tl.constexpr):
    """values[t] for a runtime t < T (a tuple of T tensors of one shape): a chain of selects, exact."""
    x = values[0]
    for i in tl.static_range(1, T):
        x = tl.where(t == i, values[i], x)
    return x


@triton.jit
def _pool_window(pool_row, x_row, mask, W: tl.constexpr):
    """The pool part of a conv window: W - 1 vectors pool[i] in x's dtype, read through L2 (`.cg`: the fused
    kernels may load them before their PDL wait, see _kda_fused_kernel)."""
    win = ()
    for i in tl.static_range(W - 1):
        win = win + (tl.load(pool_row + i, mask=mask, other=0.0, cache_modifier=".cg").to(x_row.dtype.element_ty),)
    return win


@triton.jit
def _x_window(x_row, s_xt, mask, T: tl.constexpr):
    """The x part of a conv window: T vectors x[t]. With _pool_window, a conv's whole window for T positions as a
    tuple of W - 1 + T vectors (element i is pool[i] for i < W - 1, then x[i - (W - 1)]: the values _window_value
    loads one at a time)."""
    xs = ()
    for t in tl.static_range(T):
        xs = xs + (tl.load(x_row + t * s_xt, mask=mask, other=0.0),)
    return xs


@triton.jit
def _conv_window(win, t: tl.constexpr, w0, w1, w2, w3, W: tl.constexpr, PRECISE: tl.constexpr):
    """silu(sum_j w_j * win[t + j]) in fp32, taps summed j = 0 .. W-1 one by one, as the reference does; win holds
    the window in registers (_pool_window + _x_window, or _conv_at's W loaded values)."""
    y = win[t].to(tl.float32) * w0
    y = y + win[t + 1].to(tl.float32) * w1
    if W > 2:
        y = y + win[t + 2].to(tl.float32) * w2
    if W > 3:
        y = y + win[t + 3].to(tl.float32) * w3
    return tl.math.div_rn(y, 1.0 + _exp(-y, PRECISE))


@triton.jit
def _put_window(dst_row, win, start: tl.constexpr, mask, W: tl.constexpr):
    """dst_row[c] = win[start + c] for c < W - 1, cast to dst's dtype (win: a window held in registers)."""
    for c in tl.static_range(W - 1):
        tl.store(dst_row + c, win[start + c].to(dst_row.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------- kernels

@triton.jit
def _conv_rows(x_ptr, w_ptr, pool_ptr, slots_ptr, staging_ptr, y_ptr, b, rp,
               P, s_xb, s_xt, s_pool, s_stb, s_stt,
               T: tl.constexpr, W: tl.constexpr, STAGED: tl.constexpr, PRECISE: tl.constexpr, PDL: tl.constexpr):
    """One conv program's work: channels rp of batch row b over the T positions (PDL waits and triggers inside)."""
    pm = rp < P
    w0 = _tap_weight(w_ptr, rp, pm, 0, W)
    w1 = _tap_weight(w_ptr, rp, pm, 1, W)
    w2 = _tap_weight(w_ptr, rp, pm, 2, W)
    w3 = _tap_weight(w_ptr, rp, pm, 3, W)
    if PDL:
        pdl_wait()
    slot = tl.load(slots_ptr + b).to(tl.int64)
    pool_row = pool_ptr + slot * s_pool + rp * (W - 1)                                 # [BLOCK_P] window starts
    x_row = x_ptr + b * s_xb + rp
    for t in tl.static_range(T):                      # unrolled: every position's loads can be issued up front
        y = _conv_at(pool_row, x_row, s_xt, t, pm, w0, w1, w2, w3, W, PRECISE)
        tl.store(y_ptr + (b * T + t) * P + rp, y.to(y_ptr.dtype.element_ty), mask=pm)
        if STAGED:                                                                    # window after position t
            _store_window(staging_ptr + b * s_stb + t * s_stt + rp * (W - 1), pool_row, x_row, s_xt, t + 1, pm,
                          W, False)
    if not STAGED:                                                                    # loads, barrier, stores
        _store_window(pool_row, pool_row, x_row, s_xt, T, pm, W, True)
    if PDL:
        pdl_trigger()


@triton.jit
def _kda_conv_kernel(x_ptr, w_ptr, pool_ptr, slots_ptr, staging_ptr, y_ptr,
                     P, s_xb, s_xt, s_pool, s_stb, s_stt,
                     T: tl.constexpr, W: tl.constexpr, BLOCK_P: tl.constexpr,
                     STAGED: tl.constexpr, PRECISE: tl.constexpr, PDL: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    rp = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    _conv_rows(x_ptr, w_ptr, pool_ptr, slots_ptr, staging_ptr, y_ptr, b, rp, P, s_xb, s_xt, s_pool, s_stb, s_stt,
               T, W, STAGED, PRECISE, PDL)


@triton.jit
def _kda_conv_qkv_kernel(xq_ptr, xk_ptr, xv_ptr, wq_ptr, wk_ptr, wv_ptr, pq_ptr, pk_ptr, pv_ptr, slots_ptr,
                         yq_ptr, yk_ptr, yv_ptr, P, s_qb, s_qt, s_kb, s_kt, s_vb, s_vt, s_pq, s_pk, s_pv,
                         T: tl.constexpr, W: tl.constexpr, BLOCK_P: tl.constexpr,
                         PRECISE: tl.constexpr, PDL: tl.constexpr):
    """Grid axis 2 picks the conv (0 q, 1 k, 2 v); each program is exactly a kda_conv program of that conv."""
    b = tl.program_id(0).to(tl.int64)
    rp = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    which = tl.program_id(2)
    if which == 0:
        _conv_rows(xq_ptr, wq_ptr, pq_ptr, slots_ptr, pq_ptr, yq_ptr, b, rp, P, s_qb, s_qt, s_pq, 0, 0,
                   T, W, False, PRECISE, PDL)
    elif which == 1:
        _conv_rows(xk_ptr, wk_ptr, pk_ptr, slots_ptr, pk_ptr, yk_ptr, b, rp, P, s_kb, s_kt, s_pk, 0, 0,
                   T, W, False, PRECISE, PDL)
    else:
        _conv_rows(xv_ptr, wv_ptr, pv_ptr, slots_ptr, pv_ptr, yv_ptr, b, rp, P, s_vb, s_vt, s_pv, 0, 0,
                   T, W, False, PRECISE, PDL)


@triton.jit
def _kda_recurrent_kernel(q_ptr, k_ptr, v_ptr, f_ptr, b_ptr, a_log_ptr, dt_bias_ptr, pool_ptr, slots_ptr,
                          staging_ptr, o_ptr, T, H,
                          s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_fb, s_ft, s_fh, s_bb, s_bt, s_bh,
                          s_stb, s_stt, scale, lower_bound,
                          D: tl.constexpr, DB: tl.constexpr, BV: tl.constexpr,
                          STAGED: tl.constexpr, PRECISE: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    b = (pid // H).to(tl.int64)
    h = pid % H
    rk = tl.arange(0, DB)
    rv = tl.program_id(1) * BV + tl.arange(0, BV)
    km = _in_range(rk, D, D == DB)
    vm = _in_range(rv, D, D % BV == 0)
    a = _exp(tl.load(a_log_ptr + h).to(tl.float32), PRECISE)
    dtb = tl.load(dt_bias_ptr + h * D + rk, mask=km, other=0.0).to(tl.float32)
    if PDL:
        pdl_wait()
    slot = tl.load(slots_ptr + b).to(tl.int64)
    tile = h * D * D + rk[:, None] * D + rv[None, :]                                   # [DB, BV] in a [H, D, D] state
    tmask = km[:, None] & vm[None, :]
    S = tl.load(pool_ptr + slot * H * D * D + tile, mask=tmask, other=0.0)
    q_row = q_ptr + b * s_qb + h * s_qh + rk
    k_row = k_ptr + b * s_kb + h * s_kh + rk
    v_row = v_ptr + b * s_vb + h * s_vh + rv
    f_row = f_ptr + b * s_fb + h * s_fh + rk
    b_row = b_ptr + b * s_bb + h * s_bh
    q = tl.load(q_row, mask=km, other=0.0)
    k = tl.load(k_row, mask=km, other=0.0)
    v = tl.load(v_row, mask=vm, other=0.0)
    f = tl.load(f_row, mask=km, other=0.0)
    bt = tl.load(b_row)
    for t in range(T):
        nxt = t + 1 < T                                                               # prefetch position t + 1
        q_n = tl.load(q_row + (t + 1) * s_qt, mask=km & nxt, other=0.0)
        k_n = tl.load(k_row + (t + 1) * s_kt, mask=km & nxt, other=0.0)
        v_n = tl.load(v_row + (t + 1) * s_vt, mask=vm & nxt, other=0.0)
        f_n = tl.load(f_row + (t + 1) * s_ft, mask=km & nxt, other=0.0)
        b_n = tl.load(b_row + (t + 1) * s_bt, mask=nxt, other=0.0)
        S, o = _delta_step(S, q, k, v, f, bt, a, dtb, lower_bound, scale, km, PRECISE)
        tl.store(o_ptr + ((b * T + t) * H + h) * D + rv, o.to(o_ptr.dtype.element_ty), mask=vm)
        if STAGED:
            tl.store(staging_ptr + b * s_stb + t * s_stt + tile, S, mask=tmask)
        q, k, v, f, bt = q_n, k_n, v_n, f_n, b_n
    if PDL:
        pdl_trigger()
    if not STAGED:
        tl.store(pool_ptr + slot * H * D * D + tile, S, mask=tmask)


@triton.jit
def _update_windows(cq_row, ck_row, cv_row, qx_row, kx_row, vx_row, s_xt, count_ptr, km, vm,
                    T: tl.constexpr, W: tl.constexpr):
    """kda_fused_decode's in-place conv window update, once this V tile has read every window it reads: a ticket
    from the head's counter, and the tile that draws the last one updates the head's q/k windows (every tile
    reads them) and zeroes the counter; each tile updates its own v channels. Taken before any store of the
    program (at T = 1), so the release has nothing to drain, and before the recurrence, under the state load.
    After the PDL wait: the counter is shared by every kda_fused_decode launch of the device, and the wait is
    what orders this launch's increments after the previous launch's reset."""
    tl.debug_barrier()  # every thread's window loads come before the ticket (release) is taken
    ticket = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    if ticket == tl.num_programs(1) - 1:              # every tile of the head has read the q/k windows
        _store_window(cq_row, cq_row, qx_row, s_xt, T, km, W, True)
        _store_window(ck_row, ck_row, kx_row, s_xt, T, km, W, True)
        tl.store(count_ptr, 0)                                                        # ready for the next launch
    _store_window(cv_row, cv_row, vx_row, s_xt, T, vm, W, True)      # read by no other program: as kda_conv


@triton.jit
def _kda_fused_kernel(qx_ptr, kx_ptr, vx_ptr, f_ptr, b_ptr, wq_ptr, wk_ptr, wv_ptr, cq_ptr, ck_ptr, cv_ptr,
                      a_log_ptr, dt_bias_ptr, pool_ptr, slots_ptr, sq_ptr, sk_ptr, sv_ptr, staging_ptr, count_ptr,
                      o_ptr, H, s_xb, s_xt, s_fb, s_ft, s_fh, s_bb, s_bt, s_bh, s_cpool, s_cstb, s_cstt, s_stb, s_stt,
                      scale, lower_bound,
                      T: tl.constexpr, D: tl.constexpr, DB: tl.constexpr, BV: tl.constexpr, W: tl.constexpr,
                      STAGED: tl.constexpr, PRECISE: tl.constexpr, PDL: tl.constexpr):
    """kda_fused_verify (STAGED: pools read only, per-position staging) or kda_fused_decode (pools updated in
    place; count_ptr holds one int32 ticket counter per (b, h), zero between launches)."""
    pid = tl.program_id(0)
    b = (pid // H).to(tl.int64)
    h = pid % H
    rk = tl.arange(0, DB)
    rv = tl.program_id(1) * BV + tl.arange(0, BV)
    km = _in_range(rk, D, D == DB)
    vm = _in_range(rv, D, D % BV == 0)
    ck = h * D + rk                                                                   # q/k channels of head h
    cv = h * D + rv                                                                   # v channels of this tile
    wq0 = _tap_weight(wq_ptr, ck, km, 0, W)
    wq1 = _tap_weight(wq_ptr, ck, km, 1, W)
    wq2 = _tap_weight(wq_ptr, ck, km, 2, W)
    wq3 = _tap_weight(wq_ptr, ck, km, 3, W)
    wk0 = _tap_weight(wk_ptr, ck, km, 0, W)
    wk1 = _tap_weight(wk_ptr, ck, km, 1, W)
    wk2 = _tap_weight(wk_ptr, ck, km, 2, W)
    wk3 = _tap_weight(wk_ptr, ck, km, 3, W)
    wv0 = _tap_weight(wv_ptr, cv, vm, 0, W)
    wv1 = _tap_weight(wv_ptr, cv, vm, 1, W)
    wv2 = _tap_weight(wv_ptr, cv, vm, 2, W)
    wv3 = _tap_weight(wv_ptr, cv, vm, 3, W)
    a = _exp(tl.load(a_log_ptr + h).to(tl.float32), PRECISE)
    dtb = tl.load(dt_bias_ptr + h * D + rk, mask=km, other=0.0).to(tl.float32)
    # 0. the state slice and the pool windows: under PDL, before the wait. Their
    #    writers (the host's slots; this layer's kda kernels or commits of an earlier step) are at least two
    #    kernels back, and a PDL kernel's programs start only after every program of the kernel before it has
    #    passed its own wait, i.e. after the kernel two back completed (kernels/pdl.py); the pdl pass launches a
    #    fused KDA kernel without PDL where its predecessor writes a pool (passes/pdl.py `_prewait_safe`).
    #    Read through L2 (`.cg`), as L1 is not coherent. The wait then only guards q/k/v/f/b (the projection).
    slot = tl.load(slots_ptr + b, cache_modifier=".cg").to(tl.int64)
    tile = h * D * D + rk[:, None] * D + rv[None, :]
    tmask = km[:, None] & vm[None, :]
    S = tl.load(pool_ptr + slot * H * D * D + tile, mask=tmask, other=0.0, cache_modifier=".cg")
    cq_row = cq_ptr + slot * s_cpool + ck * (W - 1)
    ck_row = ck_ptr + slot * s_cpool + ck * (W - 1)
    cv_row = cv_ptr + slot * s_cpool + cv * (W - 1)
    qx_row = qx_ptr + b * s_xb + ck
    kx_row = kx_ptr + b * s_xb + ck
    vx_row = vx_ptr + b * s_xb + cv
    f_row = f_ptr + b * s_fb + h * s_fh + rk
    b_row = b_ptr + b * s_bb + h * s_bh
    pwin_q = _pool_window(cq_row, qx_row, km, W)
    pwin_k = _pool_window(ck_row, kx_row, km, W)
    pwin_v = _pool_window(cv_row, vx_row, vm, W)
    if PDL:
        pdl_wait()
    # the q/k channels whose staged windows this V tile writes (its own slice; all tiles compute all of them)
    own = km & (rk >= tl.program_id(1) * BV) & (rk < tl.program_id(1) * BV + BV)
    # 1. every load of data the projection wrote, all T positions at once (T is a constexpr: unrolled), so the
    #    chain below pays one load latency, not one per position behind the previous position's reductions
    win_q = pwin_q + _x_window(qx_row, s_xt, km, T)
    win_k = pwin_k + _x_window(kx_row, s_xt, km, T)
    win_v = pwin_v + _x_window(vx_row, s_xt, vm, T)
    fs = ()
    bs = ()
    for t in tl.static_range(T):
        fs = fs + (tl.load(f_row + t * s_ft, mask=km, other=0.0),)
        bs = bs + (tl.load(b_row + t * s_bt),)
    if not STAGED:                                    # every window read: update them while S is still loading
        _update_windows(cq_row, ck_row, cv_row, qx_row, kx_row, vx_row, s_xt, count_ptr + pid, km, vm, T, W)
    if PDL:
        pdl_trigger()
    # 2. the convs of every position (and the staged windows): nothing here waits on the state
    qs = ()
    ks = ()
    vs = ()
    for t in tl.static_range(T):
        qs = qs + (_conv_window(win_q, t, wq0, wq1, wq2, wq3, W, PRECISE).to(qx_ptr.dtype.element_ty),)
        ks = ks + (_conv_window(win_k, t, wk0, wk1, wk2, wk3, W, PRECISE).to(kx_ptr.dtype.element_ty),)
        vs = vs + (_conv_window(win_v, t, wv0, wv1, wv2, wv3, W, PRECISE).to(vx_ptr.dtype.element_ty),)
        if STAGED:
            cst = b * s_cstb + t * s_cstt
            _put_window(sq_ptr + cst + ck * (W - 1), win_q, t + 1, own, W)
            _put_window(sk_ptr + cst + ck * (W - 1), win_k, t + 1, own, W)
            _put_window(sv_ptr + cst + cv * (W - 1), win_v, t + 1, vm, W)
    # 3. the recurrence chain: a loop, not unrolled (one copy of the step's code: unrolled over T = 6 the kernel's
    #    straight-line code stalled on instruction fetch); position t's values are picked from the registers
    for t in range(T):
        S, o = _delta_step(S, _pick(qs, t, T), _pick(ks, t, T), _pick(vs, t, T), _pick(fs, t, T), _pick(bs, t, T),
                           a, dtb, lower_bound, scale, km, PRECISE)
        tl.store(o_ptr + ((b * T + t) * H + h) * D + rv, o.to(o_ptr.dtype.element_ty), mask=vm)
        if STAGED:
            tl.store(staging_ptr + b * s_stb + t * s_stt + tile, S, mask=tmask)
    if not STAGED:
        tl.store(pool_ptr + slot * H * D * D + tile, S, mask=tmask)


@triton.jit
def _commit_rows(pool_ptr, staging_ptr, slot, accept, b, blk, N, TS, s_pool, s_stb, s_stt,
                 BLOCK: tl.constexpr, PDL: tl.constexpr):
    """pool[slot, blk-th BLOCK of the N elements] = staging[b, clamp(accept - 1, 0, TS - 1), same elements]."""
    offs = blk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    pick = tl.minimum(tl.maximum(accept - 1, 0), TS - 1)
    val = tl.load(staging_ptr + b * s_stb + pick * s_stt + offs, mask=m)
    if PDL:
        pdl_trigger()
    tl.store(pool_ptr + slot * s_pool + offs, val.to(pool_ptr.dtype.element_ty), mask=m)


@triton.jit
def _kda_commit_kernel(pool_ptr, slots_ptr, staging_ptr, accept_ptr, N, TS, s_pool, s_stb, s_stt,
                       BLOCK: tl.constexpr, PDL: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    if PDL:
        pdl_wait()
    slot = tl.load(slots_ptr + b).to(tl.int64)
    accept = tl.load(accept_ptr + b).to(tl.int64)
    _commit_rows(pool_ptr, staging_ptr, slot, accept, b, tl.program_id(1), N, TS, s_pool, s_stb, s_stt, BLOCK, PDL)


@triton.jit
def _commit_pair(p_ptr, st_ptr, slot, accept, b, blk, lo, hi, N, TS, s_p, s_stb, s_stt, BLOCK: tl.constexpr,
                 PDL: tl.constexpr):
    """Pair i's share of kda_commit_multi: the programs blk in [lo, hi) commit its blocks."""
    if (blk >= lo) & (blk < hi):
        _commit_rows(p_ptr, st_ptr, slot, accept, b, blk - lo, N, TS, s_p, s_stb, s_stt, BLOCK, PDL)


@triton.jit
def _kda_commit_multi_kernel(slots_ptr, accept_ptr, pools, stagings, Ns, TSs, s_ps, s_stbs, s_stts, ends,
                             PAIRS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Grid axis 1 runs over the pairs' blocks back to back: pair i owns [ends[i-1], ends[i]) (ends[-1] = 0). The
    pairs come as tuples (pools[i], stagings[i], their sizes and strides), one unrolled copy of the test a pair;
    a program copies the block of the one pair it falls in."""
    b = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    if PDL:
        pdl_wait()
    slot = tl.load(slots_ptr + b).to(tl.int64)
    accept = tl.load(accept_ptr + b).to(tl.int64)
    lo = 0
    for i in tl.static_range(PAIRS):
        _commit_pair(pools[i], stagings[i], slot, accept, b, blk, lo, ends[i], Ns[i], TSs[i], s_ps[i], s_stbs[i],
                     s_stts[i], BLOCK, PDL)
        lo = ends[i]


@triton.jit
def _gated_rmsnorm_kernel(x_ptr, w_ptr, g_ptr, out_ptr, R, N, s_xm, s_xh, s_gm, s_gh, inv_n, eps,
                          HR: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, PRECISE: tl.constexpr,
                          PDL: tl.constexpr, ENTRY_TRIGGER: tl.constexpr):
    # HR (heads per token) is a constexpr: the row split below is then shifts and masks, not a 64-bit division
    if PDL:
        if ENTRY_TRIGGER:   # the next launch (o_proj) reads only weights before its wait (kernels/pdl.py)
            pdl_launch_next()
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)               # row = m * HR + h
    cols = tl.arange(0, BLOCK_N)
    cm = cols < N
    m = (rows < R)[:, None] & cm[None, :]
    x_off = (rows // HR) * s_xm + (rows % HR) * s_xh
    g_off = (rows // HR) * s_gm + (rows % HR) * s_gh
    w = tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    if PDL:
        pdl_wait()
    x = tl.load(x_ptr + x_off[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + g_off[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
    if PDL:
        pdl_trigger()
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) * inv_n + eps)       # mean as torch: sum * (1/N)
    out = x * rstd[:, None] * w[None, :] * _sigmoid(g, PRECISE)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=m)


# ---------------------------------------------------------------------------------------------- launchers

def _launch_opts(pdl: bool, num_warps: int) -> dict:
    opts = {"num_warps": num_warps, "enable_fp_fusion": False}
    if pdl:
        opts["launch_pdl"] = True
    return opts


def _precise(device: torch.device) -> bool:
    """libdevice expf needs the compiled GPU path; the interpreter cannot run extern calls."""
    return device.type == "cuda" and not triton.knobs.runtime.interpret


def _fail(op: str, msg: str) -> None:
    raise ValueError(f"{op}: {msg}")


def _check_slots(op: str, slots: torch.Tensor, B: int) -> None:
    if slots.shape != (B,) or slots.dtype not in (torch.int32, torch.int64):
        _fail(op, f"slots is {list(slots.shape)} {slots.dtype}, want [{B}] int32/int64")


def _inner(t: torch.Tensor) -> torch.Tensor:
    """t with a unit-stride last dim (copied only if it has none)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_conv(op: str, x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor,
                staging: torch.Tensor | None) -> tuple[int, int, int, int]:
    if x.dim() != 3 or not x.is_floating_point():
        _fail(op, f"x is {list(x.shape)} {x.dtype}, want a float [B, T, P]")
    B, T, P = x.shape
    if weight.dim() != 3 or weight.shape[:2] != (P, 1) or not 2 <= weight.shape[2] <= MAX_CONV_WIDTH \
            or weight.dtype != torch.float32:
        _fail(op, f"weight is {list(weight.shape)} {weight.dtype}, want [{P}, 1, W] float32 with 2 <= W <= "
                  f"{MAX_CONV_WIDTH}")
    W = weight.shape[2]
    if conv_pool.dim() != 3 or conv_pool.shape[1:] != (P, W - 1) or not conv_pool.is_contiguous():
        _fail(op, f"conv_pool is {list(conv_pool.shape)}, want a contiguous [S, {P}, {W - 1}]")
    _check_slots(op, slots, B)
    if staging is not None and (staging.dim() != 4 or staging.shape[0] != B or staging.shape[1] < T
                                or staging.shape[2:] != (P, W - 1) or not staging.is_contiguous()):
        _fail(op, f"staging is {list(staging.shape)}, want a contiguous [{B}, >= {T}, {P}, {W - 1}]")
    return B, T, P, W


def _conv(op: str, x, weight, conv_pool, slots, staging, pdl: bool) -> torch.Tensor:
    B, T, P, W = _check_conv(op, x, weight, conv_pool, slots, staging)
    x = _inner(x)
    y = torch.empty((B, T, P), dtype=x.dtype, device=x.device)
    if B * T == 0:
        return y
    pdl = pdl and pdl_supported(x.device)
    st = staging if staging is not None else conv_pool
    grid = (B, triton.cdiv(P, CONV_BLOCK_P))
    _kda_conv_kernel[grid](x, weight, conv_pool, slots, st, y, P, x.stride(0), x.stride(1), conv_pool.stride(0),
                           st.stride(0), st.stride(1) if staging is not None else 0, T=T,
                           W=W,
                           BLOCK_P=CONV_BLOCK_P, STAGED=staging is not None, PRECISE=_precise(x.device), PDL=pdl,
                           **_launch_opts(pdl, CONV_WARPS))
    return y


def kda_conv(x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor, *,
             pdl: bool = False) -> torch.Tensor:
    """silu(causal depthwise conv) over x [B, T, P] continuing conv_pool[slots]; updates the pool (lingc.kda_conv)."""
    return _conv("kda_conv", x, weight, conv_pool, slots, None, pdl)


def kda_conv_staged(x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor,
                    staging: torch.Tensor, *, pdl: bool = False) -> torch.Tensor:
    """kda_conv for a verify chain: the pool is read only, the window after position t goes to staging[b, t]."""
    return _conv("kda_conv_staged", x, weight, conv_pool, slots, staging, pdl)


def kda_conv_qkv(xq: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor,
                 wv: torch.Tensor, pool_q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor,
                 slots: torch.Tensor, *, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three kda_conv (q, k, v; pools updated) in one launch (lingc.kda_conv_qkv): grid axis 2 picks the conv,
    each program runs kda_conv's program body, so every output and window has kda_conv's bits."""
    op = "kda_conv_qkv"
    dims = [_check_conv(op, x, w, p, slots, None) for x, w, p in ((xq, wq, pool_q), (xk, wk, pool_k), (xv, wv, pool_v))]
    if len(set(dims)) != 1:
        _fail(op, f"the three convs have [B, T, P, W] {dims}, want one shape")
    B, T, P, W = dims[0]
    xq, xk, xv = (_inner(x) for x in (xq, xk, xv))
    ys = tuple(torch.empty((B, T, P), dtype=x.dtype, device=x.device) for x in (xq, xk, xv))
    if B * T == 0:
        return ys
    pdl = pdl and pdl_supported(xq.device)
    _kda_conv_qkv_kernel[(B, triton.cdiv(P, CONV_BLOCK_P), 3)](
        xq, xk, xv, wq, wk, wv, pool_q, pool_k, pool_v, slots, *ys, P,
        xq.stride(0), xq.stride(1), xk.stride(0), xk.stride(1), xv.stride(0), xv.stride(1),
        pool_q.stride(0), pool_k.stride(0), pool_v.stride(0), T=T, W=W, BLOCK_P=CONV_BLOCK_P,
        PRECISE=_precise(xq.device), PDL=pdl, **_launch_opts(pdl, CONV_WARPS))
    return ys


def _check_recurrent(op: str, q, k, v, f, b, A_log, dt_bias, state_pool, slots, staging) -> tuple[int, ...]:
    if q.dim() != 4 or not q.is_floating_point():
        _fail(op, f"q is {list(q.shape)} {q.dtype}, want a float [B, T, H, D]")
    B, T, H, D = q.shape
    for name, t in (("k", k), ("v", v), ("f", f)):
        if t.shape != q.shape or not t.is_floating_point():
            _fail(op, f"{name} is {list(t.shape)} {t.dtype}, want float {list(q.shape)} (as q)")
    if b.shape != (B, T, H):
        _fail(op, f"b is {list(b.shape)}, want [{B}, {T}, {H}]")
    if A_log.shape != (H,) or dt_bias.numel() != H * D or not dt_bias.is_contiguous():
        _fail(op, f"A_log is {list(A_log.shape)}, dt_bias {list(dt_bias.shape)}; want [{H}] and contiguous [{H * D}]")
    if state_pool.dim() != 4 or state_pool.shape[1:] != (H, D, D) or state_pool.dtype != torch.float32 \
            or not state_pool.is_contiguous():
        _fail(op, f"state_pool is {list(state_pool.shape)} {state_pool.dtype}, "
                  f"want contiguous [S, {H}, {D}, {D}] float32")
    _check_slots(op, slots, B)
    if staging is not None and (staging.dim() != 5 or staging.shape[0] != B or staging.shape[1] < T
                                or staging.shape[2:] != (H, D, D) or staging.dtype != torch.float32
                                or not staging.is_contiguous()):
        _fail(op, f"staging is {list(staging.shape)} {staging.dtype}, "
                  f"want contiguous [{B}, >= {T}, {H}, {D}, {D}] float32")
    return B, T, H, D


def _recurrent(op: str, q, k, v, f, b, A_log, dt_bias, state_pool, slots, staging, lower_bound: float,
               pdl: bool, block_v: int | None, num_warps: int | None) -> torch.Tensor:
    B, T, H, D = _check_recurrent(op, q, k, v, f, b, A_log, dt_bias, state_pool, slots, staging)
    q, k, v, f = (_inner(t) for t in (q, k, v, f))
    o = torch.empty((B, T, H, D), dtype=q.dtype, device=q.device)
    if B * T == 0:
        return o
    pdl = pdl and pdl_supported(q.device)
    db = triton.next_power_of_2(D)
    bv = min(block_v or BLOCK_V, db)
    st = staging if staging is not None else state_pool
    grid = (B * H, triton.cdiv(D, bv))
    _kda_recurrent_kernel[grid](
        q, k, v, f, b, A_log, dt_bias, state_pool, slots, st, o, T, H,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *f.stride()[:3], *b.stride(),
        st.stride(0), st.stride(1) if staging is not None else 0, D ** -0.5, lower_bound,
        D=D, DB=db, BV=bv, STAGED=staging is not None, PRECISE=_precise(q.device), PDL=pdl,
        **_launch_opts(pdl, num_warps or REC_WARPS))
    return o


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
                  A_log: torch.Tensor, dt_bias: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor,
                  lower_bound: float, *, pdl: bool = False, block_v: int | None = None,
                  num_warps: int | None = None) -> torch.Tensor:
    """Gated delta rule over T positions from and into state_pool[slots] (lingc.kda_recurrent).

    block_v / num_warps override the tunables (benchmark sweeps only: they change the bits)."""
    return _recurrent("kda_recurrent", q, k, v, f, b, A_log, dt_bias, state_pool, slots, None, lower_bound,
                      pdl, block_v, num_warps)


def kda_recurrent_staged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
                         A_log: torch.Tensor, dt_bias: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor,
                         staging: torch.Tensor, lower_bound: float, *, pdl: bool = False,
                         block_v: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """kda_recurrent for a verify chain: the pool is read only, the state after position t goes to staging[b, t]."""
    return _recurrent("kda_recurrent_staged", q, k, v, f, b, A_log, dt_bias, state_pool, slots, staging,
                      lower_bound, pdl, block_v, num_warps)


def _check_commit(op: str, pool: torch.Tensor, slots: torch.Tensor, staging: torch.Tensor,
                  accept_len: torch.Tensor, name: str = "") -> tuple[int, int]:
    """(B, N elements per slot) of a (pool, staging) pair; `name` tells pairs apart in errors ('1: ')."""
    B = staging.shape[0] if staging.dim() >= 2 else -1
    if staging.dim() < 2 or staging.shape[2:] != pool.shape[1:]:
        _fail(op, f"{name}staging is {list(staging.shape)}, want [B, TS, {', '.join(map(str, pool.shape[1:]))}] "
                  f"(pool {list(pool.shape)})")
    if not pool.is_contiguous() or not staging.is_contiguous():
        _fail(op, f"{name}pool and staging must be contiguous")
    _check_slots(op, slots, B)
    if accept_len.shape != (B,) or accept_len.dtype not in (torch.int32, torch.int64):
        _fail(op, f"accept_len is {list(accept_len.shape)} {accept_len.dtype}, want [{B}] int32/int64")
    return B, math.prod(pool.shape[1:])


def kda_commit(pool: torch.Tensor, slots: torch.Tensor, staging: torch.Tensor, accept_len: torch.Tensor, *,
               pdl: bool = False, block: int | None = None, num_warps: int | None = None) -> None:
    """pool[slots[b]] = staging[b, clamp(accept_len[b] - 1, 0, TS - 1)] (lingc.kda_commit); any trailing shape."""
    B, N = _check_commit("kda_commit", pool, slots, staging, accept_len)
    if B == 0 or N == 0 or staging.shape[1] == 0:
        return None
    pdl = pdl and pdl_supported(pool.device)
    blk = block or COMMIT_BLOCK
    _kda_commit_kernel[(B, triton.cdiv(N, blk))](pool, slots, staging, accept_len, N, staging.shape[1],
                                                 pool.stride(0), staging.stride(0), staging.stride(1),
                                                 BLOCK=blk, PDL=pdl, **_launch_opts(pdl, num_warps or COMMIT_WARPS))
    return None


def kda_commit_multi(slots: torch.Tensor, accept_len: torch.Tensor, pools: list[torch.Tensor],
                     stagings: list[torch.Tensor], *, pdl: bool = False, block: int | None = None,
                     num_warps: int | None = None) -> None:
    """kda_commit of up to COMMIT_MULTI_MAX (pool, staging) pairs sharing slots and accept_len, in one launch
    (lingc.kda_commit_multi). Grid (B, the pairs' blocks end to end): each program copies one block of one pair
    exactly as a kda_commit program would, so the pools get kda_commit's bits."""
    op = "kda_commit_multi"
    pools, stagings = list(pools), list(stagings)
    if not 1 <= len(pools) <= COMMIT_MULTI_MAX:
        _fail(op, f"want 1 to {COMMIT_MULTI_MAX} (pool, staging) pairs, got {len(pools)} pools")
    if len(stagings) != len(pools) or any(t is None for t in pools + stagings):
        _fail(op, f"every pool needs its staging and every staging its pool ({len(pools)} pools, "
                  f"{len(stagings)} stagings)")
    pairs = list(zip(pools, stagings))
    blk = block or COMMIT_BLOCK
    sets, total = [], 0
    for i, (pool, staging) in enumerate(pairs):
        B, N = _check_commit(op, pool, slots, staging, accept_len, f"pair {i}: ")    # B == len(slots) for all
        TS = staging.shape[1]
        total += triton.cdiv(N, blk) if N and TS else 0           # an empty pair owns no blocks
        sets.append((pool, staging, N, TS, pool.stride(0), staging.stride(0), staging.stride(1), total))
    if B == 0 or total == 0:
        return None
    pdl = pdl and pdl_supported(pairs[0][0].device)
    _kda_commit_multi_kernel[(B, total)](slots, accept_len, *(tuple(column) for column in zip(*sets)),
                                         PAIRS=len(pairs), BLOCK=blk, PDL=pdl,
                                         **_launch_opts(pdl, num_warps or COMMIT_WARPS))
    return None


def _rows3(t: torch.Tensor, N: int) -> torch.Tensor:
    """t [..., HR, N] as [M, HR, N] with a unit-stride last dim: a view for the head views of a fused projection
    ([B, T, H, D] slices of [B, T, 5P + H], whose rows are not evenly strided), copied only if it cannot be."""
    t3 = t.reshape(-1, t.shape[-2], N) if t.dim() >= 2 else t.reshape(1, 1, N)
    return t3 if t3.stride(-1) == 1 else t3.contiguous()


def gated_rmsnorm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float, *,
                  pdl: bool = False, entry_trigger: bool = False) -> torch.Tensor:
    """rmsnorm(x) * weight * sigmoid(gate) over the last dim in fp32, cast to x.dtype (lingc.gated_rmsnorm).
    entry_trigger (a launch hint, PDL only): let the next kernel launch at entry (kernels/pdl.py)."""
    op = "gated_rmsnorm"
    N = x.shape[-1]
    if weight.shape != (N,) or gate.shape != x.shape:
        _fail(op, f"x is {list(x.shape)}, weight {list(weight.shape)}, gate {list(gate.shape)}; "
                  f"want weight [{N}] and gate like x")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x3, g3 = _rows3(x, N), _rows3(gate, N)                                           # [M, HR, N]
    R = x3.shape[0] * x3.shape[1]
    if R == 0:
        return out
    pdl = pdl and pdl_supported(x.device)
    _gated_rmsnorm_kernel[(triton.cdiv(R, NORM_ROWS),)](
        x3, weight, g3, out, R, N, x3.stride(0), x3.stride(1), g3.stride(0), g3.stride(1), 1.0 / N, eps,
        HR=x3.shape[1], ROWS=NORM_ROWS, BLOCK_N=triton.next_power_of_2(N), PRECISE=_precise(x.device), PDL=pdl,
        ENTRY_TRIGGER=pdl and entry_trigger, **_launch_opts(pdl, NORM_WARPS))
    return out


def device_counters(device: torch.device | str) -> torch.Tensor:
    """kda_fused_decode's default ticket counters on a device (int32 [FUSED_COUNTERS], kernels/workspace.py):
    zeroed on first use and kept; every launch leaves them zero."""
    return workspace.counters(device, "kda_fused_decode", FUSED_COUNTERS)


def _fused(op: str, raw: tuple, f, b, ws: tuple, pools: tuple, A_log, dt_bias, state_pool, slots,
           stagings: tuple | None, counters: torch.Tensor | None, lower_bound: float, pdl: bool,
           block_v: int | None, num_warps: int | None) -> torch.Tensor:
    """Check and launch _kda_fused_kernel: staged (stagings = q, k, v windows and the state) or in place
    (stagings None; counters: int32 ticket counters, >= B * H of them, zero)."""
    if f.dim() != 4:
        _fail(op, f"f is {list(f.shape)}, want [B, T, H, D]")
    B, T, H, D = f.shape
    q_raw, conv_q_w, conv_q_pool = raw[0], ws[0], pools[0]
    conv_st = stagings[:3] if stagings is not None else (None, None, None)
    for name, x, w, pool, st in zip("qkv", raw, ws, pools, conv_st):
        if x.shape != (B, T, H * D) or x.stride() != q_raw.stride() or x.dtype != q_raw.dtype:
            _fail(op, f"{name}_raw is {list(x.shape)} {x.dtype} {x.stride()}, want [{B}, {T}, {H * D}] "
                      f"with q_raw's dtype and strides")
        _check_conv(op, x, w, pool, slots, st)
        if w.shape != conv_q_w.shape or pool.shape != conv_q_pool.shape \
                or (st is not None and st.shape != conv_st[0].shape):
            _fail(op, "the three convs need one weight, pool and staging shape" if st is not None
                  else "the three convs need one weight and pool shape")
    _check_recurrent(op, f, f, f, f, b, A_log, dt_bias, state_pool, slots,
                     stagings[3] if stagings is not None else None)
    if q_raw.stride(-1) != 1 or f.stride(-1) != 1:
        _fail(op, "q_raw, k_raw, v_raw and f need a unit-stride last dim")
    if stagings is None:
        counters = counters if counters is not None else device_counters(q_raw.device)
        if counters.dtype != torch.int32 or not counters.is_contiguous() or counters.numel() < B * H \
                or counters.device != q_raw.device:
            _fail(op, f"workspace holds {counters.numel()} {counters.dtype} counters on {counters.device}, want a "
                      f"contiguous int32 one with >= {B * H} (batch rows x heads) on {q_raw.device}")
    o = torch.empty((B, T, H, D), dtype=q_raw.dtype, device=q_raw.device)
    if B * T == 0:
        return o
    pdl = pdl and pdl_supported(q_raw.device)
    db = triton.next_power_of_2(D)
    bv = min(block_v or BLOCK_V, db)
    if stagings is not None:                   # slots stands in for the counters: STAGED never touches them
        st, count = stagings, slots
        st_strides = (st[0].stride(0), st[0].stride(1), st[3].stride(0), st[3].stride(1))
    else:                                      # the pools stand in for the stagings: never written as such
        st, count, st_strides = (*pools, state_pool), counters, (0, 0, 0, 0)
    args = (*raw, f, b, *ws, *pools, A_log, dt_bias, state_pool, slots, *st, count, o,
            H, q_raw.stride(0), q_raw.stride(1), *f.stride()[:3], *b.stride(), conv_q_pool.stride(0), *st_strides,
            D ** -0.5, lower_bound)
    if block_v is None and num_warps is None and kda_gluon.eligible(q_raw.device, D, conv_q_w.shape[2], T) \
            and kda_gluon.launch(args, B, H, T, stagings is not None, pdl):
        return o
    _kda_fused_kernel[(B * H, triton.cdiv(D, bv))](
        *args, T=T, D=D, DB=db, BV=bv, W=conv_q_w.shape[2], STAGED=stagings is not None, PRECISE=_precise(q_raw.device),
        PDL=pdl, **_launch_opts(pdl, num_warps or FUSED_WARPS))
    return o


def kda_fused_decode(q_raw: torch.Tensor, k_raw: torch.Tensor, v_raw: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
                     conv_q_w: torch.Tensor, conv_k_w: torch.Tensor, conv_v_w: torch.Tensor,
                     conv_q_pool: torch.Tensor, conv_k_pool: torch.Tensor, conv_v_pool: torch.Tensor,
                     A_log: torch.Tensor, dt_bias: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor,
                     lower_bound: float, *, pdl: bool = False, workspace: torch.Tensor | None = None,
                     block_v: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """Three in-place convs + the recurrence in one launch (see the module docstring); every pool updated.

    workspace: int32 ticket counters, >= B * H, zero (default: the device's, device_counters); each launch leaves
    them zero. block_v / num_warps override BLOCK_V / FUSED_WARPS (benchmark sweeps only)."""
    return _fused("kda_fused_decode", (q_raw, k_raw, v_raw), f, b, (conv_q_w, conv_k_w, conv_v_w),
                  (conv_q_pool, conv_k_pool, conv_v_pool), A_log, dt_bias, state_pool, slots, None, workspace,
                  lower_bound, pdl, block_v, num_warps)


def kda_fused_verify(q_raw: torch.Tensor, k_raw: torch.Tensor, v_raw: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
                     conv_q_w: torch.Tensor, conv_k_w: torch.Tensor, conv_v_w: torch.Tensor,
                     conv_q_pool: torch.Tensor, conv_k_pool: torch.Tensor, conv_v_pool: torch.Tensor,
                     A_log: torch.Tensor, dt_bias: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor,
                     staging_q: torch.Tensor, staging_k: torch.Tensor, staging_v: torch.Tensor,
                     staging_state: torch.Tensor, lower_bound: float, *, pdl: bool = False,
                     block_v: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """Three staged convs + staged recurrence in one launch (see the module docstring); all pools read only.

    block_v / num_warps override BLOCK_V / FUSED_WARPS (benchmark sweeps only)."""
    return _fused("kda_fused_verify", (q_raw, k_raw, v_raw), f, b, (conv_q_w, conv_k_w, conv_v_w),
                  (conv_q_pool, conv_k_pool, conv_v_pool), A_log, dt_bias, state_pool, slots,
                  (staging_q, staging_k, staging_v, staging_state), None, lower_bound, pdl, block_v, num_warps)


# ---------------------------------------------------------------------------------------------- references

def kda_conv_ref(x, weight, conv_pool, slots):
    return torch.ops.lingc.kda_conv(x, weight, conv_pool, slots)


def kda_conv_staged_ref(x, weight, conv_pool, slots, staging):
    return torch.ops.lingc.kda_conv_staged(x, weight, conv_pool, slots, staging)


def kda_recurrent_ref(q, k, v, f, b, A_log, dt_bias, state_pool, slots, lower_bound):
    return torch.ops.lingc.kda_recurrent(q, k, v, f, b, A_log, dt_bias, state_pool, slots, lower_bound)


def kda_recurrent_staged_ref(q, k, v, f, b, A_log, dt_bias, state_pool, slots, staging, lower_bound):
    return torch.ops.lingc.kda_recurrent_staged(q, k, v, f, b, A_log, dt_bias, state_pool, slots, staging, lower_bound)


def kda_commit_ref(pool, slots, staging, accept_len):
    return torch.ops.lingc.kda_commit(pool, slots, staging, accept_len)


def kda_conv_qkv_ref(xq, xk, xv, wq, wk, wv, pool_q, pool_k, pool_v, slots):
    """The lingc op, whose reference is three kda_conv calls."""
    return torch.ops.lingc.kda_conv_qkv(xq, xk, xv, wq, wk, wv, pool_q, pool_k, pool_v, slots)


def kda_commit_multi_ref(slots, accept_len, pools, stagings):
    """The lingc op, whose reference is one kda_commit per (pool, staging) pair."""
    return torch.ops.lingc.kda_commit_multi(slots, accept_len, list(pools), list(stagings))


def gated_rmsnorm_ref(x, weight, gate, eps):
    return torch.ops.lingc.gated_rmsnorm(x, weight, gate, eps)


def kda_fused_decode_ref(q_raw, k_raw, v_raw, f, b, conv_q_w, conv_k_w, conv_v_w, conv_q_pool, conv_k_pool,
                         conv_v_pool, A_log, dt_bias, state_pool, slots, lower_bound):
    """The lingc op, whose reference is what it replaces: three in-place convs, then the recurrence."""
    return torch.ops.lingc.kda_fused_decode(q_raw, k_raw, v_raw, f, b, conv_q_w, conv_k_w, conv_v_w, conv_q_pool,
                                            conv_k_pool, conv_v_pool, A_log, dt_bias, state_pool, slots, lower_bound)


def kda_fused_verify_ref(q_raw, k_raw, v_raw, f, b, conv_q_w, conv_k_w, conv_v_w, conv_q_pool, conv_k_pool,
                         conv_v_pool, A_log, dt_bias, state_pool, slots, staging_q, staging_k, staging_v,
                         staging_state, lower_bound):
    """The lingc op, whose reference is what it replaces: three staged convs, then the staged recurrence."""
    return torch.ops.lingc.kda_fused_verify(q_raw, k_raw, v_raw, f, b, conv_q_w, conv_k_w, conv_v_w, conv_q_pool,
                                            conv_k_pool, conv_v_pool, A_log, dt_bias, state_pool, slots, staging_q,
                                            staging_k, staging_v, staging_state, lower_bound)


LOWERINGS: dict[str, Callable] = {
    "kda_conv": kda_conv,
    "kda_conv_staged": kda_conv_staged,
    "kda_recurrent": kda_recurrent,
    "kda_recurrent_staged": kda_recurrent_staged,
    "kda_commit": kda_commit,
    "gated_rmsnorm": gated_rmsnorm,
    "kda_conv_qkv": kda_conv_qkv,
    "kda_fused_verify": kda_fused_verify,
    "kda_fused_decode": kda_fused_decode,
    "kda_commit_multi": kda_commit_multi,
}
