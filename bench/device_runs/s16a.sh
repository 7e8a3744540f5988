#!/usr/bin/env bash
# Session 16, device call 3 (after the stage tool's install): issue 19 item 4 once more.
# Qwen2-1.5B shape, 256 x (128 + 256), block 64 (the planner's GPU default), one compile cache.
#   base:     the hf baseline, then one engine whose rows alternate in 2 rounds (one process, so the
#             host's process-to-process spread cancels): no logprobs, logprobs for every 8th prompt
#             (rollout.logprob_fraction=0.125, the default without an IS correction), flat logprobs.
#   v1runner: the same engine on vLLM's V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0): no logprobs.
#   block128: rollout.block_size=128: no logprobs.
# Every row also reports the engine processes' CPU microseconds per sequence and step (from /proc),
# which the host's noisy wall clock does not blur. At most 8 files come back: JSONs here, logs in a tarball.
set -u
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$HOME/.cache/hpcrl-s16-vllm}
T0=$SECONDS
SCRATCH=$(mktemp -d)
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -lms 250 > "$SCRATCH/smi.csv" &
smi=$!
NOLP="one seed per call, no logprobs"
arm() {  # name timeout only rounds args...
  local name=$1 t=$2 only=$3 rounds=$4; shift 4
  echo "== $name start $((SECONDS - T0)) s"
  timeout "$t" python3 bench/vllm_gpu.py --rollout-only --no-two-engines --iters 3 --rounds "$rounds" \
    --start-timeout 150 --only "$only" --out "$OUT/$name.json" "$@" > "$SCRATCH/$name.log" 2>&1
  echo "== $name rc=$? end $((SECONDS - T0)) s"
  grep -E "^rollout |^(hf|now)|ERROR" "$SCRATCH/$name.log" | head -8
}
arm base 290 "$NOLP|every 8th|one seed per call, flat logprobs" 2 --set rollout.block_size=64
if [ $((SECONDS - T0)) -lt 420 ]; then
  VLLM_USE_V2_MODEL_RUNNER=0 arm v1runner 140 "$NOLP" 1 --skip-hf --set rollout.block_size=64
fi
if [ $((SECONDS - T0)) -lt 480 ]; then arm block128 100 "$NOLP" 1 --skip-hf --set rollout.block_size=128; fi
kill $smi
tar -C "$SCRATCH" -czf "$OUT/logs_a.tgz" .
echo "== done $((SECONDS - T0)) s"
