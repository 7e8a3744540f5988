#!/usr/bin/env bash
# Session 25, one short call (the device came late or not at all; ~550 s of device time left): varlen packing
# against padded first (issue 36 item 1's >= 1.5x, bench/packing_gpu.py on a light site: the image's torch and
# transformers plus .whl/varlen), then, with KBUDGET=N (>= 330) given, the kernels' parity (s24_kernels.sh).
# Carry [.whl]. Run: `bash bench/device_runs/s25.sh`.
set -u
T0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --target /tmp/vsite .whl/varlen/*.whl
PYTHONPATH=$PWD:/tmp/vsite PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
  timeout -k 10 "${VBUDGET:-200}" python3 bench/packing_gpu.py --check-kernel --model "${VARLEN_MODELS:-smollm2_135m,qwen2_1p5b}" \
  --seqs "${VARLEN_SEQS:-64}" --max-new 3840 --mbs plan --steps 2 --out "$OUT/varlen.json" > "$OUT/varlen.log" 2>&1
echo "== varlen rc=$? at $((SECONDS - T0)) s"
grep -E "^(kernel check|batch|padded|packed|best|\||[a-z0-9_]+: planner)|Error|Traceback" "$OUT/varlen.log" | cut -c1-300
# the kernels' build alone takes its BUDGET less 200 s: only when KBUDGET (>= 330) is given
[ -n "${KBUDGET:-}" ] && { echo "== kernels at $((SECONDS - T0)) s"; BUDGET=$KBUDGET bash bench/device_runs/s24_kernels.sh parity; }
