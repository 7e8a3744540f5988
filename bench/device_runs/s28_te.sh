#!/usr/bin/env bash
# Session 28 (issue 36 item 5): the megatron backend on Transformer Engine's layers against its local
# (torch) layers, bench/te_gpu.py on one GPU where TE imports (the lead's staging installs TE 2.20.2 for
# torch 2.11 cu130 / Python 3.12; megatron-core 0.19.2, and mamba_ssm + causal_conv1d if staged, sit in
# $SITE, by default the temp dir's site/ as s27.sh installs them, put on PYTHONPATH here). Fails fast, in
# one line, where TE or megatron-core does not import.
#   bash bench/device_runs/s28_te.sh [parity] [bench]   (both by default; PTIME=300 s, BTIME=240 s)
# Writes $OUT/te_parity.{log,json} and $OUT/te_bench.{log,json}; prints each case / row as it finishes.
set -u
T0=$SECONDS
TMP=$(python3 -c 'import tempfile; print(tempfile.gettempdir())')
OUT=${OUT:-$TMP/out}
SITE=${SITE:-$TMP/site}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import transformer_engine.pytorch; from importlib.metadata import version; \
print('== Transformer Engine', version('transformer_engine'))" > "$OUT/te_import.log" 2>&1
rc=$?
cat "$OUT/te_import.log" | grep '^== '
[ $rc = 0 ] || { echo "== Transformer Engine does not import: $(grep -v '^\s' "$OUT/te_import.log" | tail -1)"; exit 2; }
python3 -c "import torch, megatron.core; print('== megatron-core', megatron.core.__version__, 'torch', torch.__version__)" \
  2> "$OUT/megatron_import.log" || { echo "== megatron-core does not import: $(tail -1 "$OUT/megatron_import.log")"; exit 3; }
python3 -c "from hpcrl.trainer import kernels; print('==', kernels.installed().describe())" 2>/dev/null
PARTS=${*:-parity bench}
if [[ " $PARTS " == *" parity "* ]]; then
  echo "== parity at $((SECONDS - T0)) s"
  timeout -k 10 "${PTIME:-300}" python3 bench/te_gpu.py --parity > "$OUT/te_parity.log" 2>&1
  echo "== parity rc=$? at $((SECONDS - T0)) s"
  grep -E "^parity|Error|Traceback" "$OUT/te_parity.log" | cut -c1-1200
  [ -f "$OUT/te_gpu.json" ] && mv "$OUT/te_gpu.json" "$OUT/te_parity.json"
fi
if [[ " $PARTS " == *" bench "* ]]; then
  echo "== bench at $((SECONDS - T0)) s"
  timeout -k 10 "${BTIME:-240}" python3 bench/te_gpu.py --bench > "$OUT/te_bench.log" 2>&1
  echo "== bench rc=$? at $((SECONDS - T0)) s"
  grep -E "^(bench|Super|([ME*]|experts) ms|step_s|tokens_per_s|peak_gb)|Error|Traceback" "$OUT/te_bench.log" | cut -c1-600
  [ -f "$OUT/te_gpu.json" ] && mv "$OUT/te_gpu.json" "$OUT/te_bench.json"
fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
echo "== done $((SECONDS - T0)) s"
