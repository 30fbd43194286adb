#!/usr/bin/env bash
# One device call (one GPU; ~10 minutes on a cold machine) for what the sixteenth and seventeenth sessions left
# untimed, the most wanted first (each step saves its JSON as it goes; a call cut off keeps what it measured):
# 1. bench/device_kernels.py --families none (OUT_DIR/kernels.json): the rmsnorm rows, now with fuse_embed_norm's
#    embedding_rmsnorm / embedding_rmsnorm_cat bits against the embedding + norm kernels (PDL on == off) and their times
# 2. bench/kernel_mla.py --combine-absorb (OUT_DIR/mla-combine-absorb.json): mla_attention with kernels/mla.py's
#    COMBINE_ABSORB on and off at 1 and 6 queries (reference tolerance, row invariance, PDL on == off, time)
# 3. the step A/B (OUT_DIR/ab.json): device_step.py --only all with its greedy parity (NEXTN == plain decoding, PDL on
#    == off, greedy copies == general graphs; fuse_embed_norm, fuse_simulate_accept and fuse_relay_cat in all), rows
#    base / noembed (passes/fuse_embed_norm.py FuseEmbedNorm.in_all False) / nosim (fuse_simulate_accept off) /
#    nocat (fuse_relay_cat off) / cabs (COMBINE_ABSORB on) / base2 / noembed2 / nosim2 / nocat2 / cabs2 / base3
# 4. bench/kernel_moe_scaling.py --linear --probe (OUT_DIR/moe-scaling-probe.json): the pair up-GEMM's fixed cost split
#    into the ids prologue, the expert id's round trip and the SwiGLU epilogue (bench/moe_up_probe.py), in the time
#    left
#
#   LINGC_COMMIT=<hash> bash bench/device_pending_ab.sh OUT_DIR [quick]
#
# `quick` (~6 minutes; for a session with little device time left): 2 and 3 only, with the rows base / noembed / nosim /
# nocat / cabs / base2 / cabs2 / base3.
#
# Each step has its own time limit, so one that hangs leaves the others' files. Run from the repository root.
set -u
OUT=${1:?usage: LINGC_COMMIT=<hash> bash bench/device_pending_ab.sh OUT_DIR [quick]}
QUICK=${2:-}
source bench/device_site.sh
if [ -z "$QUICK" ]; then
  echo "== kernels (rmsnorm family rows)"
  timeout 60 python3 bench/device_kernels.py --families none --json "$OUT/kernels.json" 2>&1 | grep -v Warning \
    | grep -v '"pairs"' | tail -6
fi
echo "== MLA combine + v_absorb in one launch"
timeout 100 python3 bench/kernel_mla.py --combine-absorb --json "$OUT/mla-combine-absorb.json" 2>&1 \
  | grep -v Warning | tail -4 | cut -c1-400
E=lingc.passes.fuse_embed_norm.FuseEmbedNorm.in_all=False
S=lingc.passes.fuse_simulate_accept.FuseSimulateAccept.in_all=False
C=lingc.passes.fuse_relay_cat.FuseRelayCat.in_all=False
A=lingc.kernels.mla.COMBINE_ABSORB=True
echo "== A/B"
if [ -n "$QUICK" ]; then
  timeout 300 python3 bench/device_step.py --only all --variant 'base:' --variant "noembed:$E" --variant "nosim:$S" \
    --variant "nocat:$C" --variant "cabs:$A" --variant 'base2:' --variant "cabs2:$A" --variant 'base3:' \
    --json "$OUT/ab.json" 2>&1 | grep -v Warning | tail -30
  exit 0
fi
timeout 400 python3 bench/device_step.py --only all --variant 'base:' --variant "noembed:$E" --variant "nosim:$S" \
  --variant "nocat:$C" --variant "cabs:$A" --variant 'base2:' --variant "noembed2:$E" --variant "nosim2:$S" \
  --variant "nocat2:$C" --variant "cabs2:$A" --variant 'base3:' --json "$OUT/ab.json" 2>&1 | grep -v Warning \
  | tail -30
echo "== MoE scaling probe"
timeout 90 python3 bench/kernel_moe_scaling.py --linear --probe --json "$OUT/moe-scaling-probe.json" 2>&1 \
  | grep -v Warning | tail -3
