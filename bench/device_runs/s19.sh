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
    smollm2) need 200 $task && fetched && recipe vllm "${STEPS:-30}" ;;
    trl)
      need 200 $task && fetched || continue
      VLLM_CACHE_ROOT=$TMP/vllm-cache-trl timeout -k 10 $(($(left) - 10)) python3 bench/peers/trl_grpo.py \
        --steps "${TRL_STEPS:-20}" --out "$OUT/trl" > "$OUT/trl.log" 2>&1
      echo "== trl rc=$? $((SECONDS - T0)) s"; grep -E "^\[trl\]|Error|Traceback|^\{\"peer" "$OUT/trl.log" | tail -6 ;;
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
