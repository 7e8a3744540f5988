#!/usr/bin/env bash
# Session 24, one call (the device came late): the kernels (s24_kernels.sh: build causal-conv1d for sm_90,
# parity, Super's shape per layer kind) in KBUDGET seconds, then varlen packing against padded
# (bench/packing_gpu.py) on a light site: torch/transformers of the image plus .whl/varlen (dill, tabulate,
# psutil), no vLLM parts. Carry [.whl]. Run: `bash bench/device_runs/s24.sh`.
set -u
T0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader
BUDGET=${KBUDGET:-330} bash bench/device_runs/s24_kernels.sh
echo "== varlen at $((SECONDS - T0)) s"
python3 -m pip install -q --no-index --no-deps --target /tmp/vsite .whl/varlen/*.whl
PYTHONPATH=$PWD:/tmp/vsite PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
  timeout -k 10 "${VBUDGET:-210}" python3 bench/packing_gpu.py --check-kernel --model "${VARLEN_MODELS:-smollm2_135m,qwen2_1p5b}" \
  --seqs "${VARLEN_SEQS:-64}" --max-new 3840 --mbs plan --steps 2 --out "$OUT/varlen.json" > "$OUT/varlen.log" 2>&1
echo "== varlen rc=$? at $((SECONDS - T0)) s"
grep -E "^(kernel check|batch|padded|packed|best|\||[a-z0-9_]+: planner)|Error|Traceback" "$OUT/varlen.log" | cut -c1-300
