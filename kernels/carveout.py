"""One shared-memory carveout for every Triton kernel lingc loads (LINGC_SMEM_CARVEOUT), so PDL neighbours can share
an SM.

An SM splits its 256 KiB of L1 / shared memory by a carveout, and a kernel's CTAs run only on an SM whose current
split suits them; changing the split needs the SM drained. Triton's loader gives kernels that use more than 48 KiB
of shared memory (the pipelined GEMVs and GEMMs) `CU_FUNC_CACHE_PREFER_SHARED`, and leaves the rest (norms, router,
kda, sampling) to the driver's default, which favours L1. In a batch-1 step the two kinds alternate, and under PDL a
kernel's CTAs are meant to start on SMs still running the kernel before it. With LINGC_SMEM_CARVEOUT=P (percent of
the maximum shared memory, 0-100) every kernel gets CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = P when it
is loaded (Triton's `kernel_load_end_hook`), so neighbours ask for the same split. The default is 100 (the most
shared memory, what Triton already asks for its big-smem kernels); LINGC_SMEM_CARVEOUT=none leaves every kernel to
Triton and the driver. H200, one call (bench/results/step-ab-h200-20261201-c.json, call 58): decode step 1.256 /
1.263 ms without (two runs) against 1.231 with 100; verify (2.583 / 2.589 against 2.584) and NEXTN unchanged.
A carveout is a hint to the driver and never changes a value. Only lingc's own kernels get it (a kernel whose name
is a `triton.jit` function of a lingc.kernels module); other Triton kernels in the process (Inductor's) keep theirs.
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings

import triton
from triton.runtime.jit import KernelInterface   # a triton.jit function (JITFunction; InterpretedFunction under the
                                                 # interpreter)

CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9   # CUfunction_attribute (cuda.h)
ENV = "LINGC_SMEM_CARVEOUT"


DEFAULT_PERCENT = 100


def carveout_percent() -> int | None:
    """LINGC_SMEM_CARVEOUT as an int in [0, 100] (DEFAULT_PERCENT when unset or empty), or None for "none"."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return DEFAULT_PERCENT
    if raw.lower() == "none":
        return None
    if not raw.isdigit() or int(raw) > 100:
        raise ValueError(f"{ENV}={raw!r}: want an integer percent of the maximum shared memory, 0-100, or none")
    return int(raw)


def lingc_kernel_names() -> set[str]:
    """Names of the triton.jit functions of every lingc.kernels module imported so far (= the compiled kernels')."""
    return {getattr(value, "__name__", None) for mod_name, mod in list(sys.modules.items())
            if mod_name.startswith("lingc.kernels.") and mod is not None
            for value in vars(mod).values() if isinstance(value, KernelInterface)} - {None}


def _set_carveout(percent: int):
    cuda = []                                 # libcuda, opened at the first kernel load (there is none on CPU)
    names: set[str] = set()
    failed: list[str] = []

    def hook(module, function, name, metadata_group, hash_) -> None:
        if name not in names:
            names.update(lingc_kernel_names())  # modules imported since the last kernel load
            if name not in names:
                return                          # not a lingc kernel: left as Triton loaded it
        if not cuda:
            cuda.append(ctypes.CDLL("libcuda.so.1"))
        err = cuda[0].cuFuncSetAttribute(ctypes.c_void_p(function), CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                                         ctypes.c_int(percent))
        if err != 0 and not failed:      # a hint: the kernel runs either way, so say it once and go on
            failed.append(name)
            warnings.warn(f"{ENV}={percent}: cuFuncSetAttribute on Triton kernel {name} failed with CUresult {err}; "
                          f"kernels keep the driver's carveout (set {ENV}=none to skip the attempt)", RuntimeWarning,
                          stacklevel=2)
    return hook


def install() -> bool:
    """Chain the carveout hook onto Triton's kernel_load_end_hook unless LINGC_SMEM_CARVEOUT=none; True if chained."""
    percent = carveout_percent()
    if percent is None:
        return False
    hook = _set_carveout(percent)
    previous = triton.knobs.runtime.kernel_load_end_hook

    def chained(*args) -> None:
        if previous is not None:
            previous(*args)
        hook(*args)
    triton.knobs.runtime.kernel_load_end_hook = chained
    return True
