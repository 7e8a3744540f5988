#!/usr/bin/env bash
# Session 30 (issue 36): why the megatron step at the 1.5B shape ran ~10x under its session-5 rate in
# s29.sh pack (TE padded 3,627 tok/s; the local spec did not finish two steps in 160 s). Found after, on the CPU:
# megatron-core's recompute dropped the bf16 autocast (fixed: model.keep_autocast_in_recompute); this profile
# checks that nothing else is left (rerun s29.sh pack first). After part.00..05
# were copied to /tmp/stage as s28_mtp.sh says (the vLLM stage carries hydra, omegaconf and the rest):
#   `bash bench/device_runs/s30.sh prof` (carry .whl/mc, .whl/antlr4...whl): one profiled step each way,
#   padded and packed, 16 sequences of the DAPO-like lengths, full depth, local spec; compiled layers (the
#   default at TP=1; dynamo's recompiles logged and counted: a recompile per micro-batch would explain it)
#   and eager (COMPILE=true: the first only). On a bare machine (no part.* staged) it
#   installs the trainer's wheels instead: .whl/trainer holds hydra-core 1.3.8 and omegaconf 2.3.1 (`pip
#   download --no-deps`), .whl/pyd pydantic's four.
set -u
T0=$SECONDS
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
SITE=/tmp/site
if ls /tmp/stage/part.* >/dev/null 2>&1; then
  source bench/device_runs/s18_site.sh
else  # a bare machine: the trainer's wheels only (carry .whl/mc, .whl/pyd, .whl/trainer, .whl/antlr4...whl)
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/pyd/*.whl .whl/trainer/*.whl \
    .whl/antlr4_python3_runtime-4.9.3-py3-none-any.whl 2>&1 | grep -v WARN
  export PYTHONPATH=$PWD:$SITE PYTHONUNBUFFERED=1
fi
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/mc/*.whl 2>&1 | grep -v WARN
echo "== staged at $((SECONDS - T0)) s"
python3 -c "import hpcrl.config.compose, megatron.core; from hpcrl.trainer.megatron import MegatronTrainer" 2>&1 | tail -1
case "${1:?prof}" in
prof)
  for c in ${COMPILE:-true false}; do
    TORCH_LOGS=recompiles PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 10 "${PROFTIME:-200}" python3 bench/packing_gpu.py \
      --trainer megatron --model qwen2_1p5b --seqs 16 --mbs 4 --max-new 3840 --steps 1 --profile \
      --set trainer.compile=$c --out "$OUT/prof_compile_$c.json" > "$OUT/prof_compile_$c.log" 2>&1
    echo "== compile=$c rc=$? at $((SECONDS - T0)) s; recompiles: $(grep -c 'Recompiling function' "$OUT/prof_compile_$c.log")"
    grep -E "hit config.recompile_limit|function: " "$OUT/prof_compile_$c.log" | sort | uniq -c | head -8 | cut -c1-200
    grep -v -E "Warning|warn" "$OUT/prof_compile_$c.log" | grep -E "^(batch|padded|packed|Name|-----|  ?[a-zA-Z_:]+)" \
      | cut -c1-180 | head -70
  done
  ;;
esac
echo "== done $((SECONDS - T0)) s"
