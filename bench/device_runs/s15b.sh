#!/usr/bin/env bash
# Session 15, last device call: is the run-to-run spread of one vLLM engine's tok/s (33-52k for the same
# config in separate processes) the CPU placement of its processes? Same arm (block 64, no logprobs,
# 256 x (128 + 256)), alternating unpinned and pinned to four cores with taskset (the engine core,
# its threads and the front-end inherit the mask), per-call seconds kept. A snapshot of the CPUs' load
# and clocks mid-run goes with the logs.
set -u
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$HOME/.cache/hpcrl-s15-vllm}
T0=$SECONDS
SCRATCH=$(mktemp -d)
lscpu > "$SCRATCH/lscpu.txt" 2>&1
ROW="now: one seed per call, no logprobs"
arm() {  # name timeout prefix...
  local name=$1 t=$2; shift 2
  echo "== $name start $((SECONDS - T0)) s"
  (sleep 60; top -b -n1 -w 200 | head -25; grep MHz /proc/cpuinfo) > "$SCRATCH/$name.top" 2>&1 &
  timeout "$t" "$@" python3 bench/vllm_gpu.py --rollout-only --no-two-engines --iters 5 --start-timeout 100 \
    --skip-hf --only "$ROW" --gc 0 --set rollout.block_size=64 --out "$OUT/$name.json" > "$SCRATCH/$name.log" 2>&1
  echo "== $name rc=$? end $((SECONDS - T0)) s"
  grep -E "^now|seconds per call" "$SCRATCH/$name.log"
}
arm free1 110 env
arm pin1 110 taskset -c 8-11
arm free2 110 env
arm pin2 110 taskset -c 8-11
tar -C "$SCRATCH" -czf "$OUT/logs_b.tgz" .
echo "== done $((SECONDS - T0)) s"
