#!/usr/bin/env bash
# Session 19 (issue 33) on one H200: `bash bench/device_runs/s19.sh TASK...` runs the named tasks in order, each
# with what is left of a 585 s budget (a task that needs more than is left is skipped and says so). Parts and
# environment: s18_site.sh (session 19 staged trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 too).
# Tasks:
#   smollm2      the SmolLM2 recipe, $STEPS steps (30), vLLM engine (item 3: hpcrl's row of the same-machine pair)
#   trl          TRL 1.16 GRPOTrainer on the same job, $TRL_STEPS steps (20), per-phase seconds (item 3)
#   smollm2_hf   the SmolLM2 recipe with rollout=hf, $HF_STEPS steps (20): the engines in the loop (item 5)
#   submit_8b / harness_8b   the 8B shape (Qwen3-8B widths, 16 layers) through hpcrl submit / the harness (item 4)
#   sweep_8b     bench/engine_sweep.py at the 8B shape: hf at 64/256, vLLM at 256/512 at once (item 5)
#   procs_s135 / procs_q15 / procs_8b   two vLLM engines in two processes on the GPU against one (item 5)
set -u
T0=$SECONDS
BUDGET=${BUDGET:-585}
source bench/device_runs/s18_site.sh
source bench/device_runs/tasks.sh
for task in "$@"; do
  echo "== $task at $((SECONDS - T0)) s"
  case $task in
    smollm2) need 200 $task && fetched && recipe vllm "${STEPS:-30}" ;;
    trl) need 200 $task && fetched && peer trl bench/peers/trl_grpo.py "${TRL_STEPS:-20}" ;;
    smollm2_hf) need 150 $task && fetched && recipe hf "${HF_STEPS:-20}" rollout=hf ;;
    submit_8b) need 200 $task && shape q8b16 qwen3_8b 16 && submit_shape q8b16 qwen3_8b 16 "$(left)" algo.max_steps=3 \
                 rollout.gpu_memory_utilization=0.3 ;;
    harness_8b) need 150 $task && shape q8b16 qwen3_8b 16 && harness q8b16 qwen3_8b 16 0.3 ;;
    sweep_8b) need 180 $task && shape q8b16 qwen3_8b 16 && sweep q8b16 qwen3_8b 16 --seqs 256,512 --skip-two ;;
    procs_s135) need 120 $task && shape s135 smollm2_135m && sweep s135 smollm2_135m "" --skip-hf --skip-two --seqs 256 \
                  && sweep s135 smollm2_135m "" --procs 2 ;;
    procs_q15) need 150 $task && shape q15 qwen2_1p5b && sweep q15 qwen2_1p5b "" --skip-hf --skip-two --seqs 256 \
                 && sweep q15 qwen2_1p5b "" --procs 2 ;;
    procs_8b) need 150 $task && shape q8b16 qwen3_8b 16 && sweep q8b16 qwen3_8b 16 --procs 2 ;;
    *) echo "== unknown task $task" ;;
  esac
done
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
echo "== done $((SECONDS - T0)) s"
