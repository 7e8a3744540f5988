#!/usr/bin/env bash
# Here, once (issue 36 item 5): Transformer Engine 2.20.2 for the lent GPU (torch 2.11.0+cu130, Python 3.12,
# no network there), packed into .te-stage/part.NN (git-ignored), each <= 55 MiB:
#   transformer_engine_cu13 2.20.2   PyPI binary wheel (libtransformer_engine.so, every arch: 327 MB unpacked)
#   transformer_engine 2.20.2        the PyPI meta wheel (megatron-core reads its version)
#   transformer_engine_torch 2.20.2  PyPI ships only its sdist: built here (a CppExtension: no nvcc, no GPU)
#                                    against torch 2.11.0+cu130 and the CUDA 13 headers of NVIDIA's PyPI wheels
#   onnx, onnxscript, onnx-ir, nvdlfw-inspect, importlib-metadata, nvidia-cudnn-frontend: what it imports
#                                    that the GPU image lacks
# Needs pyenv's Python 3.12 (or any python3.12 with venv). About 10 minutes on 2 cores, ~4 GB of downloads.
# There: `cat /tmp/stage/te.* | xz -d | tar x -C /tmp` gives /tmp/te_site; bench/device_runs/s28_te.sh does it.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qx "/.te-stage/" .git/info/exclude || echo "/.te-stage/" >> .git/info/exclude
PY312=${PY312:-$(ls -d ~/.pyenv/versions/3.12*/bin/python 2>/dev/null | head -1)}
w=$(mktemp -d); V=2.20.2
"$PY312" -m venv "$w/v"; . "$w/v/bin/activate"
pip install -q "torch==2.11.0" "setuptools<82" wheel packaging pybind11 ninja \
  "cuda-toolkit[cublas,cudart,nvrtc,nvtx,cccl,nvcc]==13.0.2" nvidia-cudnn-cu13==9.19.0.56 "nvidia-cudnn-frontend==1.32.0"
mkdir -p "$w/tew"
pip download -q --no-deps --only-binary=:all: -d "$w/tew" transformer-engine-cu13==$V transformer-engine==$V
pip install -q --no-deps "$w"/tew/transformer_engine_cu13-*.whl
url=$(curl -s https://pypi.org/simple/transformer-engine-torch/ | grep -o "https://[^\"#]*transformer_engine_torch-$V.tar.gz" | head -1)
curl -sL "$url" | tar xz -C "$w"
(cd "$w/transformer_engine_torch-$V" && NVTE_BUILD_USE_NVIDIA_WHEELS=1 MAX_JOBS=2 NVTE_PYTORCH_FORCE_BUILD=TRUE \
  NVTE_FRAMEWORK=pytorch pip wheel -q --no-build-isolation --no-deps . -w "$w/tew")
pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 -d "$w/tew" onnx==1.23.2 onnxscript==0.7.2 \
  onnx-ir==1.1.0 nvdlfw-inspect==0.2.2 importlib-metadata==10.2.0 nvidia-cudnn-frontend==1.32.0
mkdir -p "$w/te_site" .te-stage && for f in "$w"/tew/*.whl; do unzip -q -o "$f" -d "$w/te_site"; done
rm -f .te-stage/te.*
(cd "$w" && tar cf - te_site | xz -6 -T2) | split -b 55M -d - .te-stage/te.
ls -la .te-stage
