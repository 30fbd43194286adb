"""add_rmsnorm_router on one thread-block cluster a row: the logits reach the routing CTA through distributed shared
memory, not L2 (CUDA C++ through kernels/cuda_rtc.py; opt-in, LINGC_NORM_ROUTER_CLUSTER=1).

kernels/norm_router.py's Gluon kernel fuses the residual add + RMSNorm, the gate GEMV and the router into one launch,
but its programs hand the row's logits to the routing program through L2: a ticket (an acq_rel atomic), then the
last program reloads the logits. That costs what the kernel boundary it removes did (3.87 against 3.82 us on the
H200; level in the step). A cluster (sm_90: up to 16 CTAs on one GPC, non-portable past 8) can hand them on through
distributed shared memory and the hardware cluster barrier, which Triton 3.6 and Gluon 3.6 cannot express; hence CUDA
C++ compiled by NVRTC at the first launch (about a second a shape) and launched with cuLaunchKernelEx.

    cluster (one row), CTA r of CLUSTER, THREADS = h / 8 threads, thread i holding h columns [8i, 8i + 8):
        at entry: a relaxed cluster arrive, waited for right before the first DSMEM store (a CTA may store into rank
            0's shared memory only once rank 0 runs)
        before the PDL wait: its E / CLUSTER gate rows' columns (16 B a row) and the norm weight's; rank 0 the bias
        after it (then the trigger, lingc's early placement): the row's residual and x columns, new_residual =
            residual + x (one fp32 add, rounded to bf16), the sum of squares (a warp tree, then the warps' partials
            in order), normed = (w * (new_residual * rstd) rounded) rounded (the reference's two bf16 roundings), its
            E / CLUSTER logits (fp32 sums of the bf16 products, then rounded to bf16 and widened: lingc.linear's bf16
            router), stored into rank 0's shared memory (mapa + st.shared::cluster); rank 0 stores new_residual and
            normed
        barrier.cluster.arrive.release / wait.acquire; ranks 1.. leave
        rank 0, expert e on thread e: kernels/router_gluon.py's routing (sigmoid 1 / (1 + exp(-x)), the biased
            score, each group's two best (ties: the same value twice), the TOPK_GROUP best groups by (score desc, id
            asc), each kept expert's rank among the kept experts by (biased desc, id asc), pick p = rank p), the k
            weights summed in pick order, score / (total + 1e-20) * scale, the fused shared experts after them at
            weight 1.0; at one row with block_m > 0 router_align's layout (pair p at block = number of pairs with a
            lower expert id, the sentinel k + S elsewhere, -1 past the blocks in use, total = (k + S) * block_m)

Numerics: other fp32 sums than the two kernels' (and than the Gluon kernel's), so normed may differ by a bf16 ulp
and a near-tie may route otherwise: a numerics change of the op where this runs (fuse_norm_router already says so).
Row invariant: a row's cluster runs the same code whatever the row count, so a verify chain's rows get decode's bits.

Where it runs (`eligible`): LINGC_NORM_ROUTER_CLUSTER=1, CUDA sm_90+, a libnvrtc (kernels/cuda_rtc.py), bf16
activations and gate, h a multiple of 256 up to 8192 (THREADS = h / 8 whole warps), E routed experts a multiple of 32
and of the cluster, at most THREADS, in groups of a power of two up to 32 (a group inside a warp), at most 32 groups,
1-16 rows. Elsewhere, and after a compile or launch failure (warned once), kernels/norm_router.py's paths run.

Measured on an H100 (2026-12-06, fbc1c7a, `LINGC_COMMIT=fbc1c7a bash bench/device_cluster_ab.sh OUT`, one call; the
pool lent no H200). It checks out: expert ids equal to the two kernels' over the bench's rows, weights within 6e-8,
normed bit-equal. It is slower alone (bench/results/kernels-cluster-router-h100-20261206.json, PDL on): 5.22 us
against 3.94 for the two kernels at one row (router_align), 4.69 against 4.48 at six (router_topk); 5.47 / 4.97 at
clusters of 8. Why (bench/kernel_cluster_chain.py, kernels-cluster-chain-h100-20261206.json): the DSMEM handoff is
cheap (a cluster barrier 0.43-0.68 us a stage, a DSMEM all-gather 0.76-1.16, gather + scatter through rank 0
1.42-1.68), but a cluster launch in a PDL chain costs 2.4-3.0 us a link (one cluster of 2-16 CTAs) and 4.3 us at a
full GPU of clusters, against 0.90 / 1.32 us for plain CTAs: the boundary a cluster kernel sits behind costs more
than the one it removes. In the step (step-ab-h100-20261206-cluster-router.json, fuse_norm_router in `all`, one
process, baselines first, between and last): greedy decode 1.3365 / 1.3391 ms against 1.3135-1.3156 (+21 us),
verify 2.6077 / 2.6074 against 2.6126-2.6136 (-5 us), NEXTN level; greedy parity held (NEXTN == plain, PDL on ==
off, greedy copies == general graphs). So it stays opt-in and off, and no other cluster fusion is planned on sm_90.
"""

from __future__ import annotations

import ctypes
import warnings

import torch

from lingc.knobs import env_flag, env_int
from lingc.kernels import cuda_rtc
from lingc.kernels.gluon_launch import major as _major
from lingc.kernels.workspace import indexed
from lingc.ops.moe import align_sizes
from lingc.ops.norm_router import MAX_ROWS, no_align

ENABLED = env_flag("LINGC_NORM_ROUTER_CLUSTER", False)
CLUSTER = env_int("LINGC_NORM_ROUTER_CLUSTER_SIZE", 16)   # CTAs a row: E / CLUSTER gate rows each
FAILED: list[str] = []
VEC = 8                      # bf16 columns a thread: one 16-byte load a gate row
MAX_HIDDEN = 8192            # THREADS = h / 8 <= 1024

SOURCE = cuda_rtc.CLUSTER_HELPERS + r"""
typedef unsigned short bf16_t;
#define NEG_INF __int_as_float(0xff800000)
#define THREADS (H / 8)
#define WARPS (THREADS / 32)
#define EPC (E / CLUSTER)
#define NG (E / GS)
#define KP (TOPK + SHARED)

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
extern "C" __global__ void __launch_bounds__(THREADS) norm_router_cluster(
        const bf16_t* res, const bf16_t* x,                        // written by the launch before: plain loads
        const bf16_t* __restrict__ nw, const bf16_t* __restrict__ gate, const float* __restrict__ bias,
        float eps, float scale, bf16_t* normed_out, bf16_t* res_out, float* w_out, int* ids_out, int* sorted_out,
        int* block_expert_out, int* total_out, int align_cells, int align_blocks, int bm, int pdl) {
    __shared__ float logits_s[E];
    __shared__ float bias_s[E];
    __shared__ float b_s[E];
    __shared__ float red_s[WARPS][EPC];
    __shared__ float ss_s[WARPS];
    __shared__ float gs_s[NG];
    __shared__ float pick_sc[TOPK];
    __shared__ int pick_id[TOPK];
    unsigned rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    // every CTA of the cluster must have started before any stores into rank 0's shared memory: arrive now, wait
    // right before the stores (the weight loads and the norm hide it)
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int row = blockIdx.y;
    const int col = tid * 8;
    uint4 w[EPC];                                           // weights: before the wait
#pragma unroll
    for (int j = 0; j < EPC; ++j)
        w[j] = *reinterpret_cast<const uint4*>(gate + (size_t)(rank * EPC + j) * H + col);
    const uint4 nw4 = *reinterpret_cast<const uint4*>(nw + col);
    if (rank == 0 && tid < E) bias_s[tid] = bias[tid];
    if (pdl) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    }
    const uint4 r4 = *reinterpret_cast<const uint4*>(res + (size_t)row * H + col);
    const uint4 x4 = *reinterpret_cast<const uint4*>(x + (size_t)row * H + col);
    const unsigned rv[4] = {r4.x, r4.y, r4.z, r4.w}, xv[4] = {x4.x, x4.y, x4.z, x4.w};
    const unsigned nwv[4] = {nw4.x, nw4.y, nw4.z, nw4.w};
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
        const float n = __uint_as_float(rnd(nr[i] * rstd) << 16);
        nbits[i] = rnd(bf(nwv[i / 2], i & 1) * n);
        xn[i] = __uint_as_float(nbits[i] << 16);
        rbits[i] = __float_as_uint(nr[i]) >> 16;
    }
    float part[EPC];
#pragma unroll
    for (int j = 0; j < EPC; ++j) {
        const unsigned wv[4] = {w[j].x, w[j].y, w[j].z, w[j].w};
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
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");    // the cluster has started (the arrive above)
    if (tid < EPC) {
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < WARPS; ++i) s += red_s[i][tid];
        st_cluster(&logits_s[rank * EPC + tid], 0, rnd(s) << 16);   // bf16 logit as fp32 bits
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
    float score = 0.f, biased = NEG_INF;
    if (tid < E) {
        score = 1.f / (1.f + __expf(-logits_s[tid]));
        biased = score + bias_s[tid];
        b_s[tid] = biased;
        float m1 = biased;
        for (int o = GS / 2; o > 0; o >>= 1) m1 = fmaxf(m1, __shfl_xor_sync(0xffffffffu, m1, o));
        const unsigned group = GS == 32 ? 0xffffffffu : (((1u << GS) - 1u) << ((lane / GS) * GS));
        const int ties = __popc(__ballot_sync(0xffffffffu, biased == m1) & group);
        float v2 = (biased == m1) ? NEG_INF : biased;
        for (int o = GS / 2; o > 0; o >>= 1) v2 = fmaxf(v2, __shfl_xor_sync(0xffffffffu, v2, o));
        if ((tid % GS) == 0) gs_s[tid / GS] = m1 + (ties >= 2 ? m1 : v2);
    }
    __syncthreads();
    unsigned kept = 0;
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
                const int j = g * GS + k;
                const float bj = b_s[j];
                r += (bj > biased) || (bj == biased && j < tid);
            }
        }
        if (r < TOPK) { pick_id[r] = tid; pick_sc[r] = score; }
    }
    __syncthreads();
    int my_id = E + (tid - TOPK);                           // a fused shared expert, weight 1.0
    if (tid < KP) {
        float wgt = 1.f;
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
            for (int p = 0; p < KP; ++p) lower += (p < TOPK ? pick_id[p] : E + (p - TOPK)) < my_id;
            sorted_out[lower * bm] = tid;
            block_expert_out[lower] = my_id;
        }
        if (tid == 0) total_out[0] = KP * bm;
    }
}
"""

_KERNELS: dict[tuple, cuda_rtc.Kernel] = {}


def defines(hidden: int, num_routed: int, n_group: int, topk_group: int, top_k: int, fused_shared: int,
            cluster: int) -> tuple[str, ...]:
    """The NVRTC -D options of one shape."""
    return (f"-DH={hidden}", f"-DE={num_routed}", f"-DGS={num_routed // n_group}", f"-DTOPK_GROUP={topk_group}",
            f"-DTOPK={top_k}", f"-DSHARED={fused_shared}", f"-DCLUSTER={cluster}")


def shape_ok(hidden: int, num_routed: int, n_group: int, top_k: int, fused_shared: int, cluster: int) -> bool:
    """The shapes this kernel takes (module docstring)."""
    if hidden % (32 * VEC) or not 0 < hidden <= MAX_HIDDEN or num_routed % 32 or n_group <= 0:
        return False
    gs = num_routed // n_group
    return (num_routed % n_group == 0 and 0 < gs <= 32 and gs & (gs - 1) == 0 and n_group <= 32
            and num_routed <= hidden // VEC and cluster in (1, 2, 4, 8, 16) and num_routed % cluster == 0
            and 0 < top_k <= min(32, num_routed) and top_k + fused_shared <= hidden // VEC)


def eligible(x: torch.Tensor, gate_weight: torch.Tensor, n_group: int, topk_group: int, top_k: int,
             fused_shared: int) -> bool:
    """Whether add_rmsnorm_router runs here (module docstring); the arguments are the op's, already checked."""
    if not (ENABLED and not FAILED and x.is_cuda and x.dtype == torch.bfloat16
            and gate_weight.dtype == torch.bfloat16):
        return False
    num_routed, hidden = gate_weight.shape
    rows = x.numel() // hidden if hidden else 0
    if not 1 <= rows <= MAX_ROWS or not shape_ok(hidden, num_routed, n_group, top_k, fused_shared, CLUSTER):
        return False
    return _major(indexed(x.device)) >= 9 and cuda_rtc.nvrtc_available()


def _kernel(device: torch.device, opts: tuple[str, ...]) -> cuda_rtc.Kernel:
    key = (indexed(device), opts)
    if key not in _KERNELS:
        major, minor = torch.cuda.get_device_capability(device)
        arch = f"sm_{major}{minor}" + ("a" if major == 9 else "")
        with torch.cuda.device(device):
            _KERNELS[key] = cuda_rtc.Kernel(cuda_rtc.compile_cuda(SOURCE, "norm_router_cluster", arch, opts),
                                            "norm_router_cluster", non_portable_cluster=CLUSTER > 8)
    return _KERNELS[key]


def add_rmsnorm_router(residual, x, norm_weight, eps, gate_weight, expert_bias, n_group, topk_group, top_k,
                       routed_scaling_factor, num_experts, block_m, fused_shared, pdl) -> tuple | None:
    """The cluster launch into fresh outputs (normed, new_residual, weights, ids, sorted_pairs, block_expert, total),
    or None after a compile or launch failure (warned once; the caller runs kernels/norm_router.py's paths)."""
    num_routed, hidden = gate_weight.shape
    rows = x.numel() // hidden
    dev = x.device
    res2, x2 = residual.reshape(rows, hidden).contiguous(), x.reshape(rows, hidden).contiguous()
    tensors = (res2, x2, norm_weight.contiguous(), gate_weight.contiguous(), expert_bias.float().contiguous())
    if any(t.data_ptr() % 16 for t in tensors[:4]):
        return None
    normed = torch.empty(x.shape, dtype=x.dtype, device=dev)
    new_residual = torch.empty(residual.shape, dtype=residual.dtype, device=dev)
    width = top_k + fused_shared
    weights = torch.empty((rows, width), dtype=torch.float32, device=dev)
    ids = torch.empty((rows, width), dtype=torch.int32, device=dev)
    if block_m > 0:
        cells, blocks = align_sizes(rows * width, num_experts, block_m)
        aligned = (torch.empty((cells,), dtype=torch.int32, device=dev),
                   torch.empty((blocks,), dtype=torch.int32, device=dev),
                   torch.empty((1,), dtype=torch.int32, device=dev))
    else:
        cells, blocks, aligned = 0, 0, no_align(weights)
    scratch = aligned if block_m > 0 else (ids, ids, ids)
    try:
        kernel = _kernel(dev, defines(hidden, num_routed, n_group, topk_group, top_k, fused_shared, CLUSTER))
        kernel((CLUSTER, rows), (hidden // VEC,),
               [*tensors, ctypes.c_float(eps), ctypes.c_float(routed_scaling_factor), normed, new_residual, weights,
                ids, *scratch, ctypes.c_int(cells), ctypes.c_int(blocks), ctypes.c_int(max(block_m, 0)),
                ctypes.c_int(int(pdl))], cluster=CLUSTER, pdl=pdl)
    except RuntimeError as exc:
        FAILED.append(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        warnings.warn(f"lingc: the cluster norm + gate + router (kernels/norm_router_cluster.py) failed ({FAILED[0]}); "
                      "kernels/norm_router.py's kernels run instead. LINGC_NORM_ROUTER_CLUSTER=0 skips the attempt.",
                      RuntimeWarning, stacklevel=3)
        return None
    return normed, new_residual, weights, ids, *aligned
