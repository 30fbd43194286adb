"""KDA (Kimi Delta Attention) ops: the short causal conv with its state, and the gated delta rule.

Letters: B batch, T tokens, H heads, D head dim (K = V = D), P = H * D, W conv width (4).
`kda_recurrent` runs the recurrence token by token (decode); `kda_chunk` is the chunked form
(prefill). Both take the raw projections and do the safe gate, beta, q/k L2 norm and scale inside,
in fp32, and update the request's fp32 state in a pool [S, H, D, D] ([heads, K, V]) picked by
`slots` [B]. Under speculation (techniques.md section 10) `kda_conv_staged` / `kda_recurrent_staged`
leave the pools alone and write each chain position's post-state to a staging buffer, and
`kda_commit` copies the last accepted one into the pool. Launch-saving composites (the fuse_kda pass):
`kda_conv_qkv` (a layer's three in-place convs), `kda_fused_decode` (three in-place convs + the recurrence),
`kda_fused_verify` (three staged convs + the staged recurrence) and `kda_commit_multi` (a layer's commits);
each reference is the composite it replaces.
(shared/docs/architecture.md section 4; fla `naive_recurrent_kda` / `naive_chunk_kda`.)
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from lingc.ops.linear import ROW_INVARIANT_ROWS
from lingc.ops.norm import l2norm
from lingc.ops.registry import register

CHUNK = 64


def _conv_taps(window: torch.Tensor, weight: torch.Tensor, T: int) -> torch.Tensor:
    """y[:, :, t] = sum_j w[:, j] * window[:, :, t + j] in fp32, tap by tap.

    Written as explicit taps rather than conv1d so every output element is computed the same way
    whatever T is: a verify chain then gives decode's bits, position by position.
    """
    width = weight.shape[-1]
    w = weight.float().view(weight.shape[0], width)                                  # [P, W]
    win = window.float()
    y = win[..., 0:T] * w[:, 0:1]
    for j in range(1, width):
        y = y + win[..., j:j + T] * w[:, j:j + 1]
    return y                                                                         # [B, P, T]


@torch.library.custom_op("lingc::kda_conv", mutates_args=("conv_pool",))
def kda_conv(x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """silu(depthwise causal conv) over time, continuing from each request's conv window; updates the window.

    x [B, T, P] projections (pre-conv), weight [P, 1, W] fp32, conv_pool [S, P, W-1] holding per request
    slot the last W-1 pre-conv inputs (oldest first), slots [B] int32. Returns [B, T, P] in x.dtype.
    """
    width, T = weight.shape[-1], x.shape[1]
    idx = slots.long()
    window = torch.cat([conv_pool[idx].to(x.dtype), x.transpose(1, 2)], dim=-1)   # [B, P, W-1+T]
    y = _conv_taps(window, weight, T)
    conv_pool[idx] = window[..., T:].to(conv_pool.dtype)
    return F.silu(y).transpose(1, 2).to(x.dtype).contiguous()


@kda_conv.register_fake
def _(x, weight, conv_pool, slots):
    return x.new_empty(x.shape)


register("kda_conv")


@torch.library.custom_op("lingc::kda_conv_staged", mutates_args=("staging",))
def kda_conv_staged(x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor,
                    staging: torch.Tensor) -> torch.Tensor:
    """kda_conv for a verify chain: the pool is only read; the window after each position t goes to
    staging[b, t] ([B, T, P, W-1]) for kda_commit to keep the accepted one."""
    width, T = weight.shape[-1], x.shape[1]
    window = torch.cat([conv_pool[slots.long()].to(x.dtype), x.transpose(1, 2)], dim=-1)
    y = _conv_taps(window, weight, T)
    for t in range(T):
        staging[:, t] = window[..., t + 1:t + width].to(staging.dtype)
    return F.silu(y).transpose(1, 2).to(x.dtype).contiguous()


@kda_conv_staged.register_fake
def _(x, weight, conv_pool, slots, staging):
    return x.new_empty(x.shape)


register("kda_conv_staged")


@torch.library.custom_op("lingc::kda_conv_qkv", mutates_args=("pool_q", "pool_k", "pool_v"))
def kda_conv_qkv(xq: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor,
                 wv: torch.Tensor, pool_q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor,
                 slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A KDA layer's three in-place convs in one op: (kda_conv(xq, wq, pool_q, slots), ... k, ... v)."""
    return (kda_conv(xq, wq, pool_q, slots), kda_conv(xk, wk, pool_k, slots), kda_conv(xv, wv, pool_v, slots))


@kda_conv_qkv.register_fake
def _(xq, xk, xv, wq, wk, wv, pool_q, pool_k, pool_v, slots):
    return xq.new_empty(xq.shape), xk.new_empty(xk.shape), xv.new_empty(xv.shape)


register("kda_conv_qkv")


@torch.library.custom_op("lingc::kda_commit", mutates_args=("pool",))
def kda_commit(pool: torch.Tensor, slots: torch.Tensor, staging: torch.Tensor, accept_len: torch.Tensor) -> None:
    """pool[slots[b]] = staging[b, accept_len[b] - 1]: keep the state after the last accepted chain position.

    pool [S, ...], staging [B, T, ...], accept_len [B] (1..T). Works for conv windows and recurrent states.
    """
    B = staging.shape[0]
    pick = (accept_len.long() - 1).clamp(0, staging.shape[1] - 1)
    pool[slots.long()] = staging[torch.arange(B, device=staging.device), pick].to(pool.dtype)


@kda_commit.register_fake
def _(pool, slots, staging, accept_len):
    return None


register("kda_commit")


# most (pool, staging) pairs of one kda_commit_multi; why 80: kernels/kda.py COMMIT_MULTI_MAX (its launch parameters)
COMMIT_MULTI_PAIRS = 80


# pools / stagings are lists, not optional pool0..pool7 arguments: torch 2.11's custom-op wrapper drops trailing
# arguments equal to their default (None) and then indexes every mutated one, so an optional mutated pool fails
@torch.library.custom_op("lingc::kda_commit_multi", mutates_args=("pools",))
def kda_commit_multi(slots: torch.Tensor, accept_len: torch.Tensor, pools: list[torch.Tensor],
                     stagings: list[torch.Tensor]) -> None:
    """kda_commit(pools[i], slots, stagings[i], accept_len) for 1 to COMMIT_MULTI_PAIRS (pool, staging) pairs of any
    trailing shapes and dtypes (one or more layers' conv windows and recurrent states) sharing slots and accept_len."""
    if not 1 <= len(pools) <= COMMIT_MULTI_PAIRS or len(stagings) != len(pools):
        raise ValueError(f"lingc.kda_commit_multi: want 1 to {COMMIT_MULTI_PAIRS} pools and as many stagings, got "
                         f"{len(pools)} pools and {len(stagings)} stagings")
    for pool, staging in zip(pools, stagings):
        kda_commit(pool, slots, staging, accept_len)


@kda_commit_multi.register_fake
def _(slots, accept_len, pools, stagings):
    return None


register("kda_commit_multi")


def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float) -> torch.Tensor:
    """Safe gate g = lower_bound * sigmoid(exp(A_log)[h] * (f + dt_bias)) in fp32; f [B, T, H, D] -> [B, T, H, D]."""
    H, D = f.shape[-2:]
    a = A_log.float().exp().view(H, 1)
    return lower_bound * torch.sigmoid(a * (f.float() + dt_bias.float().view(H, D)))


def _prepare(q, k, v, f, b, A_log, dt_bias, lower_bound):
    """fp32 [B, H, T, D] tensors: normalised+scaled q, normalised k, v, gate g, and beta [B, H, T]."""
    D = q.shape[-1]
    qf = l2norm(q.float()) * D ** -0.5
    kf = l2norm(k.float())
    g = kda_gate(f, A_log, dt_bias, lower_bound)
    # CPU sigmoid rounds differently in its vectorised body and its scalar tail, and which one a token's
    # H gates land in depends on T (test-tiny, H = 4: T = 6 vs 1 differ on AVX2; H = 8 or 16 on AVX-512),
    # so decode-sized calls go token by token: a verify chain then gets decode's bits (as lingc.linear)
    bf = b.float()
    T = bf.shape[1]
    beta = torch.cat([torch.sigmoid(bf[:, i:i + 1]) for i in range(T)], dim=1) if T <= ROW_INVARIANT_ROWS \
        else torch.sigmoid(bf)
    t = lambda x: x.transpose(1, 2)  # noqa: E731  [B, T, H, ...] -> [B, H, T, ...]
    return t(qf), t(kf), t(v.float()), t(g), t(beta)


def _recurrence(qf, kf, vf, g, beta, S: torch.Tensor,
                staging: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token: S = diag(exp(g_t)) S; S += k_t (beta_t (v_t - S^T k_t))^T; o_t = S^T q_t."""
    outs = []
    for t in range(qf.shape[2]):
        S = S * g[:, :, t].exp().unsqueeze(-1)                                   # decay rows (K index)
        kt = kf[:, :, t]                                                          # [B, H, D]
        err = beta[:, :, t, None] * (vf[:, :, t] - torch.einsum("bhkv,bhk->bhv", S, kt))
        S = S + kt.unsqueeze(-1) * err.unsqueeze(-2)
        outs.append(torch.einsum("bhkv,bhk->bhv", S, qf[:, :, t]))
        if staging is not None:
            staging[:, t] = S
    return torch.stack(outs, dim=1), S                                            # [B, T, H, D]


@torch.library.custom_op("lingc::kda_recurrent", mutates_args=("state_pool",))
def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
                  A_log: torch.Tensor, dt_bias: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor,
                  lower_bound: float) -> torch.Tensor:
    """Gated delta rule, one token at a time, from and into state_pool[slots] ([S, H, D, D] fp32).

    q, k, v, f [B, T, H, D]; b [B, T, H]; slots [B] int32. The output is read after each update.
    """
    qf, kf, vf, g, beta = _prepare(q, k, v, f, b, A_log, dt_bias, lower_bound)
    idx = slots.long()
    o, S = _recurrence(qf, kf, vf, g, beta, state_pool[idx].float(), None)
    state_pool[idx] = S.to(state_pool.dtype)
    return o.to(q.dtype)


@kda_recurrent.register_fake
def _(q, k, v, f, b, A_log, dt_bias, state_pool, slots, lower_bound):
    return v.new_empty(v.shape)


register("kda_recurrent")


@torch.library.custom_op("lingc::kda_recurrent_staged", mutates_args=("staging",))
def kda_recurrent_staged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
                         A_log: torch.Tensor, dt_bias: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor,
                         staging: torch.Tensor, lower_bound: float) -> torch.Tensor:
    """kda_recurrent for a verify chain: reads state_pool[slots], leaves it alone, and writes the state
    after each position t to staging[b, t] ([B, T, H, D, D] fp32) for kda_commit."""
    qf, kf, vf, g, beta = _prepare(q, k, v, f, b, A_log, dt_bias, lower_bound)
    o, _ = _recurrence(qf, kf, vf, g, beta, state_pool[slots.long()].float(), staging)
    return o.to(q.dtype)


@kda_recurrent_staged.register_fake
def _(q, k, v, f, b, A_log, dt_bias, state_pool, slots, staging, lower_bound):
    return v.new_empty(v.shape)


register("kda_recurrent_staged")


@torch.library.custom_op("lingc::kda_fused_decode",
                         mutates_args=("conv_q_pool", "conv_k_pool", "conv_v_pool", "state_pool"))
def kda_fused_decode(q_raw: torch.Tensor, k_raw: torch.Tensor, v_raw: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
                     conv_q_w: torch.Tensor, conv_k_w: torch.Tensor, conv_v_w: torch.Tensor,
                     conv_q_pool: torch.Tensor, conv_k_pool: torch.Tensor, conv_v_pool: torch.Tensor,
                     A_log: torch.Tensor, dt_bias: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor,
                     lower_bound: float) -> torch.Tensor:
    """A decode step's KDA token mixer after the projections: kda_conv of the raw q, k, v projections [B, T, P]
    (conv windows updated), viewed as f's [B, T, H, D], then kda_recurrent (state updated)."""
    heads = f.shape
    q = kda_conv(q_raw, conv_q_w, conv_q_pool, slots).view(heads)
    k = kda_conv(k_raw, conv_k_w, conv_k_pool, slots).view(heads)
    v = kda_conv(v_raw, conv_v_w, conv_v_pool, slots).view(heads)
    return kda_recurrent(q, k, v, f, b, A_log, dt_bias, state_pool, slots, lower_bound)


@kda_fused_decode.register_fake
def _(q_raw, k_raw, v_raw, f, b, conv_q_w, conv_k_w, conv_v_w, conv_q_pool, conv_k_pool, conv_v_pool, A_log,
      dt_bias, state_pool, slots, lower_bound):
    return q_raw.new_empty(f.shape)


register("kda_fused_decode")


@torch.library.custom_op("lingc::kda_fused_verify",
                         mutates_args=("staging_q", "staging_k", "staging_v", "staging_state"))
def kda_fused_verify(q_raw: torch.Tensor, k_raw: torch.Tensor, v_raw: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
                     conv_q_w: torch.Tensor, conv_k_w: torch.Tensor, conv_v_w: torch.Tensor,
                     conv_q_pool: torch.Tensor, conv_k_pool: torch.Tensor, conv_v_pool: torch.Tensor,
                     A_log: torch.Tensor, dt_bias: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor,
                     staging_q: torch.Tensor, staging_k: torch.Tensor, staging_v: torch.Tensor,
                     staging_state: torch.Tensor, lower_bound: float) -> torch.Tensor:
    """A verify chain's KDA token mixer after the projections: kda_conv_staged of the raw q, k, v projections
    [B, T, P], viewed as f's [B, T, H, D], then kda_recurrent_staged; every pool read only, four stagings written."""
    heads = f.shape
    q = kda_conv_staged(q_raw, conv_q_w, conv_q_pool, slots, staging_q).view(heads)
    k = kda_conv_staged(k_raw, conv_k_w, conv_k_pool, slots, staging_k).view(heads)
    v = kda_conv_staged(v_raw, conv_v_w, conv_v_pool, slots, staging_v).view(heads)
    return kda_recurrent_staged(q, k, v, f, b, A_log, dt_bias, state_pool, slots, staging_state, lower_bound)


@kda_fused_verify.register_fake
def _(q_raw, k_raw, v_raw, f, b, conv_q_w, conv_k_w, conv_v_w, conv_q_pool, conv_k_pool, conv_v_pool, A_log,
      dt_bias, state_pool, slots, staging_q, staging_k, staging_v, staging_state, lower_bound):
    return q_raw.new_empty(f.shape)


register("kda_fused_verify")


@torch.library.custom_op("lingc::kda_chunk", mutates_args=("state_pool",))
def kda_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
              A_log: torch.Tensor, dt_bias: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor,
              lower_bound: float) -> torch.Tensor:
    """The same recurrence as kda_recurrent in chunks of 64 (WY form with per-channel decay); for prefill.

    Inside a chunk with cumulative log-decay G_t, pseudo-values U solve
    (I + diag(beta) A) U = diag(beta) (V - (exp(G) * K) S0), A[t, s] = sum_i k_t,i k_s,i exp(G_t,i - G_s,i), s < t.
    """
    qf, kf, vf, g, beta = _prepare(q, k, v, f, b, A_log, dt_bias, lower_bound)
    B, H, T, D = qf.shape
    pad = (-T) % CHUNK
    if pad:  # padded steps have k = v = beta = 0 and no decay, so they change nothing
        qf, kf, vf, g = (F.pad(x, (0, 0, 0, pad)) for x in (qf, kf, vf, g))
        beta = F.pad(beta, (0, pad))
    n = qf.shape[2] // CHUNK
    split = lambda x: x.reshape(B, H, n, CHUNK, *x.shape[3:])  # noqa: E731
    qc, kc, vc, gc, bc = map(split, (qf, kf, vf, g, beta))
    idx = slots.long()
    S = state_pool[idx].float()
    causal = torch.tril(torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device))
    outs = []
    for c in range(n):
        G = gc[:, :, c].cumsum(-2)                                                # [B, H, C, D]
        diff = G.unsqueeze(-2) - G.unsqueeze(-3)                                  # [B, H, C(t), C(s), D]
        decay = torch.where(causal[..., None], diff, torch.full_like(diff, -torch.inf)).exp()
        kt, qt, vt, bt = kc[:, :, c], qc[:, :, c], vc[:, :, c], bc[:, :, c]
        A = torch.einsum("bhti,bhsi,bhtsi->bhts", kt, kt, decay).tril(-1)
        Bqk = torch.einsum("bhti,bhsi,bhtsi->bhts", qt, kt, decay)              # inclusive of s == t
        eye = torch.eye(CHUNK, dtype=A.dtype, device=A.device)
        rhs = bt.unsqueeze(-1) * (vt - torch.einsum("bhti,bhiv->bhtv", kt * G.exp(), S))
        U = torch.linalg.solve_triangular(eye + bt.unsqueeze(-1) * A, rhs, upper=False, unitriangular=True)
        outs.append(torch.einsum("bhti,bhiv->bhtv", qt * G.exp(), S) + Bqk @ U)
        G_end = G[:, :, -1:]                                                      # [B, H, 1, D]
        S = S * G_end.transpose(-1, -2).exp() + torch.einsum("bhsi,bhsv->bhiv", kt * (G_end - G).exp(), U)
    state_pool[idx] = S.to(state_pool.dtype)
    o = torch.cat(outs, dim=2)[:, :, :T]                                         # [B, H, T, D]
    return o.transpose(1, 2).to(q.dtype).contiguous()


@kda_chunk.register_fake
def _(q, k, v, f, b, A_log, dt_bias, state_pool, slots, lower_bound):
    return v.new_empty(v.shape)


register("kda_chunk")
