"""H200 benchmark of the skinny-GEMM kernel (lingc.kernels.linear) on Ling-3.0-tiny decode shapes vs cuBLAS.

For every shape at M = 1 (decode) and M = 6 (a verify chain): correctness first (kernel vs a float64 product
within the fp32-accumulation + rounding bound of tests/kernels/test_linear.py, kernel vs the torch reference
F.linear = cuBLAS, row invariance: each row alone == all rows bit for bit, split-K determinism: two runs
equal), then time with cold weights: C distinct weight copies (C * bytes >= COLD_FACTOR x L2, see
bench/timing.py) are called back to back inside one CUDA graph, the graph is replayed, the median replay /
C is the time of one call. Bytes = N*K*w + M*K*x + M*N*y; GB/s = bytes / time. The baseline is
torch.nn.functional.linear in the weight dtype (cuBLAS GEMV / GEMM), timed the same way.

Sweep (--sweep): for each shape a few configs of both kernel kinds (BLOCK_N x BLOCK_K x rows x SPLIT_K,
filtered to a sensible CTA count, shared-memory and register size, see `candidates`) are timed at M = 1 and
M = 6 with fewer repeats and fewer weight copies; the two best by the sum and the two best at M = 1 are
re-timed like the chosen config; the report shows the best of those next to the table's choice
(`pick_config`). To retune: run with --sweep, copy the winners per shape class into CONFIG_TABLE in
kernels/linear.py, rerun without --sweep to confirm.

    python3 bench/kernel_linear.py [--sweep] [--only NAME,...] --json $OUT/linear.json

Norm rows (--norm): fuse_norm_linear's fused kernel ([add_]rmsnorm_linear: the norm in the GEMV's prologue) vs
the two launches it replaces ([add_]rmsnorm kernel, then the linear kernel), at M = 1 and M = 6 on the norm ->
linear pairs of a Ling-3.0-tiny decode step (NORM_SHAPES), both timed the same way (cold weights, one CUDA graph,
PDL off and on); checks: y within the linear bound + a normed element's rounding, the new residual bit-exact,
PDL on == off, row invariance, y vs the unfused kernels (max_abs_err, bit_exact).

    python3 bench/kernel_linear.py --norm [--only NAME,...] --json $OUT/linear-norm.json

Gated rows (--gated): gated_rmsnorm_linear (KDA's o_norm built block by block inside the o_proj GEMV, H = 16 heads
of D = 128, N = 1536) vs the gated_rmsnorm kernel then the linear kernel, at M = 1 and M = 6, timed the same way;
checks: y vs the reference op and vs the unfused kernels (max_abs_err), row invariance and repeat bits, each with PDL
off and on, and PDL on == off unless the PDL launch takes the Gluon TMA kernel (`pdl_path_tma`: kernels/linear_tma.py
GATED, its own bits).

    python3 bench/kernel_linear.py --gated --json $OUT/linear-gated.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
from dataclasses import asdict, dataclass

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import cold_copies, graph_time_us, hbm_bandwidth_gbps  # noqa: E402

BF16, FP32 = torch.bfloat16, torch.float32


@dataclass(frozen=True)
class Shape:
    name: str
    n: int
    k: int
    w_dtype: torch.dtype
    out_dtype: torch.dtype | None = None


# Ling-3.0-tiny (hidden 1536) decode linears (kda_b is also the MLA gate shape); kda_fused is K=1536 after fuse_projections (q,k,v,g,f + b).
SHAPES = [
    Shape("kda_proj", 2048, 1536, BF16), Shape("kda_b", 16, 1536, BF16), Shape("q_a", 256, 1536, BF16),
    Shape("kv_a", 576, 1536, BF16), Shape("q_b", 3072, 1536, BF16), Shape("router_fp32", 128, 1536, FP32, FP32),
    Shape("router_bf16", 128, 1536, BF16, FP32), Shape("dense_gate_up", 9216, 1536, BF16),
    Shape("shared_gate_up", 1024, 1536, BF16), Shape("lm_head", 157184, 1536, BF16, FP32),
    Shape("lm_head_fp32", 157184, 1536, FP32, FP32), Shape("o_proj", 1536, 2048, BF16),
    Shape("dense_down", 1536, 4608, BF16), Shape("shared_down", 1536, 512, BF16),
    Shape("kda_fused", 5 * 2048 + 16, 1536, BF16),
]
ROWS = (1, 6)


@dataclass(frozen=True)
class NormShape:
    """A norm -> linear pair of the decode step: the linear's shape, whether the norm adds the residual first, and
    whether another op also reads the norm's output (want_normed)."""
    name: str
    n: int
    k: int
    w_dtype: torch.dtype
    out_dtype: torch.dtype | None
    residual: bool
    want_normed: bool


# Ling-3.0-tiny decode (hidden 1536, 16 heads, q_lora 256, 128 experts): per step 23 input + 24 post-attention +
# 1 final add_rmsnorm, the layer-0 input and 6 q_a rmsnorms fold (-55 launches).
NORM_SHAPES = [
    NormShape("input+kda_fused", 5 * 2048 + 16, 1536, BF16, None, True, False),   # 18 KDA layers
    NormShape("input+mla_fused", 256 + 576 + 16, 1536, BF16, None, True, False),  # 6 MLA layers: q_a, kv_a, g
    NormShape("q_a_norm+q_b", 3072, 256, BF16, None, False, False),               # 6 MLA layers
    NormShape("post+router_bf16", 128, 1536, BF16, FP32, True, True),             # 23 MoE layers (+ moe_up reads)
    NormShape("post+dense_gate_up", 9216, 1536, BF16, None, True, False),         # layer 0
    NormShape("final+lm_head", 157184, 1536, BF16, FP32, True, True),             # + the returned hidden state
]
NORM_EPS = 1e-6
SMEM_LIMIT = 200 * 1024
SM_COUNT = 132


def candidates(shape: Shape, kinds: tuple[str, ...] = ("dot", "fma")) -> list:
    """Per kind, BN x BK (x rows) x S with >= a quarter of min(132, the most CTAs the shape allows), <= 4*132 CTAs
    when split; "dot" with 4 stages in shared memory, "fma" with fp32 accumulators rows*BN*BK <= 16K."""
    from lingc.kernels.linear import LinearConfig
    elem = torch.empty((), dtype=shape.w_dtype).element_size()
    out = []
    grids = {"dot": ((16, 32, 64, 128), (128,), (1,)),
             "fma": ((4, 8, 16), (256, 512) if elem == 2 else (128, 256), (1, 4, 8))}
    for kind in kinds:
        for bn, bk, rows, split in itertools.product(*grids[kind], (1, 2, 4, 8)):
            blocks = triton.cdiv(shape.k, bk)
            ctas = triton.cdiv(shape.n, bn) * split
            most = triton.cdiv(shape.n, bn) * min(8, blocks)    # CTAs at the largest split tried
            if split > blocks or (split > 1 and ctas > 4 * SM_COUNT) or (ctas < min(most, SM_COUNT) // 4):
                continue
            if kind == "dot":
                stages = 4 if bn * bk * elem <= 32 * 1024 else 3
                if (bn + 16) * bk * elem * stages > SMEM_LIMIT:
                    continue
                out.append(LinearConfig(bn, bk, split, 4 if bn * bk * elem <= 16384 else 8, stages))
            elif rows * bn * bk <= 16384:
                out.append(LinearConfig(bn, bk, split, 4 if rows * bn * bk <= 8192 else 8, 3, "fma", rows))
    return out


def _inputs(shape: Shape, m: int, copies: int, seed: int,
            device: torch.device | str = "cuda") -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, shape.k, device=device, generator=g).to(BF16)
    w0 = (torch.randn(shape.n, shape.k, device=device, generator=g) / shape.k**0.5).to(shape.w_dtype)
    return x, [w0] + [w0.clone() for _ in range(copies - 1)]


def _bound(x: torch.Tensor, w: torch.Tensor, y_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 product, allowance): fp32 summation bound 2*K*2^-24*sum|x w| + two roundings per side."""
    xw = x.to(w.dtype).double()
    exact = xw @ w.double().T
    mag = xw.abs() @ w.double().abs().T
    ulp = {FP32: 2.0**-23, BF16: 2.0**-7}
    step = max(ulp[w.dtype], ulp[y_dtype])
    acc = 2 * x.shape[-1] * 2.0**-24 * mag
    return exact, acc + 2 * step * (exact.abs() + acc)


def check(shape: Shape, m: int, cfg, device: torch.device) -> dict:
    """Correctness of one config at M rows on fresh inputs: vs the reference op (max_abs_err, bit_exact), vs a
    float64 product (the fp32-accumulation + rounding bound), PDL on == off, determinism, row invariance."""
    from lingc.kernels.linear import LinearWorkspace, linear, linear_ref, workspace_need
    x, (w,) = _inputs(shape, m, 1, seed=m * 7 + shape.n, device=device)
    y_dtype = shape.out_dtype or x.dtype
    ws = LinearWorkspace.allocate(device, *[max(1, v) for v in workspace_need(shape.n, shape.k, shape.w_dtype,
                                                                               config=cfg)])
    y = linear(x, w, shape.out_dtype, workspace=ws, config=cfg)
    y2 = linear(x, w, shape.out_dtype, workspace=ws, config=cfg)
    y_pdl = linear(x, w, shape.out_dtype, workspace=ws, config=cfg, pdl=True)
    alone = torch.cat([linear(x[i:i + 1], w, shape.out_dtype, workspace=ws, config=cfg) for i in range(m)])
    ref = linear_ref(x, w, shape.out_dtype)
    exact, allow = _bound(x, w, y_dtype)
    err = (y.double() - exact).abs()
    out = {"max_abs_err": (y.double() - ref.double()).abs().max().item(), "bit_exact": bool(torch.equal(y, ref)),
           "pdl_equal": bool(torch.equal(y, y_pdl)), "within_bound": bool((err <= allow).all()),
           "max_err_over_bound": (err / allow).max().item(),
           "rel_err_vs_fp64": ((y.double() - exact).norm() / exact.norm()).item(),
           "ref_rel_err_vs_fp64": ((ref.double() - exact).norm() / exact.norm()).item(),
           "deterministic": bool(torch.equal(y, y2)), "row_invariant": bool(torch.equal(y, alone)),
           "counters_reset": bool(not ws.counters.any())}
    out["ok"] = all(out[key] for key in ("within_bound", "pdl_equal", "deterministic", "row_invariant",
                                          "counters_reset"))
    return out


def time_us(shape: Shape, m: int, cfg, repeats: int, max_copies: int, with_ref: bool = True,
            pdl: bool = False) -> tuple[float, float]:
    """(kernel us, cuBLAS us) for one call, cold weights; without with_ref the cuBLAS time is nan."""
    from lingc.kernels.linear import LinearWorkspace, linear, workspace_need
    wbytes = shape.n * shape.k * torch.empty((), dtype=shape.w_dtype).element_size()
    copies = cold_copies(wbytes, maximum=max_copies)
    x, ws_ = _inputs(shape, m, copies, seed=1)
    xw = x.to(shape.w_dtype)
    out = torch.empty(m, shape.n, dtype=shape.out_dtype or x.dtype, device="cuda")
    kern = ref = float("nan")
    if cfg is not None:
        need = workspace_need(shape.n, shape.k, shape.w_dtype, config=cfg)
        wsp = LinearWorkspace.allocate("cuda", *[max(1, v) for v in need])
        kern = graph_time_us([lambda w=w: linear(x, w, shape.out_dtype, out=out, workspace=wsp,
                                                          config=cfg, pdl=pdl) for w in ws_], repeats=repeats, warmup=1)
    if with_ref:
        ref = graph_time_us([lambda w=w: torch.nn.functional.linear(xw, w) for w in ws_], repeats=repeats, warmup=1)
    return kern, ref


def _bytes(shape: Shape, m: int) -> int:
    w = torch.empty((), dtype=shape.w_dtype).element_size()
    y = torch.empty((), dtype=shape.out_dtype or BF16).element_size()
    return shape.n * shape.k * w + m * shape.k * 2 + m * shape.n * y


def _cfg_str(cfg) -> str:
    rows = f"-R{cfg.rows}" if cfg.kind == "fma" else ""
    return f"{cfg.kind}{rows}-BN{cfg.block_n}-BK{cfg.block_k}-S{cfg.split_k}-w{cfg.num_warps}-s{cfg.num_stages}"


@triton.jit
def _null_kernel(ptr):
    pass


def launch_floor_us() -> float:
    """One empty Triton kernel in the same graph harness: the per-call floor below any byte count."""
    t = torch.empty(1, device="cuda")
    return graph_time_us([lambda: _null_kernel[(SM_COUNT,)](t) for _ in range(1000)], repeats=30, warmup=1)


def run(device: torch.device, shapes: list[Shape] | None = None, swept: dict[str, list[dict]] | None = None,
        log=lambda row: None) -> list[dict]:
    """The table's config for every shape at M = 1 and M = 6: flat rows (kernel, shape, ok, max_abs_err,
    bit_exact, pdl_equal, time_us, ref_time_us, bytes, gbps, ...). With `swept` (from `sweep_shape`), the two
    best configs by M=1 + M=6 and the two best at M = 1 are re-timed too (swept_best_*)."""
    import lingc  # noqa: F401
    from lingc.kernels.linear import LinearConfig, pick_config
    rows = []
    for shape in shapes or SHAPES:
        chosen = pick_config(shape.n, shape.k, shape.w_dtype)
        table = (swept or {}).get(shape.name, [])
        top = [LinearConfig(**r["config"]) for r in table[:2]]
        top += [c for c in (LinearConfig(**r["config"]) for r in sorted(table, key=lambda r: r["us_m1"])[:2])
                if c not in top]
        for m in ROWS:
            kern, ref = time_us(shape, m, chosen, repeats=30, max_copies=8192)
            kern_pdl, _ = time_us(shape, m, chosen, repeats=30, max_copies=8192, with_ref=False, pdl=True)
            nbytes_ = _bytes(shape, m)
            row = {"kernel": "linear", "shape": f"{shape.name} M{m} N{shape.n} K{shape.k} {shape.w_dtype}",
                   **check(shape, m, chosen, device), "time_us": kern, "ref_time_us": ref, "bytes": nbytes_,
                   "gbps": nbytes_ / kern / 1e3, "ref_gbps": nbytes_ / ref / 1e3, "speedup": ref / kern,
                   "pdl_chain_time_us": kern_pdl, "config": _cfg_str(chosen), "name": shape.name, "m": m}
            retimed = [(time_us(shape, m, c, repeats=30, max_copies=8192, with_ref=False)[0], _cfg_str(c))
                       for c in top]
            if retimed:
                row["swept_best_us"], row["swept_best_config"] = min(retimed)
            rows.append(row)
            log(row)
    return rows


def _norm_inputs(shape: NormShape, m: int, copies: int, seed: int, device: torch.device | str = "cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    residual = (4 * torch.randn(m, shape.k, device=device, generator=g)).to(BF16) if shape.residual else None
    x = torch.randn(m, shape.k, device=device, generator=g).to(BF16)
    norm_weight = (1 + 0.1 * torch.randn(shape.k, device=device, generator=g)).to(BF16)
    w0 = (torch.randn(shape.n, shape.k, device=device, generator=g) / shape.k**0.5).to(shape.w_dtype)
    return residual, x, norm_weight, [w0] + [w0.clone() for _ in range(copies - 1)]


def _fused_call(shape: NormShape, residual, x, norm_weight, w, pdl: bool = False) -> tuple:
    """(y, normed, new residual or None) from the fused kernel."""
    from lingc.kernels.linear import add_rmsnorm_linear, rmsnorm_linear
    if residual is None:
        return (*rmsnorm_linear(x, norm_weight, NORM_EPS, w, shape.out_dtype, shape.want_normed, pdl=pdl), None)
    return add_rmsnorm_linear(residual, x, norm_weight, NORM_EPS, w, shape.out_dtype, shape.want_normed, pdl=pdl)


def _unfused_call(shape: NormShape, residual, x, norm_weight, w, pdl: bool = False) -> tuple:
    """(y, normed, new residual or None) from the rmsnorm kernel and then the linear kernel."""
    from lingc.kernels.linear import linear
    from lingc.kernels.rmsnorm import add_rmsnorm, rmsnorm
    if residual is None:
        normed, new_residual = rmsnorm(x, norm_weight, NORM_EPS, pdl=pdl), None
    else:
        normed, new_residual = add_rmsnorm(residual, x, norm_weight, NORM_EPS, pdl=pdl)
    return linear(normed, w, shape.out_dtype, pdl=pdl), normed, new_residual


def check_norm(shape: NormShape, m: int, device: torch.device | str) -> dict:
    """Correctness of the fused kernel at M rows: y within the linear bound (on the reference's normed) plus one
    activation rounding per normed element through |W|; normed and the new residual vs the reference; PDL on ==
    off; row invariance; y vs the unfused kernels."""
    from lingc.kernels.linear import add_rmsnorm_linear_ref, rmsnorm_linear_ref
    residual, x, norm_weight, (w,) = _norm_inputs(shape, m, 1, seed=m * 7 + shape.n, device=device)
    y, normed, new_residual = _fused_call(shape, residual, x, norm_weight, w)
    y_pdl = _fused_call(shape, residual, x, norm_weight, w, pdl=True)[0]
    alone = torch.cat([_fused_call(shape, residual[i:i + 1] if residual is not None else None, x[i:i + 1],
                                   norm_weight, w)[0] for i in range(m)])
    if residual is None:
        ref_y, ref_normed = rmsnorm_linear_ref(x, norm_weight, NORM_EPS, w, shape.out_dtype, True)
    else:
        ref_y, ref_normed, ref_residual = add_rmsnorm_linear_ref(residual, x, norm_weight, NORM_EPS, w,
                                                                 shape.out_dtype, True)
    unfused_y = _unfused_call(shape, residual, x, norm_weight, w)[0]
    exact, allow = _bound(ref_normed, w, ref_y.dtype)
    allow = allow + 4 * 2.0**-7 * (ref_normed.to(w.dtype).double().abs() @ w.double().abs().T)
    out = {"max_abs_err": (y.double() - ref_y.double()).abs().max().item(),
           "max_abs_err_vs_unfused": (y.double() - unfused_y.double()).abs().max().item(),
           "bit_exact_vs_unfused": bool(torch.equal(y, unfused_y)),
           "within_bound": bool(((y.double() - exact).abs() <= allow).all()),
           "normed_max_abs_err": (normed.double() - ref_normed.double()).abs().max().item() if shape.want_normed
           else 0.0,
           "residual_exact": residual is None or bool(torch.equal(new_residual, ref_residual)),
           "pdl_equal": bool(torch.equal(y, y_pdl)), "row_invariant": bool(torch.equal(y, alone))}
    out["ok"] = all(out[key] for key in ("within_bound", "residual_exact", "pdl_equal", "row_invariant"))
    return out


def time_norm_us(shape: NormShape, m: int, repeats: int = 30, max_copies: int = 8192,
                 pdl: bool = False) -> tuple[float, float]:
    """(fused us, unfused us) per call, cold weights, in one CUDA graph each."""
    wbytes = shape.n * shape.k * torch.empty((), dtype=shape.w_dtype).element_size()
    residual, x, norm_weight, ws_ = _norm_inputs(shape, m, cold_copies(wbytes, maximum=max_copies), seed=1)
    fused = graph_time_us([lambda w=w: _fused_call(shape, residual, x, norm_weight, w, pdl) for w in ws_],
                          repeats=repeats, warmup=1)
    unfused = graph_time_us([lambda w=w: _unfused_call(shape, residual, x, norm_weight, w, pdl) for w in ws_],
                            repeats=repeats, warmup=1)
    return fused, unfused


def run_norm(device: torch.device, shapes: list[NormShape] | None = None, log=lambda row: None) -> list[dict]:
    """Every NORM_SHAPES pair at M = 1 and M = 6: checks, then fused vs unfused time (PDL off and on)."""
    import lingc  # noqa: F401
    from lingc.kernels.linear import pick_config
    rows = []
    for shape in shapes or NORM_SHAPES:
        for m in ROWS:
            fused, unfused = time_norm_us(shape, m)
            fused_pdl, unfused_pdl = time_norm_us(shape, m, pdl=True)
            row = {"kernel": "norm_linear", "name": shape.name, "m": m,
                   "shape": f"{shape.name} M{m} N{shape.n} K{shape.k} {shape.w_dtype} residual={shape.residual} "
                            f"want_normed={shape.want_normed}",
                   "config": _cfg_str(pick_config(shape.n, shape.k, shape.w_dtype)),
                   **check_norm(shape, m, device), "time_us": fused, "unfused_time_us": unfused,
                   "saved_us": unfused - fused, "pdl_time_us": fused_pdl, "unfused_pdl_time_us": unfused_pdl,
                   "pdl_saved_us": unfused_pdl - fused_pdl}
            rows.append(row)
            log(row)
    return rows


GATED_HEADS, GATED_D, GATED_N = 16, 128, 1536      # Ling-3.0-tiny's KDA o_norm -> o_proj


def _gated_inputs(m: int, copies: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, GATED_HEADS, GATED_D, device="cuda", generator=g).to(BF16)
    wide = torch.randn(m, 5 * GATED_HEADS * GATED_D, device="cuda", generator=g).to(BF16)
    gate = wide[:, 4 * GATED_HEADS * GATED_D:].unflatten(-1, (GATED_HEADS, GATED_D))   # a column slice, as in the step
    norm_weight = (1 + 0.1 * torch.randn(GATED_D, device="cuda", generator=g)).to(BF16)
    k = GATED_HEADS * GATED_D
    w0 = (torch.randn(GATED_N, k, device="cuda", generator=g) / k**0.5).to(BF16)
    return x, gate, norm_weight, [w0] + [w0.clone() for _ in range(copies - 1)]


def run_gated(log=lambda row: None) -> list[dict]:
    """gated_rmsnorm_linear vs gated_rmsnorm + linear at M = 1 and 6: checks, then time (PDL off and on)."""
    from lingc.kernels.kda import gated_rmsnorm
    from lingc.kernels.linear import gated_rmsnorm_linear, gated_rmsnorm_linear_ref, linear, pick_config

    def fused(x, gate, nw, w, pdl=False):
        return gated_rmsnorm_linear(x, nw, gate, NORM_EPS, w, pdl=pdl)

    def unfused(x, gate, nw, w, pdl=False):
        return linear(gated_rmsnorm(x, nw, gate, NORM_EPS, pdl=pdl).flatten(-2), w, pdl=pdl)

    from lingc.kernels import linear_tma
    from lingc.kernels.linear import GatedNorm

    rows = []
    wbytes = GATED_N * GATED_HEADS * GATED_D * 2
    for m in ROWS:
        x, gate, nw, (w,) = _gated_inputs(m, 1, seed=m)
        cfg = pick_config(GATED_N, GATED_HEADS * GATED_D, BF16)
        # under PDL on sm_90 the Gluon TMA kernel builds the norm (kernels/linear_tma.py GATED): other bits than the
        # Triton GATED kernel that runs without PDL, so each path is checked on its own
        tma = linear_tma.eligible(x.flatten(-2), w, cfg, True, False,
                                  gated=GatedNorm(nw, NORM_EPS, gate.flatten(-2), GATED_D))
        ref = gated_rmsnorm_linear_ref(x, nw, gate, NORM_EPS, w)
        row = {"kernel": "gated_rmsnorm_linear", "name": "o_norm+o_proj", "m": m,
               "shape": f"M{m} H{GATED_HEADS} D{GATED_D} N{GATED_N}", "config": _cfg_str(cfg), "pdl_path_tma": tma,
               "max_abs_ref": ref.double().abs().max().item()}
        for tag, pdl in (("", False), ("pdl_", True)):
            y = fused(x, gate, nw, w, pdl)
            alone = torch.cat([fused(x[i:i + 1], gate[i:i + 1], nw, w, pdl) for i in range(m)])
            row[f"{tag}max_abs_err"] = (y.double() - ref.double()).abs().max().item()
            pair = unfused(x, gate, nw, w, pdl)
            row[f"{tag}max_abs_err_vs_unfused"] = (y.double() - pair.double()).abs().max().item()
            row[f"{tag}row_invariant"] = bool(torch.equal(y, alone))
            row[f"{tag}repeat_equal"] = bool(torch.equal(y, fused(x, gate, nw, w, pdl)))
        row["pdl_equal"] = bool(torch.equal(fused(x, gate, nw, w), fused(x, gate, nw, w, True)))
        row["pdl_path_tma"] = tma = tma and not linear_tma.GATED_FAILED     # a failed compile ran the Triton kernel
        row["ok"] = all(row[f"{t}row_invariant"] and row[f"{t}repeat_equal"]
                        and row[f"{t}max_abs_err"] <= 0.02 * row["max_abs_ref"] for t in ("", "pdl_")) \
            and (row["pdl_equal"] or tma)
        x, gate, nw, ws_ = _gated_inputs(m, cold_copies(wbytes, maximum=8192), seed=1)
        for tag, pdl in (("", False), ("pdl_", True)):
            row[f"{tag}time_us"] = graph_time_us([lambda w=w: fused(x, gate, nw, w, pdl) for w in ws_], warmup=1)
            row[f"unfused_{tag}time_us"] = graph_time_us([lambda w=w: unfused(x, gate, nw, w, pdl) for w in ws_],
                                                         warmup=1)
        rows.append(row)
        log(row)
    return rows


def sweep_shape(shape: Shape, log, kinds: tuple[str, ...]) -> list[dict]:
    """Every candidate at M = 1 and M = 6 (5 repeats, <= 1024 weight copies), sorted by the sum."""
    out = []
    for cfg in candidates(shape, kinds):
        try:
            t1, _ = time_us(shape, 1, cfg, repeats=5, max_copies=1024, with_ref=False)
            t6, _ = time_us(shape, 6, cfg, repeats=5, max_copies=1024, with_ref=False)
        except Exception as e:  # noqa: BLE001  (a config that does not compile or launch is skipped)
            log({"shape": shape.name, "config": _cfg_str(cfg), "error": repr(e)[:200]})
            continue
        out.append({"config": asdict(cfg), "cfg": _cfg_str(cfg), "us_m1": t1, "us_m6": t6})
    out.sort(key=lambda r: r["us_m1"] + r["us_m6"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="linear.json")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated shape names")
    ap.add_argument("--kinds", default="dot,fma", help="kernel kinds the sweep tries")
    ap.add_argument("--norm", action="store_true", help="time fuse_norm_linear's fused kernel vs norm + linear")
    ap.add_argument("--gated", action="store_true", help="time gated_rmsnorm_linear vs gated_rmsnorm + linear")
    args = ap.parse_args()
    import lingc  # noqa: F401
    shapes = [s for s in SHAPES if not args.only or s.name in args.only.split(",")]
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(), "commit": os.environ.get("LINGC_COMMIT", "unknown"),
              "command": " ".join(sys.argv), "copy_bandwidth_gbps": hbm_bandwidth_gbps(),
              "launch_floor_us": launch_floor_us(), "rows": [], "sweep": {}, "log": []}
    print(f"device-to-device copy: {result['copy_bandwidth_gbps']:.0f} GB/s; empty kernel in a graph: "
          f"{result['launch_floor_us']:.2f} us", flush=True)

    def log(entry: dict) -> None:
        result["log" if "error" in entry else "rows"].append(entry)
        print(json.dumps(entry), flush=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)

    if args.gated:
        run_gated(log)
        for r in result["rows"]:
            print(f"M{r['m']} {r['config']:28} fused {r['time_us']:6.2f} unfused {r['unfused_time_us']:6.2f} | pdl "
                  f"{r['pdl_time_us']:6.2f} vs {r['unfused_pdl_time_us']:6.2f} err {r['max_abs_err']:.3g} "
                  f"(vs unfused {r['max_abs_err_vs_unfused']:.3g}) {'ok' if r['ok'] else 'FAIL'}")
        return
    if args.norm:
        run_norm(torch.device("cuda"), [s for s in NORM_SHAPES if not args.only or s.name in args.only.split(",")],
                 log)
        print(f"\n{'pair':20} {'M':>2} {'config':28} {'fused':>7} {'unfused':>7} {'saved':>6} {'pdl':>7} "
              f"{'unf.pdl':>7} {'saved':>6} ok")
        for r in result["rows"]:
            print(f"{r['name']:20} {r['m']:2d} {r['config']:28} {r['time_us']:7.2f} {r['unfused_time_us']:7.2f} "
                  f"{r['saved_us']:6.2f} {r['pdl_time_us']:7.2f} {r['unfused_pdl_time_us']:7.2f} "
                  f"{r['pdl_saved_us']:6.2f} {'ok' if r['ok'] else 'FAIL'}")
        return
    for shape in shapes:
        if args.sweep:
            result["sweep"][shape.name] = sweep_shape(shape, log, tuple(args.kinds.split(",")))
        run(torch.device("cuda"), [shape], result["sweep"], log)

    print(f"\n{'shape':15} {'M':>2} {'config':28} {'us':>7} {'GB/s':>5} {'pdl':>7} {'cuBLAS':>7} {'GB/s':>5} "
          f"{'x':>5} {'best swept':28} {'us':>7} ok")
    for r in result["rows"]:
        print(f"{r['name']:15} {r['m']:2d} {r['config']:28} {r['time_us']:7.2f} {r['gbps']:5.0f} "
              f"{r['pdl_chain_time_us']:7.2f} {r['ref_time_us']:7.2f} {r['ref_gbps']:5.0f} {r['speedup']:5.2f} "
              f"{r.get('swept_best_config', '-'):28} {r.get('swept_best_us', float('nan')):7.2f} "
              f"{'ok' if r['ok'] else 'FAIL'}")


if __name__ == "__main__":
    main()
