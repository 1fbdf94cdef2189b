#!/bin/bash
# The CPU benchmarks re-run through `python -m bench NAME` after bench/ became one tool, each under
# the shared engine lock (one engine-using run at a time), each capped at 8 minutes, with sizes cut
# where a full run would not fit in that (fleet_overhead with 2 pipeline rounds ran past 8 minutes:
# its fleet and pipeline arms run as two invocations). From the repository root; writes <name>.json and
# <name>.log beside this script. Usage: bash bench/results/2026-12-06/rerun.sh NAME...
set -u
here=$(dirname "$0")
declare -A ARGS=(
  [control_plane]="--ticks 200"
  [refit_call]="--rounds 40"
  [engine_start]="--order forkserver,spawn"
  [fleet_overhead]="--rounds 5 --skip-pipeline"  # the pipeline arms: fleet_overhead_pipeline below
  [fleet_overhead_pipeline]="--rounds 1 --pipeline-rounds 1"
  [serve]="--requests 512 --rounds 2"
  [sessions]="--sessions 16 --rounds 2"
  [recovery]="--rounds 2"
  [step_loop]="--prompts 256 --rounds 3"
  [front_end]="--prompts 512 --rounds 2"
  [refit]="--rounds 3"
  [refit_inflight]="--window 20 --every 6 --idle-refits 3"
  [overload]="--window-s 10 --rounds 1"
  [crash_resume]="--kills 5"
  [rl_step]="--steps 4 --rounds 1 --quiet"
)
for name in "$@"; do
  echo "$(date -u +%H:%M:%S) waiting for the lock: $name"
  bench=${name%_pipeline}  # fleet_overhead_pipeline: fleet_overhead with other flags
  flock /tmp/nemo_gen_engine.lock timeout 480 env PYTHONPATH="$PWD" .venv/bin/python -m bench "$bench" \
    ${ARGS[$name]} --json "$here/$name.json" > "$here/$name.log" 2>&1
  rc=$?
  echo "$(date -u +%H:%M:%S) $name rc=$rc"
done
