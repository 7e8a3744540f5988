#!/usr/bin/env bash
# On a bare device machine (torch 2.11+cu130, nvcc 13, ninja, no network): build causal-conv1d 1.7.0 and
# mamba-ssm 2.3.2.post1 from their PyPI sdists for sm_90 only, in parallel, put the wheels in $OUT, install
# them, then check them against hpcrl's torch conv and SSD scan (numbers and speed): bench/kernel_smoke.py.
# Here, once: the sdists and einops's wheel in .kbuild/src (PyPI JSON urls; `pip download` of these sdists
# fails here because their setup.py needs nvcc). Run: `bash bench/device_runs/kernel_wheels.sh`, carry [.kbuild].
set -uo pipefail
repo=$(pwd)
build() {  # $1 sdist stem, $2 env var that forces a local build
  cd /tmp && tar xzf "$repo/.kbuild/src/$1.tar.gz" && cd "$1" || return 1
  # sm_90 only: both setup.py files list every arch from sm_75 to sm_121 (9 on CUDA 13)
  sed -i 's/^    if FORCE_CXX11_ABI:/    cc_flag = ["-gencode", "arch=compute_90,code=sm_90"]\n    if FORCE_CXX11_ABI:/' setup.py
  local t0=$SECONDS
  env "$2=TRUE" MAX_JOBS=8 NVCC_THREADS=2 python3 -m pip wheel -q --no-build-isolation --no-deps -w /tmp/wheels . \
    > "/tmp/$1.log" 2>&1
  local rc=$?
  echo "built $1 rc=$rc in $((SECONDS - t0)) s"; tail -5 "/tmp/$1.log"
}
mkdir -p /tmp/wheels
build causal_conv1d-1.7.0 CAUSAL_CONV1D_FORCE_BUILD &
build mamba_ssm-2.3.2.post1 MAMBA_FORCE_BUILD &
wait
ls -la /tmp/wheels
cp /tmp/wheels/*.whl "$OUT/" 2>/dev/null
cd "$repo" && python3 -m pip install -q --no-index --no-deps --target /tmp/site /tmp/wheels/*.whl .kbuild/src/einops-*.whl
export PYTHONPATH=/tmp/site:$repo
python3 bench/kernel_smoke.py | tee "$OUT/kernel_smoke.txt"
