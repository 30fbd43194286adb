#!/usr/bin/env bash
# prefetch_weights' A/B on one GPU (nvidia-h200): is a side-stream L2 prefetch (passes/prefetch_weights.py,
# kernels/l2_prefetch.py) of the big projections' weights, or of the routed experts' w13 / w2, worth putting in `all`,
# and is the MoE GEMMs' own post-wait tile prefetch (kernels/moe.py TILE_PREFETCH) worth turning on?
#
#   LINGC_COMMIT=<hash> bash bench/device_prefetch_ab.sh OUT_DIR            # probes + A/B, ~6-7 minutes
#   LINGC_COMMIT=<hash> [LINGC_PREFETCH_...=...] bash bench/device_prefetch_ab.sh OUT_DIR parity    # ~2-3 minutes
#
# ab (the default):
# 1. the probes (bench/kernel_l2_prefetch.py): the KDA projection and o_proj after a side-stream prefetch and an
#    HBM-idle gap, against cold and warm weights (OUT_DIR/kernel-l2-prefetch.json); the decode up-GEMM with and
#    without the experts' prefetch forked beside it (--moe, OUT_DIR/kernel-l2-prefetch-experts.json)
# 2. the "all" row with and without the hints in one process (OUT_DIR/ab.json): base; pf (the pass in `all`: the
#    projections' hints after the nearest streaming launch); pf_s2 (ANCHOR_SKIP 2: one streaming launch earlier);
#    pf_last (evict_last lines); pf_e (only the experts' w13 hints); pf_e_w2 (the experts' w13 and w2); pf_we (the
#    projections' and the experts' w13); up_tp (no pass: the up-GEMM's own post-wait tile prefetch,
#    kernels/moe.py UP_TILE_PREFETCH); updn_tp (the down-GEMM's too); then base, pf, pf_s2, pf_e, pf_we, up_tp again
# parity: the greedy parity with the compiled passes PARITY_PASSES (default all,prefetch_weights; `all` for the MoE
#    tile prefetch alone) (OUT_DIR/parity.json: NEXTN == plain decoding, greedy copies == general graphs, PDL off ==
#    on), the first GPU run of the side stream's fork / join inside a CUDA graph under every check; the knobs come
#    from the environment (LINGC_PREFETCH_ANCHOR_SKIP,
#    LINGC_PREFETCH_EVICT_LAST, LINGC_PREFETCH_EXPERTS, LINGC_PREFETCH_EXPERT_W2, LINGC_MOE_UP_TILE_PREFETCH,
#    LINGC_MOE_DOWN_TILE_PREFETCH)
# Each step has its own time limit, so one that hangs leaves the others' files. Run from the repository root.
set -u
OUT=${1:?usage: LINGC_COMMIT=<hash> bash bench/device_prefetch_ab.sh OUT_DIR [ab|parity]}
MODE=${2:-ab}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
rm -rf /tmp/lingc-site
pip install -q --no-deps --no-build-isolation --target /tmp/lingc-site . || exit 1
export PYTHONPATH=/tmp/lingc-site
if [ "$MODE" = parity ]; then
  env | grep -E '^(LINGC_PREFETCH|LINGC_MOE_.*TILE_PREFETCH|PARITY_PASSES)' || true
  timeout 500 python3 bench/device_step.py --only all --parity-passes "${PARITY_PASSES:-all,prefetch_weights}" \
    --json "$OUT/parity.json" 2>&1 | grep -v Warning | tail -15
  exit 0
fi
PF=lingc.passes.prefetch_weights
ON="$PF.PrefetchWeights.in_all=True"
E="$ON;$PF.WEIGHTS=False;$PF.EXPERTS=True"
WE="$ON;$PF.EXPERTS=True"
MOE=lingc.kernels.moe
echo "== probes"
timeout 100 python3 bench/kernel_l2_prefetch.py --shapes kda_qkvfbg,o_proj --json "$OUT/kernel-l2-prefetch.json" 2>&1 \
  | grep -v Warning | tail -30
timeout 90 python3 bench/kernel_l2_prefetch.py --moe --json "$OUT/kernel-l2-prefetch-experts.json" 2>&1 \
  | grep -v Warning | tail -8
echo "== A/B"
timeout 360 python3 bench/device_step.py --only all --no-parity \
  --variant 'base:' --variant "pf:$ON" --variant "pf_s2:$ON;$PF.ANCHOR_SKIP=2" \
  --variant "pf_last:$ON;lingc.kernels.l2_prefetch.EVICT_LAST=True" --variant "pf_e:$E" \
  --variant "pf_e_w2:$E;$PF.EXPERT_W2=True" --variant "pf_we:$WE" --variant "up_tp:$MOE.UP_TILE_PREFETCH=True" \
  --variant "updn_tp:$MOE.UP_TILE_PREFETCH=True;$MOE.DOWN_TILE_PREFETCH=True" \
  --variant 'base2:' --variant "pf2:$ON" --variant "pf_s2_2:$ON;$PF.ANCHOR_SKIP=2" --variant "pf_e2:$E" \
  --variant "pf_we2:$WE" --variant "up_tp2:$MOE.UP_TILE_PREFETCH=True" --json "$OUT/ab.json" 2>&1 \
  | grep -v Warning | tail -40
