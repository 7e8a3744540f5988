#!/usr/bin/env bash
# Session 17, device call 7 (issue 33 item 3): TRL 1.16 GRPOTrainer, vLLM 0.26 colocated, on the job of
# +experiment=grpo-smollm2-1n1g-chainsum, right after s17a.sh on the same machine (its site and HF cache).
set -u
TMP=${TMPDIR:-/tmp}
export PYTHONPATH=$PWD:$TMP/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 HF_HOME=$TMP/hf
export VLLM_CACHE_ROOT=$TMP/vllm-cache-trl TOKENIZERS_PARALLELISM=false
set -o pipefail
timeout -k 10 540 python3 bench/peers/trl_grpo.py --out "$OUT" 2>&1 | grep -v -i "warn" | tee "$OUT/trl.log" \
  | grep -E "^\[trl\]|Error|error|Traceback|^\{\"peer|File \"" | tail -80
nvidia-smi --query-gpu=memory.used --format=csv,noheader
