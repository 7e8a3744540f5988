# Sourced by s19.sh-s23.sh (after s18_site.sh): the time budget and the task helpers they share.
# BUDGET and T0 come from the caller; each helper writes into $OUT and prints "==" lines.
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
peer() {  # peer NAME SCRIPT STEPS [args...]: a bench/peers script on the SmolLM2 job, its log's last lines
  local name=$1 script=$2 steps=$3; shift 3
  VLLM_CACHE_ROOT=$TMP/vllm-cache-$name timeout -k 10 $(($(left) - 10)) python3 "$script" --steps "$steps" \
    --out "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc $((SECONDS - T0)) s"
  grep -E "^\[(trl|verl)\]|Error|Traceback|^\{\"peer" "$OUT/$name.log" | cut -c1-400 | tail -8
  return $rc
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
verl_site() {  # veRL's wheels (.whl/verl, bench/device_runs/verl_wheels.sh) into the site, once
  python3 -c "import verl, transfer_queue, uvicorn, watchfiles, model_hosting_container_standards" 2>/dev/null && return 0
  ls .whl/verl/*.whl > /dev/null 2>&1 || { echo "== verl: no .whl/verl/ (bench/device_runs/verl_wheels.sh here, carry .whl)"; return 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/verl/*.whl || return 1
  echo "== verl wheels installed $((SECONDS - T0)) s"
}
# veRL's vLLM server resolves files of a local model directory offline; TRL shadowed by the stand-in
vpeer() { (export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD/bench/peers/verl_standin:$PYTHONPATH; peer "$@"); }
