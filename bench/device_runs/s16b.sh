#!/usr/bin/env bash
# Session 16, device call 3 of the second staging: the 8B-shape colocated step again (the first
# attempt in s16a's session crashed in build_batch on completions without logprobs, fixed since),
# now with the step freeing its gradients and the trainers releasing the refit's buckets; then
# rollout.block_size=128 against the block-64 rows of s16a (no logprobs).
set -u
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$HOME/.cache/hpcrl-s16-vllm}
T0=$SECONDS
SCRATCH=$(mktemp -d)
echo "== 8B start"
timeout 330 python3 bench/colocated_gpu.py --model qwen3_8b --layers 16 --share 0.3 --refits 3 --skip-old \
  --out "$OUT/colocated_8b.json" > "$SCRATCH/colocated_8b.log" 2>&1
echo "== 8B rc=$? end $((SECONDS - T0)) s"
grep -vE "it/s\]|Capturing|Loading safetensors|Writing model" "$SCRATCH/colocated_8b.log" | tail -30
if [ $((SECONDS - T0)) -lt 400 ]; then
  echo "== block128 start $((SECONDS - T0)) s"
  timeout 170 python3 bench/vllm_gpu.py --rollout-only --no-two-engines --skip-hf --iters 3 --rounds 2 \
    --start-timeout 150 --only "one seed per call, no logprobs" --set rollout.block_size=128 \
    --out "$OUT/block128.json" > "$SCRATCH/block128.log" 2>&1
  echo "== block128 rc=$? end $((SECONDS - T0)) s"
  grep -E "^rollout |^now|seconds per call|ERROR" "$SCRATCH/block128.log" | head -8
fi
tar -C "$SCRATCH" -czf "$OUT/logs_b.tgz" .
echo "== done $((SECONDS - T0)) s"
