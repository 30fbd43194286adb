#!/usr/bin/env bash
# The step benchmark and its peers in one device call on one GPU (nvidia-h200): a parallel warm-up of Triton's
# on-disk kernel cache, lingc's pass ablation, floors, greedy parity and end-to-end run (bench/device_step.py --e2e
# --budget-s), then the peers on the same GPU (bench/peers.py: torch.compile max-autotune of the decode and NEXTN
# steps, each in its own process, timing under peers.py's exclusive lock; transformers 5.23 eager if its wheel is
# given), then the merge (speedup_vs_<peer> in step.json's summary). bench/device_step_x2.sh does the same side by
# side on two GPUs.
#
#   bash bench/device_step_1gpu.sh OUT_DIR [path/to/transformers-5.23.0-py3-none-any.whl]
#
# At most ~10 minutes (the device call's limit): pip, the warm-up (killed at 120 s), the step part (budgeted at
# STEP_BUDGET_S, 290 s, killed at 340 s), the peers (110 s). A cold machine compiles every row's kernels afresh: the
# 2026-12-04 call spent 264 s of its step part on compiles, one row after another, and lost its end-to-end run to a
# 450 s limit. So first WARM_SHARDS (6) processes compile the rows, the parity's and the end-to-end run's engines on
# a 4-layer model (the same kernels: every layer of a kind has the same shapes) into the shared cache, in parallel,
# timing nothing; then the step part mostly loads compiled kernels. Under its budget device_step.py runs the rows the
# table needs ("none", "partition", "all"), the parity and the end-to-end run first and the other ablation rows
# while one fits; a row that does not is listed in step.json's skipped_rows.
# Run from the repository root.
set -u
OUT=${1:?usage: bash bench/device_step_1gpu.sh OUT_DIR [transformers wheel]}
WHEEL=${2:-}
STEP_BUDGET_S=${STEP_BUDGET_S:-290}
WARM_SHARDS=${WARM_SHARDS:-6}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
rm -rf /tmp/lingc-site /tmp/lingc-tf /tmp/lingc-*.log
pip install -q --no-deps --no-build-isolation --target /tmp/lingc-site . || exit 1
export PYTHONPATH=/tmp/lingc-site
for ((i = 0; i < WARM_SHARDS; i++)); do
  timeout 120 python3 bench/device_step.py --warm-only --e2e --layers 4 --shard "$i/$WARM_SHARDS" \
    --json "/tmp/lingc-warm$i.json" > "/tmp/lingc-warm$i.log" 2>&1 &
done
wait
for ((i = 0; i < WARM_SHARDS; i++)); do echo "== warm-up $i: $(tail -1 /tmp/lingc-warm$i.log)"; done
mkdir -p "$OUT/warm-up" && cp /tmp/lingc-warm*.json "$OUT/warm-up/" 2>/dev/null   # each row's cold compile + capture
timeout 340 python3 bench/device_step.py --e2e --budget-s "$STEP_BUDGET_S" --json "$OUT/step.json" 2>&1 \
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
for log in /tmp/lingc-t*.log; do echo "== $log"; tail -3 "$log"; done   # the peers
python3 bench/device_step.py --json "$OUT/step.json" --merge-peers "${merge[@]}"
