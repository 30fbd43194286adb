"""Token selection kernels: greedy argmax, speculative chain accept, inverse-CDF sampling; launchers and references.

`greedy_sample(logits [B, T, V]) -> int64 [B, T]` matches `torch.ops.lingc.greedy_sample` (lingc/ops/sample.py):
the argmax over V, lowest id on ties, and (as torch) a NaN counts as the maximum, so the first NaN wins. V
(157184) is split into chunks of CHUNK ids over a grid (rows, chunks): stage 1 writes each chunk's (max, id)
partial, stage 2 (one program per row) merges the row's partials. Everything is an exact compare, so the result
is bit-for-bit the reference's and independent of CHUNK and of the other rows.

`chain_accept(draft_ids, draft_probs, target_probs, target_logits, temperature, u)` matches
`torch.ops.lingc.chain_accept` (lingc/ops/spec.py). Two launches:
    stage 1, grid (B*(K+1), chunks): greedy rows (temperature <= 0) write argmax partials of target_logits;
        sampled rows write, for every position i, the chunk sums of the residual max(0, p_t - p_d) (p_d = 0 at
        i = K) and of p_t (the fallback when the residual is all zero), since the stop position is not yet known
    stage 2, grid (B,): greedy rows merge the partials into the K+1 target argmaxes and accept while
        draft == argmax; sampled rows accept while u_i * max(p_d, 1e-20) < p_t (the reference's fp32 ops, so the
        same bits), then draw the stop token from the residual (or p_t) at the stop position by inverse CDF
        with u_K; accept_len and all K+1 tokens are written.
`greedy_accept(draft_ids, target_logits)` matches `torch.ops.lingc.greedy_accept` (chain_accept for all-greedy
requests, the op specialize_greedy puts in its place): greedy_sample's stage 1 over the B*(K+1) rows, then
chain_accept's stage 2 compiled for its greedy branch only (ALL_GREEDY), so the same bits as chain_accept's greedy
rows, with no temperature, distributions or uniforms read.
`vocab_expand(probs [..., N], inverse_map [V])` matches `torch.ops.lingc.vocab_expand` (draft_vocab's sampled draft:
its distribution over the N hot tokens as one over V for chain_accept): a gather, one launch, exact.
`sample_tokens(probs [B, T, V], u [B, T])` matches `torch.ops.lingc.sample_tokens` with the same inverse CDF
(stage 1: chunk sums of probs; stage 2: one program per row picks the token).

Inverse CDF: the token is the first id whose running sum exceeds u * total. The kernel sums in fp32 in its own
order (chunk sums, then an in-chunk scan) where torch's cumsum uses another (CPU: a double accumulator), so
the drawn token can differ from the reference's only when u * total lies within a few fp32 ulps of a CDF
boundary (probability ~1e-7 per draw). The drawn token always has positive mass (a chunk is picked only if
its sum is positive, an id only where the scan steps up); u * total >= total gives V - 1 as the reference.
Greedy rows and every accept decision are exact.

Bytes: greedy reads B*T*V logits (4 B) once; chain_accept greedy reads (K+1)*V logits, sampled rows read
(2K+1)*V probabilities in stage 1 and 2*CHUNK in stage 2; partials are 12 B per chunk.

PDL placement (shared/docs/kernels.md section 1.5): with the constexpr PDL on every kernel calls `gdc_wait()` before
its first load of data an earlier kernel wrote (vocab_expand loads its inverse map, a weight, before it; nothing
else these kernels read is a weight) and `gdc_launch_dependents()` after its last such load. With PDL off no GDC call
is emitted.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lingc.kernels.pdl import pdl_supported, pdl_trigger, pdl_wait
import lingc.ops  # noqa: F401  (registers torch.ops.lingc.*, used by the references)

# Tunables (read at call time). CHUNK is the ids per stage-1 program; no result depends on it (argmax is exact;
# the sampled path's fp32 sums do depend on it, but never on the number of rows).
CHUNK = 2048
NUM_WARPS = 4
MAX_CHUNKS = 8192
EXPAND_BLOCK = 2048              # vocab_expand: output ids per program (157184 -> 77 programs a row)
_NO_ID = 1 << 30                 # id of padding lanes, above every vocabulary id


@triton.jit
def _argmax_chunk(x_row_ptr, cols, V, NO_ID: tl.constexpr):
    """(max, first id of the max) of x[cols] (a NaN wins as the maximum, first NaN first)."""
    m = cols < V
    x = tl.load(x_row_ptr + cols, mask=m, other=float("-inf")).to(tl.float32)
    ids = tl.where(m, cols, NO_ID)
    return _argmax_merge(x, ids, NO_ID)


@triton.jit
def _argmax_merge(vals, ids, NO_ID: tl.constexpr, AXIS: tl.constexpr = 0):
    """(max, its lowest id) over candidates (vals, ids) along AXIS; NaN candidates beat all, the lowest id among
    them. AXIS = 1 merges every row of a [rows, candidates] tile at once (the chain's K + 1 rows)."""
    nan = vals != vals
    nan_id = tl.min(tl.where(nan, ids, NO_ID), axis=AXIS)
    best = tl.max(tl.where(nan, float("-inf"), vals), axis=AXIS)
    best_id = tl.min(tl.where(vals == tl.expand_dims(best, AXIS), ids, NO_ID), axis=AXIS)
    has_nan = nan_id < NO_ID
    return tl.where(has_nan, float("nan"), best), tl.where(has_nan, nan_id, best_id)


@triton.jit
def _greedy_partials_kernel(x_ptr, val_ptr, id_ptr, T, stride_b, stride_t, V, n_chunks,
                            CHUNK: tl.constexpr, NO_ID: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    x_row_ptr = x_ptr + (row // T).to(tl.int64) * stride_b + (row % T).to(tl.int64) * stride_t
    if PDL:
        pdl_wait()
    val, idx = _argmax_chunk(x_row_ptr, c * CHUNK + tl.arange(0, CHUNK), V, NO_ID)
    if PDL:
        pdl_trigger()
    tl.store(val_ptr + row * n_chunks + c, val)
    tl.store(id_ptr + row * n_chunks + c, idx)


@triton.jit
def _greedy_final_kernel(val_ptr, id_ptr, out_ptr, n_chunks, C_BLOCK: tl.constexpr, NO_ID: tl.constexpr,
                         PDL: tl.constexpr):
    row = tl.program_id(0)
    cc = tl.arange(0, C_BLOCK)
    cm = cc < n_chunks
    if PDL:
        pdl_wait()
    vals = tl.load(val_ptr + row * n_chunks + cc, mask=cm, other=float("-inf"))
    ids = tl.load(id_ptr + row * n_chunks + cc, mask=cm, other=NO_ID)
    if PDL:
        pdl_trigger()
    _, idx = _argmax_merge(vals, ids, NO_ID)
    tl.store(out_ptr + row, idx.to(tl.int64))


@triton.jit
def _chunk_mass(p_row_ptr, q_row_ptr, cols, V, has_q, residual):
    """The sampled masses of ids `cols`: max(0, p - q) if residual (q = 0 unless has_q), else p; 0 past V."""
    m = cols < V
    p = tl.load(p_row_ptr + cols, mask=m, other=0.0).to(tl.float32)
    q = tl.load(q_row_ptr + cols, mask=m & has_q, other=0.0).to(tl.float32)
    return tl.where(residual, tl.maximum(p - q, 0.0), p)


@triton.jit
def _inverse_cdf(sums, cc, n_chunks, u, p_row_ptr, q_row_ptr, V, has_q, residual,
                 CHUNK: tl.constexpr, NO_ID: tl.constexpr):
    """The id whose CDF interval holds u * total, from chunk sums [C_BLOCK] (0 past n_chunks) and one chunk."""
    incl = tl.cumsum(sums, axis=0)                                              # non-decreasing
    target = u * tl.max(incl, axis=0)
    chunk = tl.sum(((incl <= target) & (cc < n_chunks)).to(tl.int32), axis=0)   # first chunk ending above target
    base = tl.max(tl.where(cc < chunk, incl, 0.0), axis=0)                      # mass before that chunk
    past = chunk >= n_chunks                                                    # u * total rounded up to total
    chunk = tl.minimum(chunk, n_chunks - 1)
    j = tl.arange(0, CHUNK)
    mass = _chunk_mass(p_row_ptr, q_row_ptr, chunk * CHUNK + j, V, has_q, residual)
    above = base + tl.cumsum(mass, axis=0) > target
    first = tl.min(tl.where(above, j, NO_ID), axis=0)
    last_pos = tl.max(tl.where(mass > 0, j, -1), axis=0)                       # if the in-chunk scan fell short
    pick = chunk * CHUNK + tl.where(first < NO_ID, first, last_pos)
    return tl.where(past, V - 1, pick)


@triton.jit
def _chain_partials_kernel(logits_ptr, tprobs_ptr, dprobs_ptr, temp_ptr, val_ptr, id_ptr, sum_ptr, V, n_chunks,
                           K: tl.constexpr, CHUNK: tl.constexpr, NO_ID: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)                       # b * (K+1) + i
    c = tl.program_id(1)
    b = row // (K + 1)
    i = row % (K + 1)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    if PDL:
        pdl_wait()
    temp = tl.load(temp_ptr + b).to(tl.float32)
    if temp <= 0:
        val, idx = _argmax_chunk(logits_ptr + row.to(tl.int64) * V, cols, V, NO_ID)
        tl.store(val_ptr + row * n_chunks + c, val)
        tl.store(id_ptr + row * n_chunks + c, idx)
    else:
        t_row = tprobs_ptr + row.to(tl.int64) * V
        d_row = dprobs_ptr + (b * K + tl.minimum(i, K - 1)).to(tl.int64) * V
        res = _chunk_mass(t_row, d_row, cols, V, i < K, True)
        pt = _chunk_mass(t_row, d_row, cols, V, False, False)
        tl.store(val_ptr + row * n_chunks + c, tl.sum(res, axis=0))
        tl.store(sum_ptr + row * n_chunks + c, tl.sum(pt, axis=0))
    if PDL:
        pdl_trigger()


@triton.jit
def _chain_final_kernel(draft_ptr, tprobs_ptr, dprobs_ptr, temp_ptr, u_ptr, val_ptr, id_ptr, sum_ptr,
                        len_ptr, tok_ptr, V, n_chunks, mean_ptr, sim_u_ptr, s_sim_u, seed_ptr, counter_ptr, sim_offset,
                        K: tl.constexpr, KP1_BLOCK: tl.constexpr,
                        C_BLOCK: tl.constexpr, CHUNK: tl.constexpr, NO_ID: tl.constexpr, PDL: tl.constexpr,
                        ALL_GREEDY: tl.constexpr = False, SIMULATE: tl.constexpr = 0, MAX_ACCEPT: tl.constexpr = 1):
    """Stage 2 of chain_accept / greedy_accept (module docstring), program b. SIMULATE (fuse_simulate_accept): the
    accept_len stored is simulate_accept's of it, with mean[b] and the uniform sim_u[b * s_sim_u] (1) or the one
    at (seed[b], counter[b] + sim_offset) (2), in simulate_accept's / uniform's kernels' arithmetic."""
    b = tl.program_id(0)
    cc = tl.arange(0, C_BLOCK)
    cm = cc < n_chunks
    kk = tl.arange(0, KP1_BLOCK)
    if PDL:
        pdl_wait()
    if SIMULATE == 1:
        sim_mean = tl.load(mean_ptr + b).to(tl.float32)
        sim_u = tl.load(sim_u_ptr + b * s_sim_u).to(tl.float32)
    elif SIMULATE == 2:
        sim_mean = tl.load(mean_ptr + b).to(tl.float32)
        sim_u = _uniform_value(tl.load(seed_ptr + b).to(tl.int64),
                               tl.load(counter_ptr + b).to(tl.int64) + sim_offset)
    if ALL_GREEDY:               # greedy_accept: no temperature, no distributions (their pointers are never read)
        temp = 0.0
    else:
        temp = tl.load(temp_ptr + b).to(tl.float32)
    drafts = tl.load(draft_ptr + b * K + kk, mask=kk < K, other=0).to(tl.int64)   # [KP1_BLOCK]
    run = b * 0 + 1                                                              # int32 scalars
    accepted = b * 0
    if temp <= 0:
        # greedy: accept while the draft equals the target's argmax; the stop token is the argmax there. The K + 1
        # rows' partials load as one [KP1_BLOCK, C_BLOCK] tile and merge along the chunks together: one set of
        # block reductions instead of one a row (a loop over the rows took 3.8 us exposed at K = 5 on the H200,
        # launches-kda-tma-h200-20261204.json; this, 1.6 us on an H100, launches-h100-20261205.json). The same
        # compares, so the same ids
        rows = b * (K + 1) + kk
        live = (kk < K + 1)[:, None] & cm[None, :]
        offs = rows[:, None] * n_chunks + cc[None, :]
        vals = tl.load(val_ptr + offs, mask=live, other=float("-inf"))
        ids = tl.load(id_ptr + offs, mask=live, other=NO_ID)
        _, argmaxes = _argmax_merge(vals, ids, NO_ID, 1)                        # [KP1_BLOCK]
        argmaxes = argmaxes.to(tl.int64)
        # accepted = the leading run of drafts equal to their argmax: the first position that differs (K if none)
        differs = (drafts != argmaxes) | (kk >= K)
        accepted = tl.min(tl.where(differs, kk, K), axis=0).to(tl.int32)
        stop = tl.sum(tl.where(kk == accepted, argmaxes, 0), axis=0)
    else:
        # sampled: accept while u_i * max(p_d, 1e-20) < p_t at the draft id (the reference's fp32 ops)
        for i in tl.static_range(K):
            d = tl.load(draft_ptr + b * K + i).to(tl.int64)
            p_t = tl.load(tprobs_ptr + (b * (K + 1) + i).to(tl.int64) * V + d).to(tl.float32)
            p_d = tl.maximum(tl.load(dprobs_ptr + (b * K + i).to(tl.int64) * V + d).to(tl.float32), 1e-20)
            u_i = tl.load(u_ptr + b * (K + 1) + i).to(tl.float32)
            run = run & (u_i * p_d < p_t).to(tl.int32)
            accepted = accepted + run
        # stop token: inverse CDF with u_K over the residual at the stop position (p_t if the residual is 0)
        row = b * (K + 1) + accepted
        res_sums = tl.load(val_ptr + row * n_chunks + cc, mask=cm, other=0.0)
        pt_sums = tl.load(sum_ptr + row * n_chunks + cc, mask=cm, other=0.0)
        residual = tl.max(res_sums, axis=0) > 0
        u_k = tl.load(u_ptr + b * (K + 1) + K).to(tl.float32)
        stop = _inverse_cdf(tl.where(residual, res_sums, pt_sums), cc, n_chunks, u_k,
                            tprobs_ptr + row.to(tl.int64) * V,
                            dprobs_ptr + (b * K + tl.minimum(accepted, K - 1)).to(tl.int64) * V,
                            V, accepted < K, residual, CHUNK, NO_ID).to(tl.int64)
    if PDL:
        pdl_trigger()
    accept_len = (accepted + 1).to(tl.int32)
    if SIMULATE > 0:
        accept_len = _simulated(accept_len, sim_mean, sim_u, MAX_ACCEPT)
    tl.store(len_ptr + b, accept_len)
    tokens = tl.where(kk == accepted, stop, drafts)                              # position K: 0 unless the stop
    tl.store(tok_ptr + b * (K + 1) + kk, tokens, mask=kk < K + 1)


@triton.jit
def _chunk_sums_kernel(p_ptr, sum_ptr, T, stride_b, stride_t, V, n_chunks, CHUNK: tl.constexpr,
                       PDL: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    p_row_ptr = p_ptr + (row // T).to(tl.int64) * stride_b + (row % T).to(tl.int64) * stride_t
    if PDL:
        pdl_wait()
    mass = _chunk_mass(p_row_ptr, p_row_ptr, c * CHUNK + tl.arange(0, CHUNK), V, False, False)
    if PDL:
        pdl_trigger()
    tl.store(sum_ptr + row * n_chunks + c, tl.sum(mass, axis=0))


@triton.jit
def _sample_final_kernel(p_ptr, u_ptr, sum_ptr, out_ptr, T, stride_b, stride_t, stride_ub, stride_ut, V, n_chunks,
                         C_BLOCK: tl.constexpr, CHUNK: tl.constexpr, NO_ID: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    cc = tl.arange(0, C_BLOCK)
    p_row_ptr = p_ptr + (row // T).to(tl.int64) * stride_b + (row % T).to(tl.int64) * stride_t
    if PDL:
        pdl_wait()
    sums = tl.load(sum_ptr + row * n_chunks + cc, mask=cc < n_chunks, other=0.0)
    u = tl.load(u_ptr + (row // T) * stride_ub + (row % T) * stride_ut).to(tl.float32)
    token = _inverse_cdf(sums, cc, n_chunks, u, p_row_ptr, p_row_ptr, V, False, False, CHUNK, NO_ID)
    if PDL:
        pdl_trigger()
    tl.store(out_ptr + row, token.to(tl.int64))


def _chunks(V: int) -> tuple[int, int]:
    """(number of chunks, its power-of-two block) for a vocabulary of V ids."""
    n_chunks = triton.cdiv(V, CHUNK)
    if n_chunks > MAX_CHUNKS:
        raise ValueError(f"sample: vocabulary {V} needs {n_chunks} chunks of {CHUNK}, more than {MAX_CHUNKS}")
    return n_chunks, triton.next_power_of_2(n_chunks)


def _bt_v(x: torch.Tensor, name: str) -> torch.Tensor:
    """x as a float [B, T, V] tensor with unit last stride (copying only if needed)."""
    if x.dim() != 3 or not x.dtype.is_floating_point or x.shape[-1] == 0:
        raise ValueError(f"sample: {name} must be a float [B, T, V] tensor with V > 0, got {list(x.shape)} {x.dtype}")
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch(pdl: bool, device: torch.device) -> tuple[bool, dict]:
    pdl = pdl and pdl_supported(device)
    return pdl, ({"launch_pdl": True} if pdl else {})


def greedy_sample(logits: torch.Tensor, *, pdl: bool = False) -> torch.Tensor:
    """argmax over V of logits [B, T, V] -> int64 [B, T] (lowest id on ties, first NaN wins), two launches."""
    logits = _bt_v(logits, "logits")
    B, T, V = logits.shape
    out = torch.empty((B, T), dtype=torch.int64, device=logits.device)
    rows = B * T
    if rows == 0:
        return out
    n_chunks, c_block = _chunks(V)
    vals = torch.empty((rows, n_chunks), dtype=torch.float32, device=logits.device)
    ids = torch.empty((rows, n_chunks), dtype=torch.int32, device=logits.device)
    pdl, launch = _launch(pdl, logits.device)
    _greedy_partials_kernel[(rows, n_chunks)](logits, vals, ids, T, logits.stride(0), logits.stride(1), V, n_chunks,
                                              CHUNK=CHUNK, NO_ID=_NO_ID, PDL=pdl, num_warps=NUM_WARPS, **launch)
    _greedy_final_kernel[(rows,)](vals, ids, out, n_chunks, C_BLOCK=c_block, NO_ID=_NO_ID, PDL=pdl,
                                  num_warps=NUM_WARPS, **launch)
    return out


def _no_simulate(dummy: torch.Tensor) -> dict:
    """_chain_final_kernel's SIMULATE arguments, off: `dummy` (any tensor of the launch) stands for the pointers,
    which are never read."""
    return dict(mean_ptr=dummy, sim_u_ptr=dummy, s_sim_u=0, seed_ptr=dummy, counter_ptr=dummy, sim_offset=0,
                SIMULATE=0, MAX_ACCEPT=1)


def _simulate_args(B: int, mean: torch.Tensor, max_accept: int, u_sim: torch.Tensor | None = None,
                   seed: torch.Tensor | None = None, counter: torch.Tensor | None = None,
                   offset: int = 0) -> dict | None:
    """_chain_final_kernel's SIMULATE arguments (1: u_sim read, 2: the uniform at (seed, counter + offset)), or None
    where the shapes are not the [B] vectors the kernel reads (the caller then runs the reference op)."""
    vectors = [mean] + ([u_sim] if u_sim is not None else [seed, counter])
    if any(t.dim() != 1 or t.shape[0] != B for t in vectors) or not mean.is_floating_point() or max_accept < 1:
        return None
    if u_sim is not None:
        return dict(mean_ptr=mean.contiguous(), sim_u_ptr=u_sim, s_sim_u=u_sim.stride(0), seed_ptr=mean,
                    counter_ptr=mean, sim_offset=0, SIMULATE=1, MAX_ACCEPT=max_accept)
    if seed.is_floating_point() or counter.is_floating_point():
        return None
    return dict(mean_ptr=mean.contiguous(), sim_u_ptr=mean, s_sim_u=0, seed_ptr=seed.contiguous(),
                counter_ptr=counter.contiguous(), sim_offset=int(offset), SIMULATE=2, MAX_ACCEPT=max_accept)


def chain_accept(draft_ids: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                 target_logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor, *, pdl: bool = False,
                 _simulate: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(accept_len int32 [B], tokens int64 [B, K+1]) as torch.ops.lingc.chain_accept, two launches. _simulate:
    chain_accept_simulated's stage-2 arguments (_simulate_args)."""
    if draft_ids.dim() != 2 or draft_ids.dtype.is_floating_point or draft_ids.dtype == torch.bool:
        raise ValueError(f"chain_accept: draft_ids must be an integer [B, K] tensor, got {list(draft_ids.shape)} "
                         f"{draft_ids.dtype}")
    B, K = draft_ids.shape
    V = target_logits.shape[-1]
    want = {"draft_probs": (draft_probs, (B, K, V)), "target_probs": (target_probs, (B, K + 1, V)),
            "target_logits": (target_logits, (B, K + 1, V)), "temperature": (temperature, (B,)),
            "u": (u, (B, K + 1))}
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape or not t.dtype.is_floating_point:
            raise ValueError(f"chain_accept: {name} must be a float {list(shape)} tensor, "
                             f"got {list(t.shape)} {t.dtype}")
    if K < 1 or V < 1:
        raise ValueError(f"chain_accept: want K >= 1 draft tokens and V >= 1, got K={K}, V={V}")
    dev = draft_ids.device
    accept_len = torch.empty((B,), dtype=torch.int32, device=dev)
    tokens = torch.empty((B, K + 1), dtype=torch.int64, device=dev)
    if B == 0:
        return accept_len, tokens
    draft_ids, draft_probs, target_probs, target_logits, temperature, u = (
        t.contiguous() for t in (draft_ids, draft_probs, target_probs, target_logits, temperature, u))
    n_chunks, c_block = _chunks(V)
    vals = torch.empty((B * (K + 1), n_chunks), dtype=torch.float32, device=dev)
    ids = torch.empty((B * (K + 1), n_chunks), dtype=torch.int32, device=dev)
    sums = torch.empty((B * (K + 1), n_chunks), dtype=torch.float32, device=dev)
    pdl, launch = _launch(pdl, dev)
    _chain_partials_kernel[(B * (K + 1), n_chunks)](
        target_logits, target_probs, draft_probs, temperature, vals, ids, sums, V, n_chunks,
        K=K, CHUNK=CHUNK, NO_ID=_NO_ID, PDL=pdl, num_warps=NUM_WARPS, **launch)
    _chain_final_kernel[(B,)](
        draft_ids, target_probs, draft_probs, temperature, u, vals, ids, sums, accept_len, tokens, V, n_chunks,
        **(_simulate or _no_simulate(draft_ids)), K=K, KP1_BLOCK=triton.next_power_of_2(K + 1), C_BLOCK=c_block,
        CHUNK=CHUNK, NO_ID=_NO_ID, PDL=pdl, num_warps=NUM_WARPS, **launch)
    return accept_len, tokens


def chain_accept_simulated(draft_ids: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                           target_logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor,
                           mean: torch.Tensor, u_sim: torch.Tensor, max_accept: int, *, pdl: bool = False,
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.ops.lingc.chain_accept_simulated in chain_accept's two launches: its stage 2 stores simulate_accept's
    accept_len (the simulate_accept kernel's arithmetic on the same values: the same integers)."""
    sim = _simulate_args(draft_ids.shape[0], mean, max_accept, u_sim=u_sim) if draft_ids.dim() == 2 else None
    if sim is None:
        return torch.ops.lingc.chain_accept_simulated(draft_ids, draft_probs, target_probs, target_logits,
                                                      temperature, u, mean, u_sim, max_accept)
    return chain_accept(draft_ids, draft_probs, target_probs, target_logits, temperature, u, pdl=pdl,
                        _simulate=sim)


def greedy_accept(draft_ids: torch.Tensor, target_logits: torch.Tensor, *, pdl: bool = False,
                  _simulate: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(accept_len int32 [B], tokens int64 [B, K+1]) as torch.ops.lingc.greedy_accept, two launches: the argmax
    partials of greedy_sample over the B*(K+1) rows, then chain_accept's final kernel on its greedy branch only.
    _simulate: greedy_accept_simulated's stage-2 arguments (_simulate_args)."""
    if draft_ids.dim() != 2 or draft_ids.dtype.is_floating_point or draft_ids.dtype == torch.bool:
        raise ValueError(f"greedy_accept: draft_ids must be an integer [B, K] tensor, got {list(draft_ids.shape)} "
                         f"{draft_ids.dtype}")
    B, K = draft_ids.shape
    if target_logits.dim() != 3 or tuple(target_logits.shape[:2]) != (B, K + 1) \
            or not target_logits.dtype.is_floating_point or K < 1 or target_logits.shape[-1] < 1:
        raise ValueError(f"greedy_accept: target_logits must be a float [{B}, {K + 1}, V] tensor (K >= 1, V >= 1), "
                         f"got {list(target_logits.shape)} {target_logits.dtype}")
    dev = draft_ids.device
    accept_len = torch.empty((B,), dtype=torch.int32, device=dev)
    tokens = torch.empty((B, K + 1), dtype=torch.int64, device=dev)
    if B == 0:
        return accept_len, tokens
    draft_ids, logits = draft_ids.contiguous(), target_logits.contiguous()
    V = logits.shape[-1]
    n_chunks, c_block = _chunks(V)
    vals = torch.empty((B * (K + 1), n_chunks), dtype=torch.float32, device=dev)
    ids = torch.empty((B * (K + 1), n_chunks), dtype=torch.int32, device=dev)
    pdl, launch = _launch(pdl, dev)
    _greedy_partials_kernel[(B * (K + 1), n_chunks)](logits, vals, ids, K + 1, logits.stride(0), logits.stride(1),
                                                     V, n_chunks, CHUNK=CHUNK, NO_ID=_NO_ID, PDL=pdl,
                                                     num_warps=NUM_WARPS, **launch)
    _chain_final_kernel[(B,)](
        draft_ids, logits, logits, logits, logits, vals, ids, vals, accept_len, tokens, V, n_chunks,
        **(_simulate or _no_simulate(draft_ids)), K=K, KP1_BLOCK=triton.next_power_of_2(K + 1), C_BLOCK=c_block,
        CHUNK=CHUNK, NO_ID=_NO_ID, PDL=pdl, ALL_GREEDY=True, num_warps=NUM_WARPS, **launch)
    return accept_len, tokens


def greedy_accept_simulated(draft_ids: torch.Tensor, target_logits: torch.Tensor, mean: torch.Tensor,
                            seed: torch.Tensor, counter: torch.Tensor, offset: int, max_accept: int, *,
                            pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.ops.lingc.greedy_accept_simulated in greedy_accept's two launches: its stage 2 also draws the uniform
    (the uniform kernel's hash) and stores simulate_accept's accept_len (its kernel's arithmetic): the same integers
    as the three ops, two launches fewer."""
    sim = _simulate_args(draft_ids.shape[0], mean, max_accept, seed=seed, counter=counter, offset=offset) \
        if draft_ids.dim() == 2 else None
    if sim is None:
        return torch.ops.lingc.greedy_accept_simulated(draft_ids, target_logits, mean, seed, counter, offset,
                                                       max_accept)
    return greedy_accept(draft_ids, target_logits, pdl=pdl, _simulate=sim)


def sample_tokens(probs: torch.Tensor, u: torch.Tensor, *, pdl: bool = False) -> torch.Tensor:
    """One token per position from probs [B, T, V] with uniforms u [B, T] (inverse CDF) -> int64 [B, T]."""
    probs = _bt_v(probs, "probs")
    B, T, V = probs.shape
    if tuple(u.shape) != (B, T) or not u.dtype.is_floating_point:
        raise ValueError(f"sample_tokens: u must be a float [{B}, {T}] tensor, got {list(u.shape)} {u.dtype}")
    out = torch.empty((B, T), dtype=torch.int64, device=probs.device)
    rows = B * T
    if rows == 0:
        return out
    n_chunks, c_block = _chunks(V)
    sums = torch.empty((rows, n_chunks), dtype=torch.float32, device=probs.device)
    pdl, launch = _launch(pdl, probs.device)
    _chunk_sums_kernel[(rows, n_chunks)](probs, sums, T, probs.stride(0), probs.stride(1), V, n_chunks,
                                         CHUNK=CHUNK, PDL=pdl, num_warps=NUM_WARPS, **launch)
    _sample_final_kernel[(rows,)](probs, u, sums, out, T, probs.stride(0), probs.stride(1), u.stride(0), u.stride(1),
                                  V, n_chunks, C_BLOCK=c_block, CHUNK=CHUNK, NO_ID=_NO_ID, PDL=pdl,
                                  num_warps=NUM_WARPS, **launch)
    return out


def greedy_sample_ref(logits: torch.Tensor) -> torch.Tensor:
    """lingc's reference argmax."""
    return torch.ops.lingc.greedy_sample(logits)


def chain_accept_ref(draft_ids: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                     target_logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """lingc's reference chain accept."""
    return torch.ops.lingc.chain_accept(draft_ids, draft_probs, target_probs, target_logits, temperature, u)


def greedy_accept_ref(draft_ids: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """lingc's reference greedy chain accept."""
    return torch.ops.lingc.greedy_accept(draft_ids, target_logits)


def sample_tokens_ref(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """lingc's reference inverse-CDF sampler."""
    return torch.ops.lingc.sample_tokens(probs, u)


# ---------------------------------------------------------------------------------------------- uniform

@triton.jit
def _splitmix64(x):
    """splitmix64 finaliser on uint64 (wrapping multiply, logical shifts): lingc.ops.spec._splitmix64's bits."""
    x = x + 0x9E3779B97F4A7C15
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit
def _uniform_value(seed, index):
    """The uniform of (seed, counter index), both int64, as lingc.uniform: splitmix64 of the 64-bit patterns, the
    top 24 bits scaled by 2^-24 (exact in fp32). Shared by the uniform kernel and chain_accept's SIMULATE."""
    bits = _splitmix64(_splitmix64(seed.to(tl.uint64, bitcast=True)) ^ index.to(tl.uint64, bitcast=True))
    return (bits >> 40).to(tl.int64).to(tl.float32) * (1.0 / (1 << 24))


@triton.jit
def _uniform_kernel(seed_ptr, counter_ptr, out_ptr, N, offset, BLOCK: tl.constexpr, PDL: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    if PDL:
        pdl_wait()
    seed = tl.load(seed_ptr + b).to(tl.int64)
    counter = tl.load(counter_ptr + b).to(tl.int64) + offset
    if PDL:
        pdl_trigger()
    tl.store(out_ptr + b * N + i, _uniform_value(seed, counter + i), mask=i < N)


def uniform(seed: torch.Tensor, counter: torch.Tensor, n: int, offset: int = 0, *, pdl: bool = False) -> torch.Tensor:
    """n uniform fp32 in [0, 1) per request from (seed, counter + offset + i) (lingc.uniform): one launch, the
    reference's bits (splitmix64 on the same 64-bit patterns, top 24 bits scaled by 2^-24, exact in fp32)."""
    B = seed.shape[0]
    out = torch.empty((B, n), dtype=torch.float32, device=seed.device)
    if B == 0 or n == 0:
        return out
    pdl = pdl and pdl_supported(seed.device)
    _uniform_kernel[(B,)](seed, counter, out, n, int(offset), BLOCK=triton.next_power_of_2(n), PDL=pdl, num_warps=1,
                          **({"launch_pdl": True} if pdl else {}))
    return out


@triton.jit
def _simulate_accept_kernel(accept_ptr, mean_ptr, u_ptr, out_ptr, B, s_u, MAX_ACCEPT: tl.constexpr,
                            BLOCK_B: tl.constexpr, PDL: tl.constexpr):
    b = tl.arange(0, BLOCK_B)
    m = b < B
    if PDL:
        pdl_wait()
    accept = tl.load(accept_ptr + b, mask=m, other=0)
    mean = tl.load(mean_ptr + b, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + b * s_u, mask=m, other=0.0).to(tl.float32)
    if PDL:
        pdl_trigger()
    tl.store(out_ptr + b, _simulated(accept.to(out_ptr.dtype.element_ty), mean, u, MAX_ACCEPT), mask=m)


@triton.jit
def _simulated(accept, mean, u, MAX_ACCEPT: tl.constexpr):
    """simulate_accept's value: where mean > 0, floor(mean) + (u < frac(mean)) clamped to [1, MAX_ACCEPT] (fp32, the
    reference's ops), else accept; in accept's dtype. Shared by its kernel and chain_accept's SIMULATE."""
    base = tl.floor(mean)
    sim = base + tl.where(u < mean - base, 1.0, 0.0)
    sim = tl.minimum(tl.maximum(sim, 1.0), MAX_ACCEPT)
    return tl.where(mean > 0, sim.to(accept.dtype), accept)


def simulate_accept(accept_len: torch.Tensor, mean: torch.Tensor, u: torch.Tensor, max_accept: int, *,
                    pdl: bool = False) -> torch.Tensor:
    """The benchmark knob (lingc.simulate_accept): where mean[b] > 0, floor(mean) + (u < frac(mean)) clamped to
    [1, max_accept], else accept_len; one launch (the reference is ~8 small kernels, ~15 us in the verify graph).
    The same fp32 floor, subtraction and compare as the reference, so the same integers."""
    B = accept_len.shape[0]
    if accept_len.dim() != 1 or mean.shape != (B,) or u.shape != (B,) or B > 1024:
        return torch.ops.lingc.simulate_accept(accept_len, mean, u, max_accept)
    out = torch.empty_like(accept_len)
    if B == 0:
        return out
    pdl, launch = _launch(pdl, accept_len.device)
    _simulate_accept_kernel[(1,)](accept_len.contiguous(), mean.contiguous(), u, out, B, u.stride(0),
                                  MAX_ACCEPT=max_accept, BLOCK_B=triton.next_power_of_2(B), PDL=pdl, num_warps=1,
                                  **launch)
    return out


# ------------------------------------------------------------------------------------------- vocab_expand

@triton.jit
def _vocab_expand_kernel(p_ptr, inv_ptr, out_ptr, N, V, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = cols < V
    inv = tl.load(inv_ptr + cols, mask=m, other=-1)            # a weight (the inverse map): before the wait
    if PDL:
        pdl_wait()
    hot = m & (inv >= 0)
    p = tl.load(p_ptr + row * N + inv, mask=hot, other=0.0)
    if PDL:
        pdl_trigger()
    tl.store(out_ptr + row * V + cols, p.to(tl.float32), mask=m)


def vocab_expand(probs: torch.Tensor, inverse_map: torch.Tensor, *, pdl: bool = False) -> torch.Tensor:
    """fp32 [..., V] as torch.ops.lingc.vocab_expand: out[..., v] = probs[..., inverse_map[v]] (0 where it is -1);
    one launch, grid (cdiv(V, EXPAND_BLOCK), rows), a gather (every output written once, so no zero-fill pass).
    Exact: values are copied (widened to fp32)."""
    if inverse_map.dim() != 1 or inverse_map.dtype not in (torch.int32, torch.int64) or probs.dim() < 1 \
            or not probs.is_floating_point():
        raise ValueError(f"vocab_expand: want probs [..., N] float and inverse_map [V] int32/int64, got "
                         f"{list(probs.shape)} {probs.dtype} and {list(inverse_map.shape)} {inverse_map.dtype}")
    N, V = probs.shape[-1], inverse_map.shape[0]
    out = torch.empty((*probs.shape[:-1], V), dtype=torch.float32, device=probs.device)
    rows = out.numel() // V if V else 0
    if rows == 0 or V == 0:
        return out
    pdl, launch = _launch(pdl, probs.device)
    _vocab_expand_kernel[(triton.cdiv(V, EXPAND_BLOCK), rows)](
        probs.reshape(rows, N).contiguous(), inverse_map.contiguous(), out, N, V, BLOCK=EXPAND_BLOCK, PDL=pdl,
        num_warps=NUM_WARPS, **launch)
    return out


def vocab_expand_ref(probs: torch.Tensor, inverse_map: torch.Tensor) -> torch.Tensor:
    return torch.ops.lingc.vocab_expand(probs, inverse_map)


LOWERINGS = {"greedy_sample": greedy_sample, "chain_accept": chain_accept, "greedy_accept": greedy_accept,
             "chain_accept_simulated": chain_accept_simulated, "greedy_accept_simulated": greedy_accept_simulated,
             "sample_tokens": sample_tokens,
             "uniform": uniform, "simulate_accept": simulate_accept, "vocab_expand": vocab_expand}
