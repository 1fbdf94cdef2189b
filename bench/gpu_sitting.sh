#!/bin/bash
# One sitting on the lent GPU host (see ../shared/gpu/README.md), from the project root there,
# with the stack's parts already received (`bash .gpu/unpack.sh receive .gpu/parts/pNNN` each)
# and this repository's committed state carried as .gpu-src/:
#   bash .gpu-src/bench/gpu_sitting.sh tests    install the stack, run tests/gpu  -> $OUT/test_gpu.log
#   bash .gpu-src/bench/gpu_sitting.sh bench    install, run python -m bench gpu_bench -> $OUT/gpu_bench.{json,md}, bench.log
#                                               (BENCH_ARGS: more of its flags, e.g. "--bare-config fleet --interleave 7")
#   bash .gpu-src/bench/gpu_sitting.sh recovery install, run python -m bench gpu_recovery -> $OUT/gpu_recovery.json
#   bash .gpu-src/bench/gpu_sitting.sh inflight install, run python -m bench refit_inflight --device gpu -> $OUT/refit_inflight.json
#   bash .gpu-src/bench/gpu_sitting.sh rl       install, run python -m bench rl_step --device gpu (examples/grpo.py's loop, a 1.13 B
#                                               Llama, 64 prompts x 8 samples x 128 tokens, sync then async on one fleet)
#                                               -> $OUT/rl_step-gpu.json, $OUT/rl/{sync,async}/{steps.jsonl,run.png}, rl.log
#                                               (RL_STEPS, RL_MODE_S: steps and seconds per mode; RL_ARGS: more of its flags)
#                                               and $OUT/gpu.csv (the card's utilization, sampled); RL_MPS=1: under a CUDA
#                                               MPS daemon started for the run and stopped after it -> $OUT/mps.log
#   bash .gpu-src/bench/gpu_sitting.sh lorafp8  install, run python -m bench lora_fp8_gpu (adapter vs full refit, FP8 refit
#                                               from bf16 online and trainer-side, FP8 / bf16 throughput by batch; a 32-layer
#                                               random Llama, 14 GB) -> $OUT/lora_fp8_gpu.json, $OUT/lora_fp8.log (LF_ARGS: more flags,
#                                               e.g. "--vocab 128256 --kv-gib 10.5 --util 0.3": Llama-3's
#                                               output layer, sampler and tokenizer width; 16 GB)
#   bash .gpu-src/bench/gpu_sitting.sh rollout  install, run python -m bench rollout (fleet vs bare vLLM by batch, busy share,
#                                               step counters, roofline; py-spy profiles when .whl/ carries py-spy's wheel)
#                                               -> $OUT/rollout.json, rollout.log, nvidia-smi.txt, details.tgz (the arms'
#                                               own files and py-spy's raw records: $OUT takes 8 files, 2 folders deep)
#                                               (RO_ARGS: its flags, e.g. "--models 8b --profile-batch 512")
#   bash .gpu-src/bench/gpu_sitting.sh model    install, make bench.rollout's 8b model in /tmp/nemo-gen-rollout (the runs below share it)
#   bash .gpu-src/bench/gpu_sitting.sh colocated install, run tests/gpu/test_colocated_gpu.py -> $OUT/test_colocated.log
#   bash .gpu-src/bench/gpu_sitting.sh sleepwake install, run python -m bench sleep_wake_gpu (8b) -> $OUT/sleep_wake_gpu.json, sleep_wake.log
#   bash .gpu-src/bench/gpu_sitting.sh digest   install, run python -m bench refit_digest_gpu -> $OUT/refit_digest_gpu.json, refit_digest.log
#   bash .gpu-src/bench/gpu_sitting.sh rolloutab install, the same bench rollout (AB_ARGS) from each tree of AB_TREES (folders of
#                                               .gpu-src: git archives of other commits; "." is .gpu-src itself), one after the other
#                                               -> $OUT/rollout-<tree>.json and .log, details.tgz
# TESTS: which of tests/gpu the tests mode runs (default: all of it).
set -uo pipefail
root=$PWD
export PYTHONPATH=$root/.gpu-src:/tmp/nemo-gen-site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
# examples/grpo.py's 1b model (4.5 GB, ~1 min to make): made once, by tests/gpu or the rl run
export NEMO_GEN_RL_WORK=${NEMO_GEN_RL_WORK:-/tmp/nemo-gen-rl}
# The carried stack has no flashinfer-cubin (pack.py skips it): with FlashInfer's sampler every
# cold engine start JIT-builds it with nvcc (~80 s, bench/results/2026-12-01/h200-bench.md). PyTorch's sampler
# instead, for the fleet and the bare engine alike (greedy tokens do not depend on it).
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}
# The carried stack installed, its log under $OUT; on failure the log's tail, and the sitting ends.
install_stack() {
    bash .gpu/unpack.sh install > "$OUT/install.log" 2>&1 || { tail -40 "$OUT/install.log"; exit 1; }
}
# GPU processes an earlier run of this sitting left (a run cut off by its timeout skips the fleet's
# shutdown): started by this sitting, ended here by PID. Run from .gpu-src.
end_left_gpu_processes() {
    python3 -c "
import os, signal
from nemo_gen.host import gpu_memory
for p in gpu_memory.gpu_processes():
    print('left by an earlier run, killed:', p.pid, p.used_bytes); os.kill(p.pid, signal.SIGKILL)
"
}
# CUDA MPS (RL_MPS=1): one MPS server holds the GPU context of every CUDA process of the run (the
# trainer, the Ray workers, vLLM's EngineCore), so the trainer's and the engine's kernels can run
# at once instead of time-slicing. A user-space daemon: the card's compute mode stays as found.
# The directories are exported before Ray starts, so every worker inherits them.
start_mps() {
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/nemo-gen-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/nemo-gen-mps/log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    command -v nvidia-cuda-mps-control > /dev/null || { echo "MPS: no nvidia-cuda-mps-control on PATH"; return 1; }
    nvidia-cuda-mps-control -d || { echo "MPS: the control daemon did not start"; return 1; }
    echo "MPS: control daemon started ($(command -v nvidia-cuda-mps-control))"
    # the proof that the run's processes are MPS clients: the server's pid and nvidia-smi's process table
    ( while sleep 60; do { date +%T; echo get_server_list | nvidia-cuda-mps-control
        nvidia-smi | sed -n '/Processes/,$p'; } >> "$OUT/mps.log" 2>&1; done ) &
    mps_watch=$!
}
stop_mps() {
    kill "$mps_watch" 2> /dev/null
    for f in control server; do echo "== $f.log"; tail -40 "$CUDA_MPS_LOG_DIRECTORY/$f.log"; done >> "$OUT/mps.log" 2>&1
    echo quit | nvidia-cuda-mps-control; sleep 2
    echo "MPS: daemon stopped"; grep -c "New client" "$CUDA_MPS_LOG_DIRECTORY/server.log" 2> /dev/null
}
case "${1:-}" in
  tests)
    install_stack
    tail -2 "$OUT/install.log"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/nvidia-smi.txt"
    cd .gpu-src
    timeout "${TESTS_TIMEOUT:-450}" python3 -m pytest ${TESTS:-tests/gpu} -v -s -p no:cacheprovider --timeout 300 \
      > "$OUT/test_gpu.log" 2>&1
    rc=$?
    grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|^E  |launch of|nemo_gen_ipc refit|SIGKILL" "$OUT/test_gpu.log" | tail -60
    echo "pytest rc=$rc"
    ;;
  bench)
    install_stack  # once per host
    cd .gpu-src
    end_left_gpu_processes
    # the engines' log lines (the launch breakdown) reach the driver on stdout and stderr: both
    timeout "${BENCH_TIMEOUT:-585}" python3 -m bench gpu_bench --out "$OUT" --log "$OUT/bench.log" \
      --deadline-s "${BENCH_DEADLINE:-530}" --layers "${BENCH_LAYERS:-11}" --skip "${BENCH_SKIP:-}" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
    echo "bench rc=$?"
    cat "$OUT/gpu_bench.md" 2>/dev/null
    tail -c 2500 "$OUT/bench.log"
    ;;
  recovery)
    install_stack
    cd .gpu-src
    timeout "${RECOVERY_TIMEOUT:-330}" python3 -m bench gpu_recovery --out "$OUT" > "$OUT/recovery.log" 2>&1
    echo "recovery rc=$?"
    grep "^RECOVERY" "$OUT/recovery.log"
    ;;
  inflight)
    install_stack
    cd .gpu-src
    timeout "${INFLIGHT_TIMEOUT:-300}" python3 -m bench refit_inflight --device gpu --window "${INFLIGHT_WINDOW:-20}" \
      --every "${INFLIGHT_EVERY:-5}" --json "$OUT/refit_inflight.json" > "$OUT/inflight.log" 2>&1
    echo "inflight rc=$?"
    grep -A8 "^mode" "$OUT/inflight.log"; grep -E "^keep:|idle fleet" "$OUT/inflight.log"
    ;;
  rl)
    bash .gpu/unpack.sh install > /tmp/nemo-gen-install.log 2>&1 || { tail -40 /tmp/nemo-gen-install.log; exit 1; }
    cd .gpu-src
    end_left_gpu_processes
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    if [ "${RL_MPS:-0}" = 1 ]; then start_mps || exit 1; fi
    # the card's busy share, with each mode's steps done so far (to tell the modes apart)
    ( while sleep 0.5; do echo "$(date +%s.%N),$(nvidia-smi --query-gpu=utilization.gpu,memory.used \
        --format=csv,noheader,nounits),$(cat "$OUT"/rl/sync/steps.jsonl 2> /dev/null | wc -l),$(cat \
        "$OUT"/rl/async/steps.jsonl 2> /dev/null | wc -l)"; done > "$OUT/gpu.csv" ) &
    gpu_watch=$!
    # the model is made on the host's CPU (~1 min), the fleet launches (~2 min), then each mode runs
    # until RL_STEPS steps or RL_MODE_S seconds, whichever comes first
    timeout "${RL_TIMEOUT:-585}" python3 -m bench rl_step --device gpu --model-size 1b --prompts 64 --group 8 \
      --max-new-tokens 128 --steps "${RL_STEPS:-20}" --max-seconds "${RL_MODE_S:-120}" --work "$NEMO_GEN_RL_WORK" \
      --out "$OUT/rl" --json "$OUT/rl_step-gpu.json" ${RL_ARGS:-} > "$OUT/rl.log" 2>&1
    echo "rl rc=$?"
    kill "$gpu_watch"
    if [ "${RL_MPS:-0}" = 1 ]; then stop_mps; fi
    tail -c 3000 "$OUT/rl.log"
    ;;
  lorafp8)
    install_stack
    cd .gpu-src
    end_left_gpu_processes
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    timeout "${LF_TIMEOUT:-540}" python3 -m bench lora_fp8_gpu --out "$OUT" --deadline-s "${LF_DEADLINE:-510}" \
      ${LF_ARGS:-} > "$OUT/lora_fp8.log" 2>&1
    echo "lora_fp8 rc=$?"
    grep -E "^\[" "$OUT/lora_fp8.log" | cut -c1-400 | tail -30
    ;;
  rollout)
    bash .gpu/unpack.sh install > /tmp/nemo-gen-install.log 2>&1 || { tail -40 /tmp/nemo-gen-install.log; exit 1; }
    if ls .whl/py_spy-*.whl > /dev/null 2>&1; then  # carried (see /work/.library/device/README.md's wheel notes)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/pyspy-site .whl/py_spy-*.whl \
        && export PY_SPY=/tmp/pyspy-site/bin/py-spy
    fi
    export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on the lent hosts (KINDS.md)
    cd .gpu-src
    end_left_gpu_processes
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/nvidia-smi.txt"
    timeout "${RO_TIMEOUT:-575}" python3 -m bench rollout --out "$OUT" --work /tmp/nemo-gen-rollout \
      --deadline-s "${RO_DEADLINE:-545}" ${RO_ARGS:-} > "$OUT/rollout.log" 2>&1
    echo "rollout rc=$?"
    end_left_gpu_processes
    ( cd "$OUT" && ls -d */ > /dev/null 2>&1 && tar czf details.tgz */ && rm -rf -- */ )
    grep -E "^\[|^model|^[a-z0-9]+ +(bfloat16|fp8) " "$OUT/rollout.log" | cut -c1-400 | tail -40
    ;;
  model)
    install_stack
    tail -1 "$OUT/install.log"
    cd .gpu-src
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/nvidia-smi.txt"
    python3 -c "from pathlib import Path; from bench.rollout import make; from nemo_gen.tiny_model import make_tiny_model
w = Path('/tmp/nemo-gen-rollout'); print('made', make(None, '8b', w, make_tiny_model(w / 'tiny')))" 2>&1 | tail -3
    ;;
  colocated)
    install_stack
    cd .gpu-src
    end_left_gpu_processes
    timeout "${CO_TIMEOUT:-560}" python3 -m pytest tests/gpu/test_colocated_gpu.py -v -s -p no:cacheprovider --timeout 400 \
      > "$OUT/test_colocated.log" 2>&1
    echo "pytest rc=$?"
    end_left_gpu_processes
    grep -E "PASSED|FAILED|ERROR|passed|failed|^E  |sleep level|wake:" "$OUT/test_colocated.log" | cut -c1-300 | tail -40
    ;;
  sleepwake)
    install_stack
    cd .gpu-src
    end_left_gpu_processes
    timeout "${SW_TIMEOUT:-560}" python3 -m bench sleep_wake_gpu --work /tmp/nemo-gen-rollout --out "$OUT" ${SW_ARGS:-} \
      > "$OUT/sleep_wake.log" 2>&1
    echo "sleep_wake rc=$?"
    end_left_gpu_processes
    grep -E "^cold launch|^cycle|^sleep |verdicts|Error|error" "$OUT/sleep_wake.log" | cut -c1-600 | tail -20
    ;;
  digest)
    install_stack
    cd .gpu-src
    end_left_gpu_processes
    timeout "${DG_TIMEOUT:-560}" python3 -m bench refit_digest_gpu --out "$OUT" ${DG_ARGS:-} > "$OUT/refit_digest.log" 2>&1
    echo "refit_digest rc=$?"
    end_left_gpu_processes
    grep -E "GB: digest|nemo_gen_ipc refit|Error|error" "$OUT/refit_digest.log" | cut -c1-400 | tail -20
    ;;
  rolloutab)
    install_stack
    export NCCL_NVLS_ENABLE=0
    cd .gpu-src
    for tree in ${AB_TREES:-.}; do
      end_left_gpu_processes
      name=${tree#_}; [ "$tree" = . ] && name=head
      ( cd "$tree" && PYTHONPATH=$PWD:/tmp/nemo-gen-site timeout "${AB_EACH_S:-180}" python3 -m bench rollout --out "$OUT/ab-$name" \
          --work /tmp/nemo-gen-rollout ${AB_ARGS:-} > "$OUT/rollout-$name.log" 2>&1; echo "$name rc=$?" )
      cp "$OUT/ab-$name/rollout.json" "$OUT/rollout-$name.json" 2> /dev/null
      grep -E "^\[|^model|^[a-z0-9]+ +(bfloat16|fp8) " "$OUT/rollout-$name.log" | grep -v "^\[.*peaks" | cut -c1-300 | tail -8
    done
    end_left_gpu_processes
    ( cd "$OUT" && ls -d */ > /dev/null 2>&1 && tar czf details.tgz */ && rm -rf -- */ )
    ;;
  *) echo "usage: gpu_sitting.sh tests|bench|recovery|inflight|rl|lorafp8|rollout|model|colocated|sleepwake|digest|rolloutab"; exit 2 ;;
esac
