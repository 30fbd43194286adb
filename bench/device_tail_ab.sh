#!/usr/bin/env bash
# One device call (one GPU, nvidia-h200; ~8 minutes on a cold machine) for the verify tail's two changes and the
# boundary probe's entry mode:
# 1. bench/kernel_flag_chain.py --modes graph,pdl,entry (OUT_DIR/entry.json): the trigger at kernel entry, before the
#    weight read, against PDL's trigger after the wait (results/flag-chain-h200-20261205.json has graph / pdl / flag)
# 2. the step A/B (OUT_DIR/ab.json): device_step.py --only all with its greedy parity (NEXTN == plain decoding, PDL on
#    == off, greedy copies == general graphs: the fused emit and the one-tile chain_final on the GPU), rows base /
#    noemit (passes/fuse_emit.py FuseEmit.in_all False) / base2 / noemit2 / base3
# 3. bench/device_launches.py --pdl (OUT_DIR/launches.json): each launch's exposed time in step_greedy and verify_greedy
#    (chain_final, emit_accepted against launches-kda-tma-h200-20261204.json's 3.78 us and 0.70 + 1.79 + 1.95 us)
#
#   LINGC_COMMIT=<hash> bash bench/device_tail_ab.sh OUT_DIR
#
# Each step has its own time limit, so one that hangs leaves the others' files. Run from the repository root.
set -u
OUT=${1:?usage: LINGC_COMMIT=<hash> bash bench/device_tail_ab.sh OUT_DIR}
source bench/device_site.sh
echo "== entry probe"
timeout 90 python3 bench/kernel_flag_chain.py --modes graph,pdl,entry --grids 16,132,264 --weight-kb 0,16,32 \
  --json "$OUT/entry.json" 2>&1 | grep -v Warning | tail -14
E=lingc.passes.fuse_emit.FuseEmit.in_all=False
echo "== A/B"
timeout 330 python3 bench/device_step.py --only all --variant 'base:' --variant "noemit:$E" --variant 'base2:' \
  --variant "noemit2:$E" --variant 'base3:' --json "$OUT/ab.json" 2>&1 | grep -v Warning | tail -30
echo "== launches"
timeout 150 python3 bench/device_launches.py --pdl --graphs step_greedy,verify_greedy --json "$OUT/launches.json" 2>&1 \
  | grep -v Warning | tail -12
