#!/usr/bin/env bash
# Two questions in one device call (one GPU, nvidia-h200; ~5 minutes on a cold machine). Both answered on the H200 at
# 916022f (bench/README.md: no flag_sync, no knob change; results/flag-chain-h200-20261205.json,
# results/step-ab-h200-20261205-c.json); kept to repeat them on another GPU or after kernel changes:
# 1. the boundary probe (bench/kernel_flag_chain.py, OUT_DIR/flag-chain.json): what a kernel boundary costs inside a
#    CUDA graph with PDL's gdc_wait, against a flag handoff; it decides whether a flag_sync lowering is worth building
# 2. the MLA / linear / MoE knob A/B (OUT_DIR/ab.json): device_step.py --only all --no-parity with, against base /
#    base2 / base3: cbr32 (kernels/mla.py CB_BLOCK_R 32: more combine programs, the same bits by construction), va8
#    (VA_BLOCK_V 8) and qa32 (QA_BLOCK_R 32): more absorb programs, possibly other bits (another reduction layout, row
#    invariant either way), tma16 (kernels/linear_tma.py MAX_ROWS 16: the TMA GEMV at verify's rows too), up_s4
#    (the pair grid's up-GEMM with 4 stages), then cbr32, va8, qa32 again. A variant worth turning on still needs the
#    greedy parity (device_step.py --only all with the knob set) before it becomes a default.
#
#   LINGC_COMMIT=<hash> bash bench/device_boundary_ab.sh OUT_DIR
#
# Each step has its own time limit, so one that hangs leaves the other's file. Run from the repository root.
set -u
OUT=${1:?usage: LINGC_COMMIT=<hash> bash bench/device_boundary_ab.sh OUT_DIR}
source bench/device_site.sh
echo "== boundary probe"
timeout 120 python3 bench/kernel_flag_chain.py --json "$OUT/flag-chain.json" 2>&1 | grep -v Warning | tail -30
M=lingc.kernels.mla
MO=lingc.kernels.moe
echo "== A/B"
timeout 420 python3 bench/device_step.py --only all --no-parity \
  --variant 'base:' --variant "cbr32:$M.CB_BLOCK_R=32" --variant "va8:$M.VA_BLOCK_V=8" --variant "qa32:$M.QA_BLOCK_R=32" \
  --variant "tma16:lingc.kernels.linear_tma.MAX_ROWS=16" --variant "up_s4:$MO.UP_PAIRS_CONFIG={\"num_stages\": 4}" \
  --variant 'base2:' --variant "cbr32_2:$M.CB_BLOCK_R=32" --variant "va8_2:$M.VA_BLOCK_V=8" \
  --variant "qa32_2:$M.QA_BLOCK_R=32" --variant 'base3:' --json "$OUT/ab.json" 2>&1 | grep -v Warning | tail -40
