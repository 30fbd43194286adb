"""What a handoff between the CTAs of one thread-block cluster costs, against a kernel boundary (the structural lever).

The decode target needs fewer dependent launches a layer (docs/measurements.md, 2026-12-06 twenty-sixth session: a
KDA + MoE layer is 9 dependent launches at ~2.3 us over the floor each, and an empty PDL boundary alone costs 0.73 us,
bench/kernel_flag_chain.py). Phases fused into one kernel must still hand data on; a grid-wide ticket through L2 cost
about what the boundary did (1.14 us, the flag chain). A cluster of up to 16 CTAs (sm_90) can hand data on through
distributed shared memory (DSMEM: `mapa` + `st.shared::cluster`) and the hardware cluster barrier
(`barrier.cluster.arrive.release` / `wait.acquire`). Neither Triton 3.6 nor Gluon 3.6 exposes them (Triton's own
multi-CTA layouts fail to compile a plain reduction for sm_90: TritonGPUPlanCTAPass), so this probe compiles a
small CUDA C++ kernel with NVRTC and launches it with cuLaunchKernelEx and a cluster-dimension attribute
(kernels/cuda_rtc.py).

One launch runs `stages` dependent handoffs; each stage every CTA derives a value from the last stage's result, and:
    barrier    the cluster barrier alone (no data: the floor of any cluster handoff)
    allgather  every CTA stores its value into every CTA's shared memory (DSMEM), one barrier, each sums locally
    gather     every CTA stores into rank 0's shared memory, barrier, rank 0 sums and stores the sum into every CTA's
               shared memory, barrier (the router's shape: all ranks -> one -> all)
    global     every CTA stores its value to global memory, one barrier (release / acquire at cluster scope), each
               loads all values back through L2 (the exchange without DSMEM)
Values are uint32 with wrapping arithmetic, so the result is exact and checked against a Python model. The cost of a
stage is (t(long) - t(short)) / (long - short stages), each t a CUDA-graph replay median (bench/timing.py), so the
launch itself cancels out. Rows: cluster sizes 2-16 (16 needs the non-portable size attribute), one cluster alone
and as many clusters as the GPU holds at once (cuOccupancyMaxActiveClusters), one CTA an SM either way.

    python3 bench/kernel_cluster_chain.py [--sizes 2,4,8,16] [--modes barrier,allgather,gather,global]
                                          [--stages 16,528] [--json OUT]

Read the rows against the flag chain's `pdl` row on the same GPU (python3 bench/kernel_flag_chain.py --modes pdl).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys

import torch

from lingc.kernels.cuda_rtc import CLUSTER_HELPERS, Kernel, compile_cuda

sys.path.insert(0, os.path.dirname(__file__))
from timing import graph_time_us  # noqa: E402

MODES = {"barrier": 0, "allgather": 1, "gather": 2, "global": 3}
THREADS = 128
MAX_CLUSTER = 16

SOURCE = CLUSTER_HELPERS + r"""
__device__ __forceinline__ unsigned ld_cluster(const unsigned* p) {
    unsigned v;
    asm volatile("ld.relaxed.cluster.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

extern "C" __global__ void cluster_chain(unsigned* out, unsigned* gbuf, int stages, int mode, int pdl) {
    if (pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
    __shared__ unsigned slot[2][16];
    __shared__ unsigned result[2];
    unsigned rank, nrank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(nrank));
    unsigned cluster = blockIdx.x / nrank;
    unsigned acc = pdl ? out[blockIdx.x] : 0u;   // a PDL chain carries the value from launch to launch
    cluster_sync();                       // every CTA of the cluster has started before any DSMEM store
    for (int s = 0; s < stages; ++s) {
        unsigned v = acc * 3u + rank + 1u;
        int b = s & 1;                    // double-buffered: stage s + 2 writes only after barrier s + 1
        if (mode == 0) {
            cluster_sync();
            acc = acc * 3u + 1u;
        } else if (mode == 1) {
            if (threadIdx.x < nrank) st_cluster(&slot[b][rank], threadIdx.x, v);
            cluster_sync();
            unsigned sum = 0;
            for (unsigned r = 0; r < nrank; ++r) sum += slot[b][r];
            acc = sum;
        } else if (mode == 2) {
            if (threadIdx.x == 0) st_cluster(&slot[b][rank], 0, v);
            cluster_sync();
            if (rank == 0) {
                unsigned sum = 0;
                for (unsigned r = 0; r < nrank; ++r) sum += slot[b][r];
                if (threadIdx.x < nrank) st_cluster(&result[b], threadIdx.x, sum);
            }
            cluster_sync();
            acc = result[b];
        } else {
            unsigned* buf = gbuf + (cluster * 2 + b) * 16;
            if (threadIdx.x == 0) buf[rank] = v;
            cluster_sync();
            unsigned sum = 0;
            for (unsigned r = 0; r < nrank; ++r) sum += ld_cluster(buf + r);
            acc = sum;
        }
    }
    cluster_sync();                       // no CTA leaves while another may still store into its shared memory
    if (pdl) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (threadIdx.x == 0) out[blockIdx.x] = acc;
}
"""

class ClusterChain:
    """cluster_chain compiled for this GPU (kernels/cuda_rtc.py), launched with a cluster dimension."""

    def __init__(self) -> None:
        major, minor = torch.cuda.get_device_capability()
        self.kernel = Kernel(compile_cuda(SOURCE, "cluster_chain", f"sm_{major}{minor}a"), "cluster_chain",
                             non_portable_cluster=True)

    def max_clusters(self, cluster: int) -> int:
        return self.kernel.max_clusters(cluster, THREADS)

    def __call__(self, out: torch.Tensor, gbuf: torch.Tensor, stages: int, mode: int, grid: int, cluster: int,
                 pdl: bool = False):
        self.kernel((grid,), (THREADS,), [out, gbuf, ctypes.c_int(stages), ctypes.c_int(mode), ctypes.c_int(pdl)],
                    cluster=cluster, pdl=pdl)


def expected(mode: str, stages: int, cluster: int) -> int:
    """The value every CTA ends with (the kernel's arithmetic, uint32)."""
    acc = 0
    for _ in range(stages):
        if mode == "barrier":
            acc = (acc * 3 + 1) & 0xFFFFFFFF
        else:
            acc = sum(acc * 3 + r + 1 for r in range(cluster)) & 0xFFFFFFFF
    return acc


def measure(kernel: ClusterChain, mode: str, cluster: int, clusters: int, stages: tuple[int, int],
            dev: torch.device) -> dict:
    grid = cluster * clusters
    out = torch.zeros(grid, dtype=torch.int32, device=dev)
    gbuf = torch.zeros(clusters * 2 * MAX_CLUSTER, dtype=torch.int32, device=dev)
    times = {}
    for s in stages:
        out.zero_()
        kernel(out, gbuf, s, MODES[mode], grid, cluster)
        torch.cuda.synchronize()
        want = expected(mode, s, cluster)
        got = sorted({int(v) & 0xFFFFFFFF for v in out.tolist()})
        if got != [want]:
            return {"mode": mode, "cluster": cluster, "clusters": clusters, "ok": False,
                    "error": f"stages {s}: want {want} in every CTA, got {got[:4]}"}
        times[s] = min(graph_time_us([lambda s=s: kernel(out, gbuf, s, MODES[mode], grid, cluster)], repeats=20)
                       for _ in range(3))
    short, long_ = stages
    return {"mode": mode, "cluster": cluster, "clusters": clusters, "ctas": grid, "ok": True,
            "launch_us": {str(s): t for s, t in times.items()},
            "us_per_stage": (times[long_] - times[short]) / (long_ - short)}


def pdl_links(kernel: ClusterChain, cluster: int, clusters: int, links: int, dev: torch.device) -> dict:
    """A chain of `links` PDL launches of one stage each (allgather; the value carried in `out` from launch to launch):
    what a kernel boundary costs when the kernels are cluster launches (cluster 1: plain CTAs), us a link."""
    grid = cluster * clusters
    out = torch.zeros(grid, dtype=torch.int32, device=dev)
    gbuf = torch.zeros(clusters * 2 * MAX_CLUSTER, dtype=torch.int32, device=dev)
    mode = MODES["allgather"]
    calls = [lambda: out.zero_()] + [lambda: kernel(out, gbuf, 1, mode, grid, cluster, pdl=True)] * links
    us = min(graph_time_us(calls, repeats=20) for _ in range(3)) * len(calls) / links
    out.zero_()
    for c in calls[1:]:
        c()
    torch.cuda.synchronize()
    got = sorted({int(v) & 0xFFFFFFFF for v in out.tolist()})
    want = expected("allgather", links, cluster)
    return {"mode": "pdl_links", "cluster": cluster, "clusters": clusters, "ctas": grid, "links": links,
            "ok": got == [want], "us_per_link": us}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="2,4,8,16", help="cluster sizes (CTAs)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--stages", default="16,528", help="the short and the long chain, stages a launch")
    ap.add_argument("--links", type=int, default=256, help="PDL chain length for the pdl_links rows (0: none)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    stages = tuple(int(s) for s in args.stages.split(","))
    if len(stages) != 2 or stages[0] >= stages[1]:
        raise SystemExit(f"--stages {args.stages!r}: want SHORT,LONG with SHORT < LONG")
    kernel = ClusterChain()
    rows = []
    for cluster in (int(c) for c in args.sizes.split(",")):
        try:
            full = kernel.max_clusters(cluster)
        except RuntimeError as err:
            rows.append({"cluster": cluster, "ok": False, "error": str(err)})
            print(rows[-1], flush=True)
            continue
        for clusters in sorted({1, full}):
            for mode in args.modes.split(","):
                try:
                    row = measure(kernel, mode, cluster, clusters, stages, dev)
                except RuntimeError as err:
                    row = {"mode": mode, "cluster": cluster, "clusters": clusters, "ok": False, "error": str(err)}
                rows.append(row)
                print(f"cluster {cluster:2d} x {clusters:3d}  {mode:9s} "
                      + (f"{row['us_per_stage']:.3f} us a stage" if row.get("ok") else row.get("error", "")),
                      flush=True)
    if args.links:
        for cluster in (1,) + tuple(int(c) for c in args.sizes.split(",")):
            try:
                full = kernel.max_clusters(cluster) if cluster > 1 else 132
                for clusters in sorted({1, full}):
                    row = pdl_links(kernel, cluster, clusters, args.links, dev)
                    rows.append(row)
                    print(f"cluster {cluster:2d} x {clusters:3d}  pdl chain {row['us_per_link']:.3f} us a link"
                          f"{'' if row['ok'] else '  WRONG VALUE'}", flush=True)
            except RuntimeError as err:
                rows.append({"mode": "pdl_links", "cluster": cluster, "ok": False, "error": str(err)})
                print(rows[-1], flush=True)
    if args.json:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=os.path.dirname(__file__)).stdout.strip()
        except OSError:
            commit = ""
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "commit": os.environ.get("LINGC_COMMIT") or commit,
                       "command": "python3 bench/kernel_cluster_chain.py " + " ".join(sys.argv[1:]),
                       "stages": list(stages), "threads": THREADS, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
