#!/usr/bin/env bash
# prefetch_weights' A/B on one GPU (nvidia-h200), one device call of ~5 minutes: is the side-stream L2 prefetch of
# the big projections' weights (passes/prefetch_weights.py, kernels/l2_prefetch.py) worth putting in `all`?
#
#   LINGC_COMMIT=<hash> bash bench/device_prefetch_ab.sh OUT_DIR
#
# 1. the probe (bench/kernel_l2_prefetch.py): the KDA projection and o_proj after a side-stream prefetch and an
#    HBM-idle gap, against cold and warm weights (OUT_DIR/kernel-l2-prefetch.json)
# 2. the "all" row with and without the hints in one process, A/B/A/B (OUT_DIR/ab.json): base, pf (the default
#    placement: after the nearest streaming launch), pf_s2 (ANCHOR_SKIP 2: one streaming launch earlier), pf_last
#    (the prefetched lines evict_last), then the four again
# 3. greedy parity with the hints (OUT_DIR/parity.json: NEXTN == plain decoding, greedy copies == general graphs,
#    PDL off == on), the first GPU run of the side stream's fork / join inside a CUDA graph with every check
# Each step has its own time limit, so one that hangs leaves the others' files. Run from the repository root.
set -u
OUT=${1:?usage: LINGC_COMMIT=<hash> bash bench/device_prefetch_ab.sh OUT_DIR}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
rm -rf /tmp/lingc-site
pip install -q --no-deps --no-build-isolation --target /tmp/lingc-site . || exit 1
export PYTHONPATH=/tmp/lingc-site
PF=lingc.passes.prefetch_weights
ON="$PF.PrefetchWeights.in_all=True"
echo "== probe"
timeout 100 python3 bench/kernel_l2_prefetch.py --shapes kda_qkvfbg,o_proj --json "$OUT/kernel-l2-prefetch.json" 2>&1 \
  | grep -v Warning | tail -30
echo "== A/B"
timeout 330 python3 bench/device_step.py --only all --no-parity \
  --variant 'base:' --variant "pf:$ON" --variant "pf_s2:$ON;$PF.ANCHOR_SKIP=2" \
  --variant "pf_last:$ON;lingc.kernels.l2_prefetch.EVICT_LAST=True" \
  --variant 'base2:' --variant "pf2:$ON" --variant "pf_s2_2:$ON;$PF.ANCHOR_SKIP=2" \
  --variant "pf_last2:$ON;lingc.kernels.l2_prefetch.EVICT_LAST=True" \
  --json "$OUT/ab.json" 2>&1 | grep -v Warning | tail -40
echo "== parity with the hints"
timeout 150 python3 bench/device_step.py --only all --parity-passes all,prefetch_weights \
  --json "$OUT/parity.json" 2>&1 | grep -v Warning | tail -15
