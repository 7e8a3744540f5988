#!/usr/bin/env bash
# Session 14, last call: the 8B-shape colocated step (today's safetensors path cannot carry 8.7 GB:
# msgspec refuses bytes over 4 GiB), then rollout.block_size 64 against the default again, alternating.
set -u
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$HOME/.cache/hpcrl-s14-vllm}  # shared by the calls while the machine stays up
timeout 200 python3 bench/colocated_gpu.py --model qwen3_8b --layers 16 --share 0.3 --refits 3 --skip-old \
  --out "$OUT/colocated_8b.json" > "$OUT/colocated_8b.log" 2>&1
echo "colocated rc=$?"; grep -v "it/s\]\|^\s*$" "$OUT/colocated_8b.log" | grep -v "^\[rank\|^ \|Warning\|warn" | tail -16
ROWS="now: one seed per call, no logprobs|now, no logprobs, 128"
for arm in bs64:rollout.block_size=64 default:rollout.block_size=16; do
  name=${arm%%:*}; set=${arm#*:}
  timeout 110 python3 bench/vllm_gpu.py --rollout-only --no-two-engines --skip-hf --iters 4 --start-timeout 90 \
    --only "$ROWS" --set "$set" --out "$OUT/${name}_b.json" > "$OUT/${name}_b.log" 2>&1
  echo "$name rc=$?"; grep -A3 "^rollout " "$OUT/${name}_b.log"
done
