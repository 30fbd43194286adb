#!/usr/bin/env bash
# The step benchmark and its peers side by side in one device call on the 2-GPU kind (nvidia-h200-x2):
# lingc's pass ablation, floors, greedy parity and end-to-end run on GPU 0 (bench/device_step.py --e2e) while the
# peers compile and run on GPU 1 (bench/peers.py: torch.compile max-autotune of the decode and NEXTN steps, each in
# its own process, and transformers 5.23 eager if its wheel is given); the peers time only under an exclusive lock,
# so no two time at once. Then the peers are merged into step.json (speedup_vs_<peer> in its summary).
#
#   bash bench/device_step_x2.sh OUT_DIR [path/to/transformers-5.23.0-py3-none-any.whl]
#
# At most ~10 minutes: a parallel warm-up of Triton's kernel cache on GPU 0 (killed at 120 s), then the step part,
# budgeted at STEP_BUDGET_S (370 s) and killed at 420 s (device_step_1gpu.sh says why); the peers compile in 20-35 s
# each since peers.py short-circuits torch 2.11 inductor's log formatting.
# Run from the repository root; the device image has torch, triton, typer, rich, safetensors and networkx.
set -u
OUT=${1:?usage: bash bench/device_step_x2.sh OUT_DIR [transformers wheel]}
WHEEL=${2:-}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT"
rm -rf /tmp/lingc-site /tmp/lingc-tf /tmp/lingc-*.log
warm=()
pip install -q --no-deps --no-build-isolation --target /tmp/lingc-site . || exit 1
export PYTHONPATH=/tmp/lingc-site

peers=(torch_compile_decode torch_compile_nextn)
for p in "${peers[@]}"; do
  CUDA_VISIBLE_DEVICES=1 timeout 500 python3 bench/peers.py "$p" --json "$OUT/$p.json" > "/tmp/lingc-$p.log" 2>&1 &
done
merge=(torch_compile="$OUT/torch_compile_decode.json" torch_compile="$OUT/torch_compile_nextn.json")
if [ -n "$WHEEL" ]; then
  pip install -q --no-deps --target /tmp/lingc-tf "$WHEEL"   # only it: the image's huggingface_hub / tokenizers serve it
  CUDA_VISIBLE_DEVICES=1 PYTHONPATH=/tmp/lingc-tf:/tmp/lingc-site timeout 500 \
    python3 bench/peers.py transformers --json "$OUT/transformers.json" > /tmp/lingc-transformers.log 2>&1 &
  merge+=(transformers="$OUT/transformers.json")
fi

WARM_SHARDS=${WARM_SHARDS:-6}       # device_step_1gpu.sh says why
for ((i = 0; i < WARM_SHARDS; i++)); do
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 bench/device_step.py --warm-only --e2e --layers 4 \
    --shard "$i/$WARM_SHARDS" --json "/tmp/lingc-warm$i.json" > "/tmp/lingc-warm$i.log" 2>&1 &
  warm+=($!)
done
wait "${warm[@]}"
for ((i = 0; i < WARM_SHARDS; i++)); do echo "== warm-up $i: $(tail -1 /tmp/lingc-warm$i.log)"; done
mkdir -p "$OUT/warm-up" && cp /tmp/lingc-warm*.json "$OUT/warm-up/" 2>/dev/null   # each row's cold compile + capture
CUDA_VISIBLE_DEVICES=0 timeout 420 python3 bench/device_step.py --e2e --budget-s "${STEP_BUDGET_S:-370}" \
  --json "$OUT/step.json" 2>&1 | grep -v Warning
wait
for log in /tmp/lingc-t*.log; do echo "== $log"; tail -3 "$log"; done   # the peers
python3 bench/device_step.py --json "$OUT/step.json" --merge-peers "${merge[@]}"
