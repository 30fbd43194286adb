#!/usr/bin/env bash
# The step benchmark and its peers in one device call on one GPU (nvidia-h200): lingc's pass ablation, floors,
# greedy parity and end-to-end run first (bench/device_step.py --e2e --budget-s), then the peers on the same GPU
# (bench/peers.py: torch.compile max-autotune of the decode and NEXTN steps, each in its own process, timing
# under peers.py's exclusive lock; transformers 5.23 eager if its wheel is given), then the merge
# (speedup_vs_<peer> in step.json's summary). bench/device_step_x2.sh does the same side by side on two GPUs.
#
#   bash bench/device_step_1gpu.sh OUT_DIR [path/to/transformers-5.23.0-py3-none-any.whl]
#
# At most ~10 minutes (the device call's limit): the step part is budgeted at STEP_BUDGET_S (380 s) and killed at
# 450 s, the peers at 110 s. Under the budget device_step.py runs the rows the table needs ("none", "partition",
# "all"), the parity and the end-to-end run first, then the rest of the ablation while a row still fits; a cold
# machine compiles every row's kernels afresh (the 2026-12-04 table call spent 264 s on compiles and lost its
# end-to-end run to the old 450 s limit), so a row that does not fit is listed in step.json's skipped_rows.
# Run from the repository root.
set -u
OUT=${1:?usage: bash bench/device_step_1gpu.sh OUT_DIR [transformers wheel]}
WHEEL=${2:-}
STEP_BUDGET_S=${STEP_BUDGET_S:-380}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
rm -rf /tmp/lingc-site /tmp/lingc-tf
pip install -q --no-deps --no-build-isolation --target /tmp/lingc-site . || exit 1
export PYTHONPATH=/tmp/lingc-site
timeout 450 python3 bench/device_step.py --e2e --budget-s "$STEP_BUDGET_S" --json "$OUT/step.json" 2>&1 \
  | grep -v Warning
merge=(torch_compile="$OUT/torch_compile_decode.json" torch_compile="$OUT/torch_compile_nextn.json")
for p in torch_compile_decode torch_compile_nextn; do
  PEER_DUMP_S=100 timeout 110 python3 bench/peers.py "$p" --json "$OUT/$p.json" > "/tmp/lingc-$p.log" 2>&1 &
done
if [ -n "$WHEEL" ]; then
  pip install -q --no-deps --target /tmp/lingc-tf "$WHEEL"   # only it: the image's huggingface_hub / tokenizers serve it
  PYTHONPATH=/tmp/lingc-tf:/tmp/lingc-site timeout 110 python3 bench/peers.py transformers \
    --json "$OUT/transformers.json" > /tmp/lingc-transformers.log 2>&1
  merge+=(transformers="$OUT/transformers.json")
fi
wait
for log in /tmp/lingc-*.log; do echo "== $log"; tail -3 "$log"; done
python3 bench/device_step.py --json "$OUT/step.json" --merge-peers "${merge[@]}"
