#!/usr/bin/env bash
# Session 21 (issues 33 and 36): `bash bench/device_runs/s21b.sh TASK...` runs the named tasks in order, each with
# what is left of a $BUDGET s budget (585; a task that needs more than is left is skipped and says so).
# Parts and environment: s18_site.sh (the session-19 stage, parts 00-05). Tasks:
#   packing      bench/packing_gpu.py: the fsdp step at the 1.5B shape, 128 sequences at a DAPO-like length
#                distribution (completions up to 3,840), padded against packed, $PACK_MBS (2) rows a padded
#                micro-batch (issue 36 item 1)
#   submit_8b / harness_8b / sweep_8b / procs_8b   as s19.sh (issue 33 items 4, 5)
set -u
T0=$SECONDS
BUDGET=${BUDGET:-585}
source bench/device_runs/s18_site.sh
source bench/device_runs/tasks.sh
for task in "$@"; do
  echo "== $task at $((SECONDS - T0)) s"
  case $task in
    packing)
      need 200 $task || continue
      # --mbs 4 (a 16,560-token budget) ran out of memory packed on an H100: SDPA's masked kernel holds the
      # [L, L] mask per packed row; 2 fits (session 21)
      PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 10 $(($(left) - 5)) python3 bench/packing_gpu.py \
        --model qwen2_1p5b --seqs "${PACK_SEQS:-128}" --max-new 3840 --mbs "${PACK_MBS:-2}" --steps 2 \
        --out "$OUT/packing_q15.json" > "$OUT/packing.log" 2>&1
      echo "== packing rc=$? $((SECONDS - T0)) s"; grep -E "^(batch|padded|packed)|Error|Traceback" "$OUT/packing.log" | tail -6 ;;
    submit_8b) need 200 $task && shape q8b16 qwen3_8b 16 && submit_shape q8b16 qwen3_8b 16 "$(left)" algo.max_steps=3 \
                 rollout.gpu_memory_utilization=0.3 ;;
    harness_8b) need 150 $task && shape q8b16 qwen3_8b 16 && harness q8b16 qwen3_8b 16 0.3 ;;
    sweep_8b) need 180 $task && shape q8b16 qwen3_8b 16 && sweep q8b16 qwen3_8b 16 --seqs 256,512 --skip-two ;;
    procs_8b) need 150 $task && shape q8b16 qwen3_8b 16 && sweep q8b16 qwen3_8b 16 --procs 2 ;;
    *) echo "== unknown task $task" ;;
  esac
done
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
echo "== done $((SECONDS - T0)) s"
