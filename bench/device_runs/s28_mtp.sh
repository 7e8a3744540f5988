#!/usr/bin/env bash
# Session 28, issue 36 items 2 + 4 on the GPU: MTP drafting after a megatron refit, routes under drafts
# (bench/mtp_gpu.py). Staging: `bash bench/device_runs/prepare.sh` here once; then six calls back to back,
# each carrying one part: `mkdir -p /tmp/stage && cp .device-vllm/part.00 /tmp/stage/`, then part.01 ..
# part.04 the same way, and the last: `cp .device-vllm/part.05 /tmp/stage/ && bash bench/device_runs/s28_mtp.sh`
# carrying .device-vllm/part.05 and .whl (.whl/mc: megatron-core 0.19.2 cp312, `pip download` as in
# s24_prepare.sh).
set -o pipefail
source bench/device_runs/s18_site.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/mc/*.whl 2>&1 | grep -v WARN
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import vllm, megatron.core, torch; print('vllm', vllm.__version__, 'megatron-core', megatron.core.__version__, 'torch', torch.__version__)"
timeout -k 10 "${MTPTIME:-420}" python3 bench/mtp_gpu.py ${MTPARGS:-} 2>&1 | grep -v -E "Warning|warnings.warn|Unknown MLP" | tee "$OUT/mtp_gpu.log"
echo "== done $((SECONDS - T0)) s"
