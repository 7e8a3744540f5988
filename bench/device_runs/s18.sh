#!/usr/bin/env bash
# Session 18 (issue 33) on one H200: `bash bench/device_runs/s18.sh TASK...` runs the named tasks in order, each
# with what is left of a 585 s budget (a task that needs more than is left is skipped and says so).
# Parts and environment: s18_site.sh. Tasks:
#   smollm2        the SmolLM2 recipe again, 60 steps (fetch converts the GGUF), hpcrl plot (items 2, 3)
#   submit_q15     the Qwen2-1.5B shape (random weights) through hpcrl submit, 4 steps (item 4)
#   harness_q15    the bench harness (bench/colocated_gpu.py) on the same directory, 3 steps (item 4)
#   submit_8b      the 8B shape (Qwen3-8B widths, 16 layers, as sessions 14-16) through hpcrl submit, 3 steps
#   harness_8b     the harness on it, 3 steps
#   sweep_s135 / sweep_q15 / sweep_8b   bench/engine_sweep.py at that shape (item 5)
# Calls of session 18: see bench/results/README.md, session 18.
set -u
T0=$SECONDS
BUDGET=${BUDGET:-585}
source bench/device_runs/s18_site.sh
PL=${PROMPT_LEN:-190}
left() { echo $((BUDGET - (SECONDS - T0))); }
harness() {  # harness NAME MODEL LAYERS SHARE
  timeout -k 10 "$(left)" python3 bench/colocated_gpu.py --model "$2" ${3:+--layers $3} --model-dir "$TMP/m/$1" \
    --prompts 64 --n 4 --prompt-len $PL --gen 256 --share "$4" --refits 1 --skip-old --steps 3 \
    --out "$OUT/harness_$1.json" > "$OUT/harness_$1.log" 2>&1
  echo "== harness $1 rc=$? $((SECONDS - T0)) s"
  grep -E "^(engine start|trainer start|generate|train step|refit ipc \(step\)|wake|== step)" "$OUT/harness_$1.log" | tail -14
}
sweep() {  # sweep NAME MODEL LAYERS
  timeout -k 10 "$(left)" python3 bench/engine_sweep.py --model "$2" --model-dir "$TMP/m/$1" ${3:+--layers $3} \
    --deadline-s $(($(left) - 45)) --out "$OUT/sweep_$1.json" > "$OUT/sweep_$1.log" 2>&1
  echo "== sweep $1 rc=$? $((SECONDS - T0)) s"; grep -E "tok/s|started|FAILED|skipped|Error" "$OUT/sweep_$1.log" | tail -12
}
need() {  # need SECONDS TASK: false (and a line) when less is left
  [ "$(left)" -ge "$1" ] || { echo "== $2 skipped: $(left) s left, needs ~$1"; return 1; }
}
for task in "$@"; do
  echo "== $task at $((SECONDS - T0)) s"
  case $task in
    smollm2)
      need 400 $task || continue
      R=+experiment=grpo-smollm2-1n1g-chainsum
      hpcrl fetch $R > "$OUT/fetch.log" 2>&1; echo "== fetch rc=$? $((SECONDS - T0)) s"; tail -2 "$OUT/fetch.log"
      timeout -k 10 $(($(left) - 15)) python3 -m hpcrl.cli submit $R run.output_root=$TMP/runs > "$OUT/submit.log" 2>&1
      echo "== submit rc=$? $((SECONDS - T0)) s"; grep -E "^\[hpcrl|Error|Traceback" "$OUT/submit.log" | tail -16
      RUN=$(ls -d "$TMP"/runs/*/ 2>/dev/null | head -1)
      [ -n "$RUN" ] && { hpcrl plot "$RUN" --out "$OUT" 2>&1 | tail -1; cp "$RUN/metrics.jsonl" "$OUT/";
                         python3 bench/phase_table.py "$RUN/metrics.jsonl"; } ;;
    submit_q15) need 180 $task && shape q15 qwen2_1p5b && submit_shape q15 qwen2_1p5b "" "$(left)" algo.max_steps=4 ;;
    harness_q15) need 120 $task && shape q15 qwen2_1p5b && harness q15 qwen2_1p5b "" 0.6 ;;
    submit_8b) need 200 $task && shape q8b16 qwen3_8b 16 && submit_shape q8b16 qwen3_8b 16 "$(left)" algo.max_steps=3 \
                 rollout.gpu_memory_utilization=0.3 ;;
    harness_8b) need 150 $task && shape q8b16 qwen3_8b 16 && harness q8b16 qwen3_8b 16 0.3 ;;
    sweep_s135) need 120 $task && shape s135 smollm2_135m && sweep s135 smollm2_135m "" ;;
    sweep_q15) need 150 $task && shape q15 qwen2_1p5b && sweep q15 qwen2_1p5b "" ;;
    sweep_8b) need 180 $task && shape q8b16 qwen3_8b 16 && sweep q8b16 qwen3_8b 16 ;;
    *) echo "== unknown task $task" ;;
  esac
done
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
echo "== done $((SECONDS - T0)) s"
