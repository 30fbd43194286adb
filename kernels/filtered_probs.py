"""The sampling distribution op (`torch.ops.lingc.filtered_probs`) without a sort: Triton kernels, launcher, reference.

Job: logits [B, T, V] (fp32 / bf16 / fp16), temperature / top_k / top_p [B] -> fp32 probs [B, T, V]. Per row
(one (b, t) position), decided on the device from the row's own parameters:
    greedy     temperature <= 0                   one-hot on the argmax of the raw logits (lowest id on ties)
    plain      top_k not in (0, V) and top_p >= 1  softmax(logits / T)
    filtered   otherwise                          softmax restricted to top-k, then top-p, renormalised
The reference sorts all V values of every row; this module finds the filter's value threshold instead.

Work split: every kernel runs one program per (CHUNK-element slice of a row, row): grid (cdiv(V, CHUNK), B*T),
so a row is spread over many SMs (V = 157184 with CHUNK = 1024: 154 programs a row). Launches, in order:
  1. stats   per slice: max and sum(exp(x - max)) of x = logits / T, the finite minimum, the argmax of the raw
             logits (lowest id). The program of slice 0 zeroes the row's round tickets.
  2. rounds  len(bins_k) top-k rounds, then len(bins_p) top-p rounds (below); rows with nothing to search
             (greedy, plain, that filter off, already resolved) return at once. 5 by default, so a call is
             7 launches whatever its rows (the host cannot see them); greedy / plain rows pay only their
             early exits. The op's static `filters` mask (passes/specialize_sampling.py's copies) drops a
             cleared filter's rounds and reads it as off: 2 launches a plain call, 5 a top-p-only one.
  3. write   greedy: 0 / 1 (the logits are not read); else exp(x - M) / Z where x >= threshold, else 0.
Every program that needs the row's max M, sum Z or argmax combines the <= cdiv(V, CHUNK) slice stats itself,
in a fixed order (a few hundred bytes): no extra launch and no reduction that depends on arrival order.

Threshold search (`_round_kernel`). Both filters keep the prefix of the descending order in which a score
summed over the tokens strictly ahead stays below a target: top-k counts (target k), top-p sums the mass
w = exp(x - M) (target top_p * Z_k, Z_k = mass of the top-k set). For a threshold t let S(t) = score of
{x >= t}. A round holds a bracket [lo, hi) with S(lo) >= target > S(hi): every token >= hi is kept, every
token < lo dropped. It splits the bracket into NB value bins with edges t(j) = fma(j, (top - lo) / NB, lo)
(top = hi, or M while hi = +inf), bins each bracket token by binary search over the edges (exact and
monotone, so the kernels, the decision and the next round agree on every edge), and sums count and mass
per bin. The bin j0 holding the crossing becomes the next bracket; the row is resolved when it holds one
token (kept: the score strictly ahead of it is S(hi) < target) or all bracket tokens are equal. Exact
finish: once the chosen bin holds <= `exact` tokens (default 512), the deciding program gathers them from
the slices, gives each the score of the gathered tokens strictly greater than it (pairwise) plus S(hi), and
keeps exactly those whose score ahead stays below the target. The gather scans every slice's compacted
bracket tokens, one program alone, so before the phase's last round it runs only where no slice compacted
more than `scan_max` (64) this round; else the bin is binned once more (a round over a few tokens a slice is
cheaper than the lone program's longer scan). In a phase's first round every slice compacts its whole chunk, so
a first round never finishes early. Kept set: {x >= lo}, normaliser
Z_final = mass(x >= lo), both in the row state. Top-p starts from the top-k threshold, so the kept set is
top-k, then top-p. Each program first compacts its bracket tokens into its own slice of the output row
(scratch until the write kernel), so the NB-wide one-hot work after the first round of a phase scales with
the bracket, not the slice. The first round of a phase uses few bins (it sees every token), later ones many.
Default rounds: top-k (32, 256), top-p (32, 64, 256) bins. Top-k 50 resolves in round 2 (the crossing bin
near the max holds <= 512 tokens; its gather waits a round), LM-like top-p in round 1 or 2; flat rows (top-p
0.9 keeping ~60% of a 157k vocabulary, top-k in the bulk) by round 3 (the bracket shrinks ~20x in round 1 and
again ~50x in round 2's 64 bins, leaving a few tokens a slice for the exact finish or round 3).

Measured (H100, 2026-12-06, one row / six rows, V = 157184, cold logits, PDL on; bench/kernel_filtered_probs.py,
bench/results/kernel-filtered-probs-h100-20261206-ab.json): top-p 0.9 peaked 34.9 / 50.1 us, flat 47.6 / 74.5,
top-k 50 + top-p 0.9 40.4 / 57.6 (scan_max 64); the kernel of a6c37aa (bins on dim 1, the deciding program
summing every slice's partials, a cross-thread gather, scan_max 512) took 95.3 / 140.9, 191.7 / 245.2 and
106.0 / 156.8. Same rows at scan_max 512: flat 68.5 / 91.0, the others level. num_warps 8: one row 1-5 us faster,
six rows 8-13 us slower, the sampled step 50 us slower: 4 stays. The sampled NEXTN step (general graphs,
temperature 0.8, top-p 0.95; bench/results/step-sampling-ab-h100-20261206.json): 5.077 ms -> 4.086 ms.
Since 2026-12-06's second sweep the default is CHUNK 1024 (was 2048) and a 64-bin second top-p round (was 256):
one row / six rows peaked 31.2 / 54.1 us, flat 33.5 / 63.4, top-k 50 + top-p 0.9 34.2 / 62.4, greedy 9.3 / 17.9,
against 34.4 / 49.6, 47.0 / 73.7, 39.4 / 57.3 and 8.5 / 14.1 for the previous default in the same H100 session
(bench/results/kernel-filtered-probs-sweep-h100-20261206.json); chunk 512 was faster at one row and much slower at
six. The step weighs one-row calls five to one (four draws and the extend against verify's six rows): sampled NEXTN
4.116 / 4.117 -> 4.042 ms, chunk 1024 alone 4.071, the 64-bin round alone 4.074, greedy graphs unchanged
(step-sampling-ab-h100-20261206-b.json, one process). A numerics change at rounding level (other slices, so other
per-slice fp32 sums before the fixed point; other bin edges on the way to the same kept sets).

Cross-program step: each program bins its bracket tokens (bins on dim 0 and tokens on dim 1 of the one-hot tile, so
a token's load, exp and search run on few threads; the next step's tokens loaded before this step's are binned),
stores its per-bin counts, bracket min / max and size, and adds its per-bin count and mass (its fp32 sum in fixed
point, MASS_SCALE units of an int64) into the row's totals for the round with integer atomics; then it takes a ticket
(an acq_rel atomic after a CTA barrier, as in kernels/linear.py). The program that draws the last one reads the
totals (NB counts and masses, not every slice's partials) and writes the row's next bracket. No float atomics:
integer sums are the same in any arrival order, so the result is the same whoever arrives last. Offline sm_90 SASS
(2026-12-06): a binning step is 147 instructions for 64 tokens at 32 bins (652 with the bins on dim 1, where every
bin column's threads loaded and searched every token) and 167 for 8 tokens at 256 (487).

Ties and limits (documented, not matched bit for bit; the reference's unstable sort makes ties ambiguous):
  * ties at the threshold are all kept (top-k may then keep more than k tokens, top-p a few more);
  * a bin still above `exact` tokens after the last round keeps all its tokens (a superset next to the
    threshold; needs > 512 tokens within ~2^-13 (top-k) / 2^-21 (top-p) of the row's value range);
  * top_p <= 0 keeps the top token (the reference divides 0 by 0); -inf logits get probability 0;
  * top_p >= 1 is off: the reference's fp32 cumsum may reach 1.0 and drop tail tokens of probability
    < ~1e-7 even then; the kernel keeps them;
  * the top-p mass is summed per bin, not in sorted order: a token whose preceding mass is within float
    rounding (~1e-6 relative) of top_p may be decided the other way than by the reference's cumsum.
Numerics: x = logits.float() / T with IEEE division (tl.div_rn, as torch), exp via Triton's exp; kept
values are exp(x - M) / Z_final in fp32, within a few ulp of the reference; greedy rows are exact.

Bytes per call (R = B*T rows, s = logit element size): stats reads R*V*s; the write kernel reads R*V*s
(non-greedy rows) and writes R*V*4. Rounds of filtered rows re-read the logits (L2-resident after the
stats pass) and use the output row as scratch. Row invariance: CHUNK, the bins and the rounds are fixed
per call shape V (never B or T), every row is reduced by the same programs in the same order.

PDL placement (shared/docs/kernels.md section 1.5): every input (logits, sampling parameters, the previous
launch's workspace) is written by an earlier kernel, so each kernel calls `gdc_wait()` before its first
load and `gdc_launch_dependents()` after its last load of the logits. With PDL off no GDC call is emitted
(the Triton interpreter cannot run them, kernels.md section 1.2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lingc.kernels.pdl import pdl_supported, pdl_trigger, pdl_wait
import lingc.ops  # noqa: F401  (registers torch.ops.lingc.*, used by the reference)

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_VOCAB = tl.constexpr(1 << 24)   # the argmax travels as an fp32 (exact below 2^24)
STATE_FIELDS = tl.constexpr(8)      # per row and phase: lo, hi, cnt_hi, mass_hi, target, resolved, mass_lo, cnt_lo
TINY = tl.constexpr(1e-30)          # smallest top-p target: top_p <= 0 keeps the top token
MASS_SCALE = tl.constexpr(2.0 ** 38)   # the row totals' fixed-point mass: units of 2^-38 in an int64 (a bin holds
MASS_ULP = tl.constexpr(2.0 ** -38)    # < 2^24 tokens of mass <= 1 each: < 2^62 units)
GATHER_VEC = tl.constexpr(4)        # exact finish: a slice's tokens a gather load (16 B: one vector, one thread)
PAIR_TILE = 2048                    # then [GJ, exact] pairwise tiles (GJ = PAIR_TILE / exact)


@dataclass(frozen=True)
class FilteredProbsConfig:
    """Tunables of one call; they depend on nothing (never on B or T), so every row gets the same arithmetic.
    chunk: elements per program (power of two). bins_k / bins_p: bins per top-k / top-p round (powers of two;
    the first round of a phase sees every token, so keep it small). cell: one-hot tile size (elements).
    exact: largest bracket (tokens) finished exactly by the deciding program (power of two).
    scan_max: the exact finish's gather scans every slice's compacted bracket in one program, so before the
    phase's last round it runs only where no slice compacted more than scan_max tokens this round (module
    docstring, "Exact finish").
    finish: False drops the exact finish: a filter's threshold is then the lower edge of its last round's
    crossing bin, so the kept set is a superset of the filter's (the whole bin kept) and the distribution a coarse
    one. A draft may sample from such a distribution (speculative sampling stays exact for any draft distribution
    it both samples from and relays); no graph uses it yet: `bench/kernel_filtered_probs.py --coarse` prices it."""
    chunk: int = 1024
    num_warps: int = 4
    bins_k: tuple[int, ...] = (32, 256)
    bins_p: tuple[int, ...] = (32, 64, 256)
    cell: int = 2048
    exact: int = 512
    scan_max: int = 64        # an exact finish before the phase's last round only if no slice holds more bracket tokens
    finish: bool = True       # False: no exact finish (the last round's crossing bin kept whole)

    def check(self) -> None:
        bins = self.bins_k + self.bins_p
        pow2 = [self.chunk, self.cell, self.exact, *bins]
        if any(v < 2 or v & (v - 1) for v in pow2) or not self.bins_k or not self.bins_p:
            raise ValueError(f"filtered_probs: config {self} wants powers of two >= 2 and >= 1 round per phase")
        if self.cell < max(bins):
            raise ValueError(f"filtered_probs: cell {self.cell} is smaller than the largest bin count")


DEFAULT_CONFIG = FilteredProbsConfig()


@triton.jit
def _row_params(temp_ptr, topk_ptr, topp_ptr, b, V):
    """(temperature, greedy, top-k on, top-p on, k, p) of request b."""
    temp = tl.load(temp_ptr + b).to(tl.float32)
    k = tl.load(topk_ptr + b).to(tl.int64)
    p = tl.load(topp_ptr + b).to(tl.float32)
    greedy = temp <= 0.0
    return temp, greedy, (k > 0) & (k < V), p < 1.0, k, p


@triton.jit
def _load_x(logits_ptr, row_off, offs, valid, temp):
    """x = logits / T in fp32 (IEEE division like torch); -inf outside the row."""
    raw = tl.load(logits_ptr + row_off + offs, mask=valid, other=float("-inf")).to(tl.float32)
    return tl.div_rn(raw, tl.zeros_like(raw) + temp)


@triton.jit
def _row_stats(stats_ptr, row, NCHUNK, NCHUNK_PAD: tl.constexpr):
    """(M, Z, argmax, finite min) of a row from its slice stats, combined in slice order."""
    cs = tl.arange(0, NCHUNK_PAD)
    cm = cs < NCHUNK
    base = stats_ptr + (row * NCHUNK + cs) * 4
    mc = tl.load(base + 0, mask=cm, other=float("-inf"))
    sc = tl.load(base + 1, mask=cm, other=0.0)
    ic = tl.load(base + 2, mask=cm, other=float(MAX_VOCAB))
    xm = tl.load(base + 3, mask=cm, other=float("inf"))
    m = tl.max(mc, axis=0)
    z = tl.sum(tl.where(cm & (sc > 0), sc * tl.exp(mc - m), 0.0), axis=0)
    amax = tl.min(tl.where(mc == m, ic, float(MAX_VOCAB)), axis=0).to(tl.int32)  # first slice holding M
    return m, z, amax, tl.min(xm, axis=0)


@triton.jit
def _stats_kernel(logits_ptr, temp_ptr, stats_ptr, ticket_ptr, totals_ptr, T, V, stride_b, stride_t, NCHUNK, ROUNDS,
                  CHUNK: tl.constexpr, ROUNDS_PAD: tl.constexpr, TOTALS: tl.constexpr, TOTALS_PAD: tl.constexpr,
                  PDL: tl.constexpr):
    c = tl.program_id(0)
    row = tl.program_id(1)
    b = row // T
    row_off = b.to(tl.int64) * stride_b + (row - b * T).to(tl.int64) * stride_t
    offs = c * CHUNK + tl.arange(0, CHUNK)
    valid = offs < V
    if PDL:
        pdl_wait()
    temp = tl.load(temp_ptr + b).to(tl.float32)
    temp = tl.where(temp <= 0.0, 1.0, temp)                        # greedy rows: x = logits
    x = _load_x(logits_ptr, row_off, offs, valid, temp)
    if PDL:
        pdl_trigger()
    m = tl.max(x, axis=0)
    idx = tl.argmax(x, axis=0, tie_break_left=True) + c * CHUNK
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(tl.exp(x - m_safe), axis=0)
    xmin = tl.min(tl.where(valid & (x > float("-inf")), x, float("inf")), axis=0)
    base = stats_ptr + (row * NCHUNK + c) * 4
    tl.store(base + 0, m)
    tl.store(base + 1, s)
    tl.store(base + 2, idx.to(tl.float32))
    tl.store(base + 3, xmin)
    if c == 0:
        r = tl.arange(0, ROUNDS_PAD)
        tl.store(ticket_ptr + row * ROUNDS + r, tl.zeros([ROUNDS_PAD], tl.int32), mask=r < ROUNDS)
        zt = tl.arange(0, TOTALS_PAD)
        tl.store(totals_ptr + row * TOTALS + zt, tl.zeros([TOTALS_PAD], tl.int64), mask=zt < TOTALS)


@triton.jit
def _pick(vec, idx, at):
    """vec[at] as a scalar (vec indexed by idx)."""
    return tl.sum(tl.where(idx == at, vec, tl.zeros_like(vec)), axis=0)


@triton.jit
def _gather_load(scratch_ptr, cs, cm, ns, i0, CHUNK: tl.constexpr, NCHUNK_PAD: tl.constexpr):
    """Tokens i0 .. i0 + GATHER_VEC - 1 of every slice's compacted bracket, [slices, GATHER_VEC]. The mask is a whole
    vector's: past a slice's ns it reads the slice's own scratch, or for the row's last slice up to GATHER_VEC - 1
    elements past the row, which the launcher's allocation pads; _gather_stage masks them."""
    ii = i0 + tl.arange(0, GATHER_VEC)
    live = (ns > i0) & cm
    vec_ok = tl.broadcast_to(live[:, None], (NCHUNK_PAD, GATHER_VEC))
    return tl.load(scratch_ptr + cs[:, None] * CHUNK + ii[None, :], mask=vec_ok, other=0.0, cache_modifier=".cg")


@triton.jit
def _gather_stage(vals, stage, first, seen, cm, ns, nb, i0, lo, hi):
    """Appends the tokens of a _gather_load tile that lie in [lo, hi) to their slices' places in the stage list;
    returns the slices' counts so far."""
    ii = i0 + tl.arange(0, GATHER_VEC)
    inbin = (ii[None, :] < ns[:, None]) & cm[:, None] & (vals >= lo) & (vals < hi)
    rank = seen[:, None] + tl.cumsum(inbin.to(tl.int32), axis=1) - 1
    tl.store(stage + first[:, None] + rank, vals, mask=inbin & (rank < nb[:, None]))
    return seen + tl.sum(inbin.to(tl.int32), axis=1)


@triton.jit
def _exact(parts_ptr, scratch_ptr, stage_ptr, row, NCHUNK, j0, lo, hi, n, m, cnt_hi, mass_hi, target,
           PHASE: tl.constexpr, PSTRIDE: tl.constexpr, CHUNK: tl.constexpr, EXACT: tl.constexpr,
           NCHUNK_PAD: tl.constexpr, GJ: tl.constexpr):
    """Exact finish of the chosen bin [lo, hi) holding n <= EXACT tokens: gather them from every slice's
    compacted bracket tokens (in the output row's scratch) into one list, give each the score of the listed
    tokens strictly greater than it (pairwise, GJ at a time) plus the score above hi, and keep those whose
    score ahead stays below the target; tied tokens share their score ahead, so ties are kept or dropped
    together. Returns (threshold, mass and count of x >= threshold)."""
    cs = tl.arange(0, NCHUNK_PAD)
    cm = cs < NCHUNK
    pc = parts_ptr + (row * NCHUNK + cs) * PSTRIDE
    ns = tl.load(pc + PSTRIDE - 1, mask=cm, other=0.0, cache_modifier=".cg").to(tl.int32)  # compacted per slice
    nb = tl.load(pc + j0, mask=cm, other=0.0, cache_modifier=".cg").to(tl.int32)           # of them in the bin
    first = tl.cumsum(nb, axis=0) - nb                                # each slice's place in the gathered list
    stage = stage_ptr + row * EXACT
    seen = tl.zeros([NCHUNK_PAD], tl.int32)
    for i0 in range(0, tl.max(ns, axis=0), 4 * GATHER_VEC):
        # [slices, GATHER_VEC] tiles: a slice's GATHER_VEC tokens are one vector load in one thread, so the rank
        # (a cumsum along them) stays in the thread; four tiles' loads are issued before any is used
        v0 = _gather_load(scratch_ptr, cs, cm, ns, i0, CHUNK, NCHUNK_PAD)
        v1 = _gather_load(scratch_ptr, cs, cm, ns, i0 + GATHER_VEC, CHUNK, NCHUNK_PAD)
        v2 = _gather_load(scratch_ptr, cs, cm, ns, i0 + 2 * GATHER_VEC, CHUNK, NCHUNK_PAD)
        v3 = _gather_load(scratch_ptr, cs, cm, ns, i0 + 3 * GATHER_VEC, CHUNK, NCHUNK_PAD)
        seen = _gather_stage(v0, stage, first, seen, cm, ns, nb, i0, lo, hi)
        seen = _gather_stage(v1, stage, first, seen, cm, ns, nb, i0 + GATHER_VEC, lo, hi)
        seen = _gather_stage(v2, stage, first, seen, cm, ns, nb, i0 + 2 * GATHER_VEC, lo, hi)
        seen = _gather_stage(v3, stage, first, seen, cm, ns, nb, i0 + 3 * GATHER_VEC, lo, hi)
    tl.debug_barrier()
    pos = tl.arange(0, EXACT)
    live = pos < n
    xa = tl.load(stage + pos, mask=live, other=float("-inf"), cache_modifier=".cg")
    acc = tl.zeros([GJ, EXACT], tl.float32)        # [GJ, EXACT]: the listed tokens on the threads, summed once
    for q0 in range(0, n.to(tl.int32), GJ):
        qq = q0 + tl.arange(0, GJ)
        lq = qq < n
        xb = tl.load(stage + qq, mask=lq, other=float("-inf"), cache_modifier=".cg")
        if PHASE == 0:
            sb = lq.to(tl.float32)
        else:
            sb = tl.where(lq, tl.exp(xb - m), 0.0)
        acc += tl.where(xb[:, None] > xa[None, :], sb[:, None], 0.0)
    ahead = tl.sum(acc, axis=0)
    if PHASE == 0:
        ahead += cnt_hi
    else:
        ahead += mass_hi
    thr = tl.min(tl.where(live & (ahead < target), xa, float("inf")), axis=0)
    thr = tl.where(thr == float("inf"), tl.max(xa, axis=0), thr)      # (cannot happen: S(hi) < target)
    kept = live & (xa >= thr)
    w = tl.where(kept, tl.exp(xa - m), 0.0)
    return thr, mass_hi + tl.sum(w, axis=0), cnt_hi + tl.sum(kept.to(tl.float32), axis=0)


@triton.jit
def _decide(parts_ptr, tot_ptr, scratch_ptr, stage_ptr, st_ptr, row, NCHUNK, lo, hi, step, cnt_hi, mass_hi, m, p,
            k, PHASE: tl.constexpr, FIRST: tl.constexpr, NB: tl.constexpr, NB_MAX: tl.constexpr,
            CHUNK: tl.constexpr, EXACT: tl.constexpr, NCHUNK_PAD: tl.constexpr, GJ: tl.constexpr,
            LAST: tl.constexpr, SCAN_MAX: tl.constexpr, FINISH: tl.constexpr):
    """Last program of the row: read the row's bin totals (tot_ptr: counts, fixed-point masses), pick the bin
    holding the crossing of the target and store the row's next bracket (module docstring); a bracket of <= EXACT
    tokens is finished exactly instead (`_exact`), where its gather is short (no slice compacted more than
    SCAN_MAX bracket tokens this round) or no round of the phase is left (LAST); never without FINISH."""
    PSTRIDE: tl.constexpr = NB_MAX + 3
    r = tl.arange(0, NB)
    desc = NB - 1 - r                                             # position r holds bin NB-1-r (descending)
    cnt = tl.load(tot_ptr + desc, cache_modifier=".cg").to(tl.float32)          # the row's totals (exact)
    mass = tl.load(tot_ptr + NB_MAX + desc, cache_modifier=".cg").to(tl.float32) * MASS_ULP
    cs = tl.arange(0, NCHUNK_PAD)
    eb = parts_ptr + (row * NCHUNK + cs) * PSTRIDE + NB_MAX
    bmin = tl.min(tl.load(eb, mask=cs < NCHUNK, other=float("inf"), cache_modifier=".cg"), axis=0)
    bmax = tl.max(tl.load(eb + 1, mask=cs < NCHUNK, other=float("-inf"), cache_modifier=".cg"), axis=0)
    ccum = tl.cumsum(cnt, axis=0)                                 # count of bins >= NB-1-r
    mcum = tl.cumsum(mass, axis=0)
    n_total = tl.sum(cnt, axis=0)                                 # tokens in the bracket
    if FIRST:
        if PHASE == 0:
            target = k.to(tl.float32)
        else:
            target = tl.maximum(p * (mass_hi + tl.sum(mass, axis=0)), TINY)
    else:
        target = tl.load(st_ptr + 4)
    if PHASE == 0:
        above = cnt_hi + ccum
    else:
        above = mass_hi + mcum
    r0 = tl.sum((above < target).to(tl.int32), axis=0)           # first descending bin reaching the target
    keep_all = r0 == NB                                           # S(lo) < target: nothing to filter
    r0 = tl.minimum(r0, NB - 1)
    j0 = NB - 1 - r0
    n = _pick(cnt, r, r0)
    new_cnt_hi = cnt_hi + _pick(ccum, r, r0) - n
    new_mass_hi = mass_hi + _pick(mcum, r, r0) - _pick(mass, r, r0)
    new_lo = tl.maximum(tl.fma(j0.to(tl.float32), step, lo), lo)
    new_hi = tl.where(j0 == NB - 1, hi, tl.minimum(tl.fma((j0 + 1).to(tl.float32), step, lo), hi))
    resolved = (n <= 1.0) | (bmin == bmax) | (new_hi <= new_lo)
    if FIRST:
        new_lo = tl.where(keep_all, lo, new_lo)
        new_hi = tl.where(keep_all, hi, new_hi)
        new_cnt_hi = tl.where(keep_all, cnt_hi, new_cnt_hi)
        new_mass_hi = tl.where(keep_all, mass_hi, new_mass_hi)
        n = tl.where(keep_all, n_total, n)
        resolved = resolved | keep_all
    mass_lo = new_mass_hi + tl.where(keep_all, tl.sum(mass, axis=0), _pick(mass, r, r0))
    cnt_lo = new_cnt_hi + n
    finish = (n <= EXACT) & (resolved == 0) & FINISH
    if not LAST:                                                  # the gather's longest slice, read only if needed
        if finish:
            finish = tl.max(tl.load(parts_ptr + (row * NCHUNK + cs) * PSTRIDE + PSTRIDE - 1, mask=cs < NCHUNK,
                                    other=0.0, cache_modifier=".cg"), axis=0) <= SCAN_MAX
    if finish:
        new_lo, mass_lo, cnt_lo = _exact(parts_ptr, scratch_ptr, stage_ptr, row, NCHUNK, j0, new_lo, new_hi, n, m,
                                         new_cnt_hi, new_mass_hi, target, PHASE, PSTRIDE, CHUNK, EXACT,
                                         NCHUNK_PAD, GJ)
        resolved = n >= 0.0
    tl.store(st_ptr + 0, new_lo)
    tl.store(st_ptr + 1, new_hi)
    tl.store(st_ptr + 2, new_cnt_hi)
    tl.store(st_ptr + 3, new_mass_hi)
    tl.store(st_ptr + 4, target)
    tl.store(st_ptr + 5, resolved.to(tl.float32))
    tl.store(st_ptr + 6, mass_lo)
    tl.store(st_ptr + 7, cnt_lo)


@triton.jit
def _round_kernel(logits_ptr, temp_ptr, topk_ptr, topp_ptr, out_ptr, stats_ptr, parts_ptr, totals_ptr, stage_ptr,
                  state_ptr, ticket_ptr, T, V, stride_b, stride_t, NCHUNK, ROUNDS, ROUND,
                  PHASE: tl.constexpr, FIRST: tl.constexpr, NB: tl.constexpr, LOG2NB: tl.constexpr,
                  NB_MAX: tl.constexpr, SUB: tl.constexpr, CHUNK: tl.constexpr,
                  EXACT: tl.constexpr, NCHUNK_PAD: tl.constexpr, GJ: tl.constexpr,
                  LAST: tl.constexpr, SCAN_MAX: tl.constexpr, FINISH: tl.constexpr, PDL: tl.constexpr):
    """One bisection round (NB bins) of phase PHASE (0 top-k, 1 top-p) for every row that is searching."""
    PSTRIDE: tl.constexpr = NB_MAX + 3
    c = tl.program_id(0)
    row = tl.program_id(1)
    b = row // T
    if PDL:
        pdl_wait()
    temp, greedy, k_on, p_on, k, p = _row_params(temp_ptr, topk_ptr, topp_ptr, b, V)
    st = state_ptr + (row * 2 + PHASE) * STATE_FIELDS
    if PHASE == 0:
        active = (temp > 0.0) & k_on
    else:
        active = (temp > 0.0) & p_on
    if not FIRST:
        active = active & (tl.load(st + 5) == 0.0)
    if active:
        m, z, amax, xmin = _row_stats(stats_ptr, row, NCHUNK, NCHUNK_PAD)
        if FIRST:
            lo = xmin
            if PHASE == 1:
                lo_k = tl.load(state_ptr + row * 2 * STATE_FIELDS)   # the top-k threshold (phase 0, field lo)
                lo = tl.where(k_on, tl.maximum(lo_k, xmin), xmin)
            hi = float("inf")
            cnt_hi = 0.0
            mass_hi = 0.0
        else:
            lo = tl.load(st + 0)
            hi = tl.load(st + 1)
            cnt_hi = tl.load(st + 2)
            mass_hi = tl.load(st + 3)
        top = tl.where(hi == float("inf"), m, hi)
        step = (top - lo) / NB
        # compact this slice's bracket tokens into its slice of the output row (scratch until the write kernel)
        row_off = b.to(tl.int64) * stride_b + (row - b * T).to(tl.int64) * stride_t
        offs = c * CHUNK + tl.arange(0, CHUNK)
        valid = offs < V
        x = _load_x(logits_ptr, row_off, offs, valid, temp)
        if PDL:
            pdl_trigger()
        inb = valid & (x >= lo) & (x < hi)
        n = tl.sum(inb.to(tl.int32), axis=0)
        bmin = tl.min(tl.where(inb, x, float("inf")), axis=0)
        bmax = tl.max(tl.where(inb, x, float("-inf")), axis=0)
        row_scratch = out_ptr + row.to(tl.int64) * V
        scratch = row_scratch + c * CHUNK
        tl.store(scratch + tl.cumsum(inb.to(tl.int32), axis=0) - 1, x, mask=inb)
        tl.debug_barrier()
        # bins on dim 0, tokens on dim 1: a thread's tokens are its own (Triton spreads the fast dim over the
        # threads), so a token's exp, load and search run on few threads, not once a bin column
        bins = tl.arange(0, NB)
        cnt2 = tl.zeros([NB, SUB], tl.int32)
        mass2 = tl.zeros([NB, SUB], tl.float32)
        # software-pipelined by hand: the next step's tokens are loaded before this step's are binned (Triton does
        # not pipeline a plain load loop), so a step waits on no L2 round trip
        sub = tl.arange(0, SUB)
        xs_next = tl.load(scratch + sub, mask=sub < n, other=float("-inf"), cache_modifier=".cg")
        for s0 in range(0, n, SUB):
            so = s0 + sub
            sm = so < n
            xs = xs_next
            xs_next = tl.load(scratch + so + SUB, mask=so + SUB < n, other=float("-inf"), cache_modifier=".cg")
            w = tl.exp(xs - m)
            j = tl.zeros([SUB], tl.int32)
            for i in tl.static_range(LOG2NB):                    # largest j with x >= t(j), t(j) monotone
                cand = j + (1 << (LOG2NB - 1 - i))
                j = tl.where(xs >= tl.fma(cand.to(tl.float32), step, lo), cand, j)
            hot = tl.where(sm, j, NB)[None, :] == bins[:, None]  # a masked token in no bin
            cnt2 += hot.to(tl.int32)
            mass2 += tl.where(hot, w[None, :], 0.0)
        cnt_c = tl.sum(cnt2, axis=1)
        pb = parts_ptr + (row * NCHUNK + c) * PSTRIDE
        tl.store(pb + bins, cnt_c.to(tl.float32))                 # the slice's counts (the exact finish's offsets)
        tl.store(pb + NB_MAX, bmin)
        tl.store(pb + NB_MAX + 1, bmax)
        tl.store(pb + NB_MAX + 2, n.to(tl.float32))
        # the row's totals: integer adds, so their sum is the same in any arrival order (the mass in fixed point,
        # MASS_ULP a unit: the slice's fp32 sum truncated to 2^-38)
        tot = totals_ptr + (row * ROUNDS + ROUND) * 2 * NB_MAX
        used = cnt_c > 0
        tl.atomic_add(tot + bins, cnt_c.to(tl.int64), mask=used, sem="relaxed", scope="gpu")
        tl.atomic_add(tot + NB_MAX + bins, (tl.sum(mass2, axis=1) * MASS_SCALE).to(tl.int64), mask=used,
                      sem="relaxed", scope="gpu")
        tl.debug_barrier()                                        # every partial is written before the ticket
        ticket = tl.atomic_add(ticket_ptr + row * ROUNDS + ROUND, 1, sem="acq_rel", scope="gpu")
        if ticket == NCHUNK - 1:
            _decide(parts_ptr, tot, row_scratch, stage_ptr, st, row, NCHUNK, lo, hi, step, cnt_hi, mass_hi, m, p, k,
                    PHASE, FIRST, NB, NB_MAX, CHUNK, EXACT, NCHUNK_PAD, GJ, LAST, SCAN_MAX, FINISH)


@triton.jit
def _write_kernel(logits_ptr, temp_ptr, topk_ptr, topp_ptr, out_ptr, stats_ptr, state_ptr,
                  T, V, stride_b, stride_t, NCHUNK,
                  CHUNK: tl.constexpr, NCHUNK_PAD: tl.constexpr, PDL: tl.constexpr):
    c = tl.program_id(0)
    row = tl.program_id(1)
    b = row // T
    offs = c * CHUNK + tl.arange(0, CHUNK)
    valid = offs < V
    if PDL:
        pdl_wait()
    temp, greedy, k_on, p_on, k, p = _row_params(temp_ptr, topk_ptr, topp_ptr, b, V)
    m, z, amax, xmin = _row_stats(stats_ptr, row, NCHUNK, NCHUNK_PAD)
    if greedy:
        if PDL:
            pdl_trigger()
        probs = tl.where(offs == amax, 1.0, 0.0)
    else:
        row_off = b.to(tl.int64) * stride_b + (row - b * T).to(tl.int64) * stride_t
        x = _load_x(logits_ptr, row_off, offs, valid, temp)
        if PDL:
            pdl_trigger()
        st = state_ptr + (row * 2 + p_on.to(tl.int32)) * STATE_FIELDS   # top-p state if on, else top-k
        thr = tl.where(p_on | k_on, tl.load(st + 0), float("-inf"))
        norm = tl.where(p_on | k_on, tl.load(st + 6), z)
        e = tl.exp(x - m)
        probs = tl.where(x >= thr, tl.div_rn(e, tl.zeros_like(e) + norm), 0.0)
    tl.store(out_ptr + row.to(tl.int64) * V + offs, probs, mask=valid)


def _check(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> None:
    if logits.dim() != 3 or logits.dtype not in LOGIT_DTYPES:
        raise ValueError(f"filtered_probs: logits is {list(logits.shape)} {logits.dtype}, want [B, T, V] in "
                         f"{[str(d) for d in LOGIT_DTYPES]}")
    B, _, V = logits.shape
    for name, t in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        if t.shape != (B,):
            raise ValueError(f"filtered_probs: {name} has shape {list(t.shape)}, want [{B}] (logits is "
                             f"{list(logits.shape)})")
        if t.device != logits.device:
            raise ValueError(f"filtered_probs: {name} is on {t.device}, logits on {logits.device}")
    if top_k.dtype.is_floating_point or top_k.dtype == torch.bool:
        raise ValueError(f"filtered_probs: top_k is {top_k.dtype}, want an integer dtype")
    if not (temperature.dtype.is_floating_point and top_p.dtype.is_floating_point):
        raise ValueError(f"filtered_probs: temperature is {temperature.dtype} and top_p {top_p.dtype}, "
                         f"want floating dtypes")
    if V >= MAX_VOCAB.value:
        raise ValueError(f"filtered_probs: vocabulary {V} exceeds {MAX_VOCAB.value - 1}")


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   filters: int = 3, *, pdl: bool = False, config: FilteredProbsConfig | None = None) -> torch.Tensor:
    """fp32 probs [B, T, V] as torch.ops.lingc.filtered_probs (module docstring for ties and limits).
    filters (the op's static mask: 1 top-k, 2 top-p): a filter whose bit is clear is off for every row, so its
    rounds are not launched (plain: stats + write, 2 launches; top-p only: 5) and the rows read it as off; a row
    whose filter is off anyway gets the same bits as with every round launched (its rounds exit at once and write
    nothing). `config` overrides the tunables (tests, bench sweeps); pdl is dropped where unsupported."""
    _check(logits, temperature, top_k, top_p)
    if filters not in (0, 1, 2, 3):
        raise ValueError(f"filtered_probs: filters is a mask of 1 (top-k) and 2 (top-p), got {filters}")
    if not filters & 1:
        top_k = torch.zeros_like(top_k)          # what the op's reference does: top-k off for every row
    if not filters & 2:
        top_p = torch.ones_like(top_p)
    cfg = config or DEFAULT_CONFIG
    cfg.check()
    B, T, V = logits.shape
    dev = logits.device
    # GATHER_VEC spare elements past the last row: the exact finish's vector loads may read up to GATHER_VEC - 1 there
    out = torch.empty(B * T * V + GATHER_VEC.value, dtype=torch.float32, device=dev)[:B * T * V].view(B, T, V)
    rows = B * T
    if rows == 0 or V == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    temperature, top_k, top_p = temperature.contiguous(), top_k.contiguous(), top_p.contiguous()
    nchunk = triton.cdiv(V, cfg.chunk)
    nchunk_pad = triton.next_power_of_2(nchunk)
    bins_k = cfg.bins_k if filters & 1 else ()
    bins_p = cfg.bins_p if filters & 2 else ()
    schedule = [(0, i == 0, nb, i == len(bins_k) - 1) for i, nb in enumerate(bins_k)] + \
               [(1, i == 0, nb, i == len(bins_p) - 1) for i, nb in enumerate(bins_p)]
    nb_max = max((nb for _, _, nb, _ in schedule), default=2)   # (phase, first of phase, bins, last of phase)
    rounds = max(len(schedule), 1)         # the buffers' round axis (the stats kernel zeroes one ticket at least)
    stats = torch.empty((rows, nchunk, 4), dtype=torch.float32, device=dev)           # max, sumexp, argmax, min
    parts = torch.empty((rows, nchunk, nb_max + 3), dtype=torch.float32, device=dev)  # counts, min, max, n
    totals = torch.empty((rows, rounds, 2, nb_max), dtype=torch.int64, device=dev)   # zeroed by the stats kernel
    stage = torch.empty((rows, cfg.exact), dtype=torch.float32, device=dev)           # exact-finish list
    state = torch.empty((rows, 2, STATE_FIELDS.value), dtype=torch.float32, device=dev)  # per phase
    tickets = torch.empty((rows, rounds), dtype=torch.int32, device=dev)              # zeroed by the stats kernel
    pdl = pdl and pdl_supported(dev)
    grid = (nchunk, rows)
    common = dict(CHUNK=cfg.chunk, PDL=pdl, num_warps=cfg.num_warps, **({"launch_pdl": True} if pdl else {}))
    strides = (logits.stride(0), logits.stride(1))
    _stats_kernel[grid](logits, temperature, stats, tickets, totals, T, V, *strides, nchunk, rounds,
                        ROUNDS_PAD=max(2, triton.next_power_of_2(rounds)), TOTALS=rounds * 2 * nb_max,
                        TOTALS_PAD=triton.next_power_of_2(rounds * 2 * nb_max), **common)
    for i, (phase, first, nb, last) in enumerate(schedule):
        _round_kernel[grid](logits, temperature, top_k, top_p, out, stats, parts, totals, stage, state, tickets,
                            T, V, *strides, nchunk, rounds, i,
                            PHASE=phase, FIRST=first, NB=nb, LOG2NB=nb.bit_length() - 1, NB_MAX=nb_max,
                            SUB=cfg.cell // nb, EXACT=cfg.exact, NCHUNK_PAD=nchunk_pad,
                            GJ=max(1, PAIR_TILE // cfg.exact),
                            LAST=last, SCAN_MAX=cfg.scan_max, FINISH=cfg.finish, **common)
    _write_kernel[grid](logits, temperature, top_k, top_p, out, stats, state, T, V, *strides, nchunk,
                        NCHUNK_PAD=nchunk_pad, **common)
    return out


def filtered_probs_ref(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                       top_p: torch.Tensor) -> torch.Tensor:
    """lingc's reference (sorts every row)."""
    return torch.ops.lingc.filtered_probs(logits, temperature, top_k, top_p)


LOWERINGS = {"filtered_probs": filtered_probs}
