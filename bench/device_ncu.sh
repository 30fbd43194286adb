#!/usr/bin/env bash
# Nsight Compute over lingc's heaviest step kernels on the H200 (bench/device_ncu.py): per target one CSV of
# SpeedOfLight / WarpStateStats / LaunchStats / Occupancy, a JSON summary, and for the MLA split, the fused KDA
# verify kernel, decode's MoE up GEMM and filtered_probs' rounds that run an exact finish or bin a flat row (flat,
# top-k 50 + top-p, peaked logits) the per-SASS-instruction stall samples (--page source).
#
#   bash bench/device_ncu.sh OUT_DIR [targets...]      # about 3 minutes for the default targets
#   bash bench/device_ncu.sh OUT_DIR fp_peaked1 fp_flat1 fp_flat6 fp_k50p1    # filtered_probs, launch by launch
#
# Run from the repository root on the device (ncu reads the counters on the Firecracker H200 machines).
set -u
OUT=${1:?usage: bash bench/device_ncu.sh OUT_DIR [targets]}
shift
TARGETS=${*:-mla1 mla6 kda1 kda6 moe1 moe6 o_proj1 qkv1}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT/csv" /tmp/ncu
rm -rf /tmp/lingc-site
pip install -q --no-deps --no-build-isolation --target /tmp/lingc-site . || exit 1
export PYTHONPATH=/tmp/lingc-site
NCU=(ncu --clock-control none --profile-from-start off)
for t in $TARGETS; do
  echo "== $t"
  timeout 150 "${NCU[@]}" --csv --page details --section SpeedOfLight --section WarpStateStats \
    --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis \
    python3 bench/device_ncu.py "$t" > "$OUT/csv/$t.csv" 2> "/tmp/ncu/$t.err" || tail -5 "/tmp/ncu/$t.err"
done
# TARGET:KERNEL_REGEX[:SKIP]: the first matching launch after SKIP of them (fp_flat1's fourth round kernel is top-p's
# second round; fp_k50p1's third is top-p's first, which finishes the ~50 top-k tokens exactly; fp_peaked1's fourth is
# top-p's second, where its exact finish runs)
for spec in "mla6:_split_kernel" "kda6:_kda_(fused|gluon)_kernel" "kda1:_kda_(fused|gluon)_kernel" "moe1:_moe" \
            "fp_flat1:_round_kernel:3" "fp_k50p1:_round_kernel:2" "fp_peaked1:_round_kernel:3"; do
  t=${spec%%:*}; k=${spec#*:}; skip=0
  case $k in *:*) skip=${k#*:}; k=${k%%:*};; esac
  case " $TARGETS " in *" $t "*) ;; *) continue;; esac
  timeout 150 "${NCU[@]}" --set full --import-source no -k "regex:$k" -s "$skip" -c 1 -f -o "/tmp/ncu/$t" \
    python3 bench/device_ncu.py "$t" > /dev/null 2> "/tmp/ncu/$t.full.err" || tail -5 "/tmp/ncu/$t.full.err"
  ncu -i "/tmp/ncu/$t.ncu-rep" --page source --csv --print-source sass > "$OUT/csv/${t}_sass.txt" 2>&1
done
python3 bench/device_ncu.py summarise "$OUT/csv" "$OUT/ncu.json" > /dev/null
tar -czf "$OUT/ncu-csv.tgz" -C "$OUT" csv && rm -rf "$OUT/csv"
python3 - "$OUT/ncu.json" <<'PY'
import json, sys
t = json.load(open(sys.argv[1]))
for target, ks in t.items():
    for name, m in ks.items():
        if name == "sass":   # the SASS stall samples' summary (device_ncu.py sass_summary): its three largest
            for row in m.get("top", [])[:3]:
                print(f"{target:8s} sass {row['index']:5d} {row['share'] * 100:5.1f}% {row['sass'][:44]:44s} "
                      f"{row['stalls']}")
            continue
        st = {k[6:]: v for k, v in m.items() if k.startswith("Stall ")}
        print(f"{target:8s} {name[:34]:34s} dur {m.get('Duration', '?')!s:>7} dram% {m.get('DRAM Throughput', '?')!s:>6} "
              f"l2% {m.get('L2 Cache Throughput', '?')!s:>6} sm% {m.get('Compute (SM) Throughput', '?')!s:>6} "
              f"occ {m.get('Achieved Occupancy', '?')!s:>6} cpi {m.get('Warp Cycles Per Issued Instruction', '?')!s:>6} "
              + " ".join(f"{k}={v:.1f}" for k, v in st.items()))
PY
