#!/usr/bin/env bash
# Session 16, last staging: vLLM's multiprocess executor for a one-GPU engine (rollout.executor=mp: the
# model's worker in its own process, so the engine core's scheduler and the runner's input preparation
# run on two CPUs). One process, no hf row (the device time left allows one engine start); compare with
# the one-process ('uni') figures of sessions 14-16 (33-52k tok/s, 25.5 us per sequence-step).
# rollout.executor existed for this run only (commit "rollout.executor: ..."); removed after it: no gain.
set -u
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$HOME/.cache/hpcrl-s16-vllm}
T0=$SECONDS
timeout "${ARM_TIMEOUT:-200}" python3 bench/vllm_gpu.py --rollout-only --no-two-engines --skip-hf --iters 3 --rounds 2 \
  --start-timeout 150 --only "one seed per call, no logprobs|every 8th" \
  --set rollout.block_size=64 rollout.executor=mp --out "$OUT/mp.json" > "$OUT/mp.log" 2>&1
echo "== mp rc=$? end $((SECONDS - T0)) s"
grep -E "^rollout |^now|seconds per call|ERROR|Error" "$OUT/mp.log" | head -12
