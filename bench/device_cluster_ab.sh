#!/usr/bin/env bash
# One device call (one GPU, nvidia-h200; ~7 minutes on a cold machine) for the thread-block cluster work of
# 2026-12-06 (docs/measurements.md, twenty-seventh session), in order of what decides the most:
# 1. bench/kernel_cluster_router.py (OUT_DIR/cluster-router.json): kernels/norm_router_cluster.py at clusters of 16
#    and 8 CTAs, its outputs against the step's two kernels (add_rmsnorm_linear's gate GEMV, then router_align /
#    router_topk) and its time against them and against kernels/norm_router.py's ticket kernel, at 1 and 6 rows
# 2. bench/kernel_cluster_chain.py (OUT_DIR/cluster-chain.json): what one cluster handoff costs (the barrier alone,
#    DSMEM all-gather, gather + scatter through rank 0, a global exchange) and PDL chains of cluster launches
# 3. only if step 1 checked out at 16 CTAs: the step A/B (OUT_DIR/ab.json) with LINGC_NORM_ROUTER_CLUSTER=1, rows
#    all / all@cluster (fuse_norm_router in `all`: the op on the cluster kernel) / all@base2 / all@cluster2 /
#    all@base3, and the greedy parity with the pass on (NEXTN == plain decoding, PDL on == off, greedy copies ==
#    general graphs)
#
#   LINGC_COMMIT=<hash> bash bench/device_cluster_ab.sh OUT_DIR
#
# Each step has its own time limit, so one that hangs leaves the others' files. Run from the repository root.
set -u
OUT=${1:?usage: LINGC_COMMIT=<hash> bash bench/device_cluster_ab.sh OUT_DIR}
source bench/device_site.sh
echo "== cluster router"
timeout 150 python3 bench/kernel_cluster_router.py --json "$OUT/cluster-router.json" 2>&1 | grep -v Warning \
  | tail -8 | tee "$OUT/cluster-router.txt"
echo "== cluster chain"
timeout 90 python3 bench/kernel_cluster_chain.py --json "$OUT/cluster-chain.json" 2>&1 | grep -v Warning | tail -40
if grep -q "cluster 16 rows 1 .* ok" "$OUT/cluster-router.txt" && grep -q "cluster 16 rows 6 .* ok" "$OUT/cluster-router.txt"
then
  echo "== step A/B"
  F=lingc.passes.fuse_norm_router.FuseNormRouter.in_all=True
  LINGC_NORM_ROUTER_CLUSTER=1 timeout 330 python3 bench/device_step.py --only all --variant "cluster:$F" \
    --variant 'base2:' --variant "cluster2:$F" --variant 'base3:' --parity-passes all,fuse_norm_router \
    --json "$OUT/ab.json" 2>&1 | grep -v Warning | tail -3
  python3 bench/device_step.py --rows "$OUT/ab.json"
else
  echo "== step A/B skipped: the cluster router did not check out at 16 CTAs"
fi
