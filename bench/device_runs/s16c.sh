#!/usr/bin/env bash
# Session 16, third staging: s16b's 8B step reported different greedy tokens after three IPC refits of
# the same weights (the first attempt, same code, had them identical). Now the bench also compares the
# engine's parameter bits before and after the refits (VLLMEngine.weights_digest) and repeats the greedy
# probe once without a refit (vLLM's own determinism), every probe with its logprobs.
set -u
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$HOME/.cache/hpcrl-s16-vllm}
T0=$SECONDS
timeout 300 python3 bench/colocated_gpu.py --model qwen3_8b --layers 16 --share 0.3 --refits 3 --skip-old \
  --out "$OUT/colocated_8b_c.json" > "$OUT/colocated_8b_c.log" 2>&1
echo "== 8B rc=$? end $((SECONDS - T0)) s"
grep -vE "it/s\]|Capturing|Loading safetensors|Writing model" "$OUT/colocated_8b_c.log" | grep -v '^ ' | tail -25
