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
PL=${PROMPT_LEN:-190}
left() { echo $((BUDGET - (SECONDS - T0))); }
need() {  # need SECONDS TASK: false (and a line) when less is left
  [ "$(left)" -ge "$1" ] || { echo "== $2 skipped: $(left) s left, needs ~$1"; return 1; }
}
R=+experiment=grpo-smollm2-1n1g-chainsum
fetched() { [ -f "$OUT/fetch.log" ] || { hpcrl fetch $R > "$OUT/fetch.log" 2>&1; echo "== fetch rc=$? $((SECONDS - T0)) s"; tail -1 "$OUT/fetch.log"; }; }
recipe() {  # recipe NAME STEPS [overrides...]: hpcrl submit of the SmolLM2 recipe, then its phase table
  local name=$1 steps=$2; shift 2
  timeout -k 10 $(($(left) - 10)) python3 -m hpcrl.cli submit $R algo.max_steps="$steps" \
    run.output_root="$TMP/runs-$name" "$@" > "$OUT/submit_$name.log" 2>&1
  echo "== submit $name rc=$? $((SECONDS - T0)) s"; grep -E "^\[hpcrl|Error|Traceback" "$OUT/submit_$name.log" | tail -8
  grep -E "Recompiling|triggered by|failed:" "$OUT/submit_$name.log" | cut -c1-300 | head -8
  local run; run=$(ls -d "$TMP/runs-$name"/*/ 2>/dev/null | head -1)
  [ -n "$run" ] && { cp "$run/metrics.jsonl" "$OUT/metrics_$name.jsonl"; python3 bench/phase_table.py "$run/metrics.jsonl"; }
}
harness() {  # harness NAME MODEL LAYERS SHARE
  timeout -k 10 "$(left)" python3 bench/colocated_gpu.py --model "$2" ${3:+--layers $3} --model-dir "$TMP/m/$1" \
    --prompts 64 --n 4 --prompt-len $PL --gen 256 --share "$4" --refits 1 --skip-old --steps 3 \
    --out "$OUT/harness_$1.json" > "$OUT/harness_$1.log" 2>&1
  echo "== harness $1 rc=$? $((SECONDS - T0)) s"
  grep -E "^(engine start|trainer start|generate|train step|refit ipc \(step\)|wake|== step)" "$OUT/harness_$1.log" | tail -14
}
sweep() {  # sweep NAME MODEL LAYERS [engine_sweep args...]
  local name=$1 model=$2 layers=$3; shift 3
  timeout -k 10 "$(left)" python3 bench/engine_sweep.py --model "$model" --model-dir "$TMP/m/$name" ${layers:+--layers $layers} \
    --deadline-s $(($(left) - 45)) --out "$OUT/sweep_$name.json" "$@" >> "$OUT/sweep_$name.log" 2>&1
  echo "== sweep $name $* rc=$? $((SECONDS - T0)) s"; grep -E "tok/s|started|FAILED|skipped|Error" "$OUT/sweep_$name.log" | tail -8
}
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
