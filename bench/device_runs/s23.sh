#!/usr/bin/env bash
# Session 23 (issue 33): `bash bench/device_runs/s23.sh TASK...` runs the named tasks in order, each with what is
# left of a $BUDGET s budget (585; a task that needs more than is left is skipped and says so).
# Parts and environment: s18_site.sh (bench/device_runs/prepare.sh stages them here); carry .whl (and .devtok for
# the 8B shapes). Tasks:
#   train135    bench/packing_gpu.py --job smollm2 --profile: the SmolLM2 recipe's fsdp train step (512 sequences,
#               random weights at its shape) at 64/128/256 rows a micro-batch, 512 with activation checkpointing,
#               and packed; the GPU's busy time against the step's wall time; the fastest row's overrides go to
#               $OUT/best.txt, which the smollm2/trl/verl tasks then use (the same micro-batch for every peer)
#   smollm2/trl/verl  hpcrl submit of the SmolLM2 recipe ($STEPS, 20), TRL 1.16 and veRL 0.9.1 on the same job
#   submit_8b / harness_8b   the 8B shape cut to $L8 (10) layers through hpcrl submit and the one-process harness
#   sweep_8b    engine sweep at the 8B shape, 16 layers
set -u
T0=$SECONDS
BUDGET=${BUDGET:-585}
L8=${L8:-10}
source bench/device_runs/s18_site.sh
source bench/device_runs/tasks.sh
best() { cat "$TMP/best.txt" 2>/dev/null; }  # the train135 task's fastest row (empty: the recipe's own)
for task in "$@"; do
  echo "== $task at $((SECONDS - T0)) s"
  case $task in
    train135)
      need 200 $task || continue
      timeout -k 10 $(($(left) - 5)) python3 bench/packing_gpu.py --model smollm2_135m --job smollm2 --seqs 512 \
        --max-new 64 --mbs 64 --steps 3 --profile --rows padded,padded:128,padded:256,padded:512+ac,packed \
        --out "$OUT/train135.json" > "$OUT/train135.log" 2>&1
      echo "== train135 rc=$? $((SECONDS - T0)) s"
      grep -E "^(batch|padded|packed|best)|Error|Traceback" "$OUT/train135.log" | cut -c1-400
      python3 -c "import json,sys; print(' '.join(json.load(open(sys.argv[1]))['best']['overrides']))" \
        "$OUT/train135.json" > "$TMP/best.txt" 2>/dev/null && cp "$TMP/best.txt" "$OUT/best.txt"
      echo "== best: $(best)" ;;
    smollm2) need 200 $task && fetched && recipe vllm "${STEPS:-20}" $(best) ;;
    trl) need 200 $task && fetched && peer trl bench/peers/trl_grpo.py "${TRL_STEPS:-20}" $(best | sed 's/trainer.packing=[a-z]*//') ;;
    verl)
      need 330 $task && fetched && verl_site || continue
      vpeer verl bench/peers/verl_grpo.py "${VERL_STEPS:-20}" $(best | sed 's/trainer.packing=[a-z]*//') ;;
    submit_8b) need 200 $task && shape q8b$L8 qwen3_8b $L8 && submit_shape q8b$L8 qwen3_8b $L8 "$(left)" algo.max_steps=3 \
                 rollout.gpu_memory_utilization=0.3 ;;
    harness_8b) need 150 $task && shape q8b$L8 qwen3_8b $L8 && harness q8b$L8 qwen3_8b $L8 0.3 ;;
    sweep_8b) need 180 $task && shape q8b16 qwen3_8b 16 && sweep q8b16 qwen3_8b 16 --seqs 256,512 --skip-two ;;
    *) echo "== unknown task $task" ;;
  esac
done
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
echo "== done $((SECONDS - T0)) s"
