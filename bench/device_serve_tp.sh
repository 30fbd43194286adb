#!/usr/bin/env bash
# `lingc serve --tp 2` on the two-H200 machine (nvidia-h200-x2), end to end through the CLI as a user runs it:
#   1. lingc init: a random Ling-3.0-tiny checkpoint cut to LAYERS layers (+1 MTP layer), drawn on the GPU
#   2. lingc compile --passes all --tp 2 (one weight set per rank)
#   3. lingc serve --tp 2 --device cuda (rank 0: HTTP + scheduler; rank 1 spawned), wait for /health
#   4. one /v1/completions, one streamed /generate, then `lingc bench` (random-ids workload, concurrency 1)
#   5. kill -9 rank 1 mid-run (a request in flight): the server must stop with a clear error, not hang
# OUT_DIR gets summary.txt (every step, with log tails) and bench.json; the full logs stay in /tmp/lingc-serve-tp-logs.
#
#   bash bench/device_serve_tp.sh OUT_DIR [LAYERS]
#
# Needs fastapi/uvicorn/httpx wheels the GPU image lacks: install .device/serve_wheels first (bench/README.md).
set -u
OUT=${1:?usage: bash bench/device_serve_tp.sh OUT_DIR [LAYERS]}
LAYERS=${2:-4}
PRESET=${PRESET:-ling-3.0-tiny} DEVICE=${DEVICE:-cuda} VOCAB=${VOCAB:-157184}   # CPU smoke: PRESET=test-tiny DEVICE=cpu VOCAB=512
PROMPTS=${PROMPTS:-12} IN_LEN=${IN_LEN:-512} OUT_LEN=${OUT_LEN:-256}   # CPU smoke: PROMPTS=2 IN_LEN=16 OUT_LEN=8
PORT=30123
CK=/tmp/lingc-serve-tp-ckpt ART=/tmp/lingc-serve-tp-art
LOG=/tmp/lingc-serve-tp-logs
mkdir -p "$OUT" "$LOG"
SUM="$OUT/summary.txt"
: > "$SUM"
note() { echo "$*" | tee -a "$SUM"; }
# the CLI from a neutral directory: run from the repository root, `python3 -m` would import the source tree's
# lingc/ (without its passes/, kernels/, runtime/ subpackages) instead of the installed package
lingc() { (cd /tmp && python3 -m lingc.cli "$@"); }
rm -rf "$CK" "$ART"

t0=$(date +%s)
lingc init --preset "$PRESET" --layers "$LAYERS" --mtp-layers 1 --device "$DEVICE" -o "$CK" \
  > "$LOG/init.log" 2>&1 || { note "init failed"; tail -20 "$LOG/init.log"; exit 1; }
t1=$(date +%s)
lingc compile "$CK" -o "$ART" --passes all --tp 2 --max-len 2048 > "$LOG/compile.log" 2>&1 \
  || { note "compile failed"; tail -30 "$LOG/compile.log"; exit 1; }
t2=$(date +%s)
note "init ${LAYERS} layers: $((t1 - t0)) s; compile --tp 2: $((t2 - t1)) s; artifact $(du -sh "$ART" | cut -f1)"

(cd /tmp && exec python3 -m lingc.cli serve "$ART" --tp 2 --device "$DEVICE" --port $PORT --log-level warning > "$LOG/serve.log" 2>&1) &
SERVE=$!
up=0
for _ in $(seq 1 240); do
  if curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; then up=1; break; fi
  kill -0 $SERVE 2>/dev/null || break
  sleep 1
done
t3=$(date +%s)
if [ $up != 1 ]; then note "server did not come up in $((t3 - t2)) s"; tail -40 "$LOG/serve.log"; kill -9 $SERVE; exit 1; fi
note "serve --tp 2 up in $((t3 - t2)) s"

note "== /v1/completions"
curl -s "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
  -d '{"model": "lingc-serve-tp-art", "prompt": [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": 16, "temperature": 0}' \
  | tee -a "$SUM"; echo | tee -a "$SUM"
note "== /generate stream"
curl -sN "http://127.0.0.1:$PORT/generate" -H 'Content-Type: application/json' \
  -d '{"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 8, "temperature": 0}, "stream": true}' \
  | tail -3 | tee -a "$SUM"; echo | tee -a "$SUM"
note "== get_server_info"
curl -s "http://127.0.0.1:$PORT/get_server_info" | head -c 600 | tee -a "$SUM"; echo | tee -a "$SUM"

lingc bench --base-url "http://127.0.0.1:$PORT" --dataset-name random-ids --vocab-size "$VOCAB" \
  --num-prompts "$PROMPTS" --random-input-len "$IN_LEN" --random-output-len "$OUT_LEN" --random-range-ratio 1.0 --max-concurrency 1 \
  --warmup 2 --json "$OUT/bench.json" > "$LOG/bench.log" 2>&1
note "bench rc $?"; tail -25 "$LOG/bench.log" | tee -a "$SUM"

# a dead rank: start a long request, kill rank 1, the server must exit with an error naming it
curl -s "http://127.0.0.1:$PORT/generate" -H 'Content-Type: application/json' \
  -d '{"input_ids": [9, 9, 9], "sampling_params": {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": true}}' \
  > "$LOG/inflight.txt" 2>&1 &
sleep 1
victim=""
for c in $(pgrep -P $SERVE); do
  if tr '\0' ' ' < /proc/$c/cmdline | grep -q "spawn_main"; then victim=$c; fi
done
note "killing rank 1 (pid ${victim:-none})"
k0=$(date +%s)
[ -n "$victim" ] && kill -9 "$victim"
rc=""
for _ in $(seq 1 90); do
  if ! kill -0 $SERVE 2>/dev/null; then wait $SERVE; rc=$?; break; fi
  sleep 1
done
k1=$(date +%s)
if [ -z "$rc" ]; then note "server still running $((k1 - k0)) s after rank 1 died (hang)"; kill -9 $SERVE
else note "server exited with rc $rc, $((k1 - k0)) s after rank 1 died"; fi
note "== serve.log tail"; tail -15 "$LOG/serve.log" | tee -a "$SUM"
note "== in-flight request got"; head -c 400 "$LOG/inflight.txt" | tee -a "$SUM"; echo
pkill -9 -f lingc-serve-tp-art 2>/dev/null
exit 0
