"""lingc kernels: Triton kernels, one module per family (kernel, launcher, reference, tunables), plus the shared
helpers pdl.py (PDL calls), workspace.py (per-device scratch) and carveout.py (LINGC_SMEM_CARVEOUT). One Gluon kernel:
linear_tma.py, the skinny GEMM's Hopper path for one-row launches (LINGC_LINEAR_TMA), which linear.py's launcher
dispatches to."""

from lingc.kernels import carveout as _carveout

_carveout.install()
