"""The MoE router front in one thread-block cluster: residual add + RMSNorm, the gate GEMV and the router, with the
logits handed to one CTA through distributed shared memory instead of L2 (a probe, CUDA C++ through bench/cuda_rtc.py).

kernels/norm_router.py (fuse_norm_router, opt-in) already does the three in one launch, but its programs hand the
logits on through L2 with a ticket (an acq_rel atomic, then the last program reloads the row's logits): on the H200
3.87 us against 3.82 for the two kernels it replaces, level in the step (docs/measurements.md). Here a cluster of
CLUSTER CTAs (16 by default, the non-portable maximum) takes one row:

    CTA r of the row's cluster, 192 threads, thread i holding K columns [8i, 8i + 8) of h = 1536:
        before the PDL wait: its E / CLUSTER gate rows' columns (16 B a row a thread) and the norm weight's; rank 0
            the expert bias
        after it: the row's residual and x columns, new_residual = residual + x (bf16), the row's sum of squares
            (warp shuffles, then the 6 warps' partials in a fixed order), normed = rmsnorm(new_residual) * w (bf16, the
            reference's two roundings), its E / CLUSTER logits (fp32 sums, rounded to bf16 as lingc.linear's bf16
            router returns them) stored into rank 0's shared memory (mapa + st.shared::cluster); rank 0 stores
            new_residual and normed
        the cluster barrier (arrive.release / wait.acquire); ranks 1.. exit
        rank 0, expert e on thread e: kernels/router_gluon.py's algorithm (sigmoid, biased score, each group's two
            best, the kept groups by rank, each kept expert's rank among the kept experts by (score desc, id asc),
            picks by rank), the weights in pick order, + the fused shared expert; at one row also router_align's
            layout (pair p at block = number of pairs with a lower expert id, sentinels elsewhere)

Checked against kernels/norm_router.py's two-kernel path (the step's kernels: add_rmsnorm_linear's GEMV into fp32
logits, then router_align / router_topk) as bench/kernel_norm_router.py checks its own fused kernel: new_residual
bit-equal, normed within a bf16 ulp, the same expert ids with weights within 1e-5 (other fp32 sums may move a
near-tie: counted), the align outputs equal where the ids are. Timed the same way (CUDA-graph medians over cold
copies, PDL on) against the two kernels and the ticket kernel.

    python3 bench/kernel_cluster_router.py [--cluster 16] [--json OUT]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_rtc import Kernel, compile_cuda  # noqa: E402
from kernel_norm_router import E, H, SEEDS, SHARED, TOP_K, _args, _inputs, compare  # noqa: E402
from timing import cold_copies, graph_time_us  # noqa: E402

THREADS = 192            # 8 bf16 columns a thread: h = 1536

SOURCE = r"""
#ifndef CLUSTER
#define CLUSTER 16
#endif
#define H 1536
#define E 128
#define EPC (E / CLUSTER)
#define THREADS 192
#define WARPS (THREADS / 32)
#define GS 16
#define NG (E / GS)
#define TOPK_GROUP 4
#define TOPK 8
#define SHARED 1
#define KP (TOPK + SHARED)

typedef unsigned short bf16_t;
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float bf(unsigned v, int hi) { return __uint_as_float(hi ? (v & 0xffff0000u) : (v << 16)); }
__device__ __forceinline__ unsigned rnd(float f) {          // fp32 -> bf16 bits, round to nearest even
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    unsigned a;
    asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ void st_rank0(const float* local, float v) {
    unsigned remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, 0;" : "=r"(remote) : "r"(smem_addr(local)));
    asm volatile("st.shared::cluster.f32 [%0], %1;" :: "r"(remote), "f"(v) : "memory");
}
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

extern "C" __global__ void __launch_bounds__(THREADS) gate_router(
        const bf16_t* res, const bf16_t* x, const bf16_t* __restrict__ nw,   // res, x: written by the launch before
        const bf16_t* __restrict__ gate, const float* __restrict__ bias, float eps, float scale,
        bf16_t* __restrict__ normed_out, bf16_t* __restrict__ res_out, float* __restrict__ w_out,
        int* __restrict__ ids_out, int* __restrict__ sorted_out, int* __restrict__ block_expert_out,
        int* __restrict__ total_out, int align_cells, int align_blocks, int bm, int pdl) {
    __shared__ float logits_s[E];
    __shared__ float bias_s[E];
    __shared__ float red_s[WARPS][EPC > 1 ? EPC : 1];
    __shared__ float ss_s[WARPS];
    __shared__ float gs_s[NG];
    __shared__ float b_s[E];
    __shared__ float pick_sc[TOPK];
    __shared__ int pick_id[TOPK];
    unsigned rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int row = blockIdx.y;
    const int col = tid * 8;
    // before the wait: weights only
    uint4 w[EPC];
#pragma unroll
    for (int j = 0; j < EPC; ++j)
        w[j] = *reinterpret_cast<const uint4*>(gate + (size_t)(rank * EPC + j) * H + col);
    uint4 nw4 = *reinterpret_cast<const uint4*>(nw + col);
    if (rank == 0 && tid < E) bias_s[tid] = bias[tid];
    if (pdl) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    }
    uint4 r4 = *reinterpret_cast<const uint4*>(res + (size_t)row * H + col);
    uint4 x4 = *reinterpret_cast<const uint4*>(x + (size_t)row * H + col);
    unsigned rv[4] = {r4.x, r4.y, r4.z, r4.w}, xv[4] = {x4.x, x4.y, x4.z, x4.w};
    unsigned nwv[4] = {nw4.x, nw4.y, nw4.z, nw4.w};
    float nr[8];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        nr[i] = __uint_as_float(rnd(bf(rv[i / 2], i & 1) + bf(xv[i / 2], i & 1)) << 16);
        ss += nr[i] * nr[i];
    }
    ss = warp_sum(ss);
    if (lane == 0) ss_s[warp] = ss;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < WARPS; ++i) total += ss_s[i];
    const float rstd = rsqrtf(total / (float)H + eps);
    float xn[8];
    unsigned nbits[8], rbits[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        float n = __uint_as_float(rnd(nr[i] * rstd) << 16);               // the norm's rounding to bf16
        nbits[i] = rnd(bf(nwv[i / 2], i & 1) * n);                        // weight * normed, rounded
        xn[i] = __uint_as_float(nbits[i] << 16);
        rbits[i] = __float_as_uint(nr[i]) >> 16;
    }
    float part[EPC];
#pragma unroll
    for (int j = 0; j < EPC; ++j) {
        unsigned wv[4] = {w[j].x, w[j].y, w[j].z, w[j].w};
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) s += xn[i] * bf(wv[i / 2], i & 1);
        part[j] = warp_sum(s);
    }
    if (lane == 0) {
#pragma unroll
        for (int j = 0; j < EPC; ++j) red_s[warp][j] = part[j];
    }
    __syncthreads();
    if (tid < EPC) {
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < WARPS; ++i) s += red_s[i][tid];
        st_rank0(&logits_s[rank * EPC + tid], __uint_as_float(rnd(s) << 16));   // bf16 router: rounded logits
    }
    if (rank == 0) {
        uint4 o, q;
        o.x = nbits[0] | (nbits[1] << 16); o.y = nbits[2] | (nbits[3] << 16);
        o.z = nbits[4] | (nbits[5] << 16); o.w = nbits[6] | (nbits[7] << 16);
        q.x = rbits[0] | (rbits[1] << 16); q.y = rbits[2] | (rbits[3] << 16);
        q.z = rbits[4] | (rbits[5] << 16); q.w = rbits[6] | (rbits[7] << 16);
        *reinterpret_cast<uint4*>(normed_out + (size_t)row * H + col) = o;
        *reinterpret_cast<uint4*>(res_out + (size_t)row * H + col) = q;
    }
    cluster_sync();
    if (rank != 0) return;
    // rank 0 routes the row: expert e on thread e (router_gluon's algorithm)
    float score = 0.f, biased = NEG_INF;
    if (tid < E) {
        score = 1.f / (1.f + __expf(-logits_s[tid]));
        biased = score + bias_s[tid];
        b_s[tid] = biased;
        float m1 = biased;
        for (int o = GS / 2; o > 0; o >>= 1) m1 = fmaxf(m1, __shfl_xor_sync(0xffffffffu, m1, o));
        unsigned half = (lane < 16) ? 0x0000ffffu : 0xffff0000u;
        int ties = __popc(__ballot_sync(0xffffffffu, biased == m1) & half);
        float v2 = (biased == m1) ? NEG_INF : biased;
        for (int o = GS / 2; o > 0; o >>= 1) v2 = fmaxf(v2, __shfl_xor_sync(0xffffffffu, v2, o));
        float m2 = ties >= 2 ? m1 : v2;
        if ((tid % GS) == 0) gs_s[tid / GS] = m1 + m2;
    }
    __syncthreads();
    unsigned kept = 0;
#pragma unroll
    for (int g = 0; g < NG; ++g) {
        int r = 0;
        for (int h = 0; h < NG; ++h) r += (gs_s[h] > gs_s[g]) || (gs_s[h] == gs_s[g] && h < g);
        if (r < TOPK_GROUP) kept |= 1u << g;
    }
    if (tid < E && ((kept >> (tid / GS)) & 1u)) {
        int r = 0;
        for (int g = 0; g < NG; ++g) {
            if (!((kept >> g) & 1u)) continue;
            for (int k = 0; k < GS; ++k) {
                int j = g * GS + k;
                float bj = b_s[j];
                r += (bj > biased) || (bj == biased && j < tid);
            }
        }
        if (r < TOPK) { pick_id[r] = tid; pick_sc[r] = score; }
    }
    __syncthreads();
    int my_id = 0;
    if (tid < KP) {
        float wgt = 1.f;
        my_id = E;
        if (tid < TOPK) {
            float t = 0.f;
            for (int p = 0; p < TOPK; ++p) t += pick_sc[p];
            wgt = pick_sc[tid] / (t + 1e-20f) * scale;
            my_id = pick_id[tid];
        }
        w_out[row * KP + tid] = wgt;
        ids_out[row * KP + tid] = my_id;
    }
    if (bm > 0) {                                           // router_align's layout at one row
        for (int i = tid; i < align_cells; i += THREADS) if (i % bm != 0 || i >= KP * bm) sorted_out[i] = KP;
        for (int i = tid + KP; i < align_blocks; i += THREADS) block_expert_out[i] = -1;
        if (tid < KP) {
            int lower = 0;
            for (int p = 0; p < KP; ++p) {
                int other = p < TOPK ? pick_id[p] : E;
                lower += other < my_id;
            }
            sorted_out[lower * bm] = tid;
            block_expert_out[lower] = my_id;
        }
        if (tid == 0) total_out[0] = KP * bm;
    }
}
"""


class ClusterRouter:
    """gate_router compiled for this GPU with CLUSTER CTAs a row, launched with a cluster dimension."""

    def __init__(self, cluster: int) -> None:
        major, minor = torch.cuda.get_device_capability()
        self.cluster = cluster
        self.kernel = Kernel(compile_cuda(SOURCE, "gate_router", f"sm_{major}{minor}a", (f"-DCLUSTER={cluster}",)),
                             "gate_router", non_portable_cluster=cluster > 8)

    def __call__(self, res, x, nw, eps, gate, bias, n_group, topk_group, top_k, scale, num_experts, block_m,
                 shared, pdl: bool = True):
        """add_rmsnorm_router's outputs (normed, new_residual, weights, ids, sorted_pairs, block_expert, total)."""
        from lingc.ops.moe import align_sizes
        rows = x.numel() // H
        normed, new_res = torch.empty_like(x), torch.empty_like(x)
        weights = torch.empty((rows, TOP_K + SHARED), dtype=torch.float32, device=x.device)
        ids = torch.empty((rows, TOP_K + SHARED), dtype=torch.int32, device=x.device)
        cells, blocks = align_sizes(TOP_K + SHARED, num_experts, block_m) if block_m else (0, 0)
        sorted_pairs = torch.empty(cells, dtype=torch.int32, device=x.device)
        block_expert = torch.empty(blocks, dtype=torch.int32, device=x.device)
        total = torch.empty(1 if block_m else 0, dtype=torch.int32, device=x.device)
        self.kernel((self.cluster, rows), (THREADS,),
                    [res, x, nw, gate, bias, ctypes.c_float(eps), ctypes.c_float(scale), normed, new_res, weights,
                     ids, sorted_pairs if block_m else ids, block_expert if block_m else ids,
                     total if block_m else ids, ctypes.c_int(cells), ctypes.c_int(blocks), ctypes.c_int(block_m),
                     ctypes.c_int(int(pdl))], cluster=self.cluster, pdl=pdl)
        return normed, new_res, weights, ids, sorted_pairs, block_expert, total


def check(router: ClusterRouter, rows: int, dev: torch.device) -> dict:
    from lingc.kernels import norm_router as NR
    row = {"rows": rows, "form": "router_align" if rows == 1 else "router_topk", "seeds": SEEDS,
           "id_mismatch_rows": 0, "weights_max_abs_err": 0.0, "normed_max_abs_err": 0.0, "residual_bit_equal": True,
           "align_equal": True, "deterministic": True, "row_invariant": True}
    for seed in range(SEEDS):
        args = _args(_inputs(rows, seed, dev), rows)
        got = router(*args)
        enabled, NR.ENABLED = NR.ENABLED, False
        try:
            want = NR.add_rmsnorm_router(*args, pdl=True)                    # the step's two kernels
        finally:
            NR.ENABLED = enabled
        same = compare(row, got, want)
        if rows == 1 and bool(same.all()):
            row["align_equal"] &= all(torch.equal(a, b) for a, b in zip(got[4:], want[4:]))
        again = router(*args)
        row["deterministic"] &= all(torch.equal(a, b) for a, b in zip(got, again))
        if rows > 1:
            res, x = args[0], args[1]
            for r in range(rows):
                one = router(res[:, r:r + 1].contiguous(), x[:, r:r + 1].contiguous(), *args[2:])
                row["row_invariant"] &= torch.equal(one[0][0, 0], got[0][0, r]) and \
                    torch.equal(one[2][0], got[2][r]) and torch.equal(one[3][0], got[3][r])
    row["ok"] = bool(row["residual_bit_equal"] and row["normed_max_abs_err"] <= 0.0625 and row["deterministic"]
                     and row["row_invariant"] and row["align_equal"] and row["weights_max_abs_err"] <= 1e-5
                     and row["id_mismatch_rows"] <= rows * SEEDS // 4)
    return row


def time_rows(router: ClusterRouter, rows: int, dev: torch.device) -> dict:
    from lingc.kernels import norm_router as NR
    per_copy = E * H * 2 + 2 * rows * H * 2
    copies = [_args(_inputs(rows, 100 + c, dev), rows) for c in range(cold_copies(per_copy, maximum=64))]
    out = {"copies": len(copies)}
    out["cluster_time_us"] = graph_time_us([lambda a=a: router(*a) for a in copies])
    out["ticket_time_us"] = graph_time_us([lambda a=a: NR.add_rmsnorm_router(*a, pdl=True) for a in copies])
    enabled, NR.ENABLED = NR.ENABLED, False
    try:
        out["two_kernels_time_us"] = graph_time_us([lambda a=a: NR.add_rmsnorm_router(*a, pdl=True) for a in copies])
    finally:
        NR.ENABLED = enabled
    out["cluster_time_us_repeat"] = graph_time_us([lambda a=a: router(*a) for a in copies])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cluster", default="16,8", help="CTAs a row's cluster (E / CLUSTER gate rows each)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import lingc  # noqa: F401  (registers torch.ops.lingc.*)
    dev = torch.device("cuda")
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
              "commit": os.environ.get("LINGC_COMMIT", "unknown"),
              "command": "python3 bench/kernel_cluster_router.py " + " ".join(sys.argv[1:]), "rows": []}
    for cluster in (int(c) for c in args.cluster.split(",")):
        for rows in (1, 6):
            try:
                router = ClusterRouter(cluster)
                row = {"cluster": cluster, **check(router, rows, dev)}
                row.update(time_rows(router, rows, dev))
            except RuntimeError as err:      # a compile or launch failure: say so and go on with the next size
                result["rows"].append({"cluster": cluster, "rows": rows, "ok": False, "error": str(err)})
                print(f"cluster {cluster:2d} rows {rows}: {err}", flush=True)
                continue
            result["rows"].append(row)
            print(f"cluster {cluster:2d} rows {rows} {row['form']:12} cluster {row['cluster_time_us']:6.2f} / "
                  f"{row['cluster_time_us_repeat']:6.2f} us, ticket {row['ticket_time_us']:6.2f}, two kernels "
                  f"{row['two_kernels_time_us']:6.2f} | ids mismatch {row['id_mismatch_rows']} w err "
                  f"{row['weights_max_abs_err']:.2g} normed err {row['normed_max_abs_err']:.2g} "
                  f"{'ok' if row['ok'] else 'FAIL ' + json.dumps(row)}", flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
