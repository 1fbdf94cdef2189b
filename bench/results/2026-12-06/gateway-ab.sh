#!/bin/bash
# The gateway benchmark's A/B on the same minutes: "before" (a26a9ef's nemo_gen: the gateway as it
# was) against this checkout, alternating, both with this checkout's bench/ and tests/ (the fake
# shards). Run from the repository root under the engine lock:
#   flock /tmp/nemo_gen_engine.lock bash bench/results/2026-12-06/gateway-ab.sh [PAIRS] [extra bench flags]
# "before" runs from a copy made by git archive (no .git there: its JSON's commit reads "unknown").
set -u
REPO=$(pwd); OUT=$REPO/bench/results/2026-12-06; BASE=${BASE:-/tmp/nemo_gen-gateway-base}; PAIRS=${1:-2}; shift || true
EXTRA=("$@")
rm -rf "$BASE" && mkdir -p "$BASE"
git archive HEAD bench tests | tar -x -C "$BASE" && git archive a26a9ef nemo_gen | tar -x -C "$BASE"
run() {  # label, directory, json
  echo "== $1 $(date -u +%H:%M:%S) $(uptime)"
  (cd "$2" && env PYTHONPATH="$2" timeout 240 "$REPO/.venv/bin/python" -m bench gateway --sessions 32 --rounds 6 \
    --home "$REPO/.nemo-gen/bench" --json "$3" "${EXTRA[@]}") 2>&1 | grep -v -i "warn\|token auth\|triton"
  echo "== end $1 $(date -u +%H:%M:%S) $(uptime)"
}
for i in $(seq 1 "$PAIRS"); do
  run before "$BASE" "$OUT/cpu-gateway-ab${TAG:-}-$i-before.json"
  run after "$REPO" "$OUT/cpu-gateway-ab${TAG:-}-$i-after.json"
done
