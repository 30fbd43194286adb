"""H200 benchmark of the MLA decode kernels (lingc.kernels.mla) at Ling-3.0-tiny shapes vs torch.

Attention (H=16, N=128, Rr=64, R=512, Vd=128, pages of 16 rows in shuffled order, capacity MP*PS = 8192 rows,
B=1) at T=1 (decode) and T=6 (a verify chain), context 8192 and 1024 (positions end at ctx-1). Per case:
  (a) the kernel vs torch.ops.lingc.mla_attention (max_abs_err, rel_err = max_abs_err / max|ref|, bit_exact;
      ok = rel_err <= REL_TOL), row invariance (each query of the chain alone as a T=1 call, torch.equal),
      determinism (two runs equal);
  (b) pdl=True == pdl=False bit for bit;
  (c) time with cold caches and weights: C distinct (kv_pages, kv_b) copies, C from `cold_copies` over the
      bytes one call touches, called back to back in one CUDA graph (bench/timing.py); time_us is the
      launcher with PDL on (as the runtime runs it), time_us_nopdl without. Baselines timed the same way:
      ref_time_us = the torch reference op (expands K/V with kv_b in fp32: compute bound, 2 copies),
      absorbed_torch_us = plain torch with absorption (q_lat einsum, fp32 softmax over the gathered
      cache, einsums; bf16 matmuls). FlashInfer's MLA core is timed only if `import flashinfer` works.
bytes = cache rows read (ctx * 576 * 2) + kv_b (4 MB) + q and out; gbps = cache bytes / time (the brief's
measure), total_gbps = bytes / time. A tunable sweep (SPLIT_ROWS x BLOCK_N x warps x stages x the combine's blocks) follows at
context 8192, rows for mla_cache_write, rope and sigmoid_gate (tiny: launch bound), and fuse_mla's kernels against the
launches they replace (mla_prep; mla_attention with its gate; ok = bit-exact) close the table.

    python3 bench/kernel_mla.py [--json $OUT/mla.json]
    python3 bench/kernel_mla.py --tiles [--json ...]   # the split at SPLIT_TILE_ROWS 16 and 64 only
    python3 bench/kernel_mla.py --gluon [--json ...]   # the Gluon split (kernels/mla_gluon.py) against the Triton one
    python3 bench/kernel_mla.py --combine-absorb [--json ...]   # COMBINE_ABSORB on and off (kernels/mla.py)
    python3 bench/kernel_mla.py --qa-tile [--json ...]          # QA_TILE (q_absorb's tile form) on and off
    python3 bench/kernel_mla.py --va-tile [--json ...]          # VA_TILE (v_absorb's tile form) on and off
    python3 bench/kernel_mla.py --swap [--json ...]             # the swapped Gluon split (mla_gluon SWAP) on and off
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import cold_copies, graph_time_us, nbytes  # noqa: E402

H, N, RR, R, VD = 16, 128, 64, 512, 128
PS, CAPACITY = 16, 8192
SCALE = (N + RR) ** -0.5
THETA = 6e6
REL_TOL = 2e-2          # bf16 absorbed vs fp32-expanded reference, relative to max|ref|
CASES = [(1, 8192), (6, 8192), (1, 1024), (6, 1024)]
# (split_rows, block_n, warps, stages, combine splits per step, combine columns per program); the first row is
# the combine as it was before 2026-11-30's second session (32 splits per step, 64 columns)
SWEEP = [(64, 32, 4, 2, 32, 64), (64, 32, 4, 2, 128, 32), (64, 32, 4, 2, 128, 64), (64, 32, 4, 2, 64, 32),
         (64, 64, 8, 2, 128, 32), (128, 64, 8, 2, 64, 32), (128, 32, 4, 3, 64, 32), (128, 64, 8, 2, 64, 64),
         (256, 64, 8, 2, 32, 32)]
BF16 = torch.bfloat16


def _torch_absorbed(q_nope, q_rope, kv_pages, kv_b, page_rows, positions, scale):
    """Plain torch weight-absorbed MLA: bf16 einsums, fp32 softmax over the whole gathered capacity."""
    B, T, Hh, Nn = q_nope.shape
    Rk = kv_b.shape[1]
    w = kv_b.view(Hh, -1, Rk)                                                      # [H, N + Vd, R]
    lat = kv_pages[page_rows.long()].flatten(1, 2)                                 # [B, MP*PS, L]
    c, kr = lat[..., :Rk], lat[..., Rk:]
    q_lat = torch.einsum("bthn,hnr->bthr", q_nope, w[:, :Nn])                      # [B, T, H, R]
    scores = (torch.einsum("bthr,bsr->bths", q_lat, c) + torch.einsum("bthe,bse->bths", q_rope, kr)).float()
    visible = torch.arange(lat.shape[1], device=lat.device).view(1, 1, 1, -1) <= positions[:, :, None, None]
    p = torch.softmax((scores * scale).masked_fill(~visible, -torch.inf), dim=-1)
    o_lat = torch.einsum("bths,bsr->bthr", p.to(q_nope.dtype), c)                  # [B, T, H, R]
    return torch.einsum("bthr,hvr->bthv", o_lat, w[:, Nn:])                         # [B, T, H, Vd]


def _case(T: int, ctx: int, copies: int, seed: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    mp = CAPACITY // PS
    pool = mp + 8
    page_rows = torch.randperm(pool, device="cuda", generator=g)[:mp].view(1, mp).to(torch.int32)
    positions = torch.arange(ctx - T, ctx, device="cuda").view(1, T)
    q = (3 * torch.randn(1, T, H, N + RR, device="cuda", generator=g)).to(BF16)     # peaky enough scores
    kv0 = torch.randn(pool, PS, R + RR, device="cuda", generator=g).to(BF16)
    w0 = (torch.randn(H * (N + VD), R, device="cuda", generator=g) * R ** -0.5).to(BF16)
    return {"q_nope": q[..., :N], "q_rope": q[..., N:], "page_rows": page_rows, "positions": positions,
            "kv": [kv0] + [kv0.clone() for _ in range(copies - 1)],
            "w": [w0] + [w0.clone() for _ in range(copies - 1)]}


def _time(calls, repeats: int = 30) -> float:
    try:
        return graph_time_us(calls, repeats=repeats, warmup=2)
    except Exception as e:  # noqa: BLE001 (a baseline that cannot be captured must not stop the bench)
        print(f"timing failed: {e!r}", file=sys.stderr)
        return float("nan")


def _flashinfer_core_us(c: dict, ctx: int, q_lat_like: torch.Tensor) -> float | None:
    """FlashInfer's MLA core (absorbed q in, latent out; no absorptions) if flashinfer imports, else None."""
    try:
        import flashinfer  # noqa: F401
        from flashinfer.mla import BatchMLAPagedAttentionWrapper
    except Exception:  # noqa: BLE001
        return None
    try:
        T = q_lat_like.shape[1]
        pages = -(-ctx // PS)
        ws = torch.empty(128 * 2**20, dtype=torch.int8, device="cuda")
        wrapper = BatchMLAPagedAttentionWrapper(ws, backend="auto")
        ckv = [kv[..., :R].contiguous() for kv in c["kv"]]
        kpe = [kv[..., R:].contiguous() for kv in c["kv"]]
        wrapper.plan(torch.tensor([0, T], dtype=torch.int32, device="cuda"),
                     torch.tensor([0, pages], dtype=torch.int32, device="cuda"),
                     c["page_rows"][0, :pages].contiguous(), torch.tensor([ctx], dtype=torch.int32, device="cuda"),
                     H, R, RR, PS, True, SCALE, BF16, BF16)
        q_nope = q_lat_like[0].contiguous()                                        # [T, H, R]
        q_pe = c["q_rope"][0].contiguous()                                         # [T, H, Rr]
        return _time([lambda a=a, b=b: wrapper.run(q_nope, q_pe, a, b) for a, b in zip(ckv, kpe)])
    except Exception as e:  # noqa: BLE001
        print(f"flashinfer MLA skipped: {e!r}", file=sys.stderr)
        return None


def _attention_rows(T: int, ctx: int, sweep: list[tuple] = SWEEP) -> list[dict]:
    from lingc.kernels.mla import _mla_attention, mla_attention, mla_attention_ref, pdl_supported

    cache_bytes = ctx * (R + RR) * 2
    weight_bytes = H * (N + VD) * R * 2
    touched = cache_bytes + weight_bytes
    copies = cold_copies(touched)
    c = _case(T, ctx, copies, seed=T * 10 + ctx)
    qn, qr, pr, pos = c["q_nope"], c["q_rope"], c["page_rows"], c["positions"]
    kv, w = c["kv"][0], c["w"][0]
    ref = mla_attention_ref(qn, qr, kv, w, pr, pos, SCALE)
    out = mla_attention(qn, qr, kv, w, pr, pos, SCALE)
    out_pdl = mla_attention(qn, qr, kv, w, pr, pos, SCALE, pdl=True)
    again = mla_attention(qn, qr, kv, w, pr, pos, SCALE)
    alone = torch.cat([mla_attention(qn[:, t:t + 1], qr[:, t:t + 1], kv, w, pr, pos[:, t:t + 1], SCALE)
                       for t in range(T)], dim=1)
    absorbed = _torch_absorbed(qn, qr, kv, w, pr, pos, SCALE)
    err = (out.float() - ref.float()).abs().max().item()
    rel = err / max(ref.float().abs().max().item(), 1e-30)
    io_bytes = nbytes(qn, qr, out)
    pdl = pdl_supported(qn.device)
    t_pdl = _time([lambda k=k, v=v: mla_attention(qn, qr, k, v, pr, pos, SCALE, pdl=pdl)
                   for k, v in zip(c["kv"], c["w"])])
    t_plain = _time([lambda k=k, v=v: mla_attention(qn, qr, k, v, pr, pos, SCALE) for k, v in zip(c["kv"], c["w"])])
    t_ref = _time([lambda k=k, v=v: mla_attention_ref(qn, qr, k, v, pr, pos, SCALE)
                   for k, v in zip(c["kv"][:2], c["w"][:2])], repeats=5)
    t_abs = _time([lambda k=k, v=v: _torch_absorbed(qn, qr, k, v, pr, pos, SCALE) for k, v in zip(c["kv"], c["w"])])
    shape = f"B1-T{T}-H{H}-ctx{ctx}-PS{PS}-cap{CAPACITY}"
    exact_checks = torch.equal(out, alone) and torch.equal(out, again) and torch.equal(out, out_pdl)
    rows = [{
        "kernel": "mla_attention", "shape": shape, "ok": bool(rel <= REL_TOL and exact_checks),
        "max_abs_err": err, "rel_err": rel, "bit_exact": bool(torch.equal(out, ref)),
        "pdl_equal": bool(torch.equal(out, out_pdl)), "row_invariant": bool(torch.equal(out, alone)),
        "deterministic": bool(torch.equal(out, again)), "pdl": pdl, "time_us": t_pdl, "time_us_nopdl": t_plain,
        "ref_time_us": t_ref, "absorbed_torch_us": t_abs,
        "absorbed_torch_rel_err": (absorbed.float() - ref.float()).abs().max().item()
        / max(ref.float().abs().max().item(), 1e-30),
        "bytes": touched + io_bytes, "cache_bytes": cache_bytes, "weight_bytes": weight_bytes,
        "gbps": cache_bytes / t_pdl / 1e3, "total_gbps": (touched + io_bytes) / t_pdl / 1e3,
        "copies": copies,
    }]
    q_lat = torch.einsum("bthn,hnr->bthr", qn, w.view(H, N + VD, R)[:, :N])
    fi = _flashinfer_core_us(c, ctx, q_lat)
    if fi is not None:
        rows[0]["flashinfer_core_us"] = fi
    if ctx == CAPACITY:
        for split, bn, warps, stages, cb_s, cb_r in sweep:
            kw = dict(split_rows=split, block_n=bn, split_warps=warps, split_stages=stages, combine_block_s=cb_s,
                      combine_block_r=cb_r)
            try:
                o = _mla_attention(qn, qr, kv, w, pr, pos, SCALE, **kw)
                e = (o.float() - ref.float()).abs().max().item()
                t = _time([lambda k=k, v=v: _mla_attention(qn, qr, k, v, pr, pos, SCALE, pdl=pdl, **kw)
                           for k, v in zip(c["kv"], c["w"])], repeats=15)
            except Exception as ex:  # noqa: BLE001
                print(f"sweep {kw} failed: {ex!r}", file=sys.stderr)
                continue
            rows.append({"kernel": f"mla_attention[S{split}-N{bn}-w{warps}-s{stages}-cb{cb_s}x{cb_r}]", "shape": shape,
                         "ok": bool(e / max(ref.float().abs().max().item(), 1e-30) <= REL_TOL),
                         "max_abs_err": e, "bit_exact": bool(torch.equal(o, ref)), "pdl_equal": None,
                         "time_us": t, "ref_time_us": t_ref, "bytes": touched + io_bytes,
                         "gbps": cache_bytes / t / 1e3})
    del c
    torch.cuda.empty_cache()
    return rows


def _small_rows(T: int) -> list[dict]:
    """mla_cache_write, rope (q and k style) and sigmoid_gate at T tokens: exactness and launch-bound time."""
    from lingc.kernels.mla import (mla_cache_write, mla_cache_write_ref, pdl_supported, rope, rope_ref,
                                   sigmoid_gate, sigmoid_gate_ref)

    g = torch.Generator(device="cuda").manual_seed(T)
    dev = torch.device("cuda")
    pdl = pdl_supported(dev)
    copies = 8
    rows = []

    def row(name, shape, got, got_pdl, want, fn, ref_fn, moved):
        t, t_ref = _time([fn] * copies), _time([ref_fn] * copies)
        err = (got.float() - want.float()).abs().max().item()
        bound = 2.0**-7 * max(1.0, want.float().abs().max().item())                # one bf16 rounding
        rows.append({"kernel": name, "shape": shape, "ok": bool(err <= bound),
                     "max_abs_err": err, "bit_exact": bool(torch.equal(got, want)),
                     "pdl_equal": bool(torch.equal(got, got_pdl)), "time_us": t, "ref_time_us": t_ref,
                     "bytes": moved, "gbps": moved / t / 1e3})

    kv = torch.randn(CAPACITY // PS + 8, PS, R + RR, device=dev, generator=g).to(BF16)
    latent = torch.randn(1, T, R + RR, device=dev, generator=g).to(BF16)
    locs = torch.randperm(kv.shape[0] * PS, device=dev, generator=g)[:T].view(1, T)
    a, b, c = kv.clone(), kv.clone(), kv.clone()
    mla_cache_write(a, latent, locs)
    mla_cache_write(b, latent, locs, pdl=True)
    mla_cache_write_ref(c, latent, locs)
    row("mla_cache_write", f"B1-T{T}-L{R + RR}", a, b, c, lambda: mla_cache_write(a, latent, locs, pdl=pdl),
        lambda: mla_cache_write_ref(c, latent, locs), 2 * nbytes(latent))

    pos = torch.arange(8192 - T, 8192, device=dev).view(1, T)
    q = torch.randn(1, T, H, N + RR, device=dev, generator=g).to(BF16)[..., N:]     # q_rope view of q
    k = torch.randn(1, T, R + RR, device=dev, generator=g).to(BF16)[..., R:].unsqueeze(2)   # k_rope view
    for name, x in (("rope_q", q), ("rope_k", k)):
        row(name, f"B1-T{T}-n{x.shape[2]}-Rr{RR}", rope(x, pos, THETA), rope(x, pos, THETA, pdl=True),
            rope_ref(x, pos, THETA), lambda x=x: rope(x, pos, THETA, pdl=pdl), lambda x=x: rope_ref(x, pos, THETA),
            2 * nbytes(x))
    x = torch.randn(1, T, H, VD, device=dev, generator=g).to(BF16)
    logits = (4 * torch.randn(1, T, H, device=dev, generator=g)).to(BF16)
    row("sigmoid_gate", f"B1-T{T}-H{H}-V{VD}", sigmoid_gate(x, logits), sigmoid_gate(x, logits, pdl=True),
        sigmoid_gate_ref(x, logits), lambda: sigmoid_gate(x, logits, pdl=pdl), lambda: sigmoid_gate_ref(x, logits),
        2 * nbytes(x) + nbytes(logits))
    return rows


def _fuse_mla_rows(T: int, dev: torch.device = torch.device("cuda"), ctx: int = CAPACITY) -> list[dict]:
    """fuse_mla's kernels at T tokens against the launches they replace, on the same inputs: mla_prep vs rope (q, k)
    + rmsnorm + cat + mla_cache_write, and mla_attention with its gate vs mla_attention then sigmoid_gate. ok =
    bit_exact (the pass declares numerics unchanged: this is the device check of that claim); time_us vs
    unfused_time_us is the launch time it saves (PDL on where supported, warm inputs)."""
    from lingc.kernels.mla import mla_attention, mla_cache_write, mla_prep, pdl_supported, rope, sigmoid_gate
    from lingc.kernels.rmsnorm import rmsnorm

    g = torch.Generator(device=dev).manual_seed(100 + T)
    pdl, copies, q_lora = pdl_supported(dev), 8, 256            # the kv_a part sits after q_a in the fused projection
    pos = torch.arange(ctx - T, ctx, device=dev).view(1, T)
    q_pe = torch.randn(1, T, H, N + RR, device=dev, generator=g).to(BF16)[..., N:]
    kv_a = (3 * torch.randn(1, T, q_lora + R + RR + H, device=dev, generator=g)).to(BF16)
    c_kv, k_pe = kv_a[..., q_lora:q_lora + R], kv_a[..., q_lora + R:q_lora + R + RR]
    w = (1 + 0.1 * torch.randn(R, device=dev, generator=g)).to(BF16)
    kv = torch.randn(ctx // PS + 8, PS, R + RR, device=dev, generator=g).to(BF16)
    locs = torch.randperm(kv.shape[0] * PS, device=dev, generator=g)[:T].view(1, T)

    def prep(pages: torch.Tensor, on: bool) -> torch.Tensor:
        return mla_prep(q_pe, c_kv, k_pe, w, pages, locs, pos, THETA, 1e-6, pdl=on)

    def unfused_prep(pages: torch.Tensor, on: bool) -> torch.Tensor:
        k_rope = rope(k_pe.unsqueeze(2), pos, THETA, pdl=on).squeeze(2)
        latent = torch.cat([rmsnorm(c_kv, w, 1e-6, pdl=on), k_rope], dim=-1)
        q_rope = rope(q_pe, pos, THETA, pdl=on)
        mla_cache_write(pages, latent, locs, pdl=on)
        return q_rope

    a, b, c = kv.clone(), kv.clone(), kv.clone()
    got, got_nopdl, want = prep(a, pdl), prep(b, False), unfused_prep(c, pdl)
    rows = [{"kernel": "mla_prep", "shape": f"B1-T{T}-H{H}-R{R}-Rr{RR}",
             "ok": bool(torch.equal(got, want) and torch.equal(a, c)), "bit_exact": bool(torch.equal(got, want)),
             "cache_bit_exact": bool(torch.equal(a, c)),
             "pdl_equal": bool(torch.equal(got, got_nopdl) and torch.equal(a, b)),
             "time_us": _time([lambda: prep(a, pdl)] * copies),
             "unfused_time_us": _time([lambda: unfused_prep(c, pdl)] * copies)}]

    q_nope = torch.randn(1, T, H, N, device=dev, generator=g).to(BF16)
    kv_b = (torch.randn(H * (N + VD), R, device=dev, generator=g) * R ** -0.5).to(BF16)
    page_rows = torch.randperm(kv.shape[0], device=dev, generator=g)[:ctx // PS].view(1, -1).to(torch.int32)
    logits = (4 * torch.randn(1, T, H, device=dev, generator=g)).to(BF16)

    def gated(on: bool) -> torch.Tensor:
        return mla_attention(q_nope, got, kv, kv_b, page_rows, pos, SCALE, logits, pdl=on)

    def unfused_gated(on: bool) -> torch.Tensor:
        return sigmoid_gate(mla_attention(q_nope, got, kv, kv_b, page_rows, pos, SCALE, pdl=on), logits, pdl=on)

    out, out_nopdl, want = gated(pdl), gated(False), unfused_gated(pdl)
    rows.append({"kernel": "mla_attention+gate", "shape": f"B1-T{T}-H{H}-ctx{ctx}-PS{PS}",
                 "ok": bool(torch.equal(out, want)), "bit_exact": bool(torch.equal(out, want)),
                 "pdl_equal": bool(torch.equal(out, out_nopdl)), "time_us": _time([lambda: gated(pdl)] * copies),
                 "unfused_time_us": _time([lambda: unfused_gated(pdl)] * copies)})
    return rows


def run(device: torch.device) -> list[dict]:
    """Every row of the table (see the module docstring); device must be a CUDA device."""
    import lingc  # noqa: F401  (registers the reference ops)

    with torch.cuda.device(device):
        rows = []
        for T, ctx in CASES:
            rows += _attention_rows(T, ctx)
        for T in (1, 6):
            rows += _small_rows(T)
            rows += _fuse_mla_rows(T)
    for r in rows:
        for k, v in r.items():
            if isinstance(v, float) and math.isnan(v):
                r[k] = None
    return rows


def tile_rows(tiles: tuple[int, ...] = (16, 64)) -> list[dict]:
    """The split at each SPLIT_TILE_ROWS (kernels/mla.py) at context 8192, 1 and 6 queries: the attention row's
    checks and time (no sweep), and whether each tile gives the first tile's bits on one fixed case per T."""
    import lingc.kernels.mla as K

    saved = K.SPLIT_TILE_ROWS
    rows, outs = [], {}
    try:
        for tile in tiles:
            K.SPLIT_TILE_ROWS = tile
            for T in (1, 6):
                r = _attention_rows(T, CAPACITY, sweep=[])[0]
                keep = {k: r[k] for k in ("shape", "time_us", "rel_err", "row_invariant", "pdl_equal",
                                          "deterministic", "ok")}
                c = _case(T, CAPACITY, 1, seed=7)
                outs[tile, T] = K.mla_attention(c["q_nope"], c["q_rope"], c["kv"][0], c["w"][0], c["page_rows"],
                                                c["positions"], SCALE)
                first = outs[tiles[0], T]
                keep.update(kernel=f"mla_attention[tile{tile}]", tile_rows=tile, T=T,
                            equal_first_tile=bool(torch.equal(first, outs[tile, T])),
                            max_diff_first_tile=(first.float() - outs[tile, T].float()).abs().max().item())
                rows.append(keep)
    finally:
        K.SPLIT_TILE_ROWS = saved
    return rows


def gluon_rows() -> list[dict]:
    """mla_attention with the Gluon split (kernels/mla_gluon.py; its bf16 partials, then fp32 ones) and with the
    Triton split, 1 and 6 queries at contexts 8192 and 1024 (most splits past the positions): the attention row's
    checks (reference tolerance, row invariance, PDL on == off, determinism) and time for each, and each Gluon row's
    largest difference from the Triton split's output (max_diff_triton) and from the fp32-partial Gluon row's."""
    import lingc.kernels.mla as K
    import lingc.kernels.mla_gluon as MG

    saved = MG.ENABLED, MG.PARTIAL_BF16
    rows = []
    try:
        for T, ctx in CASES:
            c = _case(T, ctx, 1, seed=11 + T)
            outs = {}
            for name, on, bf16 in (("gluon", True, True), ("gluon-fp32-partials", True, False),
                                   ("triton", False, False)):
                MG.ENABLED, MG.PARTIAL_BF16 = on, bf16
                r = _attention_rows(T, ctx, sweep=[])[0]
                outs[name] = K.mla_attention(c["q_nope"], c["q_rope"], c["kv"][0], c["w"][0], c["page_rows"],
                                             c["positions"], SCALE)
                keep = {k: r[k] for k in ("shape", "time_us", "time_us_nopdl", "rel_err", "row_invariant",
                                          "pdl_equal", "deterministic", "ok")}
                keep.update(kernel=f"mla_attention[{name}]", T=T, ctx=ctx,
                            gluon_ran=bool(on and MG.eligible(c["kv"][0], c["q_rope"], H, R, RR, K.SPLIT_ROWS)))
                rows.append(keep)
            for row, name in zip(rows[-3:-1], ("gluon", "gluon-fp32-partials")):
                row["max_diff_triton"] = (outs[name].float() - outs["triton"].float()).abs().max().item()
            rows[-3]["max_diff_fp32_partials"] = (outs["gluon"].float()
                                                  - outs["gluon-fp32-partials"].float()).abs().max().item()
            del c
    finally:
        MG.ENABLED, MG.PARTIAL_BF16 = saved
    return rows


def flag_rows(flag: str, on_name: str, off_name: str, module: str = "lingc.kernels.mla") -> list[dict]:
    """mla_attention with the boolean flag `flag` of `module` (kernels/mla.py by default) on and off, 1 and 6 queries
    at context 8192: the attention row's checks (reference tolerance, row invariance, PDL on == off, determinism) and
    time for each, and the on row's largest difference from the off row's output (`max_diff_<off_name>`)."""
    import importlib

    K = importlib.import_module("lingc.kernels.mla")
    F = importlib.import_module(module)
    saved = getattr(F, flag)
    rows = []
    try:
        for T, ctx in CASES[:2]:
            c = _case(T, ctx, 1, seed=13 + T)
            outs = {}
            for name, on in ((on_name, True), (off_name, False)):
                setattr(F, flag, on)
                r = _attention_rows(T, ctx, sweep=[])[0]
                outs[name] = K.mla_attention(c["q_nope"], c["q_rope"], c["kv"][0], c["w"][0], c["page_rows"],
                                             c["positions"], SCALE)
                keep = {k: r[k] for k in ("shape", "time_us", "time_us_nopdl", "rel_err", "row_invariant",
                                          "pdl_equal", "deterministic", "ok")}
                keep.update(kernel=f"mla_attention[{name}]", T=T, ctx=ctx)
                rows.append(keep)
            rows[-2][f"max_diff_{off_name.replace('-', '_')}"] = (outs[on_name].float()
                                                                   - outs[off_name].float()).abs().max().item()
            del c
    finally:
        setattr(F, flag, saved)
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    ap.add_argument("--tiles", action="store_true",
                    help="only the split at SPLIT_TILE_ROWS 16 and 64 (time, checks, bits against 16)")
    ap.add_argument("--gluon", action="store_true",
                    help="only mla_attention with the Gluon split against the Triton split (checks, time, bits)")
    ap.add_argument("--combine-absorb", action="store_true",
                    help="only mla_attention with COMBINE_ABSORB on and off (checks, time, bits)")
    ap.add_argument("--qa-tile", action="store_true",
                    help="only mla_attention with q_absorb's tile form (QA_TILE) on and off (checks, time, bits)")
    ap.add_argument("--va-tile", action="store_true",
                    help="only mla_attention with v_absorb's tile form (VA_TILE) on and off (checks, time, bits)")
    ap.add_argument("--swap", action="store_true",
                    help="only mla_attention with the swapped Gluon split (kernels/mla_gluon.py SWAP) on and off")
    args = ap.parse_args()
    if args.swap:
        import lingc  # noqa: F401  (registers the reference ops)
        all_rows = flag_rows("SWAP", "gluon-swap", "gluon", module="lingc.kernels.mla_gluon")
    elif args.combine_absorb:
        import lingc  # noqa: F401  (registers the reference ops)
        all_rows = flag_rows("COMBINE_ABSORB", "combine-absorb", "two-launches")
    elif args.qa_tile or args.va_tile:
        import lingc  # noqa: F401  (registers the reference ops)
        all_rows = (flag_rows("QA_TILE", "qa-tile", "qa-per-query") if args.qa_tile else []) + \
            (flag_rows("VA_TILE", "va-tile", "va-per-query") if args.va_tile else [])
    elif args.gluon:
        import lingc  # noqa: F401  (registers the reference ops)
        all_rows = gluon_rows()
    elif args.tiles:
        import lingc  # noqa: F401  (registers the reference ops)
        all_rows = tile_rows()
    else:
        all_rows = run(torch.device("cuda"))
    for r in all_rows:
        print(json.dumps(r), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": all_rows}, f, indent=1)
