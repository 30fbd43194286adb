"""lingc kernels: Triton kernels, one module per family (kernel, launcher, reference, tunables). None yet."""
