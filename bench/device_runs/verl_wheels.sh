#!/usr/bin/env bash
# Here, once: the wheels veRL 0.9.1 needs on the GPU machine beyond the staged site (vLLM 0.26 and its wheels, the
# session-19 STAGE_EXTRA, the image's packages), into .whl/verl/ (git-ignored with .whl/; 3.4 MB, so they travel in
# the call's carry with .whl, no restaging). s21.sh installs them into the site when `import verl` fails there.
# Why each (found by importing veRL's trainer, workers, vLLM server and agent loop over vLLM 0.26's sources,
# bench/peers/verl_grpo.py's report): verl, transferqueue (its default v1 trainer), tensordict <=0.10 (veRL's
# pin; its _C.so links no libtorch) with pyvers and orjson (tensordict, veRL's file logger), codetiming, torchdata
# (StatefulDataLoader); vLLM's OpenAI server, which veRL's rollout runs: uvicorn, watchfiles,
# model-hosting-container-standards and its jmespath, prometheus-fastapi-instrumentator.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
plat=""; for n in 17 24 26 27 28 31 34 35 38 39; do plat="$plat --platform manylinux_2_${n}_x86_64"; done
mkdir -p .whl/verl
for req in verl==0.9.1 transferqueue==0.1.11 tensordict==0.10.0 pyvers==0.1.0 orjson==3.13.0 codetiming==1.4.0 \
  torchdata==0.11.0 uvicorn==0.55.0 watchfiles==1.3.0 model-hosting-container-standards==0.1.16 jmespath==1.1.0 \
  prometheus-fastapi-instrumentator==8.1.0; do
  "${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $plat --platform manylinux2014_x86_64 --platform any -d .whl/verl "$req"
done
ls -la .whl/verl
