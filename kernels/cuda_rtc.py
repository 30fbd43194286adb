"""CUDA C++ kernels where Triton cannot express them: NVRTC compile and cuLaunchKernelEx with launch attributes.

Triton 3.6 and Gluon 3.6 expose neither a thread-block cluster's barrier nor distributed shared memory on Hopper, and
Triton's launcher sets no cluster dimension for a num_ctas = 1 kernel. For kernels that need them
(kernels/norm_router_cluster.py; the probes bench/kernel_cluster_chain.py and bench/kernel_cluster_router.py) this
module compiles CUDA C++ source with NVRTC (the libnvrtc a CUDA build of torch depends on; torch's own helper,
torch.cuda._utils._nvrtc_compile, needs a CUDA toolkit's include directory, which the device image need not have) and
launches it with the driver's cuLaunchKernelEx, whose attributes carry the cluster dimension and PDL's programmatic
stream serialisation (ctypes on libcuda, as kernels/carveout.py does). A launch on torch's current stream is captured
by torch.cuda.graph like any other. CPU-only machines can still compile (tests, offline checks of the source) where a
libnvrtc is found: LINGC_NVRTC names one, else the CUDA wheels' copies in site-packages, else the loader's path.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import site
import sys

# cuda.h
CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14


# Device helpers for cluster kernels, prepended to their sources: a shared-memory address as the 32-bit shared window
# address, a store of one 32-bit value into CTA `rank`'s copy of a shared variable (mapa + st.shared::cluster), and
# the cluster barrier with release / acquire semantics (every thread of every CTA of the cluster)
CLUSTER_HELPERS = r"""
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    unsigned a;
    asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ void st_cluster(const void* local, unsigned rank, unsigned v) {
    unsigned remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(local)), "r"(rank));
    asm volatile("st.shared::cluster.u32 [%0], %1;" :: "r"(remote), "r"(v) : "memory");
}
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
"""


def nvrtc_candidates() -> list[str]:
    """Where libnvrtc may be, in the order tried: LINGC_NVRTC, the sonames (a CUDA build of torch may have loaded one
    already), then the CUDA wheels' copies under every sys.path / site-packages root (nvidia/*/lib, nvidia/cu13/lib)."""
    out = [os.environ["LINGC_NVRTC"]] if os.environ.get("LINGC_NVRTC") else []
    out += ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    roots = list(sys.path) + site.getsitepackages() + [site.getusersitepackages()]
    for root in dict.fromkeys(roots):
        for pattern in (("nvidia", "*", "lib"), ("nvidia", "*", "*", "lib")):
            out += sorted(glob.glob(os.path.join(root, *pattern, "libnvrtc.so*")), reverse=True)
    return [p for p in dict.fromkeys(out) if "builtins" not in os.path.basename(p)]


def nvrtc() -> ctypes.CDLL:
    """The first libnvrtc that loads (nvrtc_candidates), or a RuntimeError naming what was tried. A library given by
    path has its directory's libnvrtc-builtins loaded first (globally), which NVRTC opens at compile time."""
    tried = []
    for path in nvrtc_candidates():
        try:
            if os.sep in path:
                for builtins in sorted(glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so*"))):
                    try:
                        ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
                    except OSError:
                        pass
            return ctypes.CDLL(path)
        except OSError as err:
            tried.append(f"{path} ({err})")
    raise RuntimeError("no libnvrtc could be loaded; set LINGC_NVRTC to its path. Tried: " + "; ".join(tried[:8]))


@functools.lru_cache(maxsize=None)
def nvrtc_available() -> bool:
    """Whether a libnvrtc loads here (cached)."""
    try:
        nvrtc()
    except RuntimeError:
        return False
    return True


@functools.lru_cache(maxsize=64)
def compile_cuda(source: str, name: str, arch: str = "sm_90a", options: tuple[str, ...] = (),
                 ptx: bool = False) -> bytes:
    """NVRTC-compile `source` (CUDA C++, its kernels extern "C") for `arch` (sm_XX[a]): the cubin, or with ptx=True
    the PTX (for compute_XX[a]). A compile error raises with NVRTC's log and the file name `name`.cu. Cached per
    (source, name, arch, options, ptx) for the process."""
    lib = nvrtc()
    prog = ctypes.c_void_p()

    def check(err: int, what: str) -> None:
        if err != 0:
            lib.nvrtcGetErrorString.restype = ctypes.c_char_p
            raise RuntimeError(f"{name}.cu: {what} failed: {lib.nvrtcGetErrorString(err).decode()}")

    check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None),
          "nvrtcCreateProgram")
    try:
        target = arch.replace("sm_", "compute_") if ptx else arch
        opts = [f"--gpu-architecture={target}".encode(), b"--std=c++17", b"-default-device"] + \
               [o.encode() for o in options]
        res = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        if res != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"{name}.cu: NVRTC compile for {target} failed:\n{log.value.decode()}")
        size = ctypes.c_size_t()
        get_size, get = (lib.nvrtcGetPTXSize, lib.nvrtcGetPTX) if ptx else (lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN)
        check(get_size(prog, ctypes.byref(size)), "getting the output size")
        buf = ctypes.create_string_buffer(size.value)
        check(get(prog, buf), "getting the output")
        return buf.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


class _AttrValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("dims", ctypes.c_uint * 3), ("flag", ctypes.c_int)]


class _Attr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttrValue)]


class _Config(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attr)), ("num_attrs", ctypes.c_uint)]


class Kernel:
    """One extern "C" kernel of a compiled module, launched by cuLaunchKernelEx (cluster dimension, PDL)."""

    def __init__(self, binary: bytes, name: str, non_portable_cluster: bool = False, dynamic_smem: int = 0) -> None:
        self.cuda = ctypes.CDLL("libcuda.so.1")
        self.name = name
        import torch
        torch.zeros(1, device="cuda")           # the primary context, current on this thread, for the module
        torch.cuda.synchronize()
        self.module, self.func = ctypes.c_void_p(), ctypes.c_void_p()
        self._check(self.cuda.cuModuleLoadData(ctypes.byref(self.module), binary), "cuModuleLoadData")
        self._check(self.cuda.cuModuleGetFunction(ctypes.byref(self.func), self.module, name.encode()),
                    "cuModuleGetFunction")
        if non_portable_cluster:
            self._check(self.cuda.cuFuncSetAttribute(self.func, CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
                                                     ctypes.c_int(1)), "cuFuncSetAttribute(non-portable cluster)")
        if dynamic_smem:
            self._check(self.cuda.cuFuncSetAttribute(self.func, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                     ctypes.c_int(dynamic_smem)), "cuFuncSetAttribute(smem)")

    def _check(self, err: int, what: str) -> None:
        if err != 0:
            msg = ctypes.c_char_p()
            self.cuda.cuGetErrorString(err, ctypes.byref(msg))
            raise RuntimeError(f"{self.name}: {what} failed with CUresult {err} "
                               f"({msg.value.decode() if msg.value else '?'})")

    @staticmethod
    def _config(grid, block, cluster: int, pdl: bool, smem: int, stream) -> tuple[_Config, ctypes.Array]:
        attrs = (_Attr * 2)()
        n = 0
        if cluster > 1:
            attrs[n].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attrs[n].value.dims[0], attrs[n].value.dims[1], attrs[n].value.dims[2] = cluster, 1, 1
            n += 1
        if pdl:
            attrs[n].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attrs[n].value.flag = 1
            n += 1
        cfg = _Config()
        for i in range(3):
            cfg.grid[i], cfg.block[i] = (tuple(grid) + (1, 1, 1))[i], (tuple(block) + (1, 1, 1))[i]
        cfg.shared, cfg.stream, cfg.attrs, cfg.num_attrs = smem, stream, attrs, n
        return cfg, attrs

    def max_clusters(self, cluster: int, block: int, smem: int = 0) -> int:
        """How many clusters of `cluster` CTAs the GPU holds at once (cuOccupancyMaxActiveClusters)."""
        cfg, _keep = self._config((cluster * 256,), (block,), cluster, False, smem, None)
        n = ctypes.c_int(0)
        self._check(self.cuda.cuOccupancyMaxActiveClusters(ctypes.byref(n), self.func, ctypes.byref(cfg)),
                    f"cuOccupancyMaxActiveClusters({cluster})")
        return n.value

    def __call__(self, grid, block, args: list, cluster: int = 1, pdl: bool = False, smem: int = 0) -> None:
        """Launch on torch's current stream; args are ctypes scalars or torch tensors (passed as pointers)."""
        import torch
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        cfg, _keep = self._config(grid, block, cluster, pdl, smem, stream)
        vals = [ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor) else a for a in args]
        params = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in vals])
        self._check(self.cuda.cuLaunchKernelEx(ctypes.byref(cfg), self.func, params, None), "cuLaunchKernelEx")
