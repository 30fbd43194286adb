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
