#!/usr/bin/env bash
# One device call (one GPU, ~7 minutes on a cold machine: give it the whole 10-minute limit): the eighteenth session's
# sampling-kernel change against the code before it, in one process each.
# 1. bench/kernel_filtered_probs.py's modes (greedy, plain, top-p 0.9 peaked / flat, top-k 50 + top-p 0.9; T = 1 and
#    6) with the default config ("new"), without the scan_max gate on the exact finish ("old", the kernel of
#    2026-11-30): OUT_DIR/fp-{new,old}.jsonl, one line a mode. The first run has 180 s (on a cold machine it spends
#    most of them compiling: the 2026-12-06 call lost a 100 s run so), the second 90, the step A/B 300: 570 s in all.
#    The "new" run has --coarse: each mode's coarse distribution (no exact finish, one round a phase) priced too,
#    its time and its acceptance sum(min(p, q)) against the exact p
# 2. the step A/B (OUT_DIR/ab.json): device_step.py --only all --no-parity, rows base / old / base2, whose
#    nextn_sampled times are the general graphs replayed for a sampled request (temperature 0.8, top-p 0.95)
#
#   bash bench/device_sampling_ab.sh OUT_DIR COMMIT
#
# Run from the repository root.
set -u
OUT=${1:?usage: bash bench/device_sampling_ab.sh OUT_DIR COMMIT}
export LINGC_COMMIT=${2:?usage: bash bench/device_sampling_ab.sh OUT_DIR COMMIT}
source bench/device_site.sh
fp() {  # $1 label, $2 the config's replaced fields (a Python dict literal), $3 seconds, $4 extra bench flags
  timeout "$3" python3 -P -c "
import dataclasses, runpy, sys
import lingc.kernels.filtered_probs as F
F.DEFAULT_CONFIG = dataclasses.replace(F.DEFAULT_CONFIG, **$2)
sys.argv = ['kernel_filtered_probs.py'] + '${4:-}'.split()
runpy.run_path('bench/kernel_filtered_probs.py', run_name='__main__')" 2>&1 | grep '"kernel"' > "$OUT/fp-$1.jsonl"
  python3 -c "
import json
for line in open('$OUT/fp-$1.jsonl'):
    d = json.loads(line)
    print('$1', d['shape'][1], d['mode'], 'ok' if d['ok'] else 'BAD', round(d['time_us'], 1),
          *(f'coarse {d[\"coarse_time_us\"]:.1f} us accept {d[\"coarse_accept\"]:.4f}' for _ in [0] if 'coarse_accept' in d))"
}
fp new "{}" 180 --coarse
fp old "{'scan_max': 1 << 30}" 90
timeout 300 python3 bench/device_step.py --only all --no-parity --variant 'base:' \
  --variant 'old:lingc.kernels.filtered_probs.DEFAULT_CONFIG={"scan_max": 1073741824}' \
  --variant 'base2:' --json "$OUT/ab.json" 2>&1 | grep -v Warning | grep "^all"
