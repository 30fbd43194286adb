# Sourced by the one-call device scripts (device_tail_ab.sh, device_boundary_ab.sh) after they set OUT: unbuffered
# Python, the output folder, this checkout installed into /tmp/lingc-site (no dependencies: the device image has
# torch and triton) and put on PYTHONPATH, and the GPU's name printed. Run from the repository root.
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
rm -rf /tmp/lingc-site
pip install -q --no-deps --no-build-isolation --target /tmp/lingc-site . || exit 1
export PYTHONPATH=/tmp/lingc-site
nvidia-smi --query-gpu=name --format=csv,noheader
