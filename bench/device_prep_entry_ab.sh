#!/usr/bin/env bash
# One device call (one GPU; ~6 minutes on a cold machine): the pdl pass's PREP_ENTRY_TRIGGER (mla_prep triggers at its
# entry, so mla_attention's q_absorb and, at q_absorb's entry, the Gluon split launch one kernel sooner and the
# split's cache copies overlap mla_prep too; passes/pdl.py), A/B in the step, then where the time goes with it:
# 1. bench/device_step.py --only all with LINGC_PDL_PREP_ENTRY=1 (OUT_DIR/ab.json): rows all (on) / all@off /
#    all@on2 / all@off2 / all@on3, and the greedy parity with it on (NEXTN == plain decoding, PDL on == off, greedy
#    copies == general graphs)
# 2. bench/device_launches.py --pdl with it on (OUT_DIR/launches-prep-entry.json): MLA's kernels a layer
#
#   LINGC_COMMIT=<hash> bash bench/device_prep_entry_ab.sh OUT_DIR
#
# Each step has its own time limit, so one that hangs leaves the others' files. Run from the repository root.
set -u
OUT=${1:?usage: LINGC_COMMIT=<hash> bash bench/device_prep_entry_ab.sh OUT_DIR}
source bench/device_site.sh
K=lingc.passes.pdl.PREP_ENTRY_TRIGGER
echo "== step A/B"
LINGC_PDL_PREP_ENTRY=1 timeout 400 python3 bench/device_step.py --only all --variant "off:$K=False" \
  --variant "on2:$K=True" --variant "off2:$K=False" --variant "on3:$K=True" --json "$OUT/ab.json" 2>&1 \
  | grep -v Warning | tail -3
python3 bench/device_step.py --rows "$OUT/ab.json"
echo "== launches with the mla_prep entry trigger"
LINGC_PDL_PREP_ENTRY=1 timeout 150 python3 bench/device_launches.py --pdl --graphs step_greedy,verify_greedy \
  --json "$OUT/launches-prep-entry.json" 2>&1 | grep -v Warning | grep -E "mla_|q_b_proj|busy" | head -12
