#!/usr/bin/env bash
# Session 22 (issues 33 and 36): `bash bench/device_runs/s22.sh TASK...` runs the named tasks in order, each with
# what is left of a $BUDGET s budget (585; a task that needs more than is left is skipped and says so).
# Parts and environment: s18_site.sh (the session-19 stage, parts 00-05); carry .whl for veRL's wheels. Tasks:
#   verl        veRL 0.9.1 on the SmolLM2 job ($VERL_STEPS, 20), TRL shadowed by bench/peers/verl_standin
#               (session 21's run failed importing a class TRL 1.16 dropped; veRL's GRPO never uses it)
#   train135    bench/packing_gpu.py --job smollm2: the SmolLM2 recipe's fsdp train step (512 sequences,
#               random weights at its shape) at 64/128/256/512 rows a micro-batch and packed: where the
#               train phase's 1.35 s (session 19, H100) goes
#   submit_8b / harness_8b   the 8B shape (Qwen3-8B widths) cut to $L8 (10) layers so the colocated peak fits
#               an H100 (16 layers need ~101 GB: an H200, which did not come in sessions 20-21)
#   sweep_8b    engine sweep at the 8B shape, 16 layers (the engine alone fits an H100)
#   smollm2/trl hpcrl's SmolLM2 recipe through hpcrl submit ($STEPS, 20) and TRL 1.16 on the same job ($TRL_STEPS,
#               20), in one call (issue 33 item 3's same-machine ratio)
#   fp8         bench/fp8_rollout_gpu.py (issue 36 item 3): bf16 against fp8 rollout at the 8B shape, 16 layers
set -u
T0=$SECONDS
BUDGET=${BUDGET:-585}
L8=${L8:-10}
source bench/device_runs/s18_site.sh
source bench/device_runs/tasks.sh
for task in "$@"; do
  echo "== $task at $((SECONDS - T0)) s"
  case $task in
    verl)
      need 330 $task && fetched && verl_site || continue
      vpeer verl bench/peers/verl_grpo.py "${VERL_STEPS:-20}" && continue
      nvidia-smi --query-gpu=memory.used --format=csv,noheader
      need 240 verl_v0 && vpeer verl_v0 bench/peers/verl_grpo.py "${VERL_STEPS:-20}" --legacy ;;
    train135)
      need 150 $task || continue
      timeout -k 10 $(($(left) - 5)) python3 bench/packing_gpu.py --model smollm2_135m --job smollm2 --seqs 512 \
        --max-new 64 --mbs 64 --steps 3 --rows padded,packed,padded:128,padded:256,padded:512 \
        --out "$OUT/train135.json" > "$OUT/train135.log" 2>&1
      echo "== train135 rc=$? $((SECONDS - T0)) s"; grep -E "^(batch|padded|packed)|Error|Traceback" "$OUT/train135.log" | cut -c1-300 ;;
    submit_8b) need 200 $task && shape q8b$L8 qwen3_8b $L8 && submit_shape q8b$L8 qwen3_8b $L8 "$(left)" algo.max_steps=3 \
                 rollout.gpu_memory_utilization=0.3 ;;
    harness_8b) need 150 $task && shape q8b$L8 qwen3_8b $L8 && harness q8b$L8 qwen3_8b $L8 0.3 ;;
    sweep_8b) need 180 $task && shape q8b16 qwen3_8b 16 && sweep q8b16 qwen3_8b 16 --seqs 256,512 --skip-two ;;
    fp8)
      need 200 $task || continue
      timeout -k 10 $(($(left) - 5)) python3 bench/fp8_rollout_gpu.py --model qwen3_8b --layers 16 \
        --out "$OUT/fp8_q8b16.json" > "$OUT/fp8.log" 2>&1
      echo "== fp8 rc=$? $((SECONDS - T0)) s"; grep -vE "^(INFO|WARNING|\(|  )" "$OUT/fp8.log" | tail -15 | cut -c1-300 ;;
    smollm2) need 200 $task && fetched && recipe vllm "${STEPS:-20}" ;;
    trl) need 200 $task && fetched && peer trl bench/peers/trl_grpo.py "${TRL_STEPS:-20}" ;;
    *) echo "== unknown task $task" ;;
  esac
done
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
echo "== done $((SECONDS - T0)) s"
