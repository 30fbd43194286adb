#!/usr/bin/env bash
# Set up lingc in ./.venv on a fresh machine (CPU): torch 2.13 CPU wheel, triton, test oracles, lingc itself.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -d .venv ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
# torch first and pinned, so nothing below can pull a CUDA build of torch onto a CPU machine.
python -c "import torch" 2>/dev/null || pip install -q "torch==2.13.0"
pip install -q "numpy<2.4" "triton==3.6.0" "transformers==5.23.0" einops pytest pytest-xdist httpx openai
pip install -q -e ".[serve,test]"
# fla-core's naive KDA reference (tests load fla/ops/kda/naive.py by path; fla itself needs a GPU triton)
if [ ! -f .venv/fla-core/fla/ops/kda/naive.py ]; then
  mkdir -p .venv/fla-core
  pip download -q --no-deps "fla-core==0.6.0" -d .venv/fla-core
  python -m zipfile -e .venv/fla-core/fla_core-0.6.0-py3-none-any.whl .venv/fla-core
fi
# NVRTC for the offline compile tests of the CUDA C++ kernels (kernels/cuda_rtc.py; a CUDA build of torch brings its
# own libnvrtc on a GPU machine), unpacked into .venv/nvrtc; without it those tests skip.
if [ ! -f .venv/nvrtc/nvidia/cuda_nvrtc/lib/libnvrtc.so.12 ]; then
  mkdir -p .venv/nvrtc
  if pip download -q --no-deps "nvidia-cuda-nvrtc-cu12==12.9.86" -d .venv/nvrtc; then
    python -m zipfile -e .venv/nvrtc/nvidia_cuda_nvrtc_cu12-12.9.86-*.whl .venv/nvrtc
    rm -f .venv/nvrtc/*.whl
  else
    echo "setup.sh: could not download nvidia-cuda-nvrtc-cu12; the CUDA C++ compile tests will skip" >&2
  fi
fi
