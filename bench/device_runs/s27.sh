#!/usr/bin/env bash
# Session 27 (issue 36 item 5), one call on a fresh machine with little device time left: install the kernels
# from the wheel session 27 built there (.whl/kernels_built, joined from its parts; no build), then parity and
# Super's 8-layer bench in ONE process (Triton compiles and tunes mamba_ssm's kernels once; each case and row
# is printed and kept as it finishes, so a timeout loses only what was still running).
# Carry [.whl/kernels, .whl/kernels_built]. Run: `KTIME=420 bash bench/device_runs/s27.sh`.
set -u
T0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader
OUT=${OUT:-/tmp/out}
K=.whl/kernels
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/kernels_built/causal_conv1d-1.7.0-cp312-*.whl \
  $K/mamba_ssm-2.3.2.post1-py3-none-any.whl $K/megatron_core-0.19.2-*.whl $K/einops-*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
echo "== installed at $((SECONDS - T0)) s"
timeout -k 10 "${KTIME:-420}" python3 bench/kernels_gpu.py --parity --bench > "$OUT/kernels.log" 2>&1
echo "== kernels rc=$? at $((SECONDS - T0)) s"
grep -E "^(parity|bench|Super|[A-Z*] ms|step_s|tokens_per_s|peak_gb|M mixer)|Error|Traceback" "$OUT/kernels.log" | cut -c1-400
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
