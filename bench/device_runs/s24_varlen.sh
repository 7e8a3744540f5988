#!/usr/bin/env bash
# Session 24 (issue 36 item 1): `bash bench/device_runs/s24_varlen.sh varlen` on one GPU: packed micro-batches
# through varlen attention (hpcrl/trainer/varlen.py, no [L, L] mask) against padded ones, the fsdp train step
# alone (no vLLM). Parts and environment: s18_site.sh (bench/device_runs/prepare.sh stages them). Tasks:
#   varlen   bench/packing_gpu.py --check-kernel: the packed attention against SDPA under the dense mask on
#            this GPU (which path ran, output and gradient differences); then at a DAPO-like length distribution
#            (128 sequences, prompts 100-300, completions log-normal up to 3,840: max 4,140 tokens) the
#            SmolLM2-135M shape and the Qwen2-1.5B shape, padded at the planner's micro-batch against packed at
#            the planner's budget (--mbs plan); real tokens / s, the ratio, peak memory; $OUT/varlen.json
set -u
T0=$SECONDS
BUDGET=${BUDGET:-585}
source bench/device_runs/s18_site.sh
source bench/device_runs/tasks.sh
for task in "$@"; do
  echo "== $task at $((SECONDS - T0)) s"
  case $task in
    varlen)
      need 150 $task || continue
      PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 10 $(($(left) - 5)) python3 bench/packing_gpu.py \
        --check-kernel --model "${VARLEN_MODELS:-smollm2_135m,qwen2_1p5b}" --seqs "${VARLEN_SEQS:-128}" \
        --max-new "${VARLEN_MAX_NEW:-3840}" --mbs plan --steps 2 --out "$OUT/varlen.json" > "$OUT/varlen.log" 2>&1
      echo "== varlen rc=$? $((SECONDS - T0)) s"
      grep -E "^(kernel check|batch|padded|packed|best|\||[a-z0-9_]+: planner)|Error|Traceback" "$OUT/varlen.log" | cut -c1-400 ;;
    *) echo "== unknown task $task" ;;
  esac
done
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
echo "== done $((SECONDS - T0)) s"
