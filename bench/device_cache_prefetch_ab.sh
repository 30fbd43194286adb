#!/usr/bin/env bash
# One device call (one GPU; ~6 minutes on a cold machine): prefetch_weights' MLA_CACHE hint (an l2_prefetch_pages of
# each MLA layer's visible latent cache on the side stream, kernels/l2_prefetch.py), A/B in the step, then where the
# time goes with it:
# 1. bench/device_step.py --only all (OUT_DIR/ab.json): rows all / all@c1 (the hint after the nearest streaming launch
#    before mla_attention: the q_b projection) / all@base2 / all@c2 (after the q_a / kv_a / gate projection) /
#    all@c3 (after the previous layer's down-GEMM) / all@base3; greedy decode, verify and NEXTN ms
# 2. bench/device_launches.py --pdl with the hint at CACHE_ANCHOR_SKIP (OUT_DIR/launches-cache.json; default 2):
#    mla_attention's kernels with the cache in L2
#
#   LINGC_COMMIT=<hash> bash bench/device_cache_prefetch_ab.sh OUT_DIR [SKIP]
#
# Each step has its own time limit, so one that hangs leaves the others' files. Run from the repository root.
set -u
OUT=${1:?usage: LINGC_COMMIT=<hash> bash bench/device_cache_prefetch_ab.sh OUT_DIR [SKIP]}
SKIP=${2:-2}
source bench/device_site.sh
P=lingc.passes.prefetch_weights
ON="$P.PrefetchWeights.in_all=True;$P.WEIGHTS=False;$P.MLA_CACHE=True"
echo "== step A/B"
timeout 360 python3 bench/device_step.py --only all --no-parity --variant "c1:$ON;$P.CACHE_ANCHOR_SKIP=1" \
  --variant 'base2:' --variant "c2:$ON;$P.CACHE_ANCHOR_SKIP=2" --variant "c3:$ON;$P.CACHE_ANCHOR_SKIP=3" \
  --variant 'base3:' --json "$OUT/ab.json" 2>&1 | grep -v Warning | tail -3
python3 bench/device_step.py --rows "$OUT/ab.json"
echo "== launches with the cache hint (skip $SKIP)"
LINGC_PREFETCH_MLA_CACHE=1 LINGC_PREFETCH_WEIGHT_HINTS=0 LINGC_PREFETCH_CACHE_ANCHOR_SKIP=$SKIP timeout 170 \
  python3 bench/device_launches.py --pdl --passes all,prefetch_weights --graphs step_greedy,verify_greedy \
  --json "$OUT/launches-cache.json" 2>&1 | grep -v Warning | grep -E "mla_attention|busy|side" | head -12
