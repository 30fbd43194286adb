#!/usr/bin/env bash
# One device call (one GPU; ~7 minutes on a cold machine): the swapped Gluon MLA split (kernels/mla_gluon.py SWAP,
# LINGC_MLA_GLUON_SWAP=1) checked and timed alone, then A/B in the step beside the pdl pass's PREP_ENTRY_TRIGGER
# (passes/pdl.py, built in the twenty-eighth session and not yet timed):
# 1. bench/kernel_mla.py --swap (OUT_DIR/kernels-swap.json): mla_attention with the swapped split and with the
#    default one at 1 and 6 queries, context 8192: reference tolerance, row invariance (each query of the chain
#    alone as a one-query call), PDL on == off, determinism, time, and the largest difference between the two
# 2. bench/device_step.py --only all with LINGC_MLA_GLUON_SWAP=1 (OUT_DIR/ab.json), so the greedy parity (NEXTN ==
#    plain decoding, PDL on == off, greedy copies == general graphs) runs with the swapped split; rows all (swap) /
#    @noswap / @swap2 / @noswap2 / @prep (swap and the entry trigger)
#
#   LINGC_COMMIT=<hash> bash bench/device_swap_ab.sh OUT_DIR [lean]
#
# lean (a short device budget, ~5 minutes): no greedy parity and no entry-trigger row in step 2.
#
# Each step has its own time limit, so one that hangs leaves the others' files. Run from the repository root.
set -u
OUT=${1:?usage: LINGC_COMMIT=<hash> bash bench/device_swap_ab.sh OUT_DIR [lean]}
source bench/device_site.sh
S=lingc.kernels.mla_gluon.SWAP
P=lingc.passes.pdl.PREP_ENTRY_TRIGGER
echo "== the swapped split alone"
timeout 120 python3 bench/kernel_mla.py --swap --json "$OUT/kernels-swap.json" 2>&1 | grep -v Warning | tail -4
echo "== step A/B"
EXTRA=(--variant "prep:$S=True;$P=True")
[ "${2:-}" = lean ] && EXTRA=(--no-parity)
LINGC_MLA_GLUON_SWAP=1 timeout 420 python3 bench/device_step.py --only all --variant "noswap:$S=False" \
  --variant "swap2:$S=True" --variant "noswap2:$S=False" "${EXTRA[@]}" \
  --json "$OUT/ab.json" 2>&1 | grep -v Warning | tail -3
python3 bench/device_step.py --rows "$OUT/ab.json"
