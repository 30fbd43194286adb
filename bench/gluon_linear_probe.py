"""Probe: does a skinny GEMV that lands its first weight tiles in shared memory BEFORE the PDL wait beat lingc's?

Triton's pipeliner places a loop's cp.async prologue after everything before the loop, so lingc's "dot" linear
(kernels/linear.py) can only start its weight stream after gdc_wait; the two ways of reading weights earlier that
Triton allows (an L2 prefetch, a register preload) measured slower in the step. Gluon (triton.experimental.gluon,
Triton 3.6) exposes TMA, mbarriers and wgmma directly, so this probe writes the same swap-AB GEMV there:

    program (n, s): issue TMA loads of the first STAGES [BN, BK] weight blocks of its K slice (PRE: before the
    wait), gdc_wait, load x^T's slice into shared memory, then per block: wait its mbarrier, wgmma
    acc[BN, 16] += W[BN, BK] @ x^T[BK, 16], refill the slot with the block STAGES ahead; split-K partials go through
    a workspace and a ticket, summed in the fixed order 0..S-1 by the last program (lingc's `_finish` scheme).

and times it in a PDL chain behind a short producer kernel (the step's shape: o_proj behind gated_rmsnorm, the KDA
projection behind combine_add_rmsnorm): per pair (producer + GEMV), CUDA graph of distinct weight copies (cold L2),
median of replays. Rows: lingc's linear; the Gluon GEMV waiting first (PRE=0: TMA vs cp.async alone); the Gluon GEMV
with the pre-wait fill (PRE=1); the producer alone. Bits are compared with lingc's linear (same wgmma shape and K
order, so they should be equal).

    python3 bench/gluon_linear_probe.py --json OUT.json        # H200 only (Gluon has no interpreter)
    python3 bench/gluon_linear_probe.py --check --json OUT.json   # lingc's linear, TMA path on vs off, bit for bit

What came of it (2026-12-03): the probe's kernel became kernels/linear_tma.py, used at one row (decode, the draft),
where the step measured it faster; at every row count it was level (bench/results/gluon-linear-probe-h200-20261203.json,
step-ab-h200-20261203-c.json, -d.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import cold_copies, graph_time_us, hbm_bandwidth_gbps  # noqa: E402

from lingc.kernels.pdl import gluon_gdc_launch_dependents as _gdc_launch, gluon_gdc_wait as _gdc_wait  # noqa: E402

BM = 16
SMEM_2_CTAS = 110 * 1024


@gluon.jit
def _gemv_kernel(w_desc, x_ptr, y_ptr, part_ptr, count_ptr, M, N, stride_xm, stride_ym,
                 K_PER_SPLIT: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, BM_: gl.constexpr,
                 STAGES: gl.constexpr, SPLIT_K: gl.constexpr, PDL: gl.constexpr, PRE: gl.constexpr):
    KB: gl.constexpr = K_PER_SPLIT // BK
    pid_n = gl.program_id(0)
    pid_s = gl.program_id(1)
    n0 = pid_n * BN
    k0 = pid_s * K_PER_SPLIT
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(bars.index(st), count=1)
    if PDL:
        if not PRE:
            _gdc_wait()
    for st in gl.static_range(STAGES):
        if st < KB:
            mbarrier.expect(bars.index(st), w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(w_desc, [n0, k0 + st * BK], bars.index(st), w_smem.index(st))
    if PDL:
        if PRE:
            _gdc_wait()
        _gdc_launch()
    # x rows [BM, K slice] -> shared memory, K-major (the wgmma B operand, permuted to [BK, BM])
    xl: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    offs_m = gl.arange(0, BM_, layout=gl.SliceLayout(1, xl))
    offs_k = gl.arange(0, BK, layout=gl.SliceLayout(0, xl))
    x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM_, BK], gl.bfloat16)
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [KB, BM_, BK], x_layout)
    for kb in gl.static_range(KB):
        xv = gl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + kb * BK + offs_k)[None, :],
                     mask=(offs_m < M)[:, None], other=0.0)
        x_smem.index(kb).store(xv.to(gl.bfloat16))
    fence_async_shared()
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BM_, 16])
    acc = gl.zeros([BN, BM_], gl.float32, acc_layout)
    for kb in gl.static_range(KB):
        s = kb % STAGES
        mbarrier.wait(bars.index(s), (kb // STAGES) & 1)
        acc = warpgroup_mma(w_smem.index(s), x_smem.index(kb).permute((1, 0)), acc)
        if kb + STAGES < KB:
            mbarrier.expect(bars.index(s), w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(w_desc, [n0, k0 + (kb + STAGES) * BK], bars.index(s), w_smem.index(s))
    for st in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(st))
    ol: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [4, 1], [0, 1])
    out = gl.convert_layout(acc, ol)                                        # [BN, BM]
    on = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, ol))
    om = gl.arange(0, BM_, layout=gl.SliceLayout(0, ol))
    mask = (on < N)[:, None] & (om < M)[None, :]
    if SPLIT_K == 1:
        gl.store(y_ptr + om[None, :] * stride_ym + on[:, None], out.to(gl.bfloat16), mask=mask)
    else:
        poffs = om[None, :] * N + on[:, None]
        gl.store(part_ptr + pid_s * M * N + poffs, out, mask=mask)
        gl.thread_barrier()
        ticket = gl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            total = gl.zeros([BN, BM_], gl.float32, ol)
            for sp in gl.static_range(SPLIT_K):
                total += gl.load(part_ptr + sp * M * N + poffs, mask=mask, other=0.0, cache_modifier=".cg")
            gl.store(y_ptr + om[None, :] * stride_ym + on[:, None], total.to(gl.bfloat16), mask=mask)
            gl.store(count_ptr + pid_n, 0)


@triton.jit
def _produce_kernel(src_ptr, x_ptr, n, SPIN: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """The chain's producer: x = src (+ a short dependent loop standing in for a norm's reductions)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs = tl.arange(0, BLOCK)
    v = tl.load(src_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    for _ in range(SPIN):
        v = v * 1.0000001 + tl.sum(v, 0) * 0.0
    tl.store(x_ptr + offs, v.to(x_ptr.dtype.element_ty), mask=offs < n)


def produce(src, x, pdl):
    n = x.numel()
    _produce_kernel[(1,)](src, x, n, SPIN=4, BLOCK=triton.next_power_of_2(n), PDL=pdl, num_warps=4,
                          **({"launch_pdl": True} if pdl else {}))


class GluonLinear:
    def __init__(self, weight: torch.Tensor, split_k: int, block_n=64, block_k=128, max_stages=4):
        n, k = weight.shape
        assert k % (block_k * split_k) == 0
        x_bytes = BM * (k // split_k) * 2                  # the x slice, in shared memory whole
        stages = min(max_stages, k // split_k // block_k)
        while stages > 2 and x_bytes + stages * block_n * block_k * 2 > SMEM_2_CTAS:
            stages -= 1                                   # keep 2 CTAs an SM (as lingc's kernel: 80 KB)
        self.n, self.k, self.s, self.bn, self.bk, self.stages = n, k, split_k, block_n, block_k, stages
        layout = gl.NVMMASharedLayout.get_default_for([block_n, block_k], gl.bfloat16)
        self.desc = TensorDescriptor.from_tensor(weight, [block_n, block_k], layout)
        tiles = triton.cdiv(n, block_n)
        self.part = torch.empty(split_k * BM * n, dtype=torch.float32, device=weight.device)
        self.count = torch.zeros(tiles, dtype=torch.int32, device=weight.device)
        self.grid = (tiles, split_k)

    def __call__(self, x, y, pdl, pre):
        m = x.shape[0]
        _gemv_kernel[self.grid](self.desc, x, y, self.part, self.count, m, self.n, x.stride(0), y.stride(0),
                                K_PER_SPLIT=self.k // self.s, BN=self.bn, BK=self.bk, BM_=BM,
                                STAGES=self.stages, SPLIT_K=self.s, PDL=pdl,
                                PRE=pre, num_warps=4, **({"launch_pdl": True} if pdl else {}))


def run(m_values=(1, 6)) -> dict:
    from lingc.kernels import linear as L
    dev = torch.device("cuda")
    shapes = {"o_proj": (1536, 2048), "kda_fused": (10256, 1536), "mla_q_a_kv_a_g": (848, 1536),
              "mla_dense": (1536, 2048)}
    rows = []
    for name, (n, k) in shapes.items():
        cfg = L.pick_config(n, k, torch.bfloat16)
        cfg = L._fit_split(cfg, k)
        split = cfg.split_k if cfg.kind == "dot" else 4
        copies = cold_copies(n * k * 2, minimum=4, maximum=64)
        g = torch.Generator(device=dev).manual_seed(0)
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * 0.02 for _ in range(copies)]
        gls = [GluonLinear(w, split) for w in ws]
        for m in m_values:
            src = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
            x = torch.empty_like(src)
            ys = [torch.empty(m, n, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
            produce(src, x, False)
            ref = L.linear(x, ws[0])
            row = {"shape": name, "n": n, "k": k, "m": m, "lingc_config": repr(cfg), "gluon_split": split,
                   "gluon_stages": gls[0].stages, "copies": copies}
            for pre in (0, 1):
                gls[0](x, ys[0], False, pre)
                torch.cuda.synchronize()
                row[f"gluon_pre{pre}_equal_lingc"] = bool(torch.equal(ys[0], ref))
                row[f"gluon_pre{pre}_max_diff"] = float((ys[0].float() - ref.float()).abs().max())
            for pdl in (False, True):
                tag = "pdl" if pdl else "nopdl"
                row[f"producer_{tag}_us"] = graph_time_us([lambda: produce(src, x, pdl)] * copies)
                row[f"lingc_{tag}_us"] = graph_time_us(
                    [f for i in range(copies) for f in (lambda: produce(src, x, pdl),
                                                        lambda i=i: L.linear(x, ws[i], pdl=pdl, out=ys[i]))])
                for pre in (0, 1):
                    row[f"gluon_pre{pre}_{tag}_us"] = graph_time_us(
                        [f for i in range(copies) for f in (lambda: produce(src, x, pdl),
                                                            lambda i=i: gls[i](x, ys[i], pdl, pre))])
            print(json.dumps(row), flush=True)
            rows.append(row)
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "hbm_bandwidth_gbps": hbm_bandwidth_gbps(), "rows": rows,
            "note": "times are per (producer + GEMV) pair except producer_*; the GEMV's share is the difference"}


def check_lingc() -> dict:
    """lingc's linear with its TMA path (kernels/linear_tma.py, switched on here for every row count) against the same
    call on the Triton kernel, bit for bit, at shapes that take it (the KDA projection's on the partial ring) and one
    that does not, 1-16 rows with x by TMA (X_TMA) and 1 and 6 through registers, PDL (eager)."""
    from lingc.kernels import linear as L
    from lingc.kernels import linear_tma as T
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    rows = []
    for n, k in ((1536, 2048), (848, 1536), (1536, 4096), (10256, 1536)):   # the last: a partial ring (PARTIAL_RING)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
        cfg = L.pick_config(n, k, torch.bfloat16)
        for m, x_tma in ((1, True), (6, True), (16, True), (1, False), (6, False)):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
            enabled, max_rows, partial, xt = T.ENABLED, T.MAX_ROWS, T.PARTIAL_RING, T.X_TMA
            try:
                T.ENABLED, T.MAX_ROWS, T.PARTIAL_RING, T.X_TMA = True, L.MAX_ROWS, True, x_tma
                took = T.eligible(x, w, cfg, True, False)
                y_tma = L.linear(x, w, pdl=True)
                T.ENABLED = False
                y_triton = L.linear(x, w, pdl=True)
            finally:
                T.ENABLED, T.MAX_ROWS, T.PARTIAL_RING, T.X_TMA = enabled, max_rows, partial, xt
            torch.cuda.synchronize()
            rows.append({"n": n, "k": k, "m": m, "tma_path": took, "x_tma": took and T.x_tma(x, w) if x_tma else False,
                         "equal": bool(torch.equal(y_tma, y_triton))})
    return {"rows": rows, "all_equal": all(r["equal"] for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="gluon_linear_probe.json")
    ap.add_argument("--check", action="store_true", help="only compare lingc's linear with and without its TMA path")
    args = ap.parse_args()
    if args.check:
        out = check_lingc()
        print(json.dumps(out))
        Path(args.json).write_text(json.dumps(out, indent=1))
        return
    out = run()
    out["command"] = " ".join(sys.argv)
    Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
