#!/usr/bin/env bash
# One device call (one GPU, at most ~9.5 minutes: 100 + 180 + 160 + 90 s; give it the whole 10-minute limit):
# kernels/filtered_probs.py against an older copy of it, kernel and step, in one call.
# 1. bench/kernel_filtered_probs.py's modes (greedy, plain, top-p 0.9 peaked / flat, top-k 50 + top-p 0.9; T = 1 and
#    6) on the old copy (OUT_DIR/fp-old.jsonl) and on this checkout with --sweep (OUT_DIR/fp-new.jsonl: the modes,
#    then the sweep's tunable sets), one line a row
# 2. the sampled NEXTN step (device_step.py --only all --no-parity: nextn_sampled is the general graphs replayed for a
#    sampled request, temperature 0.8, top-p 0.95): this checkout with rows base / the VARIANTS / base2
#    (OUT_DIR/ab.json), then the old copy in its own process (OUT_DIR/ab-old.json)
#
#   bash bench/device_sampling_ab.sh OUT_DIR COMMIT OLD_FILE ['NAME:mod.ATTR=VALUE' ...]
#   e.g. 'scan512:lingc.kernels.filtered_probs.DEFAULT_CONFIG={"scan_max": 512}' (SWEEP=names: the kernel sweep's sets)
#
# OLD_FILE: the older kernels/filtered_probs.py (e.g. `git show a6c37aa:kernels/filtered_probs.py >
# .device/fp_old.py`, carried). Run from the repository root.
set -u
OUT=${1:?usage: bash bench/device_sampling_ab.sh OUT_DIR COMMIT OLD_FILE [variants]}
export LINGC_COMMIT=${2:?usage: bash bench/device_sampling_ab.sh OUT_DIR COMMIT OLD_FILE [variants]}
OLD=${3:?usage: bash bench/device_sampling_ab.sh OUT_DIR COMMIT OLD_FILE [variants]}
shift 3
source bench/device_site.sh
rm -rf /tmp/lingc-old && cp -r /tmp/lingc-site /tmp/lingc-old && cp "$OLD" /tmp/lingc-old/lingc/kernels/filtered_probs.py
fp() {  # $1 label, $2 site, $3 seconds, $4 extra bench flags
  PYTHONPATH=$2 timeout "$3" python3 -P bench/kernel_filtered_probs.py ${4:-} 2>&1 | grep '"kernel"' > "$OUT/fp-$1.jsonl"
  python3 -c "
import json
for line in open('$OUT/fp-$1.jsonl'):
    d = json.loads(line)
    print('$1', d.get('config', ''), d['shape'][1], d['mode'], 'ok' if d['ok'] else 'BAD', round(d.get('time_us', -1), 1))"
}
fp old /tmp/lingc-old 100
# the sweep's sets in priority order: ~3.5 sets fit the 180 s after the modes' rows (2026-12-06)
fp new /tmp/lingc-site 180 "--sweep --sweep-configs ${SWEEP:-prev,k32_64,rounds2+2,cell4096}"
variants=(--variant 'base:')
for v in "$@"; do variants+=(--variant "$v"); done
variants+=(--variant 'base2:')
timeout 160 python3 bench/device_step.py --only all --no-parity "${variants[@]}" --json "$OUT/ab.json" 2>&1 \
  | grep -v Warning | grep "^all"
PYTHONPATH=/tmp/lingc-old timeout 90 python3 bench/device_step.py --only all --no-parity --json "$OUT/ab-old.json" \
  2>&1 | grep -v Warning | grep "^all"
