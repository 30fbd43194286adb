"""lingc kernels: Triton kernels, one module per family (kernel, launcher, reference, tunables), plus the shared
helpers pdl.py (PDL calls), workspace.py (per-device scratch) and carveout.py (LINGC_SMEM_CARVEOUT)."""

from lingc.kernels import carveout as _carveout

_carveout.install()
