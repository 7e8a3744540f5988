#!/usr/bin/env bash
# Session 20 (issue 33 item 5) on one GPU: `bash bench/device_runs/s20.sh TASK...` runs the named tasks in order,
# each with what is left of a 585 s budget (as s19.sh; same parts and environment: s18_site.sh).
# Tasks: the product path (`hpcrl submit`, Ray actors, colocated, sleep, CUDA-IPC refit) with one vLLM engine per
# GPU against two (rollout.engines_per_gpu, placement-group bundles, IPC refit to both):
#   smollm2_k1 / smollm2_k2   the SmolLM2 recipe, $STEPS steps (20), engines_per_gpu 1 / auto (2 at 135M)
#   q15_k1 / q15_k2           the Qwen2-1.5B shape (random weights) through hpcrl submit, 5 steps, 1 / 2 engines
set -u
T0=$SECONDS
BUDGET=${BUDGET:-585}
source bench/device_runs/s18_site.sh
export TORCH_LOGS=${TORCH_LOGS-recompiles}  # why a later step recompiles (session 19: step 8 trained for 9.8 s)
source bench/device_runs/tasks.sh
for task in "$@"; do
  echo "== $task at $((SECONDS - T0)) s"
  case $task in
    smollm2_k1) need 200 $task && fetched && recipe k1 "${STEPS:-20}" rollout.engines_per_gpu=1 ;;
    smollm2_k2) need 200 $task && fetched && recipe k2 "${STEPS:-20}" ;;
    q15_k1) need 150 $task && shape q15 qwen2_1p5b && ln -sfn "$TMP/m/q15" "$TMP/m/q15k1" && submit_shape q15k1 qwen2_1p5b "" "$(left)" algo.max_steps=5 \
              rollout.engines_per_gpu=1 ;;
    q15_k2) need 150 $task && shape q15 qwen2_1p5b && ln -sfn "$TMP/m/q15" "$TMP/m/q15k2" && submit_shape q15k2 qwen2_1p5b "" "$(left)" algo.max_steps=5 \
              rollout.engines_per_gpu=2 ;;
    *) echo "== unknown task $task" ;;
  esac
done
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
echo "== done $((SECONDS - T0)) s"
